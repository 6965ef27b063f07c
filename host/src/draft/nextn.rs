//! [`NextnDrafter`]: drafts from the model's own multi-token-prediction block
//! (llama.cpp's `draft-mtp` for qwen35moe, qwen3next and glm4moe).

use les_core::gemv::Isa;
use les_core::model::forward::nextn::{cache_params, forward_nextn_at, NextnBlock};
use les_core::model::forward::{KvCache, Place, Scratch, TokenInput, Weights};
use les_core::model::ops::rms_norm;

use super::Drafter;
use crate::compute::ThreadedMatVec;
use crate::model::Model;
use crate::sampling::{Sampler, SamplerConfig};
use crate::supply::{Schedule, SlotBudget, Supply};

/// Drafts with the model's multi-token-prediction (nextn) block: given the
/// main model's hidden state at the last kept position and the token sampled
/// after it, the block guesses the next token; its own hidden state and that
/// guess give the one after, and so on (greedy, as llama.cpp's `draft-mtp`).
///
/// The block has its own one-layer KV cache, filled from every position the
/// model keeps ([`Drafter::observe`]: the prompt's included, so a long prompt
/// costs one more layer's pass over it). Its routed experts are read in the
/// mapped file, resident, whatever the main model's schedule: one layer's
/// worth. An error ends its drafting with a warning: drafts never change the
/// output.
pub struct NextnDrafter<'m> {
    model: &'m Model,
    /// Where the model was opened from, and the threads, for
    /// [`Drafter::fork`].
    path: std::path::PathBuf,
    threads: usize,
    block: NextnBlock<'m>,
    mv: ThreadedMatVec,
    experts: Supply<'m>,
    kv_k: Vec<f32>,
    kv_v: Vec<f32>,
    scratch: Vec<f32>,
    cat: Vec<f32>,
    /// The main model's normed hidden state at `pos - 1` (zeros before any).
    h_prev: Vec<f32>,
    /// The block's hidden state out, and the one drafting goes on from.
    h_out: Vec<f32>,
    h_draft: Vec<f32>,
    logits: Vec<f32>,
    /// The next position the block has not seen a kept input of.
    pos: usize,
    /// The temporal M-RoPE position of the text after the last one seen
    /// (the index but after an image of a model with sections): drafted
    /// tokens go on from it, as the main model places them.
    next_t: u32,
    max_positions: usize,
    greedy: Sampler,
    failed: bool,
}

impl<'m> NextnDrafter<'m> {
    /// A drafter over `model`'s nextn block (the model opened from `path`), for
    /// contexts of up to `ctx` positions, on `threads` threads. Refuses a model
    /// without one.
    pub fn new(
        model: &'m Model,
        path: &std::path::Path,
        ctx: usize,
        threads: usize,
    ) -> Result<NextnDrafter<'m>, String> {
        if let Some(e) = model.nextn_error() {
            return Err(format!(
                "the model's multi-token-prediction block cannot draft: {e}"
            ));
        }
        let block = model.nextn_block().ok_or_else(|| {
            format!(
                "the model ({}) has no multi-token-prediction block to draft with \
                 (qwen35moe, qwen3next and glm4moe files converted with their MTP layers have one)",
                model.arch.name()
            )
        })?;
        let (hp, hy) = (&model.hp, &model.hybrid);
        let experts = Supply::new(
            model,
            path,
            Schedule::Resident,
            SlotBudget::none(crate::flash::FileDeviceConfig::default()),
        )?;
        let kv = KvCache::len_for(hp, &cache_params(hy), ctx);
        let zeros = |n: usize| {
            crate::engine::zeroed(n)
                .ok_or_else(|| format!("the MTP drafter's buffers for {ctx} positions"))
        };
        let e = hp.n_embd;
        Ok(NextnDrafter {
            model,
            path: path.to_path_buf(),
            threads,
            block,
            mv: ThreadedMatVec::new(threads, Isa::detect()),
            experts,
            kv_k: zeros(kv)?,
            kv_v: zeros(kv)?,
            scratch: zeros(Scratch::len_for(hp, hy, ctx))?,
            cat: zeros(2 * e)?,
            h_prev: zeros(e)?,
            h_out: zeros(e)?,
            h_draft: zeros(e)?,
            logits: zeros(hp.n_vocab)?,
            pos: 0,
            next_t: 0,
            max_positions: ctx,
            greedy: Sampler::new(SamplerConfig::greedy()),
            failed: false,
        })
    }

    /// The block at `at` on `input` and `h` (the main model's state or its
    /// own), into `self.h_out` and, with `logits`, `self.logits`.
    fn step(
        &mut self,
        input: TokenInput<'_>,
        from_draft: bool,
        at: Place,
        logits: bool,
    ) -> Result<(), String> {
        let model = self.model;
        let (hp, hy) = (&model.hp, &model.hybrid);
        let hy1 = cache_params(hy);
        let mut kv = KvCache::new_for(hp, &hy1, &mut self.kv_k, &mut self.kv_v, self.max_positions)
            .ok_or("the MTP drafter's KV cache")?;
        let mut s = Scratch::new_for(hp, hy, &mut self.scratch, self.max_positions)
            .ok_or("the MTP drafter's scratch")?;
        let h = if from_draft {
            &self.h_draft
        } else {
            &self.h_prev
        };
        forward_nextn_at(
            hp,
            hy,
            &self.block,
            hp.n_layers,
            &mut self.mv,
            &mut self.experts,
            input,
            h,
            at,
            &mut kv,
            &mut s,
            &mut self.cat,
            &mut self.h_out,
            logits.then_some(&mut self.logits[..]),
        )
        .map_err(|e| format!("the MTP block: {e}"))
    }

    fn try_observe(
        &mut self,
        places: &[Place],
        inputs: &[TokenInput<'_>],
        hidden: &[f32],
    ) -> Result<(), String> {
        let e = self.model.hp.n_embd;
        if hidden.len() != inputs.len() * e || places.len() != inputs.len() {
            return Err("hidden states or places do not match the positions".into());
        }
        let Some(pos) = places.first().map(|p| p.index) else {
            return Ok(());
        };
        if pos != self.pos {
            // Positions it did not see (none in a run it drafts for from the
            // start): the first one pairs with zeros, as a sequence's first does.
            self.h_prev.fill(0.0);
        }
        for ((input, h), &at) in inputs.iter().zip(hidden.chunks_exact(e)).zip(places) {
            self.step(*input, false, at, false)?;
            rms_norm(
                h,
                Weights::output_norm(self.model),
                self.model.hp.norm_eps,
                &mut self.h_prev,
            );
        }
        self.pos = pos + inputs.len();
        // A token's next is one on; an image's last embedding is followed by
        // text in every prompt layout, so drafting never starts after it.
        self.next_t = places.last().map_or(0, |p| p.rope[0].saturating_add(1));
        Ok(())
    }

    fn try_draft(&mut self, token: u32, max: usize, out: &mut Vec<u32>) -> Result<(), String> {
        let mut input = token;
        let mut from_draft = false;
        let (mut pos, mut t) = (self.pos, self.next_t);
        while out.len() < max && pos < self.max_positions {
            let at = Place::text_at(pos, t);
            self.step(TokenInput::Token(input), from_draft, at, true)?;
            input = self.greedy.sample(&self.logits);
            out.push(input);
            std::mem::swap(&mut self.h_draft, &mut self.h_out);
            from_draft = true;
            pos += 1;
            t = t.saturating_add(1);
        }
        Ok(())
    }

    fn fail(&mut self, e: String) {
        note!("les: {e}; drafting stops");
        self.failed = true;
    }
}

impl Drafter for NextnDrafter<'_> {
    /// A drafter over the same block (its weights shared), with a KV cache
    /// and threads of its own; `None` where they cannot be had.
    fn fork<'a>(&self) -> Option<Box<dyn Drafter + 'a>>
    where
        Self: 'a,
    {
        match NextnDrafter::new(self.model, &self.path, self.max_positions, self.threads) {
            Ok(d) => Some(Box::new(d)),
            Err(e) => {
                note!("les: a second MTP drafter: {e}");
                None
            }
        }
    }

    fn draft(&mut self, history: &[u32], max: usize, out: &mut Vec<u32>) {
        out.clear();
        let n_vocab = self.model.hp.n_vocab as u32;
        let Some(&token) = history.last().filter(|&&t| t < n_vocab) else {
            return;
        };
        if self.failed || max == 0 {
            return;
        }
        if let Err(e) = self.try_draft(token, max, out) {
            out.clear();
            self.fail(e);
        }
    }

    fn wants_hidden(&self) -> bool {
        !self.failed
    }

    fn observe(&mut self, places: &[Place], inputs: &[TokenInput<'_>], hidden: &[f32]) {
        if self.failed {
            return;
        }
        if let Err(e) = self.try_observe(places, inputs, hidden) {
            self.fail(e);
        }
    }
}
