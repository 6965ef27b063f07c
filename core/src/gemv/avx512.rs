//! AVX-512 (F, BW, VL) kernels for x86-64, and the AVX-512 VNNI token.
//!
//! # Soundness
//!
//! As in the AVX2 module: the kernels are `#[target_feature]` functions reachable
//! only through [`Avx512`], a token whose constructor checks AVX-512 F/BW/VL (and
//! AVX2, FMA, F16C, which it implies here) at run time, or [`Avx512Vnni`], which
//! also checks AVX-512 VNNI; the other `unsafe` blocks are unaligned loads and
//! stores from references to arrays of exactly the accessed size. Types without a
//! 512-bit kernel use the AVX2 kernels, which the same check covers. With VNNI,
//! `Q6_K` has a 512-bit kernel here and `Q4_K`, `Q5_K` and the 32-element
//! formats the 256-bit ones of [`super::vnni::evex`].
//!
//! # Exactness
//!
//! The same arguments as for AVX2: exact `i32` block sums (no saturating step), and
//! float steps that mirror [`super::reference`].
#![allow(unsafe_code)]

use core::arch::x86_64::*;

use super::avx2::{self, arr, arr_mut, hx, ld128, ld256, sc2, Avx2};
use super::reference::{self as r, FLOAT_LANES};
use super::vnni::{evex, inner_group_methods, inner_methods, vnni_methods};
use super::Kernels;
use crate::quant::blocks::{
    BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS, BlockIQ4NL,
    BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
};

/// Proof that the CPU supports AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[derive(Clone, Copy)]
pub(crate) struct Avx512(Avx2);

impl Avx512 {
    /// The token, if the CPU has the features.
    pub(crate) fn new() -> Option<Self> {
        if super::cpuid::has_avx512() {
            Avx2::new().map(Avx512)
        } else {
            None
        }
    }
}

/// Proof that the CPU supports AVX-512 VNNI besides everything [`Avx512`] needs.
#[derive(Clone, Copy)]
pub(crate) struct Avx512Vnni(Avx512);

impl Avx512Vnni {
    /// The token, if the CPU has the features.
    pub(crate) fn new() -> Option<Self> {
        if super::cpuid::has_avx512_vnni() {
            Avx512::new().map(Avx512Vnni)
        } else {
            None
        }
    }
}

macro_rules! forward {
    ($($name:ident($w:ty, $x:ty);)*) => {
        $(
            #[inline]
            fn $name(self, w: $w, x: $x) -> f32 {
                // SAFETY: `self` is an `Avx512` token, which exists only if the CPU
                // supports AVX-512 F/BW/VL, AVX2, FMA and F16C (`Avx512::new`).
                unsafe { $name(w, x) }
            }
        )*
    };
}

impl Kernels for Avx512 {
    const PREFETCHES: bool = true;

    #[inline]
    fn prefetch(self, bytes: &[u8]) {
        self.0.prefetch(bytes)
    }

    forward! {
        f32(&[u8], &[f32]);
        f16(&[u8], &[f32]);
        bf16(&[u8], &[f32]);
        q6_k(&[BlockQ6K], &[BlockQ8K]);
    }
    // The AVX2 kernels' grouped products (each result their one-input
    // kernel's bits).
    inner_group_methods! {
        q4_k_n(BlockQ4K);
        q5_k_n(BlockQ5K);
        iq4_xs_n(BlockIQ4XS);
        iq1_s_n(BlockIQ1S);
        iq1_m_n(BlockIQ1M);
    }
    super::lattice_group_methods!(inner_group_methods! {});
    inner_methods! {
        // The AVX2 kernels (`cargo bench -p les-core --bench gemv`: a 512-bit
        // `Q8_0` one widening to `i16` measured 0.79x of AVX2's; a 512-bit `Q4_K`
        // one needs shuffles for its scale multipliers).
        q8_0(&[BlockQ8_0], &[BlockQ8_0]);
        q4_k(&[BlockQ4K], &[BlockQ8K]);
        q4_0(&[BlockQ4_0], &[BlockQ8_0]);
        q4_1(&[BlockQ4_1], &[BlockQ8_1]);
        q5_0(&[BlockQ5_0], &[BlockQ8_0]);
        q5_1(&[BlockQ5_1], &[BlockQ8_1]);
        iq4_nl(&[BlockIQ4NL], &[BlockQ8_0]);
        mxfp4(&[BlockMXFP4], &[BlockQ8_0]);
        q2_k(&[BlockQ2K], &[BlockQ8K]);
        q3_k(&[BlockQ3K], &[BlockQ8K]);
        q5_k(&[BlockQ5K], &[BlockQ8K]);
        iq4_xs(&[BlockIQ4XS], &[BlockQ8K]);
    }
    super::lattice_methods!(inner_methods! {});
}

impl Kernels for Avx512Vnni {
    const PREFETCHES: bool = true;

    #[inline]
    fn prefetch(self, bytes: &[u8]) {
        self.0.prefetch(bytes)
    }

    vnni_methods!(evex);
    #[inline]
    fn q6_k(self, w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
        // SAFETY: an `Avx512Vnni` token exists only if the CPU supports AVX-512
        // VNNI and everything `Avx512` needs (`Avx512Vnni::new`).
        unsafe { q6_k_vnni(w, x) }
    }
    #[inline]
    fn q4_k_n<const N: usize>(self, w: &[BlockQ4K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: as for `q6_k`: the token proves the kernels' features.
        unsafe { evex::q4_k_vnni_n(w, x) }
    }
    #[inline]
    fn q5_k_n<const N: usize>(self, w: &[BlockQ5K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: as for `q6_k`.
        unsafe { evex::q5_k_vnni_n(w, x) }
    }
    #[inline]
    fn q6_k_n<const N: usize>(self, w: &[BlockQ6K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: as for `q6_k`.
        unsafe { q6_k_vnni_n(w, x) }
    }
    inner_group_methods! {
        iq4_xs_n(BlockIQ4XS);
        iq1_s_n(BlockIQ1S);
        iq1_m_n(BlockIQ1M);
    }
    super::lattice_group_methods!(inner_group_methods! {});
    inner_methods! {
        f32(&[u8], &[f32]);
        f16(&[u8], &[f32]);
        bf16(&[u8], &[f32]);
        q2_k(&[BlockQ2K], &[BlockQ8K]);
        q3_k(&[BlockQ3K], &[BlockQ8K]);
        iq4_xs(&[BlockIQ4XS], &[BlockQ8K]);
    }
    super::lattice_methods!(inner_methods! {});
}

/// Loads 64 signed bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn ld512i(a: &[i8; 64]) -> __m512i {
    // SAFETY: reads exactly the 64 bytes of `a`; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

/// Loads 64 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn ld512(a: &[u8; 64]) -> __m512i {
    // SAFETY: reads exactly the 64 bytes of `a`; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
}

/// Loads 16 floats.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn ldps(a: &[f32; 16]) -> __m512 {
    // SAFETY: reads exactly the 16 floats of `a`; `loadu` has no alignment requirement.
    unsafe { _mm512_loadu_ps(a.as_ptr()) }
}

/// `[lo | hi]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

// ---------------------------------------------------------------------------------
// Float weights.

macro_rules! float_kernel {
    ($name:ident, $wbytes:expr, |$c:ident| $load:expr, $elems:path) => {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        fn $name(w: &[u8], x: &[f32]) -> f32 {
            const WB: usize = $wbytes;
            let n = (w.len() / WB).min(x.len());
            let full = n / FLOAT_LANES * FLOAT_LANES;
            let mut acc = [_mm512_setzero_ps(); 4];
            for (wc, xc) in w[..full * WB]
                .chunks_exact(FLOAT_LANES * WB)
                .zip(x[..full].chunks_exact(FLOAT_LANES))
            {
                for (k, a) in acc.iter_mut().enumerate() {
                    let $c = arr::<u8, { 16 * WB }>(wc, 16 * WB * k);
                    let wv = $load;
                    *a = _mm512_fmadd_ps(wv, ldps(arr(xc, 16 * k)), *a);
                }
            }
            let mut lanes = [0.0f32; FLOAT_LANES];
            for (k, a) in acc.iter().enumerate() {
                let out: &mut [f32; 16] = arr_mut(&mut lanes, 16 * k);
                // SAFETY: writes exactly the 16 floats of `out`; no alignment
                // requirement.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *a) };
            }
            r::finish_float(lanes, $elems(w, full), x, full)
        }
    };
}

float_kernel!(
    f32,
    4,
    |c| {
        let c: &[u8; 64] = c;
        // SAFETY: reads exactly the 64 bytes of `c`; no alignment requirement.
        _mm512_castsi512_ps(unsafe { _mm512_loadu_si512(c.as_ptr().cast()) })
    },
    r::f32_elems
);
float_kernel!(f16, 2, |c| _mm512_cvtph_ps(ld256(c)), r::f16_elems);
float_kernel!(
    bf16,
    2,
    |c| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(ld256(c)))),
    r::bf16_elems
);

// ---------------------------------------------------------------------------------
// K-quants.

/// Four `i16` values, each filling one 128-bit lane (scales, or permute indices
/// selecting them).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn sc4(a: i16, b: i16, c: i16, d: i16) -> __m512i {
    join(sc2(a, b), sc2(c, d))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn q6_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    let m4 = _mm512_set1_epi8(0x0f);
    let m3 = _mm512_set1_epi8(0x03);
    let m32 = _mm512_set1_epi8(32);
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let scales: &[u8; 16] = &w.scales.map(|s| s as u8);
        let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(ld128(scales)));
        let mut v = _mm512_setzero_si512();
        for half in 0..2 {
            let ql = join(
                ld256(arr(&w.ql, 64 * half)),
                ld256(arr(&w.ql, 64 * half + 32)),
            );
            let qh = ld256(arr(&w.qh, 32 * half));
            let qh = join(qh, _mm256_srli_epi16::<2>(qh));
            // Elements 0..64 of the half: low nibbles of ql with bits 0-1 / 2-3 of qh;
            // elements 64..128: high nibbles with bits 4-5 / 6-7.
            let h01 = _mm512_slli_epi16::<4>(_mm512_and_si512(qh, m3));
            let h23 = _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srli_epi16::<4>(qh), m3));
            let q01 = _mm512_or_si512(_mm512_and_si512(ql, m4), h01);
            let q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), h23);
            for (k, q) in [q01, q23].into_iter().enumerate() {
                let y = ld512i(arr(&x.qs, 128 * half + 64 * k));
                let p = _mm512_sub_epi16(_mm512_maddubs_epi16(q, y), _mm512_maddubs_epi16(m32, y));
                let i = (8 * half + 4 * k) as i16;
                let scv = _mm512_permutexvar_epi16(sc4(i, i + 1, i + 2, i + 3), sc);
                v = _mm512_add_epi32(v, _mm512_madd_epi16(p, scv));
            }
        }
        let sumi = _mm512_reduce_add_epi32(v);
        acc += (hx(w.d) * r::q8k_d(x)) * sumi as f32;
    }
    acc
}

/// `vpermw` indices over the sixteen `Q6_K` scales (as `i16`) that give half
/// `h`'s multipliers after `vpackssdw`: in 128-bit lane `i`, `i16` lanes 0-3 hold
/// the scale of sub-block `8h + i` and lanes 4-7 that of sub-block `8h + 4 + i`.
/// (Little-endian bytes of the `u16` indices.)
const Q6K_HALF_SCALES: [[u8; 64]; 2] = {
    let mut idx = [[0u8; 64]; 2];
    let mut h = 0;
    while h < 2 {
        let mut k = 0;
        while k < 32 {
            idx[h][2 * k] = (8 * h + k / 8 + 4 * (k % 8 / 4)) as u8;
            k += 1;
        }
        h += 1;
    }
    idx
};

/// [`q6_k`] with AVX-512 VNNI: `vpdpbusd` sums four products of the unsigned
/// 6-bit values (0..64) per `i32` lane, at most 4 * 63 * 128 in magnitude, so two
/// sub-blocks pack to `i16` exactly and one `vpmaddwd` scales them; the offset of
/// 32 is subtracted once per super-block as `32 * sum_j scale_j * bsum_j`, from the
/// activations' group sums. The same exact `sumi`, the same float step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6_k_vnni(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    q6_k_vnni_n::<1>(w, [x])[0]
}

/// [`q6_k_vnni`] of one row and `N` inputs (of the row's length), each result
/// its bits: the 6-bit values and the scales' multipliers are unpacked once for
/// all the inputs, and each input gets the same exact `sumi` and float step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6_k_vnni_n<const N: usize>(w: &[BlockQ6K], x: [&[BlockQ8K]; N]) -> [f32; N] {
    let m4 = _mm512_set1_epi8(0x0f);
    let m30 = _mm512_set1_epi8(0x30);
    let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    let zero = _mm512_setzero_si512();
    let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
    let mut acc = [0.0f32; N];
    for (i, w) in w[..n].iter().enumerate() {
        let scales: &[u8; 16] = &w.scales.map(|s| s as u8);
        let sc16 = _mm256_cvtepi8_epi16(ld128(scales));
        let sc = _mm512_castsi256_si512(sc16);
        // A loop, not `x.map`: the closure was not inlined (a call a block).
        let mut offset = [0i32; N];
        for (o, x) in offset.iter_mut().zip(x) {
            let bsums: &[u8; 32] = x[i].bsums.as_flattened().try_into().expect("32 bytes");
            *o = avx2::hsum(_mm256_madd_epi16(sc16, ld256(bsums)));
        }
        let mut v = [zero; N];
        for (half, pick) in Q6K_HALF_SCALES.iter().enumerate() {
            let ql = ld512(arr(&w.ql, 64 * half));
            let qh = _mm512_broadcast_i64x4(ld256(arr(&w.qh, 32 * half)));
            let qh = _mm512_srlv_epi16(qh, shifts);
            let h01 = _mm512_and_si512(_mm512_slli_epi16::<4>(qh), m30);
            let h23 = _mm512_and_si512(qh, m30);
            let q01 = _mm512_ternarylogic_epi32::<0xEA>(ql, m4, h01);
            let q23 = _mm512_ternarylogic_epi32::<0xEA>(_mm512_srli_epi16::<4>(ql), m4, h23);
            let mult = _mm512_permutexvar_epi16(ld512(pick), sc);
            for (v, x) in v.iter_mut().zip(x) {
                let s01 = _mm512_dpbusd_epi32(zero, q01, ld512i(arr(&x[i].qs, 128 * half)));
                let s23 = _mm512_dpbusd_epi32(zero, q23, ld512i(arr(&x[i].qs, 128 * half + 64)));
                *v = _mm512_add_epi32(*v, _mm512_madd_epi16(_mm512_packs_epi32(s01, s23), mult));
            }
        }
        for c in 0..N {
            let sumi = _mm512_reduce_add_epi32(v[c]) - 32 * offset[c];
            acc[c] += (hx(w.d) * r::q8k_d(&x[c][i])) * sumi as f32;
        }
    }
    acc
}
