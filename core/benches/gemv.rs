//! GEMV throughput per weight type and ISA on a 2048 x 768 matrix (2048 rows of 768
//! elements, an expert's down projection), reference and SIMD side by side;
//! `LES_BENCH_SHAPE=768x2048` (rows x columns) measures another shape, such as the
//! gate and up projections.
//!
//! `cargo bench -p les-core --bench gemv -- --warm-up-time 1 --measurement-time 2`

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use les_core::gemv::{activation_format, gemv, Input, Isa, MatrixView};
use les_core::quant::blocks::{as_blocks_mut, BlockQ8K, BlockQ8_0, BlockQ8_1};
use les_core::quant::{f16_to_f32, f32_to_bf16, f32_to_f16, GgmlType, QK_K};

/// The matrix shape: `LES_BENCH_SHAPE` (`ROWSxCOLS`, columns a multiple of 256)
/// or 2048 x 768.
fn shape() -> (usize, usize) {
    static SHAPE: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    *SHAPE.get_or_init(|| {
        let parsed = std::env::var("LES_BENCH_SHAPE").ok().and_then(|v| {
            let (r, c) = v.split_once('x')?;
            Some((r.parse().ok()?, c.parse().ok()?))
        });
        match parsed {
            Some((r, c)) if r > 0 && c > 0 && c % QK_K == 0 => (r, c),
            _ => (2048, 768),
        }
    })
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn f16(&mut self) -> [u8; 2] {
        f32_to_f16(0.01 + 0.05 * self.unit().abs()).to_le_bytes()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Offsets of the f16 scales in a block.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType as T;
    match ty {
        T::Q3K => &[108],
        T::Q6K => &[208],
        T::Q2K => &[80, 82],
        T::Q4_1 | T::Q5_1 | T::Q4K | T::Q5K => &[0, 2],
        // IQ1_M's scale is spread over its scale words: see `matrix`.
        T::F32 | T::F16 | T::BF16 | T::MXFP4 | T::IQ1M => &[],
        _ => &[0],
    }
}

fn matrix(ty: GgmlType, rng: &mut Rng) -> Vec<u8> {
    let (rows, cols) = shape();
    match ty {
        GgmlType::F32 => (0..rows * cols)
            .flat_map(|_| rng.unit().to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..rows * cols)
            .flat_map(|_| f32_to_f16(rng.unit()).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..rows * cols)
            .flat_map(|_| f32_to_bf16(rng.unit()).to_le_bytes())
            .collect(),
        _ => {
            let mut v = rng.bytes(ty.row_bytes(cols).unwrap() * rows);
            for b in v.chunks_exact_mut(ty.block_bytes()) {
                for &o in scale_offsets(ty) {
                    b[o..o + 2].copy_from_slice(&rng.f16());
                }
                if ty == GgmlType::MXFP4 {
                    b[0] = 127; // a scale of 0.5, never subnormal
                }
                if ty == GgmlType::IQ1M {
                    // The f16 scale's nibbles top the four u16 scale words.
                    let d = u16::from_le_bytes(rng.f16());
                    for k in 0..4 {
                        let w = u16::from_le_bytes([b[48 + 2 * k], b[49 + 2 * k]]);
                        let w = (w & 0x0fff) | ((d >> (4 * k)) & 15) << 12;
                        b[48 + 2 * k..50 + 2 * k].copy_from_slice(&w.to_le_bytes());
                    }
                }
            }
            v
        }
    }
}

fn bench(c: &mut Criterion) {
    let (rows, cols) = shape();
    let mut rng = Rng(1);
    let x: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
    let mut b0 = rng.bytes(cols / 32 * 34);
    let q8_0: &mut [BlockQ8_0] = as_blocks_mut(&mut b0).unwrap();
    q8_0.iter_mut().for_each(|b| b.d = rng.f16());
    let mut b1 = rng.bytes(cols / 32 * 36);
    let q8_1: &mut [BlockQ8_1] = as_blocks_mut(&mut b1).unwrap();
    for b in q8_1.iter_mut() {
        b.d = rng.f16();
        let s: i32 = b.qs.iter().map(|&q| q as i32).sum();
        b.s = f32_to_f16(f16_to_f32(u16::from_le_bytes(b.d)) * s as f32).to_le_bytes();
    }
    let mut bk = rng.bytes(cols / QK_K * 292);
    let q8k: &mut [BlockQ8K] = as_blocks_mut(&mut bk).unwrap();
    for b in q8k.iter_mut() {
        b.d = 0.01f32.to_le_bytes();
        for j in 0..16 {
            let s: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
            b.bsums[j] = (s as i16).to_le_bytes();
        }
    }
    let input = Input {
        f32: &x,
        q8_0,
        q8_1,
        q8k,
    };
    let mut y = vec![0.0f32; rows];
    for ty in GgmlType::ALL {
        if activation_format(ty).is_none() {
            continue;
        }
        let data = matrix(ty, &mut rng);
        let m = MatrixView::new(ty, rows, cols, &data).unwrap();
        let mut g = c.benchmark_group(format!("gemv_{}_{rows}x{cols}", ty.name()));
        // Reported as GB/s of weights read.
        g.throughput(Throughput::Bytes(data.len() as u64));
        for isa in Isa::available() {
            g.bench_function(isa.name(), |b| {
                b.iter(|| {
                    gemv(isa, black_box(&m), black_box(&input), 0..rows, &mut y).unwrap();
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
