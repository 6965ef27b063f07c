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
    add_into, embed, mix, router_config, shared_expert, swiglu_ffn, swiglu_ffn_checked,
    ExpertMatrices, Experts, Ffn, ForwardError, Handout, KvCache, MatVec, RecurrentState, Scratch,
    Step, TokenInput, Weights,
};
use crate::model::config::{Hparams, HybridParams};
use crate::model::ops::rms_norm;
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
    /// Each position's picks (`n x top_k`).
    ids: &'a mut [u16],
    /// The layer's union of picks (`n_experts`).
    union: &'a mut [u16],
    n: usize,
}

impl<'a> BatchScratch<'a> {
    fn lens(hp: &Hparams, n: usize) -> ([usize; 5], [usize; 2]) {
        let e = hp.n_embd;
        let (k, n_exp) = hp.moe.map_or((0, 0), |m| (m.top_k, m.n_experts));
        let sh = if hp.moe.is_some() { n * e } else { 0 };
        ([n * e, n * e, n * k * e, sh, n * k], [n * k, n_exp])
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
        let ([l_h, l_x, l_out, l_sh, l_w], [l_ids, l_union]) = Self::lens(hp, n);
        let (h, rest) = floats.split_at_mut(l_h);
        let (x, rest) = rest.split_at_mut(l_x);
        let (out, rest) = rest.split_at_mut(l_out);
        let (shared, rest) = rest.split_at_mut(l_sh);
        let (weights, _) = rest.split_at_mut(l_w);
        let (ids, rest) = ids.split_at_mut(l_ids);
        let (union, _) = rest.split_at_mut(l_union);
        Some(BatchScratch {
            h,
            x,
            out,
            shared,
            weights,
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
                for j in 0..n {
                    swiglu_ffn(mv, &m, &b.x[j * e..][..e], s.ff_a, s.ff_b, s.tmp)?;
                    add_into(&mut b.h[j * e..][..e], s.tmp);
                }
            }
            Ffn::Moe { router, shared } => {
                let rc = router_cfg
                    .as_ref()
                    .ok_or(ForwardError::Shape("MoE layer without MoE parameters"))?;
                let k = rc.top_k();
                let mut routing = Routing::new();
                let mut n_union = 0;
                for j in 0..n {
                    mv.matvec(&router, &b.x[j * e..][..e], s.router)?;
                    experts.router_logits(l, s.router);
                    rc.route(s.router, None, &mut routing)?;
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
                moe_union(
                    experts,
                    mv,
                    l,
                    &b.union[..n_union],
                    (&b.ids[..n * k], k),
                    &b.x[..n * e],
                    &mut b.out[..n * k * e],
                    shared.as_ref().map(|sh| (sh, &mut b.shared[..n * e])),
                    s,
                )?;
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

/// One MoE layer's routed experts for every position: the union of picks
/// `union` asked of `experts` in groups of [`Experts::max_picks`], each expert
/// handed out computed for every position that picked it (`ids`: `top_k` per
/// position) into `out` (`top_k x n_embd` per position). The shared expert of
/// each position (into `shared`) fills the time no routed expert is ready.
#[allow(clippy::too_many_arguments)]
fn moe_union<X: Experts, M: MatVec>(
    experts: &mut X,
    mv: &mut M,
    layer: usize,
    union: &[u16],
    (ids, k): (&[u16], usize),
    x: &[f32],
    out: &mut [f32],
    mut shared: Option<(&super::SharedExpert<'_>, &mut [f32])>,
    s: &mut Scratch<'_>,
) -> Result<(), ForwardError<X::Error>> {
    let e = s.h.len();
    let n = x.len() / e;
    let mut shared_next = 0;
    let mut shared_one = |mv: &mut M, s: &mut Scratch<'_>, j: usize| match shared.as_mut() {
        Some((sh, so)) if j < n => {
            shared_expert(
                mv,
                sh,
                &x[j * e..][..e],
                s.ff_a,
                s.ff_b,
                &mut so[j * e..][..e],
            )?;
            Ok::<bool, ForwardError<X::Error>>(true)
        }
        _ => Ok(false),
    };
    let group = experts.max_picks(layer).max(1);
    for chunk in union.chunks(group) {
        experts
            .begin_layer(layer, chunk)
            .map_err(ForwardError::Experts)?;
        loop {
            let step = if shared_next < n {
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
                    let mut crc = None;
                    let mut first = true;
                    for (p, _) in ids.iter().enumerate().filter(|(_, &id)| id == expert) {
                        let o = &mut out[p * e..][..e];
                        let j = p / k;
                        let c = swiglu_ffn_checked(
                            mv,
                            &matrices,
                            &x[j * e..][..e],
                            s.ff_a,
                            s.ff_b,
                            o,
                            verify && first,
                        )?;
                        if first {
                            crc = c;
                            first = false;
                        }
                    }
                    experts.finish(index, crc).map_err(ForwardError::Experts)?;
                }
                Step::Pending => {
                    if shared_one(mv, s, shared_next)? {
                        shared_next += 1;
                    } else {
                        shared_next = n;
                    }
                }
                Step::Done => break,
            }
        }
    }
    while shared_next < n {
        shared_one(mv, s, shared_next)?;
        shared_next += 1;
    }
    Ok(())
}
