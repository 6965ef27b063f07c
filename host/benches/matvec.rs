//! `SerialMatVec` against `ThreadedMatVec` with 1 and 2 threads (and the default
//! count, if larger) on an FFN-sized `Q4_K` matrix and an output-sized `Q6_K`
//! matrix; in the summary also attention over 64, 512 and 4096 positions, and
//! over an `f32` against an `f16` KV cache.
//!
//! `cargo bench -p les --bench matvec`; `LES_BENCH_VOCAB` sets the rows of the
//! output matrix (default 32768; Qwen's is 151936). After criterion's report, a
//! summary times the variants interleaved and prints their ratios to serial,
//! then streams `LES_BENCH_STREAM_MIB` (default 1024) MiB of expert matrices
//! from RAM with the kernels' prefetch off and on (at `PREFETCH_DISTANCE`, or at
//! each distance in bytes of `LES_BENCH_PREFETCH`, e.g. `0,1024,4096`), beside a
//! plain read loop.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use les::compute::{default_threads, Pool, ThreadedMatVec};
use les_core::gemv::{Isa, MatrixView, PREFETCH_DISTANCE};
use les_core::model::forward::{MatVec, SerialMatVec};
use les_core::model::ops::{self, AttnShape, KvRows, KvView};
use les_core::quant::blocks::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use les_core::quant::{quantize, GgmlType, QK_K};

struct Case {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    x: Vec<f32>,
}

/// A deterministic pseudo-random value in [-1, 1).
fn noise(state: &mut u64) -> f32 {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A `rows` x `cols` matrix of `ty`: 64 distinct quantized rows, tiled.
fn case(name: &str, ty: GgmlType, rows: usize, cols: usize) -> Case {
    let mut st = 0x5eed ^ rows as u64;
    let distinct = 64.min(rows);
    let vals: Vec<f32> = (0..distinct * cols).map(|_| noise(&mut st)).collect();
    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
    let mut block = vec![0u8; distinct * row_bytes];
    quantize(ty, &vals, &mut block).expect("quantizable type");
    let data: Vec<u8> = block
        .iter()
        .copied()
        .cycle()
        .take(rows * row_bytes)
        .collect();
    let x = (0..cols).map(|_| noise(&mut st)).collect();
    Case {
        name: format!("{name} {ty:?} {rows}x{cols}"),
        ty,
        rows,
        cols,
        data,
        x,
    }
}

/// Owned scratch for a `SerialMatVec`.
struct SerialScratch {
    q8_0: Vec<BlockQ8_0>,
    q8_1: Vec<BlockQ8_1>,
    q8k: Vec<BlockQ8K>,
}

impl SerialScratch {
    fn new(cols: usize) -> Self {
        let z0 = BlockQ8_0 {
            d: [0; 2],
            qs: [0; 32],
        };
        let z1 = BlockQ8_1 {
            d: [0; 2],
            s: [0; 2],
            qs: [0; 32],
        };
        let zk = BlockQ8K {
            d: [0; 4],
            qs: [0; QK_K],
            bsums: [[0; 2]; QK_K / 16],
        };
        SerialScratch {
            q8_0: vec![z0; cols / 32],
            q8_1: vec![z1; cols / 32],
            q8k: vec![zk; cols / QK_K],
        }
    }

    fn matvec(&mut self, isa: Isa) -> SerialMatVec<'_> {
        SerialMatVec {
            isa,
            q8_0: &mut self.q8_0,
            q8_1: &mut self.q8_1,
            q8k: &mut self.q8k,
        }
    }
}

fn variants() -> Vec<usize> {
    let mut t = vec![1, 2];
    let d = default_threads();
    if d > 2 {
        t.push(d);
    }
    t
}

fn bench_case(c: &mut Criterion, case: &Case, isa: Isa) {
    let w = MatrixView::new(case.ty, case.rows, case.cols, &case.data).expect("valid matrix");
    let mut y = vec![0f32; case.rows];
    let mut g = c.benchmark_group(&case.name);
    g.throughput(Throughput::Bytes(case.data.len() as u64));
    let mut scratch = SerialScratch::new(case.cols);
    g.bench_function("serial", |b| {
        let mut mv = scratch.matvec(isa);
        b.iter(|| {
            mv.matvec(black_box(&w), black_box(&case.x), &mut y)
                .unwrap()
        })
    });
    for t in variants() {
        let mut mv = ThreadedMatVec::new(t, isa);
        g.bench_function(format!("threaded{t}"), |b| {
            b.iter(|| {
                mv.matvec(black_box(&w), black_box(&case.x), &mut y)
                    .unwrap()
            })
        });
    }
    g.finish();
}

/// A threaded variant: its thread count and the call to time.
type Variant<'a> = (usize, Box<dyn FnMut() + 'a>);

/// Calls `serial` and then each of `threaded` (thread count, call) in turn,
/// interleaved so background load hits all alike, for about `budget` (at least
/// 5 rounds), and prints median times and ratios to serial.
fn print_interleaved(
    name: &str,
    budget: Duration,
    serial: &mut dyn FnMut(),
    threaded: &mut [Variant<'_>],
) {
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); threaded.len() + 1];
    let start = Instant::now();
    while start.elapsed() < budget || times[0].len() < 5 {
        let t0 = Instant::now();
        serial();
        times[0].push(t0.elapsed().as_secs_f64());
        for (i, (_, call)) in threaded.iter_mut().enumerate() {
            let t0 = Instant::now();
            call();
            times[i + 1].push(t0.elapsed().as_secs_f64());
        }
    }
    let meds: Vec<f64> = times
        .iter_mut()
        .map(|v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect();
    let mut line = format!("{name:<34} serial {:>9.1} us", meds[0] * 1e6);
    for ((t, _), m) in threaded.iter().zip(&meds[1..]) {
        line += &format!(" | threaded{t} {:>9.1} us (x{:.2})", m * 1e6, meds[0] / m);
    }
    println!(
        "{line}  [{} rounds, ratio = serial/threaded]",
        times[0].len()
    );
}

/// Serial and threaded products of `case`, interleaved (see [`print_interleaved`]).
fn summary(case: &Case, isa: Isa, budget: Duration) {
    let w = MatrixView::new(case.ty, case.rows, case.cols, &case.data).expect("valid matrix");
    let mut scratch = SerialScratch::new(case.cols);
    let mut serial = scratch.matvec(isa);
    let mut y = vec![0f32; case.rows];
    let mut threaded: Vec<Variant<'_>> = variants()
        .into_iter()
        .map(|t| {
            let (mut mv, mut y) = (ThreadedMatVec::new(t, isa), vec![0f32; case.rows]);
            let w = &w;
            let call: Box<dyn FnMut() + '_> =
                Box::new(move || mv.matvec(w, &case.x, &mut y).unwrap());
            (t, call)
        })
        .collect();
    print_interleaved(
        &case.name,
        budget,
        &mut || serial.matvec(&w, &case.x, &mut y).unwrap(),
        &mut threaded,
    );
}

/// Qwen3-30B-A3B's attention: 32 query heads, 4 KV heads of 128.
const A3B_ATTENTION: AttnShape = AttnShape {
    n_head: 32,
    n_head_kv: 4,
    head_dim: 128,
};

/// Serial scalar attention (`ops::attention` with `Isa::Scalar`) and `ThreadedMatVec::attention` over `n`
/// cached positions of Qwen3-30B-A3B's shape (32 query heads, 4 KV heads of
/// 128), interleaved (see [`print_interleaved`]).
fn attention_summary(n: usize, isa: Isa, budget: Duration) {
    let shape = A3B_ATTENTION;
    let mut st = 0xa77e_u64 ^ n as u64;
    let q: Vec<f32> = (0..32 * 128).map(|_| noise(&mut st)).collect();
    let k: Vec<f32> = (0..n * 4 * 128).map(|_| noise(&mut st)).collect();
    let v: Vec<f32> = (0..n * 4 * 128).map(|_| noise(&mut st)).collect();
    let q = &q;
    let kv = KvView {
        k: KvRows::F32(&k),
        v: KvRows::F32(&v),
        positions: n,
        sinks: None,
    };
    let (mut scores, mut out) = (vec![0f32; n], vec![0f32; q.len()]);
    let mut threaded: Vec<Variant<'_>> = variants()
        .into_iter()
        .map(|t| {
            let mut mv = ThreadedMatVec::new(t, isa);
            let (mut scores, mut out) = (vec![0f32; n], vec![0f32; q.len()]);
            let call: Box<dyn FnMut() + '_> =
                Box::new(move || mv.attention(shape, q, kv, &mut scores, &mut out));
            (t, call)
        })
        .collect();
    print_interleaved(
        &format!("attention 32x128, {n} positions"),
        budget,
        &mut || ops::attention(Isa::Scalar, shape, q, kv, &mut scores, &mut out),
        &mut threaded,
    );
}

/// Attention over an `f32` and an `f16` KV cache of the same `n` positions
/// (the `f16` one holding the `f32` one's values rounded), Qwen3-30B-A3B's
/// shape, both threaded at the default thread count, interleaved; prints the
/// medians and the ratio `f32 / f16`, after checking the two give the bits of
/// the same (widened) values.
fn kv_type_summary(n: usize, isa: Isa, budget: Duration) {
    let shape = A3B_ATTENTION;
    let mut st = 0x6b76_u64 ^ n as u64;
    let q: Vec<f32> = (0..32 * 128).map(|_| noise(&mut st)).collect();
    let hk: Vec<u16> = (0..n * 4 * 128)
        .map(|_| les_core::quant::f32_to_f16(noise(&mut st)))
        .collect();
    let hv: Vec<u16> = (0..n * 4 * 128)
        .map(|_| les_core::quant::f32_to_f16(noise(&mut st)))
        .collect();
    let wide =
        |h: &[u16]| -> Vec<f32> { h.iter().map(|&x| les_core::quant::f16_to_f32(x)).collect() };
    let (k, v) = (wide(&hk), wide(&hv));
    let f32_kv = KvView {
        k: KvRows::F32(&k),
        v: KvRows::F32(&v),
        positions: n,
        sinks: None,
    };
    let f16_kv = KvView {
        k: KvRows::F16(&hk),
        v: KvRows::F16(&hv),
        positions: n,
        sinks: None,
    };
    let mut mv = ThreadedMatVec::new(default_threads(), isa);
    let mut scores = vec![0f32; n];
    let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
    mv.attention(shape, &q, f32_kv, &mut scores, &mut a);
    mv.attention(shape, &q, f16_kv, &mut scores, &mut b);
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "f16 and f32 caches disagree"
    );
    let (mut t32, mut t16) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while start.elapsed() < budget || t32.len() < 5 {
        let t0 = Instant::now();
        mv.attention(shape, &q, f32_kv, &mut scores, &mut a);
        t32.push(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        mv.attention(shape, &q, f16_kv, &mut scores, &mut b);
        t16.push(t0.elapsed().as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let rounds = t32.len();
    let (m32, m16) = (med(&mut t32), med(&mut t16));
    println!(
        "{:<34} f32 cache {:>9.1} us | f16 cache {:>9.1} us (x{:.2})  [{rounds} rounds, ratio = f32/f16]",
        format!("KV cache type, {n} positions"),
        m32 * 1e6,
        m16 * 1e6,
        m32 / m16
    );
}

/// One decode's worth of expert products streamed from RAM: `mib` MiB of
/// distinct `Q4_K` matrices of Qwen3-30B-A3B's expert shape (768 x 2048), in
/// huge-page memory like the slot arena, each computed once per pass. Per thread
/// count, passes with the kernels' prefetch off and at each of `distances`
/// alternate with a plain read loop over the same bytes; prints median GB/s of
/// weights and each distance's ratio to prefetch off.
fn stream_summary(mib: usize, isa: Isa, distances: &[usize], budget: Duration) {
    let (rows, cols) = (768, 2048);
    let proto = case("expert", GgmlType::Q4K, rows, cols);
    let mat = proto.data.len();
    let n = (mib << 20) / mat;
    let Some(mut buf) = les::hugepages::zeroed_vec::<u8>(n * mat) else {
        println!("stream: cannot allocate {mib} MiB; skipped");
        return;
    };
    for m in buf.chunks_exact_mut(mat) {
        m.copy_from_slice(&proto.data);
    }
    let buf = &buf;
    let bytes = (n * mat) as f64;
    for t in variants() {
        // Prefetch off first, then each distance, then the plain read.
        let mut mvs: Vec<ThreadedMatVec> = core::iter::once(0)
            .chain(distances.iter().copied())
            .map(|d| ThreadedMatVec::new(t, isa).with_prefetch(d))
            .collect();
        let mut reader = ThreadedMatVec::new(t, isa);
        let mut y = vec![0f32; rows];
        let mut pass = |mv: &mut ThreadedMatVec| {
            for m in buf.chunks_exact(mat) {
                let w = MatrixView::new(GgmlType::Q4K, rows, cols, m).expect("valid matrix");
                mv.matvec(&w, &proto.x, &mut y).unwrap();
            }
        };
        let sum = std::sync::atomic::AtomicU64::new(0);
        let read = |mv: &mut ThreadedMatVec| {
            let part = buf.len().div_ceil(t);
            mv.pool().for_each(t, &|i| {
                let chunk = &buf[(i * part).min(buf.len())..((i + 1) * part).min(buf.len())];
                let s = chunk
                    .chunks_exact(8)
                    .fold(0u64, |a, c| a ^ u64::from_le_bytes(c.try_into().unwrap()));
                sum.fetch_xor(s, std::sync::atomic::Ordering::Relaxed);
            });
        };
        let mut times = vec![Vec::new(); mvs.len() + 1];
        let start = Instant::now();
        while start.elapsed() < budget || times[0].len() < 5 {
            for (i, v) in times.iter_mut().enumerate() {
                let t0 = Instant::now();
                match mvs.get_mut(i) {
                    Some(mv) => pass(mv),
                    None => read(&mut reader),
                }
                v.push(t0.elapsed().as_secs_f64());
            }
        }
        let gbs: Vec<f64> = times
            .iter_mut()
            .map(|v| {
                v.sort_by(f64::total_cmp);
                bytes / v[v.len() / 2] / 1e9
            })
            .collect();
        black_box(sum.into_inner());
        let with: Vec<String> = distances
            .iter()
            .zip(&gbs[1..])
            .map(|(d, g)| format!("prefetch {d} B {g:.1} GB/s (x{:.2})", g / gbs[0]))
            .collect();
        println!(
            "stream {mib} MiB of Q4_K 768x2048, {t} thread(s): prefetch off {:.1} GB/s | {} | \
             plain read {:.1} GB/s [{} rounds]",
            gbs[0],
            with.join(" | "),
            gbs[gbs.len() - 1],
            times[0].len()
        );
    }
}

/// Prints the median round trip of an empty `Pool::run` and of a 2-task
/// `Pool::for_each`, back to back and after the workers parked.
fn pool_overhead() {
    for threads in variants().into_iter().filter(|&t| t > 1) {
        let mut pool = Pool::new(threads);
        let mut med = |f: &mut dyn FnMut(&mut Pool), cold: bool| {
            let mut v = Vec::new();
            for _ in 0..if cold { 100 } else { 2000 } {
                if cold {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let t0 = Instant::now();
                f(&mut pool);
                v.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let run = &mut |p: &mut Pool| p.run(&|_| {});
        let (rh, rc) = (med(run, false), med(run, true));
        let each = &mut |p: &mut Pool| p.for_each(2, &|_| {});
        let (fh, fc) = (med(each, false), med(each, true));
        println!(
            "pool of {threads}: empty run {rh:.2} us back to back, {rc:.2} us after parking; \
             for_each(2) {fh:.2} / {fc:.2} us (medians)"
        );
    }
}

fn main() {
    let isa = Isa::detect();
    let vocab = std::env::var("LES_BENCH_VOCAB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32_768);
    let cases = [
        case("ffn", GgmlType::Q4K, 2048, 768),
        case("output", GgmlType::Q6K, vocab, 2048),
    ];
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();
    for case in &cases {
        bench_case(&mut c, case, isa);
    }
    c.final_summary();
    println!(
        "\nsummary (isa {isa}, default_threads {}):",
        default_threads()
    );
    for case in &cases {
        summary(case, isa, Duration::from_secs(2));
    }
    for n in [64, 512, 4096] {
        attention_summary(n, isa, Duration::from_secs(1));
    }
    // At 32768 positions one layer's keys and values take 128 MiB in f32:
    // far beyond the CPU's caches, as a long context's are.
    for n in [512, 4096, 32768] {
        kv_type_summary(n, isa, Duration::from_secs(1));
    }
    let stream_mib = std::env::var("LES_BENCH_STREAM_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    // Prefetch distances to compare with none: `LES_BENCH_PREFETCH=1024,4096`.
    let distances: Vec<usize> = std::env::var("LES_BENCH_PREFETCH")
        .ok()
        .map(|v| v.split(',').filter_map(|d| d.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![PREFETCH_DISTANCE]);
    stream_summary(stream_mib, isa, &distances, Duration::from_secs(3));
    pool_overhead();
}
