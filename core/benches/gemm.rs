//! What several inputs cost a matrix product: `gemm` of `n` inputs against
//! the same inputs one `gemv` at a time (the weights read from memory `n`
//! times) and against a tiled loop of `gemv`s (the weights read once, each
//! input computed on its own, which `gemm` did before grouping inputs), one
//! thread, on matrices of Qwen3-30B-A3B's shapes. The three run interleaved;
//! the table gives the medians as a cost per input, in single `gemv`s.
//!
//! `cargo bench -p les-core --bench gemm` (`LES_BENCH_SECONDS` per case,
//! default 1; `LES_BENCH_ISA=avx2` or another available ISA's name instead of
//! the detected one).

// A bench binary: its helpers need no docs.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use les_core::gemv::{
    gemm, gemv, gemv_with_prefetch, Input, Isa, MatrixView, GEMM_TILE_BYTES, PREFETCH_DISTANCE,
};
use les_core::quant::blocks::BlockQ8K;
use les_core::quant::{quantize, GgmlType, QK_K};

/// A deterministic pseudo-random value in [-1, 1).
fn noise(state: &mut u64) -> f32 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A `rows` x `cols` matrix of `ty`: 64 distinct quantized rows, tiled.
/// (`IQ4_XS` and the lattice types, which LES reads but does not write:
/// random bits, each block's scale `d` a plain 1/64.)
fn matrix(ty: GgmlType, rows: usize, cols: usize, st: &mut u64) -> Vec<u8> {
    let vals: Vec<f32> = (0..64 * cols).map(|_| noise(st)).collect();
    let mut block = vec![0u8; 64 * ty.row_bytes(cols).unwrap()];
    if !les_core::quant::can_quantize(ty) {
        for b in block.iter_mut() {
            *b = (noise(st) * 127.0) as i8 as u8;
        }
        for b in block.chunks_exact_mut(ty.block_bytes()) {
            b[..2].copy_from_slice(&les_core::quant::f32_to_f16(1.0 / 64.0).to_le_bytes());
        }
    } else {
        quantize(ty, &vals, &mut block).unwrap();
    }
    block
        .iter()
        .copied()
        .cycle()
        .take(rows * ty.row_bytes(cols).unwrap())
        .collect()
}

fn q8k(cols: usize, st: &mut u64) -> Vec<BlockQ8K> {
    let x: Vec<f32> = (0..cols).map(|_| noise(st)).collect();
    let mut out = vec![
        BlockQ8K {
            d: [0; 4],
            qs: [0; QK_K],
            bsums: [[0; 2]; QK_K / 16]
        };
        cols / QK_K
    ];
    les_core::quant::kquants::quantize_q8k(&x, &mut out);
    out
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let isa = match std::env::var("LES_BENCH_ISA") {
        Ok(name) => Isa::available()
            .find(|i| i.name() == name)
            .unwrap_or_else(|| panic!("LES_BENCH_ISA={name} is not available here")),
        Err(_) => Isa::detect(),
    };
    let budget = Duration::from_secs_f64(
        std::env::var("LES_BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1.0),
    );
    println!("isa {isa}; cost of n inputs per input, in single gemvs (medians, interleaved)");
    println!(
        "{:<34} {:>3} {:>10} {:>10} {:>10} {:>14}",
        "matrix", "n", "n gemvs", "tiled", "gemm", "gemm vs tiled"
    );
    let mut st = 0x5eed;
    for (name, ty, rows, cols) in [
        ("attention q (4096 x 2048)", GgmlType::Q4K, 4096, 2048),
        ("expert gate (768 x 2048)", GgmlType::Q4K, 768, 2048),
        ("output (32768 x 2048)", GgmlType::Q6K, 32768, 2048),
        ("expert gate, q5_k (768 x 2048)", GgmlType::Q5K, 768, 2048),
        (
            "expert gate, iq4_xs (768 x 2048)",
            GgmlType::IQ4XS,
            768,
            2048,
        ),
        (
            "expert gate, iq2_xxs (768 x 2048)",
            GgmlType::IQ2XXS,
            768,
            2048,
        ),
        (
            "expert gate, iq3_xxs (768 x 2048)",
            GgmlType::IQ3XXS,
            768,
            2048,
        ),
        ("expert gate, iq1_s (768 x 2048)", GgmlType::IQ1S, 768, 2048),
        ("attention q, q8_0 (ungrouped)", GgmlType::Q8_0, 4096, 2048),
    ] {
        let data = matrix(ty, rows, cols, &mut st);
        let m = MatrixView::new(ty, rows, cols, &data).unwrap();
        let acts: Vec<(Vec<BlockQ8K>, Vec<les_core::quant::blocks::BlockQ8_0>)> = (0..8)
            .map(|_| {
                let x: Vec<f32> = (0..cols).map(|_| noise(&mut st)).collect();
                let mut q0 = vec![
                    les_core::quant::blocks::BlockQ8_0 {
                        d: [0; 2],
                        qs: [0; 32]
                    };
                    cols / 32
                ];
                les_core::quant::legacy::quantize_q8_0(&x, &mut q0);
                (q8k(cols, &mut st), q0)
            })
            .collect();
        let inputs: Vec<Input<'_>> = acts
            .iter()
            .map(|(k, q0)| Input {
                f32: &[],
                q8_0: q0,
                q8_1: &[],
                q8k: k,
            })
            .collect();
        let mut one = vec![0f32; rows];
        let mut t1 = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            gemv(isa, &m, &inputs[0], 0..rows, &mut one).unwrap();
            t1.push(t.elapsed().as_secs_f64());
        }
        for n in [1, 2, 4, 8] {
            let xs = &inputs[..n];
            let mut out = vec![vec![0f32; rows]; n];
            let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
            let start = Instant::now();
            while start.elapsed() < budget || times[0].len() < 5 {
                let t = Instant::now();
                gemv(isa, &m, &xs[0], 0..rows, &mut one).unwrap();
                times[3].push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                for (x, y) in xs.iter().zip(out.iter_mut()) {
                    gemv(isa, &m, x, 0..rows, y).unwrap();
                }
                times[0].push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                let tile = (GEMM_TILE_BYTES / m.row_bytes()).max(1);
                for start in (0..rows).step_by(tile) {
                    let end = (start + tile).min(rows);
                    for (c, (x, y)) in xs.iter().zip(out.iter_mut()).enumerate() {
                        let p = if c == 0 { PREFETCH_DISTANCE } else { 0 };
                        gemv_with_prefetch(isa, &m, x, start..end, &mut y[start..end], p).unwrap();
                    }
                }
                times[1].push(t.elapsed().as_secs_f64());
                let t = Instant::now();
                let mut ys: Vec<&mut [f32]> = out.iter_mut().map(|v| &mut v[..]).collect();
                gemm(isa, &m, xs, 0..rows, &mut ys).unwrap();
                times[2].push(t.elapsed().as_secs_f64());
                black_box(&out);
            }
            let single = median(&mut times[3]);
            let [each, tiled, grouped] =
                [0, 1, 2].map(|i| median(&mut times[i]) / (n as f64 * single));
            println!(
                "{name:<34} {n:>3} {each:>10.2} {tiled:>10.2} {grouped:>10.2} {:>13.2}x",
                tiled / grouped
            );
        }
    }
}
