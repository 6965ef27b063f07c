//! Properties of the float and 32-element quantizers: ggml's round-trip error
//! thresholds, per-element error bounds, and no panics on any finite input.

use les_core::quant::blocks::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1};
use les_core::quant::{f16_to_f32, float, legacy};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

/// Every quantizer as `x -> dequantize(quantize(x))`, with its name.
type RoundTrip = fn(&[f32]) -> Vec<f32>;

fn rt_q4_0(x: &[f32]) -> Vec<f32> {
    let mut b = vec![
        BlockQ4_0 {
            d: [0; 2],
            qs: [0; 16]
        };
        x.len() / 32
    ];
    legacy::quantize_q4_0(x, &mut b);
    let mut y = vec![0.0; x.len()];
    legacy::dequantize_q4_0(&b, &mut y);
    y
}

fn rt_q4_1(x: &[f32]) -> Vec<f32> {
    let mut b = vec![
        BlockQ4_1 {
            d: [0; 2],
            m: [0; 2],
            qs: [0; 16]
        };
        x.len() / 32
    ];
    legacy::quantize_q4_1(x, &mut b);
    let mut y = vec![0.0; x.len()];
    legacy::dequantize_q4_1(&b, &mut y);
    y
}

fn rt_q5_0(x: &[f32]) -> Vec<f32> {
    let mut b = vec![
        BlockQ5_0 {
            d: [0; 2],
            qh: [0; 4],
            qs: [0; 16]
        };
        x.len() / 32
    ];
    legacy::quantize_q5_0(x, &mut b);
    let mut y = vec![0.0; x.len()];
    legacy::dequantize_q5_0(&b, &mut y);
    y
}

fn rt_q5_1(x: &[f32]) -> Vec<f32> {
    let mut b = vec![
        BlockQ5_1 {
            d: [0; 2],
            m: [0; 2],
            qh: [0; 4],
            qs: [0; 16]
        };
        x.len() / 32
    ];
    legacy::quantize_q5_1(x, &mut b);
    let mut y = vec![0.0; x.len()];
    legacy::dequantize_q5_1(&b, &mut y);
    y
}

fn rt_q8_0(x: &[f32]) -> Vec<f32> {
    let mut b = vec![
        BlockQ8_0 {
            d: [0; 2],
            qs: [0; 32]
        };
        x.len() / 32
    ];
    legacy::quantize_q8_0(x, &mut b);
    let mut y = vec![0.0; x.len()];
    legacy::dequantize_q8_0(&b, &mut y);
    y
}

fn rt_q8_1(x: &[f32]) -> Vec<f32> {
    let mut b = vec![
        BlockQ8_1 {
            d: [0; 2],
            s: [0; 2],
            qs: [0; 32]
        };
        x.len() / 32
    ];
    legacy::quantize_q8_1(x, &mut b);
    let mut y = vec![0.0; x.len()];
    legacy::dequantize_q8_1(&b, &mut y);
    y
}

fn rt_f16(x: &[f32]) -> Vec<f32> {
    let mut b = vec![0u8; x.len() * 2];
    float::quantize_f16(x, &mut b);
    let mut y = vec![0.0; x.len()];
    float::dequantize_f16(&b, &mut y);
    y
}

fn rt_bf16(x: &[f32]) -> Vec<f32> {
    let mut b = vec![0u8; x.len() * 2];
    float::quantize_bf16(x, &mut b);
    let mut y = vec![0.0; x.len()];
    float::dequantize_bf16(&b, &mut y);
    y
}

const ALL: [(&str, RoundTrip); 8] = [
    ("q4_0", rt_q4_0),
    ("q4_1", rt_q4_1),
    ("q5_0", rt_q5_0),
    ("q5_1", rt_q5_1),
    ("q8_0", rt_q8_0),
    ("q8_1", rt_q8_1),
    ("f16", rt_f16),
    ("bf16", rt_bf16),
];

/// ggml's `test-quantize-fns` data: `0.1 + 2 cos(i + offset)`.
fn ggml_test_data(n: usize, offset: f32) -> Vec<f32> {
    (0..n)
        .map(|i| 0.1 + 2.0 * (i as f32 + offset).cos())
        .collect()
}

/// ggml's error measure: `sqrt(sum (a - b)^2) / n`.
fn ggml_rmse(a: &[f32], b: &[f32]) -> f64 {
    let sum: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    sum.sqrt() / a.len() as f64
}

/// ggml's `MAX_QUANTIZATION_TOTAL_ERROR`.
const MAX_QUANTIZATION_TOTAL_ERROR: f64 = 0.002;

/// Worst per-element error of a 32-element block, given its values: a multiple of
/// the quantization step, plus the rounding of the scale (and min) to f16 and of the
/// f32 arithmetic.
fn block_bound(name: &str, xb: &[f32]) -> f32 {
    const F16_REL: f32 = 1.0 / 2048.0; // f16 rounding, relative
    const SLACK: f32 = 1e-5; // f16 subnormal spacing, times the largest quant
    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let min = xb.iter().copied().fold(f32::INFINITY, f32::min);
    let max = xb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let arith = amax * 1e-6;
    match name {
        // The element opposite the largest one may be clipped by a whole step.
        "q4_0" => amax / 8.0 * (1.0 + 8.0 * F16_REL) * 1.001 + SLACK + arith,
        "q5_0" => amax / 16.0 * (1.0 + 16.0 * F16_REL) * 1.001 + SLACK + arith,
        "q4_1" | "q5_1" => {
            let levels = if name == "q4_1" { 15.0 } else { 31.0 };
            let d = (max - min) / levels;
            d * (0.501 + levels * F16_REL) + min.abs() * F16_REL + SLACK + arith
        }
        "q8_0" | "q8_1" => amax / 127.0 * (0.501 + 127.0 * F16_REL) + SLACK + arith,
        _ => unreachable!(),
    }
}

/// Any finite `f32`, zeros (of both signs) more often than by chance.
fn finite() -> impl Strategy<Value = f32> + Clone {
    prop_oneof![
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        6 => proptest::num::f32::NORMAL | proptest::num::f32::SUBNORMAL | proptest::num::f32::ZERO,
    ]
}

/// `k` whole blocks of values from `elem`, some blocks constant.
fn blocks_of(elem: impl Strategy<Value = f32> + Clone) -> impl Strategy<Value = Vec<f32>> {
    let block = prop_oneof![
        3 => proptest::collection::vec(elem.clone(), 32),
        1 => elem.prop_map(|v| vec![v; 32]),
    ];
    proptest::collection::vec(block, 1..6).prop_map(|b| b.concat())
}

/// Moderate magnitudes (the f16 scales neither overflow nor lose much precision),
/// with zeros and small values mixed in.
fn moderate() -> impl Strategy<Value = f32> + Clone {
    prop_oneof![
        1 => Just(0.0f32),
        4 => -1e4f32..1e4f32,
        2 => -1.0f32..1.0f32,
        1 => -1e-3f32..1e-3f32,
    ]
}

proptest! {
    // Integration tests have no lib.rs for proptest's default persistence to find.
    #![proptest_config(ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn ggml_test_data_within_threshold(offset in 0.0f32..10_000.0) {
        let x = ggml_test_data(32 * 128, offset);
        for (name, rt) in ALL {
            let err = ggml_rmse(&x, &rt(&x));
            prop_assert!(
                err < MAX_QUANTIZATION_TOTAL_ERROR,
                "{name}: error {err} >= {MAX_QUANTIZATION_TOTAL_ERROR} at offset {offset}"
            );
        }
    }

    #[test]
    fn per_element_error_is_bounded(x in blocks_of(moderate())) {
        for (name, rt) in ALL {
            let y = rt(&x);
            for (i, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let bound = match name {
                    "f16" | "bf16" => {
                        let rel = if name == "f16" { 1.0 / 2048.0 } else { 1.0 / 256.0 };
                        xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) * rel + 1e-7
                    }
                    _ => block_bound(name, xb),
                };
                for (j, (a, b)) in xb.iter().zip(yb).enumerate() {
                    prop_assert!(
                        (a - b).abs() <= bound,
                        "{name}: block {i} element {j}: {a} -> {b}, bound {bound}"
                    );
                }
            }
        }
    }

    #[test]
    fn quantize_never_panics_on_finite_input(x in blocks_of(finite())) {
        for (_, rt) in ALL {
            let _ = rt(&x);
        }
        // Q8_1 is Q8_0 plus the block sum, d * sum(q) in f32 stored as f16.
        let n = x.len() / 32;
        let mut b0 = vec![BlockQ8_0 { d: [0; 2], qs: [0; 32] }; n];
        let mut b1 = vec![BlockQ8_1 { d: [0; 2], s: [0; 2], qs: [0; 32] }; n];
        legacy::quantize_q8_0(&x, &mut b0);
        legacy::quantize_q8_1(&x, &mut b1);
        for (xb, (a, b)) in x.chunks(32).zip(b0.iter().zip(&b1)) {
            prop_assert_eq!(a.d, b.d);
            prop_assert_eq!(a.qs, b.qs);
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
            let s = les_core::quant::f32_to_f16(sum as f32 * (amax / 127.0));
            prop_assert_eq!(f16_to_f32(u16::from_le_bytes(b.s)).to_bits(), f16_to_f32(s).to_bits());
        }
    }
}

#[test]
fn ggml_test_data_errors_are_in_the_expected_range() {
    // Not only below the threshold: of the size ggml reports, so a quantizer that
    // degenerated to something far better (e.g. a copy) would be noticed too.
    let x = ggml_test_data(32 * 128, 0.0);
    for (name, rt) in ALL {
        let err = ggml_rmse(&x, &rt(&x));
        let floor = match name {
            "f16" | "bf16" | "q8_0" | "q8_1" => 0.0,
            _ => 5e-5,
        };
        eprintln!("{name}: {err:e}");
        assert!(
            err > floor && err < MAX_QUANTIZATION_TOTAL_ERROR,
            "{name}: {err}"
        );
    }
}
