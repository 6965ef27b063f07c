//! `les` on synthetic LFM2 models (llama.cpp's `lfm2moe`, Liquid AI's
//! LFM2-8B-A1B, and the dense `lfm2`): gated short convolutions with an
//! attention layer in every four, dense leading layers, then routed experts
//! picked by sigmoid scores plus a selection bias. The file carries llama.cpp's
//! keys and tensors, the loader reads them as llama.cpp does and refuses what
//! it cannot run, a packed copy streams with the resident logits, and, with
//! llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's.

mod cli;
mod common;

use std::path::PathBuf;

use cli::{
    assert_biased_routing_equals_llama_cpp, assert_equals_llama_cpp, assert_selection_bias_matters,
    greedy_logits, i32_array, kld, streams_exactly, tiny, tmp, F32_WEIGHTS,
};
use les::gguf::{Gguf, MetaValue};
use les::model::Model;
use les_core::model::config::{AttnWindow, LinearShape};
use les_core::model::forward::{Mixer, Weights};
use les_core::router::Gating;

fn model(name: &str, extra: &[&str]) -> PathBuf {
    tiny("lfm2moe", name, extra)
}

/// A copy of the `q` model with `edit` applied to its metadata.
fn edited(name: &str, edit: impl Fn(&str, MetaValue) -> Option<MetaValue>) -> PathBuf {
    let dst = tmp(name);
    common::rewrite_gguf(&model("q", &[]), &dst, edit, vec![]);
    dst
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("q", &[]);
    let g = Gguf::open(&m).unwrap();
    let a = "lfm2moe";
    assert_eq!(g.get_str("general.architecture").unwrap(), a);
    assert_eq!(g.get_u64(&format!("{a}.shortconv.l_cache")).unwrap(), 3);
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "lfm2");
    assert!(g.tensor("token_embd_norm.weight").is_some());
    assert!(g.tensor("output_norm.weight").is_none());
    let kv: Vec<u64> = g
        .get_array(&format!("{a}.attention.head_count_kv"))
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(kv.len(), 4);
    for (l, n) in kv.iter().enumerate() {
        let conv = *n == 0;
        assert_eq!(
            g.tensor(&format!("blk.{l}.shortconv.in_proj.weight"))
                .is_some(),
            conv
        );
        assert_eq!(g.tensor(&format!("blk.{l}.attn_q.weight")).is_some(), !conv);
        // The first two layers are dense.
        assert_eq!(
            g.tensor(&format!("blk.{l}.ffn_gate_inp.weight")).is_some(),
            l >= 2
        );
        assert_eq!(
            g.tensor(&format!("blk.{l}.exp_probs_b.bias")).is_some(),
            l >= 2
        );
    }
    drop(g);
    let model = Model::open(&m).unwrap();
    let Some((n, LinearShape::ShortConv(shape))) = model.hybrid.linear else {
        panic!("no short convolutions: {:?}", model.hybrid);
    };
    assert_eq!(n, kv.iter().filter(|k| **k == 0).count());
    assert_eq!((shape.channels, shape.kernel), (model.hp.n_embd, 3));
    for (l, k) in kv.iter().enumerate() {
        assert_eq!(model.is_linear_layer(l), *k == 0, "layer {l}");
        match model.block(l).mixer {
            Mixer::ShortConv(w) => assert_eq!(w.shape, shape),
            Mixer::Attention(a) => assert!(a.q_norm.is_some() && a.k_norm.is_some()),
            _ => panic!("layer {l}"),
        }
        assert_eq!(model.is_moe_layer(l), l >= 2, "layer {l}");
    }
    let moe = model.hp.moe.unwrap();
    assert_eq!(
        (moe.gating, moe.normalize, moe.weights_scale),
        (Gating::Sigmoid, true, 1.0)
    );
    assert!(moe.n_ff_shared.is_none());
}

/// What llama.cpp reads otherwise or les cannot run is refused by name, and
/// what llama.cpp's graph fixes is fixed whatever the metadata says.
#[test]
fn lfm2moe_keys_are_read_as_llama_cpp_reads_them() {
    let open_err = |p: PathBuf| Model::open(&p).unwrap_err().to_string();
    let no_cache = edited("lfm2_no_lcache.gguf", |k, v| {
        (k != "lfm2moe.shortconv.l_cache").then_some(v)
    });
    assert!(open_err(no_cache).contains("shortconv.l_cache"));
    let narrow = edited("lfm2_lcache1.gguf", |k, v| match k {
        "lfm2moe.shortconv.l_cache" => Some(MetaValue::U32(1)),
        _ => Some(v),
    });
    assert!(open_err(narrow).contains("shortconv.l_cache = 1"));
    // The file's kernel holds 3 taps: a wider cache does not fit it.
    let wide = edited("lfm2_lcache4.gguf", |k, v| match k {
        "lfm2moe.shortconv.l_cache" => Some(MetaValue::U32(4)),
        _ => Some(v),
    });
    assert!(open_err(wide).contains("shortconv.conv.weight"));
    let short = edited("lfm2_short_kv.gguf", |k, v| match k {
        "lfm2moe.attention.head_count_kv" => Some(i32_array(&[0, 2])),
        _ => Some(v),
    });
    assert!(open_err(short).contains("lfm2moe.attention.head_count_kv"));
    // llama.cpp's lfm2moe renormalises and never scales, whatever the keys.
    let keys = edited("lfm2_keys.gguf", |k, v| match k {
        "lfm2moe.expert_weights_norm" => Some(MetaValue::Bool(false)),
        _ => Some(v),
    });
    let scaled = tmp("lfm2_scaled.gguf");
    common::rewrite_gguf(
        &keys,
        &scaled,
        |_, v| Some(v),
        vec![("lfm2moe.expert_weights_scale", MetaValue::F32(2.5))],
    );
    let moe = Model::open(&scaled).unwrap().hp.moe.unwrap();
    assert_eq!((moe.normalize, moe.weights_scale), (true, 1.0));
    let (_, want) = greedy_logits(&model("q", &[]), "lfm2_plain", &[]);
    let (_, got) = greedy_logits(&scaled, "lfm2_scaled", &[]);
    assert!(want == got, "ignored keys changed the logits");
}

/// `lfm2` with `attention.sliding_window` (LFM2.5's dense models): every
/// attention layer sees the last `window` positions; a window as long as
/// the run changes nothing, a shorter one changes the logits.
#[test]
fn lfm2_sliding_windows_apply_to_every_attention_layer() {
    let dense = tiny("lfm2", "dense", &[]);
    let (_, full) = greedy_logits(&dense, "lfm2_full", &[]);
    for (window, same) in [(4096, true), (4, false)] {
        let m = windowed(&dense, &format!("lfm2_swa{window}"), window);
        let model = Model::open(&m).unwrap();
        for l in (0..model.hp.n_layers).filter(|l| !model.is_linear_layer(*l)) {
            let Mixer::Attention(a) = model.block(l).mixer else {
                panic!("layer {l}");
            };
            assert_eq!(
                a.window,
                Some(AttnWindow::Sliding(window as usize)),
                "layer {l}"
            );
        }
        let (_, logits) = greedy_logits(&m, &format!("lfm2_swa{window}"), &[]);
        assert_eq!(logits == full, same, "window {window}");
    }
}

/// A copy of `src` with `lfm2.attention.sliding_window = window`.
fn windowed(src: &std::path::Path, name: &str, window: u32) -> PathBuf {
    let dst = tmp(&format!("{name}.gguf"));
    common::rewrite_gguf(
        src,
        &dst,
        |_, v| Some(v),
        vec![("lfm2.attention.sliding_window", MetaValue::U32(window))],
    );
    dst
}

/// The selection bias picks the experts (and only picks them).
#[test]
fn selection_bias_matters() {
    assert_selection_bias_matters(&model("q", &[]), "lfm2moe", 2);
}

/// The dense `lfm2` runs: a SwiGLU FFN in every layer.
#[test]
fn dense_lfm2_runs() {
    let m = tiny("lfm2", "dense", &[]);
    let model = Model::open(&m).unwrap();
    assert!(model.hp.moe.is_none());
    assert!(matches!(
        model.hybrid.linear,
        Some((_, LinearShape::ShortConv(_)))
    ));
    let (tokens, _) = greedy_logits(&m, "lfm2_dense", &[]);
    assert!(!tokens.is_empty());
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("q", &[]), "lfm2moe_q");
    assert!(!want_tokens.is_empty());
}

/// Against llama.cpp through llama-cpp-python: with f32 weights the same
/// prompt and greedy tokens and log-probabilities within rounding (and far
/// apart once the selection biases are zeroed); with the preset's quantized
/// weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    let f32 = model("f32", &F32_WEIGHTS);
    assert_biased_routing_equals_llama_cpp(&f32, &model("q", &[]), "lfm2moe", 2);
    // The dense model's widest KL divergence measured 5.2e-6 (mean 4e-8):
    // f32 rounding of its wider FFN, the greedy tokens the same.
    let dense = tiny("lfm2", "dense_f32", &F32_WEIGHTS);
    assert_equals_llama_cpp(&dense, "lfm2_f32", 1e-5, 1.0);
    // A window shorter than the prompt and continuation (LFM2.5's kind).
    let swa = windowed(&dense, "lfm2_swa_f32", 6);
    assert_equals_llama_cpp(&swa, "lfm2_swa_f32", 1e-5, 1.0);
    // ... which llama.cpp applied: the unwindowed model is far from it.
    let apart = kld(&dense, &tmp("lfm2_swa_f32.kld"));
    assert!(apart["max"].as_f64().unwrap() > 1e-3, "{apart}");
}
