//! `f32` vector kernels of attention: a query's scores against the cached keys
//! ([`scaled_dots`]), their [`softmax`] and the weighted sum of the cached
//! values ([`weighted_rows`]), with SIMD where the ISA has it; [`widen_f16`]
//! converts an `f16` cache's rows to `f32` for them.
//!
//! # Exactness
//!
//! [`dot`] defines the dot product's order: element `i` into partial sum
//! `i % 16` (a multiply, then an add: never fused), the partial sums folded by
//! halves (`s[l] += s[l + 8]`, then `+ 4`, `+ 2`, `+ 1`), then the elements
//! past the last whole 16 added in order. AVX-512 keeps the sixteen sums in one
//! register, AVX2 in two, NEON in four, and folds them in the same order, so
//! every ISA gives the same bits. [`weighted_rows`] updates each output element
//! with `o += w * v` (multiply, then add), positions in order, on every ISA.
//! [`softmax`] uses LES's own [`exp`] (range reduction and a polynomial: a
//! fixed sequence of IEEE multiplies and adds, so SIMD lanes compute it
//! exactly as the scalar code does) and sums in `f64` in eight partial sums.
//! For finite inputs every ISA gives the same bits; NaN stays NaN.
#![allow(unsafe_code)]

use super::Isa;

/// Partial sums of [`dot`].
const LANES: usize = 16;

/// Positions [`weighted_rows`]'s SIMD kernels take at a time: a tile's values
/// (64 rows of 128 floats: 32 KiB) stay in L1 while every head sharing them
/// adds them up.
#[cfg(target_arch = "x86_64")]
const SUMS_TILE: usize = 64;

/// The dot product in the fixed order of the module docs (the reference).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = tail_dot(ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0] + tail
}

/// The elements past the last whole 16, in order.
#[inline(always)]
fn tail_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        s += x * y;
    }
    s
}

/// Below this `exp` is 0 (the result would be below the smallest normal).
const EXP_MIN: f32 = -87.336_54;
/// Above this `exp` is `exp(EXP_MAX)` (softmax only takes `x <= 0`).
const EXP_MAX: f32 = 88.0;
const LOG2E: f32 = core::f32::consts::LOG2_E;
/// `1.5 * 2^23`: adding and subtracting it rounds to the nearest integer.
const ROUND: f32 = 12_582_912.0;
/// `ln 2` in two parts (Cody and Waite): `C1` has few bits, so `n * C1` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial for `e^r` on `|r| <= ln 2 / 2`, highest first (its
/// last coefficient, 0.50000001201, is 0.5 in `f32`).
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` to about 1 ulp, LES's own (not the platform's `expf`): `x = n ln 2 +
/// r` with `n` the nearest integer to `x log2 e`, `e^r` by a degree-7
/// polynomial, times `2^n` from the exponent bits. Every step is one IEEE
/// multiply or add in a fixed order (never fused), which the SIMD kernels
/// repeat lane by lane. 0 below -87.34, `e^88` above 88, NaN for NaN.
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < EXP_MIN {
        return 0.0;
    }
    let x = if x > EXP_MAX { EXP_MAX } else { x };
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut y = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        y = y * r + c;
    }
    let y = ((y * (r * r)) + r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Partial sums of [`softmax`]'s total (`f64`).
const SUM_LANES: usize = 8;

/// SwiGLU in place of the gate `x`: `x[i] = x[i] / (1 + exp(-x[i])) * y[i]`
/// (`silu(x) y`, a divide, then a multiply) with [`exp`], eight lanes at a
/// time where the ISA has them: the same bits with every `isa`. Below -88,
/// where [`exp`] stops at `e^88`, a gate gives about `1e-36 y` for 0.
pub fn swiglu(isa: Isa, x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "swiglu: lengths differ");
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::swiglu_avx2(x, y) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            // SAFETY: NEON is part of the target (`target_feature = "neon"`).
            unsafe { neon::swiglu(x, y) }
        }
        _ => swiglu_tail(x, y),
    }
}

/// `x[i] = x[i] / (1 + exp(-x[i]))` (SiLU) with [`exp`], as [`swiglu`]
/// computes its gate: the same bits with every `isa`.
pub fn silu(isa: Isa, x: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::silu_avx2(x) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            // SAFETY: NEON is part of the target (`target_feature = "neon"`).
            unsafe { neon::silu(x) }
        }
        _ => silu_tail(x),
    }
}

/// [`silu`] one element at a time (the reference, and the SIMD kernels' tail).
#[inline(always)]
fn silu_tail(x: &mut [f32]) {
    for a in x.iter_mut() {
        *a /= 1.0 + exp(-*a);
    }
}

/// [`swiglu`] one element at a time (the reference, and the SIMD kernels'
/// tail).
#[inline(always)]
fn swiglu_tail(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a = *a / (1.0 + exp(-*a)) * b;
    }
}

/// `x[i] = e^(x[i] - max) / sum_j e^(x[j] - max)` with [`exp`], the sum in
/// `f64`: element `i` into partial sum `i % 8`, folded by halves, then the
/// elements past the last whole 8 in order; each element is then multiplied
/// by `(1 / sum) as f32`. The same bits with every `isa` for finite inputs.
pub fn softmax(isa: Isa, x: &mut [f32]) {
    softmax_with_sink(isa, x, None);
}

/// [`softmax`] with an extra logit `sink` in the normalisation (an attention
/// sink, gpt-oss's: a key that every query sees and whose value is zero):
/// the max is taken over `x` and `sink`, and `e^(sink - max)` is added to the
/// sum after `x`'s terms, as ggml's `soft_max` with sinks does. `None` is
/// [`softmax`], bit for bit.
pub fn softmax_with_sink(isa: Isa, x: &mut [f32], sink: Option<f32>) {
    let mut max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if let Some(s) = sink {
        max = max.max(s);
    }
    let mut sum = match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx512() => {
            // SAFETY: the CPU supports AVX-512 F (checked just above).
            unsafe { x86::exp_sum_avx512(x, max) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::exp_sum_avx2(x, max) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            // SAFETY: NEON is part of the target (`target_feature = "neon"`).
            unsafe { neon::exp_sum(x, max) }
        }
        _ => exp_sum(x, max),
    };
    if let Some(s) = sink {
        sum += exp(s - max) as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `x[i] = exp(x[i] - max)`, returning their sum in [`softmax`]'s order.
fn exp_sum(x: &mut [f32], max: f32) -> f64 {
    let mut acc = [0f64; SUM_LANES];
    let mut chunks = x.chunks_exact_mut(SUM_LANES);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp(*v - max);
            *a += *v as f64;
        }
    }
    let tail = exp_tail(chunks.into_remainder(), max);
    fold_sums(acc) + tail
}

/// [`exp_sum`] of the elements past the last whole 8, in order.
#[inline(always)]
fn exp_tail(x: &mut [f32], max: f32) -> f64 {
    let mut s = 0f64;
    for v in x.iter_mut() {
        *v = exp(*v - max);
        s += *v as f64;
    }
    s
}

/// The eight partial sums folded by halves: `s[l] += s[l + 4]`, `+ 2`, `+ 1`.
#[inline(always)]
fn fold_sums(mut s: [f64; SUM_LANES]) -> f64 {
    let mut width = SUM_LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            s[i] += s[i + width];
        }
    }
    s[0]
}

/// One head of the gated delta rule (DeltaNet's state update and read-out),
/// row by row over the `d x d` state `m`: row `j` times `decay`, then
/// `u = (v[j] - dot(row, k)) * beta`, `row += k * u`, and `out[j] =
/// dot(row, q) * scale`. Each element sees the operations of the four passes
/// over the whole state (decay, deltas, updates, read-out) in the same order,
/// and rows do not depend on each other, so the bits are those of the four
/// passes; the state is read and written once instead of four times. `d` is
/// `k.len()`; `m` holds `d * d`, `v` and `out` `d` (panics otherwise).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    isa: Isa,
    m: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    scale: f32,
    out: &mut [f32],
) {
    let d = k.len();
    assert!(
        m.len() == d * d && q.len() == d && v.len() == d && out.len() == d,
        "delta_rule: bad lengths"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if d.is_multiple_of(LANES) && super::cpuid::has_avx512() => {
            // SAFETY: the CPU supports AVX-512 F (checked just above).
            unsafe { x86::delta_rule_avx512(m, k, q, v, decay, beta, scale, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni
            if d.is_multiple_of(LANES) && super::cpuid::has_avx2() =>
        {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::delta_rule_avx2(m, k, q, v, decay, beta, scale, out) }
        }
        _ => {
            for ((row, o), vj) in m.chunks_exact_mut(d.max(1)).zip(out.iter_mut()).zip(v) {
                for x in row.iter_mut() {
                    *x *= decay;
                }
                let u = (vj - dot(row, k)) * beta;
                for (x, kk) in row.iter_mut().zip(k) {
                    *x += kk * u;
                }
                *o = dot(row, q) * scale;
            }
        }
    }
}

/// `n` rows of `d` floats, `stride` floats apart, from the start of `data`
/// (which holds at least `(n - 1) * stride + d`): one head's keys or values in
/// a KV cache.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    /// The floats.
    pub data: &'a [f32],
    /// Floats from one row's start to the next's.
    pub stride: usize,
    /// Rows.
    pub n: usize,
    /// Floats a row.
    pub d: usize,
}

/// Whether `len` elements hold `count` runs of `run` elements `stride` apart
/// (the last run ends at `(count - 1) * stride + run`), computed without
/// overflow: the SIMD kernels read within that bound unchecked.
fn fits(len: usize, count: usize, stride: usize, run: usize) -> bool {
    count == 0
        || (count - 1)
            .checked_mul(stride)
            .and_then(|x| x.checked_add(run))
            .is_some_and(|need| len >= need)
}

/// `out[j * n + t] = dot(q_j, row t) * scale` for the `nb = q.len() / d` query
/// vectors `q_j = q[j * d..][..d]` and the `n` rows: the scores of `nb` heads
/// sharing a key head, each key read once for all of them. Needs
/// `out.len() >= nb * n` and the rows in `data` (panics otherwise, like slice
/// indexing).
pub fn scaled_dots(isa: Isa, q: &[f32], keys: Strided<'_>, scale: f32, out: &mut [f32]) {
    let Strided {
        data: rows,
        stride,
        n,
        d,
    } = keys;
    let nb = q.len() / d.max(1);
    assert!(
        fits(out.len(), nb, n, n) && fits(rows.len(), n, stride, d),
        "scaled_dots: bad lengths"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx512() => {
            // SAFETY: the CPU supports AVX-512 F (checked just above).
            unsafe { x86::scaled_dots_avx512(q, d, rows, stride, n, scale, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::scaled_dots_avx2(q, d, rows, stride, 0, n, scale, out) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            // SAFETY: NEON is part of the target (`target_feature = "neon"`).
            unsafe { neon::scaled_dots(q, d, rows, stride, n, scale, out) }
        }
        _ => {
            for t in 0..n {
                let k = &rows[t * stride..][..d];
                for j in 0..nb {
                    out[j * n + t] = dot(&q[j * d..][..d], k) * scale;
                }
            }
        }
    }
}

/// `out[j * n + t] = (sum over i of q[j * d + i] * kt[i * n + t]) * scale`
/// for the `nq = q.len() / d` queries and `n` keys given transposed (`kt`:
/// `d` rows of `n` floats, key `t` in column `t`): each sum over `i` in
/// order, a multiply then an add, from zero. The SIMD lanes run over keys,
/// so no score needs a horizontal sum: for many keys of short heads (a
/// vision tower's attention, where [`scaled_dots`]' folds cost as much as
/// the products). The same bits on every ISA (not [`scaled_dots`]' bits:
/// another order). Panics if `kt` holds fewer than `d * n` floats or `out`
/// fewer than `nq * n`.
pub fn scaled_dots_by_key(
    isa: Isa,
    q: &[f32],
    d: usize,
    kt: &[f32],
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    let nq = q.len().checked_div(d).unwrap_or(0);
    assert!(
        d.checked_mul(n).is_some_and(|m| kt.len() >= m)
            && nq.checked_mul(n).is_some_and(|m| out.len() >= m),
        "scaled_dots_by_key: bad lengths"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::dots_by_key_avx2(q, d, kt, n, scale, out) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            // SAFETY: NEON is part of the target (`target_feature = "neon"`).
            unsafe { neon::dots_by_key(q, d, kt, n, scale, out) }
        }
        _ => dots_by_key_from(q, d, kt, n, 0, scale, out),
    }
}

/// [`scaled_dots_by_key`] of keys `from..n` one at a time: the reference,
/// and the SIMD kernels' last keys.
fn dots_by_key_from(
    q: &[f32],
    d: usize,
    kt: &[f32],
    n: usize,
    from: usize,
    scale: f32,
    out: &mut [f32],
) {
    for (j, qj) in q.chunks_exact(d.max(1)).enumerate() {
        for t in from..n {
            let mut s = 0f32;
            for (i, &x) in qj.iter().enumerate() {
                s += x * kt[i * n + t];
            }
            out[j * n + t] = s * scale;
        }
    }
}

/// `o[j * d + i] += w[j * n + t] * (row t)[i]` for `t` in `0..n` in order, for
/// the `nb = o.len() / d` outputs: the weighted sums of the values of `nb`
/// heads sharing a value head, each value read once for all of them. Needs
/// `w.len() >= nb * n` and the rows in `data` (panics otherwise).
pub fn weighted_rows(isa: Isa, w: &[f32], values: Strided<'_>, o: &mut [f32]) {
    weighted_rows_strided(isa, w, values.n, values, o);
}

/// [`weighted_rows`] with output `j`'s weights at `w[j * w_stride..]`
/// (`w_stride >= n`): `o[j * d + i] += w[j * w_stride + t] * (row t)[i]` for `t`
/// in `0..n` in order. Each element gets the same additions in the same order
/// as from [`weighted_rows`] over the same weights, so a sum split over
/// consecutive runs of positions, one call a run, has the same bits as one
/// call over all of them. Panics if `w` or `data` is too short.
pub fn weighted_rows_strided(
    isa: Isa,
    w: &[f32],
    w_stride: usize,
    values: Strided<'_>,
    o: &mut [f32],
) {
    let Strided {
        data: rows,
        stride,
        n,
        d,
    } = values;
    let nb = o.len() / d.max(1);
    assert!(
        w_stride >= n && fits(w.len(), nb, w_stride, n) && fits(rows.len(), n, stride, d),
        "weighted_rows: bad lengths"
    );
    let (n, ws) = (n, w_stride);
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx512() => {
            // SAFETY: the CPU supports AVX-512 F (checked just above).
            unsafe { x86::weighted_rows_avx512(w, ws, n, rows, stride, d, o) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::weighted_rows_avx2(w, ws, n, rows, stride, d, o) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            // SAFETY: NEON is part of the target (`target_feature = "neon"`).
            unsafe { neon::weighted_rows(w, ws, n, rows, stride, d, o) }
        }
        _ => {
            for t in 0..n {
                let v = &rows[t * stride..][..d];
                for (j, oh) in o.chunks_exact_mut(d.max(1)).enumerate() {
                    let s = w[j * ws + t];
                    for (x, vv) in oh.iter_mut().zip(v) {
                        *x += s * vv;
                    }
                }
            }
        }
    }
}

/// `dst[i] = src[i]` widened from IEEE binary16 bits (an `f16` KV cache's
/// keys or values) to `f32`: exact, so every ISA gives the bits of
/// [`crate::quant::f16_to_f32`]. Converts `min(src.len(), dst.len())` values.
pub fn widen_f16(isa: Isa, src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    widen_f16_rows(isa, &src[..n], n, 1, n, &mut dst[..n]);
}

/// [`widen_f16`] of `n` rows of `d` values, `stride` apart in `src`, into
/// `dst` packed (`n * d` floats): one dispatch for a tile of a cache.
/// Panics if `src` or `dst` is too short.
pub fn widen_f16_rows(isa: Isa, src: &[u16], stride: usize, n: usize, d: usize, dst: &mut [f32]) {
    assert!(
        fits(dst.len(), n, d, d) && fits(src.len(), n, stride, d),
        "widen_f16_rows: bad lengths"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx512() => {
            // SAFETY: the CPU supports AVX-512 F (and F16C: `has_avx512`
            // implies `has_avx2`).
            unsafe { x86::widen_f16_rows_avx512(src, stride, n, d, dst) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 and F16C (checked just above).
            unsafe { x86::widen_f16_rows(src, stride, n, d, dst) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            for (t, row) in dst.chunks_exact_mut(d.max(1)).take(n).enumerate() {
                // SAFETY: NEON is part of the target (`target_feature = "neon"`).
                unsafe { neon::widen_f16(&src[t * stride..][..d], row) }
            }
        }
        _ => {
            for (t, row) in dst.chunks_exact_mut(d.max(1)).take(n).enumerate() {
                widen_f16_scalar(&src[t * stride..][..d], row);
            }
        }
    }
}

fn widen_f16_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, &h) in dst.iter_mut().zip(src) {
        *d = crate::quant::f16_to_f32(h);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! Every load below reads a sub-slice of exactly the loaded width (taken
    //! with safe indexing first), and every function is `#[target_feature]`,
    //! called only after the features were checked.
    use core::arch::x86_64::*;

    use super::{dot_tail_split, tail_dot};

    #[inline]
    #[target_feature(enable = "avx2")]
    fn ld8(s: &[f32]) -> __m256 {
        let s = &s[..8];
        // SAFETY: `s` holds exactly the 8 floats read; `loadu` needs no alignment.
        unsafe { _mm256_loadu_ps(s.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn st8(s: &mut [f32], v: __m256) {
        let s = &mut s[..8];
        // SAFETY: `s` holds exactly the 8 floats written.
        unsafe { _mm256_storeu_ps(s.as_mut_ptr(), v) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn ld16(s: &[f32]) -> __m512 {
        let s = &s[..16];
        // SAFETY: `s` holds exactly the 16 floats read.
        unsafe { _mm512_loadu_ps(s.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn st16(s: &mut [f32], v: __m512) {
        let s = &mut s[..16];
        // SAFETY: `s` holds exactly the 16 floats written.
        unsafe { _mm512_storeu_ps(s.as_mut_ptr(), v) }
    }

    /// [`super::widen_f16_rows`] with F16C: each row by [`widen_f16`].
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn widen_f16_rows(src: &[u16], stride: usize, n: usize, d: usize, dst: &mut [f32]) {
        for (t, row) in dst.chunks_exact_mut(d.max(1)).take(n).enumerate() {
            widen_f16(&src[t * stride..][..d], row);
        }
    }

    /// [`super::widen_f16_rows`] with AVX-512, sixteen values at a time (the
    /// rest of a row by [`widen_f16`]).
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(super) fn widen_f16_rows_avx512(
        src: &[u16],
        stride: usize,
        n: usize,
        d: usize,
        dst: &mut [f32],
    ) {
        let whole = d / 16 * 16;
        for (t, row) in dst.chunks_exact_mut(d.max(1)).take(n).enumerate() {
            let h = &src[t * stride..][..d];
            for c in (0..whole).step_by(16) {
                let x = &h[c..c + 16];
                // SAFETY: `x` holds exactly the 16 values (32 bytes) read.
                let x = unsafe { _mm256_loadu_si256(x.as_ptr().cast()) };
                st16(&mut row[c..], _mm512_cvtph_ps(x));
            }
            widen_f16(&h[whole..], &mut row[whole..]);
        }
    }

    /// [`super::widen_f16`] with F16C, eight values at a time.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) fn widen_f16(src: &[u16], dst: &mut [f32]) {
        let whole = src.len().min(dst.len()) / 8 * 8;
        for c in (0..whole).step_by(8) {
            let h = &src[c..c + 8];
            // SAFETY: `h` holds exactly the 8 values (16 bytes) read; `loadu`
            // needs no alignment.
            let x = unsafe { _mm_loadu_si128(h.as_ptr().cast()) };
            st8(&mut dst[c..], _mm256_cvtph_ps(x));
        }
        super::widen_f16_scalar(&src[whole..], &mut dst[whole..]);
    }

    /// Lanes 0-7 plus lanes 8-15, then the fold of [`super::dot`] from width 4.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn fold8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// [`super::exp`] of eight lanes, step for step.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn exp8(x: __m256) -> __m256 {
        use super::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E, ROUND};
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
        let xc = _mm256_min_ps(x, _mm256_set1_ps(EXP_MAX));
        let round = _mm256_set1_ps(ROUND);
        let n = _mm256_sub_ps(
            _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)), round),
            round,
        );
        let r = _mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI)));
        let r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
        let mut y = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
        }
        let y = _mm256_mul_ps(y, _mm256_mul_ps(r, r));
        let y = _mm256_add_ps(_mm256_add_ps(y, r), _mm256_set1_ps(1.0));
        let e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
        let y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e)));
        let y = _mm256_andnot_ps(low, y);
        _mm256_blendv_ps(y, x, nan)
    }

    /// `g / (1 + exp(-g))` of eight lanes, [`super::silu_tail`]'s steps.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn silu8(g: __m256) -> __m256 {
        let e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0)));
        _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    }

    /// [`super::swiglu`] with AVX2, eight lanes at a time.
    #[target_feature(enable = "avx2")]
    pub(super) fn swiglu_avx2(x: &mut [f32], y: &[f32]) {
        let whole = x.len() / 8 * 8;
        for c in (0..whole).step_by(8) {
            let s = silu8(ld8(&x[c..]));
            st8(&mut x[c..], _mm256_mul_ps(s, ld8(&y[c..])));
        }
        super::swiglu_tail(&mut x[whole..], &y[whole..]);
    }

    /// [`super::silu`] with AVX2, eight lanes at a time.
    #[target_feature(enable = "avx2")]
    pub(super) fn silu_avx2(x: &mut [f32]) {
        let whole = x.len() / 8 * 8;
        for c in (0..whole).step_by(8) {
            let s = silu8(ld8(&x[c..]));
            st8(&mut x[c..], s);
        }
        super::silu_tail(&mut x[whole..]);
    }

    /// [`super::exp_sum`] with AVX2: the eight `f64` sums in two registers.
    #[target_feature(enable = "avx2")]
    pub(super) fn exp_sum_avx2(x: &mut [f32], max: f32) -> f64 {
        let whole = x.len() / 8 * 8;
        let m = _mm256_set1_ps(max);
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for c in (0..whole).step_by(8) {
            let e = exp8(_mm256_sub_ps(ld8(&x[c..]), m));
            st8(&mut x[c..], e);
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
        }
        let tail = super::exp_tail(&mut x[whole..], max);
        fold4(_mm256_add_pd(lo, hi)) + tail
    }

    /// Lanes `i` and `i + 2`, then lanes 0 and 1: [`super::fold_sums`] from
    /// width 4.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn fold4(s4: __m256d) -> f64 {
        let s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd::<1>(s4));
        let s1 = _mm_add_sd(s2, _mm_unpackhi_pd(s2, s2));
        _mm_cvtsd_f64(s1)
    }

    /// [`super::exp_sum`] with AVX-512: [`exp8`]'s steps, the eight `f64` sums
    /// in one register.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) fn exp_sum_avx512(x: &mut [f32], max: f32) -> f64 {
        let whole = x.len() / 8 * 8;
        let m = _mm256_set1_ps(max);
        let mut acc = _mm512_setzero_pd();
        for c in (0..whole).step_by(8) {
            let e = exp8(_mm256_sub_ps(ld8(&x[c..]), m));
            st8(&mut x[c..], e);
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(e));
        }
        let tail = super::exp_tail(&mut x[whole..], max);
        let lo = _mm512_castpd512_pd256(acc);
        let hi = _mm512_extractf64x4_pd::<1>(acc);
        fold4(_mm256_add_pd(lo, hi)) + tail
    }

    macro_rules! delta_rule_with {
        ($name:ident, $features:literal, $zero:ident, $ld:ident, $st:ident, $set1:ident,
         $add:ident, $mul:ident, $w:literal, $fold:expr) => {
            /// [`super::delta_rule`], a row's sixteen dot sums in registers
            /// (folded in [`super::dot`]'s order); `d` a multiple of 16.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            pub(super) fn $name(
                m: &mut [f32],
                k: &[f32],
                q: &[f32],
                v: &[f32],
                decay: f32,
                beta: f32,
                scale: f32,
                out: &mut [f32],
            ) {
                let d = k.len();
                let dv = $set1(decay);
                for ((row, o), vj) in m.chunks_exact_mut(d).zip(out.iter_mut()).zip(v) {
                    let mut acc = [$zero(); 16 / $w];
                    for c in (0..d).step_by(16) {
                        for (i, a) in acc.iter_mut().enumerate() {
                            let at = c + $w * i;
                            let r = $mul($ld(&row[at..]), dv);
                            $st(&mut row[at..], r);
                            *a = $add(*a, $mul(r, $ld(&k[at..])));
                        }
                    }
                    let u = (vj - $fold(acc)) * beta;
                    let uv = $set1(u);
                    let mut acc = [$zero(); 16 / $w];
                    for c in (0..d).step_by(16) {
                        for (i, a) in acc.iter_mut().enumerate() {
                            let at = c + $w * i;
                            let r = $add($ld(&row[at..]), $mul($ld(&k[at..]), uv));
                            $st(&mut row[at..], r);
                            *a = $add(*a, $mul(r, $ld(&q[at..])));
                        }
                    }
                    *o = $fold(acc) * scale;
                }
            }
        };
    }
    delta_rule_with!(
        delta_rule_avx2,
        "avx2",
        _mm256_setzero_ps,
        ld8,
        st8,
        _mm256_set1_ps,
        _mm256_add_ps,
        _mm256_mul_ps,
        8,
        |a: [__m256; 2]| fold8(_mm256_add_ps(a[0], a[1]))
    );
    delta_rule_with!(
        delta_rule_avx512,
        "avx512f,avx2",
        _mm512_setzero_ps,
        ld16,
        st16,
        _mm512_set1_ps,
        _mm512_add_ps,
        _mm512_mul_ps,
        16,
        |a: [__m512; 1]| fold16(a[0])
    );

    /// A 16-lane register folded in [`super::dot`]'s order.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn fold16(acc: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        fold8(_mm256_add_ps(lo, hi))
    }

    /// [`super::dot`] of `N` queries with one key at once, each query's
    /// sixteen sums in one register (`N` independent accumulators hide the
    /// adds' latency), folded in `dot`'s order, so each result is its bits.
    /// Query `j` is `q[j * d..][..k.len()]` (the queries of a batch lie side by
    /// side: no per-key array of slices to build).
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn dots_avx512<const N: usize>(q: &[f32], d: usize, k: &[f32]) -> [f32; N] {
        let (whole, _, tk) = dot_tail_split(k, k);
        assert!(
            k.len() <= d && super::fits(q.len(), N, d, k.len()),
            "dots: short query"
        );
        let qp = q.as_ptr();
        let mut acc = [_mm512_setzero_ps(); N];
        for c in (0..whole).step_by(16) {
            let kv = ld16(&k[c..]);
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `j * d + c + 16 <= (N - 1) * d + whole <= q.len()`
                // (asserted above without overflow, `whole <= k.len()`): the 16
                // floats read lie in `q`.
                let qv = unsafe { _mm512_loadu_ps(qp.add(j * d + c)) };
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(qv, kv));
            }
        }
        let mut out = [0.0; N];
        for (j, (o, acc)) in out.iter_mut().zip(acc).enumerate() {
            *o = fold16(acc) + tail_dot(&q[j * d + whole..j * d + k.len()], tk);
        }
        out
    }

    /// [`dots_avx512`] with each query's sixteen sums in two registers.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dots_avx2<const N: usize>(q: &[f32], d: usize, k: &[f32]) -> [f32; N] {
        let (whole, _, tk) = dot_tail_split(k, k);
        let mut lo = [_mm256_setzero_ps(); N];
        let mut hi = [_mm256_setzero_ps(); N];
        for c in (0..whole).step_by(16) {
            let (kl, kh) = (ld8(&k[c..]), ld8(&k[c + 8..]));
            for j in 0..N {
                let qj = &q[j * d + c..];
                lo[j] = _mm256_add_ps(lo[j], _mm256_mul_ps(ld8(qj), kl));
                hi[j] = _mm256_add_ps(hi[j], _mm256_mul_ps(ld8(&qj[8..]), kh));
            }
        }
        let mut out = [0.0; N];
        for (j, o) in out.iter_mut().enumerate() {
            *o = fold8(_mm256_add_ps(lo[j], hi[j]))
                + tail_dot(&q[j * d + whole..j * d + k.len()], tk);
        }
        out
    }

    /// [`super::scaled_dots_by_key`]: four queries by sixteen keys in eight
    /// registers (then one query, then eight keys), each lane one score's
    /// sum in order; the last `n % 8` keys one at a time.
    #[target_feature(enable = "avx2")]
    pub(super) fn dots_by_key_avx2(
        q: &[f32],
        d: usize,
        kt: &[f32],
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let nq = q.len().checked_div(d).unwrap_or(0);
        let sv = _mm256_set1_ps(scale);
        let mut t = 0;
        while t + 8 <= n {
            let wide = t + 16 <= n;
            let mut j = 0;
            while j < nq {
                let group = if nq - j >= 4 { 4 } else { 1 };
                let mut lo = [_mm256_setzero_ps(); 4];
                let mut hi = [_mm256_setzero_ps(); 4];
                for i in 0..d {
                    let row = &kt[i * n + t..];
                    let k0 = ld8(row);
                    let k1 = if wide { ld8(&row[8..]) } else { k0 };
                    for g in 0..group {
                        let qv = _mm256_set1_ps(q[(j + g) * d + i]);
                        lo[g] = _mm256_add_ps(lo[g], _mm256_mul_ps(qv, k0));
                        hi[g] = _mm256_add_ps(hi[g], _mm256_mul_ps(qv, k1));
                    }
                }
                for g in 0..group {
                    let o = &mut out[(j + g) * n + t..];
                    st8(o, _mm256_mul_ps(lo[g], sv));
                    if wide {
                        st8(&mut o[8..], _mm256_mul_ps(hi[g], sv));
                    }
                }
                j += group;
            }
            t += if wide { 16 } else { 8 };
        }
        super::dots_by_key_from(q, d, kt, n, t, scale, out);
    }

    macro_rules! scaled_dots_with {
        ($name:ident, $features:literal, $dots:ident) => {
            /// Each key from `from` on against the queries in groups of 8 (then
            /// 4, then 1).
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $features)]
            pub(super) fn $name(
                q: &[f32],
                d: usize,
                rows: &[f32],
                stride: usize,
                from: usize,
                n: usize,
                scale: f32,
                out: &mut [f32],
            ) {
                let nb = q.len() / d.max(1);
                for t in from..n {
                    let k = &rows[t * stride..][..d];
                    let mut j = 0;
                    while j < nb {
                        let left = nb - j;
                        let qs = &q[j * d..];
                        if left >= 8 {
                            let r = $dots::<8>(qs, d, k);
                            for (i, r) in r.into_iter().enumerate() {
                                out[(j + i) * n + t] = r * scale;
                            }
                            j += 8;
                        } else if left >= 4 {
                            let r = $dots::<4>(qs, d, k);
                            for (i, r) in r.into_iter().enumerate() {
                                out[(j + i) * n + t] = r * scale;
                            }
                            j += 4;
                        } else {
                            out[j * n + t] = $dots::<1>(qs, d, k)[0] * scale;
                            j += 1;
                        }
                    }
                }
            }
        };
    }
    scaled_dots_with!(scaled_dots_avx2, "avx2", dots_avx2);
    scaled_dots_with!(scaled_dots_each_avx512, "avx512f,avx2", dots_avx512);

    /// [`super::scaled_dots`] with AVX-512: the keys sixteen at a time, each
    /// query against all sixteen (a key's sixteen lane sums in a register of
    /// its own, the sixteen folded together by [`fold16x16`] and stored at
    /// once), the last `n % 16` keys one at a time
    /// ([`scaled_dots_each_avx512`]). Each score is [`super::dot`]'s bits
    /// times `scale`, as from the reference.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) fn scaled_dots_avx512(
        q: &[f32],
        d: usize,
        rows: &[f32],
        stride: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let nb = q.len() / d.max(1);
        let whole = d / 16 * 16;
        let sv = _mm512_set1_ps(scale);
        let blocks = n / 16;
        for t0 in (0..blocks).map(|b| 16 * b) {
            // (`scaled_dots` checked, without overflow, that `rows` holds
            // `(n - 1) * stride + d` floats, so this neither wraps nor panics.)
            let keys = &rows[t0 * stride..][..15 * stride + d];
            let kp = keys.as_ptr();
            for j in 0..nb {
                let qj = &q[j * d..][..d];
                let mut acc = [_mm512_setzero_ps(); 16];
                for c in (0..whole).step_by(16) {
                    let qv = ld16(&qj[c..]);
                    for (u, a) in acc.iter_mut().enumerate() {
                        // SAFETY: `u * stride + c + 16 <= 15 * stride + whole`,
                        // and `keys` holds `15 * stride + d >= ...` floats
                        // (`whole <= d`; the slice above is checked): the 16
                        // floats read lie in `keys`. (Checked loads here made
                        // the scores 1.5-2x slower.)
                        let kv = unsafe { _mm512_loadu_ps(kp.add(u * stride + c)) };
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(qv, kv));
                    }
                }
                // `dot` adds the tail (+0 for whole chunks) after its fold.
                let mut tails = [0.0f32; 16];
                if whole < d {
                    for (u, t) in tails.iter_mut().enumerate() {
                        *t =
                            super::tail_dot(&qj[whole..], &keys[u * stride + whole..][..d - whole]);
                    }
                }
                let r = _mm512_add_ps(fold16x16(&acc), ld16(&tails));
                st16(&mut out[j * n + t0..], _mm512_mul_ps(r, sv));
            }
        }
        scaled_dots_each_avx512(q, d, rows, stride, 16 * blocks, n, scale, out);
    }

    /// [`fold16`] of sixteen registers at once: lane `u` of the result is
    /// register `u`'s lanes folded in [`super::dot`]'s order (lanes `i` and
    /// `i + 8`, then `i + 4`, `i + 2` and `i + 1`), the same adds on the same
    /// values, done for all sixteen by shuffling them together level by level.
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn fold16x16(acc: &[__m512; 16]) -> __m512 {
        // Width 8: registers 2m and 2m + 1 into one, lanes 0-7 the first's
        // `i + (i + 8)`, lanes 8-15 the second's.
        let mut l1 = [_mm512_setzero_ps(); 8];
        for (m, l) in l1.iter_mut().enumerate() {
            let (a, b) = (acc[2 * m], acc[2 * m + 1]);
            *l = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            );
        }
        // Width 4: quarter j of register p is register 4p + j's `i + (i + 4)`.
        let mut l2 = [_mm512_setzero_ps(); 4];
        for (p, l) in l2.iter_mut().enumerate() {
            let (x, y) = (l1[2 * p], l1[2 * p + 1]);
            *l = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            );
        }
        // Width 2: quarter j of register r holds registers 8r + j's and
        // 8r + 4 + j's `i + (i + 2)`, two lanes each.
        let mut l3 = [_mm512_setzero_ps(); 2];
        for (r, l) in l3.iter_mut().enumerate() {
            let (x, y) = (l2[2 * r], l2[2 * r + 1]);
            *l = _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
            );
        }
        // Width 1: lane 4j + m is register 4m + j's fold.
        let (x, y) = (l3[0], l3[1]);
        let folded = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(x, y),
            _mm512_shuffle_ps::<0b11_01_11_01>(x, y),
        );
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, folded)
    }

    /// `C` vectors of `o` (`C * W` floats from `at`) held in registers while
    /// every position's weighted value is added, in position order: each
    /// element's sum is the reference's. Returns `C`.
    macro_rules! sums_block {
        ($name:ident, $features:literal, $vec:ty, $w:literal, $ld:ident, $st:ident, $set1:ident, $add:ident, $mul:ident) => {
            #[inline]
            #[target_feature(enable = $features)]
            fn $name<const C: usize>(
                w: &[f32],
                rows: &[f32],
                stride: usize,
                n: usize,
                oh: &mut [f32],
                at: usize,
            ) -> usize {
                let mut acc: [$vec; C] = core::array::from_fn(|c| $ld(&oh[at + $w * c..]));
                for (t, &s) in w[..n].iter().enumerate() {
                    let v = &rows[t * stride + at..][..C * $w];
                    let sv = $set1(s);
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a = $add(*a, $mul(sv, $ld(&v[$w * c..])));
                    }
                }
                for (c, a) in acc.into_iter().enumerate() {
                    $st(&mut oh[at + $w * c..], a);
                }
                C
            }
        };
    }
    sums_block!(
        sums_block_avx512,
        "avx512f,avx2",
        __m512,
        16,
        ld16,
        st16,
        _mm512_set1_ps,
        _mm512_add_ps,
        _mm512_mul_ps
    );
    sums_block!(
        sums_block_avx2,
        "avx2",
        __m256,
        8,
        ld8,
        st8,
        _mm256_set1_ps,
        _mm256_add_ps,
        _mm256_mul_ps
    );

    macro_rules! weighted_rows_with {
        ($name:ident, $features:literal, $block:ident, $w:literal) => {
            /// The positions in tiles of [`SUMS_TILE`](super::SUMS_TILE); in
            /// each, every head's output in blocks of up to 8 vectors held in
            /// registers over the tile's positions (the tail element by
            /// element), so a tile's values are read from memory once and
            /// from L1 for the other heads. Positions stay in order for each
            /// element.
            #[target_feature(enable = $features)]
            pub(super) fn $name(
                w: &[f32],
                ws: usize,
                n: usize,
                rows: &[f32],
                stride: usize,
                d: usize,
                o: &mut [f32],
            ) {
                for t0 in (0..n).step_by(super::SUMS_TILE) {
                    let tn = super::SUMS_TILE.min(n - t0);
                    let tile = &rows[t0 * stride..];
                    for (j, oh) in o.chunks_exact_mut(d.max(1)).enumerate() {
                        let wj = &w[j * ws + t0..][..tn];
                        let mut at = 0;
                        while at + $w <= d {
                            let vectors = match (d - at) / $w {
                                8.. => $block::<8>(wj, tile, stride, tn, oh, at),
                                4.. => $block::<4>(wj, tile, stride, tn, oh, at),
                                _ => $block::<1>(wj, tile, stride, tn, oh, at),
                            };
                            at += vectors * $w;
                        }
                        for (t, &s) in wj.iter().enumerate() {
                            let v = &tile[t * stride..][..d];
                            for (x, vv) in oh[at..].iter_mut().zip(&v[at..]) {
                                *x += s * vv;
                            }
                        }
                    }
                }
            }
        };
    }
    weighted_rows_with!(weighted_rows_avx2, "avx2", sums_block_avx2, 8);

    /// [`sums_block_avx512`] for two outputs at once, `j` and `j + 1` (each
    /// `d` floats in `o`, their weights `ws` apart in `w`): each value vector
    /// is loaded once for both, and the two outputs' sums are independent
    /// chains, twice as many in flight. Each element's sum is the
    /// reference's, as from `sums_block_avx512`. Returns `C`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn sums_pair_avx512<const C: usize>(
        w: &[f32],
        ws: usize,
        rows: &[f32],
        stride: usize,
        n: usize,
        o: &mut [f32],
        d: usize,
        at: usize,
    ) -> usize {
        let (w0, w1) = (&w[..n], &w[ws..][..n]);
        let mut a0 = [_mm512_setzero_ps(); C];
        let mut a1 = [_mm512_setzero_ps(); C];
        for c in 0..C {
            a0[c] = ld16(&o[at + 16 * c..]);
            a1[c] = ld16(&o[d + at + 16 * c..]);
        }
        for t in 0..n {
            let v = &rows[t * stride + at..][..C * 16];
            let (s0, s1) = (_mm512_set1_ps(w0[t]), _mm512_set1_ps(w1[t]));
            for c in 0..C {
                let vv = ld16(&v[16 * c..]);
                a0[c] = _mm512_add_ps(a0[c], _mm512_mul_ps(s0, vv));
                a1[c] = _mm512_add_ps(a1[c], _mm512_mul_ps(s1, vv));
            }
        }
        for c in 0..C {
            st16(&mut o[at + 16 * c..], a0[c]);
            st16(&mut o[d + at + 16 * c..], a1[c]);
        }
        C
    }

    /// [`super::weighted_rows_strided`] with AVX-512: as [`weighted_rows_avx2`]
    /// does it (tiles of positions, each output's vectors in registers over a
    /// tile), the outputs two at a time ([`sums_pair_avx512`]), an odd last
    /// one alone. Positions stay in order for each element.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) fn weighted_rows_avx512(
        w: &[f32],
        ws: usize,
        n: usize,
        rows: &[f32],
        stride: usize,
        d: usize,
        o: &mut [f32],
    ) {
        let d1 = d.max(1);
        let nb = o.len() / d1;
        for t0 in (0..n).step_by(super::SUMS_TILE) {
            let tn = super::SUMS_TILE.min(n - t0);
            let tile = &rows[t0 * stride..];
            let mut j = 0;
            while j < nb {
                let pair = j + 1 < nb;
                let wj = &w[j * ws + t0..];
                let oh = &mut o[j * d1..][..if pair { 2 * d1 } else { d1 }];
                let mut at = 0;
                while at + 16 <= d {
                    let vectors = match ((d - at) / 16, pair) {
                        (8.., true) => sums_pair_avx512::<8>(wj, ws, tile, stride, tn, oh, d, at),
                        (4.., true) => sums_pair_avx512::<4>(wj, ws, tile, stride, tn, oh, d, at),
                        (_, true) => sums_pair_avx512::<1>(wj, ws, tile, stride, tn, oh, d, at),
                        (8.., false) => sums_block_avx512::<8>(&wj[..tn], tile, stride, tn, oh, at),
                        (4.., false) => sums_block_avx512::<4>(&wj[..tn], tile, stride, tn, oh, at),
                        (_, false) => sums_block_avx512::<1>(&wj[..tn], tile, stride, tn, oh, at),
                    };
                    at += vectors * 16;
                }
                for (r, oh) in oh.chunks_exact_mut(d1).enumerate() {
                    for (t, &s) in w[(j + r) * ws + t0..][..tn].iter().enumerate() {
                        let v = &tile[t * stride..][..d];
                        for (x, vv) in oh[at..].iter_mut().zip(&v[at..]) {
                            *x += s * vv;
                        }
                    }
                }
                j += if pair { 2 } else { 1 };
            }
        }
    }
}

#[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
mod neon {
    //! NEON is part of the target (`target_feature = "neon"`), so the
    //! `#[target_feature]` functions need no run-time check; every load and
    //! store covers a sub-slice of exactly its width.
    use core::arch::aarch64::*;

    use super::{dot_tail_split, tail_dot};

    #[inline]
    #[target_feature(enable = "neon")]
    fn ld4(s: &[f32]) -> float32x4_t {
        let s = &s[..4];
        // SAFETY: `s` holds exactly the 4 floats read.
        unsafe { vld1q_f32(s.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "neon")]
    fn st4(s: &mut [f32], v: float32x4_t) {
        let s = &mut s[..4];
        // SAFETY: `s` holds exactly the 4 floats written.
        unsafe { vst1q_f32(s.as_mut_ptr(), v) }
    }

    /// [`super::widen_f16`] four values at a time, by moving the exponent
    /// and mantissa fields (exact for zeros and normal numbers); a group with
    /// a subnormal, infinite or NaN value is converted by the scalar code.
    #[target_feature(enable = "neon")]
    pub(super) fn widen_f16(src: &[u16], dst: &mut [f32]) {
        let whole = src.len().min(dst.len()) / 4 * 4;
        for c in (0..whole).step_by(4) {
            let h = &src[c..c + 4];
            // SAFETY: `h` holds exactly the 4 values read.
            let h = vmovl_u16(unsafe { vld1_u16(h.as_ptr()) });
            let abs = vandq_u32(h, vdupq_n_u32(0x7fff));
            let exp = vshrq_n_u32::<10>(abs);
            let zero = vceqq_u32(abs, vdupq_n_u32(0));
            let subnormal = vbicq_u32(vceqq_u32(exp, vdupq_n_u32(0)), zero);
            let special = vorrq_u32(subnormal, vceqq_u32(exp, vdupq_n_u32(31)));
            if vmaxvq_u32(special) != 0 {
                super::widen_f16_scalar(&src[c..c + 4], &mut dst[c..c + 4]);
                continue;
            }
            let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
            let mag = vaddq_u32(vshlq_n_u32::<13>(abs), vdupq_n_u32((127 - 15) << 23));
            let mag = vbicq_u32(mag, zero);
            st4(&mut dst[c..], vreinterpretq_f32_u32(vorrq_u32(sign, mag)));
        }
        super::widen_f16_scalar(&src[whole..], &mut dst[whole..]);
    }

    /// [`super::dot`] with the sixteen sums in four registers (lanes 0-3, 4-7,
    /// 8-11, 12-15), folded in its order.
    #[inline]
    #[target_feature(enable = "neon")]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let (whole, ta, tb) = dot_tail_split(a, b);
        let z = vdupq_n_f32(0.0);
        let mut acc = [z; 4];
        for c in (0..whole).step_by(16) {
            for (r, acc) in acc.iter_mut().enumerate() {
                let p = vmulq_f32(ld4(&a[c + 4 * r..]), ld4(&b[c + 4 * r..]));
                *acc = vaddq_f32(*acc, p);
            }
        }
        let s4 = vaddq_f32(vaddq_f32(acc[0], acc[2]), vaddq_f32(acc[1], acc[3]));
        let s2 = vaddq_f32(s4, vextq_f32::<2>(s4, s4));
        let s1 = vgetq_lane_f32::<0>(s2) + vgetq_lane_f32::<1>(s2);
        s1 + tail_dot(ta, tb)
    }

    /// [`super::exp`] of four lanes, step for step.
    #[inline]
    #[target_feature(enable = "neon")]
    fn exp4(x: float32x4_t) -> float32x4_t {
        use super::{EXP_MAX, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2E, ROUND};
        let nan = vmvnq_u32(vceqq_f32(x, x));
        let low = vcltq_f32(x, vdupq_n_f32(EXP_MIN));
        let xc = vbslq_f32(vcgtq_f32(x, vdupq_n_f32(EXP_MAX)), vdupq_n_f32(EXP_MAX), x);
        let round = vdupq_n_f32(ROUND);
        let n = vsubq_f32(vaddq_f32(vmulq_f32(xc, vdupq_n_f32(LOG2E)), round), round);
        let r = vsubq_f32(xc, vmulq_f32(n, vdupq_n_f32(LN2_HI)));
        let r = vsubq_f32(r, vmulq_f32(n, vdupq_n_f32(LN2_LO)));
        let mut y = vdupq_n_f32(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            y = vaddq_f32(vmulq_f32(y, r), vdupq_n_f32(c));
        }
        let y = vmulq_f32(y, vmulq_f32(r, r));
        let y = vaddq_f32(vaddq_f32(y, r), vdupq_n_f32(1.0));
        let e = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
        let y = vmulq_f32(y, vreinterpretq_f32_s32(vshlq_n_s32::<23>(e)));
        let y = vbslq_f32(low, vdupq_n_f32(0.0), y);
        vbslq_f32(nan, x, y)
    }

    /// `g / (1 + exp(-g))` of four lanes, [`super::silu_tail`]'s steps.
    #[inline]
    #[target_feature(enable = "neon")]
    fn silu4(g: float32x4_t) -> float32x4_t {
        let e = exp4(vnegq_f32(g));
        vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.0), e))
    }

    /// [`super::swiglu`], four lanes at a time.
    #[target_feature(enable = "neon")]
    pub(super) fn swiglu(x: &mut [f32], y: &[f32]) {
        let whole = x.len() / 4 * 4;
        for c in (0..whole).step_by(4) {
            let s = silu4(ld4(&x[c..]));
            st4(&mut x[c..], vmulq_f32(s, ld4(&y[c..])));
        }
        super::swiglu_tail(&mut x[whole..], &y[whole..]);
    }

    /// [`super::silu`], four lanes at a time.
    #[target_feature(enable = "neon")]
    pub(super) fn silu(x: &mut [f32]) {
        let whole = x.len() / 4 * 4;
        for c in (0..whole).step_by(4) {
            let s = silu4(ld4(&x[c..]));
            st4(&mut x[c..], s);
        }
        super::silu_tail(&mut x[whole..]);
    }

    /// [`super::exp_sum`] with the eight `f64` sums in four registers.
    #[target_feature(enable = "neon")]
    pub(super) fn exp_sum(x: &mut [f32], max: f32) -> f64 {
        let whole = x.len() / 8 * 8;
        let m = vdupq_n_f32(max);
        let z = vdupq_n_f64(0.0);
        let mut acc = [z; 4];
        for c in (0..whole).step_by(8) {
            for h in 0..2 {
                let e = exp4(vsubq_f32(ld4(&x[c + 4 * h..]), m));
                st4(&mut x[c + 4 * h..], e);
                acc[2 * h] = vaddq_f64(acc[2 * h], vcvt_f64_f32(vget_low_f32(e)));
                acc[2 * h + 1] = vaddq_f64(acc[2 * h + 1], vcvt_high_f64_f32(e));
            }
        }
        let tail = super::exp_tail(&mut x[whole..], max);
        // Lanes i and i + 4 (registers r and r + 2), then i + 2, then i + 1.
        let s2 = vaddq_f64(vaddq_f64(acc[0], acc[2]), vaddq_f64(acc[1], acc[3]));
        (vgetq_lane_f64::<0>(s2) + vgetq_lane_f64::<1>(s2)) + tail
    }

    /// [`super::scaled_dots_by_key`]: four queries by sixteen keys in
    /// sixteen registers (then one query, then four keys), each lane one
    /// score's sum in order; the last `n % 4` keys one at a time.
    #[target_feature(enable = "neon")]
    pub(super) fn dots_by_key(
        q: &[f32],
        d: usize,
        kt: &[f32],
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let nq = q.len().checked_div(d).unwrap_or(0);
        let mut t = 0;
        while t + 4 <= n {
            let vecs = ((n - t) / 4).min(4);
            let mut j = 0;
            while j < nq {
                let group = if nq - j >= 4 { 4 } else { 1 };
                let mut acc = [[vdupq_n_f32(0.0); 4]; 4];
                for i in 0..d {
                    let row = &kt[i * n + t..];
                    let mut k = [vdupq_n_f32(0.0); 4];
                    for (v, kv) in k.iter_mut().enumerate().take(vecs) {
                        *kv = ld4(&row[4 * v..]);
                    }
                    for (g, a) in acc.iter_mut().enumerate().take(group) {
                        let qv = vdupq_n_f32(q[(j + g) * d + i]);
                        for v in 0..vecs {
                            a[v] = vaddq_f32(a[v], vmulq_f32(qv, k[v]));
                        }
                    }
                }
                for (g, a) in acc.iter().enumerate().take(group) {
                    let o = &mut out[(j + g) * n + t..];
                    for (v, av) in a.iter().enumerate().take(vecs) {
                        st4(&mut o[4 * v..], vmulq_n_f32(*av, scale));
                    }
                }
                j += group;
            }
            t += 4 * vecs;
        }
        super::dots_by_key_from(q, d, kt, n, t, scale, out);
    }

    #[target_feature(enable = "neon")]
    pub(super) fn scaled_dots(
        q: &[f32],
        d: usize,
        rows: &[f32],
        stride: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let nb = q.len() / d.max(1);
        for t in 0..n {
            let k = &rows[t * stride..][..d];
            for j in 0..nb {
                out[j * n + t] = dot(&q[j * d..][..d], k) * scale;
            }
        }
    }

    #[target_feature(enable = "neon")]
    pub(super) fn weighted_rows(
        w: &[f32],
        ws: usize,
        n: usize,
        rows: &[f32],
        stride: usize,
        d: usize,
        o: &mut [f32],
    ) {
        let whole = d / 4 * 4;
        for t in 0..n {
            let v = &rows[t * stride..][..d];
            for (j, oh) in o.chunks_exact_mut(d.max(1)).enumerate() {
                let s = w[j * ws + t];
                let sv = vdupq_n_f32(s);
                for c in (0..whole).step_by(4) {
                    let x = vaddq_f32(ld4(&oh[c..]), vmulq_f32(sv, ld4(&v[c..])));
                    st4(&mut oh[c..], x);
                }
                for (x, vv) in oh[whole..].iter_mut().zip(&v[whole..]) {
                    *x += s * vv;
                }
            }
        }
    }
}

/// The length of the whole 16-element chunks of `a` and `b` (as long as the
/// shorter), and the elements after them.
#[cfg(any(
    target_arch = "x86_64",
    all(target_arch = "aarch64", target_feature = "neon")
))]
#[inline(always)]
fn dot_tail_split<'a>(a: &'a [f32], b: &'a [f32]) -> (usize, &'a [f32], &'a [f32]) {
    let n = a.len().min(b.len());
    let whole = n / LANES * LANES;
    (whole, &a[whole..n], &b[whole..n])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec;
    use std::vec::Vec;

    fn rng(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// A sink takes its share of the mass: the weights sum to `1 - p(sink)`
    /// and keep their ratios; `None` is the plain softmax bit for bit, and a
    /// sink above every score is the max (no overflow).
    #[test]
    fn softmax_with_sink_adds_a_valueless_logit() {
        let x0 = [0.5f32, 1.5, -2.0, 0.0, 3.0, 1.0, -1.0, 2.0, 0.25, 4.0];
        for isa in Isa::available() {
            let mut plain = x0;
            softmax(isa, &mut plain);
            let mut none = x0;
            softmax_with_sink(isa, &mut none, None);
            assert_eq!(plain.map(f32::to_bits), none.map(f32::to_bits));
            for sink in [-1.0f32, 2.0, 90.0] {
                let mut x = x0;
                softmax_with_sink(isa, &mut x, Some(sink));
                let mx = 4.0f64.max(sink as f64);
                let z: f64 = x0.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>()
                    + (sink as f64 - mx).exp();
                for (g, &v) in x.iter().zip(&x0) {
                    let want = (v as f64 - mx).exp() / z;
                    assert!(
                        (*g as f64 - want).abs() < 1e-6,
                        "{isa:?} {sink}: {g} {want}"
                    );
                }
            }
        }
    }

    /// Every `f16` value widens to the scalar conversion's bits on every ISA,
    /// at every offset into a SIMD group (and through the tails).
    #[test]
    fn widen_f16_is_exact_on_every_isa() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut want = vec![0f32; all.len()];
        widen_f16(Isa::Scalar, &all, &mut want);
        for (&h, w) in all.iter().zip(&want) {
            let x = crate::quant::f16_to_f32(h);
            assert!(x.to_bits() == w.to_bits());
            if !x.is_nan() {
                assert_eq!(crate::quant::f32_to_f16(x), h);
            }
        }
        for isa in Isa::available() {
            for skew in 0..9 {
                let mut got = vec![0f32; all.len() - skew];
                widen_f16(isa, &all[skew..], &mut got);
                for (i, (g, w)) in got.iter().zip(&want[skew..]).enumerate() {
                    assert!(g.to_bits() == w.to_bits(), "{isa:?} {:#06x}", i + skew);
                }
            }
        }
    }

    /// [`scaled_dots_by_key`] gives the scalar order's bits on every ISA,
    /// for query counts and key counts around every SIMD group and tile
    /// edge (keys past the last whole group, one query after groups of four),
    /// and the dot products within rounding of an `f64` sum.
    #[test]
    fn scaled_dots_by_key_is_exact_on_every_isa() {
        let mut seed = 11;
        for (nq, d, n) in [
            (1, 1, 1),
            (3, 5, 7),
            (4, 16, 8),
            (5, 64, 16),
            (16, 64, 37),
            (9, 72, 24),
            (4, 3, 40),
            (2, 8, 3),
        ] {
            let q: Vec<f32> = (0..nq * d).map(|_| rng(&mut seed)).collect();
            let kt: Vec<f32> = (0..d * n).map(|_| rng(&mut seed)).collect();
            let mut want = vec![f32::NAN; nq * n];
            scaled_dots_by_key(Isa::Scalar, &q, d, &kt, n, 0.125, &mut want);
            for j in 0..nq {
                for t in 0..n {
                    let exact: f64 = (0..d)
                        .map(|i| q[j * d + i] as f64 * kt[i * n + t] as f64)
                        .sum::<f64>()
                        * 0.125;
                    let w = want[j * n + t] as f64;
                    assert!((w - exact).abs() < 1e-5, "{nq} {d} {n}: {w} {exact}");
                }
            }
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; nq * n];
                scaled_dots_by_key(isa, &q, d, &kt, n, 0.125, &mut got);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{isa:?}: {nq} queries of {d} by {n} keys"
                );
            }
        }
        // Too short a key table is refused, not read past.
        for isa in Isa::available() {
            let r = std::panic::catch_unwind(|| {
                let mut out = vec![0f32; 16];
                scaled_dots_by_key(isa, &[0.0; 4], 4, &[0.0; 15], 4, 1.0, &mut out);
            });
            assert!(r.is_err(), "{isa:?}");
        }
    }

    /// Lengths whose bound overflows `usize` are refused on every ISA (the
    /// AVX-512 kernel read out of bounds when the check wrapped).
    #[test]
    fn overflowing_strides_are_refused() {
        extern crate std;
        // `15 * stride` wraps to 14: a wrapping check passed with 30 rows.
        let stride = usize::MAX / 15 + 1;
        let (n, d) = (16, 16);
        let rows = vec![0f32; 30];
        let q = vec![0f32; d];
        for isa in Isa::available() {
            let r = std::panic::catch_unwind(|| {
                let mut out = vec![0f32; n];
                let keys = Strided {
                    data: &rows,
                    stride,
                    n,
                    d,
                };
                scaled_dots(isa, &q, keys, 1.0, &mut out);
            });
            assert!(r.is_err(), "{isa:?}: scaled_dots accepted the rows");
            let r = std::panic::catch_unwind(|| {
                let mut o = vec![0f32; d];
                let values = Strided {
                    data: &rows,
                    stride,
                    n,
                    d,
                };
                weighted_rows(isa, &vec![0f32; n], values, &mut o);
            });
            assert!(r.is_err(), "{isa:?}: weighted_rows accepted the rows");
        }
        assert!(!fits(30, 16, stride, 16));
        assert!(fits(30, 0, stride, 16) && fits(31, 2, 15, 16) && !fits(30, 2, 15, 16));
    }

    /// Every ISA's scores and weighted sums are the reference's bits, for
    /// vector lengths around the SIMD widths and several heads.
    #[test]
    fn every_isa_gives_the_reference_bits() {
        let mut seed = 5;
        for d in [1, 3, 4, 8, 15, 16, 17, 31, 64, 100, 128, 129] {
            for (nb, n) in [(1, 1), (3, 7), (8, 33), (5, 150)] {
                let stride = d + 3;
                let q: Vec<f32> = (0..nb * d).map(|_| rng(&mut seed)).collect();
                let rows: Vec<f32> = (0..n * stride).map(|_| rng(&mut seed) * 4.0).collect();
                let w: Vec<f32> = (0..nb * n).map(|_| rng(&mut seed)).collect();
                let o0: Vec<f32> = (0..nb * d).map(|_| rng(&mut seed)).collect();
                let (mut want_s, mut want_o) = (vec![0f32; nb * n], o0.clone());
                let r = Strided {
                    data: &rows,
                    stride,
                    n,
                    d,
                };
                scaled_dots(Isa::Scalar, &q, r, 0.125, &mut want_s);
                weighted_rows(Isa::Scalar, &w, r, &mut want_o);
                for isa in Isa::available() {
                    let (mut s, mut o) = (vec![0f32; nb * n], o0.clone());
                    scaled_dots(isa, &q, r, 0.125, &mut s);
                    weighted_rows(isa, &w, r, &mut o);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&s), bits(&want_s), "{isa} scores d={d} nb={nb} n={n}");
                    assert_eq!(bits(&o), bits(&want_o), "{isa} sums d={d} nb={nb} n={n}");
                    // The weights `ws` apart, the positions in two runs (two
                    // calls): the same bits.
                    let ws = n + 5;
                    let mut wide = vec![f32::NAN; nb * ws];
                    for j in 0..nb {
                        wide[j * ws..][..n].copy_from_slice(&w[j * n..][..n]);
                    }
                    let cut = n / 3;
                    let mut o = o0.clone();
                    let part = |from: usize, to: usize| Strided {
                        data: &rows[from * stride..],
                        n: to - from,
                        ..r
                    };
                    weighted_rows_strided(isa, &wide, ws, part(0, cut), &mut o);
                    weighted_rows_strided(isa, &wide[cut..], ws, part(cut, n), &mut o);
                    assert_eq!(
                        bits(&o),
                        bits(&want_o),
                        "{isa} split sums d={d} nb={nb} n={n}"
                    );
                }
            }
        }
    }

    /// `exp` is within 2 ulp of `f64` `exp` over softmax's range, and every
    /// ISA's softmax gives the reference's bits.
    #[test]
    fn exp_is_accurate_and_softmax_the_same_on_every_isa() {
        let mut worst = 0u32;
        let mut x = -87.3f32;
        while x <= 10.0 {
            let got = exp(x);
            let want = libm::exp(x as f64) as f32;
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
            x += 0.0137;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        let mut seed = 9;
        for n in [1, 5, 8, 9, 16, 37, 300] {
            let row: Vec<f32> = (0..n).map(|_| rng(&mut seed) * 30.0).collect();
            let mut want = row.clone();
            softmax(Isa::Scalar, &mut want);
            let total: f64 = want.iter().map(|&v| v as f64).sum();
            assert!((total - 1.0).abs() < 1e-5, "{total}");
            for isa in Isa::available() {
                let mut got = row.clone();
                softmax(isa, &mut got);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa} softmax of {n}");
            }
            let mut nan = row.clone();
            nan[n / 2] = f32::NAN;
            for isa in Isa::available() {
                let mut got = nan.clone();
                softmax(isa, &mut got);
                assert!(got[n / 2].is_nan(), "{isa}: NaN stays NaN");
            }
        }
    }

    /// `exp` stays within 2 ulp over SwiGLU's whole range, and every ISA's
    /// SwiGLU and SiLU give the reference's bits, NaN and the extremes included.
    #[test]
    fn swiglu_and_silu_are_the_same_on_every_isa() {
        let mut worst = 0u32;
        let mut x = -87.3f32;
        while x <= 88.0 {
            let want = libm::exp(x as f64) as f32;
            worst = worst.max(exp(x).to_bits().abs_diff(want.to_bits()));
            x += 0.0173;
        }
        assert!(worst <= 2, "{worst} ulp");
        let mut seed = 13;
        for n in [1, 7, 8, 9, 16, 37, 300] {
            let mut gate: Vec<f32> = (0..n).map(|_| rng(&mut seed) * 12.0).collect();
            let up: Vec<f32> = (0..n).map(|_| rng(&mut seed) * 3.0).collect();
            if n > 8 {
                gate[1] = f32::NAN;
                gate[2] = 100.0;
                gate[3] = -100.0;
                gate[4] = f32::INFINITY;
                gate[5] = -0.0;
            }
            let mut want = gate.clone();
            swiglu(Isa::Scalar, &mut want, &up);
            for (i, (w, (g, u))) in want.iter().zip(gate.iter().zip(&up)).enumerate() {
                // Close to silu(g) u in f64; below -88, where `exp` stops at
                // e^88, within 1e-30 of it (of 0).
                let exact = (*g as f64) / (1.0 + (-(*g as f64)).exp()) * (*u as f64);
                if g.is_nan() || g.is_infinite() {
                    continue;
                }
                assert!(
                    (*w as f64 - exact).abs() <= 1e-6 * exact.abs() + 1e-30,
                    "{i}: {g} {u}: {w} against {exact}"
                );
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            // SiLU is SwiGLU's gate (times 1, exactly).
            let mut silu_want = gate.clone();
            swiglu(Isa::Scalar, &mut silu_want, &vec![1.0; n]);
            for isa in Isa::available() {
                let mut got = gate.clone();
                swiglu(isa, &mut got, &up);
                assert_eq!(bits(&got), bits(&want), "{isa} swiglu of {n}");
                let mut got = gate.clone();
                silu(isa, &mut got);
                assert_eq!(bits(&got), bits(&silu_want), "{isa} silu of {n}");
            }
        }
    }

    /// The one-pass delta rule equals the four passes over the whole state,
    /// bit for bit, on every ISA.
    #[test]
    fn delta_rule_equals_its_four_passes() {
        let mut seed = 11;
        for d in [16, 40, 64, 128] {
            let m0: Vec<f32> = (0..d * d).map(|_| rng(&mut seed)).collect();
            let [k, q, v]: [Vec<f32>; 3] =
                core::array::from_fn(|_| (0..d).map(|_| rng(&mut seed)).collect());
            let (decay, beta, scale) = (0.93, 0.61, 0.088);
            let mut want = m0.clone();
            for x in want.iter_mut() {
                *x *= decay;
            }
            let u: Vec<f32> = (0..d)
                .map(|j| (v[j] - dot(&want[j * d..][..d], &k)) * beta)
                .collect();
            for (row, u) in want.chunks_exact_mut(d).zip(&u) {
                for (x, kk) in row.iter_mut().zip(&k) {
                    *x += kk * u;
                }
            }
            let want_out: Vec<f32> = (0..d)
                .map(|j| dot(&want[j * d..][..d], &q) * scale)
                .collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for isa in Isa::available() {
                let (mut m, mut out) = (m0.clone(), vec![0f32; d]);
                delta_rule(isa, &mut m, &k, &q, &v, decay, beta, scale, &mut out);
                assert_eq!(bits(&m), bits(&want), "{isa} state d={d}");
                assert_eq!(bits(&out), bits(&want_out), "{isa} output d={d}");
            }
        }
    }

    #[test]
    fn dot_of_every_length_is_accurate() {
        let a: [f32; 67] = core::array::from_fn(|i| ((i * 29 % 31) as f32 - 15.0) / 8.0);
        let b: [f32; 67] = core::array::from_fn(|i| ((i * 17 % 13) as f32 - 6.0) / 3.0);
        for n in 0..=67 {
            let want: f64 = (0..n).map(|i| a[i] as f64 * b[i] as f64).sum();
            let got = dot(&a[..n], &b[..n]) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "n={n}: {got} vs {want}"
            );
        }
        assert_eq!(dot(&a[..5], &b[..3]), dot(&a[..3], &b[..3]));
    }

    /// The reference is the plain fixed order: sixteen sums, folded by halves.
    #[test]
    fn dot_follows_its_documented_order() {
        let a: Vec<f32> = (0..35).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let b: Vec<f32> = (0..35).map(|i| 1.0 - i as f32 * 7e-4).collect();
        let mut s = [0f32; 16];
        for i in 0..32 {
            s[i % 16] += a[i] * b[i];
        }
        for w in [8, 4, 2, 1] {
            for i in 0..w {
                s[i] += s[i + w];
            }
        }
        let mut tail = 0f32;
        for i in 32..35 {
            tail += a[i] * b[i];
        }
        assert_eq!(dot(&a, &b).to_bits(), (s[0] + tail).to_bits());
    }
}
