//! `les` on synthetic qwen35moe models (MiniCPM-V 4.7's hybrid gated DeltaNet /
//! gated attention architecture): every schedule and the packed file give logits
//! bit-identical to resident, the output does not depend on threads, the MTP block
//! is loaded and skipped (a file without it gives the same logits), and, with a
//! llama.cpp build at hand, the greedy continuation equals llama.cpp's.

mod cli;
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use cli::{
    greedy_json, greedy_logits, kld, les, llama_greedy, llama_kld_base, pack, synth_once, tmp,
    tokens, F32_WEIGHTS,
};
use common::rewrite_gguf;
use les::gguf::MetaValue;

/// A synthetic qwen35moe `tiny` written once per test binary (`extra` args).
fn model(name: &str, extra: &[&str]) -> PathBuf {
    let args = ["--arch", "qwen35moe", "--preset", "tiny", "--seed", "5"];
    synth_once(&format!("qwen35_{name}.gguf"), &[&args[..], extra].concat())
}

#[test]
fn every_schedule_and_the_packed_file_give_bit_identical_logits() {
    let m = model("mtp", &[]);
    let (want_tokens, want) = greedy_logits(&m, "resident", &["--schedule", "resident"]);
    assert_eq!(want_tokens.len(), 24);
    assert!(!want.is_empty());
    for args in [
        &["--schedule", "on-demand", "--slots", "2"][..],
        &["--schedule", "les", "--slots", "2"],
        &["--schedule", "les", "--slots", "5"],
        &["--schedule", "on-demand", "--slots", "32"],
        &["--schedule", "les", "--expert-mem", "64KiB"],
        &["--schedule", "les", "--slots", "3", "-t", "1"],
    ] {
        let name = args.join("_").replace(['-', ' '], "");
        let (t, l) = greedy_logits(&m, &name, args);
        assert_eq!(t, want_tokens, "{args:?}");
        assert!(l == want, "{args:?}: logits differ");
    }
    // Packed (one aligned extent per expert, the MTP block's experts included).
    let packed = tmp("qwen35_packed.gguf");
    pack(&m, &packed);
    for args in [
        &["--schedule", "resident"][..],
        &["--schedule", "les", "--slots", "2"],
        &["--schedule", "on-demand", "--slots", "3"],
    ] {
        let name = format!("packed_{}", args.join("_").replace(['-', ' '], ""));
        let (t, l) = greedy_logits(&packed, &name, args);
        assert_eq!(t, want_tokens, "packed {args:?}");
        assert!(l == want, "packed {args:?}: logits differ");
    }
}

#[test]
fn greedy_output_does_not_depend_on_threads() {
    let m = model("mtp", &[]);
    let a = greedy_json(&m, &["-t", "1"]);
    let b = greedy_json(&m, &["-t", "2"]);
    assert_eq!(tokens(&a), tokens(&b));
}

#[test]
fn mtp_block_is_loaded_and_skipped() {
    let with = model("mtp", &[]);
    let without = model("nomtp", &["--mtp-layers", "0"]);
    let g = les::gguf::Gguf::open(&with).unwrap();
    assert_eq!(g.get_u32("qwen35moe.nextn_predict_layers").unwrap(), 1);
    assert_eq!(g.get_u32("qwen35moe.block_count").unwrap(), 5);
    assert!(g.tensor("blk.4.nextn.eh_proj.weight").is_some());
    drop(g);
    let m = les::model::Model::open(&with).unwrap();
    assert_eq!((m.hp.n_layers, m.n_nextn_layers), (4, 1));
    assert_eq!(m.hybrid.n_attn_layers, 2);
    assert_eq!(m.hybrid.n_linear_layers(), 2);
    assert!(m.is_linear_layer(0) && !m.is_linear_layer(1));
    let n = les::model::Model::open(&without).unwrap();
    assert_eq!((n.hp.n_layers, n.n_nextn_layers), (4, 0));
    // The main stack is the same: the same logits, bit for bit.
    let (ta, la) = greedy_logits(&with, "mtp_res", &[]);
    let (tb, lb) = greedy_logits(&without, "nomtp_res", &[]);
    assert_eq!(ta, tb);
    assert!(la == lb, "logits differ with and without the MTP block");
}

/// Greedy continuation against llama.cpp's `llama-simple` (which prints the prompt
/// and then each generated token's bytes): set `LLAMA_SIMPLE` to its path.
#[test]
#[ignore = "needs a llama.cpp build: LLAMA_SIMPLE=/path/to/llama-simple"]
fn greedy_continuation_equals_llama_cpp() {
    let bin = std::env::var("LLAMA_SIMPLE").expect("LLAMA_SIMPLE");
    let m = model("mtp", &[]);
    let prompt = "The quick brown fox";
    let n = 24; // as `run` asks of les
    let lib_dir = Path::new(&bin).parent().unwrap();
    let out = Command::new(&bin)
        .env("LD_LIBRARY_PATH", lib_dir)
        .arg("-m")
        .arg(&m)
        .args(["-n", &n.to_string(), prompt])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "llama-simple: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // llama-simple prints the prompt, the pieces, then a newline.
    let theirs = out.stdout.strip_prefix(prompt.as_bytes()).unwrap();
    let theirs = theirs.strip_suffix(b"\n").unwrap_or(theirs).to_vec();
    let v = greedy_json(&m, &[]);
    let g = les::gguf::Gguf::open(&m).unwrap();
    let tok = les::tokenizer::Tokenizer::from_gguf(&g).unwrap();
    let ours: Vec<u8> = tokens(&v)
        .iter()
        .flat_map(|&t| tok.piece(t as u32, true).to_vec())
        .collect();
    assert!(!ours.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&ours),
        String::from_utf8_lossy(&theirs),
        "greedy continuations differ"
    );
    assert_eq!(ours, theirs);
}

/// YaRN on multi-section RoPE (a file with `rope.scaling.type = yarn`, factor
/// 4 over 64 positions, f32 weights) against llama.cpp through
/// llama-cpp-python: llama.cpp's log-probabilities over this crate's sample
/// text (`host/tests/scripts/llama_kld_base.py`) are les's within rounding,
/// and measurably not the unscaled model's; the greedy continuations agree.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn yarn_equals_llama_cpp() {
    let plain = model("f32", &F32_WEIGHTS);
    let m = tmp("qwen35_yarn_f32.gguf");
    rewrite_gguf(
        &plain,
        &m,
        |_, v| Some(v),
        vec![
            ("qwen35moe.rope.scaling.type", MetaValue::from("yarn")),
            ("qwen35moe.rope.scaling.factor", MetaValue::F32(4.0)),
            (
                "qwen35moe.rope.scaling.original_context_length",
                MetaValue::U32(64),
            ),
        ],
    );
    let base = tmp("qwen35_yarn.kld");
    llama_kld_base(&m, &base);
    let scaled = kld(&m, &base);
    assert!(scaled["max"].as_f64().unwrap() < 1e-4, "{scaled}");
    assert_eq!(scaled["same_top"], 1.0, "{scaled}");
    let unscaled = kld(&plain, &base);
    assert!(unscaled["max"].as_f64().unwrap() > 1e-3, "{unscaled}");

    let theirs = llama_greedy(&m);
    let v = greedy_json(&m, &[]);
    assert_eq!(serde_json::json!(tokens(&v)), theirs["tokens"]);
}

#[test]
fn minicpmv47_preset_has_the_published_shape() {
    let out = les()
        .args([
            "synth",
            "--arch",
            "qwen35moe",
            "--preset",
            "minicpmv47",
            "--dry-run",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("layers 40, embd 2048, heads 16/2 x 256, vocab 248320"),
        "{text}"
    );
    assert!(text.contains("experts 256 x 512, top-8, shared expert 512"));
    let has = |name: &str| text.lines().any(|l| l.trim_start().starts_with(name));
    // Three DeltaNet layers, then gated attention (query + gate rows), repeated.
    assert!(has("blk.0.attn_qkv.weight") && has("blk.2.ssm_conv1d.weight"));
    assert!(has("blk.3.attn_q.weight") && !has("blk.3.attn_qkv.weight"));
    assert!(has("blk.39.attn_q.weight") && has("blk.38.ssm_out.weight"));
    assert!(text.contains("2048 x 8192"), "attn_q of 16 heads x 256 x 2");
    // One MTP block after the 40 layers.
    assert!(has("blk.40.nextn.eh_proj.weight") && !has("blk.41.attn_norm.weight"));
    let total: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("total_bytes "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (total / 21.2e9 - 1.0).abs() < 0.05,
        "minicpmv47 is {total} bytes"
    );
}

/// Copies the GGUF `src` to `dst`, passing each metadata pair through `edit`
/// (`None` drops it).
fn rewrite(
    src: &Path,
    dst: &Path,
    mut edit: impl FnMut(&str, les::gguf::MetaValue) -> Option<les::gguf::MetaValue>,
) {
    let g = les::gguf::Gguf::open(src).unwrap();
    let mut w = les::gguf::GgufWriter::new();
    for (k, v) in g.metadata() {
        if let Some(v) = edit(k, v.to_meta()) {
            w.add_kv(k, v).unwrap();
        }
    }
    for t in g.tensors() {
        w.add_tensor(t.name(), t.dims(), t.ggml_type()).unwrap();
    }
    let mut data = w.write_header(Vec::new()).unwrap();
    for t in g.tensors() {
        data.write_tensor(t.name(), t.data()).unwrap();
    }
    std::fs::write(dst, data.finish().unwrap()).unwrap();
}

#[test]
fn layer_kinds_and_expert_sizes_as_llama_cpp_reads_them() {
    use les::gguf::{MetaArray, MetaValue, ValueType};
    let src = model("mtp", &[]);
    let (want_tokens, want) = greedy_logits(&src, "kinds_ref", &[]);
    // Without `attention.recurrent_layers` the pattern follows
    // `full_attention_interval`; a per-layer `expert_feed_forward_length` array
    // of equal values is one size.
    let dst = tmp("qwen35_interval_only.gguf");
    rewrite(&src, &dst, |k, v| match k {
        "qwen35moe.attention.recurrent_layers" => None,
        "qwen35moe.expert_feed_forward_length" => Some(MetaValue::Array(
            MetaArray::new(ValueType::U32, vec![MetaValue::U32(64); 5]).unwrap(),
        )),
        _ => Some(v),
    });
    let m = les::model::Model::open(&dst).unwrap();
    assert!(m.is_linear_layer(0) && !m.is_linear_layer(1) && m.is_linear_layer(2));
    let (t, l) = greedy_logits(&dst, "kinds_interval", &[]);
    assert_eq!(t, want_tokens);
    assert!(l == want, "logits differ");
    // An explicit pattern is obeyed: as all-attention, layer 0 lacks its query.
    let dst2 = tmp("qwen35_all_attention.gguf");
    rewrite(&src, &dst2, |k, v| match k {
        "qwen35moe.attention.recurrent_layers" => Some(MetaValue::Array(
            MetaArray::new(ValueType::Bool, vec![MetaValue::Bool(false); 5]).unwrap(),
        )),
        _ => Some(v),
    });
    let err = les::model::Model::open(&dst2).unwrap_err().to_string();
    assert!(err.contains("blk.0.attn_q.weight"), "{err}");
    // Unequal per-layer expert sizes are refused with a clear message.
    let dst3 = tmp("qwen35_uneven_ff.gguf");
    rewrite(&src, &dst3, |k, v| match k {
        "qwen35moe.expert_feed_forward_length" => Some(MetaValue::Array(
            MetaArray::new(
                ValueType::U32,
                vec![
                    MetaValue::U32(64),
                    MetaValue::U32(32),
                    MetaValue::U32(64),
                    MetaValue::U32(64),
                    MetaValue::U32(64),
                ],
            )
            .unwrap(),
        )),
        _ => Some(v),
    });
    let err = les::model::Model::open(&dst3).unwrap_err().to_string();
    assert!(err.contains("expert_feed_forward_length"), "{err}");
}
