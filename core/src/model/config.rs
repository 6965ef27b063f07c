//! Hyperparameters of a decoder-only transformer with optional MoE FFNs.

use super::ops::RopeStyle;
use crate::router::Gating;

/// The MoE part of a model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeParams {
    /// Routed experts per MoE layer.
    pub n_experts: usize,
    /// Experts each token uses per layer.
    pub top_k: usize,
    /// Hidden size of one routed expert.
    pub n_ff_exp: usize,
    /// Softmax or sigmoid gating.
    pub gating: Gating,
    /// Renormalise the selected weights.
    pub normalize: bool,
    /// Multiplier of the expert weights (1 = none).
    pub weights_scale: f32,
    /// Hidden size of the shared expert, if the model has one.
    pub n_ff_shared: Option<usize>,
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hparams {
    /// Transformer blocks.
    pub n_layers: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Dimension of one attention head.
    pub head_dim: usize,
    /// Dimensions of each head RoPE rotates.
    pub n_rot: usize,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Hidden size of dense FFN layers (0 when every layer is MoE).
    pub n_ff: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// RoPE pairing.
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// Mixture-of-experts parameters, if any layer has experts.
    pub moe: Option<MoeParams>,
}

impl Hparams {
    /// Width of the key (and value) vector of one position.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of the query vector.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Checks the shape is consistent; the message names the first problem.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.n_layers == 0 || self.n_embd == 0 || self.n_vocab == 0 {
            return Err("n_layers, n_embd and n_vocab must be positive");
        }
        if self.n_head == 0 || self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err("n_head must be a positive multiple of n_head_kv");
        }
        if self.head_dim == 0 || self.n_rot > self.head_dim || !self.n_rot.is_multiple_of(2) {
            return Err("n_rot must be even and at most head_dim");
        }
        if !(self.norm_eps >= 0.0 && self.rope_base > 0.0) {
            return Err("norm_eps must be >= 0 and rope_base > 0");
        }
        if let Some(m) = self.moe {
            if m.top_k == 0 || m.top_k > m.n_experts || m.top_k > crate::router::MAX_TOP_K {
                return Err("expert_used_count must be in 1..=min(expert_count, 32)");
            }
            if m.n_experts > u16::MAX as usize || m.n_ff_exp == 0 {
                return Err("expert_count must be below 65536 and experts non-empty");
            }
        }
        if self.n_layers > u16::MAX as usize {
            return Err("too many layers");
        }
        Ok(())
    }
}
