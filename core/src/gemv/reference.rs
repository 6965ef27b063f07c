//! Scalar reference dot products, one per weight format.
//!
//! These define the results every SIMD kernel must reproduce bit for bit (see the
//! [module docs](super) for the accumulation order). The integer math is ggml's
//! generic `ggml_vec_dot_*`: the same products, summed exactly in `i32`.
//!
//! Each function takes one weight row and the matching activations. They should
//! have the same length in elements; if they do not, the extra blocks of the longer
//! one are ignored ([`super::gemv`] checks lengths before calling).

use crate::quant::blocks::{
    BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS, BlockIQ4NL,
    BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, KVALUES_IQ4NL, KVALUES_MXFP4,
};
use crate::quant::iq1::{
    iq1m_d, iq1m_group, iq1m_scales, iq1m_words, iq1s_index, iq1s_scale_shift,
};
use crate::quant::iq2::{grid_byte, iq2s_index, ksign, le16, le32, scale_pair, word_scale, KSIGNS};
use crate::quant::iq3::{iq3s_indices, iq3s_scale, pair};
use crate::quant::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
};
use crate::quant::kscales::{scale_min_k4, scales_q3k};
use crate::quant::mxfp4::e8m0_to_f32_half;
use crate::quant::{bf16_to_f32, f16_to_f32};

/// Partial sums of the float-weight dot products: element `i` goes to lane `i % 64`.
pub const FLOAT_LANES: usize = 64;

/// Accumulators of the 32-element block formats: block `b` goes to `b % 4`.
pub const BLOCK_LANES: usize = 4;

/// An f16 stored as two little-endian bytes, as `f32`.
#[inline(always)]
pub(crate) fn h(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

/// `Q8_K`'s f32 scale.
#[inline(always)]
pub(crate) fn q8k_d(x: &BlockQ8K) -> f32 {
    f32::from_le_bytes(x.d)
}

/// `Q8_K`'s sixteen group sums.
#[inline(always)]
pub(crate) fn q8k_bsum(x: &BlockQ8K, j: usize) -> i32 {
    i16::from_le_bytes(x.bsums[j]) as i32
}

/// Folds `N` (a power of two) partial sums by halves: `s[l] += s[l + N/2]`, then
/// `N/4`, ... down to `s[0] + s[1]`.
#[inline]
pub(crate) fn fold<const N: usize>(mut s: [f32; N]) -> f32 {
    let mut half = N / 2;
    while half > 0 {
        for l in 0..half {
            s[l] += s[l + half];
        }
        half /= 2;
    }
    s[0]
}

/// Adds the elements `start..` of a float row to `acc` (element `i` into lane
/// `i % 64`, fused multiply-add) and folds the lanes: the common tail of the
/// reference and SIMD float kernels. `start` must be a multiple of 64.
#[inline]
pub(crate) fn finish_float(
    mut acc: [f32; FLOAT_LANES],
    w: impl Iterator<Item = f32>,
    x: &[f32],
    start: usize,
) -> f32 {
    for (i, (wv, &xv)) in w.zip(&x[start.min(x.len())..]).enumerate() {
        let l = i % FLOAT_LANES;
        acc[l] = libm::fmaf(wv, xv, acc[l]);
    }
    fold(acc)
}

/// The lanes of a [`super::tile`] product (element `i` into lane `i % 8`)
/// given the tail `x` from a multiple of 8 on and its weights `w`, folded by
/// halves (`s[l] += s[l + 4]`, `+ 2`, `+ 1`).
#[inline]
pub(crate) fn finish8(mut acc: [f32; 8], w: impl Iterator<Item = f32>, x: &[f32]) -> f32 {
    for (i, (wv, &xv)) in w.zip(x).enumerate() {
        acc[i % 8] = libm::fmaf(wv, xv, acc[i % 8]);
    }
    fold(acc)
}

/// The `f32` weights of a little-endian byte row, from element `start`.
#[inline]
pub(crate) fn f32_elems(w: &[u8], start: usize) -> impl Iterator<Item = f32> + '_ {
    w.chunks_exact(4)
        .skip(start)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// The `f16` weights of a byte row as `f32`, from element `start`.
#[inline]
pub(crate) fn f16_elems(w: &[u8], start: usize) -> impl Iterator<Item = f32> + '_ {
    w.chunks_exact(2).skip(start).map(|c| h([c[0], c[1]]))
}

/// The `bf16` weights of a byte row as `f32`, from element `start`.
#[inline]
pub(crate) fn bf16_elems(w: &[u8], start: usize) -> impl Iterator<Item = f32> + '_ {
    w.chunks_exact(2)
        .skip(start)
        .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
}

/// `F32` weights (little-endian bytes, 4 per element) times `f32` activations.
pub fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    finish_float([0.0; FLOAT_LANES], f32_elems(w, 0), x, 0)
}

/// `F16` weights (2 bytes per element) times `f32` activations.
pub fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    finish_float([0.0; FLOAT_LANES], f16_elems(w, 0), x, 0)
}

/// `BF16` weights (2 bytes per element) times `f32` activations.
pub fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    finish_float([0.0; FLOAT_LANES], bf16_elems(w, 0), x, 0)
}

/// Accumulates per-block terms of a 32-element format: block `b` into lane `b % 4`.
#[inline(always)]
pub(crate) fn blocks4(terms: impl Iterator<Item = f32>) -> f32 {
    let mut acc = [0.0f32; BLOCK_LANES];
    for (b, t) in terms.enumerate() {
        acc[b % BLOCK_LANES] += t;
    }
    fold(acc)
}

/// The float term of a block with an `i32` dot product `isum`: `(dw * dx) * isum`.
#[inline(always)]
pub(crate) fn term(dw: [u8; 2], dx: [u8; 2], isum: i32) -> f32 {
    (h(dw) * h(dx)) * isum as f32
}

/// The float term of an `MXFP4` block: `(dx * 2^(e - 128)) * isum`, ggml's order.
#[inline(always)]
pub(crate) fn term_e8m0(e: u8, dx: [u8; 2], isum: i32) -> f32 {
    (h(dx) * e8m0_to_f32_half(e)) * isum as f32
}

/// The float term of a `Q4_1`/`Q5_1` block: `(dw * dx) * isum + mw * sx`.
#[inline(always)]
pub(crate) fn term_m(w_d: [u8; 2], w_m: [u8; 2], x: &BlockQ8_1, isum: i32) -> f32 {
    (h(w_d) * h(x.d)) * isum as f32 + h(w_m) * h(x.s)
}

/// The fifth bits of a `Q5_0`/`Q5_1` block.
#[inline(always)]
fn qh32(qh: [u8; 4]) -> u32 {
    u32::from_le_bytes(qh)
}

/// `sum_j (qs[j] & 15 + lo_add[j]) * y[j] + (qs[j] >> 4 + hi_add[j]) * y[j + 16]`:
/// the nibble dot product shared by the 32-element 4- and 5-bit formats.
#[inline(always)]
fn nibble_dot(qs: &[u8; 16], y: &[i8; 32], high: impl Fn(usize) -> i32, offset: i32) -> i32 {
    let mut sum = 0i32;
    for j in 0..16 {
        let v0 = (qs[j] & 15) as i32 + high(j) - offset;
        let v1 = (qs[j] >> 4) as i32 + high(j + 16) - offset;
        sum += v0 * y[j] as i32 + v1 * y[j + 16] as i32;
    }
    sum
}

/// `Q4_0` weights times `Q8_0` activations.
pub fn dot_q4_0(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
    blocks4(w.iter().zip(x).map(|(w, x)| {
        let isum = nibble_dot(&w.qs, &x.qs, |_| 0, 8);
        term(w.d, x.d, isum)
    }))
}

/// `Q4_1` weights times `Q8_1` activations.
pub fn dot_q4_1(w: &[BlockQ4_1], x: &[BlockQ8_1]) -> f32 {
    blocks4(w.iter().zip(x).map(|(w, x)| {
        let isum = nibble_dot(&w.qs, &x.qs, |_| 0, 0);
        term_m(w.d, w.m, x, isum)
    }))
}

/// `Q5_0` weights times `Q8_0` activations.
pub fn dot_q5_0(w: &[BlockQ5_0], x: &[BlockQ8_0]) -> f32 {
    blocks4(w.iter().zip(x).map(|(w, x)| {
        let qh = qh32(w.qh);
        let isum = nibble_dot(&w.qs, &x.qs, |j| (((qh >> j) & 1) << 4) as i32, 16);
        term(w.d, x.d, isum)
    }))
}

/// `Q5_1` weights times `Q8_1` activations.
pub fn dot_q5_1(w: &[BlockQ5_1], x: &[BlockQ8_1]) -> f32 {
    blocks4(w.iter().zip(x).map(|(w, x)| {
        let qh = qh32(w.qh);
        let isum = nibble_dot(&w.qs, &x.qs, |j| (((qh >> j) & 1) << 4) as i32, 0);
        term_m(w.d, w.m, x, isum)
    }))
}

/// `Q8_0` weights times `Q8_0` activations.
pub fn dot_q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
    blocks4(w.iter().zip(x).map(|(w, x)| {
        let isum: i32 =
            w.qs.iter()
                .zip(&x.qs)
                .map(|(&a, &b)| a as i32 * b as i32)
                .sum();
        term(w.d, x.d, isum)
    }))
}

/// `sum_j codebook[qs[j] & 15] * y[j] + codebook[qs[j] >> 4] * y[j + 16]`: the
/// integer dot product of the 32-element codebook formats (`IQ4_NL`, `MXFP4`).
#[inline(always)]
fn codebook_dot(codebook: &[i8; 16], qs: &[u8; 16], y: &[i8; 32]) -> i32 {
    let mut isum = 0i32;
    for j in 0..16 {
        isum += codebook[(qs[j] & 15) as usize] as i32 * y[j] as i32;
        isum += codebook[(qs[j] >> 4) as usize] as i32 * y[j + 16] as i32;
    }
    isum
}

/// `IQ4_NL` weights times `Q8_0` activations.
pub fn dot_iq4_nl(w: &[BlockIQ4NL], x: &[BlockQ8_0]) -> f32 {
    blocks4(
        w.iter()
            .zip(x)
            .map(|(w, x)| term(w.d, x.d, codebook_dot(&KVALUES_IQ4NL, &w.qs, &x.qs))),
    )
}

/// `MXFP4` weights times `Q8_0` activations.
pub fn dot_mxfp4(w: &[BlockMXFP4], x: &[BlockQ8_0]) -> f32 {
    blocks4(
        w.iter()
            .zip(x)
            .map(|(w, x)| term_e8m0(w.e, x.d, codebook_dot(&KVALUES_MXFP4, &w.qs, &x.qs))),
    )
}

/// `Q2_K` weights times `Q8_K` activations.
pub fn dot_q2_k(w: &[BlockQ2K], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut summs = 0i32;
        for j in 0..16 {
            summs += q8k_bsum(x, j) * (w.scales[j] >> 4) as i32;
        }
        let mut sumi = 0i32;
        for half in 0..2 {
            for s in 0..4 {
                for g in 0..2 {
                    let sc = (w.scales[8 * half + 2 * s + g] & 15) as i32;
                    let mut sub = 0i32;
                    for l in 16 * g..16 * g + 16 {
                        let q = ((w.qs[32 * half + l] >> (2 * s)) & 3) as i32;
                        sub += q * x.qs[128 * half + 32 * s + l] as i32;
                    }
                    sumi += sc * sub;
                }
            }
        }
        acc += k_term(w.d, w.dmin, x, sumi, summs);
    }
    acc
}

/// `Q3_K` weights times `Q8_K` activations.
pub fn dot_q3_k(w: &[BlockQ3K], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let scales = scales_q3k(&w.scales);
        let mut sumi = 0i32;
        for half in 0..2 {
            for s in 0..4 {
                let bit = 4 * half + s;
                for g in 0..2 {
                    let mut sub = 0i32;
                    for l in 16 * g..16 * g + 16 {
                        let lo = ((w.qs[32 * half + l] >> (2 * s)) & 3) as i32;
                        let hi = if (w.hmask[l] >> bit) & 1 == 1 { 0 } else { 4 };
                        sub += (lo - hi) * x.qs[128 * half + 32 * s + l] as i32;
                    }
                    sumi += scales[8 * half + 2 * s + g] as i32 * sub;
                }
            }
        }
        acc += (h(w.d) * q8k_d(x)) * sumi as f32;
    }
    acc
}

/// The shared body of `Q4_K`/`Q5_K`: `q(l)` is the quant of element `l` (0..256).
#[inline(always)]
fn k4_like(
    d: [u8; 2],
    dmin: [u8; 2],
    scales: &[u8; 12],
    x: &BlockQ8K,
    q: impl Fn(usize) -> i32,
) -> f32 {
    let mut sumi = 0i32;
    let mut summs = 0i32;
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        let mut sub = 0i32;
        for l in 32 * j..32 * j + 32 {
            sub += q(l) * x.qs[l] as i32;
        }
        sumi += sc as i32 * sub;
        summs += m as i32 * (q8k_bsum(x, 2 * j) + q8k_bsum(x, 2 * j + 1));
    }
    k_term(d, dmin, x, sumi, summs)
}

/// A `Q2_K`/`Q4_K`/`Q5_K` super-block's float step: its exact integer sums
/// `sumi` (quants times scales times activations) and `summs` (mins times
/// the activations' group sums), scaled by `d` and `dmin` (`f16`) and the
/// activations' scale, in this order.
#[inline(always)]
pub(crate) fn k_term(d: [u8; 2], dmin: [u8; 2], x: &BlockQ8K, sumi: i32, summs: i32) -> f32 {
    let dx = q8k_d(x);
    (h(d) * dx) * sumi as f32 - (h(dmin) * dx) * summs as f32
}

/// `Q4_K` weights times `Q8_K` activations.
pub fn dot_q4_k(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        acc += k4_like(w.d, w.dmin, &w.scales, x, |l| {
            let byte = w.qs[32 * (l / 64) + l % 32];
            (if l % 64 < 32 { byte & 15 } else { byte >> 4 }) as i32
        });
    }
    acc
}

/// `Q5_K` weights times `Q8_K` activations.
pub fn dot_q5_k(w: &[BlockQ5K], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        acc += k4_like(w.d, w.dmin, &w.scales, x, |l| {
            let byte = w.qs[32 * (l / 64) + l % 32];
            let lo = if l % 64 < 32 { byte & 15 } else { byte >> 4 };
            let hi = (w.qh[l % 32] >> (l / 32)) & 1;
            (lo | (hi << 4)) as i32
        });
    }
    acc
}

/// `Q6_K` weights times `Q8_K` activations.
pub fn dot_q6_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut sumi = 0i32;
        for half in 0..2 {
            let ql = &w.ql[64 * half..64 * half + 64];
            let qh = &w.qh[32 * half..32 * half + 32];
            for k in 0..4 {
                // Element 128*half + 32*k + l: low nibble of ql[l] (k = 0) or
                // ql[l + 32] (k = 1), high nibble of the same (k = 2, 3); bits
                // 2k..2k+2 of qh[l] on top.
                for g in 0..2 {
                    let mut sub = 0i32;
                    for l in 16 * g..16 * g + 16 {
                        let byte = ql[l + 32 * (k & 1)];
                        let lo = if k < 2 { byte & 15 } else { byte >> 4 };
                        let hi = (qh[l] >> (2 * k)) & 3;
                        let q = (lo | (hi << 4)) as i32 - 32;
                        sub += q * x.qs[128 * half + 32 * k + l] as i32;
                    }
                    sumi += w.scales[8 * half + 2 * k + g] as i32 * sub;
                }
            }
        }
        acc += (h(w.d) * q8k_d(x)) * sumi as f32;
    }
    acc
}

/// The 6-bit scale of sub-block `j` (0..8) of an `IQ4_XS` block, minus 32.
#[inline(always)]
pub(crate) fn iq4xs_scale(w: &BlockIQ4XS, j: usize) -> i32 {
    let lo = (w.scales_l[j / 2] >> (4 * (j % 2))) & 15;
    let hi = (u16::from_le_bytes(w.scales_h) >> (2 * j)) & 3;
    (lo as i32 | (hi as i32) << 4) - 32
}

/// `IQ4_XS` weights times `Q8_K` activations.
pub fn dot_iq4_xs(w: &[BlockIQ4XS], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut sumi = 0i32;
        for j in 0..8 {
            let qs = &w.qs[16 * j..16 * j + 16];
            let y = &x.qs[32 * j..32 * j + 32];
            let mut sub = 0i32;
            for l in 0..16 {
                sub += KVALUES_IQ4NL[(qs[l] & 15) as usize] as i32 * y[l] as i32;
                sub += KVALUES_IQ4NL[(qs[l] >> 4) as usize] as i32 * y[l + 16] as i32;
            }
            sumi += iq4xs_scale(w, j) * sub;
        }
        acc += (h(w.d) * q8k_d(x)) * sumi as f32;
    }
    acc
}

/// `sum_j grid[j] * y[j]`, negated where bit `j` of `signs` is set: one
/// 8-element group of the lattice formats (ggml's `grid[j] * q8[j] * (±1)`).
#[inline(always)]
pub(crate) fn signed_dot8(grid: u64, signs: u8, y: &[i8]) -> i32 {
    let mut s = 0i32;
    for (j, &q) in y.iter().enumerate().take(8) {
        let p = grid_byte(grid, j) as i32 * q as i32;
        s += if signs >> j & 1 != 0 { -p } else { p };
    }
    s
}

/// A lattice super-block's float step: its exact integer sum scaled by the
/// weights' and the activations' scales, in this order (ggml's
/// `sumf += d * bsum`; the format's constant factor applies to the row).
#[inline(always)]
pub(crate) fn iq_term(d: [u8; 2], x: &BlockQ8K, bsum: i32) -> f32 {
    (h(d) * q8k_d(x)) * bsum as f32
}

/// `IQ2_XXS` weights times `Q8_K` activations.
pub fn dot_iq2_xxs(w: &[BlockIQ2XXS], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut bsum = 0i32;
        for ib in 0..8 {
            let q = &w.qs[8 * ib..8 * ib + 8];
            let aux = le32(q, 4);
            let mut sumi = 0i32;
            for l in 0..4 {
                let y = &x.qs[32 * ib + 8 * l..];
                sumi += signed_dot8(IQ2XXS_GRID[q[l] as usize], ksign(aux, l), y);
            }
            bsum += sumi * word_scale(aux);
        }
        acc += iq_term(w.d, x, bsum);
    }
    0.125 * acc
}

/// The integer sum of an `IQ2_XS` or `IQ2_S` super-block against `x`:
/// sub-block `ib`'s halves have the 4-bit scales of `scales[ib]` (low nibble
/// first), and its group `l` is `point(ib, l)`, a grid word and its signs.
#[inline(always)]
fn two_scale_bsum(
    scales: &[u8; 8],
    x: &BlockQ8K,
    point: impl Fn(usize, usize) -> (u64, u8),
) -> i32 {
    let mut bsum = 0i32;
    for (ib, &sc) in scales.iter().enumerate() {
        for (half, ls) in scale_pair(sc).into_iter().enumerate() {
            let mut sumi = 0i32;
            for l in 2 * half..2 * half + 2 {
                let (grid, signs) = point(ib, l);
                sumi += signed_dot8(grid, signs, &x.qs[32 * ib + 8 * l..]);
            }
            bsum += sumi * ls;
        }
    }
    bsum
}

/// `IQ2_XS` weights times `Q8_K` activations.
pub fn dot_iq2_xs(w: &[BlockIQ2XS], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let bsum = two_scale_bsum(&w.scales, x, |ib, l| {
            let q = le16(&w.qs, 2 * (4 * ib + l));
            (IQ2XS_GRID[(q & 511) as usize], KSIGNS[(q >> 9) as usize])
        });
        acc += iq_term(w.d, x, bsum);
    }
    0.125 * acc
}

/// `IQ2_S` weights times `Q8_K` activations.
pub fn dot_iq2_s(w: &[BlockIQ2S], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let bsum = two_scale_bsum(&w.scales, x, |ib, l| {
            (IQ2S_GRID[iq2s_index(w, ib, l)], w.qs[32 + 4 * ib + l])
        });
        acc += iq_term(w.d, x, bsum);
    }
    0.125 * acc
}

/// `IQ3_XXS` weights times `Q8_K` activations.
pub fn dot_iq3_xxs(w: &[BlockIQ3XXS], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut bsum = 0i32;
        for ib in 0..8 {
            let aux = le32(&w.qs, 64 + 4 * ib);
            let q = &w.qs[8 * ib..8 * ib + 8];
            let mut sumi = 0i32;
            for l in 0..4 {
                let g = pair(
                    IQ3XXS_GRID[q[2 * l] as usize],
                    IQ3XXS_GRID[q[2 * l + 1] as usize],
                );
                sumi += signed_dot8(g, ksign(aux, l), &x.qs[32 * ib + 8 * l..]);
            }
            bsum += sumi * word_scale(aux);
        }
        acc += iq_term(w.d, x, bsum);
    }
    0.25 * acc
}

/// `IQ3_S` weights times `Q8_K` activations.
pub fn dot_iq3_s(w: &[BlockIQ3S], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut bsum = 0i32;
        for ib in 0..8 {
            let mut sumi = 0i32;
            for l in 0..4 {
                let (i1, i2) = iq3s_indices(w, ib, l);
                let g = pair(IQ3S_GRID[i1], IQ3S_GRID[i2]);
                sumi += signed_dot8(g, w.signs[4 * ib + l], &x.qs[32 * ib + 8 * l..]);
            }
            bsum += sumi * iq3s_scale(w, ib) as i32;
        }
        acc += iq_term(w.d, x, bsum);
    }
    acc
}

/// `sum_j grid[j] * y[j]` of one 8-element `IQ1` group (elements -1, 0, 1).
#[inline(always)]
pub(crate) fn iq1_dot8(grid: u64, y: &[i8]) -> i32 {
    let mut s = 0i32;
    for (j, &q) in y.iter().enumerate().take(8) {
        s += grid_byte(grid, j) as i8 as i32 * q as i32;
    }
    s
}

/// An `IQ1` super-block's float step: `d * dx * (sumi + delta_sum / 8)`,
/// rounded as ggml's `d * y.d * (sumi + IQ1S_DELTA * sumi1)`.
#[inline(always)]
pub(crate) fn iq1_term(d: f32, x: &BlockQ8K, sumi: i32, delta_sum: i32) -> f32 {
    (d * q8k_d(x)) * (sumi as f32 + 0.125 * delta_sum as f32)
}

/// `IQ1_S` weights times `Q8_K` activations.
pub fn dot_iq1_s(w: &[BlockIQ1S], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let (mut sumi, mut sumi1) = (0i32, 0i32);
        for ib in 0..8 {
            let (ls, negative) = iq1s_scale_shift(w, ib);
            let delta = if negative { -1 } else { 1 };
            let mut lsum = 0i32;
            for l in 0..4 {
                lsum += iq1_dot8(IQ1S_GRID[iq1s_index(w, ib, l)], &x.qs[32 * ib + 8 * l..]);
            }
            sumi += ls * lsum;
            sumi1 += ls * delta * (q8k_bsum(x, 2 * ib) + q8k_bsum(x, 2 * ib + 1));
        }
        acc += iq1_term(h(w.d), x, sumi, sumi1);
    }
    acc
}

/// `IQ1_M` weights times `Q8_K` activations.
pub fn dot_iq1_m(w: &[BlockIQ1M], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let sc = iq1m_words(w);
        let (mut sumi1, mut sumi2) = (0i32, 0i32);
        for ib in 0..8 {
            let ls = iq1m_scales(sc, ib);
            for l in 0..4 {
                let (index, negative) = iq1m_group(w, ib, l);
                let y = &x.qs[32 * ib + 8 * l..32 * ib + 8 * l + 8];
                let sum: i32 = y.iter().map(|&q| q as i32).sum();
                sumi1 += ls[l / 2] * iq1_dot8(IQ1S_GRID[index], y);
                sumi2 += ls[l / 2] * if negative { -sum } else { sum };
            }
        }
        acc += iq1_term(iq1m_d(sc), x, sumi1, sumi2);
    }
    acc
}
