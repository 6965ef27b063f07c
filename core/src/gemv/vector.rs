//! `f32` vector kernels of attention: a query's scores against the cached keys
//! ([`scaled_dots`]) and the scores' weighted sum of the cached values
//! ([`weighted_rows`]), with SIMD where the ISA has it.
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
#![allow(unsafe_code)]

use super::Isa;

/// Partial sums of [`dot`].
const LANES: usize = 16;

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
        out.len() >= nb * n && (n == 0 || rows.len() >= (n - 1) * stride + d),
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
            unsafe { x86::scaled_dots_avx2(q, d, rows, stride, n, scale, out) }
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

/// `o[j * d + i] += w[j * n + t] * (row t)[i]` for `t` in `0..n` in order, for
/// the `nb = o.len() / d` outputs: the weighted sums of the values of `nb`
/// heads sharing a value head, each value read once for all of them. Needs
/// `w.len() >= nb * n` and the rows in `data` (panics otherwise).
pub fn weighted_rows(isa: Isa, w: &[f32], values: Strided<'_>, o: &mut [f32]) {
    let Strided {
        data: rows,
        stride,
        n,
        d,
    } = values;
    let nb = o.len() / d.max(1);
    assert!(
        w.len() >= nb * n && (n == 0 || rows.len() >= (n - 1) * stride + d),
        "weighted_rows: bad lengths"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx512() => {
            // SAFETY: the CPU supports AVX-512 F (checked just above).
            unsafe { x86::weighted_rows_avx512(w, n, rows, stride, d, o) }
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni if super::cpuid::has_avx2() => {
            // SAFETY: the CPU supports AVX2 (checked just above).
            unsafe { x86::weighted_rows_avx2(w, n, rows, stride, d, o) }
        }
        #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
        Isa::Neon | Isa::NeonDot => {
            // SAFETY: NEON is part of the target (`target_feature = "neon"`).
            unsafe { neon::weighted_rows(w, n, rows, stride, d, o) }
        }
        _ => {
            for t in 0..n {
                let v = &rows[t * stride..][..d];
                for (j, oh) in o.chunks_exact_mut(d.max(1)).enumerate() {
                    let s = w[j * n + t];
                    for (x, vv) in oh.iter_mut().zip(v) {
                        *x += s * vv;
                    }
                }
            }
        }
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

    /// Lanes 0-7 plus lanes 8-15, then the fold of [`super::dot`] from width 4.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn fold8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let (whole, ta, tb) = dot_tail_split(a, b);
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in (0..whole).step_by(16) {
            lo = _mm256_add_ps(lo, _mm256_mul_ps(ld8(&a[c..]), ld8(&b[c..])));
            hi = _mm256_add_ps(hi, _mm256_mul_ps(ld8(&a[c + 8..]), ld8(&b[c + 8..])));
        }
        fold8(_mm256_add_ps(lo, hi)) + tail_dot(ta, tb)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx2")]
    fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let (whole, ta, tb) = dot_tail_split(a, b);
        let mut acc = _mm512_setzero_ps();
        for c in (0..whole).step_by(16) {
            acc = _mm512_add_ps(acc, _mm512_mul_ps(ld16(&a[c..]), ld16(&b[c..])));
        }
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
        fold8(_mm256_add_ps(lo, hi)) + tail_dot(ta, tb)
    }

    macro_rules! scaled_dots_with {
        ($name:ident, $features:literal, $dot:ident) => {
            #[target_feature(enable = $features)]
            pub(super) fn $name(
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
                        out[j * n + t] = $dot(&q[j * d..][..d], k) * scale;
                    }
                }
            }
        };
    }
    scaled_dots_with!(scaled_dots_avx2, "avx2", dot_avx2);
    scaled_dots_with!(scaled_dots_avx512, "avx512f,avx2", dot_avx512);

    #[target_feature(enable = "avx2")]
    pub(super) fn weighted_rows_avx2(
        w: &[f32],
        n: usize,
        rows: &[f32],
        stride: usize,
        d: usize,
        o: &mut [f32],
    ) {
        let whole = d / 8 * 8;
        for t in 0..n {
            let v = &rows[t * stride..][..d];
            for (j, oh) in o.chunks_exact_mut(d.max(1)).enumerate() {
                let s = w[j * n + t];
                let sv = _mm256_set1_ps(s);
                for c in (0..whole).step_by(8) {
                    let x = _mm256_add_ps(ld8(&oh[c..]), _mm256_mul_ps(sv, ld8(&v[c..])));
                    st8(&mut oh[c..], x);
                }
                for (x, vv) in oh[whole..].iter_mut().zip(&v[whole..]) {
                    *x += s * vv;
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx2")]
    pub(super) fn weighted_rows_avx512(
        w: &[f32],
        n: usize,
        rows: &[f32],
        stride: usize,
        d: usize,
        o: &mut [f32],
    ) {
        let whole = d / 16 * 16;
        for t in 0..n {
            let v = &rows[t * stride..][..d];
            for (j, oh) in o.chunks_exact_mut(d.max(1)).enumerate() {
                let s = w[j * n + t];
                let sv = _mm512_set1_ps(s);
                for c in (0..whole).step_by(16) {
                    let x = _mm512_add_ps(ld16(&oh[c..]), _mm512_mul_ps(sv, ld16(&v[c..])));
                    st16(&mut oh[c..], x);
                }
                for (x, vv) in oh[whole..].iter_mut().zip(&v[whole..]) {
                    *x += s * vv;
                }
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
                let s = w[j * n + t];
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

    /// Every ISA's scores and weighted sums are the reference's bits, for
    /// vector lengths around the SIMD widths and several heads.
    #[test]
    fn every_isa_gives_the_reference_bits() {
        let mut seed = 5;
        for d in [1, 3, 4, 8, 15, 16, 17, 31, 64, 100, 128, 129] {
            for (nb, n) in [(1, 1), (3, 7), (8, 33)] {
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
                }
            }
        }
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
