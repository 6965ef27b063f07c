//! `les` on synthetic dense Qwen models, `qwen3` (Qwen3-0.6B ... 32B: Q/K
//! norms per head) and `qwen2` (Qwen2 / Qwen2.5: Q/K/V biases), the draft
//! models of Qwen's MoEs: the file carries llama.cpp's keys and tensors, the
//! loader reads them as llama.cpp does (no experts, whatever the keys say),
//! a qwen3 drafts for a qwen3moe without changing its tokens, and, with
//! llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's.

mod cli;

use std::path::PathBuf;

use cli::{greedy_json, tiny, tmp, tokens, F32_WEIGHTS};
use les::gguf::{Gguf, MetaValue};

fn model(arch: &str, name: &str, extra: &[&str]) -> PathBuf {
    tiny(arch, name, extra)
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    for (arch, norms, biases) in [("qwen3", true, false), ("qwen2", false, true)] {
        let m = model(arch, "q", &[]);
        let g = Gguf::open(&m).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), arch);
        assert!(g.get(&format!("{arch}.expert_count")).is_none(), "{arch}");
        assert!(g.tensor("blk.0.ffn_gate.weight").is_some(), "{arch}");
        assert!(g.tensor("blk.0.ffn_gate_inp.weight").is_none(), "{arch}");
        assert_eq!(
            g.tensor("blk.0.attn_q_norm.weight").is_some(),
            norms,
            "{arch}"
        );
        assert_eq!(g.tensor("blk.0.attn_q.bias").is_some(), biases, "{arch}");
        drop(g);
        let model = les::model::Model::open(&m).unwrap();
        assert!(model.hp.moe.is_none(), "{arch}");
        assert_eq!(model.hp.rope_style, les_core::model::ops::RopeStyle::Neox);
    }
}

/// llama.cpp's dense Qwen loaders read no experts: an `expert_count` in the
/// file changes nothing.
#[test]
fn an_expert_count_changes_nothing() {
    let m = model("qwen3", "q", &[]);
    let dst = cli::with_metadata(&m, "qwen3_expert_count.gguf", |meta| {
        meta.push(("qwen3.expert_count".into(), MetaValue::U32(8)));
        meta.push(("qwen3.expert_used_count".into(), MetaValue::U32(2)));
    });
    assert_eq!(greedy_json(&dst, &[])["text"], greedy_json(&m, &[])["text"]);
}

/// A dense qwen3 of the same vocabulary drafts for a qwen3moe (every draft
/// verified): the tokens are plain decoding's.
#[test]
fn a_qwen3_drafts_for_a_qwen3moe() {
    let target = tiny("qwen3moe", "target", &[]);
    let draft = model("qwen3", "q", &[]);
    let plain = greedy_json(&target, &[]);
    let d = draft.to_str().unwrap();
    let drafted = greedy_json(&target, &["--model-draft", d, "--draft-fixed"]);
    assert_eq!(tokens(&drafted), tokens(&plain));
    assert!(
        drafted["stats"]["drafted"].as_u64().unwrap() > 0,
        "{drafted}"
    );
}

/// The dense architectures are refused experts by name.
#[test]
fn experts_are_refused_by_name() {
    for (arch, moe) in [("qwen3", "qwen3moe"), ("qwen2", "qwen2moe")] {
        let out = cli::les()
            .args([
                "synth",
                "--arch",
                arch,
                "--preset",
                "tiny",
                "--experts",
                "4",
                "-o",
            ])
            .arg(tmp(&format!("{arch}_experts.gguf")))
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(moe), "{arch}: {err}");
    }
}

/// Against llama.cpp through llama-cpp-python: with f32 weights the same
/// prompt and greedy tokens and log-probabilities within rounding; with the
/// preset's quantized weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    for arch in ["qwen3", "qwen2"] {
        let f32 = model(arch, "f32", &F32_WEIGHTS);
        cli::assert_equals_llama_cpp(&f32, &format!("{arch}_f32"), 1e-4, 1.0);
        cli::assert_close_to_llama_cpp(&model(arch, "q", &[]), &format!("{arch}_q"));
    }
}
