//! Tests of the GEMV kernels: SIMD == reference bit for bit, reference ~ a plain float
//! computation from the format description, GEMV == per-row dot products, errors.

extern crate std;

use std::vec;
use std::vec::Vec;

use proptest::prelude::*;

use super::*;
use crate::quant::blocks::{as_blocks_mut, block_bytes};
use crate::quant::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, QK_K};
use core::ops::Range;

/// SplitMix64: bulk random bytes without proptest shrinking cost.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A finite, moderate, normal value: sign * 2^e * (1 + f), e in -8..=0.
    fn scale(&mut self) -> f32 {
        let e = (self.next() % 9) as i32 - 8;
        let f = (self.next() % 1024) as f32 / 1024.0;
        let s = if self.next() & 1 == 1 { -1.0 } else { 1.0 };
        s * libm::ldexpf(1.0 + f, e)
    }
    fn f16(&mut self) -> [u8; 2] {
        f32_to_f16(self.scale()).to_le_bytes()
    }
}

/// Offsets of the f16 scale fields inside one block of a quantized weight type.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType as T;
    match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4NL | T::Q3K | T::Q6K | T::IQ4XS => match ty {
            T::Q3K => &[108],
            T::Q6K => &[208],
            _ => &[0],
        },
        T::IQ2XXS | T::IQ2XS | T::IQ2S | T::IQ3XXS | T::IQ3S | T::IQ1S => &[0],
        T::Q4_1 | T::Q5_1 | T::Q4K | T::Q5K => &[0, 2],
        T::Q2K => &[80, 82],
        _ => &[],
    }
}

/// `nrows` random rows of `cols` elements of `ty`: random bytes, with finite moderate
/// scales (and finite float weights).
fn random_matrix(ty: GgmlType, nrows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let bytes = ty.row_bytes(cols).unwrap() * nrows;
    match ty {
        GgmlType::F32 => (0..nrows * cols)
            .flat_map(|_| (4.0 * rng.unit()).to_le_bytes())
            .collect(),
        // Any finite half, subnormals included.
        GgmlType::F16 => (0..nrows * cols)
            .flat_map(|_| {
                let h = rng.next() as u16;
                let h = if h & 0x7c00 == 0x7c00 { h & !0x4000 } else { h };
                h.to_le_bytes()
            })
            .collect(),
        GgmlType::BF16 => (0..nrows * cols)
            .flat_map(|_| f32_to_bf16(4.0 * rng.unit()).to_le_bytes())
            .collect(),
        _ => {
            let mut v = rng.bytes(bytes);
            for block in v.chunks_exact_mut(ty.block_bytes()) {
                for &o in scale_offsets(ty) {
                    block[o..o + 2].copy_from_slice(&rng.f16());
                }
                if ty == GgmlType::MXFP4 {
                    // Exponents from 2^-16 to 2^15, as the f16 scales span.
                    block[0] = 112 + (rng.next() % 32) as u8;
                }
                if ty == GgmlType::IQ1M {
                    set_iq1m_scale(block, rng.f16());
                }
            }
            v
        }
    }
}

/// Writes the f16 `d` into an `IQ1_M` block: its four nibbles are the top
/// nibbles of the four `u16` scale words (bytes 48..56), lowest first.
fn set_iq1m_scale(block: &mut [u8], d: [u8; 2]) {
    let d = u16::from_le_bytes(d);
    for k in 0..4 {
        let at = 48 + 2 * k;
        let w = u16::from_le_bytes([block[at], block[at + 1]]);
        let w = (w & 0x0fff) | ((d >> (4 * k)) & 15) << 12;
        block[at..at + 2].copy_from_slice(&w.to_le_bytes());
    }
}

/// Activation buffers for `cols` elements, all formats filled.
struct Acts {
    f32: Vec<f32>,
    q8_0: Vec<BlockQ8_0>,
    q8_1: Vec<BlockQ8_1>,
    q8k: Vec<BlockQ8K>,
}

impl Acts {
    fn random(cols: usize, rng: &mut Rng) -> Acts {
        let f32 = (0..cols).map(|_| 4.0 * rng.unit()).collect();
        let nb = cols / 32;
        let mut b0 = rng.bytes(nb * 34);
        let q8_0: &mut [BlockQ8_0] = as_blocks_mut(&mut b0).unwrap();
        for b in q8_0.iter_mut() {
            b.d = rng.f16();
        }
        let q8_0 = q8_0.to_vec();
        let mut b1 = rng.bytes(nb * 36);
        let q8_1: &mut [BlockQ8_1] = as_blocks_mut(&mut b1).unwrap();
        for b in q8_1.iter_mut() {
            b.d = rng.f16();
            let sum: i32 = b.qs.iter().map(|&q| q as i32).sum();
            b.s = f32_to_f16(f16_to_f32(u16::from_le_bytes(b.d)) * sum as f32).to_le_bytes();
        }
        let q8_1 = q8_1.to_vec();
        let mut bk = rng.bytes(cols / QK_K * 292);
        let q8k: &mut [BlockQ8K] = as_blocks_mut(&mut bk).unwrap();
        for b in q8k.iter_mut() {
            b.d = (rng.scale() / 64.0).to_le_bytes();
            for j in 0..16 {
                let s: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
                b.bsums[j] = (s as i16).to_le_bytes();
            }
        }
        let q8k = q8k.to_vec();
        Acts {
            f32,
            q8_0,
            q8_1,
            q8k,
        }
    }

    fn input(&self) -> Input<'_> {
        Input {
            f32: &self.f32,
            q8_0: &self.q8_0,
            q8_1: &self.q8_1,
            q8k: &self.q8k,
        }
    }
}

/// The weight types GEMV supports.
fn weight_types() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL
        .into_iter()
        .filter(|t| activation_format(*t).is_some())
}

/// A row length of `units` blocks (or `units * 23 + units % 7` elements for floats,
/// to hit every tail length).
fn cols_for(ty: GgmlType, units: usize) -> usize {
    if ty.block_elems() == 1 {
        units * 23 + units % 7
    } else {
        units * ty.block_elems()
    }
}

fn check_fast_equals_reference(ty: GgmlType, units: usize, seed: u64) {
    check_fast_equals_reference_cols(ty, cols_for(ty, units), seed);
}

fn check_fast_equals_reference_cols(ty: GgmlType, cols: usize, seed: u64) {
    let mut rng = Rng(seed);
    let acts = Acts::random(cols, &mut rng);
    let nrows = 3;
    let w = random_matrix(ty, nrows, cols, &mut rng);
    let m = MatrixView::new(ty, nrows, cols, &w).unwrap();
    let mut want = vec![0.0f32; nrows];
    gemv(Isa::Scalar, &m, &acts.input(), 0..nrows, &mut want).unwrap();
    for v in &want {
        assert!(v.is_finite(), "{ty}: reference result {v} not finite");
    }
    for isa in Isa::available() {
        let mut got = vec![0.0f32; nrows];
        gemv(isa, &m, &acts.input(), 0..nrows, &mut got).unwrap();
        for r in 0..nrows {
            assert_eq!(
                got[r].to_bits(),
                want[r].to_bits(),
                "{ty} {isa} cols={cols} row {r}: {} != {}",
                got[r],
                want[r]
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn fast_kernels_equal_reference_f(units in 0usize..=24, seed in any::<u64>()) {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
            check_fast_equals_reference(ty, units, seed);
            // Whole 64-lane steps, no tail: the lanes fold in registers.
            check_fast_equals_reference_cols(ty, 64 * (units % 9 + 1), seed);
        }
    }

    #[test]
    fn fast_kernels_equal_reference_32(units in 0usize..=13, seed in any::<u64>()) {
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                   GgmlType::Q8_0, GgmlType::IQ4NL, GgmlType::MXFP4] {
            check_fast_equals_reference(ty, units, seed);
        }
    }

    #[test]
    fn fast_kernels_equal_reference_k(units in 0usize..=4, seed in any::<u64>()) {
        for ty in [GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q4K, GgmlType::Q5K,
                   GgmlType::Q6K, GgmlType::IQ4XS] {
            check_fast_equals_reference(ty, units, seed);
        }
    }

    #[test]
    fn fast_kernels_equal_reference_lattice(units in 0usize..=4, seed in any::<u64>()) {
        for ty in [GgmlType::IQ2XXS, GgmlType::IQ2XS, GgmlType::IQ2S, GgmlType::IQ3XXS,
                   GgmlType::IQ3S, GgmlType::IQ1S, GgmlType::IQ1M] {
            check_fast_equals_reference(ty, units, seed);
        }
    }

    /// Also at any prefetch distance, from none to past the matrix: prefetching
    /// is a hint and never changes a bit.
    #[test]
    fn gemv_over_a_range_equals_row_dots(
        ty_i in 0usize..23,
        units in 0usize..=5,
        nrows in 0usize..=7,
        a in 0usize..=7,
        b in 0usize..=7,
        distance in prop_oneof![
            Just(0usize), 1usize..=200, Just(PREFETCH_DISTANCE), Just(usize::MAX)
        ],
        seed in any::<u64>(),
    ) {
        let ty = weight_types().nth(ty_i).unwrap();
        let mut rng = Rng(seed);
        let cols = cols_for(ty, units);
        let acts = Acts::random(cols, &mut rng);
        let w = random_matrix(ty, nrows, cols, &mut rng);
        let m = MatrixView::new(ty, nrows, cols, &w).unwrap();
        let (start, end) = (a.min(b).min(nrows), a.max(b).min(nrows));
        for isa in Isa::available() {
            let mut y = vec![f32::NAN; end - start];
            gemv_with_prefetch(isa, &m, &acts.input(), start..end, &mut y, distance).unwrap();
            for (i, v) in (start..end).zip(&y) {
                let d = dot(Isa::Scalar, ty, cols, m.row(i).unwrap(), &acts.input()).unwrap();
                prop_assert_eq!(v.to_bits(), d.to_bits(), "{} {} row {} prefetch {}", ty, isa, i, distance);
            }
        }
    }
}

#[test]
fn every_weight_type_is_in_the_range_test() {
    // `gemv_over_a_range_equals_row_dots` draws `ty_i` below this.
    assert_eq!(weight_types().count(), 23);
}

/// `gemm` gives `gemv`'s bits for each input, over matrices of one tile and of
/// several (rows past `GEMM_TILE_BYTES`), any row range, and rejects
/// mismatched outputs without writing.
#[test]
fn gemm_equals_gemv_of_each_input() {
    let mut rng = Rng(77);
    for ty in weight_types() {
        let cols = cols_for(ty, 2);
        let row_bytes = ty.row_bytes(cols).unwrap();
        for nrows in [
            1,
            5,
            GEMM_TILE_BYTES / row_bytes + 3,
            2 * GEMM_TILE_BYTES / row_bytes + 1,
        ] {
            let w = random_matrix(ty, nrows, cols, &mut rng);
            let m = MatrixView::new(ty, nrows, cols, &w).unwrap();
            let acts: Vec<Acts> = (0..3).map(|_| Acts::random(cols, &mut rng)).collect();
            let inputs: Vec<Input<'_>> = acts.iter().map(|a| a.input()).collect();
            for isa in Isa::available() {
                gemm_matches_gemv(isa, &m, &inputs, 0..nrows);
                for rows in [0..nrows, nrows / 2..nrows, 0..0] {
                    let mut out = vec![vec![f32::NAN; rows.len()]; inputs.len()];
                    let mut ys: Vec<&mut [f32]> = out.iter_mut().map(|v| &mut v[..]).collect();
                    gemm(isa, &m, &inputs, rows.clone(), &mut ys).unwrap();
                    for (x, got) in inputs.iter().zip(&out) {
                        let mut want = vec![0f32; rows.len()];
                        gemv(isa, &m, x, rows.clone(), &mut want).unwrap();
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(got), bits(&want), "{ty} {isa} {nrows} rows {rows:?}");
                    }
                }
                let mut short = vec![0f32; nrows - 1];
                let mut full = vec![f32::NAN; nrows];
                let mut ys: Vec<&mut [f32]> = vec![&mut full[..], &mut short[..], &mut []];
                assert!(gemm(isa, &m, &inputs, 0..nrows, &mut ys).is_err());
                assert!(full.iter().all(|v| v.is_nan()), "nothing written on error");
                let mut ys: Vec<&mut [f32]> = Vec::new();
                assert!(gemm(isa, &m, &inputs, 0..nrows, &mut ys).is_err());
            }
        }
    }
}

/// `gemm` of `inputs` over `rows`, at its default prefetch distance and at
/// others, gives `gemv`'s bits for each input.
fn gemm_matches_gemv(isa: Isa, m: &MatrixView<'_>, inputs: &[Input<'_>], rows: Range<usize>) {
    for distance in [None, Some(0), Some(64), Some(PREFETCH_DISTANCE)] {
        gemm_at_matches_gemv(isa, m, inputs, rows.clone(), distance);
    }
}

fn gemm_at_matches_gemv(
    isa: Isa,
    m: &MatrixView<'_>,
    inputs: &[Input<'_>],
    rows: Range<usize>,
    distance: Option<usize>,
) {
    let mut out = vec![vec![f32::NAN; rows.len()]; inputs.len()];
    let mut ys: Vec<&mut [f32]> = out.iter_mut().map(|v| &mut v[..]).collect();
    match distance {
        None => gemm(isa, m, inputs, rows.clone(), &mut ys).unwrap(),
        Some(d) => gemm_with_prefetch(isa, m, inputs, rows.clone(), &mut ys, d).unwrap(),
    }
    for (c, (x, got)) in inputs.iter().zip(&out).enumerate() {
        let mut want = vec![0f32; rows.len()];
        gemv(isa, m, x, rows.clone(), &mut want).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(got),
            bits(&want),
            "{} {isa} {} rows {rows:?}, input {c} of {}, prefetch {distance:?}",
            m.ty(),
            m.rows(),
            inputs.len()
        );
    }
}

/// Groups of inputs (`GEMM_GROUP` at a time, and the rest) give each input's
/// `gemv` bits, with rows of odd and even numbers of blocks.
#[test]
fn gemm_in_groups_equals_gemv_of_each_input() {
    let mut rng = Rng(78);
    for ty in weight_types() {
        for blocks in [1, 3, 6] {
            let cols = cols_for(ty, blocks);
            let w = random_matrix(ty, 7, cols, &mut rng);
            let m = MatrixView::new(ty, 7, cols, &w).unwrap();
            let acts: Vec<Acts> = (0..2 * GEMM_GROUP + 1)
                .map(|_| Acts::random(cols, &mut rng))
                .collect();
            let inputs: Vec<Input<'_>> = acts.iter().map(|a| a.input()).collect();
            for isa in Isa::available() {
                for n in 1..=inputs.len() {
                    gemm_matches_gemv(isa, &m, &inputs[..n], 0..7);
                }
                gemm_matches_gemv(isa, &m, &inputs, 2..5);
            }
        }
    }
}

#[test]
fn bytes_ahead_stays_inside_the_data() {
    let data = [0u8; 10];
    assert_eq!(bytes_ahead(&data, 0, 4, 3).len(), 3);
    assert_eq!(bytes_ahead(&data, 2, 4, 8).len(), 4);
    assert!(bytes_ahead(&data, 9, 4, 8).is_empty());
    assert!(bytes_ahead(&data, usize::MAX, usize::MAX, usize::MAX).is_empty());
    assert!(bytes_ahead(&[], 0, 0, 1).is_empty());
}

/// Every weight type against every ISA once with a long row (several SIMD chunks).
#[test]
fn long_rows_match_reference() {
    for ty in weight_types() {
        for seed in 0..4 {
            check_fast_equals_reference(ty, if ty.block_elems() == 1 { 40 } else { 16 }, seed);
        }
    }
}

/// Extreme quant values: every byte -128 / 0x80 and 127 / 0xff, to catch saturation.
#[test]
fn extreme_quants_match_reference() {
    for fill in [0x80u8, 0xff, 0x7f, 0x00] {
        for ty in weight_types().filter(|t| t.block_elems() > 1) {
            let cols = 2 * QK_K;
            let mut rng = Rng(fill as u64);
            let mut w = vec![fill; ty.row_bytes(cols).unwrap()];
            for block in w.chunks_exact_mut(ty.block_bytes()) {
                for &o in scale_offsets(ty) {
                    block[o..o + 2].copy_from_slice(&f32_to_f16(0.5).to_le_bytes());
                }
                if ty == GgmlType::MXFP4 {
                    block[0] = 127; // 0.5
                }
                if ty == GgmlType::IQ1M {
                    set_iq1m_scale(block, f32_to_f16(0.5).to_le_bytes());
                }
            }
            let mut acts = Acts::random(cols, &mut rng);
            for b in acts.q8_0.iter_mut() {
                b.qs = [fill as i8; 32];
            }
            for b in acts.q8_1.iter_mut() {
                b.qs = [fill as i8; 32];
            }
            for b in acts.q8k.iter_mut() {
                b.qs = [fill as i8; QK_K];
                b.bsums = [((fill as i8) as i16 * 16).to_le_bytes(); 16];
            }
            let want = dot(Isa::Scalar, ty, cols, &w, &acts.input()).unwrap();
            for isa in Isa::available() {
                let got = dot(isa, ty, cols, &w, &acts.input()).unwrap();
                assert_eq!(got.to_bits(), want.to_bits(), "{ty} {isa} fill {fill:#x}");
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// Reference kernels against a plain float computation from the format description.

fn hf(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

/// Dequantizes one row of `ty`, written from the layouts in FORMATS.md / ggml's
/// `dequantize_row_*`, element by element.
#[allow(clippy::type_complexity)]
fn dequant(ty: GgmlType, row: &[u8]) -> Vec<f32> {
    use crate::quant::blocks::*;
    use crate::quant::kscales::{scale_min_k4, scales_q3k};
    use GgmlType as T;
    let mut out = Vec::new();
    match ty {
        T::F32 => out.extend(
            row.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap())),
        ),
        T::F16 => out.extend(row.chunks_exact(2).map(|c| hf([c[0], c[1]]))),
        T::BF16 => out.extend(
            row.chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
        ),
        T::Q4_0 => {
            for b in as_blocks::<BlockQ4_0>(row).unwrap() {
                let d = hf(b.d);
                let mut e = [0.0; 32];
                for j in 0..16 {
                    e[j] = d * ((b.qs[j] & 15) as f32 - 8.0);
                    e[j + 16] = d * ((b.qs[j] >> 4) as f32 - 8.0);
                }
                out.extend(e);
            }
        }
        T::Q4_1 => {
            for b in as_blocks::<BlockQ4_1>(row).unwrap() {
                let (d, m) = (hf(b.d), hf(b.m));
                let mut e = [0.0; 32];
                for j in 0..16 {
                    e[j] = d * (b.qs[j] & 15) as f32 + m;
                    e[j + 16] = d * (b.qs[j] >> 4) as f32 + m;
                }
                out.extend(e);
            }
        }
        T::Q5_0 | T::Q5_1 => {
            let blocks: Vec<([u8; 2], Option<[u8; 2]>, [u8; 4], [u8; 16])> = if ty == T::Q5_0 {
                as_blocks::<BlockQ5_0>(row)
                    .unwrap()
                    .iter()
                    .map(|b| (b.d, None, b.qh, b.qs))
                    .collect()
            } else {
                as_blocks::<BlockQ5_1>(row)
                    .unwrap()
                    .iter()
                    .map(|b| (b.d, Some(b.m), b.qh, b.qs))
                    .collect()
            };
            for (d, m, qh, qs) in blocks {
                let qh = u32::from_le_bytes(qh);
                let d = hf(d);
                let mut e = [0.0; 32];
                for j in 0..16 {
                    let q0 = (qs[j] & 15) as u32 | ((qh >> j) & 1) << 4;
                    let q1 = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                    match m {
                        None => {
                            e[j] = d * (q0 as f32 - 16.0);
                            e[j + 16] = d * (q1 as f32 - 16.0);
                        }
                        Some(m) => {
                            e[j] = d * q0 as f32 + hf(m);
                            e[j + 16] = d * q1 as f32 + hf(m);
                        }
                    }
                }
                out.extend(e);
            }
        }
        T::Q8_0 => {
            for b in as_blocks::<BlockQ8_0>(row).unwrap() {
                out.extend(b.qs.iter().map(|&q| hf(b.d) * q as f32));
            }
        }
        T::IQ4NL => {
            for b in as_blocks::<BlockIQ4NL>(row).unwrap() {
                let mut e = [0.0; 32];
                for j in 0..16 {
                    e[j] = hf(b.d) * KVALUES_IQ4NL[(b.qs[j] & 15) as usize] as f32;
                    e[j + 16] = hf(b.d) * KVALUES_IQ4NL[(b.qs[j] >> 4) as usize] as f32;
                }
                out.extend(e);
            }
        }
        T::Q2K => {
            for b in as_blocks::<BlockQ2K>(row).unwrap() {
                let (d, dmin) = (hf(b.d), hf(b.dmin));
                // 16 sub-blocks of 16; element i: 128-half h, shift s, index l.
                for i in 0..256 {
                    let (h, s, l) = (i / 128, (i % 128) / 32, i % 32);
                    let sc = b.scales[i / 16];
                    let q = (b.qs[32 * h + l] >> (2 * s)) & 3;
                    out.push(d * (sc & 15) as f32 * q as f32 - dmin * (sc >> 4) as f32);
                }
            }
        }
        T::Q3K => {
            for b in as_blocks::<BlockQ3K>(row).unwrap() {
                let sc = scales_q3k(&b.scales);
                for i in 0..256 {
                    let (h, s, l) = (i / 128, (i % 128) / 32, i % 32);
                    let lo = ((b.qs[32 * h + l] >> (2 * s)) & 3) as i32;
                    let hbit = (b.hmask[l] >> (4 * h + s)) & 1;
                    let q = lo - if hbit == 1 { 0 } else { 4 };
                    out.push(hf(b.d) * sc[i / 16] as f32 * q as f32);
                }
            }
        }
        T::Q4K | T::Q5K => {
            let blocks: Vec<([u8; 2], [u8; 2], [u8; 12], Option<[u8; 32]>, [u8; 128])> =
                if ty == T::Q4K {
                    as_blocks::<BlockQ4K>(row)
                        .unwrap()
                        .iter()
                        .map(|b| (b.d, b.dmin, b.scales, None, b.qs))
                        .collect()
                } else {
                    as_blocks::<BlockQ5K>(row)
                        .unwrap()
                        .iter()
                        .map(|b| (b.d, b.dmin, b.scales, Some(b.qh), b.qs))
                        .collect()
                };
            for (d, dmin, scales, qh, qs) in blocks {
                for i in 0..256 {
                    let (sc, m) = scale_min_k4(i / 32, &scales);
                    // Chunk of 64: 32 bytes, low nibbles first.
                    let byte = qs[32 * (i / 64) + i % 32];
                    let mut q = if i % 64 < 32 { byte & 15 } else { byte >> 4 };
                    if let Some(qh) = qh {
                        q |= ((qh[i % 32] >> (i / 32)) & 1) << 4;
                    }
                    out.push(hf(d) * sc as f32 * q as f32 - hf(dmin) * m as f32);
                }
            }
        }
        T::Q6K => {
            for b in as_blocks::<BlockQ6K>(row).unwrap() {
                for i in 0..256 {
                    let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
                    let byte = b.ql[64 * h + 32 * (k % 2) + l];
                    let lo = if k < 2 { byte & 15 } else { byte >> 4 };
                    let hi = (b.qh[32 * h + l] >> (2 * k)) & 3;
                    let q = (lo | hi << 4) as i32 - 32;
                    out.push(hf(b.d) * b.scales[i / 16] as f32 * q as f32);
                }
            }
        }
        T::IQ4XS => {
            for b in as_blocks::<BlockIQ4XS>(row).unwrap() {
                for i in 0..256 {
                    let j = i / 32;
                    let ls = ((b.scales_l[j / 2] >> (4 * (j % 2))) & 15) as i32
                        | (((u16::from_le_bytes(b.scales_h) >> (2 * j)) & 3) as i32) << 4;
                    let byte = b.qs[16 * j + i % 16];
                    let q = if i % 32 < 16 { byte & 15 } else { byte >> 4 };
                    out.push(hf(b.d) * (ls - 32) as f32 * KVALUES_IQ4NL[q as usize] as f32);
                }
            }
        }
        T::MXFP4 => {
            for b in as_blocks::<BlockMXFP4>(row).unwrap() {
                // 2^(e - 127) times the E2M1 value (the codebook holds it doubled).
                let scale = libm::ldexpf(1.0, b.e as i32 - 127);
                let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
                let value = |q: u8| {
                    let v = e2m1[(q & 7) as usize];
                    if q & 8 != 0 {
                        -v
                    } else {
                        v
                    }
                };
                for i in 0..32 {
                    let byte = b.qs[i % 16];
                    let q = if i < 16 { byte & 15 } else { byte >> 4 };
                    out.push(scale * value(q));
                }
            }
        }
        // The lattice formats: through `quant::dequantize`, which the
        // integration tests hold bit for bit to the `gguf` package.
        T::IQ2XXS | T::IQ2XS | T::IQ2S | T::IQ3XXS | T::IQ3S | T::IQ1S | T::IQ1M => {
            out = vec![0.0; row.len() / ty.block_bytes() * ty.block_elems()];
            crate::quant::dequantize(ty, row, &mut out).unwrap();
        }
        T::Q8_1 | T::Q8K | T::I8 => unreachable!(),
    }
    out
}

/// The activations a weight type sees, as floats.
fn act_floats(ty: GgmlType, acts: &Acts) -> Vec<f32> {
    match activation_format(ty).unwrap() {
        ActivationFormat::F32 => acts.f32.clone(),
        ActivationFormat::Q8_0 => acts
            .q8_0
            .iter()
            .flat_map(|b| b.qs.map(|q| hf(b.d) * q as f32))
            .collect(),
        ActivationFormat::Q8_1 => acts
            .q8_1
            .iter()
            .flat_map(|b| b.qs.map(|q| hf(b.d) * q as f32))
            .collect(),
        ActivationFormat::Q8K => acts
            .q8k
            .iter()
            .flat_map(|b| b.qs.map(|q| f32::from_le_bytes(b.d) * q as f32))
            .collect(),
    }
}

#[test]
fn reference_matches_float_dot_product() {
    for ty in weight_types() {
        for seed in 0..8u64 {
            let mut rng = Rng(seed * 7919 + ty.id() as u64);
            let cols = cols_for(ty, if ty.block_elems() == 1 { 20 } else { 3 });
            let acts = Acts::random(cols, &mut rng);
            let w = random_matrix(ty, 1, cols, &mut rng);
            let got = dot(Isa::Scalar, ty, cols, &w, &acts.input()).unwrap() as f64;
            let wf = dequant(ty, &w);
            let xf = act_floats(ty, &acts);
            assert_eq!(wf.len(), cols);
            assert_eq!(xf.len(), cols);
            let want: f64 = wf.iter().zip(&xf).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = wf
                .iter()
                .zip(&xf)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            // Q4_1/Q5_1 use the f16 `s = d * sum(q)` of Q8_1 for the min term.
            let slack: f64 = if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                let m_off = 2;
                w.chunks_exact(ty.block_bytes())
                    .zip(&acts.q8_1)
                    .map(|(b, x)| {
                        (hf([b[m_off], b[m_off + 1]]) as f64 * hf(x.s) as f64).abs() * 2e-3
                    })
                    .sum()
            } else {
                0.0
            };
            let tol = 1e-4 * mag + slack + 1e-6;
            assert!(
                (got - want).abs() <= tol,
                "{ty} seed {seed}: reference {got} vs float {want} (tol {tol})"
            );
        }
    }
}

/// A hand-checked case per layout detail: Q4_0's low nibbles are the first half.
#[test]
fn q4_0_nibble_order() {
    let mut w = BlockQ4_0 {
        d: f32_to_f16(1.0).to_le_bytes(),
        qs: [0x88; 16],
    };
    w.qs[0] = 0x8f; // element 0 = 15 - 8 = 7, element 16 = 0
    let mut x = BlockQ8_0 {
        d: f32_to_f16(1.0).to_le_bytes(),
        qs: [0; 32],
    };
    x.qs[0] = 2;
    x.qs[16] = 100;
    assert_eq!(reference::dot_q4_0(&[w], &[x]), 14.0);
    for isa in Isa::available() {
        let input = Input {
            q8_0: core::slice::from_ref(&x),
            ..Input::default()
        };
        let got = dot(isa, GgmlType::Q4_0, 32, block_bytes(&[w]), &input).unwrap();
        assert_eq!(got, 14.0, "{isa}");
    }
}

// ---------------------------------------------------------------------------------
// API: detection and errors.

#[test]
fn detect_returns_an_available_isa() {
    let best = Isa::detect();
    assert!(best.is_available());
    assert!(Isa::Scalar.is_available());
    assert_eq!(Isa::available().next(), Some(Isa::Scalar));
    #[cfg(target_arch = "x86_64")]
    {
        assert!(!Isa::Neon.is_available());
        assert!(!Isa::NeonDot.is_available());
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            assert_ne!(best, Isa::Scalar);
        }
    }
}

/// The dot-product instructions are detected as `std` detects them. QEMU's
/// default CPU has them: `scripts/test-aarch64.sh` sets `LES_EXPECT_NEON_DOTPROD`,
/// so that the `NeonDot` kernels surely run in every kernel test there.
#[cfg(target_arch = "aarch64")]
#[test]
fn dotprod_detection_agrees_with_std() {
    assert_eq!(
        Isa::NeonDot.is_available(),
        std::arch::is_aarch64_feature_detected!("dotprod")
    );
    assert!(Isa::Neon.is_available());
    if std::env::var_os("LES_EXPECT_NEON_DOTPROD").is_some() {
        assert!(Isa::NeonDot.is_available(), "this CPU should have dotprod");
    }
}

#[test]
fn errors_instead_of_panics() {
    let w = vec![0u8; 2 * 18];
    assert_eq!(
        MatrixView::new(GgmlType::Q8K, 1, 256, &[0; 292]).unwrap_err(),
        GemvError::UnsupportedType(GgmlType::Q8K)
    );
    assert_eq!(
        MatrixView::new(GgmlType::Q4_0, 2, 33, &w).unwrap_err(),
        GemvError::RowLength {
            ty: GgmlType::Q4_0,
            cols: 33
        }
    );
    assert_eq!(
        MatrixView::new(GgmlType::Q4_0, 3, 32, &w).unwrap_err(),
        GemvError::MatrixBytes {
            expected: 54,
            len: 36
        }
    );
    assert!(matches!(
        MatrixView::new(GgmlType::Q4_0, usize::MAX, 32, &w),
        Err(GemvError::RowLength { .. })
    ));
    let m = MatrixView::new(GgmlType::Q4_0, 2, 32, &w).unwrap();
    let x = [BlockQ8_0 {
        d: [0; 2],
        qs: [0; 32],
    }];
    let input = Input {
        q8_0: &x,
        ..Input::default()
    };
    let mut y = [0.0f32; 2];
    assert_eq!(
        gemv(Isa::Scalar, &m, &Input::default(), 0..2, &mut y),
        Err(GemvError::InputLength {
            format: ActivationFormat::Q8_0,
            expected: 1,
            len: 0
        })
    );
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 2..1;
    assert!(matches!(
        gemv(Isa::Scalar, &m, &input, reversed, &mut y[..0]),
        Err(GemvError::RowRange { .. })
    ));
    assert!(matches!(
        gemv(Isa::Scalar, &m, &input, 1..3, &mut y),
        Err(GemvError::RowRange { .. })
    ));
    assert_eq!(
        gemv(Isa::Scalar, &m, &input, 0..1, &mut y),
        Err(GemvError::OutputLength {
            expected: 1,
            len: 2
        })
    );
    for isa in Isa::ALL {
        let r = gemv(isa, &m, &input, 0..2, &mut y);
        assert_eq!(r.is_ok(), isa.is_available(), "{isa}");
        if !isa.is_available() {
            assert_eq!(r, Err(GemvError::IsaUnavailable(isa)));
        }
    }
    assert!(gemv(Isa::Scalar, &m, &input, 1..1, &mut []).is_ok());
    // Display is implemented and says something.
    let e: &dyn core::error::Error = &GemvError::IsaUnavailable(Isa::Neon);
    assert!(std::format!("{e}").contains("neon"));
}

#[test]
fn zero_length_rows() {
    for ty in weight_types() {
        let m = MatrixView::new(ty, 3, 0, &[]).unwrap();
        let mut y = [1.0f32; 3];
        for isa in Isa::available() {
            gemv(isa, &m, &Input::default(), 0..3, &mut y).unwrap();
            assert_eq!(y, [0.0; 3]);
        }
    }
}
