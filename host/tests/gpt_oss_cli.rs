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
    greedy, greedy_json, greedy_logits, kld_with, les, llama_greedy, llama_kld_base, pack,
    stdout_ok, synth_once, tmp, tokens, F32_WEIGHTS,
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
        Some(les_core::quant::GgmlType::MXFP4)
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
    // window of 16) are llama.cpp's within rounding, with every position of
    // the windowed layers kept and in rings of 16 + 8 - 1 (batches of 8).
    let m = model("f32", &F32_WEIGHTS);
    let base = tmp("gpt_oss_f32.kld");
    llama_kld_base(&m, &base);
    for extra in [&[][..], &["--batch-size", "8"]] {
        let kld = kld_with(&m, &base, extra);
        assert!(kld["max"].as_f64().unwrap() < 1e-4, "{extra:?}: {kld}");
        assert_eq!(kld["same_top"], 1.0, "{extra:?}: {kld}");
    }
}

/// A prompt and continuation several windows (16 positions in `tiny`) long.
const LONG: &str = "The quick brown fox jumps over the lazy dog, and the dog, who \
                    was not lazy at all, ran after the fox through the field and \
                    over the hill until both of them were tired and slept.";

/// `les run --json` of [`LONG`] with `extra`: its JSON and logits.
fn long_run(m: &std::path::Path, name: &str, extra: &[&str]) -> (serde_json::Value, Vec<u8>) {
    let logits = tmp(&format!("gpt_oss_long_{name}.npy"));
    let out = les()
        .args(["run", "-m"])
        .arg(m)
        .args([
            "-p", LONG, "-n", "64", "--temp", "0", "--json", "--ctx", "160",
        ])
        .args(["--logits-out", logits.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&stdout_ok(out, name)).unwrap();
    (v, cli::npy(&logits).2)
}

/// The sliding-window layers kept in rings of the window plus a pass (the
/// default, llama.cpp's SWA cache) decode as with every position kept
/// (`--swa-full`): the same tokens and logits, bit for bit, over a prompt
/// and continuation many windows long, in prompt batches of several sizes
/// and with drafts verified and rejected; the rings take less memory.
#[test]
fn sliding_window_rings_change_nothing_but_memory() {
    let m = model("mxfp4", &["--expert-type", "mxfp4"]);
    let (full, full_logits) = long_run(&m, "full", &["--swa-full"]);
    let full_bytes = full["stats"]["kv_cache"]["bytes"].as_u64().unwrap();
    assert!(full["stats"]["kv_cache"]["swa_ring_positions"].is_null());
    assert!(full["prompt_tokens"].as_array().unwrap().len() > 2 * 16);
    for (name, extra, span) in [
        ("b1", &["--batch-size", "1"][..], 16),
        ("b5", &["--batch-size", "5"], 20),
        ("b256", &[], 16 + 159),
        (
            "ngram",
            &[
                "--batch-size",
                "3",
                "--speculate",
                "ngram",
                "--draft-fixed",
                "--draft-max",
                "4",
            ],
            16 + 4,
        ),
    ] {
        let (v, logits) = long_run(&m, name, extra);
        assert_eq!(tokens(&v), tokens(&full), "{name}");
        assert!(logits == full_logits, "{name}: logits differ");
        let kv = &v["stats"]["kv_cache"];
        // With a batch of the whole context, a ring would outgrow it.
        if name == "b256" {
            assert!(kv["swa_ring_positions"].is_null(), "{kv}");
            assert_eq!(kv["bytes"].as_u64().unwrap(), full_bytes);
            continue;
        }
        assert_eq!(kv["swa_ring_positions"], span, "{name}");
        assert!(
            kv["bytes"].as_u64().unwrap() < full_bytes * 3 / 4,
            "{name}: {kv}"
        );
        if name == "ngram" {
            let (drafted, accepted) = (
                v["stats"]["drafted"].as_u64(),
                v["stats"]["accepted"].as_u64(),
            );
            assert!(
                drafted > accepted,
                "rejected drafts: {drafted:?} {accepted:?}"
            );
        }
    }
}

/// A session's rings against a session keeping every position, through the
/// engine's API: one position at a time while the rings turn over, rings
/// grown in the middle of a sequence (a larger batch), batches, going back
/// (as far as a pass, and no further), and a saved state restored, cut back
/// as far as it can be; the logits bit for bit the same throughout.
#[test]
fn session_rings_grow_rewind_and_restore_like_full_caches() {
    use les::compute::ThreadedMatVec;
    use les::engine::{KvTypes, Session, SwaCache};
    use les::flash::FileDeviceConfig;
    use les::model::Model;
    use les::supply::{Schedule, SlotBudget, Supply};
    use les_core::gemv::Isa;
    use les_core::model::forward::TokenInput;

    let path = model("mxfp4", &["--expert-type", "mxfp4"]);
    let model = Model::open(&path).unwrap();
    let window = model.kv_window.unwrap().window;
    let supply = || {
        Supply::new(
            &model,
            &path,
            Schedule::Resident,
            SlotBudget::none(FileDeviceConfig::default()),
        )
        .unwrap()
    };
    let (mut ring_x, mut full_x) = (supply(), supply());
    let mut mv = ThreadedMatVec::new(1, Isa::detect());
    let n_vocab = model.hp.n_vocab;
    let ids: Vec<u32> = (0..120u32)
        .map(|i| (i * 7919 + 13) % n_vocab as u32)
        .collect();
    let input = |r: std::ops::Range<usize>| -> Vec<TokenInput<'static>> {
        ids[r].iter().map(|&t| TokenInput::Token(t)).collect()
    };
    let kv = KvTypes::default();
    let mut ring = Session::with_kv(&model, 120, kv, SwaCache::Window).unwrap();
    let mut full = Session::with_kv(&model, 120, kv, SwaCache::Full).unwrap();
    let full_bytes = full.kv_bytes();
    assert_eq!(ring.kv_ring().unwrap().span, window);
    assert!(ring.kv_bytes() < full_bytes * 3 / 4);

    // Both sessions through the same steps, the logits compared.
    let mut same = |ring: &mut Session<'_>, full: &mut Session<'_>, r: std::ops::Range<usize>| {
        let (mut a, mut b) = (vec![0f32; n_vocab], vec![0f32; n_vocab]);
        if r.len() == 1 {
            let t = input(r.clone())[0];
            ring.eval(&mut mv, &mut ring_x, None, t, &mut a).unwrap();
            full.eval(&mut mv, &mut full_x, None, t, &mut b).unwrap();
        } else {
            ring.eval_batch(&mut mv, &mut ring_x, &input(r.clone()), &mut a)
                .unwrap();
            full.eval_batch(&mut mv, &mut full_x, &input(r.clone()), &mut b)
                .unwrap();
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "positions {r:?}");
    };
    for p in 0..2 * window + 3 {
        same(&mut ring, &mut full, p..p + 1);
    }
    // Batches of 6: the rings grow, keeping what they hold.
    let mut pos = ring.position();
    assert_eq!(ring.set_prefill_batch(6).unwrap(), 6);
    full.set_prefill_batch(6).unwrap();
    assert_eq!(ring.kv_ring().unwrap().span, window + 5);
    for _ in 0..5 {
        same(&mut ring, &mut full, pos..pos + 6);
        pos += 6;
    }
    // Back by a pass (positions overwritten with other tokens), not further.
    assert!(ring.rewind(pos - 7).is_err());
    assert_eq!(ring.position(), pos);
    ring.rewind(pos - 6).unwrap();
    full.rewind(pos - 6).unwrap();
    pos -= 6;
    same(&mut ring, &mut full, pos + 40..pos + 41);
    pos += 1;
    same(&mut ring, &mut full, pos..pos + 4);
    pos += 4;

    // Saved: the rings' state holds the last window of the windowed layers.
    let (mut saved_ring, mut saved_full) = (Vec::new(), Vec::new());
    ring.write_state(&mut saved_ring).unwrap();
    full.write_state(&mut saved_full).unwrap();
    assert!(ring.saves_windows() && !full.saves_windows());
    assert_eq!(saved_ring.len() as u64, ring.state_bytes(pos, true));
    assert_eq!(saved_full.len() as u64, full.state_bytes(pos, false));
    assert!(saved_ring.len() < saved_full.len());
    let mut fresh = Session::with_kv(&model, 120, kv, SwaCache::Window).unwrap();
    let mut fresh_full = Session::with_kv(&model, 120, kv, SwaCache::Full).unwrap();
    // A ring state goes back a position, no further; a full one anywhere,
    // into rings or not.
    assert!(fresh.can_restore(pos, pos - 1, true).is_ok());
    let err = fresh.can_restore(pos, pos - 2, true).unwrap_err();
    assert!(err.contains("--swa-full"), "{err}");
    assert!(fresh
        .read_state(&mut &saved_ring[..], pos, pos - 2, true)
        .is_err());
    for (keep, state, windows) in [
        (pos, &saved_ring, true),
        (pos - 1, &saved_ring, true),
        (pos - 9, &saved_full, false),
        (window - 3, &saved_full, false),
    ] {
        fresh.rewind(0).unwrap();
        fresh_full.rewind(0).unwrap();
        fresh
            .read_state(&mut &state[..], pos, keep, windows)
            .unwrap();
        fresh_full
            .read_state(&mut &saved_full[..], pos, keep, false)
            .unwrap();
        assert_eq!(fresh.position(), keep);
        for p in keep..keep + 3 {
            same(&mut fresh, &mut fresh_full, p..p + 1);
        }
    }
}
