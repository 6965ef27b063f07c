//! `les` on synthetic granitehybrid models (IBM Granite 4.0-H: Mamba2 layers
//! and a few attention layers without RoPE, each followed by routed and
//! shared experts, Granite's multipliers): the file carries llama.cpp's keys
//! and tensors, the loader reads them as llama.cpp does and refuses what it
//! cannot run, a packed copy streams with the resident logits, and, with
//! llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's.

mod cli;
mod common;

use std::path::PathBuf;

use cli::{
    assert_close_to_llama_cpp, assert_equals_llama_cpp, greedy_logits, i32_array, streams_exactly,
    tiny, tmp, F32_WEIGHTS,
};
use les::gguf::{Gguf, MetaValue};
use les::model::Model;
use les_core::model::config::{LinearShape, Scales};
use les_core::model::forward::{Mixer, Weights};
use les_core::router::Gating;

fn model(name: &str, extra: &[&str]) -> PathBuf {
    tiny("granitehybrid", name, extra)
}

/// A copy of the `q` model with `edit` applied to its metadata and `extra`
/// keys added.
fn edited(
    name: &str,
    edit: impl Fn(&str, MetaValue) -> Option<MetaValue>,
    extra: Vec<(&str, MetaValue)>,
) -> PathBuf {
    let dst = tmp(name);
    common::rewrite_gguf(&model("q", &[]), &dst, edit, extra);
    dst
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    let m = model("q", &[]);
    let g = Gguf::open(&m).unwrap();
    let a = "granitehybrid";
    assert_eq!(g.get_str("general.architecture").unwrap(), a);
    assert!(!g.get_bool(&format!("{a}.rope.scaling.finetuned")).unwrap());
    let kv: Vec<u64> = g
        .get_array(&format!("{a}.attention.head_count_kv"))
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(kv.len(), 4);
    for (l, n) in kv.iter().enumerate() {
        let ssm = *n == 0;
        assert_eq!(g.tensor(&format!("blk.{l}.ssm_in.weight")).is_some(), ssm);
        assert_eq!(g.tensor(&format!("blk.{l}.attn_q.weight")).is_some(), !ssm);
        assert!(g.tensor(&format!("blk.{l}.ffn_up_shexp.weight")).is_some());
    }
    drop(g);
    let model = Model::open(&m).unwrap();
    let Some((n, LinearShape::Mamba2(shape))) = model.hybrid.linear else {
        panic!("no Mamba2 layers: {:?}", model.hybrid);
    };
    assert_eq!(n, kv.iter().filter(|k| **k == 0).count());
    assert_eq!(shape.d_inner, 2 * model.hp.n_embd);
    for (l, k) in kv.iter().enumerate() {
        assert_eq!(model.is_linear_layer(l), *k == 0, "layer {l}");
        match model.block(l).mixer {
            Mixer::Mamba2(w) => assert_eq!(w.shape, shape),
            // No RoPE on the attention layers, and nothing in its place.
            Mixer::Attention(a) => assert_eq!(a.nope.map(|t| t.at(1 << 20)), Some(1.0)),
            _ => panic!("layer {l}"),
        }
    }
    assert_eq!(
        model.hp.scales,
        Scales {
            embedding: 12.0,
            residual: 0.22,
            attention: Some(0.015625),
            logit: 6.0
        }
    );
    let moe = model.hp.moe.unwrap();
    assert_eq!((moe.gating, moe.normalize), (Gating::Softmax, true));
    assert!(moe.n_ff_shared.is_some());
    let err = les::mcu::write_index(&model).unwrap_err().to_string();
    assert!(err.contains("Granite"), "{err}");
}

/// A dense granitehybrid (Granite 4.0-H-1B's kind: `--experts 0`) has a
/// SwiGLU FFN in every layer and runs.
#[test]
fn dense_granitehybrid_runs() {
    let m = model("dense", &["--experts", "0"]);
    let g = Gguf::open(&m).unwrap();
    assert!(g.tensor("blk.0.ffn_gate.weight").is_some());
    assert!(g.tensor("blk.0.ffn_gate_inp.weight").is_none());
    drop(g);
    let model = Model::open(&m).unwrap();
    assert!(model.hp.moe.is_none());
    assert!(matches!(
        model.hybrid.linear,
        Some((_, LinearShape::Mamba2(_)))
    ));
    let (tokens, _) = greedy_logits(&m, "gh_dense", &[]);
    assert!(!tokens.is_empty());
}

/// What llama.cpp reads otherwise or les cannot run is refused by name; the
/// optional parts are optional, as in llama.cpp.
#[test]
fn granitehybrid_keys_are_read_as_llama_cpp_reads_them() {
    let open_err = |p: PathBuf| Model::open(&p).unwrap_err().to_string();
    let kv_key = "granitehybrid.attention.head_count_kv";
    let uneven = edited(
        "gh_uneven_kv.gguf",
        |k, v| match k {
            "granitehybrid.attention.head_count_kv" => Some(i32_array(&[0, 2, 0, 4])),
            _ => Some(v),
        },
        vec![],
    );
    assert!(open_err(uneven).contains("different KV head counts"));
    let short = edited(
        "gh_short_kv.gguf",
        |k, v| match k {
            "granitehybrid.attention.head_count_kv" => Some(i32_array(&[0, 2])),
            _ => Some(v),
        },
        vec![],
    );
    assert!(open_err(short).contains(kv_key));
    let no_state = edited(
        "gh_no_state.gguf",
        |k, v| (k != "granitehybrid.ssm.state_size").then_some(v),
        vec![],
    );
    assert!(open_err(no_state).contains("ssm.state_size"));
    let bad_groups = edited(
        "gh_bad_groups.gguf",
        |k, v| match k {
            "granitehybrid.ssm.group_count" => Some(MetaValue::U32(3)),
            _ => Some(v),
        },
        vec![],
    );
    assert!(open_err(bad_groups).contains("groups"));
    // The multipliers are optional here (Bamba has none), unlike granitemoe.
    let plain = edited(
        "gh_no_scales.gguf",
        |k, v| (!k.ends_with("_scale") && !k.ends_with("attention.scale")).then_some(v),
        vec![],
    );
    assert_eq!(Model::open(&plain).unwrap().hp.scales, Scales::NONE);
    // With `rope.scaling.finetuned` true (Bamba's), the attention rotates.
    let rope = edited(
        "gh_rope.gguf",
        |k, v| match k {
            "granitehybrid.rope.scaling.finetuned" => Some(MetaValue::Bool(true)),
            _ => Some(v),
        },
        vec![],
    );
    let m = Model::open(&rope).unwrap();
    let attn = (0..m.hp.n_layers).find(|l| !m.is_linear_layer(*l)).unwrap();
    let Mixer::Attention(a) = m.block(attn).mixer else {
        panic!("layer {attn}");
    };
    assert!(a.nope.is_none());
    let (_, with_rope) = greedy_logits(&rope, "gh_rope", &[]);
    let (_, without) = greedy_logits(&model("q", &[]), "gh_norope", &[]);
    assert!(with_rope != without, "RoPE changed nothing");
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("q", &[]), "granitehybrid_q");
    assert!(!want_tokens.is_empty());
}

/// Against llama.cpp through llama-cpp-python: with f32 weights the same
/// prompt and greedy tokens and log-probabilities within rounding; with the
/// preset's quantized weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    assert_equals_llama_cpp(&model("f32", &F32_WEIGHTS), "granitehybrid_f32", 5e-6, 1.0);
    let dense = [&F32_WEIGHTS[..], &["--experts", "0"]].concat();
    assert_equals_llama_cpp(
        &model("dense_f32", &dense),
        "granitehybrid_dense",
        5e-6,
        1.0,
    );
    assert_close_to_llama_cpp(&model("q", &[]), "granitehybrid_q");
}
