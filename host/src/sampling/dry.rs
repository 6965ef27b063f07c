//! DRY ("don't repeat yourself"), llama.cpp's penalty on tokens that would
//! extend a repetition of the recent text (`llama_sampler_dry_apply`).
//!
//! Over the last `last_n` accepted tokens (the prompt's included): for each
//! earlier place where the text just before it equals the text that ends
//! now, for `n >= allowed_length` tokens, the token that came next there
//! would extend the repetition to `n + 1`; its logit loses
//! `multiplier * base^(n - allowed_length)` for the longest such `n`.
//! Sequence breakers (by default a line break, `:`, `"` and `*`) stop a
//! repetition: the matched length is at most the distance back to the most
//! recent breaker, and a token that is a breaker by itself is never
//! penalized. A breaker string becomes token sequences as llama.cpp makes
//! them: every token whose text contains it is a breaker by itself, and
//! every token whose text ends with a start of it is the head of a breaker
//! whose tail is the rest of the string, tokenized (at most
//! [`MAX_TAIL_TOKENS`] tokens).
//!
//! The lengths of the repeated suffixes come from the Z-function of the
//! recent tokens read backwards, as in llama.cpp: linear in `last_n`.

use std::collections::{BTreeMap, VecDeque};

use crate::tokenizer::Tokenizer;

/// Longest breaker string llama.cpp keeps (bytes; longer ones are cut).
pub const MAX_BREAKER_BYTES: usize = 40;
/// Most tokens of a breaker's tail (after its head token).
pub const MAX_TAIL_TOKENS: usize = 20;
/// Most breaker strings.
pub const MAX_BREAKERS: usize = 64;

/// llama.cpp's default breakers.
pub const DEFAULT_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

/// DRY's settings, as llama.cpp's `--dry-*` options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrySettings {
    /// Scale of the penalty; 0 is off.
    pub multiplier: f32,
    /// Base of its growth with the repeated length; below 1 is off.
    pub base: f32,
    /// Repeats up to this long go unpenalized.
    pub allowed_length: usize,
    /// Tokens looked back over (the model's context where llama.cpp says -1).
    pub last_n: usize,
}

impl DrySettings {
    /// Whether it changes anything.
    pub fn enabled(&self) -> bool {
        self.multiplier != 0.0 && self.base >= 1.0 && self.last_n != 0
    }
}

/// DRY's state: its settings, the breakers and the recent tokens.
#[derive(Clone, Debug)]
pub struct Dry {
    settings: DrySettings,
    /// Breakers by head token: their tails (an empty tail: the head alone).
    breakers: BTreeMap<u32, Vec<Vec<u32>>>,
    /// The last `last_n` accepted tokens, most recent last.
    recent: VecDeque<u32>,
}

impl Dry {
    /// DRY with breakers given as token sequences (head, then tail).
    pub fn with_token_breakers(settings: DrySettings, breakers: &[Vec<u32>]) -> Dry {
        let mut map: BTreeMap<u32, Vec<Vec<u32>>> = BTreeMap::new();
        for b in breakers {
            if let Some((&head, tail)) = b.split_first() {
                let tails = map.entry(head).or_default();
                if !tails.iter().any(|t| t == tail) {
                    tails.push(tail.to_vec());
                }
            }
        }
        Dry {
            settings,
            breakers: map,
            recent: VecDeque::new(),
        }
    }

    /// DRY with breaker strings turned into token sequences over
    /// `tokenizer`'s vocabulary (see the [module docs](self)). At most
    /// [`MAX_BREAKERS`] strings; empty ones are skipped, longer than
    /// [`MAX_BREAKER_BYTES`] are cut (at a character boundary).
    pub fn new(settings: DrySettings, breakers: &[String], tokenizer: &Tokenizer) -> Dry {
        let mut seqs: Vec<Vec<u32>> = Vec::new();
        if settings.enabled() {
            let cut: Vec<&str> = breakers
                .iter()
                .take(MAX_BREAKERS)
                .map(|b| {
                    let mut end = b.len().min(MAX_BREAKER_BYTES);
                    while !b.is_char_boundary(end) {
                        end -= 1;
                    }
                    &b[..end]
                })
                .filter(|b| !b.is_empty())
                .collect();
            breaker_sequences(&cut, tokenizer, &mut seqs);
        }
        Dry::with_token_breakers(settings, &seqs)
    }

    /// Records an accepted token.
    pub fn accept(&mut self, token: u32) {
        if !self.settings.enabled() {
            return;
        }
        while self.recent.len() >= self.settings.last_n {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }

    /// Forgets the recent tokens.
    pub fn clear(&mut self) {
        self.recent.clear();
    }

    /// The tokens to penalize and by how much (to subtract from the logit),
    /// sorted by token.
    pub fn penalties(&self) -> Vec<(u32, f64)> {
        let s = self.settings;
        let n = self.recent.len();
        if !s.enabled() || n <= s.allowed_length {
            return Vec::new();
        }
        // Read backwards: r[0] is the last token.
        let r: Vec<u32> = self.recent.iter().rev().copied().collect();
        // The repeat may not reach back past the most recent breaker.
        let mut limit = n;
        for i in 0..n {
            let Some(tails) = self.breakers.get(&r[i]) else {
                continue;
            };
            let mut longest: Option<usize> = None;
            for tail in tails {
                let len = tail.len();
                if len <= i
                    && longest.is_none_or(|l| len > l)
                    && tail.iter().enumerate().all(|(k, &t)| r[i - k - 1] == t)
                {
                    longest = Some(len);
                }
            }
            if let Some(l) = longest {
                limit = i - l;
                break;
            }
        }
        if limit < s.allowed_length {
            return Vec::new();
        }
        let z = z_function(&r);
        // The longest repeat each token would extend.
        let mut longest: BTreeMap<u32, usize> = BTreeMap::new();
        for k in 1..n {
            let len = z[k].min(limit);
            if len >= s.allowed_length {
                let next = r[k - 1];
                let e = longest.entry(next).or_insert(0);
                *e = (*e).max(len);
            }
        }
        let base = f64::from(s.base);
        // llama.cpp keeps base^exp below f32::MAX.
        let max_exp = if s.base > 1.000_001 {
            (88.722_839_1_f64 / libm::log(base)) as usize
        } else {
            0
        };
        longest
            .into_iter()
            .filter(|(t, _)| {
                !self
                    .breakers
                    .get(t)
                    .is_some_and(|tails| tails.iter().any(Vec::is_empty))
            })
            .map(|(t, len)| {
                let mut exp = len - s.allowed_length;
                if max_exp > 0 {
                    exp = exp.min(max_exp);
                }
                let exp = i32::try_from(exp).unwrap_or(i32::MAX);
                (t, f64::from(s.multiplier) * libm::pow(base, f64::from(exp)))
            })
            .collect()
    }
}

/// `z[k]`: the length of the longest common prefix of `s` and `s[k..]`
/// (`z[0] = s.len()`).
fn z_function(s: &[u32]) -> Vec<usize> {
    let n = s.len();
    let mut z = vec![0; n];
    if n == 0 {
        return z;
    }
    z[0] = n;
    let (mut l, mut r) = (0, 0);
    for k in 1..n {
        let mut len = if k < r { z[k - l].min(r - k) } else { 0 };
        while k + len < n && s[len] == s[k + len] {
            len += 1;
        }
        if k + len > r {
            l = k;
            r = k + len;
        }
        z[k] = len;
    }
    z
}

/// Adds the token sequences of the breaker strings (as llama.cpp's
/// `get_overlapping_token_sequences`, each token's text read once).
fn breaker_sequences(breakers: &[&str], tokenizer: &Tokenizer, out: &mut Vec<Vec<u32>>) {
    if breakers.is_empty() {
        return;
    }
    // Each breaker's tail after its first `i` bytes, tokenized once (`None`
    // where `i` is not a character boundary: the tokenizer takes text).
    let tails: Vec<Vec<Option<Vec<u32>>>> = breakers
        .iter()
        .map(|b| {
            (0..b.len())
                .map(|i| {
                    let tail = b.get(i..)?;
                    let mut t = tokenizer.encode(tail, false, false);
                    t.truncate(MAX_TAIL_TOKENS);
                    Some(t)
                })
                .collect()
        })
        .collect();
    let n_vocab = u32::try_from(tokenizer.n_vocab()).unwrap_or(u32::MAX);
    for id in 0..n_vocab {
        // The token's text as llama.cpp's `detokenize` gives it (special
        // tokens written out, the space prefix dropped).
        let word = tokenizer.decode_with(&[id], true).into_bytes();
        for (b, tails) in breakers.iter().zip(&tails) {
            let bb = b.as_bytes();
            if word.windows(bb.len()).any(|w| w == bb) {
                out.push(vec![id]);
                continue;
            }
            // Each place where the word ends with a start of `b`: the rest
            // of the breaker is the tail.
            for pos in 0..word.len() {
                let rest = &word[pos..];
                if rest.len() < bb.len() && bb.starts_with(rest) {
                    if let Some(tail) = &tails[rest.len()] {
                        let mut seq = vec![id];
                        seq.extend_from_slice(tail);
                        out.push(seq);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn settings(allowed_length: usize) -> DrySettings {
        DrySettings {
            multiplier: 0.5,
            base: 1.75,
            allowed_length,
            last_n: 1000,
        }
    }

    fn dry(tokens: &[u32], breakers: &[Vec<u32>], allowed: usize) -> Vec<(u32, f64)> {
        let mut d = Dry::with_token_breakers(settings(allowed), breakers);
        for &t in tokens {
            d.accept(t);
        }
        d.penalties()
    }

    #[test]
    fn the_token_after_an_earlier_occurrence_of_the_ending_is_penalized() {
        // a b c d ... a b c: d would make "a b c" "a b c d" again.
        let p = dry(&[1, 2, 3, 4, 9, 9, 1, 2, 3], &[], 2);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].0, 4);
        // Repeat of 3, allowed 2: 0.5 * 1.75^1.
        assert!((p[0].1 - 0.5 * 1.75).abs() < 1e-12);
        // A repeat as long as the allowed length is penalized, a shorter not.
        assert_eq!(dry(&[1, 2, 3, 4, 9, 9, 1, 2, 3], &[], 3)[0].0, 4);
        assert!(dry(&[1, 2, 3, 4, 9, 9, 1, 2, 3], &[], 4).is_empty());
    }

    #[test]
    fn breakers_cut_the_repeat_and_are_never_penalized() {
        // llama.cpp's example: a b c c b c y a b c; the last three also end
        // at the first c, so c (after it) gets the repeat of 3, and y (after
        // "b c") 2.
        let toks = [1, 2, 3, 3, 2, 3, 7, 1, 2, 3];
        let p: BTreeMap<u32, f64> = dry(&toks, &[], 2).into_iter().collect();
        assert!((p[&3] - 0.5 * 1.75).abs() < 1e-12);
        assert!((p[&7] - 0.5).abs() < 1e-12);
        // y (7) as a breaker: repeats reach back 3 tokens at most (to it),
        // which "a b c" fits; y itself is not penalized.
        let p = dry(&toks, &[vec![7]], 2);
        let p: BTreeMap<u32, f64> = p.into_iter().collect();
        assert!((p[&3] - 0.5 * 1.75).abs() < 1e-12);
        assert!(!p.contains_key(&7), "a breaker is not penalized");
        // A breaker right before the end: nothing repeats.
        assert!(dry(&toks, &[vec![2, 3]], 2).is_empty());
    }

    /// The repeat lengths of a plain quadratic search.
    fn naive(tokens: &[u32], limit: usize, allowed: usize) -> BTreeMap<u32, usize> {
        let n = tokens.len();
        let mut out: BTreeMap<u32, usize> = BTreeMap::new();
        // An earlier position j (the token after it is tokens[j + 1]).
        for j in 0..n.saturating_sub(1) {
            let mut len = 0;
            while len <= j && tokens[j - len] == tokens[n - 1 - len] {
                len += 1;
            }
            let len = len.min(limit);
            if len >= allowed {
                let e = out.entry(tokens[j + 1]).or_insert(0);
                *e = (*e).max(len);
            }
        }
        out
    }

    proptest! {
        #[test]
        fn penalties_follow_the_longest_repeat(
            tokens in prop::collection::vec(0u32..4, 0..60),
            allowed in 1usize..4,
        ) {
            let mut d = Dry::with_token_breakers(settings(allowed), &[]);
            for &t in &tokens {
                d.accept(t);
            }
            let got: BTreeMap<u32, f64> = d.penalties().into_iter().collect();
            let want = if tokens.len() <= allowed {
                BTreeMap::new()
            } else {
                naive(&tokens, tokens.len(), allowed)
            };
            prop_assert_eq!(got.len(), want.len());
            for (t, len) in want {
                let p = 0.5 * 1.75f64.powi((len - allowed) as i32);
                prop_assert!((got[&t] - p).abs() < 1e-9 * p, "{} {} {}", t, got[&t], p);
            }
        }

        #[test]
        fn z_function_is_the_longest_common_prefix(s in prop::collection::vec(0u32..3, 0..40)) {
            let z = z_function(&s);
            for k in 0..s.len() {
                let lcp = s.iter().zip(&s[k..]).take_while(|(a, b)| a == b).count();
                prop_assert_eq!(z[k], lcp);
            }
        }
    }
}
