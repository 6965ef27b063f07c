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

use super::config::Hparams;
use super::ops::{attention, rms_norm, rms_norm_heads, rope, swiglu, AttnShape};
use crate::gemv::{activation_format, gemv, ActivationFormat, GemvError, Input, Isa, MatrixView};
use crate::quant::blocks::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use crate::quant::{self, QuantError};
use crate::router::{
    self, LayerMask, Prediction, PredictorConfig, RouterConfig, RouterError, Routing,
};

/// Weights of one shared (always-resident) expert.
#[derive(Clone, Copy, Debug)]
pub struct SharedExpert<'a> {
    /// Gate projection (`n_ff_shared` x `n_embd`).
    pub gate: MatrixView<'a>,
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
    /// A dense SwiGLU FFN.
    Dense {
        /// Gate projection.
        gate: MatrixView<'a>,
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
    },
}

/// The resident weights of one layer.
#[derive(Clone, Copy, Debug)]
pub struct LayerWeights<'a> {
    /// Pre-attention RMSNorm weight.
    pub attn_norm: &'a [f32],
    /// Query projection.
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
    /// Pre-FFN RMSNorm weight.
    pub ffn_norm: &'a [f32],
    /// The FFN.
    pub ffn: Ffn<'a>,
}

/// Access to a model's resident weights.
pub trait Weights {
    /// Weights of layer `layer` (< `n_layers`).
    fn layer(&self, layer: usize) -> LayerWeights<'_>;
    /// Token embedding matrix (`n_vocab` x `n_embd`).
    fn embedding(&self) -> MatrixView<'_>;
    /// Final RMSNorm weight.
    fn output_norm(&self) -> &[f32];
    /// Output projection (`n_vocab` x `n_embd`), the embedding when tied.
    fn output(&self) -> MatrixView<'_>;
}

/// The three matrices of one routed expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertMatrices<'a> {
    /// Gate projection (`n_ff_exp` x `n_embd`).
    pub gate: MatrixView<'a>,
    /// Up projection.
    pub up: MatrixView<'a>,
    /// Down projection (`n_embd` x `n_ff_exp`).
    pub down: MatrixView<'a>,
}

/// Supplies routed experts: all resident, or streamed through the scheduler.
pub trait Experts {
    /// Error of the supplier (I/O, checksum).
    type Error;
    /// A new token starts.
    fn begin_token(&mut self) {}
    /// The router of `layer` picked `routing` (expert ids, router order).
    fn begin_layer(&mut self, layer: usize, routing: &[u16]) -> Result<(), Self::Error>;
    /// Whether [`prefetch`](Self::prefetch) is used (predictions cost a GEMV).
    fn wants_predictions(&self) -> bool {
        false
    }
    /// Lookahead prediction of `layer`'s experts, most confident first.
    fn prefetch(&mut self, layer: usize, predicted: &[u16]) -> Result<(), Self::Error> {
        let _ = (layer, predicted);
        Ok(())
    }
    /// The next picked expert to compute, as its routing index and matrices, or
    /// `None` once every picked expert was handed out and finished.
    fn next(&mut self) -> Result<Option<(usize, ExpertMatrices<'_>)>, Self::Error>;
    /// Routing index `index` was computed; its memory may be reused.
    fn finish(&mut self, index: usize) -> Result<(), Self::Error>;
}

/// Matrix-vector products `y = W x` over all rows.
pub trait MatVec {
    /// Computes `y = w x`.
    fn matvec(&mut self, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) -> Result<(), GemvError>;
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
}

/// Lookahead prediction settings.
#[derive(Clone, Copy, Debug)]
pub struct Lookahead {
    /// How many experts to predict.
    pub predictor: PredictorConfig,
    /// Layers to predict for.
    pub layers: LayerMask,
}

/// Per-layer KV cache over caller memory: `[layer][position][kv_dim]` for keys and
/// values each.
pub struct KvCache<'a> {
    k: &'a mut [f32],
    v: &'a mut [f32],
    max_positions: usize,
}

impl<'a> KvCache<'a> {
    /// Floats each of `k` and `v` must hold.
    pub fn len(hp: &Hparams, max_positions: usize) -> usize {
        hp.n_layers * max_positions * hp.kv_dim()
    }

    /// A cache of `max_positions` positions; `k` and `v` hold [`len`](Self::len) floats.
    pub fn new(
        hp: &Hparams,
        k: &'a mut [f32],
        v: &'a mut [f32],
        max_positions: usize,
    ) -> Option<Self> {
        let n = Self::len(hp, max_positions);
        (k.len() == n && v.len() == n).then_some(KvCache {
            k,
            v,
            max_positions,
        })
    }

    /// Positions it holds at most.
    pub fn max_positions(&self) -> usize {
        self.max_positions
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
    router: &'a mut [f32],
    pred_x: &'a mut [f32],
}

fn max_ff(hp: &Hparams) -> usize {
    let m = hp
        .moe
        .map_or(0, |m| m.n_ff_exp.max(m.n_ff_shared.unwrap_or(0)));
    hp.n_ff.max(m).max(1)
}

impl<'a> Scratch<'a> {
    /// Floats of scratch needed for `hp` with up to `max_positions` positions.
    pub fn len(hp: &Hparams, max_positions: usize) -> usize {
        let e = hp.n_embd;
        let (k, n_exp) = hp.moe.map_or((0, 0), |m| (m.top_k, m.n_experts));
        5 * e + 2 * hp.q_dim() + 2 * hp.kv_dim() + max_positions + 2 * max_ff(hp) + k * e + n_exp
    }

    /// Splits `buf` (at least [`len`](Self::len) floats).
    pub fn new(hp: &Hparams, buf: &'a mut [f32], max_positions: usize) -> Option<Self> {
        if buf.len() < Self::len(hp, max_positions) {
            return None;
        }
        let e = hp.n_embd;
        let (top_k, n_exp) = hp.moe.map_or((0, 0), |m| (m.top_k, m.n_experts));
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
        let (router, rest) = rest.split_at_mut(n_exp);
        let (pred_x, _) = rest.split_at_mut(e);
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
            router,
            pred_x,
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

fn add_into(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
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

/// SwiGLU FFN `down(silu(gate x) * up x)` into `out`.
fn swiglu_ffn<M: MatVec>(
    mv: &mut M,
    w: &ExpertMatrices<'_>,
    x: &[f32],
    ff_a: &mut [f32],
    ff_b: &mut [f32],
    out: &mut [f32],
) -> Result<(), GemvError> {
    let ExpertMatrices { gate, up, down } = w;
    let n = gate.rows();
    if up.rows() != n || down.cols() != n || n > ff_a.len() {
        return Err(GemvError::RowLength {
            ty: down.ty(),
            cols: down.cols(),
        });
    }
    let (a, b) = (&mut ff_a[..n], &mut ff_b[..n]);
    mv.matvec(gate, x, a)?;
    mv.matvec(up, x, b)?;
    swiglu(a, b);
    mv.matvec(down, a, out)
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
    if pos >= kv.max_positions {
        return Err(ForwardError::ContextFull(kv.max_positions));
    }
    if logits.len() != hp.n_vocab {
        return Err(ForwardError::Shape("logits length"));
    }
    match input {
        TokenInput::Token(token) => {
            let emb = weights.embedding();
            let row = emb.row(token as usize).ok_or(ForwardError::Token(token))?;
            quant::dequantize(emb.ty(), row, s.h).map_err(ForwardError::Quant)?;
        }
        TokenInput::Embedding(e) => {
            if e.len() != s.h.len() {
                return Err(ForwardError::Shape("input embedding length"));
            }
            s.h.copy_from_slice(e);
        }
    }

    let router_cfg = match hp.moe {
        Some(m) => Some(RouterConfig::new(
            m.n_experts,
            m.top_k,
            m.gating,
            m.normalize,
            m.weights_scale,
        )?),
        None => None,
    };
    let shape = AttnShape {
        n_head: hp.n_head,
        n_head_kv: hp.n_head_kv,
        head_dim: hp.head_dim,
    };
    let kv_dim = hp.kv_dim();
    let layer_stride = kv.max_positions * kv_dim;
    experts.begin_token();
    let mut routing = Routing::new();
    let mut prediction = Prediction::new();
    let mut ids: heapless::Vec<u16, { router::MAX_PREDICTED }> = heapless::Vec::new();

    for l in 0..hp.n_layers {
        let lw = weights.layer(l);
        // Attention.
        rms_norm(s.h, lw.attn_norm, hp.norm_eps, s.x);
        mv.matvec(&lw.wq, s.x, s.q)?;
        mv.matvec(&lw.wk, s.x, s.k)?;
        mv.matvec(&lw.wv, s.x, s.v)?;
        add_bias(s.q, lw.bq).map_err(ForwardError::Shape)?;
        add_bias(s.k, lw.bk).map_err(ForwardError::Shape)?;
        add_bias(s.v, lw.bv).map_err(ForwardError::Shape)?;
        norm_heads(s.q, lw.q_norm, hp.norm_eps).map_err(ForwardError::Shape)?;
        norm_heads(s.k, lw.k_norm, hp.norm_eps).map_err(ForwardError::Shape)?;
        rope(
            s.q,
            hp.head_dim,
            hp.n_rot,
            pos as u32,
            hp.rope_base,
            hp.rope_style,
        );
        rope(
            s.k,
            hp.head_dim,
            hp.n_rot,
            pos as u32,
            hp.rope_base,
            hp.rope_style,
        );
        let base = l * layer_stride;
        kv.k[base + pos * kv_dim..][..kv_dim].copy_from_slice(s.k);
        kv.v[base + pos * kv_dim..][..kv_dim].copy_from_slice(s.v);
        attention(
            shape,
            s.q,
            &kv.k[base..base + layer_stride],
            &kv.v[base..base + layer_stride],
            pos + 1,
            s.scores,
            s.att,
        );
        mv.matvec(&lw.wo, s.att, s.tmp)?;
        add_into(s.h, s.tmp);

        // FFN.
        rms_norm(s.h, lw.ffn_norm, hp.norm_eps, s.x);
        match lw.ffn {
            Ffn::Dense { gate, up, down } => {
                swiglu_ffn(
                    mv,
                    &ExpertMatrices { gate, up, down },
                    s.x,
                    s.ff_a,
                    s.ff_b,
                    s.tmp,
                )?;
                add_into(s.h, s.tmp);
            }
            Ffn::Moe { router, shared } => {
                let rc = router_cfg
                    .as_ref()
                    .ok_or(ForwardError::Shape("MoE layer without MoE parameters"))?;
                mv.matvec(&router, s.x, s.router)?;
                rc.route(s.router, None, &mut routing)?;
                ids.clear();
                ids.extend(routing.iter().map(|r| r.expert));
                experts
                    .begin_layer(l, &ids)
                    .map_err(ForwardError::Experts)?;

                // Lookahead: the next layer's router on this layer's hidden state.
                if let Some(la) = lookahead.filter(|_| experts.wants_predictions()) {
                    let next = l + 1;
                    if next < hp.n_layers && la.layers.is_enabled(next) {
                        let nw = weights.layer(next);
                        if let Ffn::Moe { router: nr, .. } = nw.ffn {
                            rms_norm(s.h, nw.ffn_norm, hp.norm_eps, s.pred_x);
                            mv.matvec(&nr, s.pred_x, s.router)?;
                            router::predict(s.router, None, rc, &la.predictor, &mut prediction)?;
                            ids.clear();
                            ids.extend(prediction.iter().map(|p| p.expert));
                            experts
                                .prefetch(next, &ids)
                                .map_err(ForwardError::Experts)?;
                        }
                    }
                }

                // Ready-first: compute in whatever order experts become ready.
                let e = hp.n_embd;
                while let Some((index, m)) = experts.next().map_err(ForwardError::Experts)? {
                    let out = s
                        .expert_out
                        .get_mut(index * e..(index + 1) * e)
                        .ok_or(ForwardError::Shape("routing index"))?;
                    swiglu_ffn(mv, &m, s.x, s.ff_a, s.ff_b, out)?;
                    experts.finish(index).map_err(ForwardError::Experts)?;
                }
                // Combine in router order, whatever the compute order was.
                s.moe.fill(0.0);
                for (i, r) in routing.iter().enumerate() {
                    for (acc, o) in s.moe.iter_mut().zip(&s.expert_out[i * e..(i + 1) * e]) {
                        *acc += r.weight * o;
                    }
                }
                if let Some(sh) = shared {
                    let shw = ExpertMatrices {
                        gate: sh.gate,
                        up: sh.up,
                        down: sh.down,
                    };
                    swiglu_ffn(mv, &shw, s.x, s.ff_a, s.ff_b, s.tmp)?;
                    if let Some(g) = sh.gate_inp {
                        let mut logit = [0f32];
                        mv.matvec(&g, s.x, &mut logit)?;
                        let gate = router::shared_expert_gate(logit[0]);
                        for v in s.tmp.iter_mut() {
                            *v *= gate;
                        }
                    }
                    add_into(s.moe, s.tmp);
                }
                add_into(s.h, s.moe);
            }
        }
    }
    rms_norm(s.h, weights.output_norm(), hp.norm_eps, s.x);
    mv.matvec(&weights.output(), s.x, logits)?;
    Ok(())
}
