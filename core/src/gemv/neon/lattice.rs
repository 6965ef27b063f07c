//! NEON kernels of the lattice i-quants (`IQ1_S`, `IQ1_M`, `IQ2_XXS`,
//! `IQ2_XS`, `IQ2_S`, `IQ3_XXS`, `IQ3_S`), compiled into [`super::plain`]
//! and [`super::dot`] by [`lattice_kernels!`] with their `mac16`.
//!
//! Each 16 elements are two 8-element grid points (table words) times their
//! signs ([`SIGN_BYTES`](crate::gemv::SIGN_BYTES), `vmulq_s8`: the grids'
//! magnitudes are at most 62, so the signed weights fit `i8`), multiplied
//! with the activations by `mac16` (exact) and summed (`vaddvq_s32`) before
//! their sub-block scale: the reference's integer sums, then its float
//! steps, so every result is [`crate::gemv::reference`]'s bits.

use core::arch::aarch64::*;

use crate::gemv::SIGN_BYTES;

/// Two 8-byte words as 16 signed bytes, `a` first.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn words16(a: u64, b: u64) -> int8x16_t {
    vreinterpretq_s8_u64(vcombine_u64(vcreate_u64(a), vcreate_u64(b)))
}

/// Grid points `a` and `b` with the signs of the sign bytes `sa` and `sb`.
#[inline]
#[target_feature(enable = "neon")]
pub(super) fn signed16(a: u64, b: u64, sa: u8, sb: u8) -> int8x16_t {
    let s = words16(SIGN_BYTES[sa as usize], SIGN_BYTES[sb as usize]);
    vmulq_s8(words16(a, b), s)
}

/// A lattice kernel `$name` and its grouped twin `$name_n`, compiled with
/// `$features` (in a [`lattice_kernels!`] expansion: `isum16` in scope; the
/// one-input kernel is the grouped one's `N = 1`): per super-block, `$sub`
/// gives sub-block
/// `$ib`'s two halves of signed weights and their scales; their products
/// are summed exactly, then the reference's float step and the format's
/// constant `$factor`.
macro_rules! lattice_kernel {
    ($features:literal, $name:ident, $name_n:ident, $W:ty, $factor:expr, |$w:ident, $ib:ident| $sub:expr) => {
        #[target_feature(enable = $features)]
        pub(super) fn $name(w: &[$W], x: &[BlockQ8K]) -> f32 {
            $name_n(w, [x])[0]
        }

        /// One row and `N` inputs, each result the one-input kernel's bits:
        /// each sub-block's signed weights and scales worked out once.
        #[target_feature(enable = $features)]
        pub(super) fn $name_n<const N: usize>(w: &[$W], x: [&[BlockQ8K]; N]) -> [f32; N] {
            let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
            let mut acc = [0.0f32; N];
            for (i, $w) in w[..n].iter().enumerate() {
                let mut bsum = [0i32; N];
                for $ib in 0..8 {
                    let (lo, hi, [ls_lo, ls_hi]): (int8x16_t, int8x16_t, [i32; 2]) = $sub;
                    let y = 32 * $ib;
                    for c in 0..N {
                        let q = &x[c][i].qs;
                        bsum[c] += isum16(lo, arr(q, y)) * ls_lo;
                        bsum[c] += isum16(hi, arr(q, y + 16)) * ls_hi;
                    }
                }
                for c in 0..N {
                    acc[c] += r::iq_term($w.d, &x[c][i], bsum[c]);
                }
            }
            acc.map(|a| $factor * a)
        }
    };
}
pub(super) use lattice_kernel;

/// The lattice kernels, compiled with `$features` and the `mac16` in scope.
macro_rules! lattice_kernels {
    ($features:literal) => {
        use super::lattice::{signed16, words16};
        use crate::gemv::SIGN_BYTES;
        use crate::quant::blocks::{
            BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS,
        };
        use crate::quant::iq1::{
            iq1m_d, iq1m_group, iq1m_scales, iq1m_words, iq1s_index, iq1s_scale_shift,
        };
        use crate::quant::iq2::{iq2s_index, ksign, le16, le32, scale_pair, word_scale, KSIGNS};
        use crate::quant::iq3::{iq3s_indices, iq3s_scale, pair};
        use crate::quant::iq_grids::{
            IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID,
        };

        /// `sum_j v[j] * y[j]` over 16 elements, exact.
        #[inline]
        #[target_feature(enable = $features)]
        fn isum16(v: int8x16_t, y: &[i8; 16]) -> i32 {
            vaddvq_s32(mac16(vdupq_n_s32(0), v, ld_s8(y)))
        }

        super::lattice::lattice_kernel!(
            $features,
            iq2_xxs,
            iq2_xxs_n,
            BlockIQ2XXS,
            0.125,
            |w, ib| {
                let q: &[u8; 8] = arr(&w.qs, 8 * ib);
                let aux = le32(q, 4);
                let g = |l: usize| IQ2XXS_GRID[q[l] as usize];
                let lo = signed16(g(0), g(1), ksign(aux, 0), ksign(aux, 1));
                let hi = signed16(g(2), g(3), ksign(aux, 2), ksign(aux, 3));
                (lo, hi, [word_scale(aux); 2])
            }
        );

        super::lattice::lattice_kernel!($features, iq2_xs, iq2_xs_n, BlockIQ2XS, 0.125, |w, ib| {
            let q = |l: usize| le16(&w.qs, 2 * (4 * ib + l));
            let g = |l: usize| IQ2XS_GRID[(q(l) & 511) as usize];
            let k = |l: usize| KSIGNS[(q(l) >> 9) as usize];
            let lo = signed16(g(0), g(1), k(0), k(1));
            let hi = signed16(g(2), g(3), k(2), k(3));
            (lo, hi, scale_pair(w.scales[ib]))
        });

        super::lattice::lattice_kernel!($features, iq2_s, iq2_s_n, BlockIQ2S, 0.125, |w, ib| {
            let g = |l: usize| IQ2S_GRID[iq2s_index(w, ib, l)];
            let s: &[u8; 4] = arr(&w.qs, 32 + 4 * ib);
            let lo = signed16(g(0), g(1), s[0], s[1]);
            let hi = signed16(g(2), g(3), s[2], s[3]);
            (lo, hi, scale_pair(w.scales[ib]))
        });

        super::lattice::lattice_kernel!(
            $features,
            iq3_xxs,
            iq3_xxs_n,
            BlockIQ3XXS,
            0.25,
            |w, ib| {
                let q: &[u8; 8] = arr(&w.qs, 8 * ib);
                let aux = le32(&w.qs, 64 + 4 * ib);
                let g = |l: usize| {
                    pair(
                        IQ3XXS_GRID[q[2 * l] as usize],
                        IQ3XXS_GRID[q[2 * l + 1] as usize],
                    )
                };
                let lo = signed16(g(0), g(1), ksign(aux, 0), ksign(aux, 1));
                let hi = signed16(g(2), g(3), ksign(aux, 2), ksign(aux, 3));
                (lo, hi, [word_scale(aux); 2])
            }
        );

        super::lattice::lattice_kernel!($features, iq3_s, iq3_s_n, BlockIQ3S, 1.0, |w, ib| {
            let g = |l: usize| {
                let (i1, i2) = iq3s_indices(w, ib, l);
                pair(IQ3S_GRID[i1], IQ3S_GRID[i2])
            };
            let s: &[u8; 4] = arr(&w.signs, 4 * ib);
            let lo = signed16(g(0), g(1), s[0], s[1]);
            let hi = signed16(g(2), g(3), s[2], s[3]);
            let ls = iq3s_scale(w, ib) as i32;
            (lo, hi, [ls, ls])
        });

        #[target_feature(enable = $features)]
        pub(super) fn iq1_s(w: &[BlockIQ1S], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let (mut sumi, mut sumi1) = (0i32, 0i32);
                for ib in 0..8 {
                    let g = |l: usize| IQ1S_GRID[iq1s_index(w, ib, l)];
                    let y = 32 * ib;
                    let lsum = isum16(words16(g(0), g(1)), arr(&x.qs, y))
                        + isum16(words16(g(2), g(3)), arr(&x.qs, y + 16));
                    let (ls, negative) = iq1s_scale_shift(w, ib);
                    let delta = if negative { -1 } else { 1 };
                    sumi += ls * lsum;
                    sumi1 += ls * delta * (r::q8k_bsum(x, 2 * ib) + r::q8k_bsum(x, 2 * ib + 1));
                }
                acc += r::iq1_term(r::h(w.d), x, sumi, sumi1);
            }
            acc
        }

        #[target_feature(enable = $features)]
        pub(super) fn iq1_m(w: &[BlockIQ1M], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let sc = iq1m_words(w);
                let (mut sumi1, mut sumi2) = (0i32, 0i32);
                for ib in 0..8 {
                    let ls = iq1m_scales(sc, ib);
                    for half in 0..2 {
                        let (a, na) = iq1m_group(w, ib, 2 * half);
                        let (b, nb) = iq1m_group(w, ib, 2 * half + 1);
                        let y: &[i8; 16] = arr(&x.qs, 32 * ib + 16 * half);
                        let n = |negative: bool| if negative { 0xff } else { 0 };
                        // The two groups' activations, each with its shift's sign.
                        let shifts = words16(SIGN_BYTES[n(na)], SIGN_BYTES[n(nb)]);
                        sumi1 += ls[half] * isum16(words16(IQ1S_GRID[a], IQ1S_GRID[b]), y);
                        sumi2 += ls[half] * isum16(shifts, y);
                    }
                }
                acc += r::iq1_term(iq1m_d(sc), x, sumi1, sumi2);
            }
            acc
        }
    };
}
pub(super) use lattice_kernels;
