//! `les synth`: deterministic synthetic models (random weights) in GGUF, shaped
//! and named exactly as llama.cpp expects for `qwen3moe`, `olmoe`, `qwen2moe`,
//! `llama` (dense, or Mixtral-style with experts), `qwen35moe` (the hybrid gated
//! DeltaNet / gated attention model of MiniCPM-V 4.7, with its multi-token
//! prediction block), `gpt-oss` and `glm4moe` (GLM-4.5), with a small
//! byte-level BPE vocabulary ([`vocab`]).
//!
//! # Shapes
//! A [`Preset`] gives the dimensions ([`Shape`]) and tensor types ([`Types`]);
//! [`Overrides`] change any of them. The architecture fixes the rest: `olmoe` and
//! `qwen2moe` have `head_dim = n_embd / n_head` (their `attn_q` is square), `olmoe`
//! has as many KV heads as query heads (its `attn_k_norm` is `n_embd` wide),
//! `qwen2moe` adds attention biases and a gated shared expert, plain `llama` is dense
//! unless experts are asked for, `mixtral` is `llama` with the preset's experts.
//! `qwen35moe` makes every `full_attention_interval`-th layer gated attention
//! (query and gate interleaved per head in `attn_q`, partial IMRoPE over
//! `rope_dim` dimensions) and the others gated DeltaNet (`attn_qkv`, `attn_gate`,
//! `ssm_*`), all with routed experts plus a sigmoid-gated shared expert, then
//! appends `mtp_layers` nextn blocks (`nextn_predict_layers`). `gpt-oss` has
//! attention biases and sinks, a sliding window on even layers, YaRN and
//! expert biases; `glm4moe` Q/K/V biases, half of each head rotated, a dense
//! first layer, sigmoid routing with a selection bias (`exp_probs_b`), an
//! ungated shared expert and one nextn block; `ernie4_5-moe` Llama attention,
//! a dense first layer, softmax routing with a selection bias and an ungated
//! shared expert. `granitehybrid` (Granite 4.0-H) has Mamba2 layers with a few
//! attention layers among them ([`granitehybrid_is_attention`]), every one
//! followed by routed experts and an ungated shared expert. `nemotron_h_moe`
//! (NVIDIA Nemotron 3 Nano) has layers of one sub-layer each, Mamba2, attention
//! without RoPE or ungated ReLU² experts routed by sigmoid with a selection bias
//! plus an ungated shared expert ([`nemotron_layer_kind`]); `nemotron_h` has
//! ungated ReLU² FFNs in place of its experts.
//! The `small`, `a3b` and `minicpmv47` presets are typed as llama.cpp's `Q4_K_M`
//! quantization types those models ([`Mix::Q4KM`]: `q4_k`, with `q6_k` for `attn_v`
//! and `ffn_down*` of every third layer and the first and last eighth; `a3b` then has
//! the 17.28 GiB of Qwen3-30B-A3B's `Q4_K_M` file); `--mix uniform` and the
//! `--*-type` flags give one type per class.
//! A type whose block does not divide a tensor's row length falls back as
//! llama.cpp's quantizer does (`q4_k` to `q5_0`, `q5_k` to `q5_1`, `q6_k` to
//! `q8_0`, after the mix's choice), else to `f16`; norms, biases and routers are
//! `f32`.
//!
//! # Weights
//! Gaussian with `1/sqrt(fan_in)` scaling so activations stay O(1); norm weights
//! `1 + 0.02 N(0,1)`. Three knobs ([`Knobs`]) shape the routing so that LES's
//! lookahead and caching see what they would in a trained model:
//! - **`router_corr` C**: layer `l+1`'s router is `C * router_l + sqrt(1-C^2) *
//!   noise` (before the popularity term), so consecutive layers favour the same
//!   expert ids for the same hidden state.
//! - **`popularity_skew` S**: every token embedding shares one direction `u` (a
//!   quarter of its variance), and each router row gets a component along `u` that
//!   adds `b_e = -S ln(1 + rank_e)` (centred) to expert `e`'s logit, `rank_e` a
//!   random permutation fixed for the model: a Zipf-like prior `(1+rank)^-S` over
//!   experts. The router's own random part is orthogonal to `u`.
//! - **`residual_scale` R**: the output projections (`attn_output`, `ffn_down*`)
//!   have standard deviation `R/sqrt(fan_in)`, so each block adds about `R` times an
//!   O(1) vector to a residual stream of O(1) elements; a small `R` makes the hidden
//!   state drift slowly across layers, which is what makes lookahead (layer `l+1`'s
//!   router applied to layer `l`'s hidden state) right most of the time.
//! - `router_scale` G: standard deviation of the router logits' random part.
//!
//! [`probe`] measures the result on a written file. With the defaults, the
//! single-position probe of the `tiny` and `small` presets gives a top-k lookahead
//! precision of roughly 0.6-0.75.
//!
//! # Determinism and streaming
//! Every chunk of every tensor (one expert of a 3-D tensor, a band of rows of a
//! matrix) has its own random stream derived from the seed and the tensor's name
//! ([`rng`]), so the file is byte-identical for the same arguments whatever the
//! thread count. [`write_model`] generates, quantizes and writes chunk by chunk
//! (memory is a few chunks per thread, not a tensor), into a temporary file in the
//! target directory that is renamed over the target only when complete.

mod gen;
pub mod mmproj;
pub mod probe;
pub mod rng;
pub mod vocab;

use std::fmt;

use les_core::quant::{can_quantize, GgmlType};

use crate::gguf::{GgufError, GgufWriter, MetaArray, MetaValue, ValueType};

pub use gen::{write_model, WriteOptions, WriteReport};
pub use mmproj::{write_mmproj, MmprojConfig};
pub use vocab::Vocab;

/// An architecture `les synth` can produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    /// Qwen3-MoE: per-head q/k norms, no shared expert, softmax top-k renormalised.
    Qwen3moe,
    /// OLMoE: full-width q/k norms, no renormalisation.
    Olmoe,
    /// Qwen2-MoE (Qwen1.5-MoE): attention biases, sigmoid-gated shared expert.
    Qwen2moe,
    /// Llama: dense, or Mixtral-style when given `--experts`.
    Llama,
    /// Mixtral: arch `llama` with the preset's experts.
    Mixtral,
    /// Qwen3.5-MoE (MiniCPM-V 4.7's language model): gated DeltaNet and gated
    /// attention layers, routed plus shared experts, a multi-token-prediction block.
    Qwen35moe,
    /// Qwen3-Next: qwen35moe's layers with plain partial RoPE (no sections),
    /// value heads grouped by key head and a fused `ssm_ba`.
    Qwen3next,
    /// gpt-oss: attention biases and sinks, a sliding window on even layers,
    /// YaRN RoPE, routed experts with biases and a clamped SwiGLU.
    #[value(name = "gpt-oss")]
    GptOss,
    /// GLM-4.5 (llama.cpp's `glm4moe`): Q/K/V biases, half of each head
    /// rotated (NeoX), the first layer dense, routed experts chosen by sigmoid
    /// scores plus a selection bias (`exp_probs_b`) and scaled by 2.5, an
    /// ungated shared expert, and one nextn (MTP) block after the main stack.
    Glm4moe,
    /// DeepSeek-V3 (llama.cpp's `deepseek2`): multi-head latent attention
    /// (split `attn_k_b` / `attn_v_b`, YaRN with `yarn_log_multiplier`), the
    /// first layer dense, sigmoid routing with a selection bias over expert
    /// groups, weights scaled by 2.5, an ungated shared expert.
    Deepseek2,
    /// ERNIE 4.5 MoE (llama.cpp's `ernie4_5-moe`): Llama attention, the first
    /// layer dense, routed experts picked by softmax probabilities plus a
    /// selection bias (`exp_probs_b`), an ungated shared expert.
    #[value(name = "ernie4_5-moe")]
    Ernie45moe,
    /// Ling 2.0 (llama.cpp's `bailingmoe2`): a fused QKV projection, per-head
    /// Q/K norms, half of each head rotated (NeoX), the first layer dense,
    /// sigmoid routing with a selection bias over expert groups, weights
    /// scaled by 2.5, an ungated shared expert.
    Bailingmoe2,
    /// MiniMax-M2 (llama.cpp's `minimax-m2`): Q/K norms over all heads at
    /// once, half of each head rotated (NeoX), every layer routed experts
    /// picked by sigmoid scores plus a selection bias, no shared expert.
    #[value(name = "minimax-m2")]
    MinimaxM2,
    /// dots.llm1 (llama.cpp's `dots1`): Qwen3's attention, the first layer
    /// dense, sigmoid routing with a selection bias, weights scaled by 2.5,
    /// an ungated shared expert.
    Dots1,
    /// Hunyuan-A13B (llama.cpp's `hunyuan-moe`): Q/K norms per head after
    /// RoPE, every layer softmax-routed experts plus an ungated shared expert.
    #[value(name = "hunyuan-moe")]
    HunyuanMoe,
    /// Llama 4 (llama.cpp's `llama4`): Llama attention, chunked on three
    /// layers of four and without RoPE on the fourth, experts every
    /// `--moe-every` layers (Scout's 1 by default, Maverick's 2) picked by
    /// logit and weighing their inputs, an ungated shared expert as wide as
    /// one routed expert, dense SwiGLU layers in between.
    #[value(name = "llama4")]
    Llama4,
    /// Qwen3-VL's MoE language model (llama.cpp's `qwen3vlmoe`): qwen3moe's
    /// layers rotated by IMRoPE sections (`rope.dimension_sections`), the
    /// vision tower's deepstack layers counted (`n_deepstack_layers`).
    #[value(name = "qwen3vlmoe")]
    Qwen3vlmoe,
    /// Qwen3-VL's dense language model (llama.cpp's `qwen3vl`): Qwen3's
    /// attention rotated by IMRoPE sections, dense SwiGLU layers.
    #[value(name = "qwen3vl")]
    Qwen3vl,
    /// IBM Granite 3.x, dense (llama.cpp's `granite`): Llama's layers with
    /// Granite's multipliers (`GRANITE_SCALES`).
    Granite,
    /// IBM Granite 3.x MoE (llama.cpp's `granitemoe`): Granite's layers with
    /// softmax-routed experts, renormalised, and an ungated shared expert
    /// (`expert_shared_feed_forward_length`, as Granite's shared-expert MoEs).
    Granitemoe,
    /// IBM Granite 4.0-H (llama.cpp's `granitehybrid`): Mamba2 layers with a
    /// few attention layers among them (without RoPE), all followed by
    /// granitemoe's experts and shared expert, Granite's multipliers.
    Granitehybrid,
    /// NVIDIA Nemotron-H MoE (llama.cpp's `nemotron_h_moe`, Nemotron 3 Nano
    /// 30B-A3B): every layer one sub-layer (`nemotron_layer_kind`), Mamba2
    /// (`nemotron_ssm`), attention without RoPE, or ungated ReLU² experts
    /// picked by sigmoid scores plus a selection bias, weights renormalised
    /// and scaled by 2.5, with an ungated ReLU² shared expert.
    #[value(name = "nemotron_h_moe")]
    NemotronHMoe,
    /// NVIDIA Nemotron-H, dense (llama.cpp's `nemotron_h`): the MoE's layers
    /// with an ungated ReLU² FFN (`--ff`) in place of the experts.
    #[value(name = "nemotron_h")]
    NemotronH,
    /// Liquid AI's LFM2 MoE (llama.cpp's `lfm2moe`, LFM2-8B-A1B): gated short
    /// convolutions with an attention layer in every four
    /// (`lfm2_is_attention`; per-head Q/K norms, NeoX RoPE), the first
    /// `LFM2_DENSE_LAYERS` dense, then routed experts picked by sigmoid
    /// scores plus a selection bias, renormalised.
    Lfm2moe,
    /// LFM2, dense (llama.cpp's `lfm2`): the MoE's layers with a SwiGLU FFN
    /// (`--ff`) each.
    Lfm2,
    /// Qwen3's dense models (llama.cpp's `qwen3`): qwen3moe's attention with a
    /// SwiGLU FFN (`--ff`) a layer; a draft model for qwen3moe (the same
    /// vocabulary).
    Qwen3,
    /// Qwen2 / Qwen2.5's dense models (llama.cpp's `qwen2`): attention with
    /// Q/K/V biases, a SwiGLU FFN (`--ff`) a layer.
    Qwen2,
    /// PowerInfer's SmallThinker (llama.cpp's `smallthinker`): Llama-style
    /// attention without Q/K norms (NeoX RoPE), every layer routed experts
    /// whose router reads the layer's input (before the attention, without a
    /// norm), sigmoid scores renormalised, `relu(gate) * up`; a sliding window
    /// key, which makes llama.cpp window three layers of four by 4096
    /// positions and leave the fourth without RoPE.
    Smallthinker,
}

/// Whether layer `l` of an LFM2 stack is attention (the others gated short
/// convolutions): every fourth from the third (`l % 4 == 2`), six of
/// LFM2-8B-A1B's 24 layers as in its `layer_types`; `tiny`'s four layers
/// have one.
pub fn lfm2_is_attention(l: u64) -> bool {
    l % 4 == 2
}

/// LFM2-MoE's dense leading layers (LFM2-8B-A1B's `num_dense_layers`).
pub const LFM2_DENSE_LAYERS: u64 = 2;

/// LFM2's convolution width (`conv_L_cache`).
pub const LFM2_CONV_WIDTH: u64 = 3;

/// The Granite presets' multipliers of the embedding, the blocks' outputs,
/// the attention scores and the logits (granite-3.0-1b-a400m's
/// `embedding_multiplier`, `residual_multiplier`, `attention_multiplier`
/// and `logits_scaling`).
pub const GRANITE_SCALES: [f32; 4] = [12.0, 0.22, 0.015625, 6.0];

/// Whether layer `l` of a `granitehybrid` stack of `layers` is attention (the
/// others are Mamba2): the middle layer of every run of `p = clamp(layers / 2,
/// 2, 10)` (`l % p == p / 2`). Forty layers give layers 5, 15, 25 and 35, as
/// Granite 4.0-H's `layer_types`; `tiny`'s four give 1 and 3, `small`'s
/// sixteen 4 and 12, `a3b`'s 48 five.
pub fn granitehybrid_is_attention(l: u64, layers: u64) -> bool {
    let p = (layers / 2).clamp(2, 10);
    l < layers && l % p == p / 2
}

/// The Mamba2 head size and state size of a synthetic `granitehybrid`:
/// Granite 4.0-H's 64 and 128 (`mamba_d_head`, `mamba_d_state`), 16 and 16
/// in `tiny`.
pub fn granitehybrid_ssm(preset: Preset) -> (u64, u64) {
    match preset {
        Preset::Tiny => (16, 16),
        _ => (64, 128),
    }
}

/// What a Nemotron-H layer is: llama.cpp tells them apart by their
/// `attention.head_count_kv` and `feed_forward_length`, both 0 on Mamba2
/// layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NemotronLayer {
    /// A Mamba2 mixer (`M` in Nemotron's `hybrid_override_pattern`).
    Mamba2,
    /// Attention without RoPE (`*`).
    Attention,
    /// The routed and shared experts (`E`), or the dense FFN of `nemotron_h`
    /// (`-`).
    Ffn,
}

/// The kind of layer `l` of a Nemotron-H stack of `layers`: in every run of
/// `p = clamp(layers, 3, 9)` layers, the second to last is attention, the
/// last FFN, and those before alternate Mamba2 and FFN from Mamba2
/// (`MEMEMEM*E` for `p = 9`); a last, shorter run stops where the stack
/// does. Any stack of 3 or more layers has each kind; big ones have 4 Mamba2,
/// 4 FFN and 1 attention layer in 9 (Nemotron 3 Nano: 23, 23 and 6 of 52,
/// `MEMEM*EMEMEM*E...`). `tiny`'s four layers are `ME*E`, `small`'s sixteen
/// `MEMEMEM*EMEMEMEM`, `a3b`'s 52 have attention at 7, 16, 25, 34 and 43
/// (Nemotron 3 Nano at 5, 12, 19, 26, 33 and 42).
pub fn nemotron_layer_kind(l: u64, layers: u64) -> NemotronLayer {
    let p = layers.clamp(3, 9);
    match l % p {
        i if i + 2 == p => NemotronLayer::Attention,
        i if i + 1 == p || i % 2 == 1 => NemotronLayer::Ffn,
        _ => NemotronLayer::Mamba2,
    }
}

/// The Mamba2 mixer of a synthetic Nemotron-H: heads, head size, state size
/// and groups (`ssm.time_step_rank`, `ssm.inner_size / ssm.time_step_rank`,
/// `ssm.state_size`, `ssm.group_count`). `a3b` has Nemotron 3 Nano's 64
/// heads of 64, a state of 128 and 8 groups (an inner width of 4096 over an
/// embedding of 2688); `small` 24 heads of 64 in 8 groups (1.5 times its
/// embedding, as Nemotron 3 Nano's), `tiny` 6 heads of 16, a state of 16 and
/// 2 groups. The inner width is not tied to the embedding, as it is in
/// `granitehybrid`.
pub fn nemotron_ssm(preset: Preset) -> [u64; 4] {
    match preset {
        Preset::Tiny => [6, 16, 16, 2],
        Preset::Small => [24, 64, 128, 8],
        _ => [64, 64, 128, 8],
    }
}

/// A preset's dimensions for Nemotron-H, before the overrides: the preset's
/// with the Mamba2 mixer of [`nemotron_ssm`] and a layer-norm epsilon of
/// 1e-5; `a3b` is Nemotron 3 Nano 30B-A3B's (52 layers, hidden size 2688,
/// 32 query and 2 KV heads of 128, 128 experts of 1856, 6 per token, a
/// shared expert of 3712; the vocabulary of 131072 is Nemotron-H's as
/// remembered, not read from the file: Hugging Face is not reachable here).
pub fn nemotron_shape(preset: Preset) -> Shape {
    let p = preset.shape();
    let [heads, head, state, groups] = nemotron_ssm(preset);
    let p = Shape {
        norm_eps: 1e-5,
        ssm_k_heads: groups,
        ssm_v_heads: heads,
        ssm_head_dim: state,
        ssm_conv: 4,
        ssm_inner: heads * head,
        ..p
    };
    match preset {
        Preset::A3b => Shape {
            layers: 52,
            embd: 2688,
            heads: 32,
            kv_heads: 2,
            head_dim: 128,
            vocab: 131_072,
            experts: 128,
            top_k: 6,
            expert_ff: 1856,
            shared_ff: 3712,
            ..p
        },
        _ => p,
    }
}

/// A Nemotron-H preset's default routing knobs: [`Preset::knobs`] with a
/// stronger popularity skew, 2.75 in `small` (64 experts) and 1.5 in `a3b`
/// (128; `tiny`, for tests, keeps the default 0.5). The residual scale
/// cannot calibrate these: a synthetic Nemotron's hidden state carries
/// little of its context (one attention layer in nine, and the random Mamba2
/// layers read their state out per token and gate it per token), so
/// consecutive tokens route nearly as independently as random ones, and
/// plain LRU caching at a 25% budget hits 44-47% of `small`'s picks whatever
/// the residual scale (0.7 to 2.0), 55% of a 12-layer cut of `a3b`'s. With
/// these skews (`les bench --schedules on-demand,les`, sampled decode, 25%)
/// LRU hits 72.7% (`small`) and 73.9% (the `a3b` cut), Belady's cache 88.0%
/// and 88.4%, as the other presets are calibrated (72-76%, mid-range of the
/// 60-85% trained MoE models show); the locality then comes from popular
/// experts rather than from the context, so the picks concentrate on fewer
/// experts than a trained, load-balanced model's.
pub fn nemotron_knobs(preset: Preset) -> Knobs {
    let d = preset.knobs();
    let popularity_skew = match preset {
        Preset::Tiny => return d,
        Preset::Small => 2.75,
        _ => 1.5,
    };
    Knobs {
        popularity_skew,
        ..d
    }
}

/// The routing knobs of a synthetic LFM2-MoE. As Nemotron-H's, its hidden
/// state follows each token more than its context (three layers in four are
/// short convolutions over the last three tokens), so plain LRU caching at a
/// 25% budget hits 41% of `small`'s picks at the default knobs, whatever the
/// residual scale (0.35 gave 41%). A stronger popularity skew gives `small`
/// LRU 70.6% and Belady's cache 86.7% (`les bench --schedules
/// on-demand,les`, sampled decode, 25%), as the other presets are
/// calibrated. `a3b` is not calibrated (not measured here): the defaults.
pub fn lfm2_knobs(preset: Preset) -> Knobs {
    let d = preset.knobs();
    match preset {
        Preset::Small => Knobs {
            popularity_skew: 3.0,
            ..d
        },
        _ => d,
    }
}

/// Nemotron-H MoE's `routed_scaling_factor` (Nemotron 3 Nano's).
pub const NEMOTRON_WEIGHTS_SCALE: f32 = 2.5;

impl Arch {
    /// `general.architecture`.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Qwen3moe => "qwen3moe",
            Arch::Olmoe => "olmoe",
            Arch::Qwen2moe => "qwen2moe",
            Arch::Llama | Arch::Mixtral => "llama",
            Arch::Qwen35moe => "qwen35moe",
            Arch::Qwen3next => "qwen3next",
            Arch::GptOss => "gpt-oss",
            Arch::Glm4moe => "glm4moe",
            Arch::Deepseek2 => "deepseek2",
            Arch::Ernie45moe => "ernie4_5-moe",
            Arch::Bailingmoe2 => "bailingmoe2",
            Arch::MinimaxM2 => "minimax-m2",
            Arch::Dots1 => "dots1",
            Arch::HunyuanMoe => "hunyuan-moe",
            Arch::Llama4 => "llama4",
            Arch::Qwen3vlmoe => "qwen3vlmoe",
            Arch::Qwen3vl => "qwen3vl",
            Arch::Granite => "granite",
            Arch::Granitemoe => "granitemoe",
            Arch::Smallthinker => "smallthinker",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen2 => "qwen2",
            Arch::Granitehybrid => "granitehybrid",
            Arch::NemotronHMoe => "nemotron_h_moe",
            Arch::NemotronH => "nemotron_h",
            Arch::Lfm2moe => "lfm2moe",
            Arch::Lfm2 => "lfm2",
        }
    }

    /// The name on the command line.
    pub fn cli_name(self) -> &'static str {
        match self {
            Arch::Mixtral => "mixtral",
            a => a.gguf_name(),
        }
    }

    /// Whether the head size is tied to `n_embd / n_head`.
    fn square_attention(self) -> bool {
        matches!(self, Arch::Olmoe | Arch::Qwen2moe | Arch::Qwen2) || self.is_lfm2()
    }

    /// Whether this is LFM2 (short convolutions between attention layers).
    pub fn is_lfm2(self) -> bool {
        matches!(self, Arch::Lfm2moe | Arch::Lfm2)
    }

    /// Whether llama.cpp falls back to the token embedding without `output.weight`.
    fn may_tie(self) -> bool {
        matches!(
            self,
            Arch::Qwen3moe
                | Arch::Llama
                | Arch::Mixtral
                | Arch::Qwen35moe
                | Arch::Qwen3next
                | Arch::Ernie45moe
                | Arch::Llama4
                | Arch::Qwen3vlmoe
                | Arch::Qwen3vl
                | Arch::Granite
                | Arch::Granitemoe
                | Arch::Granitehybrid
                | Arch::NemotronHMoe
                | Arch::NemotronH
                | Arch::Lfm2moe
                | Arch::Lfm2
                | Arch::Smallthinker
                | Arch::Qwen3
                | Arch::Qwen2
        )
    }

    /// `expert_weights_norm`: whether the top-k weights are renormalised.
    fn normalizes(self) -> bool {
        matches!(
            self,
            Arch::Qwen3moe
                | Arch::Llama
                | Arch::Mixtral
                | Arch::Qwen35moe
                | Arch::Qwen3next
                | Arch::Qwen3vlmoe
                | Arch::Glm4moe
                | Arch::Deepseek2
                | Arch::Bailingmoe2
                | Arch::MinimaxM2
                | Arch::Dots1
                | Arch::HunyuanMoe
                | Arch::Granitemoe
                | Arch::Granitehybrid
                | Arch::NemotronHMoe
                | Arch::Lfm2moe
                | Arch::Smallthinker
        )
    }

    /// The MoE architecture of a dense one whose MoE is another.
    fn moe_of(self) -> Option<Arch> {
        match self {
            Arch::Qwen3vl => Some(Arch::Qwen3vlmoe),
            Arch::Qwen3 => Some(Arch::Qwen3moe),
            Arch::Qwen2 => Some(Arch::Qwen2moe),
            Arch::Granite => Some(Arch::Granitemoe),
            Arch::NemotronH => Some(Arch::NemotronHMoe),
            Arch::Lfm2 => Some(Arch::Lfm2moe),
            _ => None,
        }
    }

    /// Whether the architecture's models have no experts unless `--experts`
    /// asks for them (llama, whose experts make a Mixtral) or ever (those
    /// whose MoE is another architecture, [`moe_of`](Self::moe_of)).
    fn dense_by_default(self) -> bool {
        self == Arch::Llama || self.moe_of().is_some()
    }

    /// Whether the architecture has a shared expert.
    fn has_shared_expert(self) -> bool {
        matches!(
            self,
            Arch::Qwen2moe
                | Arch::Qwen35moe
                | Arch::Qwen3next
                | Arch::Glm4moe
                | Arch::Deepseek2
                | Arch::Ernie45moe
                | Arch::Bailingmoe2
                | Arch::Dots1
                | Arch::HunyuanMoe
                | Arch::Llama4
                | Arch::Granitemoe
                | Arch::Granitehybrid
                | Arch::NemotronHMoe
        )
    }

    /// Whether the architecture ends with multi-token-prediction (nextn) blocks.
    fn has_mtp(self) -> bool {
        matches!(
            self,
            Arch::Qwen35moe | Arch::Qwen3next | Arch::Glm4moe | Arch::Deepseek2
        )
    }

    /// Whether layers mix gated DeltaNet with gated attention (qwen35moe, qwen3next).
    fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen35moe | Arch::Qwen3next)
    }

    /// Whether this is Nemotron-H (layers of one sub-layer, [`nemotron_layer_kind`]).
    pub fn is_nemotron(self) -> bool {
        matches!(self, Arch::NemotronHMoe | Arch::NemotronH)
    }

    /// Whether the layers have Mamba2 mixers (granitehybrid, Nemotron-H).
    fn has_mamba2(self) -> bool {
        self == Arch::Granitehybrid || self.is_nemotron()
    }
}

/// A named set of dimensions and types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// Milliseconds to generate and run (about 330 KB): 4 layers, 64 wide, 8 experts
    /// of 64, top-2.
    Tiny,
    /// About 560 MB: 16 layers, 1024 wide, 64 experts of 256, top-4.
    Small,
    /// The shape of Qwen3-30B-A3B: 48 layers, 2048 wide, 128 experts of 768, top-8;
    /// in llama.cpp's `Q4_K_M` mix (`Mix::Q4KM`) about 18.6 GB (17.28 GiB), the
    /// size of that model's `Q4_K_M` download. With `nemotron_h_moe`, Nemotron
    /// 3 Nano 30B-A3B's shape (`nemotron_shape`), about 25.5 GB.
    A3b,
    /// The shape of MiniCPM-V 4.7's language model (Qwen3.5-35B-A3B, arch
    /// `qwen35moe`): 40 layers (30 gated DeltaNet, 10 gated attention), 2048 wide,
    /// 256 experts of 512, top-8, a shared expert of 512, vocabulary 248320, one
    /// MTP block; about 21.7 GB in the `Q4_K_M` mix.
    Minicpmv47,
    /// The shape of gpt-oss-20b (arch `gpt-oss` only): 24 layers, 2880 wide,
    /// 64 query and 8 KV heads of 64, 32 experts of 2880, top-4, vocabulary
    /// 201088; `MXFP4` experts and `q8_0` elsewhere, about 12.1 GB (the size
    /// of ggml-org's `MXFP4` download).
    #[value(name = "gpt-oss-20b")]
    GptOss20b,
}

/// Model dimensions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    /// Transformer blocks.
    pub layers: u64,
    /// Width of the residual stream.
    pub embd: u64,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Size of one head.
    pub head_dim: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// `context_length`.
    pub context: u64,
    /// Hidden size of dense FFNs (`feed_forward_length`).
    pub ff: u64,
    /// Routed experts per layer (0: dense).
    pub experts: u64,
    /// Experts used per token.
    pub top_k: u64,
    /// Hidden size of one routed expert.
    pub expert_ff: u64,
    /// Hidden size of the shared expert (0: none).
    pub shared_ff: u64,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// Dimensions of each head RoPE rotates (qwen35moe: a quarter of the head).
    pub rope_dim: u64,
    /// IMRoPE sections (`rope.dimension_sections`, qwen35moe).
    pub rope_sections: [u32; 4],
    /// Every this many layers one is gated attention, the others gated DeltaNet
    /// (`full_attention_interval`, qwen35moe).
    pub full_attn_interval: u64,
    /// DeltaNet query/key heads; Mamba2 groups of `B` and `C` (`ssm.group_count`).
    pub ssm_k_heads: u64,
    /// DeltaNet value heads; Mamba2 heads (`ssm.time_step_rank`).
    pub ssm_v_heads: u64,
    /// DeltaNet head size; Mamba2 state size (`ssm.state_size`).
    pub ssm_head_dim: u64,
    /// DeltaNet or Mamba2 convolution width (`ssm.conv_kernel`).
    pub ssm_conv: u64,
    /// Mamba2 inner width (`ssm.inner_size`): `2 * embd` in granitehybrid,
    /// heads times their size in Nemotron-H; 0 without Mamba2.
    pub ssm_inner: u64,
    /// Multi-token-prediction blocks after the main stack (`nextn_predict_layers`).
    pub mtp_layers: u64,
}

impl Shape {
    /// Whether main layer `l` is gated DeltaNet (qwen35moe).
    pub fn is_linear(&self, l: u64) -> bool {
        self.full_attn_interval > 0
            && l < self.layers
            && !(l + 1).is_multiple_of(self.full_attn_interval)
    }

    /// DeltaNet query/key width.
    pub fn ssm_key_dim(&self) -> u64 {
        self.ssm_k_heads * self.ssm_head_dim
    }

    /// DeltaNet value width (`ssm.inner_size`).
    pub fn ssm_value_dim(&self) -> u64 {
        self.ssm_v_heads * self.ssm_head_dim
    }

    /// DeltaNet convolution channels.
    pub fn ssm_conv_dim(&self) -> u64 {
        2 * self.ssm_key_dim() + self.ssm_value_dim()
    }

    /// Mamba2 inner width (`ssm.inner_size`, [`ssm_inner`](Self::ssm_inner)):
    /// in granitehybrid twice the embedding, the only expansion llama.cpp's
    /// `granitehybrid` accepts.
    pub fn mamba2_inner(&self) -> u64 {
        self.ssm_inner
    }

    /// Mamba2 convolution channels: `x`, then `B` and `C` per group.
    pub fn mamba2_conv_dim(&self) -> u64 {
        self.mamba2_inner() + 2 * self.ssm_k_heads * self.ssm_head_dim
    }

    /// Rows of Mamba2's `ssm_in`: the gate `z`, the convolution channels and
    /// one time step per head.
    pub fn mamba2_in_proj(&self) -> u64 {
        self.mamba2_inner() + self.mamba2_conv_dim() + self.ssm_v_heads
    }

    /// Width of the query vector.
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Width of the key and value vectors.
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }
}

/// Tensor types by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Types {
    /// Routed expert tensors.
    pub expert: GgmlType,
    /// Attention, dense FFN and shared-expert matrices.
    pub dense: GgmlType,
    /// `token_embd.weight`.
    pub embd: GgmlType,
    /// `output.weight`.
    pub output: GgmlType,
    /// How types vary inside the expert and dense classes.
    pub mix: Mix,
}

/// How tensor types vary inside a class ([`Types`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mix {
    /// Every tensor has its class's type.
    Uniform,
    /// llama.cpp's `Q4_K_M` recipe (`llama_tensor_get_type`) over the classes whose
    /// type is `q4_k`: `attn_v` and every `ffn_down*` (routed, shared or dense) of
    /// the "more bits" layers (the first and last eighth, and every third between)
    /// become `q6_k`, DeltaNet `attn_qkv` `q5_k`; with exactly 8 experts
    /// (Mixtral) `attn_k` and `attn_v` become `q8_0` and `attn_output` `q5_k`.
    /// What `llama-quantize ... Q4_K_M`, the usual 4-bit download, writes.
    #[value(name = "q4_k_m")]
    Q4KM,
}

impl Mix {
    /// The name `--mix` takes.
    pub fn name(self) -> &'static str {
        match self {
            Mix::Uniform => "uniform",
            Mix::Q4KM => "q4_k_m",
        }
    }
}

/// llama.cpp's `use_more_bits`: layer `i` of `n` gets more bits in `Q4_K_M`.
fn use_more_bits(i: u64, n: u64) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// Applies [`Mix::Q4KM`] to a plan whose tensors have their class types: the
/// type `llama_tensor_get_type` picks for each tensor of a `q4_k` class, then
/// [`fit`] to its rows. `attn_v` tensors count in layer order among all
/// `attn_v` / `attn_qkv` tensors, as in llama.cpp.
fn apply_q4_k_m(cfg: &SynthConfig, plan: &mut [TensorPlan]) {
    let t = &cfg.types;
    let n_layer = cfg.shape.layers + cfg.shape.mtp_layers;
    let eight_experts = cfg.shape.experts == 8;
    let n_wv = plan
        .iter()
        .filter(|p| p.name.contains("attn_v.weight") || p.name.contains("attn_qkv.weight"))
        .count() as u64;
    // The plan lists layers in order and at most one attn_v per layer.
    let mut i_wv = 0;
    // Without experts llama.cpp counts the ffn_down tensors (Nemotron-H's
    // FFNs are on some layers only); with them it reads the layer's number.
    let mut i_ffn_down = 0;
    for p in plan.iter_mut() {
        let class = if p.is_expert() { t.expert } else { t.dense };
        let Some(layer) = p.layer else { continue };
        let is_v = p.name.contains("attn_v.weight");
        let bumped = if is_v {
            let more = use_more_bits(i_wv, n_wv);
            i_wv += 1;
            if eight_experts {
                Some(GgmlType::Q8_0)
            } else {
                more.then_some(GgmlType::Q6K)
            }
        } else if p.name.contains("attn_k.weight") {
            eight_experts.then_some(GgmlType::Q8_0)
        } else if p.name.contains("ffn_down") {
            let i = if cfg.shape.experts > 1 {
                layer
            } else {
                i_ffn_down
            };
            i_ffn_down += 1;
            use_more_bits(i, n_layer).then_some(GgmlType::Q6K)
        } else if p.name.contains("attn_output.weight") {
            eight_experts.then_some(GgmlType::Q5K)
        } else if p.name.contains("attn_qkv.weight") {
            Some(GgmlType::Q5K)
        } else {
            None
        };
        if let Some(ty) = bumped {
            if class == GgmlType::Q4K && p.ty == fit(class, p.dims[0]) {
                p.ty = fit(ty, p.dims[0]);
            }
        }
    }
}

/// The routing-realism knobs; see the [module documentation](self).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Knobs {
    /// Correlation of consecutive layers' routers, in `[0, 1]`.
    pub router_corr: f32,
    /// Zipf exponent of the per-expert popularity prior, `>= 0`.
    pub popularity_skew: f32,
    /// Scale of the blocks' output projections, `> 0`.
    pub residual_scale: f32,
    /// Standard deviation of the router logits' random part, `> 0`.
    pub router_scale: f32,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            router_corr: 0.9,
            popularity_skew: 0.5,
            residual_scale: 0.5,
            router_scale: 2.0,
        }
    }
}

impl Preset {
    /// The preset's default routing knobs: [`Knobs::default`] with the
    /// `residual_scale` calibrated so that plain LRU caching hits about 72-76% of
    /// picked experts at a 25% slot budget (`les bench --schedules on-demand`,
    /// sampled decode; the figure moves a little with the sampled tokens),
    /// mid-range of the 60-85% trained MoE models show:
    /// `small` (16 layers) 0.7, `a3b` (48 layers) 0.35; `minicpmv47` (40 layers)
    /// takes a3b's value, not measured. The deeper the stack, the smaller: over
    /// many blocks a residual stream moved by R per block is dominated by what
    /// the blocks add, which varies little between tokens, so deep layers route
    /// every token alike (a3b at 0.5: LRU hits ~85%); a shallow stack at 0.5
    /// keeps too little in common between tokens (small: ~54%). `tiny` (for
    /// tests) keeps 0.5.
    pub fn knobs(self) -> Knobs {
        let residual_scale = match self {
            Preset::Small => 0.7,
            Preset::A3b | Preset::Minicpmv47 => 0.35,
            _ => return Knobs::default(),
        };
        Knobs {
            residual_scale,
            ..Knobs::default()
        }
    }

    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::A3b => "a3b",
            Preset::Minicpmv47 => "minicpmv47",
            Preset::GptOss20b => "gpt-oss-20b",
        }
    }

    /// The preset's dimensions, before the architecture's rules.
    pub fn shape(self) -> Shape {
        match self {
            Preset::Tiny => Shape {
                layers: 4,
                embd: 64,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                vocab: 300,
                context: 4096,
                ff: 128,
                experts: 8,
                top_k: 2,
                expert_ff: 64,
                shared_ff: 128,
                rope_base: 1e6,
                norm_eps: 1e-6,
                // qwen35moe: two DeltaNet and two attention layers (key heads tiled
                // over twice as many value heads), half of each head rotated, and
                // one MTP block.
                rope_dim: 8,
                rope_sections: [2, 1, 1, 0],
                full_attn_interval: 2,
                ssm_k_heads: 2,
                ssm_v_heads: 4,
                ssm_head_dim: 16,
                ssm_conv: 4,
                ssm_inner: 0,
                mtp_layers: 1,
            },
            Preset::Small => Shape {
                layers: 16,
                embd: 1024,
                heads: 16,
                kv_heads: 4,
                head_dim: 64,
                vocab: 32000,
                context: 32768,
                ff: 2816,
                experts: 64,
                top_k: 4,
                expert_ff: 256,
                shared_ff: 1024,
                rope_base: 1e6,
                norm_eps: 1e-6,
                rope_dim: 16,
                rope_sections: [3, 3, 2, 0],
                full_attn_interval: 4,
                ssm_k_heads: 8,
                ssm_v_heads: 16,
                ssm_head_dim: 64,
                ssm_conv: 4,
                ssm_inner: 0,
                mtp_layers: 1,
            },
            // Qwen/Qwen3-30B-A3B `config.json` (Hugging Face): hidden_size 2048,
            // intermediate_size 6144, moe_intermediate_size 768,
            // num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4,
            // head_dim 128, num_experts 128, num_experts_per_tok 8,
            // vocab_size 151936, max_position_embeddings 40960, rope_theta 1e6,
            // rms_norm_eps 1e-6, norm_topk_prob true, tie_word_embeddings false.
            Preset::A3b => Shape {
                layers: 48,
                embd: 2048,
                heads: 32,
                kv_heads: 4,
                head_dim: 128,
                vocab: 151_936,
                context: 40960,
                ff: 6144,
                experts: 128,
                top_k: 8,
                expert_ff: 768,
                shared_ff: 3072,
                rope_base: 1e6,
                norm_eps: 1e-6,
                rope_dim: 32,
                rope_sections: [6, 5, 5, 0],
                full_attn_interval: 4,
                ssm_k_heads: 16,
                ssm_v_heads: 32,
                ssm_head_dim: 128,
                ssm_conv: 4,
                ssm_inner: 0,
                mtp_layers: 1,
            },
            // MiniCPM-V 4.7-35B-A3B: its language backbone is `qwen3_5_moe_text` with
            // 256 experts, 8 per token (OpenBMB's MiniCPM-V CookBook, v4.7 overview),
            // i.e. Qwen/Qwen3.5-35B-A3B's text model, whose published dimensions are
            // (slime scripts/models/qwen3.5-35B-A3B.sh, mirroring its config.json):
            // num_hidden_layers 40, hidden_size 2048, num_attention_heads 16,
            // num_key_value_heads 2, head_dim 256, partial_rotary_factor 0.25
            // (64 rotated dims), rope_theta 1e7, rms_norm_eps 1e-6, num_experts 256,
            // num_experts_per_tok 8, moe_intermediate_size 512,
            // shared_expert_intermediate_size 512, vocab_size 248320,
            // full_attention_interval 4 (layer_types: 3 linear_attention then 1
            // full_attention, repeated), linear_conv_kernel_dim 4,
            // linear_key_head_dim 128, linear_value_head_dim 128,
            // linear_num_key_heads 16, linear_num_value_heads 32,
            // mrope_section [11, 11, 10], mtp_num_hidden_layers 1,
            // max_position_embeddings 262144. MiniCPM-V 4.7's own config.json was
            // not reachable; these are the base model's.
            // openai/gpt-oss-20b `config.json` as published (from memory: Hugging
            // Face is not reachable from the machine this was written on):
            // hidden_size 2880, intermediate_size 2880, num_hidden_layers 24,
            // num_attention_heads 64, num_key_value_heads 8, head_dim 64,
            // num_local_experts 32, num_experts_per_tok 4, vocab_size 201088,
            // sliding_window 128, rope_theta 150000, rope_scaling yarn factor 32
            // over 4096, max_position_embeddings 131072, rms_norm_eps 1e-5.
            Preset::GptOss20b => Shape {
                layers: 24,
                embd: 2880,
                heads: 64,
                kv_heads: 8,
                head_dim: 64,
                vocab: 201_088,
                context: 131_072,
                ff: 2880,
                experts: 32,
                top_k: 4,
                expert_ff: 2880,
                shared_ff: 0,
                rope_base: 150_000.0,
                norm_eps: 1e-5,
                rope_dim: 64,
                rope_sections: [0; 4],
                full_attn_interval: 0,
                ssm_k_heads: 0,
                ssm_v_heads: 0,
                ssm_head_dim: 0,
                ssm_conv: 0,
                ssm_inner: 0,
                mtp_layers: 0,
            },
            Preset::Minicpmv47 => Shape {
                layers: 40,
                embd: 2048,
                heads: 16,
                kv_heads: 2,
                head_dim: 256,
                vocab: 248_320,
                context: 262_144,
                ff: 512,
                experts: 256,
                top_k: 8,
                expert_ff: 512,
                shared_ff: 512,
                rope_base: 1e7,
                norm_eps: 1e-6,
                rope_dim: 64,
                rope_sections: [11, 11, 10, 0],
                full_attn_interval: 4,
                ssm_k_heads: 16,
                ssm_v_heads: 32,
                ssm_head_dim: 128,
                ssm_conv: 4,
                ssm_inner: 0,
                mtp_layers: 1,
            },
        }
    }

    /// The preset's tensor types.
    pub fn types(self) -> Types {
        match self {
            Preset::Tiny => Types {
                expert: GgmlType::Q4_0,
                dense: GgmlType::Q8_0,
                embd: GgmlType::Q8_0,
                output: GgmlType::Q8_0,
                mix: Mix::Uniform,
            },
            // What llama.cpp's Q4_K_M gives these models: q4_k with the recipe's
            // q6_k / q5_k tensors, token_embd q4_k, output q6_k.
            Preset::GptOss20b => Types {
                expert: GgmlType::MXFP4,
                dense: GgmlType::Q8_0,
                embd: GgmlType::Q8_0,
                output: GgmlType::Q8_0,
                mix: Mix::Uniform,
            },
            Preset::Small | Preset::A3b | Preset::Minicpmv47 => Types {
                expert: GgmlType::Q4K,
                dense: GgmlType::Q4K,
                embd: GgmlType::Q4K,
                output: GgmlType::Q6K,
                mix: Mix::Q4KM,
            },
        }
    }
}

/// Changes to a preset; `None` keeps the preset's value.
#[derive(Clone, Debug, Default)]
#[allow(missing_docs)] // One per Shape / Types / Knobs field.
pub struct Overrides {
    pub layers: Option<u64>,
    pub embd: Option<u64>,
    pub heads: Option<u64>,
    pub kv_heads: Option<u64>,
    pub head_dim: Option<u64>,
    pub vocab: Option<u64>,
    pub context: Option<u64>,
    pub ff: Option<u64>,
    pub experts: Option<u64>,
    pub top_k: Option<u64>,
    pub expert_ff: Option<u64>,
    pub shared_ff: Option<u64>,
    pub rope_base: Option<f32>,
    pub expert_type: Option<GgmlType>,
    pub dense_type: Option<GgmlType>,
    pub embd_type: Option<GgmlType>,
    pub output_type: Option<GgmlType>,
    pub mix: Option<Mix>,
    pub router_corr: Option<f32>,
    pub popularity_skew: Option<f32>,
    pub residual_scale: Option<f32>,
    pub router_scale: Option<f32>,
    pub tie_embeddings: bool,
    pub mtp_layers: Option<u64>,
    pub q_lora_rank: Option<u64>,
    pub rope_freqs: bool,
    pub moe_every: Option<u64>,
    pub mrope: bool,
    pub image_tokens: &'static [&'static str],
}

/// Why a configuration or a write failed.
#[derive(Debug)]
pub enum SynthError {
    /// The configuration is inconsistent.
    Config(String),
    /// Writing the file failed.
    Gguf(GgufError),
    /// An I/O error outside the GGUF writer (temporary file, rename).
    Io(std::io::Error),
}

impl fmt::Display for SynthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SynthError::Config(m) => write!(f, "synth: {m}"),
            SynthError::Gguf(e) => write!(f, "synth: {e}"),
            SynthError::Io(e) => write!(f, "synth: {e}"),
        }
    }
}

impl std::error::Error for SynthError {}

impl From<GgufError> for SynthError {
    fn from(e: GgufError) -> Self {
        SynthError::Gguf(e)
    }
}

impl From<std::io::Error> for SynthError {
    fn from(e: std::io::Error) -> Self {
        SynthError::Io(e)
    }
}

fn config_err<T>(m: impl Into<String>) -> Result<T, SynthError> {
    Err(SynthError::Config(m.into()))
}

/// A complete, validated description of the model to write.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthConfig {
    /// The architecture.
    pub arch: Arch,
    /// The preset it came from.
    pub preset: Preset,
    /// Dimensions.
    pub shape: Shape,
    /// Tensor types.
    pub types: Types,
    /// Routing knobs.
    pub knobs: Knobs,
    /// Random seed.
    pub seed: u64,
    /// Omit `output.weight` (llama.cpp then uses `token_embd.weight`).
    pub tie_embeddings: bool,
    /// deepseek2's query compression rank (0: none).
    pub q_lora_rank: u64,
    /// Llama 3.1's `rope_freqs.weight` (llama, mixtral and llama4).
    pub rope_freqs: bool,
    /// llama4's `interleave_moe_layer_step`: experts on every this many
    /// layers (0 for the other architectures).
    pub moe_every: u64,
    /// glm4moe: M-RoPE sections in the language model, as GLM-4.5V's
    /// (`rope.dimension_sections`, a quarter of the rotated pairs by time
    /// and the rest split between height and width).
    pub mrope: bool,
    /// Image markers the vocabulary carries for a projector beyond the
    /// architecture's own (InternVL's `<img>` / `</img>`).
    pub image_tokens: &'static [&'static str],
}

impl SynthConfig {
    /// Qwen3-VL's `n_deepstack_layers` (a matching vision tower's deepstack
    /// mergers, whose features images add to the first layers' inputs): 3,
    /// or the layers if fewer; 0 for the other architectures.
    pub fn n_deepstack_layers(&self) -> u64 {
        if matches!(self.arch, Arch::Qwen3vlmoe | Arch::Qwen3vl) {
            3.min(self.shape.layers)
        } else {
            0
        }
    }

    /// The output projections' scale (`attn_output`, `ffn_down*`,
    /// `ssm_out`): the `residual_scale` knob, divided by Granite's residual
    /// multiplier in the Granite architectures, so that the blocks add to the
    /// residual stream as much as in the others (a trained Granite's weights
    /// are scaled for its multipliers; without this, the stream would be the
    /// token's embedding, 12 times over, and the routing would follow the
    /// token alone rather than the context).
    pub fn output_init(&self) -> f32 {
        self.knobs.residual_scale / self.granite_scales().map_or(1.0, |[_, r, _, _]| r)
    }

    /// Granite's four multipliers ([`GRANITE_SCALES`]) where the
    /// architecture has them.
    pub fn granite_scales(&self) -> Option<[f32; 4]> {
        matches!(
            self.arch,
            Arch::Granite | Arch::Granitemoe | Arch::Granitehybrid
        )
        .then_some(GRANITE_SCALES)
    }

    /// The preset with the overrides and the architecture's rules applied.
    pub fn new(arch: Arch, preset: Preset, o: &Overrides, seed: u64) -> Result<Self, SynthError> {
        let p = if arch.is_nemotron() {
            nemotron_shape(preset)
        } else {
            preset.shape()
        };
        let mut s = Shape {
            layers: o.layers.unwrap_or(p.layers),
            embd: o.embd.unwrap_or(p.embd),
            heads: o.heads.unwrap_or(p.heads),
            kv_heads: o.kv_heads.unwrap_or(p.kv_heads),
            head_dim: o.head_dim.unwrap_or(p.head_dim),
            vocab: o.vocab.unwrap_or(p.vocab),
            context: o.context.unwrap_or(p.context),
            ff: o.ff.unwrap_or(p.ff),
            experts: o.experts.unwrap_or(p.experts),
            top_k: o.top_k.unwrap_or(p.top_k),
            expert_ff: o.expert_ff.unwrap_or(p.expert_ff),
            shared_ff: o.shared_ff.unwrap_or(p.shared_ff),
            rope_base: o.rope_base.unwrap_or(p.rope_base),
            norm_eps: p.norm_eps,
            rope_dim: p.rope_dim,
            rope_sections: p.rope_sections,
            full_attn_interval: p.full_attn_interval,
            ssm_k_heads: p.ssm_k_heads,
            ssm_v_heads: p.ssm_v_heads,
            ssm_head_dim: p.ssm_head_dim,
            ssm_conv: p.ssm_conv,
            ssm_inner: p.ssm_inner,
            mtp_layers: o.mtp_layers.unwrap_or(p.mtp_layers),
        };
        let name = arch.cli_name();
        if (preset == Preset::GptOss20b) != (arch == Arch::GptOss) && preset != Preset::Tiny {
            return config_err(format!(
                "preset {} is for {}, not {name}",
                preset.name(),
                if arch == Arch::GptOss {
                    "other architectures"
                } else {
                    "gpt-oss"
                }
            ));
        }
        if !arch.has_mtp() {
            if o.mtp_layers.is_some() {
                return config_err(format!(
                    "--mtp-layers applies to qwen35moe and glm4moe, not {name}"
                ));
            }
            s.mtp_layers = 0;
        }
        if arch == Arch::Deepseek2 && o.mtp_layers.is_none() {
            // llama.cpp's converter long dropped DeepSeek-V3's MTP layer.
            s.mtp_layers = 0;
        }
        if !arch.is_hybrid() {
            s.full_attn_interval = 0;
            s.rope_dim = s.head_dim;
        }
        if arch == Arch::MinimaxM2 {
            // MiniMax-M2's rotary_dim: half of each head.
            s.rope_dim = s.head_dim / 2;
        }
        if arch == Arch::Dots1 {
            // llama.cpp's dots1 loader sizes keys and values as queries.
            if o.kv_heads.is_some_and(|k| k != s.heads) {
                return config_err("dots1: --kv-heads must equal --heads (no grouped queries)");
            }
            s.kv_heads = s.heads;
        }
        if o.rope_freqs && !matches!(arch, Arch::Llama | Arch::Mixtral | Arch::Llama4) {
            return config_err(format!(
                "--rope-freqs applies to llama, mixtral and llama4, not {name}"
            ));
        }
        let moe_every = match (arch, o.moe_every) {
            (Arch::Llama4, None) => 1,
            (Arch::Llama4, Some(0)) => return config_err("--moe-every must be positive"),
            (Arch::Llama4, Some(n)) if n > s.layers => {
                return config_err(format!(
                    "--moe-every {n} leaves no layer of {} with experts",
                    s.layers
                ))
            }
            (Arch::Llama4, Some(n)) => n,
            (_, Some(_)) => {
                return config_err(format!("--moe-every applies to llama4, not {name}"))
            }
            (_, None) => 0,
        };
        if arch == Arch::Llama4 {
            // llama.cpp's llama4 sizes the shared expert as a routed one.
            if o.shared_ff
                .is_some_and(|f| Some(f) != o.expert_ff.or(Some(s.expert_ff)))
            {
                return config_err("llama4: the shared expert is as wide as --expert-ff");
            }
            s.shared_ff = s.expert_ff;
        }
        if o.mrope && arch != Arch::Glm4moe {
            return config_err(format!(
                "M-RoPE sections (a glm4v projector's language model) apply to glm4moe, not {name}"
            ));
        }
        if o.q_lora_rank.is_some() && arch != Arch::Deepseek2 {
            return config_err(format!("--q-lora-rank applies to deepseek2, not {name}"));
        }
        if matches!(
            arch,
            Arch::Glm4moe | Arch::Deepseek2 | Arch::Ernie45moe | Arch::Bailingmoe2 | Arch::Dots1
        ) {
            // GLM-4.5's and Ling 2.0's partial_rotary_factor 0.5; the shared
            // expert is `expert_shared_count` routed experts wide.
            if matches!(arch, Arch::Glm4moe | Arch::Bailingmoe2) {
                s.rope_dim = s.head_dim / 2;
            }
            if o.shared_ff.is_none() {
                s.shared_ff = s.expert_ff;
            }
            if s.expert_ff == 0 || s.shared_ff == 0 || !s.shared_ff.is_multiple_of(s.expert_ff) {
                return config_err(format!(
                    "{name}: --shared-ff must be a positive multiple of --expert-ff"
                ));
            }
        }
        if arch.dense_by_default() && o.experts.is_none() {
            s.experts = 0;
        }
        if let Some(moe) = arch.moe_of().filter(|_| s.experts > 0) {
            return config_err(format!("{name} is dense: its MoE is {}", moe.cli_name()));
        }
        if arch == Arch::Granitehybrid {
            // One group of B and C; heads of the preset's size over 2 * embd.
            let (head, state) = granitehybrid_ssm(preset);
            if !(2 * s.embd).is_multiple_of(head) {
                return config_err(format!(
                    "granitehybrid: 2 * --embd must be a multiple of the Mamba2 head size {head}"
                ));
            }
            s.ssm_k_heads = 1;
            s.ssm_inner = 2 * s.embd;
            s.ssm_v_heads = s.mamba2_inner() / head;
            s.ssm_head_dim = state;
            s.ssm_conv = 4;
        }
        if arch == Arch::NemotronHMoe && s.shared_ff == 0 {
            return config_err(
                "nemotron_h_moe needs a shared expert (llama.cpp requires ffn_up_shexp): \
                 --shared-ff must be positive",
            );
        }
        if !arch.has_shared_expert() {
            if o.shared_ff.is_some() {
                return config_err(format!(
                    "--shared-ff applies to qwen2moe, qwen35moe and glm4moe, not {name}"
                ));
            }
            s.shared_ff = 0;
        }
        // granitehybrid is dense only when asked (`--experts 0`: Granite
        // 4.0-H-1B / 350M).
        let dense_ok =
            arch.dense_by_default() || (arch == Arch::Granitehybrid && o.experts == Some(0));
        if s.experts == 0 && !dense_ok {
            let dense = match arch {
                Arch::NemotronHMoe => " (the dense one is nemotron_h)",
                Arch::Lfm2moe => " (the dense one is lfm2)",
                _ => "",
            };
            return config_err(format!("{name} needs at least one expert{dense}"));
        }
        if s.experts > 0 && o.top_k.is_none() {
            s.top_k = s.top_k.min(s.experts);
        }
        if arch.square_attention() {
            if s.heads == 0 || !s.embd.is_multiple_of(s.heads) {
                return config_err(format!(
                    "{name}: embedding width {} is not a multiple of the {} heads",
                    s.embd, s.heads
                ));
            }
            let hd = s.embd / s.heads;
            if o.head_dim.is_some_and(|d| d != hd) {
                return config_err(format!("{name} needs head_dim = embd / heads = {hd}"));
            }
            s.head_dim = hd;
        }
        if arch == Arch::Olmoe {
            if o.kv_heads.is_some_and(|k| k != s.heads) {
                return config_err("olmoe needs as many KV heads as query heads");
            }
            s.kv_heads = s.heads;
        }
        if o.tie_embeddings && !arch.may_tie() {
            return config_err(format!(
                "{name} requires output.weight; it cannot tie embeddings"
            ));
        }

        let t = preset.types();
        let types = Types {
            expert: o.expert_type.unwrap_or(t.expert),
            dense: o.dense_type.unwrap_or(t.dense),
            embd: o.embd_type.unwrap_or(t.embd),
            output: o.output_type.unwrap_or(t.output),
            mix: o.mix.unwrap_or(t.mix),
        };
        let d = if arch.is_nemotron() {
            nemotron_knobs(preset)
        } else if arch.is_lfm2() {
            lfm2_knobs(preset)
        } else {
            preset.knobs()
        };
        let knobs = Knobs {
            router_corr: o.router_corr.unwrap_or(d.router_corr),
            popularity_skew: o.popularity_skew.unwrap_or(d.popularity_skew),
            residual_scale: o.residual_scale.unwrap_or(d.residual_scale),
            router_scale: o.router_scale.unwrap_or(d.router_scale),
        };
        let cfg = SynthConfig {
            arch,
            preset,
            shape: s,
            types,
            knobs,
            seed,
            tie_embeddings: o.tie_embeddings,
            q_lora_rank: o.q_lora_rank.unwrap_or(4 * s.head_dim),
            rope_freqs: o.rope_freqs,
            moe_every,
            mrope: o.mrope,
            image_tokens: o.image_tokens,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), SynthError> {
        let s = &self.shape;
        let positive = [
            ("layers", s.layers),
            ("embd", s.embd),
            ("heads", s.heads),
            ("kv-heads", s.kv_heads),
            ("head-dim", s.head_dim),
            ("context", s.context),
        ];
        if let Some((n, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return config_err(format!("--{n} must be positive"));
        }
        // Bounds that keep the generator's buffers (one expert matrix, a router,
        // a row) far below any machine's memory; real models sit well inside.
        let widths = [
            ("layers", s.layers, MAX_LAYERS),
            ("embd", s.embd, MAX_WIDTH),
            ("heads", s.heads, 1024),
            ("kv-heads", s.kv_heads, 1024),
            ("head-dim", s.head_dim, 4096),
            ("context", s.context, 1 << 24),
            ("ff", s.ff, MAX_WIDTH),
            ("expert-ff", s.expert_ff, MAX_WIDTH),
            ("shared-ff", s.shared_ff, MAX_WIDTH),
            ("ssm-head-dim", s.ssm_head_dim, 4096),
            ("ssm-k-heads", s.ssm_k_heads, 1024),
            ("ssm-v-heads", s.ssm_v_heads, 1024),
            ("ssm-conv", s.ssm_conv, 64),
        ];
        if let Some((n, v, max)) = widths.iter().find(|(_, v, max)| v > max) {
            return config_err(format!("--{n} {v} is more than the {max} synth writes"));
        }
        let matrices = [
            ("embd x heads x head-dim", s.embd * s.heads * s.head_dim),
            ("embd x ff", s.embd * s.ff),
            ("embd x expert-ff", s.embd * s.expert_ff),
            ("embd x shared-ff", s.embd * s.shared_ff),
            ("embd x experts", s.embd * s.experts.min(1 << 16)),
            (
                "embd x ssm_in rows",
                if self.arch.has_mamba2() {
                    s.embd * s.mamba2_in_proj()
                } else {
                    0
                },
            ),
        ];
        if let Some((n, v)) = matrices.iter().find(|(_, v)| *v > MAX_MATRIX) {
            return config_err(format!(
                "{n} = {v} elements in one matrix, more than the {MAX_MATRIX} synth writes"
            ));
        }
        if !s.heads.is_multiple_of(s.kv_heads) {
            return config_err(format!(
                "{} heads are not a multiple of {} KV heads",
                s.heads, s.kv_heads
            ));
        }
        if !s.head_dim.is_multiple_of(2) {
            return config_err("head_dim must be even (RoPE rotates pairs)");
        }
        if self.arch.is_hybrid() {
            if s.rope_dim == 0 || s.rope_dim > s.head_dim || !s.rope_dim.is_multiple_of(2) {
                return config_err("qwen35moe: rope_dim must be even and at most head_dim");
            }
            if s.ssm_k_heads == 0
                || s.ssm_head_dim == 0
                || s.ssm_conv < 2
                || s.ssm_v_heads == 0
                || !s.ssm_v_heads.is_multiple_of(s.ssm_k_heads)
            {
                return config_err(
                    "qwen35moe: DeltaNet value heads must be a multiple of its key heads",
                );
            }
            if s.full_attn_interval == 0 {
                return config_err("qwen35moe: full_attention_interval must be positive");
            }
        }
        if s.mtp_layers > 4 {
            return config_err("--mtp-layers: at most 4");
        }
        if self.arch == Arch::Granitehybrid && s.layers < 2 {
            return config_err("granitehybrid: needs 2 or more layers (Mamba2 and attention)");
        }
        // Its first attention layer is the third; experts follow the dense ones.
        let fewest = (LFM2_DENSE_LAYERS + 1).max(3);
        if self.arch == Arch::Lfm2moe && s.layers < fewest {
            return config_err(format!(
                "lfm2moe: needs {fewest} or more layers (convolutions, attention and experts \
                 after the {LFM2_DENSE_LAYERS} dense ones)"
            ));
        }
        if self.arch == Arch::Lfm2 && s.layers < 3 {
            return config_err("lfm2: needs 3 or more layers (convolutions and attention)");
        }
        if self.arch == Arch::NemotronHMoe && s.experts < 2 {
            // Its converter writes expert_group_count = 1, and llama.cpp
            // asserts fewer groups than experts.
            return config_err("nemotron_h_moe: needs 2 or more experts");
        }
        if self.arch.is_nemotron() && s.layers < 3 {
            return config_err(format!(
                "{}: needs 3 or more layers (Mamba2, attention and {})",
                self.arch.cli_name(),
                if self.is_moe() { "experts" } else { "FFN" }
            ));
        }
        if matches!(
            self.arch,
            Arch::Glm4moe | Arch::Deepseek2 | Arch::Ernie45moe
        ) && (s.layers < 2 || s.ff == 0)
        {
            return config_err(format!(
                "{}: needs 2 or more layers (the first is dense) and --ff",
                self.arch.cli_name()
            ));
        }
        if matches!(self.arch, Arch::Deepseek2 | Arch::Bailingmoe2) && s.experts < 4 {
            return config_err(format!(
                "{}: needs 4 or more experts (they route in groups)",
                self.arch.cli_name()
            ));
        }
        if matches!(
            self.arch,
            Arch::Glm4moe | Arch::Bailingmoe2 | Arch::MinimaxM2
        ) && !s.rope_dim.is_multiple_of(2)
        {
            return config_err(format!(
                "{}: head_dim must be a multiple of 4 (half of it is rotated)",
                self.arch.cli_name()
            ));
        }
        if s.vocab < vocab::MIN_VOCAB as u64 {
            return config_err(format!("--vocab must be at least {}", vocab::MIN_VOCAB));
        }
        if s.vocab > u64::from(i32::MAX as u32) {
            return config_err("--vocab is too large");
        }
        if s.experts > 0 {
            if s.top_k == 0 || s.top_k > s.experts {
                return config_err(format!(
                    "--top-k must be in 1..={} (the expert count)",
                    s.experts
                ));
            }
            if s.expert_ff == 0 {
                return config_err("--expert-ff must be positive");
            }
            if s.experts > u64::from(u16::MAX) {
                return config_err("at most 65535 experts");
            }
        } else if s.ff == 0 {
            return config_err("--ff must be positive for a dense model");
        }
        for (n, ty) in [
            ("expert", self.types.expert),
            ("dense", self.types.dense),
            ("embd", self.types.embd),
            ("output", self.types.output),
        ] {
            if !can_quantize(ty) || ty.is_activation_only() {
                return config_err(format!("--{n}-type {ty}: LES cannot write that type"));
            }
        }
        let k = &self.knobs;
        if !(0.0..=1.0).contains(&k.router_corr) {
            return config_err("--router-corr must be in [0, 1]");
        }
        if !(k.popularity_skew >= 0.0 && k.popularity_skew.is_finite()) {
            return config_err("--popularity-skew must be >= 0");
        }
        if !(k.residual_scale > 0.0 && k.residual_scale.is_finite()) {
            return config_err("--residual-scale must be > 0");
        }
        if !(k.router_scale > 0.0 && k.router_scale.is_finite()) {
            return config_err("--router-scale must be > 0");
        }
        if !(s.rope_base > 0.0 && s.rope_base.is_finite()) {
            return config_err("--rope-base must be > 0");
        }
        Ok(())
    }

    /// Whether the layers have routed experts.
    pub fn is_moe(&self) -> bool {
        self.shape.experts > 0
    }

    /// `general.name`.
    pub fn model_name(&self) -> String {
        format!(
            "LES synthetic {} {}",
            self.arch.cli_name(),
            self.preset.name()
        )
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// `1 + 0.02 N(0,1)`: RMSNorm weights.
    Norm,
    /// `N(0, std^2)`.
    Normal(f32),
    /// Token embeddings: unit-variance rows sharing the popularity direction.
    Embedding,
    /// A layer's router: correlated with the previous layer's, plus popularity.
    Router,
    /// Uniform in `[lo, hi)`.
    Uniform(f32, f32),
    /// Mamba2's time-step bias: the inverse softplus of a time step drawn
    /// log-uniform in `[lo, hi)`, so that `softplus(bias)` lies there.
    DtBias(f32, f32),
    /// Llama 3.1's RoPE frequency factors ([`llama3_rope_factors`]).
    RopeFactors,
}

/// The original context of the synthetic `--rope-freqs` factors: Llama 3.1's
/// are 8192 positions, and a shorter one makes the factors matter within a
/// test's few dozen positions (the head's pairs then get factors of 1, 8 and
/// the ramp between).
pub const LLAMA3_ORIGINAL_CONTEXT: f32 = 256.0;

/// Llama 3.1's RoPE frequency factors for heads of `dim` rotated dimensions
/// and RoPE base `base`, as llama.cpp's converter computes them (scaling
/// factor 8, low- and high-frequency factors 1 and 4) over
/// [`LLAMA3_ORIGINAL_CONTEXT`] positions: 1 for the pairs whose wavelength
/// is under a quarter of it, 8 past the whole of it, a ramp between.
pub fn llama3_rope_factors(dim: usize, base: f32) -> Vec<f32> {
    // In f32 throughout, as the converter's torch tensors are.
    let (factor, low, high, old) = (8.0f32, 1.0f32, 4.0f32, LLAMA3_ORIGINAL_CONTEXT);
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    (0..dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f32 / dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// One tensor of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPlan {
    /// GGUF name.
    pub name: String,
    /// `ne`, innermost first.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// How values are drawn.
    pub init: Init,
    /// The layer, for per-layer tensors.
    pub layer: Option<u64>,
}

impl TensorPlan {
    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        let n: u64 = self.dims.iter().product();
        n / self.ty.block_elems() as u64 * self.ty.block_bytes() as u64
    }

    /// Whether this is a routed-expert tensor (`ffn_*_exps`).
    pub fn is_expert(&self) -> bool {
        self.dims.len() == 3 && self.name.contains("_exps.")
    }
}

/// `ty`, or the type llama.cpp's quantizer falls back to when `ty`'s block does
/// not divide a row of `ne0` elements (`llama_tensor_get_type`'s incompatible-
/// tensor rule for the K-quants this writes; `f16` where that does not divide
/// either, and for every other type).
fn fit(ty: GgmlType, ne0: u64) -> GgmlType {
    let divides = |t: GgmlType| ne0.is_multiple_of(t.block_elems() as u64);
    if divides(ty) {
        return ty;
    }
    match ty {
        GgmlType::Q4K => Some(GgmlType::Q5_0),
        GgmlType::Q5K => Some(GgmlType::Q5_1),
        GgmlType::Q6K => Some(GgmlType::Q8_0),
        _ => None,
    }
    .filter(|&t| divides(t))
    .unwrap_or(GgmlType::F16)
}

/// `general.file_type` (llama.cpp's `llama_ftype`) for a model whose bulk is `ty`.
pub fn file_type(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q2K => 10,
        GgmlType::Q3K => 12,
        GgmlType::Q4K => 15,
        GgmlType::Q5K => 17,
        GgmlType::Q6K => 18,
        GgmlType::IQ4NL => 25,
        GgmlType::IQ4XS => 30,
        GgmlType::IQ2XXS => 19,
        GgmlType::IQ2XS => 20,
        GgmlType::IQ3XXS => 23,
        GgmlType::IQ1S => 24,
        GgmlType::IQ3S => 26,
        GgmlType::IQ2S => 28,
        GgmlType::IQ1M => 31,
        GgmlType::BF16 => 32,
        GgmlType::MXFP4 => 38, // LLAMA_FTYPE_MOSTLY_MXFP4_MOE
        GgmlType::Q8_1 | GgmlType::Q8K | GgmlType::I8 => 7,
    }
}

/// gpt-oss's sliding window in a synthetic model: 128 positions as the real
/// models, 16 in `tiny` so that its short tests reach past it.
pub fn gpt_oss_window(preset: Preset) -> u64 {
    match preset {
        Preset::Tiny => 16,
        _ => 128,
    }
}

/// gpt-oss's YaRN: a factor of 32 over an original context of 4096 positions.
const GPT_OSS_YARN: (f32, u64) = (32.0, 4096);

/// Most layers `les synth` writes.
const MAX_LAYERS: u64 = 4096;
/// Widest row or column `les synth` writes (embedding, feed-forward widths).
const MAX_WIDTH: u64 = 1 << 17;
/// Most elements of one matrix (an expert's, a router's) `les synth` writes: the
/// generator holds one in memory as `f32`.
const MAX_MATRIX: u64 = 1 << 27;

/// Every tensor of the model, in file order.
pub fn tensor_plan(cfg: &SynthConfig) -> Vec<TensorPlan> {
    let s = &cfg.shape;
    let t = &cfg.types;
    let r = cfg.output_init();
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let mut out = Vec::new();
    let mut add = |name: String, dims: Vec<u64>, ty: GgmlType, init: Init, layer: Option<u64>| {
        let ty = match init {
            Init::Norm | Init::Router => GgmlType::F32,
            _ if dims.len() == 1
                || name.ends_with("ssm_conv1d.weight")
                || name.ends_with("shortconv.conv.weight") =>
            {
                GgmlType::F32
            }
            _ => fit(ty, dims[0]),
        };
        out.push(TensorPlan {
            name,
            dims,
            ty,
            init,
            layer,
        });
    };
    let (e, q, kv) = (s.embd, s.q_dim(), s.kv_dim());
    add(
        "token_embd.weight".into(),
        vec![e, s.vocab],
        t.embd,
        Init::Embedding,
        None,
    );
    for l in 0..s.layers + s.mtp_layers {
        let n = |part: &str| format!("blk.{l}.{part}");
        let lay = Some(l);
        if cfg.arch.is_hybrid() {
            qwen35moe_layer(cfg, l, &mut add);
            continue;
        }
        if cfg.arch == Arch::GptOss {
            gpt_oss_layer(cfg, l, &mut add);
            continue;
        }
        if cfg.arch == Arch::Glm4moe {
            glm4moe_layer(cfg, l, &mut add);
            continue;
        }
        if cfg.arch == Arch::Deepseek2 {
            deepseek2_layer(cfg, l, &mut add);
            continue;
        }
        if cfg.arch == Arch::Bailingmoe2 {
            bailingmoe2_layer(cfg, l, &mut add);
            continue;
        }
        if cfg.arch == Arch::Granitehybrid {
            granitehybrid_layer(cfg, l, &mut add);
            continue;
        }
        if cfg.arch.is_nemotron() {
            nemotron_layer(cfg, l, &mut add);
            continue;
        }
        if cfg.arch.is_lfm2() {
            lfm2_layer(cfg, l, &mut add);
            continue;
        }
        norm_tensor(&mut add, l, "attn_norm.weight", e);
        for (part, rows) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
            add(
                n(&format!("{part}.weight")),
                vec![e, rows],
                t.dense,
                Init::Normal(inv(e)),
                lay,
            );
            if matches!(cfg.arch, Arch::Qwen2moe | Arch::Qwen2) {
                add(
                    n(&format!("{part}.bias")),
                    vec![rows],
                    GgmlType::F32,
                    Init::Normal(0.1),
                    lay,
                );
            }
        }
        add(
            n("attn_output.weight"),
            vec![q, e],
            t.dense,
            Init::Normal(r * inv(q)),
            lay,
        );
        match cfg.arch {
            Arch::Qwen3moe
            | Arch::Qwen3
            | Arch::Dots1
            | Arch::HunyuanMoe
            | Arch::Qwen3vlmoe
            | Arch::Qwen3vl => {
                norm_tensor(&mut add, l, "attn_q_norm.weight", s.head_dim);
                norm_tensor(&mut add, l, "attn_k_norm.weight", s.head_dim);
            }
            Arch::Olmoe | Arch::MinimaxM2 => {
                norm_tensor(&mut add, l, "attn_q_norm.weight", q);
                norm_tensor(&mut add, l, "attn_k_norm.weight", kv);
            }
            _ => {}
        }
        norm_tensor(&mut add, l, "ffn_norm.weight", e);
        if matches!(cfg.arch, Arch::Ernie45moe | Arch::Dots1) {
            lead_dense_or_biased_moe(cfg, l, &mut add);
        } else if cfg.arch == Arch::Llama4 {
            // Experts on every `moe_every`-th layer, each with an ungated
            // shared expert; dense SwiGLU on the others.
            if (l + 1).is_multiple_of(cfg.moe_every) {
                routed_experts(cfg, l, &mut add);
                swiglu_ffn(cfg, l, &mut add, s.shared_ff, "_shexp");
            } else {
                swiglu_ffn(cfg, l, &mut add, s.ff, "");
            }
        } else if cfg.is_moe() {
            routed_experts(cfg, l, &mut add);
            if cfg.arch == Arch::MinimaxM2 {
                selection_bias(cfg, l, &mut add);
            }
            match cfg.arch {
                // Hunyuan-A13B's and Granite's shared experts have no gate.
                Arch::HunyuanMoe | Arch::Granitemoe => {
                    swiglu_ffn(cfg, l, &mut add, s.shared_ff, "_shexp")
                }
                _ if s.shared_ff > 0 => shared_expert(cfg, l, &mut add),
                _ => {}
            }
        } else {
            swiglu_ffn(cfg, l, &mut add, s.ff, "");
        }
    }
    if cfg.rope_freqs {
        let pairs = vec![s.head_dim / 2];
        add(
            "rope_freqs.weight".into(),
            pairs,
            GgmlType::F32,
            Init::RopeFactors,
            None,
        );
    }
    // LFM2's final norm goes by `token_embd_norm` (llama.cpp's converter).
    let output_norm = if cfg.arch.is_lfm2() {
        "token_embd_norm.weight"
    } else {
        "output_norm.weight"
    };
    add(output_norm.into(), vec![e], GgmlType::F32, Init::Norm, None);
    if !cfg.tie_embeddings {
        add(
            "output.weight".into(),
            vec![e, s.vocab],
            t.output,
            Init::Normal(inv(e)),
            None,
        );
    }
    if t.mix == Mix::Q4KM {
        apply_q4_k_m(cfg, &mut out);
    }
    out
}

/// The router and the stacked routed experts of MoE block `l`.
fn routed_experts(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let (s, t, r) = (&cfg.shape, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let (e, x, f, lay) = (s.embd, s.experts, s.expert_ff, Some(l));
    add(
        n("ffn_gate_inp.weight"),
        vec![e, x],
        GgmlType::F32,
        Init::Router,
        lay,
    );
    add(
        n("ffn_gate_exps.weight"),
        vec![e, f, x],
        t.expert,
        Init::Normal(inv(e)),
        lay,
    );
    add(
        n("ffn_up_exps.weight"),
        vec![e, f, x],
        t.expert,
        Init::Normal(inv(e)),
        lay,
    );
    add(
        n("ffn_down_exps.weight"),
        vec![f, e, x],
        t.expert,
        Init::Normal(r * inv(f)),
        lay,
    );
}

/// The sigmoid-gated shared expert of MoE block `l`.
fn shared_expert(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let e = cfg.shape.embd;
    let gate = format!("blk.{l}.ffn_gate_inp_shexp.weight");
    let std = Init::Normal(1.0 / (e as f32).sqrt());
    add(gate, vec![e], GgmlType::F32, std, Some(l));
    swiglu_ffn(cfg, l, add, cfg.shape.shared_ff, "_shexp");
}

/// Block `l`'s attention with Q/K/V biases (gpt-oss, glm4moe): its norm, the
/// projections and their biases, the output projection.
fn biased_attention(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    norm_tensor(&mut *add, l, "attn_norm.weight", cfg.shape.embd);
    attention_projections(cfg, l, add, true);
}

/// The tensors of gpt-oss block `l`, in llama.cpp's names and shapes: biases
/// everywhere but the norms, one sink logit per head, the FFN norm named
/// `post_attention_norm`.
fn gpt_oss_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let s = &cfg.shape;
    let n = |part: &str| format!("blk.{l}.{part}");
    let (lay, e) = (Some(l), s.embd);
    let (x, f) = (s.experts, s.expert_ff);
    biased_attention(cfg, l, add);
    let bo = n("attn_output.bias");
    add(bo, vec![e], GgmlType::F32, Init::Normal(0.02), lay);
    let sinks = n("attn_sinks.weight");
    add(sinks, vec![s.heads], GgmlType::F32, Init::Normal(1.0), lay);
    norm_tensor(&mut *add, l, "post_attention_norm.weight", e);
    routed_experts(cfg, l, add);
    let bias = |name: &str, dims: Vec<u64>, std: f32, add: &mut dyn FnMut(_, _, _, _, _)| {
        add(n(name), dims, GgmlType::F32, Init::Normal(std), lay)
    };
    bias("ffn_gate_inp.bias", vec![x], 0.5, add);
    bias("ffn_gate_exps.bias", vec![f, x], 0.1, add);
    bias("ffn_up_exps.bias", vec![f, x], 0.1, add);
    bias("ffn_down_exps.bias", vec![e, x], 0.02, add);
}

/// GLM-4.5's leading dense layers: one, as GLM-4.5-Air's.
pub const GLM4MOE_DENSE_LAYERS: u64 = 1;
/// GLM-4.5's `routed_scaling_factor` (GLM-4.5-Air's is 1).
pub const GLM4MOE_WEIGHTS_SCALE: f32 = 2.5;

/// The tensors of glm4moe block `l` (a main layer, or a nextn block past them),
/// in llama.cpp's names and shapes: Q/K/V biases, the FFN norm named
/// `post_attention_norm`, the first [`GLM4MOE_DENSE_LAYERS`] dense, the others
/// routed experts with a selection bias and an ungated shared expert.
fn glm4moe_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    biased_attention(cfg, l, add);
    norm_tensor(&mut *add, l, "post_attention_norm.weight", cfg.shape.embd);
    lead_dense_or_biased_moe(cfg, l, add);
    nextn_head(cfg, l, add);
}

/// The tensors of bailingmoe2 block `l`, in llama.cpp's names and shapes:
/// the query, key and value projections fused in `attn_qkv`, per-head Q/K
/// norms, then the FFN of [`lead_dense_or_biased_moe`].
fn bailingmoe2_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let (s, t, r) = (&cfg.shape, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let (e, q, kv, lay) = (s.embd, s.q_dim(), s.kv_dim(), Some(l));
    norm_tensor(&mut *add, l, "attn_norm.weight", e);
    let qkv = vec![e, q + 2 * kv];
    add(
        n("attn_qkv.weight"),
        qkv,
        t.dense,
        Init::Normal(inv(e)),
        lay,
    );
    let wo = n("attn_output.weight");
    add(wo, vec![q, e], t.dense, Init::Normal(r * inv(q)), lay);
    for norm in ["attn_q_norm.weight", "attn_k_norm.weight"] {
        norm_tensor(&mut *add, l, norm, s.head_dim);
    }
    norm_tensor(&mut *add, l, "ffn_norm.weight", e);
    lead_dense_or_biased_moe(cfg, l, add);
}

/// The tensors of granitehybrid block `l`, in llama.cpp's names and shapes:
/// attention without biases ([`granitehybrid_is_attention`]) or a Mamba2
/// mixer ([`mamba2_mixer`]), then routed experts and an ungated shared
/// expert.
fn granitehybrid_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let (s, e) = (&cfg.shape, cfg.shape.embd);
    norm_tensor(&mut *add, l, "attn_norm.weight", e);
    if granitehybrid_is_attention(l, s.layers) {
        attention_projections(cfg, l, add, false);
    } else {
        mamba2_mixer(cfg, l, add);
    }
    norm_tensor(&mut *add, l, "ffn_norm.weight", e);
    if !cfg.is_moe() {
        swiglu_ffn(cfg, l, add, s.ff, "");
        return;
    }
    routed_experts(cfg, l, add);
    if s.shared_ff > 0 {
        swiglu_ffn(cfg, l, add, s.shared_ff, "_shexp");
    }
}

/// The tensors of LFM2 block `l`, in llama.cpp's names and shapes:
/// `attn_norm`, then attention with per-head Q/K norms where
/// [`lfm2_is_attention`], else the gated short convolution
/// (`shortconv.in_proj` for `b`, `c` and `x`, the convolution, `out_proj`),
/// `ffn_norm`, and a dense SwiGLU FFN (every `lfm2` layer, `lfm2moe`'s first
/// [`LFM2_DENSE_LAYERS`]) or the router, its selection bias and the experts.
fn lfm2_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let (s, t, r) = (&cfg.shape, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let (e, lay) = (s.embd, Some(l));
    norm_tensor(&mut *add, l, "attn_norm.weight", e);
    if lfm2_is_attention(l) {
        attention_projections(cfg, l, add, false);
        norm_tensor(&mut *add, l, "attn_q_norm.weight", s.head_dim);
        norm_tensor(&mut *add, l, "attn_k_norm.weight", s.head_dim);
    } else {
        let k = LFM2_CONV_WIDTH;
        let w_in = vec![e, 3 * e];
        add(
            n("shortconv.in_proj.weight"),
            w_in,
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
        let conv = Init::Normal(inv(k));
        add(
            n("shortconv.conv.weight"),
            vec![k, e],
            GgmlType::F32,
            conv,
            lay,
        );
        let wo = Init::Normal(r * inv(e));
        add(n("shortconv.out_proj.weight"), vec![e, e], t.dense, wo, lay);
    }
    norm_tensor(&mut *add, l, "ffn_norm.weight", e);
    if cfg.is_moe() && l >= LFM2_DENSE_LAYERS {
        routed_experts(cfg, l, add);
        selection_bias(cfg, l, add);
    } else {
        swiglu_ffn(cfg, l, add, s.ff, "");
    }
}

/// Block `l`'s attention projections, without norms: Q, K and V (each with
/// its bias where `biased`), then the output projection (unbiased:
/// granitehybrid's, Nemotron-H's).
fn attention_projections(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
    biased: bool,
) {
    let (s, t, r) = (&cfg.shape, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let (e, lay) = (s.embd, Some(l));
    let (q, kv) = (s.q_dim(), s.kv_dim());
    for (part, rows) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
        let w = n(&format!("{part}.weight"));
        add(w, vec![e, rows], t.dense, Init::Normal(inv(e)), lay);
        if biased {
            let b = n(&format!("{part}.bias"));
            add(b, vec![rows], GgmlType::F32, Init::Normal(0.1), lay);
        }
    }
    let wo = n("attn_output.weight");
    add(wo, vec![q, e], t.dense, Init::Normal(r * inv(q)), lay);
}

/// Block `l`'s Mamba2 mixer (granitehybrid, Nemotron-H), in llama.cpp's
/// names and shapes, with Mamba2's initialisation, so the recurrence stays
/// tame over long prompts: `A = -U[1, 16)`, `dt_bias` the inverse softplus
/// of a log-uniform time step in `[0.001, 0.1)`, `D` and the gated norm
/// about 1.
fn mamba2_mixer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let (s, t, r) = (&cfg.shape, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let (e, lay) = (s.embd, Some(l));
    let (inner, conv, heads) = (s.mamba2_inner(), s.mamba2_conv_dim(), s.ssm_v_heads);
    let w_in = vec![e, s.mamba2_in_proj()];
    add(n("ssm_in.weight"), w_in, t.dense, Init::Normal(inv(e)), lay);
    let (k, g) = (s.ssm_conv, s.ssm_k_heads);
    // `ssm_a` is -exp(A_log) as the converter stores it, Mamba2's A U[1, 16).
    for (part, dims, init) in [
        ("ssm_conv1d.weight", vec![k, conv], Init::Normal(inv(k))),
        ("ssm_conv1d.bias", vec![conv], Init::Normal(0.1)),
        ("ssm_dt.bias", vec![heads], Init::DtBias(0.001, 0.1)),
        ("ssm_a", vec![1, heads], Init::Uniform(-16.0, -1.0)),
        ("ssm_d", vec![1, heads], Init::Norm),
        ("ssm_norm.weight", vec![inner / g, g], Init::Norm),
    ] {
        add(n(part), dims, GgmlType::F32, init, lay);
    }
    let wo = Init::Normal(r * inv(inner));
    add(n("ssm_out.weight"), vec![inner, e], t.dense, wo, lay);
}

/// The tensors of Nemotron-H block `l`, in llama.cpp's names and shapes: its
/// one norm, `attn_norm`, then by [`nemotron_layer_kind`] a Mamba2 mixer
/// ([`mamba2_mixer`], over [`nemotron_ssm`]'s heads and groups), attention
/// without biases, or the router, its selection bias
/// (`exp_probs_b`), the ungated experts (`ffn_up_exps`, `ffn_down_exps`) and
/// the ungated shared expert; `nemotron_h`'s FFN is `ffn_up`, `ffn_down`.
fn nemotron_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let (s, t, r) = (&cfg.shape, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let (e, lay) = (s.embd, Some(l));
    norm_tensor(&mut *add, l, "attn_norm.weight", e);
    match nemotron_layer_kind(l, s.layers) {
        NemotronLayer::Attention => attention_projections(cfg, l, add, false),
        NemotronLayer::Mamba2 => mamba2_mixer(cfg, l, add),
        NemotronLayer::Ffn if cfg.is_moe() => {
            let (x, f) = (s.experts, s.expert_ff);
            add(
                n("ffn_gate_inp.weight"),
                vec![e, x],
                GgmlType::F32,
                Init::Router,
                lay,
            );
            selection_bias(cfg, l, add);
            let up = Init::Normal(inv(e));
            add(n("ffn_up_exps.weight"), vec![e, f, x], t.expert, up, lay);
            let down = Init::Normal(r * inv(f));
            add(
                n("ffn_down_exps.weight"),
                vec![f, e, x],
                t.expert,
                down,
                lay,
            );
            relu2_ffn(cfg, l, add, s.shared_ff, "_shexp");
        }
        NemotronLayer::Ffn => relu2_ffn(cfg, l, add, s.ff, ""),
    }
}

/// Block `l`'s ungated FFN `ffn_{up,down}{suffix}` of `f` hidden units
/// (Nemotron-H's `relu(up x)^2`: a dense FFN, or a shared expert with
/// `_shexp`).
fn relu2_ffn(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
    f: u64,
    suffix: &str,
) {
    let (e, t, r) = (cfg.shape.embd, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.ffn_{part}{suffix}.weight");
    let up = Init::Normal(inv(e));
    add(n("up"), vec![e, f], t.dense, up, Some(l));
    let down = Init::Normal(r * inv(f));
    add(n("down"), vec![f, e], t.dense, down, Some(l));
}

/// Block `l`'s norm weight `name`: `len` values in F32.
fn norm_tensor(
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
    l: u64,
    name: &str,
    len: u64,
) {
    add(
        format!("blk.{l}.{name}"),
        vec![len],
        GgmlType::F32,
        Init::Norm,
        Some(l),
    );
}

/// The FFN of glm4moe, deepseek2, ernie4_5-moe, bailingmoe2 and dots1 block `l`: the first
/// [`GLM4MOE_DENSE_LAYERS`] dense, the others routed experts with a selection
/// bias (`exp_probs_b`) and an ungated shared expert.
fn lead_dense_or_biased_moe(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let s = &cfg.shape;
    let (f, suffix) = if l < GLM4MOE_DENSE_LAYERS {
        (s.ff, "")
    } else {
        routed_experts(cfg, l, add);
        selection_bias(cfg, l, add);
        (s.shared_ff, "_shexp")
    };
    swiglu_ffn(cfg, l, add, f, suffix);
}

/// Block `l`'s experts' selection bias (`exp_probs_b`). Sigmoid scores lie
/// in (0, 1): a bias of 0.05 reorders the close ones, as DeepSeek-V3's
/// load-balancing biases do. Softmax probabilities (ernie4_5-moe) average
/// 1 / experts: a fifth of that.
fn selection_bias(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let s = &cfg.shape;
    let std = Init::Normal(match cfg.arch {
        Arch::Ernie45moe => 0.2 / s.experts as f32,
        _ => 0.05,
    });
    let bias = format!("blk.{l}.exp_probs_b.bias");
    add(bias, vec![s.experts], GgmlType::F32, std, Some(l));
}

/// Block `l`'s SwiGLU FFN `ffn_{gate,up,down}{suffix}` of `f` hidden units
/// (a dense FFN, or a shared expert with `_shexp`).
fn swiglu_ffn(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
    f: u64,
    suffix: &str,
) {
    let (e, t, r) = (cfg.shape.embd, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.ffn_{part}{suffix}.weight");
    for part in ["gate", "up"] {
        add(n(part), vec![e, f], t.dense, Init::Normal(inv(e)), Some(l));
    }
    add(
        n("down"),
        vec![f, e],
        t.dense,
        Init::Normal(r * inv(f)),
        Some(l),
    );
}

/// The nextn head of block `l` when it is past the main stack:
/// `[enorm(embedding), hnorm(hidden)] -> eh_proj -> the block`, then its own
/// head norm (the head is the model's).
fn nextn_head(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let s = &cfg.shape;
    if l < s.layers {
        return;
    }
    let (e, lay) = (s.embd, Some(l));
    let n = |part: &str| format!("blk.{l}.{part}");
    let eh = n("nextn.eh_proj.weight");
    let std = 1.0 / ((2 * e) as f32).sqrt();
    add(eh, vec![2 * e, e], cfg.types.dense, Init::Normal(std), lay);
    for name in [
        "nextn.enorm.weight",
        "nextn.hnorm.weight",
        "nextn.shared_head_norm.weight",
    ] {
        norm_tensor(&mut *add, l, name, e);
    }
}

/// deepseek2's latent attention in a synthetic model, from the head size `d`:
/// `nope = 2d`, `rope = d`, `v = 2d`, `kv_lora = 4d` (DeepSeek-V3 has
/// 128 / 64 / 128 / 512).
pub fn deepseek2_mla(head_dim: u64) -> [u64; 4] {
    [2 * head_dim, head_dim, 2 * head_dim, 4 * head_dim]
}

/// deepseek2's expert groups in a synthetic model: groups of two experts,
/// half of them used (DeepSeek-V3: 8 groups of 32, 4 used).
pub fn deepseek2_groups(experts: u64) -> (u64, u64) {
    (experts / 2, experts / 4)
}

/// deepseek2's YaRN: factor 4 over a quarter of the context, DeepSeek-V3's
/// `mscale_all_dim` (the key holds a tenth of it, as llama.cpp's converter writes).
const DEEPSEEK2_YARN: (f32, f32) = (4.0, 0.1 * 0.707);

/// The tensors of deepseek2 block `l`, in llama.cpp's names and shapes.
fn deepseek2_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let (s, t, r) = (&cfg.shape, &cfg.types, cfg.output_init());
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let lay = Some(l);
    let (e, h) = (s.embd, s.heads);
    let [nope, rope, v, kv_lora] = deepseek2_mla(s.head_dim);
    let ql = cfg.q_lora_rank;
    norm_tensor(&mut *add, l, "attn_norm.weight", e);
    if ql > 0 {
        add(
            n("attn_q_a.weight"),
            vec![e, ql],
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
        norm_tensor(&mut *add, l, "attn_q_a_norm.weight", ql);
        let qb = n("attn_q_b.weight");
        add(
            qb,
            vec![ql, h * (nope + rope)],
            t.dense,
            Init::Normal(inv(ql)),
            lay,
        );
    } else {
        let q = n("attn_q.weight");
        add(
            q,
            vec![e, h * (nope + rope)],
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
    }
    let kva = n("attn_kv_a_mqa.weight");
    add(
        kva,
        vec![e, kv_lora + rope],
        t.dense,
        Init::Normal(inv(e)),
        lay,
    );
    norm_tensor(&mut *add, l, "attn_kv_a_norm.weight", kv_lora);
    let kb = n("attn_k_b.weight");
    add(
        kb,
        vec![nope, kv_lora, h],
        t.dense,
        Init::Normal(inv(nope)),
        lay,
    );
    let vb = n("attn_v_b.weight");
    add(
        vb,
        vec![kv_lora, v, h],
        t.dense,
        Init::Normal(inv(kv_lora)),
        lay,
    );
    let wo = n("attn_output.weight");
    add(
        wo,
        vec![h * v, e],
        t.dense,
        Init::Normal(r * inv(h * v)),
        lay,
    );
    norm_tensor(&mut *add, l, "ffn_norm.weight", e);
    lead_dense_or_biased_moe(cfg, l, add);
    nextn_head(cfg, l, add);
}

/// The tensors of qwen35moe block `l` (a main layer, or an MTP block past them),
/// in llama.cpp's names and shapes.
fn qwen35moe_layer(
    cfg: &SynthConfig,
    l: u64,
    add: &mut impl FnMut(String, Vec<u64>, GgmlType, Init, Option<u64>),
) {
    let s = &cfg.shape;
    let t = &cfg.types;
    let r = cfg.output_init();
    let inv = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let n = |part: &str| format!("blk.{l}.{part}");
    let lay = Some(l);
    let (e, q, kv) = (s.embd, s.q_dim(), s.kv_dim());
    norm_tensor(&mut *add, l, "attn_norm.weight", e);
    norm_tensor(&mut *add, l, "post_attention_norm.weight", e);
    if s.is_linear(l) {
        let (kd, vd, cd, nv) = (
            s.ssm_key_dim(),
            s.ssm_value_dim(),
            s.ssm_conv_dim(),
            s.ssm_v_heads,
        );
        let _ = kd;
        add(
            n("attn_qkv.weight"),
            vec![e, cd],
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
        add(
            n("attn_gate.weight"),
            vec![e, vd],
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
        add(
            n("ssm_conv1d.weight"),
            vec![s.ssm_conv, cd],
            GgmlType::F32,
            Init::Normal(inv(s.ssm_conv)),
            lay,
        );
        add(n("ssm_dt.bias"), vec![nv], GgmlType::F32, Init::Norm, lay);
        // -exp(A_log) with A_log = ln(U[0.05, 1)): decays between e^-1 and e^-0.05
        // per unit of softplus, so the state keeps a few tokens.
        add(
            n("ssm_a"),
            vec![nv],
            GgmlType::F32,
            Init::Uniform(-1.0, -0.05),
            lay,
        );
        if cfg.arch == Arch::Qwen3next {
            // Per key head: its value heads' beta rows, then their alpha rows.
            add(
                n("ssm_ba.weight"),
                vec![e, 2 * nv],
                t.dense,
                Init::Normal(inv(e)),
                lay,
            );
        } else {
            add(
                n("ssm_beta.weight"),
                vec![e, nv],
                t.dense,
                Init::Normal(inv(e)),
                lay,
            );
            add(
                n("ssm_alpha.weight"),
                vec![e, nv],
                t.dense,
                Init::Normal(inv(e)),
                lay,
            );
        }
        norm_tensor(&mut *add, l, "ssm_norm.weight", s.ssm_head_dim);
        add(
            n("ssm_out.weight"),
            vec![vd, e],
            t.dense,
            Init::Normal(r * inv(vd)),
            lay,
        );
    } else {
        // attn_q yields a query and an output gate per head.
        add(
            n("attn_q.weight"),
            vec![e, 2 * q],
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
        add(
            n("attn_k.weight"),
            vec![e, kv],
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
        add(
            n("attn_v.weight"),
            vec![e, kv],
            t.dense,
            Init::Normal(inv(e)),
            lay,
        );
        add(
            n("attn_output.weight"),
            vec![q, e],
            t.dense,
            Init::Normal(r * inv(q)),
            lay,
        );
        norm_tensor(&mut *add, l, "attn_q_norm.weight", s.head_dim);
        norm_tensor(&mut *add, l, "attn_k_norm.weight", s.head_dim);
    }
    routed_experts(cfg, l, add);
    shared_expert(cfg, l, add);
    nextn_head(cfg, l, add);
}

/// Every metadata pair, in file order (`general.*`, hyperparameters, provenance,
/// tokenizer).
pub fn metadata(cfg: &SynthConfig, vocab: &Vocab) -> Vec<(String, MetaValue)> {
    let s = &cfg.shape;
    let a = cfg.arch.gguf_name();
    let bulk = if cfg.is_moe() {
        cfg.types.expert
    } else {
        cfg.types.dense
    };
    let mut m: Vec<(String, MetaValue)> = Vec::new();
    let mut kv = |k: String, v: MetaValue| m.push((k, v));
    let u32v = |v: u64| MetaValue::U32(v as u32);
    kv("general.architecture".into(), a.into());
    kv("general.type".into(), "model".into());
    kv("general.name".into(), cfg.model_name().into());
    kv("general.alignment".into(), MetaValue::U32(32));
    kv("general.file_type".into(), MetaValue::U32(file_type(bulk)));
    kv("general.quantization_version".into(), MetaValue::U32(2));
    kv(format!("{a}.block_count"), u32v(s.layers + s.mtp_layers));
    kv(format!("{a}.context_length"), u32v(s.context));
    kv(format!("{a}.embedding_length"), u32v(s.embd));
    let ff = match cfg.arch {
        // OLMoE, MiniMax-M2, Hunyuan, Granite MoE and Mixtral size their
        // experts with feed_forward_length.
        // SmallThinker's converter writes its experts' size as both.
        Arch::Olmoe
        | Arch::MinimaxM2
        | Arch::HunyuanMoe
        | Arch::Granitemoe
        | Arch::Smallthinker => s.expert_ff,
        Arch::Llama | Arch::Mixtral | Arch::Granitehybrid if cfg.is_moe() => s.expert_ff,
        _ => s.ff,
    };
    let i32_array = |values: Vec<u64>| {
        let items = values.into_iter().map(|v| MetaValue::I32(v as i32));
        MetaValue::Array(
            MetaArray::new(ValueType::I32, items.collect()).expect("i32 items in an i32 array"),
        )
    };
    // Nemotron-H's per layer, in the converter's i32 arrays: the FFN's width
    // on its FFN layers, the KV heads on its attention layers, 0 elsewhere
    // (how llama.cpp tells the layers apart).
    let nemotron_layers = |kind: NemotronLayer, v: u64| {
        let per = (0..s.layers).map(|l| {
            if nemotron_layer_kind(l, s.layers) == kind {
                v
            } else {
                0
            }
        });
        i32_array(per.collect())
    };
    if cfg.arch.is_nemotron() {
        let width = if cfg.is_moe() { s.expert_ff } else { s.ff };
        kv(
            format!("{a}.feed_forward_length"),
            nemotron_layers(NemotronLayer::Ffn, width),
        );
    } else {
        kv(format!("{a}.feed_forward_length"), u32v(ff));
    }
    kv(format!("{a}.attention.head_count"), u32v(s.heads));
    if cfg.arch == Arch::Deepseek2 {
        // MLA as llama.cpp's converter writes it: one latent head, keys of
        // kv_lora + rope and values of kv_lora (the `_mla` keys hold a head's).
        let [_, rope, _, kv_lora] = deepseek2_mla(s.head_dim);
        kv(format!("{a}.attention.head_count_kv"), u32v(1));
        kv(format!("{a}.attention.key_length"), u32v(kv_lora + rope));
        kv(format!("{a}.attention.value_length"), u32v(kv_lora));
    } else {
        if cfg.arch == Arch::Granitehybrid {
            // Per layer, 0 on the Mamba2 ones (how llama.cpp tells them), in
            // the converter's i32 array.
            let heads = (0..s.layers).map(|l| {
                if granitehybrid_is_attention(l, s.layers) {
                    s.kv_heads
                } else {
                    0
                }
            });
            kv(
                format!("{a}.attention.head_count_kv"),
                i32_array(heads.collect()),
            );
        } else if cfg.arch.is_nemotron() {
            kv(
                format!("{a}.attention.head_count_kv"),
                nemotron_layers(NemotronLayer::Attention, s.kv_heads),
            );
        } else if cfg.arch.is_lfm2() {
            // Per layer, 0 on the convolutions (how llama.cpp tells them).
            let heads = (0..s.layers).map(|l| if lfm2_is_attention(l) { s.kv_heads } else { 0 });
            kv(
                format!("{a}.attention.head_count_kv"),
                i32_array(heads.collect()),
            );
        } else {
            kv(format!("{a}.attention.head_count_kv"), u32v(s.kv_heads));
        }
        if !cfg.arch.square_attention() {
            kv(format!("{a}.attention.key_length"), u32v(s.head_dim));
            kv(format!("{a}.attention.value_length"), u32v(s.head_dim));
        }
    }
    if matches!(
        cfg.arch,
        Arch::Llama
            | Arch::Mixtral
            | Arch::Llama4
            | Arch::Granite
            | Arch::Granitemoe
            | Arch::Granitehybrid
    ) {
        kv(format!("{a}.rope.dimension_count"), u32v(s.head_dim));
    }
    if let Some([embedding, residual, attention, logit]) = cfg.granite_scales() {
        kv(format!("{a}.embedding_scale"), MetaValue::F32(embedding));
        kv(format!("{a}.residual_scale"), MetaValue::F32(residual));
        kv(format!("{a}.attention.scale"), MetaValue::F32(attention));
        kv(format!("{a}.logit_scale"), MetaValue::F32(logit));
    }
    if matches!(cfg.arch, Arch::Qwen3vlmoe | Arch::Qwen3vl) {
        // As llama.cpp's converter writes Qwen3-VL's language model: IMRoPE
        // sections of a head's pairs (Qwen3-VL's 24 / 20 / 20 of 64), and
        // the vision tower's deepstack layers (whose features only images
        // add; text runs as without them).
        let pairs = s.head_dim / 2;
        let t = pairs * 3 / 8;
        let h = (pairs - t) / 2;
        kv(
            format!("{a}.rope.dimension_sections"),
            sections_value([t, h, pairs - t - h, 0]),
        );
        kv(
            format!("{a}.n_deepstack_layers"),
            u32v(cfg.n_deepstack_layers()),
        );
    }
    if cfg.arch.has_mamba2() {
        // As llama.cpp's converter writes Granite 4.0-H, and Nemotron-H
        // through the same writer: no RoPE (granitehybrid's
        // `rope.scaling.finetuned` switches RoPE), Mamba2's sizes.
        kv(
            format!("{a}.rope.scaling.finetuned"),
            MetaValue::Bool(false),
        );
        kv(format!("{a}.ssm.conv_kernel"), u32v(s.ssm_conv));
        kv(format!("{a}.ssm.state_size"), u32v(s.ssm_head_dim));
        kv(format!("{a}.ssm.group_count"), u32v(s.ssm_k_heads));
        kv(format!("{a}.ssm.inner_size"), u32v(s.mamba2_inner()));
        kv(format!("{a}.ssm.time_step_rank"), u32v(s.ssm_v_heads));
    }
    if cfg.arch.is_lfm2() {
        // As llama.cpp's converter writes LFM2 (`conv_L_cache`, and
        // LFM2-MoE's `num_dense_layers`).
        kv(format!("{a}.shortconv.l_cache"), u32v(LFM2_CONV_WIDTH));
        if cfg.arch == Arch::Lfm2moe {
            kv(
                format!("{a}.leading_dense_block_count"),
                u32v(LFM2_DENSE_LAYERS),
            );
        }
    }
    if cfg.arch == Arch::Llama4 {
        // As llama.cpp's converter writes a Llama 4 (no sliding-window key:
        // its loader then chunks, as for Scout and Maverick).
        kv(
            format!("{a}.interleave_moe_layer_step"),
            u32v(cfg.moe_every),
        );
    }
    if cfg.arch.is_hybrid() {
        kv(format!("{a}.rope.dimension_count"), u32v(s.rope_dim));
        if cfg.arch == Arch::Qwen35moe {
            kv(
                format!("{a}.rope.dimension_sections"),
                sections_value(s.rope_sections.map(u64::from)),
            );
        }
        kv(format!("{a}.ssm.conv_kernel"), u32v(s.ssm_conv));
        kv(format!("{a}.ssm.state_size"), u32v(s.ssm_head_dim));
        kv(format!("{a}.ssm.group_count"), u32v(s.ssm_k_heads));
        kv(format!("{a}.ssm.time_step_rank"), u32v(s.ssm_v_heads));
        kv(format!("{a}.ssm.inner_size"), u32v(s.ssm_value_dim()));
        let flags = (0..s.layers + s.mtp_layers).map(|l| MetaValue::Bool(s.is_linear(l)));
        kv(
            format!("{a}.attention.recurrent_layers"),
            MetaValue::Array(
                MetaArray::new(ValueType::Bool, flags.collect())
                    .expect("bool items in a bool array"),
            ),
        );
        kv(
            format!("{a}.full_attention_interval"),
            u32v(s.full_attn_interval),
        );
        if s.mtp_layers > 0 {
            kv(format!("{a}.nextn_predict_layers"), u32v(s.mtp_layers));
        }
    }
    if cfg.arch == Arch::Glm4moe {
        kv(format!("{a}.rope.dimension_count"), u32v(s.rope_dim));
        if cfg.mrope {
            // As llama.cpp's converter writes GLM-4.5V's language model: its
            // `mrope_section` (8 / 12 / 12 of 32 pairs), padded to four.
            let pairs = s.rope_dim / 2;
            let t = pairs / 4;
            let h = (pairs - t) / 2;
            kv(
                format!("{a}.rope.dimension_sections"),
                sections_value([t, h, pairs - t - h, 0]),
            );
        }
        dense_lead_shared_keys(&mut kv, cfg, false);
        if s.mtp_layers > 0 {
            kv(format!("{a}.nextn_predict_layers"), u32v(s.mtp_layers));
        }
    }
    if cfg.arch == Arch::Deepseek2 {
        let [nope, rope, v, kv_lora] = deepseek2_mla(s.head_dim);
        kv(format!("{a}.attention.q_lora_rank"), u32v(cfg.q_lora_rank));
        kv(format!("{a}.attention.kv_lora_rank"), u32v(kv_lora));
        kv(format!("{a}.attention.key_length_mla"), u32v(nope + rope));
        kv(format!("{a}.attention.value_length_mla"), u32v(v));
        kv(format!("{a}.rope.dimension_count"), u32v(rope));
        dense_lead_shared_keys(&mut kv, cfg, true);
        let (factor, log_mul) = DEEPSEEK2_YARN;
        kv(format!("{a}.rope.scaling.type"), "yarn".into());
        kv(format!("{a}.rope.scaling.factor"), MetaValue::F32(factor));
        kv(
            format!("{a}.rope.scaling.original_context_length"),
            u32v(s.context / 4),
        );
        kv(
            format!("{a}.rope.scaling.yarn_log_multiplier"),
            MetaValue::F32(log_mul),
        );
        if s.mtp_layers > 0 {
            kv(format!("{a}.nextn_predict_layers"), u32v(s.mtp_layers));
        }
    }
    if cfg.arch == Arch::MinimaxM2 {
        kv(format!("{a}.rope.dimension_count"), u32v(s.rope_dim));
    }
    if cfg.arch == Arch::Dots1 {
        dense_lead_shared_keys(&mut kv, cfg, false);
    }
    if cfg.arch == Arch::Bailingmoe2 {
        kv(format!("{a}.rope.dimension_count"), u32v(s.rope_dim));
        dense_lead_shared_keys(&mut kv, cfg, true);
    }
    if cfg.arch == Arch::Ernie45moe {
        // As llama.cpp's converter writes them (no gating or norm keys: its
        // graph fixes a softmax and renormalised weights).
        kv(
            format!("{a}.leading_dense_block_count"),
            u32v(GLM4MOE_DENSE_LAYERS),
        );
        kv(format!("{a}.interleave_moe_layer_step"), u32v(1));
        kv(
            format!("{a}.expert_shared_count"),
            u32v(s.shared_ff / s.expert_ff.max(1)),
        );
    }
    if cfg.arch == Arch::Smallthinker {
        // As SmallThinker-21B-A3B's converter writes it (llama.cpp then fixes
        // 4096 whatever the value).
        kv(format!("{a}.attention.sliding_window"), u32v(4096));
    }
    if cfg.arch == Arch::GptOss {
        let window = gpt_oss_window(cfg.preset);
        kv(format!("{a}.attention.sliding_window"), u32v(window));
        let (factor, orig) = GPT_OSS_YARN;
        kv(format!("{a}.rope.scaling.type"), "yarn".into());
        kv(format!("{a}.rope.scaling.factor"), MetaValue::F32(factor));
        kv(
            format!("{a}.rope.scaling.original_context_length"),
            u32v(orig),
        );
    }
    kv(format!("{a}.rope.freq_base"), MetaValue::F32(s.rope_base));
    // Nemotron-H's converter writes the config's `layer_norm_epsilon`, which
    // llama.cpp's loader requires and takes for the RMS norms.
    let eps = if cfg.arch.is_nemotron() {
        "layer_norm_epsilon"
    } else {
        "layer_norm_rms_epsilon"
    };
    kv(format!("{a}.attention.{eps}"), MetaValue::F32(s.norm_eps));
    kv(format!("{a}.vocab_size"), u32v(s.vocab));
    if cfg.is_moe() {
        kv(format!("{a}.expert_count"), u32v(s.experts));
        kv(format!("{a}.expert_used_count"), u32v(s.top_k));
        kv(format!("{a}.expert_feed_forward_length"), u32v(s.expert_ff));
        if s.shared_ff > 0
            && !matches!(
                cfg.arch,
                Arch::Glm4moe | Arch::Deepseek2 | Arch::Dots1 | Arch::Llama4
            )
        {
            // bailingmoe2: one expert's width, times `expert_shared_count`.
            kv(
                format!("{a}.expert_shared_feed_forward_length"),
                u32v(s.shared_ff),
            );
        }
        if cfg.arch == Arch::NemotronHMoe {
            // As the converter writes Nemotron 3 Nano's (its gating, a
            // sigmoid, is fixed by llama.cpp's graph: no key).
            kv(format!("{a}.expert_shared_count"), u32v(1));
            kv(format!("{a}.expert_weights_norm"), MetaValue::Bool(true));
            kv(
                format!("{a}.expert_weights_scale"),
                MetaValue::F32(NEMOTRON_WEIGHTS_SCALE),
            );
            kv(format!("{a}.expert_group_count"), u32v(1));
        }
        // llama.cpp's graph fixes ERNIE's, Llama 4's and Nemotron-H's
        // routing; their converters write no such keys.
        if !matches!(
            cfg.arch,
            Arch::Ernie45moe | Arch::Llama4 | Arch::NemotronHMoe
        ) {
            kv(
                format!("{a}.expert_weights_norm"),
                MetaValue::Bool(cfg.arch.normalizes()),
            );
            // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid.
            let gating = if matches!(
                cfg.arch,
                Arch::Glm4moe
                    | Arch::Deepseek2
                    | Arch::Bailingmoe2
                    | Arch::MinimaxM2
                    | Arch::Dots1
                    | Arch::Lfm2moe
                    | Arch::Smallthinker
            ) {
                2
            } else {
                1
            };
            kv(format!("{a}.expert_gating_func"), MetaValue::U32(gating));
        }
    }
    let k = &cfg.knobs;
    kv("les.synth.preset".into(), cfg.preset.name().into());
    kv("les.synth.arch".into(), cfg.arch.cli_name().into());
    kv("les.synth.seed".into(), MetaValue::U64(cfg.seed));
    kv(
        "les.synth.router_corr".into(),
        MetaValue::F32(k.router_corr),
    );
    kv(
        "les.synth.popularity_skew".into(),
        MetaValue::F32(k.popularity_skew),
    );
    kv(
        "les.synth.residual_scale".into(),
        MetaValue::F32(k.residual_scale),
    );
    kv(
        "les.synth.router_scale".into(),
        MetaValue::F32(k.router_scale),
    );
    for (key, v) in vocab.metadata() {
        // Ling 2.0's pre-tokenizer name (llama.cpp splits as for qwen2).
        let v = match (key, cfg.arch) {
            ("tokenizer.ggml.pre", Arch::Bailingmoe2) => "bailingmoe2".into(),
            // MiniMax-M2's (llama.cpp: the o200k pattern, as gpt-4o's).
            ("tokenizer.ggml.pre", Arch::MinimaxM2) => "minimax-m2".into(),
            ("tokenizer.ggml.pre", Arch::HunyuanMoe) => "hunyuan".into(),
            // Llama 4's (llama.cpp: the o200k pattern, as gpt-4o's).
            ("tokenizer.ggml.pre", Arch::Llama4) => "llama4".into(),
            // LFM2's (llama.cpp: Llama 3's pattern).
            ("tokenizer.ggml.pre", Arch::Lfm2moe | Arch::Lfm2) => "lfm2".into(),
            // Granite 3's (llama.cpp: each digit alone, then GPT-2's).
            ("tokenizer.ggml.pre", Arch::Granite | Arch::Granitemoe | Arch::Granitehybrid) => {
                "refact".into()
            }
            _ => v,
        };
        m.push((key.to_string(), v));
    }
    m
}

/// The routing keys glm4moe, deepseek2, bailingmoe2 and dots1 share: one dense
/// leading layer, the shared expert `expert_shared_count` routed experts
/// wide, weights scaled by [`GLM4MOE_WEIGHTS_SCALE`], and with `groups`
/// DeepSeek-V3's expert groups ([`deepseek2_groups`]).
fn dense_lead_shared_keys(kv: &mut impl FnMut(String, MetaValue), cfg: &SynthConfig, groups: bool) {
    let (s, a) = (&cfg.shape, cfg.arch.gguf_name());
    let u32v = |v: u64| MetaValue::U32(v as u32);
    kv(
        format!("{a}.leading_dense_block_count"),
        u32v(GLM4MOE_DENSE_LAYERS),
    );
    kv(
        format!("{a}.expert_shared_count"),
        u32v(s.shared_ff / s.expert_ff.max(1)),
    );
    kv(
        format!("{a}.expert_weights_scale"),
        MetaValue::F32(GLM4MOE_WEIGHTS_SCALE),
    );
    if groups {
        let (count, used) = deepseek2_groups(s.experts);
        kv(format!("{a}.expert_group_count"), u32v(count));
        kv(format!("{a}.expert_group_used_count"), u32v(used));
    }
}

/// `rope.dimension_sections` as llama.cpp's converter writes it: four `i32`.
fn sections_value(sections: [u64; 4]) -> MetaValue {
    let items = sections.map(|x| MetaValue::I32(x as i32)).to_vec();
    MetaValue::Array(MetaArray::new(ValueType::I32, items).expect("i32 items in an i32 array"))
}

/// The vocabulary of `cfg`'s model: Qwen3-VL's, Kimi-VL's (`deepseek2`),
/// Llama 4's and GLM-4.5V's (`glm4moe`) carry their image markers too, and
/// every one the markers of [`SynthConfig::image_tokens`].
pub fn vocab_of(cfg: &SynthConfig) -> Result<Vocab, SynthError> {
    let own: &[&str] = match cfg.arch {
        Arch::Qwen3vlmoe | Arch::Qwen3vl => &vocab::QWEN_VL_TOKENS,
        Arch::Deepseek2 => &vocab::KIMI_VL_TOKENS,
        Arch::Llama4 => &vocab::LLAMA4_TOKENS,
        Arch::Glm4moe => &vocab::GLM_V_TOKENS,
        _ => &[],
    };
    let mut more = own.to_vec();
    more.extend(cfg.image_tokens.iter().filter(|t| !own.contains(t)));
    Vocab::build_with(cfg.shape.vocab as usize, &more).map_err(SynthError::Config)
}

/// The header writer with every pair and tensor info added, and the plan.
pub fn gguf_writer(
    cfg: &SynthConfig,
    vocab: &Vocab,
) -> Result<(GgufWriter, Vec<TensorPlan>), SynthError> {
    let mut w = GgufWriter::new();
    for (k, v) in metadata(cfg, vocab) {
        w.add_kv(k, v)?;
    }
    let plan = tensor_plan(cfg);
    for t in &plan {
        // The generator quantizes every tensor to its planned type.
        if !can_quantize(t.ty) {
            return config_err(format!("{}: LES cannot write {} tensors", t.name, t.ty));
        }
        w.add_tensor(t.name.clone(), &t.dims, t.ty)?;
    }
    Ok((w, plan))
}

/// Writes the plan as a table plus totals (what `--dry-run` prints); returns the
/// file size in bytes.
pub fn describe(
    cfg: &SynthConfig,
    out: &mut dyn std::io::Write,
) -> Result<u64, Box<dyn std::error::Error>> {
    let vocab = vocab_of(cfg)?;
    let (w, plan) = gguf_writer(cfg, &vocab)?;
    let s = &cfg.shape;
    let t = &cfg.types;
    let k = &cfg.knobs;
    writeln!(
        out,
        "{} (general.architecture {}), preset {}, seed {}",
        cfg.model_name(),
        cfg.arch.gguf_name(),
        cfg.preset.name(),
        cfg.seed
    )?;
    writeln!(
        out,
        "  layers {}, embd {}, heads {}/{} x {}, vocab {} ({} merges), context {}",
        s.layers,
        s.embd,
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.vocab,
        vocab.merges.len(),
        s.context
    )?;
    if cfg.arch == Arch::Granitehybrid {
        let attention: Vec<String> = (0..s.layers)
            .filter(|&l| granitehybrid_is_attention(l, s.layers))
            .map(|l| l.to_string())
            .collect();
        writeln!(
            out,
            "  mamba2: inner {}, heads {} x {}, state {}, groups {}, conv {}; attention layers {}",
            s.mamba2_inner(),
            s.ssm_v_heads,
            s.mamba2_inner() / s.ssm_v_heads,
            s.ssm_head_dim,
            s.ssm_k_heads,
            s.ssm_conv,
            attention.join(",")
        )?;
    }
    if cfg.arch.is_nemotron() {
        let pattern: String = (0..s.layers)
            .map(|l| match nemotron_layer_kind(l, s.layers) {
                NemotronLayer::Mamba2 => 'M',
                NemotronLayer::Attention => '*',
                NemotronLayer::Ffn if cfg.is_moe() => 'E',
                NemotronLayer::Ffn => '-',
            })
            .collect();
        writeln!(
            out,
            "  mamba2: inner {}, heads {} x {}, state {}, groups {}, conv {}; layers {pattern}",
            s.mamba2_inner(),
            s.ssm_v_heads,
            s.mamba2_inner() / s.ssm_v_heads,
            s.ssm_head_dim,
            s.ssm_k_heads,
            s.ssm_conv,
        )?;
    }
    if cfg.is_moe() {
        write!(
            out,
            "  experts {} x {}, top-{}",
            s.experts, s.expert_ff, s.top_k
        )?;
        if s.shared_ff > 0 {
            write!(out, ", shared expert {}", s.shared_ff)?;
        }
        writeln!(out)?;
    } else {
        writeln!(out, "  dense ffn {}", s.ff)?;
    }
    writeln!(
        out,
        "  types: experts {}, dense {}, token_embd {}, output {}, mix {}",
        t.expert,
        t.dense,
        t.embd,
        if cfg.tie_embeddings {
            "tied"
        } else {
            t.output.name()
        },
        t.mix.name()
    )?;
    writeln!(
        out,
        "  knobs: router-corr {}, popularity-skew {}, residual-scale {}, router-scale {}",
        k.router_corr, k.popularity_skew, k.residual_scale, k.router_scale
    )?;
    writeln!(out, "tensors:")?;
    let (mut experts, mut resident) = (0u64, 0u64);
    for p in &plan {
        let dims: Vec<String> = p.dims.iter().map(u64::to_string).collect();
        writeln!(
            out,
            "  {:<32} {:<22} {:<6} {:>14}",
            p.name,
            dims.join(" x "),
            p.ty.name(),
            p.bytes()
        )?;
        if p.is_expert() {
            experts += p.bytes();
        } else {
            resident += p.bytes();
        }
    }
    let total = w.file_len();
    writeln!(out, "expert_bytes {experts}")?;
    writeln!(out, "resident_bytes {resident}")?;
    writeln!(
        out,
        "total_bytes {total} ({:.2} GB, {:.2} GiB)",
        total as f64 / 1e9,
        total as f64 / (1u64 << 30) as f64
    )?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(arch: Arch, preset: Preset, o: Overrides) -> Vec<TensorPlan> {
        tensor_plan(&SynthConfig::new(arch, preset, &o, 0).unwrap())
    }

    fn ty(plan: &[TensorPlan], name: &str) -> GgmlType {
        plan.iter().find(|p| p.name == name).unwrap().ty
    }

    #[test]
    fn more_bits_layers_match_llama_cpp() {
        // 48 layers: the first and last six, and every third from layer 8.
        let more: Vec<u64> = (0..48).filter(|&i| use_more_bits(i, 48)).collect();
        let mut want: Vec<u64> = (0..6).chain((8..42).step_by(3)).collect();
        want.extend(42..48);
        assert_eq!(more, want);
        assert_eq!((0..2).filter(|&i| use_more_bits(i, 2)).count(), 1);
    }

    #[test]
    fn a3b_is_qwen3_30b_a3b_q4_k_m() {
        let p = plan(Arch::Qwen3moe, Preset::A3b, Overrides::default());
        for l in 0..48 {
            let want = if use_more_bits(l, 48) {
                GgmlType::Q6K
            } else {
                GgmlType::Q4K
            };
            assert_eq!(ty(&p, &format!("blk.{l}.attn_v.weight")), want, "layer {l}");
            assert_eq!(ty(&p, &format!("blk.{l}.ffn_down_exps.weight")), want);
            for part in [
                "attn_q",
                "attn_k",
                "attn_output",
                "ffn_gate_exps",
                "ffn_up_exps",
            ] {
                assert_eq!(ty(&p, &format!("blk.{l}.{part}.weight")), GgmlType::Q4K);
            }
        }
        assert_eq!(ty(&p, "token_embd.weight"), GgmlType::Q4K);
        assert_eq!(ty(&p, "output.weight"), GgmlType::Q6K);
        assert_eq!(ty(&p, "blk.0.ffn_gate_inp.weight"), GgmlType::F32);
        // 17.28 GiB of tensors, the size of llama.cpp's Q4_K_M of Qwen3-30B-A3B.
        let bytes: u64 = p.iter().map(TensorPlan::bytes).sum();
        assert_eq!(bytes, 18_550_716_416);
    }

    /// Every architecture and preset plans only types LES can write (a planned
    /// `q5_k` once had no quantizer, and `les synth` panicked on it).
    #[test]
    fn every_plan_is_quantizable() {
        for arch in [
            Arch::Qwen3moe,
            Arch::Olmoe,
            Arch::Qwen2moe,
            Arch::Llama,
            Arch::Mixtral,
            Arch::Qwen35moe,
            Arch::Qwen3next,
            Arch::Glm4moe,
            Arch::Deepseek2,
            Arch::Ernie45moe,
            Arch::Bailingmoe2,
            Arch::MinimaxM2,
            Arch::Dots1,
            Arch::HunyuanMoe,
            Arch::Llama4,
            Arch::Qwen3vlmoe,
            Arch::Qwen3vl,
            Arch::Granite,
            Arch::Granitemoe,
            Arch::Granitehybrid,
            Arch::NemotronHMoe,
            Arch::NemotronH,
            Arch::Smallthinker,
            Arch::Qwen3,
            Arch::Qwen2,
        ] {
            for preset in [Preset::Tiny, Preset::Small, Preset::A3b, Preset::Minicpmv47] {
                for t in plan(arch, preset, Overrides::default()) {
                    assert!(
                        can_quantize(t.ty),
                        "{arch:?} {preset:?}: {} is {}",
                        t.name,
                        t.ty
                    );
                }
            }
        }
        for preset in [Preset::Tiny, Preset::GptOss20b] {
            for t in plan(Arch::GptOss, preset, Overrides::default()) {
                assert!(
                    can_quantize(t.ty),
                    "gpt-oss {preset:?}: {} is {}",
                    t.name,
                    t.ty
                );
            }
        }
    }

    #[test]
    fn granitehybrid_attention_layers_follow_granite_4_0_h() {
        let attention = |layers: u64| -> Vec<u64> {
            (0..layers)
                .filter(|&l| granitehybrid_is_attention(l, layers))
                .collect()
        };
        assert_eq!(attention(40), [5, 15, 25, 35]);
        assert_eq!(attention(4), [1, 3]);
        assert_eq!(attention(16), [4, 12]);
        assert_eq!(attention(48), [5, 15, 25, 35, 45]);
        for layers in 2..=64 {
            let a = attention(layers);
            assert!(!a.is_empty() && !a.contains(&0), "{layers}: {a:?}");
            assert!(layers - a.len() as u64 >= a.len() as u64, "{layers}: {a:?}");
        }
    }

    /// The metadata and tensors llama.cpp's `granitehybrid` loader reads: the
    /// per-layer KV head count is 0 exactly on the Mamba2 layers, which have
    /// the Mamba2 tensors and no attention.
    #[test]
    fn granitehybrid_plan_and_metadata() {
        for preset in [Preset::Tiny, Preset::Small, Preset::A3b] {
            let cfg =
                SynthConfig::new(Arch::Granitehybrid, preset, &Overrides::default(), 0).unwrap();
            let s = &cfg.shape;
            let (head, state) = granitehybrid_ssm(preset);
            let (e, inner, heads) = (s.embd, 2 * s.embd, 2 * s.embd / head);
            assert_eq!(
                (s.ssm_v_heads, s.ssm_head_dim, s.ssm_k_heads),
                (heads, state, 1)
            );
            let vocab = Vocab::build(s.vocab as usize).unwrap();
            let meta = metadata(&cfg, &vocab);
            let get = |k: &str| {
                meta.iter()
                    .find(|(key, _)| key == &format!("granitehybrid.{k}"))
                    .unwrap_or_else(|| panic!("{k}"))
                    .1
                    .clone()
            };
            let MetaValue::Array(kv) = get("attention.head_count_kv") else {
                panic!("head_count_kv is not an array");
            };
            let kv: Vec<MetaValue> = kv.items().collect();
            assert_eq!(kv.len() as u64, s.layers);
            let attention = (0..s.layers).filter(|&l| granitehybrid_is_attention(l, s.layers));
            assert!(attention.count() >= 2);
            let p = tensor_plan(&cfg);
            let find = |name: &str| p.iter().find(|t| t.name == name);
            for l in 0..s.layers {
                let attn = granitehybrid_is_attention(l, s.layers);
                let want = if attn { s.kv_heads as i32 } else { 0 };
                assert_eq!(kv[l as usize], MetaValue::I32(want), "{preset:?} layer {l}");
                let t = |part: &str| find(&format!("blk.{l}.{part}"));
                assert_eq!(t("attn_q.weight").is_some(), attn);
                assert_eq!(t("ssm_in.weight").is_some(), !attn);
                for part in ["attn_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight"] {
                    assert!(t(part).is_some(), "{part}");
                }
                for part in ["gate", "up", "down"] {
                    assert!(t(&format!("ffn_{part}_exps.weight")).is_some());
                    assert!(t(&format!("ffn_{part}_shexp.weight")).is_some());
                }
                if attn {
                    continue;
                }
                let f32 = GgmlType::F32;
                let conv = inner + 2 * state;
                for (part, dims, small) in [
                    (
                        "ssm_in.weight",
                        vec![e, 2 * inner + 2 * state + heads],
                        false,
                    ),
                    ("ssm_conv1d.weight", vec![4, conv], true),
                    ("ssm_conv1d.bias", vec![conv], true),
                    ("ssm_dt.bias", vec![heads], true),
                    ("ssm_a", vec![1, heads], true),
                    ("ssm_d", vec![1, heads], true),
                    ("ssm_norm.weight", vec![inner, 1], true),
                    ("ssm_out.weight", vec![inner, e], false),
                ] {
                    let t = t(part).unwrap();
                    assert_eq!(t.dims, dims, "{part}");
                    assert_eq!(t.ty == f32, small, "{preset:?} {part} is {}", t.ty);
                }
            }
            let u = |k: &str| match get(k) {
                MetaValue::U32(v) => u64::from(v),
                v => panic!("{k}: {v:?}"),
            };
            assert_eq!(u("ssm.inner_size"), inner);
            assert_eq!(u("ssm.time_step_rank"), heads);
            assert_eq!(u("ssm.state_size"), state);
            assert_eq!(u("ssm.group_count"), 1);
            assert_eq!(u("ssm.conv_kernel"), 4);
            assert_eq!(u("feed_forward_length"), s.expert_ff);
            assert_eq!(u("expert_shared_feed_forward_length"), s.shared_ff);
            assert_eq!(get("rope.scaling.finetuned"), MetaValue::Bool(false));
            assert_eq!(get("logit_scale"), MetaValue::F32(GRANITE_SCALES[3]));
        }
    }

    #[test]
    fn granitehybrid_q4_k_m_and_refusals() {
        // Small: attn_v counts among the two attention layers' (the second gets
        // q6_k), ssm_in / ssm_out take the class's q4_k.
        let p = plan(Arch::Granitehybrid, Preset::Small, Overrides::default());
        assert_eq!(ty(&p, "blk.4.attn_v.weight"), GgmlType::Q4K);
        assert_eq!(ty(&p, "blk.12.attn_v.weight"), GgmlType::Q6K);
        assert_eq!(ty(&p, "blk.1.ssm_in.weight"), GgmlType::Q4K);
        assert_eq!(ty(&p, "blk.1.ssm_out.weight"), GgmlType::Q4K);
        assert_eq!(ty(&p, "blk.0.ffn_down_exps.weight"), GgmlType::Q6K);
        let new = |o: Overrides| SynthConfig::new(Arch::Granitehybrid, Preset::Small, &o, 0);
        let e = new(Overrides {
            embd: Some(1000),
            ..Overrides::default()
        });
        assert!(e.unwrap_err().to_string().contains("Mamba2 head size 64"));
        let e = new(Overrides {
            layers: Some(1),
            ..Overrides::default()
        });
        assert!(e.unwrap_err().to_string().contains("2 or more layers"));
        let e = new(Overrides {
            mtp_layers: Some(1),
            ..Overrides::default()
        });
        assert!(e.is_err());
    }

    #[test]
    fn nemotron_layer_kinds_follow_nemotron_3_nano_mix() {
        let pattern = |layers: u64| -> String {
            (0..layers)
                .map(|l| match nemotron_layer_kind(l, layers) {
                    NemotronLayer::Mamba2 => 'M',
                    NemotronLayer::Attention => '*',
                    NemotronLayer::Ffn => 'E',
                })
                .collect()
        };
        assert_eq!(pattern(3), "M*E");
        assert_eq!(pattern(4), "ME*E");
        assert_eq!(pattern(7), "MEMEM*E");
        assert_eq!(pattern(16), "MEMEMEM*EMEMEMEM");
        let a3b = pattern(52);
        assert_eq!(&a3b[..18], "MEMEMEM*EMEMEMEM*E");
        let count = |p: &str, c: char| p.chars().filter(|x| *x == c).count();
        // Nemotron 3 Nano: 23 Mamba2, 23 MoE and 6 attention layers of 52.
        assert_eq!(
            [count(&a3b, 'M'), count(&a3b, 'E'), count(&a3b, '*')],
            [24, 23, 5]
        );
        for layers in 3..=200 {
            let p = pattern(layers);
            let [m, e, a] = [count(&p, 'M'), count(&p, 'E'), count(&p, '*')];
            assert!(m > 0 && e > 0 && a > 0, "{layers}: {p}");
            // Never two Mamba2 or two attention layers in a row.
            assert!(!p.contains("MM") && !p.contains("**"), "{layers}: {p}");
            if layers >= 36 {
                // About 45% each of Mamba2 and FFN, 10% attention.
                let share = |n: usize| n as f64 / layers as f64;
                assert!((0.42..0.48).contains(&share(m)), "{layers}: {p}");
                assert!((0.42..0.48).contains(&share(e)), "{layers}: {p}");
                assert!((0.08..0.14).contains(&share(a)), "{layers}: {p}");
            }
        }
    }

    /// The metadata and tensors llama.cpp's `nemotron_h_moe` and `nemotron_h`
    /// loaders read: per-layer KV heads and FFN widths, 0 except on the
    /// attention and FFN layers, each layer one norm and one sub-layer.
    #[test]
    fn nemotron_plan_and_metadata() {
        for (arch, preset) in [
            (Arch::NemotronHMoe, Preset::Tiny),
            (Arch::NemotronHMoe, Preset::Small),
            (Arch::NemotronHMoe, Preset::A3b),
            (Arch::NemotronH, Preset::Tiny),
            (Arch::NemotronH, Preset::Small),
        ] {
            let cfg = SynthConfig::new(arch, preset, &Overrides::default(), 0).unwrap();
            let s = &cfg.shape;
            let moe = arch == Arch::NemotronHMoe;
            assert_eq!(cfg.is_moe(), moe);
            let [heads, head, state, groups] = nemotron_ssm(preset);
            let (e, inner) = (s.embd, heads * head);
            let vocab = Vocab::build(s.vocab as usize).unwrap();
            let meta = metadata(&cfg, &vocab);
            let a = arch.gguf_name();
            let get = |k: &str| {
                let key = format!("{a}.{k}");
                meta.iter().find(|(x, _)| *x == key).map(|(_, v)| v.clone())
            };
            let array = |k: &str| -> Vec<MetaValue> {
                let Some(MetaValue::Array(v)) = get(k) else {
                    panic!("{k} is not an array");
                };
                v.items().collect()
            };
            let u = |k: &str| match get(k) {
                Some(MetaValue::U32(v)) => u64::from(v),
                v => panic!("{k}: {v:?}"),
            };
            let (kv, ff) = (
                array("attention.head_count_kv"),
                array("feed_forward_length"),
            );
            assert_eq!((kv.len() as u64, ff.len() as u64), (s.layers, s.layers));
            let p = tensor_plan(&cfg);
            let find = |name: &str| p.iter().find(|t| t.name == name);
            let width = if moe { s.expert_ff } else { s.ff };
            for l in 0..s.layers {
                let kind = nemotron_layer_kind(l, s.layers);
                let at = |k| if kind == k { 1 } else { 0 };
                let want_kv = (at(NemotronLayer::Attention) * s.kv_heads) as i32;
                let want_ff = (at(NemotronLayer::Ffn) * width) as i32;
                assert_eq!(kv[l as usize], MetaValue::I32(want_kv), "{preset:?} {l}");
                assert_eq!(ff[l as usize], MetaValue::I32(want_ff), "{preset:?} {l}");
                let t = |part: &str| find(&format!("blk.{l}.{part}"));
                assert!(t("attn_norm.weight").is_some());
                assert!(t("ffn_norm.weight").is_none());
                assert_eq!(
                    t("attn_q.weight").is_some(),
                    kind == NemotronLayer::Attention
                );
                assert_eq!(t("ssm_in.weight").is_some(), kind == NemotronLayer::Mamba2);
                let ffn = kind == NemotronLayer::Ffn;
                for part in [
                    "ffn_gate_inp.weight",
                    "exp_probs_b.bias",
                    "ffn_up_exps.weight",
                    "ffn_down_exps.weight",
                    "ffn_up_shexp.weight",
                    "ffn_down_shexp.weight",
                ] {
                    assert_eq!(t(part).is_some(), ffn && moe, "{l} {part}");
                }
                for part in ["ffn_up.weight", "ffn_down.weight"] {
                    assert_eq!(t(part).is_some(), ffn && !moe, "{l} {part}");
                }
                // Ungated, everywhere.
                for part in ["ffn_gate_exps", "ffn_gate_shexp", "ffn_gate"] {
                    assert!(t(&format!("{part}.weight")).is_none());
                }
                if ffn && moe {
                    let (x, f, sh) = (s.experts, s.expert_ff, s.shared_ff);
                    assert_eq!(t("ffn_up_exps.weight").unwrap().dims, [e, f, x]);
                    assert_eq!(t("ffn_down_exps.weight").unwrap().dims, [f, e, x]);
                    assert_eq!(t("ffn_up_shexp.weight").unwrap().dims, [e, sh]);
                    assert_eq!(t("ffn_down_shexp.weight").unwrap().dims, [sh, e]);
                    let bias = t("exp_probs_b.bias").unwrap();
                    assert_eq!((bias.dims.clone(), bias.ty), (vec![x], GgmlType::F32));
                }
                if kind != NemotronLayer::Mamba2 {
                    continue;
                }
                let conv = inner + 2 * groups * state;
                for (part, dims, small) in [
                    (
                        "ssm_in.weight",
                        vec![e, 2 * inner + 2 * groups * state + heads],
                        false,
                    ),
                    ("ssm_conv1d.weight", vec![4, conv], true),
                    ("ssm_conv1d.bias", vec![conv], true),
                    ("ssm_dt.bias", vec![heads], true),
                    ("ssm_a", vec![1, heads], true),
                    ("ssm_d", vec![1, heads], true),
                    ("ssm_norm.weight", vec![inner / groups, groups], true),
                    ("ssm_out.weight", vec![inner, e], false),
                ] {
                    let t = t(part).unwrap();
                    assert_eq!(t.dims, dims, "{part}");
                    assert_eq!(
                        t.ty == GgmlType::F32,
                        small,
                        "{preset:?} {part} is {}",
                        t.ty
                    );
                }
            }
            assert_eq!(u("ssm.inner_size"), inner);
            assert_eq!(u("ssm.time_step_rank"), heads);
            assert_eq!(u("ssm.state_size"), state);
            assert_eq!(u("ssm.group_count"), groups);
            assert_eq!(u("ssm.conv_kernel"), 4);
            assert_eq!(u("attention.key_length"), s.head_dim);
            assert_eq!(u("attention.value_length"), s.head_dim);
            assert_eq!(
                get("attention.layer_norm_epsilon"),
                Some(MetaValue::F32(1e-5))
            );
            assert_eq!(get("attention.layer_norm_rms_epsilon"), None);
            assert_eq!(get("rope.scaling.finetuned"), Some(MetaValue::Bool(false)));
            assert_eq!(get("expert_gating_func"), None);
            if moe {
                assert_eq!(u("expert_count"), s.experts);
                assert_eq!(u("expert_used_count"), s.top_k);
                assert_eq!(u("expert_feed_forward_length"), s.expert_ff);
                assert_eq!(u("expert_shared_feed_forward_length"), s.shared_ff);
                assert_eq!(u("expert_shared_count"), 1);
                assert_eq!(u("expert_group_count"), 1);
                assert_eq!(get("expert_weights_norm"), Some(MetaValue::Bool(true)));
                let scale = Some(MetaValue::F32(NEMOTRON_WEIGHTS_SCALE));
                assert_eq!(get("expert_weights_scale"), scale);
            } else {
                assert_eq!(get("expert_count"), None);
            }
        }
    }

    #[test]
    fn nemotron_a3b_is_nemotron_3_nano_and_refusals() {
        let cfg =
            SynthConfig::new(Arch::NemotronHMoe, Preset::A3b, &Overrides::default(), 0).unwrap();
        let s = &cfg.shape;
        assert_eq!(
            [s.layers, s.embd, s.heads, s.kv_heads, s.head_dim, s.vocab],
            [52, 2688, 32, 2, 128, 131_072]
        );
        assert_eq!(
            [s.experts, s.top_k, s.expert_ff, s.shared_ff],
            [128, 6, 1856, 3712]
        );
        assert_eq!(s.mamba2_inner(), 4096);
        // The popularity skew calibrated for Nemotron's LRU hit rates
        // (nemotron_knobs); an override still wins.
        let skew = |preset, o: Overrides| {
            SynthConfig::new(Arch::NemotronHMoe, preset, &o, 0)
                .unwrap()
                .knobs
                .popularity_skew
        };
        assert_eq!(cfg.knobs.popularity_skew, 1.5);
        assert_eq!(skew(Preset::Small, Overrides::default()), 2.75);
        assert_eq!(skew(Preset::Tiny, Overrides::default()), 0.5);
        let o = Overrides {
            popularity_skew: Some(0.25),
            ..Overrides::default()
        };
        assert_eq!(skew(Preset::Small, o), 0.25);
        assert_eq!(cfg.knobs.residual_scale, Preset::A3b.knobs().residual_scale);
        // Rows of 2688 take no K-quant: q4_k falls back to q5_0 and the
        // more-bits q6_k to q8_0, as llama.cpp's quantizer does; rows of
        // 1856 (ffn_down_exps) alike.
        let p = tensor_plan(&cfg);
        assert_eq!(ty(&p, "blk.1.ffn_up_exps.weight"), GgmlType::Q5_0);
        assert_eq!(ty(&p, "blk.1.ffn_down_exps.weight"), GgmlType::Q8_0);
        assert_eq!(ty(&p, "blk.21.ffn_down_exps.weight"), GgmlType::Q5_0);
        assert_eq!(ty(&p, "blk.0.ssm_out.weight"), GgmlType::Q4K);
        // attn_v counts among the five attention layers': the third and the
        // fifth get more bits.
        for (l, want) in [(7, 5), (16, 5), (25, 8), (34, 5), (43, 8)] {
            let want = if want == 8 {
                GgmlType::Q8_0
            } else {
                GgmlType::Q5_0
            };
            assert_eq!(ty(&p, &format!("blk.{l}.attn_v.weight")), want, "{l}");
        }
        // 25.5 GB: 31.6 billion weights, most of them in q5_0 and q8_0.
        let bytes: u64 = p.iter().map(TensorPlan::bytes).sum();
        assert_eq!(bytes, 25_490_741_248);

        let new = |arch, o: Overrides| SynthConfig::new(arch, Preset::Tiny, &o, 0);
        let err = |arch, o| new(arch, o).unwrap_err().to_string();
        let layers = |n| Overrides {
            layers: Some(n),
            ..Overrides::default()
        };
        assert!(err(Arch::NemotronHMoe, layers(2)).contains("3 or more layers"));
        assert!(err(Arch::NemotronH, layers(2)).contains("3 or more layers"));
        assert!(new(Arch::NemotronHMoe, layers(3)).is_ok());
        let experts = |n| Overrides {
            experts: Some(n),
            ..Overrides::default()
        };
        assert!(err(Arch::NemotronHMoe, experts(0)).contains("nemotron_h"));
        assert!(err(Arch::NemotronHMoe, experts(1)).contains("2 or more experts"));
        assert!(new(Arch::NemotronHMoe, experts(2)).is_ok());
        assert!(err(Arch::NemotronH, experts(8)).contains("nemotron_h_moe"));
        let no_shared = Overrides {
            shared_ff: Some(0),
            ..Overrides::default()
        };
        assert!(err(Arch::NemotronHMoe, no_shared).contains("shared expert"));
        let mtp = Overrides {
            mtp_layers: Some(1),
            ..Overrides::default()
        };
        assert!(err(Arch::NemotronHMoe, mtp).contains("--mtp-layers"));
        // The Mamba2 width is not tied to the embedding (unlike granitehybrid).
        let wide = Overrides {
            embd: Some(80),
            ..Overrides::default()
        };
        let cfg = new(Arch::NemotronHMoe, wide).unwrap();
        assert_eq!((cfg.shape.embd, cfg.shape.mamba2_inner()), (80, 96));
    }

    /// LFM2's layouts: a convolution or attention by [`lfm2_is_attention`],
    /// the MoE's first [`LFM2_DENSE_LAYERS`] dense, square attention, and
    /// what cannot be written refused by name.
    #[test]
    fn lfm2_layouts() {
        let new = |arch, o: Overrides| SynthConfig::new(arch, Preset::Tiny, &o, 0);
        let cfg = new(Arch::Lfm2moe, Overrides::default()).unwrap();
        assert_eq!(cfg.shape.head_dim * cfg.shape.heads, cfg.shape.embd);
        let plan = tensor_plan(&cfg);
        let has = |name: &str| plan.iter().any(|t| t.name == name);
        for l in 0..cfg.shape.layers {
            let n = |part: &str| format!("blk.{l}.{part}");
            assert_eq!(has(&n("attn_q_norm.weight")), lfm2_is_attention(l), "{l}");
            assert_eq!(
                has(&n("shortconv.in_proj.weight")),
                !lfm2_is_attention(l),
                "{l}"
            );
            assert_eq!(
                has(&n("ffn_gate_inp.weight")),
                l >= LFM2_DENSE_LAYERS,
                "{l}"
            );
            assert_eq!(has(&n("ffn_gate.weight")), l < LFM2_DENSE_LAYERS, "{l}");
        }
        let conv = plan
            .iter()
            .find(|t| t.name == "blk.0.shortconv.conv.weight")
            .unwrap();
        assert_eq!(conv.dims, vec![LFM2_CONV_WIDTH, cfg.shape.embd]);
        assert_eq!(conv.ty, GgmlType::F32);
        assert!(has("token_embd_norm.weight") && !has("output_norm.weight"));

        let err = |arch, o| new(arch, o).unwrap_err().to_string();
        let layers = |n| Overrides {
            layers: Some(n),
            ..Overrides::default()
        };
        assert!(err(Arch::Lfm2moe, layers(2)).contains("3 or more layers"));
        assert!(new(Arch::Lfm2moe, layers(3)).is_ok());
        assert!(err(Arch::Lfm2, layers(2)).contains("3 or more layers"));
        let experts = |n| Overrides {
            experts: Some(n),
            ..Overrides::default()
        };
        assert!(err(Arch::Lfm2moe, experts(0)).contains("the dense one is lfm2"));
        assert!(err(Arch::Lfm2, experts(8)).contains("lfm2moe"));
        let dense = new(Arch::Lfm2, Overrides::default()).unwrap();
        assert!(!tensor_plan(&dense)
            .iter()
            .any(|t| t.name.contains("ffn_gate_inp")));
    }

    /// A dense Nemotron-H counts its FFN layers for the more-bits rule, as
    /// llama.cpp does without experts.
    #[test]
    fn nemotron_h_q4_k_m_counts_ffn_layers() {
        let p = plan(Arch::NemotronH, Preset::Small, Overrides::default());
        let downs: Vec<(u64, GgmlType)> = p
            .iter()
            .filter(|t| t.name.ends_with("ffn_down.weight"))
            .map(|t| (t.layer.unwrap(), t.ty))
            .collect();
        assert_eq!(downs.len(), 7);
        for (i, (l, t)) in downs.iter().enumerate() {
            let more = use_more_bits(i as u64, 16);
            assert_eq!(*t == GgmlType::Q6K, more, "ffn_down #{i} (layer {l})");
        }
    }

    #[test]
    fn q4_k_m_rules_for_other_architectures() {
        // Mixtral (8 experts): attn_k / attn_v q8_0, attn_output q5_k.
        let o = Overrides {
            experts: Some(8),
            top_k: Some(2),
            layers: Some(8),
            ..Overrides::default()
        };
        let p = plan(Arch::Mixtral, Preset::Small, o);
        for l in 0..8 {
            assert_eq!(ty(&p, &format!("blk.{l}.attn_v.weight")), GgmlType::Q8_0);
            assert_eq!(ty(&p, &format!("blk.{l}.attn_k.weight")), GgmlType::Q8_0);
            assert_eq!(
                ty(&p, &format!("blk.{l}.attn_output.weight")),
                GgmlType::Q5K
            );
            assert_eq!(ty(&p, &format!("blk.{l}.attn_q.weight")), GgmlType::Q4K);
        }
        // qwen35moe: DeltaNet attn_qkv q5_k; attn_v counts among the 40 attn_v +
        // attn_qkv tensors (+1 in the MTP block), so all of the first five attention
        // layers' attn_v get more bits; ffn_down_shexp follows the layer.
        let p = plan(Arch::Qwen35moe, Preset::Minicpmv47, Overrides::default());
        assert_eq!(ty(&p, "blk.0.attn_qkv.weight"), GgmlType::Q5K);
        assert_eq!(ty(&p, "blk.0.attn_gate.weight"), GgmlType::Q4K);
        let v: Vec<GgmlType> = p
            .iter()
            .filter(|t| t.name.ends_with("attn_v.weight"))
            .map(|t| t.ty)
            .collect();
        let n = p
            .iter()
            .filter(|t| t.name.ends_with("attn_v.weight") || t.name.ends_with("attn_qkv.weight"))
            .count() as u64;
        for (i, t) in v.iter().enumerate() {
            let more = use_more_bits(i as u64, n);
            assert_eq!(*t == GgmlType::Q6K, more, "attn_v #{i} of {n}");
        }
        assert_eq!(ty(&p, "blk.0.ffn_down_shexp.weight"), GgmlType::Q6K);
        assert_eq!(ty(&p, "blk.6.ffn_down_shexp.weight"), GgmlType::Q4K);
    }

    #[test]
    fn rows_a_k_quant_does_not_divide_fall_back_as_in_llama_cpp() {
        assert_eq!(fit(GgmlType::Q4K, 512), GgmlType::Q4K);
        assert_eq!(fit(GgmlType::Q4K, 96), GgmlType::Q5_0);
        assert_eq!(fit(GgmlType::Q5K, 96), GgmlType::Q5_1);
        assert_eq!(fit(GgmlType::Q6K, 96), GgmlType::Q8_0);
        assert_eq!(fit(GgmlType::Q6K, 40), GgmlType::F16);
        assert_eq!(fit(GgmlType::Q8_0, 40), GgmlType::F16);
        // Experts of width 96: ffn_down's rows take the fallback of the type the
        // mix picked for their layer (q6_k on layer 0, q4_k on layer 2), as
        // llama.cpp decides the type first and falls back after.
        let o = Overrides {
            expert_ff: Some(96),
            ..Overrides::default()
        };
        let p = plan(Arch::Qwen3moe, Preset::Small, o);
        assert_eq!(ty(&p, "blk.0.ffn_down_exps.weight"), GgmlType::Q8_0);
        assert_eq!(ty(&p, "blk.2.ffn_down_exps.weight"), GgmlType::Q5_0);
        assert_eq!(ty(&p, "blk.2.ffn_gate_exps.weight"), GgmlType::Q4K);
    }

    #[test]
    fn q4_k_m_leaves_other_types_and_uniform_alone() {
        // A dense class set to q8_0 keeps it everywhere; experts still follow.
        let o = Overrides {
            dense_type: Some(GgmlType::Q8_0),
            ..Overrides::default()
        };
        let p = plan(Arch::Qwen3moe, Preset::A3b, o);
        assert_eq!(ty(&p, "blk.0.attn_v.weight"), GgmlType::Q8_0);
        assert_eq!(ty(&p, "blk.0.ffn_down_exps.weight"), GgmlType::Q6K);
        let o = Overrides {
            mix: Some(Mix::Uniform),
            ..Overrides::default()
        };
        let p = plan(Arch::Qwen3moe, Preset::A3b, o);
        assert!(p
            .iter()
            .filter(|t| t.dims.len() > 1
                && t.name != "output.weight"
                && !t.name.contains("gate_inp"))
            .all(|t| t.ty == GgmlType::Q4K));
        // tiny stays uniform.
        let p = plan(Arch::Qwen3moe, Preset::Tiny, Overrides::default());
        assert_eq!(ty(&p, "blk.0.ffn_down_exps.weight"), GgmlType::Q4_0);
    }
}
