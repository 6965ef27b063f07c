//! The per-token forward pass of the supported architectures, over caller buffers.
//!
//! - [`config`]: the model shape ([`config::Hparams`]).
//! - [`ops`]: the layer arithmetic (norms, RoPE, attention, SwiGLU).
//! - [`deltanet`]: gated DeltaNet, the linear attention of hybrid models.
//! - [`mamba2`]: Mamba2, the selective state-space layer of hybrid models.
//! - [`shortconv`]: LFM2's gated short convolution.
//! - [`forward`]: one token through the model, with routed experts supplied by an
//!   [`forward::Experts`] implementation (resident, or streamed by the scheduler),
//!   or several positions layer by layer ([`forward::forward_batch`], a prompt's
//!   prefill; [`forward::forward_sequences`], several sequences' at once, each
//!   over its own cache and state), bit-identical to one at a time; [`forward::nextn`] runs
//!   qwen35moe's multi-token-prediction block, which drafts for speculative
//!   decoding; its [`forward::KvCache`] keeps sliding-window (and chunked)
//!   layers in rings where the caller asks ([`forward::KvRing`]), with the
//!   same logits.

pub mod config;
pub mod deltanet;
pub mod experts;
pub mod forward;
pub mod mamba2;
pub mod ops;
pub mod shortconv;
