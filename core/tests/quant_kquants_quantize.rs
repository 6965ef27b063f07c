//! K-quant quantizers (`Q4_K`, `Q5_K`, `Q6_K`, `Q8_K`): ggml's own accuracy test,
//! properties over random input, and edge cases that must not panic.

use les_core::quant::blocks::{BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use les_core::quant::kquants::{
    dequantize_q4k, dequantize_q5k, dequantize_q6k, quantize_q4k, quantize_q5k, quantize_q6k,
    quantize_q8k,
};
use proptest::prelude::*;

const ZERO_Q4K: BlockQ4K = BlockQ4K {
    d: [0; 2],
    dmin: [0; 2],
    scales: [0; 12],
    qs: [0; 128],
};
const ZERO_Q5K: BlockQ5K = BlockQ5K {
    d: [0; 2],
    dmin: [0; 2],
    scales: [0; 12],
    qh: [0; 32],
    qs: [0; 128],
};
const ZERO_Q6K: BlockQ6K = BlockQ6K {
    ql: [0; 128],
    qh: [0; 64],
    scales: [0; 16],
    d: [0; 2],
};
const ZERO_Q8K: BlockQ8K = BlockQ8K {
    d: [0; 4],
    qs: [0; 256],
    bsums: [[0; 2]; 16],
};

fn roundtrip_q4k(x: &[f32]) -> Vec<f32> {
    let mut blocks = vec![ZERO_Q4K; x.len() / 256];
    quantize_q4k(x, &mut blocks);
    let mut y = vec![0f32; x.len()];
    dequantize_q4k(&blocks, &mut y);
    y
}

fn roundtrip_q5k(x: &[f32]) -> Vec<f32> {
    let mut blocks = vec![ZERO_Q5K; x.len() / 256];
    quantize_q5k(x, &mut blocks);
    let mut y = vec![0f32; x.len()];
    dequantize_q5k(&blocks, &mut y);
    y
}

fn roundtrip_q6k(x: &[f32]) -> Vec<f32> {
    let mut blocks = vec![ZERO_Q6K; x.len() / 256];
    quantize_q6k(x, &mut blocks);
    let mut y = vec![0f32; x.len()];
    dequantize_q6k(&blocks, &mut y);
    y
}

fn quant_q8k(x: &[f32]) -> Vec<BlockQ8K> {
    let mut blocks = vec![ZERO_Q8K; x.len() / 256];
    quantize_q8k(x, &mut blocks);
    blocks
}

fn dequant_q8k(blocks: &[BlockQ8K]) -> Vec<f32> {
    dequant_q8k_f64(blocks)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// In f64, so that `d * 127` of a block near `f32::MAX` does not overflow.
fn dequant_q8k_f64(blocks: &[BlockQ8K]) -> Vec<f64> {
    blocks
        .iter()
        .flat_map(|b| {
            let d = f32::from_le_bytes(b.d) as f64;
            b.qs.iter().map(move |&q| d * q as f64)
        })
        .collect()
}

fn check_bsums(blocks: &[BlockQ8K]) {
    for (i, b) in blocks.iter().enumerate() {
        for (j, s) in b.bsums.iter().enumerate() {
            let sum: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
            assert_eq!(i16::from_le_bytes(*s) as i32, sum, "block {i} bsum {j}");
        }
    }
}

/// ggml's `array_rmse` from `test-quantize-fns`: sqrt(sum of squared errors) / n.
fn ggml_error(a: &[f32], b: &[f32]) -> f64 {
    let sum: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    sum.sqrt() / a.len() as f64
}

/// ggml's test data: `0.1 + 2 * cos(i + offset)`, 32 * 128 values.
fn ggml_data(offset: f32) -> Vec<f32> {
    (0..32 * 128)
        .map(|i| 0.1 + 2.0 * (i as f32 + offset).cos())
        .collect()
}

#[test]
fn ggml_quantize_fns_error_thresholds() {
    for offset in [0.0, 0.5, 1.0] {
        let x = ggml_data(offset);
        let e4 = ggml_error(&x, &roundtrip_q4k(&x));
        let e5 = ggml_error(&x, &roundtrip_q5k(&x));
        let e6 = ggml_error(&x, &roundtrip_q6k(&x));
        let q8 = quant_q8k(&x);
        check_bsums(&q8);
        let e8 = ggml_error(&x, &dequant_q8k(&q8));
        assert!(e4 < 0.002, "q4_k error {e4} (offset {offset})");
        assert!(e5 < 0.002, "q5_k error {e5} (offset {offset})");
        assert!(e6 < 0.002, "q6_k error {e6} (offset {offset})");
        assert!(e8 < 0.002, "q8_k error {e8} (offset {offset})");
        // Finer formats must be more accurate on the same data.
        assert!(
            e8 < e6 && e6 < e5 && e5 < e4,
            "q8_k {e8}, q6_k {e6}, q5_k {e5}, q4_k {e4}"
        );
    }
}

fn edge_inputs() -> Vec<(&'static str, Vec<f32>)> {
    let mut v = vec![
        ("zeros", vec![0.0; 512]),
        ("negative zeros", vec![-0.0; 256]),
        ("positive constant", vec![0.75; 256]),
        ("negative constant", vec![-3.0; 256]),
        ("max", vec![f32::MAX; 256]),
        ("min", vec![f32::MIN; 256]),
        ("smallest subnormal", vec![f32::from_bits(1); 256]),
        ("smallest normal", vec![f32::MIN_POSITIVE; 256]),
    ];
    let alternating = |a: f32, b: f32| (0..256).map(|i| if i % 2 == 0 { a } else { b }).collect();
    v.push(("huge alternating", alternating(f32::MAX, f32::MIN)));
    v.push(("huge and tiny", alternating(3e38, 1e-40)));
    v.push(("tiny alternating", alternating(1e-30, -1e-38)));
    v.push((
        "one spike",
        (0..256).map(|i| if i == 77 { 1e20 } else { 0.0 }).collect(),
    ));
    v.push((
        "f16 overflow",
        (0..256).map(|i| 1e6 * (i as f32 - 128.0)).collect(),
    ));
    v
}

#[test]
fn edge_cases_do_not_panic() {
    for (name, x) in edge_inputs() {
        let y4 = roundtrip_q4k(&x);
        let y5 = roundtrip_q5k(&x);
        let y6 = roundtrip_q6k(&x);
        let q8 = quant_q8k(&x);
        check_bsums(&q8);
        let y8 = dequant_q8k_f64(&q8);
        if x.iter().all(|&v| v == 0.0) {
            for (fmt, y) in [("q4_k", &y4), ("q5_k", &y5), ("q6_k", &y6)] {
                assert!(
                    y.iter().all(|&v| v == 0.0),
                    "{name}: {fmt} of zeros is not zero"
                );
            }
            assert!(
                y8.iter().all(|&v| v == 0.0),
                "{name}: q8_k of zeros is not zero"
            );
        }
        // Q8_K keeps a f32 scale, so it stays accurate across the finite range; as in
        // ggml, blocks whose largest magnitude is below 127 / f32::MAX (where
        // -127 / max overflows) come out as zero.
        for (i, (&a, &b)) in x.iter().zip(&y8).enumerate() {
            let amax = x[i / 256 * 256..][..256]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs())) as f64;
            let err = (a as f64 - b).abs();
            assert!(
                err <= amax / 127.0 * 0.5001 + 4e-37,
                "{name}: q8_k {i}: {a} -> {b}"
            );
        }
    }
}

#[test]
fn constant_blocks_reconstruct() {
    for c in [0.75f32, -3.0, 100.0, -0.01] {
        let x = vec![c; 256];
        for (fmt, y) in [
            ("q4_k", roundtrip_q4k(&x)),
            ("q5_k", roundtrip_q5k(&x)),
            ("q6_k", roundtrip_q6k(&x)),
        ] {
            for &v in &y {
                assert!(
                    (v - c).abs() <= c.abs() * 0.02,
                    "{fmt}: constant {c} -> {v}"
                );
            }
        }
    }
}

/// 1 to 3 blocks of uniform values in `[-2^e, 2^e)`. `exp_min` keeps the f16
/// super-block scales normal: below that the formats themselves lose precision.
fn blocks_strategy(exp_min: i32) -> impl Strategy<Value = Vec<f32>> {
    (1usize..=3, exp_min..=20).prop_flat_map(|(n, exp)| {
        let scale = 2f32.powi(exp);
        prop::collection::vec(-1.0f32..1.0, n * 256)
            .prop_map(move |v| v.into_iter().map(|x| x * scale).collect())
    })
}

fn rms(v: impl Iterator<Item = f32>) -> f64 {
    let (s, n) = v.fold((0f64, 0usize), |(s, n), x| (s + (x as f64).powi(2), n + 1));
    (s / n as f64).sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn q8k_error_is_half_a_step(x in blocks_strategy(-60)) {
        let blocks = quant_q8k(&x);
        check_bsums(&blocks);
        let y = dequant_q8k(&blocks);
        for (xb, (yb, b)) in x.chunks(256).zip(y.chunks(256).zip(&blocks)) {
            let d = f32::from_le_bytes(b.d).abs();
            for (&a, &q) in xb.iter().zip(yb) {
                prop_assert!((a - q).abs() <= d * 0.5001, "{a} -> {q}, d {d}");
            }
        }
    }

    #[test]
    fn k_quant_errors_are_bounded(x in blocks_strategy(-2)) {
        let y4 = roundtrip_q4k(&x);
        let y5 = roundtrip_q5k(&x);
        let y6 = roundtrip_q6k(&x);
        let blocks = x.chunks(256).zip(y4.chunks(256)).zip(y5.chunks(256)).zip(y6.chunks(256));
        for (((xb, b4), b5), b6) in blocks {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            let e4 = rms(xb.iter().zip(b4).map(|(a, b)| a - b));
            let e5 = rms(xb.iter().zip(b5).map(|(a, b)| a - b));
            let e6 = rms(xb.iter().zip(b6).map(|(a, b)| a - b));
            // Uniform data over [-a, a]: a 4-bit step is about a/7.5, a 5-bit one
            // a/15.5, a 6-bit one a/31.
            prop_assert!(e4 <= amax * 0.06, "q4_k rms {e4}, amax {amax}");
            prop_assert!(e5 <= amax * 0.03, "q5_k rms {e5}, amax {amax}");
            prop_assert!(e6 <= amax * 0.015, "q6_k rms {e6}, amax {amax}");
            for (&a, ((&p, &r), &q)) in xb.iter().zip(b4.iter().zip(b5).zip(b6)) {
                prop_assert!((a - p).abs() as f64 <= amax * 0.25, "q4_k {a} -> {p}");
                prop_assert!((a - r).abs() as f64 <= amax * 0.12, "q5_k {a} -> {r}");
                prop_assert!((a - q).abs() as f64 <= amax * 0.06, "q6_k {a} -> {q}");
            }
        }
    }

    #[test]
    fn arbitrary_finite_values_do_not_panic(
        x in prop::collection::vec(any::<f32>().prop_filter("finite", |v| v.is_finite()), 256)
    ) {
        let _ = roundtrip_q4k(&x);
        let _ = roundtrip_q5k(&x);
        let _ = roundtrip_q6k(&x);
        check_bsums(&quant_q8k(&x));
    }
}
