//! `Sampler::sample` over a vocabulary's logits: llama.cpp's default chain
//! (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8), the same with a repeat
//! penalty over 64 tokens, and greedy; for Qwen3's vocabulary (151936) and
//! MiniCPM-V 4.7's (248320). A decode samples once a token, on the critical
//! path: no read for the next token can start before it.
//!
//! `cargo bench -p les --bench sampling`. To compare builds, run it on each,
//! alternated: the machines are noisy.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use les::sampling::{Penalties, Sampler, SamplerConfig};

/// Logits as a random-weight model's output layer gives them: uniform in
/// [-3, 3), deterministic.
fn logits(n: usize) -> Vec<f32> {
    let mut st = 0x5eed_u64;
    (0..n)
        .map(|_| {
            st = st
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((st >> 40) as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
        })
        .collect()
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let penalized = SamplerConfig {
        penalties: Some(Penalties::repeat(1.1, 64)),
        ..SamplerConfig::default()
    };
    let configs = [
        ("default chain", SamplerConfig::default()),
        ("repeat penalty", penalized),
        ("greedy", SamplerConfig::greedy()),
    ];
    for n_vocab in [151_936, 248_320] {
        let l = logits(n_vocab);
        let mut g = c.benchmark_group(format!("sample {n_vocab}"));
        g.throughput(Throughput::Elements(n_vocab as u64));
        for (name, config) in configs {
            let mut s = Sampler::new(config);
            // A history for the penalty: tokens spread over the vocabulary.
            for t in 0..64u32 {
                s.accept(t.wrapping_mul(2_654_435_761) % n_vocab as u32);
            }
            g.bench_function(name, |b| b.iter(|| black_box(s.sample(black_box(&l)))));
        }
        g.finish();
    }
    c.final_summary();
}
