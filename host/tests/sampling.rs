//! `Sampler`: greedy, reproducibility, the filters, the distribution, robustness.

use les::sampling::{Mirostat, Penalties, Sampler, SamplerConfig};
use proptest::prelude::*;

fn random(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: None,
        penalties: None,
        seed,
        ..SamplerConfig::default()
    }
}

fn logits(n: usize, seed: u64) -> Vec<f32> {
    let mut st = seed;
    (0..n)
        .map(|_| {
            st = st
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((st >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn sampling_greedy_picks_argmax_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplerConfig::greedy());
    assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9]), 1);
    assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0]), 1);
    assert_eq!(s.sample(&[-0.0, 0.0]), 0);
    for seed in 0..20 {
        let l = logits(1000, seed);
        assert_eq!(s.sample(&l), argmax(&l));
    }
    // Negative temperature is greedy too.
    let mut s = Sampler::new(SamplerConfig {
        temperature: -1.0,
        ..SamplerConfig::default()
    });
    let l = logits(500, 3);
    assert_eq!(s.sample(&l), argmax(&l));
}

#[test]
fn sampling_same_seed_same_sequence_different_seed_differs() {
    let run = |seed| {
        let mut s = Sampler::new(random(seed));
        (0..200)
            .map(|i| s.sample(&logits(64, i)))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
    assert_ne!(run(0), run(1));
}

#[test]
fn sampling_reset_replays_the_sequence() {
    let mut s = Sampler::new(SamplerConfig {
        seed: 9,
        ..SamplerConfig::default()
    });
    let l = logits(100, 1);
    let a: Vec<u32> = (0..50).map(|_| s.sample(&l)).collect();
    s.reset();
    let b: Vec<u32> = (0..50).map(|_| s.sample(&l)).collect();
    assert_eq!(a, b);
}

/// Pins the draws: a change here changes every seeded run on every platform.
#[test]
fn sampling_seeded_sequence_is_pinned() {
    let mut s = Sampler::new(random(1234));
    let l = [0.5, 1.5, -0.5, 1.0, 0.0, 2.0, -1.0, 0.25];
    let got: Vec<u32> = (0..16).map(|_| s.sample(&l)).collect();
    assert_eq!(got, PINNED);
}

const PINNED: [u32; 16] = [5, 7, 3, 7, 5, 7, 1, 5, 1, 3, 1, 5, 5, 3, 5, 7];

#[test]
fn sampling_top_k_1_and_tiny_top_p_are_greedy() {
    for seed in 0..50 {
        let l = logits(300, seed);
        let mut k1 = Sampler::new(SamplerConfig {
            top_k: 1,
            ..random(seed)
        });
        let mut p0 = Sampler::new(SamplerConfig {
            top_p: 1e-6,
            ..random(seed)
        });
        let mut pz = Sampler::new(SamplerConfig {
            top_p: 0.0,
            temperature: 5.0,
            ..random(seed)
        });
        for _ in 0..5 {
            assert_eq!(k1.sample(&l), argmax(&l));
            assert_eq!(p0.sample(&l), argmax(&l));
            assert_eq!(pz.sample(&l), argmax(&l));
        }
    }
    // Ties: the lowest id, as greedy.
    let mut k1 = Sampler::new(SamplerConfig {
        top_k: 1,
        ..random(0)
    });
    assert_eq!(k1.sample(&[1.0, 2.0, 2.0]), 1);
}

#[test]
fn sampling_filters_keep_only_their_sets() {
    let l = [3.0, 2.0, 1.0, 0.0, -1.0, -2.0];
    // Top-k 2: only ids 0 and 1, both seen.
    let mut s = Sampler::new(SamplerConfig {
        top_k: 2,
        temperature: 100.0,
        ..random(1)
    });
    let mut seen = [0usize; 6];
    for _ in 0..2000 {
        seen[s.sample(&l) as usize] += 1;
    }
    assert!(
        seen[0] > 0 && seen[1] > 0 && seen[2..].iter().all(|&c| c == 0),
        "{seen:?}"
    );
    // Min-p 0.3: p_i >= 0.3 p_max <=> l_i >= 3 + ln 0.3 = 1.796: ids 0 and 1.
    let mut s = Sampler::new(SamplerConfig {
        min_p: Some(0.3),
        temperature: 100.0,
        ..random(2)
    });
    let mut seen = [0usize; 6];
    for _ in 0..2000 {
        seen[s.sample(&l) as usize] += 1;
    }
    assert!(
        seen[0] > 0 && seen[1] > 0 && seen[2..].iter().all(|&c| c == 0),
        "{seen:?}"
    );
    // Top-p 0.9 at temperature 1: softmax(l) = .634 .233 .086 ...; the prefix
    // reaching 0.9 is ids 0..=2.
    let mut s = Sampler::new(SamplerConfig {
        top_p: 0.9,
        temperature: 100.0,
        ..random(3)
    });
    let mut seen = [0usize; 6];
    for _ in 0..3000 {
        seen[s.sample(&l) as usize] += 1;
    }
    assert!(
        seen[..3].iter().all(|&c| c > 0) && seen[3..].iter().all(|&c| c == 0),
        "{seen:?}"
    );
}

fn check_distribution(l: &[f32], temperature: f32, draws: usize) {
    let mut s = Sampler::new(SamplerConfig {
        temperature,
        ..random(2024)
    });
    let mut counts = vec![0usize; l.len()];
    for _ in 0..draws {
        counts[s.sample(l) as usize] += 1;
    }
    let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = l
        .iter()
        .map(|&v| ((v as f64 - max) / temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    for (i, (&c, &wi)) in counts.iter().zip(&w).enumerate() {
        let p = wi / total;
        let freq = c as f64 / draws as f64;
        // 5 standard deviations of a binomial frequency.
        let tol = 5.0 * (p * (1.0 - p) / draws as f64).sqrt() + 1e-9;
        assert!(
            (freq - p).abs() <= tol,
            "token {i}: frequency {freq}, softmax {p}, tolerance {tol}"
        );
    }
}

#[test]
fn sampling_distribution_matches_softmax() {
    check_distribution(&[1.0, 2.0, 0.5, -1.0], 1.0, 20_000);
    check_distribution(&[1.0, 2.0, 0.5, -1.0], 0.5, 20_000);
    check_distribution(&[0.0, 0.0, 0.0, 0.0], 1.0, 20_000);
    check_distribution(&[0.5, 1.5, -0.5, 1.0, 0.0, 2.0, -1.0, 0.25], 1.0, 40_000);
}

#[test]
fn sampling_repeat_penalty_discourages_recent_tokens() {
    let cfg = SamplerConfig {
        penalties: Some(Penalties::repeat(1.5, 2)),
        ..SamplerConfig::greedy()
    };
    let mut s = Sampler::new(cfg);
    let l = [2.0, 1.9, 1.8, -3.0];
    // 0 wins, then is penalized (2 / 1.5 = 1.33): 1, then 2, then 0 again (its
    // penalty expired after two more tokens).
    assert_eq!(s.sample(&l), 0);
    assert_eq!(s.sample(&l), 1);
    assert_eq!(s.sample(&l), 2);
    assert_eq!(s.sample(&l), 0);
    // Negative logits are multiplied: -0.5 * 1.5 = -0.75 < -0.6.
    let mut s = Sampler::new(cfg);
    s.accept(0);
    assert_eq!(s.sample(&[-0.5, -0.6]), 1);
    // Out-of-vocabulary history is ignored.
    let mut s = Sampler::new(cfg);
    s.accept(1_000_000);
    assert_eq!(s.sample(&[1.0, 0.0]), 0);
}

/// llama.cpp's frequency and presence penalties: the frequency penalty times
/// a token's count among the last `last_n`, plus the presence penalty, is
/// subtracted after the repeat penalty's division or multiplication.
#[test]
fn sampling_frequency_and_presence_penalties_subtract() {
    let pick = |repeat: f32, frequency: f32, presence: f32, logits: &[f32]| {
        let mut s = Sampler::new(SamplerConfig {
            penalties: Some(Penalties {
                repeat,
                frequency,
                presence,
                last_n: 8,
            }),
            ..SamplerConfig::greedy()
        });
        // Token 0 twice in the window, token 1 once.
        for t in [0, 1, 0] {
            s.accept(t);
        }
        s.sample(logits)
    };
    let l = [3.0, 2.0, 1.75];
    assert_eq!(pick(1.0, 0.0, 0.0, &l), 0);
    // Presence alone: 2.5, 1.5, 1.75.
    assert_eq!(pick(1.0, 0.0, 0.5, &l), 0);
    // Frequency alone: 3 - 2 * 0.75 = 1.5, 2 - 0.75 = 1.25, 1.75.
    assert_eq!(pick(1.0, 0.75, 0.0, &l), 2);
    // Both: 3 - 1 - 0.5 = 1.5, 2 - 0.5 - 0.5 = 1.0, 1.75.
    assert_eq!(pick(1.0, 0.5, 0.5, &l), 2);
    // After the repeat penalty: 3 / 1.5 - 0.25 = 1.75 against 1.7 untouched (- 0.35: 1.65).
    assert_eq!(pick(1.5, 0.0, 0.25, &[3.0, -5.0, 1.7]), 0);
    assert_eq!(pick(1.5, 0.0, 0.35, &[3.0, -5.0, 1.7]), 2);
    // A negative logit is multiplied first: -1 * 2 - 0.5 = -2.5 < -2.4.
    assert_eq!(pick(2.0, 0.0, 0.5, &[-1.0, -9.0, -2.4]), 2);
    // Negative penalties favour the window's tokens.
    assert_eq!(pick(1.0, 0.0, -2.0, &[1.0, 0.5, 2.0]), 0);
    // A window of 0 turns them all off.
    let mut s = Sampler::new(SamplerConfig {
        penalties: Some(Penalties {
            repeat: 1.0,
            frequency: 5.0,
            presence: 5.0,
            last_n: 0,
        }),
        ..SamplerConfig::greedy()
    });
    s.accept(0);
    assert_eq!(s.sample(&l), 0);
}

#[test]
fn sampling_non_finite_logits() {
    let inf = f32::INFINITY;
    let nan = f32::NAN;
    for cfg in [SamplerConfig::greedy(), random(5), SamplerConfig::default()] {
        let mut s = Sampler::new(cfg);
        // All -inf or NaN: token 0.
        assert_eq!(s.sample(&[-inf, -inf, -inf]), 0);
        assert_eq!(s.sample(&[nan, nan]), 0);
        assert_eq!(s.sample(&[]), 0);
        // NaN never wins; +inf always does.
        assert_eq!(s.sample(&[nan, -inf, 1.0, nan]), 2);
        let t = s.sample(&[1.0, inf, 3.0, inf]);
        assert!(t == 1 || t == 3, "{t}");
        assert_eq!(s.sample(&[-inf, 5.0]), 1);
    }
    // Tokens at +inf share the mass equally.
    let mut s = Sampler::new(random(8));
    let mut c = [0usize; 3];
    for _ in 0..4000 {
        c[s.sample(&[inf, 0.0, inf]) as usize] += 1;
    }
    assert_eq!(c[1], 0);
    assert!(c[0].abs_diff(c[2]) < 400, "{c:?}");
    // Extreme temperatures.
    for t in [1e-30, 1e30, f32::MAX, f32::MIN_POSITIVE, inf] {
        let mut s = Sampler::new(SamplerConfig {
            temperature: t,
            ..random(1)
        });
        let id = s.sample(&[f32::MAX, -f32::MAX, 0.0]);
        assert!(id < 3);
    }
}

fn any_logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -50.0f32..50.0,
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::MAX),
        1 => Just(-f32::MAX),
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
    ]
}

fn any_param() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -2.0f32..3.0,
        1 => Just(0.0f32),
        1 => Just(1.0f32),
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
    ]
}

proptest! {
    #[test]
    fn sampling_never_panics_and_stays_in_range(
        l in prop::collection::vec(any_logit(), 0..40),
        temperature in any_param(),
        top_k in 0usize..50,
        top_p in any_param(),
        min_p in prop::option::of(any_param()),
        penalty in prop::option::of((any_param(), 0usize..8)),
        history in prop::collection::vec(0u32..60, 0..10),
        seed in any::<u64>(),
        (typical_p, top_n_sigma, xtc_probability, xtc_threshold) in
            (any_param(), any_param(), any_param(), any_param()),
        mirostat in prop::option::of((any::<bool>(), any_param(), any_param())),
    ) {
        let mut s = Sampler::new(SamplerConfig {
            temperature,
            top_k,
            top_p,
            min_p,
            typical_p,
            top_n_sigma,
            xtc_probability,
            xtc_threshold,
            penalties: penalty.map(|(penalty, last_n)| Penalties::repeat(penalty, last_n)),
            mirostat: mirostat.map(|(v2, tau, eta)| Mirostat { v2, tau, eta }),
            seed,
        });
        for t in history {
            s.accept(t);
        }
        for _ in 0..3 {
            let id = s.sample(&l);
            prop_assert!((id as usize) < l.len().max(1));
            // A finite-or-+inf logit exists => the pick is not -inf or NaN.
            if l.iter().any(|v| *v > f32::NEG_INFINITY) {
                let v = l[id as usize];
                prop_assert!(v > f32::NEG_INFINITY, "picked {} = {}", id, v);
            }
        }
    }
}

#[test]
fn sampling_banned_tokens_are_never_picked() {
    let l = logits(64, 5);
    let top = argmax(&l);
    let mut greedy = Sampler::new(SamplerConfig::greedy());
    greedy.ban([top, 1000]);
    let second = {
        let mut m = l.clone();
        m[top as usize] = f32::NEG_INFINITY;
        argmax(&m)
    };
    assert_eq!(greedy.sample(&l), second);
    greedy.reset();
    assert_eq!(greedy.sample(&l), second, "reset keeps the bans");

    // Sampled: the banned half never comes up, the other half does.
    let mut s = Sampler::new(random(9));
    s.ban((0..64).filter(|t| t % 2 == 0));
    let flat = vec![0.0f32; 64];
    let picks: Vec<u32> = (0..500).map(|_| s.sample(&flat)).collect();
    assert!(picks.iter().all(|t| t % 2 == 1), "{picks:?}");
    assert!(picks.iter().collect::<std::collections::HashSet<_>>().len() > 16);

    // Every token banned: token 0, as for all logits -inf.
    let mut all = Sampler::new(random(1));
    all.ban(0..4);
    assert_eq!(all.sample(&[1.0, 2.0, 3.0, 4.0]), 0);
}
