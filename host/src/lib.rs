//! # les: the host side of LES
//!
//! Binds [`les_core`] to real files, threads and models. The `les` binary is a thin
//! command-line layer over this library.

pub mod tokenizer;
