//! Prefill and decode: the KV cache, the scratch buffers and the token loop around
//! [`les_core::model::forward::forward`].

use std::time::{Duration, Instant};

use les_core::model::forward::{
    forward_batch, forward_hybrid, BatchScratch, Experts, ForwardError, KvCache, Lookahead, MatVec,
    RecurrentState, Scratch, TokenInput,
};

use crate::model::Model;

/// Timings and counts of one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GenStats {
    /// Prompt tokens evaluated.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub generated: usize,
    /// Time spent on the prompt.
    pub prefill: Duration,
    /// Time spent generating (after the prompt).
    pub decode: Duration,
}

impl GenStats {
    /// Prompt tokens per second.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill)
    }

    /// Generated tokens per second.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.generated, self.decode)
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

/// Per-sequence state: KV cache (attention layers), recurrent state
/// (linear-attention layers) and scratch for one model.
pub struct Session<'m> {
    model: &'m Model,
    max_positions: usize,
    state: SequenceBuffers,
    /// Buffers of [`eval_batch`](Session::eval_batch), for `prefill_batch`
    /// positions (none for 1).
    batch_floats: Vec<f32>,
    batch_ids: Vec<u16>,
    prefill_batch: usize,
    pos: usize,
}

/// Positions a prompt is evaluated in at once by default (see
/// [`Session::set_prefill_batch`]).
pub const DEFAULT_PREFILL_BATCH: usize = 64;

/// Most positions [`Session::set_prefill_batch`] accepts.
pub const MAX_PREFILL_BATCH: usize = 4096;

/// Most bytes of batch buffers [`Session::set_prefill_batch`] allocates (64
/// positions of `a3b` take about 10 MiB).
pub const MAX_BATCH_BYTES: usize = 256 << 20;

/// A sequence's KV cache, recurrent state and scratch, as allocated by
/// [`Session::new`].
struct SequenceBuffers {
    kv_k: Vec<f32>,
    kv_v: Vec<f32>,
    conv_state: Vec<f32>,
    ssm_state: Vec<f32>,
    scratch: Vec<f32>,
}

impl SequenceBuffers {
    /// The forward pass's views of the buffers, for `model` and `max_positions`
    /// (what they were allocated for).
    fn views(
        &mut self,
        model: &Model,
        max_positions: usize,
    ) -> (KvCache<'_>, RecurrentState<'_>, Scratch<'_>) {
        let (hp, hy) = (&model.hp, &model.hybrid);
        (
            KvCache::new_for(hp, hy, &mut self.kv_k, &mut self.kv_v, max_positions)
                .expect("KV buffers sized by Session::new"),
            RecurrentState::new(hy, &mut self.conv_state, &mut self.ssm_state)
                .expect("recurrent state sized by Session::new"),
            Scratch::new_for(hp, hy, &mut self.scratch, max_positions)
                .expect("scratch sized by Session::new"),
        )
    }
}

/// The buffers of a [`Session`] could not be allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionAllocError {
    /// The positions asked for.
    pub positions: usize,
    /// The bytes they need (KV cache, recurrent state and scratch).
    pub bytes: u128,
}

impl std::fmt::Display for SessionAllocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.positions > MAX_POSITIONS {
            return write!(
                f,
                "a context of {} positions is more than the {MAX_POSITIONS} a session holds",
                self.positions
            );
        }
        write!(
            f,
            "cannot allocate the KV cache and scratch of {} positions ({:.2} GiB); \
             ask for fewer (--ctx, -n, --batch-size)",
            self.positions,
            self.bytes as f64 / (1u64 << 30) as f64
        )
    }
}

impl std::error::Error for SessionAllocError {}

/// Most positions a [`Session`] holds.
pub const MAX_POSITIONS: usize = 1 << 24;

/// `n` zeroed floats, or `None` where the allocator refuses them.
fn zeroed(n: usize) -> Option<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    v.resize(n, 0.0);
    Some(v)
}

impl<'m> Session<'m> {
    /// A session of up to `max_positions` tokens; an error (not an abort) where
    /// its buffers cannot be allocated.
    pub fn new(model: &'m Model, max_positions: usize) -> Result<Session<'m>, SessionAllocError> {
        let (hp, hy) = (&model.hp, &model.hybrid);
        let (conv, ssm) = RecurrentState::len(hy);
        if max_positions > MAX_POSITIONS {
            // Beyond any machine's memory, and keeps the sizes below from overflowing.
            return Err(SessionAllocError {
                positions: max_positions,
                bytes: u128::MAX,
            });
        }
        let kv = KvCache::len_for(hp, hy, max_positions);
        let scratch = Scratch::len_for(hp, hy, max_positions);
        let err = SessionAllocError {
            positions: max_positions,
            bytes: 4 * (2 * kv as u128 + conv as u128 + ssm as u128 + scratch as u128),
        };
        Ok(Session {
            model,
            max_positions,
            state: SequenceBuffers {
                // Attention streams the KV cache every token: huge pages.
                kv_k: crate::hugepages::zeroed_vec(kv).ok_or(err)?,
                kv_v: crate::hugepages::zeroed_vec(kv).ok_or(err)?,
                conv_state: zeroed(conv).ok_or(err)?,
                ssm_state: zeroed(ssm).ok_or(err)?,
                scratch: zeroed(scratch).ok_or(err)?,
            },
            batch_floats: Vec::new(),
            batch_ids: Vec::new(),
            prefill_batch: 1,
            pos: 0,
        })
    }

    /// How many prompt positions [`generate_from`] evaluates at once
    /// ([`eval_batch`](Self::eval_batch); 1, the default, = one at a time, with
    /// lookahead prefetching), and allocates the batch buffers. The size is
    /// clamped to `1..=`[`MAX_PREFILL_BATCH`], to the session's positions and to
    /// what [`MAX_BATCH_BYTES`] of buffers hold (the model's dimensions come from
    /// its file); returns the size set. The logits are the same whatever the size.
    pub fn set_prefill_batch(&mut self, n: usize) -> Result<usize, SessionAllocError> {
        let (hp, hy) = (&self.model.hp, &self.model.hybrid);
        let per_position = 4 * BatchScratch::floats(hp, hy, 1) + 2 * BatchScratch::ids(hp, hy, 1);
        let n = n
            .clamp(1, MAX_PREFILL_BATCH)
            .min(self.max_positions.max(1))
            .min((MAX_BATCH_BYTES / per_position.max(1)).max(1));
        if n == 1 {
            (self.batch_floats, self.batch_ids) = (Vec::new(), Vec::new());
            self.prefill_batch = 1;
            return Ok(1);
        }
        let (nf, ni) = (
            BatchScratch::floats(hp, hy, n),
            BatchScratch::ids(hp, hy, n),
        );
        let err = SessionAllocError {
            positions: self.max_positions,
            bytes: 4 * nf as u128 + 2 * ni as u128,
        };
        self.batch_floats = zeroed(nf).ok_or(err)?;
        self.batch_ids = Vec::new();
        self.batch_ids.try_reserve_exact(ni).map_err(|_| err)?;
        self.batch_ids.resize(ni, 0);
        self.prefill_batch = n;
        Ok(n)
    }

    /// See [`set_prefill_batch`](Self::set_prefill_batch).
    pub fn prefill_batch(&self) -> usize {
        self.prefill_batch
    }

    /// Positions evaluated so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Most positions the session holds.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Evaluates `input` (a token or an embedding) at the next position and writes
    /// the next-token logits.
    pub fn eval<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        lookahead: Option<&Lookahead>,
        input: TokenInput<'_>,
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        let (hp, hy) = (&self.model.hp, &self.model.hybrid);
        let (mut kv, mut rs, mut s) = self.state.views(self.model, self.max_positions);
        forward_hybrid(
            hp, hy, self.model, mv, experts, lookahead, input, self.pos, &mut kv, &mut rs, &mut s,
            logits,
        )?;
        self.pos += 1;
        Ok(())
    }
}

impl Session<'_> {
    /// Evaluates `inputs` at the next positions in one pass, layer by layer
    /// ([`forward_batch`]: each layer's experts are asked for once for all the
    /// positions), and writes the last one's next-token logits: the same logits,
    /// caches and state as [`eval`](Self::eval) of each input in turn.
    pub fn eval_batch<M: MatVec, X: Experts>(
        &mut self,
        mv: &mut M,
        experts: &mut X,
        inputs: &[TokenInput<'_>],
        logits: &mut [f32],
    ) -> Result<(), ForwardError<X::Error>> {
        let (hp, hy) = (&self.model.hp, &self.model.hybrid);
        let n = inputs.len();
        if n > self.prefill_batch {
            return Err(ForwardError::Shape("more positions than the batch buffers"));
        }
        let (mut kv, mut rs, mut s) = self.state.views(self.model, self.max_positions);
        let mut b = BatchScratch::new(hp, hy, n, &mut self.batch_floats, &mut self.batch_ids)
            .expect("batch buffers sized by set_prefill_batch");
        forward_batch(
            hp, hy, self.model, mv, experts, inputs, self.pos, &mut kv, &mut rs, &mut s, &mut b,
            logits,
        )?;
        self.pos += n;
        Ok(())
    }
}

/// Evaluates `prompt` at the next positions, [`Session::prefill_batch`]
/// positions at a time (a batch of one with [`Session::eval`] and `lookahead`,
/// larger ones with [`Session::eval_batch`]), and writes the last one's
/// next-token logits.
pub fn prefill<M: MatVec, X: Experts>(
    session: &mut Session<'_>,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    prompt: &[TokenInput<'_>],
    logits: &mut [f32],
) -> Result<(), ForwardError<X::Error>> {
    for chunk in prompt.chunks(session.prefill_batch) {
        match chunk {
            [input] => session.eval(mv, experts, lookahead, *input, logits)?,
            _ => session.eval_batch(mv, experts, chunk, logits)?,
        }
    }
    Ok(())
}

/// What to do after each generated token.
pub enum Control {
    /// Keep generating.
    Continue,
    /// Stop (end of generation token, or the caller is done).
    Stop,
}

/// Evaluates `prompt`, then generates up to `n` tokens with `sample`, calling
/// `on_token(token, logits)` for each. Stops early when `on_token` says so.
#[allow(clippy::too_many_arguments)]
pub fn generate<M: MatVec, X: Experts>(
    session: &mut Session<'_>,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    prompt: &[u32],
    n: usize,
    sample: impl FnMut(&[f32]) -> u32,
    on_token: impl FnMut(u32, &[f32]) -> Control,
) -> Result<GenStats, ForwardError<X::Error>> {
    let inputs: Vec<TokenInput<'_>> = prompt.iter().map(|&t| TokenInput::Token(t)).collect();
    generate_from(
        session, mv, experts, lookahead, &inputs, n, sample, on_token,
    )
}

/// [`generate`] from a prompt of tokens and given embeddings (image embeddings
/// spliced into the text).
#[allow(clippy::too_many_arguments)]
pub fn generate_from<M: MatVec, X: Experts>(
    session: &mut Session<'_>,
    mv: &mut M,
    experts: &mut X,
    lookahead: Option<&Lookahead>,
    prompt: &[TokenInput<'_>],
    n: usize,
    mut sample: impl FnMut(&[f32]) -> u32,
    mut on_token: impl FnMut(u32, &[f32]) -> Control,
) -> Result<GenStats, ForwardError<X::Error>> {
    let mut logits = vec![0f32; session.model.hp.n_vocab];
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
    let start = Instant::now();
    prefill(session, mv, experts, lookahead, prompt, &mut logits)?;
    stats.prefill = start.elapsed();
    let start = Instant::now();
    for i in 0..n {
        let token = sample(&logits);
        stats.generated += 1;
        if let Control::Stop = on_token(token, &logits) {
            break;
        }
        if i + 1 < n {
            session.eval(
                mv,
                experts,
                lookahead,
                TokenInput::Token(token),
                &mut logits,
            )?;
        }
    }
    stats.decode = start.elapsed();
    Ok(stats)
}

/// The process's peak resident set size (`VmHWM`), where the OS reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
