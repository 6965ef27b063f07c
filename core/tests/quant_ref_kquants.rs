//! K-quant and IQ4 dequantization, bit for bit against the `gguf` Python package
//! (reference data from `scripts/quant_refs.py`).

mod common;

use les_core::quant::blocks::{as_blocks, Block};
use les_core::quant::{iq4, kquants};

fn check<B: Block>(name: &str, elems_per_block: usize, dequantize: fn(&[B], &mut [f32])) {
    let bytes = common::read_ref(name, "blocks");
    let want = common::read_ref_f32(name, "dequant");
    let blocks: &[B] = as_blocks(&bytes).unwrap_or_else(|| panic!("{name}: ragged block file"));
    assert!(!blocks.is_empty(), "{name}: no reference blocks");
    assert_eq!(
        want.len(),
        blocks.len() * elems_per_block,
        "{name}: reference length"
    );
    let mut got = vec![0f32; want.len()];
    dequantize(blocks, &mut got);
    common::assert_bits_eq(name, &got, &want);
}

#[test]
fn q2_k_matches_gguf() {
    check("q2_k", 256, kquants::dequantize_q2k);
}

#[test]
fn q3_k_matches_gguf() {
    check("q3_k", 256, kquants::dequantize_q3k);
}

#[test]
fn q4_k_matches_gguf() {
    check("q4_k", 256, kquants::dequantize_q4k);
}

#[test]
fn q5_k_matches_gguf() {
    check("q5_k", 256, kquants::dequantize_q5k);
}

#[test]
fn q6_k_matches_gguf() {
    check("q6_k", 256, kquants::dequantize_q6k);
}

#[test]
fn iq4_nl_matches_gguf() {
    check("iq4_nl", 32, iq4::dequantize_iq4nl);
}

#[test]
fn iq4_xs_matches_gguf() {
    check("iq4_xs", 256, iq4::dequantize_iq4xs);
}
