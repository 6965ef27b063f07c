//! # les: the host side of LES
//!
//! Binds [`les_core`] to real files, threads and models. The `les` binary is a thin
//! command-line layer ([`cli`]) over this library.
//!
//! - [`gguf`]: a hardened GGUF reader (memory-mapped, zero-copy) and a streaming writer.
//! - [`synth`]: deterministic synthetic models of real architectures (`les synth`).

pub mod cli;
pub mod gguf;
pub mod synth;
