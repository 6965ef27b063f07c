//! AVX2 kernels of the lattice i-quants (`IQ1_S`, `IQ1_M`, `IQ2_XXS`,
//! `IQ2_XS`, `IQ2_S`, `IQ3_XXS`, `IQ3_S`) with `Q8_K` activations.
//!
//! Each 32-element sub-block gathers its four 8-element grid points into one
//! vector (`vpinsrq` of table words), gives them their signs (a byte of
//! `0x01`/`0xff` per element from [`SIGN_BYTES`](crate::gemv::SIGN_BYTES)) and multiplies with
//! [`dot_signed_k`] (`|y|` unsigned times the signed weight: no saturation, as
//! the grids' magnitudes are at most 62, `IQ1`'s 1); `madd` applies the
//! sub-block scales and sums pairs in `i32`. The integer sums are the
//! reference's exactly, and the float steps are the reference's own
//! functions, so every result is [`super::r`]'s bits.
//!
//! Soundness as in [`super`]: `#[target_feature]` functions reached through
//! the `Avx2` token.

use core::arch::x86_64::*;

use super::{arr, dot_signed_k, hsum, y32};
use crate::gemv::reference as r;
use crate::gemv::SIGN_BYTES;
use crate::quant::blocks::{
    BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS, BlockQ8K,
};
use crate::quant::iq1::{
    iq1m_d, iq1m_group, iq1m_scales, iq1m_words, iq1s_index, iq1s_scale_shift,
};
use crate::quant::iq2::{self, iq2s_index, ksign, le32, KSIGNS};
use crate::quant::iq3::{iq3s_indices, iq3s_scale};
use crate::quant::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
};

/// Four 8-byte words as one vector, `w[0]` lowest.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn words(w: [u64; 4]) -> __m256i {
    _mm256_set_epi64x(w[3] as i64, w[2] as i64, w[1] as i64, w[0] as i64)
}

/// The sign vector of four sign bytes (one per 8 elements).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signs(b: [u8; 4]) -> __m256i {
    let s = |i: usize| SIGN_BYTES[b[i] as usize];
    words([s(0), s(1), s(2), s(3)])
}

/// The four parity-completed sign patterns of a signs-and-scale word (bits
/// `7l..7l + 7` for group `l`). (Written out: closures passed to
/// `array::from_fn` or `map` were not inlined into the kernels.)
#[inline(always)]
fn ksigns(aux: u32) -> [u8; 4] {
    [ksign(aux, 0), ksign(aux, 1), ksign(aux, 2), ksign(aux, 3)]
}

/// `sum_j signed grid[j] * y[j]` of one sub-block in `i16` pairs: the grid
/// magnitudes `g` with the signs `s` against the activations at `off`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_products(g: __m256i, s: __m256i, x: &BlockQ8K, off: usize) -> __m256i {
    dot_signed_k(_mm256_sign_epi8(g, s), y32(x, off))
}

/// `i16` multipliers: `lo` for the first 16 elements' pairs, `hi` for the rest.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// The multipliers of a byte of two 4-bit scales `s` (low nibble first):
/// `2s + 1` each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pair(sc: u8) -> __m256i {
    let [lo, hi] = iq2::scale_pair(sc);
    halves(lo, hi)
}

/// The multiplier `2s + 1` of a sub-block's 4-bit scale `s` (the top bits of
/// its signs-and-scale word).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn word_scale(aux: u32) -> __m256i {
    _mm256_set1_epi16(iq2::word_scale(aux) as i16)
}

/// A lattice kernel `$name` and its grouped twin `$name_n` (one row, `N`
/// inputs, each result `$name`'s bits): per super-block, `$sub` gives
/// sub-block `$ib`'s grid magnitudes, signs and `i16` scale multipliers
/// (looked up once for all inputs in `$name_n`); their products are summed
/// exactly, then the reference's float step and the format's constant
/// `$factor`.
macro_rules! lattice_kernel {
    ($name:ident, $name_n:ident, $W:ty, $factor:expr, |$w:ident, $ib:ident| $sub:expr) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::gemv) fn $name(w: &[$W], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for ($w, x) in w.iter().zip(x) {
                let mut v = _mm256_setzero_si256();
                for $ib in 0..8 {
                    let (g, s, ls): (__m256i, __m256i, __m256i) = $sub;
                    let p = signed_products(g, s, x, 32 * $ib);
                    v = _mm256_add_epi32(v, _mm256_madd_epi16(p, ls));
                }
                acc += r::iq_term($w.d, x, hsum(v));
            }
            $factor * acc
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub(in crate::gemv) fn $name_n<const N: usize>(w: &[$W], x: [&[BlockQ8K]; N]) -> [f32; N] {
            let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
            let mut acc = [0.0f32; N];
            for (i, $w) in w[..n].iter().enumerate() {
                let mut v = [_mm256_setzero_si256(); N];
                for $ib in 0..8 {
                    let (g, s, ls): (__m256i, __m256i, __m256i) = $sub;
                    let k = _mm256_sign_epi8(g, s);
                    for (v, x) in v.iter_mut().zip(x) {
                        let p = dot_signed_k(k, y32(&x[i], 32 * $ib));
                        *v = _mm256_add_epi32(*v, _mm256_madd_epi16(p, ls));
                    }
                }
                for c in 0..N {
                    acc[c] += r::iq_term($w.d, &x[c][i], hsum(v[c]));
                }
            }
            acc.map(|a| $factor * a)
        }
    };
}

lattice_kernel!(iq2_xxs, iq2_xxs_n, BlockIQ2XXS, 0.125, |w, ib| {
    let q: &[u8; 8] = arr(&w.qs, 8 * ib);
    let aux = le32(q, 4);
    let g = |l: usize| IQ2XXS_GRID[q[l] as usize];
    let g = words([g(0), g(1), g(2), g(3)]);
    (g, signs(ksigns(aux)), word_scale(aux))
});

lattice_kernel!(iq2_xs, iq2_xs_n, BlockIQ2XS, 0.125, |w, ib| {
    // The sub-block's four index-and-signs words at once.
    let q = u64::from_le_bytes(*arr(&w.qs, 8 * ib));
    let q = |l: u32| (q >> (16 * l)) as u16;
    let g = |l: u32| IQ2XS_GRID[(q(l) & 511) as usize];
    let k = |l: u32| KSIGNS[(q(l) >> 9) as usize];
    let g = words([g(0), g(1), g(2), g(3)]);
    (g, signs([k(0), k(1), k(2), k(3)]), scale_pair(w.scales[ib]))
});

lattice_kernel!(iq2_s, iq2_s_n, BlockIQ2S, 0.125, |w, ib| {
    let g = |l: usize| IQ2S_GRID[iq2s_index(w, ib, l)];
    let g = words([g(0), g(1), g(2), g(3)]);
    (g, signs(*arr(&w.qs, 32 + 4 * ib)), scale_pair(w.scales[ib]))
});

lattice_kernel!(iq3_xxs, iq3_xxs_n, BlockIQ3XXS, 0.25, |w, ib| {
    let q: &[u8; 8] = arr(&w.qs, 8 * ib);
    let aux = le32(&w.qs, 64 + 4 * ib);
    let g = |l: usize| IQ3XXS_GRID[q[l] as usize] as i32;
    let g = _mm256_setr_epi32(g(0), g(1), g(2), g(3), g(4), g(5), g(6), g(7));
    (g, signs(ksigns(aux)), word_scale(aux))
});

lattice_kernel!(iq3_s, iq3_s_n, BlockIQ3S, 1.0, |w, ib| {
    let mut g = [0i32; 8];
    for l in 0..4 {
        let (i1, i2) = iq3s_indices(w, ib, l);
        g[2 * l] = IQ3S_GRID[i1] as i32;
        g[2 * l + 1] = IQ3S_GRID[i2] as i32;
    }
    let g = _mm256_setr_epi32(g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]);
    let ls = _mm256_set1_epi16(iq3s_scale(w, ib) as i16);
    (g, signs(*arr(&w.signs, 4 * ib)), ls)
});

#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::gemv) fn iq1_s(w: &[BlockIQ1S], x: &[BlockQ8K]) -> f32 {
    iq1_s_n(w, [x])[0]
}

/// [`iq1_s`] of one row and `N` inputs, each result its bits: each
/// sub-block's grid points and scale looked up once for all inputs.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::gemv) fn iq1_s_n<const N: usize>(w: &[BlockIQ1S], x: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
    let mut acc = [0.0f32; N];
    for (i, w) in w[..n].iter().enumerate() {
        let mut v = [_mm256_setzero_si256(); N];
        let mut sumi1 = [0i32; N];
        for ib in 0..8 {
            let g = |l: usize| IQ1S_GRID[iq1s_index(w, ib, l)];
            let g = words([g(0), g(1), g(2), g(3)]);
            let (ls, negative) = iq1s_scale_shift(w, ib);
            let m = _mm256_set1_epi16(ls as i16);
            let delta = if negative { -1 } else { 1 };
            for c in 0..N {
                let x = &x[c][i];
                let p = dot_signed_k(g, y32(x, 32 * ib));
                v[c] = _mm256_add_epi32(v[c], _mm256_madd_epi16(p, m));
                sumi1[c] += ls * delta * (r::q8k_bsum(x, 2 * ib) + r::q8k_bsum(x, 2 * ib + 1));
            }
        }
        for c in 0..N {
            acc[c] += r::iq1_term(r::h(w.d), &x[c][i], hsum(v[c]), sumi1[c]);
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::gemv) fn iq1_m(w: &[BlockIQ1M], x: &[BlockQ8K]) -> f32 {
    iq1_m_n(w, [x])[0]
}

/// [`iq1_m`] of one row and `N` inputs, each result its bits: each
/// sub-block's grid points, shift signs and scales looked up once.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::gemv) fn iq1_m_n<const N: usize>(w: &[BlockIQ1M], x: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
    let mut acc = [0.0f32; N];
    for (i, w) in w[..n].iter().enumerate() {
        let sc = iq1m_words(w);
        let mut v = [_mm256_setzero_si256(); N];
        let mut shifts = [_mm256_setzero_si256(); N];
        for ib in 0..8 {
            let group = |l: usize| iq1m_group(w, ib, l);
            let groups = [group(0), group(1), group(2), group(3)];
            let g = |l: usize| IQ1S_GRID[groups[l].0];
            let g = words([g(0), g(1), g(2), g(3)]);
            let ls = iq1m_scales(sc, ib);
            let m = halves(ls[0], ls[1]);
            // Each group's activations summed with its shift's sign.
            let neg = |l: usize| if groups[l].1 { 0xff } else { 0 };
            let d = signs([neg(0), neg(1), neg(2), neg(3)]);
            for c in 0..N {
                let y = y32(&x[c][i], 32 * ib);
                v[c] = _mm256_add_epi32(v[c], _mm256_madd_epi16(dot_signed_k(g, y), m));
                shifts[c] = _mm256_add_epi32(shifts[c], _mm256_madd_epi16(dot_signed_k(d, y), m));
            }
        }
        let d = iq1m_d(sc);
        for c in 0..N {
            acc[c] += r::iq1_term(d, &x[c][i], hsum(v[c]), hsum(shifts[c]));
        }
    }
    acc
}
