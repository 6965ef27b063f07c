//! Hyperparameters of a decoder-only transformer with optional MoE FFNs.

use super::ops::{RopeStyle, Yarn};
use crate::router::{ExpertGroups, Gating};

/// The activation between a routed expert's gate/up and down projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// `silu(gate) * up` (every architecture but gpt-oss and Nemotron-H).
    SwiGlu,
    /// `relu(up)^2` of an expert without a gate projection (Nemotron-H's
    /// routed and shared experts; llama.cpp's `LLM_FFN_RELU_SQR`, which it
    /// only has ungated).
    ReluSqr,
    /// gpt-oss's clamped SwiGLU (ggml's `swiglu_oai`): with
    /// `g = min(gate, limit)` and `u = clamp(up, -limit, limit)`,
    /// `g * sigmoid(alpha * g) * (u + 1)`.
    SwiGluOai {
        /// Slope of the sigmoid (1.702).
        alpha: f32,
        /// Clamp of gate and up (7).
        limit: f32,
    },
    /// `relu(gate) * up` (SmallThinker's experts; ggml's `reglu`).
    ReGlu,
}

impl ExpertAct {
    /// Whether the activation takes a gate projection (all but [`ReluSqr`](Self::ReluSqr)).
    pub fn gated(&self) -> bool {
        !matches!(self, ExpertAct::ReluSqr)
    }
}

/// Sliding-window attention on some layers (llama.cpp's `n_swa` with a
/// `swa_pattern`): layer `l` attends only to the last `window` positions
/// (itself included) when `l % pattern < pattern - 1`, to all otherwise. A
/// model's [`Weights`](super::forward::Weights) say so per layer
/// ([`AttentionWeights::window`](super::forward::AttentionWeights::window)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Positions a windowed layer sees (positive).
    pub window: usize,
    /// Period of the windowed / full layers (positive; 2 for gpt-oss: even
    /// layers windowed).
    pub pattern: usize,
}

impl SlidingWindow {
    /// Layer `layer`'s window, `None` where it attends to every position.
    pub fn of_layer(&self, layer: usize) -> Option<usize> {
        (layer % self.pattern.max(1) < self.pattern.saturating_sub(1)).then_some(self.window)
    }
}

/// Which earlier positions an attention layer's query sees, besides itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnWindow {
    /// The last `n` positions, itself included (gpt-oss's windowed layers).
    Sliding(usize),
    /// The positions of its own chunk of `n`, from the last multiple of `n`
    /// (Llama 4's chunked layers; llama.cpp's `LLAMA_SWA_TYPE_CHUNKED`).
    Chunked(usize),
}

impl AttnWindow {
    /// The first position the query at `end - 1` sees; `None` for a window of
    /// no positions.
    pub fn start(&self, end: usize) -> Option<usize> {
        match *self {
            AttnWindow::Sliding(0) | AttnWindow::Chunked(0) => None,
            AttnWindow::Sliding(n) => Some(end.saturating_sub(n)),
            AttnWindow::Chunked(n) => Some(end.saturating_sub(1) / n * n),
        }
    }
}

/// Llama 4's attention temperature on its NoPE layers: the query at position
/// `p` is scaled by `ln(floor((p + offset) / floor_scale) + 1) * scale + 1`,
/// with llama.cpp's roundings (`inp_attn_scale`): 1 before the first
/// `floor_scale - offset` positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnTemperature {
    /// Positions per step of the logarithm (8192).
    pub floor_scale: u32,
    /// Growth per step (0.1).
    pub scale: f32,
    /// Added to the position first (1).
    pub offset: f32,
}

impl AttnTemperature {
    /// No temperature (a factor of 1 everywhere): a layer without RoPE and
    /// nothing in its place (Granite 4.0-H).
    pub const NONE: AttnTemperature = AttnTemperature {
        floor_scale: 0,
        scale: 0.0,
        offset: 0.0,
    };

    /// The values llama.cpp fixes for Llama 4.
    pub const LLAMA4: AttnTemperature = AttnTemperature {
        floor_scale: 8192,
        scale: 0.1,
        offset: 1.0,
    };

    /// The factor of the query at position `pos` (1 for a `floor_scale` of 0).
    pub fn at(&self, pos: usize) -> f32 {
        if self.floor_scale == 0 {
            return 1.0;
        }
        // f32 as ggml's input is computed: the position and its quotient in
        // f32, the logarithm in f64.
        let steps = libm::floorf((pos as f32 + self.offset) / self.floor_scale as f32);
        (libm::log(f64::from(steps) + 1.0) * f64::from(self.scale) + 1.0) as f32
    }
}

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
    /// The routed experts' activation.
    pub act: ExpertAct,
    /// Group-limited routing (DeepSeek-V3 style), if any.
    pub groups: Option<ExpertGroups>,
    /// The picks' weights scale each routed expert's *input* and its output
    /// is summed as it is (Llama 4; llama.cpp's `weight_before_ffn`), instead
    /// of scaling the output.
    pub weight_inputs: bool,
    /// The router reads the layer's input, the residual stream before the
    /// layer's attention and without a norm (SmallThinker), instead of the
    /// FFN's normed input: the picks are known before the attention, whose
    /// compute then hides their reads.
    pub route_before_attention: bool,
}

/// Granite's multipliers of the embedding, the blocks' outputs, the
/// attention scores and the logits ([`Scales::NONE`] for other models).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scales {
    /// The input embedding (a token's row or an image's) times this.
    pub embedding: f32,
    /// Each block's attention (or mixer) and FFN outputs times this before
    /// they join the residual stream.
    pub residual: f32,
    /// The attention scores' scale instead of `1 / sqrt(head_dim)`, if set.
    pub attention: Option<f32>,
    /// The logits divided by this (multiplied by its reciprocal, as
    /// llama.cpp).
    pub logit: f32,
}

impl Scales {
    /// No multipliers: every model but Granite's.
    pub const NONE: Scales = Scales {
        embedding: 1.0,
        residual: 1.0,
        attention: None,
        logit: 1.0,
    };

    /// Whether any multiplier changes something.
    pub fn any(&self) -> bool {
        *self != Scales::NONE
    }
}

impl Default for Scales {
    fn default() -> Self {
        Scales::NONE
    }
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
    /// YaRN scaling of RoPE (gpt-oss), if any.
    pub rope_yarn: Option<Yarn>,
    /// Granite's multipliers ([`Scales::NONE`] for other models).
    pub scales: Scales,
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
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            return Err("norm_eps must be finite and >= 0");
        }
        if !(self.rope_base.is_finite() && self.rope_base > 0.0) {
            return Err("rope_base must be finite and > 0");
        }
        let sc = self.scales;
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if !(positive(sc.embedding)
            && sc.residual.is_finite()
            && positive(sc.logit)
            && sc.attention.is_none_or(positive))
        {
            return Err("the embedding, residual, attention and logit scales must be finite (and all but the residual > 0)");
        }
        if let Some(m) = self.moe {
            if m.top_k == 0 || m.top_k > m.n_experts || m.top_k > crate::router::MAX_TOP_K {
                return Err("expert_used_count must be in 1..=min(expert_count, 32)");
            }
            if m.n_experts > u16::MAX as usize || m.n_ff_exp == 0 {
                return Err("expert_count must be below 65536 and experts non-empty");
            }
            if let Some(g) = m.groups {
                let rc = crate::router::RouterConfig::new(
                    m.n_experts,
                    m.top_k,
                    m.gating,
                    m.normalize,
                    1.0,
                );
                if rc.and_then(|rc| rc.with_groups(g)).is_err() {
                    return Err(
                        "expert_group_count must divide the experts into groups of 2 \
                                or more (at most 64), expert_group_used_count be below it and \
                                its groups hold expert_used_count experts",
                    );
                }
            }
        }
        if self.n_layers > u16::MAX as usize {
            return Err("too many layers");
        }
        if let Some(y) = self.rope_yarn {
            let finite = [
                y.freq_scale,
                y.ext_factor,
                y.attn_factor,
                y.beta_fast,
                y.beta_slow,
            ]
            .iter()
            .all(|v| v.is_finite());
            if !finite || y.freq_scale <= 0.0 || y.beta_fast <= 0.0 || y.beta_slow <= 0.0 {
                return Err("YaRN parameters must be finite, the scale and betas positive");
            }
        }
        if let Some(MoeParams {
            act: ExpertAct::SwiGluOai { alpha, limit },
            ..
        }) = self.moe
        {
            if !(alpha.is_finite() && limit.is_finite()) {
                return Err("swiglu_oai alpha and limit must be finite");
            }
        }
        Ok(())
    }
}

/// Shape of the gated DeltaNet (linear-attention) layers of a hybrid model.
///
/// Value head `h` uses key head `h % n_k_heads` (tiled): llama.cpp's converter
/// reorders qwen35's value heads (grouped by key head in Hugging Face
/// checkpoints) into this order, which ggml's broadcasting computes. qwen3next
/// files keep them grouped ([`grouped_values`](Self::grouped_values)): value head
/// `h` uses key head `h / (n_v_heads / n_k_heads)`, as llama.cpp's repeat-interleave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetShape {
    /// Query/key heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`); a multiple of `n_k_heads`.
    pub n_v_heads: usize,
    /// Size of one key (and value) head (`ssm.state_size`).
    pub head_dim: usize,
    /// Width of the causal convolution (`ssm.conv_kernel`).
    pub conv_kernel: usize,
    /// Value heads grouped by key head (qwen3next) rather than tiled (qwen35).
    pub grouped_values: bool,
}

impl DeltaNetShape {
    /// The key head value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        if self.grouped_values {
            h / (self.n_v_heads / self.n_k_heads).max(1)
        } else {
            h % self.n_k_heads.max(1)
        }
    }

    /// Width of all query (or key) heads.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_dim
    }

    /// Width of all value heads (`ssm.inner_size`).
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_dim
    }

    /// Channels of the convolution: query, key and value side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Floats of one layer's convolution state (the last `conv_kernel - 1` inputs
    /// of every channel).
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }

    /// Floats of one layer's recurrent state (a `head_dim x head_dim` matrix per
    /// value head).
    pub fn ssm_state_len(&self) -> usize {
        self.n_v_heads * self.head_dim * self.head_dim
    }

    /// Checks the shape is consistent; the message names the first problem.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.n_k_heads == 0 || self.head_dim == 0 || self.conv_kernel < 2 {
            return Err("DeltaNet heads and head size must be positive and conv_kernel >= 2");
        }
        if self.n_v_heads == 0 || !self.n_v_heads.is_multiple_of(self.n_k_heads) {
            return Err("DeltaNet value heads must be a positive multiple of the key heads");
        }
        Ok(())
    }
}

/// Shape of the Mamba2 (selective state-space) layers of a hybrid model
/// (Granite 4.0-H, llama.cpp's `granitehybrid`).
///
/// The input projection yields `z` (`d_inner`), the convolved channels `xBC`
/// (`x`: `d_inner`, then `B` and `C`: `n_group * d_state` each) and one time
/// step per head (`n_head`); head `h` reads group `h / (n_head / n_group)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mamba2Shape {
    /// Width of the inner stream `x` (`ssm.inner_size`), `n_head * head_dim`.
    pub d_inner: usize,
    /// Size of each head's state per channel (`ssm.state_size`).
    pub d_state: usize,
    /// SSM heads (`ssm.time_step_rank`), each with one decay and time step.
    pub n_head: usize,
    /// Groups sharing `B` and `C` (`ssm.group_count`).
    pub n_group: usize,
    /// Width of the causal convolution (`ssm.conv_kernel`).
    pub conv_kernel: usize,
}

impl Mamba2Shape {
    /// Channels of one head.
    pub fn head_dim(&self) -> usize {
        self.d_inner / self.n_head.max(1)
    }

    /// The group head `h` reads `B` and `C` from.
    pub fn group(&self, h: usize) -> usize {
        h / (self.n_head / self.n_group.max(1)).max(1)
    }

    /// Channels of the convolution: `x`, `B` and `C` side by side.
    pub fn conv_dim(&self) -> usize {
        self.d_inner + 2 * self.n_group * self.d_state
    }

    /// Rows of the input projection: `z`, `xBC` and the time steps.
    pub fn in_proj_dim(&self) -> usize {
        self.d_inner + self.conv_dim() + self.n_head
    }

    /// Floats of one layer's convolution state (the last `conv_kernel - 1`
    /// inputs of every channel).
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dim()
    }

    /// Floats of one layer's recurrent state (`d_state` per channel of `x`).
    pub fn ssm_state_len(&self) -> usize {
        self.d_inner * self.d_state
    }

    /// Checks the shape is consistent; the message names the first problem.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.d_inner == 0 || self.d_state == 0 || self.n_head == 0 || self.conv_kernel < 2 {
            return Err("Mamba2 sizes must be positive and conv_kernel >= 2");
        }
        if !self.d_inner.is_multiple_of(self.n_head) {
            return Err("Mamba2 inner size must be a multiple of its heads");
        }
        if self.n_group == 0 || !self.n_head.is_multiple_of(self.n_group) {
            return Err("Mamba2 heads must be a positive multiple of its groups");
        }
        Ok(())
    }
}

/// Shape of the gated short convolutions of LFM2 (llama.cpp's `lfm2`,
/// `lfm2moe`): `W_in` yields `b`, `c` and `x` of `channels` each, and the
/// convolution runs over `b * x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShortConvShape {
    /// Channels of the convolution (`n_embd`).
    pub channels: usize,
    /// Width of the causal convolution (`shortconv.l_cache`).
    pub kernel: usize,
}

impl ShortConvShape {
    /// Floats of one layer's convolution state (the last `kernel - 1` gated
    /// inputs of every channel).
    pub fn conv_state_len(&self) -> usize {
        (self.kernel - 1) * self.channels
    }

    /// Checks the shape is consistent; the message names the first problem.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.channels == 0 || self.kernel < 2 {
            return Err("short convolution channels must be positive and its width >= 2");
        }
        Ok(())
    }
}

/// The recurrent mixer of a hybrid model's linear-time layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearShape {
    /// Gated DeltaNet (qwen3next, qwen35, qwen35moe).
    DeltaNet(DeltaNetShape),
    /// Mamba2 (granitehybrid).
    Mamba2(Mamba2Shape),
    /// Gated short convolution (lfm2moe): a convolution state only.
    ShortConv(ShortConvShape),
}

impl LinearShape {
    /// The DeltaNet shape, if these layers are DeltaNet.
    pub fn delta_net(&self) -> Option<DeltaNetShape> {
        match self {
            LinearShape::DeltaNet(d) => Some(*d),
            LinearShape::Mamba2(_) | LinearShape::ShortConv(_) => None,
        }
    }

    /// Floats of one layer's convolution state.
    pub fn conv_state_len(&self) -> usize {
        match self {
            LinearShape::DeltaNet(d) => d.conv_state_len(),
            LinearShape::Mamba2(m) => m.conv_state_len(),
            LinearShape::ShortConv(c) => c.conv_state_len(),
        }
    }

    /// Floats of one layer's recurrent state.
    pub fn ssm_state_len(&self) -> usize {
        match self {
            LinearShape::DeltaNet(d) => d.ssm_state_len(),
            LinearShape::Mamba2(m) => m.ssm_state_len(),
            LinearShape::ShortConv(_) => 0,
        }
    }

    /// Checks the shape is consistent; the message names the first problem.
    pub fn validate(&self) -> Result<(), &'static str> {
        match self {
            LinearShape::DeltaNet(d) => d.validate(),
            LinearShape::Mamba2(m) => m.validate(),
            LinearShape::ShortConv(c) => c.validate(),
        }
    }
}

/// What a hybrid model adds to [`Hparams`]: which layers are recurrent (gated
/// DeltaNet or Mamba2, linear in the sequence) rather than attention, the output gate of attention, and
/// multi-section RoPE, multi-head latent attention. [`HybridParams::plain`]
/// describes a plain transformer, for which the forward pass is the same
/// arithmetic as before these existed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HybridParams {
    /// Layers with attention (they own a slice of the KV cache).
    pub n_attn_layers: usize,
    /// Recurrent layers (they own recurrent state), and their shape.
    pub linear: Option<(usize, LinearShape)>,
    /// Layers that are an FFN alone, with nothing mixing positions
    /// ([`Mixer::None`](super::forward::Mixer::None): Nemotron-H's MoE layers).
    pub n_ffn_only_layers: usize,
    /// Attention output is gated: `wq` yields a query and a gate per head
    /// (`[q_h, g_h]` interleaved, `2 * q_dim` rows), and the attention output is
    /// multiplied by `sigmoid(g)` before `wo` (qwen3next, qwen35, qwen35moe).
    pub attn_output_gate: bool,
    /// Multi-section RoPE (`rope.dimension_sections`): each rotated pair
    /// turns by the temporal, height, width or extra position ([`Mrope`]).
    /// Text positions are `[p, p, p, 0]`.
    pub rope_sections: Option<Mrope>,
    /// Deepstack layers (Qwen3-VL): an image embedding carries this many
    /// extra `n_embd` features after its input, the `i`-th added to the
    /// residual stream after layer `i` (llama.cpp's `n_deepstack_layers`).
    pub n_deepstack: usize,
    /// Multi-head latent attention (deepseek2): the attention layers are
    /// [`Mixer::Mla`](super::forward::Mixer::Mla) of this shape.
    pub mla: Option<MlaShape>,
}

/// Multi-head latent attention (DeepSeek-V2/V3, llama.cpp's `deepseek2` in its
/// `attn_k_b` / `attn_v_b` form), computed as llama.cpp computes it: the key
/// up-projection absorbed into the queries, so that attention runs over the
/// cached latent as one shared key/value head of `kv_lora + rope` dimensions
/// ([`Hparams::head_dim`], with `n_head_kv = 1` and `n_rot = rope`); each
/// head's output, in the latent's first `kv_lora` dimensions, goes through
/// its value up-projection. The cache keeps the latent as key and value alike.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaShape {
    /// Rank of the query compression (`attention.q_lora_rank`; 0: the queries
    /// are projected directly, as in DeepSeek-V2-Lite).
    pub q_lora: usize,
    /// Rank of the key-value compression (`attention.kv_lora_rank`).
    pub kv_lora: usize,
    /// Query and key dimensions of a head that are not rotated.
    pub nope: usize,
    /// Rotated dimensions of a head (its key's are shared by all heads).
    pub rope: usize,
    /// Value dimensions of a head.
    pub v_head_dim: usize,
    /// The attention scale: `mscale^2 / sqrt(nope + rope)`, `mscale` YaRN's
    /// magnitude correction (1 without YaRN).
    pub kq_scale: f32,
}

impl MlaShape {
    /// A head's query width before absorption (`nope + rope`).
    pub fn q_head(&self) -> usize {
        self.nope + self.rope
    }

    /// Width of the cached latent, the shared key (`kv_lora + rope`).
    pub fn latent(&self) -> usize {
        self.kv_lora + self.rope
    }

    /// Checks the shape against `hp`; the message names the first problem.
    pub fn validate(&self, hp: &Hparams) -> Result<(), &'static str> {
        if self.kv_lora == 0 || self.nope == 0 || self.rope == 0 || self.v_head_dim == 0 {
            return Err("MLA ranks and head dimensions must be positive");
        }
        if !self.rope.is_multiple_of(2) {
            return Err("MLA rotated dimensions must be even");
        }
        if hp.n_head_kv != 1 || hp.head_dim != self.latent() || hp.n_rot != self.rope {
            return Err("MLA attends over one latent head of kv_lora + rope dimensions");
        }
        if !(self.kq_scale.is_finite() && self.kq_scale > 0.0) {
            return Err("MLA attention scale must be finite and positive");
        }
        Ok(())
    }
}

/// Multi-section RoPE (ggml's `rope_multi`): the pairs of the rotated
/// dimensions are cut into `sections` (temporal, height, width, extra), each
/// pair turning by its section's position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mrope {
    /// Pairs per position component.
    pub sections: [u32; 4],
    /// `true`: interleaved (ggml's IMROPE, Qwen3-VL and qwen35moe: pair `i`
    /// by `i % 3` within the sections); `false`: one section after the
    /// other (ggml's MROPE, GLM-4.xV).
    pub interleaved: bool,
}

impl Mrope {
    /// Which position component (0 temporal, 1 height, 2 width, 3 extra)
    /// turns rotated pair `i`, as ggml's `ggml_mrope_cache_init` picks it.
    pub fn component(&self, i: usize) -> usize {
        let s = self.sections.map(|v| v as usize);
        let sector = i % s.iter().sum::<usize>().max(1);
        if self.interleaved {
            if sector % 3 == 1 && sector < 3 * s[1] {
                1
            } else if sector % 3 == 2 && sector < 3 * s[2] {
                2
            } else if sector.is_multiple_of(3) && sector < 3 * s[0] {
                0
            } else {
                3
            }
        } else if sector < s[0] {
            0
        } else if sector < s[0] + s[1] {
            1
        } else if sector < s[0] + s[1] + s[2] {
            2
        } else {
            3
        }
    }
}

impl HybridParams {
    /// A plain transformer: every layer has (ungated) attention.
    pub fn plain(hp: &Hparams) -> HybridParams {
        HybridParams {
            n_attn_layers: hp.n_layers,
            linear: None,
            n_ffn_only_layers: 0,
            attn_output_gate: false,
            rope_sections: None,
            n_deepstack: 0,
            mla: None,
        }
    }

    /// Recurrent (linear-attention or Mamba2) layers.
    pub fn n_linear_layers(&self) -> usize {
        self.linear.map_or(0, |(n, _)| n)
    }

    /// Checks the parameters against `hp`; the message names the first problem.
    pub fn validate(&self, hp: &Hparams) -> Result<(), &'static str> {
        let layers = self.n_attn_layers + self.n_linear_layers() + self.n_ffn_only_layers;
        if layers != hp.n_layers {
            return Err("attention, recurrent and FFN-only layers must add up to n_layers");
        }
        if let Some((_, shape)) = self.linear {
            shape.validate()?;
        }
        if let Some(m) = self.rope_sections {
            let total: u64 = m.sections.iter().map(|&x| x as u64).sum();
            if total == 0 || total > hp.head_dim as u64 {
                return Err("rope sections must sum to between 1 and head_dim");
            }
        }
        if let Some(m) = self.mla {
            m.validate(hp)?;
            if self.linear.is_some() || self.attn_output_gate || self.rope_sections.is_some() {
                return Err("MLA does not combine with linear attention, gates or sections");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_start_where_llama_cpp_masks() {
        // Sliding: the last n positions; chunked: from the chunk's start
        // (llama.cpp masks key p0 for query p1 when p0 < p1 / n * n).
        assert_eq!(AttnWindow::Sliding(4).start(10), Some(6));
        assert_eq!(AttnWindow::Sliding(4).start(3), Some(0));
        assert_eq!(AttnWindow::Chunked(4).start(1), Some(0));
        assert_eq!(AttnWindow::Chunked(4).start(4), Some(0));
        assert_eq!(AttnWindow::Chunked(4).start(5), Some(4));
        assert_eq!(AttnWindow::Chunked(4).start(9), Some(8));
        assert_eq!(AttnWindow::Chunked(4).start(0), Some(0));
        assert_eq!(AttnWindow::Sliding(0).start(3), None);
        assert_eq!(AttnWindow::Chunked(0).start(3), None);
        for end in 1..40usize {
            let start = AttnWindow::Chunked(8).start(end).unwrap();
            let query = end - 1;
            assert!((start..end).all(|key| key >= query / 8 * 8));
            assert_eq!(start % 8, 0);
        }
    }

    #[test]
    fn llama4_temperature_steps_every_8192_positions() {
        let t = AttnTemperature::LLAMA4;
        assert_eq!(t.at(0), 1.0);
        assert_eq!(t.at(8190), 1.0);
        assert_eq!(
            t.at(8191),
            (libm::log(2.0) * f64::from(0.1f32) + 1.0) as f32
        );
        assert_eq!(t.at(16382), t.at(8191));
        assert_eq!(
            t.at(16383),
            (libm::log(3.0) * f64::from(0.1f32) + 1.0) as f32
        );
        let none = AttnTemperature {
            floor_scale: 0,
            ..t
        };
        assert_eq!(none.at(1 << 20), 1.0);
    }
}
