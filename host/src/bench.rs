//! `les bench`: the schedules back to back on one model, budget and prompt.
//!
//! Before each schedule the model file is dropped from the page cache, so every
//! run starts cold. Every schedule samples with the same settings and seed, so by
//! the engine's exactness (bit-identical logits) all must produce the same tokens.
//! The default is sampling at temperature 0.8 rather than greedy: a greedy decode
//! of a random-weight synthetic model soon repeats one token, and a loop of equal
//! tokens routes to the same experts every step, which no real text does.
//!
//! Overlap efficiency is `max(compute time, minimum I/O time) / actual time`:
//! compute time is the decode time minus the time blocked on reads; minimum I/O
//! time is the bytes read over the device's bandwidth for expert-sized reads at
//! full queue depth, measured by [`device_bandwidth`] in the same session.

use std::path::Path;
use std::time::{Duration, Instant};

use les_core::gemv::{GemvError, Isa, MatrixView};
use les_core::model::forward::{HeadFn, Lookahead, MatVec, TokenInput, Weights};
use les_core::model::ops::{AttnShape, KvView};
use les_core::router::{LayerMask, PredictorConfig};
use les_core::schedule::{LayerState, Stats};
use les_core::slots::ExpertKey;

use crate::belady::Recording;
use crate::compute::ThreadedMatVec;
use crate::cpu_steal::CpuTimes;
use crate::engine::Session;
use crate::flash::{FileDevice, FileDeviceConfig, IoSnapshot};
use crate::layer_costs::{LayerCost, LayerCosts};
use crate::model::Model;
use crate::sampling::{Sampler, SamplerConfig};
use crate::supply::{Schedule, SlotBudget, Supply};
use crate::trace::{self, Event, LayerMarks, Trace, What};
use crate::watch::Watched;

/// How many experts the lookahead predicts per layer.
#[derive(Clone, Copy, Debug, PartialEq, clap::Args)]
pub struct LookaheadArgs {
    /// Experts predicted per layer (default: as many as the router picks).
    #[arg(long)]
    pub predict: Option<usize>,
    /// Only predict experts whose gating probability is at least this (at most
    /// `--predict` of them).
    #[arg(long, value_parser = crate::cli::values::probability)]
    pub predict_min_prob: Option<f32>,
    /// MoE layers ahead to predict and prefetch: 1 (default) = the next MoE
    /// layer's router on this layer's hidden state (layers without experts in
    /// between passed over); 2 also runs the router of the one after it and
    /// reads its picks while the device is otherwise idle (helps models whose
    /// layers compute faster than an expert reads).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=les_core::schedule::MAX_DEPTH as i64))]
    pub lookahead_depth: u8,
}

/// The lookahead of `les run` and `les bench`: for every layer, the next layer's
/// router on this layer's hidden state.
pub fn lookahead(model: &Model, args: &LookaheadArgs) -> Lookahead {
    let top_k = model.hp.moe.map_or(1, |m| m.top_k);
    let n = args
        .predict
        .unwrap_or(top_k)
        .clamp(1, les_core::router::MAX_PREDICTED);
    let predictor = match args.predict_min_prob {
        Some(p) => PredictorConfig::threshold(p, n),
        None => PredictorConfig::top_k(n),
    };
    let mut layers = LayerMask::new();
    for l in 0..model.hp.n_layers.min(LayerMask::CAPACITY) {
        let _ = layers.enable(l);
    }
    Lookahead {
        predictor,
        layers,
        depth: args.lookahead_depth as usize,
    }
}

/// Prediction quality of one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerPrediction {
    /// Layer index.
    pub layer: usize,
    /// Predicted experts that were picked / predicted.
    pub precision: f32,
    /// Picked experts that were predicted / picked.
    pub recall: f32,
    /// Whether prefetching was still enabled at the end.
    pub enabled: bool,
    /// Experts predicted for this layer over the decode.
    pub predicted: u64,
}

/// Parts [`run_schedule`] splits a decode into, to show whether its rate held:
/// a decode that starts cold spends its first tokens filling the slots, whose
/// rate is not the one it settles at.
pub const STRETCHES: usize = 4;

/// One stretch of a decode: consecutive tokens, and what they cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stretch {
    /// Tokens generated in it.
    pub tokens: usize,
    /// Its wall time.
    pub time: Duration,
    /// Bytes read from the file in it.
    pub bytes_read: u64,
    /// Time blocked on reads in it.
    pub stall: Duration,
}

impl Stretch {
    /// Tokens per second (0 for an empty stretch).
    pub fn tok_s(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.tokens as f64 / self.time.as_secs_f64().max(1e-9)
        }
    }

    /// Bytes read per token (0 for an empty stretch).
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.tokens.max(1) as f64
    }

    /// The stretch from `start` to `end`, each a token index, the time it was
    /// reached and the device's counters then.
    fn between(start: (usize, Instant, IoSnapshot), end: (usize, Instant, IoSnapshot)) -> Self {
        let io = end.2 - start.2;
        Stretch {
            tokens: end.0 - start.0,
            time: end.1 - start.1,
            bytes_read: io.file_bytes,
            stall: Duration::from_nanos(io.stall_nanos),
        }
    }
}

/// Where each of `parts` near-equal stretches of `n` tokens starts, and `n`:
/// `parts + 1` ascending bounds, fewer where `n < parts` (no stretch is empty).
pub fn stretch_bounds(n: usize, parts: usize) -> Vec<usize> {
    let parts = parts.max(1);
    let mut b: Vec<usize> = (0..=parts).map(|i| i * n / parts).collect();
    b.dedup();
    b
}

/// What one schedule did.
#[derive(Clone, Debug)]
pub struct ScheduleReport {
    /// The schedule.
    pub schedule: Schedule,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Decode time (after the prompt).
    pub decode: Duration,
    /// Prompt time.
    pub prefill: Duration,
    /// Bytes read from the file during decode.
    pub bytes_read: u64,
    /// Time blocked on reads during decode.
    pub stall: Duration,
    /// Device reads during decode.
    pub reads: u64,
    /// Time the I/O threads spent in those reads (summed over threads).
    pub read_time: Duration,
    /// Time during decode in which the device had reads outstanding.
    pub busy: Duration,
    /// How the device issued its reads: `uring` or `threads` (`None` when
    /// resident).
    pub io_engine: Option<&'static str>,
    /// Scheduler counters over the decode.
    pub stats: Stats,
    /// Per-layer prediction quality over the whole run (MoE layers with predictions).
    pub layers: Vec<LayerPrediction>,
    /// Device bandwidth used for the minimum I/O time (bytes/s).
    pub device_bw: f64,
    /// The device bandwidth probed just before and just after the run (bytes/s;
    /// zeros where nobody probed).
    pub probes: [f64; 2],
    /// Time in the output projection during decode: no read for the next token
    /// can start then (they depend on the token it picks), so it adds to the
    /// reads' minimum time.
    pub output_time: Duration,
    /// Every expert the router picked (prompt and decode), in order.
    pub picks: Vec<ExpertKey>,
    /// Where the decode's picks start in `picks`.
    pub decode_from: usize,
    /// Per layer (indexed by layer; empty for `resident`): the decode's stall
    /// while the layer's experts were computed, and its hits, late hits and
    /// misses ([`crate::layer_costs`]).
    pub layer_costs: Vec<LayerCost>,
    /// Share of the machine's CPU time a hypervisor took during decode
    /// ([`crate::cpu_steal`]; `None` where it cannot be read).
    pub cpu_steal: Option<f64>,
    /// The decode in [`STRETCHES`] consecutive stretches (fewer for fewer
    /// tokens), in order: their tokens, times, bytes and stalls add up to the
    /// decode's.
    pub stretches: Vec<Stretch>,
    /// The decode's timeline, where [`BenchConfig::trace`] asked for it, and the
    /// events it had no room for.
    pub trace: Option<(Vec<Event>, u64)>,
    /// How busy the device was in each phase of the decode's tokens, from its
    /// timeline ([`trace::disk_use`], phases of layers in the groups of
    /// [`crate::layer_costs::group_bounds`]); `None` until computed.
    pub disk_use: Option<Vec<(trace::Phase, trace::PhaseUse)>>,
}

impl ScheduleReport {
    fn n(&self) -> f64 {
        self.tokens.len().max(1) as f64
    }

    /// Decode tokens per second.
    pub fn tok_s(&self) -> f64 {
        self.tokens.len() as f64 / self.decode.as_secs_f64().max(1e-9)
    }

    /// Share of the decode in which the device had reads outstanding.
    pub fn busy_share(&self) -> f64 {
        self.busy.as_secs_f64() / self.decode.as_secs_f64().max(1e-9)
    }

    /// Bytes read per generated token.
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.n()
    }

    /// Time in the output projection per token, seconds.
    pub fn output_per_token(&self) -> f64 {
        self.output_time.as_secs_f64() / self.n()
    }

    /// Time blocked on I/O per token, seconds.
    pub fn stall_per_token(&self) -> f64 {
        self.stall.as_secs_f64() / self.n()
    }

    /// Mean time of one device read, seconds (0 without reads).
    pub fn mean_read_time(&self) -> f64 {
        self.read_time.as_secs_f64() / self.reads.max(1) as f64
    }

    /// Slot hit rate over the decode.
    pub fn hit_rate(&self) -> f64 {
        if self.schedule == Schedule::Resident {
            1.0
        } else {
            self.stats.hit_rate() as f64
        }
    }

    /// Picked experts resident and landed when picked, over all picked (1 for
    /// `resident`): the hit rate to compare with a cache that does not prefetch.
    pub fn ready_hit_rate(&self) -> f64 {
        if self.schedule == Schedule::Resident {
            1.0
        } else {
            self.stats.ready_hit_rate() as f64
        }
    }

    /// Bytes read per second of decode.
    pub fn effective_bw(&self) -> f64 {
        self.bytes_read as f64 / self.decode.as_secs_f64().max(1e-9)
    }

    /// Bytes read per second the device had reads outstanding (0 without
    /// reads): a measured lower bound on the bandwidth it gave this run, which
    /// can exceed the probe's (scattered, cold reads). Not bytes per second of
    /// stall: even on-demand computes a layer's resident experts in order while
    /// the reads for its later picks land, so its stall is shorter than its reads.
    pub fn busy_read_bw(&self) -> f64 {
        let s = self.busy.as_secs_f64();
        if s > 0.0 {
            self.bytes_read as f64 / s
        } else {
            0.0
        }
    }

    /// Time per token not stalled on a read, seconds: the compute, as
    /// slowed by whatever the reads cost it.
    pub fn compute_per_token(&self) -> f64 {
        (self.decode.as_secs_f64() - self.stall.as_secs_f64()).max(0.0) / self.n()
    }

    /// `max(compute, minimum I/O) / actual` (1 = perfect overlap).
    pub fn overlap_efficiency(&self) -> f64 {
        let actual = self.decode.as_secs_f64().max(1e-9);
        let compute = (actual - self.stall.as_secs_f64()).max(0.0);
        let min_io = if self.device_bw > 0.0 {
            self.bytes_read as f64 / self.device_bw
        } else {
            0.0
        };
        (compute.max(min_io) / actual).min(1.0)
    }

    /// The speedup over `on_demand` this schedule would reach with perfect
    /// overlap, an estimate: on-demand's time per token over the longer of
    /// on-demand's compute time per token (the same kernels) and this schedule's
    /// minimum I/O time per token: its bytes at the device's bandwidth (the
    /// probe's, or what this schedule reached if more) plus the output
    /// projection, during which the next token's reads are not known yet.
    /// `None` without a measured bandwidth or on-demand compute time.
    pub fn overlap_bound(&self, on_demand: &ScheduleReport) -> Option<f64> {
        let n = on_demand.n();
        let time = on_demand.decode.as_secs_f64() / n;
        let compute = (on_demand.decode.as_secs_f64() - on_demand.stall.as_secs_f64()) / n;
        let io = if self.device_bw > 0.0 {
            self.bytes_per_token() / self.device_bw.max(self.effective_bw())
                + self.output_per_token()
        } else {
            return None;
        };
        let floor = compute.max(io);
        (floor > 0.0).then(|| time / floor)
    }

    /// Mean prediction precision over layers.
    pub fn mean_precision(&self) -> f64 {
        mean(self.layers.iter().map(|l| l.precision as f64))
    }

    /// Mean prediction recall over layers.
    pub fn mean_recall(&self) -> f64 {
        mean(self.layers.iter().map(|l| l.recall as f64))
    }
}

fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = it.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Settings of a benchmark.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate per schedule.
    pub n_tokens: usize,
    /// Compute threads.
    pub threads: usize,
    /// Expert slots and I/O settings (shared by the streamed schedules).
    pub budget: SlotBudget,
    /// Lookahead prediction settings.
    pub lookahead: LookaheadArgs,
    /// How tokens are picked: every schedule uses a fresh sampler with these
    /// settings, so equal logits give equal tokens.
    pub sampler: SamplerConfig,
    /// Record each run's decode ([`ScheduleReport::trace`]).
    pub trace: bool,
    /// The KV cache's element types.
    pub kv_types: crate::engine::KvTypes,
    /// How the sliding-window layers' keys and values are kept.
    pub swa: crate::engine::SwaCache,
}

/// Bandwidth of expert-sized reads at full queue depth, cold cache, over about
/// `bytes` bytes of the model's experts (bytes/s).
pub fn device_bandwidth(
    model: &Model,
    path: &Path,
    io: FileDeviceConfig,
    bytes: u64,
) -> std::io::Result<f64> {
    use les_core::blockdev::{BlockDevice, ReadRequest, SlotId, Tag};
    let Some(moe) = model.hp.moe else {
        return Ok(0.0);
    };
    FileDevice::evict_page_cache(path)?;
    let depth = io.queue_depth.max(1);
    // One slot per expert in flight; an expert may take up to 3 reads.
    let n_slots = (depth / les_core::schedule::MAX_PARTS).max(1);
    let mut dev = FileDevice::open(path, n_slots, model.max_expert_bytes(), io)?;
    let moe_layers: Vec<usize> = (0..model.hp.n_layers)
        .filter(|l| model.is_moe_layer(*l))
        .collect();
    let total_experts = moe_layers.len() * moe.n_experts;
    let mut next = 0usize;
    let (mut submitted, mut in_flight, mut tag) = (0u64, 0usize, 0u32);
    let mut free: Vec<u32> = (0..n_slots as u32).collect();
    let mut slot_of = std::collections::HashMap::new();
    let start = Instant::now();
    while submitted < bytes || in_flight > 0 {
        while submitted < bytes && !free.is_empty() && next < total_experts {
            // Spread over the file: a stride through all experts.
            let i = (next * 7919) % total_experts;
            next += 1;
            let key = les_core::slots::ExpertKey {
                layer: moe_layers[i / moe.n_experts] as u16,
                expert: (i % moe.n_experts) as u16,
            };
            let slot = free.pop().expect("checked non-empty");
            let ext = model.expert_extents(key);
            for e in &ext {
                tag += 1;
                dev.submit(ReadRequest {
                    tag: Tag(tag),
                    offset: e.offset,
                    len: e.len,
                    slot: SlotId(slot),
                    slot_offset: e.slot_offset,
                    urgent: true,
                })
                .map_err(|e| std::io::Error::other(format!("{e:?}")))?;
                slot_of.insert(tag, (slot, ext.len()));
                in_flight += 1;
                submitted += e.len as u64;
            }
        }
        if next >= total_experts && in_flight == 0 {
            break;
        }
        match dev.poll() {
            Some(c) => {
                in_flight -= 1;
                if let Some((slot, _)) = slot_of.remove(&c.tag.0) {
                    if !slot_of.values().any(|(s, _)| *s == slot) {
                        free.push(slot);
                    }
                }
            }
            None => dev.wait(),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(dev.counters().snapshot().file_bytes as f64 / secs.max(1e-9))
}

/// A [`MatVec`] that times the products with one matrix (the output
/// projection, told apart by its bytes' address).
struct TimedOutput<M> {
    inner: M,
    output: usize,
    time: Duration,
    /// Where each product with it is recorded as [`What::Output`].
    trace: Option<Trace>,
}

impl<M: MatVec> MatVec for TimedOutput<M> {
    fn matvec(&mut self, w: &MatrixView<'_>, x: &[f32], y: &mut [f32]) -> Result<(), GemvError> {
        if w.bytes().as_ptr() as usize != self.output {
            return self.inner.matvec(w, x, y);
        }
        let t = Instant::now();
        let r = self.inner.matvec(w, x, y);
        self.time += t.elapsed();
        if let Some(trace) = &self.trace {
            trace.span(What::Output, t, Instant::now());
        }
        r
    }

    fn matvec_checksum(
        &mut self,
        w: &MatrixView<'_>,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<u32, GemvError> {
        self.inner.matvec_checksum(w, x, y)
    }

    fn attention(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        self.inner.attention(shape, q, kv, scores, out)
    }

    fn matmul(&mut self, w: &MatrixView<'_>, xs: &[f32], ys: &mut [f32]) -> Result<(), GemvError> {
        self.inner.matmul(w, xs, ys)
    }

    fn attention_causal(
        &mut self,
        shape: AttnShape,
        q: &[f32],
        kv: KvView<'_>,
        first: usize,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        self.inner
            .attention_causal(shape, q, kv, first, scores, out)
    }

    fn for_heads(&mut self, n: usize, state: &mut [f32], out: &mut [f32], f: &HeadFn<'_>) {
        self.inner.for_heads(n, state, out, f)
    }
}

/// The experts of `schedule` over `cfg`'s budget, with `path` dropped from the
/// page cache first, so every run starts cold.
fn cold_supply<'m>(
    model: &'m Model,
    path: &Path,
    cfg: &BenchConfig,
    schedule: Schedule,
) -> Result<Supply<'m>, Box<dyn std::error::Error>> {
    FileDevice::evict_page_cache(path)?;
    let budget = if schedule == Schedule::Resident {
        SlotBudget::none(cfg.budget.io)
    } else {
        cfg.budget.clone()
    };
    let supply = Supply::new(model, path, schedule, budget)?;
    // As `les run` loads: the resident weights in memory, the experts not.
    model.populate_resident();
    Ok(supply)
}

/// Bytes `supply`'s file device has read from the model file so far (0 when
/// resident).
fn file_bytes_read(supply: &Supply<'_>) -> u64 {
    supply
        .device()
        .map_or(0, |d| d.counters().snapshot().file_bytes)
}

/// What evaluating a prompt cost one schedule at one batch size.
#[derive(Clone, Debug)]
pub struct PrefillReport {
    /// The schedule.
    pub schedule: Schedule,
    /// Positions evaluated at once.
    pub batch: usize,
    /// Prompt positions.
    pub tokens: usize,
    /// Time to evaluate them.
    pub time: Duration,
    /// Bytes read from the model file meanwhile.
    pub bytes_read: u64,
    /// Time blocked on reads meanwhile.
    pub stall: Duration,
    /// Time the device had reads outstanding meanwhile.
    pub busy: Duration,
    /// The last position's logits.
    pub logits: Vec<f32>,
}

impl PrefillReport {
    /// Prompt positions per second.
    pub fn tok_s(&self) -> f64 {
        self.tokens as f64 / self.time.as_secs_f64().max(1e-9)
    }

    /// Bytes read per prompt position.
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.tokens.max(1) as f64
    }

    /// The share of the time blocked on reads.
    pub fn stall_share(&self) -> f64 {
        self.stall.as_secs_f64() / self.time.as_secs_f64().max(1e-9)
    }

    /// The share of the time the device had reads outstanding.
    pub fn busy_share(&self) -> f64 {
        self.busy.as_secs_f64() / self.time.as_secs_f64().max(1e-9)
    }
}

/// Evaluates `cfg.prompt` cold with `schedule`, `batch` positions at a time, as
/// `les run -b` does (see [`crate::engine::generate_from`]).
pub fn run_prefill(
    model: &Model,
    path: &Path,
    cfg: &BenchConfig,
    schedule: Schedule,
    batch: usize,
) -> Result<PrefillReport, Box<dyn std::error::Error>> {
    let mut supply = cold_supply(model, path, cfg, schedule)?;
    let lookahead = lookahead(model, &cfg.lookahead);
    let mut mv = ThreadedMatVec::new(cfg.threads, Isa::detect());
    let mut session = Session::with_kv(model, cfg.prompt.len(), cfg.kv_types, cfg.swa)?;
    session.set_prefill_batch(batch)?;
    let inputs: Vec<TokenInput<'_>> = cfg.prompt.iter().map(|&t| TokenInput::Token(t)).collect();
    let mut logits = vec![0f32; model.hp.n_vocab];
    let io0 = io_snapshot(&supply);
    let t0 = Instant::now();
    crate::engine::prefill(
        &mut session,
        &mut mv,
        &mut supply,
        Some(&lookahead),
        &inputs,
        &mut logits,
    )?;
    let time = t0.elapsed();
    let io = io_snapshot(&supply) - io0;
    Ok(PrefillReport {
        schedule,
        batch: session.prefill_batch(),
        tokens: inputs.len(),
        time,
        bytes_read: io.file_bytes,
        stall: Duration::from_nanos(io.stall_nanos),
        busy: Duration::from_nanos(io.busy_nanos),
        logits,
    })
}

/// What decoding several sequences side by side cost one schedule
/// ([`run_parallel`]).
#[derive(Clone, Debug)]
pub struct ParallelReport {
    /// The schedule.
    pub schedule: Schedule,
    /// Whether each sequence drafted (`--speculate`) or decoded a token a
    /// pass.
    pub speculative: bool,
    /// Each sequence's generated tokens (sequence `i` sampled with the seed
    /// plus `i`).
    pub tokens: Vec<Vec<u32>>,
    /// Time from the passes of the prompts' last tokens to the last token.
    pub time: Duration,
    /// Bytes read from the model file meanwhile.
    pub bytes_read: u64,
    /// Time blocked on reads meanwhile.
    pub stall: Duration,
    /// Passes of the model.
    pub passes: usize,
    /// Draft tokens verified, all sequences together.
    pub drafted: usize,
    /// Draft tokens the samples agreed with, all sequences together.
    pub accepted: usize,
}

impl ParallelReport {
    /// Sequences decoded side by side.
    pub fn sequences(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens generated, all sequences together.
    pub fn generated(&self) -> usize {
        self.tokens.iter().map(Vec::len).sum()
    }

    /// Tokens per second, all sequences together.
    pub fn tok_s(&self) -> f64 {
        self.generated() as f64 / self.time.as_secs_f64().max(1e-9)
    }

    /// Bytes read per generated token.
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.generated().max(1) as f64
    }

    /// The share of the time blocked on reads.
    pub fn stall_share(&self) -> f64 {
        self.stall.as_secs_f64() / self.time.as_secs_f64().max(1e-9)
    }

    /// Tokens a sequence got from each pass it took part in (1 without
    /// drafts).
    pub fn tokens_per_pass(&self) -> f64 {
        let taken = self.generated().saturating_sub(self.accepted).max(1);
        self.generated() as f64 / taken as f64
    }
}

/// Sequences decoded side by side ([`run_parallel`]).
#[derive(Clone, Copy, Debug)]
pub struct SideBySide<'a> {
    /// How many.
    pub sequences: usize,
    /// Their prompts: sequence `i` decodes `prompts[i % prompts.len()]`
    /// (the config's prompt where there are none).
    pub prompts: &'a [Vec<u32>],
    /// Each drafting on its own (a drafter that
    /// [forks](crate::draft::Drafter::fork): prompt lookup, a draft model,
    /// the MTP block shown its sequence's hidden states), or decoding a
    /// token a pass.
    pub spec: Option<&'a crate::draft::SpecArgs>,
    /// The draft model `spec` names, opened
    /// ([`SpecArgs::open_draft_model`](crate::draft::SpecArgs::open_draft_model)).
    pub draft_model: Option<&'a Model>,
}

/// Decodes `run.sequences` sequences side by side, cold, with `schedule`:
/// each prompt but its last token evaluated alone first, unmeasured; then
/// passes for all the sequences' next tokens at once
/// ([`Session::eval_together_placed`]: each layer's experts read once for
/// all) until each has `cfg.n_tokens`, sequence `i` sampling with
/// `cfg.sampler`'s seed plus `i`. With drafts, each sequence verifies its
/// own in the shared pass (every one of its positions' logits) and keeps
/// what its samples agree with. One sequence of a token a pass decodes as
/// `les run` does (with the lookahead). Each sequence's tokens are the ones
/// it gets decoded alone and plainly.
pub fn run_parallel(
    model: &Model,
    path: &Path,
    cfg: &BenchConfig,
    schedule: Schedule,
    run: SideBySide<'_>,
) -> Result<ParallelReport, Box<dyn std::error::Error>> {
    use crate::draft::Drafter;
    use crate::engine::{Drafting, PassCost, SessionInputs, Settled};
    let one = [cfg.prompt.clone()];
    let prompts = if run.prompts.is_empty() {
        &one[..]
    } else {
        run.prompts
    };
    if prompts.iter().any(Vec::is_empty) {
        return Err("a prompt is empty".into());
    }
    let mut supply = cold_supply(model, path, cfg, schedule)?;
    let lookahead = lookahead(model, &cfg.lookahead);
    let mut mv = ThreadedMatVec::new(cfg.threads, Isa::detect());
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let ctx = longest.saturating_add(cfg.n_tokens);
    let n_vocab = model.hp.n_vocab;
    let draft_max = run.spec.map_or(0, |s| s.draft_max() as usize);
    let drafter = match run.spec {
        Some(s) => s.drafter(model, path, run.draft_model, ctx, cfg.threads)?,
        None => None,
    };
    struct Seq<'d> {
        sampler: Sampler,
        /// The token sampled last, not evaluated yet (`None`: done).
        next: Option<u32>,
        tokens: Vec<u32>,
        drafting: Option<(Box<dyn Drafter + 'd>, Drafting)>,
    }
    let mut sessions = Vec::with_capacity(run.sequences);
    let mut seqs = Vec::with_capacity(run.sequences);
    let mut logits = vec![0f32; n_vocab];
    for i in 0..run.sequences {
        let prompt = &prompts[i % prompts.len()];
        let (&last, head) = prompt.split_last().expect("prompts are not empty");
        let mut session = Session::with_kv(model, ctx, cfg.kv_types, cfg.swa)?;
        let batch = run.sequences.saturating_mul(draft_max + 1);
        session.set_prefill_batch(crate::engine::DEFAULT_PREFILL_BATCH.max(batch))?;
        let max_draft = match &drafter {
            Some(_) => session.set_max_draft(draft_max)?,
            None => 0,
        };
        // Its own drafter, shown the prompt where it reads the model's hidden
        // states (an MTP block).
        let mut own = match &drafter {
            Some(d) => Some(d.fork().ok_or("the drafter does not fork")?),
            None => None,
        };
        let inputs: Vec<TokenInput<'_>> = head.iter().map(|&t| TokenInput::Token(t)).collect();
        if !inputs.is_empty() {
            crate::engine::prefill_observed(
                &mut session,
                &mut mv,
                &mut supply,
                None,
                &inputs,
                &[],
                &mut logits,
                own.as_deref_mut(),
            )?;
        }
        session.set_keep_hidden(own.as_ref().is_some_and(|d| d.wants_hidden()));
        sessions.push(session);
        let mut sampler = Sampler::new(SamplerConfig {
            seed: cfg.sampler.seed.wrapping_add(i as u64),
            ..cfg.sampler
        });
        for &t in prompt {
            sampler.accept(t);
        }
        let drafting = own.map(|own| {
            let adaptive = run.spec.is_some_and(|s| !s.draft_fixed);
            (
                own,
                Drafting::new(prompt.clone(), max_draft, adaptive, n_vocab),
            )
        });
        seqs.push(Seq {
            sampler,
            next: (cfg.n_tokens > 0).then_some(last),
            tokens: Vec::with_capacity(cfg.n_tokens),
            drafting,
        });
    }
    let (mut passes, mut drafted, mut accepted) = (0, 0, 0);
    let mut pass_cost = PassCost::default();
    let mut all = Vec::new();
    let io0 = io_snapshot(&supply);
    let t0 = Instant::now();
    loop {
        // Each sequence's tokens this pass: its next one and the draft after
        // it (none where it is done).
        let mut batches: Vec<Vec<TokenInput<'static>>> = Vec::with_capacity(seqs.len());
        let costs = pass_cost.costs(seqs.iter().filter(|q| q.next.is_some()).count());
        for (q, session) in seqs.iter_mut().zip(&sessions) {
            let mut batch = Vec::new();
            if let Some(t) = q.next {
                batch.push(TokenInput::Token(t));
                if let Some((d, state)) = &mut q.drafting {
                    if let Some(c) = costs {
                        state.pass_costs(c);
                    }
                    let room = (cfg.n_tokens.saturating_sub(q.tokens.len() + 1)).min(
                        session
                            .max_positions()
                            .saturating_sub(session.position() + 1),
                    );
                    let draft = state.draft(d.as_mut(), t, room);
                    batch.extend(draft.iter().map(|&g| TokenInput::Token(g)));
                }
            }
            batches.push(batch);
        }
        if batches.iter().all(Vec::is_empty) {
            break;
        }
        let rows: usize = batches.iter().map(Vec::len).sum();
        all.resize(rows * n_vocab, 0.0);
        let pass = Instant::now();
        let mut taking: Vec<&mut Session<'_>> = Vec::with_capacity(seqs.len());
        let mut parts = Vec::with_capacity(seqs.len());
        for (session, batch) in sessions.iter_mut().zip(&batches) {
            if batch.is_empty() {
                continue;
            }
            if batch.len() > 1 {
                session.save_for_keep(batch.len())?;
            }
            taking.push(session);
            parts.push(SessionInputs {
                inputs: batch,
                places: &[],
                every: true,
            });
        }
        match (&mut taking[..], &parts[..]) {
            ([one], [part]) if part.inputs.len() == 1 => {
                let out = &mut all[..n_vocab];
                one.eval(&mut mv, &mut supply, Some(&lookahead), part.inputs[0], out)?;
            }
            _ => {
                Session::eval_together_placed(&mut taking, &mut mv, &mut supply, &parts, &mut all)?
            }
        }
        let took = pass.elapsed();
        pass_cost.record(rows, took);
        passes += 1;
        let mut row = 0;
        for ((q, session), batch) in seqs.iter_mut().zip(sessions.iter_mut()).zip(&batches) {
            let Some(t) = q.next else {
                continue;
            };
            // Its rows, back to back.
            let lg = &all[row * n_vocab..(row + batch.len()) * n_vocab];
            row += batch.len();
            let Seq {
                sampler,
                tokens,
                drafting,
                ..
            } = q;
            let mut take = |row: &[f32]| {
                let next = sampler.sample(row);
                tokens.push(next);
                (next, tokens.len() < cfg.n_tokens)
            };
            let settled = match drafting {
                Some((_, state)) => state.settle(t, lg, took, &mut take),
                None => Settled::plain(take(lg)),
            };
            drafted += batch.len() - 1;
            accepted += settled.accepted;
            q.next = settled.next;
            session.keep(&mut mv, &mut supply, batch, settled.kept)?;
            if let Some((d, _)) = drafting.as_mut().filter(|(d, _)| d.wants_hidden()) {
                // The pass's rows, or the replay's of the kept ones.
                session.show(d.as_mut(), &batch[..settled.kept]);
            }
        }
    }
    let time = t0.elapsed();
    let io = io_snapshot(&supply) - io0;
    Ok(ParallelReport {
        schedule,
        speculative: drafter.is_some(),
        tokens: seqs.into_iter().map(|q| q.tokens).collect(),
        time,
        bytes_read: io.file_bytes,
        stall: Duration::from_nanos(io.stall_nanos),
        passes,
        drafted,
        accepted,
    })
}

/// What one cold decode cost, plain or speculative ([`run_speculative`]).
#[derive(Clone, Debug)]
pub struct SpecReport {
    /// The schedule.
    pub schedule: Schedule,
    /// Whether it drafted (`--speculate`) or decoded one token a pass.
    pub speculative: bool,
    /// The tokens generated.
    pub tokens: Vec<u32>,
    /// Time from the last prompt token's evaluation to the last token.
    pub time: Duration,
    /// Bytes read from the model file meanwhile.
    pub bytes_read: u64,
    /// Drafts, acceptance and passes.
    pub stats: crate::engine::GenStats,
}

impl SpecReport {
    /// Generated tokens per second.
    pub fn tok_s(&self) -> f64 {
        self.tokens.len() as f64 / self.time.as_secs_f64().max(1e-9)
    }

    /// Bytes read per generated token.
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.tokens.len().max(1) as f64
    }

    /// Tokens each pass of the model yielded (1 without drafts).
    pub fn tokens_per_pass(&self) -> f64 {
        // Each pass (the last prompt token's included) yields one token plus
        // the draft tokens it accepted.
        let passes = self.tokens.len().saturating_sub(self.stats.accepted).max(1);
        self.tokens.len() as f64 / passes as f64
    }
}

/// Decodes `cfg.n_tokens` tokens cold with `schedule` through
/// [`crate::engine::generate_from`], speculatively as `spec` says (`None`: one
/// token a pass; `draft_model` as `SpecArgs::open_draft_model` opened it). The prompt but its last token is evaluated first, unmeasured;
/// the time and bytes cover the last prompt token and every generated token's
/// pass, the `n_tokens` evaluations [`run_schedule`] measures.
pub fn run_speculative(
    model: &Model,
    path: &Path,
    cfg: &BenchConfig,
    schedule: Schedule,
    spec: Option<&crate::draft::SpecArgs>,
    draft_model: Option<&Model>,
) -> Result<SpecReport, Box<dyn std::error::Error>> {
    let (last, head) = cfg.prompt.split_last().ok_or("the prompt is empty")?;
    let mut supply = cold_supply(model, path, cfg, schedule)?;
    let lookahead = lookahead(model, &cfg.lookahead);
    let mut mv = ThreadedMatVec::new(cfg.threads, Isa::detect());
    let mut session = Session::with_kv(
        model,
        cfg.prompt.len().saturating_add(cfg.n_tokens),
        cfg.kv_types,
        cfg.swa,
    )?;
    session.set_prefill_batch(crate::engine::DEFAULT_PREFILL_BATCH)?;
    let ctx = cfg.prompt.len().saturating_add(cfg.n_tokens);
    let mut drafter = match spec {
        Some(s) => s.drafter(model, path, draft_model, ctx, cfg.threads)?,
        None => None,
    };
    let max_draft = match (&drafter, spec) {
        (Some(_), Some(s)) => session.set_max_draft(s.draft_max() as usize)?,
        _ => 0,
    };
    let mut logits = vec![0f32; model.hp.n_vocab];
    let inputs: Vec<TokenInput<'_>> = head.iter().map(|&t| TokenInput::Token(t)).collect();
    crate::engine::prefill_observed(
        &mut session,
        &mut mv,
        &mut supply,
        Some(&lookahead),
        &inputs,
        &[],
        &mut logits,
        drafter.as_deref_mut(),
    )?;
    let mut sampler = Sampler::new(cfg.sampler);
    for &t in &cfg.prompt {
        sampler.accept(t);
    }
    let read0 = file_bytes_read(&supply);
    let mut tokens = Vec::with_capacity(cfg.n_tokens);
    let t0 = Instant::now();
    let stats = crate::engine::generate_from(
        &mut session,
        &mut mv,
        &mut supply,
        Some(&lookahead),
        &[TokenInput::Token(*last)],
        &[],
        drafter.as_deref_mut().map(|d| crate::draft::Speculation {
            drafter: d,
            max_draft,
            adaptive: spec.is_some_and(|s| !s.draft_fixed),
            context: head,
        }),
        cfg.n_tokens,
        |l| sampler.sample(l),
        |t, _| {
            tokens.push(t);
            crate::engine::Control::Continue
        },
    )?;
    let time = t0.elapsed();
    Ok(SpecReport {
        schedule,
        speculative: drafter.is_some(),
        tokens,
        time,
        bytes_read: file_bytes_read(&supply) - read0,
        stats,
    })
}

/// Runs one schedule cold: prompt, then `n_tokens` tokens from `cfg.sampler`.
pub fn run_schedule(
    model: &Model,
    path: &Path,
    cfg: &BenchConfig,
    schedule: Schedule,
    device_bw: f64,
) -> Result<ScheduleReport, Box<dyn std::error::Error>> {
    let mut supply = cold_supply(model, path, cfg, schedule)?;
    let mut supply = Watched::new(
        &mut supply,
        (
            Recording::default(),
            (LayerCosts::default(), LayerMarks::default()),
        ),
    );
    let lookahead = lookahead(model, &cfg.lookahead);
    let mut mv = TimedOutput {
        inner: ThreadedMatVec::new(cfg.threads, Isa::detect()),
        output: model.output().bytes().as_ptr() as usize,
        time: Duration::ZERO,
        trace: None,
    };
    let mut session = Session::with_kv(
        model,
        cfg.prompt.len().saturating_add(cfg.n_tokens),
        cfg.kv_types,
        cfg.swa,
    )?;
    let mut logits = vec![0f32; model.hp.n_vocab];
    let t0 = Instant::now();
    for &t in &cfg.prompt {
        session.eval(
            &mut mv,
            &mut supply,
            Some(&lookahead),
            TokenInput::Token(t),
            &mut logits,
        )?;
    }
    let prefill = t0.elapsed();
    supply.watcher.1 .0.reset(supply.inner);
    // The decode's timeline, from here on.
    let trace = cfg.trace.then(|| Trace::new(trace::DEFAULT_CAPACITY));
    if let Some(t) = &trace {
        if let Some(d) = supply.inner.device() {
            d.trace_into(t.clone());
        }
        supply.watcher.1 .1 = LayerMarks(Some(t.clone()));
        mv.trace = Some(t.clone());
    }
    let decode_from = supply.watcher.0.picks.len();
    let stats0 = supply.inner.stats().unwrap_or_default();
    // The predictions' counts so far (the prompt's): the report is the decode's.
    let layers0: Vec<LayerState> = supply.inner.layers().map(<[_]>::to_vec).unwrap_or_default();
    let io0 = io_snapshot(supply.inner);
    let cpu0 = CpuTimes::now();
    let t1 = Instant::now();
    let output0 = mv.time;
    let mut tokens = Vec::with_capacity(cfg.n_tokens);
    let mut sampler = Sampler::new(cfg.sampler);
    for &t in &cfg.prompt {
        sampler.accept(t);
    }
    let bounds = stretch_bounds(cfg.n_tokens, STRETCHES);
    let mut stretches = Vec::with_capacity(STRETCHES);
    // Where the current stretch began: its first token, the time, the counters.
    let mut mark = (0, t1, io0);
    for i in 0..cfg.n_tokens {
        if i > 0 && bounds.contains(&i) {
            let now = (i, Instant::now(), io_snapshot(supply.inner));
            stretches.push(Stretch::between(mark, now));
            mark = now;
        }
        let t = sampler.sample(&logits);
        tokens.push(t);
        if let Some(tr) = &trace {
            tr.instant(What::Token(i as u32));
        }
        session.eval(
            &mut mv,
            &mut supply,
            Some(&lookahead),
            TokenInput::Token(t),
            &mut logits,
        )?;
    }
    let end = (cfg.n_tokens, Instant::now(), io_snapshot(supply.inner));
    let decode = end.1 - t1;
    if cfg.n_tokens > 0 {
        stretches.push(Stretch::between(mark, end));
    }
    let layer_costs = match schedule {
        Schedule::Resident => Vec::new(), // nothing streams: no stall, no misses
        _ => supply.watcher.1 .0.finish(supply.inner),
    };
    let trace = trace.map(|t| (t.events(), t.dropped()));
    let cpu_steal = CpuTimes::now()
        .zip(cpu0)
        .and_then(|(now, before)| now.steal_since(&before));
    let io: IoSnapshot = end.2 - io0;
    let s1 = supply.inner.stats().unwrap_or_default();
    let stats = s1.since(&stats0);
    let layers = supply
        .inner
        .layers()
        .map(|ls: &[LayerState]| {
            ls.iter()
                .enumerate()
                .map(|(layer, s)| {
                    (
                        layer,
                        s.since(layers0.get(layer).unwrap_or(&LayerState::INITIAL)),
                    )
                })
                .filter(|(_, s)| s.predicted > 0)
                .map(|(layer, s)| LayerPrediction {
                    layer,
                    precision: s.precision(),
                    recall: s.recall(),
                    enabled: s.prefetch_enabled,
                    predicted: s.predicted,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(ScheduleReport {
        schedule,
        tokens,
        decode,
        prefill,
        bytes_read: io.file_bytes,
        stall: Duration::from_nanos(io.stall_nanos),
        reads: io.reads,
        read_time: Duration::from_nanos(io.read_nanos),
        busy: Duration::from_nanos(io.busy_nanos),
        io_engine: supply.inner.device().map(FileDevice::engine_name),
        stats,
        layers,
        device_bw,
        probes: [0.0; 2],
        output_time: mv.time - output0,
        layer_costs,
        picks: std::mem::take(&mut supply.watcher.0.picks),
        decode_from,
        cpu_steal,
        stretches,
        trace,
        disk_use: None,
    })
}

/// The file device's counters (zero for a resident supply).
fn io_snapshot(supply: &Supply<'_>) -> IoSnapshot {
    supply
        .device()
        .map(FileDevice::io_snapshot)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(schedule: Schedule, decode_ms: u64, stall_ms: u64, bytes: u64) -> ScheduleReport {
        ScheduleReport {
            schedule,
            tokens: vec![0; 10],
            decode: Duration::from_millis(decode_ms),
            prefill: Duration::ZERO,
            bytes_read: bytes,
            stall: Duration::from_millis(stall_ms),
            reads: 0,
            read_time: Duration::ZERO,
            busy: Duration::ZERO,
            io_engine: None,
            stats: Stats::default(),
            layers: Vec::new(),
            layer_costs: Vec::new(),
            device_bw: 1e9,
            probes: [0.0; 2],
            output_time: Duration::ZERO,
            picks: Vec::new(),
            decode_from: 0,
            cpu_steal: None,
            stretches: Vec::new(),
            trace: None,
            disk_use: None,
        }
    }

    #[test]
    fn overlap_bound_is_on_demand_time_over_the_longer_of_compute_and_io_with_the_output_layer() {
        // On-demand: 400 ms/token, 150 of them stalled: 250 ms of compute.
        let od = report(Schedule::OnDemand, 4000, 1500, 0);
        assert!((od.compute_per_token() - 0.25).abs() < 1e-9);
        // 100 MB/token at 1 GB/s = 100 ms < 250 ms: compute bounds.
        let les = report(Schedule::Les, 3000, 100, 1_000_000_000);
        assert!((les.overlap_bound(&od).unwrap() - 1.6).abs() < 1e-9);
        // 500 MB/token at 1 GB/s = 500 ms: the reads bound, below 1x.
        let heavy = report(Schedule::Les, 6000, 100, 5_000_000_000);
        assert!((heavy.overlap_bound(&od).unwrap() - 0.8).abs() < 1e-9);
        // Read faster than the probe (500 MB/token in 300 ms): that bandwidth counts.
        let fast = report(Schedule::Les, 3000, 100, 5_000_000_000);
        assert!((fast.overlap_bound(&od).unwrap() - 0.4 / 0.3).abs() < 1e-9);
        // The output layer (200 ms/token) adds to the 100 ms of reads: 300 ms
        // > 250 ms of compute bounds.
        let with_output = ScheduleReport {
            output_time: Duration::from_millis(2000),
            ..report(Schedule::Les, 3000, 100, 1_000_000_000)
        };
        assert!((with_output.overlap_bound(&od).unwrap() - 0.4 / 0.3).abs() < 1e-9);
        let unmeasured = ScheduleReport {
            device_bw: 0.0,
            ..report(Schedule::Les, 3000, 100, 1)
        };
        assert_eq!(unmeasured.overlap_bound(&od), None);
    }

    #[test]
    fn stretches_cover_the_decode_without_empty_ones() {
        assert_eq!(stretch_bounds(128, 4), [0, 32, 64, 96, 128]);
        assert_eq!(stretch_bounds(10, 4), [0, 2, 5, 7, 10]);
        assert_eq!(stretch_bounds(3, 4), [0, 1, 2, 3]);
        assert_eq!(stretch_bounds(1, 4), [0, 1]);
        assert_eq!(stretch_bounds(0, 4), [0]);
        assert_eq!(stretch_bounds(5, 0), [0, 5]);
        for n in 0..40 {
            for parts in 1..6 {
                let b = stretch_bounds(n, parts);
                assert_eq!((b[0], *b.last().unwrap()), (0, n));
                assert!(b.windows(2).all(|w| w[0] < w[1]), "{n} {parts} {b:?}");
                assert!(b.len() <= parts + 1);
            }
        }
    }

    #[test]
    fn busy_read_bandwidth_is_bytes_per_second_with_reads_outstanding() {
        // 1.5 GB read while the device was busy 2 s (of 1.5 s of stall): 0.75 GB/s.
        let od = ScheduleReport {
            busy: Duration::from_secs(2),
            ..report(Schedule::OnDemand, 4000, 1500, 1_500_000_000)
        };
        assert!((od.busy_read_bw() - 0.75e9).abs() < 1.0);
        assert_eq!(report(Schedule::Les, 4000, 0, 5).busy_read_bw(), 0.0);
    }
}
