//! The lookahead's router copies: a Q8_0 copy of each float router, the same
//! shape, within Q8_0's rounding of the router, ranking experts like it.

mod cli;

use std::path::PathBuf;

use les::model::Model;
use les_core::gemv::{gemv, Input, Isa};
use les_core::model::forward::{Ffn, Weights};
use les_core::quant::{self, blocks::BlockQ8_0, GgmlType};

fn tiny(arch: &str) -> PathBuf {
    cli::synth_once(
        &format!("lookahead-{arch}.gguf"),
        &["--arch", arch, "--preset", "tiny"],
    )
}

#[test]
fn float_routers_get_a_q8_0_copy_that_ranks_experts_alike() {
    for arch in ["qwen3moe", "olmoe", "qwen2moe"] {
        let model = Model::open(tiny(arch)).unwrap();
        let mut copies = 0;
        for layer in 0..model.hp.n_layers {
            let Ffn::Moe { router, .. } = model.block(layer).ffn else {
                assert!(model.lookahead_router(layer).is_none());
                continue;
            };
            let Some(copy) = model.lookahead_router(layer) else {
                assert!(!matches!(router.ty(), GgmlType::F32 | GgmlType::F16));
                continue;
            };
            copies += 1;
            assert_eq!(copy.ty(), GgmlType::Q8_0, "{arch} layer {layer}");
            assert_eq!((copy.rows(), copy.cols()), (router.rows(), router.cols()));
            let cols = router.cols();
            let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..router.rows() {
                quant::dequantize(router.ty(), router.row(r).unwrap(), &mut want).unwrap();
                quant::dequantize(GgmlType::Q8_0, copy.row(r).unwrap(), &mut got).unwrap();
                let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (g, w) in got.iter().zip(&want) {
                    // Half a step, plus the step stored as f16.
                    assert!(
                        (g - w).abs() <= max / 127.0 * 0.6 + 1e-6,
                        "{arch} {layer}/{r}: {g} vs {w}, max {max}"
                    );
                }
            }
            // Logits of a few inputs: the same top expert, close values.
            for seed in 0..8u32 {
                let x: Vec<f32> = (0..cols)
                    .map(|i| {
                        (((i as u32).wrapping_mul(2_654_435_761) ^ (seed * 97)) % 1000) as f32
                            / 500.0
                            - 1.0
                    })
                    .collect();
                let logits = |m: &les_core::gemv::MatrixView<'_>| {
                    let mut q8 = vec![
                        BlockQ8_0 {
                            d: [0; 2],
                            qs: [0; 32]
                        };
                        cols / 32
                    ];
                    quant::legacy::quantize_q8_0(&x, &mut q8);
                    let input = Input {
                        f32: &x,
                        q8_0: &q8,
                        q8_1: &[],
                        q8k: &[],
                    };
                    let mut y = vec![0f32; m.rows()];
                    gemv(Isa::Scalar, m, &input, 0..m.rows(), &mut y).unwrap();
                    y
                };
                let (a, b) = (logits(&router), logits(&copy));
                let top = |v: &[f32]| (0..v.len()).fold(0, |t, i| if v[i] > v[t] { i } else { t });
                let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (p, q) in a.iter().zip(&b) {
                    assert!(
                        (p - q).abs() <= 0.05 * scale + 1e-4,
                        "{arch} {layer}: {p} vs {q}"
                    );
                }
                let (ta, tb) = (top(&a), top(&b));
                assert!(
                    ta == tb || (a[ta] - a[tb]).abs() <= 0.05 * scale,
                    "{arch} {layer}"
                );
            }
        }
        assert!(copies > 0, "{arch}: the tiny model's routers are f32");
    }
}
