//! A vision tower's matrix products, one thread: `gemv` token by token (how
//! `les::vision::gemm` multiplied float weights before 2026-12-05) against
//! `float_tile` (three rows by four tokens in registers), on the matrices of
//! a SigLIP-400M block (1152 wide, 4304 hidden; MiniCPM-V's and Gemma 3's
//! towers) for 64 patch tokens, `f16` and `f32` weights.
//!
//! Then one attention head's scores, every query against every key in
//! blocks of 16 queries as the tower runs them: `vector::scaled_dots` over
//! the keys in place (how the tower scored before 2026-12-05) against
//! transposing the head's keys once and `vector::scaled_dots_by_key` (lanes
//! over keys, no horizontal sums).
//!
//! `cargo bench -p les --bench vision_gemm`. After criterion's report, a
//! summary times each pair interleaved (median of 7 rounds) and prints
//! their ratio.

use std::hint::black_box;
use std::time::Instant;

use criterion::Criterion;
use les_core::gemv::tile::float_tile;
use les_core::gemv::vector::{self, Strided};
use les_core::gemv::{gemv, Input, Isa, MatrixView};
use les_core::quant::{quantize, GgmlType};

const TOKENS: usize = 64;

struct Case {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    x: Vec<f32>,
}

/// Uniform values in [-1, 1) from an LCG seeded with `seed`.
fn noise(mut seed: u64) -> impl FnMut() -> f32 {
    move || {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn case(ty: GgmlType, rows: usize, cols: usize) -> Case {
    let mut noise = noise(0x5eed_u64 ^ (rows * cols) as u64);
    let vals: Vec<f32> = (0..rows * cols).map(|_| noise()).collect();
    let mut data = vec![0u8; ty.row_bytes(cols).expect("float type") * rows];
    quantize(ty, &vals, &mut data).expect("float type");
    let x = (0..TOKENS * cols).map(|_| noise()).collect();
    Case {
        name: format!("{ty:?} {rows}x{cols} x {TOKENS} tokens"),
        ty,
        rows,
        cols,
        data,
        x,
    }
}

fn per_token(isa: Isa, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    for (xt, yt) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows)) {
        let input = Input {
            f32: xt,
            ..Input::default()
        };
        gemv(isa, w, &input, 0..rows, yt).unwrap();
    }
}

fn tiled(isa: Isa, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) {
    float_tile(isa, w, x, TOKENS, 0..w.rows(), y).unwrap();
}

/// One head's attention inputs: `n` tokens of a `d`-wide activation whose
/// head `dh` wide starts at column 0.
struct Head {
    name: String,
    n: usize,
    d: usize,
    dh: usize,
    q: Vec<f32>,
    k: Vec<f32>,
}

fn head(n: usize, d: usize, dh: usize) -> Head {
    let mut noise = noise(0x0a77_u64 ^ (n * dh) as u64);
    Head {
        name: format!("scores, {n} tokens, head of {dh}"),
        n,
        d,
        dh,
        q: (0..n * dh).map(|_| noise()).collect(),
        k: (0..n * d).map(|_| noise()).collect(),
    }
}

const QUERY_BLOCK: usize = 16;

/// Every query block against the keys where they are (rows `d` apart).
fn scores_in_place(isa: Isa, h: &Head, out: &mut [f32]) {
    let keys = Strided {
        data: &h.k,
        stride: h.d,
        n: h.n,
        d: h.dh,
    };
    for (q, o) in
        h.q.chunks(QUERY_BLOCK * h.dh)
            .zip(out.chunks_mut(QUERY_BLOCK * h.n))
    {
        vector::scaled_dots(isa, q, keys, 0.125, o);
    }
}

/// The keys transposed once, then every query block against them.
fn scores_by_key(isa: Isa, h: &Head, kt: &mut [f32], out: &mut [f32]) {
    for (t, key) in h.k.chunks_exact(h.d).enumerate() {
        for (i, &x) in key[..h.dh].iter().enumerate() {
            kt[i * h.n + t] = x;
        }
    }
    for (q, o) in
        h.q.chunks(QUERY_BLOCK * h.dh)
            .zip(out.chunks_mut(QUERY_BLOCK * h.n))
    {
        vector::scaled_dots_by_key(isa, q, h.dh, kt, h.n, 0.125, o);
    }
}

fn main() {
    let isa = Isa::detect();
    let cases = [
        case(GgmlType::F16, 1152, 1152),
        case(GgmlType::F16, 4304, 1152),
        case(GgmlType::F16, 1152, 4304),
        case(GgmlType::F32, 1152, 1152),
    ];
    let mut c = Criterion::default().configure_from_args();
    for k in &cases {
        let w = MatrixView::new(k.ty, k.rows, k.cols, &k.data).unwrap();
        let mut y = vec![0f32; TOKENS * k.rows];
        let mut g = c.benchmark_group(&k.name);
        g.bench_function("gemv per token", |b| {
            b.iter(|| per_token(isa, black_box(&w), black_box(&k.x), &mut y))
        });
        g.bench_function("float_tile", |b| {
            b.iter(|| tiled(isa, black_box(&w), black_box(&k.x), &mut y))
        });
        g.finish();
    }
    // SigLIP's heads (1152 / 16) and Qwen3-VL's (1152 / 18).
    let heads = [
        head(1024, 1152, 72),
        head(1024, 1152, 64),
        head(4096, 1152, 64),
    ];
    for h in &heads {
        let (mut kt, mut out) = (vec![0f32; h.n * h.dh], vec![0f32; h.n * h.n]);
        let mut g = c.benchmark_group(&h.name);
        g.bench_function("scaled_dots", |b| {
            b.iter(|| scores_in_place(isa, black_box(h), &mut out))
        });
        g.bench_function("transposed, scaled_dots_by_key", |b| {
            b.iter(|| scores_by_key(isa, black_box(h), &mut kt, &mut out))
        });
        g.finish();
    }
    println!("\nsummary ({isa:?}, one thread, median of 7 interleaved rounds):");
    for k in &cases {
        let w = MatrixView::new(k.ty, k.rows, k.cols, &k.data).unwrap();
        let mut y = vec![0f32; TOKENS * k.rows];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            per_token(isa, &w, &k.x, &mut y);
            a.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            tiled(isa, &w, &k.x, &mut y);
            b.push(t.elapsed().as_secs_f64());
        }
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        let flops = 2.0 * (TOKENS * k.rows * k.cols) as f64;
        println!(
            "  {:<34} gemv per token {:>7.2} ms ({:>5.1} GFLOP/s)  float_tile {:>7.2} ms ({:>5.1} GFLOP/s)  {:.2}x",
            k.name,
            a[3] * 1e3,
            flops / a[3] / 1e9,
            b[3] * 1e3,
            flops / b[3] / 1e9,
            a[3] / b[3]
        );
    }
    for h in &heads {
        let (mut kt, mut out) = (vec![0f32; h.n * h.dh], vec![0f32; h.n * h.n]);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            scores_in_place(isa, h, &mut out);
            a.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            scores_by_key(isa, h, &mut kt, &mut out);
            b.push(t.elapsed().as_secs_f64());
        }
        a.sort_by(f64::total_cmp);
        b.sort_by(f64::total_cmp);
        let flops = 2.0 * (h.n * h.n * h.dh) as f64;
        println!(
            "  {:<34} scaled_dots {:>7.2} ms ({:>5.1} GFLOP/s)  by key {:>7.2} ms ({:>5.1} GFLOP/s)  {:.2}x",
            h.name,
            a[3] * 1e3,
            flops / a[3] / 1e9,
            b[3] * 1e3,
            flops / b[3] / 1e9,
            a[3] / b[3]
        );
    }
}
