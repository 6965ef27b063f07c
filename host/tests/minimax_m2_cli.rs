//! `les` on synthetic minimax-m2 models (MiniMax-M2: Q/K norms over all heads
//! at once, half of each head rotated, every layer routed experts picked by
//! sigmoid scores plus a selection bias, renormalised, no shared expert): the
//! file carries llama.cpp's keys and tensors, the loader reads them as
//! llama.cpp does, a packed copy streams with the resident logits, and, with
//! llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's (its `minimax-m2` pre-tokenizer included).

mod cli;

use std::path::PathBuf;

use cli::{streams_exactly, tiny, F32_WEIGHTS};
use les::gguf::Gguf;
use les_core::router::Gating;

/// A synthetic minimax-m2 `tiny` written once per test binary (`extra` args).
fn model(name: &str, extra: &[&str]) -> PathBuf {
    tiny("minimax-m2", name, extra)
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("q", &[]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "minimax-m2");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "minimax-m2");
    assert_eq!(g.get_u32("minimax-m2.rope.dimension_count").unwrap(), 8);
    assert_eq!(g.get_u32("minimax-m2.expert_gating_func").unwrap(), 2);
    for name in [
        "blk.0.attn_q_norm.weight",
        "blk.0.ffn_gate_inp.weight",
        "blk.0.exp_probs_b.bias",
    ] {
        assert!(g.tensor(name).is_some(), "{name}");
    }
    // Norms over all heads at once.
    let q_norm = g.tensor("blk.0.attn_q_norm.weight").unwrap();
    assert_eq!(q_norm.n_elements(), 64);
    assert!(g.tensor("blk.0.ffn_gate_shexp.weight").is_none());
    drop(g);
    let model = les::model::Model::open(&m).unwrap();
    assert!((0..4).all(|l| model.is_moe_layer(l)));
    assert_eq!(model.hp.rope_style, les_core::model::ops::RopeStyle::Neox);
    let moe = model.hp.moe.unwrap();
    assert_eq!((moe.gating, moe.normalize), (Gating::Sigmoid, true));
}

/// The selection bias decides picks: zeroed, the logits move.
#[test]
fn the_selection_bias_changes_the_picks() {
    cli::assert_selection_bias_matters(&model("q", &[]), "minimax_q", 4);
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("q", &[]), "minimax_q");
    assert_eq!(want_tokens.len(), 24);
}

/// Against llama.cpp through llama-cpp-python, with f32 weights: the same
/// prompt and greedy tokens, log-probabilities within rounding, far apart
/// without the selection bias; with the preset's quantized weights, close
/// log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    let (f32, q) = (model("f32", &F32_WEIGHTS), model("q", &[]));
    cli::assert_biased_routing_equals_llama_cpp(&f32, &q, "minimax", 4);
}
