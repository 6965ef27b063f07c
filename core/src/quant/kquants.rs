//! K-quant super-blocks (`Q2_K` .. `Q6_K`, 256 elements each) and the `Q8_K`
//! activation format.
//!
//! Dequantization is bit-identical to the `gguf` Python package and to ggml's
//! `dequantize_row_*`: the sub-block factors `d * sc` and `dmin * m` are rounded to
//! f32 first, then each value is `(d * sc) * q - (dmin * m)`, with no fused
//! multiply-add.
//!
//! The quantizers reproduce ggml's reference quantizers (`quantize_row_*_ref`)
//! operation for operation, including its `nearest_int` float trick, so their bytes
//! equal ggml's wherever the C compiler keeps `a * b + c` unfused (x86-64 builds
//! without FMA; an aarch64 build that contracts to FMA can differ in rare ties).

use libm::sqrtf;

use super::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use super::kscales::{scale_min_k4, scales_q3k};
use super::{f16_to_f32, f32_to_f16, QK_K};

/// ggml's `GROUP_MAX_EPS`: groups whose largest magnitude is below it count as zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// `|x|`, by clearing the sign bit.
#[inline]
fn abs(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0x7fff_ffff)
}

#[inline]
fn h2f(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

#[inline]
fn f2h(x: f32) -> [u8; 2] {
    f32_to_f16(x).to_le_bytes()
}

#[track_caller]
fn check_len(what: &str, blocks: usize, values: usize, values_name: &str) {
    assert!(
        blocks.checked_mul(QK_K) == Some(values),
        "{what}: {values_name}.len() ({values}) must be 256 * the number of blocks ({blocks})"
    );
}

/// ggml's `nearest_int`: adds 1.5 * 2^23 so the FPU rounds to an integer (half to
/// even) and reads it back from the mantissa bits. Exact for |x| < 2^22; for larger
/// or non-finite values it returns the same garbage as ggml, which the callers clamp.
#[inline]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

// ---------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------

/// Dequantizes `Q2_K` blocks into `out`. Sub-block `j` (16 elements) has scale
/// `scales[j] & 15` and min `scales[j] >> 4`; each 128-element half takes 32 bytes
/// of `qs`, 2-bit field `s` (bits `2s..2s+2`) of byte `l` being element `32s + l`.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_q2k(blocks: &[BlockQ2K], out: &mut [f32]) {
    check_len("dequantize_q2k", blocks.len(), out.len(), "out");
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        let dmin = h2f(b.dmin);
        for (half, (q, yh)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(128))
                .enumerate()
        {
            for (sub, ys) in yh.chunks_exact_mut(16).enumerate() {
                let shift = 2 * (sub / 2);
                let qo = 16 * (sub % 2);
                let sc = b.scales[half * 8 + sub];
                let dl = d * (sc & 0x0f) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for (v, &qb) in ys.iter_mut().zip(&q[qo..qo + 16]) {
                    *v = dl * ((qb >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

/// Dequantizes `Q3_K` blocks into `out`. The 2-bit low parts are laid out as in
/// `Q2_K`; bit `e / 32` of `hmask[e % 32]` is element `e`'s high bit, and a *clear*
/// bit subtracts 4, so `q` runs -4..=3. Values are `(d * (sc - 32)) * q` with the
/// sixteen 6-bit scales of [`scales_q3k`].
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_q3k(blocks: &[BlockQ3K], out: &mut [f32]) {
    check_len("dequantize_q3k", blocks.len(), out.len(), "out");
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        let scales = scales_q3k(&b.scales);
        for (half, (q, yh)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(128))
                .enumerate()
        {
            for (sub, ys) in yh.chunks_exact_mut(16).enumerate() {
                let s = sub / 2;
                let qo = 16 * (sub % 2);
                let hbit = half * 4 + s;
                let dl = d * scales[half * 8 + sub] as f32;
                for (l, v) in ys.iter_mut().enumerate() {
                    let low = ((q[qo + l] >> (2 * s)) & 3) as i32;
                    let high = (b.hmask[qo + l] >> hbit) & 1;
                    let qv = if high != 0 { low } else { low - 4 };
                    *v = dl * qv as f32;
                }
            }
        }
    }
}

/// Dequantizes `Q4_K` blocks into `out`: `(d * sc) * q - (dmin * m)` per 32-element
/// sub-block, scales and mins from [`scale_min_k4`]; each 64-element chunk uses 32
/// bytes of `qs`, low nibbles first.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_q4k(blocks: &[BlockQ4K], out: &mut [f32]) {
    check_len("dequantize_q4k", blocks.len(), out.len(), "out");
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        let dmin = h2f(b.dmin);
        for (c, (q, yc)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (sc1, m1) = scale_min_k4(2 * c, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let (lo, hi) = yc.split_at_mut(32);
            for ((&qb, l), h) in q.iter().zip(lo).zip(hi) {
                *l = d1 * (qb & 0x0f) as f32 - m1;
                *h = d2 * (qb >> 4) as f32 - m2;
            }
        }
    }
}

/// Dequantizes `Q5_K` blocks into `out`: as [`dequantize_q4k`] with a fifth bit:
/// sub-block `j`'s element `l` adds 16 when bit `j` of `qh[l]` is set.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_q5k(blocks: &[BlockQ5K], out: &mut [f32]) {
    check_len("dequantize_q5k", blocks.len(), out.len(), "out");
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        let dmin = h2f(b.dmin);
        for (c, (q, yc)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (sc1, m1) = scale_min_k4(2 * c, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * c + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let (lo, hi) = yc.split_at_mut(32);
            for (((&qb, &hb), l), h) in q.iter().zip(&b.qh).zip(lo).zip(hi) {
                let h1 = ((hb >> (2 * c)) & 1) << 4;
                let h2 = ((hb >> (2 * c + 1)) & 1) << 4;
                *l = d1 * ((qb & 0x0f) | h1) as f32 - m1;
                *h = d2 * ((qb >> 4) | h2) as f32 - m2;
            }
        }
    }
}

/// Dequantizes `Q6_K` blocks into `out`: `(d * scales[e / 16]) * (q - 32)`. Per
/// 128-element half, `ql` byte `l` (of 64) holds element `l` in its low nibble and
/// `l + 64` in its high nibble; `qh` byte `l` (of 32) holds the top two bits of
/// elements `l`, `l + 32`, `l + 64`, `l + 96`, lowest pair first.
///
/// # Panics
/// If `out.len() != blocks.len() * 256`.
pub fn dequantize_q6k(blocks: &[BlockQ6K], out: &mut [f32]) {
    check_len("dequantize_q6k", blocks.len(), out.len(), "out");
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = h2f(b.d);
        let mut dl = [0f32; 16];
        for (o, &s) in dl.iter_mut().zip(&b.scales) {
            *o = d * s as f32;
        }
        for (half, yh) in y.chunks_exact_mut(128).enumerate() {
            let ql = &b.ql[64 * half..64 * half + 64];
            let qh = &b.qh[32 * half..32 * half + 32];
            let dl = &dl[8 * half..8 * half + 8];
            for (e, v) in yh.iter_mut().enumerate() {
                let quarter = e / 32;
                let l = e % 32;
                let low = if quarter < 2 {
                    ql[e] & 0x0f
                } else {
                    ql[e - 64] >> 4
                };
                let high = (qh[l] >> (2 * quarter)) & 3;
                let q = (low | (high << 4)) as i32 - 32;
                *v = dl[e / 16] * q as f32;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Q8_K activations
// ---------------------------------------------------------------------------

/// Quantizes activations to `Q8_K` exactly as ggml's `quantize_row_q8_K_ref`: per
/// 256 values, the value `max` of largest magnitude maps to -127 (`q = nearest(x *
/// iscale)` with `iscale = -127 / max`, capped at 127), `d = 1 / iscale` is stored as
/// f32, and `bsums[j]` is the sum of quants `16j..16j+16`, which the K-quant dot
/// products use to apply the mins. An all-zero input block gives an all-zero block
/// (ggml leaves its `bsums` unwritten there; here they are zeroed).
///
/// # Panics
/// If `x.len() != out.len() * 256`.
pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    check_len("quantize_q8k", out.len(), x.len(), "x");
    for (xb, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        // ggml keeps the first value of largest magnitude, skipping NaNs. Two passes
        // give the same value: a max over eight independent lanes (vectorizes; the max
        // of magnitudes does not depend on the order), then a search for its first
        // occurrence.
        let mut lanes = [0f32; 8];
        for c in xb.chunks_exact(8) {
            for (m, &v) in lanes.iter_mut().zip(c) {
                let a = abs(v);
                if a > *m {
                    *m = a;
                }
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &a| if a > m { a } else { m });
        if amax == 0.0 {
            y.d = [0; 4];
            y.qs = [0; QK_K];
            y.bsums = [[0; 2]; QK_K / 16];
            continue;
        }
        let max = xb.iter().copied().find(|&v| abs(v) == amax).unwrap_or(amax);
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(xb) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, qs) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            let sum: i32 = qs.iter().map(|&q| q as i32).sum();
            *s = (sum as i16).to_le_bytes();
        }
        y.d = (1.0 / iscale).to_le_bytes();
    }
}

// ---------------------------------------------------------------------------
// Reference weight quantizers
// ---------------------------------------------------------------------------

/// ggml's `make_qkx2_quants` without the `use_mad` option (squared error): fits
/// `x ≈ scale * L - the_min` with `L` in `0..=nmax`, trying `nstep + 1` scales around
/// `nmax / (max - min)` and refitting scale and min by weighted least squares.
/// Writes the levels to `levels` and returns `(scale, the_min)`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    levels: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &w) in x.iter().zip(weights).skip(1) {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
        sum_w += w;
        sum_x += w * v;
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for ((l, &v), &w) in levels.iter_mut().zip(x).zip(weights) {
        let q = nearest_int(iscale * (v - min)).clamp(0, nmax);
        *l = q as u8;
        let diff = scale * q as f32 + min - v;
        best_error += w * (diff * diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((la, &v), &w) in laux.iter_mut().zip(x).zip(weights) {
            let q = nearest_int(iscale * (v - min)).clamp(0, nmax);
            *la = q as u8;
            let qf = q as f32;
            sum_l += w * qf;
            sum_l2 += w * qf * qf;
            sum_xl += w * qf * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for ((&la, &v), &w) in laux.iter().zip(x).zip(weights) {
                let diff = this_scale * la as f32 + this_min - v;
                cur_error += w * (diff * diff);
            }
            if cur_error < best_error {
                levels.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no importance weights (weights
/// `x^2`): symmetric levels `L - nmax` in `-nmax..nmax`, trying 19 scales around
/// `-nmax / max` and keeping the best least-squares fit. Writes `L` (0..2*nmax) to
/// `levels` and returns the scale.
fn make_qx_quants_rmse1(nmax: i32, x: &[f32], levels: &mut [u8]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        let ax = abs(v);
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let mut iscale = -nmaxf / max;
    for (o, &v) in levels.iter_mut().zip(x) {
        *o = (level(iscale, v) + nmax) as u8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmaxf + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in levels.iter_mut().zip(x) {
                *o = (level(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// The scale-and-min part of ggml's `quantize_row_q4_K_ref` and
/// `quantize_row_q5_K_ref` for one super-block `xb`: per 32-element sub-block a
/// weighted fit (`make_qkx2_quants` with levels `0..=nmax`, weights `rms + |x|`,
/// `rmin`, step 0.1, `nstep` steps), the scales and mins quantized to 6 bits
/// against the block maxima and packed as `get_scale_min_k4` reads them, then
/// every value re-quantized with the stored (f16-rounded) factors into
/// `levels`. Returns `(d, dmin, packed scales)`.
fn k4_fit(
    xb: &[f32],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    levels: &mut [u8; QK_K],
) -> ([u8; 2], [u8; 2], [u8; 12]) {
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for (j, (xs, ls)) in xb
        .chunks_exact(32)
        .zip(levels.chunks_exact_mut(32))
        .enumerate()
    {
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = sqrtf(sum_x2 / 32.0);
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + abs(v);
        }
        let (scale, min) = make_qkx2_quants(nmax, xs, &weights, ls, &mut laux, rmin, 0.1, nstep);
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }

    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        // ggml stores nearest_int into a uint8_t (wrapping) before capping at 63.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (f2h(max_scale / 63.0), f2h(max_min / 63.0));

    let d_all = h2f(d);
    let dmin_all = h2f(dmin);
    for (j, (xs, ls)) in xb
        .chunks_exact(32)
        .zip(levels.chunks_exact_mut(32))
        .enumerate()
    {
        let (sc, m) = scale_min_k4(j, &packed);
        let d = d_all * sc as f32;
        if d == 0.0 {
            continue; // ggml keeps the levels of the fit
        }
        let dm = dmin_all * m as f32;
        for (l, &v) in ls.iter_mut().zip(xs) {
            *l = nearest_int((v + dm) / d).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed)
}

/// Quantizes `x` to `Q4_K` with ggml's reference quantizer `quantize_row_q4_K_ref`
/// (no importance matrix): per 32-element sub-block a weighted scale-and-min fit
/// (ggml's `make_qkx2_quants`, weights `rms + |x|`), scales and mins quantized to 6
/// bits against the block maxima, then every value re-quantized with the stored
/// (f16-rounded) factors. Produces the same bytes as ggml.
///
/// # Panics
/// If `x.len() != out.len() * 256`.
pub fn quantize_q4k(x: &[f32], out: &mut [BlockQ4K]) {
    check_len("quantize_q4k", out.len(), x.len(), "x");
    let mut levels = [0u8; QK_K];
    for (xb, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        (y.d, y.dmin, y.scales) = k4_fit(xb, 15, -1.0, 20, &mut levels);
        for (q, ls) in y.qs.chunks_exact_mut(32).zip(levels.chunks_exact(64)) {
            for (i, qb) in q.iter_mut().enumerate() {
                *qb = ls[i] | (ls[i + 32] << 4);
            }
        }
    }
}

/// Quantizes `x` to `Q5_K` with ggml's reference quantizer `quantize_row_q5_K_ref`
/// (no importance matrix): [`quantize_q4k`]'s fit with levels `0..=31` (`rmin`
/// -0.5, 15 steps); per 64 elements, `qs` holds the low four bits of elements
/// `l` and `l + 32` and `qh` bit pair `2c, 2c + 1` their fifth bits. Produces
/// the same bytes as ggml (llama.cpp's `Q4_K_M` types the DeltaNet `attn_qkv`
/// this way).
///
/// # Panics
/// If `x.len() != out.len() * 256`.
pub fn quantize_q5k(x: &[f32], out: &mut [BlockQ5K]) {
    check_len("quantize_q5k", out.len(), x.len(), "x");
    let mut levels = [0u8; QK_K];
    for (xb, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        (y.d, y.dmin, y.scales) = k4_fit(xb, 31, -0.5, 15, &mut levels);
        y.qh = [0; QK_K / 8];
        for (c, (q, ls)) in
            y.qs.chunks_exact_mut(32)
                .zip(levels.chunks_exact(64))
                .enumerate()
        {
            for (i, qb) in q.iter_mut().enumerate() {
                let (l1, l2) = (ls[i], ls[i + 32]);
                y.qh[i] |= ((l1 >> 4) << (2 * c)) | ((l2 >> 4) << (2 * c + 1));
                *qb = (l1 & 0x0f) | ((l2 & 0x0f) << 4);
            }
        }
    }
}

/// Quantizes `x` to `Q6_K` with ggml's reference quantizer `quantize_row_q6_K_ref`
/// (no importance matrix): per 16-element sub-block a symmetric 6-bit fit (weights
/// `x^2`), sub-block scales quantized to i8 against the largest, then every value
/// re-quantized with the stored factors. Produces the same bytes as ggml.
///
/// # Panics
/// If `x.len() != out.len() * 256`.
pub fn quantize_q6k(x: &[f32], out: &mut [BlockQ6K]) {
    check_len("quantize_q6k", out.len(), x.len(), "x");
    let mut levels = [0u8; QK_K];
    for (xb, y) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let mut scales = [0f32; 16];
        let mut max_scale = 0f32;
        let mut max_abs_scale = 0f32;
        for ((xs, ls), s) in xb
            .chunks_exact(16)
            .zip(levels.chunks_exact_mut(16))
            .zip(scales.iter_mut())
        {
            let scale = make_qx_quants_rmse1(32, xs, ls);
            *s = scale;
            let abs_scale = abs(scale);
            if abs_scale > max_abs_scale {
                max_abs_scale = abs_scale;
                max_scale = scale;
            }
        }

        if max_abs_scale < GROUP_MAX_EPS {
            *y = BlockQ6K {
                ql: [0; QK_K / 2],
                qh: [0; QK_K / 4],
                scales: [0; QK_K / 16],
                d: f2h(0.0),
            };
            continue;
        }

        let iscale = -128.0 / max_scale;
        y.d = f2h(1.0 / iscale);
        for (o, &s) in y.scales.iter_mut().zip(&scales) {
            // Stored into an int8_t by ggml: wraps.
            *o = nearest_int(iscale * s).min(127) as i8;
        }

        let d_all = h2f(y.d);
        for ((xs, ls), &sc) in xb
            .chunks_exact(16)
            .zip(levels.chunks_exact_mut(16))
            .zip(&y.scales)
        {
            let d = d_all * sc as f32;
            if d == 0.0 {
                continue; // ggml keeps the levels of the fit
            }
            for (l, &v) in ls.iter_mut().zip(xs) {
                *l = (nearest_int(v / d).clamp(-32, 31) + 32) as u8;
            }
        }

        for (half, ls) in levels.chunks_exact(128).enumerate() {
            let ql = &mut y.ql[64 * half..64 * half + 64];
            let qh = &mut y.qh[32 * half..32 * half + 32];
            for l in 0..32 {
                let (l1, l2, l3, l4) = (ls[l], ls[l + 32], ls[l + 64], ls[l + 96]);
                ql[l] = (l1 & 0x0f) | ((l3 & 0x0f) << 4);
                ql[l + 32] = (l2 & 0x0f) | ((l4 & 0x0f) << 4);
                qh[l] = (l1 >> 4) | ((l2 >> 4) << 2) | ((l3 >> 4) << 4) | ((l4 >> 4) << 6);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f32_to_f16(x).to_le_bytes()
    }

    /// A deterministic byte pattern that touches every bit position.
    fn pattern<const N: usize>(seed: u32) -> [u8; N] {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        core::array::from_fn(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as u8
        })
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-3.5), -4);
        assert_eq!(nearest_int(2.499_999_8), 2);
        assert_eq!(nearest_int(-7.6), -8);
        assert_eq!(nearest_int(4_194_303.0), 4_194_303);
        assert_eq!(nearest_int(-4_194_303.0), -4_194_303);
        // Outside ggml's range it yields ggml's (meaningless) bits, never a panic.
        let _ = nearest_int(f32::NAN);
        let _ = nearest_int(f32::INFINITY);
        let _ = nearest_int(-1e30);
    }

    #[test]
    fn q2k_hand_built_block() {
        let b = BlockQ2K {
            scales: pattern(1),
            qs: pattern(2),
            d: f16b(0.5),
            dmin: f16b(0.125),
        };
        let mut out = [0f32; 256];
        dequantize_q2k(&[b], &mut out);
        for (e, &v) in out.iter().enumerate() {
            // Element e: half e/128, 2-bit field (e%128)/32 of byte 32*half + e%32.
            let byte = b.qs[32 * (e / 128) + e % 32];
            let q = (byte >> (2 * ((e % 128) / 32))) & 3;
            let sc = b.scales[e / 16];
            let want = (0.5 * (sc & 15) as f32) * q as f32 - 0.125 * (sc >> 4) as f32;
            assert_eq!(v.to_bits(), want.to_bits(), "element {e}");
        }
    }

    #[test]
    fn q3k_hand_built_block() {
        let b = BlockQ3K {
            hmask: pattern(3),
            qs: pattern(4),
            scales: pattern(5),
            d: f16b(-0.25),
        };
        let sc = scales_q3k(&b.scales);
        let mut out = [0f32; 256];
        dequantize_q3k(&[b], &mut out);
        for (e, &v) in out.iter().enumerate() {
            let byte = b.qs[32 * (e / 128) + e % 32];
            let low = ((byte >> (2 * ((e % 128) / 32))) & 3) as i32;
            let high = (b.hmask[e % 32] >> (e / 32)) & 1;
            let q = low - if high == 1 { 0 } else { 4 };
            let want = (-0.25 * sc[e / 16] as f32) * q as f32;
            assert_eq!(v.to_bits(), want.to_bits(), "element {e}");
        }
    }

    #[test]
    fn q4k_hand_built_block() {
        let b = BlockQ4K {
            d: f16b(0.75),
            dmin: f16b(0.0625),
            scales: pattern(6),
            qs: pattern(7),
        };
        let mut out = [0f32; 256];
        dequantize_q4k(&[b], &mut out);
        for (e, &v) in out.iter().enumerate() {
            // 64-element chunk: 32 bytes, low nibbles first, then high nibbles.
            let byte = b.qs[32 * (e / 64) + e % 32];
            let q = if e % 64 < 32 { byte & 15 } else { byte >> 4 };
            let (sc, m) = scale_min_k4(e / 32, &b.scales);
            let want = (0.75 * sc as f32) * q as f32 - 0.0625 * m as f32;
            assert_eq!(v.to_bits(), want.to_bits(), "element {e}");
        }
    }

    #[test]
    fn q5k_hand_built_block() {
        let b = BlockQ5K {
            d: f16b(1.5),
            dmin: f16b(-0.5),
            scales: pattern(8),
            qh: pattern(9),
            qs: pattern(10),
        };
        let mut out = [0f32; 256];
        dequantize_q5k(&[b], &mut out);
        for (e, &v) in out.iter().enumerate() {
            let byte = b.qs[32 * (e / 64) + e % 32];
            let low = if e % 64 < 32 { byte & 15 } else { byte >> 4 };
            let high = (b.qh[e % 32] >> (e / 32)) & 1;
            let q = low | (high << 4);
            let (sc, m) = scale_min_k4(e / 32, &b.scales);
            let want = (1.5 * sc as f32) * q as f32 - (-0.5 * m as f32);
            assert_eq!(v.to_bits(), want.to_bits(), "element {e}");
        }
    }

    #[test]
    fn q6k_hand_built_block() {
        let scales: [u8; 16] = pattern(11);
        let b = BlockQ6K {
            ql: pattern(12),
            qh: pattern(13),
            scales: scales.map(|s| s as i8),
            d: f16b(0.03125),
        };
        let mut out = [0f32; 256];
        dequantize_q6k(&[b], &mut out);
        for (e, &v) in out.iter().enumerate() {
            let (half, r) = (e / 128, e % 128);
            let lbyte = b.ql[64 * half + r % 64];
            let low = if r < 64 { lbyte & 15 } else { lbyte >> 4 };
            let high = (b.qh[32 * half + r % 32] >> (2 * (r / 32))) & 3;
            let q = (low | (high << 4)) as i32 - 32;
            let want = (0.03125 * b.scales[e / 16] as f32) * q as f32;
            assert_eq!(v.to_bits(), want.to_bits(), "element {e}");
        }
    }

    #[test]
    #[should_panic(expected = "dequantize_q4k")]
    fn dequantize_rejects_wrong_length() {
        let b = BlockQ4K {
            d: [0; 2],
            dmin: [0; 2],
            scales: [0; 12],
            qs: [0; 128],
        };
        dequantize_q4k(&[b], &mut [0f32; 257]);
    }

    #[test]
    #[should_panic(expected = "quantize_q8k")]
    fn quantize_rejects_wrong_length() {
        let mut out = [BlockQ8K {
            d: [0; 4],
            qs: [0; 256],
            bsums: [[0; 2]; 16],
        }];
        quantize_q8k(&[0.0; 512], &mut out);
    }

    #[test]
    fn q8k_hand_checked_block() {
        let mut x = [0f32; 256];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 100.0) / 8.0;
        }
        x[7] = -40.0; // largest magnitude: maps to -127, so d is positive here
        let mut out = [BlockQ8K {
            d: [0; 4],
            qs: [0; 256],
            bsums: [[0; 2]; 16],
        }];
        quantize_q8k(&x, &mut out);
        let d = f32::from_le_bytes(out[0].d);
        assert_eq!(d, 1.0 / (-127.0 / -40.0));
        assert_eq!(out[0].qs[7], -127);
        assert_eq!(out[0].qs[100], 0);
        for (j, s) in out[0].bsums.iter().enumerate() {
            let sum: i32 = out[0].qs[16 * j..16 * j + 16]
                .iter()
                .map(|&q| q as i32)
                .sum();
            assert_eq!(i16::from_le_bytes(*s) as i32, sum);
        }
    }
}
