//! # les: the host side of LES
//!
//! Binds [`les_core`] to real files, threads and models. The `les` binary is a thin
//! command-line layer ([`cli`]) over this library.
//!
//! - [`gguf`]: a hardened GGUF reader (memory-mapped, zero-copy) and a streaming writer.

pub mod cli;
pub mod engine;
pub mod flash;
pub mod gguf;
pub mod model;
