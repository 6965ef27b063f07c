//! NEON (Advanced SIMD) kernels for aarch64, with and without the dot-product
//! instructions.
//!
//! The integer kernels are built twice from one source ([`int_kernels!`]): in
//! [`plain`], for every aarch64 CPU ([`Neon`]), and in [`dot`], with ARMv8.2's
//! `sdot` for the CPUs that have it ([`NeonDot`]: every phone core since about
//! 2018, Apple's M series, Neoverse). The float kernels are shared.
//!
//! # Soundness
//!
//! This module is compiled only when NEON is enabled for the whole build
//! (`cfg(target_feature = "neon")`, part of every aarch64 Linux, Android and Apple
//! target), so the NEON instructions it uses exist on every CPU the binary can run
//! on. The `dotprod` kernels are reachable only through a [`NeonDot`] token, whose
//! constructor checks the feature ([`super::hwcap`]). The other `unsafe` blocks are
//! loads and stores through pointers taken from references to arrays of exactly the
//! accessed size, and the one `sdot` of [`dot`], which reads and writes registers
//! only.
//!
//! # Exactness
//!
//! Integer products are exact: [`plain`] widens them (`vmull_s8`: i8 x i8 into
//! i16, exact for all inputs including -128) and sums them pairwise into i32
//! (`vpadalq_s16`); [`dot`] sums four i8 x i8 products into each i32 lane
//! (`sdot`, at most 4 * 128 * 128 in magnitude). The two put different products
//! in each lane, but every kernel adds the four lanes (`vaddvq_s32`) before using
//! them, so the block sums are the same integers. The float steps are the
//! reference's own helpers, or fused multiply-adds (`vfmaq_f32`) in the lane order
//! of [`super::reference`].
#![allow(unsafe_code)]

use core::arch::aarch64::*;

mod lattice;

use super::reference::{self as r, FLOAT_LANES};
use super::Kernels;
use crate::quant::blocks::{
    BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS, BlockIQ4NL,
    BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
};

/// The NEON kernels (NEON is a compile-time feature here, so no run-time token).
#[derive(Clone, Copy)]
pub(crate) struct Neon;

/// The NEON kernels with the dot-product instructions; only [`NeonDot::new`]
/// makes one, on a CPU that has them.
#[derive(Clone, Copy)]
pub(crate) struct NeonDot(());

impl NeonDot {
    /// The token, where the CPU has the dot-product instructions.
    pub(crate) fn new() -> Option<NeonDot> {
        super::hwcap::has_dotprod().then_some(NeonDot(()))
    }
}

/// Kernel methods calling the functions of the same name in `$module`.
macro_rules! forward {
    ($module:ident: $($name:ident($w:ty, $x:ty);)*) => {
        $(
            #[inline]
            fn $name(self, w: $w, x: $x) -> f32 {
                // SAFETY: NEON is enabled for the whole build; the `dot` kernels
                // are reached only through a `NeonDot`, which exists only where
                // the CPU has `dotprod`.
                unsafe { $module::$name(w, x) }
            }
        )*
    };
}

/// Grouped kernel methods (one row, `N` inputs) calling the functions of the
/// same name in `$module`.
macro_rules! group_forward {
    ($module:ident: $($name:ident($w:ty);)*) => {
        $(
            #[inline]
            fn $name<const N: usize>(self, w: &[$w], x: [&[BlockQ8K]; N]) -> [f32; N] {
                // SAFETY: as for `forward!`'s methods.
                unsafe { $module::$name(w, x) }
            }
        )*
    };
}

/// The float kernels and, from `$module`, the integer ones.
macro_rules! neon_methods {
    ($module:ident) => {
        forward! {
            float:
            f32(&[u8], &[f32]);
            f16(&[u8], &[f32]);
            bf16(&[u8], &[f32]);
        }
        forward! {
            $module:
            q4_0(&[BlockQ4_0], &[BlockQ8_0]);
            q4_1(&[BlockQ4_1], &[BlockQ8_1]);
            q5_0(&[BlockQ5_0], &[BlockQ8_0]);
            q5_1(&[BlockQ5_1], &[BlockQ8_1]);
            q8_0(&[BlockQ8_0], &[BlockQ8_0]);
            iq4_nl(&[BlockIQ4NL], &[BlockQ8_0]);
            mxfp4(&[BlockMXFP4], &[BlockQ8_0]);
            q2_k(&[BlockQ2K], &[BlockQ8K]);
            q3_k(&[BlockQ3K], &[BlockQ8K]);
            q4_k(&[BlockQ4K], &[BlockQ8K]);
            q5_k(&[BlockQ5K], &[BlockQ8K]);
            q6_k(&[BlockQ6K], &[BlockQ8K]);
            iq4_xs(&[BlockIQ4XS], &[BlockQ8K]);
        }
        super::lattice_methods!(forward! { $module: });
        #[inline]
        fn q4_k_n<const N: usize>(self, w: &[BlockQ4K], x: [&[BlockQ8K]; N]) -> [f32; N] {
            // SAFETY: as for `forward!`'s methods.
            unsafe { $module::q4_k_n(w, x) }
        }
        #[inline]
        fn q5_k_n<const N: usize>(self, w: &[BlockQ5K], x: [&[BlockQ8K]; N]) -> [f32; N] {
            // SAFETY: as for `forward!`'s methods.
            unsafe { $module::q5_k_n(w, x) }
        }
        #[inline]
        fn q6_k_n<const N: usize>(self, w: &[BlockQ6K], x: [&[BlockQ8K]; N]) -> [f32; N] {
            // SAFETY: as for `forward!`'s methods.
            unsafe { $module::q6_k_n(w, x) }
        }
        #[inline]
        fn iq4_xs_n<const N: usize>(self, w: &[BlockIQ4XS], x: [&[BlockQ8K]; N]) -> [f32; N] {
            // SAFETY: as for `forward!`'s methods.
            unsafe { $module::iq4_xs_n(w, x) }
        }
        super::lattice_group_methods!(group_forward! { $module: });
    };
}

impl Kernels for Neon {
    neon_methods!(plain);
}

impl Kernels for NeonDot {
    neon_methods!(dot);
}

/// `&s[off..off + N]` as an array reference.
#[inline(always)]
fn arr<T, const N: usize>(s: &[T], off: usize) -> &[T; N] {
    s[off..off + N].try_into().expect("slice of length N")
}

#[inline]
#[target_feature(enable = "neon")]
fn ld_u8(a: &[u8; 16]) -> uint8x16_t {
    // SAFETY: reads exactly the 16 bytes of `a`.
    unsafe { vld1q_u8(a.as_ptr()) }
}

#[inline]
#[target_feature(enable = "neon")]
fn ld_s8(a: &[i8; 16]) -> int8x16_t {
    // SAFETY: reads exactly the 16 bytes of `a`.
    unsafe { vld1q_s8(a.as_ptr()) }
}

#[inline]
#[target_feature(enable = "neon")]
fn ld_f32(a: &[f32; 4]) -> float32x4_t {
    // SAFETY: reads exactly the 4 floats of `a`.
    unsafe { vld1q_f32(a.as_ptr()) }
}

/// The float kernels (`f32`, `f16`, `bf16`), the same for both kernel sets.
mod float {
    use super::*;

    /// Four f16 values (8 little-endian bytes) as `f32`, exactly (NaN payloads aside):
    /// the magnitude bits shifted into f32 position and scaled by 2^112 (exact, covers
    /// subnormals), the sign or-ed back, and exponent 31 mapped to inf/NaN.
    #[inline]
    #[target_feature(enable = "neon")]
    fn f16x4(c: &[u8; 8]) -> float32x4_t {
        // SAFETY: reads exactly the 8 bytes of `c`.
        let h = vmovl_u16(vreinterpret_u16_u8(unsafe { vld1_u8(c.as_ptr()) }));
        let mag = vshlq_n_u32::<13>(vandq_u32(h, vdupq_n_u32(0x7fff)));
        let scaled = vreinterpretq_u32_f32(vmulq_f32(
            vreinterpretq_f32_u32(mag),
            vdupq_n_f32(f32::from_bits(0x7780_0000)), // 2^112
        ));
        let special = vceqq_u32(vandq_u32(h, vdupq_n_u32(0x7c00)), vdupq_n_u32(0x7c00));
        let infnan = vorrq_u32(mag, vdupq_n_u32(0x7f80_0000));
        let v = vbslq_u32(special, infnan, scaled);
        let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
        vreinterpretq_f32_u32(vorrq_u32(v, sign))
    }

    macro_rules! float_kernel {
        ($name:ident, $wbytes:expr, |$c:ident| $load:expr, $elems:path) => {
            #[target_feature(enable = "neon")]
            pub(super) fn $name(w: &[u8], x: &[f32]) -> f32 {
                const WB: usize = $wbytes;
                let n = (w.len() / WB).min(x.len());
                let full = n / FLOAT_LANES * FLOAT_LANES;
                let mut acc = [vdupq_n_f32(0.0); 16];
                for (wc, xc) in w[..full * WB]
                    .chunks_exact(FLOAT_LANES * WB)
                    .zip(x[..full].chunks_exact(FLOAT_LANES))
                {
                    for (k, a) in acc.iter_mut().enumerate() {
                        let $c = arr::<u8, { 4 * WB }>(wc, 4 * WB * k);
                        *a = vfmaq_f32(*a, $load, ld_f32(arr(xc, 4 * k)));
                    }
                }
                let mut lanes = [0.0f32; FLOAT_LANES];
                for (k, a) in acc.iter().enumerate() {
                    let out = &mut lanes[4 * k..4 * k + 4];
                    // SAFETY: writes exactly the 4 floats of `out`.
                    unsafe { vst1q_f32(out.as_mut_ptr(), *a) };
                }
                r::finish_float(lanes, $elems(w, full), x, full)
            }
        };
    }

    float_kernel!(f32, 4, |c| vreinterpretq_f32_u8(ld_u8(c)), r::f32_elems);
    float_kernel!(f16, 2, |c| f16x4(c), r::f16_elems);
    float_kernel!(
        bf16,
        2,
        |c| {
            let c: &[u8; 8] = c;
            // SAFETY: reads exactly the 8 bytes of `c`.
            let v = unsafe { vld1_u8(c.as_ptr()) };
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vreinterpret_u16_u8(v)))
        },
        r::bf16_elems
    );

    /// Float weights times several tokens (`super::super::tile`): one 8-lane
    /// accumulator (two registers) per output, element `i` into lane `i % 8`.
    macro_rules! tile_kernels {
        ($tile:ident, $one:ident, $wbytes:expr, |$c:ident| $load:expr, $elems:path) => {
            /// `R` weight rows times `T` tokens' activations: `out[r][t]`.
            #[target_feature(enable = "neon")]
            pub(in super::super) fn $tile<const R: usize, const T: usize>(
                w: [&[u8]; R],
                x: [&[f32]; T],
            ) -> [[f32; T]; R] {
                const WB: usize = $wbytes;
                let n = x[0].len();
                let full = n / 8 * 8;
                let mut acc = [[[vdupq_n_f32(0.0); 2]; T]; R];
                let mut k = 0;
                while k < full {
                    for h in 0..2 {
                        let wv: [float32x4_t; R] = core::array::from_fn(|r| {
                            let $c = arr::<u8, { 4 * WB }>(w[r], (k + 4 * h) * WB);
                            $load
                        });
                        for (t, xt) in x.iter().enumerate() {
                            let a = ld_f32(arr(xt, k + 4 * h));
                            for r in 0..R {
                                acc[r][t][h] = vfmaq_f32(acc[r][t][h], wv[r], a);
                            }
                        }
                    }
                    k += 8;
                }
                let mut out = [[0.0f32; T]; R];
                for r in 0..R {
                    for t in 0..T {
                        out[r][t] =
                            r::finish8(lanes8(acc[r][t]), $elems(w[r], full), &x[t][full..]);
                    }
                }
                out
            }

            /// One weight row times one token, as `$tile` computes each product.
            #[target_feature(enable = "neon")]
            pub(in super::super) fn $one(w: &[u8], x: &[f32]) -> f32 {
                const WB: usize = $wbytes;
                let full = x.len() / 8 * 8;
                let mut acc = [vdupq_n_f32(0.0); 2];
                let mut k = 0;
                while k < full {
                    for (h, a) in acc.iter_mut().enumerate() {
                        let $c = arr::<u8, { 4 * WB }>(w, (k + 4 * h) * WB);
                        *a = vfmaq_f32(*a, $load, ld_f32(arr(x, k + 4 * h)));
                    }
                    k += 8;
                }
                r::finish8(lanes8(acc), $elems(w, full), &x[full..])
            }
        };
    }

    /// Lanes 0-3 then 4-7.
    #[inline]
    #[target_feature(enable = "neon")]
    fn lanes8(acc: [float32x4_t; 2]) -> [f32; 8] {
        let mut lanes = [0.0f32; 8];
        for (h, a) in acc.iter().enumerate() {
            let out = &mut lanes[4 * h..4 * h + 4];
            // SAFETY: writes exactly the 4 floats of `out`.
            unsafe { vst1q_f32(out.as_mut_ptr(), *a) };
        }
        lanes
    }

    tile_kernels!(
        tile_f32,
        one_f32,
        4,
        |c| vreinterpretq_f32_u8(ld_u8(c)),
        r::f32_elems
    );
    tile_kernels!(tile_f16, one_f16, 2, |c| f16x4(c), r::f16_elems);
    tile_kernels!(
        tile_bf16,
        one_bf16,
        2,
        |c| {
            let c: &[u8; 8] = c;
            // SAFETY: reads exactly the 8 bytes of `c`.
            let v = unsafe { vld1_u8(c.as_ptr()) };
            vreinterpretq_f32_u32(vshll_n_u16::<16>(vreinterpret_u16_u8(v)))
        },
        r::bf16_elems
    );
}

impl Neon {
    /// `float::tile_*` for `ty` (`F32`, `F16` or `BF16`; others give zeros).
    pub(crate) fn float_tile<const R: usize, const N: usize>(
        self,
        ty: crate::quant::GgmlType,
        w: [&[u8]; R],
        x: [&[f32]; N],
    ) -> [[f32; N]; R] {
        use crate::quant::GgmlType as T;
        // SAFETY: NEON is enabled for the whole build.
        unsafe {
            match ty {
                T::F32 => float::tile_f32(w, x),
                T::F16 => float::tile_f16(w, x),
                T::BF16 => float::tile_bf16(w, x),
                _ => [[0.0; N]; R],
            }
        }
    }

    /// `float::one_*` for `ty` (`F32`, `F16` or `BF16`; others give zero).
    pub(crate) fn float_one(self, ty: crate::quant::GgmlType, w: &[u8], x: &[f32]) -> f32 {
        use crate::quant::GgmlType as T;
        // SAFETY: NEON is enabled for the whole build.
        unsafe {
            match ty {
                T::F32 => float::one_f32(w, x),
                T::F16 => float::one_f16(w, x),
                T::BF16 => float::one_bf16(w, x),
                _ => 0.0,
            }
        }
    }
}

/// A kernel over 32-element blocks: exact block sums from `$isum`, float terms and
/// lanes as the reference ([`r::term`] / [`r::term_m`], block `b` in lane `b % 4`).
macro_rules! blocks32_kernel {
    ($features:literal, $name:ident, $W:ty, $X:ty, |$w:ident, $x:ident| $term:expr) => {
        #[target_feature(enable = $features)]
        pub(super) fn $name(w: &[$W], x: &[$X]) -> f32 {
            let mut acc = [0.0f32; r::BLOCK_LANES];
            for (b, ($w, $x)) in w.iter().zip(x).enumerate() {
                acc[b % r::BLOCK_LANES] += $term;
            }
            r::fold(acc)
        }
    };
}

/// The integer kernels, compiled with `$features`; `$mac16` is the function
/// `mac16(acc, a, b)` that adds the exact products `a[i] * b[i]` of 16 i8 pairs
/// to four i32 partial sums (which product goes to which lane is its own choice:
/// the kernels only use the lanes' total).
macro_rules! int_kernels {
    ($features:literal, $mac16:item) => {
        use core::arch::aarch64::*;

        use super::{arr, ld_s8, ld_u8};
        use crate::gemv::reference as r;
        use crate::quant::blocks::{
            BlockIQ4NL, BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
            BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
            KVALUES_IQ4NL, KVALUES_MXFP4,
        };
        use crate::quant::kscales::{scale_min_k4, scales_q3k};

        $mac16

        super::lattice::lattice_kernels!($features);

        #[inline]
        #[target_feature(enable = $features)]
        fn dot_i8_32(a: &[i8; 32], b: &[i8; 32]) -> i32 {
            let acc = mac16(vdupq_n_s32(0), ld_s8(arr(a, 0)), ld_s8(arr(b, 0)));
            vaddvq_s32(mac16(acc, ld_s8(arr(a, 16)), ld_s8(arr(b, 16))))
        }

        blocks32_kernel!($features, q4_0, BlockQ4_0, BlockQ8_0, |w, x| r::term(
            w.d,
            x.d,
            isum_nib(&w.qs, vdupq_n_u8(0), vdupq_n_u8(0), 8, &x.qs)
        ));
        blocks32_kernel!($features, q4_1, BlockQ4_1, BlockQ8_1, |w, x| r::term_m(
            w.d,
            w.m,
            x,
            isum_nib(&w.qs, vdupq_n_u8(0), vdupq_n_u8(0), 0, &x.qs)
        ));
        blocks32_kernel!($features, q5_0, BlockQ5_0, BlockQ8_0, |w, x| {
            let (h0, h1) = bits5(w.qh);
            r::term(w.d, x.d, isum_nib(&w.qs, h0, h1, 16, &x.qs))
        });
        blocks32_kernel!($features, q5_1, BlockQ5_1, BlockQ8_1, |w, x| {
            let (h0, h1) = bits5(w.qh);
            r::term_m(w.d, w.m, x, isum_nib(&w.qs, h0, h1, 0, &x.qs))
        });
        blocks32_kernel!($features, q8_0, BlockQ8_0, BlockQ8_0, |w, x| r::term(
            w.d,
            x.d,
            dot_i8_32(&w.qs, &x.qs)
        ));
        blocks32_kernel!($features, iq4_nl, BlockIQ4NL, BlockQ8_0, |w, x| r::term(
            w.d,
            x.d,
            isum_table(&KVALUES_IQ4NL, &w.qs, &x.qs)
        ));
        blocks32_kernel!($features, mxfp4, BlockMXFP4, BlockQ8_0, |w, x| r::term_e8m0(
            w.e,
            x.d,
            isum_table(&KVALUES_MXFP4, &w.qs, &x.qs)
        ));

        /// The fifth bits of a `Q5_0`/`Q5_1` block as `0x10` bytes: elements 0..16 and 16..32.
        #[inline]
        #[target_feature(enable = $features)]
        fn bits5(qh: [u8; 4]) -> (uint8x16_t, uint8x16_t) {
            let bits: [u8; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
            // SAFETY: reads exactly the 8 bytes of `bits`.
            let m = unsafe { vld1_u8(bits.as_ptr()) };
            let t = |b: u8| vtst_u8(vdup_n_u8(b), m);
            let sixteen = vdupq_n_u8(0x10);
            (
                vandq_u8(vcombine_u8(t(qh[0]), t(qh[1])), sixteen),
                vandq_u8(vcombine_u8(t(qh[2]), t(qh[3])), sixteen),
            )
        }

        /// `sum((q_j | h_j) - off) * y_j` for the nibble formats: low nibbles (with `h0`)
        /// are elements 0..16, high nibbles (with `h1`) elements 16..32.
        #[inline]
        #[target_feature(enable = $features)]
        fn isum_nib(qs: &[u8; 16], h0: uint8x16_t, h1: uint8x16_t, off: i8, y: &[i8; 32]) -> i32 {
            let q = ld_u8(qs);
            let off = vdupq_n_s8(off);
            let lo = vsubq_s8(
                vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(15)), h0)),
                off,
            );
            let hi = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(q), h1)), off);
            let acc = mac16(vdupq_n_s32(0), lo, ld_s8(arr(y, 0)));
            vaddvq_s32(mac16(acc, hi, ld_s8(arr(y, 16))))
        }

        /// `sum(codebook[q_j] * y_j)` over 32 elements (nibble layout as `Q4_0`).
        #[inline]
        #[target_feature(enable = $features)]
        fn isum_table(codebook: &[i8; 16], qs: &[u8; 16], y: &[i8; 32]) -> i32 {
            let table = ld_s8(codebook);
            let q = ld_u8(qs);
            let lo = vqtbl1q_s8(table, vandq_u8(q, vdupq_n_u8(15)));
            let hi = vqtbl1q_s8(table, vshrq_n_u8::<4>(q));
            let acc = mac16(vdupq_n_s32(0), lo, ld_s8(arr(y, 0)));
            vaddvq_s32(mac16(acc, hi, ld_s8(arr(y, 16))))
        }

        #[target_feature(enable = $features)]
        pub(super) fn q4_k(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let mut sumi = 0i32;
                let mut summs = 0i32;
                for c in 0..4 {
                    let mut lo = vdupq_n_s32(0);
                    let mut hi = vdupq_n_s32(0);
                    for h in 0..2 {
                        let q = ld_u8(arr(&w.qs, 32 * c + 16 * h));
                        let ql = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(15)));
                        let qh = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q));
                        lo = mac16(lo, ql, ld_s8(arr(&x.qs, 64 * c + 16 * h)));
                        hi = mac16(hi, qh, ld_s8(arr(&x.qs, 64 * c + 32 + 16 * h)));
                    }
                    for (j, s) in [(2 * c, lo), (2 * c + 1, hi)] {
                        let (sc, m) = scale_min_k4(j, &w.scales);
                        sumi += sc as i32 * vaddvq_s32(s);
                        summs += m as i32 * (r::q8k_bsum(x, 2 * j) + r::q8k_bsum(x, 2 * j + 1));
                    }
                }
                acc += r::k_term(w.d, w.dmin, x, sumi, summs);
            }
            acc
        }

        /// [`q4_k`] of one row and `N` inputs (of the row's length), each
        /// result its bits: each chunk's nibbles unpacked once for all
        /// inputs, each input's integer sums exact and its float step the
        /// same.
        #[target_feature(enable = $features)]
        pub(super) fn q4_k_n<const N: usize>(w: &[BlockQ4K], x: [&[BlockQ8K]; N]) -> [f32; N] {
            let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
            let mut acc = [0.0f32; N];
            for (i, w) in w[..n].iter().enumerate() {
                let (sumi, summs) = k4_sums_n(&w.scales, x.map(|x| &x[i]), |c, h| {
                    let q = ld_u8(arr(&w.qs, 32 * c + 16 * h));
                    let ql = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(15)));
                    (ql, vreinterpretq_s8_u8(vshrq_n_u8::<4>(q)))
                });
                for k in 0..N {
                    acc[k] += r::k_term(w.d, w.dmin, &x[k][i], sumi[k], summs[k]);
                }
            }
            acc
        }

        /// [`q5_k`] of one row and `N` inputs, each result its bits, as
        /// [`q4_k_n`]: the nibbles under their fifth bits unpacked once.
        #[target_feature(enable = $features)]
        pub(super) fn q5_k_n<const N: usize>(w: &[BlockQ5K], x: [&[BlockQ8K]; N]) -> [f32; N] {
            let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
            let mut acc = [0.0f32; N];
            for (i, w) in w[..n].iter().enumerate() {
                // `qh` of each half, shifted right by 2 after each chunk.
                let mut hq = [ld_u8(arr(&w.qh, 0)), ld_u8(arr(&w.qh, 16))];
                let (sumi, summs) = k4_sums_n(&w.scales, x.map(|x| &x[i]), |c, h| {
                    let q = ld_u8(arr(&w.qs, 32 * c + 16 * h));
                    let hb = hq[h];
                    let h0 = vshlq_n_u8::<4>(vandq_u8(hb, vdupq_n_u8(1)));
                    let h1 = vshlq_n_u8::<3>(vandq_u8(hb, vdupq_n_u8(2)));
                    hq[h] = vshrq_n_u8::<2>(hb);
                    (
                        vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(15)), h0)),
                        vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(q), h1)),
                    )
                });
                for k in 0..N {
                    acc[k] += r::k_term(w.d, w.dmin, &x[k][i], sumi[k], summs[k]);
                }
            }
            acc
        }

        /// A `Q4_K`/`Q5_K` super-block's integer sums against `N` inputs:
        /// `sumi` (each sub-block's products times its scale) and `summs`
        /// (its group sums times its min). `values(c, h)` gives half `h` of
        /// chunk `c` as the low and the high sub-block's values (called in
        /// order: chunk by chunk, each half in turn), unpacked once for all
        /// inputs.
        #[inline]
        #[target_feature(enable = $features)]
        fn k4_sums_n<const N: usize>(
            scales: &[u8; 12],
            x: [&BlockQ8K; N],
            mut values: impl FnMut(usize, usize) -> (int8x16_t, int8x16_t),
        ) -> ([i32; N], [i32; N]) {
            let mut sumi = [0i32; N];
            let mut summs = [0i32; N];
            for c in 0..4 {
                let mut lo = [vdupq_n_s32(0); N];
                let mut hi = [vdupq_n_s32(0); N];
                for h in 0..2 {
                    let (ql, qh) = values(c, h);
                    for ((lo, hi), x) in lo.iter_mut().zip(hi.iter_mut()).zip(x) {
                        *lo = mac16(*lo, ql, ld_s8(arr(&x.qs, 64 * c + 16 * h)));
                        *hi = mac16(*hi, qh, ld_s8(arr(&x.qs, 64 * c + 32 + 16 * h)));
                    }
                }
                for (j, s) in [(2 * c, &lo), (2 * c + 1, &hi)] {
                    let (sc, m) = scale_min_k4(j, scales);
                    for k in 0..N {
                        sumi[k] += sc as i32 * vaddvq_s32(s[k]);
                        summs[k] +=
                            m as i32 * (r::q8k_bsum(x[k], 2 * j) + r::q8k_bsum(x[k], 2 * j + 1));
                    }
                }
            }
            (sumi, summs)
        }

        /// [`iq4_xs`] of one row and `N` inputs, each result its bits: each
        /// sub-block's codebook values looked up once for all inputs.
        #[target_feature(enable = $features)]
        pub(super) fn iq4_xs_n<const N: usize>(
            w: &[BlockIQ4XS],
            x: [&[BlockQ8K]; N],
        ) -> [f32; N] {
            let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
            let table = ld_s8(&KVALUES_IQ4NL);
            let mut acc = [0.0f32; N];
            for (i, w) in w[..n].iter().enumerate() {
                let mut sumi = [0i32; N];
                for j in 0..8 {
                    let q = ld_u8(arr(&w.qs, 16 * j));
                    let lo = vqtbl1q_s8(table, vandq_u8(q, vdupq_n_u8(15)));
                    let hi = vqtbl1q_s8(table, vshrq_n_u8::<4>(q));
                    let sc = r::iq4xs_scale(w, j);
                    for (sumi, x) in sumi.iter_mut().zip(x) {
                        let y: &[i8; 32] = arr(&x[i].qs, 32 * j);
                        let s = mac16(vdupq_n_s32(0), lo, ld_s8(arr(y, 0)));
                        *sumi += sc * vaddvq_s32(mac16(s, hi, ld_s8(arr(y, 16))));
                    }
                }
                for k in 0..N {
                    acc[k] += (r::h(w.d) * r::q8k_d(&x[k][i])) * sumi[k] as f32;
                }
            }
            acc
        }

        /// [`q6_k`] of one row and `N` inputs (of the row's length), each
        /// result its bits, as [`q4_k_n`].
        #[target_feature(enable = $features)]
        pub(super) fn q6_k_n<const N: usize>(w: &[BlockQ6K], x: [&[BlockQ8K]; N]) -> [f32; N] {
            let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
            let mut acc = [0.0f32; N];
            for (i, w) in w[..n].iter().enumerate() {
                let mut sumi = [0i32; N];
                for half in 0..2 {
                    for g in 0..2 {
                        for (k, q) in q6_k_values(w, half, g).into_iter().enumerate() {
                            let q = vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32));
                            let sc = w.scales[8 * half + 2 * k + g] as i32;
                            for (sumi, x) in sumi.iter_mut().zip(x) {
                                let y = ld_s8(arr(&x[i].qs, 128 * half + 32 * k + 16 * g));
                                *sumi += sc * vaddvq_s32(mac16(vdupq_n_s32(0), q, y));
                            }
                        }
                    }
                }
                for k in 0..N {
                    acc[k] += (r::h(w.d) * r::q8k_d(&x[k][i])) * sumi[k] as f32;
                }
            }
            acc
        }

        /// Elements `128 half + 32 k + 16 g ..` `+ 16` of a `Q6_K` block for
        /// `k = 0..4`, as unsigned 6-bit values.
        #[inline]
        #[target_feature(enable = $features)]
        fn q6_k_values(w: &BlockQ6K, half: usize, g: usize) -> [uint8x16_t; 4] {
            let qa = ld_u8(arr(&w.ql, 64 * half + 16 * g));
            let qb = ld_u8(arr(&w.ql, 64 * half + 32 + 16 * g));
            let qh = ld_u8(arr(&w.qh, 32 * half + 16 * g));
            let m4 = vdupq_n_u8(15);
            let m3 = vdupq_n_u8(3);
            [
                vorrq_u8(vandq_u8(qa, m4), vshlq_n_u8::<4>(vandq_u8(qh, m3))),
                vorrq_u8(
                    vandq_u8(qb, m4),
                    vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(qh), m3)),
                ),
                vorrq_u8(
                    vshrq_n_u8::<4>(qa),
                    vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(qh), m3)),
                ),
                vorrq_u8(vshrq_n_u8::<4>(qb), vshlq_n_u8::<4>(vshrq_n_u8::<6>(qh))),
            ]
        }

        #[target_feature(enable = $features)]
        pub(super) fn q6_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let mut sumi = 0i32;
                for half in 0..2 {
                    for g in 0..2 {
                        for (k, q) in q6_k_values(w, half, g).into_iter().enumerate() {
                            let q = vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32));
                            let y = ld_s8(arr(&x.qs, 128 * half + 32 * k + 16 * g));
                            let s = vaddvq_s32(mac16(vdupq_n_s32(0), q, y));
                            sumi += w.scales[8 * half + 2 * k + g] as i32 * s;
                        }
                    }
                }
                acc += (r::h(w.d) * r::q8k_d(x)) * sumi as f32;
            }
            acc
        }

        #[target_feature(enable = $features)]
        pub(super) fn q2_k(w: &[BlockQ2K], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let mut summs = 0i32;
                for j in 0..16 {
                    summs += r::q8k_bsum(x, j) * (w.scales[j] >> 4) as i32;
                }
                let mut sumi = 0i32;
                for half in 0..2 {
                    for g in 0..2 {
                        let mut q = ld_u8(arr(&w.qs, 32 * half + 16 * g));
                        for s in 0..4 {
                            let v = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(3)));
                            let y = ld_s8(arr(&x.qs, 128 * half + 32 * s + 16 * g));
                            let sc = (w.scales[8 * half + 2 * s + g] & 15) as i32;
                            sumi += sc * vaddvq_s32(mac16(vdupq_n_s32(0), v, y));
                            q = vshrq_n_u8::<2>(q);
                        }
                    }
                }
                acc += r::k_term(w.d, w.dmin, x, sumi, summs);
            }
            acc
        }

        #[target_feature(enable = $features)]
        pub(super) fn q3_k(w: &[BlockQ3K], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let scales = scales_q3k(&w.scales);
                let mut sumi = 0i32;
                for g in 0..2 {
                    let mut hm = ld_u8(arr(&w.hmask, 16 * g));
                    for half in 0..2 {
                        let mut q = ld_u8(arr(&w.qs, 32 * half + 16 * g));
                        for s in 0..4 {
                            // 4 where the high bit is clear, else 0.
                            let sub = vshlq_n_u8::<2>(vbicq_u8(vdupq_n_u8(1), hm));
                            let v = vsubq_s8(
                                vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(3))),
                                vreinterpretq_s8_u8(sub),
                            );
                            let y = ld_s8(arr(&x.qs, 128 * half + 32 * s + 16 * g));
                            let sc = scales[8 * half + 2 * s + g] as i32;
                            sumi += sc * vaddvq_s32(mac16(vdupq_n_s32(0), v, y));
                            q = vshrq_n_u8::<2>(q);
                            hm = vshrq_n_u8::<1>(hm);
                        }
                    }
                }
                acc += (r::h(w.d) * r::q8k_d(x)) * sumi as f32;
            }
            acc
        }

        #[target_feature(enable = $features)]
        pub(super) fn q5_k(w: &[BlockQ5K], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let mut sumi = 0i32;
                let mut summs = 0i32;
                let mut hq = [ld_u8(arr(&w.qh, 0)), ld_u8(arr(&w.qh, 16))];
                for c in 0..4 {
                    let mut lo = vdupq_n_s32(0);
                    let mut hi = vdupq_n_s32(0);
                    for (h, hb) in hq.iter_mut().enumerate() {
                        let q = ld_u8(arr(&w.qs, 32 * c + 16 * h));
                        let h0 = vshlq_n_u8::<4>(vandq_u8(*hb, vdupq_n_u8(1)));
                        let h1 = vshlq_n_u8::<3>(vandq_u8(*hb, vdupq_n_u8(2)));
                        let ql = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(15)), h0));
                        let qh = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(q), h1));
                        lo = mac16(lo, ql, ld_s8(arr(&x.qs, 64 * c + 16 * h)));
                        hi = mac16(hi, qh, ld_s8(arr(&x.qs, 64 * c + 32 + 16 * h)));
                        *hb = vshrq_n_u8::<2>(*hb);
                    }
                    for (j, s) in [(2 * c, lo), (2 * c + 1, hi)] {
                        let (sc, m) = scale_min_k4(j, &w.scales);
                        sumi += sc as i32 * vaddvq_s32(s);
                        summs += m as i32 * (r::q8k_bsum(x, 2 * j) + r::q8k_bsum(x, 2 * j + 1));
                    }
                }
                acc += r::k_term(w.d, w.dmin, x, sumi, summs);
            }
            acc
        }

        #[target_feature(enable = $features)]
        pub(super) fn iq4_xs(w: &[BlockIQ4XS], x: &[BlockQ8K]) -> f32 {
            let mut acc = 0.0f32;
            for (w, x) in w.iter().zip(x) {
                let mut sumi = 0i32;
                for j in 0..8 {
                    sumi += r::iq4xs_scale(w, j) * isum_table(&KVALUES_IQ4NL, arr(&w.qs, 16 * j), arr(&x.qs, 32 * j));
                }
                acc += (r::h(w.d) * r::q8k_d(x)) * sumi as f32;
            }
            acc
        }
    };
}

/// The integer kernels for every aarch64 CPU: products widened with `vmull_s8`.
mod plain {
    int_kernels!(
        "neon",
        #[inline]
        #[target_feature(enable = "neon")]
        fn mac16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
            let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
            let hi = vmull_s8(vget_high_s8(a), vget_high_s8(b));
            vpadalq_s16(vpadalq_s16(acc, lo), hi)
        }
    );
}

/// The integer kernels with ARMv8.2's dot-product instructions: `sdot` sums four
/// products into each lane. Its intrinsic (`vdotq_s32`) is not stable in Rust, so
/// the instruction is written out.
mod dot {
    int_kernels!(
        "neon,dotprod",
        #[inline]
        #[target_feature(enable = "neon,dotprod")]
        fn mac16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
            let mut acc = acc;
            // SAFETY: `sdot` reads and writes the three vector registers only; this
            // function is compiled with `dotprod` and reached only through a
            // `NeonDot`, which exists only on CPUs that have it.
            unsafe {
                core::arch::asm!(
                    "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
                    acc = inout(vreg) acc,
                    a = in(vreg) a,
                    b = in(vreg) b,
                    options(pure, nomem, nostack, preserves_flags),
                );
            }
            acc
        }
    );
}
