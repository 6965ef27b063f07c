//! Token sampling: greedy, or llama.cpp's common chain with a reproducible draw.
//!
//! # What is followed
//!
//! The chain is llama.cpp's default sampler sequence
//! (`common_params_sampling::samplers` in `common/common.h`: penalties, DRY,
//! top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature, then `dist`),
//! in the same order, after llama.cpp's logit bias:
//!
//! 0. **logit bias** ([`Sampler::bias`], [`Sampler::ban`]: `-inf`): added to
//!    the token's logit (`llama_sampler_init_logit_bias`, first in the chain);
//! 1. **penalties** (off by default) over the last `last_n` accepted tokens,
//!    each distinct token once: a logit `<= 0` is multiplied by the repeat
//!    penalty, a positive one divided, then the frequency penalty times the
//!    token's count in the window and the presence penalty are subtracted
//!    (`llama_sampler_penalties_apply`);
//!    Then **DRY** ([`Sampler::set_dry`], [`Dry`]): the tokens that would
//!    extend a repetition of the recent text lose
//!    `multiplier * base^(length - allowed_length)`;
//! 2. **top-n-sigma** (`top_n_sigma <= 0`: off): keep the logits at least
//!    `max - n * sigma`, sigma the population deviation of every candidate's
//!    logit (`llama_sampler_top_n_sigma_apply`);
//! 3. **top-k** (`top_k == 0`: off): keep the `k` highest logits;
//! 4. **typical-p** (`typical_p >= 1`: off): on the softmax at temperature 1,
//!    order the tokens by how far their surprise `-ln p` is from the entropy
//!    (nearest first, ties by rank) and keep them until their mass exceeds
//!    `typical_p` (`llama_sampler_typical_apply`; it may drop the best);
//! 5. **top-p** (`top_p >= 1`: off): softmax of the remaining logits (at
//!    temperature 1, as llama.cpp: the temperature comes later), keep the shortest
//!    prefix, by descending logit, whose probability mass is `>= top_p`; at least
//!    one token;
//! 6. **min-p** (`None` or `<= 0`: off): keep the tokens with
//!    `logit >= max_logit + ln(min_p)`, i.e. `p >= min_p * p_max`;
//! 7. **XTC** (`xtc_probability <= 0` or `xtc_threshold > 0.5`: off): with
//!    probability `xtc_probability` (a draw of its own generator, made
//!    whenever two or more tokens are left), drop the tokens at least
//!    `xtc_threshold` likely but the last of them (`llama_sample_xtc_apply`);
//! 8. **temperature**: logits divided by `temperature`;
//! 9. **draw**: softmax of the rest, `u` uniform in `[0, 1)`, and the first token
//!    (by descending logit) whose running sum of weights exceeds `u * total`.
//!
//! **Mirostat** ([`SamplerConfig::mirostat`], llama.cpp's `--mirostat 1|2`)
//! takes the place of the chain, as llama.cpp's `common_sampler` puts it:
//! logit bias, temperature, then Mirostat (no penalties, DRY or filters).
//! Version 2 keeps the tokens whose surprise `-log2 p` is at most `mu`,
//! version 1 the `k` most likely, `k` from Zipf's exponent estimated over
//! the 100 most likely; each draws from the renormalized rest and moves `mu`
//! by `eta` times how far the pick's surprise was from `tau` (`mu` starts at
//! `2 tau`).
//!
//! `temperature <= 0` (or NaN) is greedy: the highest logit after the
//! penalties, the lowest id among ties (as llama.cpp's greedy sampler; the
//! filters then play no part).
//!
//! # Grammars
//!
//! With a grammar ([`Sampler::constrain`]) the pick is checked as llama.cpp's
//! `common_sampler_sample` does: the token the chain picks is kept if the
//! grammar allows it; if not, the chain runs again over the tokens the grammar
//! allows (the grammar first, then bias, penalties, filters and a new draw), and
//! the grammar moves past the token picked. Greedy decoding thus picks the best
//! allowed token. A lazy grammar ([`Sampler::constrain_from`], llama.cpp's
//! lazy grammars with trigger words) lets picks be free until the reply
//! spells one of its triggers, then takes the text from that trigger on and
//! constrains the rest. Where the grammar allows no token at all (it is complete and
//! the end-of-generation tokens are banned, say), [`Sampler::grammar_error`]
//! says so.
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
//! # Cost
//!
//! A token is sampled on the decode's critical path, so the vocabulary is read
//! once: greedy keeps the best token as it goes, and top-k keeps only the
//! tokens above the current `k`-th best (the same `k` best as sorting them
//! all); the later filters then see `k` candidates. Only top-k off (`0`)
//! builds a candidate per token.
//!
//! # Non-finite logits
//!
//! NaN is read as `-inf`, `+inf` as `f32::MAX` (tokens at `+inf` share the mass
//! equally), `-0.0` as `0.0`. Tokens at `-inf` are never drawn. If every logit is
//! `-inf` (or NaN), or with an empty slice, the greedy rule gives token 0.

pub mod dry;
pub mod logprobs;

pub use dry::{Dry, DrySettings, DEFAULT_BREAKERS};

use std::cmp::Ordering;
use std::collections::VecDeque;

use crate::grammar::{GrammarError, TokenGrammar};

/// The penalties on recently accepted tokens (llama.cpp's `--repeat-penalty`,
/// `--frequency-penalty` and `--presence-penalty` over `--repeat-last-n`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalties {
    /// Repeat penalty factor; 1 is none. Non-finite or non-positive values
    /// are none too.
    pub repeat: f32,
    /// Subtracted from a token's logit once per time it is in the window
    /// (0: none; non-finite values are none).
    pub frequency: f32,
    /// Subtracted once from the logit of a token in the window (0: none;
    /// non-finite values are none).
    pub presence: f32,
    /// How many of the most recent accepted tokens are penalized (0: off).
    pub last_n: usize,
}

impl Penalties {
    /// Only the repeat penalty `repeat` over the last `last_n` tokens.
    pub fn repeat(repeat: f32, last_n: usize) -> Self {
        Penalties {
            repeat,
            frequency: 0.0,
            presence: 0.0,
            last_n,
        }
    }

    /// The repeat factor (1 where it is not a positive finite number).
    fn repeat_factor(&self) -> f32 {
        if self.repeat.is_finite() && self.repeat > 0.0 {
            self.repeat
        } else {
            1.0
        }
    }

    /// What is subtracted from the logit of a token `count` times in the
    /// window.
    fn subtracted(&self, count: usize) -> f64 {
        let finite = |v: f32| if v.is_finite() { f64::from(v) } else { 0.0 };
        count as f64 * finite(self.frequency) + finite(self.presence)
    }

    /// Whether they change anything.
    fn active(&self) -> bool {
        let finite_nonzero = |v: f32| v.is_finite() && v != 0.0;
        self.last_n > 0
            && (self.repeat_factor() != 1.0
                || finite_nonzero(self.frequency)
                || finite_nonzero(self.presence))
    }
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
    /// Locally typical sampling: keep the tokens whose surprise is closest
    /// to the distribution's entropy, up to this probability mass; `>= 1`
    /// (or NaN) keeps all.
    pub typical_p: f32,
    /// Top-n-sigma: keep the tokens whose logit is within `n` standard
    /// deviations (over every candidate's logit) of the highest; `<= 0` (or
    /// NaN) keeps all.
    pub top_n_sigma: f32,
    /// XTC ("exclude top choices"): with this probability, drop every token
    /// at least [`xtc_threshold`](Self::xtc_threshold) likely but the least
    /// likely of them; `<= 0` is off.
    pub xtc_probability: f32,
    /// XTC's threshold; above 0.5 XTC is off.
    pub xtc_threshold: f32,
    /// Penalties on recent tokens; `None` is off.
    pub penalties: Option<Penalties>,
    /// Mirostat instead of the chain (see the [module docs](self)); `None`
    /// is off.
    pub mirostat: Option<Mirostat>,
    /// Seed of the random generator.
    pub seed: u64,
}

/// Mirostat's settings (llama.cpp's `--mirostat`, `--mirostat-ent`,
/// `--mirostat-lr`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mirostat {
    /// Version 2 (surprise-truncated) or 1 (top-k from Zipf's exponent).
    pub v2: bool,
    /// The target surprise `tau` (5).
    pub tau: f32,
    /// The learning rate `eta` (0.1).
    pub eta: f32,
}

impl Mirostat {
    /// llama.cpp's `mirostat` value (0: off, 1, 2; others off) with `tau`
    /// and `eta`.
    pub fn of(version: u8, tau: f32, eta: f32) -> Option<Mirostat> {
        matches!(version, 1 | 2).then_some(Mirostat {
            v2: version == 2,
            tau,
            eta,
        })
    }
}

/// Tokens Mirostat 1 estimates Zipf's exponent over (llama.cpp's `m`).
const MIROSTAT_M: usize = 100;

impl Default for SamplerConfig {
    /// llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
    /// no repeat penalty (llama.cpp's default factor is 1.0), typical-p,
    /// top-n-sigma and XTC off (XTC's threshold 0.1), seed 0.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: Some(0.05),
            typical_p: 1.0,
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            penalties: None,
            mirostat: None,
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
            penalties: None,
            seed: 0,
            ..SamplerConfig::default()
        }
    }
}

/// Mixed into the seed of XTC's generator, so that its stream is not the
/// draw's.
const XTC_STREAM: u64 = 0x5854_435F_5354_524D;

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
    /// XTC's own generator (as llama.cpp's XTC has its own), so that XTC
    /// turned off leaves the draws, and the tokens, as they were.
    xtc_rng: Xoshiro256StarStar,
    /// Accepted tokens, most recent last, at most `penalties.last_n`.
    history: VecDeque<u32>,
    candidates: Vec<Candidate>,
    /// The window's tokens sorted (a buffer of `collect_adjusted`).
    recent: Vec<u32>,
    /// Tokens whose logit a bias or the penalties change, sorted by id.
    adjusted: Vec<(u32, Adjust)>,
    /// Logit biases ([`bias`](Self::bias), [`ban`](Self::ban)), sorted by
    /// token, one per token (a token's biases summed).
    biases: Vec<(u32, f64)>,
    /// DRY's state ([`set_dry`](Self::set_dry)).
    dry: Option<Dry>,
    /// The grammar picks must follow ([`constrain`](Self::constrain)).
    grammar: Option<TokenGrammar>,
    /// Why the last pick broke the grammar, until taken.
    grammar_error: Option<GrammarError>,
    /// A lazy grammar's triggers ([`constrain_from`](Self::constrain_from)).
    triggers: Vec<Vec<u8>>,
    /// The reply's last bytes while the trigger has not come (what may be
    /// its start); `None` once it came, or without one.
    waiting: Option<Vec<u8>>,
    /// Mirostat's `mu` (its running surprise bound).
    mu: f64,
}

impl Sampler {
    /// A sampler with `config`, its generator seeded from `config.seed`.
    pub fn new(config: SamplerConfig) -> Self {
        Sampler {
            config,
            rng: Xoshiro256StarStar::seed_from_u64(config.seed),
            xtc_rng: Xoshiro256StarStar::seed_from_u64(config.seed ^ XTC_STREAM),
            history: VecDeque::new(),
            recent: Vec::new(),
            candidates: Vec::new(),
            adjusted: Vec::new(),
            biases: Vec::new(),
            dry: None,
            grammar: None,
            grammar_error: None,
            triggers: Vec::new(),
            waiting: None,
            mu: mirostat_mu(config),
        }
    }

    /// Applies DRY from now on: its penalties come after the repetition
    /// penalties, and it sees every token [`accept`](Self::accept)ed.
    pub fn set_dry(&mut self, dry: Dry) {
        self.dry = Some(dry);
    }

    /// Picks only tokens `grammar` allows from now on (see the [module
    /// docs](self#grammars)); [`reset`](Self::reset) takes it back to its
    /// start.
    pub fn constrain(&mut self, grammar: TokenGrammar) {
        self.grammar = Some(grammar);
        self.triggers.clear();
        self.waiting = None;
    }

    /// A lazy grammar: picks are free until the reply spells one of
    /// `triggers` (empty ones are ignored; none at all is
    /// [`constrain`](Self::constrain)), then the grammar takes the reply's
    /// text from the first trigger spelled on (the grammar starts with each)
    /// and constrains every later pick.
    pub fn constrain_from(&mut self, grammar: TokenGrammar, triggers: &[&str]) {
        self.grammar = Some(grammar);
        self.triggers = triggers
            .iter()
            .filter(|t| !t.is_empty())
            .map(|t| t.as_bytes().to_vec())
            .collect();
        self.waiting = self.waiting_start();
    }

    /// What a new reply waits with: nothing seen yet, where there are triggers.
    fn waiting_start(&self) -> Option<Vec<u8>> {
        (!self.triggers.is_empty()).then(Vec::new)
    }

    /// Takes the grammar back to its start (a new reply), keeping the rest.
    pub fn reset_grammar(&mut self) {
        if let Some(g) = &mut self.grammar {
            g.reset();
        }
        self.grammar_error = None;
        self.waiting = self.waiting_start();
    }

    /// Why the last [`sample`](Self::sample) could not follow the grammar
    /// (no token was allowed), taken: the caller should stop generating.
    pub fn grammar_error(&mut self) -> Option<GrammarError> {
        self.grammar_error.take()
    }

    /// Never picks `tokens` (their logits read as `-inf`, as a logit bias of
    /// `-inf` does in llama.cpp: `--ignore-eos` bans the end-of-generation
    /// tokens); [`reset`](Self::reset) keeps the bans. If every token is banned
    /// the greedy rule's token 0 comes back, as for all logits `-inf`.
    pub fn ban(&mut self, tokens: impl IntoIterator<Item = u32>) {
        for t in tokens {
            self.add_bias(t, f64::NEG_INFINITY);
        }
    }

    /// Adds `bias` to `token`'s logit before the penalties, as llama.cpp's
    /// `--logit-bias` (several biases of a token add up; `-inf` is a
    /// [`ban`](Self::ban)). A `bias` that is NaN or `+inf` is ignored: it
    /// would make every probability NaN. [`reset`](Self::reset) keeps the
    /// biases.
    pub fn bias(&mut self, token: u32, bias: f32) {
        if !bias.is_nan() && bias != f32::INFINITY {
            self.add_bias(token, f64::from(bias));
        }
    }

    fn add_bias(&mut self, token: u32, bias: f64) {
        match self.biases.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.biases[i].1 += bias,
            Err(i) => self.biases.insert(i, (token, bias)),
        }
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
        self.xtc_rng = Xoshiro256StarStar::seed_from_u64(self.config.seed ^ XTC_STREAM);
        if let Some(dry) = &mut self.dry {
            dry.clear();
        }
        self.mu = mirostat_mu(self.config);
        self.reset_grammar();
    }

    /// Records `token` for the penalties (as llama.cpp's `accept`): call it
    /// for prompt tokens; [`sample`](Self::sample) records its own picks.
    pub fn accept(&mut self, token: u32) {
        if let Some(dry) = &mut self.dry {
            dry.accept(token);
        }
        let n = self.penalty().map_or(0, |p| p.last_n);
        if n == 0 {
            return;
        }
        while self.history.len() >= n {
            self.history.pop_front();
        }
        self.history.push_back(token);
    }

    /// The penalties, if they change anything.
    fn penalty(&self) -> Option<Penalties> {
        self.config.penalties.filter(Penalties::active)
    }

    /// Picks the next token from `logits` (one per vocabulary id) and records it
    /// with [`accept`](Self::accept). Never panics; returns 0 for an empty slice.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = match self.grammar.take() {
            None => self.pick(logits, &mut |_| true).unwrap_or(0),
            Some(mut grammar) => {
                let token = match self.waiting.take() {
                    Some(mut tail) => {
                        let token = self.pick(logits, &mut |_| true).unwrap_or(0);
                        self.waiting = self.wait_for_trigger(&mut grammar, &mut tail, token);
                        token
                    }
                    None => self.pick_in_grammar(logits, &mut grammar),
                };
                self.grammar = Some(grammar);
                token
            }
        };
        self.accept(token);
        token
    }

    /// A lazy grammar's wait after the free pick `token`, `tail` the reply's
    /// last bytes before it: the grammar fed the text from the trigger on
    /// where it came (`None`: waiting no more), else the bytes that may
    /// still start it.
    fn wait_for_trigger(
        &mut self,
        grammar: &mut TokenGrammar,
        tail: &mut Vec<u8>,
        token: u32,
    ) -> Option<Vec<u8>> {
        if grammar.ends_generation(token) {
            return Some(std::mem::take(tail));
        }
        tail.extend_from_slice(grammar.piece(token));
        // Where the first trigger spelled starts.
        let first = self
            .triggers
            .iter()
            .filter_map(|t| tail.windows(t.len()).position(|w| w == t))
            .min();
        match first {
            Some(at) => {
                if let Err(e) = grammar.accept_bytes(&tail[at..]) {
                    self.grammar_error = Some(e);
                }
                None
            }
            None => {
                let longest = self.triggers.iter().map(Vec::len).max().unwrap_or(1);
                let keep = tail.len().min(longest - 1);
                tail.drain(..tail.len() - keep);
                Some(std::mem::take(tail))
            }
        }
    }

    /// The pick under `grammar` (see the [module docs](self#grammars)), and
    /// the grammar moved past it; token 0 and an error kept for
    /// [`grammar_error`](Self::grammar_error) where no token is allowed.
    fn pick_in_grammar(&mut self, logits: &[f32], grammar: &mut TokenGrammar) -> u32 {
        let first = self.pick(logits, &mut |_| true).unwrap_or(0);
        let token = if grammar.allows(first) {
            Some(first)
        } else {
            self.pick(logits, &mut |t| grammar.allows(t))
        };
        match token {
            Some(t) => {
                if let Err(e) = grammar.accept(t) {
                    self.grammar_error = Some(e);
                }
                t
            }
            None => {
                self.grammar_error = Some(GrammarError(
                    "grammar: no token can continue it (is it complete, with the \
                     end-of-generation tokens banned?)"
                        .into(),
                ));
                0
            }
        }
    }

    /// The chain's pick among the tokens `allowed` lets through (each asked
    /// at most once, and only for tokens that could be picked); `None` if
    /// there is none with a finite logit.
    fn pick(&mut self, logits: &[f32], allowed: &mut impl FnMut(u32) -> bool) -> Option<u32> {
        // Token ids are u32; a longer slice is cut (no vocabulary is that large).
        let logits = &logits[..logits.len().min(u32::MAX as usize)];
        self.collect_adjusted();
        let cfg = self.config;
        // NaN temperature is greedy too.
        if cfg.temperature.is_nan() || cfg.temperature <= 0.0 {
            return self.greedy(logits, allowed);
        }
        if let Some(m) = cfg.mirostat {
            return self.mirostat(logits, allowed, m);
        }
        let mut cands = std::mem::take(&mut self.candidates);
        cands.clear();
        // Top-n-sigma's deviation is over every candidate: gather them all.
        if cfg.top_k == 0 || cfg.top_k >= logits.len() || top_n_sigma(cfg).is_some() {
            for_each_value(logits, &self.adjusted, |id, value| {
                let logit = value.logit();
                if logit > f64::NEG_INFINITY && allowed(id) {
                    cands.push(Candidate { id, logit });
                }
            });
        } else {
            gather_top_k(logits, &self.adjusted, cfg.top_k, &mut cands, allowed);
        }
        let token = self.pick_from(&mut cands);
        self.candidates = cands;
        token
    }

    /// Fills `adjusted` with the tokens whose logit is not read as it is,
    /// sorted by id: the biased ones and the penalized ones (each distinct
    /// recent token once), a token both biased and penalized once.
    fn collect_adjusted(&mut self) {
        self.adjusted.clear();
        self.adjusted.extend(self.biases.iter().map(|&(t, bias)| {
            (
                t,
                Adjust {
                    bias,
                    penalty: None,
                    dry: 0.0,
                },
            )
        }));
        let mut merge = false;
        if let Some(dry) = &self.dry {
            let penalties = dry.penalties();
            merge = !penalties.is_empty();
            self.adjusted.extend(penalties.into_iter().map(|(t, dry)| {
                (
                    t,
                    Adjust {
                        bias: 0.0,
                        penalty: None,
                        dry,
                    },
                )
            }));
        }
        if let Some(p) = self.penalty() {
            let mut recent = std::mem::take(&mut self.recent);
            recent.clear();
            recent.extend(self.history.iter().copied());
            recent.sort_unstable();
            let repeat = p.repeat_factor();
            self.adjusted
                .extend(recent.chunk_by(|a, b| a == b).map(|run| {
                    let subtract = p.subtracted(run.len());
                    (
                        run[0],
                        Adjust {
                            bias: 0.0,
                            penalty: Some((repeat, subtract)),
                            dry: 0.0,
                        },
                    )
                }));
            self.recent = recent;
            merge = true;
        }
        if merge {
            // Each list is sorted and holds a token at most once: a token in
            // several ends up as one entry with its bias, penalty and DRY.
            self.adjusted.sort_by_key(|&(t, _)| t);
            let mut w = 0;
            for r in 0..self.adjusted.len() {
                let (t, a) = self.adjusted[r];
                if w > 0 && self.adjusted[w - 1].0 == t {
                    let merged = &mut self.adjusted[w - 1].1;
                    merged.bias += a.bias;
                    merged.penalty = merged.penalty.or(a.penalty);
                    merged.dry += a.dry;
                } else {
                    self.adjusted[w] = (t, a);
                    w += 1;
                }
            }
            self.adjusted.truncate(w);
        }
    }

    /// The highest adjusted logit's allowed token, the lowest id among ties;
    /// `None` if none (every logit `-inf`, or none at all).
    fn greedy(&self, logits: &[f32], allowed: &mut impl FnMut(u32) -> bool) -> Option<u32> {
        let mut best: Option<Candidate> = None;
        let mut bound = f64::NEG_INFINITY;
        for_each_value(logits, &self.adjusted, |id, value| {
            if let Some(logit) = value.above(bound) {
                if allowed(id) {
                    best = Some(Candidate { id, logit });
                    bound = logit;
                }
            }
        });
        best.map(|c| c.id)
    }

    /// Top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature and the
    /// draw over `cands`: the finite candidates, every one or (with top-k and
    /// no top-n-sigma) at least the `top_k` best by rank.
    fn pick_from(&mut self, cands: &mut Vec<Candidate>) -> Option<u32> {
        let cfg = self.config;
        if cands.is_empty() {
            return None;
        }

        // Top-n-sigma (llama_sampler_top_n_sigma_apply): the population
        // deviation of the logits; keep those within n of it of the best.
        if let Some(n) = top_n_sigma(cfg) {
            if cands.len() > 1 {
                let len = cands.len() as f64;
                let max = cands
                    .iter()
                    .map(|c| c.logit)
                    .fold(f64::NEG_INFINITY, f64::max);
                let mean = cands.iter().map(|c| c.logit).sum::<f64>() / len;
                let var = cands.iter().map(|c| (c.logit - mean).powi(2)).sum::<f64>() / len;
                // n = inf keeps all (and times a deviation of 0, all equal).
                let spread = n * var.sqrt();
                if spread.is_finite() {
                    cands.retain(|c| c.logit >= max - spread);
                }
            }
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

        // Typical-p (llama_sampler_typical_apply); it may drop the best.
        if cfg.typical_p < 1.0 {
            typical(cands, f64::from(cfg.typical_p));
        }
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

        // XTC (llama_sample_xtc_apply): drawn first, then every candidate at
        // least `threshold` likely is dropped but the last of them.
        if cfg.xtc_probability > 0.0 && cfg.xtc_threshold <= 0.5 && cands.len() >= 2 {
            let chance = self.xtc_rng.next_f64();
            if chance <= f64::from(cfg.xtc_probability) {
                let total: f64 = cands.iter().map(|c| libm::exp(c.logit - max)).sum();
                let threshold = f64::from(cfg.xtc_threshold) * total;
                let above = cands
                    .iter()
                    .take_while(|c| libm::exp(c.logit - max) >= threshold)
                    .count();
                if above > 1 {
                    cands.drain(..above - 1);
                }
            }
        }
        let max = cands[0].logit;

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
                return Some(c.id);
            }
        }
        // Only reached through rounding of `total` against the running sum.
        Some(last)
    }
}

impl Sampler {
    /// Mirostat's pick (see the [module docs](self)): the logits biased
    /// and divided by the temperature, truncated by `mu` (version 2) or to
    /// the estimated `k` (version 1), one drawn from the rest, `mu` moved.
    fn mirostat(
        &mut self,
        logits: &[f32],
        allowed: &mut impl FnMut(u32) -> bool,
        m: Mirostat,
    ) -> Option<u32> {
        let t = f64::from(self.config.temperature);
        let mut cands = std::mem::take(&mut self.candidates);
        cands.clear();
        let mut biases = self.biases.iter().peekable();
        for (id, &l) in logits.iter().enumerate() {
            let id = id as u32;
            let mut logit = clean(l);
            while biases.next_if(|b| b.0 < id).is_some() {}
            if let Some(&&(_, bias)) = biases.peek().filter(|b| b.0 == id) {
                logit += bias;
            }
            if logit > f64::NEG_INFINITY && allowed(id) {
                cands.push(Candidate {
                    id,
                    logit: logit / t,
                });
            }
        }
        if cands.is_empty() {
            self.candidates = cands;
            return None;
        }
        cands.sort_unstable_by(by_rank);
        let probs = |cands: &[Candidate]| -> Vec<f64> {
            let max = cands[0].logit;
            let w: Vec<f64> = cands.iter().map(|c| libm::exp(c.logit - max)).collect();
            let total: f64 = w.iter().sum();
            w.into_iter().map(|x| x / total).collect()
        };
        let p = probs(&cands);
        let keep = if m.v2 {
            // The tokens whose surprise is at most mu, at least one.
            p.iter()
                .position(|&p| -libm::log2(p) > self.mu)
                .unwrap_or(p.len())
                .max(1)
        } else {
            // Zipf's exponent over the most likely, then the k whose
            // expected surprise is mu.
            let (mut ti_bi, mut ti_sq) = (0.0, 0.0);
            for i in 0..(MIROSTAT_M - 1).min(p.len() - 1) {
                let t_i = libm::log((i + 2) as f64 / (i + 1) as f64);
                let b_i = libm::log(p[i] / p[i + 1]);
                ti_bi += t_i * b_i;
                ti_sq += t_i * t_i;
            }
            let s_hat = ti_bi / ti_sq;
            let eps = s_hat - 1.0;
            let n = logits.len() as f64;
            let k = libm::pow(
                eps * libm::pow(2.0, self.mu) / (1.0 - libm::pow(n, -eps)),
                1.0 / s_hat,
            );
            if k.is_finite() && k >= 1.0 {
                (k as usize).min(p.len())
            } else if k.is_finite() {
                1
            } else {
                p.len()
            }
        };
        cands.truncate(keep);
        let p = probs(&cands);
        let target = self.rng.next_f64();
        let mut cum = 0.0;
        let mut pick = cands.len() - 1;
        for (i, &pi) in p.iter().enumerate() {
            cum += pi;
            if cum > target {
                pick = i;
                break;
            }
        }
        let surprise = -libm::log2(p[pick]);
        self.mu -= f64::from(m.eta) * (surprise - f64::from(m.tau));
        let id = cands[pick].id;
        self.candidates = cands;
        Some(id)
    }
}

/// Mirostat's starting `mu`: twice its target surprise (0 without it).
fn mirostat_mu(config: SamplerConfig) -> f64 {
    config.mirostat.map_or(0.0, |m| 2.0 * f64::from(m.tau))
}

/// Top-n-sigma's `n`, if it is on.
fn top_n_sigma(cfg: SamplerConfig) -> Option<f64> {
    (cfg.top_n_sigma > 0.0).then_some(f64::from(cfg.top_n_sigma))
}

/// Locally typical sampling over `cands` (sorted by rank, not empty): by
/// the distance of each token's surprise `-ln p` from the entropy, nearest
/// first (ties in rank order), keep tokens until their mass exceeds `mass`;
/// `cands` stays sorted by rank. A token whose probability underflows to 0
/// adds nothing to the entropy and comes last (llama.cpp's `0 * ln 0` would
/// make the entropy NaN).
fn typical(cands: &mut Vec<Candidate>, mass: f64) {
    let max = cands[0].logit;
    let total: f64 = cands.iter().map(|c| libm::exp(c.logit - max)).sum();
    let p: Vec<f64> = cands
        .iter()
        .map(|c| libm::exp(c.logit - max) / total)
        .collect();
    let entropy: f64 = p
        .iter()
        .filter(|&&p| p > 0.0)
        .map(|&p| -p * libm::log(p))
        .sum();
    let mut order: Vec<(f64, usize)> = p
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let d = if p > 0.0 {
                (-libm::log(p) - entropy).abs()
            } else {
                f64::INFINITY
            };
            (d, i)
        })
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut cum = 0.0;
    let mut keep = order.len();
    for (n, &(_, i)) in order.iter().enumerate() {
        cum += p[i];
        if cum > mass {
            keep = n + 1;
            break;
        }
    }
    let mut kept: Vec<usize> = order[..keep].iter().map(|&(_, i)| i).collect();
    kept.sort_unstable();
    let mut w = 0;
    for i in kept {
        cands[w] = cands[i];
        w += 1;
    }
    cands.truncate(w);
}

/// How a token's logit is adjusted before sampling.
#[derive(Clone, Copy, Debug)]
struct Adjust {
    /// Added first (`-inf`: never picked).
    bias: f64,
    /// Then the penalties `(repeat, subtract)`: a logit `<= 0` multiplied by
    /// `repeat`, a positive one divided, then `subtract` subtracted.
    penalty: Option<(f32, f64)>,
    /// Then DRY's penalty, subtracted.
    dry: f64,
}

impl Adjust {
    fn apply(self, logit: f64) -> f64 {
        let l = logit + self.bias;
        let l = match self.penalty {
            Some((repeat, subtract)) if l <= 0.0 => l * f64::from(repeat) - subtract,
            Some((repeat, subtract)) => l / f64::from(repeat) - subtract,
            None => l,
        };
        l - self.dry
    }
}

/// A token's logit as [`for_each_value`] hands it over.
#[derive(Clone, Copy)]
enum Value {
    /// Not adjusted: read with [`clean`] (at most the `f32` as `f64`, so a
    /// token whose `f32` is not above a bound is not above it cleaned).
    Raw(f32),
    /// Cleaned and adjusted.
    Adjusted(f64),
}

impl Value {
    /// The logit, cleaned and adjusted.
    #[inline(always)]
    fn logit(self) -> f64 {
        match self {
            Value::Raw(l) => clean(l),
            Value::Adjusted(v) => v,
        }
    }

    /// Whether the logit is above `bound`, checking the raw `f32` first: one
    /// comparison for almost every token.
    #[inline(always)]
    fn above(self, bound: f64) -> Option<f64> {
        match self {
            Value::Raw(l) if f64::from(l) <= bound || l.is_nan() => None,
            v => Some(v.logit()).filter(|&v| v > bound),
        }
    }
}

/// Calls `f(id, value)` for every token in id order; the tokens in `adjusted`
/// (sorted by id) come cleaned and adjusted, the runs between them raw.
#[inline(always)]
fn for_each_value(logits: &[f32], adjusted: &[(u32, Adjust)], mut f: impl FnMut(u32, Value)) {
    let mut from = 0usize;
    for &(t, adjust) in adjusted {
        let t = t as usize;
        if t >= logits.len() {
            break;
        }
        for (i, &l) in (from..t).zip(&logits[from..t]) {
            f(i as u32, Value::Raw(l));
        }
        f(t as u32, Value::Adjusted(adjust.apply(clean(logits[t]))));
        from = t + 1;
    }
    for (i, &l) in (from..logits.len()).zip(&logits[from..]) {
        f(i as u32, Value::Raw(l));
    }
}

/// Collects into `cands` the finite candidates top-k can keep, in one pass:
/// a buffer of those above a threshold, cut to the `k` best by rank whenever
/// it fills, the threshold then the `k`-th best's logit. A token not above it
/// ranks under `k` others (on a tie, the later id ranks lower), so never
/// passes top-k: `cands` holds the same `k` best as the whole list (with fewer
/// finite tokens than `k`, all of them), and the pass costs a comparison a
/// token instead of a 16-byte candidate each and a selection over them all.
///
/// Only tokens `allowed` lets through are kept; it is asked only for tokens
/// above the threshold, so a grammar is consulted for few of them.
fn gather_top_k(
    logits: &[f32],
    adjusted: &[(u32, Adjust)],
    k: usize,
    cands: &mut Vec<Candidate>,
    allowed: &mut impl FnMut(u32) -> bool,
) {
    let k = k.max(1);
    let cap = k.saturating_mul(4).max(256);
    let mut threshold = f64::NEG_INFINITY;
    for_each_value(logits, adjusted, |id, value| {
        if let Some(logit) = value.above(threshold).filter(|_| allowed(id)) {
            cands.push(Candidate { id, logit });
            if cands.len() >= cap {
                cands.select_nth_unstable_by(k - 1, by_rank);
                cands.truncate(k);
                threshold = cands[k - 1].logit;
            }
        }
    });
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
    use proptest::prelude::*;
    use std::collections::BTreeSet;

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

    #[test]
    fn sampling_logit_bias_comes_before_the_penalties() {
        // Token 0 at 4, biased -2, recent with a repeat penalty of 2: (4 - 2)
        // / 2 = 1 beats token 1's 0.5 (the penalty first would give 0).
        let mut s = Sampler::new(SamplerConfig {
            penalties: Some(Penalties::repeat(2.0, 8)),
            ..SamplerConfig::greedy()
        });
        s.accept(0);
        s.bias(0, -2.0);
        assert_eq!(s.sample(&[4.0, 0.5]), 0);
        // Biases of a token add up; NaN and +inf are ignored.
        let mut s = Sampler::new(SamplerConfig::greedy());
        s.bias(1, 3.0);
        s.bias(1, 3.0);
        s.bias(0, f32::NAN);
        s.bias(0, f32::INFINITY);
        assert_eq!(s.sample(&[5.5, 0.0]), 1);
        // -inf is a ban, and the reset keeps it.
        s.bias(1, f32::NEG_INFINITY);
        s.reset();
        assert_eq!(s.sample(&[0.0, 100.0]), 0);
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            ..SamplerConfig::default()
        });
        s.bias(2, 50.0);
        assert!((0..20).all(|_| s.sample(&[1.0, 2.0, 0.0]) == 2));
    }

    /// A grammar over tokens "a", "b", "ab", "c" and an end token (4).
    fn abc_grammar(text: &str) -> TokenGrammar {
        let pieces: [(&[u8], bool); 5] = [
            (b"a", false),
            (b"b", false),
            (b"ab", false),
            (b"c", false),
            (b"", true),
        ];
        TokenGrammar::from_pieces(crate::grammar::Grammar::parse(text).unwrap(), pieces).unwrap()
    }

    #[test]
    fn sampling_follows_a_grammar() {
        // Greedy: the best allowed token, then only the end.
        let mut s = Sampler::new(SamplerConfig::greedy());
        s.constrain(abc_grammar("root ::= (\"a\" | \"b\") \"c\""));
        let logits = [1.0, 2.0, 9.0, 5.0, 7.0];
        assert_eq!(
            s.sample(&logits),
            1,
            "ab and c not allowed first; b beats a"
        );
        assert_eq!(s.sample(&logits), 3, "only c now");
        assert_eq!(s.sample(&logits), 4, "complete: only the end");
        assert!(s.grammar_error().is_none());
        // The reset starts the grammar over; the unconstrained best is kept
        // when allowed.
        s.reset();
        assert_eq!(s.sample(&[5.0, 1.0, 0.0, 0.0, 9.0]), 0);
        // Sampling at a temperature, with and without top-k: only allowed
        // tokens, from both of them.
        for top_k in [0, 2, 40] {
            let mut s = Sampler::new(SamplerConfig {
                temperature: 1.0,
                top_k,
                top_p: 1.0,
                min_p: None,
                seed: 7,
                ..SamplerConfig::default()
            });
            s.constrain(abc_grammar("root ::= (\"a\" | \"b\") \"c\""));
            let mut seen = [0usize; 5];
            for _ in 0..200 {
                s.reset_grammar();
                let first = s.sample(&[0.0, 0.0, 3.0, 3.0, 3.0]);
                assert!(first <= 1, "top_k {top_k}: {first}");
                seen[first as usize] += 1;
                assert_eq!(s.sample(&[0.0, 0.0, 3.0, 3.0, 3.0]), 3);
                assert_eq!(s.sample(&[0.0, 0.0, 3.0, 3.0, 3.0]), 4);
            }
            assert!(seen[0] > 50 && seen[1] > 50, "top_k {top_k}: {seen:?}");
        }
    }

    #[test]
    fn a_lazy_grammar_starts_at_its_trigger() {
        // Trigger "ab", spelled by "a" then "b", or by "ab" at once; the
        // grammar starts with it and then wants "c" and the end.
        let grammar = || abc_grammar("root ::= \"ab\" \"c\"");
        let mut s = Sampler::new(SamplerConfig::greedy());
        s.constrain_from(grammar(), &["ab"]);
        // Free until the trigger: "c", then the end would be picked.
        assert_eq!(s.sample(&[0.0, 0.0, 0.0, 9.0, 1.0]), 3);
        assert_eq!(s.sample(&[5.0, 0.0, 0.0, 9.0, 1.0]), 3);
        // "a" then "b" spell the trigger across two tokens: from then on only
        // "c", then only the end.
        assert_eq!(s.sample(&[9.0, 0.0, 0.0, 1.0, 5.0]), 0);
        assert_eq!(s.sample(&[0.0, 9.0, 0.0, 1.0, 5.0]), 1);
        assert_eq!(s.sample(&[9.0, 8.0, 7.0, 1.0, 5.0]), 3);
        assert_eq!(s.sample(&[9.0, 8.0, 7.0, 1.0, 5.0]), 4);
        assert!(s.grammar_error().is_none());
        // A new reply waits for the trigger again; "ab" in one token.
        s.reset();
        assert_eq!(s.sample(&[0.0, 0.0, 0.0, 1.0, 9.0]), 4, "free: the end");
        s.reset();
        assert_eq!(s.sample(&[0.0, 0.0, 9.0, 1.0, 5.0]), 2);
        assert_eq!(s.sample(&[9.0, 8.0, 7.0, 1.0, 5.0]), 3);
        // Text after the trigger in the same token that the grammar refuses
        // is reported: "ab" then "ab" again is not "abc".
        let mut s = Sampler::new(SamplerConfig::greedy());
        s.constrain_from(abc_grammar("root ::= \"abc\""), &["b"]);
        assert_eq!(s.sample(&[0.0, 0.0, 9.0, 0.0, 0.0]), 2);
        assert!(s.grammar_error().is_some(), "\"b\" does not start \"abc\"");
        // `constrain` makes it strict again.
        s.constrain(grammar());
        assert_eq!(s.sample(&[0.0, 0.0, 1.0, 9.0, 5.0]), 2);
        // Several triggers: whichever is spelled first starts the grammar,
        // from where it starts ("bc" here, within "abc" spelled "ab", "c").
        let either = || abc_grammar("root ::= \"ca\" | \"bc\" \"a\"");
        let mut s = Sampler::new(SamplerConfig::greedy());
        s.constrain_from(either(), &["ca", "bc", ""]);
        assert_eq!(s.sample(&[0.0, 0.0, 9.0, 0.0, 0.0]), 2);
        assert_eq!(s.sample(&[0.0, 0.0, 0.0, 9.0, 0.0]), 3);
        // Now under the grammar: "bc" wants "a", then the end.
        assert_eq!(s.sample(&[0.0, 9.0, 0.0, 5.0, 1.0]), 0);
        assert_eq!(s.sample(&[0.0, 9.0, 0.0, 5.0, 1.0]), 4);
        assert!(s.grammar_error().is_none());
        s.reset();
        // "c" then "a": the other trigger.
        assert_eq!(s.sample(&[0.0, 0.0, 0.0, 9.0, 0.0]), 3);
        assert_eq!(s.sample(&[9.0, 0.0, 0.0, 0.0, 0.0]), 0);
        assert_eq!(s.sample(&[9.0, 0.0, 0.0, 0.0, 1.0]), 4);
        assert!(s.grammar_error().is_none());
        // Only empty triggers: a strict grammar.
        s.constrain_from(either(), &[""]);
        assert_eq!(s.sample(&[0.0, 0.0, 9.0, 5.0, 1.0]), 3);
    }

    #[test]
    fn a_grammar_that_allows_nothing_is_reported() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        s.constrain(abc_grammar("root ::= \"a\""));
        // The end token is banned, as --ignore-eos does.
        s.ban([4]);
        assert_eq!(s.sample(&[1.0, 2.0, 3.0, 4.0, 5.0]), 0);
        assert!(s.grammar_error().is_none());
        s.sample(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let e = s.grammar_error().expect("nothing is allowed");
        assert!(e.0.contains("no token"), "{e}");
        // Taken once.
        assert!(s.grammar_error().is_none());
    }

    /// The sampler as it was before candidates were gathered in one pass: every
    /// token a candidate, the biases then the penalty applied to the whole list.
    fn reference_pick(s: &mut Sampler, logits: &[f32]) -> u32 {
        let mut cands: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate {
                id: i as u32,
                logit: clean(l),
            })
            .collect();
        for &(t, b) in &s.biases {
            if let Some(c) = cands.get_mut(t as usize) {
                c.logit += b;
            }
        }
        if let Some(p) = s.penalty() {
            let mut recent: Vec<u32> = s.history.iter().copied().collect();
            recent.sort_unstable();
            recent.dedup();
            for t in recent {
                let count = s.history.iter().filter(|&&h| h == t).count();
                if let Some(c) = cands.get_mut(t as usize) {
                    // llama_sampler_penalties_apply, in f64.
                    let r = f64::from(p.repeat_factor());
                    let l = if c.logit <= 0.0 {
                        c.logit * r
                    } else {
                        c.logit / r
                    };
                    c.logit = l - count as f64 * f64::from(p.frequency) - f64::from(p.presence);
                }
            }
        }
        let t = s.config.temperature;
        let token = if t.is_nan() || t <= 0.0 {
            let mut best: Option<Candidate> = None;
            for &c in &cands {
                match best {
                    Some(b) if c.logit <= b.logit => {}
                    _ => best = Some(c),
                }
            }
            best.map_or(0, |b| b.id)
        } else {
            cands.retain(|c| c.logit > f64::NEG_INFINITY);
            s.pick_from(&mut cands).unwrap_or(0)
        };
        s.accept(token);
        token
    }

    /// The tokens `config` draws from `logits` over many seeds.
    fn drawn(config: SamplerConfig, logits: &[f32]) -> BTreeSet<u32> {
        (0..400)
            .map(|seed| Sampler::new(SamplerConfig { seed, ..config }).sample(logits))
            .collect()
    }

    fn mirostat(v2: bool, tau: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature: 1.0,
            mirostat: Some(Mirostat { v2, tau, eta: 0.1 }),
            seed,
            ..SamplerConfig::default()
        }
    }

    /// With a target surprise near 0, both versions keep only the most
    /// likely token, and `mu` grows by `eta * tau` a pick (its surprise,
    /// renormalized alone, is 0); with a large one, version 2 truncates
    /// nothing and draws across the distribution.
    #[test]
    fn mirostat_truncates_by_surprise_and_learns_mu() {
        let logits = logits_of(&[0.4, 0.3, 0.2, 0.1]);
        for v2 in [true, false] {
            let mut s = Sampler::new(mirostat(v2, 0.01, 1));
            assert_eq!(s.mu, 2.0 * f64::from(0.01f32));
            let picks: Vec<u32> = (0..8).map(|_| s.sample(&logits)).collect();
            assert!(picks.iter().all(|&t| t == 0), "v2 {v2}: {picks:?}");
            let want = 2.0 * f64::from(0.01f32) + 8.0 * f64::from(0.1f32) * f64::from(0.01f32);
            assert!((s.mu - want).abs() < 1e-12, "{}", s.mu);
        }
        let wide: BTreeSet<u32> = (0..200)
            .map(|seed| Sampler::new(mirostat(true, 50.0, seed)).sample(&logits))
            .collect();
        assert_eq!(wide.len(), 4);
    }

    /// As llama.cpp's chain with Mirostat: the logit biases apply, the
    /// penalties do not; the same seed gives the same picks, and a reset
    /// (`mu` included) replays them.
    #[test]
    fn mirostat_takes_biases_not_penalties_and_replays() {
        let logits = logits_of(&[0.4, 0.3, 0.2, 0.1]);
        let mut s = Sampler::new(SamplerConfig {
            penalties: Some(Penalties::repeat(100.0, 8)),
            ..mirostat(true, 0.01, 1)
        });
        s.accept(0);
        assert_eq!(s.sample(&logits), 0, "penalized, and picked");
        s.ban([0]);
        assert_eq!(s.sample(&logits), 1, "banned");
        let zipf: Vec<f32> = (1..=50).map(|i| -(i as f32).ln()).collect();
        for v2 in [true, false] {
            let mut s = Sampler::new(mirostat(v2, 3.0, 7));
            let a: Vec<u32> = (0..40).map(|_| s.sample(&zipf)).collect();
            s.reset();
            let b: Vec<u32> = (0..40).map(|_| s.sample(&zipf)).collect();
            assert_eq!(a, b);
            assert!(
                a.iter().collect::<BTreeSet<_>>().len() > 1,
                "v2 {v2}: {a:?}"
            );
            assert!(a.iter().all(|&t| t < 50));
        }
    }

    /// Only the sampler under test: no top-k, top-p or min-p, temperature 1.
    fn plain() -> SamplerConfig {
        SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: None,
            ..SamplerConfig::default()
        }
    }

    fn logits_of(p: &[f64]) -> Vec<f32> {
        p.iter().map(|&p| libm::log(p) as f32).collect()
    }

    #[test]
    fn top_n_sigma_keeps_the_logits_near_the_best() {
        // Mean 0.917, population deviation 1.304: within one of 3, 3 and 2.5.
        let logits = [3.0, 2.5, 0.0, 0.0, 0.0, 0.0];
        let one = SamplerConfig {
            top_n_sigma: 1.0,
            ..plain()
        };
        assert_eq!(drawn(one, &logits), BTreeSet::from([0, 1]));
        // Within three (down to -0.9): all.
        let three = SamplerConfig {
            top_n_sigma: 3.0,
            ..plain()
        };
        assert_eq!(drawn(three, &logits).len(), 6);
        // Before top-k, over every token: top-k 1 keeps token 0 alone.
        let k1 = SamplerConfig {
            top_n_sigma: 1.0,
            top_k: 1,
            ..plain()
        };
        assert_eq!(drawn(k1, &logits), BTreeSet::from([0]));
    }

    #[test]
    fn typical_p_can_drop_the_most_likely_token() {
        // p = 0.4, 0.3, 0.3: entropy 1.089; surprise 0.916 (0.173 away) and
        // 1.204 (0.115 away): tokens 1 and 2 are the typical ones, and their
        // 0.6 exceeds 0.5.
        let logits = logits_of(&[0.4, 0.3, 0.3]);
        let typical = SamplerConfig {
            typical_p: 0.5,
            ..plain()
        };
        assert_eq!(drawn(typical, &logits), BTreeSet::from([1, 2]));
        // Their 0.6 does not exceed 0.65: token 0 joins.
        let more = SamplerConfig {
            typical_p: 0.65,
            ..plain()
        };
        assert_eq!(drawn(more, &logits), BTreeSet::from([0, 1, 2]));
    }

    #[test]
    fn xtc_drops_the_likely_tokens_but_the_last_of_them() {
        let logits = logits_of(&[0.4, 0.3, 0.2, 0.1]);
        let xtc = |probability, threshold| SamplerConfig {
            xtc_probability: probability,
            xtc_threshold: threshold,
            ..plain()
        };
        // 0.4, 0.3 and 0.2 reach 0.19: the first two go.
        assert_eq!(drawn(xtc(1.0, 0.19), &logits), BTreeSet::from([2, 3]));
        // Only the best reaches 0.35: nothing goes.
        assert_eq!(drawn(xtc(1.0, 0.35), &logits).len(), 4);
        // Above 0.5, off.
        assert_eq!(drawn(xtc(1.0, 0.55), &logits).len(), 4);
        // Half the time: every token still comes up.
        assert_eq!(drawn(xtc(0.5, 0.19), &logits).len(), 4);
        // Off, XTC draws nothing: the tokens are those of no XTC at all.
        let mut a = Sampler::new(SamplerConfig {
            seed: 7,
            ..xtc(0.0, 0.2)
        });
        let mut b = Sampler::new(SamplerConfig { seed: 7, ..plain() });
        for _ in 0..50 {
            assert_eq!(a.sample(&logits), b.sample(&logits));
        }
    }

    fn logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            4 => -8.0f32..8.0,
            // Few distinct values: ties at the top-k threshold.
            4 => (-3i32..3).prop_map(|v| v as f32),
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NEG_INFINITY),
            1 => Just(-0.0f32),
        ]
    }

    /// A logit bias: small, large, or `-inf`.
    fn bias() -> impl Strategy<Value = f32> {
        prop_oneof![
            3 => -3.0f32..3.0,
            1 => prop_oneof![Just(-100.0f32), Just(100.0)],
            1 => Just(f32::NEG_INFINITY),
        ]
    }

    /// Logits of every kind, only finite ones (so the top is not a run of
    /// `+inf`s, which hides a wrong threshold), or few distinct values.
    fn logit_vec(max: usize) -> impl Strategy<Value = Vec<f32>> {
        use proptest::collection::vec;
        prop_oneof![
            vec(logit(), 0..max),
            vec(-8.0f32..8.0, 0..max),
            vec((-3i32..3).prop_map(|v| v as f32), 0..max),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Mirostat on any logits, biases and bans: a token of the
        /// vocabulary with a finite (biased) logit where there is one, never a
        /// banned one, `mu` a number whatever the surprise.
        #[test]
        fn mirostat_picks_a_live_token(
            logits in logit_vec(300),
            v2 in any::<bool>(),
            tau in 0.0f32..20.0,
            banned in proptest::collection::vec(0u32..300, 0..4),
            temperature in prop_oneof![Just(0.3f32), Just(1.0), Just(2.0)],
            seed in any::<u64>(),
        ) {
            let mut s = Sampler::new(SamplerConfig {
                temperature,
                mirostat: Some(Mirostat { v2, tau, eta: 0.1 }),
                seed,
                ..SamplerConfig::default()
            });
            s.ban(banned.iter().copied());
            let live = |t: u32| {
                (t as usize) < logits.len() && !banned.contains(&t) && clean(logits[t as usize]) > f64::NEG_INFINITY
            };
            for _ in 0..4 {
                let t = s.sample(&logits);
                if (0..logits.len() as u32).any(live) {
                    prop_assert!(live(t), "{t}");
                }
                prop_assert!(!s.mu.is_nan(), "mu {}", s.mu);
            }
        }

        /// The one-pass gather holds the `k` best finite candidates by rank,
        /// as the full list sorted does.
        #[test]
        fn sampling_one_pass_gather_holds_the_top_k(
            logits in logit_vec(3000),
            k in prop_oneof![1usize..8, 30usize..80],
            adjusted in proptest::collection::vec(
                (0u32..3000, bias(), prop_oneof![Just(None), (0.5f32..2.0, -1.0f64..1.0).prop_map(Some)], prop_oneof![Just(0.0f64), 0.0f64..10.0])
                    .prop_map(|(t, b, penalty, dry)| (t, Adjust { bias: f64::from(b), penalty, dry })),
                0..8,
            ),
        ) {
            let mut adjusted = adjusted;
            adjusted.sort_by_key(|&(t, _)| t);
            adjusted.dedup_by_key(|&mut (t, _)| t);
            let mut gathered = Vec::new();
            gather_top_k(&logits, &adjusted, k, &mut gathered, &mut |_| true);
            let mut all = Vec::new();
            for_each_value(&logits, &adjusted, |id, value| {
                let logit = value.logit();
                if logit > f64::NEG_INFINITY {
                    all.push(Candidate { id, logit });
                }
            });
            for list in [&mut gathered, &mut all] {
                list.sort_unstable_by(by_rank);
                list.truncate(k);
            }
            let ids = |l: &[Candidate]| l.iter().map(|c| c.id).collect::<Vec<_>>();
            prop_assert_eq!(ids(&gathered), ids(&all));
        }

        /// Gathering the candidates in one pass picks the tokens the full
        /// list did, for every filter, penalty, ban and non-finite logit.
        #[test]
        fn sampling_one_pass_gather_picks_as_the_full_list(
            logits in logit_vec(1500),
            top_k in prop_oneof![Just(0usize), 1usize..8, 30usize..60, 1000usize..1600],
            temperature in prop_oneof![Just(0.0f32), Just(0.8), Just(1.5), Just(f32::NAN)],
            top_p in prop_oneof![Just(1.0f32), 0.05f32..1.0],
            min_p in prop_oneof![Just(None), (0.0f32..0.5).prop_map(Some)],
            penalty in prop_oneof![
                Just(None),
                (0.5f32..2.0, 1usize..16).prop_map(|(repeat, last_n)| Some(Penalties::repeat(repeat, last_n))),
                (prop_oneof![Just(1.0f32), 0.5f32..2.0], -1.0f32..2.0, -1.0f32..2.0, 1usize..16)
                    .prop_map(|(repeat, frequency, presence, last_n)| Some(Penalties { repeat, frequency, presence, last_n })),
            ],
            banned in proptest::collection::vec(0u32..1600, 0..6),
            biases in proptest::collection::vec((0u32..1600, bias()), 0..6),
            seed in any::<u64>(),
            typical_p in prop_oneof![Just(1.0f32), 0.2f32..1.0],
            top_n_sigma in prop_oneof![Just(-1.0f32), 0.2f32..3.0],
            (xtc_probability, xtc_threshold) in prop_oneof![Just((0.0f32, 0.1f32)), (0.0f32..1.0, 0.0f32..0.6)],
        ) {
            let config = SamplerConfig {
                temperature, top_k, top_p, min_p, typical_p, top_n_sigma, xtc_probability,
                xtc_threshold, penalties: penalty, mirostat: None, seed,
            };
            let (mut fast, mut reference) = (Sampler::new(config), Sampler::new(config));
            for s in [&mut fast, &mut reference] {
                s.ban(banned.iter().copied());
                for &(t, b) in &biases {
                    s.bias(t, b);
                }
            }
            for t in [3u32, 3, 7, 1, 1200] {
                fast.accept(t);
                reference.accept(t);
            }
            for _ in 0..6 {
                let want = reference_pick(&mut reference, &logits);
                prop_assert_eq!(fast.sample(&logits), want);
            }
        }
    }
}
