//! `les` on synthetic qwen3next models (Qwen3-Next-80B-A3B's architecture:
//! qwen35moe's gated DeltaNet and gated attention layers, but plain partial
//! NeoX RoPE, value heads grouped by key head and a fused `ssm_ba`): the file
//! carries llama.cpp's keys and tensors, the loader reads them as llama.cpp
//! does, a packed copy streams with the resident logits, the nextn block
//! drafts without changing them, and, with llama-cpp-python at hand, les's
//! tokens and log-probabilities are llama.cpp's.

mod cli;

use std::path::PathBuf;

use cli::{assert_equals_llama_cpp, mtp_tokens, streams_exactly, tiny, F32_WEIGHTS};
use les::gguf::Gguf;

/// A synthetic qwen3next `tiny` written once per test binary (`extra` args).
fn model(name: &str, extra: &[&str]) -> PathBuf {
    tiny("qwen3next", name, extra)
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("q", &[]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "qwen3next");
    for (key, want) in [
        ("qwen3next.block_count", 5),
        ("qwen3next.nextn_predict_layers", 1),
        ("qwen3next.rope.dimension_count", 8),
        ("qwen3next.ssm.group_count", 2),
        ("qwen3next.ssm.time_step_rank", 4),
        ("qwen3next.full_attention_interval", 2),
    ] {
        assert_eq!(g.get_u32(key).unwrap(), want, "{key}");
    }
    assert!(g.get("qwen3next.rope.dimension_sections").is_none());
    for name in [
        "blk.0.ssm_ba.weight",
        "blk.0.attn_qkv.weight",
        "blk.0.attn_gate.weight",
        "blk.1.attn_q.weight",
        "blk.1.ffn_gate_inp_shexp.weight",
        "blk.4.nextn.eh_proj.weight",
    ] {
        assert!(g.tensor(name).is_some(), "{name}");
    }
    for name in ["blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight"] {
        assert!(g.tensor(name).is_none(), "{name}");
    }
    drop(g);
    let model = les::model::Model::open(&m).unwrap();
    assert_eq!((model.hp.n_layers, model.n_nextn_layers), (4, 1));
    assert_eq!((model.hp.head_dim, model.hp.n_rot), (16, 8));
    assert_eq!(model.hybrid.rope_sections, None);
    let (n_linear, shape) = model.hybrid.linear.unwrap();
    assert_eq!(n_linear, 2);
    assert!(shape.delta_net().unwrap().grouped_values);
    assert!(model.is_linear_layer(0) && !model.is_linear_layer(1));
    assert!(model.nextn_block().is_some());
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size; drafting with the nextn block keeps the tokens.
#[test]
fn packed_experts_stream_exactly() {
    let (packed, want_tokens) = streams_exactly(&model("q", &[]), "qwen3next_q");
    assert_eq!(want_tokens.len(), 24);
    assert_eq!(mtp_tokens(&packed, &["--slots", "3"]), want_tokens);
}

/// Against llama.cpp through llama-cpp-python: the same greedy tokens with
/// f32 weights and with the preset's quantized ones, and log-probabilities
/// within rounding (f32: a largest KL divergence of 5e-6) or close
/// (quantized: at most 1e-2, a mean of 3e-5 on this model).
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    assert_equals_llama_cpp(&model("f32", &F32_WEIGHTS), "qwen3next_f32", 1e-4, 1.0);
    assert_equals_llama_cpp(&model("q", &[]), "qwen3next_q", 1e-2, 0.95);
}
