//! Multi-head latent attention (DeepSeek-V2/V3, llama.cpp's `deepseek2`), one
//! position at a time, as llama.cpp computes it with its absorbed key
//! projection ([`MlaShape`]):
//!
//! ```text
//! q      = W_q x                  or W_qb rmsnorm(W_qa x)   n_head x (nope + rope)
//! [c, r] = W_kva x                                           kv_lora + rope
//! c      = rmsnorm(c);  r = rope(r)                          the cached latent [c, r]
//! q_h    = [W_kb,h q_nope,h ; rope(q_rope,h)]                kv_lora + rope each
//! o_h    = attention of q_h over the latents (one key/value head, scale kq_scale)
//! out    = W_o concat_h(W_vb,h o_h[..kv_lora])
//! ```
//!
//! The latent is stored as the key and, whole, as the value: each head's
//! output then carries the rotated part's weighted sum in its last `rope`
//! dimensions, which the value up-projection does not read. Queries are
//! scaled by `kq_scale * sqrt(kv_lora + rope)` before the attention kernel's
//! own `1 / sqrt(head_dim)`.

use super::super::config::{Hparams, HybridParams, MlaShape};
use super::super::ops::{rms_norm_heads, rope_scaled, AttnShape};
use super::{cached, ForwardError, KvCache, MatVec, Scratch};
use crate::gemv::MatrixView;

/// The weights of one multi-head latent attention layer (llama.cpp tensor
/// names in brackets).
#[derive(Clone, Copy, Debug)]
pub struct MlaWeights<'a> {
    /// Query compression (`attn_q_a`, `q_lora` x `n_embd`) and its RMSNorm
    /// weight (`attn_q_a_norm`); `None` where queries are projected directly.
    pub q_a: Option<(MatrixView<'a>, &'a [f32])>,
    /// Query projection: `attn_q_b` (`n_head (nope + rope)` x `q_lora`), or
    /// `attn_q` (x `n_embd`) without compression.
    pub q: MatrixView<'a>,
    /// Latent and rotated key projection (`attn_kv_a_mqa`,
    /// `kv_lora + rope` x `n_embd`).
    pub kv_a: MatrixView<'a>,
    /// RMSNorm weight of the latent (`attn_kv_a_norm`, `kv_lora`).
    pub kv_a_norm: &'a [f32],
    /// Key up-projections, absorbed into the queries (`attn_k_b`: head `h`'s
    /// `kv_lora` x `nope` block is rows `h kv_lora..`).
    pub k_b: MatrixView<'a>,
    /// Value up-projections (`attn_v_b`: head `h`'s `v_head_dim` x `kv_lora`
    /// block is rows `h v_head_dim..`).
    pub v_b: MatrixView<'a>,
    /// Output projection (`attn_output`, `n_embd` x `n_head v_head_dim`).
    pub wo: MatrixView<'a>,
}

/// Rows `h * rows..` of `m`: one head's block of a stacked projection.
pub(super) fn head_block<'a, E>(
    m: &MatrixView<'a>,
    h: usize,
    rows: usize,
) -> Result<MatrixView<'a>, ForwardError<E>> {
    let rb = m.row_bytes();
    let bytes = m
        .bytes()
        .get(h * rows * rb..(h + 1) * rows * rb)
        .ok_or(ForwardError::Shape("MLA head block"))?;
    MatrixView::new(m.ty(), rows, m.cols(), bytes)
        .map_err(|_| ForwardError::Shape("MLA head block"))
}

/// The model's MLA shape, checked against `w` and `hp`.
pub(super) fn shape<E>(
    hp: &Hparams,
    hy: &HybridParams,
    w: &MlaWeights<'_>,
) -> Result<MlaShape, ForwardError<E>> {
    let m = hy
        .mla
        .ok_or(ForwardError::Shape("MLA weights without an MLA shape"))?;
    check(hp, &m, w)?;
    Ok(m)
}

/// RoPE of a rotated part `x` (`rope` dimensions) at position `pos`.
pub(super) fn rope_part(hp: &Hparams, m: &MlaShape, x: &mut [f32], pos: usize) {
    rope_scaled(
        x,
        m.rope,
        m.rope,
        pos as u32,
        hp.rope_base,
        hp.rope_style,
        hp.rope_yarn.as_ref(),
    )
}

/// The projected latent `l` (`kv_lora + rope`) made ready, its first `kv_lora`
/// normed by `norm` and the rest rotated, and cached at `pos` as key and value
/// (`base` is the cache layer's first float).
pub(super) fn cache_latent(
    hp: &Hparams,
    m: &MlaShape,
    norm: &[f32],
    l: &mut [f32],
    kv: &mut KvCache<'_>,
    cache_layer: usize,
    pos: usize,
) {
    let (c, r) = l.split_at_mut(m.kv_lora);
    rms_norm_heads(c, norm, hp.norm_eps);
    rope_part(hp, m, r, pos);
    kv.store(cache_layer, pos, l, l);
}

/// The factor queries are scaled by before the attention kernel, whose own
/// scale is `1 / sqrt(kv_lora + rope)`: together the file's `kq_scale`.
pub(super) fn query_prescale(m: &MlaShape) -> f32 {
    m.kq_scale * libm::sqrtf(m.latent() as f32)
}

/// A head's query at `pos` made ready: `out` holds its absorbed part
/// (`kv_lora`); the rotated part `qr` goes after it, rotated, and all of it
/// is scaled by `pre` for the kernel.
pub(super) fn finish_query(
    hp: &Hparams,
    m: &MlaShape,
    out: &mut [f32],
    qr: &mut [f32],
    pos: usize,
    pre: f32,
) {
    rope_part(hp, m, qr, pos);
    out[m.kv_lora..].copy_from_slice(qr);
    for v in out.iter_mut() {
        *v *= pre;
    }
}

/// Checks `w` against the model's shape `m` and `hp`.
fn check<E>(hp: &Hparams, m: &MlaShape, w: &MlaWeights<'_>) -> Result<(), ForwardError<E>> {
    let n = hp.n_head;
    let q_in = match w.q_a {
        Some((qa, norm)) => {
            if qa.rows() != m.q_lora || qa.cols() != hp.n_embd || norm.len() != m.q_lora {
                return Err(ForwardError::Shape("MLA query compression"));
            }
            m.q_lora
        }
        None => hp.n_embd,
    };
    let ok = w.q.rows() == n * m.q_head()
        && w.q.cols() == q_in
        && w.kv_a.rows() == m.latent()
        && w.kv_a.cols() == hp.n_embd
        && w.kv_a_norm.len() == m.kv_lora
        && w.k_b.rows() == n * m.kv_lora
        && w.k_b.cols() == m.nope
        && w.v_b.rows() == n * m.v_head_dim
        && w.v_b.cols() == m.kv_lora
        && w.wo.rows() == hp.n_embd
        && w.wo.cols() == n * m.v_head_dim;
    if ok {
        Ok(())
    } else {
        Err(ForwardError::Shape("MLA weights"))
    }
}

/// The MLA layer at position `pos` on the normed input `s.x`: the latent into
/// cache layer `cache_layer` and the layer's
/// output into `s.tmp`.
#[allow(clippy::too_many_arguments)]
pub(super) fn mla_layer<M: MatVec, E>(
    hp: &Hparams,
    hy: &HybridParams,
    w: &MlaWeights<'_>,
    mv: &mut M,
    s: &mut Scratch<'_>,
    kv: &mut KvCache<'_>,
    cache_layer: usize,
    pos: usize,
) -> Result<(), ForwardError<E>> {
    let m = shape(hp, hy, w)?;
    let (n, qh, lat, kvl, vd) = (hp.n_head, m.q_head(), m.latent(), m.kv_lora, m.v_head_dim);
    if s.mla_q.len() < n * qh.max(vd) || s.mla_qa.len() != m.q_lora {
        return Err(ForwardError::Shape("MLA scratch"));
    }

    // Queries, then the latent: [rmsnorm(c), rope(r)], key and value alike.
    let q_raw = &mut s.mla_q[..n * qh];
    match w.q_a {
        Some((qa, norm)) => {
            mv.matvec(&qa, s.x, s.mla_qa)?;
            rms_norm_heads(s.mla_qa, norm, hp.norm_eps);
            mv.matvec(&w.q, s.mla_qa, q_raw)?;
        }
        None => mv.matvec(&w.q, s.x, q_raw)?,
    }
    mv.matvec(&w.kv_a, s.x, s.k)?;
    cache_latent(hp, &m, w.kv_a_norm, s.k, kv, cache_layer, pos);

    // Each head's query in the latent's space, scaled for the kernel.
    let pre = query_prescale(&m);
    for h in 0..n {
        let (qn, qr) = q_raw[h * qh..][..qh].split_at_mut(m.nope);
        let out = &mut s.q[h * lat..][..lat];
        mv.matvec(&head_block(&w.k_b, h, kvl)?, qn, &mut out[..kvl])?;
        finish_query(hp, &m, out, qr, pos, pre);
    }
    let shape = AttnShape {
        n_head: n,
        n_head_kv: 1,
        head_dim: lat,
    };
    let view = cached(kv, cache_layer, 0..pos + 1)?;
    mv.attention(shape, s.q, view, s.scores, s.att);

    // Each head's value up-projection, then the output projection.
    let o = &mut s.mla_q[..n * vd];
    for h in 0..n {
        let att = &s.att[h * lat..][..kvl];
        mv.matvec(&head_block(&w.v_b, h, vd)?, att, &mut o[h * vd..][..vd])?;
    }
    mv.matvec(&w.wo, o, s.tmp)?;
    Ok(())
}
