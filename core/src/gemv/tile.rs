//! Float weights times many tokens at once: the products of a vision tower's
//! (or any batch's) `f32`, `f16` and `bf16` matrices.
//!
//! [`gemv`](super::gemv) multiplies one token's activations by each row: every
//! weight is loaded (and for `f16`, converted) once per token. [`float_tile`]
//! multiplies three rows by four tokens in registers, so each converted weight
//! serves four tokens and each activation three rows. Its products keep one
//! 8-lane accumulator each: element `i` is added into lane `i % 8` by a fused
//! multiply-add, in order, and the lanes are folded by halves (`s[l] += s[l +
//! 4]`, `+ 2`, `+ 1`), on every ISA and whatever the tiling, so a product does
//! not depend on where the tile boundaries fall, on the thread count or on the
//! CPU. (This order differs from `gemv`'s 64 lanes: a product here is not
//! bit for bit `gemv`'s. [`gemm`](super::gemm) is the multi-token product
//! that is, for the language model's batches; with float weights its 64-lane
//! products cannot share registers across tokens.)

use core::ops::Range;

use super::{reference as r, GemvError, Isa, MatrixView};
use crate::quant::GgmlType;

/// Whether [`float_tile`] takes matrices of `ty`: `F32`, `F16`, `BF16`.
pub fn tiles(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// The kernels of one ISA.
#[derive(Clone, Copy)]
enum Kernels {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2(super::avx2::Avx2),
    #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
    Neon(super::neon::Neon),
}

impl Kernels {
    fn of(isa: Isa) -> Result<Kernels, GemvError> {
        match isa {
            Isa::Scalar => Ok(Kernels::Scalar),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::AvxVnni | Isa::Avx512 | Isa::Avx512Vnni => super::avx2::Avx2::new()
                .map(Kernels::Avx2)
                .ok_or(GemvError::IsaUnavailable(isa)),
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Isa::Neon => Ok(Kernels::Neon(super::neon::Neon)),
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Isa::NeonDot => super::neon::NeonDot::new()
                .map(|_| Kernels::Neon(super::neon::Neon))
                .ok_or(GemvError::IsaUnavailable(isa)),
            #[allow(unreachable_patterns)]
            _ => Err(GemvError::IsaUnavailable(isa)),
        }
    }

    /// One row times one token.
    fn one(self, ty: GgmlType, w: &[u8], x: &[f32]) -> f32 {
        match self {
            Kernels::Scalar => reference_dot(ty, w, x),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(k) => k.float_one(ty, w, x),
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Kernels::Neon(k) => k.float_one(ty, w, x),
        }
    }

    /// `ROWS` rows times `TOKENS` tokens: `[row][token]`.
    fn tile(self, ty: GgmlType, w: [&[u8]; ROWS], x: [&[f32]; TOKENS]) -> [[f32; TOKENS]; ROWS] {
        match self {
            Kernels::Scalar => w.map(|w| x.map(|x| reference_dot(ty, w, x))),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2(k) => k.float_tile(ty, w, x),
            #[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
            Kernels::Neon(k) => k.float_tile(ty, w, x),
        }
    }
}

/// One product in the module's order, element by element.
fn reference_dot(ty: GgmlType, w: &[u8], x: &[f32]) -> f32 {
    match ty {
        GgmlType::F32 => r::finish8([0.0; 8], r::f32_elems(w, 0), x),
        GgmlType::F16 => r::finish8([0.0; 8], r::f16_elems(w, 0), x),
        GgmlType::BF16 => r::finish8([0.0; 8], r::bf16_elems(w, 0), x),
        _ => 0.0,
    }
}

/// `out[t * rows.len() + (r - rows.start)] = W[r] . x[t]` for the `n`
/// tokens of `x` (`w.cols()` floats each, back to back) and every row `r` of
/// `rows`, in the module's order. `w` must be `F32`, `F16` or `BF16`.
pub fn float_tile(
    isa: Isa,
    w: &MatrixView<'_>,
    x: &[f32],
    n: usize,
    rows: Range<usize>,
    out: &mut [f32],
) -> Result<(), GemvError> {
    if !tiles(w.ty) {
        return Err(GemvError::UnsupportedType(w.ty));
    }
    let cols = w.cols;
    if n * cols != x.len() {
        return Err(GemvError::InputLength {
            format: super::ActivationFormat::F32,
            expected: n * cols,
            len: x.len(),
        });
    }
    super::check_row_range(w, &rows)?;
    let nr = rows.len();
    if out.len() != n * nr {
        return Err(GemvError::OutputLength {
            expected: n * nr,
            len: out.len(),
        });
    }
    let k = Kernels::of(isa)?;
    let (ty, rb) = (w.ty, w.row_bytes);
    let row = |r: usize| &w.data[r * rb..(r + 1) * rb];
    let token = |t: usize| &x[t * cols..(t + 1) * cols];
    let mut r = rows.start;
    while r < rows.end {
        let i = r - rows.start;
        if r + ROWS <= rows.end {
            let mut t = 0;
            while t + TOKENS <= n {
                let w = core::array::from_fn(|a| row(r + a));
                let y = k.tile(ty, w, core::array::from_fn(|j| token(t + j)));
                for (a, ya) in y.iter().enumerate() {
                    for (j, v) in ya.iter().enumerate() {
                        out[(t + j) * nr + i + a] = *v;
                    }
                }
                t += TOKENS;
            }
            for t in t..n {
                for a in 0..ROWS {
                    out[t * nr + i + a] = k.one(ty, row(r + a), token(t));
                }
            }
            r += ROWS;
        } else {
            for t in 0..n {
                out[t * nr + i] = k.one(ty, row(r), token(t));
            }
            r += 1;
        }
    }
    Ok(())
}

/// Rows of a register tile: blocks of rows that are a multiple of it go
/// through whole tiles only (a leftover row takes the slower one-row path).
pub const ROWS: usize = 3;
/// Tokens of a register tile.
const TOKENS: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use std::vec::Vec;

    /// `vals` as little-endian `ty` bytes.
    fn encode(ty: GgmlType, vals: &[f32]) -> Vec<u8> {
        vals.iter()
            .flat_map(|&v| match ty {
                GgmlType::F32 => v.to_le_bytes().to_vec(),
                GgmlType::F16 => crate::quant::f32_to_f16(v).to_le_bytes().to_vec(),
                _ => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// Every ISA gives the scalar products bit for bit, whatever the
        /// shape (tiles of two rows and four tokens, and the edges), and the
        /// products are dot products.
        #[test]
        fn every_isa_gives_the_reference_products(
            nrows in 1usize..=7,
            cols in 0usize..=80,
            n in 1usize..=9,
            start in 0usize..3,
            seed in any::<u32>(),
        ) {
            let mut st = seed;
            let mut noise = || {
                st = st.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (st >> 8) as f32 / (1 << 23) as f32 - 1.0
            };
            let wv: [f32; 7 * 80] = core::array::from_fn(|_| noise());
            let xv: [f32; 9 * 80] = core::array::from_fn(|_| noise());
            let x = &xv[..n * cols];
            for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
                let bytes = encode(ty, &wv[..nrows * cols]);
                let w = MatrixView::new(ty, nrows, cols, &bytes).unwrap();
                let rows = start.min(nrows)..nrows;
                let m = rows.len();
                let mut want = [0f32; 9 * 7];
                float_tile(Isa::Scalar, &w, x, n, rows.clone(), &mut want[..n * m]).unwrap();
                for t in 0..n {
                    for (i, r) in rows.clone().enumerate() {
                        let row = &bytes[r * w.row_bytes..(r + 1) * w.row_bytes];
                        let eb = w.row_bytes / cols.max(1);
                        let mut exact = 0f64;
                        for c in 0..cols {
                            let wc = reference_dot(ty, &row[c * eb..(c + 1) * eb], &[1.0]);
                            exact += f64::from(wc) * f64::from(x[t * cols + c]);
                        }
                        prop_assert!((f64::from(want[t * m + i]) - exact).abs() < 1e-4, "{} {} {}", ty, t, r);
                    }
                }
                for isa in Isa::available() {
                    let mut got = [f32::NAN; 9 * 7];
                    float_tile(isa, &w, x, n, rows.clone(), &mut got[..n * m]).unwrap();
                    for i in 0..n * m {
                        prop_assert_eq!(got[i].to_bits(), want[i].to_bits(), "{} {} at {}", ty, isa, i);
                    }
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let data = [0u8; 4 * 6];
        let w = MatrixView::new(GgmlType::F32, 2, 3, &data).unwrap();
        let mut out = [0f32; 4];
        assert!(float_tile(Isa::Scalar, &w, &[0.0; 5], 2, 0..2, &mut out).is_err());
        assert!(float_tile(Isa::Scalar, &w, &[0.0; 6], 2, 0..3, &mut out).is_err());
        assert!(float_tile(Isa::Scalar, &w, &[0.0; 6], 2, 0..2, &mut out[..3]).is_err());
        float_tile(Isa::Scalar, &w, &[0.0; 6], 2, 0..2, &mut out).unwrap();
        let q = [0u8; 34];
        let w = MatrixView::new(GgmlType::Q8_0, 1, 32, &q).unwrap();
        assert_eq!(
            float_tile(Isa::Scalar, &w, &[0.0; 32], 1, 0..1, &mut out[..1]),
            Err(GemvError::UnsupportedType(GgmlType::Q8_0))
        );
    }
}
