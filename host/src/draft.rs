//! Draft tokens for speculative decoding: guesses of the next few tokens that
//! one batched pass of the model then verifies ([`crate::engine::generate_from`]
//! with a [`Speculation`]).
//!
//! A draft only decides how much work one pass does, never what is generated:
//! each generated token is still sampled from the model's own logits, in order,
//! so a bad draft costs time, not tokens.
//!
//! [`NgramDrafter`] is prompt lookup (llama.cpp's `lookup` examples, Saxena's
//! "prompt lookup decoding"): where the last few tokens occurred before in the
//! prompt or the output, guess that what followed them then follows again. It
//! needs no second model and costs nothing when it has no guess; it pays where
//! the output copies from its context (code edits, summaries, extraction,
//! repetitive text).
//!
//! [`ModelDrafter`] asks a small model with the same vocabulary (llama.cpp's
//! `--model-draft`: Qwen3-0.6B for Qwen3-30B-A3B, say), all in RAM, for its
//! greedy continuation.
//!
//! [`NextnDrafter`] asks the model's own multi-token-prediction block
//! (qwen35moe's, MiniCPM-V 4.7's: llama.cpp's `draft-mtp`), which sees the
//! model's hidden states ([`Drafter::observe`]).

use std::collections::HashMap;

mod nextn;
pub use nextn::NextnDrafter;

use les_core::gemv::Isa;
use les_core::model::forward::{Place, TokenInput};

use crate::compute::ThreadedMatVec;
use crate::engine::{Checkpoint, Session, SwaCache};
use crate::model::Model;
use crate::sampling::{Sampler, SamplerConfig};
use crate::supply::{Schedule, SlotBudget, Supply};
use crate::tokenizer::Tokenizer;

/// Proposes tokens to follow a sequence.
pub trait Drafter {
    /// Writes up to `max` guesses of the tokens that follow `history` into
    /// `out` (cleared first; empty: no guess). `history` is the sequence so far,
    /// prompt then output; between calls it only grows (a shorter or different
    /// one starts over). Entries `>= n_vocab` stand for image embeddings.
    fn draft(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>);

    /// Whether it needs [`observe`](Self::observe)'s hidden states (a
    /// multi-token-prediction head does); the session then keeps them.
    fn wants_hidden(&self) -> bool {
        false
    }

    /// A new drafter of the same kind for another sequence (prompt lookup's
    /// index, a draft model's session, a multi-token-prediction block's
    /// cache), so that sequences decoded side by side each draft on their
    /// own (and each is shown its own sequence's positions); `None` where it
    /// cannot.
    fn fork<'a>(&self) -> Option<Box<dyn Drafter + 'a>>
    where
        Self: 'a,
    {
        None
    }

    /// Sees positions that the model evaluated and keeps: where each sat
    /// (`places`: its cache index and M-RoPE positions, consecutive indices),
    /// their inputs and final hidden states (before the output norm, `n_embd`
    /// floats each). Every kept position is seen once, in order, before the
    /// draft after it. Called only where [`wants_hidden`](Self::wants_hidden).
    fn observe(&mut self, places: &[Place], inputs: &[TokenInput<'_>], hidden: &[f32]) {
        let _ = (places, inputs, hidden);
    }
}

/// Most tokens an [`NgramDrafter`] matches on.
pub const MAX_NGRAM: usize = 8;

/// Prompt lookup: the latest earlier occurrence of the sequence's last `n`
/// tokens (the longest `n` from `max_n` down to `min_n` that occurred), and the
/// tokens that followed it.
///
/// An index of every n-gram's latest occurrence is kept up to date as the
/// history grows, so a draft costs `O(max_n)` lookups whatever the length of
/// the context.
pub struct NgramDrafter {
    min_n: usize,
    max_n: usize,
    /// For each length `n` (index `n - min_n`): n-gram -> the position just
    /// after its latest occurrence that has a token after it.
    index: Vec<HashMap<NgramKey, usize>>,
    /// Tokens of the history indexed so far.
    seen: usize,
    /// Its last tokens (up to [`CHECKED_TAIL`]): a history that does not end
    /// its first `seen` tokens with them is another one.
    tail: Vec<u32>,
}

/// An n-gram, padded with `u32::MAX`.
type NgramKey = [u32; MAX_NGRAM];

/// How many of the indexed tokens are compared to tell a grown history from
/// another one (comparing them all would cost the context's length a draft).
const CHECKED_TAIL: usize = 2 * MAX_NGRAM;

impl NgramDrafter {
    /// Matches on `min_n..=max_n` tokens, clamped to `1..=`[`MAX_NGRAM`].
    pub fn new(min_n: usize, max_n: usize) -> Self {
        let max_n = max_n.clamp(1, MAX_NGRAM);
        let min_n = min_n.clamp(1, max_n);
        NgramDrafter {
            min_n,
            max_n,
            index: (min_n..=max_n).map(|_| HashMap::new()).collect(),
            seen: 0,
            tail: Vec::new(),
        }
    }

    fn key(gram: &[u32]) -> NgramKey {
        let mut k = [u32::MAX; MAX_NGRAM];
        k[..gram.len()].copy_from_slice(gram);
        k
    }

    /// Indexes the n-grams of `history` that end before its last token (whose
    /// continuation is known) and were not indexed yet.
    fn catch_up(&mut self, history: &[u32]) {
        let grown = history.len() >= self.seen
            && history[self.seen - self.tail.len()..self.seen] == self.tail[..];
        if !grown {
            self.index.iter_mut().for_each(HashMap::clear);
            self.seen = 0;
        }
        for end in self.seen.max(1)..history.len() {
            // The n-grams ending at `end - 1`, followed by `history[end]`.
            for (i, n) in (self.min_n..=self.max_n).enumerate() {
                if let Some(start) = end.checked_sub(n) {
                    self.index[i].insert(Self::key(&history[start..end]), end);
                }
            }
        }
        self.seen = history.len();
        self.tail.clear();
        self.tail
            .extend_from_slice(&history[history.len().saturating_sub(CHECKED_TAIL)..]);
    }
}

impl Drafter for NgramDrafter {
    fn fork<'a>(&self) -> Option<Box<dyn Drafter + 'a>>
    where
        Self: 'a,
    {
        Some(Box::new(NgramDrafter::new(self.min_n, self.max_n)))
    }

    fn draft(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        self.catch_up(history);
        if max == 0 {
            return;
        }
        for n in (self.min_n..=self.max_n).rev() {
            let i = n - self.min_n;
            let Some(start) = history.len().checked_sub(n) else {
                continue;
            };
            if let Some(&next) = self.index[i].get(&Self::key(&history[start..])) {
                // `next < history.len()`: the guess may run into the suffix itself
                // (a repeating pattern continues).
                out.extend(history[next..].iter().take(max));
                return;
            }
        }
    }
}

/// A draft model's greedy continuation: [`Drafter`] over a second, small model
/// (resident) that shares the target's vocabulary.
///
/// Its session follows the history: the tokens it has evaluated are compared
/// with each new history, it goes back to where they part (a rejected draft;
/// [`Session::rewind`], the KV cache only) and evaluates the rest, then
/// drafts greedily one token a pass. A model with recurrent layers (LFM2,
/// Granite 4.0-H, ...), whose state cannot go back, keeps a
/// [`Checkpoint`] before the history's last token and goes back to it
/// (evaluating the accepted draft again), or to the start where the history
/// parts before it. Image embeddings in the history (another
/// model's space) are left out of what it sees. An error of the draft model
/// (it has its own context limit) ends its drafting, with a warning: drafts
/// never change the output.
pub struct ModelDrafter<'m> {
    model: &'m Model,
    /// Where the model was opened from, for [`Drafter::fork`]'s supply.
    path: std::path::PathBuf,
    threads: usize,
    session: Session<'m>,
    mv: ThreadedMatVec,
    experts: Supply<'m>,
    logits: Vec<f32>,
    /// The tokens the session has evaluated, in order.
    fed: Vec<u32>,
    /// The history's tokens, without embeddings (reused buffer).
    text: Vec<u32>,
    /// Picks the draft's tokens (the sampler's greedy rule: the highest
    /// logit, NaN as `-inf`, the lowest id among ties).
    greedy: Sampler,
    failed: bool,
    /// Whether the model has recurrent layers (its state cannot go back).
    recurrent: bool,
    /// Models with recurrent layers: the session before the history's last
    /// token, the furthest back it can go without starting over.
    checkpoint: Option<Checkpoint>,
}

impl<'m> ModelDrafter<'m> {
    /// A drafter over `model` (opened from `path`), for contexts of up to
    /// `ctx` positions, on `threads` threads.
    pub fn new(
        model: &'m Model,
        path: &std::path::Path,
        ctx: usize,
        threads: usize,
    ) -> Result<ModelDrafter<'m>, String> {
        let experts = Supply::new(
            model,
            path,
            Schedule::Resident,
            SlotBudget::none(crate::flash::FileDeviceConfig::default()),
        )?;
        // Every position of any sliding-window layers: the draft goes back to
        // wherever the main model's tokens part from its own.
        let mut session = Session::with_kv(model, ctx, Default::default(), SwaCache::Full)
            .map_err(|e| e.to_string())?;
        session
            .set_prefill_batch(crate::engine::DEFAULT_PREFILL_BATCH)
            .map_err(|e| e.to_string())?;
        Ok(ModelDrafter {
            model,
            path: path.to_path_buf(),
            threads,
            session,
            mv: ThreadedMatVec::new(threads, Isa::detect()),
            experts,
            logits: vec![0f32; model.hp.n_vocab],
            fed: Vec::new(),
            text: Vec::new(),
            greedy: Sampler::new(SamplerConfig::greedy()),
            failed: false,
            recurrent: model.hybrid.linear.is_some(),
            checkpoint: None,
        })
    }

    fn try_draft(&mut self, max: usize, out: &mut Vec<u32>) -> Result<(), String> {
        let n_vocab = self.logits.len();
        let common = self
            .fed
            .iter()
            .zip(&self.text)
            .take_while(|(a, b)| a == b)
            .count();
        // The last history token is evaluated again when nothing is new, for
        // its logits.
        let mut keep = common.min(self.text.len().saturating_sub(1));
        let e = |e: les_core::model::forward::ForwardError<_>| format!("the draft model: {e}");
        if self.recurrent {
            // A recurrent state goes back only to the checkpoint (or to 0).
            keep = match &self.checkpoint {
                _ if keep == self.session.position() => keep,
                Some(c) if c.position() <= keep => {
                    self.session.restore(c)?;
                    c.position()
                }
                _ => {
                    self.session.rewind(0)?;
                    0
                }
            };
            // Up to the history's last token (`keep` is at most there), a
            // checkpoint, then that token.
            let last = self.text.len() - 1;
            if keep < last {
                self.eval(keep..last).map_err(e)?;
                keep = last;
            }
            match &mut self.checkpoint {
                Some(c) => self.session.checkpoint_into(c),
                None => self.checkpoint = Some(self.session.checkpoint()),
            }
        } else {
            self.session.rewind(keep)?;
        }
        self.fed.truncate(keep);
        self.eval(keep..self.text.len()).map_err(e)?;
        self.fed.extend_from_slice(&self.text[keep..]);
        while out.len() < max {
            let next = self.greedy.sample(&self.logits[..n_vocab]);
            out.push(next);
            if out.len() == max || self.session.position() >= self.session.max_positions() {
                break;
            }
            self.session
                .eval(
                    &mut self.mv,
                    &mut self.experts,
                    None,
                    TokenInput::Token(next),
                    &mut self.logits,
                )
                .map_err(e)?;
            self.fed.push(next);
        }
        Ok(())
    }
}

impl ModelDrafter<'_> {
    /// Evaluates the history's tokens `range` at the next positions (its
    /// logits those of the last).
    fn eval(
        &mut self,
        range: std::ops::Range<usize>,
    ) -> Result<(), les_core::model::forward::ForwardError<crate::supply::SupplyError>> {
        let new: Vec<TokenInput<'_>> = self.text[range]
            .iter()
            .map(|&t| TokenInput::Token(t))
            .collect();
        crate::engine::prefill(
            &mut self.session,
            &mut self.mv,
            &mut self.experts,
            None,
            &new,
            &mut self.logits,
        )
    }
}

impl Drafter for ModelDrafter<'_> {
    /// A drafter over the same model (its weights shared), with a session
    /// and threads of its own; `None` where they cannot be had.
    fn fork<'a>(&self) -> Option<Box<dyn Drafter + 'a>>
    where
        Self: 'a,
    {
        let ctx = self.session.max_positions();
        match ModelDrafter::new(self.model, &self.path, ctx, self.threads) {
            Ok(d) => Some(Box::new(d)),
            Err(e) => {
                note!("les: a second draft model session: {e}");
                None
            }
        }
    }

    fn draft(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        if self.failed || max == 0 {
            return;
        }
        let n_vocab = self.logits.len() as u32;
        self.text.clear();
        self.text
            .extend(history.iter().copied().filter(|&t| t < n_vocab));
        if self.text.is_empty() {
            return;
        }
        if let Err(e) = self.try_draft(max, out) {
            note!("les: {e}; drafting stops");
            self.failed = true;
            out.clear();
        }
    }
}

/// Whether `draft` can draft for `target`: the same kind of tokenizer, the same
/// BOS and EOS, no more tokens, and every token of the draft's the target's
/// (llama.cpp's `common_speculative_are_compatible` checks the same).
pub fn check_compatible(target: &Tokenizer, draft: &Tokenizer) -> Result<(), String> {
    if target.kind() != draft.kind() {
        return Err(format!(
            "the draft model's tokenizer is {:?}, the model's {:?}",
            draft.kind(),
            target.kind()
        ));
    }
    if target.bos() != draft.bos() || target.eos() != draft.eos() {
        return Err("the draft model's BOS or EOS token differs from the model's".into());
    }
    if draft.n_vocab() > target.n_vocab() {
        return Err(format!(
            "the draft model has {} tokens, more than the model's {}",
            draft.n_vocab(),
            target.n_vocab()
        ));
    }
    for id in 0..draft.n_vocab() as u32 {
        if target.token_text(id) != draft.token_text(id) {
            return Err(format!(
                "token {id} is {:?} in the draft model and {:?} in the model",
                draft.token_text(id).unwrap_or(""),
                target.token_text(id).unwrap_or("")
            ));
        }
    }
    Ok(())
}

/// Most draft tokens one pass verifies (`--draft-max`).
pub const MAX_DRAFT: usize = 64;

/// Where `les run` and `les bench` take draft tokens from ([`NgramDrafter`],
/// [`ModelDrafter`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftSource {
    /// No speculative decoding: one token a pass.
    None,
    /// Prompt lookup: what followed an earlier occurrence of the last tokens.
    Ngram,
    /// The greedy continuation of the --model-draft model.
    Model,
    /// The model's own multi-token-prediction block (qwen35moe, qwen3next, glm4moe).
    Mtp,
}

/// Speculative decoding options of `les run` and `les bench`.
#[derive(Clone, Debug, clap::Args)]
pub struct SpecArgs {
    /// Speculative decoding: `ngram` guesses the next tokens from an earlier
    /// occurrence of the last ones in the prompt or output (prompt lookup),
    /// `model` asks the --model-draft model, `mtp` the model's own
    /// multi-token-prediction block (qwen35moe, qwen3next, glm4moe), and the guess is checked in one
    /// pass, which reads each layer's experts once for all of it; `none`
    /// decodes one token a pass. The tokens and logits are the same either way.
    /// Default: `model` with --model-draft, else `none`.
    #[arg(long, value_enum)]
    pub speculate: Option<DraftSource>,
    /// A small model with the same vocabulary to draft with (`--speculate
    /// model`; resident, attention only).
    #[arg(long = "model-draft", visible_alias = "md", value_name = "GGUF")]
    pub model_draft: Option<std::path::PathBuf>,
    /// Most draft tokens checked in one pass [default: 8].
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=MAX_DRAFT as i64))]
    pub draft_max: Option<u8>,
    /// Shortest run of tokens `--speculate ngram` matches on [default: 2].
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=MAX_NGRAM as i64))]
    pub ngram_min: Option<u8>,
    /// Longest run of tokens `--speculate ngram` matches on (the longest that
    /// occurred wins) [default: 4].
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=MAX_NGRAM as i64))]
    pub ngram_max: Option<u8>,
    /// Verify every draft whole. By default a draft is cut to the length that
    /// pays by the acceptance and pass times measured so far (none while the
    /// guesses are poor).
    #[arg(long)]
    pub draft_fixed: bool,
}

impl SpecArgs {
    /// Where drafts come from (`--speculate`, or `model` with `--model-draft`).
    pub fn source(&self) -> DraftSource {
        match (self.speculate, &self.model_draft) {
            (Some(s), _) => s,
            (None, Some(_)) => DraftSource::Model,
            (None, None) => DraftSource::None,
        }
    }

    /// Most draft tokens one pass verifies (`--draft-max`, default 8).
    pub fn draft_max(&self) -> u8 {
        self.draft_max.unwrap_or(8)
    }

    /// The n-gram lengths `--speculate ngram` matches on (default 2 to 4).
    pub fn ngram_range(&self) -> (u8, u8) {
        (self.ngram_min.unwrap_or(2), self.ngram_max.unwrap_or(4))
    }

    /// Refuses options that would be ignored: drafting options without
    /// speculative decoding, n-gram lengths without `--speculate ngram`, and
    /// `--ngram-min` above `--ngram-max`.
    pub fn check(&self) -> Result<(), String> {
        let source = self.source();
        let ngram = self.ngram_min.is_some() || self.ngram_max.is_some();
        if source != DraftSource::Ngram && ngram {
            return Err("--ngram-min and --ngram-max size the guesses of --speculate ngram, which is not on".into());
        }
        if source == DraftSource::None && (self.draft_max.is_some() || self.draft_fixed) {
            return Err(
                "--draft-max and --draft-fixed shape speculative decoding, which is not on \
                 (--speculate ngram or mtp, or --model-draft)"
                    .into(),
            );
        }
        let (min, max) = self.ngram_range();
        if min > max {
            return Err(format!("--ngram-min {min} is more than --ngram-max {max}"));
        }
        Ok(())
    }

    /// The draft model these options name, opened and checked against the
    /// target's tokenizer (`None` unless drafting from a model). The options
    /// are [`check`](Self::check)ed first.
    pub fn open_draft_model(&self, target: &Tokenizer) -> Result<Option<Model>, String> {
        self.check()?;
        match (self.source(), &self.model_draft) {
            (DraftSource::Model, Some(path)) => {
                let m = Model::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
                let t = Tokenizer::from_gguf(m.gguf())
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                check_compatible(target, &t)
                    .map_err(|e| format!("--model-draft {}: {e}", path.display()))?;
                Ok(Some(m))
            }
            (DraftSource::Model, None) => Err("--speculate model needs --model-draft".into()),
            (_, Some(_)) => Err("--model-draft needs --speculate model (or no --speculate)".into()),
            _ => Ok(None),
        }
    }

    /// The drafter these options ask for, if any: `target` is the model
    /// (opened from `target_path`), `draft` what
    /// [`open_draft_model`](Self::open_draft_model) returned, `ctx` the
    /// session's positions.
    pub fn drafter<'m>(
        &self,
        target: &'m Model,
        target_path: &std::path::Path,
        draft: Option<&'m Model>,
        ctx: usize,
        threads: usize,
    ) -> Result<Option<Box<dyn Drafter + 'm>>, String> {
        Ok(match (self.source(), draft) {
            (DraftSource::Mtp, _) => Some(Box::new(NextnDrafter::new(
                target,
                target_path,
                ctx,
                threads,
            )?)),
            (DraftSource::None, _) => None,
            (DraftSource::Ngram, _) => {
                let (min, max) = self.ngram_range();
                Some(Box::new(NgramDrafter::new(min as usize, max as usize)))
            }
            (DraftSource::Model, Some(m)) => {
                let path = self.model_draft.as_deref().ok_or("--model-draft")?;
                Some(Box::new(ModelDrafter::new(m, path, ctx, threads)?))
            }
            (DraftSource::Model, None) => {
                return Err("--speculate model needs --model-draft".into())
            }
        })
    }
}

/// Speculative decoding settings for [`crate::engine::generate_from`].
pub struct Speculation<'d> {
    /// Where the guesses come from.
    pub drafter: &'d mut dyn Drafter,
    /// Most guesses verified in one pass (0: none, plain decoding).
    pub max_draft: usize,
    /// Verify as many of a draft's tokens as measured acceptance and pass costs
    /// say pay (none where guesses are poor), instead of every one.
    pub adaptive: bool,
    /// The tokens the session evaluated before the prompt `generate_from` is
    /// given (the drafter sees them before it), if any.
    pub context: &'d [u32],
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(d: &mut NgramDrafter, h: &[u32], max: usize) -> Vec<u32> {
        let mut out = vec![99];
        d.draft(h, max, &mut out);
        out
    }

    #[test]
    fn a_fork_drafts_for_its_own_sequence() {
        let mut d = NgramDrafter::new(2, 3);
        let a = [1, 2, 3, 9, 1, 2];
        assert_eq!(draft(&mut d, &a, 2), [3, 9]);
        // A fork matches the same lengths over its own history, from
        // nothing of the first one's.
        let mut f = d.fork().expect("prompt lookup forks");
        let b = [5, 6, 7, 1, 2];
        let mut out = vec![99];
        f.draft(&b, 2, &mut out);
        assert!(out.is_empty(), "{out:?}");
        f.draft(&[5, 6, 7, 5, 6], 4, &mut out);
        assert_eq!(out, [7, 5, 6]);
        f.draft(&[4, 1, 4], 2, &mut out);
        assert!(out.is_empty(), "a fork matches 2 tokens at least: {out:?}");
        // The first one goes on with its own.
        assert_eq!(draft(&mut d, &[1, 2, 3, 9, 1, 2, 3], 1), [9]);
    }

    #[test]
    fn guesses_what_followed_the_latest_match() {
        let mut d = NgramDrafter::new(1, 3);
        // "1 2 3" occurred twice; the latest one was followed by 7 8.
        let h = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3];
        assert_eq!(draft(&mut d, &h, 2), [7, 8]);
        assert_eq!(draft(&mut d, &h, 10), [7, 8, 9, 1, 2, 3]);
        // The history grows: 3 4 matches the first occurrence's 3 4.
        let mut h2 = h.to_vec();
        h2.push(4);
        assert_eq!(draft(&mut d, &h2, 3), [5, 1, 2]);
    }

    #[test]
    fn the_longest_match_wins() {
        let mut d = NgramDrafter::new(1, 3);
        // Unigram 3 last occurred before 6; the trigram 1 2 3 before 4.
        let h = [1, 2, 3, 4, 9, 3, 6, 1, 2, 3];
        assert_eq!(draft(&mut d, &h, 1), [4]);
        let mut d = NgramDrafter::new(1, 1);
        assert_eq!(draft(&mut d, &h, 1), [6]);
    }

    #[test]
    fn no_guess_without_a_match_or_room() {
        let mut d = NgramDrafter::new(2, 3);
        assert!(draft(&mut d, &[], 4).is_empty());
        assert!(draft(&mut d, &[5], 4).is_empty());
        assert!(draft(&mut d, &[1, 2, 3, 4], 4).is_empty());
        // The suffix itself is not a match (nothing follows it yet).
        assert!(draft(&mut d, &[1, 2, 3, 1, 2], 0).is_empty());
        assert_eq!(draft(&mut d, &[1, 2, 3, 1, 2], 4), [3, 1, 2]);
    }

    #[test]
    fn a_repeating_pattern_continues_into_the_suffix() {
        let mut d = NgramDrafter::new(2, 2);
        assert_eq!(draft(&mut d, &[5, 6, 5, 6], 5), [5, 6]);
    }

    #[test]
    fn another_history_starts_over() {
        let mut d = NgramDrafter::new(1, 2);
        assert_eq!(draft(&mut d, &[1, 2, 1], 1), [2]);
        assert!(draft(&mut d, &[3, 4, 1], 1).is_empty());
        assert_eq!(draft(&mut d, &[3, 4, 1, 3], 2), [4, 1]);
    }

    /// Incremental indexing finds what a plain scan of the whole history finds.
    #[test]
    fn the_index_equals_a_plain_scan() {
        let mut rng = 12345u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % 5) as u32
        };
        let mut d = NgramDrafter::new(2, 4);
        let mut h = Vec::new();
        for _ in 0..400 {
            h.push(next());
            let got = draft(&mut d, &h, 6);
            let mut want: Vec<u32> = Vec::new();
            'n: for n in (2..=4).rev() {
                if h.len() < n {
                    continue;
                }
                let suffix = &h[h.len() - n..];
                for end in (n..h.len()).rev() {
                    if &h[end - n..end] == suffix {
                        want.extend(h[end..].iter().take(6));
                        break 'n;
                    }
                }
            }
            assert_eq!(got, want, "history {h:?}");
        }
    }
}
