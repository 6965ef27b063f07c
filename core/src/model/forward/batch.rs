//! Several consecutive positions through the model at once, layer by layer: a
//! prompt's prefill.
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

use super::{
    add_into, embed, mix, router_config, swiglu_ffn_checked, ExpertMatrices, Experts, Ffn,
    ForwardError, Handout, KvCache, MatVec, RecurrentState, Scratch, SharedExpert, Step,
    TokenInput, Weights,
};
use crate::gemv::GemvError;
use crate::model::config::{Hparams, HybridParams};
use crate::model::ops::{rms_norm, swiglu};
use crate::router::Routing;

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
    /// Each position's picks (`n x top_k`).
    ids: &'a mut [u16],
    /// The layer's union of picks (`n_experts`).
    union: &'a mut [u16],
    n: usize,
}

impl<'a> BatchScratch<'a> {
    fn lens(hp: &Hparams, n: usize) -> ([usize; 10], [usize; 2]) {
        let (e, ff) = (hp.n_embd, super::max_ff(hp));
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
            ],
            [n * k, n_exp],
        )
    }

    /// Floats needed for batches of up to `n` positions of `hp`.
    pub fn floats(hp: &Hparams, n: usize) -> usize {
        Self::lens(hp, n).0.iter().sum()
    }

    /// Expert ids (`u16`) needed for batches of up to `n` positions of `hp`.
    pub fn ids(hp: &Hparams, n: usize) -> usize {
        Self::lens(hp, n).1.iter().sum()
    }

    /// Splits `floats` and `ids` (at least [`floats`](Self::floats) and
    /// [`ids`](Self::ids) long) for batches of up to `n` positions.
    pub fn new(hp: &Hparams, n: usize, floats: &'a mut [f32], ids: &'a mut [u16]) -> Option<Self> {
        if floats.len() < Self::floats(hp, n) || ids.len() < Self::ids(hp, n) {
            return None;
        }
        let ([l_h, l_x, l_out, l_sh, l_w, l_ga, l_gb, l_gx, l_go, l_lg], [l_ids, l_union]) =
            Self::lens(hp, n);
        let (h, rest) = floats.split_at_mut(l_h);
        let (x, rest) = rest.split_at_mut(l_x);
        let (out, rest) = rest.split_at_mut(l_out);
        let (shared, rest) = rest.split_at_mut(l_sh);
        let (weights, rest) = rest.split_at_mut(l_w);
        let (ga, rest) = rest.split_at_mut(l_ga);
        let (gb, rest) = rest.split_at_mut(l_gb);
        let (gx, rest) = rest.split_at_mut(l_gx);
        let (go, rest) = rest.split_at_mut(l_go);
        let (logits, _) = rest.split_at_mut(l_lg);
        let (ids, rest) = ids.split_at_mut(l_ids);
        let (union, _) = rest.split_at_mut(l_union);
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
            ids,
            union,
            n,
        })
    }

    /// The most positions one batch holds.
    pub fn positions(&self) -> usize {
        self.n
    }
}

/// Marks an unused pick of a position that routed to fewer than `top_k` experts.
const NO_EXPERT: u16 = u16::MAX;

/// Runs `inputs` at positions `pos, pos + 1, ...` (the KV cache holds positions
/// `0..pos`) and writes the next-token logits of the last one into `logits`:
/// what [`forward_hybrid`](super::forward_hybrid) of each input in turn would
/// give, bit for bit, with the caches and states left as it would leave them.
/// Makes no lookahead predictions (a layer's whole union of picks is known at
/// once). Needs at least one input, and at most `b.positions()`.
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
    let n = inputs.len();
    if n == 0 || n > b.n {
        return Err(ForwardError::Shape("batch size"));
    }
    if pos.saturating_add(n) > kv.max_positions {
        return Err(ForwardError::ContextFull(kv.max_positions));
    }
    if logits.len() != hp.n_vocab {
        return Err(ForwardError::Shape("logits length"));
    }
    let e = hp.n_embd;
    for (input, h) in inputs.iter().zip(b.h.chunks_exact_mut(e)) {
        embed(weights, *input, h)?;
    }
    let router_cfg = router_config(hp)?;
    for _ in 0..n {
        experts.begin_token();
    }
    let (mut attn_idx, mut lin_idx) = (0usize, 0usize);
    for l in 0..hp.n_layers {
        let lw = weights.block(l);
        let (mut a, mut li) = (attn_idx, lin_idx);
        for j in 0..n {
            (a, li) = (attn_idx, lin_idx);
            s.h.copy_from_slice(&b.h[j * e..][..e]);
            mix(hp, hy, &lw, mv, s, kv, rs, (&mut a, &mut li), pos + j)?;
            rms_norm(s.h, lw.ffn_norm, hp.norm_eps, &mut b.x[j * e..][..e]);
            b.h[j * e..][..e].copy_from_slice(s.h);
        }
        (attn_idx, lin_idx) = (a, li);

        match lw.ffn {
            Ffn::Dense { gate, up, down } => {
                let m = ExpertMatrices { gate, up, down };
                let (x, out) = (&b.x[..n * e], &mut b.go[..n * e]);
                swiglu_ffn_batch(mv, &m, x, b.ga, b.gb, out)?;
                for (h, o) in b.h.chunks_exact_mut(e).zip(out.chunks_exact(e)) {
                    add_into(h, o);
                }
            }
            Ffn::Moe { router, shared } => {
                let rc = router_cfg
                    .as_ref()
                    .ok_or(ForwardError::Shape("MoE layer without MoE parameters"))?;
                let (k, n_exp) = (rc.top_k(), s.router.len());
                let logits = &mut b.logits[..n * n_exp];
                mv.matmul(&router, &b.x[..n * e], logits)?;
                let mut routing = Routing::new();
                let mut n_union = 0;
                for (j, lg) in logits.chunks_exact(n_exp).enumerate() {
                    experts.router_logits(l, lg);
                    rc.route(lg, None, &mut routing)?;
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
                moe_union(experts, mv, l, n_union, k, n, shared.as_ref(), b, s)?;
                // Combine each position's outputs in its router order, the
                // shared expert's last, as the one-position pass does.
                for j in 0..n {
                    s.moe.fill(0.0);
                    for i in 0..k {
                        if b.ids[j * k + i] == NO_EXPERT {
                            continue;
                        }
                        let w = b.weights[j * k + i];
                        let out = &b.out[(j * k + i) * e..][..e];
                        for (acc, o) in s.moe.iter_mut().zip(out) {
                            *acc += w * o;
                        }
                    }
                    if shared.is_some() {
                        add_into(s.moe, &b.shared[j * e..][..e]);
                    }
                    add_into(&mut b.h[j * e..][..e], s.moe);
                }
            }
        }
    }
    s.h.copy_from_slice(&b.h[(n - 1) * e..][..e]);
    rms_norm(s.h, weights.output_norm(), hp.norm_eps, s.x);
    mv.matvec(&weights.output(), s.x, logits)?;
    Ok(())
}

/// [`swiglu_ffn`](super::swiglu_ffn) of every input in `xs` (`n_embd` each)
/// into `outs`, each product over all the inputs at once ([`MatVec::matmul`]);
/// `a` and `b` hold the gate and up projections (`n_ff` an input).
fn swiglu_ffn_batch<M: MatVec>(
    mv: &mut M,
    w: &ExpertMatrices<'_>,
    xs: &[f32],
    a: &mut [f32],
    b: &mut [f32],
    outs: &mut [f32],
) -> Result<(), GemvError> {
    let ExpertMatrices { gate, up, down } = w;
    let n = gate.rows();
    let m = xs.len() / gate.cols().max(1);
    if up.rows() != n || down.cols() != n || m * n > a.len() || m * n > b.len() {
        return Err(GemvError::RowLength {
            ty: down.ty(),
            cols: down.cols(),
        });
    }
    let (a, b) = (&mut a[..m * n], &mut b[..m * n]);
    mv.matmul(gate, xs, a)?;
    mv.matmul(up, xs, b)?;
    swiglu(a, b);
    mv.matmul(down, a, outs)
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
    swiglu_ffn_batch(mv, &m, x, b.ga, b.gb, out)?;
    if let Some(g) = sh.gate_inp {
        let logits = &mut b.gx[..n];
        mv.matmul(&g, x, logits)?;
        for (o, &l) in out.chunks_exact_mut(e).zip(logits.iter()) {
            let gate = crate::router::shared_expert_gate(l);
            for v in o.iter_mut() {
                *v *= gate;
            }
        }
    }
    Ok(())
}

/// One MoE layer's routed experts for every position: the union of picks
/// (`b.union[..n_union]`) asked of `experts` in groups of
/// [`Experts::max_picks`], each expert handed out computed for every position
/// that picked it (`b.ids`: `k` per position) at once, into `b.out` (`k x
/// n_embd` per position). The positions' shared experts (into `b.shared`) are
/// computed the first time no routed expert is ready, or last.
#[allow(clippy::too_many_arguments)]
fn moe_union<X: Experts, M: MatVec>(
    experts: &mut X,
    mv: &mut M,
    layer: usize,
    n_union: usize,
    k: usize,
    n: usize,
    shared: Option<&SharedExpert<'_>>,
    b: &mut BatchScratch<'_>,
    s: &mut Scratch<'_>,
) -> Result<(), ForwardError<X::Error>> {
    let e = s.h.len();
    let mut shared_left = shared;
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
        loop {
            let step = if shared_left.is_some() {
                experts.try_next()
            } else {
                experts.next().map(Step::from)
            }
            .map_err(ForwardError::Experts)?;
            match step {
                Step::Compute(Handout {
                    index,
                    matrices,
                    verify,
                }) => {
                    let expert = *chunk
                        .get(index)
                        .ok_or(ForwardError::Shape("routing index"))?;
                    // With `verify`, the first pick computes the checksum as it
                    // goes; the others' inputs are gathered and multiplied at
                    // once, and their outputs scattered back in the same order.
                    let mut picks = (0..n * k).filter(|&p| b.ids[p] == expert);
                    let mut crc = None;
                    let checked = if verify { picks.next() } else { None };
                    if let Some(p) = checked {
                        let x = &b.x[(p / k) * e..][..e];
                        let o = &mut b.out[p * e..][..e];
                        crc = swiglu_ffn_checked(mv, &matrices, x, s.ff_a, s.ff_b, o, true)?;
                    }
                    let mut m = 0;
                    for p in picks {
                        b.gx[m * e..][..e].copy_from_slice(&b.x[(p / k) * e..][..e]);
                        m += 1;
                    }
                    if m > 0 {
                        let (xs, outs) = (&b.gx[..m * e], &mut b.go[..m * e]);
                        swiglu_ffn_batch(mv, &matrices, xs, b.ga, b.gb, outs)?;
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
            }
        }
    }
    if let Some(sh) = shared_left.take() {
        shared_batch(mv, sh, n, b, e)?;
    }
    Ok(())
}
