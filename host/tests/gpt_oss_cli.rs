//! `les` on synthetic gpt-oss models (llama.cpp's `OPENAI_MOE`: attention with
//! biases, sinks and a sliding window on even layers, YaRN RoPE, routed
//! experts with biases and a clamped SwiGLU, MXFP4 experts): the file carries
//! llama.cpp's keys and tensors, a packed and requantized copy runs, every
//! schedule gives the resident logits (also in `run_cli`), and, with
//! llama-cpp-python at hand, the greedy continuation equals llama.cpp's.

mod cli;
mod common;

use std::path::PathBuf;

use cli::{
    greedy, greedy_json, greedy_logits, kld, les, llama_greedy, llama_kld_base, pack, stdout_ok,
    synth_once, tmp, tokens, F32_WEIGHTS,
};
use common::rewrite_gguf;
use les::gguf::{Gguf, MetaValue};

/// A synthetic gpt-oss `tiny` written once per test binary (`extra` args).
fn model(name: &str, extra: &[&str]) -> PathBuf {
    let args = ["--arch", "gpt-oss", "--preset", "tiny", "--seed", "5"];
    synth_once(
        &format!("gpt_oss_{name}.gguf"),
        &[&args[..], extra].concat(),
    )
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("mxfp4", &["--expert-type", "mxfp4"]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "gpt-oss");
    assert_eq!(g.get_u32("gpt-oss.attention.sliding_window").unwrap(), 16);
    assert_eq!(g.get_str("gpt-oss.rope.scaling.type").unwrap(), "yarn");
    assert_eq!(g.get_f32("gpt-oss.rope.scaling.factor").unwrap(), 32.0);
    assert_eq!(
        g.get_u32("gpt-oss.rope.scaling.original_context_length")
            .unwrap(),
        4096
    );
    for name in [
        "blk.0.attn_sinks.weight",
        "blk.0.attn_q.bias",
        "blk.0.attn_output.bias",
        "blk.0.post_attention_norm.weight",
        "blk.0.ffn_gate_inp.bias",
        "blk.0.ffn_gate_exps.bias",
        "blk.0.ffn_up_exps.bias",
        "blk.0.ffn_down_exps.bias",
    ] {
        assert!(g.tensor(name).is_some(), "{name}");
    }
    let t = g.tensor("blk.1.ffn_up_exps.weight").unwrap();
    assert_eq!(t.ggml_type(), les_core::quant::GgmlType::MXFP4);
    assert!(g.tensor("blk.0.ffn_norm.weight").is_none());
}

/// `les pack` keeps the MXFP4 experts as they are (same logits as the plain
/// file), streams them at any budget with the resident logits, and can
/// requantize another model's experts to MXFP4.
#[test]
fn packed_mxfp4_experts_stream_exactly() {
    let m = model("mxfp4", &["--expert-type", "mxfp4"]);
    let packed = tmp("gpt_oss_mxfp4.p.gguf");
    pack(&m, &packed);
    let (want_tokens, want) = greedy_logits(&m, "plain", &[]);
    assert_eq!(want_tokens.len(), 24);
    for (name, file, extra) in [
        ("packed", &packed, &[][..]),
        (
            "packed_les",
            &packed,
            &["--schedule", "les", "--slots", "3"][..],
        ),
        (
            "packed_od",
            &packed,
            &["--schedule", "on-demand", "--slots", "5"],
        ),
        (
            "plain_les",
            &m,
            &["--schedule", "les", "--slots", "4", "-b", "1"],
        ),
    ] {
        let (t, got) = greedy_logits(file, name, extra);
        assert_eq!(t, want_tokens, "{name}");
        assert!(got == want, "{name}: logits differ");
    }
    let q = model("q4", &[]);
    let requant = tmp("gpt_oss_requant.gguf");
    let out = les()
        .arg("pack")
        .arg(&q)
        .arg("-o")
        .arg(&requant)
        .args(["--expert-types", "0-:mxfp4"])
        .output()
        .unwrap();
    stdout_ok(out, "les pack --expert-types 0-:mxfp4");
    let g = Gguf::open(&requant).unwrap();
    assert_eq!(
        les::pack::PackedIndex::from_gguf(&g)
            .unwrap()
            .unwrap()
            .layer(0)
            .unwrap()
            .format
            .gate,
        les_core::quant::GgmlType::MXFP4
    );
    assert!(!tokens(&greedy_json(&requant, &[])).is_empty());
}

/// RoPE scaling keys as llama.cpp reads them: an unknown type is refused by
/// key, `none` turns YaRN off (other logits), a lone factor is linear
/// scaling (other logits again); qwen35moe's multi-section RoPE is scaled too
/// (against llama.cpp: `qwen35_cli::yarn_continuation_equals_llama_cpp`).
#[test]
fn rope_scaling_keys_are_read_or_refused() {
    let m = model("mxfp4", &["--expert-type", "mxfp4"]);
    let (_, yarn) = greedy_logits(&m, "yarn", &[]);
    let with = |name: &str, kind: Option<&str>| {
        let dst = tmp(&format!("gpt_oss_rope_{name}.gguf"));
        let kind = kind.map(str::to_owned);
        rewrite_gguf(
            &m,
            &dst,
            |k, v| {
                if k == "gpt-oss.rope.scaling.type" {
                    kind.clone().map(MetaValue::from)
                } else {
                    Some(v)
                }
            },
            vec![],
        );
        dst
    };
    let out = greedy(&with("foo", Some("foo")), &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gpt-oss.rope.scaling.type"), "{err}");
    let (_, none) = greedy_logits(&with("none", Some("none")), "none", &[]);
    let (_, linear) = greedy_logits(&with("linear", None), "linear", &[]);
    assert!(none != yarn && linear != yarn && linear != none);

    let q = synth_once(
        "gpt_oss_qwen35.gguf",
        &["--arch", "qwen35moe", "--preset", "tiny"],
    );
    let dst = tmp("gpt_oss_qwen35_yarn.gguf");
    rewrite_gguf(
        &q,
        &dst,
        |_, v| Some(v),
        vec![
            ("qwen35moe.rope.scaling.type", MetaValue::from("yarn")),
            ("qwen35moe.rope.scaling.factor", MetaValue::F32(4.0)),
        ],
    );
    let (_, plain) = greedy_logits(&q, "qwen35_plain", &[]);
    let (_, scaled) = greedy_logits(&dst, "qwen35_yarn", &[]);
    assert!(plain != scaled, "YaRN changed nothing on qwen35moe");
}

/// Greedy continuation against llama.cpp through llama-cpp-python
/// (`host/tests/scripts/llama_greedy.py`), with f32 weights (where the two
/// differ only by rounding) and with MXFP4 experts.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_continuation_equals_llama_cpp() {
    for (name, extra) in [
        ("f32", &F32_WEIGHTS[..]),
        ("mxfp4", &["--expert-type", "mxfp4"][..]),
    ] {
        let m = model(name, extra);
        let theirs = llama_greedy(&m);
        let v = greedy_json(&m, &[]);
        assert_eq!(v["prompt_tokens"], theirs["prompt"], "{name}: prompt");
        let ours = tokens(&v);
        assert!(ours.len() > 10, "{name}: {ours:?}");
        assert_eq!(
            serde_json::json!(ours),
            theirs["tokens"],
            "{name}: greedy continuations differ"
        );
    }
    // The f32 model's log-probabilities over 2 x 128 positions (past the
    // window of 16) are llama.cpp's within rounding.
    let m = model("f32", &F32_WEIGHTS);
    let base = tmp("gpt_oss_f32.kld");
    llama_kld_base(&m, &base);
    let kld = kld(&m, &base);
    assert!(kld["max"].as_f64().unwrap() < 1e-4, "{kld}");
    assert_eq!(kld["same_top"], 1.0, "{kld}");
}
