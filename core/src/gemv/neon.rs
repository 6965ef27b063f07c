//! NEON (Advanced SIMD) kernels for aarch64.
//!
//! # Soundness
//!
//! This module is compiled only when NEON is enabled for the whole build
//! (`cfg(target_feature = "neon")`, part of every aarch64 Linux, Android and Apple
//! target), so the NEON instructions it uses exist on every CPU the binary can run
//! on and no run-time check is needed. The only `unsafe` blocks are loads and stores
//! through pointers taken from references to arrays of exactly the accessed size.
//!
//! # Exactness
//!
//! Integer products are widened (`vmull_s8`: i8 x i8 into i16, exact for all inputs
//! including -128) and summed pairwise into i32 (`vpadalq_s16`), so block sums are
//! exact; the float steps are the reference's own helpers, or fused multiply-adds
//! (`vfmaq_f32`) in the lane order of [`super::reference`].
#![allow(unsafe_code)]

use core::arch::aarch64::*;

use super::reference::{self as r, FLOAT_LANES};
use super::Kernels;
use crate::quant::blocks::{BlockQ4K, BlockQ4_0, BlockQ6K, BlockQ8K, BlockQ8_0};
use crate::quant::kscales::scale_min_k4;

/// The NEON kernels (NEON is a compile-time feature here, so no run-time token).
#[derive(Clone, Copy)]
pub(crate) struct Neon;

macro_rules! forward {
    ($($name:ident($w:ty, $x:ty);)*) => {
        $(
            #[inline]
            fn $name(self, w: $w, x: $x) -> f32 {
                // SAFETY: this module is only compiled with NEON enabled for the
                // whole build, so every CPU running this code has NEON.
                unsafe { $name(w, x) }
            }
        )*
    };
}

impl Kernels for Neon {
    forward! {
        f32(&[u8], &[f32]);
        bf16(&[u8], &[f32]);
        q4_0(&[BlockQ4_0], &[BlockQ8_0]);
        q8_0(&[BlockQ8_0], &[BlockQ8_0]);
        q4_k(&[BlockQ4K], &[BlockQ8K]);
        q6_k(&[BlockQ6K], &[BlockQ8K]);
    }
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

/// Adds the exact products `a[i] * b[i]` of 16 i8 pairs to four i32 partial sums.
#[inline]
#[target_feature(enable = "neon")]
fn mac16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    let hi = vmull_s8(vget_high_s8(a), vget_high_s8(b));
    vpadalq_s16(vpadalq_s16(acc, lo), hi)
}

#[inline]
#[target_feature(enable = "neon")]
fn dot_i8_32(a: &[i8; 32], b: &[i8; 32]) -> i32 {
    let acc = mac16(vdupq_n_s32(0), ld_s8(arr(a, 0)), ld_s8(arr(b, 0)));
    vaddvq_s32(mac16(acc, ld_s8(arr(a, 16)), ld_s8(arr(b, 16))))
}

#[inline]
#[target_feature(enable = "neon")]
fn isum_q4_0(w: &BlockQ4_0, x: &BlockQ8_0) -> i32 {
    let q = ld_u8(&w.qs);
    let eight = vdupq_n_s8(8);
    let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(15))), eight);
    let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(q)), eight);
    let acc = mac16(vdupq_n_s32(0), lo, ld_s8(arr(&x.qs, 0)));
    vaddvq_s32(mac16(acc, hi, ld_s8(arr(&x.qs, 16))))
}

#[target_feature(enable = "neon")]
fn q4_0(w: &[BlockQ4_0], x: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; r::BLOCK_LANES];
    for (b, (w, x)) in w.iter().zip(x).enumerate() {
        acc[b % r::BLOCK_LANES] += r::term(w.d, x.d, isum_q4_0(w, x));
    }
    r::fold(acc)
}

#[target_feature(enable = "neon")]
fn q8_0(w: &[BlockQ8_0], x: &[BlockQ8_0]) -> f32 {
    let mut acc = [0.0f32; r::BLOCK_LANES];
    for (b, (w, x)) in w.iter().zip(x).enumerate() {
        acc[b % r::BLOCK_LANES] += r::term(w.d, x.d, dot_i8_32(&w.qs, &x.qs));
    }
    r::fold(acc)
}

macro_rules! float_kernel {
    ($name:ident, $wbytes:expr, |$c:ident| $load:expr, $elems:path) => {
        #[target_feature(enable = "neon")]
        fn $name(w: &[u8], x: &[f32]) -> f32 {
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

#[target_feature(enable = "neon")]
fn q4_k(w: &[BlockQ4K], x: &[BlockQ8K]) -> f32 {
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
        let dx = r::q8k_d(x);
        acc += (r::h(w.d) * dx) * sumi as f32 - (r::h(w.dmin) * dx) * summs as f32;
    }
    acc
}

#[target_feature(enable = "neon")]
fn q6_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut sumi = 0i32;
        for half in 0..2 {
            for g in 0..2 {
                // Elements 128*half + 32*k + 16*g .. + 16 for k = 0..4.
                let qa = ld_u8(arr(&w.ql, 64 * half + 16 * g));
                let qb = ld_u8(arr(&w.ql, 64 * half + 32 + 16 * g));
                let qh = ld_u8(arr(&w.qh, 32 * half + 16 * g));
                let m4 = vdupq_n_u8(15);
                let m3 = vdupq_n_u8(3);
                let q = [
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
                ];
                for (k, q) in q.into_iter().enumerate() {
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
