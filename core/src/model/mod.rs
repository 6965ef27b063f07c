//! The per-token forward pass of the supported architectures, over caller buffers.
//!
//! [`ops`] holds the layer arithmetic (norms, RoPE, attention, SwiGLU).

pub mod ops;
