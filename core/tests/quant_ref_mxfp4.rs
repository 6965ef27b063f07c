//! `MXFP4` against the `gguf` Python package, bit for bit (reference data from
//! `scripts/quant_refs.py`): dequantization of random blocks (every exponent byte,
//! subnormal and overflowing scales included) and quantization of random rows, over
//! moderate and over extreme magnitudes.

mod common;

use les_core::quant::blocks::{as_blocks, as_blocks_mut, BlockMXFP4};
use les_core::quant::mxfp4::{dequantize_mxfp4, quantize_mxfp4};

#[test]
fn dequantize_matches_gguf() {
    let bytes = common::read_ref("mxfp4", "blocks");
    let want = common::read_ref_f32("mxfp4", "dequant");
    let blocks: &[BlockMXFP4] = as_blocks(&bytes).expect("whole blocks");
    assert!(!blocks.is_empty());
    assert_eq!(want.len(), blocks.len() * 32);
    let mut got = vec![0f32; want.len()];
    dequantize_mxfp4(blocks, &mut got);
    common::assert_bits_eq("mxfp4", &got, &want);
}

fn check_quantize(qin: &str, qout: &str) {
    let x = common::read_ref_f32("mxfp4", qin);
    let want = common::read_ref("mxfp4", qout);
    assert_eq!(want.len(), x.len() / 32 * 17, "reference size");
    let mut got = vec![0u8; want.len()];
    quantize_mxfp4(&x, as_blocks_mut(&mut got).unwrap());
    for (i, (g, w)) in got.chunks(17).zip(want.chunks(17)).enumerate() {
        assert_eq!(
            g,
            w,
            "mxfp4.{qin}: block {i} differs; input {:?}",
            &x[i * 32..(i + 1) * 32]
        );
    }
}

#[test]
fn quantize_matches_gguf() {
    check_quantize("qin", "qout");
}

#[test]
fn quantize_matches_gguf_at_extreme_magnitudes() {
    check_quantize("qin_wide", "qout_wide");
}
