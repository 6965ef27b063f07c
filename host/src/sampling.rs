//! Token sampling: greedy, or llama.cpp's common chain with a reproducible draw.
//!
//! # What is followed
//!
//! The chain is the part of llama.cpp's default sampler sequence
//! (`common_params_sampling::samplers` in `common/common.h`: penalties, DRY,
//! top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature, then `dist`)
//! that LES supports, in the same order:
//!
//! 1. **repeat penalty** (off by default) over the last `last_n` accepted tokens,
//!    each distinct token once: a logit `<= 0` is multiplied by the penalty, a
//!    positive one divided (`llama_sampler_penalties_apply`);
//! 2. **top-k** (`top_k == 0`: off): keep the `k` highest logits;
//! 3. **top-p** (`top_p >= 1`: off): softmax of the remaining logits (at
//!    temperature 1, as llama.cpp: the temperature comes later), keep the shortest
//!    prefix, by descending logit, whose probability mass is `>= top_p`; at least
//!    one token;
//! 4. **min-p** (`None` or `<= 0`: off): keep the tokens with
//!    `logit >= max_logit + ln(min_p)`, i.e. `p >= min_p * p_max`;
//! 5. **temperature**: logits divided by `temperature`;
//! 6. **draw**: softmax of the rest, `u` uniform in `[0, 1)`, and the first token
//!    (by descending logit) whose running sum of weights exceeds `u * total`.
//!
//! `temperature <= 0` (or NaN) is greedy: the highest logit after the repeat
//! penalty, the lowest id among ties (as llama.cpp's greedy sampler).
//!
//! # Reproducibility
//!
//! For a given seed and the same calls the tokens are the same on every platform:
//! the generator is LES's own (xoshiro256\*\* seeded with splitmix64, not
//! llama.cpp's `mt19937`, so the draws differ from llama.cpp's), all arithmetic
//! after reading the logits is `f64` with [`libm`]'s `exp` and `log` (pure Rust,
//! identical everywhere, unlike the platform's `libm`), and candidates are ordered
//! by a total order (logit descending, then id ascending), so no sort stability
//! or tie question arises.
//!
//! # Non-finite logits
//!
//! NaN is read as `-inf`, `+inf` as `f32::MAX` (tokens at `+inf` share the mass
//! equally), `-0.0` as `0.0`. Tokens at `-inf` are never drawn. If every logit is
//! `-inf` (or NaN), or with an empty slice, the greedy rule gives token 0.

use std::cmp::Ordering;
use std::collections::VecDeque;

/// The repeat penalty (llama.cpp's `--repeat-penalty` / `--repeat-last-n`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RepeatPenalty {
    /// Penalty factor; 1 is no penalty. Non-finite or non-positive values turn
    /// the penalty off.
    pub penalty: f32,
    /// How many of the most recent accepted tokens are penalized (0: off).
    pub last_n: usize,
}

/// Settings of a [`Sampler`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; `<= 0` (or NaN) means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Nucleus threshold; `>= 1` (or NaN) keeps all.
    pub top_p: f32,
    /// Keep tokens with `p >= min_p * p_max`; `None` or `<= 0` keeps all.
    pub min_p: Option<f32>,
    /// Repeat penalty; `None` is off.
    pub repeat_penalty: Option<RepeatPenalty>,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
    /// no repeat penalty (llama.cpp's default factor is 1.0), seed 0.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: Some(0.05),
            repeat_penalty: None,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: None,
            repeat_penalty: None,
            seed: 0,
        }
    }
}

/// A candidate token: id and (cleaned, penalized) logit.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    id: u32,
    logit: f64,
}

/// Logit descending, then id ascending: a total order on distinct ids.
fn by_rank(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Reads a logit: NaN as `-inf`, `+inf` as `f32::MAX`, `-0.0` as `0.0`.
fn clean(l: f32) -> f64 {
    if l.is_nan() {
        f64::NEG_INFINITY
    } else if l == f32::INFINITY {
        f64::from(f32::MAX)
    } else if l == 0.0 {
        0.0
    } else {
        f64::from(l)
    }
}

/// Picks token ids from logits; see the [module docs](self) for the rules.
#[derive(Clone, Debug)]
pub struct Sampler {
    config: SamplerConfig,
    rng: Xoshiro256StarStar,
    /// Accepted tokens, most recent last, at most `repeat_penalty.last_n`.
    history: VecDeque<u32>,
    candidates: Vec<Candidate>,
    penalized: Vec<u32>,
    /// Tokens never picked ([`ban`](Self::ban)), sorted.
    banned: Vec<u32>,
}

impl Sampler {
    /// A sampler with `config`, its generator seeded from `config.seed`.
    pub fn new(config: SamplerConfig) -> Self {
        Sampler {
            config,
            rng: Xoshiro256StarStar::seed_from_u64(config.seed),
            history: VecDeque::new(),
            candidates: Vec::new(),
            penalized: Vec::new(),
            banned: Vec::new(),
        }
    }

    /// Never picks `tokens` (their logits read as `-inf`, as a logit bias of
    /// `-inf` does in llama.cpp: `--ignore-eos` bans the end-of-generation
    /// tokens); [`reset`](Self::reset) keeps the bans. If every token is banned
    /// the greedy rule's token 0 comes back, as for all logits `-inf`.
    pub fn ban(&mut self, tokens: impl IntoIterator<Item = u32>) {
        self.banned.extend(tokens);
        self.banned.sort_unstable();
        self.banned.dedup();
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Forgets the accepted tokens and reseeds the generator: the sampler then
    /// behaves as new.
    pub fn reset(&mut self) {
        self.history.clear();
        self.rng = Xoshiro256StarStar::seed_from_u64(self.config.seed);
    }

    /// Records `token` for the repeat penalty (as llama.cpp's `accept`): call it
    /// for prompt tokens; [`sample`](Self::sample) records its own picks.
    pub fn accept(&mut self, token: u32) {
        let n = self.penalty().map_or(0, |p| p.last_n);
        if n == 0 {
            return;
        }
        while self.history.len() >= n {
            self.history.pop_front();
        }
        self.history.push_back(token);
    }

    /// The repeat penalty, if it is on.
    fn penalty(&self) -> Option<RepeatPenalty> {
        self.config
            .repeat_penalty
            .filter(|p| p.penalty.is_finite() && p.penalty > 0.0 && p.penalty != 1.0)
            .filter(|p| p.last_n > 0)
    }

    /// Picks the next token from `logits` (one per vocabulary id) and records it
    /// with [`accept`](Self::accept). Never panics; returns 0 for an empty slice.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = self.pick(logits);
        self.accept(token);
        token
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        // Token ids are u32; a longer slice is cut (no vocabulary is that large).
        let logits = &logits[..logits.len().min(u32::MAX as usize)];
        let mut cands = std::mem::take(&mut self.candidates);
        cands.clear();
        cands.extend(logits.iter().enumerate().map(|(i, &l)| Candidate {
            id: i as u32,
            logit: clean(l),
        }));
        self.apply_penalty(&mut cands);
        for &t in &self.banned {
            if let Some(c) = cands.get_mut(t as usize) {
                c.logit = f64::NEG_INFINITY;
            }
        }
        let token = self.pick_from(&mut cands);
        self.candidates = cands;
        token
    }

    /// Applies the repeat penalty to `cands` (in id order).
    fn apply_penalty(&mut self, cands: &mut [Candidate]) {
        let Some(p) = self.penalty() else { return };
        let penalty = f64::from(p.penalty);
        self.penalized.clear();
        self.penalized.extend(self.history.iter().copied());
        self.penalized.sort_unstable();
        self.penalized.dedup();
        for &t in &self.penalized {
            if let Some(c) = cands.get_mut(t as usize) {
                if c.logit <= 0.0 {
                    c.logit *= penalty;
                } else {
                    c.logit /= penalty;
                }
            }
        }
    }

    fn pick_from(&mut self, cands: &mut Vec<Candidate>) -> u32 {
        let cfg = self.config;
        // NaN temperature is greedy too.
        if cfg.temperature.is_nan() || cfg.temperature <= 0.0 {
            return greedy(cands);
        }
        cands.retain(|c| c.logit > f64::NEG_INFINITY);
        if cands.is_empty() {
            return 0;
        }

        // Top-k (sorted either way: top-p and the draw walk in rank order).
        let k = if cfg.top_k == 0 {
            cands.len()
        } else {
            cfg.top_k.min(cands.len())
        };
        if k < cands.len() {
            cands.select_nth_unstable_by(k - 1, by_rank);
            cands.truncate(k);
        }
        cands.sort_unstable_by(by_rank);
        let max = cands[0].logit;

        // Top-p, on the softmax at temperature 1.
        if cfg.top_p < 1.0 {
            let total: f64 = cands.iter().map(|c| libm::exp(c.logit - max)).sum();
            let target = f64::from(cfg.top_p) * total;
            let mut cum = 0.0;
            let mut keep = cands.len();
            for (i, c) in cands.iter().enumerate() {
                cum += libm::exp(c.logit - max);
                if cum >= target {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep);
        }

        // Min-p.
        if let Some(p) = cfg.min_p.filter(|&p| p > 0.0) {
            let min_logit = max + libm::log(f64::from(p));
            let keep = cands
                .iter()
                .position(|c| c.logit < min_logit)
                .unwrap_or(cands.len())
                .max(1);
            cands.truncate(keep);
        }

        // Temperature and draw. (l - max) / t <= 0, so no overflow even for tiny t.
        let t = f64::from(cfg.temperature);
        let weight = |c: &Candidate| libm::exp((c.logit - max) / t);
        let total: f64 = cands.iter().map(weight).sum();
        let target = self.rng.next_f64() * total;
        let mut cum = 0.0;
        let mut last = cands[0].id;
        for c in cands.iter() {
            let w = weight(c);
            if w > 0.0 {
                last = c.id;
            }
            cum += w;
            if cum > target {
                return c.id;
            }
        }
        // Only reached through rounding of `total` against the running sum.
        last
    }
}

/// The id of the highest logit, the lowest id among ties; 0 if none.
fn greedy(cands: &[Candidate]) -> u32 {
    let mut best: Option<Candidate> = None;
    for &c in cands {
        match best {
            Some(b) if c.logit <= b.logit => {}
            _ => best = Some(c),
        }
    }
    best.map_or(0, |b| b.id)
}

/// xoshiro256\*\* (Blackman and Vigna), seeded by splitmix64.
#[derive(Clone, Debug)]
struct Xoshiro256StarStar {
    s: [u64; 4],
}

/// One step of splitmix64: advances `state` and returns the next output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Xoshiro256StarStar {
    fn seed_from_u64(seed: u64) -> Self {
        let mut st = seed;
        let s = [
            splitmix64(&mut st),
            splitmix64(&mut st),
            splitmix64(&mut st),
            splitmix64(&mut st),
        ];
        // splitmix64 outputs are a bijection of distinct states: never all zero.
        Xoshiro256StarStar { s }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`, 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_splitmix64_reference_vector() {
        // First outputs of splitmix64 seeded with 0 (Vigna's reference code).
        let mut st = 0u64;
        assert_eq!(splitmix64(&mut st), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix64(&mut st), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn sampling_next_f64_in_unit_interval() {
        let mut r = Xoshiro256StarStar::seed_from_u64(7);
        for _ in 0..10_000 {
            let u = r.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }
}
