//! # les: the host side of LES
//!
//! Binds [`les_core`] to real files, threads and models. The `les` binary is a thin
//! command-line layer ([`cli`]) over this library.
//!
//! - [`gguf`]: a hardened GGUF reader (memory-mapped, zero-copy) and a streaming writer.
//! - [`compute`]: a persistent thread pool and the multi-threaded `MatVec`.
//! - [`sampling`]: reproducible token sampling (greedy, top-k, top-p, min-p).

pub mod cli;
pub mod compute;
pub mod gguf;
pub mod sampling;
