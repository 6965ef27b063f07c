//! `les` on synthetic dots1 models (dots.llm1: Qwen3's attention, a dense
//! first layer, sigmoid routing with a selection bias, an ungated shared
//! expert `expert_shared_count` experts wide): the file carries llama.cpp's
//! keys and tensors, the loader reads them as llama.cpp does, a packed copy
//! streams with the resident logits, and, with llama-cpp-python at hand,
//! les's tokens and log-probabilities are llama.cpp's.

mod cli;

use std::path::PathBuf;

use cli::{streams_exactly, tiny, F32_WEIGHTS};
use les::gguf::Gguf;
use les_core::router::Gating;

/// A synthetic dots1 `tiny` written once per test binary (`extra` args).
fn model(name: &str, extra: &[&str]) -> PathBuf {
    tiny("dots1", name, extra)
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("q", &[]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "dots1");
    for (key, want) in [
        ("dots1.leading_dense_block_count", 1),
        ("dots1.expert_shared_count", 1),
        ("dots1.expert_gating_func", 2),
    ] {
        assert_eq!(g.get_u32(key).unwrap(), want, "{key}");
    }
    // llama.cpp's loader sizes the shared experts itself, and keys and
    // values as queries.
    assert!(g.get("dots1.expert_shared_feed_forward_length").is_none());
    assert_eq!(
        g.get_u32("dots1.attention.head_count_kv").unwrap(),
        g.get_u32("dots1.attention.head_count").unwrap()
    );
    for name in [
        "blk.0.ffn_gate.weight",
        "blk.0.attn_q_norm.weight",
        "blk.1.exp_probs_b.bias",
        "blk.1.ffn_gate_shexp.weight",
    ] {
        assert!(g.tensor(name).is_some(), "{name}");
    }
    drop(g);
    let model = les::model::Model::open(&m).unwrap();
    assert!(!model.is_moe_layer(0) && model.is_moe_layer(1));
    let moe = model.hp.moe.unwrap();
    assert_eq!(
        (moe.gating, moe.normalize, moe.weights_scale),
        (Gating::Sigmoid, true, 2.5)
    );
}

/// The selection bias decides picks: zeroed, the logits move.
#[test]
fn the_selection_bias_changes_the_picks() {
    cli::assert_selection_bias_matters(&model("q", &[]), "dots1_q", 3);
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("q", &[]), "dots1_q");
    assert!(want_tokens.len() > 4);
}

/// Against llama.cpp through llama-cpp-python (see
/// `cli::assert_biased_routing_equals_llama_cpp`).
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    let (f32, q) = (model("f32", &F32_WEIGHTS), model("q", &[]));
    cli::assert_biased_routing_equals_llama_cpp(&f32, &q, "dots1", 3);
}
