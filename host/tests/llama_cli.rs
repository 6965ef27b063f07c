//! `les` on synthetic llama models with Llama 3.1's RoPE frequency factors
//! (`rope_freqs.weight`, which llama.cpp's converter writes for its `llama3`
//! scaling and its llama loader applies to every layer's rotation): the
//! factors are read and change the logits, a packed copy streams with the
//! resident logits, the firmware index refuses them by name, and, with
//! llama-cpp-python at hand, les's tokens and log-probabilities are
//! llama.cpp's.

mod cli;

use std::path::PathBuf;

use cli::{assert_equals_llama_cpp, greedy_logits, kld, streams_exactly, tiny, tmp, F32_WEIGHTS};
use les::model::Model;
use les_core::model::forward::{Mixer, Weights};

/// A synthetic llama `tiny` with `rope_freqs.weight`, written once per test
/// binary (`extra` args).
fn llama3(name: &str, extra: &[&str]) -> PathBuf {
    tiny(
        "llama",
        &format!("rope_{name}"),
        &[&["--rope-freqs"][..], extra].concat(),
    )
}

/// The same model without the factors (same seed: the same other tensors).
fn plain(name: &str, extra: &[&str]) -> PathBuf {
    tiny("llama", &format!("plain_{name}"), extra)
}

#[test]
fn rope_frequency_factors_are_read_and_change_the_logits() {
    let m = llama3("q", &[]);
    let model = Model::open(&m).unwrap();
    let want = les::synth::llama3_rope_factors(model.hp.head_dim, model.hp.rope_base);
    assert!(want.contains(&1.0) && want.contains(&8.0), "{want:?}");
    for l in 0..model.hp.n_layers {
        let Mixer::Attention(a) = model.block(l).mixer else {
            panic!("layer {l}")
        };
        assert_eq!(a.rope_freqs, Some(&want[..]), "layer {l}");
    }
    let (_, with) = greedy_logits(&m, "rope_freqs", &[]);
    let (_, without) = greedy_logits(&plain("q", &[]), "no_rope_freqs", &[]);
    assert!(with != without, "the frequency factors changed nothing");
    let err = les::mcu::write_index(&model).unwrap_err().to_string();
    assert!(err.contains("RoPE frequency factors"), "{err}");
}

/// A packed copy gives the resident logits under every schedule, slot count
/// and batch size.
#[test]
fn packed_experts_stream_exactly() {
    let m = tiny("mixtral", "rope_freqs", &["--rope-freqs"]);
    let (_, want_tokens) = streams_exactly(&m, "llama3_moe");
    assert_eq!(want_tokens.len(), 24);
}

/// Against llama.cpp through llama-cpp-python, with f32 weights: the same
/// greedy tokens, log-probabilities within rounding, and far apart from the
/// same model without the factors (so the comparison sees them).
#[test]
#[ignore = "needs llama-cpp-python (pip install llama-cpp-python)"]
fn greedy_and_log_probabilities_equal_llama_cpp() {
    let m = llama3("f32", &F32_WEIGHTS);
    assert_equals_llama_cpp(&m, "llama3_f32", 1e-4, 1.0);
    let apart = kld(&plain("f32", &F32_WEIGHTS), &tmp("llama3_f32.kld"));
    assert!(apart["max"].as_f64().unwrap() > 1e-3, "{apart}");
}
