//! `les` on synthetic bailingmoe2 models (Ling 2.0 / Ring 2.0: a fused QKV
//! projection, per-head Q/K norms, half of each head rotated, a dense first
//! layer, sigmoid routing with a selection bias over expert groups, an
//! ungated shared expert): the file carries llama.cpp's keys and tensors, the
//! loader reads them as llama.cpp does, a packed copy streams with the
//! resident logits, and, with llama-cpp-python at hand, les's tokens and
//! log-probabilities are llama.cpp's (its `bailingmoe2` pre-tokenizer
//! included).

mod cli;
mod common;

use std::path::PathBuf;

use cli::{streams_exactly, tiny, tmp, F32_WEIGHTS};
use les::gguf::Gguf;
use les_core::router::{ExpertGroups, Gating};

/// A synthetic bailingmoe2 `tiny` written once per test binary (`extra` args).
fn model(name: &str, extra: &[&str]) -> PathBuf {
    tiny("bailingmoe2", name, extra)
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("q", &[]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "bailingmoe2");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "bailingmoe2");
    for (key, want) in [
        ("bailingmoe2.leading_dense_block_count", 1),
        ("bailingmoe2.expert_shared_count", 1),
        ("bailingmoe2.expert_gating_func", 2),
        ("bailingmoe2.rope.dimension_count", 8),
        ("bailingmoe2.attention.key_length", 16),
    ] {
        assert_eq!(g.get_u32(key).unwrap(), want, "{key}");
    }
    for name in [
        "blk.0.attn_qkv.weight",
        "blk.0.attn_q_norm.weight",
        "blk.0.ffn_gate.weight",
        "blk.1.ffn_gate_inp.weight",
        "blk.1.exp_probs_b.bias",
        "blk.1.ffn_gate_shexp.weight",
    ] {
        assert!(g.tensor(name).is_some(), "{name}");
    }
    for name in ["blk.0.attn_q.weight", "blk.1.ffn_gate_inp_shexp.weight"] {
        assert!(g.tensor(name).is_none(), "{name}");
    }
    drop(g);
    let model = les::model::Model::open(&m).unwrap();
    assert!(!model.is_moe_layer(0) && model.is_moe_layer(1));
    assert_eq!(model.hp.rope_style, les_core::model::ops::RopeStyle::Neox);
    assert_eq!((model.hp.head_dim, model.hp.n_rot), (16, 8));
    let moe = model.hp.moe.unwrap();
    assert_eq!(
        (moe.gating, moe.normalize, moe.weights_scale),
        (Gating::Sigmoid, true, 2.5)
    );
    assert_eq!(moe.groups, Some(ExpertGroups { count: 4, used: 2 }));
}

/// The selection bias decides picks: zeroed, the logits move.
#[test]
fn the_selection_bias_changes_the_picks() {
    cli::assert_selection_bias_matters(&model("q", &[]), "bailingmoe2_q", 3);
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("q", &[]), "bailingmoe2_q");
    assert_eq!(want_tokens.len(), 24);
}

/// Against llama.cpp through llama-cpp-python, with f32 weights: the same
/// prompt tokens (its `bailingmoe2` pre-tokenizer) and greedy tokens,
/// log-probabilities within rounding, far apart without the selection bias;
/// with the preset's quantized weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    let (f32, q) = (model("f32", &F32_WEIGHTS), model("q", &[]));
    cli::assert_biased_routing_equals_llama_cpp(&f32, &q, "bailingmoe2", 3);
}

/// Its multi-token-prediction layers are skipped, as llama.cpp skips them:
/// the model runs without them, and `--speculate mtp` says why it cannot.
#[test]
fn mtp_layers_are_skipped() {
    let m = model("q", &[]);
    let with_mtp = tmp("bailingmoe2_q_mtp.gguf");
    common::rewrite_gguf(
        &m,
        &with_mtp,
        |_, v| Some(v),
        vec![(
            "bailingmoe2.nextn_predict_layers",
            les::gguf::MetaValue::U32(1),
        )],
    );
    let model = les::model::Model::open(&with_mtp).unwrap();
    assert_eq!((model.hp.n_layers, model.n_nextn_layers), (3, 1));
    assert!(cli::greedy(&with_mtp, &[]).status.success());
    let out = cli::greedy(&with_mtp, &["--speculate", "mtp"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not run"), "{err}");
}
