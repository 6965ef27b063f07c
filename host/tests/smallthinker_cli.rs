//! `les` on synthetic smallthinker models (PowerInfer's SmallThinker: every
//! layer's router reads the layer's input before its attention, sigmoid
//! scores renormalised, `relu(gate) * up` experts, no Q/K norms; with a
//! sliding window key, windows on three layers of four and no RoPE on the
//! fourth): the file carries llama.cpp's keys and tensors, the loader reads
//! them as llama.cpp does (its quirks included), a packed copy streams with
//! the resident logits, and, with llama-cpp-python at hand, les's tokens and
//! log-probabilities are llama.cpp's.

mod cli;

use std::path::{Path, PathBuf};

use cli::{greedy, greedy_logits, streams_exactly, synth_once, F32_WEIGHTS};
use les::gguf::{Gguf, MetaValue};
use les_core::model::config::ExpertAct;
use les_core::router::Gating;

/// A synthetic smallthinker written once per test binary: `tiny` with
/// `layers` layers (`extra` args).
fn model(name: &str, layers: usize, extra: &[&str]) -> PathBuf {
    let layers = layers.to_string();
    let args = [
        "--arch",
        "smallthinker",
        "--preset",
        "tiny",
        "--seed",
        "5",
        "--layers",
        &layers,
    ];
    synth_once(
        &format!("smallthinker_{name}.gguf"),
        &[&args[..], extra].concat(),
    )
}

/// Six layers: the first and the fifth without RoPE (in a model of four,
/// llama.cpp rotates every layer).
fn six(name: &str, extra: &[&str]) -> PathBuf {
    model(name, 6, extra)
}

/// A copy of `src` (named after `tag`) whose metadata `edit` changed.
fn with_metadata(src: &Path, tag: &str, edit: impl Fn(&mut Vec<(String, MetaValue)>)) -> PathBuf {
    cli::with_metadata(src, &format!("smallthinker_{tag}.gguf"), edit)
}

/// `src` without the key `key`.
fn without(src: &Path, tag: &str, key: &'static str) -> PathBuf {
    with_metadata(src, tag, |m| m.retain(|(k, _)| k != key))
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = six("q", &[]);
    let g = Gguf::open(&m).unwrap();
    assert_eq!(g.get_str("general.architecture").unwrap(), "smallthinker");
    assert_eq!(g.get_u32("smallthinker.expert_gating_func").unwrap(), 2);
    assert_eq!(
        g.get_u32("smallthinker.attention.sliding_window").unwrap(),
        4096
    );
    let ff = g
        .get_u32("smallthinker.expert_feed_forward_length")
        .unwrap();
    assert_eq!(g.get_u32("smallthinker.feed_forward_length").unwrap(), ff);
    for name in ["blk.0.ffn_gate_inp.weight", "blk.5.ffn_down_exps.weight"] {
        assert!(g.tensor(name).is_some(), "{name}");
    }
    assert!(g.tensor("blk.0.attn_q_norm.weight").is_none());
    assert!(g.tensor("blk.0.ffn_gate_shexp.weight").is_none());
    drop(g);
    let model = les::model::Model::open(&m).unwrap();
    assert!((0..6).all(|l| model.is_moe_layer(l)));
    assert_eq!(model.hp.rope_style, les_core::model::ops::RopeStyle::Neox);
    let moe = model.hp.moe.unwrap();
    assert_eq!((moe.gating, moe.normalize), (Gating::Sigmoid, true));
    assert_eq!((moe.act, moe.weights_scale), (ExpertAct::ReGlu, 1.0));
    assert!(moe.route_before_attention);
}

/// llama.cpp's graph has no default gating for smallthinker (it aborts):
/// without the key the model is refused, naming it.
#[test]
fn a_missing_gating_function_is_refused_by_name() {
    let m = without(
        &six("q", &[]),
        "nogating",
        "smallthinker.expert_gating_func",
    );
    let out = greedy(&m, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("smallthinker.expert_gating_func"), "{err}");
}

/// The sliding window key takes RoPE from every fourth layer (the windows
/// themselves, 4096 positions, are longer than these prompts): the logits
/// move without it; in a four-layer model, where llama.cpp's "every layer
/// rotates" test matches, they do not.
#[test]
fn the_window_key_takes_rope_from_every_fourth_layer() {
    let key = "smallthinker.attention.sliding_window";
    let (_, with) = greedy_logits(&six("q", &[]), "st6_window", &[]);
    let plain = without(&six("q", &[]), "st6_nowindow", key);
    let (_, without_key) = greedy_logits(&plain, "st6_nowindow", &[]);
    assert!(with != without_key, "the window key changed nothing");
    let four = model("four", 4, &[]);
    let (_, with) = greedy_logits(&four, "st4_window", &[]);
    let plain = without(&four, "st4_nowindow", key);
    let (_, without_key) = greedy_logits(&plain, "st4_nowindow", &[]);
    assert_eq!(with, without_key, "a four-layer model has no NoPE layer");
}

/// A RoPE base of the windowed layers' own (`rope.freq_base_swa`) is refused
/// rather than ignored; the model's own base is accepted.
#[test]
fn a_rope_base_of_the_windowed_layers_own_is_refused() {
    let m = six("q", &[]);
    let base = Gguf::open(&m)
        .unwrap()
        .get_f32("smallthinker.rope.freq_base")
        .unwrap();
    let add = |tag: &str, v: f32| {
        with_metadata(&m, tag, |meta| {
            meta.push(("smallthinker.rope.freq_base_swa".into(), MetaValue::F32(v)))
        })
    };
    let out = greedy(&add("swa_base", base / 10.0), &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rope.freq_base_swa"), "{err}");
    assert!(greedy(&add("same_base", base), &[]).status.success());
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size (the picks of each layer are known before its attention).
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&six("q", &[]), "smallthinker_q");
    assert_eq!(want_tokens.len(), 24);
}

/// Against llama.cpp through llama-cpp-python: with f32 weights the same
/// prompt and greedy tokens and log-probabilities within rounding, with the
/// window key (NoPE layers) and without; with the preset's quantized
/// weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    let f32 = six("f32", &F32_WEIGHTS);
    cli::assert_equals_llama_cpp(&f32, "smallthinker_f32", 1e-4, 1.0);
    let key = "smallthinker.attention.sliding_window";
    let plain = without(&f32, "f32_nowindow", key);
    cli::assert_equals_llama_cpp(&plain, "smallthinker_f32_nowindow", 1e-4, 1.0);
    cli::assert_close_to_llama_cpp(&six("q", &[]), "smallthinker_q");
}
