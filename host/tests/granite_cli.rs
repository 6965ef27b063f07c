//! `les` on synthetic granite and granitemoe models (IBM Granite 3.x, dense
//! and MoE): the file carries llama.cpp's keys and tensors, the loader reads
//! Granite's multipliers as llama.cpp does and refuses what it cannot run, a
//! packed copy streams with the resident logits, and, with
//! llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's.

mod cli;
mod common;

use std::path::{Path, PathBuf};

use cli::{
    assert_close_to_llama_cpp, assert_equals_llama_cpp, streams_exactly, tiny, tmp, F32_WEIGHTS,
};
use les::gguf::{Gguf, MetaValue};
use les::model::Model;
use les_core::model::config::Scales;
use les_core::router::Gating;

fn model(arch: &str, name: &str, extra: &[&str]) -> PathBuf {
    tiny(arch, name, extra)
}

#[test]
fn synth_writes_llama_cpp_names_and_keys() {
    for arch in ["granite", "granitemoe"] {
        let m = model(arch, "q", &[]);
        let g = Gguf::open(&m).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), arch);
        assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "refact");
        for (key, want) in [
            ("embedding_scale", 12.0),
            ("residual_scale", 0.22),
            ("attention.scale", 0.015625),
            ("logit_scale", 6.0),
        ] {
            assert_eq!(g.get_f32(&format!("{arch}.{key}")).unwrap(), want, "{key}");
        }
        let moe = arch == "granitemoe";
        assert_eq!(g.tensor("blk.0.ffn_gate_inp.weight").is_some(), moe);
        assert_eq!(g.tensor("blk.0.ffn_up_shexp.weight").is_some(), moe);
        assert!(g.tensor("blk.0.ffn_gate_inp_shexp.weight").is_none());
        assert!(g.tensor("blk.0.attn_q_norm.weight").is_none());
        drop(g);
        let model = Model::open(&m).unwrap();
        assert_eq!(
            model.hp.scales,
            Scales {
                embedding: 12.0,
                residual: 0.22,
                attention: Some(0.015625),
                logit: 6.0
            }
        );
        match model.hp.moe {
            Some(m) => {
                assert!(moe);
                assert_eq!((m.gating, m.normalize), (Gating::Softmax, true));
                assert!(m.n_ff_shared.is_some());
            }
            None => assert!(!moe),
        }
        let err = les::mcu::write_index(&model).unwrap_err().to_string();
        assert!(err.contains("Granite"), "{err}");
    }
}

/// A copy of `src` with `edit` applied to its metadata.
fn edited(src: &Path, name: &str, edit: impl Fn(&str, MetaValue) -> Option<MetaValue>) -> PathBuf {
    let dst = tmp(name);
    common::rewrite_gguf(src, &dst, edit, vec![]);
    dst
}

/// What llama.cpp's graph cannot run or reads otherwise is refused by name;
/// scales of 0 are none, as llama.cpp reads them.
#[test]
fn granite_keys_are_read_as_llama_cpp_reads_them() {
    let src = model("granitemoe", "q", &[]);
    let open_err = |p: PathBuf| Model::open(&p).unwrap_err().to_string();
    let no_logit = edited(&src, "granite_no_logit.gguf", |k, v| {
        (k != "granitemoe.logit_scale").then_some(v)
    });
    assert!(open_err(no_logit).contains("logit_scale"));
    let zero = edited(&src, "granite_zero.gguf", |k, v| match k {
        "granitemoe.residual_scale" | "granitemoe.attention.scale" => Some(MetaValue::F32(0.0)),
        _ => Some(v),
    });
    let m = Model::open(&zero).unwrap();
    assert_eq!((m.hp.scales.residual, m.hp.scales.attention), (1.0, None));
    let negative = edited(&src, "granite_negative.gguf", |k, v| match k {
        "granitemoe.embedding_scale" => Some(MetaValue::F32(-1.0)),
        _ => Some(v),
    });
    assert!(open_err(negative).contains("embedding_scale"));
    let with = |name: &str, key: &str, value: MetaValue| {
        let dst = tmp(name);
        common::rewrite_gguf(&src, &dst, |_, v| Some(v), vec![(key, value)]);
        dst
    };
    let finetuned = "granitemoe.rope.scaling.finetuned";
    let no_rope = with("granite_no_rope.gguf", finetuned, MetaValue::Bool(false));
    assert!(open_err(no_rope).contains("without RoPE"));
    let deepstack = "granitemoe.deepstack_mapping";
    let deepstack = with("granite_deepstack.gguf", deepstack, MetaValue::I32(0));
    assert!(open_err(deepstack).contains("deepstack"));
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let (_, want_tokens) = streams_exactly(&model("granitemoe", "q", &[]), "granitemoe_q");
    assert!(!want_tokens.is_empty());
}

/// Against llama.cpp through llama-cpp-python: with f32 weights the same
/// prompt and greedy tokens and log-probabilities within rounding; with the
/// preset's quantized weights, close log-probabilities.
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    for arch in ["granite", "granitemoe"] {
        let tag = format!("{arch}_f32");
        assert_equals_llama_cpp(&model(arch, "f32", &F32_WEIGHTS), &tag, 1e-4, 1.0);
        assert_close_to_llama_cpp(&model(arch, "q", &[]), &format!("{arch}_q"));
    }
}
