//! # les-core: the `no_std` kernel of Lookahead Expert Scheduling
//!
//! LES runs Mixture-of-Experts models whose experts do not fit in RAM: expert
//! weights stay on flash, and a fixed pool of RAM *slots* holds the ones being used.
//! This crate holds every decision and every piece of arithmetic, over buffers the
//! caller owns; it has no allocator and no I/O of its own, so the same code runs in
//! the `les` CLI, inside a phone app and on a Cortex-M4.
//!
//! How the pieces fit, bottom to top:
//!
//! - [`quant`]: ggml's block formats, bit-exact (dequantize, and quantize for the
//!   weight and activation formats LES writes).
//! - [`gemv`]: `y = W x` over a row range for every weight format, a scalar
//!   reference kernel and SIMD kernels checked against it; `gemm` for several
//!   inputs at once, with the same bits; `gemv::vector`, attention's `f32`
//!   kernels (scores, softmax, weighted sums), the same bits on every ISA.
//! - [`router`]: expert gating (softmax / sigmoid, top-k, renormalisation, shared
//!   expert gate) and the **lookahead predictor**: layer `l+1`'s router applied to
//!   layer `l`'s hidden state, to know which experts to prefetch.
//! - [`blockdev`]: the abstract, poll-based, allocation-free read device, and a
//!   scripted simulated device for tests.
//! - [`slots`]: the fixed-capacity table of expert slots and its eviction policies;
//!   [`slot_classes`]: slots sized to the experts of models with mixed expert sizes.
//! - [`schedule`]: the LES planner that turns routing results, predictions and I/O
//!   completions into reads, cancellations and a *ready-first* compute order, and
//!   the on-demand baseline as the same machinery with prediction and overlap off.
//! - [`model`]: the forward pass over those pieces (attention, multi-head
//!   latent attention, gated DeltaNet, Mamba2 and short-convolution layers): one token
//!   ([`model::forward::forward_hybrid`]), or a prompt's positions layer by layer
//!   ([`model::forward::forward_batch`], each layer's experts asked for once as
//!   the union of the positions' picks), or several sequences' next positions
//!   in one pass, each over its own cache ([`model::forward::forward_sequences`]:
//!   requests decoded side by side); the `_at` variants take each
//!   position's M-RoPE place ([`model::forward::Place`]) and image
//!   embeddings with deepstack features.
//!
//! Exactness is the rule throughout: predictions only steer prefetching; every
//! expert the real router picks is loaded and used, and expert outputs are combined
//! in router order, so offloaded decoding is bit-identical to all-in-RAM decoding.
#![no_std]
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(test)]
extern crate std;

pub mod blockdev;
pub mod gemv;
pub mod layout;
pub mod model;
pub mod quant;
pub mod router;
pub mod schedule;
pub mod slot_classes;
pub mod slots;
