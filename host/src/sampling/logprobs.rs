//! Log probabilities of a position's tokens, as llama-server's `n_probs` and
//! OpenAI's `logprobs` report them: the softmax of the model's logits at
//! temperature 1, before any sampler (bias, penalties, filters, grammar).
//!
//! The arithmetic is the sampler's: logits read as it reads them (NaN as
//! `-inf`, `+inf` as `f32::MAX`), `f64` with [`libm`], and the most likely
//! tokens ordered by logit, then id (a total order: no ties to break).

use super::clean;

/// One token's log probability (natural logarithm; `-inf` where its
/// probability is 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub id: u32,
    /// `ln p`.
    pub logprob: f32,
}

/// The log probabilities at one position: the token taken there and the
/// most likely ones.
#[derive(Clone, Debug, PartialEq)]
pub struct PositionLogprobs {
    /// The token taken (sampled or not, whatever its rank).
    pub token: TokenLogprob,
    /// The most likely tokens, most likely first (logit descending, then id).
    pub top: Vec<TokenLogprob>,
}

/// The log probability of `token` under `logits` and the `top` most likely
/// tokens' (fewer where the vocabulary is smaller). A `token` outside
/// `logits` gets `-inf`.
pub fn log_probs(logits: &[f32], token: u32, top: usize) -> PositionLogprobs {
    let max = logits
        .iter()
        .map(|&l| clean(l))
        .fold(f64::NEG_INFINITY, f64::max);
    // ln of the softmax's denominator; -inf where every logit is.
    let norm = if max == f64::NEG_INFINITY {
        f64::INFINITY
    } else {
        let sum: f64 = logits.iter().map(|&l| libm::exp(clean(l) - max)).sum();
        max + libm::log(sum)
    };
    let of = |id: u32| TokenLogprob {
        id,
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| (clean(l) - norm) as f32),
    };
    let by_rank = |a: &u32, b: &u32| {
        clean(logits[*b as usize])
            .total_cmp(&clean(logits[*a as usize]))
            .then(a.cmp(b))
    };
    let top = top.min(logits.len());
    let mut ids: Vec<u32> = Vec::new();
    if top > 0 {
        ids = (0..logits.len() as u32).collect();
        ids.select_nth_unstable_by(top - 1, by_rank);
        ids.truncate(top);
        ids.sort_unstable_by(by_rank);
    }
    PositionLogprobs {
        token: of(token),
        top: ids.into_iter().map(of).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn log_probs_are_the_softmax_at_temperature_one() {
        // p = 1/6, 2/6, 3/6.
        let logits = [0.0, 2f32.ln(), 3f32.ln()];
        let p = log_probs(&logits, 0, 2);
        assert!((p.token.logprob - (1.0f32 / 6.0).ln()).abs() < 1e-6);
        assert_eq!(p.top.iter().map(|t| t.id).collect::<Vec<_>>(), [2, 1]);
        assert!((p.top[0].logprob - 0.5f32.ln()).abs() < 1e-6);
        assert!((p.top[1].logprob - (1.0f32 / 3.0).ln()).abs() < 1e-6);
        // Shifting every logit changes nothing.
        let shifted = logits.map(|l| l + 100.0);
        let q = log_probs(&shifted, 0, 2);
        assert!((q.token.logprob - p.token.logprob).abs() < 1e-5);
    }

    #[test]
    fn ties_go_to_the_lower_id_and_top_is_bounded_by_the_vocabulary() {
        let p = log_probs(&[1.0, 3.0, 3.0, 1.0], 3, 10);
        let ids: Vec<u32> = p.top.iter().map(|t| t.id).collect();
        assert_eq!(ids, [1, 2, 0, 3]);
        assert_eq!(p.top[3], p.token);
        assert!(log_probs(&[1.0, 2.0], 0, 0).top.is_empty());
    }

    #[test]
    fn impossible_tokens_and_odd_logits_get_minus_infinity() {
        let p = log_probs(&[f32::NEG_INFINITY, 0.0, f32::NAN], 0, 3);
        assert_eq!(p.token.logprob, f32::NEG_INFINITY);
        assert_eq!(
            p.top[0],
            TokenLogprob {
                id: 1,
                logprob: 0.0
            }
        );
        assert_eq!(p.top[2].logprob, f32::NEG_INFINITY);
        assert_eq!(log_probs(&[0.0], 7, 1).token.logprob, f32::NEG_INFINITY);
        let none = log_probs(&[f32::NEG_INFINITY; 3], 1, 1);
        assert_eq!(none.token.logprob, f32::NEG_INFINITY);
        assert!(log_probs(&[], 0, 5).top.is_empty());
        // +inf reads as the largest float: finite log probabilities.
        let inf = log_probs(&[f32::INFINITY, 0.0], 0, 1);
        assert_eq!(inf.token.logprob, 0.0);
    }

    proptest! {
        #[test]
        fn the_probabilities_add_up_and_top_is_the_most_likely(
            logits in prop::collection::vec(-50f32..50.0, 1..200),
            token in 0u32..220,
            top in 0usize..30,
        ) {
            let all = log_probs(&logits, token, logits.len());
            let mass: f64 = all.top.iter().map(|t| (t.logprob as f64).exp()).sum();
            prop_assert!((mass - 1.0).abs() < 1e-4, "mass {mass}");
            let p = log_probs(&logits, token, top);
            prop_assert_eq!(p.top.len(), top.min(logits.len()));
            prop_assert_eq!(&p.top[..], &all.top[..p.top.len()]);
            for w in all.top.windows(2) {
                prop_assert!(w[0].logprob >= w[1].logprob);
            }
            match all.top.iter().find(|t| t.id == token) {
                Some(t) => prop_assert_eq!(*t, p.token),
                None => prop_assert_eq!(p.token.logprob, f32::NEG_INFINITY),
            }
        }
    }
}
