//! Several consecutive positions through the model at once, layer by layer: a
//! prompt's prefill; or several sequences' next positions in one pass
//! ([`forward_sequences`]), each sequence's mixers over its own KV cache and
//! recurrent state, their experts shared.
//!
//! [`forward_batch`] runs every layer for all the positions before the next
//! layer, so a routed expert that several positions picked is asked of the
//! [`Experts`] supplier once and computed for each of them back to back (its
//! bytes are read from flash once, and from RAM once while they are in cache).
//! The supplier gets the layer's picks as their union, in groups of at most
//! [`Experts::max_picks`].
//!
//! Exactness: each position's arithmetic is the one [`forward_hybrid`] does for
//! it alone, in the same order (the same kernels on the same vectors, outputs
//! combined in its router order, the shared expert last), and the positions of
//! a layer run in order, so each sees the KV cache and recurrent state of the
//! earlier ones. The logits, caches and states are bit-identical to evaluating
//! the positions one at a time.
//!
//! [`forward_hybrid`]: super::forward_hybrid

use super::deltanet::DeltaNetWeights;
use super::mamba2::Mamba2Weights;
use super::shortconv::ShortConvWeights;
use super::{
    add_bias, add_deepstack, add_into, add_residual, attended, cached, combine, deltanet_state,
    deltanet_step, early_router, embed, expert_tail, ffn_checked, gate_shared, lookahead_matrix,
    mamba2_state, mamba2_step, next_moe_layers, next_step, output_gate, project_position,
    router_config, scale_embedding, scale_logits, shortconv_state, shortconv_step,
    AttentionWeights, ExpertMatrices, ExpertTail, Experts, Ffn, ForwardError, Handout, KvCache,
    MatVec, Mixer, MoeFfn, Place, RecurrentState, Residency, RouterBiases, Scratch, SharedExpert,
    Step, TokenInput, Weights,
};
use crate::gemv::{GemvError, MatrixView};
use crate::model::config::{Hparams, HybridParams};
use crate::model::ops::{rms_norm, rms_norm_heads, AttnShape};
use crate::router::{RouterConfig, Routing};

/// Per-position buffers of a batch of up to [`positions`](Self::positions)
/// positions, carved from caller memory (floats, and expert ids).
pub struct BatchScratch<'a> {
    /// Residual stream of each position (`n x n_embd`).
    h: &'a mut [f32],
    /// FFN input of each position (`n x n_embd`).
    x: &'a mut [f32],
    /// Routed experts' outputs of each position (`n x top_k x n_embd`).
    out: &'a mut [f32],
    /// Shared expert's output of each position (`n x n_embd`, empty without MoE).
    shared: &'a mut [f32],
    /// Router weights of each position's picks (`n x top_k`).
    weights: &'a mut [f32],
    /// Gate and up projections of several positions (`n x n_ff` each).
    ga: &'a mut [f32],
    gb: &'a mut [f32],
    /// Inputs gathered for one expert, and its outputs (`n x n_embd` each).
    gx: &'a mut [f32],
    go: &'a mut [f32],
    /// Router logits of each position (`n x n_experts`).
    logits: &'a mut [f32],
    /// Attention projections of each position: query (with its gate, if
    /// any), key, value, and the attention output before `wo`.
    aq: &'a mut [f32],
    ak: &'a mut [f32],
    av: &'a mut [f32],
    aatt: &'a mut [f32],
    /// Each position's query after its norms and rotation (`n x q_dim`).
    aqr: &'a mut [f32],
    /// DeltaNet projections of each position (`qkv`, `z`, `beta`, `alpha`) and
    /// its output before `out` (empty without linear attention).
    dqkv: &'a mut [f32],
    dz: &'a mut [f32],
    dbeta: &'a mut [f32],
    dalpha: &'a mut [f32],
    dout: &'a mut [f32],
    /// Each position's picks (`n x top_k`).
    ids: &'a mut [u16],
    /// The layer's union of picks (`n_experts`).
    union: &'a mut [u16],
    /// The next MoE layer's predicted picks per expert (`n_experts`).
    votes: &'a mut [u16],
    /// The next MoE layer's predicted experts to read ahead (`n_experts`).
    ahead: &'a mut [u16],
    n: usize,
    /// The buffer lengths, for the model the scratch was made for.
    lens: Lens,
}

/// Lengths of a [`BatchScratch`]'s float and id buffers.
type Lens = ([usize; 20], [usize; 4]);

impl<'a> BatchScratch<'a> {
    fn lens(hp: &Hparams, hy: &HybridParams, n: usize) -> Lens {
        let [_, d_qkv, d_z, d_beta, d_alpha, d_out, _, _] = super::extra_lens(hp, hy);
        let (e, ff) = (hp.n_embd, super::max_ff(hp));
        let q_rows = if hy.attn_output_gate { 2 } else { 1 } * hp.q_dim();
        let (k, n_exp) = hp.moe.map_or((0, 0), |m| (m.top_k, m.n_experts));
        let sh = if hp.moe.is_some() { n * e } else { 0 };
        (
            [
                n * e,
                n * e,
                n * k * e,
                sh,
                n * k,
                n * ff,
                n * ff,
                n * e,
                n * e,
                n * n_exp,
                n * q_rows,
                n * hp.kv_dim(),
                n * hp.kv_dim(),
                n * hp.q_dim(),
                n * hp.q_dim(),
                n * d_qkv,
                n * d_z,
                n * d_beta,
                n * d_alpha,
                n * d_out,
            ],
            [n * k, n_exp, n_exp, n_exp],
        )
    }

    /// Floats needed for batches of up to `n` positions of `hp` and `hy`.
    pub fn floats(hp: &Hparams, hy: &HybridParams, n: usize) -> usize {
        Self::lens(hp, hy, n).0.iter().sum()
    }

    /// Expert ids (`u16`) needed for batches of up to `n` positions of `hp`.
    pub fn ids(hp: &Hparams, hy: &HybridParams, n: usize) -> usize {
        Self::lens(hp, hy, n).1.iter().sum()
    }

    /// Splits `floats` and `ids` (at least [`floats`](Self::floats) and
    /// [`ids`](Self::ids) long) for batches of up to `n` positions.
    pub fn new(
        hp: &Hparams,
        hy: &HybridParams,
        n: usize,
        floats: &'a mut [f32],
        ids: &'a mut [u16],
    ) -> Option<Self> {
        if floats.len() < Self::floats(hp, hy, n) || ids.len() < Self::ids(hp, hy, n) {
            return None;
        }
        let lens = Self::lens(hp, hy, n);
        let (
            [l_h, l_x, l_out, l_sh, l_w, l_ga, l_gb, l_gx, l_go, l_lg, l_aq, l_ak, l_av, l_att, l_aqr, l_dqkv, l_dz, l_db, l_da, l_do],
            [l_ids, l_union, l_votes, l_ahead],
        ) = lens;
        let (h, rest) = floats.split_at_mut(l_h);
        let (x, rest) = rest.split_at_mut(l_x);
        let (out, rest) = rest.split_at_mut(l_out);
        let (shared, rest) = rest.split_at_mut(l_sh);
        let (weights, rest) = rest.split_at_mut(l_w);
        let (ga, rest) = rest.split_at_mut(l_ga);
        let (gb, rest) = rest.split_at_mut(l_gb);
        let (gx, rest) = rest.split_at_mut(l_gx);
        let (go, rest) = rest.split_at_mut(l_go);
        let (logits, rest) = rest.split_at_mut(l_lg);
        let (aq, rest) = rest.split_at_mut(l_aq);
        let (ak, rest) = rest.split_at_mut(l_ak);
        let (av, rest) = rest.split_at_mut(l_av);
        let (aatt, rest) = rest.split_at_mut(l_att);
        let (aqr, rest) = rest.split_at_mut(l_aqr);
        let (dqkv, rest) = rest.split_at_mut(l_dqkv);
        let (dz, rest) = rest.split_at_mut(l_dz);
        let (dbeta, rest) = rest.split_at_mut(l_db);
        let (dalpha, rest) = rest.split_at_mut(l_da);
        let (dout, _) = rest.split_at_mut(l_do);
        let (ids, rest) = ids.split_at_mut(l_ids);
        let (union, rest) = rest.split_at_mut(l_union);
        let (votes, rest) = rest.split_at_mut(l_votes);
        let (ahead, _) = rest.split_at_mut(l_ahead);
        Some(BatchScratch {
            h,
            x,
            out,
            shared,
            weights,
            ga,
            gb,
            gx,
            go,
            logits,
            aq,
            ak,
            av,
            aatt,
            aqr,
            dqkv,
            dz,
            dbeta,
            dalpha,
            dout,
            ids,
            union,
            votes,
            ahead,
            n,
            lens,
        })
    }

    /// The most positions one batch holds.
    pub fn positions(&self) -> usize {
        self.n
    }

    /// The final hidden states (before the output norm) of the first `n`
    /// positions of the last [`forward_batch`], `n_embd` floats each.
    pub fn hidden(&self, n: usize) -> &[f32] {
        let e = self.h.len() / self.n.max(1);
        &self.h[..(n * e).min(self.h.len())]
    }
}

/// One sequence of a [`forward_sequences`] pass: its inputs (the next `len`
/// of the pass's, after the sequences before it), where they go, and its own
/// KV cache and recurrent state.
pub struct Sequence<'s, 'k, 'r> {
    /// How many of the pass's inputs are this sequence's (at least one).
    pub len: usize,
    /// The position of its first input: its cache holds `0..pos`.
    pub pos: usize,
    /// Its inputs' M-RoPE positions (`len` of them), or `None`: text
    /// positions, the cache index.
    pub rope: Option<&'s [[u32; 4]]>,
    /// Its KV cache.
    pub kv: &'s mut KvCache<'k>,
    /// Its recurrent state (empty for models without linear attention).
    pub rs: &'s mut RecurrentState<'r>,
    /// Whether each of its positions gets next-token logits (a speculative
    /// verification's), or only its last.
    pub every: bool,
}

impl Sequence<'_, '_, '_> {
    /// How many rows of next-token logits it gets.
    fn logit_rows(&self) -> usize {
        if self.every {
            self.len
        } else {
            1
        }
    }
}

/// Marks an unused pick of a position that routed to fewer than `top_k` experts.
const NO_EXPERT: u16 = u16::MAX;

/// Runs `inputs` at positions `pos, pos + 1, ...` (the KV cache holds positions
/// `0..pos`) and writes next-token logits into `logits`: the last position's
/// where it holds `n_vocab` floats, every position's (back to back) where it
/// holds `inputs.len() * n_vocab`, as a speculative decode's verification
/// needs. They are what [`forward_hybrid`](super::forward_hybrid) of each
/// input in turn would give, bit for bit, with the caches and states left as
/// it would leave them.
/// Reads ahead where `experts` [wants predictions](Experts::wants_predictions):
/// a layer's union of picks is asked for in groups, those on their way first,
/// then the resident ones ([`Experts::residency`]), and each next group is
/// named to [`Experts::prefetch_known`] while the current one computes; during
/// the last group, the next layer's likeliest experts (its router on each
/// position's residual stream, each position's top picks voting) are named.
/// Needs at least one input, and at most `b.positions()`.
#[allow(clippy::too_many_arguments)]
pub fn forward_batch<W, M, X>(
    hp: &Hparams,
    hy: &HybridParams,
    weights: &W,
    mv: &mut M,
    experts: &mut X,
    inputs: &[TokenInput<'_>],
    pos: usize,
    kv: &mut KvCache<'_>,
    rs: &mut RecurrentState<'_>,
    s: &mut Scratch<'_>,
    b: &mut BatchScratch<'_>,
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>>
where
    W: Weights,
    M: MatVec,
    X: Experts,
{
    forward_batch_at(
        hp, hy, weights, mv, experts, inputs, pos, None, kv, rs, s, b, logits,
    )
}

/// [`forward_batch`] with each input's M-RoPE positions given (`rope`, one
/// per input; `None`: text positions, the cache index): what
/// [`forward_hybrid_at`](super::forward_hybrid_at) does for each input at
/// [`Place`] `{ index: pos + j, rope: rope[j] }`. Image embeddings may carry
/// deepstack features as there.
#[allow(clippy::too_many_arguments)]
pub fn forward_batch_at<W, M, X>(
    hp: &Hparams,
    hy: &HybridParams,
    weights: &W,
    mv: &mut M,
    experts: &mut X,
    inputs: &[TokenInput<'_>],
    pos: usize,
    rope: Option<&[[u32; 4]]>,
    kv: &mut KvCache<'_>,
    rs: &mut RecurrentState<'_>,
    s: &mut Scratch<'_>,
    b: &mut BatchScratch<'_>,
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>>
where
    W: Weights,
    M: MatVec,
    X: Experts,
{
    let mut one = [Sequence {
        len: inputs.len(),
        pos,
        rope,
        kv,
        rs,
        every: inputs.len() > 1 && logits.len() == inputs.len().saturating_mul(hp.n_vocab),
    }];
    forward_sequences(hp, hy, weights, mv, experts, inputs, &mut one, s, b, logits)
}

/// Several sequences' next inputs through the model in one pass: each
/// sequence's consecutive inputs at its own positions over its own KV cache
/// and recurrent state ([`Sequence`], in the order of `inputs`), every layer's
/// experts asked for once for all of them, so that sequences decoded together
/// read an expert they share once. Writes next-token logits back to back,
/// in order: each sequence's last position's, or every one of its
/// positions' where it asks ([`Sequence::every`]); `logits` holds that many
/// rows of `n_vocab` floats.
///
/// Each sequence's logits, cache and state are the ones [`forward_batch_at`]
/// of its inputs alone gives, bit for bit: a position's arithmetic does not
/// depend on the other positions of its pass, and each sequence's mixers see
/// its own cache and state only. With one sequence it is [`forward_batch_at`].
#[allow(clippy::too_many_arguments)]
pub fn forward_sequences<W, M, X>(
    hp: &Hparams,
    hy: &HybridParams,
    weights: &W,
    mv: &mut M,
    experts: &mut X,
    inputs: &[TokenInput<'_>],
    seqs: &mut [Sequence<'_, '_, '_>],
    s: &mut Scratch<'_>,
    b: &mut BatchScratch<'_>,
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>>
where
    W: Weights,
    M: MatVec,
    X: Experts,
{
    let n = inputs.len();
    if n == 0 || n > b.n {
        return Err(ForwardError::Shape("batch size"));
    }
    if seqs.is_empty()
        || seqs.iter().any(|q| q.len == 0)
        || seqs.iter().map(|q| q.len).sum::<usize>() != n
    {
        return Err(ForwardError::Shape(
            "each sequence one or more of the inputs",
        ));
    }
    for q in seqs.iter() {
        if q.rope.is_some_and(|r| r.len() != q.len) {
            return Err(ForwardError::Shape("one RoPE position per input"));
        }
        if q.pos.saturating_add(q.len) > q.kv.max_positions() {
            return Err(ForwardError::ContextFull(q.kv.max_positions()));
        }
    }
    let rows: usize = seqs.iter().map(Sequence::logit_rows).sum();
    if Some(logits.len()) != rows.checked_mul(hp.n_vocab) {
        return Err(ForwardError::Shape("logits length"));
    }
    let e = hp.n_embd;
    if e == 0
        || s.h.len() != e
        || hp.moe.is_some_and(|m| m.n_experts != s.router.len())
        || b.lens != BatchScratch::lens(hp, hy, b.n)
    {
        return Err(ForwardError::Shape("scratch does not fit the model"));
    }
    let emb = weights.embedding();
    for (input, h) in inputs.iter().zip(b.h.chunks_exact_mut(e)) {
        embed(&emb, *input, hy.n_deepstack, h)?;
        scale_embedding(hp, h);
    }
    let router_cfg = router_config(hp)?;
    for _ in 0..n {
        experts.begin_token();
    }
    let read_ahead = experts.wants_predictions();
    // The first layer's likeliest experts, from the embeddings: their reads
    // overlap its attention.
    if let (true, Some(rc)) = (read_ahead, router_cfg.as_ref()) {
        if let Some(first) = next_moe_layers(weights, hp.n_layers, 0, 1).next() {
            let ahead = predict_batch(hp, weights, rc, first, n, mv, b, experts)?;
            if ahead > 0 {
                experts
                    .prefetch_known(first, &b.ahead[..ahead])
                    .map_err(ForwardError::Experts)?;
            }
        }
    }
    let (mut attn_idx, mut lin_idx) = (0usize, 0usize);
    for l in 0..hp.n_layers {
        let lw = weights.block(l);
        // A router on the layer's input (SmallThinker) routes the positions
        // before the attention, whose compute then hides the reads of the
        // first group of missing picks.
        let routed = match early_router(hp, &lw.ffn) {
            Some((router, biases)) => {
                let rc = router_cfg
                    .as_ref()
                    .ok_or(ForwardError::Shape("MoE layer without MoE parameters"))?;
                let n_exp = s.router.len().max(1);
                mv.matmul(router, &b.h[..n * e], &mut b.logits[..n * n_exp])?;
                let n_union = route_batch(l, rc, biases, n, n_exp, experts, b)?;
                if read_ahead {
                    let mut missing = 0;
                    for i in 0..n_union {
                        let x = b.union[i];
                        if experts.residency(l, x) == Residency::Missing {
                            b.ahead[missing] = x;
                            missing += 1;
                        }
                    }
                    let first = missing.min(experts.max_picks(l));
                    if first > 0 {
                        experts
                            .prefetch_known(l, &b.ahead[..first])
                            .map_err(ForwardError::Experts)?;
                    }
                }
                Some(n_union)
            }
            None => None,
        };
        // Every mixer projects all the positions at once, each sequence's
        // keys, values or recurrence over its own cache or state.
        match &lw.mixer {
            Mixer::Attention(aw) => {
                attention_batch(hp, hy, aw, lw.attn_norm, mv, s, seqs, b, n, attn_idx)?;
            }
            Mixer::DeltaNet(dw) => {
                deltanet_batch(hp, hy, dw, lw.attn_norm, mv, s, seqs, b, n, lin_idx)?;
            }
            Mixer::Mamba2(mw) => {
                mamba2_batch(hp, hy, mw, lw.attn_norm, mv, s, seqs, b, n, lin_idx)?;
            }
            Mixer::ShortConv(cw) => {
                shortconv_batch(hp, hy, cw, lw.attn_norm, mv, s, seqs, b, n, lin_idx)?;
            }
            Mixer::Mla(mw) => {
                mla_batch(hp, hy, mw, lw.attn_norm, mv, s, seqs, b, n, attn_idx)?;
            }
            Mixer::None => {}
        }
        match &lw.mixer {
            Mixer::Attention(_) | Mixer::Mla(_) => attn_idx += 1,
            Mixer::DeltaNet(_) | Mixer::Mamba2(_) | Mixer::ShortConv(_) => lin_idx += 1,
            Mixer::None => {}
        }
        if !matches!(lw.ffn, Ffn::None) {
            for (h, x) in b.h.chunks_exact(e).zip(b.x.chunks_exact_mut(e)).take(n) {
                rms_norm(h, lw.ffn_norm, hp.norm_eps, x);
            }
        }

        match lw.ffn {
            Ffn::None => {}
            Ffn::Dense { gate, up, down } => {
                let m = ExpertMatrices { gate, up, down };
                let (x, out) = (&b.x[..n * e], &mut b.go[..n * e]);
                let tail = ExpertTail::plain(gate.as_ref());
                ffn_batch(mv, &m, tail, x, b.ga, b.gb, out)?;
                for (h, o) in b.h.chunks_exact_mut(e).zip(out.chunks_exact(e)) {
                    add_residual(hp, h, o);
                }
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
                let (k, n_exp) = (rc.top_k(), s.router.len().max(1));
                let n_union = match routed {
                    Some(n_union) => n_union,
                    None => {
                        mv.matmul(&router, &b.x[..n * e], &mut b.logits[..n * n_exp])?;
                        let biases = RouterBiases {
                            logits: router_bias,
                            selection: selection_bias,
                        };
                        route_batch(l, rc, biases, n, n_exp, experts, b)?
                    }
                };
                // The next MoE layer's likeliest experts (`ahead` of them).
                let next = next_moe_layers(weights, hp.n_layers, l + 1, 1).next();
                let mut ahead = 0;
                if read_ahead {
                    // Groups of picks on their way or resident first: the
                    // reads of the rest go on while they compute.
                    if n_union > experts.max_picks(l).max(1) {
                        let union = &mut b.union[..n_union];
                        union.sort_unstable_by_key(|&x| (experts.residency(l, x), x));
                    }
                    if let Some(next) = next {
                        ahead = predict_batch(hp, weights, rc, next, n, mv, b, experts)?;
                    }
                }
                let ffn = MoeFfn {
                    shared: shared.as_ref(),
                    expert_bias: expert_bias.as_ref(),
                };
                let ahead = next.map_or(Ahead::NONE, |layer| Ahead { layer, n: ahead });
                moe_union(hp, experts, mv, l, n_union, ahead, k, n, ffn, b, s)?;
                let weigh = super::weighs_inputs(hp);
                // Combine each position's outputs in its router order, the
                // shared expert's last, as the one-position pass does.
                for j in 0..n {
                    let picks = (j * k..(j + 1) * k)
                        .filter(|&p| b.ids[p] != NO_EXPERT)
                        .map(|p| {
                            (
                                super::output_weight(b.weights[p], weigh),
                                &b.out[p * e..][..e],
                            )
                        });
                    let sh = shared.is_some().then(|| &b.shared[j * e..][..e]);
                    combine(s.moe, picks, sh, hp.scales.residual, &mut b.h[j * e..][..e]);
                }
            }
        }
        for (input, h) in inputs.iter().zip(b.h.chunks_exact_mut(e)) {
            add_deepstack(e, hy.n_deepstack, *input, l, h);
        }
    }
    s.h.copy_from_slice(&b.h[(n - 1) * e..][..e]);
    if rows == 1 {
        rms_norm(s.h, weights.output_norm(), hp.norm_eps, s.x);
        mv.matvec(&weights.output(), s.x, logits)?;
    } else {
        // The rows asked for, normed into `b.x` in order (`matmul`'s rows
        // are `matvec`'s).
        let (mut end, mut row) = (0, 0);
        for q in seqs.iter() {
            end += q.len;
            for p in end - q.logit_rows()..end {
                let (h, x) = (&b.h[p * e..][..e], &mut b.x[row * e..][..e]);
                rms_norm(h, weights.output_norm(), hp.norm_eps, x);
                row += 1;
            }
        }
        mv.matmul(&weights.output(), &b.x[..rows * e], logits)?;
    }
    scale_logits(hp, logits);
    Ok(())
}

/// Routes MoE layer `layer`'s `n` positions on their router logits
/// (`b.logits`, `n_exp` each, to which the router bias is added): each
/// position's picks and weights into `b.ids` and `b.weights` (`top_k` each,
/// [`NO_EXPERT`] past a shorter routing), their union in first-pick order into
/// `b.union`; shows `experts` each position's logits. Returns the union's size.
fn route_batch<X: Experts>(
    layer: usize,
    rc: &RouterConfig,
    biases: RouterBiases<'_>,
    n: usize,
    n_exp: usize,
    experts: &mut X,
    b: &mut BatchScratch<'_>,
) -> Result<usize, ForwardError<X::Error>> {
    let k = rc.top_k();
    let mut routing = Routing::new();
    let mut n_union = 0;
    for (j, lg) in b.logits[..n * n_exp].chunks_exact_mut(n_exp).enumerate() {
        add_bias(lg, biases.logits).map_err(ForwardError::Shape)?;
        let lg = &*lg;
        experts.router_logits(layer, lg);
        rc.route(lg, biases.selection, &mut routing)?;
        let ids = &mut b.ids[j * k..][..k];
        let wts = &mut b.weights[j * k..][..k];
        ids.fill(NO_EXPERT);
        for (i, r) in routing.iter().enumerate().take(k) {
            ids[i] = r.expert;
            wts[i] = r.weight;
            if !b.union[..n_union].contains(&r.expert) {
                *b.union.get_mut(n_union).ok_or(ForwardError::Shape(
                    "routing names an expert outside the model",
                ))? = r.expert;
                n_union += 1;
            }
        }
    }
    Ok(n_union)
}

/// Multi-head latent attention over a batch, the positions of `seqs` in turn
/// ([`super::mla`]): the projections of every position at once, each head's
/// absorption and value up-projection over all positions, each sequence's
/// attention of its positions over its own cache. Each step is the
/// one-position pass's arithmetic (`matmul` rows are `matvec`'s, the grouped
/// attention each position's), so the bits are the same. Where a buffer of
/// the batch is too short for the shape it runs one position after another.
#[allow(clippy::too_many_arguments)]
fn mla_batch<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    w: &super::mla::MlaWeights<'_>,
    attn_norm: &[f32],
    mv: &mut M,
    s: &mut Scratch<'_>,
    seqs: &mut [Sequence<'_, '_, '_>],
    b: &mut BatchScratch<'_>,
    n: usize,
    cache_layer: usize,
) -> Result<(), ForwardError<E>> {
    use super::mla::{cache_latent, finish_query, head_block, query_prescale, shape};
    if seqs.iter().any(|sq| cache_layer >= sq.kv.n_layers()) {
        return Err(ForwardError::Shape(
            "more attention layers than the KV cache",
        ));
    }
    let m = shape(hp, hy, w)?;
    let (e, nh, qh, lat, kvl, vd) = (
        hp.n_embd,
        hp.n_head,
        m.q_head(),
        m.latent(),
        m.kv_lora,
        m.v_head_dim,
    );
    let gather = kvl.max(m.nope).max(vd);
    let fits = m.q_lora <= e
        && qh <= lat
        && vd <= lat
        && b.ga.len() >= n * gather
        && b.gb.len() >= n * gather;
    if !fits {
        let mut rows = b.h.chunks_exact_mut(e).take(n);
        for sq in seqs.iter_mut() {
            for (i, h) in (&mut rows).take(sq.len).enumerate() {
                rms_norm(h, attn_norm, hp.norm_eps, s.x);
                super::mla::mla_layer(hp, hy, w, mv, s, sq.kv, cache_layer, sq.pos + i)?;
                add_residual(hp, h, s.tmp);
            }
        }
        return Ok(());
    }
    norm_positions(hp, attn_norm, b, n);
    let x = &b.gx[..n * e];
    // Queries, then the latents: rotated, normed, cached as key and value.
    let q_raw = &mut b.aqr[..n * nh * qh];
    match w.q_a {
        Some((qa, norm)) => {
            let c = &mut b.x[..n * m.q_lora];
            mv.matmul(&qa, x, c)?;
            for row in c.chunks_exact_mut(m.q_lora) {
                rms_norm_heads(row, norm, hp.norm_eps);
            }
            mv.matmul(&w.q, c, q_raw)?;
        }
        None => mv.matmul(&w.q, x, q_raw)?,
    }
    let lats = &mut b.ak[..n * lat];
    mv.matmul(&w.kv_a, x, lats)?;
    let mut rows = lats.chunks_exact_mut(lat);
    for sq in seqs.iter_mut() {
        for (j, l) in (&mut rows).take(sq.len).enumerate() {
            cache_latent(hp, &m, w.kv_a_norm, l, sq.kv, cache_layer, sq.pos + j);
        }
    }
    // Each head's queries in the latent's space, for every position.
    let pre = query_prescale(&m);
    let q = &mut b.aq[..n * nh * lat];
    let (gin, gout) = (&mut b.ga[..n * gather], &mut b.gb[..n * gather]);
    for h in 0..nh {
        for j in 0..n {
            gin[j * m.nope..][..m.nope].copy_from_slice(&q_raw[(j * nh + h) * qh..][..m.nope]);
        }
        let kb = head_block(&w.k_b, h, kvl)?;
        mv.matmul(&kb, &gin[..n * m.nope], &mut gout[..n * kvl])?;
        let mut g = 0;
        for sq in seqs.iter() {
            for p in sq.pos..sq.pos + sq.len {
                let out = &mut q[(g * nh + h) * lat..][..lat];
                out[..kvl].copy_from_slice(&gout[g * kvl..][..kvl]);
                let qr = &mut q_raw[(g * nh + h) * qh + m.nope..][..m.rope];
                finish_query(hp, &m, out, qr, p, pre);
                g += 1;
            }
        }
    }
    let shape = AttnShape {
        n_head: nh,
        n_head_kv: 1,
        head_dim: lat,
    };
    // Each sequence's positions over its own cache.
    let att = &mut b.aatt[..n * nh * lat];
    let mut first = 0;
    for sq in seqs.iter() {
        let rows = first * nh * lat..(first + sq.len) * nh * lat;
        let view = cached(sq.kv, cache_layer, 0..sq.pos + sq.len)?;
        mv.attention_causal(
            shape,
            &q[rows.clone()],
            view,
            sq.pos,
            s.scores,
            &mut att[rows],
        );
        first += sq.len;
    }
    // Each head's value up-projection for every position, then `wo`.
    let o = &mut b.aqr[..n * nh * vd];
    for h in 0..nh {
        for j in 0..n {
            gin[j * kvl..][..kvl].copy_from_slice(&att[(j * nh + h) * lat..][..kvl]);
        }
        let vb = head_block(&w.v_b, h, vd)?;
        mv.matmul(&vb, &gin[..n * kvl], &mut gout[..n * vd])?;
        for j in 0..n {
            o[(j * nh + h) * vd..][..vd].copy_from_slice(&gout[j * vd..][..vd]);
        }
    }
    let out = &mut b.go[..n * e];
    mv.matmul(&w.wo, o, out)?;
    for (h, o) in b.h.chunks_exact_mut(e).zip(out.chunks_exact(e)) {
        add_residual(hp, h, o);
    }
    Ok(())
}

/// One attention layer for the first `n` positions of `b.h`, the positions
/// of `seqs` in turn: what [`mix`](super::mix) does for each, with the
/// projections of all the positions at once ([`MatVec::matmul`]), every
/// position's key and value cached in its sequence's cache, then each
/// sequence's attention of its positions ([`MatVec::attention_causal`]), each
/// over its sequence's positions up to its own: it sees the keys and values of
/// the earlier ones and no later one.
#[allow(clippy::too_many_arguments)]
fn attention_batch<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    aw: &AttentionWeights<'_>,
    attn_norm: &[f32],
    mv: &mut M,
    s: &mut Scratch<'_>,
    seqs: &mut [Sequence<'_, '_, '_>],
    b: &mut BatchScratch<'_>,
    n: usize,
    cache_layer: usize,
) -> Result<(), ForwardError<E>> {
    let (e, q_dim, kv_dim) = (hp.n_embd, hp.q_dim(), hp.kv_dim());
    let q_rows = if hy.attn_output_gate {
        2 * q_dim
    } else {
        q_dim
    };
    if aw.wq.rows() != q_rows || (hy.attn_output_gate && s.qg.len() != q_rows) {
        return Err(ForwardError::Shape("query projection"));
    }
    for sq in seqs.iter() {
        if cache_layer >= sq.kv.n_layers() {
            return Err(ForwardError::Shape(
                "more attention layers than the KV cache",
            ));
        }
        if !sq.kv.holds_pass(cache_layer, sq.len) {
            return Err(ForwardError::Shape(
                "a pass of more positions than the layer's KV cache ring holds",
            ));
        }
    }
    norm_positions(hp, attn_norm, b, n);
    let x = &b.gx[..n * e];
    let (q, k, v) = (
        &mut b.aq[..n * q_rows],
        &mut b.ak[..n * kv_dim],
        &mut b.av[..n * kv_dim],
    );
    mv.matmul(&aw.wq, x, q)?;
    mv.matmul(&aw.wk, x, k)?;
    mv.matmul(&aw.wv, x, v)?;
    let shape = AttnShape {
        n_head: hp.n_head,
        n_head_kv: hp.n_head_kv,
        head_dim: hp.head_dim,
    };
    let (qr, att) = (&mut b.aqr[..n * q_dim], &mut b.aatt[..n * q_dim]);
    let mut first = 0;
    for sq in seqs.iter_mut() {
        let (len, pos, rope) = (sq.len, sq.pos, sq.rope);
        // Each position's query made ready (into `aqr`) and its key and value
        // cached, then the attention of the sequence's positions, each over
        // the positions up to its own.
        for j in 0..len {
            let g = first + j;
            let qj = &q[g * q_rows..][..q_rows];
            if hy.attn_output_gate {
                s.qg.copy_from_slice(qj);
            } else {
                s.q.copy_from_slice(qj);
            }
            s.k.copy_from_slice(&k[g * kv_dim..][..kv_dim]);
            s.v.copy_from_slice(&v[g * kv_dim..][..kv_dim]);
            let at = match rope {
                Some(r) => Place {
                    index: pos + j,
                    rope: r[j],
                },
                None => Place::text(pos + j),
            };
            project_position(hp, hy, aw, s, sq.kv, cache_layer, at)?;
            qr[g * q_dim..][..q_dim].copy_from_slice(s.q);
        }
        let qs = &qr[first * q_dim..(first + len) * q_dim];
        let os = &mut att[first * q_dim..(first + len) * q_dim];
        if aw.window.is_some() {
            // Each position over its own window of the positions before it.
            for (j, (qj, oj)) in qs.chunks(q_dim).zip(os.chunks_mut(q_dim)).enumerate() {
                mv.attention(
                    shape,
                    qj,
                    attended(aw, sq.kv, cache_layer, pos + j + 1)?,
                    s.scores,
                    oj,
                );
            }
        } else {
            let cached = attended(aw, sq.kv, cache_layer, pos + len)?;
            mv.attention_causal(shape, qs, cached, pos, s.scores, os);
        }
        first += len;
    }
    if hy.attn_output_gate {
        for (qg, a) in q.chunks_exact(q_rows).zip(att.chunks_exact_mut(q_dim)) {
            output_gate(hp.head_dim, qg, a);
        }
    }
    let out = &mut b.go[..n * e];
    mv.matmul(&aw.wo, &b.aatt[..n * q_dim], out)?;
    for (h, o) in b.h.chunks_exact_mut(e).zip(out.chunks_exact_mut(e)) {
        add_bias(o, aw.bo).map_err(ForwardError::Shape)?;
        add_residual(hp, h, o);
    }
    Ok(())
}

/// One gated DeltaNet layer for the first `n` positions of `b.h`, the
/// positions of `seqs` in turn: what [`mix`](super::mix) does for each, with
/// the projections of all the positions at once ([`MatVec::matmul`]) and the
/// recurrence a position at a time, in order, over its sequence's state.
#[allow(clippy::too_many_arguments)]
fn deltanet_batch<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    dw: &DeltaNetWeights<'_>,
    attn_norm: &[f32],
    mv: &mut M,
    s: &mut Scratch<'_>,
    seqs: &mut [Sequence<'_, '_, '_>],
    b: &mut BatchScratch<'_>,
    n: usize,
    state: usize,
) -> Result<(), ForwardError<E>> {
    let e = hp.n_embd;
    let (lq, lz, lb, la) = (s.d_qkv.len(), s.d_z.len(), s.d_beta.len(), s.d_alpha.len());
    let lo = s.d_out.len();
    norm_positions(hp, attn_norm, b, n);
    let x = &b.gx[..n * e];
    let (qkv, z) = (&mut b.dqkv[..n * lq], &mut b.dz[..n * lz]);
    let (beta, alpha) = (&mut b.dbeta[..n * lb], &mut b.dalpha[..n * la]);
    mv.matmul(&dw.qkv, x, qkv)?;
    mv.matmul(&dw.gate, x, z)?;
    mv.matmul(&dw.beta, x, beta)?;
    mv.matmul(&dw.alpha, x, alpha)?;
    let mut g = 0;
    for sq in seqs.iter_mut() {
        let (conv, ssm) = deltanet_state(hp, hy, dw, sq.rs, state)?;
        for j in 0..sq.len {
            s.d_qkv.copy_from_slice(&qkv[g * lq..][..lq]);
            s.d_z.copy_from_slice(&z[g * lz..][..lz]);
            s.d_beta.copy_from_slice(&beta[g * lb..][..lb]);
            s.d_alpha.copy_from_slice(&alpha[g * la..][..la]);
            deltanet_step(hp, dw, mv, s, conv, ssm, sq.pos + j);
            b.dout[g * lo..][..lo].copy_from_slice(s.d_out);
            g += 1;
        }
    }
    recurrent_out(hp, mv, &dw.out, b, n, lo)
}

/// One Mamba2 layer for the first `n` positions of `b.h`, the positions of
/// `seqs` in turn: what [`mix`](super::mix) does for each
/// ([`projected_batch`], the scan a position at a time, in order, over its
/// sequence's state).
#[allow(clippy::too_many_arguments)]
fn mamba2_batch<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    mw: &Mamba2Weights<'_>,
    attn_norm: &[f32],
    mv: &mut M,
    s: &mut Scratch<'_>,
    seqs: &mut [Sequence<'_, '_, '_>],
    b: &mut BatchScratch<'_>,
    n: usize,
    state: usize,
) -> Result<(), ForwardError<E>> {
    let step = |mv: &mut M, s: &mut Scratch<'_>, rs: &mut RecurrentState<'_>, pos: usize| {
        let (conv, ssm) = mamba2_state(hp, hy, mw, rs, state)?;
        mamba2_step(hp, mw, mv, s, conv, ssm, pos);
        Ok(())
    };
    projected_batch(
        hp,
        attn_norm,
        (&mw.in_proj, &mw.out),
        mv,
        s,
        seqs,
        b,
        n,
        step,
    )
}

/// One short-convolution layer for the first `n` positions of `b.h`, the
/// positions of `seqs` in turn: what [`mix`](super::mix) does for each
/// ([`projected_batch`], the convolution a position at a time, in order,
/// over its sequence's state).
#[allow(clippy::too_many_arguments)]
fn shortconv_batch<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    cw: &ShortConvWeights<'_>,
    attn_norm: &[f32],
    mv: &mut M,
    s: &mut Scratch<'_>,
    seqs: &mut [Sequence<'_, '_, '_>],
    b: &mut BatchScratch<'_>,
    n: usize,
    state: usize,
) -> Result<(), ForwardError<E>> {
    let step = |_: &mut M, s: &mut Scratch<'_>, rs: &mut RecurrentState<'_>, pos: usize| {
        let conv = shortconv_state(hp, hy, cw, rs, state)?;
        shortconv_step(cw, s, conv, pos);
        Ok(())
    };
    projected_batch(
        hp,
        attn_norm,
        (&cw.in_proj, &cw.out),
        mv,
        s,
        seqs,
        b,
        n,
        step,
    )
}

/// A recurrent layer of one input projection (into `s.d_qkv`) and one output
/// projection (of `s.d_out`), `proj` = (input, output), for the first `n`
/// positions of `b.h`, the positions of `seqs` in turn: both projections of
/// all the positions at once ([`MatVec::matmul`]), and `step(mv, s, state,
/// position)` for each position in between, in order, with its sequence's
/// recurrent state.
#[allow(clippy::too_many_arguments)]
fn projected_batch<M: MatVec, E>(
    hp: &Hparams,
    attn_norm: &[f32],
    proj: (&MatrixView<'_>, &MatrixView<'_>),
    mv: &mut M,
    s: &mut Scratch<'_>,
    seqs: &mut [Sequence<'_, '_, '_>],
    b: &mut BatchScratch<'_>,
    n: usize,
    mut step: impl FnMut(
        &mut M,
        &mut Scratch<'_>,
        &mut RecurrentState<'_>,
        usize,
    ) -> Result<(), ForwardError<E>>,
) -> Result<(), ForwardError<E>> {
    let e = hp.n_embd;
    let (lp, lo) = (s.d_qkv.len(), s.d_out.len());
    norm_positions(hp, attn_norm, b, n);
    let x = &b.gx[..n * e];
    let projected = &mut b.dqkv[..n * lp];
    mv.matmul(proj.0, x, projected)?;
    let mut g = 0;
    for sq in seqs.iter_mut() {
        for j in 0..sq.len {
            s.d_qkv.copy_from_slice(&projected[g * lp..][..lp]);
            step(mv, s, sq.rs, sq.pos + j)?;
            b.dout[g * lo..][..lo].copy_from_slice(s.d_out);
            g += 1;
        }
    }
    recurrent_out(hp, mv, proj.1, b, n, lo)
}

/// `b.gx` = the first `n` positions of `b.h` through the RMSNorm `weight`
/// (a layer's input norm).
fn norm_positions(hp: &Hparams, weight: &[f32], b: &mut BatchScratch<'_>, n: usize) {
    let e = hp.n_embd;
    for (h, x) in b.h.chunks_exact(e).zip(b.gx[..n * e].chunks_exact_mut(e)) {
        rms_norm(h, weight, hp.norm_eps, x);
    }
}

/// A recurrent layer's outputs in `b.dout` (`lo` floats a position) through
/// `w`, added to the first `n` positions' residual streams.
fn recurrent_out<M: MatVec, E>(
    hp: &Hparams,
    mv: &mut M,
    w: &MatrixView<'_>,
    b: &mut BatchScratch<'_>,
    n: usize,
    lo: usize,
) -> Result<(), ForwardError<E>> {
    let e = hp.n_embd;
    let out = &mut b.go[..n * e];
    mv.matmul(w, &b.dout[..n * lo], out)?;
    for (h, o) in b.h.chunks_exact_mut(e).zip(out.chunks_exact(e)) {
        add_residual(hp, h, o);
    }
    Ok(())
}

/// [`ffn_checked`](super::ffn_checked)'s arithmetic for every input in `xs`
/// (`n_embd` each) into `outs`, each product over all the inputs at once
/// ([`MatVec::matmul`]); `a` and `b` hold the gate and up projections (`n_ff`
/// an input).
#[allow(clippy::too_many_arguments)]
fn ffn_batch<M: MatVec, E>(
    mv: &mut M,
    w: &ExpertMatrices<'_>,
    tail: ExpertTail<'_>,
    xs: &[f32],
    a: &mut [f32],
    b: &mut [f32],
    outs: &mut [f32],
) -> Result<(), ForwardError<E>> {
    let ExpertMatrices { gate, up, down } = w;
    super::check_gate(tail.act, gate.is_some())?;
    let n = up.rows();
    let m = xs.len() / up.cols().max(1);
    let bias_fits = tail.biases.is_none_or(|[g, u, d]| {
        (gate.is_none() || g.len() == n) && u.len() == n && d.len() == down.rows()
    });
    let gate_fits = gate.is_none_or(|g| g.rows() == n);
    if !gate_fits || down.cols() != n || m * n > a.len() || m * n > b.len() || !bias_fits {
        return Err(GemvError::RowLength {
            ty: down.ty(),
            cols: down.cols(),
        }
        .into());
    }
    let (a, b) = (&mut a[..m * n], &mut b[..m * n]);
    if let Some(gate) = gate {
        mv.matmul(gate, xs, a)?;
        mv.matmul(up, xs, b)?;
        if let Some([gb, ub, _]) = tail.biases {
            for (ar, br) in a.chunks_exact_mut(n).zip(b.chunks_exact_mut(n)) {
                add_into(ar, gb);
                add_into(br, ub);
            }
        }
    } else {
        mv.matmul(up, xs, a)?;
        if let Some([_, ub, _]) = tail.biases {
            for ar in a.chunks_exact_mut(n) {
                add_into(ar, ub);
            }
        }
    }
    super::activate(tail.act, a, b);
    mv.matmul(down, a, outs)?;
    if let Some([_, _, db]) = tail.biases {
        for o in outs.chunks_exact_mut(db.len().max(1)) {
            add_into(o, db);
        }
    }
    Ok(())
}

/// The shared expert of the first `n` positions of `b.x` into `b.shared`, each
/// product over all of them at once: [`shared_expert`](super::shared_expert)'s
/// arithmetic for each.
fn shared_batch<M: MatVec, E>(
    mv: &mut M,
    sh: &SharedExpert<'_>,
    n: usize,
    b: &mut BatchScratch<'_>,
    e: usize,
) -> Result<(), ForwardError<E>> {
    let m = ExpertMatrices {
        gate: sh.gate,
        up: sh.up,
        down: sh.down,
    };
    let (x, out) = (&b.x[..n * e], &mut b.shared[..n * e]);
    ffn_batch(
        mv,
        &m,
        ExpertTail::plain(sh.gate.as_ref()),
        x,
        b.ga,
        b.gb,
        out,
    )?;
    if let Some(g) = sh.gate_inp {
        let logits = &mut b.gx[..n];
        mv.matmul(&g, x, logits)?;
        for (o, &l) in out.chunks_exact_mut(e).zip(logits.iter()) {
            gate_shared(o, l);
        }
    }
    Ok(())
}

/// A batch's lookahead for `layer`, where it is an MoE layer: its router
/// ([`Weights::lookahead_router`] where the weights have a cheaper copy) on
/// each position's residual stream (`b.h`, normed by that layer's FFN norm
/// unless its router reads the layer's input, as
/// [`forward_hybrid`](super::forward_hybrid)'s lookahead does for one
/// position). Each position's top picks vote; the experts neither resident nor
/// on their way ([`Experts::residency`]) go to `b.ahead`, most votes first, at
/// most one group ([`Experts::max_picks`]). Returns how many. Uses `b.gx` and
/// `b.logits`.
#[allow(clippy::too_many_arguments)]
fn predict_batch<W: Weights, M: MatVec, X: Experts>(
    hp: &Hparams,
    weights: &W,
    rc: &RouterConfig,
    layer: usize,
    n: usize,
    mv: &mut M,
    b: &mut BatchScratch<'_>,
    experts: &X,
) -> Result<usize, ForwardError<X::Error>> {
    let w = weights.block(layer);
    let Ffn::Moe {
        router,
        router_bias,
        selection_bias,
        ..
    } = w.ffn
    else {
        return Ok(0);
    };
    let r = lookahead_matrix(weights, layer, router);
    let (e, n_exp) = (hp.n_embd, b.votes.len());
    if r.rows() != n_exp {
        return Err(ForwardError::Shape("router rows"));
    }
    let x = &mut b.gx[..n * e];
    for (h, x) in b.h.chunks_exact(e).zip(x.chunks_exact_mut(e)) {
        if hp.moe.is_some_and(|m| m.route_before_attention) {
            x.copy_from_slice(h);
        } else {
            rms_norm(h, w.ffn_norm, hp.norm_eps, x);
        }
    }
    let logits = &mut b.logits[..n * n_exp];
    mv.matmul(&r, x, logits)?;
    b.votes.fill(0);
    let mut routing = Routing::new();
    for lg in logits.chunks_exact_mut(n_exp) {
        add_bias(lg, router_bias).map_err(ForwardError::Shape)?;
        rc.route(lg, selection_bias, &mut routing)?;
        for p in routing.iter() {
            if let Some(v) = b.votes.get_mut(usize::from(p.expert)) {
                *v = v.saturating_add(1);
            }
        }
    }
    let mut ahead = 0;
    for (x, &v) in (0..).zip(b.votes.iter()) {
        if v > 0 && experts.residency(layer, x) == Residency::Missing {
            b.ahead[ahead] = x;
            ahead += 1;
        }
    }
    let votes = &b.votes;
    b.ahead[..ahead].sort_unstable_by_key(|&x| (core::cmp::Reverse(votes[usize::from(x)]), x));
    Ok(ahead.min(experts.max_picks(layer)))
}

/// The next MoE layer's predicted experts, `b.ahead[..n]`.
#[derive(Clone, Copy, Debug)]
struct Ahead {
    layer: usize,
    n: usize,
}

impl Ahead {
    /// No prediction.
    const NONE: Ahead = Ahead { layer: 0, n: 0 };
}

/// One MoE layer's routed experts for every position: the union of picks
/// (`b.union[..n_union]`) asked of `experts` in groups of
/// [`Experts::max_picks`], each expert handed out computed for every position
/// that picked it (`b.ids`: `k` per position) at once, into `b.out` (`k x
/// n_embd` per position). The positions' shared experts (into `b.shared`) are
/// computed the first time no routed expert is ready, or last. The next MoE
/// layer's predicted experts (`ahead`) are named to
/// [`Experts::prefetch_known`] when the last group starts.
#[allow(clippy::too_many_arguments)]
fn moe_union<X: Experts, M: MatVec>(
    hp: &Hparams,
    experts: &mut X,
    mv: &mut M,
    layer: usize,
    n_union: usize,
    ahead: Ahead,
    k: usize,
    n: usize,
    ffn: MoeFfn<'_, '_>,
    b: &mut BatchScratch<'_>,
    s: &mut Scratch<'_>,
) -> Result<(), ForwardError<X::Error>> {
    let e = s.h.len();
    let mut shared_left = ffn.shared;
    let group = experts.max_picks(layer).max(1);
    let mut first = 0;
    while first < n_union {
        let end = (first + group).min(n_union);
        let mut chunk: heapless::Vec<u16, { crate::schedule::MAX_PICKS }> = heapless::Vec::new();
        for &x in &b.union[first..end] {
            chunk
                .push(x)
                .map_err(|_| ForwardError::Shape("group of picks"))?;
        }
        first = end;
        experts
            .begin_layer(layer, &chunk)
            .map_err(ForwardError::Experts)?;
        // The next group's reads overlap this group's products; the next
        // layer's, the last group's and the next attention.
        if first < n_union {
            let next = &b.union[first..(first + group).min(n_union)];
            experts
                .prefetch_known(layer, next)
                .map_err(ForwardError::Experts)?;
        } else if ahead.n > 0 {
            experts
                .prefetch_known(ahead.layer, &b.ahead[..ahead.n])
                .map_err(ForwardError::Experts)?;
        }
        loop {
            // Whole experts only: a batch multiplies each by every input at once.
            match next_step(experts, shared_left.is_some(), false)? {
                Step::Compute(Handout {
                    index,
                    matrices,
                    verify,
                }) => {
                    let expert = *chunk
                        .get(index)
                        .ok_or(ForwardError::Shape("routing index"))?;
                    let tail = expert_tail(hp, ffn.expert_bias, expert)?;
                    // With `verify`, the first pick computes the checksum as it
                    // goes; the others' inputs are gathered and multiplied at
                    // once, and their outputs scattered back in the same order.
                    let mut picks = (0..n * k).filter(|&p| b.ids[p] == expert);
                    let mut crc = None;
                    let checked = if verify { picks.next() } else { None };
                    let weigh = super::weighs_inputs(hp);
                    if let Some(p) = checked {
                        let x = &b.x[(p / k) * e..][..e];
                        let x = super::pick_input(x, weigh.then_some(b.weights[p]), s.moe);
                        let o = &mut b.out[p * e..][..e];
                        crc = ffn_checked(mv, &matrices, tail, x, s.ff_a, s.ff_b, o, true)?;
                    }
                    let mut m = 0;
                    for p in picks {
                        let (x, gx) = (&b.x[(p / k) * e..][..e], &mut b.gx[m * e..][..e]);
                        super::copy_input(x, weigh.then_some(b.weights[p]), gx);
                        m += 1;
                    }
                    if m > 0 {
                        let (xs, outs) = (&b.gx[..m * e], &mut b.go[..m * e]);
                        ffn_batch(mv, &matrices, tail, xs, b.ga, b.gb, outs)?;
                        let picks = (0..n * k)
                            .filter(|&p| b.ids[p] == expert)
                            .filter(|&p| Some(p) != checked);
                        for (p, o) in picks.zip(b.go.chunks_exact(e)) {
                            b.out[p * e..][..e].copy_from_slice(o);
                        }
                    }
                    experts.finish(index, crc).map_err(ForwardError::Experts)?;
                }
                Step::Pending => {
                    if let Some(sh) = shared_left.take() {
                        shared_batch(mv, sh, n, b, e)?;
                    }
                }
                Step::Done => break,
                Step::GateUp(_) | Step::Down(_) => {
                    return Err(ForwardError::Shape("an expert in halves in a batch"));
                }
            }
        }
    }
    if let Some(sh) = shared_left.take() {
        shared_batch(mv, sh, n, b, e)?;
    }
    Ok(())
}
