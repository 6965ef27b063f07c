//! `les` on synthetic ERNIE 4.5 MoE models (llama.cpp's `ERNIE4_5_MOE`,
//! ERNIE-4.5-21B-A3B and -300B-A47B: Llama attention, a dense first layer,
//! routed experts picked by softmax probabilities plus a selection bias,
//! renormalised, an ungated shared expert): the file carries llama.cpp's
//! keys and tensors, the loader reads them as llama.cpp does (refusing what
//! llama.cpp cannot run), a packed copy streams with the resident logits,
//! and, with llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's.

mod cli;
mod common;

use std::path::{Path, PathBuf};

use cli::{greedy, greedy_logits, streams_exactly, tiny, tmp, F32_WEIGHTS};
use common::rewrite_gguf;
use les::gguf::{Gguf, MetaValue};
use les_core::router::Gating;

/// A synthetic ernie4_5-moe `tiny` written once per test binary (`extra` args).
fn model(name: &str, extra: &[&str]) -> PathBuf {
    tiny("ernie4_5-moe", name, extra)
}

/// A copy of `src` with `key` set to `value` (or removed for `None`).
fn with_key(src: &Path, name: &str, key: &'static str, value: Option<MetaValue>) -> PathBuf {
    let dst = tmp(&format!("ernie_{name}.gguf"));
    let added = value.map(|v| vec![(key, v)]).unwrap_or_default();
    rewrite_gguf(src, &dst, |k, v| (k != key).then_some(v), added);
    dst
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("q", &[]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "ernie4_5-moe");
    for (key, want) in [
        ("ernie4_5-moe.block_count", 4),
        ("ernie4_5-moe.leading_dense_block_count", 1),
        ("ernie4_5-moe.interleave_moe_layer_step", 1),
        ("ernie4_5-moe.expert_shared_count", 1),
    ] {
        assert_eq!(g.get_u32(key).unwrap(), want, "{key}");
    }
    // llama.cpp's converter writes neither: its graph fixes both.
    for key in [
        "ernie4_5-moe.expert_gating_func",
        "ernie4_5-moe.expert_weights_norm",
    ] {
        assert!(g.get(key).is_none(), "{key}");
    }
    for name in [
        "blk.0.ffn_gate.weight",
        "blk.0.ffn_norm.weight",
        "blk.1.ffn_gate_inp.weight",
        "blk.1.exp_probs_b.bias",
        "blk.1.ffn_gate_shexp.weight",
        "blk.1.ffn_down_exps.weight",
    ] {
        assert!(g.tensor(name).is_some(), "{name}");
    }
    for name in [
        "blk.0.ffn_gate_inp.weight",
        "blk.1.ffn_gate_inp_shexp.weight",
        "blk.1.attn_q.bias",
        "blk.1.attn_q_norm.weight",
        "blk.1.post_attention_norm.weight",
    ] {
        assert!(g.tensor(name).is_none(), "{name}");
    }
    drop(g);
    let model = les::model::Model::open(&m).unwrap();
    assert!(!model.is_moe_layer(0) && model.is_moe_layer(1));
    assert_eq!(model.hp.rope_style, les_core::model::ops::RopeStyle::Normal);
    let moe = model.hp.moe.unwrap();
    assert_eq!((moe.gating, moe.normalize), (Gating::Softmax, true));
    // Whatever the metadata says, as llama.cpp's graph.
    let sigmoid = with_key(
        &m,
        "sigmoid",
        "ernie4_5-moe.expert_gating_func",
        Some(MetaValue::U32(2)),
    );
    let moe = les::model::Model::open(&sigmoid).unwrap().hp.moe.unwrap();
    assert_eq!((moe.gating, moe.normalize), (Gating::Softmax, true));
}

/// The selection bias decides picks: zeroed, the logits move.
#[test]
fn the_selection_bias_changes_the_picks() {
    cli::assert_selection_bias_matters(&model("q", &[]), "ernie_q", 3);
}

/// Experts every other layer, which llama.cpp's graph cannot run (its loader
/// gives every layer past the dense ones experts), and a missing or zero
/// step, which its loader refuses, are refused with the reason.
#[test]
fn moe_layer_steps_llama_cpp_cannot_run_are_refused() {
    let m = model("q", &[]);
    let key = "ernie4_5-moe.interleave_moe_layer_step";
    for (name, value, says) in [
        ("step2", Some(MetaValue::U32(2)), "every 2 layers"),
        (
            "step0",
            Some(MetaValue::U32(0)),
            "interleave_moe_layer_step",
        ),
        ("nostep", None, "interleave_moe_layer_step"),
    ] {
        let out = greedy(&with_key(&m, name, key, value), &[]);
        assert!(!out.status.success(), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{name}: {err}");
    }
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("q", &[]), "ernie_q");
    assert_eq!(want_tokens.len(), 24);
}

/// Against llama.cpp through llama-cpp-python, with f32 weights: the same
/// greedy tokens, log-probabilities within rounding, and, once the selection
/// bias is gone, apart by far more than the bound (so the comparison sees
/// it); with the
/// preset's quantized weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    let (f32, q) = (model("f32", &F32_WEIGHTS), model("q", &[]));
    cli::assert_biased_routing_equals_llama_cpp(&f32, &q, "ernie", 3);
}

/// A dense `ernie4_5` file (ERNIE-4.5-0.3B's architecture: Llama's layers
/// under another name), made from a dense llama `tiny` by renaming its keys:
/// the same logits as the llama file, and it drafts for the MoE model
/// (`--model-draft`, the same vocabulary) without changing its tokens.
#[test]
fn dense_ernie_runs_as_llama_and_drafts() {
    let llama = tiny("llama", "dense", &[]);
    let dense = tmp("ernie_dense.gguf");
    let g = Gguf::open(&llama).unwrap();
    let renamed: Vec<(String, MetaValue)> = g
        .metadata()
        .filter_map(|(k, v)| {
            let k = k.strip_prefix("llama.")?;
            Some((format!("ernie4_5.{k}"), v.to_meta()))
        })
        .collect();
    drop(g);
    let extra: Vec<(&str, MetaValue)> = renamed
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .chain([("general.architecture", MetaValue::from("ernie4_5"))])
        .collect();
    rewrite_gguf(
        &llama,
        &dense,
        |k, v| (!k.starts_with("llama.") && k != "general.architecture").then_some(v),
        extra,
    );
    let opened = les::model::Model::open(&dense).unwrap();
    assert_eq!(opened.arch.name(), "ernie4_5");
    assert!(opened.hp.moe.is_none());
    let (want_tokens, want) = greedy_logits(&llama, "llama_dense", &[]);
    let (tokens, got) = greedy_logits(&dense, "ernie_dense", &[]);
    assert_eq!(tokens, want_tokens);
    assert!(got == want, "the renamed dense model's logits differ");

    let moe = model("q", &[]);
    let (want_tokens, want) = greedy_logits(&moe, "ernie_moe_plain", &[]);
    let draft = ["--model-draft", dense.to_str().unwrap(), "--draft-fixed"];
    let (tokens, got) = greedy_logits(&moe, "ernie_moe_drafted", &draft);
    assert_eq!(tokens, want_tokens);
    assert!(got == want, "drafting changed the logits");
}
