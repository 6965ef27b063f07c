//! AVX2 (+FMA, F16C) kernels for x86-64.
//!
//! # Soundness
//!
//! The kernels are `#[target_feature(enable = "avx2,fma,f16c")]` functions, which are
//! undefined behaviour to run on a CPU without those features. They are reachable
//! only through [`Avx2`], a zero-sized token whose only constructor,
//! [`Avx2::new`], checks the features at run time ([`super::cpuid`]); every call
//! site's `unsafe` block relies on holding that token. The other `unsafe` blocks are
//! unaligned vector loads and stores (`loadu`/`storeu`, no alignment requirement)
//! from references to arrays of exactly the loaded size, so they stay in bounds.
//!
//! # Exactness
//!
//! Integer dot products never saturate: `maddubs` (u8 x i8 pairs into i16) is only
//! used with an unsigned side of at most 63 (so a pair is at most 2 * 63 * 128),
//! or, for the signed `IQ4_NL` codebook, with `|y|` on the unsigned side and the
//! codebook value (never -128) carrying the sign; `Q8_0 x Q8_0` widens to i16 and uses
//! `madd`. The float steps mirror [`super::reference`] operation for operation.
#![allow(unsafe_code)]

use core::arch::x86_64::*;

mod lattice;

use super::reference::{self as r, FLOAT_LANES};
use super::Kernels;
use crate::quant::blocks::{
    BlockIQ1M, BlockIQ1S, BlockIQ2S, BlockIQ2XS, BlockIQ2XXS, BlockIQ3S, BlockIQ3XXS, BlockIQ4NL,
    BlockIQ4XS, BlockMXFP4, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, KVALUES_IQ4NL, KVALUES_MXFP4,
};
use crate::quant::kscales::{scales_mins_k4, scales_q3k};
use crate::quant::mxfp4::e8m0_to_f32_half;
use lattice::{
    iq1_m, iq1_m_n, iq1_s, iq1_s_n, iq2_s, iq2_s_n, iq2_xs, iq2_xs_n, iq2_xxs, iq2_xxs_n, iq3_s,
    iq3_s_n, iq3_xxs, iq3_xxs_n,
};

/// Proof that the CPU supports AVX2, FMA and F16C.
#[derive(Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// The token, if the CPU has the features.
    pub(crate) fn new() -> Option<Self> {
        super::cpuid::has_avx2().then_some(Avx2(()))
    }
}

/// Implements a `Kernels` method by calling the target-feature kernel of the same name.
macro_rules! forward {
    ($($name:ident($w:ty, $x:ty);)*) => {
        $(
            #[inline]
            fn $name(self, w: $w, x: $x) -> f32 {
                // SAFETY: `self` is an `Avx2` token, which exists only if the CPU
                // supports AVX2, FMA and F16C (checked in `Avx2::new`).
                unsafe { $name(w, x) }
            }
        )*
    };
}

/// Implements grouped `Kernels` methods (one row, `N` inputs) by calling the
/// target-feature kernel of the same name.
macro_rules! group_forward {
    ($($name:ident($w:ty);)*) => {
        $(
            #[inline]
            fn $name<const N: usize>(self, w: &[$w], x: [&[BlockQ8K]; N]) -> [f32; N] {
                // SAFETY: `self` is an `Avx2` token, which exists only if the CPU
                // supports AVX2, FMA and F16C (checked in `Avx2::new`).
                unsafe { $name(w, x) }
            }
        )*
    };
}

impl Kernels for Avx2 {
    const PREFETCHES: bool = true;

    #[inline]
    fn prefetch(self, bytes: &[u8]) {
        // SAFETY: `self` is an `Avx2` token, which exists only if the CPU
        // supports AVX2, FMA and F16C (checked in `Avx2::new`).
        unsafe { prefetch(bytes) }
    }

    forward! {
        f32(&[u8], &[f32]);
        f16(&[u8], &[f32]);
        bf16(&[u8], &[f32]);
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

    #[inline]
    fn q4_k_n<const N: usize>(self, w: &[BlockQ4K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: `self` is an `Avx2` token, which exists only if the CPU
        // supports AVX2, FMA and F16C (checked in `Avx2::new`).
        unsafe { q4_k_n(w, x) }
    }

    #[inline]
    fn q5_k_n<const N: usize>(self, w: &[BlockQ5K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: as for `q4_k_n`.
        unsafe { q5_k_n(w, x) }
    }

    #[inline]
    fn q6_k_n<const N: usize>(self, w: &[BlockQ6K], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: as for `q4_k_n`.
        unsafe { q6_k_n(w, x) }
    }

    #[inline]
    fn iq4_xs_n<const N: usize>(self, w: &[BlockIQ4XS], x: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: as for `q4_k_n`.
        unsafe { iq4_xs_n(w, x) }
    }

    super::lattice_methods!(forward! {});
    super::lattice_group_methods!(group_forward! {});
    group_forward! {
        iq1_s_n(BlockIQ1S);
        iq1_m_n(BlockIQ1M);
    }
}

/// Asks for every cache line of `bytes` to be brought into L1 (`prefetcht0`): a
/// hint, which reads nothing the program sees and never faults.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch(bytes: &[u8]) {
    // Every 64th byte from the first, and the last: each line the slice touches.
    for b in bytes.iter().step_by(64).chain(bytes.last()) {
        _mm_prefetch::<_MM_HINT_T0>((b as *const u8).cast());
    }
}

// ---------------------------------------------------------------------------------
// Loads and small helpers (shared with the AVX-512 module).

/// Loads 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld256(a: &[u8; 32]) -> __m256i {
    // SAFETY: reads exactly the 32 bytes of `a`; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// Loads 32 signed bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld256i(a: &[i8; 32]) -> __m256i {
    // SAFETY: reads exactly the 32 bytes of `a`; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }
}

/// Loads 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld128(a: &[u8; 16]) -> __m128i {
    // SAFETY: reads exactly the 16 bytes of `a`; `loadu` has no alignment requirement.
    unsafe { _mm_loadu_si128(a.as_ptr().cast()) }
}

/// Loads 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ldps(a: &[f32; 8]) -> __m256 {
    // SAFETY: reads exactly the 8 floats of `a`; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_ps(a.as_ptr()) }
}

/// Stores 8 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn stps(a: &mut [f32; 8], v: __m256) {
    // SAFETY: writes exactly the 8 floats of `a`; `storeu` has no alignment requirement.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) }
}

/// `&s[off..off + N]` as an array reference.
#[inline(always)]
pub(super) fn arr<T, const N: usize>(s: &[T], off: usize) -> &[T; N] {
    s[off..off + N].try_into().expect("slice of length N")
}

/// `&mut s[off..off + N]` as an array reference.
#[inline(always)]
pub(super) fn arr_mut<T, const N: usize>(s: &mut [T], off: usize) -> &mut [T; N] {
    (&mut s[off..off + N])
        .try_into()
        .expect("slice of length N")
}

/// The sum of the eight `i32` lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// `[sum(v0), sum(v1), sum(v2), sum(v3)]` of four vectors of eight `i32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum4(v0: __m256i, v1: __m256i, v2: __m256i, v3: __m256i) -> __m128i {
    let a = _mm256_hadd_epi32(v0, v1);
    let b = _mm256_hadd_epi32(v2, v3);
    let c = _mm256_hadd_epi32(a, b);
    _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c))
}

/// Four f16 scales as four `f32` (exact, like [`r::h`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn h4(d: [[u8; 2]; 4]) -> __m128 {
    let e = |i: usize| i16::from_le_bytes(d[i]);
    _mm_cvtph_ps(_mm_setr_epi16(e(0), e(1), e(2), e(3), 0, 0, 0, 0))
}

/// An f16 scale as `f32` with F16C (exact, like [`r::h`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hx(d: [u8; 2]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(
        _mm_cvtsi32_si128(u16::from_le_bytes(d) as i32),
    ))
}

/// [`r::term`] with F16C conversions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn term(dw: [u8; 2], dx: [u8; 2], isum: i32) -> f32 {
    (hx(dw) * hx(dx)) * isum as f32
}

/// [`r::term_e8m0`] with F16C conversions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn term_e8m0(e: u8, dx: [u8; 2], isum: i32) -> f32 {
    (hx(dx) * e8m0_to_f32_half(e)) * isum as f32
}

/// [`r::term_m`] with F16C conversions.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn term_m(w_d: [u8; 2], w_m: [u8; 2], x: &BlockQ8_1, isum: i32) -> f32 {
    (hx(w_d) * hx(x.d)) * isum as f32 + hx(w_m) * hx(x.s)
}

/// `sum_j bsums[j] * m16[j]` over the sixteen `Q8_K` group sums, exact in `i32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bsums_dot(x: &BlockQ8K, m16: __m256i) -> i32 {
    let b: &[u8; 32] = x.bsums.as_flattened().try_into().expect("32 bytes");
    hsum(_mm256_madd_epi16(ld256(b), m16))
}

/// Byte indices (`0x80` = zero) that spread eight bytes `b0..b7`, present in both
/// 128-bit lanes, into eight `i32` lanes `j` holding the `i16` pair `(b_j, b_j)`:
/// the multiplier `madd` needs to scale (or, for the mins, weight) sub-block `j`.
const PAIRS: [u8; 32] = {
    let mut idx = [0x80u8; 32];
    let mut j = 0;
    while j < 8 {
        idx[4 * j] = j as u8;
        idx[4 * j + 2] = j as u8;
        j += 1;
    }
    idx
};

/// Eight bytes as eight `(b_j, b_j)` `i16` pairs ([`PAIRS`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn pairs8(b: [u8; 8]) -> __m256i {
    _mm256_shuffle_epi8(_mm256_set1_epi64x(i64::from_le_bytes(b)), ld256(&PAIRS))
}

/// Adds the terms of four blocks to the four block lanes:
/// `acc[l] += (dw[l] * dx[l]) * isum[l]`, as [`r::term`] does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn acc4(acc: __m128, isum: __m128i, dw: [[u8; 2]; 4], dx: [[u8; 2]; 4]) -> __m128 {
    let d = _mm_mul_ps(h4(dw), h4(dx));
    _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(isum)))
}

/// As [`acc4`] for `MXFP4`'s power-of-two scales ([`r::term_e8m0`]): `(dx * 2^(e - 128)) * isum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn acc4_e8m0(acc: __m128, isum: __m128i, e: [u8; 4], dx: [[u8; 2]; 4]) -> __m128 {
    let s = e.map(e8m0_to_f32_half);
    let d = _mm_mul_ps(h4(dx), _mm_setr_ps(s[0], s[1], s[2], s[3]));
    _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(isum)))
}

/// As [`acc4`] plus the `m * s` term of `Q4_1`/`Q5_1` ([`r::term_m`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn acc4_m(
    acc: __m128,
    isum: __m128i,
    dw: [[u8; 2]; 4],
    dx: [[u8; 2]; 4],
    mw: [[u8; 2]; 4],
    sx: [[u8; 2]; 4],
) -> __m128 {
    let d = _mm_mul_ps(h4(dw), h4(dx));
    let t = _mm_add_ps(
        _mm_mul_ps(d, _mm_cvtepi32_ps(isum)),
        _mm_mul_ps(h4(mw), h4(sx)),
    );
    _mm_add_ps(acc, t)
}

/// The four block lanes as an array.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn lanes4(v: __m128) -> [f32; 4] {
    let mut out = [0.0f32; 4];
    // SAFETY: writes exactly the 4 floats of `out`; `storeu` has no alignment
    // requirement.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) };
    out
}

/// The four `i32` lanes as an array.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn lanes4i(v: __m128i) -> [i32; 4] {
    let mut out = [0i32; 4];
    // SAFETY: writes exactly the 4 `i32` of `out`; `storeu` has no alignment
    // requirement.
    unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), v) };
    out
}

/// 32 nibbles of a 16-byte array as bytes: low nibbles first, then high nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn nib32(qs: &[u8; 16]) -> __m256i {
    let t = ld128(qs);
    let v = _mm256_set_m128i(_mm_srli_epi16::<4>(t), t);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
}

/// Byte `j` is `0xff` if bit `j` of the little-endian `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bits32(qh: [u8; 4]) -> __m256i {
    let v = _mm256_set1_epi32(i32::from_le_bytes(qh));
    let shuf = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let v = _mm256_shuffle_epi8(v, shuf);
    let m = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(v, m), m)
}

/// A 16-entry codebook (`KVALUES_IQ4NL`, `KVALUES_MXFP4`) in both 128-bit
/// lanes, for `vpshufb` lookups by nibble.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn codebook(values: &[i8; 16]) -> __m256i {
    let k: [u8; 16] = values.map(|v| v as u8);
    let t = ld128(&k);
    _mm256_set_m128i(t, t)
}

/// Pairwise `i32` sums of `sum(a[i] * b[i])` for unsigned `a <= 63` and any `b`:
/// eight partial sums, exact.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u(a: __m256i, b: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
}

/// As [`dot_u`] for `a - off` with `0 <= a <= 63`, `0 <= off <= 32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u_off(a: __m256i, off: i8, b: __m256i) -> __m256i {
    let p = _mm256_sub_epi16(
        _mm256_maddubs_epi16(a, b),
        _mm256_maddubs_epi16(_mm256_set1_epi8(off), b),
    );
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// `sum(k[i] * y[i])` partial sums for `k` from the IQ4_NL or MXFP4 codebook (never -128) and
/// any `y`: `|y|` (as unsigned, so -128 is 128) times `k` with `y`'s sign.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_signed_k(k: __m256i, y: __m256i) -> __m256i {
    _mm256_maddubs_epi16(_mm256_abs_epi8(y), _mm256_sign_epi8(k, y))
}

/// `i8 x i8` dot product of 32 elements, widened to i16 (exact for all inputs).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_i8(a: &[i8; 32], b: &[i8; 32]) -> __m256i {
    let ld = |s: &[i8; 32], o: usize| -> __m256i {
        let h: &[i8; 16] = arr(s, o);
        // SAFETY: reads exactly the 16 bytes of `h`; no alignment requirement.
        _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(h.as_ptr().cast()) })
    };
    _mm256_add_epi32(
        _mm256_madd_epi16(ld(a, 0), ld(b, 0)),
        _mm256_madd_epi16(ld(a, 16), ld(b, 16)),
    )
}

/// Two `i16` scales as a madd operand: `a` for the low 128 bits, `b` for the high.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn sc2(a: i16, b: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))
}

// ---------------------------------------------------------------------------------
// Float weights.

macro_rules! float_kernel {
    ($name:ident, $wbytes:expr, |$c:ident| $load:expr, $elems:path) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $name(w: &[u8], x: &[f32]) -> f32 {
            const WB: usize = $wbytes;
            let n = (w.len() / WB).min(x.len());
            let full = n / FLOAT_LANES * FLOAT_LANES;
            let mut acc = [_mm256_setzero_ps(); 8];
            for (wc, xc) in w[..full * WB]
                .chunks_exact(FLOAT_LANES * WB)
                .zip(x[..full].chunks_exact(FLOAT_LANES))
            {
                for (k, a) in acc.iter_mut().enumerate() {
                    let $c = arr::<u8, { 8 * WB }>(wc, 8 * WB * k);
                    let wv = $load;
                    *a = _mm256_fmadd_ps(wv, ldps(arr(xc, 8 * k)), *a);
                }
            }
            if full == n {
                return fold64(acc);
            }
            let mut lanes = [0.0f32; FLOAT_LANES];
            for (k, a) in acc.iter().enumerate() {
                stps(arr_mut(&mut lanes, 8 * k), *a);
            }
            r::finish_float(lanes, $elems(w, full), x, full)
        }
    };
}

/// The 64 lanes of eight accumulators (lane `8k + l` in `acc[k]`) folded by
/// halves as [`r::fold`] folds them, the same additions of the same values:
/// `acc[k] + acc[k + 4]`, `+ 2`, `+ 1`, then within the vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fold64(acc: [__m256; 8]) -> f32 {
    let a: [__m256; 4] = core::array::from_fn(|k| _mm256_add_ps(acc[k], acc[k + 4]));
    let b = [_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])];
    let c = _mm256_add_ps(b[0], b[1]);
    let d = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps::<1>(c));
    let e = _mm_add_ps(d, _mm_movehl_ps(d, d));
    _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps::<1>(e, e)))
}

float_kernel!(f32, 4, |c| _mm256_castsi256_ps(ld256(c)), r::f32_elems);
float_kernel!(f16, 2, |c| _mm256_cvtph_ps(ld128(c)), r::f16_elems);
float_kernel!(
    bf16,
    2,
    |c| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(c)))),
    r::bf16_elems
);

// ---------------------------------------------------------------------------------
// Float weights times several tokens (`super::tile`): one 8-lane accumulator per
// output, element `i` into lane `i % 8`.

macro_rules! tile_kernels {
    ($tile:ident, $one:ident, $wbytes:expr, |$c:ident| $load:expr, $elems:path) => {
        /// `R` weight rows times `T` tokens' activations (all of one length):
        /// `out[r][t]`, each as [`r::finish8`] orders it.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $tile<const R: usize, const T: usize>(
            w: [&[u8]; R],
            x: [&[f32]; T],
        ) -> [[f32; T]; R] {
            const WB: usize = $wbytes;
            let n = x[0].len();
            let full = n / 8 * 8;
            let mut acc = [[_mm256_setzero_ps(); T]; R];
            let mut k = 0;
            while k < full {
                let wv: [__m256; R] = core::array::from_fn(|r| {
                    let $c = arr::<u8, { 8 * WB }>(w[r], k * WB);
                    $load
                });
                for (t, xt) in x.iter().enumerate() {
                    let a = ldps(arr(xt, k));
                    for r in 0..R {
                        acc[r][t] = _mm256_fmadd_ps(wv[r], a, acc[r][t]);
                    }
                }
                k += 8;
            }
            let mut out = [[0.0f32; T]; R];
            for r in 0..R {
                for t in 0..T {
                    let mut lanes = [0.0f32; 8];
                    stps(&mut lanes, acc[r][t]);
                    out[r][t] = r::finish8(lanes, $elems(w[r], full), &x[t][full..]);
                }
            }
            out
        }

        /// One weight row times one token's activations, as `$tile` computes
        /// each of its products.
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) fn $one(w: &[u8], x: &[f32]) -> f32 {
            const WB: usize = $wbytes;
            let full = x.len() / 8 * 8;
            let mut acc = _mm256_setzero_ps();
            let mut k = 0;
            while k < full {
                let $c = arr::<u8, { 8 * WB }>(w, k * WB);
                acc = _mm256_fmadd_ps($load, ldps(arr(x, k)), acc);
                k += 8;
            }
            let mut lanes = [0.0f32; 8];
            stps(&mut lanes, acc);
            r::finish8(lanes, $elems(w, full), &x[full..])
        }
    };
}

tile_kernels!(
    tile_f32,
    one_f32,
    4,
    |c| _mm256_castsi256_ps(ld256(c)),
    r::f32_elems
);
tile_kernels!(
    tile_f16,
    one_f16,
    2,
    |c| _mm256_cvtph_ps(ld128(c)),
    r::f16_elems
);
tile_kernels!(
    tile_bf16,
    one_bf16,
    2,
    |c| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(c)))),
    r::bf16_elems
);

impl Avx2 {
    /// `tile_*` for `ty` (`F32`, `F16` or `BF16`; others give zeros).
    pub(crate) fn float_tile<const R: usize, const N: usize>(
        self,
        ty: crate::quant::GgmlType,
        w: [&[u8]; R],
        x: [&[f32]; N],
    ) -> [[f32; N]; R] {
        use crate::quant::GgmlType as T;
        // SAFETY: `self` is an `Avx2` token, which exists only if the CPU
        // supports AVX2, FMA and F16C (checked in `Avx2::new`).
        unsafe {
            match ty {
                T::F32 => tile_f32(w, x),
                T::F16 => tile_f16(w, x),
                T::BF16 => tile_bf16(w, x),
                _ => [[0.0; N]; R],
            }
        }
    }

    /// `one_*` for `ty` (`F32`, `F16` or `BF16`; others give zero).
    pub(crate) fn float_one(self, ty: crate::quant::GgmlType, w: &[u8], x: &[f32]) -> f32 {
        use crate::quant::GgmlType as T;
        // SAFETY: as in `float_tile`.
        unsafe {
            match ty {
                T::F32 => one_f32(w, x),
                T::F16 => one_f16(w, x),
                T::BF16 => one_bf16(w, x),
                _ => 0.0,
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// 32-element block formats.

/// A kernel over 32-element blocks: `$isum` gives a block's eight `i32` partial
/// sums; groups of four blocks go through [`acc4`] (or [`acc4_m`] with `m`), the
/// last `n % 4` blocks through the scalar term, each in lane `b % 4`.
///
/// `$features` are the kernel's target features (the `vnni` module builds its
/// kernels with it); the helpers are named at the call site.
macro_rules! blocks32_kernel {
    ($features:literal, $vis:vis $name:ident, $W:ident, $X:ident, |$w:ident, $x:ident| $isum:expr) => {
        #[target_feature(enable = $features)]
        $vis fn $name(w: &[$W], x: &[$X]) -> f32 {
            let isum = |$w: &$W, $x: &$X| -> __m256i { $isum };
            let n = w.len().min(x.len());
            let full = n / 4 * 4;
            let mut acc = _mm_setzero_ps();
            for (w4, x4) in w[..full].chunks_exact(4).zip(x[..full].chunks_exact(4)) {
                let s = hsum4(
                    isum(&w4[0], &x4[0]),
                    isum(&w4[1], &x4[1]),
                    isum(&w4[2], &x4[2]),
                    isum(&w4[3], &x4[3]),
                );
                acc = blocks32_kernel!(@acc acc, s, w4, x4, $W, $X);
            }
            let mut lanes = lanes4(acc);
            for (l, (w, x)) in w[full..n].iter().zip(&x[full..n]).enumerate() {
                lanes[l] += blocks32_kernel!(@term w, x, hsum(isum(w, x)), $W, $X);
            }
            r::fold(lanes)
        }
    };
    (@acc $acc:ident, $s:ident, $w4:ident, $x4:ident, BlockMXFP4, BlockQ8_0) => {
        acc4_e8m0($acc, $s, [0, 1, 2, 3].map(|i| $w4[i].e), [0, 1, 2, 3].map(|i| $x4[i].d))
    };
    (@acc $acc:ident, $s:ident, $w4:ident, $x4:ident, $W:ident, BlockQ8_0) => {
        acc4($acc, $s, [0, 1, 2, 3].map(|i| $w4[i].d), [0, 1, 2, 3].map(|i| $x4[i].d))
    };
    (@acc $acc:ident, $s:ident, $w4:ident, $x4:ident, $W:ident, BlockQ8_1) => {
        acc4_m(
            $acc,
            $s,
            [0, 1, 2, 3].map(|i| $w4[i].d),
            [0, 1, 2, 3].map(|i| $x4[i].d),
            [0, 1, 2, 3].map(|i| $w4[i].m),
            [0, 1, 2, 3].map(|i| $x4[i].s),
        )
    };
    (@term $w:ident, $x:ident, $isum:expr, BlockMXFP4, BlockQ8_0) => {
        term_e8m0($w.e, $x.d, $isum)
    };
    (@term $w:ident, $x:ident, $isum:expr, $W:ident, BlockQ8_0) => {
        term($w.d, $x.d, $isum)
    };
    (@term $w:ident, $x:ident, $isum:expr, $W:ident, BlockQ8_1) => {
        term_m($w.d, $w.m, $x, $isum)
    };
}
pub(super) use blocks32_kernel;

blocks32_kernel!("avx2,fma,f16c", pub(super) q4_0, BlockQ4_0, BlockQ8_0, |w, x| isum_q4_0(w, x));
blocks32_kernel!("avx2,fma,f16c", pub(super) q4_1, BlockQ4_1, BlockQ8_1, |w, x| dot_u(
    nib32(&w.qs),
    ld256i(&x.qs)
));
blocks32_kernel!("avx2,fma,f16c", pub(super) q5_0, BlockQ5_0, BlockQ8_0, |w, x| {
    let hb = _mm256_and_si256(bits32(w.qh), _mm256_set1_epi8(0x10));
    dot_u_off(_mm256_or_si256(nib32(&w.qs), hb), 16, ld256i(&x.qs))
});
blocks32_kernel!("avx2,fma,f16c", pub(super) q5_1, BlockQ5_1, BlockQ8_1, |w, x| {
    let hb = _mm256_and_si256(bits32(w.qh), _mm256_set1_epi8(0x10));
    dot_u(_mm256_or_si256(nib32(&w.qs), hb), ld256i(&x.qs))
});
blocks32_kernel!("avx2,fma,f16c", pub(super) q8_0, BlockQ8_0, BlockQ8_0, |w, x| isum_q8_0(w, x));
blocks32_kernel!("avx2,fma,f16c", pub(super) iq4_nl, BlockIQ4NL, BlockQ8_0, |w, x| {
    let k = _mm256_shuffle_epi8(codebook(&KVALUES_IQ4NL), nib32(&w.qs));
    _mm256_madd_epi16(dot_signed_k(k, ld256i(&x.qs)), _mm256_set1_epi16(1))
});
blocks32_kernel!("avx2,fma,f16c", pub(super) mxfp4, BlockMXFP4, BlockQ8_0, |w, x| {
    let k = _mm256_shuffle_epi8(codebook(&KVALUES_MXFP4), nib32(&w.qs));
    _mm256_madd_epi16(dot_signed_k(k, ld256i(&x.qs)), _mm256_set1_epi16(1))
});

/// Eight partial sums of a `Q4_0 x Q8_0` block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn isum_q4_0(w: &BlockQ4_0, x: &BlockQ8_0) -> __m256i {
    dot_u_off(nib32(&w.qs), 8, ld256i(&x.qs))
}

/// Eight partial sums of a `Q8_0 x Q8_0` block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn isum_q8_0(w: &BlockQ8_0, x: &BlockQ8_0) -> __m256i {
    dot_i8(&w.qs, &x.qs)
}

// ---------------------------------------------------------------------------------
// K-quants.

/// `Q8_K` activations of elements `off..off + 32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn y32(x: &BlockQ8K, off: usize) -> __m256i {
    ld256i(arr(&x.qs, off))
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q2_k(w: &[BlockQ2K], x: &[BlockQ8K]) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(
            _mm_srli_epi16::<4>(ld128(&w.scales)),
            _mm_set1_epi8(15),
        ));
        let summs = bsums_dot(x, mins);
        let sc = |i: usize| (w.scales[i] & 15) as i16;
        let mut v = _mm256_setzero_si256();
        for half in 0..2 {
            let mut q = ld256(arr(&w.qs, 32 * half));
            for s in 0..4 {
                let p = _mm256_maddubs_epi16(_mm256_and_si256(q, m3), y32(x, 128 * half + 32 * s));
                let i = 8 * half + 2 * s;
                v = _mm256_add_epi32(v, _mm256_madd_epi16(p, sc2(sc(i), sc(i + 1))));
                q = _mm256_srli_epi16::<2>(q);
            }
        }
        let sumi = hsum(v);
        let dx = r::q8k_d(x);
        acc += (hx(w.d) * dx) * sumi as f32 - (hx(w.dmin) * dx) * summs as f32;
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q3_k(w: &[BlockQ3K], x: &[BlockQ8K]) -> f32 {
    let m3 = _mm256_set1_epi8(3);
    let one = _mm256_set1_epi8(1);
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let scales = scales_q3k(&w.scales);
        let mut hm = ld256(&w.hmask);
        let mut v = _mm256_setzero_si256();
        for half in 0..2 {
            let mut q = ld256(arr(&w.qs, 32 * half));
            for s in 0..4 {
                let y = y32(x, 128 * half + 32 * s);
                // 4 where the high bit is clear, else 0.
                let sub = _mm256_slli_epi16::<2>(_mm256_andnot_si256(hm, one));
                let p = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(_mm256_and_si256(q, m3), y),
                    _mm256_maddubs_epi16(sub, y),
                );
                let i = 8 * half + 2 * s;
                let scv = sc2(scales[i] as i16, scales[i + 1] as i16);
                v = _mm256_add_epi32(v, _mm256_madd_epi16(p, scv));
                q = _mm256_srli_epi16::<2>(q);
                hm = _mm256_srli_epi16::<1>(hm);
            }
        }
        let sumi = hsum(v);
        acc += (hx(w.d) * r::q8k_d(x)) * sumi as f32;
    }
    acc
}

/// One `Q4_K` super-block: eight `i32` partial sums of `sumi` (each sub-block's
/// nibble dot product times its scale) and eight of `summs` (each sub-block's
/// activation sum times its min), both exact.
///
/// The scale multipliers are broadcast from memory (a load, no shuffle port), and
/// the two sums are reduced later, two super-blocks at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k_sums(w: &BlockQ4K, x: &BlockQ8K) -> (__m256i, __m256i) {
    let (sc, mins) = scales_mins_k4(&w.scales);
    let mut sc_pairs = [0i32; 8];
    // SAFETY: writes exactly the 8 `i32` of `sc_pairs`; no alignment requirement.
    unsafe { _mm256_storeu_si256(sc_pairs.as_mut_ptr().cast(), pairs8(sc)) };
    let bsums: &[u8; 32] = x.bsums.as_flattened().try_into().expect("32 bytes");
    let m = _mm256_madd_epi16(ld256(bsums), pairs8(mins));
    let mut v = _mm256_setzero_si256();
    for c in 0..4 {
        let (lo, hi) = nibbles32(arr(&w.qs, 32 * c));
        let p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, y32(x, 64 * c)),
            _mm256_set1_epi32(sc_pairs[2 * c]),
        );
        let p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, y32(x, 64 * c + 32)),
            _mm256_set1_epi32(sc_pairs[2 * c + 1]),
        );
        v = _mm256_add_epi32(v, _mm256_add_epi32(p0, p1));
    }
    (v, m)
}

/// [`r::dot_q4_k`]'s float step for one super-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn k4_term(d: [u8; 2], dmin: [u8; 2], x: &BlockQ8K, sumi: i32, summs: i32) -> f32 {
    let dx = r::q8k_d(x);
    (hx(d) * dx) * sumi as f32 - (hx(dmin) * dx) * summs as f32
}

/// [`k4_term`] of two super-blocks with scales `a`, `b` (`d`, `dmin`) at once, from
/// `s = [sumi_a, summs_a, sumi_b, summs_b]`: the same `f32` multiplications and
/// subtraction, lane by lane, so the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn k4_terms2(
    a: ([u8; 2], [u8; 2]),
    b: ([u8; 2], [u8; 2]),
    xa: &BlockQ8K,
    xb: &BlockQ8K,
    s: __m128i,
) -> (f32, f32) {
    let e = |h: [u8; 2]| i16::from_le_bytes(h);
    let dd = _mm_cvtph_ps(_mm_setr_epi16(e(a.0), e(a.1), e(b.0), e(b.1), 0, 0, 0, 0));
    let (dxa, dxb) = (r::q8k_d(xa), r::q8k_d(xb));
    let dx = _mm_setr_ps(dxa, dxa, dxb, dxb);
    let t = _mm_mul_ps(_mm_mul_ps(dd, dx), _mm_cvtepi32_ps(s));
    let d = _mm_hsub_ps(t, t);
    (_mm_cvtss_f32(d), _mm_cvtss_f32(_mm_movehdup_ps(d)))
}

/// The `Q4_K`/`Q5_K` row loop over a super-block's sums `$sums` (eight `i32`
/// partial sums each of `sumi` and `summs`): two super-blocks a step through
/// [`k4_terms2`], an odd last one through [`k4_term`], the reference's float
/// steps. `$features` as in `blocks32_kernel`; the helpers are named at the call
/// site.
macro_rules! k4_kernel {
    ($features:literal, $vis:vis $name:ident, $W:ty, $sums:ident) => {
        #[target_feature(enable = $features)]
        $vis fn $name(w: &[$W], x: &[BlockQ8K]) -> f32 {
            let n = w.len().min(x.len());
            let (w, x) = (&w[..n], &x[..n]);
            let mut acc = 0.0f32;
            for (w2, x2) in w.chunks_exact(2).zip(x.chunks_exact(2)) {
                let (va, ma) = $sums(&w2[0], &x2[0]);
                let (vb, mb) = $sums(&w2[1], &x2[1]);
                let (ta, tb) = k4_terms2(
                    (w2[0].d, w2[0].dmin),
                    (w2[1].d, w2[1].dmin),
                    &x2[0],
                    &x2[1],
                    hsum4(va, ma, vb, mb),
                );
                acc += ta;
                acc += tb;
            }
            if n % 2 == 1 {
                let (v, m) = $sums(&w[n - 1], &x[n - 1]);
                let zero = _mm256_setzero_si256();
                let s = lanes4i(hsum4(v, m, zero, zero));
                acc += k4_term(w[n - 1].d, w[n - 1].dmin, &x[n - 1], s[0], s[1]);
            }
            acc
        }
    };
}
pub(super) use k4_kernel;

k4_kernel!("avx2,fma,f16c", pub(super) q4_k, BlockQ4K, q4_k_sums);

/// [`q4_k_sums`] of one super-block against `N` inputs: the scales, their
/// multipliers and the nibbles unpacked once for all of them. Each input's
/// sums are the exact integers `q4_k_sums` gives it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k_sums_n<const N: usize>(w: &BlockQ4K, x: [&BlockQ8K; N]) -> [(__m256i, __m256i); N] {
    let (sc, mins) = scales_mins_k4(&w.scales);
    let mut sc_pairs = [0i32; 8];
    // SAFETY: writes exactly the 8 `i32` of `sc_pairs`; no alignment requirement.
    unsafe { _mm256_storeu_si256(sc_pairs.as_mut_ptr().cast(), pairs8(sc)) };
    let pm = pairs8(mins);
    let zero = _mm256_setzero_si256();
    let mut out = [(zero, zero); N];
    for (o, x) in out.iter_mut().zip(x) {
        let bsums: &[u8; 32] = x.bsums.as_flattened().try_into().expect("32 bytes");
        o.1 = _mm256_madd_epi16(ld256(bsums), pm);
    }
    for c in 0..4 {
        let (lo, hi) = nibbles32(arr(&w.qs, 32 * c));
        let (s0, s1) = (
            _mm256_set1_epi32(sc_pairs[2 * c]),
            _mm256_set1_epi32(sc_pairs[2 * c + 1]),
        );
        for (o, x) in out.iter_mut().zip(x) {
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y32(x, 64 * c)), s0);
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y32(x, 64 * c + 32)), s1);
            o.0 = _mm256_add_epi32(o.0, _mm256_add_epi32(p0, p1));
        }
    }
    out
}

/// The `Q4_K` kernel of one row and `N` inputs (of the row's length) over a
/// super-block's sums for all of them (`$sums_n`), each result the
/// one-input kernel's bits: the same exact integer sums, and for each input
/// the same float steps in the same order (super-blocks in pairs through
/// [`k4_terms2`], an odd last one through [`k4_term`]). `$features` as in
/// `k4_kernel`; the helpers are named at the call site.
macro_rules! k4_kernel_n {
    ($features:literal, $vis:vis $name:ident, $W:ty, $sums_n:ident) => {
        #[target_feature(enable = $features)]
        $vis fn $name<const N: usize>(w: &[$W], x: [&[BlockQ8K]; N]) -> [f32; N] {
            let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
            let mut acc = [0.0f32; N];
            let mut i = 0;
            while i + 2 <= n {
                let a = $sums_n(&w[i], x.map(|x| &x[i]));
                let b = $sums_n(&w[i + 1], x.map(|x| &x[i + 1]));
                for (c, acc) in acc.iter_mut().enumerate() {
                    let (ta, tb) = k4_terms2(
                        (w[i].d, w[i].dmin),
                        (w[i + 1].d, w[i + 1].dmin),
                        &x[c][i],
                        &x[c][i + 1],
                        hsum4(a[c].0, a[c].1, b[c].0, b[c].1),
                    );
                    *acc += ta;
                    *acc += tb;
                }
                i += 2;
            }
            if n % 2 == 1 {
                let last = $sums_n(&w[n - 1], x.map(|x| &x[n - 1]));
                let zero = _mm256_setzero_si256();
                for (c, acc) in acc.iter_mut().enumerate() {
                    let s = lanes4i(hsum4(last[c].0, last[c].1, zero, zero));
                    *acc += k4_term(w[n - 1].d, w[n - 1].dmin, &x[c][n - 1], s[0], s[1]);
                }
            }
            acc
        }
    };
}
pub(super) use k4_kernel_n;

k4_kernel_n!("avx2,fma,f16c", pub(super) q4_k_n, BlockQ4K, q4_k_sums_n);

/// Chunk `c` (sub-blocks `2c` and `2c + 1`) of a `Q5_K` block as unsigned 5-bit
/// values: the low and high nibbles of `qs` under the fifth bits, bits 0 and 1
/// of `hq` (`qh` shifted right by `2c`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_k_chunk(w: &BlockQ5K, c: usize, hq: __m256i) -> (__m256i, __m256i) {
    let (lo, hi) = nibbles32(arr(&w.qs, 32 * c));
    let one = _mm256_set1_epi8(1);
    let two = _mm256_set1_epi8(2);
    let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(hq, one));
    let h1 = _mm256_slli_epi16::<3>(_mm256_and_si256(hq, two));
    (_mm256_or_si256(lo, h0), _mm256_or_si256(hi, h1))
}

/// The low and the high nibbles of 32 bytes, each as 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn nibbles32(qs: &[u8; 32]) -> (__m256i, __m256i) {
    let m4 = _mm256_set1_epi8(0x0f);
    let q = ld256(qs);
    (
        _mm256_and_si256(q, m4),
        _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
    )
}

/// The `Q5_K` kernel: [`q5_k_n`] of one input (as fast as a kernel of its
/// own in `cargo bench -p les-core --bench gemv`; `Q6_K`'s and `IQ4_XS`'s
/// one-input kernels measured 5-8% faster than theirs, so they stay).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_k(w: &[BlockQ5K], x: &[BlockQ8K]) -> f32 {
    q5_k_n(w, [x])[0]
}

/// [`q5_k`] of one row and `N` inputs (of the row's length), each result its
/// bits: the scales and each chunk's 5-bit values unpacked once for all
/// inputs, each input's integer sums exact and its float step the same.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q5_k_n<const N: usize>(w: &[BlockQ5K], x: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
    let mut acc = [0.0f32; N];
    for (i, w) in w[..n].iter().enumerate() {
        let (sc, mins) = scales_mins_k4(&w.scales);
        let pm = pairs8(mins);
        let mut summs = [0i32; N];
        for (s, x) in summs.iter_mut().zip(x) {
            *s = bsums_dot(&x[i], pm);
        }
        let mut hq = ld256(&w.qh);
        let mut v = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            let (lo, hi) = q5_k_chunk(w, c, hq);
            let (s0, s1) = (
                _mm256_set1_epi16(i16::from(sc[2 * c])),
                _mm256_set1_epi16(i16::from(sc[2 * c + 1])),
            );
            for (v, x) in v.iter_mut().zip(x) {
                let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y32(&x[i], 64 * c)), s0);
                let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y32(&x[i], 64 * c + 32)), s1);
                *v = _mm256_add_epi32(*v, _mm256_add_epi32(p0, p1));
            }
            hq = _mm256_srli_epi16::<2>(hq);
        }
        for c in 0..N {
            acc[c] += k4_term(w.d, w.dmin, &x[c][i], hsum(v[c]), summs[c]);
        }
    }
    acc
}

/// Half `half` of a `Q6_K` block as four vectors of 32 unsigned 6-bit
/// values (sub-blocks `8 half + 2k` and `8 half + 2k + 1` in vector `k`):
/// the low nibbles of `ql` under two bits of `qh` each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k_half(w: &BlockQ6K, half: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0f);
    let m3 = _mm256_set1_epi8(0x03);
    let qa = ld256(arr(&w.ql, 64 * half));
    let qb = ld256(arr(&w.ql, 64 * half + 32));
    let qh = ld256(arr(&w.qh, 32 * half));
    let hi = |k: i32| -> __m256i {
        let s = match k {
            0 => qh,
            1 => _mm256_srli_epi16::<2>(qh),
            2 => _mm256_srli_epi16::<4>(qh),
            _ => _mm256_srli_epi16::<6>(qh),
        };
        _mm256_slli_epi16::<4>(_mm256_and_si256(s, m3))
    };
    [
        _mm256_or_si256(_mm256_and_si256(qa, m4), hi(0)),
        _mm256_or_si256(_mm256_and_si256(qb, m4), hi(1)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(qa), m4), hi(2)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(qb), m4), hi(3)),
    ]
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6_k(w: &[BlockQ6K], x: &[BlockQ8K]) -> f32 {
    let m32 = _mm256_set1_epi8(32);
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut v = _mm256_setzero_si256();
        for half in 0..2 {
            let q = q6_k_half(w, half);
            for (k, q) in q.into_iter().enumerate() {
                let y = y32(x, 128 * half + 32 * k);
                let p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, y), _mm256_maddubs_epi16(m32, y));
                let i = 8 * half + 2 * k;
                let scv = sc2(w.scales[i] as i16, w.scales[i + 1] as i16);
                v = _mm256_add_epi32(v, _mm256_madd_epi16(p, scv));
            }
        }
        let sumi = hsum(v);
        acc += (hx(w.d) * r::q8k_d(x)) * sumi as f32;
    }
    acc
}

/// [`q6_k`] of one row and `N` inputs (of the row's length), each result its
/// bits: each half's 6-bit values and the scale multipliers unpacked once for
/// all inputs, each input's integer sum exact and its float step the same.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6_k_n<const N: usize>(w: &[BlockQ6K], x: [&[BlockQ8K]; N]) -> [f32; N] {
    let m32 = _mm256_set1_epi8(32);
    let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
    let mut acc = [0.0f32; N];
    for (i, w) in w[..n].iter().enumerate() {
        let mut v = [_mm256_setzero_si256(); N];
        for half in 0..2 {
            let q = q6_k_half(w, half);
            for (k, q) in q.into_iter().enumerate() {
                let j = 8 * half + 2 * k;
                let scv = sc2(w.scales[j] as i16, w.scales[j + 1] as i16);
                for (v, x) in v.iter_mut().zip(x) {
                    let y = y32(&x[i], 128 * half + 32 * k);
                    let p =
                        _mm256_sub_epi16(_mm256_maddubs_epi16(q, y), _mm256_maddubs_epi16(m32, y));
                    *v = _mm256_add_epi32(*v, _mm256_madd_epi16(p, scv));
                }
            }
        }
        for c in 0..N {
            let sumi = hsum(v[c]);
            acc[c] += (hx(w.d) * r::q8k_d(&x[c][i])) * sumi as f32;
        }
    }
    acc
}

/// [`iq4_xs`] of one row and `N` inputs (of the row's length), each result
/// its bits: each sub-block's codebook values and scale looked up once for
/// all inputs.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq4_xs_n<const N: usize>(w: &[BlockIQ4XS], x: [&[BlockQ8K]; N]) -> [f32; N] {
    let table = codebook(&KVALUES_IQ4NL);
    let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
    let mut acc = [0.0f32; N];
    for (i, w) in w[..n].iter().enumerate() {
        let mut v = [_mm256_setzero_si256(); N];
        for j in 0..8 {
            let k = _mm256_shuffle_epi8(table, nib32(arr(&w.qs, 16 * j)));
            let s = _mm256_set1_epi16(r::iq4xs_scale(w, j) as i16);
            for (v, x) in v.iter_mut().zip(x) {
                let p = dot_signed_k(k, y32(&x[i], 32 * j));
                *v = _mm256_add_epi32(*v, _mm256_madd_epi16(p, s));
            }
        }
        for c in 0..N {
            let sumi = hsum(v[c]);
            acc[c] += (hx(w.d) * r::q8k_d(&x[c][i])) * sumi as f32;
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq4_xs(w: &[BlockIQ4XS], x: &[BlockQ8K]) -> f32 {
    let table = codebook(&KVALUES_IQ4NL);
    let mut acc = 0.0f32;
    for (w, x) in w.iter().zip(x) {
        let mut v = _mm256_setzero_si256();
        for j in 0..8 {
            let k = _mm256_shuffle_epi8(table, nib32(arr(&w.qs, 16 * j)));
            let p = dot_signed_k(k, y32(x, 32 * j));
            let s = r::iq4xs_scale(w, j) as i16;
            v = _mm256_add_epi32(v, _mm256_madd_epi16(p, _mm256_set1_epi16(s)));
        }
        let sumi = hsum(v);
        acc += (hx(w.d) * r::q8k_d(x)) * sumi as f32;
    }
    acc
}
