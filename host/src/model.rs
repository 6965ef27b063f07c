//! A GGUF file as a runnable model: hyperparameters and weights per architecture,
//! with the conventions llama.cpp gives each one.
//!
//! Every tensor is checked once at load (present, right type and shape), so the
//! [`Weights`] accessors the forward pass calls per token cannot fail. Experts stay
//! where they are in the file: [`Model::expert`] views them in the mapping (the
//! resident schedule), and [`Model::expert_extents`] names their byte ranges so
//! they can be read into slots instead (the streamed schedules).

use std::fmt;
use std::path::Path;

use les_core::gemv::MatrixView;
use les_core::model::config::{
    AttnTemperature, AttnWindow, DeltaNetShape, ExpertAct, Hparams, HybridParams, LinearShape,
    Mamba2Shape, MlaShape, MoeParams, Mrope, Scales, ShortConvShape, SlidingWindow,
};
use les_core::model::deltanet::DeltaNetWeights;
use les_core::model::experts::ExpertFormat;
use les_core::model::forward::nextn::NextnBlock;
use les_core::model::forward::{
    AttentionWeights, Block, ExpertBiases, ExpertMatrices, Ffn, Mixer, MlaWeights, SharedExpert,
    Weights,
};
use les_core::model::mamba2::Mamba2Weights;
use les_core::model::ops::{RopeStyle, Yarn};
use les_core::model::shortconv::ShortConvWeights;
use les_core::quant::{self, GgmlType};
use les_core::router::{ExpertGroups, Gating};
use les_core::schedule::{Extent, Extents};
use les_core::slot_classes::{class_for, SizeGroup, SlotClass};
use les_core::slots::ExpertKey;

use crate::flash::arena::SLOT_ALIGN;
use crate::flash::{Check, ReadChecks};
use crate::gguf::{Gguf, GgufError, MappedFile, OptionalKey};

/// Why a model could not be loaded.
#[derive(Debug)]
pub enum ModelError {
    /// The file is not a valid GGUF.
    Gguf(GgufError),
    /// The architecture is not supported.
    Unsupported(String),
    /// A tensor or key is missing or inconsistent.
    Invalid(String),
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Gguf(e) => e.fmt(f),
            ModelError::Unsupported(a) => write!(f, "unsupported architecture: {a}"),
            ModelError::Invalid(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for ModelError {}

impl From<GgufError> for ModelError {
    fn from(e: GgufError) -> Self {
        ModelError::Gguf(e)
    }
}

fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::Invalid(msg.into())
}

/// Architectures LES runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama (dense) and Mixtral (llama with experts).
    Llama,
    /// Qwen3-MoE.
    Qwen3Moe,
    /// Qwen2-MoE (shared expert with a sigmoid gate, attention biases).
    Qwen2Moe,
    /// OLMoE.
    Olmoe,
    /// Qwen3.5-MoE (MiniCPM-V 4.7's language model): gated DeltaNet layers
    /// interleaved with gated attention, routed plus gated shared experts.
    Qwen35Moe,
    /// Qwen3-Next (Qwen3-Next-80B-A3B): qwen35moe's layers with plain partial
    /// RoPE, value heads grouped by key head, a fused `ssm_ba`.
    Qwen3Next,
    /// gpt-oss (llama.cpp's `OPENAI_MOE`): attention with biases, sinks and a
    /// sliding window on every other layer, YaRN RoPE, routed experts with
    /// biases and a clamped SwiGLU, softmax over the picked experts' logits.
    GptOss,
    /// GLM-4.5 / GLM-4.5-Air (llama.cpp's `GLM4_MOE`): attention with Q/K/V
    /// biases and a partial NeoX RoPE, dense leading layers, routed experts
    /// chosen by sigmoid scores plus a selection bias, an ungated shared
    /// expert, a multi-token-prediction block after the main stack; GLM-4.5V's
    /// and GLM-4.6V's (`rope.dimension_sections`) rotate by plain M-RoPE.
    Glm4Moe,
    /// ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, -300B-A47B; llama.cpp's
    /// `ernie4_5-moe`): Llama attention, dense leading layers, routed experts
    /// picked by softmax probabilities plus a selection bias, renormalised,
    /// an ungated shared expert.
    Ernie45Moe,
    /// ERNIE 4.5's dense models (ERNIE-4.5-0.3B, a draft model for the MoE
    /// ones: the same vocabulary).
    Ernie45,
    /// Ling 2.0 / Ring 2.0 (Ling-mini-2.0, Ling-flash-2.0; llama.cpp's
    /// `bailingmoe2`): a fused QKV projection, per-head Q/K norms, partial
    /// NeoX RoPE, dense leading layers, routed experts by sigmoid scores with
    /// a selection bias over expert groups, ungated shared experts; its MTP
    /// layers are skipped, as llama.cpp skips them.
    BailingMoe2,
    /// MiniMax-M2 (llama.cpp's `minimax-m2`): Q/K RMS norms over all heads
    /// at once, partial NeoX RoPE, every layer routed experts picked by
    /// sigmoid scores plus a selection bias, renormalised, no shared expert.
    MinimaxM2,
    /// dots.llm1 (llama.cpp's `dots1`): Qwen3's attention (per-head Q/K
    /// norms, NeoX RoPE), dense leading layers, routed experts (softmax or
    /// sigmoid with a selection bias, as the file says) and shared experts
    /// `expert_shared_count` experts wide.
    Dots1,
    /// Hunyuan-A13B (llama.cpp's `hunyuan-moe`): Q/K norms per head after
    /// RoPE (NeoX), every layer a softmax-routed, renormalised MoE sized by
    /// `feed_forward_length` plus an ungated shared expert.
    HunyuanMoe,
    /// Qwen3-VL's MoE language model (Qwen3-VL-30B-A3B, -235B-A22B;
    /// llama.cpp's `qwen3vlmoe`): qwen3moe's layers rotated by IMRoPE
    /// sections; images through its `qwen3vl_merger` projector, with
    /// deepstack features ([`HybridParams::n_deepstack`]).
    Qwen3VlMoe,
    /// Qwen3-VL's dense language model (llama.cpp's `qwen3vl`).
    Qwen3Vl,
    /// Llama 4 Scout / Maverick (llama.cpp's `llama4`; images through its
    /// `llama4` projector): chunked
    /// attention (8192 positions) on three layers of four, the fourth without
    /// RoPE and with a query temperature, Q/K norms without weights after
    /// RoPE (not Maverick's), experts every `interleave_moe_layer_step`
    /// layers, one expert picked by logit whose sigmoid weighs its *input*,
    /// plus an ungated shared expert.
    Llama4,
    /// DeepSeek-V2 / V3 / R1, Kimi K2 and Kimi-VL's language model
    /// (llama.cpp's `deepseek2` with split `attn_k_b` / `attn_v_b`; Kimi-VL's
    /// images through a `kimivl` projector): multi-head latent attention, dense leading
    /// layers, routed experts (softmax, or sigmoid with a selection bias and
    /// expert groups), ungated shared experts.
    Deepseek2,
    /// IBM Granite 3.x (dense): Llama's layers with Granite's multipliers of
    /// the embedding, the blocks' outputs, the attention scores and the logits.
    Granite,
    /// IBM Granite 3.x MoE (1B-A400M, 3B-A800M; shared experts where
    /// `expert_shared_feed_forward_length` says): [`Granite`](Arch::Granite)'s
    /// layers with routed experts, a softmax renormalised over the picks.
    GraniteMoe,
    /// IBM Granite 4.0-H (llama.cpp's `granitehybrid`): Mamba2 layers and a
    /// few attention layers (a KV head count of 0 marks the Mamba2 ones),
    /// without RoPE unless `rope.scaling.finetuned` asks for it, each
    /// followed by [`GraniteMoe`](Arch::GraniteMoe)'s experts (or a dense
    /// FFN), with Granite's multipliers.
    GraniteHybrid,
    /// NVIDIA Nemotron-H (dense: Nemotron-H 8B, Nemotron Nano 9B v2): layers
    /// of one sub-layer each, Mamba2, attention without RoPE, or an FFN
    /// without a gate (`relu(up x)^2`); `feed_forward_length` and
    /// `attention.head_count_kv` per layer say which.
    NemotronH,
    /// NVIDIA Nemotron-H MoE (Nemotron 3 Nano 30B-A3B): [`NemotronH`](Arch::NemotronH)'s
    /// layers with ungated ReLU² experts routed by sigmoid (plus `exp_probs_b`
    /// to pick them) and an ungated shared expert.
    NemotronHMoe,
    /// Liquid AI's LFM2 MoE (LFM2-8B-A1B, LFM2-24B-A2B; llama.cpp's
    /// `lfm2moe`): gated short convolutions and a few attention layers
    /// (per-head Q/K norms, NeoX RoPE; a KV head count of 0 marks the
    /// convolutions), dense leading layers, then routed experts picked by
    /// sigmoid scores plus a selection bias, renormalised.
    Lfm2Moe,
    /// LFM2's dense models (LFM2-350M ... 2.6B; llama.cpp's `lfm2`):
    /// [`Lfm2Moe`](Arch::Lfm2Moe)'s layers with a SwiGLU FFN each (the same
    /// vocabulary: a draft model for the MoE ones).
    Lfm2,
    /// PowerInfer's SmallThinker (SmallThinker-4B-A0.6B, 21B-A3B), made to
    /// run on phones with its experts on flash: each layer's router reads
    /// the layer's input (before its attention, without a norm), sigmoid or
    /// softmax scores renormalised, `relu(gate) * up` experts; with
    /// `attention.sliding_window`, 4096-position windows on three layers of
    /// four and no RoPE on the fourth.
    SmallThinker,
    /// Qwen3's dense models (Qwen3-0.6B ... 32B; llama.cpp's `qwen3`):
    /// [`Qwen3Moe`](Arch::Qwen3Moe)'s attention (per-head Q/K norms, NeoX
    /// RoPE) with a SwiGLU FFN a layer; draft models for Qwen3's MoEs.
    Qwen3,
    /// Qwen2 and Qwen2.5's dense models (llama.cpp's `qwen2`): attention with
    /// Q/K/V biases, NeoX RoPE, a SwiGLU FFN a layer; draft models for
    /// Qwen2-MoE.
    Qwen2,
}

impl Arch {
    /// Every architecture les runs.
    pub const ALL: [Arch; 28] = [
        Arch::Llama,
        Arch::Qwen3Moe,
        Arch::Qwen2Moe,
        Arch::Olmoe,
        Arch::Qwen35Moe,
        Arch::Qwen3Next,
        Arch::GptOss,
        Arch::Glm4Moe,
        Arch::Deepseek2,
        Arch::Ernie45Moe,
        Arch::Ernie45,
        Arch::BailingMoe2,
        Arch::MinimaxM2,
        Arch::Dots1,
        Arch::HunyuanMoe,
        Arch::Llama4,
        Arch::Qwen3VlMoe,
        Arch::Qwen3Vl,
        Arch::Granite,
        Arch::GraniteMoe,
        Arch::GraniteHybrid,
        Arch::NemotronH,
        Arch::NemotronHMoe,
        Arch::Lfm2Moe,
        Arch::Lfm2,
        Arch::SmallThinker,
        Arch::Qwen3,
        Arch::Qwen2,
    ];

    /// From `general.architecture`.
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The GGUF name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Olmoe => "olmoe",
            Arch::Qwen35Moe => "qwen35moe",
            Arch::Qwen3Next => "qwen3next",
            Arch::GptOss => "gpt-oss",
            Arch::Glm4Moe => "glm4moe",
            Arch::Deepseek2 => "deepseek2",
            Arch::Ernie45Moe => "ernie4_5-moe",
            Arch::Ernie45 => "ernie4_5",
            Arch::BailingMoe2 => "bailingmoe2",
            Arch::MinimaxM2 => "minimax-m2",
            Arch::Dots1 => "dots1",
            Arch::HunyuanMoe => "hunyuan-moe",
            Arch::Llama4 => "llama4",
            Arch::Qwen3VlMoe => "qwen3vlmoe",
            Arch::Qwen3Vl => "qwen3vl",
            Arch::Granite => "granite",
            Arch::GraniteMoe => "granitemoe",
            Arch::GraniteHybrid => "granitehybrid",
            Arch::NemotronH => "nemotron_h",
            Arch::NemotronHMoe => "nemotron_h_moe",
            Arch::Lfm2Moe => "lfm2moe",
            Arch::Lfm2 => "lfm2",
            Arch::SmallThinker => "smallthinker",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen2 => "qwen2",
        }
    }

    /// llama.cpp's default for renormalising the top-k weights.
    fn default_norm_topk(self) -> bool {
        matches!(
            self,
            Arch::Llama | Arch::Qwen3Moe | Arch::Qwen35Moe | Arch::Qwen3Next
        )
    }

    /// Nemotron-H's layer structure (one sub-layer each, no RoPE).
    fn is_nemotron(self) -> bool {
        matches!(self, Arch::NemotronH | Arch::NemotronHMoe)
    }

    /// LFM2's layers (gated short convolutions between attention layers).
    fn is_lfm2(self) -> bool {
        matches!(self, Arch::Lfm2Moe | Arch::Lfm2)
    }

    fn rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama
            | Arch::Llama4
            | Arch::Deepseek2
            | Arch::Ernie45Moe
            | Arch::Ernie45
            | Arch::Granite
            | Arch::GraniteMoe
            | Arch::GraniteHybrid => RopeStyle::Normal,
            _ => RopeStyle::Neox,
        }
    }
}

/// A resident matrix: in the file, or rows of one copied out and regrouped
/// (qwen3next's fused `ssm_ba`, bytes as they are).
#[derive(Debug)]
enum MatRef {
    File(Tref),
    Owned {
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    },
}

/// Where a tensor's bytes are in the file, checked at load.
#[derive(Clone, Copy, Debug)]
struct Tref {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    offset: usize,
    len: usize,
}

impl Tref {
    /// Its rows `first..first + n` (within it: callers split a fused matrix
    /// whose shape was checked).
    fn rows(&self, first: usize, n: usize) -> Tref {
        let row_bytes = self.len / self.rows.max(1);
        Tref {
            rows: n,
            offset: self.offset + first * row_bytes,
            len: n * row_bytes,
            ..*self
        }
    }
}

/// A routed-expert tensor stack (`{cols, rows, n_expert}`).
#[derive(Clone, Copy, Debug)]
struct ExpertStack {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    offset: usize,
    /// Bytes of one expert.
    stride: usize,
}

/// Where a layer's routed experts are.
#[derive(Debug)]
enum ExpertStore {
    /// Stacked tensors (a plain GGUF): a scattered read per matrix of an expert.
    Plain(Stacks),
    /// One packed tensor (`les pack`): one aligned extent per expert, checksummed.
    Packed(Box<crate::pack::PackedLayer>),
}

/// A plain GGUF's stacked expert tensors of one layer: gate (where the
/// experts have one), up and down.
#[derive(Debug)]
struct Stacks {
    gate: Option<ExpertStack>,
    up: ExpertStack,
    down: ExpertStack,
}

impl Stacks {
    /// The stacks in slot order.
    fn parts(&self) -> impl Iterator<Item = &ExpertStack> {
        self.gate.iter().chain([&self.up, &self.down])
    }
}

/// A dense FFN or a shared expert: gate (absent for ReLU²), up, down.
#[derive(Debug)]
struct FfnMatrices {
    gate: Option<Tref>,
    up: Tref,
    down: Tref,
}

// One per layer: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum FfnRefs {
    /// No FFN (Nemotron-H's Mamba2 and attention layers).
    None,
    Dense(FfnMatrices),
    Moe {
        router: Tref,
        experts: ExpertStore,
        /// The shared expert and its scalar gate (`ffn_gate_inp_shexp`).
        shared: Option<(FfnMatrices, Option<Tref>)>,
        /// The router's bias (gpt-oss).
        router_bias: Option<Vec<f32>>,
        /// The experts' selection bias (`exp_probs_b`: glm4moe).
        selection_bias: Option<Vec<f32>>,
        /// The experts' gate, up and down biases (gpt-oss), all experts' back to back.
        expert_bias: Option<Box<[Vec<f32>; 3]>>,
    },
}

#[derive(Debug)]
struct AttnRefs {
    wq: Tref,
    wk: Tref,
    wv: Tref,
    wo: Tref,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    bo: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
    window: Option<AttnWindow>,
    /// No RoPE, the query scaled by this temperature (Llama 4).
    nope: Option<AttnTemperature>,
}

/// A gated DeltaNet layer (qwen35moe, qwen3next).
#[derive(Debug)]
struct DeltaRefs {
    shape: DeltaNetShape,
    qkv: Tref,
    gate: Tref,
    beta: MatRef,
    alpha: MatRef,
    dt_bias: Vec<f32>,
    a: Vec<f32>,
    conv: Vec<f32>,
    norm: Vec<f32>,
    out: Tref,
}

/// A multi-head latent attention layer (deepseek2).
#[derive(Debug)]
struct MlaRefs {
    q_a: Option<(Tref, Vec<f32>)>,
    q: Tref,
    kv_a: Tref,
    kv_a_norm: Vec<f32>,
    k_b: Tref,
    v_b: Tref,
    wo: Tref,
}

/// A gated short-convolution layer (lfm2moe).
#[derive(Debug)]
struct ShortConvRefs {
    shape: ShortConvShape,
    in_proj: Tref,
    conv: Vec<f32>,
    out: Tref,
}

/// A Mamba2 layer (granitehybrid).
#[derive(Debug)]
struct Mamba2Refs {
    shape: Mamba2Shape,
    in_proj: Tref,
    conv: Vec<f32>,
    conv_bias: Option<Vec<f32>>,
    dt_bias: Vec<f32>,
    a: Vec<f32>,
    d: Vec<f32>,
    norm: Vec<f32>,
    out: Tref,
}

#[derive(Debug)]
enum MixerRefs {
    /// Nothing mixes positions (Nemotron-H's MoE layers).
    None,
    Attention(AttnRefs),
    DeltaNet(DeltaRefs),
    Mamba2(Mamba2Refs),
    ShortConv(ShortConvRefs),
    Mla(MlaRefs),
}

#[derive(Debug)]
struct LayerRefs {
    attn_norm: Vec<f32>,
    mixer: MixerRefs,
    ffn_norm: Vec<f32>,
    ffn: FfnRefs,
}

/// The first multi-token-prediction block: a layer and the nextn tensors
/// (`embedding`, `head_norm` and `head` default to the model's).
#[derive(Debug)]
struct NextnRefs {
    layer: LayerRefs,
    eh_proj: Tref,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    embedding: Option<Tref>,
    head_norm: Option<Vec<f32>>,
    head: Option<Tref>,
}

/// A loaded model: the mapped GGUF plus validated views of its weights.
pub struct Model {
    gguf: Gguf<MappedFile>,
    /// The architecture.
    pub arch: Arch,
    /// The model shape.
    pub hp: Hparams,
    /// Layer kinds and the hybrid architectures' extra parameters.
    pub hybrid: HybridParams,
    /// Multi-token-prediction (nextn) blocks after the main stack; never run in
    /// the main pass. The first one drafts for `--speculate mtp`
    /// ([`nextn_block`](Self::nextn_block)).
    pub n_nextn_layers: usize,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    /// Its layers whose queries see at most `window` positions back, in the
    /// period they repeat with: gpt-oss's sliding windows (its even layers),
    /// Llama 4's chunks (three layers of four). The KV cache keeps those
    /// layers in rings ([`SwaCache::Window`](crate::engine::SwaCache::Window)).
    pub kv_window: Option<SlidingWindow>,
    /// RoPE frequency factors (`rope_freqs.weight`, Llama 3.1's scaling),
    /// where the architecture reads them and the file has them.
    rope_freqs: Option<Vec<f32>>,
    layers: Vec<LayerRefs>,
    /// The multi-token-prediction block, if the file has one, or why it
    /// cannot be used.
    nextn: Result<Option<NextnRefs>, String>,
    embedding: Tref,
    output: Tref,
    output_norm: Vec<f32>,
    /// Q8_0 copies of the float routers, for lookahead predictions; made on
    /// first use (see [`Weights::lookahead_router`]).
    lookahead_routers: std::sync::OnceLock<Vec<Option<Vec<u8>>>>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("arch", &self.arch)
            .field("hp", &self.hp)
            .finish_non_exhaustive()
    }
}

fn tensor_ref(
    g: &Gguf<MappedFile>,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Tref, ModelError> {
    let t = g.require_tensor(name)?;
    let dims = t.dims();
    let ok = match dims {
        [c] => *c as usize == cols && rows == 1,
        [c, r] => *c as usize == cols && *r as usize == rows,
        _ => false,
    };
    if !ok {
        return Err(invalid(format!(
            "tensor {name} has shape {dims:?}, expected [{cols}, {rows}]"
        )));
    }
    let ty = t.ggml_type();
    MatrixView::new(ty, rows, cols, t.data()).map_err(|e| {
        invalid(format!(
            "tensor {name} ({ty}) cannot be a weight matrix: {e}"
        ))
    })?;
    Ok(Tref {
        ty,
        rows,
        cols,
        offset: t.offset() as usize,
        len: t.size() as usize,
    })
}

fn vector(g: &Gguf<MappedFile>, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = g.require_tensor(name)?;
    if t.n_elements() != len as u64 {
        return Err(invalid(format!(
            "tensor {name} has {} elements, expected {len}",
            t.n_elements()
        )));
    }
    let mut out = vec![0f32; len];
    quant::dequantize(t.ggml_type(), t.data(), &mut out)
        .map_err(|e| invalid(format!("tensor {name}: {e}")))?;
    Ok(out)
}

/// [`tensor_ref`] of `name`, where the file has it.
fn optional_tensor_ref(
    g: &Gguf<MappedFile>,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Option<Tref>, ModelError> {
    if g.tensor(name).is_some() {
        tensor_ref(g, name, rows, cols).map(Some)
    } else {
        Ok(None)
    }
}

fn optional_vector(
    g: &Gguf<MappedFile>,
    name: &str,
    len: usize,
) -> Result<Option<Vec<f32>>, ModelError> {
    if g.tensor(name).is_some() {
        vector(g, name, len).map(Some)
    } else {
        Ok(None)
    }
}

fn expert_stack(
    g: &Gguf<MappedFile>,
    name: &str,
    rows: usize,
    cols: usize,
    n_expert: usize,
) -> Result<ExpertStack, ModelError> {
    let t = g.require_tensor(name)?;
    let dims = t.dims();
    if dims != [cols as u64, rows as u64, n_expert as u64] {
        return Err(invalid(format!(
            "tensor {name} has shape {dims:?}, expected [{cols}, {rows}, {n_expert}]"
        )));
    }
    let ty = t.ggml_type();
    let stride = ty
        .row_bytes(cols)
        .and_then(|b| b.checked_mul(rows))
        .ok_or_else(|| invalid(format!("tensor {name}: bad row length for {ty}")))?;
    MatrixView::new(ty, rows, cols, &t.data()[..stride])
        .map_err(|e| invalid(format!("tensor {name} ({ty}) cannot hold experts: {e}")))?;
    Ok(ExpertStack {
        ty,
        rows,
        cols,
        offset: t.offset() as usize,
        stride,
    })
}

fn key_usize(g: &Gguf<MappedFile>, key: &str) -> Result<usize, ModelError> {
    Ok(g.get_u64(key)? as usize)
}

fn opt_usize(g: &Gguf<MappedFile>, key: &str) -> Result<Option<usize>, ModelError> {
    Ok(g.get_u64(key).optional()?.map(|v| v as usize))
}

/// An integer key that may also be a per-layer array (llama.cpp's
/// `get_key_or_arr`); LES needs the same value for every layer.
fn uniform_usize(g: &Gguf<MappedFile>, key: &str, n: usize) -> Result<Option<usize>, ModelError> {
    let Some(v) = g.get(key) else {
        return Ok(None);
    };
    if let Some(x) = v.as_u64() {
        return Ok(Some(x as usize));
    }
    let arr = v
        .as_array()
        .ok_or_else(|| invalid(format!("{key} must be an integer or an array of integers")))?;
    let vals: Option<Vec<u64>> = arr.iter().map(|x| x.as_u64()).collect();
    match vals.as_deref() {
        Some([first, rest @ ..]) if arr.len() == n && rest.iter().all(|x| x == first) => {
            Ok(Some(*first as usize))
        }
        _ => Err(invalid(format!(
            "{key} must be one value, or {n} equal values (LES needs one size for every layer)"
        ))),
    }
}

/// Llama 4's attention, as llama.cpp's loader and graph fix it: chunks of
/// [`LLAMA4_CHUNK`] positions on the layers of `attention.sliding_window_pattern`
/// (by default three of every four), no RoPE on every fourth layer (its
/// query scaled by [`AttnTemperature::LLAMA4`] instead), and Q/K norms
/// without weights after RoPE on the others unless the model has 128
/// experts (Maverick).
#[derive(Debug)]
struct Llama4Attention {
    chunked: Vec<bool>,
    /// The period of the chunked layers (`l % pattern < pattern - 1`), where
    /// they have one.
    pattern: Option<usize>,
    kq_norm: bool,
}

/// Positions of a chunk of Llama 4's chunked attention (llama.cpp fixes it,
/// whatever `attention.sliding_window` says).
pub const LLAMA4_CHUNK: usize = 8192;

/// Every this many layers one has no RoPE, in Llama 4 and in SmallThinker
/// with sliding windows (llama.cpp's default `n_no_rope_layer_step`).
const NO_ROPE_STEP: usize = 4;

impl Llama4Attention {
    fn nope(&self, layer: usize) -> Option<AttnTemperature> {
        (layer + 1)
            .is_multiple_of(NO_ROPE_STEP)
            .then_some(AttnTemperature::LLAMA4)
    }

    fn window(&self, layer: usize) -> Option<AttnWindow> {
        self.chunked
            .get(layer)
            .copied()
            .unwrap_or(false)
            .then_some(AttnWindow::Chunked(LLAMA4_CHUNK))
    }

    /// The chunked layers as a KV ring sees them: a query sees at most a
    /// chunk back, as in a sliding window of a chunk.
    fn kv_window(&self) -> Option<SlidingWindow> {
        self.pattern.map(|pattern| SlidingWindow {
            window: LLAMA4_CHUNK,
            pattern,
        })
    }

    /// The Q/K norm of layer `layer`: ones (a norm without weights, bit for
    /// bit), on the layers with RoPE, where the model has them.
    fn unit_norm(&self, layer: usize, head_dim: usize) -> Option<Vec<f32>> {
        (self.kq_norm && self.nope(layer).is_none()).then(|| vec![1.0; head_dim])
    }
}

/// Which layers `{a}.attention.sliding_window_pattern` windows, as llama.cpp's
/// `load_swa_pattern` reads it: one boolean a layer, or a period `p` (0: every
/// layer; absent: `default`) that windows all but the last layer of each `p`,
/// or all but the first where `dense_first`; and that period where there is
/// one of at least 2 (a KV ring's).
fn swa_layers(
    g: &Gguf<MappedFile>,
    a: &str,
    n_layers: usize,
    default: usize,
    dense_first: bool,
) -> Result<(Vec<bool>, Option<usize>), ModelError> {
    let key = format!("{a}.attention.sliding_window_pattern");
    let period = |p: usize| -> (Vec<bool>, Option<usize>) {
        let layers = (0..n_layers)
            .map(|l| match dense_first {
                true => l % p != 0,
                false => l % p < p - 1,
            })
            .collect();
        (layers, (p >= 2).then_some(p))
    };
    match g.get(&key) {
        None => Ok(period(default)),
        Some(v) => match (v.as_u64(), v.as_array()) {
            (Some(0), _) => Ok((vec![true; n_layers], None)),
            (Some(p), _) => Ok(period(p.min(n_layers as u64 + 1) as usize)),
            (None, Some(arr)) if arr.len() == n_layers => Ok((
                arr.iter()
                    .map(|x| x.as_bool().or(x.as_u64().map(|v| v != 0)))
                    .collect::<Option<Vec<bool>>>()
                    .ok_or_else(|| invalid(format!("{key} must hold booleans")))?,
                None,
            )),
            _ => Err(invalid(format!(
                "{key} must be a number or {n_layers} booleans"
            ))),
        },
    }
}

/// Refuses a `{a}.rope.freq_base_swa` other than the model's RoPE base: les
/// rotates every layer by one base.
fn same_swa_rope_base(
    g: &Gguf<MappedFile>,
    a: &str,
    rope_base: f32,
    layers: &str,
) -> Result<(), ModelError> {
    match g.get_f32(&format!("{a}.rope.freq_base_swa")).optional()? {
        Some(base) if base != rope_base => Err(ModelError::Unsupported(format!(
            "{a} with a RoPE base of its own on the {layers} layers \
             ({a}.rope.freq_base_swa = {base}, rope.freq_base = {rope_base})"
        ))),
        _ => Ok(()),
    }
}

/// Positions a windowed SmallThinker layer sees: llama.cpp fixes 4096,
/// whatever `attention.sliding_window` says.
pub const SMALLTHINKER_WINDOW: usize = 4096;

/// SmallThinker's attention as llama.cpp's loader and graph fix it: with a
/// positive `attention.sliding_window`, [`SMALLTHINKER_WINDOW`] positions on
/// the layers of `attention.sliding_window_pattern` (by default all but every
/// fourth, the first of each four) and no RoPE on every fourth layer
/// (`n_no_rope_layer_step`: `l % 4 == 0`, except in a model of exactly 4
/// layers, where llama.cpp's test for "every layer rotates" matches); without
/// one, every layer full and rotated. The caches stay whole (no ring).
#[derive(Debug)]
struct SmallThinkerAttention {
    windowed: Vec<bool>,
    nope_step: Option<usize>,
}

impl SmallThinkerAttention {
    fn read(
        g: &Gguf<MappedFile>,
        a: &str,
        n_layers: usize,
        rope_base: f32,
    ) -> Result<SmallThinkerAttention, ModelError> {
        if opt_usize(g, &format!("{a}.attention.sliding_window"))?.is_none_or(|w| w == 0) {
            return Ok(SmallThinkerAttention {
                windowed: vec![false; n_layers],
                nope_step: None,
            });
        }
        let (windowed, _) = swa_layers(g, a, n_layers, 4, true)?;
        same_swa_rope_base(g, a, rope_base, "windowed")?;
        Ok(SmallThinkerAttention {
            windowed,
            nope_step: (n_layers != NO_ROPE_STEP).then_some(NO_ROPE_STEP),
        })
    }

    fn window(&self, layer: usize) -> Option<AttnWindow> {
        self.windowed
            .get(layer)
            .copied()
            .unwrap_or(false)
            .then_some(AttnWindow::Sliding(SMALLTHINKER_WINDOW))
    }

    fn nope(&self, layer: usize) -> bool {
        self.nope_step.is_some_and(|s| layer.is_multiple_of(s))
    }
}

/// The multiplier `{a}.{key}`: `None` where absent or 0 (llama.cpp's "none"),
/// else a positive finite number.
fn positive_scale(g: &Gguf, a: &str, key: &str) -> Result<Option<f32>, ModelError> {
    match g.get_f32(&format!("{a}.{key}")).optional()? {
        None | Some(0.0) => Ok(None),
        Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
        Some(x) => Err(invalid(format!(
            "{a}.{key} = {x} must be a positive number"
        ))),
    }
}

/// Granite's multipliers, read as llama.cpp reads them: `logit_scale`
/// required (optional in `granitehybrid`), `residual_scale`,
/// `embedding_scale` and `attention.scale` optional, a 0 meaning none (the logits' must not be 0: they are divided
/// by it). Granite Vision's deepstack inputs are refused by name, and so is
/// Granite's switch for RoPE (`rope.scaling.finetuned` false: no RoPE) but
/// in `granitehybrid` ([`granite_rope`]).
fn granite_scales(g: &Gguf, arch: Arch, a: &str) -> Result<Scales, ModelError> {
    let k = |s: &str| format!("{a}.{s}");
    let scale = |key: &str| positive_scale(g, a, key);
    // llama.cpp's granitehybrid loader takes it as optional (Bamba has
    // none); its granite and granitemoe loaders require it.
    let logit = match scale("logit_scale")? {
        Some(x) => x,
        None if arch == Arch::GraniteHybrid => 1.0,
        None => {
            return Err(invalid(format!(
                "{a}.logit_scale must be given and positive (the logits are divided by it)"
            )))
        }
    };
    if g.get(&k("deepstack_mapping")).is_some() {
        return Err(ModelError::Unsupported(format!(
            "{a} with deepstack inputs ({a}.deepstack_mapping: Granite Vision)"
        )));
    }
    if arch != Arch::GraniteHybrid && !granite_rope(g, a)? {
        return Err(ModelError::Unsupported(format!(
            "{a} without RoPE ({a}.rope.scaling.finetuned = false)"
        )));
    }
    Ok(Scales {
        embedding: scale("embedding_scale")?.unwrap_or(1.0),
        residual: scale("residual_scale")?.unwrap_or(1.0),
        attention: scale("attention.scale")?,
        logit,
    })
}

/// Whether a Granite model's attention rotates by position: llama.cpp reads
/// `rope.scaling.finetuned` as the switch, true when absent (Granite 4.0-H's
/// converter writes false: its attention layers have no position encoding).
fn granite_rope(g: &Gguf, a: &str) -> Result<bool, ModelError> {
    Ok(g.get_bool(&format!("{a}.rope.scaling.finetuned"))
        .optional()?
        .unwrap_or(true))
}

/// An integer key given per layer (llama.cpp's `get_key_or_arr`): one value
/// for all `n_layers_all` layers, or an array of exactly that many; `None`
/// where the file has no such key.
fn per_layer(
    g: &Gguf<MappedFile>,
    key: &str,
    n_layers_all: usize,
) -> Result<Option<Vec<u64>>, ModelError> {
    let Some(v) = g.get(key) else {
        return Ok(None);
    };
    if let Some(x) = v.as_u64() {
        return Ok(Some(vec![x; n_layers_all]));
    }
    let arr = v
        .as_array()
        .ok_or_else(|| invalid(format!("{key} must be an integer or an array")))?;
    let vals: Option<Vec<u64>> = arr.iter().map(|x| x.as_u64()).collect();
    match vals {
        Some(c) if c.len() == n_layers_all => Ok(Some(c)),
        _ => Err(invalid(format!(
            "{key} must hold {n_layers_all} integers, one a layer"
        ))),
    }
}

/// `attention.head_count_kv` of granitehybrid, Nemotron-H and LFM2, as llama.cpp
/// reads it: one count per layer (or one for all), 0 marking a layer without
/// attention. The attention layers' count (they must share one) and which
/// layers have none.
fn kv_heads_by_layer(
    g: &Gguf<MappedFile>,
    a: &str,
    n_layers_all: usize,
    n_layers: usize,
) -> Result<(usize, Vec<bool>), ModelError> {
    let key = format!("{a}.attention.head_count_kv");
    let counts = per_layer(g, &key, n_layers_all)?
        .ok_or_else(|| invalid(format!("{key} is missing (0 marks the recurrent layers)")))?;
    let counts = &counts[..n_layers];
    let mut attn = counts.iter().filter(|c| **c != 0);
    let n_head_kv = attn.next().copied().unwrap_or(0);
    if attn.any(|c| *c != n_head_kv) {
        return Err(ModelError::Unsupported(format!(
            "{key} = {counts:?}: attention layers with different KV head counts"
        )));
    }
    let n_head_kv = usize::try_from(n_head_kv)
        .ok()
        .filter(|n| *n <= MAX_DIM)
        .ok_or_else(|| invalid(format!("{key} = {n_head_kv} is implausibly large")))?;
    Ok((n_head_kv, counts.iter().map(|c| *c == 0).collect()))
}

/// The Mamba2 shape (`ssm.*`, as llama.cpp reads them) of granitehybrid and
/// Nemotron-H, for the layers `recurrent` marks; `n_ffn_only` layers are
/// neither attention nor recurrent (Nemotron-H's FFN layers).
fn mamba2_params(
    g: &Gguf<MappedFile>,
    a: &str,
    hp: &Hparams,
    recurrent: &[bool],
    n_ffn_only: usize,
) -> Result<HybridParams, ModelError> {
    let k = |s: &str| format!("{a}.{s}");
    let shape = Mamba2Shape {
        d_inner: key_usize(g, &k("ssm.inner_size"))?,
        d_state: key_usize(g, &k("ssm.state_size"))?,
        n_head: key_usize(g, &k("ssm.time_step_rank"))?,
        n_group: key_usize(g, &k("ssm.group_count"))?,
        conv_kernel: key_usize(g, &k("ssm.conv_kernel"))?,
    };
    at_most(
        a,
        MAX_SSM_DIM,
        &[
            ("ssm.inner_size", shape.d_inner),
            ("ssm.state_size", shape.d_state),
            ("ssm.time_step_rank", shape.n_head),
            ("ssm.group_count", shape.n_group),
            ("ssm.conv_kernel", shape.conv_kernel),
        ],
    )?;
    shape.validate().map_err(|e| invalid(format!("{a}: {e}")))?;
    if shape.d_inner.saturating_mul(shape.d_state) > MAX_DIM * 64 {
        return Err(invalid(format!(
            "{a}: a Mamba2 state of {} x {} floats is implausibly large",
            shape.d_inner, shape.d_state
        )));
    }
    let n_linear = recurrent.iter().filter(|r| **r).count();
    let hy = HybridParams {
        n_attn_layers: hp.n_layers - n_linear - n_ffn_only,
        linear: (n_linear > 0).then_some((n_linear, LinearShape::Mamba2(shape))),
        n_ffn_only_layers: n_ffn_only,
        ..HybridParams::plain(hp)
    };
    hy.validate(hp).map_err(|e| invalid(format!("{a}: {e}")))?;
    Ok(hy)
}

/// LFM2's short-convolution shape (`shortconv.l_cache` wide, over the
/// `n_embd` channels) for the layers `recurrent` marks.
fn shortconv_params(
    g: &Gguf<MappedFile>,
    a: &str,
    hp: &Hparams,
    recurrent: &[bool],
) -> Result<HybridParams, ModelError> {
    let key = format!("{a}.shortconv.l_cache");
    let kernel = key_usize(g, &key)?;
    at_most(a, MAX_SSM_DIM, &[("shortconv.l_cache", kernel)])?;
    let shape = ShortConvShape {
        channels: hp.n_embd,
        kernel,
    };
    shape
        .validate()
        .map_err(|e| invalid(format!("{key} = {kernel}: {e}")))?;
    let n_linear = recurrent.iter().filter(|r| **r).count();
    let hy = HybridParams {
        n_attn_layers: hp.n_layers - n_linear,
        linear: (n_linear > 0).then_some((n_linear, LinearShape::ShortConv(shape))),
        ..HybridParams::plain(hp)
    };
    hy.validate(hp).map_err(|e| invalid(format!("{a}: {e}")))?;
    Ok(hy)
}

/// The tensors of LFM2's short-convolution layer `l`, checked against `shape`.
fn shortconv_refs(
    g: &Gguf<MappedFile>,
    l: usize,
    n_embd: usize,
    shape: ShortConvShape,
) -> Result<ShortConvRefs, ModelError> {
    let t = |s: &str| format!("blk.{l}.{s}");
    let ch = shape.channels;
    Ok(ShortConvRefs {
        shape,
        in_proj: tensor_ref(g, &t("shortconv.in_proj.weight"), 3 * ch, n_embd)?,
        conv: conv_taps(g, &t("shortconv.conv.weight"), shape.kernel, ch)?,
        out: tensor_ref(g, &t("shortconv.out_proj.weight"), n_embd, ch)?,
    })
}

/// A causal convolution `name` (`{kernel, channels}`: the taps of each
/// channel contiguous), checked and read.
fn conv_taps(
    g: &Gguf<MappedFile>,
    name: &str,
    kernel: usize,
    channels: usize,
) -> Result<Vec<f32>, ModelError> {
    let t = g.require_tensor(name)?;
    if t.dims() != [kernel as u64, channels as u64] {
        return Err(invalid(format!(
            "tensor {name} has shape {:?}, expected [{kernel}, {channels}]",
            t.dims()
        )));
    }
    vector(g, name, channels * kernel)
}

/// The tensors of Mamba2 layer `l`, checked against `shape`.
fn mamba2_refs(
    g: &Gguf<MappedFile>,
    l: usize,
    n_embd: usize,
    shape: Mamba2Shape,
) -> Result<Mamba2Refs, ModelError> {
    let t = |s: &str| format!("blk.{l}.{s}");
    let (nh, di, cd) = (shape.n_head, shape.d_inner, shape.conv_dim());
    let conv = conv_taps(g, &t("ssm_conv1d.weight"), shape.conv_kernel, cd)?;
    Ok(Mamba2Refs {
        shape,
        in_proj: tensor_ref(g, &t("ssm_in.weight"), shape.in_proj_dim(), n_embd)?,
        conv,
        conv_bias: optional_vector(g, &t("ssm_conv1d.bias"), cd)?,
        dt_bias: vector(g, &t("ssm_dt.bias"), nh)?,
        a: vector(g, &t("ssm_a"), nh)?,
        d: vector(g, &t("ssm_d"), nh)?,
        norm: vector(g, &t("ssm_norm.weight"), di)?,
        out: tensor_ref(g, &t("ssm_out.weight"), n_embd, di)?,
    })
}

fn llama4_attention(
    g: &Gguf<MappedFile>,
    a: &str,
    n_layers: usize,
    rope_base: f32,
    n_experts: usize,
) -> Result<Llama4Attention, ModelError> {
    if opt_usize(g, &format!("{a}.attention.sliding_window"))? == Some(0) {
        return Err(ModelError::Unsupported(format!(
            "{a} without chunked attention ({a}.attention.sliding_window = 0): llama.cpp's \
             graph then leaves the last layer without RoPE and asks for a temperature it \
             never set; only Llama 4's chunked layout runs here"
        )));
    }
    let (chunked, pattern) = swa_layers(g, a, n_layers, 4, false)?;
    same_swa_rope_base(g, a, rope_base, "chunked")?;
    Ok(Llama4Attention {
        chunked,
        pattern,
        kq_norm: n_experts != 128,
    })
}

/// `{a}.rope.dimension_sections`: the pairs of each head each of M-RoPE's
/// four position components rotates (qwen35moe's and Qwen3-VL's IMRoPE).
fn rope_sections(g: &Gguf<MappedFile>, a: &str) -> Result<[u32; 4], ModelError> {
    let sections = g
        .get_array(&format!("{a}.rope.dimension_sections"))
        .map_err(|e| invalid(format!("{a}: {e}")))?;
    let vals: Option<Vec<u64>> = sections.iter().map(|x| x.as_u64()).collect();
    match vals.as_deref() {
        Some(v) if !v.is_empty() && v.len() <= 4 && v.iter().all(|x| *x <= u32::MAX as u64) => {
            let mut out = [0u32; 4];
            for (o, x) in out.iter_mut().zip(v) {
                *o = *x as u32;
            }
            Ok(out)
        }
        _ => Err(invalid(format!(
            "{a}.rope.dimension_sections must be up to 4 non-negative integers"
        ))),
    }
}

/// Checks each of `dims` (a key under `a`, its value) is at most `max`.
fn at_most(a: &str, max: usize, dims: &[(&str, usize)]) -> Result<(), ModelError> {
    match dims.iter().find(|(_, v)| *v > max) {
        Some((name, v)) => Err(invalid(format!("{a}.{name} = {v} is implausibly large"))),
        None => Ok(()),
    }
}

/// Bound on DeltaNet and Mamba2 dimensions read from metadata.
const MAX_SSM_DIM: usize = 1 << 16;

/// The qwen35moe and qwen3next hyperparameters beyond [`Hparams`], and which
/// of the main layers are linear attention, as llama.cpp's loader reads them.
fn hybrid_params(
    g: &Gguf<MappedFile>,
    arch: Arch,
    hp: &Hparams,
    n_layers_all: usize,
) -> Result<(HybridParams, Vec<bool>), ModelError> {
    let a = arch.name();
    let k = |s: &str| format!("{a}.{s}");
    let shape = DeltaNetShape {
        // llama.cpp repeat-interleaves qwen3next's key heads; its converter
        // tiles qwen35's value heads.
        grouped_values: arch == Arch::Qwen3Next,
        n_k_heads: key_usize(g, &k("ssm.group_count"))?,
        n_v_heads: key_usize(g, &k("ssm.time_step_rank"))?,
        head_dim: key_usize(g, &k("ssm.state_size"))?,
        conv_kernel: key_usize(g, &k("ssm.conv_kernel"))?,
    };
    at_most(
        a,
        MAX_SSM_DIM,
        &[
            ("ssm.group_count", shape.n_k_heads),
            ("ssm.time_step_rank", shape.n_v_heads),
            ("ssm.state_size", shape.head_dim),
            ("ssm.conv_kernel", shape.conv_kernel),
        ],
    )?;
    shape.validate().map_err(|e| invalid(format!("{a}: {e}")))?;
    let inner = key_usize(g, &k("ssm.inner_size"))?;
    if inner != shape.value_dim() {
        return Err(invalid(format!(
            "{a}.ssm.inner_size = {inner}, expected time_step_rank * state_size = {}",
            shape.value_dim()
        )));
    }
    // Which layers are recurrent: an explicit per-layer array, else every layer
    // but each `full_attention_interval`-th.
    let recurrent: Vec<bool> = match g.get(&k("attention.recurrent_layers")) {
        Some(v) => {
            let arr = v.as_array().ok_or_else(|| {
                invalid(format!("{a}.attention.recurrent_layers must be an array"))
            })?;
            let flags: Option<Vec<bool>> = arr
                .iter()
                .map(|x| x.as_bool().or_else(|| x.as_u64().map(|n| n != 0)))
                .collect();
            match flags {
                Some(f) if f.len() == n_layers_all => f[..hp.n_layers].to_vec(),
                _ => {
                    return Err(invalid(format!(
                        "{a}.attention.recurrent_layers must hold {n_layers_all} flags"
                    )))
                }
            }
        }
        None => {
            let interval = opt_usize(g, &k("full_attention_interval"))?.unwrap_or(4);
            if interval == 0 {
                return Err(invalid(format!(
                    "{a}.full_attention_interval must be positive"
                )));
            }
            (0..hp.n_layers)
                .map(|i| !(i + 1).is_multiple_of(interval))
                .collect()
        }
    };
    let n_linear = recurrent.iter().filter(|r| **r).count();
    // qwen35moe rotates by sections (IMRoPE); qwen3next by plain NeoX RoPE.
    let rope_sections = match arch {
        Arch::Qwen3Next => None,
        _ => Some(Mrope {
            sections: rope_sections(g, a)?,
            interleaved: true,
        }),
    };
    let hy = HybridParams {
        n_attn_layers: hp.n_layers - n_linear,
        linear: (n_linear > 0).then_some((n_linear, LinearShape::DeltaNet(shape))),
        n_ffn_only_layers: 0,
        attn_output_gate: true,
        rope_sections,
        n_deepstack: 0,
        mla: None,
    };
    hy.validate(hp).map_err(|e| invalid(format!("{a}: {e}")))?;
    Ok((hy, recurrent))
}

/// The tensors of gated DeltaNet layer `l`, checked against `shape`.
fn delta_refs(
    g: &Gguf<MappedFile>,
    l: usize,
    n_embd: usize,
    shape: DeltaNetShape,
) -> Result<DeltaRefs, ModelError> {
    let t = |s: &str| format!("blk.{l}.{s}");
    let (nv, vd, cd) = (shape.n_v_heads, shape.value_dim(), shape.conv_dim());
    let conv = conv_taps(g, &t("ssm_conv1d.weight"), shape.conv_kernel, cd)?;
    if g.tensor(&t("attn_qkv.weight")).is_none() && g.tensor(&t("ssm_in.weight")).is_some() {
        return Err(invalid(format!(
            "layer {l} has the fused ssm_in of early qwen3next conversions; \
             convert the model again with a current llama.cpp (attn_qkv and attn_gate)"
        )));
    }
    let (beta, alpha) = match g.tensor(&t("ssm_ba.weight")) {
        None => (
            MatRef::File(tensor_ref(g, &t("ssm_beta.weight"), nv, n_embd)?),
            MatRef::File(tensor_ref(g, &t("ssm_alpha.weight"), nv, n_embd)?),
        ),
        Some(_) => {
            let ba = tensor_ref(g, &t("ssm_ba.weight"), 2 * nv, n_embd)?;
            split_beta_alpha(&g.bytes()[ba.offset..][..ba.len], ba, shape)
        }
    };
    Ok(DeltaRefs {
        shape,
        qkv: tensor_ref(g, &t("attn_qkv.weight"), cd, n_embd)?,
        gate: tensor_ref(g, &t("attn_gate.weight"), vd, n_embd)?,
        beta,
        alpha,
        dt_bias: vector(g, &t("ssm_dt.bias"), nv)?,
        a: vector(g, &t("ssm_a"), nv)?,
        conv,
        norm: vector(g, &t("ssm_norm.weight"), shape.head_dim)?,
        out: tensor_ref(g, &t("ssm_out.weight"), n_embd, vd)?,
    })
}

/// deepseek2's multi-head latent attention shape, as llama.cpp reads it: the
/// ranks, the per-head key width (`attention.key_length_mla`, else
/// `key_length` in older files) less the `rope` rotated dimensions, the value
/// width; and YaRN as llama.cpp applies it to this architecture. With
/// `rope.scaling.yarn_log_multiplier` (written as 0.1 times the model's
/// `mscale_all_dim`), the rotation's own magnitude is cancelled and the
/// attention scale becomes `mscale^2 / sqrt(nope + rope)`, `mscale =
/// attn_factor (1 + 0.1 mscale_all_dim ln(factor))`.
fn mla_shape(
    g: &Gguf<MappedFile>,
    a: &str,
    rope: usize,
    yarn: Option<Yarn>,
) -> Result<(MlaShape, Option<Yarn>), ModelError> {
    let k = |s: &str| format!("{a}.{s}");
    let kv_lora = key_usize(g, &k("attention.kv_lora_rank"))?;
    let q_lora = opt_usize(g, &k("attention.q_lora_rank"))?.unwrap_or(0);
    let either = |mla: &str, plain: &str| -> Result<usize, ModelError> {
        match opt_usize(g, &k(mla))? {
            Some(v) => Ok(v),
            None => key_usize(g, &k(plain)),
        }
    };
    let key_len = either("attention.key_length_mla", "attention.key_length")?;
    let v_head_dim = either("attention.value_length_mla", "attention.value_length")?;
    at_most(
        a,
        MAX_DIM,
        &[
            ("attention.kv_lora_rank", kv_lora),
            ("attention.q_lora_rank", q_lora),
            ("attention.key_length_mla", key_len),
            ("attention.value_length_mla", v_head_dim),
        ],
    )?;
    if key_len <= rope {
        return Err(invalid(format!(
            "{a}: a head's key ({key_len}) must be wider than its {rope} rotated dimensions"
        )));
    }
    let log_mul = match g
        .get_f32(&k("rope.scaling.yarn_log_multiplier"))
        .optional()?
    {
        None => 0.0,
        Some(v) if v.is_finite() => v / 0.1,
        Some(v) => {
            return Err(invalid(format!(
                "{a}.rope.scaling.yarn_log_multiplier = {v} is not finite"
            )))
        }
    };
    let mut yarn = yarn;
    let ln = |fs: f32| libm::logf(1.0 / fs);
    if let Some(y) = yarn
        .as_mut()
        .filter(|y| y.ext_factor != 0.0 && log_mul != 0.0)
    {
        y.attn_factor /= 1.0 + 0.1 * ln(y.freq_scale);
    }
    let (attn_factor, fs) = yarn.map_or((1.0, 1.0), |y| (y.attn_factor, y.freq_scale));
    let mscale = attn_factor * (1.0 + 0.1 * ln(fs)) * (1.0 + 0.1 * log_mul * ln(fs));
    let shape = MlaShape {
        q_lora,
        kv_lora,
        nope: key_len - rope,
        rope,
        v_head_dim,
        kq_scale: mscale * mscale / libm::sqrtf(key_len as f32),
    };
    Ok((shape, yarn))
}

/// A 3-D tensor `{cols, rows, n}` as one `n * rows` x `cols` matrix (the
/// heads' blocks of deepseek2's `attn_k_b` and `attn_v_b`).
fn stacked_ref(
    g: &Gguf<MappedFile>,
    name: &str,
    rows: usize,
    cols: usize,
    n: usize,
) -> Result<Tref, ModelError> {
    let t = g.require_tensor(name)?;
    if t.dims() != [cols as u64, rows as u64, n as u64] {
        return Err(invalid(format!(
            "tensor {name} has shape {:?}, expected [{cols}, {rows}, {n}]",
            t.dims()
        )));
    }
    let ty = t.ggml_type();
    MatrixView::new(ty, n * rows, cols, t.data()).map_err(|e| {
        invalid(format!(
            "tensor {name} ({ty}) cannot be a weight matrix: {e}"
        ))
    })?;
    Ok(Tref {
        ty,
        rows: n * rows,
        cols,
        offset: t.offset() as usize,
        len: t.size() as usize,
    })
}

/// The tensors of deepseek2 layer `l`'s multi-head latent attention. Files
/// from before llama.cpp split `attn_kv_b` into `attn_k_b` and `attn_v_b`
/// are refused with the reason.
fn mla_refs(
    g: &Gguf<MappedFile>,
    l: usize,
    n_embd: usize,
    n_head: usize,
    m: MlaShape,
) -> Result<MlaRefs, ModelError> {
    let t = |s: &str| format!("blk.{l}.{s}");
    if g.tensor(&t("attn_k_b.weight")).is_none() && g.tensor(&t("attn_kv_b.weight")).is_some() {
        return Err(invalid(format!(
            "layer {l} has the unsplit attn_kv_b of older deepseek2 conversions; convert \
             the model again with a current llama.cpp (attn_k_b and attn_v_b)"
        )));
    }
    let q_rows = n_head * m.q_head();
    let (q_a, q) = if m.q_lora > 0 {
        (
            Some((
                tensor_ref(g, &t("attn_q_a.weight"), m.q_lora, n_embd)?,
                vector(g, &t("attn_q_a_norm.weight"), m.q_lora)?,
            )),
            tensor_ref(g, &t("attn_q_b.weight"), q_rows, m.q_lora)?,
        )
    } else {
        (None, tensor_ref(g, &t("attn_q.weight"), q_rows, n_embd)?)
    };
    Ok(MlaRefs {
        q_a,
        q,
        kv_a: tensor_ref(g, &t("attn_kv_a_mqa.weight"), m.latent(), n_embd)?,
        kv_a_norm: vector(g, &t("attn_kv_a_norm.weight"), m.kv_lora)?,
        k_b: stacked_ref(g, &t("attn_k_b.weight"), m.kv_lora, m.nope, n_head)?,
        v_b: stacked_ref(g, &t("attn_v_b.weight"), m.v_head_dim, m.kv_lora, n_head)?,
        wo: tensor_ref(g, &t("attn_output.weight"), n_embd, n_head * m.v_head_dim)?,
    })
}

/// qwen3next's `ssm_ba` (`2 n_v_heads` rows) as its beta and alpha
/// projections: per key head, the `beta` rows of its value heads, then their
/// `alpha` rows (llama.cpp's split of `mixed_ba`). Rows are copied as stored.
fn split_beta_alpha(bytes: &[u8], ba: Tref, shape: DeltaNetShape) -> (MatRef, MatRef) {
    let row = ba.len / ba.rows.max(1);
    let r = shape.n_v_heads / shape.n_k_heads.max(1);
    let (mut beta, mut alpha) = (
        Vec::with_capacity(ba.len / 2),
        Vec::with_capacity(ba.len / 2),
    );
    for group in bytes.chunks_exact(2 * r * row) {
        let (b, a) = group.split_at(r * row);
        beta.extend_from_slice(b);
        alpha.extend_from_slice(a);
    }
    let owned = |bytes| MatRef::Owned {
        ty: ba.ty,
        rows: shape.n_v_heads,
        cols: ba.cols,
        bytes,
    };
    (owned(beta), owned(alpha))
}

/// RoPE scaling from `{arch}.rope.scaling.*`, as llama.cpp reads it: `yarn`
/// (ext factor 1, betas 32 and 1 unless the file says otherwise) or `linear`
/// (the angles scaled by `1 / factor`, nothing else; llama.cpp's default type
/// when only a factor is given); `none`, or no factor, none.
fn rope_scaling(
    g: &Gguf<MappedFile>,
    a: &str,
    n_ctx_train: usize,
) -> Result<Option<Yarn>, ModelError> {
    let k = |s: &str| format!("{a}.rope.scaling.{s}");
    let f = |s: &str, default: f32| -> Result<f32, ModelError> {
        match g.get_f32(&k(s)).optional()? {
            Some(v) if v.is_finite() => Ok(v),
            Some(v) => Err(invalid(format!("{} = {v} is not finite", k(s)))),
            None => Ok(default),
        }
    };
    // llama.cpp's default type is `linear`: a `factor` alone scales the angles.
    let kind = g.get_str(&k("type")).optional()?.unwrap_or("linear");
    let factor = f("factor", 0.0)?;
    let ext_factor = match kind {
        "none" => return Ok(None),
        "linear" if factor == 0.0 || factor == 1.0 => return Ok(None),
        "linear" => 0.0,
        "yarn" => 1.0,
        other => {
            return Err(invalid(format!(
                "{} = {other:?}: les supports yarn, linear and none",
                k("type")
            )))
        }
    };
    if factor < 0.0 {
        return Err(invalid(format!("{} = {factor} is negative", k("factor"))));
    }
    let freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
    let n_ctx_orig = opt_usize(g, &k("original_context_length"))?.unwrap_or(n_ctx_train);
    Ok(Some(Yarn {
        freq_scale,
        ext_factor,
        attn_factor: f("attn_factor", 1.0)?,
        beta_fast: f("yarn_beta_fast", 32.0)?,
        beta_slow: f("yarn_beta_slow", 1.0)?,
        n_ctx_orig: u32::try_from(n_ctx_orig)
            .map_err(|_| invalid(format!("{} is too large", k("original_context_length"))))?,
    }))
}

/// Largest dimension accepted from metadata, to bound allocations made from it.
const MAX_DIM: usize = 1 << 20;

impl Model {
    /// Width of an input embedding from a vision projector (llama.cpp's
    /// `n_embd_inp`): `n_embd`, times one plus the deepstack layers whose
    /// features ride after it (Qwen3-VL).
    pub fn n_embd_inp(&self) -> usize {
        self.hp.n_embd * (1 + self.hybrid.n_deepstack)
    }

    /// Loads and validates the model in `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        let g = Gguf::open(path)?;
        Self::from_gguf(g)
    }

    /// Validates an opened GGUF as a model.
    pub fn from_gguf(g: Gguf<MappedFile>) -> Result<Model, ModelError> {
        let arch_name = g.architecture()?.to_string();
        let arch = Arch::from_name(&arch_name).ok_or_else(|| {
            let known: Vec<&str> = Arch::ALL.iter().map(|a| a.name()).collect();
            ModelError::Unsupported(format!("{arch_name} (les runs {})", known.join(", ")))
        })?;
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let n_layers_all = key_usize(&g, &k("block_count"))?;
        // Before anything is sized by it (per-layer keys given as one value).
        at_most(a, MAX_DIM, &[("block_count", n_layers_all)])?;
        // Multi-token-prediction blocks follow the main stack (qwen35moe, qwen3next, glm4moe); they are
        // for speculative decoding and never run in the main pass.
        let n_nextn_layers = opt_usize(&g, &k("nextn_predict_layers"))?.unwrap_or(0);
        if n_nextn_layers >= n_layers_all.max(1) {
            return Err(invalid(format!(
                "{a}.nextn_predict_layers = {n_nextn_layers} leaves no layers of {n_layers_all}"
            )));
        }
        let n_layers = n_layers_all - n_nextn_layers;
        let n_embd = key_usize(&g, &k("embedding_length"))?;
        let n_head = key_usize(&g, &k("attention.head_count"))?;
        // granitehybrid's, Nemotron-H's and LFM2's KV head counts are per
        // layer, 0 on layers without attention.
        let (n_head_kv, kv_recurrent) =
            if arch == Arch::GraniteHybrid || arch.is_nemotron() || arch.is_lfm2() {
                let (n, r) = kv_heads_by_layer(&g, a, n_layers_all, n_layers)?;
                (if n == 0 { n_head } else { n }, Some(r))
            } else {
                let n = opt_usize(&g, &k("attention.head_count_kv"))?.unwrap_or(n_head);
                (n, None)
            };
        if n_head == 0 || n_embd == 0 {
            return Err(invalid("head_count and embedding_length must be positive"));
        }
        let head_dim = opt_usize(&g, &k("attention.key_length"))?.unwrap_or(n_embd / n_head);
        let n_rot = opt_usize(&g, &k("rope.dimension_count"))?.unwrap_or(head_dim);
        // Nemotron-H: the layers with a feed-forward length are an FFN alone,
        // the others a mixer alone (its widest is `n_ff`); llama.cpp's
        // `n_ff(il) > 0`. `None` where every layer has both.
        let (n_ff, ffn_only): (usize, Option<Vec<bool>>) = if arch.is_nemotron() {
            let key = k("feed_forward_length");
            let ff = per_layer(&g, &key, n_layers_all)?
                .ok_or_else(|| invalid(format!("{key} is missing (it marks the FFN layers)")))?;
            let widest = ff[..n_layers].iter().copied().max().unwrap_or(0);
            let widest = usize::try_from(widest).unwrap_or(usize::MAX);
            (
                widest,
                Some(ff[..n_layers].iter().map(|f| *f > 0).collect()),
            )
        } else {
            (opt_usize(&g, &k("feed_forward_length"))?.unwrap_or(0), None)
        };
        let rope_base = g
            .get_f32(&k("rope.freq_base"))
            .optional()?
            .unwrap_or(10000.0);
        let mut norm_eps = g
            .get_f32(&k("attention.layer_norm_rms_epsilon"))
            .optional()?;
        if arch.is_nemotron() && norm_eps.is_none() {
            // llama.cpp's nemotron_h loader: the layer norm's epsilon, which
            // it requires.
            let key = k("attention.layer_norm_epsilon");
            norm_eps = Some(g.get_f32(&key).optional()?.ok_or_else(|| {
                invalid(format!(
                    "{key} is missing (and {a}.attention.layer_norm_rms_epsilon)"
                ))
            })?);
        }
        let norm_eps = norm_eps.unwrap_or(1e-6);
        let n_ctx_train = opt_usize(&g, &k("context_length"))?.unwrap_or(4096);
        let emb = g.require_tensor("token_embd.weight")?;
        let n_vocab =
            *emb.dims()
                .get(1)
                .ok_or_else(|| invalid("token_embd.weight must be 2-D"))? as usize;
        at_most(
            a,
            MAX_DIM,
            &[
                ("block_count", n_layers),
                ("embedding_length", n_embd),
                ("head_count", n_head),
                ("head_count_kv", n_head_kv),
                ("key_length", head_dim),
                ("feed_forward_length", n_ff),
            ],
        )?;
        // llama.cpp's dense Qwen loaders read no experts.
        let n_experts = match arch {
            Arch::Qwen3 | Arch::Qwen2 => 0,
            _ => opt_usize(&g, &k("expert_count"))?.unwrap_or(0),
        };
        let moe = if n_experts > 0 {
            let top_k = key_usize(&g, &k("expert_used_count"))?;
            let n_ff_exp = match arch {
                // llama.cpp's minimax-m2, hunyuan-moe and granitemoe loaders
                // size their experts by `n_ff`.
                Arch::MinimaxM2 | Arch::HunyuanMoe | Arch::GraniteMoe | Arch::GraniteHybrid => n_ff,
                // llama.cpp's qwen3vlmoe: without the key, n_ff over the picks.
                Arch::Qwen3VlMoe | Arch::NemotronH | Arch::NemotronHMoe => {
                    uniform_usize(&g, &k("expert_feed_forward_length"), n_layers_all)?
                        .unwrap_or(n_ff / top_k.max(1))
                }
                _ => uniform_usize(&g, &k("expert_feed_forward_length"), n_layers_all)?
                    .unwrap_or(n_ff),
            };
            let mut gating = match opt_usize(&g, &k("expert_gating_func"))? {
                // 0 ("none") is llama.cpp's default: a softmax, glm4moe's a
                // sigmoid; its smallthinker graph aborts on it.
                None | Some(0) if arch == Arch::Glm4Moe => Gating::Sigmoid,
                None | Some(0) if arch == Arch::SmallThinker => {
                    return Err(invalid(format!(
                        "{a}.expert_gating_func must say softmax (1) or sigmoid (2): \
                         llama.cpp's graph has no default for it"
                    )))
                }
                None | Some(0) => Gating::Softmax,
                Some(x) => u32::try_from(x)
                    .ok()
                    .and_then(Gating::from_gguf)
                    .ok_or_else(|| invalid(format!("{a}.expert_gating_func = {x} is unknown")))?,
            };
            let mut normalize = g
                .get_bool(&k("expert_weights_norm"))
                .optional()?
                .unwrap_or(arch.default_norm_topk());
            if matches!(
                arch,
                Arch::Qwen35Moe
                    | Arch::Qwen3Next
                    | Arch::Ernie45Moe
                    | Arch::HunyuanMoe
                    | Arch::Qwen3VlMoe
                    | Arch::GraniteMoe
                    | Arch::GraniteHybrid
            ) {
                // llama.cpp's graph for this arch fixes both, whatever the metadata.
                gating = Gating::Softmax;
                normalize = true;
            }
            if arch == Arch::MinimaxM2 {
                // Its graph renormalises whatever the metadata says.
                normalize = true;
            }
            // llama.cpp's lfm2moe and smallthinker renormalise and, not
            // reading the key, never scale.
            let fixed_scale = matches!(arch, Arch::Lfm2Moe | Arch::SmallThinker);
            if fixed_scale {
                normalize = true;
            }
            if arch == Arch::Ernie45Moe {
                // llama.cpp's loader makes every layer past the leading dense
                // ones an MoE layer and its graph then uses dense weights for
                // those off the step: only a step of 1 runs there.
                match opt_usize(&g, &k("interleave_moe_layer_step"))? {
                    Some(1) => {}
                    None | Some(0) => {
                        return Err(invalid(format!(
                            "{a}.interleave_moe_layer_step must be given and positive"
                        )))
                    }
                    Some(step) => {
                        return Err(ModelError::Unsupported(format!(
                            "{a} with experts every {step} layers (interleave_moe_layer_step); \
                             llama.cpp runs a step of 1 only"
                        )))
                    }
                }
            }
            let mut weights_scale = match g.get_f32(&k("expert_weights_scale")).optional()? {
                _ if fixed_scale => 1.0,
                // llama.cpp scales the weights only when the scale is neither 0 nor 1.
                None => 1.0,
                Some(0.0) => 1.0,
                Some(x) if x.is_finite() => x,
                Some(x) => {
                    return Err(invalid(format!(
                        "{a}.expert_weights_scale = {x} is not finite"
                    )))
                }
            };
            let mut n_ff_shared = opt_usize(&g, &k("expert_shared_feed_forward_length"))?;
            if arch == Arch::Llama4 {
                // Fixed by llama.cpp's graph: sigmoid weights of the picks by
                // logit, unscaled, on the experts' inputs; the shared expert
                // as wide as a routed one, whatever the keys say.
                gating = Gating::SigmoidOfLogits;
                normalize = false;
                weights_scale = 1.0;
                n_ff_shared = Some(n_ff_exp);
            }
            let mut act = ExpertAct::SwiGlu;
            if arch == Arch::GptOss {
                // Fixed by llama.cpp's graph for this arch, as are alpha and limit.
                gating = Gating::SoftmaxWeight;
                normalize = false;
                act = ExpertAct::SwiGluOai {
                    alpha: 1.702,
                    limit: 7.0,
                };
            }
            if arch == Arch::SmallThinker {
                // Fixed by llama.cpp's graph (`LLM_FFN_RELU`, gated).
                act = ExpertAct::ReGlu;
            }
            if arch.is_nemotron() {
                // Fixed by llama.cpp's graph: each expert's sigmoid, ungated
                // ReLU² experts.
                gating = Gating::Sigmoid;
                act = ExpertAct::ReluSqr;
                if opt_usize(&g, &k("moe_latent_size"))?.is_some_and(|n| n > 0) {
                    return Err(ModelError::Unsupported(format!(
                        "{a} with latent experts ({a}.moe_latent_size: Nemotron 3 Super)"
                    )));
                }
            }
            // Group-limited routing, read for every architecture as llama.cpp
            // does (a count of 0 or 1 is none).
            let groups = match opt_usize(&g, &k("expert_group_count"))? {
                None | Some(0) | Some(1) => None,
                Some(count) => Some(ExpertGroups {
                    count,
                    used: opt_usize(&g, &k("expert_group_used_count"))?.unwrap_or(0),
                }),
            };
            Some(MoeParams {
                n_experts,
                top_k,
                n_ff_exp,
                gating,
                normalize,
                weights_scale,
                n_ff_shared,
                act,
                groups,
                weight_inputs: arch == Arch::Llama4,
                route_before_attention: arch == Arch::SmallThinker,
            })
        } else if arch == Arch::Llama4 {
            return Err(invalid(format!(
                "{a}.expert_count must be positive (llama.cpp's loader refuses a \
                 Llama 4 without experts)"
            )));
        } else {
            None
        };
        // Llama 4's experts are on every `interleave_moe_layer_step`-th layer.
        let moe_step = match arch {
            Arch::Llama4 => match opt_usize(&g, &k("interleave_moe_layer_step"))? {
                Some(step) if step > 0 => Some(step),
                _ => {
                    return Err(invalid(format!(
                        "{a}.interleave_moe_layer_step must be given and positive"
                    )))
                }
            },
            _ => None,
        };
        let rope_yarn = rope_scaling(&g, a, n_ctx_train)?;
        // GLM-4.xV's language models carry M-RoPE sections: llama.cpp then
        // rotates by them (ggml's plain MROPE, image tokens at their grid
        // positions) where the first two are positive, else by NeoX RoPE.
        let glm_mrope = if arch == Arch::Glm4Moe && g.get(&k("rope.dimension_sections")).is_some() {
            let sections = rope_sections(&g, a)?;
            (sections[0] > 0 && sections[1] > 0).then_some(Mrope {
                sections,
                interleaved: false,
            })
        } else {
            None
        };
        // Sliding-window attention: gpt-oss's even layers (llama.cpp's
        // `set_swa_pattern(2)`), over `attention.sliding_window` positions.
        let swa = match (arch, opt_usize(&g, &k("attention.sliding_window"))?) {
            (Arch::GptOss, Some(0)) | (Arch::GptOss, None) => {
                return Err(invalid(format!(
                    "{a}.attention.sliding_window must be a positive window"
                )))
            }
            (Arch::GptOss, Some(window)) => Some(SlidingWindow { window, pattern: 2 }),
            _ => None,
        };
        // LFM2.5's dense models: every attention layer sees the last
        // `attention.sliding_window` positions (llama.cpp's lfm2 loader; 0 or
        // none: full attention). Their caches stay whole (no ring).
        let lfm2_window = match arch {
            Arch::Lfm2 => opt_usize(&g, &k("attention.sliding_window"))?.filter(|w| *w > 0),
            _ => None,
        };
        let llama4 = match arch {
            Arch::Llama4 => Some(llama4_attention(&g, a, n_layers, rope_base, n_experts)?),
            _ => None,
        };
        let smallthinker = match arch {
            Arch::SmallThinker => Some(SmallThinkerAttention::read(&g, a, n_layers, rope_base)?),
            _ => None,
        };
        // Multi-head latent attention attends over one cached latent head of
        // kv_lora + rope dimensions; YaRN's scale goes into the attention.
        let (mla, n_head_kv, head_dim, rope_yarn) = if arch == Arch::Deepseek2 {
            let (shape, yarn) = mla_shape(&g, a, n_rot, rope_yarn)?;
            (Some(shape), 1, shape.latent(), yarn)
        } else {
            (None, n_head_kv, head_dim, rope_yarn)
        };
        let scales = match arch {
            Arch::Granite | Arch::GraniteMoe | Arch::GraniteHybrid => granite_scales(&g, arch, a)?,
            _ => Scales::NONE,
        };
        let hp = Hparams {
            n_layers,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            n_vocab,
            n_ff,
            rope_base,
            rope_style: arch.rope_style(),
            norm_eps,
            moe,
            rope_yarn,
            scales,
        };
        hp.validate().map_err(|e| invalid(format!("{a}: {e}")))?;
        let (hybrid, recurrent) = if matches!(arch, Arch::Qwen35Moe | Arch::Qwen3Next) {
            hybrid_params(&g, arch, &hp, n_layers_all)?
        } else if let Some(no_kv) = kv_recurrent {
            // Nemotron-H's FFN layers have no KV heads either.
            let ffn_at = |l: usize| ffn_only.as_ref().is_some_and(|f| f[l]);
            let recurrent: Vec<bool> = (0..n_layers).map(|l| no_kv[l] && !ffn_at(l)).collect();
            let n_ffn_only = (0..n_layers).filter(|&l| ffn_at(l)).count();
            let hy = if arch.is_lfm2() {
                shortconv_params(&g, a, &hp, &recurrent)?
            } else {
                mamba2_params(&g, a, &hp, &recurrent, n_ffn_only)?
            };
            (hy, recurrent)
        } else {
            let rope_sections = match arch {
                Arch::Qwen3VlMoe | Arch::Qwen3Vl => Some(Mrope {
                    sections: rope_sections(&g, a)?,
                    interleaved: true,
                }),
                _ => glm_mrope,
            };
            // Qwen3-VL: image embeddings carry the vision tower's deepstack
            // features, added after the first layers (llama.cpp reads the
            // key as optional).
            let n_deepstack = match arch {
                Arch::Qwen3VlMoe | Arch::Qwen3Vl => {
                    let n = opt_usize(&g, &format!("{a}.n_deepstack_layers"))?.unwrap_or(0);
                    if n > n_layers {
                        return Err(invalid(format!(
                            "{a}.n_deepstack_layers = {n}, more than the {n_layers} layers"
                        )));
                    }
                    n
                }
                _ => 0,
            };
            let hy = HybridParams {
                mla,
                rope_sections,
                n_deepstack,
                ..HybridParams::plain(&hp)
            };
            hy.validate(&hp).map_err(|e| invalid(format!("{a}: {e}")))?;
            (hy, vec![false; n_layers])
        };

        // bailingmoe2's and dots1's shared experts are this many experts wide
        // (their loaders require the key).
        let shared_count = match arch {
            Arch::BailingMoe2 | Arch::Dots1 => {
                Some(key_usize(&g, &k("expert_shared_count"))?.min(MAX_DIM))
            }
            _ => None,
        };
        let packed = crate::pack::PackedIndex::from_gguf(&g)
            .map_err(|e| invalid(format!("packed expert index: {e}")))?;
        // Granite 4.0-H's and Nemotron-H's attention layers: no RoPE, and
        // nothing in its place.
        let no_rope = arch.is_nemotron() || (arch == Arch::GraniteHybrid && !granite_rope(&g, a)?);
        // Their experts and FFNs have no gate: `relu(up x)^2`.
        let ungated = arch.is_nemotron();
        let load_layer = |l: usize, is_recurrent: bool| -> Result<LayerRefs, ModelError> {
            let t = |s: &str| format!("blk.{l}.{s}");
            let (q_dim, kv_dim) = (hp.q_dim(), hp.kv_dim());
            // Q/K norms: per head (qwen3) or over the whole vector (olmoe).
            let qk_norm = |name: &str, full: usize| -> Result<Option<Vec<f32>>, ModelError> {
                match g.tensor(&t(name)) {
                    None => Ok(None),
                    Some(x) if x.n_elements() == head_dim as u64 => {
                        vector(&g, &t(name), head_dim).map(Some)
                    }
                    Some(_) => vector(&g, &t(name), full).map(Some),
                }
            };
            let packed_layer = packed.as_ref().and_then(|p| p.layer(l)).cloned();
            let has_router = g.tensor(&t("ffn_gate_inp.weight")).is_some();
            if let Some(step) = moe_step {
                if has_router != (l + 1).is_multiple_of(step) {
                    return Err(invalid(format!(
                        "layer {l} {} routed experts, but {a}.interleave_moe_layer_step = {step} \
                         puts them on layers {}, {}, ...",
                        if has_router { "has" } else { "lacks" },
                        step - 1,
                        2 * step - 1
                    )));
                }
                if has_router && g.tensor(&t("ffn_gate_shexp.weight")).is_none() {
                    return Err(invalid(format!(
                        "{a} layer {l} has no shared expert ({} is missing)",
                        t("ffn_gate_shexp.weight")
                    )));
                }
            }
            // Nemotron-H: an FFN layer has no mixer (`Some(true)`), the
            // others no FFN (`Some(false)`).
            let one_sublayer = ffn_only.as_ref().and_then(|f| f.get(l).copied());
            let ffn = if one_sublayer == Some(false) {
                FfnRefs::None
            } else if has_router {
                let m = moe.ok_or_else(|| {
                    invalid(format!("layer {l} has a router but no {a}.expert_count"))
                })?;
                let shared = match (g.tensor(&t("ffn_gate_shexp.weight")), m.n_ff_shared) {
                    // Nemotron-H's: ungated, always there, as wide as the key says.
                    _ if ungated => {
                        let n_sh = m.n_ff_shared.ok_or_else(|| {
                            invalid(format!("{a}.expert_shared_feed_forward_length is missing"))
                        })?;
                        Some((
                            FfnMatrices {
                                gate: None,
                                up: tensor_ref(&g, &t("ffn_up_shexp.weight"), n_sh, n_embd)?,
                                down: tensor_ref(&g, &t("ffn_down_shexp.weight"), n_embd, n_sh)?,
                            },
                            None,
                        ))
                    }
                    (None, _) => None,
                    (Some(sh), n) => {
                        let n_sh = match shared_count {
                            // llama.cpp's dots1: an expert's width times the
                            // shared experts, whatever the key says.
                            Some(count) if arch == Arch::Dots1 => m.n_ff_exp.saturating_mul(count),
                            // Its bailingmoe2: the key (else an expert's
                            // width) times the shared experts.
                            Some(count) => n.unwrap_or(m.n_ff_exp).saturating_mul(count),
                            None => n.unwrap_or(*sh.dims().get(1).unwrap_or(&0) as usize),
                        };
                        Some((
                            FfnMatrices {
                                gate: Some(tensor_ref(
                                    &g,
                                    &t("ffn_gate_shexp.weight"),
                                    n_sh,
                                    n_embd,
                                )?),
                                up: tensor_ref(&g, &t("ffn_up_shexp.weight"), n_sh, n_embd)?,
                                down: tensor_ref(&g, &t("ffn_down_shexp.weight"), n_embd, n_sh)?,
                            },
                            optional_tensor_ref(&g, &t("ffn_gate_inp_shexp.weight"), 1, n_embd)?,
                        ))
                    }
                };
                let (ne, nf) = (m.n_experts, m.n_ff_exp);
                let expert_bias = match g.tensor(&t("ffn_gate_exps.bias")) {
                    None => None,
                    Some(_) => Some(Box::new([
                        vector(&g, &t("ffn_gate_exps.bias"), ne * nf)?,
                        vector(&g, &t("ffn_up_exps.bias"), ne * nf)?,
                        vector(&g, &t("ffn_down_exps.bias"), ne * n_embd)?,
                    ])),
                };
                FfnRefs::Moe {
                    router: tensor_ref(&g, &t("ffn_gate_inp.weight"), m.n_experts, n_embd)?,
                    experts: match packed_layer {
                        Some(p) => {
                            let f = p.format;
                            if f.n_embd != n_embd || f.n_ff != m.n_ff_exp {
                                return Err(invalid(format!(
                                    "packed layer {l} has the wrong expert shape"
                                )));
                            }
                            if f.gate.is_some() == ungated {
                                return Err(invalid(format!(
                                    "packed layer {l}'s experts {} a gate, {a}'s {}",
                                    if ungated { "have" } else { "lack" },
                                    if ungated { "have none" } else { "have one" },
                                )));
                            }
                            ExpertStore::Packed(Box::new(p))
                        }
                        None => {
                            let stack = |name: &str, rows, cols| {
                                expert_stack(&g, &t(name), rows, cols, m.n_experts)
                            };
                            let gate = if ungated {
                                None
                            } else {
                                Some(stack("ffn_gate_exps.weight", m.n_ff_exp, n_embd)?)
                            };
                            ExpertStore::Plain(Stacks {
                                gate,
                                up: stack("ffn_up_exps.weight", m.n_ff_exp, n_embd)?,
                                down: stack("ffn_down_exps.weight", n_embd, m.n_ff_exp)?,
                            })
                        }
                    },
                    shared,
                    router_bias: optional_vector(&g, &t("ffn_gate_inp.bias"), m.n_experts)?,
                    selection_bias: if ungated {
                        // llama.cpp's nemotron_h loader requires it.
                        Some(vector(&g, &t("exp_probs_b.bias"), m.n_experts)?)
                    } else {
                        optional_vector(&g, &t("exp_probs_b.bias"), m.n_experts)?
                    },
                    expert_bias,
                }
            } else {
                let gate = if ungated {
                    for bias in ["ffn_up.bias", "ffn_down.bias"] {
                        if g.tensor(&t(bias)).is_some() {
                            return Err(ModelError::Unsupported(format!(
                                "an FFN with biases ({})",
                                t(bias)
                            )));
                        }
                    }
                    None
                } else {
                    Some(tensor_ref(&g, &t("ffn_gate.weight"), n_ff, n_embd)?)
                };
                FfnRefs::Dense(FfnMatrices {
                    gate,
                    up: tensor_ref(&g, &t("ffn_up.weight"), n_ff, n_embd)?,
                    down: tensor_ref(&g, &t("ffn_down.weight"), n_embd, n_ff)?,
                })
            };
            let mixer = match (hybrid.linear, hybrid.mla) {
                _ if one_sublayer == Some(true) => MixerRefs::None,
                (Some((_, LinearShape::DeltaNet(d))), _) if is_recurrent => {
                    MixerRefs::DeltaNet(delta_refs(&g, l, n_embd, d)?)
                }
                (Some((_, LinearShape::Mamba2(m))), _) if is_recurrent => {
                    MixerRefs::Mamba2(mamba2_refs(&g, l, n_embd, m)?)
                }
                (Some((_, LinearShape::ShortConv(c))), _) if is_recurrent => {
                    MixerRefs::ShortConv(shortconv_refs(&g, l, n_embd, c)?)
                }
                (_, Some(m)) => MixerRefs::Mla(mla_refs(&g, l, n_embd, n_head, m)?),
                _ => {
                    // A gated query projection yields a query and a gate per head.
                    let q_rows = if hybrid.attn_output_gate {
                        2 * q_dim
                    } else {
                        q_dim
                    };
                    // A fused projection (bailingmoe2's `attn_qkv`, which
                    // llama.cpp's loaders take for any plain attention): the
                    // query, key and value rows one after another.
                    let fused =
                        !hybrid.attn_output_gate && g.tensor(&t("attn_qkv.weight")).is_some();
                    let [wq, wk, wv] = if fused {
                        let qkv =
                            tensor_ref(&g, &t("attn_qkv.weight"), q_rows + 2 * kv_dim, n_embd)?;
                        [
                            qkv.rows(0, q_rows),
                            qkv.rows(q_rows, kv_dim),
                            qkv.rows(q_rows + kv_dim, kv_dim),
                        ]
                    } else {
                        [
                            tensor_ref(&g, &t("attn_q.weight"), q_rows, n_embd)?,
                            tensor_ref(&g, &t("attn_k.weight"), kv_dim, n_embd)?,
                            tensor_ref(&g, &t("attn_v.weight"), kv_dim, n_embd)?,
                        ]
                    };
                    if fused && g.tensor(&t("attn_qkv.bias")).is_some() {
                        return Err(ModelError::Unsupported(format!(
                            "a fused QKV bias ({}): none of the architectures les runs has one",
                            t("attn_qkv.bias")
                        )));
                    }
                    let [bq, bk, bv] = [
                        optional_vector(&g, &t("attn_q.bias"), q_dim)?,
                        optional_vector(&g, &t("attn_k.bias"), kv_dim)?,
                        optional_vector(&g, &t("attn_v.bias"), kv_dim)?,
                    ];
                    MixerRefs::Attention(AttnRefs {
                        wq,
                        wk,
                        wv,
                        wo: tensor_ref(&g, &t("attn_output.weight"), n_embd, q_dim)?,
                        bq,
                        bk,
                        bv,
                        q_norm: match &llama4 {
                            Some(l4) => l4.unit_norm(l, head_dim),
                            None => qk_norm("attn_q_norm.weight", q_dim)?,
                        },
                        k_norm: match &llama4 {
                            Some(l4) => l4.unit_norm(l, head_dim),
                            None => qk_norm("attn_k_norm.weight", kv_dim)?,
                        },
                        bo: optional_vector(&g, &t("attn_output.bias"), n_embd)?,
                        sinks: optional_vector(&g, &t("attn_sinks.weight"), hp.n_head)?,
                        window: match (&llama4, &smallthinker) {
                            (Some(l4), _) => l4.window(l),
                            (_, Some(st)) => st.window(l),
                            _ => swa
                                .and_then(|w| w.of_layer(l))
                                .or(lfm2_window)
                                .map(AttnWindow::Sliding),
                        },
                        nope: match &llama4 {
                            Some(l4) => l4.nope(l),
                            // Granite 4.0-H: no position encoding at all;
                            // SmallThinker's every fourth layer.
                            None if no_rope => Some(AttnTemperature::NONE),
                            None if smallthinker.as_ref().is_some_and(|st| st.nope(l)) => {
                                Some(AttnTemperature::NONE)
                            }
                            None => None,
                        },
                    })
                }
            };
            let ffn_norm = if matches!(
                arch,
                Arch::Qwen35Moe | Arch::Qwen3Next | Arch::GptOss | Arch::Glm4Moe
            ) {
                "post_attention_norm.weight"
            } else {
                "ffn_norm.weight"
            };
            let attn_norm = vector(&g, &t("attn_norm.weight"), n_embd)?;
            // Nemotron-H norms every layer's one sub-layer by `attn_norm`.
            let ffn_norm = if arch.is_nemotron() {
                attn_norm.clone()
            } else {
                vector(&g, &t(ffn_norm), n_embd)?
            };
            Ok(LayerRefs {
                attn_norm,
                mixer,
                ffn_norm,
                ffn,
            })
        };
        let mut layers = Vec::with_capacity(n_layers);
        for (l, &is_recurrent) in recurrent.iter().enumerate() {
            layers.push(load_layer(l, is_recurrent)?);
        }
        // The first multi-token-prediction block, where the file has its tensors
        // (a `--no-mtp` conversion keeps none): a full-attention layer with
        // routed experts, plus its own input projection and norms.
        let load_nextn = || -> Result<NextnRefs, ModelError> {
            let layer = load_layer(n_layers, false)?;
            if !matches!(layer.ffn, FfnRefs::Moe { .. }) {
                return Err(invalid(format!(
                    "the multi-token-prediction block blk.{n_layers} has no routed experts"
                )));
            }
            let t = |s: &str| format!("blk.{n_layers}.nextn.{s}");
            let optional = |name: &str| optional_tensor_ref(&g, &t(name), n_vocab, n_embd);
            Ok(NextnRefs {
                layer,
                eh_proj: tensor_ref(&g, &t("eh_proj.weight"), n_embd, 2 * n_embd)?,
                enorm: vector(&g, &t("enorm.weight"), n_embd)?,
                hnorm: vector(&g, &t("hnorm.weight"), n_embd)?,
                embedding: optional("embed_tokens.weight")?,
                head_norm: optional_vector(&g, &t("shared_head_norm.weight"), n_embd)?,
                head: optional("shared_head_head.weight")?,
            })
        };
        // A malformed block only matters to `--speculate mtp`, which reports
        // why; the model runs without it, as llama.cpp's skips it unasked.
        let nextn = if arch.is_nemotron() && n_nextn_layers > 0 {
            Err(format!(
                "{a}'s multi-token-prediction block is not run (it folds attention and \
                 experts into one layer, which LES's nextn pass does not)"
            ))
        } else if arch == Arch::BailingMoe2 && n_nextn_layers > 0 {
            Err(format!(
                "{a}'s multi-token-prediction layers are not run (llama.cpp skips them too)"
            ))
        } else if n_nextn_layers > 0
            && g.tensor(&format!("blk.{n_layers}.nextn.eh_proj.weight"))
                .is_some()
        {
            load_nextn().map(Some).map_err(|e| e.to_string())
        } else {
            Ok(None)
        };
        // Llama 3.1's RoPE scaling, as llama.cpp's llama loader reads it (its
        // other loaders here ignore the tensor).
        let rope_freqs = match arch {
            Arch::Llama | Arch::Llama4 | Arch::Granite | Arch::GraniteMoe | Arch::GraniteHybrid => {
                optional_vector(&g, "rope_freqs.weight", hp.n_rot / 2)?
            }
            _ => None,
        };
        let embedding = tensor_ref(&g, "token_embd.weight", n_vocab, n_embd)?;
        let output = if g.tensor("output.weight").is_some() {
            tensor_ref(&g, "output.weight", n_vocab, n_embd)?
        } else {
            embedding // tied embeddings
        };
        // LFM2's final norm is named `token_embd_norm` (llama.cpp's
        // OUTPUT_NORM_LFM2).
        let output_norm = if arch.is_lfm2() {
            "token_embd_norm.weight"
        } else {
            "output_norm.weight"
        };
        let output_norm = vector(&g, output_norm, n_embd)?;
        Ok(Model {
            gguf: g,
            arch,
            hp,
            hybrid,
            n_nextn_layers,
            n_ctx_train,
            kv_window: swa.or(llama4.as_ref().and_then(|l4| l4.kv_window())),
            rope_freqs,
            layers,
            nextn,
            embedding,
            output,
            output_norm,
            lookahead_routers: std::sync::OnceLock::new(),
        })
    }

    /// The underlying GGUF.
    pub fn gguf(&self) -> &Gguf<MappedFile> {
        &self.gguf
    }

    fn view(&self, t: &Tref) -> MatrixView<'_> {
        let bytes = &self.gguf.bytes()[t.offset..t.offset + t.len];
        MatrixView::new(t.ty, t.rows, t.cols, bytes).expect("shape and bytes validated at load")
    }

    fn mat<'m>(&'m self, m: &'m MatRef) -> MatrixView<'m> {
        match m {
            MatRef::File(t) => self.view(t),
            MatRef::Owned {
                ty,
                rows,
                cols,
                bytes,
            } => MatrixView::new(*ty, *rows, *cols, bytes)
                .expect("rows copied whole from a validated tensor"),
        }
    }

    /// The experts of layer `layer`; layer `n_layers` is the nextn block's.
    fn store(&self, layer: usize) -> Option<&ExpertStore> {
        let refs = match self.layers.get(layer) {
            Some(l) => l,
            None if layer == self.hp.n_layers => &self.nextn.as_ref().ok()?.as_ref()?.layer,
            None => return None,
        };
        match &refs.ffn {
            FfnRefs::Moe { experts, .. } => Some(experts),
            FfnRefs::Dense(_) | FfnRefs::None => None,
        }
    }

    /// Whether layer `layer` has routed experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.store(layer).is_some()
    }

    /// Whether the experts are packed (`les pack`): one aligned extent each.
    pub fn is_packed(&self) -> bool {
        (0..self.hp.n_layers).any(|l| matches!(self.store(l), Some(ExpertStore::Packed(_))))
    }

    /// The layout of layer `layer`'s expert in a slot (gate, up, down back to back).
    pub fn expert_format(&self, layer: usize) -> Option<ExpertFormat> {
        Some(match self.store(layer)? {
            ExpertStore::Plain(s) => ExpertFormat {
                gate: s.gate.as_ref().map(|g| g.ty),
                up: s.up.ty,
                down: s.down.ty,
                n_embd: s.up.cols,
                n_ff: s.up.rows,
            },
            ExpertStore::Packed(p) => p.format,
        })
    }

    /// Bytes read for one expert of `layer` (a packed expert is read whole,
    /// padding included, so O_DIRECT can serve it).
    fn expert_read_bytes(&self, layer: usize) -> Option<usize> {
        Some(match self.store(layer)? {
            ExpertStore::Plain(s) => s.parts().map(|x| x.stride).sum(),
            ExpertStore::Packed(p) => p.stride as usize,
        })
    }

    /// Bytes of the largest expert read of any layer (the slot size).
    pub fn max_expert_bytes(&self) -> usize {
        (0..self.hp.n_layers)
            .filter_map(|l| self.expert_read_bytes(l))
            .max()
            .unwrap_or(0)
    }

    /// The slot sizes the experts need, per MoE layer: each layer's expert read
    /// size rounded up to the slot alignment, times its expert count (for
    /// `les_core::slot_classes`).
    pub fn expert_size_groups(&self) -> Vec<SizeGroup> {
        let n = self.hp.moe.map_or(0, |m| m.n_experts) as u32;
        (0..self.hp.n_layers)
            .filter_map(|l| self.expert_read_bytes(l))
            .map(|b| SizeGroup {
                bytes: b.next_multiple_of(SLOT_ALIGN).min(u32::MAX as usize) as u32,
                count: n,
            })
            .collect()
    }

    /// The index in `classes` (smallest first) of the slots layer `layer`'s
    /// experts take; `None` for a layer without experts.
    pub fn slot_class_of(&self, classes: &[SlotClass], layer: usize) -> Option<usize> {
        let need = u32::try_from(self.expert_read_bytes(layer)?).ok()?;
        class_for(classes, need)
    }

    /// Total bytes of routed experts in the file.
    pub fn total_expert_bytes(&self) -> u64 {
        let n = self.hp.moe.map_or(0, |m| m.n_experts) as u64;
        (0..self.hp.n_layers)
            .filter_map(|l| self.expert_read_bytes(l))
            .map(|b| b as u64 * n)
            .sum()
    }

    /// Bytes of slots that hold every expert at once: the
    /// [`expert_size_groups`](Self::expert_size_groups) the slot planner takes
    /// (each expert's read rounded up to a slot). `--expert-mem 100%` is this much.
    pub fn expert_slot_bytes(&self) -> u64 {
        self.expert_size_groups()
            .iter()
            .map(|g| g.bytes as u64 * g.count as u64)
            .sum()
    }

    /// The file bytes of the routed experts, one range per expert tensor (a
    /// plain GGUF's three stacks of a layer, or a packed layer's tensor).
    pub fn expert_ranges(&self) -> Vec<std::ops::Range<u64>> {
        let n = self.hp.moe.map_or(0, |m| m.n_experts) as u64;
        let mut out = Vec::new();
        for layer in 0..=self.hp.n_layers {
            match self.store(layer) {
                Some(ExpertStore::Plain(stacks)) => {
                    for s in stacks.parts() {
                        out.push(s.offset as u64..s.offset as u64 + s.stride as u64 * n);
                    }
                }
                Some(ExpertStore::Packed(p)) => out.push(p.offset..p.offset + p.stride * n),
                None => {}
            }
        }
        out
    }

    /// Brings the resident weights (every tensor's data but the routed
    /// experts': embeddings, attention, norms, routers, shared experts, the
    /// output layer) into memory, and returns their bytes.
    ///
    /// They are used from the file's mapping; without this, a page the
    /// decode needs for the first time (above all an embedding row, of which
    /// each new token reads one) is read from the file by a page fault in the
    /// middle of a token, with the device otherwise idle: up to 17 ms a token
    /// on `a3b` after the page cache was dropped. Experts are read by the
    /// file device into slots and stay out of the page cache. The reads are
    /// [`MappedFile::populate`]'s (large, on several threads).
    pub fn populate_resident(&self) -> u64 {
        let experts = self.expert_ranges();
        let resident: Vec<std::ops::Range<usize>> = self
            .gguf
            .tensors()
            .filter(|t| !experts.iter().any(|r| r.contains(&t.offset())))
            .map(|t| t.offset() as usize..(t.offset() + t.size()) as usize)
            .collect();
        self.gguf.source().populate(&resident);
        resident.iter().map(|r| r.len() as u64).sum()
    }

    /// Expert `expert` of layer `layer`, viewed in the mapped file.
    pub fn expert(&self, layer: usize, expert: u16) -> Option<ExpertMatrices<'_>> {
        if expert as usize >= self.hp.moe?.n_experts {
            return None;
        }
        let bytes = self.gguf.bytes();
        match self.store(layer)? {
            ExpertStore::Plain(s) => {
                let view = |x: &ExpertStack| {
                    let start = x.offset + expert as usize * x.stride;
                    MatrixView::new(x.ty, x.rows, x.cols, &bytes[start..start + x.stride])
                        .expect("expert stacks validated at load")
                };
                Some(ExpertMatrices {
                    gate: s.gate.as_ref().map(view),
                    up: view(&s.up),
                    down: view(&s.down),
                })
            }
            ExpertStore::Packed(p) => {
                let e = p.extent(expert as usize)?;
                let slot = &bytes[e.offset as usize..(e.offset + e.len) as usize];
                Some(
                    p.format
                        .matrices(slot)
                        .expect("packed index validated at load"),
                )
            }
        }
    }

    /// The file extents of an expert, placed back to back in the slot: three for a
    /// plain GGUF (gate, up, down), one aligned extent for a packed file.
    pub fn expert_extents(&self, key: ExpertKey) -> Extents {
        let mut ext = Extents::new();
        match self.store(key.layer as usize) {
            Some(ExpertStore::Plain(s)) => {
                let mut at = 0u32;
                for x in s.parts() {
                    let _ = ext.push(Extent {
                        offset: (x.offset + key.expert as usize * x.stride) as u64,
                        len: x.stride as u32,
                        slot_offset: at,
                    });
                    at += x.stride as u32;
                }
            }
            Some(ExpertStore::Packed(p)) => {
                if let Some(e) = p.extent(key.expert as usize) {
                    let _ = ext.push(Extent {
                        offset: e.offset,
                        len: e.padded_len as u32,
                        slot_offset: 0,
                    });
                }
            }
            None => {}
        }
        ext
    }

    /// The checksum of every packed expert's read, by file offset, for
    /// [`FileDevice::set_checks`](crate::flash::FileDevice::set_checks) (empty
    /// for a plain GGUF).
    pub fn read_checks(&self) -> ReadChecks {
        let mut checks = Vec::new();
        for l in 0..self.hp.n_layers {
            if let Some(ExpertStore::Packed(p)) = self.store(l) {
                for (e, &crc) in p.checksums.iter().enumerate() {
                    let (Some(x), Ok(len)) = (p.extent(e), u32::try_from(p.expert_bytes)) else {
                        continue;
                    };
                    checks.push((x.offset, Check { len, crc }));
                }
            }
        }
        ReadChecks::new(checks)
    }

    /// The CRC-32 of `key`'s expert bytes (gate, up, down back to back), stored
    /// by `les pack`; `None` in plain GGUFs.
    pub fn expert_checksum(&self, key: ExpertKey) -> Option<u32> {
        match self.store(key.layer as usize) {
            Some(ExpertStore::Packed(p)) => p.checksums.get(key.expert as usize).copied(),
            _ => None,
        }
    }

    /// Whether the bytes read for `key` match its checksum (packed files; plain
    /// GGUFs carry none).
    pub fn verify_expert(&self, key: ExpertKey, slot: &[u8]) -> bool {
        match self.store(key.layer as usize) {
            Some(ExpertStore::Packed(p)) => p.verify(key.expert as usize, slot),
            _ => true,
        }
    }
}

impl Model {
    fn ffn<'a>(&'a self, l: &'a LayerRefs) -> Ffn<'a> {
        match &l.ffn {
            FfnRefs::None => Ffn::None,
            FfnRefs::Dense(m) => Ffn::Dense {
                gate: m.gate.as_ref().map(|g| self.view(g)),
                up: self.view(&m.up),
                down: self.view(&m.down),
            },
            FfnRefs::Moe {
                router,
                shared,
                router_bias,
                selection_bias,
                expert_bias,
                ..
            } => Ffn::Moe {
                router: self.view(router),
                router_bias: router_bias.as_deref(),
                selection_bias: selection_bias.as_deref(),
                expert_bias: expert_bias.as_deref().map(|[g, u, d]| ExpertBiases {
                    gate: g,
                    up: u,
                    down: d,
                }),
                shared: shared.as_ref().map(|(m, gi)| SharedExpert {
                    gate: m.gate.as_ref().map(|g| self.view(g)),
                    up: self.view(&m.up),
                    down: self.view(&m.down),
                    gate_inp: gi.as_ref().map(|t| self.view(t)),
                }),
            },
        }
    }

    fn attention_weights<'m>(&'m self, a: &'m AttnRefs) -> AttentionWeights<'m> {
        AttentionWeights {
            wq: self.view(&a.wq),
            wk: self.view(&a.wk),
            wv: self.view(&a.wv),
            wo: self.view(&a.wo),
            bq: a.bq.as_deref(),
            bk: a.bk.as_deref(),
            bv: a.bv.as_deref(),
            q_norm: a.q_norm.as_deref(),
            k_norm: a.k_norm.as_deref(),
            bo: a.bo.as_deref(),
            sinks: a.sinks.as_deref(),
            window: a.window,
            rope_freqs: self.rope_freqs.as_deref(),
            norm_after_rope: matches!(self.arch, Arch::HunyuanMoe | Arch::Llama4),
            nope: a.nope,
        }
    }

    /// Whether layer `layer` is recurrent (gated DeltaNet or Mamba2) rather
    /// than attention.
    pub fn is_linear_layer(&self, layer: usize) -> bool {
        matches!(
            self.layers.get(layer).map(|l| &l.mixer),
            Some(MixerRefs::DeltaNet(_) | MixerRefs::Mamba2(_) | MixerRefs::ShortConv(_))
        )
    }
}

impl Model {
    /// The multi-token-prediction block the file carries, if any, as
    /// [`forward_nextn`](les_core::model::forward::nextn::forward_nextn) runs
    /// it; its routed experts are layer `n_layers`'s ([`expert`](Self::expert)).
    pub fn nextn_block(&self) -> Option<NextnBlock<'_>> {
        let n = self.nextn.as_ref().ok()?.as_ref()?;
        Some(NextnBlock {
            block: self.block_of(&n.layer),
            eh_proj: self.view(&n.eh_proj),
            enorm: &n.enorm,
            hnorm: &n.hnorm,
            embedding: self.view(n.embedding.as_ref().unwrap_or(&self.embedding)),
            head_norm: n.head_norm.as_deref().unwrap_or(&self.output_norm),
            head: self.view(n.head.as_ref().unwrap_or(&self.output)),
        })
    }

    /// Why the file's multi-token-prediction block cannot run (a tensor
    /// missing or misshapen), where it has one that cannot.
    pub fn nextn_error(&self) -> Option<&str> {
        self.nextn.as_ref().err().map(String::as_str)
    }

    fn block_of<'a>(&'a self, l: &'a LayerRefs) -> Block<'a> {
        let mixer = match &l.mixer {
            MixerRefs::None => Mixer::None,
            MixerRefs::Attention(a) => Mixer::Attention(self.attention_weights(a)),
            MixerRefs::Mla(m) => Mixer::Mla(MlaWeights {
                q_a: m.q_a.as_ref().map(|(t, norm)| (self.view(t), &norm[..])),
                q: self.view(&m.q),
                kv_a: self.view(&m.kv_a),
                kv_a_norm: &m.kv_a_norm,
                k_b: self.view(&m.k_b),
                v_b: self.view(&m.v_b),
                wo: self.view(&m.wo),
            }),
            MixerRefs::Mamba2(m) => Mixer::Mamba2(Mamba2Weights {
                shape: m.shape,
                in_proj: self.view(&m.in_proj),
                conv: &m.conv,
                conv_bias: m.conv_bias.as_deref(),
                dt_bias: &m.dt_bias,
                a: &m.a,
                d: &m.d,
                norm: &m.norm,
                out: self.view(&m.out),
            }),
            MixerRefs::ShortConv(c) => Mixer::ShortConv(ShortConvWeights {
                shape: c.shape,
                in_proj: self.view(&c.in_proj),
                conv: &c.conv,
                out: self.view(&c.out),
            }),
            MixerRefs::DeltaNet(d) => Mixer::DeltaNet(DeltaNetWeights {
                shape: d.shape,
                qkv: self.view(&d.qkv),
                gate: self.view(&d.gate),
                beta: self.mat(&d.beta),
                alpha: self.mat(&d.alpha),
                dt_bias: &d.dt_bias,
                a: &d.a,
                conv: &d.conv,
                norm: &d.norm,
                out: self.view(&d.out),
            }),
        };
        Block {
            attn_norm: &l.attn_norm,
            mixer,
            ffn_norm: &l.ffn_norm,
            ffn: self.ffn(l),
        }
    }
}

impl Weights for Model {
    fn block(&self, layer: usize) -> Block<'_> {
        self.block_of(&self.layers[layer])
    }

    fn embedding(&self) -> MatrixView<'_> {
        self.view(&self.embedding)
    }

    fn output_norm(&self) -> &[f32] {
        &self.output_norm
    }

    fn output(&self) -> MatrixView<'_> {
        self.view(&self.output)
    }

    /// A Q8_0 copy of a float (f32, f16, bf16) router: a quarter of an f32
    /// router's bytes to stream per prediction. Layers whose router is quantized
    /// already, or whose width is not a multiple of 32, predict with the router.
    fn lookahead_router(&self, layer: usize) -> Option<MatrixView<'_>> {
        let copies = self.lookahead_routers.get_or_init(|| {
            self.layers
                .iter()
                .map(|l| match &l.ffn {
                    FfnRefs::Moe { router, .. } => q8_0_copy(self.view(router)),
                    FfnRefs::Dense(_) | FfnRefs::None => None,
                })
                .collect()
        });
        let bytes = copies.get(layer)?.as_deref()?;
        let FfnRefs::Moe { router, .. } = &self.layers.get(layer)?.ffn else {
            return None;
        };
        MatrixView::new(GgmlType::Q8_0, router.rows, router.cols, bytes).ok()
    }
}

/// `m` requantized to Q8_0, if it is a float matrix whose rows are whole Q8_0
/// blocks.
fn q8_0_copy(m: MatrixView<'_>) -> Option<Vec<u8>> {
    let float = matches!(m.ty(), GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    if !float || m.cols() % 32 != 0 {
        return None;
    }
    let mut row = vec![0f32; m.cols()];
    let row_bytes = GgmlType::Q8_0.row_bytes(m.cols())?;
    let mut out = vec![0u8; row_bytes * m.rows()];
    for (i, dst) in out.chunks_exact_mut(row_bytes).enumerate() {
        quant::dequantize(m.ty(), m.row(i)?, &mut row).ok()?;
        quant::quantize(GgmlType::Q8_0, &row, dst).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::Arch;

    /// A file of an architecture les does not run says which it runs.
    #[test]
    fn unknown_architectures_are_named_with_the_known_ones() {
        use crate::gguf::{GgufWriter, MetaValue};
        let path = std::env::temp_dir().join(format!("les-arch-{}.gguf", std::process::id()));
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", MetaValue::from("jamba"))
            .unwrap();
        let file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        w.write_header(file).unwrap().finish().unwrap();
        let err = super::Model::open(&path).unwrap_err().to_string();
        let _ = std::fs::remove_file(&path);
        assert!(err.contains("unsupported architecture: jamba"), "{err}");
        for a in Arch::ALL {
            assert!(err.contains(a.name()), "{err}");
        }
    }

    /// `Arch::ALL` names each architecture once, and names read back.
    #[test]
    fn every_architecture_is_listed_once_by_its_name() {
        let names: std::collections::HashSet<&str> = Arch::ALL.iter().map(|a| a.name()).collect();
        assert_eq!(names.len(), Arch::ALL.len());
        for a in Arch::ALL {
            assert_eq!(Arch::from_name(a.name()), Some(a));
            // A new variant fails to compile here until it is listed above.
            match a {
                Arch::Llama
                | Arch::Qwen3Moe
                | Arch::Qwen2Moe
                | Arch::Olmoe
                | Arch::Qwen35Moe
                | Arch::Qwen3Next
                | Arch::GptOss
                | Arch::Glm4Moe
                | Arch::Deepseek2
                | Arch::Ernie45Moe
                | Arch::Ernie45
                | Arch::BailingMoe2
                | Arch::MinimaxM2
                | Arch::Dots1
                | Arch::HunyuanMoe
                | Arch::Llama4
                | Arch::Qwen3VlMoe
                | Arch::Qwen3Vl
                | Arch::Granite
                | Arch::GraniteMoe
                | Arch::GraniteHybrid
                | Arch::NemotronH
                | Arch::NemotronHMoe
                | Arch::Lfm2Moe
                | Arch::Lfm2
                | Arch::SmallThinker
                | Arch::Qwen3
                | Arch::Qwen2 => {}
            }
        }
    }
}
