//! The small numeric operations of a transformer layer, over caller slices, with
//! the arithmetic of ggml's CPU backend where it matters for matching llama.cpp
//! (f64 accumulation in norms, iterative RoPE angles, max-subtracted softmax).

use libm::{cosf, expf, sinf, sqrtf};

use super::config::Mrope;
use crate::gemv::{vector, Isa};

/// `out = x / rms(x) * weight` (ggml `rms_norm` followed by `mul`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == weight.len() && x.len() == out.len(),
        "rms_norm: lengths differ"
    );
    let sum: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / sqrtf(mean + eps);
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// In-place [`rms_norm`] of each `head_dim` chunk of `x` with the same weight
/// (per-head Q/K norms).
pub fn rms_norm_heads(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    assert!(
        d > 0 && x.len().is_multiple_of(d),
        "rms_norm_heads: lengths differ"
    );
    for head in x.chunks_exact_mut(d) {
        let sum: f64 = head.iter().map(|v| (*v as f64) * (*v as f64)).sum();
        let mean = (sum / d as f64) as f32;
        let scale = 1.0 / sqrtf(mean + eps);
        for (v, w) in head.iter_mut().zip(weight) {
            *v = (*v * scale) * w;
        }
    }
}

/// How RoPE pairs up dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)` (llama, mixtral).
    Normal,
    /// Halves `(i, i + n_rot/2)` (GPT-NeoX; qwen2/3, olmoe).
    Neox,
}

/// Rotary position embedding of every `head_dim` chunk of `x` at position `pos`,
/// rotating the first `n_rot` dimensions of each head.
pub fn rope(
    x: &mut [f32],
    head_dim: usize,
    n_rot: usize,
    pos: u32,
    freq_base: f32,
    style: RopeStyle,
) {
    rope_scaled(x, head_dim, n_rot, pos, freq_base, style, None);
}

/// YaRN context extension of RoPE (ggml's `rope_yarn`): each pair's angle
/// `theta` (the plain one, "extrapolated") is mixed with `freq_scale * theta`
/// ("interpolated") by a ramp over the pairs between the correction dimensions
/// of `beta_fast` and `beta_slow` rotations within `n_ctx_orig` positions, and
/// the cosine and sine are scaled by `attn_factor * (1 + 0.1 ln(1 / freq_scale))`
/// when `ext_factor` is not 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `1 / rope.scaling.factor`.
    pub freq_scale: f32,
    /// Weight of the extrapolated angle on the ramp (1 for YaRN).
    pub ext_factor: f32,
    /// Magnitude scale of the rotation (`rope.scaling.attn_factor`, 1 by default).
    pub attn_factor: f32,
    /// Rotations at which the ramp starts (32).
    pub beta_fast: f32,
    /// Rotations at which it ends (1).
    pub beta_slow: f32,
    /// Context length the model was trained at (`rope.scaling.original_context_length`).
    pub n_ctx_orig: u32,
}

impl Yarn {
    /// The pairs where the ramp runs, `[low, high]` (ggml's
    /// `ggml_rope_yarn_corr_dims`): floor and ceiling of the dimensions whose
    /// wavelength fits `beta_fast` and `beta_slow` rotations in `n_ctx_orig`.
    pub fn corr_dims(&self, n_rot: usize, freq_base: f32) -> [f32; 2] {
        let dim = |rotations: f32| {
            let two_pi = 2.0 * core::f32::consts::PI;
            n_rot as f32 * libm::logf(self.n_ctx_orig as f32 / (rotations * two_pi))
                / (2.0 * libm::logf(freq_base))
        };
        let start = libm::floorf(dim(self.beta_fast));
        let end = libm::ceilf(dim(self.beta_slow));
        [start.max(0.0), end.min(n_rot as f32 - 1.0)]
    }

    /// Pair `i`'s cosine and sine for the plain angle `theta_extrap`.
    fn angle(&self, theta_extrap: f32, corr: [f32; 2], i: usize) -> (f32, f32) {
        let theta_interp = self.freq_scale * theta_extrap;
        let mut theta = theta_interp;
        let mut mscale = self.attn_factor;
        if self.ext_factor != 0.0 {
            let y = (i as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
            let ramp_mix = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
            theta = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0 + 0.1 * libm::logf(1.0 / self.freq_scale);
        }
        (cosf(theta) * mscale, sinf(theta) * mscale)
    }
}

/// Pair `i`'s cosine and sine for the plain angle `theta`: scaled by `yarn`
/// (with its correction dimensions) where given.
#[inline]
fn pair_angle(yarn: Option<(&Yarn, [f32; 2])>, theta: f32, i: usize) -> (f32, f32) {
    match yarn {
        Some((y, corr)) => y.angle(theta, corr, i),
        None => (cosf(theta), sinf(theta)),
    }
}

/// [`rope`] with YaRN scaling ([`Yarn`]) where `yarn` is given.
pub fn rope_scaled(
    x: &mut [f32],
    head_dim: usize,
    n_rot: usize,
    pos: u32,
    freq_base: f32,
    style: RopeStyle,
    yarn: Option<&Yarn>,
) {
    rope_factored(x, head_dim, n_rot, pos, freq_base, style, yarn, None);
}

/// [`rope_scaled`] with per-pair frequency factors where `factors` is given
/// (`n_rot / 2` of them: Llama 3.1's `rope_freqs.weight`, ggml's
/// `freq_factors`): pair `i`'s plain angle is divided by `factors[i]` before
/// any YaRN mixing, as ggml divides it.
#[allow(clippy::too_many_arguments)]
pub fn rope_factored(
    x: &mut [f32],
    head_dim: usize,
    n_rot: usize,
    pos: u32,
    freq_base: f32,
    style: RopeStyle,
    yarn: Option<&Yarn>,
    factors: Option<&[f32]>,
) {
    assert!(rope_fits(x, head_dim, n_rot), "rope: bad dimensions");
    assert!(
        factors.is_none_or(|f| f.len() == n_rot / 2),
        "rope: one frequency factor a pair"
    );
    let theta_scale = libm::powf(freq_base, -2.0 / n_rot as f32);
    let yarn = yarn.map(|y| (y, y.corr_dims(n_rot, freq_base)));
    let mut theta = pos as f32;
    rotate_pairs(x, head_dim, n_rot / 2, style, |i0, cs| {
        for (i, c) in (i0..).zip(cs) {
            *c = match factors {
                Some(f) => pair_angle(yarn, theta / f[i], i),
                None => pair_angle(yarn, theta, i),
            };
            theta *= theta_scale;
        }
    });
}

/// Whether `x` is whole heads of `head_dim` whose first `n_rot` (even)
/// dimensions can be rotated.
fn rope_fits(x: &[f32], head_dim: usize, n_rot: usize) -> bool {
    n_rot.is_multiple_of(2) && n_rot <= head_dim && head_dim > 0 && x.len().is_multiple_of(head_dim)
}

/// Pairs [`rotate_pairs`] takes the angles of at a time.
const ROPE_PAIRS: usize = 64;

/// Rotates pair `i` (of `half`, paired as `style` says) of every head of `x`
/// by the angle whose cosine and sine `angles` gives it: `angles(i0, cs)`
/// fills `cs` for pairs `i0..i0 + cs.len()`, chunk after chunk in order (so it
/// may keep a running angle). Every head turns by the same angles, so each
/// pair's cosine and sine are computed once for all heads.
fn rotate_pairs(
    x: &mut [f32],
    head_dim: usize,
    half: usize,
    style: RopeStyle,
    mut angles: impl FnMut(usize, &mut [(f32, f32)]),
) {
    let mut i0 = 0;
    while i0 < half {
        let m = (half - i0).min(ROPE_PAIRS);
        let mut cs = [(0.0f32, 0.0f32); ROPE_PAIRS];
        angles(i0, &mut cs[..m]);
        for head in x.chunks_exact_mut(head_dim) {
            for (k, &(c, s)) in cs[..m].iter().enumerate() {
                let i = i0 + k;
                let (a, b) = match style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
        i0 += m;
    }
}

/// [`rope`] with interleaved multi-section angles (ggml's `GGML_ROPE_TYPE_IMROPE`,
/// always NeoX-paired): pair `i` takes position `pos[j]` where, with
/// `sector = i % sum(sections)`, `j` is 1 (height) when `sector % 3 == 1` and
/// `sector < 3 * sections[1]`, 2 (width) when `sector % 3 == 2` and
/// `sector < 3 * sections[2]`, 0 (time) when `sector % 3 == 0` and
/// `sector < 3 * sections[0]`, else 3. Text tokens have `pos = [p, p, p, 0]`.
pub fn rope_imrope(
    x: &mut [f32],
    head_dim: usize,
    n_rot: usize,
    pos: [u32; 4],
    sections: [u32; 4],
    freq_base: f32,
) {
    let m = Mrope {
        sections,
        interleaved: true,
    };
    rope_multi_scaled(x, head_dim, n_rot, pos, &m, freq_base, None);
}

/// Multi-section RoPE (ggml's `rope_multi`, `GGML_ROPE_TYPE_MROPE` or
/// `_IMROPE`, always NeoX-paired): pair `i` turns by `pos[m.component(i)]`
/// ([`Mrope::component`]), every component's angle shrinking by the same
/// factor a pair; with YaRN scaling where `yarn` is given, each pair's
/// section angle through [`Yarn`]'s mix and magnitude, as ggml's
/// `rope_multi` does (the ramp over the pairs of all sections alike).
pub fn rope_multi_scaled(
    x: &mut [f32],
    head_dim: usize,
    n_rot: usize,
    pos: [u32; 4],
    m: &Mrope,
    freq_base: f32,
    yarn: Option<&Yarn>,
) {
    let sect_dims: u64 = m.sections.iter().map(|&s| u64::from(s)).sum();
    assert!(
        rope_fits(x, head_dim, n_rot) && sect_dims > 0,
        "rope_multi: bad dimensions"
    );
    let theta_scale = libm::powf(freq_base, -2.0 / n_rot as f32);
    let yarn = yarn.map(|y| (y, y.corr_dims(n_rot, freq_base)));
    let mut theta = pos.map(|p| p as f32);
    rotate_pairs(x, head_dim, n_rot / 2, RopeStyle::Neox, |i0, cs| {
        for (i, c) in (i0..).zip(cs) {
            *c = pair_angle(yarn, theta[m.component(i)], i);
            for t in theta.iter_mut() {
                *t *= theta_scale;
            }
        }
    });
}

/// `1 / (1 + e^-x)`, as ggml's `sigmoid`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + expf(-x))
}

/// `x / (1 + e^-x)`, as ggml's `silu`, with LES's own `exp` (the bits of
/// [`vector::silu`]).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + vector::exp(-x))
}

/// `ln(1 + e^x)`, `x` itself above 20 (ggml's `softplus`).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        libm::logf(1.0 + expf(x))
    }
}

/// In-place L2 normalisation of each `head_dim` chunk: `x / sqrt(sum x^2 + eps)`,
/// computed as llama.cpp's gated DeltaNet does (`rms_norm(x, eps / n) / sqrt(n)`).
pub fn l2_norm_heads(x: &mut [f32], head_dim: usize, eps: f32) {
    assert!(
        head_dim > 0 && x.len().is_multiple_of(head_dim),
        "l2_norm_heads: lengths differ"
    );
    let n = head_dim as f32;
    let eps_n = eps / n;
    let post = 1.0 / sqrtf(n);
    for head in x.chunks_exact_mut(head_dim) {
        let sum: f64 = head.iter().map(|v| (v * v) as f64).sum();
        let mean = (sum / head_dim as f64) as f32;
        let scale = 1.0 / sqrtf(mean + eps_n);
        for v in head.iter_mut() {
            *v = (*v * scale) * post;
        }
    }
}

/// `x = silu(x) * y`, the SwiGLU of expert and dense FFNs, with LES's own
/// vectorised `exp` ([`vector::swiglu`]: the same bits on every ISA).
pub fn swiglu(x: &mut [f32], y: &[f32]) {
    vector::swiglu(Isa::detect(), x, y);
}

/// `x = relu(x)^2` in place, as ggml's `relu` then `sqr` (Nemotron-H's
/// ungated experts): negative values and NaN become 0.
pub fn relu_sqr(x: &mut [f32]) {
    for v in x {
        let r = if *v > 0.0 { *v } else { 0.0 };
        *v = r * r;
    }
}

/// `x = relu(x) * y` in place, as ggml's `reglu` (SmallThinker's experts):
/// `x * y` where `x > 0`, else 0 (NaN gates too).
pub fn reglu(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "reglu: lengths differ");
    for (a, &b) in x.iter_mut().zip(y) {
        *a = if *a > 0.0 { *a * b } else { 0.0 };
    }
}

/// gpt-oss's clamped SwiGLU in place of the gate `x` (ggml's `swiglu_oai`):
/// `g * sigmoid(alpha * g) * (u + 1)` with `g = min(x, limit)` and
/// `u = clamp(y, -limit, limit)`, comparisons as C++'s `std::min` and `std::clamp`.
pub fn swiglu_oai(x: &mut [f32], y: &[f32], alpha: f32, limit: f32) {
    assert_eq!(x.len(), y.len(), "swiglu_oai: lengths differ");
    for (a, &b) in x.iter_mut().zip(y) {
        let g = if limit < *a { limit } else { *a };
        let u = if b < -limit {
            -limit
        } else if limit < b {
            limit
        } else {
            b
        };
        let glu = g / (1.0 + expf(alpha * (-g)));
        *a = glu * (u + 1.0);
    }
}

/// Shape of grouped-query attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (divides `n_head`).
    pub n_head_kv: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

/// Cached keys or values, in the cache's element type.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    /// `f32` values.
    F32(&'a [f32]),
    /// IEEE binary16 bits (llama.cpp's default `f16` cache), widened to `f32`
    /// as attention reads them.
    F16(&'a [u16]),
}

impl<'a> KvRows<'a> {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(x) => x.len(),
            KvRows::F16(x) => x.len(),
        }
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values from `at` on.
    fn from(self, at: usize) -> KvRows<'a> {
        match self {
            KvRows::F32(x) => KvRows::F32(&x[at..]),
            KvRows::F16(x) => KvRows::F16(&x[at..]),
        }
    }

    /// Rows `t0..t0 + n` of `d` values, `stride` apart: in place for `f32`,
    /// widened into `buf` (at least `n * d` floats) for `f16`.
    fn rows<'b>(
        self,
        isa: Isa,
        t0: usize,
        n: usize,
        stride: usize,
        d: usize,
        buf: &'b mut [f32],
    ) -> vector::Strided<'b>
    where
        'a: 'b,
    {
        match self {
            KvRows::F32(x) => vector::Strided {
                data: &x[t0 * stride..],
                stride,
                n,
                d,
            },
            KvRows::F16(x) => {
                vector::widen_f16_rows(isa, &x[t0 * stride..], stride, n, d, buf);
                vector::Strided {
                    data: buf,
                    stride: d,
                    n,
                    d,
                }
            }
        }
    }
}

impl<'a> From<&'a [f32]> for KvRows<'a> {
    fn from(x: &'a [f32]) -> Self {
        KvRows::F32(x)
    }
}

/// The cached keys and values one attention reads: `k` and `v` hold
/// `positions * n_head_kv * head_dim` values (or more), position-major.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    /// Keys.
    pub k: KvRows<'a>,
    /// Values.
    pub v: KvRows<'a>,
    /// Positions attended to (`n_past + 1`).
    pub positions: usize,
    /// Attention sinks (gpt-oss): one logit per query head, taking part in its
    /// softmax as a key whose value is zero ([`vector::softmax_with_sink`]).
    pub sinks: Option<&'a [f32]>,
}

impl<'a> KvView<'a> {
    /// The view of positions `start..positions` only (a sliding window), each
    /// position `kv_stride` values.
    pub fn from_position(self, start: usize, kv_stride: usize) -> KvView<'a> {
        let start = start.min(self.positions);
        KvView {
            k: self.k.from(start * kv_stride),
            v: self.v.from(start * kv_stride),
            positions: self.positions - start,
            sinks: self.sinks,
        }
    }
}

/// Floats of the stack buffer an `f16` cache's rows are widened into, a tile
/// of positions at a time: 16 KiB on 64-bit targets (it stays in L1 while
/// every head sharing the rows reads them), 4 KiB on smaller ones, whose
/// stacks are small.
#[cfg(target_pointer_width = "64")]
const WIDE_TILE: usize = 4096;
#[cfg(not(target_pointer_width = "64"))]
const WIDE_TILE: usize = 1024;

/// Scores of a tile (queries x positions) [`tiled_dots`] computes at once.
#[cfg(target_pointer_width = "64")]
const TILE_SCORES: usize = 1024;
#[cfg(not(target_pointer_width = "64"))]
const TILE_SCORES: usize = 256;

/// Largest `head_dim` an `f16` cache supports (a row must fit a tile): 4096
/// on 64-bit targets, 1024 on others.
pub const MAX_F16_HEAD_DIM: usize = WIDE_TILE;

/// Positions a tile holds: a tile of [`WIDE_TILE`] floats, and at most a
/// query's row of [`TILE_SCORES`].
fn tile_positions(d: usize) -> usize {
    (WIDE_TILE / d.max(1)).clamp(1, TILE_SCORES)
}

/// `scaled_dots` of the query rows `q` (`d` each) against cached rows
/// `0..n` (`stride` apart from `rows`' start) into `sc[j * n + t]`: in one
/// call for an `f32` cache, a tile of positions at a time for `f16`, each
/// score the one-call result (scores do not depend on each other).
#[allow(clippy::too_many_arguments)]
fn tiled_dots(
    isa: Isa,
    q: &[f32],
    rows: KvRows<'_>,
    n: usize,
    stride: usize,
    d: usize,
    scale: f32,
    sc: &mut [f32],
) {
    if let KvRows::F32(x) = rows {
        let keys = vector::Strided {
            data: x,
            stride,
            n,
            d,
        };
        return vector::scaled_dots(isa, q, keys, scale, sc);
    }
    let mut buf = [0f32; WIDE_TILE];
    let mut tile_scores = [0f32; TILE_SCORES];
    let tile = tile_positions(d);
    // Queries scored against a tile at once (each key read once for them).
    let group = (TILE_SCORES / tile).max(1);
    let nq = q.len() / d.max(1);
    for t0 in (0..n).step_by(tile) {
        let tn = tile.min(n - t0);
        let keys = rows.rows(isa, t0, tn, stride, d, &mut buf);
        for j0 in (0..nq).step_by(group) {
            let jn = group.min(nq - j0);
            let ts = &mut tile_scores[..jn * tn];
            vector::scaled_dots(isa, &q[j0 * d..(j0 + jn) * d], keys, scale, ts);
            for (j, row) in ts.chunks_exact(tn).enumerate() {
                sc[(j0 + j) * n + t0..][..tn].copy_from_slice(row);
            }
        }
    }
}

/// `weighted_rows_strided` of the weights `w` (output `j`'s at `w[j * ws..]`,
/// indexed by position) over the cached rows `from..to`: in one call for an
/// `f32` cache, a tile of positions at a time for `f16`, the same additions
/// in the same order.
#[allow(clippy::too_many_arguments)]
fn tiled_sums(
    isa: Isa,
    w: &[f32],
    ws: usize,
    rows: KvRows<'_>,
    (from, to): (usize, usize),
    stride: usize,
    d: usize,
    o: &mut [f32],
) {
    if let KvRows::F32(x) = rows {
        let values = vector::Strided {
            data: &x[from * stride..],
            stride,
            n: to - from,
            d,
        };
        return vector::weighted_rows_strided(isa, &w[from..], ws, values, o);
    }
    let mut buf = [0f32; WIDE_TILE];
    let tile = tile_positions(d);
    for t0 in (from..to).step_by(tile) {
        let tn = tile.min(to - t0);
        let values = rows.rows(isa, t0, tn, stride, d, &mut buf);
        vector::weighted_rows_strided(isa, &w[t0..], ws, values, o);
    }
}

/// Attention of one query (all heads, `q`) over the cached positions of `kv`.
/// `scores` is scratch of at least `kv.positions`.
/// The result is the same bits with every `isa` (its vector kernels only
/// change the speed: [`crate::gemv::vector`]).
pub fn attention(
    isa: Isa,
    shape: AttnShape,
    q: &[f32],
    kv: KvView<'_>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    attention_heads(isa, shape, 0..shape.n_head, q, kv, scores, out);
}

/// Whether [`attention_heads`] accepts these arguments (it panics otherwise).
pub fn attention_fits(
    shape: AttnShape,
    heads: &core::ops::Range<usize>,
    q: &[f32],
    kv: KvView<'_>,
    scores: &[f32],
    out: &[f32],
) -> bool {
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim,
    } = shape;
    let n_kv_positions = kv.positions;
    let len = n_kv_positions
        .saturating_mul(n_head_kv)
        .saturating_mul(head_dim);
    n_head_kv > 0
        && n_head % n_head_kv == 0
        && heads.start <= heads.end
        && heads.end <= n_head
        && q.len() == n_head.saturating_mul(head_dim)
        && out.len() == heads.len().saturating_mul(head_dim)
        && kv.k.len() >= len
        && kv.v.len() >= len
        && scores.len() >= n_kv_positions
        && f16_fits(kv, head_dim)
        && kv.sinks.is_none_or(|s| s.len() == n_head)
}

/// An `f16` cache's rows fit a tile.
fn f16_fits(kv: KvView<'_>, head_dim: usize) -> bool {
    let f16 = matches!(kv.k, KvRows::F16(_)) || matches!(kv.v, KvRows::F16(_));
    !f16 || head_dim <= MAX_F16_HEAD_DIM
}

/// [`attention`] of the query heads `heads` only: `out` holds those heads'
/// outputs (`heads.len() * head_dim` values). Heads that share a key/value head
/// are computed up to `scores.len() / n_kv_positions` at a time, so each cached
/// key and value is read once per batch rather than once per head (the scores
/// need one row of `n_kv_positions` per head of a batch). Every head is computed
/// exactly as [`attention`] computes it, whichever range and batch it is in, so
/// splitting the heads across threads changes no bit of the result.
pub fn attention_heads(
    isa: Isa,
    shape: AttnShape,
    heads: core::ops::Range<usize>,
    q: &[f32],
    kv: KvView<'_>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim,
    } = shape;
    let n = kv.positions;
    let kv_stride = n_head_kv * head_dim;
    assert!(
        attention_fits(shape, &heads, q, kv, scores, out),
        "attention: bad shapes"
    );
    let group = n_head / n_head_kv;
    let batch = (scores.len() / n.max(1)).max(1);
    let scale = 1.0 / sqrtf(head_dim as f32);
    let mut h0 = heads.start;
    while h0 < heads.end {
        // Heads h0..h1 share KV head `kvh`.
        let kvh = h0 / group;
        let h1 = heads.end.min((kvh + 1) * group).min(h0 + batch);
        let nb = h1 - h0;
        let sc = &mut scores[..nb * n];
        let qs = &q[h0 * head_dim..h1 * head_dim];
        let (k, v) = (kv.k.from(kvh * head_dim), kv.v.from(kvh * head_dim));
        let o = &mut out[(h0 - heads.start) * head_dim..(h1 - heads.start) * head_dim];
        o.fill(0.0);
        tiled_dots(isa, qs, k, n, kv_stride, head_dim, scale, sc);
        for (h, row) in (h0..).zip(sc.chunks_exact_mut(n.max(1))) {
            vector::softmax_with_sink(isa, row, kv.sinks.map(|s| s[h]));
        }
        tiled_sums(isa, sc, n, v, (0, n), kv_stride, head_dim, o);
        h0 = h1;
    }
}

/// Scratch floats [`attention_causal`] needs for `g` positions of `shape`,
/// the last attending to `n` cached positions: each query head of one KV
/// head, for every position, gets its query, its row of `n` scores and its
/// output.
pub fn attention_causal_scratch(shape: AttnShape, g: usize, n: usize) -> usize {
    let group = shape.n_head / shape.n_head_kv.max(1);
    g.saturating_mul(group)
        .saturating_mul(n.saturating_add(2 * shape.head_dim))
}

/// Whether [`attention_causal`] accepts these arguments, with a scratch of
/// `scratch` floats (it panics otherwise).
pub fn attention_causal_fits(
    shape: AttnShape,
    q: &[f32],
    kv: KvView<'_>,
    first: usize,
    scratch: usize,
    out: &[f32],
) -> bool {
    let q_dim = shape.n_head.saturating_mul(shape.head_dim);
    let g = q.len().checked_div(q_dim).unwrap_or(0);
    let len = kv
        .positions
        .saturating_mul(shape.n_head_kv)
        .saturating_mul(shape.head_dim);
    shape.n_head_kv > 0
        && shape.n_head.is_multiple_of(shape.n_head_kv)
        && g > 0
        && q.len() == g * q_dim
        && out.len() == q.len()
        && first.checked_add(g) == Some(kv.positions)
        && kv.k.len() >= len
        && kv.v.len() >= len
        && scratch >= attention_causal_scratch(shape, g, kv.positions)
        && f16_fits(kv, shape.head_dim)
        && kv.sinks.is_none_or(|s| s.len() == shape.n_head)
}

/// Causal attention of the `g` consecutive positions `first..first + g` at
/// once: `q` holds their queries (`g` rows of `n_head * head_dim`), `kv` the
/// keys and values of positions `0..first + g` (`kv.positions = first + g`),
/// and position `first + i` attends to positions `0..=first + i`; `out` gets
/// their outputs, laid out as `q`. Each position's output is [`attention`]'s
/// over `kv` cut at its position, bit for bit: the same dot products of the
/// same vectors, the softmax over the same row, and the same values added in
/// the same order (those all the positions see in one pass, then the few each
/// sees beyond the first one). But each cached key and value is read once for
/// the `g` positions and all query heads of its KV head, instead of once a
/// position. (The scores of a position's later keys are computed and then
/// ignored: a triangle of `g * (g - 1) / 2` dots, which the shared pass saves
/// many times over.) `scratch` holds at least [`attention_causal_scratch`]
/// floats.
pub fn attention_causal(
    isa: Isa,
    shape: AttnShape,
    q: &[f32],
    kv: KvView<'_>,
    first: usize,
    scratch: &mut [f32],
    out: &mut [f32],
) {
    assert!(
        attention_causal_fits(shape, q, kv, first, scratch.len(), out),
        "attention_causal: bad shapes"
    );
    let AttnShape {
        n_head,
        n_head_kv,
        head_dim: d,
    } = shape;
    let (q_dim, kv_stride) = (n_head * d, n_head_kv * d);
    let g = q.len() / q_dim;
    let n = kv.positions;
    let nb = n_head / n_head_kv;
    let rows = g * nb;
    let scale = 1.0 / sqrtf(d as f32);
    let (qs, rest) = scratch.split_at_mut(rows * d);
    let (sc, rest) = rest.split_at_mut(rows * n);
    let os = &mut rest[..rows * d];
    for kvh in 0..n_head_kv {
        // Row `i * nb + j`: query head `kvh * nb + j` of position `first + i`.
        for i in 0..g {
            let from = &q[i * q_dim + kvh * nb * d..][..nb * d];
            qs[i * nb * d..][..nb * d].copy_from_slice(from);
        }
        let (k, v) = (kv.k.from(kvh * d), kv.v.from(kvh * d));
        tiled_dots(isa, qs, k, n, kv_stride, d, scale, sc);
        for (r, row) in sc.chunks_exact_mut(n).enumerate() {
            let sink = kv.sinks.map(|s| s[kvh * nb + r % nb]);
            vector::softmax_with_sink(isa, &mut row[..first + r / nb + 1], sink);
        }
        os.fill(0.0);
        // Positions `0..=first`, which every row sees, then each position's
        // own later ones, in order.
        let sums = |w: &[f32], from: usize, to: usize, o: &mut [f32]| {
            tiled_sums(isa, w, n, v, (from, to), kv_stride, d, o)
        };
        sums(sc, 0, first + 1, os);
        for i in 1..g {
            let w = &sc[i * nb * n..];
            let o = &mut os[i * nb * d..][..nb * d];
            sums(w, first + 1, first + 1 + i, o);
        }
        for i in 0..g {
            out[i * q_dim + kvh * nb * d..][..nb * d].copy_from_slice(&os[i * nb * d..][..nb * d]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_normalises() {
        let x = [3.0, 4.0];
        let mut out = [0.0; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6);
        assert!((out[1] - 8.0 / rms).abs() < 1e-6);
    }

    /// gpt-oss's activation clamps the gate from above only and the up
    /// projection both ways, as ggml's `swiglu_oai`.
    #[test]
    fn swiglu_oai_clamps_as_ggml() {
        let mut g = [10.0f32, -10.0, 1.0, 0.0];
        let u = [10.0f32, -10.0, -0.5, 3.0];
        swiglu_oai(&mut g, &u, 1.702, 7.0);
        let f = |g: f32, u: f32| g / (1.0 + expf(1.702 * -g)) * (u + 1.0);
        assert_eq!(g, [f(7.0, 7.0), f(-10.0, -7.0), f(1.0, -0.5), 0.0]);
    }

    #[test]
    fn reglu_gates_by_the_sign_of_the_gate() {
        let mut g = [2.0f32, -1.0, -0.0, f32::NAN, 0.5];
        reglu(&mut g, &[3.0, 5.0, f32::INFINITY, 1.0, -4.0]);
        assert_eq!(g, [6.0, 0.0, 0.0, 0.0, -2.0]);
        assert!(g[1].is_sign_positive() && g[2].is_sign_positive());
    }

    #[test]
    fn relu_sqr_zeroes_negatives_and_nan() {
        let mut x = [3.0f32, -2.0, 0.5, -0.0, f32::NAN, f32::INFINITY];
        relu_sqr(&mut x);
        assert_eq!(x, [9.0, 0.0, 0.25, 0.0, 0.0, f32::INFINITY]);
        assert!(x[3].is_sign_positive());
    }

    /// With ext_factor 0 YaRN is linear scaling: angles times freq_scale and
    /// no magnitude change; at pair 0 (past the ramp's fast end) it is the
    /// plain angle scaled by the magnitude factor.
    #[test]
    fn rope_yarn_reduces_to_its_parts() {
        let x0: std::vec::Vec<f32> = (0..32).map(|i| libm::sinf(i as f32)).collect();
        let base = 10000.0;
        let mut plain = x0.clone();
        rope(&mut plain, 16, 16, 7, base, RopeStyle::Neox);
        let linear = Yarn {
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            n_ctx_orig: 4096,
        };
        let mut got = x0.clone();
        rope_scaled(&mut got, 16, 16, 7, base, RopeStyle::Neox, Some(&linear));
        assert_eq!(got, plain, "freq_scale 1 without ext is plain RoPE");
        let yarn = Yarn {
            freq_scale: 0.25,
            ext_factor: 1.0,
            ..linear
        };
        let mut got = x0.clone();
        rope_scaled(&mut got, 16, 16, 7, base, RopeStyle::Neox, Some(&yarn));
        let m = 1.0 + 0.1 * libm::logf(4.0);
        let (c, s) = (cosf(7.0) * m, sinf(7.0) * m);
        assert_eq!(got[0], x0[0] * c - x0[8] * s);
        assert_eq!(got[8], x0[0] * s + x0[8] * c);
        let [low, high] = yarn.corr_dims(16, base);
        assert!(low >= 0.0 && low <= high && high <= 15.0, "{low} {high}");
    }

    #[test]
    fn rope_rotates_pairs_by_position() {
        // Position 0 is the identity; rotation preserves pair norms.
        let mut x = [1.0, 2.0, 3.0, 4.0];
        rope(&mut x, 4, 4, 0, 10000.0, RopeStyle::Neox);
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0]);
        let mut n = [1.0, 0.0, 0.0, 0.0];
        rope(&mut n, 4, 4, 1, 10000.0, RopeStyle::Normal);
        assert!((n[0] - 1f32.cos()).abs() < 1e-6 && (n[1] - 1f32.sin()).abs() < 1e-6);
        let mut h = [1.0, 0.0, 0.0, 0.0];
        rope(&mut h, 4, 4, 1, 10000.0, RopeStyle::Neox);
        assert!((h[0] - 1f32.cos()).abs() < 1e-6 && (h[2] - 1f32.sin()).abs() < 1e-6);
        // Partial rotation leaves the tail alone.
        let mut p = [1.0, 0.0, 5.0, 6.0];
        rope(&mut p, 4, 2, 3, 10000.0, RopeStyle::Neox);
        assert_eq!(&p[2..], &[5.0, 6.0]);
    }

    /// `rope` as a head at a time, each pair's angle from the running product.
    fn rope_per_head(
        x: &mut [f32],
        head_dim: usize,
        n_rot: usize,
        pos: u32,
        base: f32,
        style: RopeStyle,
    ) {
        let theta_scale = libm::powf(base, -2.0 / n_rot as f32);
        for head in x.chunks_exact_mut(head_dim) {
            let mut theta = pos as f32;
            for i in 0..n_rot / 2 {
                let (c, s) = (cosf(theta), sinf(theta));
                let (a, b) = match style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + n_rot / 2),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
                theta *= theta_scale;
            }
        }
    }

    /// `rope_imrope` as a head at a time (sections of the text-and-image kind).
    fn imrope_per_head(x: &mut [f32], head_dim: usize, n_rot: usize, pos: [u32; 4], base: f32) {
        let sections = [11usize, 11, 10, 0];
        let sect_dims: usize = sections.iter().sum();
        let theta_scale = libm::powf(base, -2.0 / n_rot as f32);
        for head in x.chunks_exact_mut(head_dim) {
            let mut theta = pos.map(|p| p as f32);
            for i in 0..n_rot / 2 {
                let sector = i % sect_dims;
                let which = if sector % 3 == 1 && sector < 3 * sections[1] {
                    1
                } else if sector % 3 == 2 && sector < 3 * sections[2] {
                    2
                } else if sector.is_multiple_of(3) && sector < 3 * sections[0] {
                    0
                } else {
                    3
                };
                let (c, sn) = (cosf(theta[which]), sinf(theta[which]));
                let (a, b) = (i, i + n_rot / 2);
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * sn;
                head[b] = x0 * sn + x1 * c;
                for t in theta.iter_mut() {
                    *t *= theta_scale;
                }
            }
        }
    }

    #[test]
    fn rope_shares_the_angles_across_heads_bit_for_bit() {
        // More than one chunk of pairs (head_dim 512: 256 pairs), partial rotation.
        for (head_dim, n_rot) in [
            (64, 64),
            (128, 128),
            (256, 256),
            (512, 512),
            (256, 130),
            (8, 2),
        ] {
            for style in [RopeStyle::Normal, RopeStyle::Neox] {
                for pos in [0u32, 1, 17, 40_000] {
                    let mut a = [0.0f32; 3 * 512];
                    for (i, v) in a.iter_mut().enumerate() {
                        *v = libm::sinf(i as f32 * 0.37);
                    }
                    let mut b = a;
                    let n = 3 * head_dim;
                    let (mut c, mut e) = (a, a);
                    rope(&mut a[..n], head_dim, n_rot, pos, 1e6, style);
                    rope_per_head(&mut b[..n], head_dim, n_rot, pos, 1e6, style);
                    for (x, y) in a.iter().zip(&b) {
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "{head_dim} {n_rot} {style:?} {pos}"
                        );
                    }
                    let p = [pos, pos / 3, pos / 5, 0];
                    rope_imrope(&mut c[..n], head_dim, n_rot, p, [11, 11, 10, 0], 1e6);
                    imrope_per_head(&mut e[..n], head_dim, n_rot, p, 1e6);
                    for (x, y) in c.iter().zip(&e) {
                        assert_eq!(x.to_bits(), y.to_bits(), "imrope {head_dim} {n_rot} {pos}");
                    }
                }
            }
        }
    }

    /// Frequency factors divide each pair's angle before YaRN: factors of 1
    /// change nothing, and factors of 2 at position `2p` rotate as none at
    /// `p` (doubling and halving are exact), bit for bit, with and without
    /// YaRN; one factor of 2 moves only its own pair.
    #[test]
    fn rope_frequency_factors_divide_the_angles() {
        let x: std::vec::Vec<f32> = (0..48).map(|i| (i as f32 * 0.61).cos()).collect();
        let yarn = Yarn {
            freq_scale: 0.25,
            ext_factor: 1.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            n_ctx_orig: 64,
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<std::vec::Vec<_>>();
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            for y in [None, Some(&yarn)] {
                for pos in [0u32, 1, 5, 333] {
                    let (mut a, mut b, mut c) = (x.clone(), x.clone(), x.clone());
                    rope_scaled(&mut a, 16, 12, pos, 1e4, style, y);
                    rope_factored(&mut b, 16, 12, pos, 1e4, style, y, Some(&[1.0; 6]));
                    rope_factored(&mut c, 16, 12, 2 * pos, 1e4, style, y, Some(&[2.0; 6]));
                    assert_eq!(bits(&a), bits(&b), "{style:?} {pos}");
                    assert_eq!(bits(&a), bits(&c), "{style:?} {pos}");
                    let mut d = x.clone();
                    let one = [1.0, 1.0, 1.0, 2.0, 1.0, 1.0];
                    rope_factored(&mut d, 16, 12, pos, 1e4, style, y, Some(&one));
                    let pair = |i: usize| match style {
                        RopeStyle::Normal => [2 * i, 2 * i + 1],
                        RopeStyle::Neox => [i, i + 6],
                    };
                    for i in 0..6 {
                        for head in 0..3 {
                            for k in pair(i) {
                                let same = a[head * 16 + k].to_bits() == d[head * 16 + k].to_bits();
                                assert!(same || (i == 3 && pos > 0), "{style:?} {pos} pair {i}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn imrope_of_text_positions_is_neox_rope() {
        // Sections covering every rotated pair: text positions [p, p, p, 0] rotate
        // exactly as plain NeoX RoPE (bit for bit: same angles, same order).
        let x: std::vec::Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
        for pos in [0u32, 1, 7, 1000] {
            let (mut a, mut b) = (x.clone(), x.clone());
            rope(&mut a, 16, 8, pos, 1e7, RopeStyle::Neox);
            rope_imrope(&mut b, 16, 8, [pos, pos, pos, 0], [2, 1, 1, 0], 1e7);
            assert_eq!(a, b);
        }
        // A pair on the extra section stays put for text.
        let mut c = x.clone();
        rope_imrope(&mut c, 16, 8, [5, 5, 5, 0], [1, 1, 1, 1], 1e4);
        assert_eq!((c[3], c[7]), (x[3], x[7]));
        assert_ne!(c[0], x[0]);
    }

    /// ggml's plain M-RoPE (GLM-4.xV's): the sections one after the other,
    /// pair `i` by the time, height, width or extra position as `i` falls in
    /// the first, second, third or last section; the same angles as a
    /// reference that spells the sections out, bit for bit, and text
    /// positions rotate as plain NeoX RoPE.
    #[test]
    fn mrope_sections_follow_one_another() {
        let x: std::vec::Vec<f32> = (0..64).map(|i| (i as f32 * 0.29).cos()).collect();
        let m = Mrope {
            sections: [2, 3, 2, 1],
            interleaved: false,
        };
        let owner = [0, 0, 1, 1, 1, 2, 2, 3];
        assert_eq!(
            (0..8).map(|i| m.component(i)).collect::<std::vec::Vec<_>>(),
            owner
        );
        // Past the sections' sum (here 16 pairs, 8 in the sections) they repeat.
        assert_eq!(m.component(10), 1);
        let pos = [7u32, 30, 400, 2];
        let mut a = x.clone();
        rope_multi_scaled(&mut a, 32, 16, pos, &m, 1e4, None);
        let theta_scale = libm::powf(1e4, -2.0 / 16.0);
        let mut b = x.clone();
        for head in b.chunks_exact_mut(32) {
            let mut theta = pos.map(|p| p as f32);
            for i in 0..8 {
                let t = theta[owner[i]];
                let (c, sn) = (cosf(t), sinf(t));
                let (x0, x1) = (head[i], head[i + 8]);
                head[i] = x0 * c - x1 * sn;
                head[i + 8] = x0 * sn + x1 * c;
                theta.iter_mut().for_each(|t| *t *= theta_scale);
            }
        }
        assert_eq!(a, b);
        for p in [0u32, 3, 999] {
            let (mut c, mut d) = (x.clone(), x.clone());
            let text = Mrope {
                sections: [2, 3, 3, 0],
                interleaved: false,
            };
            rope_multi_scaled(&mut c, 32, 16, [p, p, p, 0], &text, 1e4, None);
            rope(&mut d, 32, 16, p, 1e4, RopeStyle::Neox);
            assert_eq!(c, d, "{p}");
        }
    }

    #[test]
    fn l2_norm_and_gates() {
        let mut v = [3.0, 4.0, 0.0, 0.0];
        l2_norm_heads(&mut v, 2, 1e-6);
        assert!((v[0] - 0.6).abs() < 1e-6 && (v[1] - 0.8).abs() < 1e-6);
        assert_eq!(&v[2..], &[0.0, 0.0]);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-6);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7 && silu(0.0) == 0.0);
    }

    #[test]
    fn attention_of_head_ranges_equals_all_heads_bit_for_bit() {
        let shape = AttnShape {
            n_head: 6,
            n_head_kv: 2,
            head_dim: 4,
        };
        let n = 5;
        let val = |i: usize| ((i * 37 % 23) as f32 - 11.0) / 7.0;
        let q: [f32; 24] = core::array::from_fn(val);
        let k: [f32; 40] = core::array::from_fn(|i| val(i + 3));
        let v: [f32; 40] = core::array::from_fn(|i| val(i + 7));
        let mut scores = [0.0; 5];
        let mut whole = [0.0; 24];
        let kv = KvView {
            k: KvRows::F32(&k),
            v: KvRows::F32(&v),
            positions: n,
            sinks: None,
        };
        attention(Isa::Scalar, shape, &q, kv, &mut scores, &mut whole);
        // Head ranges crossing KV groups, in batches of 1, 2 and 3 heads, with
        // every ISA's vector kernels.
        for isa in Isa::available() {
            for batch in [1, 2, 3] {
                let mut wide = [0.0; 15];
                let mut split = [0.0; 24];
                for heads in [0..1, 1..4, 4..4, 4..6] {
                    let out = &mut split[heads.start * 4..heads.end * 4];
                    attention_heads(isa, shape, heads, &q, kv, &mut wide[..batch * n], out);
                }
                assert_eq!(
                    whole.map(f32::to_bits),
                    split.map(f32::to_bits),
                    "{isa} batch {batch}"
                );
            }
        }
    }

    /// An `f16` cache (keys, values or both) gives the bits of the `f32`
    /// cache holding the same values widened, on every ISA, one position or a
    /// causal group at a time, over more positions than a tile holds.
    #[test]
    fn f16_cache_equals_f32_cache_of_the_widened_values_bit_for_bit() {
        let mut seed = 21u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        };
        for (n_head, n_head_kv, d) in [(4, 2, 8), (6, 1, 5), (8, 2, 128), (2, 2, 17)] {
            let shape = AttnShape {
                n_head,
                n_head_kv,
                head_dim: d,
            };
            let (q_dim, kv_dim) = (n_head * d, n_head_kv * d);
            let n = 2 * tile_positions(d) + 7;
            let half: std::vec::Vec<u16> = (0..2 * n * kv_dim)
                .map(|_| crate::quant::f32_to_f16(rnd()))
                .collect();
            let wide: std::vec::Vec<f32> =
                half.iter().map(|&h| crate::quant::f16_to_f32(h)).collect();
            let (hk, hv) = half.split_at(n * kv_dim);
            let (wk, wv) = wide.split_at(n * kv_dim);
            let g = 5;
            let q: std::vec::Vec<f32> = (0..g * q_dim).map(|_| rnd()).collect();
            let want_kv = KvView {
                k: KvRows::F32(wk),
                v: KvRows::F32(wv),
                positions: n,
                sinks: None,
            };
            let mut scores = std::vec![0f32; 2 * n];
            let mut want = std::vec![0f32; q_dim];
            attention(
                Isa::Scalar,
                shape,
                &q[..q_dim],
                want_kv,
                &mut scores,
                &mut want,
            );
            let scratch_len = attention_causal_scratch(shape, g, n);
            let mut want_group = std::vec![0f32; g * q_dim];
            let mut scratch = std::vec![0f32; scratch_len];
            let first = n - g;
            attention_causal(
                Isa::Scalar,
                shape,
                &q,
                want_kv,
                first,
                &mut scratch,
                &mut want_group,
            );
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<std::vec::Vec<_>>();
            for (k, v) in [
                (KvRows::F16(hk), KvRows::F16(hv)),
                (KvRows::F16(hk), KvRows::F32(wv)),
                (KvRows::F32(wk), KvRows::F16(hv)),
            ] {
                let kv = KvView {
                    k,
                    v,
                    positions: n,
                    sinks: None,
                };
                for isa in Isa::available() {
                    let mut got = std::vec![f32::NAN; q_dim];
                    attention(isa, shape, &q[..q_dim], kv, &mut scores, &mut got);
                    assert_eq!(bits(&got), bits(&want), "{isa} {shape:?}");
                    let mut got = std::vec![f32::NAN; g * q_dim];
                    let mut scratch = std::vec![f32::NAN; scratch_len];
                    attention_causal(isa, shape, &q, kv, first, &mut scratch, &mut got);
                    assert_eq!(bits(&got), bits(&want_group), "{isa} {shape:?} causal");
                }
            }
        }
        // A head wider than a tile is refused for an f16 cache.
        let shape = AttnShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: MAX_F16_HEAD_DIM + 1,
        };
        let (h, w) = (
            std::vec![0u16; MAX_F16_HEAD_DIM + 1],
            std::vec![0f32; MAX_F16_HEAD_DIM + 1],
        );
        let (k, v) = (KvRows::F16(&h), KvRows::F32(&w));
        let kv = KvView {
            k,
            v,
            positions: 1,
            sinks: None,
        };
        assert!(!attention_fits(shape, &(0..1), &w, kv, &[0.0], &w));
        let kv = KvView {
            k: v,
            v,
            positions: 1,
            sinks: None,
        };
        assert!(attention_fits(shape, &(0..1), &w, kv, &[0.0], &w));
    }

    /// Each position of a causal group gets [`attention`]'s bits over the
    /// cache cut at its position, with every ISA, for groups of several sizes
    /// at several offsets, with more query heads than KV heads.
    #[test]
    fn causal_group_equals_attention_at_each_position_bit_for_bit() {
        let mut seed = 9u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        };
        for (n_head, n_head_kv, d) in [(4, 2, 8), (6, 1, 5), (8, 2, 64), (2, 2, 17)] {
            let shape = AttnShape {
                n_head,
                n_head_kv,
                head_dim: d,
            };
            let (q_dim, kv_dim) = (n_head * d, n_head_kv * d);
            for (first, g) in [(0, 1), (0, 5), (3, 1), (7, 4), (70, 9)] {
                let n = first + g;
                let k: std::vec::Vec<f32> = (0..n * kv_dim).map(|_| rnd()).collect();
                let v: std::vec::Vec<f32> = (0..n * kv_dim).map(|_| rnd()).collect();
                let q: std::vec::Vec<f32> = (0..g * q_dim).map(|_| rnd()).collect();
                let mut want = std::vec![0f32; g * q_dim];
                let mut scores = std::vec![0f32; n];
                for i in 0..g {
                    let kv = KvView {
                        k: KvRows::F32(&k),
                        v: KvRows::F32(&v),
                        positions: first + i + 1,
                        sinks: None,
                    };
                    let (qi, oi) = (&q[i * q_dim..][..q_dim], &mut want[i * q_dim..][..q_dim]);
                    attention(Isa::Scalar, shape, qi, kv, &mut scores, oi);
                }
                let kv = KvView {
                    k: KvRows::F32(&k),
                    v: KvRows::F32(&v),
                    positions: n,
                    sinks: None,
                };
                for isa in Isa::available() {
                    let mut scratch = std::vec![f32::NAN; attention_causal_scratch(shape, g, n)];
                    let mut got = std::vec![f32::NAN; g * q_dim];
                    attention_causal(isa, shape, &q, kv, first, &mut scratch, &mut got);
                    let bits =
                        |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<std::vec::Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{isa} {shape:?} first={first} g={g}"
                    );
                }
                // A short scratch, or a group that does not end at the cache's
                // last position, is refused.
                let need = attention_causal_scratch(shape, g, n);
                let mut out = std::vec![0f32; g * q_dim];
                assert!(!attention_causal_fits(shape, &q, kv, first, need - 1, &out));
                assert!(attention_causal_fits(shape, &q, kv, first, need, &out));
                assert!(!attention_causal_fits(shape, &q, kv, first + 1, need, &out));
                out.pop();
                assert!(!attention_causal_fits(shape, &q, kv, first, need, &out));
            }
        }
    }

    #[test]
    fn attention_over_one_position_returns_its_value() {
        let shape = AttnShape {
            n_head: 2,
            n_head_kv: 1,
            head_dim: 2,
        };
        let mut out = [0.0; 4];
        let mut scores = [0.0; 1];
        attention(
            Isa::detect(),
            shape,
            &[1.0, 0.0, 0.0, 1.0],
            KvView {
                k: KvRows::F32(&[0.5, 0.5]),
                v: KvRows::F32(&[7.0, -1.0]),
                positions: 1,
                sinks: None,
            },
            &mut scores,
            &mut out,
        );
        assert_eq!(out, [7.0, -1.0, 7.0, -1.0]);
    }

    #[test]
    fn attention_weights_by_softmax_of_scaled_scores() {
        let shape = AttnShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: 1,
        };
        let mut out = [0.0];
        let mut scores = [0.0; 2];
        attention(
            Isa::detect(),
            shape,
            &[1.0],
            KvView {
                k: KvRows::F32(&[0.0, 2.0]),
                v: KvRows::F32(&[10.0, 20.0]),
                positions: 2,
                sinks: None,
            },
            &mut scores,
            &mut out,
        );
        let w1 = 2f32.exp() / (1.0 + 2f32.exp());
        assert!((out[0] - (10.0 * (1.0 - w1) + 20.0 * w1)).abs() < 1e-4);
    }
}

#[cfg(test)]
mod window_tests {
    use super::*;
    use crate::quant::{f16_to_f32, f32_to_f16};

    /// A windowed view of an `f16` cache attends exactly as the same window of
    /// an `f32` cache holding the same (rounded) values, at every start and
    /// length, with sinks or without.
    #[test]
    fn windowed_f16_view_equals_f32() {
        let shape = AttnShape {
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
        };
        let stride = shape.n_head_kv * shape.head_dim;
        let total = 24;
        let vals = |seed: u32| -> std::vec::Vec<u16> {
            (0..total * stride)
                .map(|i| {
                    let x = libm::sinf((i as u32 * 7 + seed) as f32 * 0.37) * 2.0;
                    f32_to_f16(x)
                })
                .collect()
        };
        let (hk, hv) = (vals(1), vals(2));
        let wk: std::vec::Vec<f32> = hk.iter().map(|&h| f16_to_f32(h)).collect();
        let wv: std::vec::Vec<f32> = hv.iter().map(|&h| f16_to_f32(h)).collect();
        let q: std::vec::Vec<f32> = (0..shape.n_head * shape.head_dim)
            .map(|i| libm::cosf(i as f32))
            .collect();
        let sinks = [0.5f32, -1.0, 2.0, 0.0];
        for isa in crate::gemv::Isa::available() {
            for positions in 1..=total {
                for start in 0..positions {
                    for s in [None, Some(&sinks[..])] {
                        let view = |k, v| {
                            KvView {
                                k,
                                v,
                                positions,
                                sinks: s,
                            }
                            .from_position(start, stride)
                        };
                        let mut sc = std::vec![0f32; 4 * total];
                        let mut a = std::vec![0f32; q.len()];
                        let mut b = std::vec![0f32; q.len()];
                        attention(
                            isa,
                            shape,
                            &q,
                            view(KvRows::F16(&hk), KvRows::F16(&hv)),
                            &mut sc,
                            &mut a,
                        );
                        attention(
                            isa,
                            shape,
                            &q,
                            view(KvRows::F32(&wk), KvRows::F32(&wv)),
                            &mut sc,
                            &mut b,
                        );
                        assert_eq!(a, b, "{isa} positions {positions} start {start}");
                    }
                }
            }
        }
    }
}
