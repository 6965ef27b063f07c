//! One token through the model: embedding, attention, dense or MoE FFN, logits.
//!
//! The forward pass owns nothing. Weights come through [`Weights`] (a mapped GGUF
//! on a host, flash on a microcontroller), matrix-vector products through
//! [`MatVec`] (one thread, or a host's thread pool), routed experts through
//! [`Experts`] (all resident, or streamed by the LES scheduler), and every buffer
//! from the caller ([`Scratch`], [`KvCache`]).
//!
//! Exactness: the arithmetic is the same whatever the [`Experts`] implementation
//! and the order it hands experts out in, because expert outputs are kept per
//! routing index and combined in router order.

use core::fmt;

use super::config::{AttnTemperature, AttnWindow, ExpertAct, Hparams, HybridParams, LinearShape};
use super::deltanet::{self, DeltaNetWeights, Projections};
use super::mamba2::{self, Mamba2Weights};
use super::ops::{
    reglu, relu_sqr, rms_norm, rms_norm_heads, rope_factored, rope_multi_scaled, sigmoid, swiglu,
    swiglu_oai, AttnShape, KvView,
};
use super::shortconv::{self, ShortConvWeights};
use crate::gemv::{activation_format, gemv, ActivationFormat, GemvError, Input, Isa, MatrixView};
use crate::quant::blocks::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use crate::quant::{self, QuantError};
use crate::router::{
    self, LayerMask, Prediction, PredictorConfig, RouterConfig, RouterError, Routing,
};

mod batch;
mod kv;
pub mod mla;
pub mod nextn;
pub use crate::slots::Residency;
pub use batch::{forward_batch, forward_batch_at, forward_sequences, BatchScratch, Sequence};
pub use kv::{KvBuf, KvCache, KvLayout, KvRing, KvType};
pub use mla::MlaWeights;

/// Weights of one shared (always-resident) expert.
#[derive(Clone, Copy, Debug)]
pub struct SharedExpert<'a> {
    /// Gate projection (`n_ff_shared` x `n_embd`); `None` for an ungated
    /// expert, whose activation is `relu(up x)^2` (Nemotron-H).
    pub gate: Option<MatrixView<'a>>,
    /// Up projection.
    pub up: MatrixView<'a>,
    /// Down projection (`n_embd` x `n_ff_shared`).
    pub down: MatrixView<'a>,
    /// Optional scalar gate (`1 x n_embd`): output scaled by `sigmoid(g . x)`.
    pub gate_inp: Option<MatrixView<'a>>,
}

/// The FFN of a layer.
#[derive(Clone, Copy, Debug)]
pub enum Ffn<'a> {
    /// A dense FFN: SwiGLU, or `relu(up x)^2` without a gate (Nemotron-H).
    Dense {
        /// Gate projection (`None`: ungated, ReLU²).
        gate: Option<MatrixView<'a>>,
        /// Up projection.
        up: MatrixView<'a>,
        /// Down projection.
        down: MatrixView<'a>,
    },
    /// Routed experts (served by [`Experts`]) plus an optional shared expert.
    Moe {
        /// Router (`n_experts` x `n_embd`).
        router: MatrixView<'a>,
        /// Shared expert.
        shared: Option<SharedExpert<'a>>,
        /// Bias added to the router's logits (gpt-oss).
        router_bias: Option<&'a [f32]>,
        /// Per-expert bias added to the gating probabilities to choose the picks,
        /// not to weigh them (DeepSeek-V3's and GLM-4.5's `exp_probs_b`).
        selection_bias: Option<&'a [f32]>,
        /// The routed experts' biases (gpt-oss), resident.
        expert_bias: Option<ExpertBiases<'a>>,
    },
    /// No FFN: the layer is its mixer alone (Nemotron-H's Mamba2 and
    /// attention layers); its `ffn_norm` is not read.
    None,
}

/// The biases of a layer's routed experts, resident (gpt-oss): expert `e`'s
/// gate and up biases are `gate[e * n_ff_exp..][..n_ff_exp]` and
/// `up[..]` alike, its down bias `down[e * n_embd..][..n_embd]`, each added
/// to its product.
#[derive(Clone, Copy, Debug)]
pub struct ExpertBiases<'a> {
    /// Gate biases, `n_experts * n_ff_exp`.
    pub gate: &'a [f32],
    /// Up biases, `n_experts * n_ff_exp`.
    pub up: &'a [f32],
    /// Down biases, `n_experts * n_embd`.
    pub down: &'a [f32],
}

impl<'a> ExpertBiases<'a> {
    /// Expert `expert`'s three biases, if the slices hold them.
    fn of(&self, expert: usize, n_ff: usize, n_embd: usize) -> Option<[&'a [f32]; 3]> {
        Some([
            self.gate.get(expert * n_ff..)?.get(..n_ff)?,
            self.up.get(expert * n_ff..)?.get(..n_ff)?,
            self.down.get(expert * n_embd..)?.get(..n_embd)?,
        ])
    }
}

/// How an expert's products are finished: the activation between gate/up and
/// down, and the expert's biases where the model has them.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertTail<'a> {
    pub(super) act: ExpertAct,
    pub(super) biases: Option<[&'a [f32]; 3]>,
}

impl ExpertTail<'_> {
    /// No biases, and SwiGLU where there is a `gate`, ReLU² where there is
    /// none (dense FFNs and shared experts).
    pub(super) fn plain(gate: Option<&MatrixView<'_>>) -> ExpertTail<'static> {
        ExpertTail {
            act: if gate.is_some() {
                ExpertAct::SwiGlu
            } else {
                ExpertAct::ReluSqr
            },
            biases: None,
        }
    }
}

/// The tail of routed expert `expert` of a layer with `biases`.
pub(super) fn expert_tail<'a, E>(
    hp: &Hparams,
    biases: Option<&ExpertBiases<'a>>,
    expert: u16,
) -> Result<ExpertTail<'a>, ForwardError<E>> {
    let Some(m) = hp.moe else {
        return Err(ForwardError::Shape("MoE layer without MoE parameters"));
    };
    let biases = match biases {
        Some(b) => Some(
            b.of(expert as usize, m.n_ff_exp, hp.n_embd)
                .ok_or(ForwardError::Shape("expert bias length"))?,
        ),
        None => None,
    };
    Ok(ExpertTail { act: m.act, biases })
}

/// The attention of a layer (full, causal, grouped-query).
#[derive(Clone, Copy, Debug)]
pub struct AttentionWeights<'a> {
    /// Query projection (`2 * q_dim` rows with an output gate, see
    /// [`HybridParams::attn_output_gate`]).
    pub wq: MatrixView<'a>,
    /// Key projection.
    pub wk: MatrixView<'a>,
    /// Value projection.
    pub wv: MatrixView<'a>,
    /// Output projection.
    pub wo: MatrixView<'a>,
    /// Query bias.
    pub bq: Option<&'a [f32]>,
    /// Key bias.
    pub bk: Option<&'a [f32]>,
    /// Value bias.
    pub bv: Option<&'a [f32]>,
    /// Query RMSNorm (per head when `head_dim` long, else over the whole vector).
    pub q_norm: Option<&'a [f32]>,
    /// Key RMSNorm (same rule).
    pub k_norm: Option<&'a [f32]>,
    /// Output projection bias (gpt-oss).
    pub bo: Option<&'a [f32]>,
    /// Attention sinks, one logit per query head (gpt-oss; see
    /// [`KvView::sinks`]).
    pub sinks: Option<&'a [f32]>,
    /// The positions a query sees where it is not all of them before it:
    /// gpt-oss's sliding windows ([`SlidingWindow`](super::config::SlidingWindow)),
    /// Llama 4's chunks.
    pub window: Option<AttnWindow>,
    /// RoPE frequency factors, `n_rot / 2` of them (Llama 3.1's
    /// `rope_freqs.weight`): each pair's angle is divided by its factor
    /// ([`rope_factored`]).
    pub rope_freqs: Option<&'a [f32]>,
    /// The Q/K norms come after RoPE, not before (Hunyuan-A13B's order).
    pub norm_after_rope: bool,
    /// No RoPE in this layer (Llama 4's every fourth, "NoPE"): the query is
    /// scaled by this temperature at its position instead.
    pub nope: Option<AttnTemperature>,
}

/// What mixes positions in a layer.
#[derive(Clone, Copy, Debug)]
pub enum Mixer<'a> {
    /// Attention over the KV cache.
    Attention(AttentionWeights<'a>),
    /// Gated DeltaNet over the layer's recurrent state.
    DeltaNet(DeltaNetWeights<'a>),
    /// Mamba2 over the layer's recurrent state.
    Mamba2(Mamba2Weights<'a>),
    /// LFM2's gated short convolution over the layer's convolution state.
    ShortConv(ShortConvWeights<'a>),
    /// Multi-head latent attention over the KV cache (deepseek2; the shape is
    /// [`HybridParams::mla`]).
    Mla(MlaWeights<'a>),
    /// Nothing mixes positions: the layer is its FFN alone (Nemotron-H's MoE
    /// layers, counted by [`HybridParams::n_ffn_only_layers`]); its
    /// `attn_norm` is not read.
    None,
}

/// The resident weights of one layer of any supported architecture.
#[derive(Clone, Copy, Debug)]
pub struct Block<'a> {
    /// RMSNorm weight before the mixer.
    pub attn_norm: &'a [f32],
    /// Attention or linear attention.
    pub mixer: Mixer<'a>,
    /// RMSNorm weight before the FFN (`post_attention_norm` in qwen35moe).
    pub ffn_norm: &'a [f32],
    /// The FFN.
    pub ffn: Ffn<'a>,
}

/// Access to a model's resident weights.
pub trait Weights {
    /// Weights of layer `layer` (< `n_layers`), whatever its kind (a plain
    /// transformer's layers are all [`Mixer::Attention`]).
    fn block(&self, layer: usize) -> Block<'_>;
    /// Token embedding matrix (`n_vocab` x `n_embd`).
    fn embedding(&self) -> MatrixView<'_>;
    /// Final RMSNorm weight.
    fn output_norm(&self) -> &[f32];
    /// Output projection (`n_vocab` x `n_embd`), the embedding when tied.
    fn output(&self) -> MatrixView<'_>;
    /// A cheaper copy of MoE layer `layer`'s router (same shape, e.g. quantized)
    /// for lookahead predictions, which only decide what is read early and so
    /// need not match the router's bits; `None` predicts with the router itself.
    /// Routing always uses the router.
    fn lookahead_router(&self, layer: usize) -> Option<MatrixView<'_>> {
        let _ = layer;
        None
    }
}

/// The matrices of one routed expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertMatrices<'a> {
    /// Gate projection (`n_ff_exp` x `n_embd`); `None` for the ungated
    /// experts of [`ExpertAct::ReluSqr`].
    pub gate: Option<MatrixView<'a>>,
    /// Up projection.
    pub up: MatrixView<'a>,
    /// Down projection (`n_embd` x `n_ff_exp`).
    pub down: MatrixView<'a>,
}

/// A picked expert to compute.
#[derive(Clone, Copy, Debug)]
pub struct Handout<'a> {
    /// Position in the routing passed to [`Experts::begin_layer`].
    pub index: usize,
    /// The expert's matrices.
    pub matrices: ExpertMatrices<'a>,
    /// Its bytes are not checked yet: compute the CRC-32 of gate, up and down
    /// (back to back, [`crate::layout::checksum`]) with the products and pass it
    /// to [`Experts::finish`], which refuses the expert if it does not match.
    pub verify: bool,
}

/// The gate and up projections of a picked expert whose down projection is
/// still loading ([`Experts::next_part`]).
#[derive(Clone, Copy, Debug)]
pub struct GateUp<'a> {
    /// Position in the routing passed to [`Experts::begin_layer`].
    pub index: usize,
    /// Gate projection (`None` for an ungated expert).
    pub gate: Option<MatrixView<'a>>,
    /// Up projection.
    pub up: MatrixView<'a>,
    /// Compute the CRC-32 of gate and up (back to back) with the products, to
    /// be concatenated with the down projection's for [`Experts::finish`].
    pub verify: bool,
}

/// The down projection of a picked expert whose [`GateUp`] came before.
#[derive(Clone, Copy, Debug)]
pub struct Down<'a> {
    /// Position in the routing passed to [`Experts::begin_layer`].
    pub index: usize,
    /// Down projection.
    pub down: MatrixView<'a>,
    /// Compute its CRC-32 too; [`Experts::finish`] takes the whole expert's.
    pub verify: bool,
}

/// What [`Experts::try_next`] says to do.
#[derive(Clone, Copy, Debug)]
pub enum Step<'a> {
    /// Compute this expert, then call [`Experts::finish`].
    Compute(Handout<'a>),
    /// ([`Experts::next_part`] only.) Compute this expert's gate and up
    /// projections and keep their SwiGLU activations: its down projection is
    /// still loading and comes as [`Step::Down`].
    GateUp(GateUp<'a>),
    /// ([`Experts::next_part`] only.) Compute the down projection of an expert
    /// from the activations of its [`Step::GateUp`], then call
    /// [`Experts::finish`] with the whole expert's checksum.
    Down(Down<'a>),
    /// Reads are in flight and nothing is ready yet.
    Pending,
    /// Every picked expert was handed out and finished.
    Done,
}

impl<'a> From<Option<Handout<'a>>> for Step<'a> {
    /// [`Experts::next`]'s answer as a step: an expert to compute, or done.
    fn from(next: Option<Handout<'a>>) -> Self {
        match next {
            Some(h) => Step::Compute(h),
            None => Step::Done,
        }
    }
}

/// Supplies routed experts: all resident, or streamed through the scheduler.
pub trait Experts {
    /// Error of the supplier (I/O, checksum).
    type Error;
    /// A new token starts (or a new pass of several). A supplier that keeps
    /// state between layers gives up here a layer that an error left
    /// unfinished, so that a pass after a failed one starts clean.
    fn begin_token(&mut self) {}
    /// The router of `layer` picked `routing` (expert ids, router order).
    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), Self::Error>;
    /// The most experts one [`begin_layer`](Self::begin_layer) of `layer` may
    /// name ([`forward_batch`] asks for a layer's union of picks in groups of
    /// this size; a token's own picks always fit).
    fn max_picks(&self, layer: usize) -> usize {
        let _ = layer;
        crate::schedule::MAX_PICKS
    }
    /// The router of `layer` gave every expert the logits `logits` (one per
    /// expert); called just before [`begin_layer`](Self::begin_layer) of that
    /// layer. A supplier that caches experts can learn their popularity from it.
    fn router_logits(&mut self, layer: usize, logits: &[f32]) {
        let _ = (layer, logits);
    }
    /// Whether [`prefetch`](Self::prefetch) is used (predictions cost a GEMV).
    fn wants_predictions(&self) -> bool {
        false
    }
    /// Lookahead prediction of `layer`'s experts, most confident first.
    fn prefetch(&mut self, layer: usize, predicted: &[u16]) -> Result<(), Self::Error> {
        let _ = (layer, predicted);
        Ok(())
    }
    /// `experts` of `layer` will be asked for next, for certain or nearly (a
    /// batch's next group of picks, during the current group; the experts most
    /// of a batch's positions are predicted to pick in the next layer, during
    /// this layer's last group): a supplier that reads ahead may start their
    /// reads now.
    fn prefetch_known(&mut self, layer: usize, experts: &[u16]) -> Result<(), Self::Error> {
        let _ = (layer, experts);
        Ok(())
    }
    /// Whether `expert` of `layer` is resident, on its way, or neither. A batch
    /// asks for a layer's picks in that order ([`forward_batch`]); the default
    /// is [`Residency::Missing`] for all.
    fn residency(&self, layer: usize, expert: u16) -> Residency {
        let _ = (layer, expert);
        Residency::Missing
    }
    /// The next picked expert to compute, or `None` once every picked expert was
    /// handed out and finished.
    fn next(&mut self) -> Result<Option<Handout<'_>>, Self::Error>;
    /// Like [`next`](Self::next), but answers [`Step::Pending`] instead of
    /// blocking while no picked expert is ready yet, so the caller can compute
    /// other resident work (the shared expert) while reads are in flight.
    /// Suppliers that do not overlap reads with compute (resident, the on-demand
    /// baseline) never answer `Pending`: the default is [`next`](Self::next).
    fn try_next(&mut self) -> Result<Step<'_>, Self::Error> {
        self.next().map(Step::from)
    }
    /// Like [`try_next`](Self::try_next) (`block` false) or [`next`](Self::next)
    /// (`block` true, never [`Step::Pending`]), but may also hand out an expert in
    /// halves, [`Step::GateUp`] once its gate and up projections landed and
    /// [`Step::Down`] once the rest has: ready-first within an expert. A caller
    /// that asks this for a layer keeps asking this until [`Step::Done`]. The
    /// default never splits.
    fn next_part(&mut self, block: bool) -> Result<Step<'_>, Self::Error> {
        if block {
            self.next().map(Step::from)
        } else {
            self.try_next()
        }
    }
    /// Routing index `index` was computed; its memory may be reused. `checksum`
    /// is the CRC-32 of its bytes when it was handed out with
    /// [`verify`](Handout::verify) (`None` otherwise); an error means the
    /// expert's output must not be used. Where the bytes failed their check,
    /// a supplier may instead read the expert again and hand `index` out
    /// again: the output computed then replaces this one, so callers keep
    /// each index's output apart until the layer is done.
    fn finish(&mut self, index: usize, checksum: Option<u32>) -> Result<(), Self::Error>;
}

/// The forward pass's heavy kernels: matrix-vector products `y = W x` over all
/// rows, and attention over the KV cache.
pub trait MatVec {
    /// Computes `y = w x`.
    fn matvec(&mut self, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) -> Result<(), GemvError>;

    /// Computes `y_c = w x_c` for several inputs: `xs` holds them back to back
    /// (`w.cols()` each) and `ys` the outputs (`w.rows()` each). Each output is
    /// [`matvec`](Self::matvec)'s, bit for bit; an implementation may multiply a
    /// part of `w` by every input while it is in cache (the default calls
    /// `matvec` for each input).
    fn matmul(&mut self, w: &MatrixView<'_>, xs: &[f32], ys: &mut [f32]) -> Result<(), GemvError> {
        let (cols, rows) = (w.cols().max(1), w.rows());
        let n = xs.len() / cols;
        if !xs.len().is_multiple_of(cols) || ys.len() != n * rows {
            return Err(GemvError::OutputLength {
                expected: n * rows,
                len: ys.len(),
            });
        }
        for (x, y) in xs.chunks_exact(cols).zip(ys.chunks_exact_mut(rows.max(1))) {
            self.matvec(w, x, y)?;
        }
        Ok(())
    }

    /// Computes `y = w x` and returns the CRC-32 ([`crate::layout::checksum`]) of
    /// `w`'s bytes. The default hashes `w` after the product; an implementation
    /// may hash each part right after computing it, while it is still in cache.
    fn matvec_checksum(
        &mut self,
        w: &MatrixView<'_>,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<u32, GemvError> {
        self.matvec(w, x, y)?;
        Ok(crate::layout::checksum(w.bytes()))
    }

    /// [`ops::attention`](super::ops::attention) of one query over the cached
    /// positions of `kv` (the default with the CPU's best vector kernels). An
    /// implementation may compute the heads on several threads
    /// ([`ops::attention_heads`](super::ops::attention_heads)); each head's
    /// result is the same bits either way, with any ISA.
    fn attention(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        super::ops::attention(Isa::detect(), shape, q, kv, scores, out);
    }

    /// Causal attention of the consecutive positions `first..kv.positions`: `q`
    /// holds their queries and `out` gets their outputs (a row of
    /// `n_head * head_dim` each), position `p` attending to the cached positions
    /// `0..=p`. Each position's output is [`attention`](Self::attention)'s over
    /// `kv` cut at that position, bit for bit. The default computes them one
    /// after another (`scores` as for `attention`); an implementation may take
    /// several positions at once
    /// ([`ops::attention_causal`](super::ops::attention_causal)), reading each
    /// cached key and value once for all of them.
    fn attention_causal(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        first: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        attention_each_position(self, shape, q, kv, first, scores, out);
    }

    /// Runs `f(h, state_h, out_h)` for each head `h < n`, `state_h` and
    /// `out_h` the `h`-th of `n` equal chunks of `state` and `out`: the
    /// per-head recurrences of DeltaNet and Mamba2 layers. The default runs
    /// them in order ([`each_head`]); an implementation may spread them over
    /// threads: a head writes only its own chunks, so the bits are the same.
    fn for_heads(&mut self, n: usize, state: &mut [f32], out: &mut [f32], f: &HeadFn<'_>) {
        each_head(n, state, out, f);
    }
}

/// A head's work for [`MatVec::for_heads`]: `(head, its state, its output)`.
pub type HeadFn<'a> = dyn Fn(usize, &mut [f32], &mut [f32]) + Sync + 'a;

/// [`MatVec::for_heads`] in order on this thread; panics unless `n` divides
/// both lengths.
pub fn each_head(n: usize, state: &mut [f32], out: &mut [f32], f: &HeadFn<'_>) {
    assert!(
        n > 0 && state.len().is_multiple_of(n) && out.len().is_multiple_of(n),
        "each_head: lengths are not multiples of the heads"
    );
    let (sl, ol) = (state.len() / n, out.len() / n);
    for (h, (st, o)) in state
        .chunks_exact_mut(sl.max(1))
        .zip(out.chunks_exact_mut(ol.max(1)))
        .enumerate()
        .take(n)
    {
        f(h, st, o);
    }
}

/// [`MatVec::attention_causal`] one position after another through
/// `m`'s [`attention`](MatVec::attention): the trait's default, and the fallback
/// of implementations that group positions. A short last query (malformed
/// input) still goes to `attention`, which rejects it with its message.
pub fn attention_each_position<M: MatVec + ?Sized>(
    m: &mut M,
    shape: AttnShape,
    q: &[f32],
    kv: KvView<'_>,
    first: usize,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let q_dim = (shape.n_head * shape.head_dim).max(1);
    for (i, (qi, oi)) in q.chunks(q_dim).zip(out.chunks_mut(q_dim)).enumerate() {
        let cut = KvView {
            positions: first + i + 1,
            ..kv
        };
        m.attention(shape, qi, cut, scores, oi);
    }
}

/// Single-threaded [`MatVec`] over caller buffers for the quantized activations
/// (each at least `max_cols / 32` resp. `max_cols / 256` blocks).
pub struct SerialMatVec<'a> {
    /// Kernels to use.
    pub isa: Isa,
    /// Scratch for `Q8_0` activations.
    pub q8_0: &'a mut [BlockQ8_0],
    /// Scratch for `Q8_1` activations.
    pub q8_1: &'a mut [BlockQ8_1],
    /// Scratch for `Q8_K` activations.
    pub q8k: &'a mut [BlockQ8K],
}

/// Quantizes `x` into the activation format `w` needs and returns the [`Input`].
pub fn prepare_input<'b>(
    ty: quant::GgmlType,
    x: &'b [f32],
    q8_0: &'b mut [BlockQ8_0],
    q8_1: &'b mut [BlockQ8_1],
    q8k: &'b mut [BlockQ8K],
) -> Result<Input<'b>, GemvError> {
    let format = activation_format(ty).ok_or(GemvError::UnsupportedType(ty))?;
    let short = GemvError::InputLength {
        format,
        expected: x.len() / format.block_elems(),
        len: 0,
    };
    let blocks = x.len() / format.block_elems();
    let mut input = Input::default();
    match format {
        ActivationFormat::F32 => input.f32 = x,
        ActivationFormat::Q8_0 => {
            let b = q8_0
                .get_mut(..blocks)
                .filter(|_| x.len().is_multiple_of(32))
                .ok_or(short)?;
            quant::legacy::quantize_q8_0(x, b);
            input.q8_0 = b;
        }
        ActivationFormat::Q8_1 => {
            let b = q8_1
                .get_mut(..blocks)
                .filter(|_| x.len().is_multiple_of(32))
                .ok_or(short)?;
            quant::legacy::quantize_q8_1(x, b);
            input.q8_1 = b;
        }
        ActivationFormat::Q8K => {
            let b = q8k
                .get_mut(..blocks)
                .filter(|_| x.len().is_multiple_of(256))
                .ok_or(short)?;
            quant::kquants::quantize_q8k(x, b);
            input.q8k = b;
        }
    }
    Ok(input)
}

impl MatVec for SerialMatVec<'_> {
    fn matvec(&mut self, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) -> Result<(), GemvError> {
        let input = prepare_input(w.ty(), x, self.q8_0, self.q8_1, self.q8k)?;
        gemv(self.isa, w, &input, 0..w.rows(), y)
    }

    fn attention(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        super::ops::attention(self.isa, shape, q, kv, scores, out);
    }
}

/// Lookahead prediction settings.
#[derive(Clone, Copy, Debug)]
pub struct Lookahead {
    /// How many experts to predict.
    pub predictor: PredictorConfig,
    /// Layers to predict for.
    pub layers: LayerMask,
    /// How many MoE layers ahead to predict: 1 = the next MoE layer's router
    /// on this layer's hidden state (LES); 2 also runs the router of the one
    /// after it, whose reads then have two layers of compute to complete in
    /// (for models whose layers compute faster than an expert reads). 0
    /// predicts nothing. Layers without routed experts in between (Llama 4's
    /// interleaved dense layers, leading dense layers) are passed over
    /// ([`next_moe_layers`]). The first `depth` MoE layers are predicted from
    /// the token's embedding, at the start of the token.
    pub depth: usize,
}

/// The recurrent state of the linear-attention layers, over caller memory: per
/// layer, the convolution state and the DeltaNet state matrices. Position 0
/// starts a sequence and clears it.
pub struct RecurrentState<'a> {
    conv: &'a mut [f32],
    ssm: &'a mut [f32],
    n_layers: usize,
}

impl<'a> RecurrentState<'a> {
    /// Floats of the convolution state and of the DeltaNet state for `hy`.
    pub fn len(hy: &HybridParams) -> (usize, usize) {
        match hy.linear {
            Some((n, shape)) => (
                n.saturating_mul(shape.conv_state_len()),
                n.saturating_mul(shape.ssm_state_len()),
            ),
            None => (0, 0),
        }
    }

    /// State for `hy` over `conv` and `ssm` of [`len`](Self::len) floats.
    pub fn new(hy: &HybridParams, conv: &'a mut [f32], ssm: &'a mut [f32]) -> Option<Self> {
        let (c, m) = Self::len(hy);
        (conv.len() == c && ssm.len() == m).then_some(RecurrentState {
            conv,
            ssm,
            n_layers: hy.n_linear_layers(),
        })
    }

    /// No state, for models without linear attention.
    pub fn empty() -> RecurrentState<'static> {
        RecurrentState {
            conv: &mut [],
            ssm: &mut [],
            n_layers: 0,
        }
    }
}

/// Scratch vectors of the forward pass, carved from one caller buffer.
pub struct Scratch<'a> {
    h: &'a mut [f32],
    x: &'a mut [f32],
    q: &'a mut [f32],
    k: &'a mut [f32],
    v: &'a mut [f32],
    att: &'a mut [f32],
    scores: &'a mut [f32],
    ff_a: &'a mut [f32],
    ff_b: &'a mut [f32],
    tmp: &'a mut [f32],
    moe: &'a mut [f32],
    expert_out: &'a mut [f32],
    /// SwiGLU activations of experts computed in halves (`top_k * n_ff_exp`).
    expert_act: &'a mut [f32],
    router: &'a mut [f32],
    pred_x: &'a mut [f32],
    /// Query and gate of gated attention (`2 * q_dim`, else empty).
    qg: &'a mut [f32],
    /// DeltaNet projections and output (empty without linear attention).
    d_qkv: &'a mut [f32],
    d_z: &'a mut [f32],
    d_beta: &'a mut [f32],
    d_alpha: &'a mut [f32],
    d_out: &'a mut [f32],
    /// MLA's compressed query (`q_lora`) and its per-head queries, then the
    /// heads' values (empty without MLA).
    mla_qa: &'a mut [f32],
    mla_q: &'a mut [f32],
}

fn max_ff(hp: &Hparams) -> usize {
    let m = hp
        .moe
        .map_or(0, |m| m.n_ff_exp.max(m.n_ff_shared.unwrap_or(0)));
    hp.n_ff.max(m).max(1)
}

/// Extra scratch of `hy`: gated query, then DeltaNet `qkv, z, beta, alpha,
/// out`, then MLA's compressed query and per-head queries.
fn extra_lens(hp: &Hparams, hy: &HybridParams) -> [usize; 8] {
    let qg = if hy.attn_output_gate {
        2 * hp.q_dim()
    } else {
        0
    };
    let [qa, q] = match hy.mla {
        Some(m) => [m.q_lora, hp.n_head * m.q_head().max(m.v_head_dim)],
        None => [0, 0],
    };
    match hy.linear {
        Some((_, LinearShape::DeltaNet(d))) => [
            qg,
            d.conv_dim(),
            d.value_dim(),
            d.n_v_heads,
            d.n_v_heads,
            d.value_dim(),
            qa,
            q,
        ],
        // Mamba2's projection in `d_qkv`, its output in `d_out`.
        Some((_, LinearShape::Mamba2(m))) => [qg, m.in_proj_dim(), 0, 0, 0, m.d_inner, qa, q],
        // The short convolution's `[b, c, x]` in `d_qkv`, its output in `d_out`.
        Some((_, LinearShape::ShortConv(c))) => [qg, 3 * c.channels, 0, 0, 0, c.channels, qa, q],
        None => [qg, 0, 0, 0, 0, 0, qa, q],
    }
}

impl<'a> Scratch<'a> {
    /// The final hidden state (before the output norm) of the last
    /// [`forward_hybrid`] (also the last position's of a [`forward_batch`]).
    pub fn hidden(&self) -> &[f32] {
        self.h
    }

    /// Floats of scratch needed for `hp` with up to `max_positions` positions.
    pub fn len(hp: &Hparams, max_positions: usize) -> usize {
        let e = hp.n_embd;
        let (k, n_exp, ff) = hp
            .moe
            .map_or((0, 0, 0), |m| (m.top_k, m.n_experts, m.n_ff_exp));
        5 * e
            + 2 * hp.q_dim()
            + 2 * hp.kv_dim()
            + max_positions
            + 2 * max_ff(hp)
            + k * e
            + k * ff
            + n_exp
    }

    /// Splits `buf` (at least [`len`](Self::len) floats).
    pub fn new(hp: &Hparams, buf: &'a mut [f32], max_positions: usize) -> Option<Self> {
        Self::new_for(hp, &HybridParams::plain(hp), buf, max_positions)
    }

    /// Floats of scratch needed for `hp` and `hy`.
    pub fn len_for(hp: &Hparams, hy: &HybridParams, max_positions: usize) -> usize {
        Self::len(hp, max_positions) + extra_lens(hp, hy).iter().sum::<usize>()
    }

    /// Splits `buf` (at least [`len_for`](Self::len_for) floats).
    pub fn new_for(
        hp: &Hparams,
        hy: &HybridParams,
        buf: &'a mut [f32],
        max_positions: usize,
    ) -> Option<Self> {
        if buf.len() < Self::len_for(hp, hy, max_positions) {
            return None;
        }
        let e = hp.n_embd;
        let (top_k, n_exp, ff_exp) = hp
            .moe
            .map_or((0, 0, 0), |m| (m.top_k, m.n_experts, m.n_ff_exp));
        let ff = max_ff(hp);
        let (h, rest) = buf.split_at_mut(e);
        let (x, rest) = rest.split_at_mut(e);
        let (q, rest) = rest.split_at_mut(hp.q_dim());
        let (k, rest) = rest.split_at_mut(hp.kv_dim());
        let (v, rest) = rest.split_at_mut(hp.kv_dim());
        let (att, rest) = rest.split_at_mut(hp.q_dim());
        let (scores, rest) = rest.split_at_mut(max_positions);
        let (ff_a, rest) = rest.split_at_mut(ff);
        let (ff_b, rest) = rest.split_at_mut(ff);
        let (tmp, rest) = rest.split_at_mut(e);
        let (moe, rest) = rest.split_at_mut(e);
        let (expert_out, rest) = rest.split_at_mut(top_k * e);
        let (expert_act, rest) = rest.split_at_mut(top_k * ff_exp);
        let (router, rest) = rest.split_at_mut(n_exp);
        let (pred_x, rest) = rest.split_at_mut(e);
        let [l_qg, l_qkv, l_z, l_beta, l_alpha, l_out, l_mla_qa, l_mla_q] = extra_lens(hp, hy);
        let (qg, rest) = rest.split_at_mut(l_qg);
        let (d_qkv, rest) = rest.split_at_mut(l_qkv);
        let (d_z, rest) = rest.split_at_mut(l_z);
        let (d_beta, rest) = rest.split_at_mut(l_beta);
        let (d_alpha, rest) = rest.split_at_mut(l_alpha);
        let (d_out, rest) = rest.split_at_mut(l_out);
        let (mla_qa, rest) = rest.split_at_mut(l_mla_qa);
        let (mla_q, _) = rest.split_at_mut(l_mla_q);
        Some(Scratch {
            h,
            x,
            q,
            k,
            v,
            att,
            scores,
            ff_a,
            ff_b,
            tmp,
            moe,
            expert_out,
            expert_act,
            router,
            pred_x,
            qg,
            d_qkv,
            d_z,
            d_beta,
            d_alpha,
            d_out,
            mla_qa,
            mla_q,
        })
    }
}

/// Why a forward pass failed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ForwardError<E> {
    /// The expert supplier failed (I/O error, checksum mismatch).
    Experts(E),
    /// A weight matrix does not fit its role.
    Gemv(GemvError),
    /// Routing failed.
    Router(RouterError),
    /// Dequantizing the embedding failed.
    Quant(QuantError),
    /// The token id is outside the vocabulary.
    Token(u32),
    /// The KV cache is full.
    ContextFull(usize),
    /// The shapes of weights and hyperparameters disagree.
    Shape(&'static str),
}

impl<E: fmt::Display> fmt::Display for ForwardError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ForwardError::Experts(e) => write!(f, "loading experts: {e}"),
            ForwardError::Gemv(e) => write!(f, "matrix product: {e}"),
            ForwardError::Router(e) => write!(f, "routing: {e}"),
            ForwardError::Quant(e) => write!(f, "embedding: {e}"),
            ForwardError::Token(t) => write!(f, "token id {t} is outside the vocabulary"),
            ForwardError::ContextFull(n) => write!(f, "context full ({n} positions)"),
            ForwardError::Shape(why) => write!(f, "weights do not match the model shape: {why}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> core::error::Error for ForwardError<E> {}

impl<E> From<GemvError> for ForwardError<E> {
    fn from(e: GemvError) -> Self {
        ForwardError::Gemv(e)
    }
}

impl<E> From<RouterError> for ForwardError<E> {
    fn from(e: RouterError) -> Self {
        ForwardError::Router(e)
    }
}

fn add_bias(y: &mut [f32], b: Option<&[f32]>) -> Result<(), &'static str> {
    if let Some(b) = b {
        if b.len() != y.len() {
            return Err("bias length");
        }
        for (v, b) in y.iter_mut().zip(b) {
            *v += b;
        }
    }
    Ok(())
}

pub(super) fn add_into(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

/// `dst += src * scale`, each product rounded before the sum (llama.cpp's
/// `ggml_scale` then `ggml_add`); a plain sum at scale 1.
pub(super) fn add_scaled_into(dst: &mut [f32], src: &[f32], scale: f32) {
    if scale == 1.0 {
        return add_into(dst, src);
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s * scale;
    }
}

/// A block's output `out` into the residual stream `h`, times the model's
/// residual scale.
pub(super) fn add_residual(hp: &Hparams, h: &mut [f32], out: &[f32]) {
    add_scaled_into(h, out, hp.scales.residual);
}

/// The input embedding `h` times the model's embedding scale.
pub(super) fn scale_embedding(hp: &Hparams, h: &mut [f32]) {
    let f = hp.scales.embedding;
    if f != 1.0 {
        h.iter_mut().for_each(|x| *x *= f);
    }
}

/// The logits divided by the model's logit scale (times its reciprocal).
pub(super) fn scale_logits(hp: &Hparams, logits: &mut [f32]) {
    if hp.scales.logit != 1.0 {
        let f = 1.0 / hp.scales.logit;
        logits.iter_mut().for_each(|x| *x *= f);
    }
}

fn norm_heads(x: &mut [f32], w: Option<&[f32]>, eps: f32) -> Result<(), &'static str> {
    if let Some(w) = w {
        if w.is_empty() || !x.len().is_multiple_of(w.len()) {
            return Err("q/k norm length");
        }
        rms_norm_heads(x, w, eps);
    }
    Ok(())
}

/// A dense or shared expert's FFN into `out`: `down(silu(gate x) * up x)`,
/// or `down(relu(up x)^2)` without a gate.
pub(super) fn ffn<M: MatVec, E>(
    mv: &mut M,
    w: &ExpertMatrices<'_>,
    x: &[f32],
    ff_a: &mut [f32],
    ff_b: &mut [f32],
    out: &mut [f32],
) -> Result<(), ForwardError<E>> {
    let tail = ExpertTail::plain(w.gate.as_ref());
    ffn_checked(mv, w, tail, x, ff_a, ff_b, out, false).map(|_| ())
}

/// [`ffn`] finished by `tail` (its activation and biases), also returning
/// the CRC-32 of gate, up and down back to back when `verify` (each hashed
/// by [`MatVec::matvec_checksum`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn ffn_checked<M: MatVec, E>(
    mv: &mut M,
    w: &ExpertMatrices<'_>,
    tail: ExpertTail<'_>,
    x: &[f32],
    ff_a: &mut [f32],
    ff_b: &mut [f32],
    out: &mut [f32],
    verify: bool,
) -> Result<Option<u32>, ForwardError<E>> {
    let ExpertMatrices { gate, up, down } = w;
    let n = up.rows();
    if down.cols() != n {
        return Err(GemvError::RowLength {
            ty: down.ty(),
            cols: down.cols(),
        }
        .into());
    }
    let crc_gate_up = gate_up_checked(mv, gate.as_ref(), up, tail, x, ff_a, ff_b, verify)?;
    let crc_down = down_checked(mv, down, tail, &ff_a[..n], out, verify)?;
    Ok(concat_checksums(crc_gate_up, crc_down, down))
}

/// Whether an expert with (or without) `gate` suits `act`: SwiGLU needs a
/// gate, ReLU² has none.
pub(super) fn check_gate<E>(act: ExpertAct, gate: bool) -> Result<(), ForwardError<E>> {
    match (act.gated(), gate) {
        (true, true) | (false, false) => Ok(()),
        (true, false) => Err(ForwardError::Shape("gated activation without a gate")),
        (false, true) => Err(ForwardError::Shape("ReLU^2 expert with a gate")),
    }
}

/// The first half of [`ffn_checked`]: the activation of `gate x` and `up x`
/// (each plus its bias where `tail` has them; `up x` alone without a gate)
/// into `ff_a[..up.rows()]`, and with `verify` the CRC-32 of gate and up back
/// to back.
#[allow(clippy::too_many_arguments)]
pub(super) fn gate_up_checked<M: MatVec, E>(
    mv: &mut M,
    gate: Option<&MatrixView<'_>>,
    up: &MatrixView<'_>,
    tail: ExpertTail<'_>,
    x: &[f32],
    ff_a: &mut [f32],
    ff_b: &mut [f32],
    verify: bool,
) -> Result<Option<u32>, ForwardError<E>> {
    check_gate(tail.act, gate.is_some())?;
    let n = up.rows();
    let bias_fits = tail
        .biases
        .is_none_or(|[g, u, _]| (gate.is_none() || g.len() == n) && u.len() == n);
    if gate.is_some_and(|g| g.rows() != n) || n > ff_a.len() || n > ff_b.len() || !bias_fits {
        return Err(GemvError::RowLength {
            ty: up.ty(),
            cols: up.cols(),
        }
        .into());
    }
    let (a, b) = (&mut ff_a[..n], &mut ff_b[..n]);
    let crc = match gate {
        Some(gate) => {
            let crc_gate = product_checked(mv, gate, x, a, verify)?;
            let crc_up = product_checked(mv, up, x, b, verify)?;
            if let Some([gb, ub, _]) = tail.biases {
                add_into(a, gb);
                add_into(b, ub);
            }
            concat_checksums(crc_gate, crc_up, up)
        }
        None => {
            let crc_up = product_checked(mv, up, x, a, verify)?;
            if let Some([_, ub, _]) = tail.biases {
                add_into(a, ub);
            }
            crc_up
        }
    };
    activate(tail.act, a, b);
    Ok(crc)
}

/// `a` = the activation `act` of the gate products `a` and up products `b`
/// (of `up` alone, in `a`, for [`ExpertAct::ReluSqr`]; `b` then unused).
pub(super) fn activate(act: ExpertAct, a: &mut [f32], b: &[f32]) {
    match act {
        ExpertAct::SwiGlu => swiglu(a, b),
        ExpertAct::SwiGluOai { alpha, limit } => swiglu_oai(a, b, alpha, limit),
        ExpertAct::ReluSqr => relu_sqr(a),
        ExpertAct::ReGlu => reglu(a, b),
    }
}

/// The second half of [`ffn_checked`]: `down act` plus the down bias
/// where `tail` has one, and with `verify` the CRC-32 of `down`.
pub(super) fn down_checked<M: MatVec>(
    mv: &mut M,
    down: &MatrixView<'_>,
    tail: ExpertTail<'_>,
    act: &[f32],
    out: &mut [f32],
    verify: bool,
) -> Result<Option<u32>, GemvError> {
    let crc = product_checked(mv, down, act, out, verify)?;
    if let Some([_, _, db]) = tail.biases {
        if db.len() != out.len() {
            return Err(GemvError::RowLength {
                ty: down.ty(),
                cols: down.cols(),
            });
        }
        add_into(out, db);
    }
    Ok(crc)
}

/// `y = w x`, and with `verify` the CRC-32 of `w`'s bytes.
pub(super) fn product_checked<M: MatVec>(
    mv: &mut M,
    w: &MatrixView<'_>,
    x: &[f32],
    y: &mut [f32],
    verify: bool,
) -> Result<Option<u32>, GemvError> {
    if verify {
        mv.matvec_checksum(w, x, y).map(Some)
    } else {
        mv.matvec(w, x, y).map(|()| None)
    }
}

/// The CRC-32 of two byte runs back to back from theirs (`b`'s the bytes of
/// `second`); `None` unless both are known.
pub(super) fn concat_checksums(
    a: Option<u32>,
    b: Option<u32>,
    second: &MatrixView<'_>,
) -> Option<u32> {
    Some(crate::layout::checksum_concat(
        a?,
        b?,
        second.bytes().len() as u64,
    ))
}

/// What enters the model at one position.
#[derive(Clone, Copy, Debug)]
pub enum TokenInput<'a> {
    /// A token id, looked up in the embedding matrix.
    Token(u32),
    /// An embedding given directly (`n_embd` values), e.g. from a vision encoder.
    Embedding(&'a [f32]),
}

/// Runs `input` at position `pos` (the KV cache holds positions `0..pos`)
/// and writes the next-token logits (`n_vocab`) into `logits`.
#[allow(clippy::too_many_arguments)]
pub fn forward<W, M, X>(
    hp: &Hparams,
    weights: &W,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    input: TokenInput<'_>,
    pos: usize,
    kv: &mut KvCache<'_>,
    s: &mut Scratch<'_>,
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>>
where
    W: Weights,
    M: MatVec,
    X: Experts,
{
    forward_hybrid(
        hp,
        &HybridParams::plain(hp),
        weights,
        mv,
        experts,
        lookahead,
        input,
        pos,
        kv,
        &mut RecurrentState::empty(),
        s,
        logits,
    )
}

/// [`forward`] for any architecture: layers are whatever [`Weights::block`] says,
/// attention layers use `kv` (one cache layer per attention layer, in order) and
/// linear-attention layers `rs` (likewise). Position 0 starts a new sequence and
/// clears the recurrent state.
#[allow(clippy::too_many_arguments)]
pub fn forward_hybrid<W, M, X>(
    hp: &Hparams,
    hy: &HybridParams,
    weights: &W,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    input: TokenInput<'_>,
    pos: usize,
    kv: &mut KvCache<'_>,
    rs: &mut RecurrentState<'_>,
    s: &mut Scratch<'_>,
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>>
where
    W: Weights,
    M: MatVec,
    X: Experts,
{
    let at = Place::text(pos);
    forward_hybrid_at(
        hp, hy, weights, mv, experts, lookahead, input, at, kv, rs, s, logits,
    )
}

/// Where a position sits: its index in the KV cache (the positions before it
/// are the ones it attends to) and the positions RoPE rotates it by.
///
/// They differ only for M-RoPE models ([`HybridParams::rope_sections`]) once
/// an image is in the sequence: an image's embeddings share one temporal
/// position and take their row and column in the other sections, and the
/// text after it goes on from the temporal position plus the image's larger
/// side (llama.cpp's `mtmd` positions). Other models rotate by `index` and
/// ignore `rope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// Index in the KV cache.
    pub index: usize,
    /// M-RoPE positions: temporal, height (row), width (column), extra.
    pub rope: [u32; 4],
}

impl Place {
    /// A text position: `[index, index, index, 0]`.
    pub fn text(index: usize) -> Place {
        Place::text_at(index, index as u32)
    }

    /// A text position at cache index `index` and temporal position `t`:
    /// `[t, t, t, 0]`.
    pub fn text_at(index: usize, t: u32) -> Place {
        Place {
            index,
            rope: [t, t, t, 0],
        }
    }
}

/// [`forward_hybrid`] at an explicit [`Place`]: `at.index` is the KV cache
/// position, `at.rope` the M-RoPE positions of models with sections. An
/// image embedding of a model with deepstack layers
/// ([`HybridParams::n_deepstack`]) may carry their features after its own
/// `n_embd` values.
#[allow(clippy::too_many_arguments)]
pub fn forward_hybrid_at<W, M, X>(
    hp: &Hparams,
    hy: &HybridParams,
    weights: &W,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    input: TokenInput<'_>,
    at: Place,
    kv: &mut KvCache<'_>,
    rs: &mut RecurrentState<'_>,
    s: &mut Scratch<'_>,
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>>
where
    W: Weights,
    M: MatVec,
    X: Experts,
{
    let pos = at.index;
    if pos >= kv.max_positions() {
        return Err(ForwardError::ContextFull(kv.max_positions()));
    }
    if logits.len() != hp.n_vocab {
        return Err(ForwardError::Shape("logits length"));
    }
    embed(&weights.embedding(), input, hy.n_deepstack, s.h)?;
    scale_embedding(hp, s.h);
    let router_cfg = router_config(hp)?;
    experts.begin_token();
    // The first layers' lookahead, from the token's embedding: their reads
    // overlap the first attention layer instead of stalling it.
    if let (Some(la), Some(rc)) = (lookahead, router_cfg.as_ref()) {
        predict_layers(
            hp,
            weights,
            rc,
            la,
            next_moe_layers(weights, hp.n_layers, 0, la.depth),
            mv,
            s,
            experts,
        )?;
    }
    let mut routing = Routing::new();
    // Cache layer of the next attention layer, state slot of the next linear one.
    let (mut attn_idx, mut lin_idx) = (0usize, 0usize);

    for l in 0..hp.n_layers {
        let lw = weights.block(l);
        // A router on the layer's input (SmallThinker) routes before the
        // attention: the picks' reads overlap it.
        let routed = match early_router(hp, &lw.ffn) {
            Some((router, biases)) => {
                let rc = router_cfg
                    .as_ref()
                    .ok_or(ForwardError::Shape("MoE layer without MoE parameters"))?;
                s.x.copy_from_slice(s.h);
                route(l, router, biases, rc, mv, s, experts, &mut routing)?;
                true
            }
            None => false,
        };
        mix(
            hp,
            hy,
            &lw,
            mv,
            s,
            kv,
            rs,
            (&mut attn_idx, &mut lin_idx),
            at,
        )?;

        // FFN.
        if !matches!(lw.ffn, Ffn::None) {
            rms_norm(s.h, lw.ffn_norm, hp.norm_eps, s.x);
        }
        match lw.ffn {
            Ffn::None => {}
            Ffn::Dense { gate, up, down } => {
                ffn(
                    mv,
                    &ExpertMatrices { gate, up, down },
                    s.x,
                    s.ff_a,
                    s.ff_b,
                    s.tmp,
                )?;
                add_residual(hp, s.h, s.tmp);
            }
            Ffn::Moe {
                router,
                shared,
                router_bias,
                selection_bias,
                expert_bias,
            } => {
                let rc = router_cfg
                    .as_ref()
                    .ok_or(ForwardError::Shape("MoE layer without MoE parameters"))?;
                if !routed {
                    let biases = RouterBiases {
                        logits: router_bias,
                        selection: selection_bias,
                    };
                    route(l, &router, biases, rc, mv, s, experts, &mut routing)?;
                }

                // Lookahead: the next MoE layer's router on this layer's
                // hidden state (whatever mixes positions in the layers up to
                // it: it only needs the residual stream).
                if let Some(la) = lookahead {
                    let next = next_moe_layers(weights, hp.n_layers, l + 1, la.depth);
                    predict_layers(hp, weights, rc, la, next, mv, s, experts)?;
                }

                let ffn = MoeFfn {
                    shared: shared.as_ref(),
                    expert_bias: expert_bias.as_ref(),
                };
                compute_picks(hp, mv, s, experts, &routing, ffn)?;
            }
        }
        add_deepstack(hp.n_embd, hy.n_deepstack, input, l, s.h);
    }
    rms_norm(s.h, weights.output_norm(), hp.norm_eps, s.x);
    mv.matvec(&weights.output(), s.x, logits)?;
    scale_logits(hp, logits);
    Ok(())
}

/// The router of `ffn` and its biases where it reads the layer's input
/// ([`MoeParams::route_before_attention`](super::config::MoeParams::route_before_attention)):
/// the layer routes before its attention.
pub(super) fn early_router<'r, 'a>(
    hp: &Hparams,
    ffn: &'r Ffn<'a>,
) -> Option<(&'r MatrixView<'a>, RouterBiases<'a>)> {
    match ffn {
        Ffn::Moe {
            router,
            router_bias,
            selection_bias,
            ..
        } if hp.moe.is_some_and(|m| m.route_before_attention) => Some((
            router,
            RouterBiases {
                logits: *router_bias,
                selection: *selection_bias,
            },
        )),
        _ => None,
    }
}

/// A router's two optional biases ([`Ffn::Moe`]'s `router_bias` and
/// `selection_bias`).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RouterBiases<'a> {
    /// Added to the logits.
    pub(super) logits: Option<&'a [f32]>,
    /// Added to the gating probabilities to choose the picks.
    pub(super) selection: Option<&'a [f32]>,
}

/// Routes MoE layer `layer` on its normed input `s.x` with `router` (and its
/// `biases`) into `routing`, shows `experts` the router's scores, and begins
/// the layer with the picks ([`Experts::begin_layer`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn route<M: MatVec, X: Experts>(
    layer: usize,
    router: &MatrixView<'_>,
    biases: RouterBiases<'_>,
    rc: &RouterConfig,
    mv: &mut M,
    s: &mut Scratch<'_>,
    experts: &mut X,
    routing: &mut Routing,
) -> Result<(), ForwardError<X::Error>> {
    mv.matvec(router, s.x, s.router)?;
    add_bias(s.router, biases.logits).map_err(ForwardError::Shape)?;
    experts.router_logits(layer, s.router);
    rc.route(s.router, biases.selection, routing)?;
    let mut ids: heapless::Vec<u16, { router::MAX_PREDICTED }> = heapless::Vec::new();
    ids.extend(routing.iter().map(|r| r.expert));
    experts
        .begin_layer(layer, &ids)
        .map_err(ForwardError::Experts)
}

/// What a MoE layer computes besides its routed experts' products: its
/// shared expert and its experts' biases, where it has them.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct MoeFfn<'r, 'a> {
    pub(super) shared: Option<&'r SharedExpert<'a>>,
    pub(super) expert_bias: Option<&'r ExpertBiases<'a>>,
}

/// A MoE layer's routed experts, after [`Experts::begin_layer`]: computed
/// ready-first (in whatever order `experts` hands them out), then combined
/// into `s.h` in router order with the shared expert's output last, whatever
/// the compute order was. `s.x` is the layer's normed input.
pub(super) fn compute_picks<M: MatVec, X: Experts>(
    hp: &Hparams,
    mv: &mut M,
    s: &mut Scratch<'_>,
    experts: &mut X,
    routing: &Routing,
    ffn: MoeFfn<'_, '_>,
) -> Result<(), ForwardError<X::Error>> {
    let shared = ffn.shared;
    let weigh = weighs_inputs(hp);
    // Pick `index`'s tail, and its weight where it scales the input.
    let pick = |index: usize| -> Result<_, ForwardError<X::Error>> {
        let r = routing
            .get(index)
            .ok_or(ForwardError::Shape("routing index"))?;
        Ok((
            expert_tail(hp, ffn.expert_bias, r.expert)?,
            weigh.then_some(r.weight),
        ))
    };
    // Ready-first: compute in whatever order experts become ready.
    // The shared expert is resident: it is computed the first time
    // no routed expert is ready (while reads are in flight), or last.
    let e = hp.n_embd;
    let mut shared_left = shared;
    // The checksums of the gate and up halves computed first.
    let mut first_crc = [None::<u32>; crate::schedule::MAX_PICKS];
    loop {
        let step = next_step(experts, shared_left.is_some(), true)?;
        match step {
            Step::Compute(Handout {
                index,
                matrices,
                verify,
            }) => {
                let out = s
                    .expert_out
                    .get_mut(index * e..(index + 1) * e)
                    .ok_or(ForwardError::Shape("routing index"))?;
                let (tail, weight) = pick(index)?;
                let x = pick_input(s.x, weight, s.moe);
                let crc = ffn_checked(mv, &matrices, tail, x, s.ff_a, s.ff_b, out, verify)?;
                experts.finish(index, crc).map_err(ForwardError::Experts)?;
            }
            Step::GateUp(GateUp {
                index,
                gate,
                up,
                verify,
            }) => {
                let n = up.rows();
                let act = s
                    .expert_act
                    .get_mut(index * n..(index + 1) * n)
                    .ok_or(ForwardError::Shape("routing index"))?;
                let (tail, weight) = pick(index)?;
                let x = pick_input(s.x, weight, s.moe);
                let crc = gate_up_checked(mv, gate.as_ref(), &up, tail, x, act, s.ff_b, verify)?;
                *first_crc
                    .get_mut(index)
                    .ok_or(ForwardError::Shape("routing index"))? = crc;
            }
            Step::Down(Down {
                index,
                down,
                verify,
            }) => {
                let n = down.cols();
                let (act, out) = (
                    s.expert_act.get(index * n..(index + 1) * n),
                    s.expert_out.get_mut(index * e..(index + 1) * e),
                );
                let (Some(act), Some(out)) = (act, out) else {
                    return Err(ForwardError::Shape("routing index"));
                };
                let crc = down_checked(mv, &down, pick(index)?.0, act, out, verify)?;
                let first = first_crc.get(index).copied().flatten();
                let crc = concat_checksums(first, crc, &down);
                experts.finish(index, crc).map_err(ForwardError::Experts)?;
            }
            Step::Pending | Step::Done => {
                if let Some(sh) = shared_left.take() {
                    shared_expert(mv, sh, s.x, s.ff_a, s.ff_b, s.tmp)?;
                } else if let Step::Done = step {
                    break;
                }
            }
        }
    }
    // Combine in router order, whatever the compute order was; the
    // shared expert's output (in `s.tmp`) last.
    let picks = routing.iter().enumerate().map(|(i, r)| {
        (
            output_weight(r.weight, weigh),
            &s.expert_out[i * e..(i + 1) * e],
        )
    });
    combine(
        s.moe,
        picks,
        shared.is_some().then_some(&*s.tmp),
        hp.scales.residual,
        s.h,
    );
    Ok(())
}

/// Whether the picks' weights scale the routed experts' inputs
/// ([`MoeParams::weight_inputs`](super::config::MoeParams::weight_inputs)).
pub(super) fn weighs_inputs(hp: &Hparams) -> bool {
    hp.moe.is_some_and(|m| m.weight_inputs)
}

/// A routed expert's input: the layer's normed input `x`, or, where its
/// weight scales the input, `x` times `weight` written to `buf`
/// (`n_embd` long, free while the experts compute).
pub(super) fn pick_input<'b>(x: &'b [f32], weight: Option<f32>, buf: &'b mut [f32]) -> &'b [f32] {
    match weight {
        None => x,
        Some(_) => {
            copy_input(x, weight, buf);
            &buf[..x.len().min(buf.len())]
        }
    }
}

/// A routed expert's input into `out`: `x`, times `weight` where there is one.
pub(super) fn copy_input(x: &[f32], weight: Option<f32>, out: &mut [f32]) {
    match weight {
        None => out.copy_from_slice(x),
        Some(w) => {
            for (o, v) in out.iter_mut().zip(x) {
                *o = v * w;
            }
        }
    }
}

/// What a routed expert's output is multiplied by in the combine: its
/// weight, or 1 where the weight scaled its input (`o * 1.0` is `o`, bit
/// for bit, as llama.cpp sums those outputs unscaled).
pub(super) fn output_weight(weight: f32, weighs_inputs: bool) -> f32 {
    if weighs_inputs {
        1.0
    } else {
        weight
    }
}

/// The first layer's input for `input` into `h` (`n_embd` values): the
/// token's row of `emb` (the token embeddings), or the given embedding.
///
/// With `n_deepstack` deepstack layers an embedding may be `n_embd` values or
/// `(1 + n_deepstack) * n_embd` (its deepstack features after it, for
/// [`add_deepstack`]).
pub(super) fn embed<E>(
    emb: &MatrixView<'_>,
    input: TokenInput<'_>,
    n_deepstack: usize,
    h: &mut [f32],
) -> Result<(), ForwardError<E>> {
    match input {
        TokenInput::Token(token) => {
            let row = emb.row(token as usize).ok_or(ForwardError::Token(token))?;
            quant::dequantize(emb.ty(), row, h).map_err(ForwardError::Quant)?;
        }
        TokenInput::Embedding(e) => {
            let n = h.len();
            let with_features = n_deepstack
                .checked_add(1)
                .and_then(|k| k.checked_mul(n))
                .is_some_and(|w| n_deepstack > 0 && e.len() == w);
            if e.len() != n && !with_features {
                return Err(ForwardError::Shape("input embedding length"));
            }
            h.copy_from_slice(&e[..n]);
        }
    }
    Ok(())
}

/// After layer `layer`, the residual stream `h` of an image embedding that
/// carries deepstack features (see [`embed`]) takes the layer's feature
/// (Qwen3-VL; llama.cpp adds it after the layer's FFN residual). Tokens and
/// plain embeddings are left alone.
pub(super) fn add_deepstack(
    n_embd: usize,
    n_deepstack: usize,
    input: TokenInput<'_>,
    layer: usize,
    h: &mut [f32],
) {
    if layer >= n_deepstack {
        return;
    }
    if let TokenInput::Embedding(e) = input {
        if e.len() > n_embd {
            let feature = &e[(layer + 1) * n_embd..][..n_embd];
            for (x, f) in h.iter_mut().zip(feature) {
                *x += f;
            }
        }
    }
}

/// The router configuration of an MoE model (`None` for a dense one).
pub(super) fn router_config<E>(hp: &Hparams) -> Result<Option<RouterConfig>, ForwardError<E>> {
    Ok(match hp.moe {
        Some(m) => {
            let rc =
                RouterConfig::new(m.n_experts, m.top_k, m.gating, m.normalize, m.weights_scale)?;
            Some(match m.groups {
                Some(g) => rc.with_groups(g)?,
                None => rc,
            })
        }
        None => None,
    })
}

/// Layer `lw`'s mixer at position `pos` on the residual stream `s.h`: the
/// attention norm, attention over the KV cache or a DeltaNet step over the
/// recurrent state, and the residual add. `idx` holds the cache layer of the
/// next attention layer and the state slot of the next linear one, advanced here.
#[allow(clippy::too_many_arguments)]
pub(super) fn mix<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    lw: &Block<'_>,
    mv: &mut M,
    s: &mut Scratch<'_>,
    kv: &mut KvCache<'_>,
    rs: &mut RecurrentState<'_>,
    idx: (&mut usize, &mut usize),
    at: Place,
) -> Result<(), ForwardError<E>> {
    let pos = at.index;
    let (attn_idx, lin_idx) = idx;
    if let Mixer::None = lw.mixer {
        return Ok(());
    }
    let shape = AttnShape {
        n_head: hp.n_head,
        n_head_kv: hp.n_head_kv,
        head_dim: hp.head_dim,
    };
    rms_norm(s.h, lw.attn_norm, hp.norm_eps, s.x);
    match &lw.mixer {
        Mixer::Attention(aw) => {
            if *attn_idx >= kv.n_layers() {
                return Err(ForwardError::Shape(
                    "more attention layers than the KV cache",
                ));
            }
            attention_layer(hp, hy, aw, mv, s, kv, *attn_idx, at, shape)?;
            *attn_idx += 1;
        }
        Mixer::Mla(mw) => {
            if *attn_idx >= kv.n_layers() {
                return Err(ForwardError::Shape(
                    "more attention layers than the KV cache",
                ));
            }
            mla::mla_layer(hp, hy, mw, mv, s, kv, *attn_idx, pos)?;
            *attn_idx += 1;
        }
        Mixer::DeltaNet(dw) => {
            let (conv, ssm) = deltanet_state(hp, hy, dw, rs, *lin_idx)?;
            mv.matvec(&dw.qkv, s.x, s.d_qkv)?;
            mv.matvec(&dw.gate, s.x, s.d_z)?;
            mv.matvec(&dw.beta, s.x, s.d_beta)?;
            mv.matvec(&dw.alpha, s.x, s.d_alpha)?;
            deltanet_step(hp, dw, mv, s, conv, ssm, pos);
            mv.matvec(&dw.out, s.d_out, s.tmp)?;
            *lin_idx += 1;
        }
        Mixer::Mamba2(mw) => {
            let (conv, ssm) = mamba2_state(hp, hy, mw, rs, *lin_idx)?;
            mv.matvec(&mw.in_proj, s.x, s.d_qkv)?;
            mamba2_step(hp, mw, mv, s, conv, ssm, pos);
            mv.matvec(&mw.out, s.d_out, s.tmp)?;
            *lin_idx += 1;
        }
        Mixer::ShortConv(cw) => {
            let conv = shortconv_state(hp, hy, cw, rs, *lin_idx)?;
            mv.matvec(&cw.in_proj, s.x, s.d_qkv)?;
            shortconv_step(cw, s, conv, pos);
            mv.matvec(&cw.out, s.d_out, s.tmp)?;
            *lin_idx += 1;
        }
        // Returned above, before the norm: nothing to add.
        Mixer::None => return Ok(()),
    }
    add_residual(hp, s.h, s.tmp);
    Ok(())
}

/// The recurrent state (conv, ssm) of linear-attention layer `state` for
/// DeltaNet weights `dw`, after checking they fit the model.
pub(super) fn deltanet_state<'r, E>(
    hp: &Hparams,
    hy: &HybridParams,
    dw: &DeltaNetWeights<'_>,
    rs: &'r mut RecurrentState<'_>,
    state: usize,
) -> Result<(&'r mut [f32], &'r mut [f32]), ForwardError<E>> {
    let shape = LinearShape::DeltaNet(dw.shape);
    layer_state(hy, rs, shape, dw.check(hp.n_embd), state)
}

/// The recurrent state of layer `state`, whose weights have `shape` and
/// `checked` says whether they fit the model: its conv and ssm slices, or
/// the first problem (named by the layer's kind).
fn layer_state<'r, E>(
    hy: &HybridParams,
    rs: &'r mut RecurrentState<'_>,
    shape: LinearShape,
    checked: Result<(), &'static str>,
    state: usize,
) -> Result<(&'r mut [f32], &'r mut [f32]), ForwardError<E>> {
    let (missing, mismatch) = match shape {
        LinearShape::DeltaNet(_) => (
            "linear-attention layer without recurrent state",
            "DeltaNet layer shape",
        ),
        LinearShape::Mamba2(_) => ("Mamba2 layer without recurrent state", "Mamba2 layer shape"),
        LinearShape::ShortConv(_) => (
            "short-convolution layer without recurrent state",
            "short-convolution layer shape",
        ),
    };
    let Some((_, model_shape)) = hy.linear.filter(|_| state < rs.n_layers) else {
        return Err(ForwardError::Shape(missing));
    };
    if model_shape != shape {
        return Err(ForwardError::Shape(mismatch));
    }
    checked.map_err(ForwardError::Shape)?;
    let (cl, ml) = (shape.conv_state_len(), shape.ssm_state_len());
    Ok((
        &mut rs.conv[state * cl..][..cl],
        &mut rs.ssm[state * ml..][..ml],
    ))
}

/// Position 0 starts a sequence: a recurrent layer's state from zero.
fn clear_at_start(pos: usize, conv: &mut [f32], ssm: &mut [f32]) {
    if pos == 0 {
        conv.fill(0.0);
        ssm.fill(0.0);
    }
}

/// The recurrent state (conv, ssm) of recurrent layer `state` for Mamba2
/// weights `mw`, after checking they fit the model.
pub(super) fn mamba2_state<'r, E>(
    hp: &Hparams,
    hy: &HybridParams,
    mw: &Mamba2Weights<'_>,
    rs: &'r mut RecurrentState<'_>,
    state: usize,
) -> Result<(&'r mut [f32], &'r mut [f32]), ForwardError<E>> {
    let shape = LinearShape::Mamba2(mw.shape);
    layer_state(hy, rs, shape, mw.check(hp.n_embd), state)
}

/// One Mamba2 step at position `pos` (position 0 starts from a zero state)
/// from the input projection in `s.d_qkv`, into `s.d_out`.
pub(super) fn mamba2_step<M: MatVec + ?Sized>(
    hp: &Hparams,
    mw: &Mamba2Weights<'_>,
    mv: &mut M,
    s: &mut Scratch<'_>,
    conv: &mut [f32],
    ssm: &mut [f32],
    pos: usize,
) {
    clear_at_start(pos, conv, ssm);
    mamba2::step(mv, mw, s.d_qkv, hp.norm_eps, conv, ssm, s.d_out);
}

/// The convolution state of recurrent layer `state` for short-convolution
/// weights `cw`, after checking they fit the model.
pub(super) fn shortconv_state<'r, E>(
    hp: &Hparams,
    hy: &HybridParams,
    cw: &ShortConvWeights<'_>,
    rs: &'r mut RecurrentState<'_>,
    state: usize,
) -> Result<&'r mut [f32], ForwardError<E>> {
    let shape = LinearShape::ShortConv(cw.shape);
    layer_state(hy, rs, shape, cw.check(hp.n_embd), state).map(|(conv, _)| conv)
}

/// One short-convolution step at position `pos` (position 0 starts from a
/// zero state) from the input projection in `s.d_qkv`, into `s.d_out`.
pub(super) fn shortconv_step(
    cw: &ShortConvWeights<'_>,
    s: &mut Scratch<'_>,
    conv: &mut [f32],
    pos: usize,
) {
    clear_at_start(pos, conv, &mut []);
    shortconv::step(cw, s.d_qkv, conv, s.d_out);
}

/// One DeltaNet step at position `pos` (position 0 starts from a zero state)
/// from the projections in `s.d_qkv`, `s.d_z`, `s.d_beta`, `s.d_alpha`, into
/// `s.d_out`.
pub(super) fn deltanet_step<M: MatVec + ?Sized>(
    hp: &Hparams,
    dw: &DeltaNetWeights<'_>,
    mv: &mut M,
    s: &mut Scratch<'_>,
    conv: &mut [f32],
    ssm: &mut [f32],
    pos: usize,
) {
    clear_at_start(pos, conv, ssm);
    deltanet::step(
        mv,
        dw,
        Projections {
            qkv: s.d_qkv,
            z: s.d_z,
            beta: s.d_beta,
            alpha: s.d_alpha,
        },
        hp.norm_eps,
        conv,
        ssm,
        s.d_out,
    );
}

/// The next expert to compute: with other work left to fill the wait (`filler`),
/// [`Experts::try_next`], which answers [`Step::Pending`] while none is ready;
/// else [`Experts::next`], which blocks. With `split`, [`Experts::next_part`]
/// instead, which may also hand out experts in halves.
pub(super) fn next_step<X: Experts>(
    experts: &mut X,
    filler: bool,
    split: bool,
) -> Result<Step<'_>, ForwardError<X::Error>> {
    match (split, filler) {
        (true, _) => experts.next_part(!filler),
        (false, true) => experts.try_next(),
        (false, false) => experts.next().map(Step::from),
    }
    .map_err(ForwardError::Experts)
}

/// Adds a MoE layer's output to the residual stream `h`: the picked experts'
/// outputs weighted by their router weights, in the order given (router
/// order), then the shared expert's, summed into `moe` first. The one order of
/// these additions is what makes the result the same whatever order the experts
/// were computed in.
pub(super) fn combine<'o>(
    moe: &mut [f32],
    picks: impl Iterator<Item = (f32, &'o [f32])>,
    shared: Option<&[f32]>,
    residual: f32,
    h: &mut [f32],
) {
    moe.fill(0.0);
    for (w, out) in picks {
        for (acc, o) in moe.iter_mut().zip(out) {
            *acc += w * o;
        }
    }
    if let Some(sh) = shared {
        add_into(moe, sh);
    }
    add_scaled_into(h, moe, residual);
}

/// Scales a shared expert's output by its gate, `sigmoid(logit)`.
pub(super) fn gate_shared(out: &mut [f32], logit: f32) {
    let gate = router::shared_expert_gate(logit);
    for v in out.iter_mut() {
        *v *= gate;
    }
}

/// Lookahead prediction for the MoE layers `targets` (those `la` enables): each
/// one's router ([`Weights::lookahead_router`] where the weights have a cheaper
/// copy) on the residual stream `s.h` (normed by that layer's FFN norm, unless
/// the router reads the layer's input, [`early_router`]), handed to
/// [`Experts::prefetch`]. Does nothing where `experts` wants no predictions.
#[allow(clippy::too_many_arguments)]
fn predict_layers<W: Weights, M: MatVec, X: Experts>(
    hp: &Hparams,
    weights: &W,
    rc: &RouterConfig,
    la: &Lookahead,
    targets: impl Iterator<Item = usize>,
    mv: &mut M,
    s: &mut Scratch<'_>,
    experts: &mut X,
) -> Result<(), ForwardError<X::Error>> {
    if !experts.wants_predictions() {
        return Ok(());
    }
    let mut prediction = Prediction::new();
    let mut ids: heapless::Vec<u16, { router::MAX_PREDICTED }> = heapless::Vec::new();
    for layer in targets.filter(|l| la.layers.is_enabled(*l)) {
        let w = weights.block(layer);
        if let Ffn::Moe {
            router,
            router_bias,
            selection_bias,
            ..
        } = w.ffn
        {
            let r = lookahead_matrix(weights, layer, router);
            if hp.moe.is_some_and(|m| m.route_before_attention) {
                s.pred_x.copy_from_slice(s.h);
            } else {
                rms_norm(s.h, w.ffn_norm, hp.norm_eps, s.pred_x);
            }
            mv.matvec(&r, s.pred_x, s.router)?;
            add_bias(s.router, router_bias).map_err(ForwardError::Shape)?;
            let p = &la.predictor;
            router::predict(s.router, selection_bias, rc, p, &mut prediction)?;
            ids.clear();
            ids.extend(prediction.iter().map(|p| p.expert));
            experts
                .prefetch(layer, &ids)
                .map_err(ForwardError::Experts)?;
        }
    }
    Ok(())
}

/// The first `depth` layers from `from` on (below `n_layers`) with routed
/// experts: the layers a lookahead predicts.
pub fn next_moe_layers<W: Weights>(
    weights: &W,
    n_layers: usize,
    from: usize,
    depth: usize,
) -> impl Iterator<Item = usize> + '_ {
    (from..n_layers)
        .filter(|&l| matches!(weights.block(l).ffn, Ffn::Moe { .. }))
        .take(depth)
}

/// The router matrix `layer`'s lookahead multiplies: the weights' cheaper
/// copy ([`Weights::lookahead_router`]) where it has the router's shape, else
/// the router itself.
pub(super) fn lookahead_matrix<'w, W: Weights>(
    weights: &'w W,
    layer: usize,
    router: MatrixView<'w>,
) -> MatrixView<'w> {
    weights
        .lookahead_router(layer)
        .filter(|c| c.rows() == router.rows() && c.cols() == router.cols())
        .unwrap_or(router)
}

/// The shared expert of `x` into `out`, scaled by its gate where it has one.
pub(super) fn shared_expert<M: MatVec, E>(
    mv: &mut M,
    sh: &SharedExpert<'_>,
    x: &[f32],
    ff_a: &mut [f32],
    ff_b: &mut [f32],
    out: &mut [f32],
) -> Result<(), ForwardError<E>> {
    let m = ExpertMatrices {
        gate: sh.gate,
        up: sh.up,
        down: sh.down,
    };
    ffn(mv, &m, x, ff_a, ff_b, out)?;
    if let Some(g) = sh.gate_inp {
        let mut logit = [0f32];
        mv.matvec(&g, x, &mut logit)?;
        gate_shared(out, logit[0]);
    }
    Ok(())
}

/// One attention layer: `s.x` (the normed hidden state) in, `s.tmp` (the output
/// projection) out; the layer's keys and values go to cache layer `cache_layer`.
#[allow(clippy::too_many_arguments)]
fn attention_layer<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    aw: &AttentionWeights<'_>,
    mv: &mut M,
    s: &mut Scratch<'_>,
    kv: &mut KvCache<'_>,
    cache_layer: usize,
    at: Place,
    shape: AttnShape,
) -> Result<(), ForwardError<E>> {
    if hy.attn_output_gate {
        if s.qg.len() != 2 * hp.q_dim() || aw.wq.rows() != s.qg.len() {
            return Err(ForwardError::Shape("gated query projection"));
        }
        mv.matvec(&aw.wq, s.x, s.qg)?;
    } else {
        mv.matvec(&aw.wq, s.x, s.q)?;
    }
    mv.matvec(&aw.wk, s.x, s.k)?;
    mv.matvec(&aw.wv, s.x, s.v)?;
    attend(hp, hy, aw, mv, s, kv, cache_layer, at, shape)?;
    mv.matvec(&aw.wo, s.att, s.tmp)?;
    add_bias(s.tmp, aw.bo).map_err(ForwardError::Shape)?;
    Ok(())
}

/// Attention at position `pos` from its projections (`s.q`, or `s.qg` with an
/// output gate, and `s.k`, `s.v`): biases, q/k norms, RoPE, the position's keys
/// and values into the cache, attention over positions `0..=pos`, the output
/// gate; the result in `s.att`, before the output projection.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    aw: &AttentionWeights<'_>,
    mv: &mut M,
    s: &mut Scratch<'_>,
    kv: &mut KvCache<'_>,
    cache_layer: usize,
    at: Place,
    shape: AttnShape,
) -> Result<(), ForwardError<E>> {
    project_position(hp, hy, aw, s, kv, cache_layer, at)?;
    let kv = attended(aw, kv, cache_layer, at.index + 1)?;
    mv.attention(shape, s.q, kv, s.scores, s.att);
    if hy.attn_output_gate {
        output_gate(hp.head_dim, s.qg, s.att);
    }
    Ok(())
}

/// What the query at position `end - 1` of a layer with attention weights
/// `aw` attends over in cache layer `cache_layer`: the positions up to its
/// own, only those of its window where the layer has one, and its sinks.
pub(super) fn attended<'k, E>(
    aw: &AttentionWeights<'k>,
    kv: &'k KvCache<'_>,
    cache_layer: usize,
    end: usize,
) -> Result<KvView<'k>, ForwardError<E>> {
    let start = match aw.window {
        Some(w) => w
            .start(end)
            .ok_or(ForwardError::Shape("attention window of 0 positions"))?,
        None => 0,
    };
    Ok(KvView {
        sinks: aw.sinks,
        ..cached(kv, cache_layer, start..end)?
    })
}

/// The keys and values of `kv` (cache layer `cache_layer`) at positions
/// `range`, which ends at the position cached last.
pub(super) fn cached<'k, E>(
    kv: &'k KvCache<'_>,
    cache_layer: usize,
    range: core::ops::Range<usize>,
) -> Result<KvView<'k>, ForwardError<E>> {
    kv.view(cache_layer, range).ok_or(ForwardError::Shape(
        "attention over more positions than the layer's KV cache ring holds",
    ))
}

/// An attention output `att` gated by the gate halves of the projected
/// query `qg` (`[q_h, g_h]` per head): `att_h *= sigmoid(g_h)`.
pub(super) fn output_gate(hd: usize, qg: &[f32], att: &mut [f32]) {
    for (h, pair) in qg.chunks_exact(2 * hd).enumerate() {
        for (o, g) in att[h * hd..][..hd].iter_mut().zip(&pair[hd..]) {
            *o *= sigmoid(*g);
        }
    }
}

/// Position `pos`'s query, key and value, projected into `s.qg` (or `s.q`),
/// `s.k` and `s.v`, made ready: biases, head norms and rotations (a NoPE
/// layer's temperature instead of the rotations); the query
/// into `s.q`, the key and value into the cache at `pos`.
#[allow(clippy::too_many_arguments)]
pub(super) fn project_position<E>(
    hp: &Hparams,
    hy: &HybridParams,
    aw: &AttentionWeights<'_>,
    s: &mut Scratch<'_>,
    kv: &mut KvCache<'_>,
    cache_layer: usize,
    at: Place,
) -> Result<(), ForwardError<E>> {
    let pos = at.index;
    if hy.attn_output_gate {
        // [q_h, g_h] per head: split the query from its gate.
        let hd = hp.head_dim;
        if s.qg.len() != 2 * hp.q_dim() {
            return Err(ForwardError::Shape("gated query projection"));
        }
        for (h, pair) in s.qg.chunks_exact(2 * hd).enumerate() {
            s.q[h * hd..][..hd].copy_from_slice(&pair[..hd]);
        }
    }
    add_bias(s.q, aw.bq).map_err(ForwardError::Shape)?;
    add_bias(s.k, aw.bk).map_err(ForwardError::Shape)?;
    add_bias(s.v, aw.bv).map_err(ForwardError::Shape)?;
    if !aw.norm_after_rope {
        norm_heads(s.q, aw.q_norm, hp.norm_eps).map_err(ForwardError::Shape)?;
        norm_heads(s.k, aw.k_norm, hp.norm_eps).map_err(ForwardError::Shape)?;
    }
    if let Some(t) = aw.nope {
        let f = t.at(pos);
        for q in s.q.iter_mut() {
            *q *= f;
        }
    } else {
        match hy.rope_sections {
            Some(_) if aw.rope_freqs.is_some() => {
                return Err(ForwardError::Shape("RoPE frequency factors with sections"));
            }
            Some(m) => {
                for x in [&mut *s.q, &mut *s.k] {
                    rope_multi_scaled(
                        x,
                        hp.head_dim,
                        hp.n_rot,
                        at.rope,
                        &m,
                        hp.rope_base,
                        hp.rope_yarn.as_ref(),
                    );
                }
            }
            None => {
                if aw.rope_freqs.is_some_and(|f| f.len() != hp.n_rot / 2) {
                    return Err(ForwardError::Shape("RoPE frequency factors"));
                }
                for x in [&mut *s.q, &mut *s.k] {
                    rope_factored(
                        x,
                        hp.head_dim,
                        hp.n_rot,
                        pos as u32,
                        hp.rope_base,
                        hp.rope_style,
                        hp.rope_yarn.as_ref(),
                        aw.rope_freqs,
                    );
                }
            }
        }
    }
    if aw.norm_after_rope {
        norm_heads(s.q, aw.q_norm, hp.norm_eps).map_err(ForwardError::Shape)?;
        norm_heads(s.k, aw.k_norm, hp.norm_eps).map_err(ForwardError::Shape)?;
    }
    if let Some(scale) = hp.scales.attention {
        // The kernels scale the scores by 1 / sqrt(head_dim): the query
        // carries the rest.
        let f = scale * libm::sqrtf(hp.head_dim as f32);
        s.q.iter_mut().for_each(|q| *q *= f);
    }
    kv.store(cache_layer, pos, s.k, s.v);
    Ok(())
}
