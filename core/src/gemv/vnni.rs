//! 256-bit kernels that sum integer products with `vpdpbusd`, built twice from
//! one source: with AVX-512 VNNI (EVEX encoding, [`evex`], for
//! [`Avx512Vnni`](super::avx512::Avx512Vnni)) and with AVX-VNNI (VEX encoding,
//! [`vex`], for [`AvxVnni`], the CPUs that have VNNI without AVX-512, such as
//! Intel's since Alder Lake).
//!
//! # Soundness and exactness
//!
//! As in the AVX2 module: the kernels are `#[target_feature]` functions reachable
//! only through tokens whose constructors check the features at run time, and the
//! other `unsafe` blocks are loads from references of exactly the accessed size.
//! Every `vpdpbusd` lane sums four products of an unsigned byte of at most 255 and
//! a signed byte, so nothing overflows `i32`; where two sub-blocks are packed to
//! `i16` their values are at most 31 (`Q4_K`, `Q5_K`), so nothing saturates. The
//! integers equal the reference's, and the float steps are the AVX2 kernels'.
#![allow(unsafe_code)]

use super::avx2::Avx2;
use super::Kernels;
use crate::quant::blocks::{
    BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS, BlockIQ4NL,
    BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1,
};

/// Byte indices for `vpshufb` over the eight scales (in both 128-bit lanes) that
/// give chunk `c`'s multipliers: in each 128-bit lane, `i16` lanes 0-3 hold scale
/// `2c` and lanes 4-7 scale `2c + 1` (`0x80` = zero high bytes), matching the
/// lane order of `vpackssdw` over sub-blocks `2c` and `2c + 1`.
const CHUNK_SCALES: [[u8; 32]; 4] = {
    let mut idx = [[0x80u8; 32]; 4];
    let mut c = 0;
    while c < 4 {
        let mut k = 0;
        while k < 16 {
            // i16 lane k % 8 of 128-bit lane k / 8.
            idx[c][2 * k] = (2 * c + k % 8 / 4) as u8;
            k += 1;
        }
        c += 1;
    }
    idx
};

/// The kernels, for one encoding: `$features` to compile them with, `$dpbusd` the
/// intrinsic of that encoding.
macro_rules! vnni_kernels {
    ($features:literal, $dpbusd:ident) => {
        use core::arch::x86_64::*;

        use crate::gemv::avx2::{
            self, acc4, acc4_e8m0, acc4_m, arr, blocks32_kernel, hsum, hsum4, k4_kernel,
            k4_kernel_n, k4_term, k4_terms2, lanes4, lanes4i, ld256, ld256i, term, term_e8m0,
            term_m,
        };
        use crate::gemv::reference as r;
        use crate::quant::blocks::{
            BlockIQ4NL, BlockMXFP4, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
            BlockQ8K, BlockQ8_0, BlockQ8_1, KVALUES_IQ4NL, KVALUES_MXFP4,
        };
        use crate::quant::kscales::scales_mins_k4;

        /// Eight `i32` partial sums of `sum(u[i] * x[i]) - off * sum(x[i])` over a
        /// 32-element block, for unsigned `u` (0..=255) and signed `x`, with `vpdpbusd`:
        /// exact (each `vpdpbusd` lane sums four products, at most 4 * 255 * 128).
        /// Signed weights `w` enter as `u = w + 128` (the sign bit flipped), `off = 128`.
        #[inline]
        #[target_feature(enable = $features)]
        fn dot_u_off_vnni(u: __m256i, off: i8, x: __m256i) -> __m256i {
            let zero = _mm256_setzero_si256();
            let s = $dpbusd(zero, u, x);
            if off == 0 {
                s
            } else {
                _mm256_sub_epi32(s, $dpbusd(zero, _mm256_set1_epi8(off), x))
            }
        }

        /// Signed bytes as the unsigned `w + 128` of [`dot_u_off_vnni`].
        #[inline]
        #[target_feature(enable = $features)]
        fn flip(w: __m256i) -> __m256i {
            _mm256_xor_si256(w, _mm256_set1_epi8(i8::MIN))
        }

        blocks32_kernel!(
            $features,
            pub(crate) q8_0_vnni,
            BlockQ8_0,
            BlockQ8_0,
            |w, x| dot_u_off_vnni(flip(ld256i(&w.qs)), i8::MIN, ld256i(&x.qs))
        );
        blocks32_kernel!(
            $features,
            pub(crate) q4_0_vnni,
            BlockQ4_0,
            BlockQ8_0,
            |w, x| dot_u_off_vnni(avx2::nib32(&w.qs), 8, ld256i(&x.qs))
        );
        blocks32_kernel!(
            $features,
            pub(crate) q4_1_vnni,
            BlockQ4_1,
            BlockQ8_1,
            |w, x| dot_u_off_vnni(avx2::nib32(&w.qs), 0, ld256i(&x.qs))
        );
        blocks32_kernel!(
            $features,
            pub(crate) q5_0_vnni,
            BlockQ5_0,
            BlockQ8_0,
            |w, x| {
                let hb = _mm256_and_si256(avx2::bits32(w.qh), _mm256_set1_epi8(0x10));
                dot_u_off_vnni(_mm256_or_si256(avx2::nib32(&w.qs), hb), 16, ld256i(&x.qs))
            }
        );
        blocks32_kernel!(
            $features,
            pub(crate) q5_1_vnni,
            BlockQ5_1,
            BlockQ8_1,
            |w, x| {
                let hb = _mm256_and_si256(avx2::bits32(w.qh), _mm256_set1_epi8(0x10));
                dot_u_off_vnni(_mm256_or_si256(avx2::nib32(&w.qs), hb), 0, ld256i(&x.qs))
            }
        );
        blocks32_kernel!(
            $features,
            pub(crate) iq4_nl_vnni,
            BlockIQ4NL,
            BlockQ8_0,
            |w, x| {
                let k = _mm256_shuffle_epi8(avx2::codebook(&KVALUES_IQ4NL), avx2::nib32(&w.qs));
                dot_u_off_vnni(flip(k), i8::MIN, ld256i(&x.qs))
            }
        );
        blocks32_kernel!(
            $features,
            pub(crate) mxfp4_vnni,
            BlockMXFP4,
            BlockQ8_0,
            |w, x| {
                let k = _mm256_shuffle_epi8(avx2::codebook(&KVALUES_MXFP4), avx2::nib32(&w.qs));
                dot_u_off_vnni(flip(k), i8::MIN, ld256i(&x.qs))
            }
        );

        /// A `Q4_K`/`Q5_K` super-block's eight `i32` partial sums of `sumi` and of
        /// `summs` with `vpdpbusd`, as [`avx2::q4_k_sums`] gives them: `values(c)` is
        /// chunk `c`'s two sub-blocks of unsigned values (0..32). `vpdpbusd` sums four
        /// value-times-byte products per `i32` lane (at most 4 * 31 * 128 in
        /// magnitude), two sub-blocks are packed to `i16` (exact, nothing saturates)
        /// and scaled with one `vpmaddwd`: the same exact integers in fewer
        /// instructions.
        #[inline]
        #[target_feature(enable = $features)]
        fn k4_sums_vnni(
            packed_scales: &[u8; 12],
            x: &BlockQ8K,
            mut values: impl FnMut(usize) -> (__m256i, __m256i),
        ) -> (__m256i, __m256i) {
            let (sc, mins) = scales_mins_k4(packed_scales);
            // The eight scales in every 64-bit lane, for `CHUNK_SCALES` to pick from.
            let scales = _mm256_set1_epi64x(i64::from_le_bytes(sc));
            let bsums: &[u8; 32] = x.bsums.as_flattened().try_into().expect("32 bytes");
            let m = _mm256_madd_epi16(ld256(bsums), avx2::pairs8(mins));
            let zero = _mm256_setzero_si256();
            let mut v = _mm256_setzero_si256();
            for (c, pick) in super::CHUNK_SCALES.iter().enumerate() {
                let (lo, hi) = values(c);
                let sa = $dpbusd(zero, lo, avx2::y32(x, 64 * c));
                let sb = $dpbusd(zero, hi, avx2::y32(x, 64 * c + 32));
                let mult = _mm256_shuffle_epi8(scales, ld256(pick));
                v = _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_packs_epi32(sa, sb), mult));
            }
            (v, m)
        }

        /// [`k4_sums_vnni`] of a `Q4_K` super-block: the low and high nibbles.
        #[inline]
        #[target_feature(enable = $features)]
        fn q4_k_sums_vnni(w: &BlockQ4K, x: &BlockQ8K) -> (__m256i, __m256i) {
            k4_sums_vnni(&w.scales, x, |c| avx2::nibbles32(arr(&w.qs, 32 * c)))
        }

        /// [`k4_sums_vnni`] of a `Q5_K` super-block: the nibbles under the fifth bits.
        #[inline]
        #[target_feature(enable = $features)]
        fn q5_k_sums_vnni(w: &BlockQ5K, x: &BlockQ8K) -> (__m256i, __m256i) {
            // `hq` is qh shifted right by 2c for chunk c (see `avx2::q5_k_chunk`).
            let mut hq = ld256(&w.qh);
            k4_sums_vnni(&w.scales, x, |c| {
                let values = avx2::q5_k_chunk(w, c, hq);
                hq = _mm256_srli_epi16::<2>(hq);
                values
            })
        }

        k4_kernel!(
            $features,
            pub(crate) q4_k_vnni,
            BlockQ4K,
            q4_k_sums_vnni
        );

        /// [`k4_sums_vnni`] of one super-block against `N` inputs: each
        /// chunk's values (`values(c)`), the scales and their multipliers
        /// unpacked once for all of them. Each input's sums are the exact
        /// integers `k4_sums_vnni` gives it.
        #[inline]
        #[target_feature(enable = $features)]
        fn k4_sums_vnni_n<const N: usize>(
            packed_scales: &[u8; 12],
            x: [&BlockQ8K; N],
            mut values: impl FnMut(usize) -> (__m256i, __m256i),
        ) -> [(__m256i, __m256i); N] {
            let (sc, mins) = scales_mins_k4(packed_scales);
            let scales = _mm256_set1_epi64x(i64::from_le_bytes(sc));
            let pm = avx2::pairs8(mins);
            let zero = _mm256_setzero_si256();
            let mut out = [(zero, zero); N];
            for (o, x) in out.iter_mut().zip(x) {
                let bsums: &[u8; 32] = x.bsums.as_flattened().try_into().expect("32 bytes");
                o.1 = _mm256_madd_epi16(ld256(bsums), pm);
            }
            for (c, pick) in super::CHUNK_SCALES.iter().enumerate() {
                let (lo, hi) = values(c);
                let mult = _mm256_shuffle_epi8(scales, ld256(pick));
                for (o, x) in out.iter_mut().zip(x) {
                    let sa = $dpbusd(zero, lo, avx2::y32(x, 64 * c));
                    let sb = $dpbusd(zero, hi, avx2::y32(x, 64 * c + 32));
                    let t = _mm256_madd_epi16(_mm256_packs_epi32(sa, sb), mult);
                    o.0 = _mm256_add_epi32(o.0, t);
                }
            }
            out
        }

        /// [`q4_k_sums_vnni`] against `N` inputs ([`k4_sums_vnni_n`]).
        #[inline]
        #[target_feature(enable = $features)]
        fn q4_k_sums_vnni_n<const N: usize>(
            w: &BlockQ4K,
            x: [&BlockQ8K; N],
        ) -> [(__m256i, __m256i); N] {
            k4_sums_vnni_n(&w.scales, x, |c| avx2::nibbles32(arr(&w.qs, 32 * c)))
        }

        /// [`q5_k_sums_vnni`] against `N` inputs ([`k4_sums_vnni_n`]).
        #[inline]
        #[target_feature(enable = $features)]
        fn q5_k_sums_vnni_n<const N: usize>(
            w: &BlockQ5K,
            x: [&BlockQ8K; N],
        ) -> [(__m256i, __m256i); N] {
            let mut hq = ld256(&w.qh);
            k4_sums_vnni_n(&w.scales, x, |c| {
                let values = avx2::q5_k_chunk(w, c, hq);
                hq = _mm256_srli_epi16::<2>(hq);
                values
            })
        }

        // [`q4_k_vnni`] of one row and `N` inputs, each result its bits.
        k4_kernel_n!($features, pub(crate) q4_k_vnni_n, BlockQ4K, q4_k_sums_vnni_n);
        k4_kernel!(
            $features,
            pub(crate) q5_k_vnni,
            BlockQ5K,
            q5_k_sums_vnni
        );
        // [`q5_k_vnni`] of one row and `N` inputs, each result its bits.
        k4_kernel_n!($features, pub(crate) q5_k_vnni_n, BlockQ5K, q5_k_sums_vnni_n);
    };
}

/// The kernels with AVX-512 VNNI (`vpdpbusd` on YMM registers, EVEX encoded).
pub(crate) mod evex {
    vnni_kernels!(
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        _mm256_dpbusd_epi32
    );
}

/// The kernels with AVX-VNNI (`vpdpbusd`, VEX encoded).
pub(crate) mod vex {
    vnni_kernels!("avxvnni,avx2,fma,f16c", _mm256_dpbusd_avx_epi32);
}

/// Proof that the CPU supports AVX-VNNI besides AVX2, FMA and F16C.
#[derive(Clone, Copy)]
pub(crate) struct AvxVnni(Avx2);

impl AvxVnni {
    /// The token, if the CPU has the features.
    pub(crate) fn new() -> Option<Self> {
        if super::cpuid::has_avx_vnni() {
            Avx2::new().map(AvxVnni)
        } else {
            None
        }
    }
}

/// Implements the `Kernels` methods of the formats with VNNI kernels by calling
/// those of module `$m` (`evex` or `vex`), behind a token that proves `$m`'s
/// features.
macro_rules! vnni_methods {
    ($m:ident) => {
        $crate::gemv::vnni::vnni_methods! { $m:
            q8_0 => q8_0_vnni(&[BlockQ8_0], &[BlockQ8_0]);
            q4_0 => q4_0_vnni(&[BlockQ4_0], &[BlockQ8_0]);
            q4_1 => q4_1_vnni(&[BlockQ4_1], &[BlockQ8_1]);
            q5_0 => q5_0_vnni(&[BlockQ5_0], &[BlockQ8_0]);
            q5_1 => q5_1_vnni(&[BlockQ5_1], &[BlockQ8_1]);
            iq4_nl => iq4_nl_vnni(&[BlockIQ4NL], &[BlockQ8_0]);
            mxfp4 => mxfp4_vnni(&[BlockMXFP4], &[BlockQ8_0]);
            q4_k => q4_k_vnni(&[BlockQ4K], &[BlockQ8K]);
            q5_k => q5_k_vnni(&[BlockQ5K], &[BlockQ8K]);
        }
    };
    ($m:ident: $($name:ident => $kernel:ident($w:ty, $x:ty);)*) => {
        $(
            #[inline]
            fn $name(self, w: $w, x: $x) -> f32 {
                // SAFETY: the token exists only if the CPU supports the kernel's
                // features (checked in its constructor).
                unsafe { $m::$kernel(w, x) }
            }
        )*
    };
}
pub(super) use vnni_methods;

/// Implements `Kernels` methods by calling the same method of the token `self.0`.
macro_rules! inner_methods {
    ($($name:ident($w:ty, $x:ty);)*) => {
        $(
            #[inline]
            fn $name(self, w: $w, x: $x) -> f32 {
                self.0.$name(w, x)
            }
        )*
    };
}
pub(super) use inner_methods;

/// Implements `Kernels`' grouped methods (`q4_k_n` and the like: one row, `N`
/// inputs) by calling the same method of the token `self.0`.
macro_rules! inner_group_methods {
    ($($name:ident($w:ty);)*) => {
        $(
            #[inline]
            fn $name<const N: usize>(self, w: &[$w], x: [&[BlockQ8K]; N]) -> [f32; N] {
                self.0.$name(w, x)
            }
        )*
    };
}
pub(super) use inner_group_methods;

impl Kernels for AvxVnni {
    const PREFETCHES: bool = true;

    #[inline]
    fn prefetch(self, bytes: &[u8]) {
        self.0.prefetch(bytes)
    }

    vnni_methods!(vex);
    #[inline]
    fn q4_k_n<const N: usize>(self, w: &[BlockQ4K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: an `AvxVnni` token exists only if the CPU supports AVX-VNNI,
        // AVX2, FMA and F16C (`AvxVnni::new`).
        unsafe { vex::q4_k_vnni_n(w, x) }
    }
    #[inline]
    fn q5_k_n<const N: usize>(self, w: &[BlockQ5K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: as for `q4_k_n`.
        unsafe { vex::q5_k_vnni_n(w, x) }
    }
    inner_group_methods! {
        q6_k_n(BlockQ6K);
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
        q6_k(&[BlockQ6K], &[BlockQ8K]);
        iq4_xs(&[BlockIQ4XS], &[BlockQ8K]);
    }
    super::lattice_methods!(inner_methods! {});
}
