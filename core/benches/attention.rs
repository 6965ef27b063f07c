//! Attention's vector kernels (`les_core::gemv::vector`), one thread, on one
//! key/value head of Qwen3-30B-A3B's shape (8 query heads of 128 sharing it)
//! over 64, 512 and 4096 cached positions, the delta rule of one DeltaNet
//! layer of MiniCPM-V 4.7's (32 heads of 128), and the SwiGLU of one layer's
//! eight experts of Qwen3-30B-A3B's (8 x 768): the scalar reference and the
//! CPU's ISA side by side, interleaved, with their ratio; SwiGLU also against
//! the platform's `expf` (`libm`), which LES used before.
//!
//! `cargo bench -p les-core --bench attention` (`LES_BENCH_SECONDS` per case,
//! default 1).

// A bench binary: its helpers need no docs.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use les_core::gemv::vector::{delta_rule, scaled_dots, softmax, swiglu, weighted_rows, Strided};
use les_core::gemv::Isa;

fn noise(state: &mut u64) -> f32 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let isa = Isa::detect();
    let budget = Duration::from_secs_f64(
        std::env::var("LES_BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1.0),
    );
    let env = |name: &str, default: usize| -> usize {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    // Query rows sharing the KV head (`LES_BENCH_HEADS`; a prompt's groups of
    // positions have many) and the head size (`LES_BENCH_D`).
    let (heads, d) = (env("LES_BENCH_HEADS", 8), env("LES_BENCH_D", 128));
    let stride: usize = std::env::var("LES_BENCH_STRIDE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512);
    println!("isa {isa}: microseconds for one KV head ({heads} query heads of {d}), medians");
    println!(
        "{:<10} {:>9} {:>11} {:>11} {:>8}",
        "positions",
        "kernel",
        "scalar us",
        format!("{isa} us"),
        "ratio"
    );
    let mut st = 7;
    for n in [64, 512, 4096] {
        let rows: Vec<f32> = (0..n * stride).map(|_| noise(&mut st)).collect();
        let q: Vec<f32> = (0..heads * d).map(|_| noise(&mut st)).collect();
        let r = Strided {
            data: &rows,
            stride,
            n,
            d,
        };
        let mut sc = vec![0f32; heads * n];
        let mut o = vec![0f32; heads * d];
        let mut t = [
            [Vec::new(), Vec::new()],
            [Vec::new(), Vec::new()],
            [Vec::new(), Vec::new()],
        ];
        let start = Instant::now();
        while start.elapsed() < budget || t[0][0].len() < 5 {
            for (i, which) in [Isa::Scalar, isa].into_iter().enumerate() {
                let t0 = Instant::now();
                scaled_dots(which, &q, r, 0.088, &mut sc);
                let t1 = Instant::now();
                for row in sc.chunks_exact_mut(n) {
                    softmax(which, row);
                }
                let t2 = Instant::now();
                weighted_rows(which, &sc, r, &mut o);
                let t3 = Instant::now();
                black_box(&o);
                t[0][i].push((t1 - t0).as_secs_f64());
                t[1][i].push((t2 - t1).as_secs_f64());
                t[2][i].push((t3 - t2).as_secs_f64());
            }
        }
        for (name, tt) in ["scores", "softmax", "sums"].iter().zip(t.iter_mut()) {
            let (s, v) = (median(&mut tt[0]), median(&mut tt[1]));
            println!(
                "{n:<10} {name:>9} {:>11.1} {:>11.1} {:>7.2}x",
                s * 1e6,
                v * 1e6,
                s / v
            );
        }
    }
    // One DeltaNet layer of MiniCPM-V 4.7's shape: 32 heads of 128.
    let (heads, d) = (32, 128);
    let state: Vec<f32> = (0..heads * d * d).map(|_| noise(&mut st) * 0.1).collect();
    let [k, q, v]: [Vec<f32>; 3] =
        core::array::from_fn(|_| (0..d).map(|_| noise(&mut st)).collect());
    let mut m = state.clone();
    let mut out = vec![0f32; d];
    let mut t = [Vec::new(), Vec::new()];
    let start = Instant::now();
    while start.elapsed() < budget || t[0].len() < 5 {
        for (i, which) in [Isa::Scalar, isa].into_iter().enumerate() {
            m.copy_from_slice(&state);
            let t0 = Instant::now();
            for h in m.chunks_exact_mut(d * d) {
                delta_rule(which, h, &k, &q, &v, 0.97, 0.5, 0.088, &mut out);
            }
            t[i].push(t0.elapsed().as_secs_f64());
            black_box(&out);
        }
    }
    let (s, v) = (median(&mut t[0]), median(&mut t[1]));
    println!(
        "{:<10} {:>9} {:>11.1} {:>11.1} {:>7.2}x",
        "32 heads",
        "deltanet",
        s * 1e6,
        v * 1e6,
        s / v
    );
    // SwiGLU of eight experts of 768: with libm's `expf` (before), the
    // scalar reference and the ISA's kernel.
    let n = 8 * 768;
    let gate: Vec<f32> = (0..n).map(|_| noise(&mut st) * 4.0).collect();
    let up: Vec<f32> = (0..n).map(|_| noise(&mut st)).collect();
    let mut x = gate.clone();
    let mut t = [Vec::new(), Vec::new(), Vec::new()];
    let start = Instant::now();
    while start.elapsed() < budget || t[0].len() < 5 {
        for (i, t) in t.iter_mut().enumerate() {
            x.copy_from_slice(&gate);
            let t0 = Instant::now();
            match i {
                0 => {
                    for (a, b) in x.iter_mut().zip(&up) {
                        *a = *a / (1.0 + libm::expf(-*a)) * b;
                    }
                }
                1 => swiglu(Isa::Scalar, &mut x, &up),
                _ => swiglu(isa, &mut x, &up),
            }
            t.push(t0.elapsed().as_secs_f64());
            black_box(&x);
        }
    }
    let [l, s, v] = t.map(|mut t| median(&mut t));
    println!(
        "{:<10} {:>9} {:>11.1} {:>11.1} {:>7.2}x  (libm expf {:.1} us: {:.2}x)",
        "8 x 768",
        "swiglu",
        s * 1e6,
        v * 1e6,
        s / v,
        l * 1e6,
        l / v
    );
}
