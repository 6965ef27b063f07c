//! The float and 32-element formats against the `gguf` Python package, bit for bit.

mod common;

use les_core::quant::blocks::{
    as_blocks, block_bytes, Block, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0,
};
use les_core::quant::{float, legacy};

fn check_dequant_bytes(name: &str, bytes_per_elem: usize, f: fn(&[u8], &mut [f32])) {
    let src = common::read_ref(name, "blocks");
    let want = common::read_ref_f32(name, "dequant");
    let mut got = vec![0.0f32; src.len() / bytes_per_elem];
    f(&src, &mut got);
    common::assert_bits_eq(name, &got, &want);
}

fn check_dequant_blocks<B: Block>(name: &str, f: fn(&[B], &mut [f32])) {
    let src = common::read_ref(name, "blocks");
    let blocks: &[B] = as_blocks(&src).expect("whole blocks");
    let want = common::read_ref_f32(name, "dequant");
    let mut got = vec![0.0f32; blocks.len() * 32];
    f(blocks, &mut got);
    common::assert_bits_eq(name, &got, &want);
}

/// Quantizes `<name>.<qin>` and compares with `<name>.<qout>` byte for byte, naming
/// the first differing block.
fn check_quant_blocks<B: Block>(name: &str, qin: &str, qout: &str, f: fn(&[f32], &mut [B])) {
    let x = common::read_ref_f32(name, qin);
    let want = common::read_ref(name, qout);
    let size = core::mem::size_of::<B>();
    assert_eq!(want.len(), x.len() / 32 * size, "{name}: reference size");
    let mut bytes = vec![0u8; want.len()];
    f(
        &x,
        les_core::quant::blocks::as_blocks_mut(&mut bytes).unwrap(),
    );
    let got = block_bytes::<B>(as_blocks(&bytes).unwrap());
    for (i, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
        assert_eq!(
            g,
            w,
            "{name}.{qin}: block {i} differs; input {:?}",
            &x[i * 32..(i + 1) * 32]
        );
    }
}

fn check_quant_bytes(name: &str, qin: &str, qout: &str, f: fn(&[f32], &mut [u8])) {
    let x = common::read_ref_f32(name, qin);
    let want = common::read_ref(name, qout);
    let mut got = vec![0u8; x.len() * 2];
    f(&x, &mut got);
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.chunks(2).zip(want.chunks(2)).enumerate() {
        assert_eq!(g, w, "{name}.{qin}: element {i} ({:e}) differs", x[i]);
    }
}

#[test]
fn dequantize_float_formats() {
    check_dequant_bytes("f32", 4, float::dequantize_f32);
    check_dequant_bytes("f16", 2, float::dequantize_f16);
    check_dequant_bytes("bf16", 2, float::dequantize_bf16);
}

#[test]
fn dequantize_legacy_formats() {
    check_dequant_blocks::<BlockQ4_0>("q4_0", legacy::dequantize_q4_0);
    check_dequant_blocks::<BlockQ4_1>("q4_1", legacy::dequantize_q4_1);
    check_dequant_blocks::<BlockQ5_0>("q5_0", legacy::dequantize_q5_0);
    check_dequant_blocks::<BlockQ5_1>("q5_1", legacy::dequantize_q5_1);
    check_dequant_blocks::<BlockQ8_0>("q8_0", legacy::dequantize_q8_0);
}

#[test]
fn quantize_legacy_formats() {
    check_quant_blocks::<BlockQ4_0>("q4_0", "qin", "qout", legacy::quantize_q4_0);
    check_quant_blocks::<BlockQ4_1>("q4_1", "qin", "qout", legacy::quantize_q4_1);
    check_quant_blocks::<BlockQ5_0>("q5_0", "qin", "qout", legacy::quantize_q5_0);
    check_quant_blocks::<BlockQ5_1>("q5_1", "qin", "qout", legacy::quantize_q5_1);
    check_quant_blocks::<BlockQ8_0>("q8_0", "qin", "qout", legacy::quantize_q8_0);
}

#[test]
fn quantize_float_formats() {
    check_quant_bytes("f16", "qin", "qout", float::quantize_f16);
    check_quant_bytes("bf16", "qin", "qout", float::quantize_bf16);
}

/// Magnitudes from subnormal to near `f32::MAX`. Where `1/d` overflows, numpy's
/// float-to-int casts decide the quants; [`legacy`] follows x86-64's, so the
/// reference is only comparable there.
#[test]
#[cfg(target_arch = "x86_64")]
fn quantize_extreme_magnitudes() {
    check_quant_blocks::<BlockQ4_0>("q4_0", "qin_edge", "qout_edge", legacy::quantize_q4_0);
    check_quant_blocks::<BlockQ4_1>("q4_1", "qin_edge", "qout_edge", legacy::quantize_q4_1);
    check_quant_blocks::<BlockQ5_0>("q5_0", "qin_edge", "qout_edge", legacy::quantize_q5_0);
    check_quant_blocks::<BlockQ5_1>("q5_1", "qin_edge", "qout_edge", legacy::quantize_q5_1);
    check_quant_blocks::<BlockQ8_0>("q8_0", "qin_edge", "qout_edge", legacy::quantize_q8_0);
    check_quant_bytes("f16", "qin_edge", "qout_edge", float::quantize_f16);
    check_quant_bytes("bf16", "qin_edge", "qout_edge", float::quantize_bf16);
}
