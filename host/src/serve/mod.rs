//! `les serve`: an HTTP server with llama-server's OpenAI-style endpoints
//! over one model and one session.
//!
//! - [`http`]: HTTP/1.1 requests read within bounds, responses and
//!   server-sent events written.
//! - [`api`]: the JSON requests ([`api::Completion`]) and errors.
//! - [`anthropic`]: Anthropic's Messages API, translated to and from
//!   [`api`]'s chat requests and answers.
//! - [`responses`]: OpenAI's Responses API, translated likewise.
//! - [`reasoning`]: a reply's reasoning told from its answer by the model's
//!   marker tokens (`<think>`, harmony channels).
//! - [`tools`]: tool calls, for chat templates that take tools and models
//!   that write Hermes-style `<tool_call>` blocks or gpt-oss's harmony calls.
//! - [`Engine`]: the model's sessions (`--parallel` slots, each with its
//!   own KV cache); each slot keeps what it evaluated, and a request goes to
//!   the free slot whose cache it keeps best (the most of its prompt held,
//!   less what would be dropped; of equals, the least recently used), so
//!   that a chat's next turn evaluates only what is new, also between turns
//!   of other chats. With several slots (and no drafter, or a fork of it
//!   a slot: prompt lookup, a draft model, the MTP block) completions run
//!   side by side:
//!   each pass of the model evaluates every
//!   running completion's next token (and the draft it verifies), and
//!   chunks of new prompts in the room left ([`Session::eval_together`]:
//!   each layer's experts are read once for all), and each answers what it
//!   answers alone, bit for bit.
//! - [`serve`]: the accept loop and a thread a connection; completions queue
//!   for the engine, which runs on the calling thread, while `/health` and
//!   `/v1/models` answer at once.
//! - [`batch`]: `les batch`, a file of requests in OpenAI's Batch API format
//!   answered by the engine without a server.
//!
//! Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/chat/completions`
//! (images as base64 `data:` URLs with a vision projector; tools; log
//! probabilities), `POST /v1/completions`, llama-server's `POST /completion`
//! and `POST /infill`, Anthropic's `POST /v1/messages` ([`anthropic`]),
//! OpenAI's `POST /v1/responses` ([`responses`]), each
//! with `stream` for server-sent events; the
//! helpers `/tokenize`, `/detokenize`, `/apply-template`, `GET /props`,
//! `/slots` and (`--metrics`) `/metrics`. A client that goes away stops its
//! generation.

pub mod anthropic;
pub mod api;
pub mod batch;
pub mod http;
pub mod reasoning;
pub mod responses;
pub mod tools;

use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use les_core::model::forward::Lookahead;
use serde_json::{json, Value};

use crate::compute::ThreadedMatVec;
use crate::draft::{Drafter, Speculation};
use crate::engine::{
    generate_from, Control, Drafting, GenStats, InputPlace, PassCost, Session, SessionInputs,
    Settled,
};
use crate::grammar::{Grammar, TokenGrammar};
use crate::model::Model;
use crate::reply::Reply;
use crate::sampling::logprobs::{log_probs, PositionLogprobs, TokenLogprob};
use crate::sampling::{Penalties, Sampler, SamplerConfig};
use crate::supply::Supply;
use crate::tokenizer::{ChatTemplate, Tokenizer};
use crate::vision::{self, ClipModel, MultimodalPrompt};
use api::{ApiError, Completion, Prompt};
use les_core::model::forward::TokenInput;
use reasoning::{Channel, Splitter};
use tools::{ToolCall, ToolChoice, ToolFormat};

/// How long a connection may sit idle between requests (or mid-request).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// What a finished completion reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    /// The generated text (cut before a stop string), its reasoning apart.
    pub text: String,
    /// The reasoning, where the model's markers set it apart (chat
    /// completions, unless `reasoning_format` is `none`).
    pub reasoning: String,
    /// "stop" (an end-of-generation token or a stop string), "tool_calls"
    /// or "length" (`max_tokens`, or the context is full).
    pub finish_reason: &'static str,
    /// The generated tokens where the request asked for them
    /// (`return_tokens`; not an end-of-generation one, a stop string's as
    /// generated).
    pub tokens: Vec<u32>,
    /// The stop string that ended the reply, if one did.
    pub stopping_word: Option<String>,
    /// Prompt positions (tokens and image embeddings).
    pub prompt_tokens: usize,
    /// Of them, those its slot held from an earlier request instead of
    /// evaluated.
    pub cached_tokens: usize,
    /// The slot (session) that answered.
    pub slot: usize,
    /// Tokens generated (an end-of-generation token not counted).
    pub completion_tokens: usize,
    /// Time on the prompt's new positions.
    pub prompt_time: Duration,
    /// Time generating.
    pub predicted_time: Duration,
    /// Passes of the model after the prompt's that generated its tokens
    /// (shared with the other completions running side by side).
    pub passes: usize,
    /// Draft tokens verified (speculative decoding).
    pub drafted: usize,
    /// Of them, those the model's own samples agreed with.
    pub accepted: usize,
    /// Where the request asked for them, each generated token's log
    /// probabilities, in order: the end-of-generation token's too, not
    /// those of tokens from a stop string on.
    pub logprobs: Option<Vec<PositionLogprobs>>,
    /// The calls read from the reply where the request gave tools (the
    /// text around them is `text`).
    pub tool_calls: Vec<ToolCall>,
}

#[cfg(test)]
impl Finished {
    /// An answer for the endpoints' unit tests: `text`, `reasoning` and
    /// `calls`, ended by `reason`, after a prompt of 10 positions (4 of them
    /// kept) and 6 tokens generated.
    pub(crate) fn for_test(
        text: &str,
        reasoning: &str,
        calls: Vec<ToolCall>,
        reason: &'static str,
    ) -> Finished {
        Finished {
            text: text.into(),
            reasoning: reasoning.into(),
            finish_reason: reason,
            tokens: Vec::new(),
            stopping_word: None,
            prompt_tokens: 10,
            cached_tokens: 4,
            slot: 0,
            completion_tokens: 6,
            prompt_time: Duration::ZERO,
            predicted_time: Duration::ZERO,
            passes: 5,
            drafted: 0,
            accepted: 0,
            logprobs: None,
            tool_calls: calls,
        }
    }
}

/// The model's session and what it needs to answer completions.
pub struct Engine<'m> {
    model: &'m Model,
    tokenizer: &'m Tokenizer,
    template: Option<ChatTemplate>,
    clip: Option<&'m ClipModel>,
    /// The sessions, one a slot (at least one).
    slots: Vec<Slot<'m>>,
    /// Completions answered: the slots' clock.
    answered: u64,
    mv: ThreadedMatVec,
    supply: Supply<'m>,
    lookahead: Lookahead,
    /// Speculative decoding's drafter, its longest draft and whether drafts
    /// are cut to what pays ([`Speculation`]).
    drafter: Option<(Box<dyn Drafter + 'm>, usize, bool)>,
    /// What a pass side by side costs by its positions, for drafts' lengths.
    pass_cost: PassCost,
    /// How the model marks its reasoning, if it does (and it is told apart).
    splitter: Option<Splitter>,
    /// How the model writes calls, where its chat template takes tools.
    tool_format: Option<ToolFormat>,
    /// A harmony model's splitter, for its calls whatever the reasoning's
    /// format.
    harmony: Option<Splitter>,
}

/// One session and what it holds.
struct Slot<'m> {
    session: Session<'m>,
    /// The positions the session holds: a token's id, or `None` for an
    /// image embedding.
    held: Vec<Option<u32>>,
    /// When it last answered ([`Engine::answered`]).
    used: u64,
    /// Its own drafter (a fork of the engine's), for completions side by
    /// side; its state follows the slot's (a draft model's cache).
    drafter: Option<Box<dyn Drafter + 'm>>,
}

impl<'m> Slot<'m> {
    fn new(session: Session<'m>) -> Self {
        Slot {
            session,
            held: Vec::new(),
            used: 0,
            drafter: None,
        }
    }

    /// How many of `items`' first positions it holds (tokens only).
    fn holds(&self, items: &[Option<u32>]) -> usize {
        self.held
            .iter()
            .zip(items)
            .take_while(|(a, b)| a.is_some() && a == b)
            .count()
    }
}

impl<'m> Engine<'m> {
    /// An engine over `session` (empty), `supply` and `mv` for `model`.
    pub fn new(
        model: &'m Model,
        tokenizer: &'m Tokenizer,
        clip: Option<&'m ClipModel>,
        session: Session<'m>,
        mv: ThreadedMatVec,
        supply: Supply<'m>,
        lookahead: Lookahead,
    ) -> Self {
        let template = tokenizer.chat_template().ok();
        let harmony = Splitter::of(tokenizer).filter(Splitter::is_harmony);
        let tool_format = match (&template, tokenizer.chat_template_source()) {
            (Some(t), Some(source)) => tools::template_format(source, harmony.is_some(), |tool| {
                let user = [serde_json::json!({"role": "user", "content": "hi"})];
                let tools = tool.as_array().map(Vec::as_slice);
                t.apply_json(&user, tools, true, None).ok()
            }),
            _ => None,
        };
        Engine {
            model,
            tokenizer,
            template,
            tool_format,
            harmony,
            clip,
            slots: vec![Slot::new(session)],
            answered: 0,
            mv,
            supply,
            lookahead,
            drafter: None,
            pass_cost: PassCost::default(),
            splitter: Splitter::of(tokenizer),
        }
    }

    /// This engine with `sessions` (empty, each its own KV cache of the
    /// first's size) as more slots.
    pub fn with_slots(mut self, sessions: impl IntoIterator<Item = Session<'m>>) -> Self {
        self.slots.extend(sessions.into_iter().map(Slot::new));
        self.fork_drafters();
        self
    }

    /// The positions a completion's prompt and reply may take.
    pub fn max_positions(&self) -> usize {
        self.slots[0].session.max_positions()
    }

    /// The positions each slot's cache holds.
    pub fn slots_held(&self) -> Vec<usize> {
        self.slots.iter().map(|s| s.held.len()).collect()
    }

    /// This engine with the model's reasoning left in the answer
    /// (`--reasoning-format none`), whatever requests ask.
    pub fn without_reasoning(mut self) -> Self {
        self.splitter = None;
        self
    }

    /// This engine with speculative decoding: `drafter` guesses up to
    /// `max_draft` tokens (the session set up for them), cut to what pays
    /// where `adaptive`. The answers stay the same, bit for bit.
    pub fn with_drafter(
        mut self,
        drafter: Box<dyn Drafter + 'm>,
        max_draft: usize,
        adaptive: bool,
    ) -> Self {
        self.drafter = Some((drafter, max_draft, adaptive));
        self.fork_drafters();
        self
    }

    /// With several slots and a drafter, a fork of it in each slot, so that
    /// completions run side by side; none where it does not fork (they
    /// then run one at a time).
    fn fork_drafters(&mut self) {
        let Some((drafter, ..)) = &self.drafter else {
            return;
        };
        if self.slots.len() < 2 {
            return;
        }
        for slot in &mut self.slots {
            if slot.drafter.is_none() {
                slot.drafter = drafter.fork();
                if slot.drafter.is_none() {
                    break;
                }
            }
            // Its passes keep the final hidden states for the drafter.
            let watch = slot.drafter.as_ref().is_some_and(|d| d.wants_hidden());
            slot.session.set_keep_hidden(watch);
        }
        if self.slots.iter().any(|s| s.drafter.is_none()) {
            for s in &mut self.slots {
                s.drafter = None;
                s.session.set_keep_hidden(false);
            }
        }
    }

    /// The prompt of `c`: the chat template applied to its messages, or its
    /// text; its images encoded where its markers are.
    fn prompt(&mut self, c: &Completion) -> Result<MultimodalPrompt, ApiError> {
        let text = match &c.prompt {
            Prompt::Text(t) => t.clone(),
            Prompt::Infill(infill) => {
                let ids =
                    infill_tokens(self.tokenizer, infill, self.max_positions(), c.max_tokens)?;
                return Ok(MultimodalPrompt::from_tokens(ids, self.model.hp.n_embd));
            }
            Prompt::Tokens(ids) => {
                let n_vocab = self.model.hp.n_vocab;
                if let Some(t) = ids.iter().find(|&&t| t as usize >= n_vocab) {
                    return Err(ApiError::bad(format!(
                        "'prompt': token {t} is outside the vocabulary ({n_vocab} tokens)"
                    )));
                }
                return Ok(MultimodalPrompt::from_tokens(
                    ids.clone(),
                    self.model.hp.n_embd,
                ));
            }
            Prompt::Chat(messages) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    ApiError::bad(
                        "the model has no chat template: use /v1/completions with a prompt",
                    )
                })?;
                if c.tools.is_some() && self.tool_format.is_none() {
                    return Err(ApiError::bad(
                        "tools: this model's chat template does not take tools as les reads them \
                         (a template that renders `tools` and writes Hermes-style <tool_call> \
                         blocks: Qwen 2.5/3, MiniCPM-V, Hermes; Qwen3-Coder's XML calls: \
                         Qwen3-Coder, Qwen3.5, Nemotron 3 Nano; GLM-4.5's, MiniMax-M2's or \
                         Kimi K2's calls; or gpt-oss's harmony calls)",
                    ));
                }
                api::chat_text(
                    self.tokenizer,
                    template,
                    messages,
                    c.tools.as_ref(),
                    c.chat_template_kwargs.as_ref(),
                )?
            }
        };
        let n_embd = self.model.n_embd_inp();
        if c.images.is_empty() {
            return Ok(MultimodalPrompt::from_tokens(
                self.tokenizer.encode(&text, true, true),
                n_embd,
            ));
        }
        let clip = self.clip.ok_or_else(api::no_projector)?;
        api::image_markers(&text, c.images.len())?;
        let mut encoded = Vec::with_capacity(c.images.len());
        let mut ctx = vision::Ctx {
            isa: self.mv.isa(),
            pool: self.mv.pool(),
        };
        for (i, bytes) in c.images.iter().enumerate() {
            let img = vision::image::decode_image(bytes)
                .map_err(|e| ApiError::bad(format!("image {}: {e}", i + 1)))?;
            encoded.push(
                vision::encode_image(&mut ctx, clip, &img)
                    .map_err(|e| ApiError::bad(format!("image {}: {e}", i + 1)))?,
            );
        }
        vision::build_prompt(
            self.tokenizer,
            clip.hp.projector,
            &text,
            true,
            &encoded,
            n_embd,
        )
        .map_err(|e| ApiError::bad(e.to_string()))
    }

    /// Answers `c`: `started` with the slot that answers once the prompt is
    /// read and fits (an error before it is the request's), then `delta` with each new piece of text,
    /// whether it is reasoning or answer, and the log probabilities (where
    /// asked) of the tokens generated since the last piece (streaming; those
    /// left at the end are [`Finished::logprobs`]' last); generation stops
    /// early where `delta` returns false (the client went away).
    pub fn complete(
        &mut self,
        c: &Completion,
        started: impl FnOnce(usize),
        mut delta: impl FnMut(Channel, &str, Vec<PositionLogprobs>) -> bool,
    ) -> Result<Finished, ApiError> {
        let g = self.begin(c, |_| true)?;
        started(g.slot);
        let Generation {
            slot,
            prompt,
            ids,
            keep,
            n,
            mut sampler,
            stuck,
            mut out,
        } = g;
        let inputs = prompt.inputs();
        let session = &mut self.slots[slot].session;
        let stats = generate_from(
            session,
            &mut self.mv,
            &mut self.supply,
            Some(&self.lookahead),
            &inputs[keep..],
            &prompt.places()[keep..],
            self.drafter
                .as_mut()
                .map(|(drafter, max_draft, adaptive)| Speculation {
                    drafter: drafter.as_mut(),
                    max_draft: *max_draft,
                    adaptive: *adaptive,
                    context: &ids[..keep],
                }),
            n,
            |logits| pick(&mut sampler, &stuck, logits),
            |t, logits| out.take(t, logits, &stuck, &mut delta),
        )
        .map_err(|e| server_error(format!("the forward pass failed: {e}")))?;
        self.finish(slot, prompt, keep, out, stuck.get(), &stats, &mut delta)
    }

    /// Starts answering `c`: its prompt read and checked, its sampler made,
    /// and a slot chosen among those `free` says are (the one whose cache is
    /// best kept) and gone back to what it holds of the prompt. `None` of
    /// the slots free is an error.
    fn begin(
        &mut self,
        c: &Completion,
        free: impl Fn(usize) -> bool,
    ) -> Result<Generation<'m>, ApiError> {
        let prompt = self.prompt(c)?;
        let ctx = self.max_positions();
        if prompt.is_empty() {
            return Err(ApiError::bad("the prompt is empty after tokenization"));
        }
        if prompt.len() >= ctx {
            return Err(ApiError::bad(format!(
                "the prompt is {} positions; the context holds {ctx} (les serve --ctx)",
                prompt.len()
            )));
        }
        let tokenizer = self.tokenizer;
        let mut sampler = sampler(c);
        let n_vocab = self.model.hp.n_vocab;
        for &(id, bias) in &c.sampling.logit_bias {
            if id as usize >= n_vocab {
                return Err(ApiError::bad(format!(
                    "'logit_bias': token {id} is outside the vocabulary ({n_vocab} tokens)"
                )));
            }
            if bias == f32::NEG_INFINITY {
                sampler.ban([id]);
            } else {
                sampler.bias(id, bias);
            }
        }
        if let Some(g) = &c.grammar {
            let g = Grammar::parse(g).map_err(|e| ApiError::bad(format!("the grammar: {e}")))?;
            sampler.constrain(
                TokenGrammar::new(g, tokenizer)
                    .map_err(|e| ApiError::bad(format!("the grammar: {e}")))?,
            );
        }
        let format = self.tool_format.filter(|_| c.tools.is_some());
        if let (Some(t), Some(format)) = (&c.tools, format) {
            let tools_grammar = |text: &str| {
                let g = Grammar::parse(text)
                    .map_err(|e| ApiError::bad(format!("the tools' grammar: {e}")))?;
                TokenGrammar::new(g, tokenizer)
                    .map_err(|e| ApiError::bad(format!("the tools' grammar: {e}")))
            };
            match (&t.choice, format) {
                // A required call: the reply is one, from its start.
                (ToolChoice::Required | ToolChoice::Function(_), _) => {
                    if let Some(g) = t.grammar(format)? {
                        sampler.constrain(tools_grammar(&g)?);
                    }
                }
                // Free until the model opens a call, which then follows the
                // tools (a grammar of the request's own stands instead).
                _ if c.grammar.is_none() => {
                    let (g, starts) = t.lazy(format)?;
                    let starts: Vec<&str> = starts.iter().map(String::as_str).collect();
                    sampler.constrain_from(tools_grammar(&g)?, &starts);
                }
                _ => {}
            }
        }
        let items = prompt.tokens();
        // As llama.cpp: the prompt's tokens count for the repeat penalty.
        for t in items.iter().flatten() {
            sampler.accept(*t);
        }
        // The slot whose cache is best kept: the most of this prompt it
        // holds, less what it holds past that (dropped); of equals, the
        // least recently used.
        let best = (0..self.slots.len())
            .filter(|&i| free(i))
            .min_by_key(|&i| {
                let slot = &self.slots[i];
                let holds = slot.holds(&items) as i64;
                let dropped = slot.held.len() as i64 - holds;
                (std::cmp::Reverse(holds - dropped), slot.used)
            })
            .ok_or_else(|| server_error("no slot is free".into()))?;
        self.answered += 1;
        let slot = &mut self.slots[best];
        slot.used = self.answered;
        // What the session holds of this prompt already (tokens only; the
        // last position is evaluated again for its logits).
        let same = slot
            .holds(&items)
            .min(items.len() - 1)
            .min(slot.session.position());
        let keep = match slot.session.rewind(same) {
            Ok(()) => same,
            Err(_) => {
                slot.session
                    .rewind(0)
                    .map_err(|e| server_error(e.to_string()))?;
                0
            }
        };
        slot.held.truncate(keep);
        let ids = prompt.token_ids(self.model.hp.n_vocab as u32);
        let room = ctx - prompt.len();
        let n = c.max_tokens.unwrap_or(usize::MAX).min(room + 1);
        let mut reply = Reply::new(tokenizer, &c.stop);
        if let Some(f) = format {
            reply.show(f.markers().iter().filter_map(|m| tokenizer.token_id(m)));
        }
        // Where the reasoning and the answer start in the reply's text (and,
        // for harmony calls, where a call's arguments are).
        let mut splitter = match format {
            Some(ToolFormat::Harmony) => self.harmony.clone(),
            _ => self.splitter.clone().filter(|_| c.reasoning),
        };
        let mut marks = Marks::default();
        if let Some(s) = &mut splitter {
            s.start(&items);
            marks.set(0, s.channel());
        }
        Ok(Generation {
            slot: best,
            prompt,
            ids,
            keep,
            n,
            sampler,
            stuck: std::cell::Cell::new(false),
            out: Output {
                tokenizer,
                items,
                reply,
                sampled: Vec::new(),
                gone: false,
                splitter,
                marks,
                probs: Vec::new(),
                starts: Vec::new(),
                passed: 0,
                sent_to: 0,
                with_tools: c.tools.is_some(),
                // Calls written as text (all but harmony's): held back from
                // the pieces.
                call_starts: format.and_then(ToolFormat::call_starts),
                // Where a call in the reasoning ends it, what may start one
                // is held back there too.
                ends_reasoning: format.is_some_and(ToolFormat::call_ends_reasoning),
                format,
                tools: c.tools.clone(),
                logprobs: c.logprobs,
                return_tokens: c.return_tokens,
                stop: c.stop.clone(),
            },
        })
    }

    /// Ends the answer `out` gave in `slot` to a prompt of which the slot
    /// kept `keep` positions: the rest of its text passed to `delta`, its
    /// calls read, what the slot now holds recorded, with the times, passes
    /// and drafts of `stats`.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &mut self,
        slot: usize,
        prompt: MultimodalPrompt,
        keep: usize,
        out: Output<'m>,
        stuck: bool,
        stats: &GenStats,
        delta: &mut dyn FnMut(Channel, &str, Vec<PositionLogprobs>) -> bool,
    ) -> Result<Finished, ApiError> {
        let Output {
            items,
            mut reply,
            sampled,
            gone,
            splitter,
            marks,
            mut probs,
            starts,
            mut passed,
            sent_to,
            with_tools,
            call_starts,
            format,
            tools,
            logprobs,
            return_tokens,
            stop,
            ..
        } = out;
        reply.finish().map_err(|e| server_error(e.to_string()))?;
        if reply.stopped.is_some() {
            // The tokens of the stop string (and after) are not the reply's.
            probs.truncate(starts.partition_point(|&s| s < reply.text.len()));
        }
        if !gone {
            let end = match (marks.answer_start(), call_starts) {
                (Some(at), Some(starts)) => {
                    let at = at.min(reply.text.len());
                    at + tools::before_calls(&reply.text[at..], starts)
                }
                _ => reply.text.len(),
            };
            for (to, r) in marks.split(sent_to.min(end)..end) {
                let Some(to) = shown(to, with_tools) else {
                    continue;
                };
                let with = probs[passed.min(probs.len())..].to_vec();
                passed = probs.len();
                delta(to, &reply.text[r], with);
            }
        }
        let (mut text, mut reasoning, mut arguments) = (String::new(), String::new(), None);
        for (to, r) in marks.split(0..reply.text.len()) {
            match to {
                Channel::Reasoning => reasoning.push_str(&reply.text[r]),
                Channel::Call if with_tools => arguments
                    .get_or_insert_with(String::new)
                    .push_str(&reply.text[r]),
                _ => text.push_str(&reply.text[r]),
            }
        }
        let mut tool_calls = Vec::new();
        match (format, &tools) {
            (Some(ToolFormat::Harmony), _) => {
                let name = splitter.as_ref().and_then(Splitter::recipient);
                if let (Some(name), Some(arguments)) = (name, arguments) {
                    tool_calls.push(ToolCall {
                        name: name.to_string(),
                        arguments: arguments.trim().to_string(),
                    });
                }
            }
            (Some(f), Some(t)) => (text, tool_calls) = t.read_reply(&text, f),
            _ => {}
        }
        // The session now holds the prompt and all but the last token sampled.
        let best = slot;
        let slot = &mut self.slots[slot];
        slot.held = items;
        slot.held.extend(sampled.iter().map(|&t| Some(t)));
        slot.held.truncate(slot.session.position());
        let finish_reason = if reply.eog.is_some() || reply.stopped.is_some() || stuck {
            if tool_calls.is_empty() {
                "stop"
            } else {
                "tool_calls"
            }
        } else {
            "length"
        };
        let stopping_word = reply.stopped.as_ref().map(|(i, _)| stop[*i].clone());
        Ok(Finished {
            text,
            reasoning,
            finish_reason,
            tokens: if return_tokens {
                reply.tokens.clone()
            } else {
                Vec::new()
            },
            stopping_word,
            prompt_tokens: prompt.len(),
            cached_tokens: keep,
            slot: best,
            // Every token sampled, markers included, but an end of generation.
            completion_tokens: sampled.len() - usize::from(reply.eog.is_some()),
            prompt_time: stats.prefill,
            predicted_time: stats.decode,
            passes: stats.passes,
            drafted: stats.drafted,
            accepted: stats.accepted,
            logprobs: logprobs.map(|_| probs),
            tool_calls,
        })
    }
}

/// A completion begun ([`Engine::begin`]) and not yet finished: its slot,
/// prompt, what of it the slot kept, the most tokens it generates, its
/// sampler, and what takes its tokens.
struct Generation<'m> {
    slot: usize,
    prompt: MultimodalPrompt,
    /// The prompt's token ids (for a drafter's context).
    ids: Vec<u32>,
    keep: usize,
    n: usize,
    sampler: Sampler,
    /// Set when the sampler's grammar admits no token: the reply stops.
    stuck: std::cell::Cell<bool>,
    out: Output<'m>,
}

/// Samples a token from `logits`, noting in `stuck` a grammar that admits
/// none.
fn pick(sampler: &mut Sampler, stuck: &std::cell::Cell<bool>, logits: &[f32]) -> u32 {
    let t = sampler.sample(logits);
    if sampler.grammar_error().is_some() {
        stuck.set(true);
    }
    t
}

/// What a completion's tokens go to as they come: its reply, its reasoning
/// told apart, the pieces passed on, and what its answer is made of at the
/// end.
struct Output<'m> {
    tokenizer: &'m Tokenizer,
    /// The prompt's positions (a token, or `None` for an embedding).
    items: Vec<Option<u32>>,
    reply: Reply<'m>,
    sampled: Vec<u32>,
    /// Whether `delta` said the client went away.
    gone: bool,
    splitter: Option<Splitter>,
    marks: Marks,
    /// Each token's log probabilities (where asked), where its text starts
    /// in the reply's, and how many of them were passed with a piece.
    probs: Vec<PositionLogprobs>,
    starts: Vec<usize>,
    passed: usize,
    /// Bytes of the reply's text passed on as pieces; with tools, none from
    /// the first call on (the calls come whole at the end).
    sent_to: usize,
    with_tools: bool,
    call_starts: Option<&'static [&'static str]>,
    ends_reasoning: bool,
    format: Option<ToolFormat>,
    tools: Option<tools::Tools>,
    logprobs: Option<usize>,
    return_tokens: bool,
    stop: Vec<String>,
}

impl Output<'_> {
    /// Takes the sampled token `t` (sampled from `logits`): its text into
    /// the reply, the new pieces to `delta`. Stops where the reply ends,
    /// the grammar is `stuck` or `delta` says the client went away.
    fn take(
        &mut self,
        t: u32,
        logits: &[f32],
        stuck: &std::cell::Cell<bool>,
        delta: &mut dyn FnMut(Channel, &str, Vec<PositionLogprobs>) -> bool,
    ) -> Control {
        self.sampled.push(t);
        if let Some(top) = self.logprobs {
            self.probs.push(log_probs(logits, t, top));
            self.starts.push(self.reply.text.len());
        }
        if stuck.get() {
            return Control::Stop;
        }
        if let Some(s) = &mut self.splitter {
            match s.route(t, &self.tokenizer.decode(&[t])) {
                // Markers and headers are neither (an end of generation
                // still ends it).
                Channel::Hidden if !self.tokenizer.is_eog(t) => return Control::Continue,
                Channel::Hidden => {}
                to => self.marks.set(self.reply.text.len(), to),
            }
        }
        let before = self.reply.text.len();
        let control = self.reply.take(t, None);
        if let (true, Some(s), Some(starts)) =
            (self.ends_reasoning, &mut self.splitter, self.call_starts)
        {
            if let Some(start) = self
                .marks
                .reasoning_start()
                .filter(|_| s.channel() == Channel::Reasoning)
            {
                // Only a start this token's text completes is new: it
                // begins less than a marker's length before that text.
                let longest = starts.iter().map(|m| m.len()).max().unwrap_or(0);
                let mut from = start.max(before.saturating_sub(longest));
                while !self.reply.text.is_char_boundary(from) {
                    from -= 1;
                }
                if let Some(at) = tools::first_call(&self.reply.text[from..], starts) {
                    self.marks.set(from + at, Channel::Content);
                    s.end_thought();
                }
            }
        }
        // What the reply passed on is its text's next bytes (short of
        // what may be a tool call), with the tokens whose text starts
        // before their end.
        let end = passable(
            &self.reply.text,
            self.reply.written(),
            &self.marks,
            self.call_starts,
            self.ends_reasoning,
        );
        let upto = self.starts.partition_point(|&s| s < end);
        for (to, r) in self.marks.split(self.sent_to..end) {
            let Some(to) = shown(to, self.with_tools) else {
                continue;
            };
            let with = self.probs[self.passed..upto].to_vec();
            self.passed = upto;
            if !delta(to, &self.reply.text[r], with) {
                self.gone = true;
                return Control::Stop;
            }
        }
        self.sent_to = self.sent_to.max(end);
        control
    }
}

/// Where each part of a reply's text goes: the channel from each offset on.
#[derive(Default)]
struct Marks(Vec<(usize, Channel)>);

impl Marks {
    /// From byte `at` on, text goes to `to`.
    fn set(&mut self, at: usize, to: Channel) {
        if self.0.last().is_none_or(|&(_, c)| c != to) {
            self.0.push((at, to));
        }
    }

    /// `range` of the text cut where its channel changes (all content
    /// without marks).
    fn split(&self, range: std::ops::Range<usize>) -> Vec<(Channel, std::ops::Range<usize>)> {
        let mut out = Vec::new();
        let mut at = range.start;
        while at < range.end {
            let i = self.0.partition_point(|&(from, _)| from <= at);
            let to = if i == 0 {
                Channel::Content
            } else {
                self.0[i - 1].1
            };
            let end = self
                .0
                .get(i)
                .map_or(range.end, |&(from, _)| from.min(range.end));
            out.push((to, at..end));
            at = end;
        }
        out
    }

    /// Where the reasoning's last run of text starts, if the reply is in
    /// its reasoning.
    fn reasoning_start(&self) -> Option<usize> {
        match self.0.last() {
            Some(&(at, Channel::Reasoning)) => Some(at),
            _ => None,
        }
    }

    /// Where the answer's last run of text starts, if the reply is in the
    /// answer (not in its reasoning).
    fn answer_start(&self) -> Option<usize> {
        match self.0.last() {
            None => Some(0),
            Some(&(at, Channel::Content)) => Some(at),
            Some(_) => None,
        }
    }
}

/// llama-server's default `--batch-size`, by which its `/infill` sizes the
/// prefix and suffix it keeps.
const INFILL_BATCH: usize = 2048;

/// The prompt of a fill-in-the-middle request, as llama-server's
/// `format_prompt_infill` builds it (its repository-level pattern): the
/// extra files (after `<|repo_name|>myproject`, each after `<|file_sep|>`
/// and its name, or a snippet separator without that token), as much of
/// them as the context leaves, then BOS where the model adds one,
/// `<|fim_prefix|>`, the prefix's last tokens and `prompt`,
/// `<|fim_suffix|>`, the suffix's first tokens, and `<|fim_middle|>`.
fn infill_tokens(
    tk: &Tokenizer,
    infill: &api::Infill,
    n_ctx: usize,
    n_predict: Option<usize>,
) -> Result<Vec<u32>, ApiError> {
    use crate::tokenizer::Fim;
    let (Some(pre), Some(suf), Some(mid)) = (
        tk.fim(Fim::Prefix),
        tk.fim(Fim::Suffix),
        tk.fim(Fim::Middle),
    ) else {
        return Err(ApiError::bad(
            "the model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)",
        ));
    };
    let enc = |t: &str| tk.encode(t, false, false);
    let mut extra = Vec::new();
    if let Some(repo) = tk.fim(Fim::Repo) {
        extra.push(repo);
        extra.extend(enc("myproject\n"));
    }
    for (filename, text) in &infill.extra {
        match tk.fim(Fim::FileSep) {
            Some(sep) => {
                extra.push(sep);
                extra.extend(enc(&format!("{filename}\n")));
            }
            None => extra.extend(enc("\n\n--- snippet ---\n\n")),
        }
        extra.extend(enc(text));
    }
    if let Some(sep) = tk.fim(Fim::FileSep) {
        extra.push(sep);
        extra.extend(enc("filename\n"));
    }
    let prompt = enc(&infill.prompt);
    let mut prefix = enc(&infill.prefix);
    let mut suffix = enc(&infill.suffix);
    // The prefix and suffix fit a batch, 3 to 1; the files fill the rest.
    let prefix_take = prefix.len().min(3 * (INFILL_BATCH / 4));
    let suffix_take = suffix
        .len()
        .min((INFILL_BATCH / 4).saturating_sub(2 + prompt.len()));
    let predict = n_predict.map_or(-1, |n| n.min(i64::MAX as usize / 4) as i64);
    let room = (n_ctx as i64 - INFILL_BATCH as i64 - 2 * predict).max(0) as usize;
    let extra_take = room.min(extra.len());
    prefix.drain(..prefix.len() - prefix_take);
    suffix.truncate(suffix_take);
    let mut out = extra[extra.len() - extra_take..].to_vec();
    if tk.add_bos() {
        out.extend(tk.bos());
    }
    out.push(pre);
    out.extend(prefix);
    out.extend(prompt);
    out.push(suf);
    out.extend(suffix);
    out.push(mid);
    Ok(out)
}

/// Where a piece of text of channel `to` goes as it streams: a harmony
/// call's arguments nowhere where the request gave tools (they come whole
/// at the end), the answer's way where it did not.
fn shown(to: Channel, with_tools: bool) -> Option<Channel> {
    match to {
        Channel::Call if with_tools => None,
        Channel::Call => Some(Channel::Content),
        to => Some(to),
    }
}

/// How much of `reply`'s text may be passed on: what it wrote, short of a
/// tool call in the answer (one starting at any of `call_starts`, where
/// calls are text), or what may start one. Reasoning that spells a call's
/// tag is passed on as it is, unless `in_reasoning` (a call there ends the
/// reasoning): then the reasoning holds back what may start one too.
fn passable(
    text: &str,
    written: usize,
    marks: &Marks,
    call_starts: Option<&[&str]>,
    in_reasoning: bool,
) -> usize {
    let from = if in_reasoning {
        marks.reasoning_start().or(marks.answer_start())
    } else {
        marks.answer_start()
    };
    match (from, call_starts) {
        (Some(at), Some(starts)) => {
            let at = at.min(text.len());
            written.min(at + tools::streamable(&text[at..], starts))
        }
        _ => written,
    }
}

fn server_error(message: String) -> ApiError {
    ApiError {
        status: 500,
        message,
    }
}

/// The sampler of a request: its settings, its seed or a new one.
fn sampler(c: &Completion) -> Sampler {
    let s = &c.sampling;
    let seed = s.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    Sampler::new(SamplerConfig {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        min_p: Some(s.min_p),
        typical_p: s.typical_p,
        top_n_sigma: -1.0,
        xtc_probability: 0.0,
        xtc_threshold: 0.1,
        penalties: Some(Penalties {
            repeat: s.repeat_penalty,
            frequency: s.frequency_penalty,
            presence: s.presence_penalty,
            last_n: s.repeat_last_n,
        }),
        mirostat: crate::sampling::Mirostat::of(s.mirostat, s.mirostat_tau, s.mirostat_eta),
        seed,
    })
}

/// Which endpoint a job came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Text,
    /// llama-server's own `/completion`.
    Native,
    /// Anthropic's `/v1/messages`.
    Messages,
    /// OpenAI's `/v1/responses`.
    Responses,
}

impl Endpoint {
    /// Reads a request `body` sent to this endpoint at `path`.
    fn read(self, path: &str, body: &[u8]) -> Result<Completion, ApiError> {
        match self {
            Endpoint::Chat => api::chat_request(body),
            Endpoint::Messages => anthropic::messages_request(body),
            Endpoint::Responses => responses::responses_request(body),
            Endpoint::Native if path == "/infill" => api::infill_request(body),
            Endpoint::Text | Endpoint::Native => api::text_request(body),
        }
    }

    /// The body of error `e` in this endpoint's shape.
    fn error_body(self, e: &ApiError) -> Value {
        match self {
            Endpoint::Messages => anthropic::error_body(e),
            _ => e.body(),
        }
    }
}

/// A completion for the engine, and where its answer goes.
struct Job {
    completion: Completion,
    endpoint: Endpoint,
    events: Sender<Event>,
    /// Set when the client went away before the answer.
    cancel: Arc<AtomicBool>,
}

/// What the engine tells a connection of its job.
enum Event {
    Started,
    /// A piece of text, with the log probabilities of the tokens since the
    /// last piece (where asked).
    Delta(Channel, String, Vec<PositionLogprobs>),
    Done(Result<Finished, ApiError>),
}

/// Settings of [`serve`].
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The model's name in responses and `/v1/models`.
    pub model_id: String,
    /// Answer `GET /metrics` (llama-server's `--metrics`).
    pub metrics: bool,
    /// Request bounds.
    pub limits: http::Limits,
    /// Connections served at once; more are answered 503.
    pub max_connections: usize,
    /// The key requests must carry (`Authorization: Bearer KEY`), if any;
    /// `/health` is open.
    pub api_key: Option<String>,
}

/// Serves `listener` until the process ends: a thread accepts connections
/// and one a connection reads its requests; completions run on this
/// thread, in `engine`, side by side where it has several slots and no
/// drafter or one that drafts for each completion on its own, else one at a
/// time.
pub fn serve(listener: TcpListener, engine: &mut Engine<'_>, opts: &ServeOptions) {
    let (jobs, queue) = channel::<Job>();
    let about = About::new(engine, opts);
    std::thread::scope(|scope| {
        scope.spawn(|| accept(scope, listener, jobs, &about));
        work_all(engine, queue, &about, &mut || {});
    });
}

/// Answers the jobs of `queue` until it closes: side by side where the
/// engine can, else one at a time; `after` runs after each job answered
/// one at a time, or each round of passes side by side.
fn work_all(
    engine: &mut Engine<'_>,
    queue: Receiver<Job>,
    about: &About<'_>,
    after: &mut dyn FnMut(),
) {
    if engine.side_by_side() {
        work_side_by_side(engine, queue, about, after);
    } else {
        work(engine, queue, about, after);
    }
}

/// What the connections answer from themselves, without the engine.
struct About<'a> {
    opts: &'a ServeOptions,
    tokenizer: &'a Tokenizer,
    n_ctx: usize,
    /// The vision projector, where images are served.
    clip: Option<&'a ClipModel>,
    speculative: bool,
    /// What the engine's loop did, for `/slots` and `/metrics`.
    activity: std::sync::Mutex<Activity>,
}

/// What the engine's loop did so far and does now.
#[derive(Debug, Default)]
struct Activity {
    /// Each slot: the positions its cache holds, and whether it answers now.
    slots: Vec<(usize, bool)>,
    /// Prompt positions evaluated (not those kept), and the seconds taken.
    prompt_tokens: u64,
    prompt_seconds: f64,
    /// Tokens generated, and the seconds taken.
    predicted_tokens: u64,
    predicted_seconds: f64,
    /// Completions answered.
    requests: u64,
    /// Completions waiting for the engine.
    deferred: usize,
    /// Passes after the prompts' (llama.cpp's decode calls), and the
    /// completions they generated for, each counted in every pass it took
    /// part in.
    decode_passes: u64,
    decode_slots: u64,
    /// The expert scheduler's counters, where experts stream from flash.
    experts: Option<les_core::schedule::Stats>,
}

impl<'a> About<'a> {
    /// What the server tells of `engine`, run with `opts`.
    fn new<'m: 'a>(engine: &Engine<'m>, opts: &'a ServeOptions) -> Self {
        About {
            opts,
            tokenizer: engine.tokenizer,
            n_ctx: engine.max_positions(),
            clip: engine.clip,
            speculative: engine.drafter.is_some(),
            activity: std::sync::Mutex::new(Activity {
                slots: engine
                    .slots_held()
                    .into_iter()
                    .map(|n| (n, false))
                    .collect(),
                ..Activity::default()
            }),
        }
    }
    /// The expert scheduler's counters now (`None`: experts resident).
    fn experts(&self, stats: Option<les_core::schedule::Stats>) {
        self.activity().experts = stats;
    }

    /// A job was taken from the queue.
    fn took_job(&self) {
        let mut a = self.activity();
        a.deferred = a.deferred.saturating_sub(1);
    }

    /// A completion started in `slot`.
    fn started(&self, slot: usize) {
        if let Some(s) = self.activity().slots.get_mut(slot) {
            s.1 = true;
        }
    }

    /// `passes` passes after the prompts' ran, for `slots` completions in
    /// all (a completion counted once in each pass it took part in).
    fn passes(&self, passes: u64, slots: u64) {
        let mut a = self.activity();
        a.decode_passes += passes;
        a.decode_slots += slots;
    }

    fn activity(&self) -> std::sync::MutexGuard<'_, Activity> {
        // A poisoned lock still holds counters worth reporting.
        self.activity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The engine's loop, one completion at a time: each job's answer, in order.
fn work(engine: &mut Engine<'_>, queue: Receiver<Job>, about: &About<'_>, after: &mut dyn FnMut()) {
    for job in queue {
        about.took_job();
        let events = &job.events;
        let mut slot = None;
        let result = engine.complete(
            &job.completion,
            |s| {
                slot = Some(s);
                about.started(s);
                let _ = events.send(Event::Started);
            },
            deliver(&job),
        );
        match (&result, slot) {
            (Ok(f), _) => about.passes(f.passes as u64, f.passes as u64),
            (Err(_), Some(s)) => engine.forget(s),
            (Err(_), None) => {}
        }
        answered(engine, job, slot, result, about);
        after();
    }
}

/// The engine's loop with completions side by side
/// ([`Engine::side_by_side`]): each waiting job begins in a free slot, then
/// each round's passes ([`Engine::step`]) evaluate every running
/// completion's next token (and its draft) and chunks of the new prompts at
/// once ([`Session::eval_together`]: each layer's experts read once for
/// all), each takes the tokens it samples, and those done are answered.
fn work_side_by_side<'m>(
    engine: &mut Engine<'m>,
    queue: Receiver<Job>,
    about: &About<'_>,
    after: &mut dyn FnMut(),
) {
    let mut waiting = std::collections::VecDeque::new();
    let mut running: Vec<Running<'m>> = Vec::new();
    loop {
        if running.is_empty() && waiting.is_empty() {
            let Ok(job) = queue.recv() else {
                return;
            };
            waiting.push_back(job);
        }
        waiting.extend(queue.try_iter());
        while running.len() < engine.slots.len() {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            about.took_job();
            running.extend(engine.start(job, &running, about));
        }
        if !running.is_empty() {
            engine.step(&mut running, about);
            about.experts(engine.supply.stats());
        }
        after();
    }
}

/// What a job's answer gets as it goes: each piece of text (streaming),
/// while the client is there.
fn deliver(job: &Job) -> impl FnMut(Channel, &str, Vec<PositionLogprobs>) -> bool + '_ {
    let streaming = job.completion.stream;
    move |to, piece, probs| {
        !job.cancel.load(Ordering::Relaxed)
            && (!streaming
                || job
                    .events
                    .send(Event::Delta(to, piece.to_string(), probs))
                    .is_ok())
    }
}

/// Logs and records `job`'s answer (from `slot`, where it got one) and sends
/// it to the job's connection.
fn answered(
    engine: &Engine<'_>,
    job: Job,
    slot: Option<usize>,
    result: Result<Finished, ApiError>,
    about: &About<'_>,
) {
    about.experts(engine.supply.stats());
    if let Ok(f) = &result {
        note!(
            "les: {} ({}, slot {}): prompt {} ({} kept), {} generated in {:.2?}, {}",
            about.opts.model_id,
            match job.endpoint {
                Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => "chat",
                Endpoint::Text | Endpoint::Native => "text",
            },
            f.slot,
            f.prompt_tokens,
            f.cached_tokens,
            f.completion_tokens,
            f.prompt_time + f.predicted_time,
            f.finish_reason
        );
    }
    {
        let mut a = about.activity();
        if let Some(s) = slot {
            if let (Some(entry), Some(done)) = (a.slots.get_mut(s), engine.slots.get(s)) {
                *entry = (done.held.len(), false);
            }
        }
        if let Ok(f) = &result {
            a.prompt_tokens += (f.prompt_tokens - f.cached_tokens) as u64;
            a.prompt_seconds += f.prompt_time.as_secs_f64();
            a.predicted_tokens += f.completion_tokens as u64;
            a.predicted_seconds += f.predicted_time.as_secs_f64();
            a.requests += 1;
        }
    }
    let _ = job.events.send(Event::Done(result));
}

/// A completion running side by side with others
/// ([`work_side_by_side`]): its prompt evaluated a chunk a pass, then a
/// token (and its draft, with a drafter) a pass.
struct Running<'m> {
    job: Job,
    g: Generation<'m>,
    /// The prompt's next position to evaluate (its length once evaluated).
    prompt_at: usize,
    /// The token sampled last, not evaluated yet (`None`: the completion
    /// is done, or its prompt is not evaluated yet).
    next: Option<u32>,
    /// Speculative decoding's state, where its slot has a drafter.
    drafting: Option<Drafting>,
    /// Tokens sampled, and the passes, drafts and agreeing guesses since
    /// its prompt's.
    stats: GenStats,
    /// When it began.
    began: std::time::Instant,
}

/// Samples a token from `logits` for `g`, whose `generated` tokens were
/// sampled before, and hands it to its answer (`job`'s): the token and
/// whether the completion goes on.
fn sample_next(
    g: &mut Generation<'_>,
    generated: &mut usize,
    job: &Job,
    logits: &[f32],
) -> (u32, bool) {
    let t = pick(&mut g.sampler, &g.stuck, logits);
    *generated += 1;
    let control = g.out.take(t, logits, &g.stuck, &mut deliver(job));
    (t, matches!(control, Control::Continue) && *generated < g.n)
}

impl Running<'_> {
    /// Whether its prompt is evaluated.
    fn prompted(&self) -> bool {
        self.prompt_at == self.g.prompt.len()
    }

    /// Whether it is done: prompted, and no token left to evaluate.
    fn done(&self) -> bool {
        self.prompted() && self.next.is_none()
    }

    /// How many positions it evaluates in the next pass (0: none, it is
    /// done), given at most `room` prompt positions: its next token and the
    /// draft after it (drafted now), or a chunk of its prompt (one position
    /// at least, so that a prompt always goes on).
    fn plan(&mut self, slot: &mut Slot<'_>, room: usize) -> usize {
        let session = &slot.session;
        if !self.prompted() {
            return (self.g.prompt.len() - self.prompt_at).min(room.max(1));
        }
        let Some(t) = self.next else {
            return 0;
        };
        let (Some(d), Some(drafter)) = (&mut self.drafting, &mut slot.drafter) else {
            return 1;
        };
        // The tokens still wanted after the one the pass samples last, and
        // the session's positions after `t`'s.
        let room = (self.g.n - self.stats.generated - 1)
            .min(
                session
                    .max_positions()
                    .saturating_sub(session.position() + 1),
            )
            .min(session.max_draft());
        1 + d.draft(drafter.as_mut(), t, room).len()
    }

    /// Its `k` inputs of the next pass ([`plan`](Self::plan)) and their
    /// places.
    fn inputs(&self, k: usize) -> (Vec<TokenInput<'_>>, Vec<InputPlace>) {
        if !self.prompted() {
            let chunk = self.prompt_at..self.prompt_at + k;
            return (
                self.g.prompt.inputs()[chunk.clone()].to_vec(),
                self.g.prompt.places()[chunk].to_vec(),
            );
        }
        (self.tokens(k), Vec::new())
    }

    /// The first `k` of its next token and the draft after it: what its
    /// next pass evaluates once its prompt is.
    fn tokens(&self, k: usize) -> Vec<TokenInput<'static>> {
        let draft = self.drafting.as_ref().map_or(&[][..], Drafting::drafted);
        let tokens = self.next.into_iter().chain(draft.iter().copied());
        tokens.take(k).map(TokenInput::Token).collect()
    }
}

impl<'m> Engine<'m> {
    /// Whether completions run side by side: with several slots, and no
    /// drafter or one a slot ([`Drafter::fork`]).
    fn side_by_side(&self) -> bool {
        self.slots.len() > 1
            && (self.drafter.is_none() || self.slots.iter().all(|s| s.drafter.is_some()))
    }

    /// Begins `job` in a slot none of `running` holds: the completion, its
    /// prompt's new positions left to the passes ([`step`](Self::step));
    /// `None` where it is already answered (an error).
    fn start(
        &mut self,
        job: Job,
        running: &[Running<'m>],
        about: &About<'_>,
    ) -> Option<Running<'m>> {
        let g = match self.begin(&job.completion, |i| running.iter().all(|r| r.g.slot != i)) {
            Ok(g) => g,
            Err(e) => {
                answered(self, job, None, Err(e), about);
                return None;
            }
        };
        about.started(g.slot);
        let _ = job.events.send(Event::Started);
        let n_vocab = self.model.hp.n_vocab;
        let drafting = match (&self.drafter, &self.slots[g.slot].drafter) {
            (Some((_, max_draft, adaptive)), Some(_)) => {
                Some(Drafting::new(g.ids.clone(), *max_draft, *adaptive, n_vocab))
            }
            _ => None,
        };
        Some(Running {
            job,
            prompt_at: g.keep,
            g,
            next: None,
            drafting,
            stats: GenStats::default(),
            began: std::time::Instant::now(),
        })
    }

    /// One round of passes: every generating completion's next token (and
    /// the draft after it, with a drafter), and with what room is left in
    /// the batch buffers, chunks of the prompts not yet evaluated (images at
    /// their places); each completion whose prompt is done takes the tokens
    /// it samples (those of its draft that agree, and one more), and those
    /// done are answered. A failed pass ends only the completions that fail
    /// alone too (models without recurrent state; else all of its own).
    fn step(&mut self, running: &mut Vec<Running<'m>>, about: &About<'_>) {
        running.sort_by_key(|r| r.g.slot);
        let n_vocab = self.model.hp.n_vocab;
        let Some(at_once) = running
            .first()
            .map(|r| self.slots[r.g.slot].session.prefill_batch().max(1))
        else {
            return;
        };
        // Each completion's positions this round: the generating ones' first,
        // then prompts in the room they leave in the batch buffers.
        let mut take = vec![0; running.len()];
        let generating = running.iter().filter(|r| r.prompted() && r.next.is_some());
        let costs = self.pass_cost.costs(generating.count());
        for (k, r) in take.iter_mut().zip(running.iter_mut()) {
            if r.prompted() {
                if let (Some(d), Some(c)) = (&mut r.drafting, costs) {
                    d.pass_costs(c);
                }
                *k = r.plan(&mut self.slots[r.g.slot], 0);
            }
        }
        let mut room = at_once.saturating_sub(take.iter().sum());
        for (k, r) in take.iter_mut().zip(running.iter_mut()) {
            if !r.prompted() {
                *k = r.plan(&mut self.slots[r.g.slot], room);
                room = room.saturating_sub(*k);
            }
        }
        let drafted: Vec<bool> = running
            .iter()
            .zip(&take)
            .map(|(r, &k)| r.prompted() && k > 1)
            .collect();
        let (owned, owned_places): (Vec<Vec<TokenInput<'_>>>, Vec<Vec<InputPlace>>) =
            running.iter().zip(&take).map(|(r, &k)| r.inputs(k)).unzip();
        // Each completion's rows of logits: every position's where it
        // verifies a draft, else its last's (none where it sits out).
        let rows: Vec<usize> = take
            .iter()
            .zip(&drafted)
            .map(|(&k, &d)| if d { k } else { k.min(1) })
            .collect();
        let mut logits = vec![0f32; rows.iter().sum::<usize>() * n_vocab];
        let mut sessions: Vec<&mut Session<'m>> = self
            .slots
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| running.iter().any(|r| r.g.slot == *i))
            .map(|(_, s)| &mut s.session)
            .collect();
        // Passes of at most `at_once` positions, in order; each completion's
        // time is its pass's. A pass that fails is tried again a completion
        // at a time where the model holds no recurrent state (a failed pass
        // leaves the caches as they were for the positions before it), so
        // that an error only some completions meet (an expert only they
        // pick, unreadable) ends only those; else it ends all of its own.
        let retry = self.model.hybrid.linear.is_none();
        let mut took = vec![Duration::ZERO; running.len()];
        let mut failed: Vec<Option<String>> = vec![None; running.len()];
        let (mut first, mut row) = (0, 0);
        while first < running.len() {
            let mut end = first;
            let mut total = 0;
            while end < running.len() && (end == first || total + take[end] <= at_once) {
                total += take[end];
                end += 1;
            }
            let n_rows: usize = rows[first..end].iter().sum();
            let lg = &mut logits[row * n_vocab..(row + n_rows) * n_vocab];
            let t0 = std::time::Instant::now();
            // Those with nothing this round sit it out.
            let members: Vec<usize> = (first..end).filter(|&i| take[i] > 0).collect();
            let part = |i: usize| SessionInputs {
                inputs: &owned[i],
                places: &owned_places[i],
                every: drafted[i],
            };
            let pass = {
                let mut with: Vec<&mut Session<'m>> = Vec::with_capacity(members.len());
                let mut ready = Ok(());
                for (i, s) in (first..end).zip(sessions[first..end].iter_mut()) {
                    if take[i] == 0 {
                        continue;
                    }
                    if drafted[i] {
                        ready = ready.and(s.save_for_keep(take[i]).map_err(str::to_string));
                    }
                    with.push(&mut **s);
                }
                let parts: Vec<SessionInputs<'_, '_>> = members.iter().map(|&i| part(i)).collect();
                match (&mut with[..], &parts[..]) {
                    _ if ready.is_err() => ready,
                    ([], _) => Ok(()),
                    ([one], [part]) if part.inputs.len() == 1 => one
                        .eval_placed(
                            &mut self.mv,
                            &mut self.supply,
                            Some(&self.lookahead),
                            part.inputs[0],
                            part.places.first().copied().unwrap_or(InputPlace::Text),
                            lg,
                        )
                        .map_err(|e| e.to_string()),
                    _ => Session::eval_together_placed(
                        &mut with,
                        &mut self.mv,
                        &mut self.supply,
                        &parts,
                        lg,
                    )
                    .map_err(|e| e.to_string()),
                }
            };
            took[first..end].fill(t0.elapsed());
            let generating = |i: &usize| running[*i].prompted();
            match pass {
                Ok(()) => {
                    if total > 0 {
                        self.pass_cost.record(total, t0.elapsed());
                    }
                    let n = members.iter().filter(|i| generating(i)).count();
                    if n > 0 {
                        about.passes(1, n as u64);
                    }
                }
                Err(e) if !retry || members.len() < 2 => {
                    for &i in &members {
                        failed[i] = Some(e.clone());
                    }
                }
                Err(_) => {
                    // Each alone, into its own rows.
                    let mut at = 0;
                    for i in first..end {
                        let mine = &mut lg[at * n_vocab..(at + rows[i]) * n_vocab];
                        at += rows[i];
                        if take[i] == 0 {
                            continue;
                        }
                        let s = &mut *sessions[i];
                        let t0 = std::time::Instant::now();
                        let alone = if drafted[i] {
                            s.save_for_keep(take[i]).map_err(str::to_string)
                        } else {
                            Ok(())
                        }
                        .and_then(|()| {
                            Session::eval_together_placed(
                                &mut [s],
                                &mut self.mv,
                                &mut self.supply,
                                &[part(i)],
                                mine,
                            )
                            .map_err(|e| e.to_string())
                        });
                        took[i] = t0.elapsed();
                        match alone {
                            Ok(()) if generating(&i) => about.passes(1, 1),
                            Ok(()) => {}
                            Err(e) => failed[i] = Some(e),
                        }
                    }
                }
            }
            (first, row) = (end, row + n_rows);
        }
        drop((sessions, owned, owned_places));
        let mut row = 0;
        for (i, run) in running.iter_mut().enumerate() {
            // Its rows, back to back.
            let lg = &logits[row * n_vocab..(row + rows[i]) * n_vocab];
            row += rows[i];
            let Some(last) = lg.rchunks_exact(n_vocab).next() else {
                continue;
            };
            if failed[i].is_some() {
                continue; // its pass failed: answered below
            }
            if !run.prompted() {
                // A drafter that reads the model's hidden states sees every
                // position its slot keeps, the prompt's included.
                let slot = &mut self.slots[run.g.slot];
                if let Some(d) = slot.drafter.as_mut().filter(|d| d.wants_hidden()) {
                    let (chunk, _) = run.inputs(take[i]);
                    slot.session.show(d.as_mut(), &chunk);
                }
                run.prompt_at += take[i];
                if run.prompted() {
                    run.stats.prefill = run.began.elapsed();
                    if run.g.n > 0 {
                        let Running { g, stats, job, .. } = run;
                        let (t, go_on) = sample_next(g, &mut stats.generated, job, last);
                        run.next = go_on.then_some(t);
                    }
                }
                continue;
            }
            let Some(t) = run.next else {
                continue;
            };
            // The pass's tokens: `t` and the draft verified after it.
            let verified = run.tokens(take[i]);
            let Running {
                g,
                stats,
                job,
                drafting,
                ..
            } = run;
            let mut sample = |row: &[f32]| sample_next(g, &mut stats.generated, job, row);
            let settled = match drafting {
                Some(d) => d.settle(t, lg, took[i], &mut sample),
                None => Settled::plain(sample(last)),
            };
            stats.passes += 1;
            if drafted[i] {
                stats.verify_passes += 1;
                stats.drafted += take[i] - 1;
                stats.accepted += settled.accepted;
            }
            run.next = settled.next;
            let slot = &mut self.slots[run.g.slot];
            let session = &mut slot.session;
            let kept = settled.kept;
            if let Err(e) = session.keep(&mut self.mv, &mut self.supply, &verified, kept) {
                failed[i] = Some(e.to_string());
                run.next = None;
            } else if let Some(d) = slot.drafter.as_mut().filter(|d| d.wants_hidden()) {
                // The pass's rows, or the replay's of the kept ones.
                session.show(d.as_mut(), &verified[..kept]);
            }
        }
        let mut i = running.len();
        while i > 0 {
            i -= 1;
            if let Some(e) = failed[i].take() {
                let run = running.swap_remove(i);
                self.forget(run.g.slot);
                let e = server_error(format!("the forward pass failed: {e}"));
                answered(self, run.job, Some(run.g.slot), Err(e), about);
            } else if running[i].done() {
                let run = running.swap_remove(i);
                self.end(run, about);
            }
        }
    }

    /// Empties `slot` after a completion in it failed: a pass that fails
    /// midway may leave a recurrent state (or cache rows) of positions the
    /// slot does not count, so nothing it holds is kept for the next.
    fn forget(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        s.held.clear();
        // Always allowed; position 0 starts the state from zero.
        let _ = s.session.rewind(0);
    }

    /// Answers the completion `run` ran.
    fn end(&mut self, run: Running<'m>, about: &About<'_>) {
        let Running {
            job,
            g,
            stats,
            began,
            ..
        } = run;
        let stats = GenStats {
            prompt_tokens: g.prompt.len() - g.keep,
            decode: began.elapsed().saturating_sub(stats.prefill),
            ..stats
        };
        let slot = g.slot;
        let stuck = g.stuck.get();
        let result = self.finish(
            slot,
            g.prompt,
            g.keep,
            g.out,
            stuck,
            &stats,
            &mut deliver(&job),
        );
        answered(self, job, Some(slot), result, about);
    }
}

/// Accepts connections until the listener fails, each served on a thread
/// of `scope`.
fn accept<'s, 'a: 's>(
    scope: &'s std::thread::Scope<'s, '_>,
    listener: TcpListener,
    jobs: Sender<Job>,
    about: &'a About<'a>,
) {
    let open = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else {
            // Out of file descriptors, say: give the open ones time to close
            // instead of spinning.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let (jobs, open) = (jobs.clone(), Arc::clone(&open));
        if open.fetch_add(1, Ordering::SeqCst) >= about.opts.max_connections {
            open.fetch_sub(1, Ordering::SeqCst);
            // Read the request first (briefly), so that the client gets the
            // answer instead of a reset for the bytes left unread.
            let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
            let drain = http::Limits {
                max_body: 1 << 20,
                ..about.opts.limits
            };
            let _ = http::read_request(&mut BufReader::new(&stream), &mut std::io::sink(), &drain);
            let e = ApiError {
                status: 503,
                message: format!(
                    "too many connections (at most {}: les serve --max-connections)",
                    about.opts.max_connections
                ),
            };
            let _ = respond_error(&mut &stream, &e, false);
            continue;
        }
        scope.spawn(move || {
            let _ = connection(stream, &jobs, about);
            open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Serves one connection's requests until it closes.
fn connection(stream: TcpStream, jobs: &Sender<Job>, about: &About<'_>) -> std::io::Result<()> {
    let opts = about.opts;
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    stream.set_nodelay(true)?;
    let mut out = stream.try_clone()?;
    let mut input = BufReader::new(stream);
    loop {
        let req = match http::read_request(&mut input, &mut out, &opts.limits) {
            Ok(r) => r,
            Err(http::HttpError::Closed) | Err(http::HttpError::Io(_)) => return Ok(()),
            Err(e) => {
                let e = ApiError {
                    status: e.status(),
                    message: e.to_string(),
                };
                return respond_error(&mut out, &e, false);
            }
        };
        let keep = req.keep_alive();
        let path = req.path.trim_end_matches('/');
        if !authorized(&req, path, opts.api_key.as_deref()) {
            let e = ApiError {
                status: 401,
                message: "a valid API key is required (Authorization: Bearer KEY)".into(),
            };
            respond_error(&mut out, &e, keep)?;
            if keep {
                continue;
            }
            return Ok(());
        }
        let endpoint = match path {
            "/v1/chat/completions" | "/chat/completions" => Some(Endpoint::Chat),
            "/v1/completions" => Some(Endpoint::Text),
            "/completion" | "/completions" | "/infill" => Some(Endpoint::Native),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/responses" | "/responses" => Some(Endpoint::Responses),
            _ => None,
        };
        let counts = counted(path);
        match (req.method.as_str(), path, endpoint) {
            ("GET", "/health" | "/v1/health", _) => {
                respond_json(&mut out, 200, &json!({"status": "ok"}), keep)?
            }
            ("GET", "/v1/models" | "/models", _) => {
                let models = json!({"object": "list", "data": [{
                    "id": opts.model_id, "object": "model", "created": now(), "owned_by": "les"}]});
                respond_json(&mut out, 200, &models, keep)?
            }
            ("GET", "/props", _) => respond_json(&mut out, 200, &props(about), keep)?,
            ("GET", "/slots", _) => respond_json(&mut out, 200, &slots(about), keep)?,
            ("GET", "/metrics", _) if opts.metrics => http::write_response(
                &mut out,
                200,
                "text/plain; version=0.0.4",
                metrics(about).as_bytes(),
                keep,
                &[],
            )?,
            ("GET", "/metrics", _) => respond_error(
                &mut out,
                &ApiError {
                    status: 501,
                    message: "metrics are off: start les serve with --metrics".into(),
                },
                keep,
            )?,
            ("POST", _, None) if counts.is_some() => {
                let kind = counts.unwrap_or(Endpoint::Chat);
                let count = kind
                    .read(path, &req.body)
                    .and_then(|c| api::count_tokens(&c, about.tokenizer, about.clip));
                match count {
                    Ok(n) if kind == Endpoint::Messages => {
                        respond_json(&mut out, 200, &json!({"input_tokens": n}), keep)?
                    }
                    Ok(n) => respond_json(
                        &mut out,
                        200,
                        &json!({"object": "response.input_tokens", "input_tokens": n}),
                        keep,
                    )?,
                    Err(e) => respond_json(&mut out, e.status, &kind.error_body(&e), keep)?,
                }
            }
            ("POST", "/tokenize" | "/detokenize" | "/apply-template", _) => {
                let answer = match path {
                    "/tokenize" => api::tokenize(&req.body, about.tokenizer),
                    "/detokenize" => api::detokenize(&req.body, about.tokenizer),
                    _ => api::apply_template(&req.body, about.tokenizer),
                };
                match answer {
                    Ok(v) => respond_json(&mut out, 200, &v, keep)?,
                    Err(e) => respond_error(&mut out, &e, keep)?,
                }
            }
            ("OPTIONS", ..) => http::write_response(
                &mut out,
                204,
                "text/plain",
                b"",
                keep,
                &[
                    ("Access-Control-Allow-Methods", "GET, POST, OPTIONS"),
                    (
                        "Access-Control-Allow-Headers",
                        "Content-Type, Authorization",
                    ),
                ],
            )?,
            ("POST", _, Some(endpoint)) => {
                let c = match endpoint.read(path, &req.body) {
                    Ok(c) => c,
                    Err(e) => {
                        respond_json(&mut out, e.status, &endpoint.error_body(&e), keep)?;
                        if keep {
                            continue;
                        }
                        return Ok(());
                    }
                };
                let shape = Shape {
                    id: &completion_id(endpoint),
                    created: now(),
                    model: &opts.model_id,
                    endpoint,
                    tokenizer: about.tokenizer,
                };
                about.activity().deferred += 1;
                if !complete(&mut out, jobs, c, &shape, keep)? {
                    return Ok(());
                }
            }
            _ if endpoint.is_some()
                || counts.is_some()
                || matches!(
                    path,
                    "/health"
                        | "/v1/health"
                        | "/v1/models"
                        | "/models"
                        | "/props"
                        | "/tokenize"
                        | "/detokenize"
                        | "/apply-template"
                ) =>
            {
                let e = ApiError {
                    status: 405,
                    message: format!("{} {} is not served", req.method, req.path),
                };
                respond_error(&mut out, &e, keep)?
            }
            _ => {
                let e = ApiError {
                    status: 404,
                    message: format!("no endpoint {}", req.path),
                };
                respond_error(&mut out, &e, keep)?
            }
        }
        if !keep {
            return Ok(());
        }
    }
}

/// The endpoint whose prompt tokens `path` counts (llama-server's
/// `/v1/chat/completions/input_tokens`, `/v1/responses/input_tokens` and
/// Anthropic's `/v1/messages/count_tokens`).
fn counted(path: &str) -> Option<Endpoint> {
    match path {
        "/v1/chat/completions/input_tokens" | "/chat/completions/input_tokens" => {
            Some(Endpoint::Chat)
        }
        "/v1/responses/input_tokens" | "/responses/input_tokens" => Some(Endpoint::Responses),
        "/v1/messages/count_tokens" => Some(Endpoint::Messages),
        _ => None,
    }
}

/// Whether `req` (to `path`) may be answered: `/health`, a preflight
/// `OPTIONS` and, without a key, everything; else a request carrying it.
fn authorized(req: &http::Request, path: &str, key: Option<&str>) -> bool {
    let Some(key) = key else { return true };
    if req.method == "OPTIONS" || matches!(path, "/health" | "/v1/health") {
        return true;
    }
    let given = req
        .header("authorization")
        .and_then(|h| {
            h.strip_prefix("Bearer ")
                .or_else(|| h.strip_prefix("bearer "))
        })
        .map(str::trim);
    // Compared in constant time: the answer's timing tells nothing of the key.
    given.is_some_and(|g| {
        g.len() == key.len()
            && g.bytes()
                .zip(key.bytes())
                .fold(0u8, |d, (a, b)| d | (a ^ b))
                == 0
    })
}

/// Queues completion `c` and writes its answer; whether the connection
/// stays open.
fn complete(
    out: &mut TcpStream,
    jobs: &Sender<Job>,
    c: Completion,
    shape: &Shape<'_>,
    keep: bool,
) -> std::io::Result<bool> {
    let (events, answers) = channel();
    let stream = c.stream;
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        completion: c,
        endpoint: shape.endpoint,
        events,
        cancel: Arc::clone(&cancel),
    };
    if jobs.send(job).is_err() {
        let e = server_error("the engine stopped".into());
        respond_error(out, &e, false)?;
        return Ok(false);
    }
    if !stream {
        // Deltas are not sent: wait for the end, looking now and then
        // whether the client is still there.
        loop {
            match answers.recv_timeout(Duration::from_millis(100)) {
                Ok(Event::Done(result)) => {
                    match result {
                        Ok(f) => respond_json(out, 200, &shape.whole(&f), keep)?,
                        Err(e) => respond_json(out, e.status, &shape.error(&e), keep)?,
                    }
                    return Ok(keep);
                }
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => {
                    if client_gone(out) {
                        cancel.store(true, Ordering::Relaxed);
                        return Ok(false);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    respond_error(out, &server_error("the engine stopped".into()), false)?;
                    return Ok(false);
                }
            }
        }
    }
    if shape.endpoint == Endpoint::Messages {
        let mut stream = anthropic::Stream::new(shape.tag(), shape.model);
        return stream_named(out, answers, shape, &mut stream);
    }
    if shape.endpoint == Endpoint::Responses {
        let mut stream = responses::Stream::new(shape.tag(), shape.model, shape.created);
        return stream_named(out, answers, shape, &mut stream);
    }
    let mut started = false;
    // Log probabilities sent with the pieces so far.
    let mut sent = 0;
    for event in answers {
        let written = match event {
            Event::Started => {
                started = true;
                http::start_event_stream(out).and_then(|()| {
                    let first = shape.chunk(Some((Channel::Content, "")), None, &[]);
                    http::write_event(out, &first.to_string())
                })
            }
            Event::Delta(to, text, probs) => {
                sent += probs.len();
                let chunk = shape.chunk(Some((to, &text)), None, &probs);
                http::write_event(out, &chunk.to_string())
            }
            Event::Done(Ok(f)) => {
                let rest = f
                    .logprobs
                    .as_deref()
                    .map_or(&[][..], |p| &p[sent.min(p.len())..]);
                if !f.tool_calls.is_empty() {
                    // The calls, whole, in a delta of their own.
                    let mut calls = shape.chunk(None, None, &[]);
                    calls["choices"][0]["delta"] =
                        json!({ "tool_calls": shape.tool_calls(&f.tool_calls, true) });
                    http::write_event(out, &calls.to_string())?;
                }
                let mut last = shape.chunk(None, Some(&f), rest);
                if shape.endpoint == Endpoint::Native {
                    // llama-server's own stream ends with its last event.
                    http::write_event(out, &last.to_string())?;
                    return Ok(false);
                }
                last["usage"] = usage(&f);
                last["timings"] = timings(&f);
                http::write_event(out, &last.to_string())
                    .and_then(|()| http::write_event(out, "[DONE]"))?;
                return Ok(false);
            }
            // Before the stream started, an answer of its own; after, an
            // event (llama-server's), and the stream ends.
            Event::Done(Err(e)) if started => {
                http::write_event(out, &e.body().to_string())?;
                return Ok(false);
            }
            Event::Done(Err(e)) => {
                respond_error(out, &e, false)?;
                return Ok(false);
            }
        };
        if written.is_err() {
            // The client went away: dropping `answers` stops the generation.
            return Ok(false);
        }
    }
    Ok(false)
}

/// A stream of named events: Anthropic's ([`anthropic::Stream`]) or the
/// Responses API's ([`responses::Stream`]).
pub trait NamedEvents {
    /// The first events.
    fn start(&mut self) -> Vec<(&'static str, Value)>;
    /// The events of a piece of text of the answer or its reasoning.
    fn piece(&mut self, to: Channel, text: &str) -> Vec<(&'static str, Value)>;
    /// The last events.
    fn finish(&mut self, f: &Finished) -> Vec<(&'static str, Value)>;
}

/// Writes the stream of a `/v1/messages` or `/v1/responses` answer: its
/// named events, an error before it started as an answer in the endpoint's
/// error shape, one after as an `error` event.
fn stream_named(
    out: &mut TcpStream,
    answers: Receiver<Event>,
    shape: &Shape<'_>,
    stream: &mut impl NamedEvents,
) -> std::io::Result<bool> {
    let mut started = false;
    let write = |out: &mut TcpStream, events: Vec<(&str, Value)>| {
        events
            .into_iter()
            .try_for_each(|(name, v)| http::write_named_event(out, Some(name), &v.to_string()))
    };
    for event in answers {
        let written = match event {
            Event::Started => {
                started = true;
                http::start_event_stream(out).and_then(|()| write(out, stream.start()))
            }
            Event::Delta(to, text, _) => write(out, stream.piece(to, &text)),
            Event::Done(Ok(f)) => {
                write(out, stream.finish(&f))?;
                return Ok(false);
            }
            Event::Done(Err(e)) if started => {
                // Anthropic's error body says its type; OpenAI's is told so.
                let mut body = shape.error(&e);
                body["type"] = json!("error");
                http::write_named_event(out, Some("error"), &body.to_string())?;
                return Ok(false);
            }
            Event::Done(Err(e)) => {
                respond_json(out, e.status, &shape.error(&e), false)?;
                return Ok(false);
            }
        };
        if written.is_err() {
            return Ok(false);
        }
    }
    Ok(false)
}

/// Whether the client closed its end (a waiting client sends nothing more;
/// its next request, pipelined, is data, not a close).
fn client_gone(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let peeked = s.peek(&mut [0u8; 1]);
    let _ = s.set_nonblocking(false);
    match peeked {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        ),
    }
}

/// The fixed parts of one completion's answers.
struct Shape<'a> {
    id: &'a str,
    created: u64,
    model: &'a str,
    endpoint: Endpoint,
    tokenizer: &'a Tokenizer,
}

impl Shape<'_> {
    /// The whole answer (`stream: false`).
    fn whole(&self, f: &Finished) -> Value {
        let mut choice = match self.endpoint {
            Endpoint::Native => {
                return self.native(f, &f.text, f.logprobs.as_deref().unwrap_or_default())
            }
            Endpoint::Messages => return anthropic::message(self.tag(), self.model, f),
            Endpoint::Responses => {
                return responses::response(self.tag(), self.model, self.created, f)
            }
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": f.text});
                if !f.reasoning.is_empty() {
                    message["reasoning_content"] = json!(f.reasoning);
                }
                if !f.tool_calls.is_empty() {
                    message["tool_calls"] = self.tool_calls(&f.tool_calls, false);
                    if f.text.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                json!({"index": 0, "finish_reason": f.finish_reason, "message": message})
            }
            Endpoint::Text => json!({"index": 0,
                "finish_reason": f.finish_reason, "text": f.text, "logprobs": null}),
        };
        // Asked for, they are there even when no token was generated.
        if let Some(probs) = &f.logprobs {
            choice["logprobs"] = self.logprobs(probs);
        }
        let mut v = self.envelope("chat.completion", choice, &[]);
        v["usage"] = usage(f);
        v["timings"] = timings(f);
        v
    }

    /// An answer or a chunk of one: `choice`, with `probs` where there are
    /// any, under the id, the object (`chat_object` for chat, else
    /// `text_completion`), the time and the model.
    fn envelope(&self, chat_object: &str, mut choice: Value, probs: &[PositionLogprobs]) -> Value {
        if !probs.is_empty() {
            choice["logprobs"] = self.logprobs(probs);
        }
        json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => chat_object,
                Endpoint::Text | Endpoint::Native => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// One event of a stream: a piece of text (the reasoning's or the
    /// answer's), or the end, with the log probabilities of the tokens since
    /// the last event.
    fn chunk(
        &self,
        text: Option<(Channel, &str)>,
        end: Option<&Finished>,
        probs: &[PositionLogprobs],
    ) -> Value {
        if self.endpoint == Endpoint::Native {
            return match end {
                // The last event: the stats, the text sent already.
                Some(f) => self.native(f, "", probs),
                None => {
                    let mut v = json!({"index": 0, "content": text.map_or("", |(_, t)| t),
                        "tokens": [], "stop": false});
                    if !probs.is_empty() {
                        v["completion_probabilities"] = self.logprobs(probs)["content"].take();
                    }
                    v
                }
            };
        }
        let reason = end.map(|f| f.finish_reason);
        let choice = match self.endpoint {
            Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
                let delta = match text {
                    Some((_, "")) => json!({"role": "assistant", "content": ""}),
                    Some((Channel::Reasoning, t)) => json!({"reasoning_content": t}),
                    Some((_, t)) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": 0, "delta": delta, "finish_reason": reason})
            }
            Endpoint::Text | Endpoint::Native => json!({"index": 0,
                "text": text.map_or("", |(_, t)| t), "logprobs": null, "finish_reason": reason}),
        };
        self.envelope("chat.completion.chunk", choice, probs)
    }
}

impl Shape<'_> {
    /// The body of error `e` in this endpoint's shape.
    fn error(&self, e: &ApiError) -> Value {
        self.endpoint.error_body(e)
    }

    /// The id's unique part (after its kind).
    fn tag(&self) -> &str {
        self.id.rsplit('-').next().unwrap_or_default()
    }

    /// llama-server's own `/completion` answer of `f`, its text `content`
    /// (the whole answer's, or nothing in a stream's last event) and `probs`
    /// (all, or those not sent yet).
    fn native(&self, f: &Finished, content: &str, probs: &[PositionLogprobs]) -> Value {
        let stop_type = match (f.finish_reason, &f.stopping_word) {
            ("length", _) => "limit",
            (_, Some(_)) => "word",
            _ => "eos",
        };
        let mut v = json!({
            "index": 0,
            "content": content,
            "tokens": f.tokens,
            "id_slot": f.slot,
            "stop": true,
            "model": self.model,
            "tokens_predicted": f.completion_tokens,
            "tokens_evaluated": f.prompt_tokens,
            "has_new_line": f.text.contains('\n'),
            "truncated": false,
            "stop_type": stop_type,
            "stopping_word": f.stopping_word.as_deref().unwrap_or(""),
            "tokens_cached": f.cached_tokens,
            "timings": timings(f),
        });
        if !probs.is_empty() {
            v["completion_probabilities"] = self.logprobs(probs)["content"].take();
        }
        v
    }

    /// The calls as OpenAI writes them (`{"id", "type", "function": {"name",
    /// "arguments"}}`, and their `index` in a stream's delta).
    fn tool_calls(&self, calls: &[ToolCall], indexed: bool) -> Value {
        let tag = self.tag();
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({"id": format!("call_{tag}_{i}"), "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments}});
                if indexed {
                    v["index"] = json!(i);
                }
                v
            })
            .collect()
    }

    /// Log probabilities as llama-server writes them (OpenAI's chat shape,
    /// for both endpoints): `{"content": [{"id", "token", "bytes",
    /// "logprob", "top_logprobs": [...]}]}`.
    fn logprobs(&self, probs: &[PositionLogprobs]) -> Value {
        let one = |t: &TokenLogprob| {
            // Special tokens as their text: what they are, not nothing.
            let bytes = self.tokenizer.piece(t.id, true);
            let token = match std::str::from_utf8(bytes) {
                Ok(s) => s,
                // A piece of a character: its whole characters, as llama-server.
                Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or_default(),
            };
            // JSON has no -inf: the lowest float instead, as llama-server.
            let logprob = if t.logprob.is_finite() {
                t.logprob
            } else {
                f32::MIN
            };
            json!({"id": t.id, "token": token, "bytes": bytes, "logprob": logprob})
        };
        let content: Vec<Value> = probs
            .iter()
            .map(|p| {
                let mut v = one(&p.token);
                v["top_logprobs"] = p.top.iter().map(one).collect();
                v
            })
            .collect();
        json!({ "content": content })
    }
}

/// llama-server's `/props`: the context, the defaults, the template.
fn props(about: &About<'_>) -> Value {
    let d = api::Sampling::default();
    json!({
        "default_generation_settings": {
            "n_ctx": about.n_ctx,
            "params": {
                "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                "min_p": d.min_p, "typical_p": d.typical_p, "repeat_penalty": d.repeat_penalty,
                "repeat_last_n": d.repeat_last_n, "n_predict": -1,
            },
        },
        "total_slots": about.activity().slots.len(),
        "model_alias": about.opts.model_id,
        "chat_template": about.tokenizer.chat_template_source().unwrap_or(""),
        "modalities": {"vision": about.clip.is_some(), "audio": false},
        "build_info": format!("les {}", env!("CARGO_PKG_VERSION")),
    })
}

/// llama-server's `/slots`: each slot's context, whether it answers now,
/// and the positions its cache holds.
fn slots(about: &About<'_>) -> Value {
    let a = about.activity();
    a.slots
        .iter()
        .enumerate()
        .map(|(id, &(held, busy))| {
            json!({"id": id, "n_ctx": about.n_ctx, "is_processing": busy,
                "speculative": about.speculative, "n_cached": held})
        })
        .collect()
}

/// llama-server's `/metrics`, in Prometheus' text format.
fn metrics(about: &About<'_>) -> String {
    let a = about.activity();
    let busy = a.slots.iter().filter(|s| s.1).count();
    let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let per_pass = if a.decode_passes > 0 {
        a.decode_slots as f64 / a.decode_passes as f64
    } else {
        0.0
    };
    let rows: [(&str, &str, &str, f64); 10] = [
        (
            "prompt_tokens_total",
            "counter",
            "Prompt positions evaluated.",
            a.prompt_tokens as f64,
        ),
        (
            "prompt_seconds_total",
            "counter",
            "Seconds evaluating prompts.",
            a.prompt_seconds,
        ),
        (
            "tokens_predicted_total",
            "counter",
            "Tokens generated.",
            a.predicted_tokens as f64,
        ),
        (
            "tokens_predicted_seconds_total",
            "counter",
            "Seconds generating.",
            a.predicted_seconds,
        ),
        (
            "prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            rate(a.prompt_tokens, a.prompt_seconds),
        ),
        (
            "predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            rate(a.predicted_tokens, a.predicted_seconds),
        ),
        (
            "requests_processing",
            "gauge",
            "Completions being answered.",
            busy as f64,
        ),
        (
            "requests_deferred",
            "gauge",
            "Completions waiting.",
            a.deferred as f64,
        ),
        (
            "n_decode_total",
            "counter",
            "Passes of the model after the prompts'.",
            a.decode_passes as f64,
        ),
        (
            "n_busy_slots_per_decode",
            "gauge",
            "Average completions generating in one pass.",
            per_pass,
        ),
    ];
    // Where experts stream from flash, the scheduler's counters (les's own).
    let experts = a.experts.map(|x| {
        [
            (
                "expert_hits_total",
                "Picked experts resident when their layer began.",
                x.hits,
            ),
            (
                "expert_late_hits_total",
                "Picked experts whose read ahead was still in flight.",
                x.late_hits,
            ),
            (
                "expert_misses_total",
                "Picked experts read when picked.",
                x.misses,
            ),
            (
                "expert_demand_bytes_total",
                "Bytes read for picked experts not resident.",
                x.demand_bytes,
            ),
            (
                "expert_prefetch_bytes_total",
                "Bytes read ahead by the lookahead.",
                x.prefetch_bytes,
            ),
            (
                "expert_read_retries_total",
                "Expert reads retried after transient device errors.",
                x.retries,
            ),
            (
                "expert_rereads_total",
                "Picked experts read again after their checksum failed.",
                x.rereads,
            ),
        ]
    });
    let mut out = String::new();
    let llama = rows.map(|(name, kind, help, v)| ("llamacpp", name, kind, help, v));
    let les = experts
        .into_iter()
        .flatten()
        .map(|(name, help, v)| ("les", name, "counter", help, v as f64));
    for (prefix, name, kind, help, value) in llama.into_iter().chain(les) {
        out.push_str(&format!(
            "# HELP {prefix}:{name} {help}\n# TYPE {prefix}:{name} {kind}\n{prefix}:{name} {value}\n"
        ));
    }
    out
}

fn usage(f: &Finished) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

/// llama-server's `timings`.
fn timings(f: &Finished) -> Value {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let per_s = |n: usize, d: Duration| {
        if d.is_zero() {
            0.0
        } else {
            n as f64 / d.as_secs_f64()
        }
    };
    let evaluated = f.prompt_tokens - f.cached_tokens;
    json!({
        "cache_n": f.cached_tokens,
        "prompt_n": evaluated,
        "prompt_ms": ms(f.prompt_time),
        "prompt_per_second": per_s(evaluated, f.prompt_time),
        "predicted_n": f.completion_tokens,
        "predicted_ms": ms(f.predicted_time),
        "predicted_per_second": per_s(f.completion_tokens, f.predicted_time),
        "draft_n": f.drafted,
        "draft_n_accepted": f.accepted,
    })
}

fn respond_json(out: &mut impl Write, status: u16, v: &Value, keep: bool) -> std::io::Result<()> {
    http::write_response(
        out,
        status,
        "application/json",
        v.to_string().as_bytes(),
        keep,
        &[],
    )
}

fn respond_error(out: &mut impl Write, e: &ApiError, keep: bool) -> std::io::Result<()> {
    respond_json(out, e.status, &e.body(), keep)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A new completion id: the time and a count, unique within the process.
/// A new completion's id (`chatcmpl-...` or `cmpl-...`).
fn completion_id(endpoint: Endpoint) -> String {
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let kind = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Text | Endpoint::Native => "cmpl",
        Endpoint::Messages => "msg",
        Endpoint::Responses => "resp",
    };
    format!(
        "{kind}-{nanos:x}{:x}",
        COUNT.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_passed_on_short_of_a_call_in_the_answer_only() {
        let hermes = ToolFormat::Hermes.call_starts();
        let text = "think <tool_call> more";
        let mut thinking = Marks::default();
        thinking.set(0, Channel::Reasoning);
        // In the reasoning, a call's tag is text.
        assert_eq!(
            passable(text, text.len(), &thinking, hermes, false),
            text.len()
        );
        // In the answer, the text stops short of it (and of its start).
        let answer = Marks::default();
        assert_eq!(passable(text, text.len(), &answer, hermes, false), 6);
        assert_eq!(passable("ok <tool", 8, &answer, hermes, false), 3);
        // What the reply held back (a stop string's start) stays held.
        assert_eq!(passable("ok then", 4, &answer, hermes, false), 4);
        // Without tools, all it wrote.
        assert_eq!(passable(text, text.len(), &answer, None, false), text.len());
        // Reasoning, then an answer from byte 6: the answer's call counts.
        let mut both = Marks::default();
        both.set(0, Channel::Reasoning);
        both.set(6, Channel::Content);
        assert_eq!(both.answer_start(), Some(6));
        assert_eq!(
            passable("abcdefgh <tool_call>", 20, &both, hermes, false),
            9
        );
        assert_eq!(thinking.answer_start(), None);
        // A bare XML format: a function line starts a call too.
        let bare = ToolFormat::Xml { bare: true }.call_starts();
        assert_eq!(passable("ok <function=f>", 15, &answer, bare, false), 3);
        assert_eq!(passable("ok <function=f>", 15, &answer, hermes, false), 15);
        // Where a call ends the reasoning, the reasoning holds back too.
        let xml = ToolFormat::Xml { bare: false }.call_starts();
        assert_eq!(passable("hmm <tool_c", 11, &thinking, xml, true), 4);
        assert_eq!(passable("hmm <tool_c", 11, &thinking, xml, false), 11);
        assert_eq!(thinking.reasoning_start(), Some(0));
        assert_eq!(answer.reasoning_start(), None);
    }
}
