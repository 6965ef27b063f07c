//! # les: the host side of LES
//!
//! Binds [`les_core`] to real files, threads and models. The `les` binary is a thin
//! command-line layer ([`cli`]) over this library.
//!
//! - [`gguf`]: a hardened GGUF reader (memory-mapped, zero-copy) and a streaming writer.
//! - [`model`]: a GGUF as a runnable model (hyperparameters, validated weights).
//! - [`tokenizer`]: tokenizers built from the GGUF's `tokenizer.ggml.*` metadata.
//! - [`compute`]: a persistent thread pool and the multi-threaded `MatVec`.
//! - [`sampling`]: reproducible token sampling (greedy, repeat penalty, top-k,
//!   top-p, min-p, banned tokens); [`grammar`], GBNF grammars that constrain it.
//! - [`engine`]: KV cache, prefill and the decode loop ([`prompt_cache`]: a
//!   prompt's evaluated state kept in a file); [`draft`], the guesses
//!   speculative decoding verifies (prompt lookup, a draft model, or the
//!   model's own multi-token-prediction block).
//! - [`hugepages`]: transparent huge pages for the slots and the KV cache.
//! - [`flash`]: the file device experts stream from (O_DIRECT; I/O threads or `io_uring`).
//! - [`supply`]: the expert schedules (resident, on-demand, les).
//! - [`bench`](mod@bench): `les bench`, schedules compared side by side; [`belady`], the
//!   optimal cache's hit rate over the run's routing; [`layer_costs`], each layer's
//!   stall and misses; [`cpu_steal`], the CPU time a hypervisor took meanwhile;
//!   [`watch`], how they watch the expert supplier; [`trace`], a run's timeline
//!   (`--trace`) and how busy the device was in each phase of a token.
//! - [`synth`]: deterministic synthetic models for tests, demos and benchmarks.
//! - [`perplexity`]: `les perplexity`, perplexity and KL divergence over a
//!   text, with llama.cpp's base files.
//! - [`pack`]: `les pack`, experts rewritten as aligned extents, and their index.
//! - [`vision`]: images in: mmproj vision towers (MiniCPM-V 4.6, Gemma 3,
//!   Qwen3-VL), image preprocessing, embeddings spliced into the prompt and
//!   placed as llama.cpp places them ([`engine::InputPlace`]).
//! - [`serve`]: `les serve`, llama-server's OpenAI-style HTTP API over the
//!   model's slots, completions side by side; `les batch` ([`serve::batch`]),
//!   OpenAI Batch API files through the same engine; [`reply`], a reply's
//!   text cut at stop strings as it streams.
//! - [`mcu`]: the compact model index a microcontroller firmware reads.
//! - [`interrupt`]: partial outputs removed on Ctrl-C.

/// `eprintln!` for diagnostics that must never end a run: a stderr that cannot
/// be written (closed by `les ... 2>&1 | head`) is ignored instead of panicking.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `eprint!`, as [`note!`] (no line break: progress lines).
macro_rules! note_inline {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stderr(), $($arg)*);
    }};
}

pub mod belady;
pub mod bench;
pub mod cli;
pub mod compute;
pub mod cpu_steal;
pub mod draft;
pub mod engine;
pub mod flash;
pub mod gguf;
pub mod grammar;
pub mod hugepages;
pub mod interrupt;
pub mod layer_costs;
pub mod mcu;
pub mod model;
pub mod pack;
pub mod perplexity;
pub mod prompt_cache;
pub mod reply;
pub mod sampling;
pub mod serve;
pub mod supply;
pub mod synth;
pub mod tokenizer;
pub mod trace;
pub mod vision;
pub mod watch;
