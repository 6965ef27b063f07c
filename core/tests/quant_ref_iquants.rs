//! The lattice i-quants (`IQ1_S`, `IQ1_M`, `IQ2_XXS`, `IQ2_XS`, `IQ2_S`,
//! `IQ3_XXS`, `IQ3_S`): dequantization bit for bit against the `gguf` Python
//! package, over random blocks (reference data from `scripts/quant_refs.py`),
//! which reach every grid table and sign pattern; and through the generic
//! [`dequantize`] dispatch.

mod common;

use les_core::quant::blocks::{as_blocks, Block};
use les_core::quant::{dequantize, iq1, iq2, iq3, GgmlType};

fn check<B: Block>(name: &str, ty: GgmlType, dequantize_blocks: fn(&[B], &mut [f32])) {
    let bytes = common::read_ref(name, "blocks");
    let want = common::read_ref_f32(name, "dequant");
    let blocks: &[B] = as_blocks(&bytes).unwrap_or_else(|| panic!("{name}: ragged block file"));
    assert!(blocks.len() >= 64, "{name}: too few reference blocks");
    assert_eq!(want.len(), blocks.len() * 256, "{name}: reference length");
    let mut got = vec![0f32; want.len()];
    dequantize_blocks(blocks, &mut got);
    common::assert_bits_eq(name, &got, &want);
    let mut via = vec![0f32; want.len()];
    dequantize(ty, &bytes, &mut via).unwrap();
    common::assert_bits_eq(name, &via, &want);
    // Not every value the same: the blocks are random, their scales finite.
    assert!(want.iter().all(|v| v.is_finite()), "{name}");
    assert!(
        want.iter().any(|v| *v > 0.0) && want.iter().any(|v| *v < 0.0),
        "{name}"
    );
}

#[test]
fn iq2_xxs_matches_gguf() {
    check("iq2_xxs", GgmlType::IQ2XXS, iq2::dequantize_iq2xxs);
}

#[test]
fn iq2_xs_matches_gguf() {
    check("iq2_xs", GgmlType::IQ2XS, iq2::dequantize_iq2xs);
}

#[test]
fn iq2_s_matches_gguf() {
    check("iq2_s", GgmlType::IQ2S, iq2::dequantize_iq2s);
}

#[test]
fn iq3_xxs_matches_gguf() {
    check("iq3_xxs", GgmlType::IQ3XXS, iq3::dequantize_iq3xxs);
}

#[test]
fn iq3_s_matches_gguf() {
    check("iq3_s", GgmlType::IQ3S, iq3::dequantize_iq3s);
}

#[test]
fn iq1_s_matches_gguf() {
    check("iq1_s", GgmlType::IQ1S, iq1::dequantize_iq1s);
}

#[test]
fn iq1_m_matches_gguf() {
    check("iq1_m", GgmlType::IQ1M, iq1::dequantize_iq1m);
}
