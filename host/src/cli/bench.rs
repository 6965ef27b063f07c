//! `les bench`: the schedules side by side, cold cache, same model, budget and prompt.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use serde_json::{json, Map, Value};

use les_core::slot_classes::{plan_by_bytes, plan_minimum, SlotClass};
use les_core::slots::ExpertKey;

use super::run::resolve_budget;
use super::values::ExpertMem;
use crate::belady;
use crate::bench::{device_bandwidth, run_schedule, BenchConfig, ScheduleReport};
use crate::compute::{default_threads, kernel_prefetch};
use crate::flash::IoEngine;
use crate::layer_costs::group_bounds;
use crate::model::Model;
use crate::supply::Schedule;
use crate::tokenizer::Tokenizer;
use crate::trace::{disk_use, write_chrome, Event, Phase, PhaseUse};

/// Runs of layers the per-layer stall is printed in.
const LAYER_GROUPS: usize = 8;

/// Steal (share of CPU time) from which `les bench` mentions it.
const STEAL_WORTH_NOTING: f64 = 0.01;

/// Arguments of `les bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The model (GGUF, plain or packed).
    #[arg(short, long)]
    pub model: PathBuf,
    /// RAM for expert slots: a size (e.g. 2GiB) or a share of the model's
    /// expert bytes (e.g. 25%, as `--sweep` takes them); experts of different
    /// sizes get slots of their size, each size the same share.
    #[arg(long)]
    pub expert_mem: Option<String>,
    /// Number of expert slots (instead of --expert-mem), split across expert
    /// sizes by their expert counts.
    #[arg(long, conflicts_with = "expert_mem")]
    pub slots: Option<usize>,
    /// Tokens to generate per schedule (128, as llama-bench's `tg128`: a decode
    /// that starts cold first fills the expert slots, and a short one measures
    /// mostly that; the report's rate by quarter shows whether it held).
    #[arg(short = 'n', long, default_value_t = 128, value_parser = super::values::tokens)]
    pub n_tokens: usize,
    /// The prompt (raw). With --parallel, several may be given: sequence
    /// `i` decodes the `i`-th (counting round).
    #[arg(long, default_value = "The history of the printing press begins", action = clap::ArgAction::Append)]
    pub prompt: Vec<String>,
    /// Schedules to run, comma-separated, in order.
    #[arg(long, value_delimiter = ',', default_value = "on-demand,les")]
    pub schedules: Vec<Schedule>,
    /// Compute threads (default: physical cores).
    #[arg(short, long, value_parser = super::values::threads)]
    pub threads: Option<usize>,
    /// The file device's I/O settings.
    #[command(flatten)]
    pub io: super::run::IoArgs,
    /// KV cache types.
    #[command(flatten)]
    pub cache: super::run::CacheArgs,
    /// Print one JSON object instead of tables (with `--sweep`: one entry per
    /// budget under `budgets`, and the verdicts)
    #[arg(long)]
    pub json: bool,
    /// Sampling temperature (0 = greedy; greedy decodes of random-weight
    /// synthetic models fall into loops that route to the same experts).
    #[arg(long = "temp", default_value_t = 0.8, value_parser = super::values::non_negative)]
    pub temperature: f32,
    /// Run the schedules this many times, interleaved (A B A B ...), and report
    /// each schedule's median run: slow drift of a shared machine then affects
    /// every schedule alike.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,
    /// Sampling seed (the same for every schedule).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Lookahead prediction (les schedule).
    #[command(flatten)]
    pub lookahead: crate::bench::LookaheadArgs,
    /// Instead of one budget, sweep these percentages of the expert bytes (e.g.
    /// `10,25,50,100`, each as `--expert-mem P%`) and print one row per budget
    /// and schedule.
    #[arg(long, value_delimiter = ',', value_parser = super::values::percent, conflicts_with_all = ["expert_mem", "slots", "speculate", "model_draft"])]
    pub sweep: Vec<f64>,
    /// Instead of decoding, time the prompt's evaluation at each of these batch
    /// sizes (e.g. `1,64`; see `les run -b`), every schedule at each, and print
    /// the speedups over the first size.
    #[arg(long, value_delimiter = ',', value_parser = super::values::batch, conflicts_with_all = ["sweep", "speculate", "model_draft"])]
    pub prefill_batches: Vec<usize>,
    /// Instead of one sequence, decode this many side by side (e.g. `1,2,4`),
    /// each counting its own tokens from the prompt (sequence `i` sampling
    /// with the seed plus `i`, from the `i`-th --prompt where several are
    /// given), every pass reading each layer's experts once for all of them;
    /// every schedule at each count, and the throughput over the first count
    /// printed. With --speculate, each count also with each sequence
    /// verifying its own drafts in the shared passes.
    #[arg(long, value_delimiter = ',', value_parser = super::values::sequences, conflicts_with_all = ["sweep", "prefill_batches", "trace"])]
    pub parallel: Vec<usize>,
    /// Prompt positions for --prefill-batches: a built-in English text's tokens,
    /// repeated to this many.
    #[arg(long, default_value_t = 512, value_parser = super::values::tokens)]
    pub prefill_tokens: usize,
    /// With `--speculate`: every schedule decodes plainly and speculatively,
    /// and the speedups of speculation are printed.
    #[command(flatten)]
    pub spec: crate::draft::SpecArgs,
    /// Record each run's decode (every read, stall, layer, output projection
    /// and token) into this file, in the Chrome trace format
    /// (`chrome://tracing`, ui.perfetto.dev), and print how busy the device was
    /// in each phase of a token.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["sweep", "prefill_batches", "speculate", "model_draft"])]
    pub trace: Option<PathBuf>,
}

/// The sampler every schedule uses: `les run`'s defaults (llama.cpp's:
/// top-k 40, top-p 0.95, min-p 0.05, no repeat penalty) at `--temp`, seeded.
fn sampler(args: &BenchArgs) -> crate::sampling::SamplerConfig {
    crate::sampling::SamplerConfig {
        temperature: args.temperature,
        seed: args.seed,
        ..crate::sampling::SamplerConfig::default()
    }
}

/// The decode benchmark's settings from `args`: its prompt, tokens, threads,
/// budget, lookahead and sampler.
pub(super) fn decode_config(
    args: &BenchArgs,
    tokenizer: &Tokenizer,
    budget: &crate::supply::SlotBudget,
) -> Result<BenchConfig, Box<dyn Error>> {
    let prompt = tokenizer.encode(&args.prompt[0], true, true);
    if prompt.is_empty() {
        return Err("the prompt is empty after tokenization".into());
    }
    Ok(BenchConfig {
        prompt,
        n_tokens: args.n_tokens,
        threads: args.threads.unwrap_or_else(default_threads).max(1),
        budget: budget.clone(),
        lookahead: args.lookahead,
        sampler: sampler(args),
        trace: args.trace.is_some(),
        kv_types: args.cache.types(),
        swa: args.cache.swa(),
    })
}

/// `run` of each schedule with each setting (the pairs schedule by
/// schedule), `repeat` rounds interleaved (A B A B ...), so that slow drift
/// of a shared machine affects every pair alike; each run noted before as
/// `what` names it, and after with what `done` says of it. Each pair's runs,
/// in order.
pub(super) fn interleaved<P: Copy, R>(
    repeat: u32,
    schedules: &[Schedule],
    settings: &[P],
    what: impl Fn(Schedule, P) -> String,
    mut run: impl FnMut(Schedule, P) -> Result<R, Box<dyn Error>>,
    done: impl Fn(&R) -> String,
) -> Result<Vec<Vec<R>>, Box<dyn Error>> {
    let pairs: Vec<(Schedule, P)> = schedules
        .iter()
        .flat_map(|&s| settings.iter().map(move |&p| (s, p)))
        .collect();
    let mut all: Vec<Vec<R>> = pairs.iter().map(|_| Vec::new()).collect();
    for round in 0..repeat {
        for (i, &(s, p)) in pairs.iter().enumerate() {
            let name = what(s, p);
            note!("les bench: {name} ({}/{repeat}) ...", round + 1);
            let r = run(s, p)?;
            note!("les bench: {name}: {}", done(&r));
            all[i].push(r);
        }
    }
    Ok(all)
}

/// Each list's median run by `time` (the runs of one configuration, from
/// interleaved rounds; [`median_index`]).
pub(super) fn medians<R>(all: Vec<Vec<R>>, time: impl Fn(&R) -> std::time::Duration) -> Vec<R> {
    all.into_iter()
        .map(|mut v| {
            v.sort_by_key(&time);
            v.swap_remove(median_index(v.len()))
        })
        .collect()
}

/// Which of `n` runs sorted by time (fastest first) is reported as their
/// median: the middle one, and of an even count the faster of the middle two
/// (a run's figures cannot be averaged with another's; every schedule is
/// picked by the same rule). `n` must not be 0.
pub(super) fn median_index(n: usize) -> usize {
    n.saturating_sub(1) / 2
}

/// Refuses a schedule named twice: each schedule's results are keyed by its
/// name, so a second run of it would silently replace the first.
pub(super) fn check_schedules(schedules: &[Schedule]) -> Result<(), Box<dyn Error>> {
    for (i, s) in schedules.iter().enumerate() {
        if schedules[..i].contains(s) {
            return Err(format!(
                "--schedules names {} twice (use --repeat to run it again)",
                s.name()
            )
            .into());
        }
    }
    Ok(())
}

/// A budget as given, for tables: `25`, `12.5`, `0.0001` (not rounded to `0`).
fn percent_label(p: f64) -> String {
    format!("{p}")
}

/// `slots N = M MiB (P% of experts)`, for the benches' first line.
pub(super) fn slots_summary(model: &Model, budget: &crate::supply::SlotBudget) -> String {
    format!(
        "slots {} = {:.1} MiB ({:.1}% of experts)",
        budget.slots(),
        mib(budget.bytes() as f64),
        100.0 * budget.bytes() as f64 / model.expert_slot_bytes().max(1) as f64,
    )
}

pub(super) fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

/// The model, its tokenizer, the slot budget (none when every schedule is
/// `resident`) and whether any schedule streams.
pub(super) fn open(
    args: &BenchArgs,
) -> Result<(Model, Tokenizer, crate::supply::SlotBudget, bool), Box<dyn Error>> {
    let model = Model::open(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(model.gguf())?;
    if args.schedules.is_empty() {
        return Err("--schedules is empty".into());
    }
    let streamed = args.schedules.iter().any(|s| *s != Schedule::Resident);
    let (_, budget) = resolve_budget(
        &model,
        Some(if streamed {
            Schedule::Les
        } else {
            Schedule::Resident
        }),
        args.expert_mem.as_deref(),
        args.slots,
        &args.io,
    )?;
    Ok((model, tokenizer, budget, streamed))
}

/// Runs `les bench`.
pub fn run(args: &BenchArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    check_schedules(&args.schedules)?;
    args.spec.check()?;
    if args.prompt.len() > 1 && args.parallel.is_empty() {
        return Err("several --prompt are for --parallel (a prompt a sequence)".into());
    }
    if !args.sweep.is_empty() {
        return sweep(args, out);
    }
    if !args.prefill_batches.is_empty() {
        return super::prefill::prefill(args, out);
    }
    if !args.parallel.is_empty() {
        return super::parallel::parallel(args, out);
    }
    if args.spec.source() != crate::draft::DraftSource::None {
        return super::speculate::speculate(args, out);
    }
    let (model, tokenizer, budget, streamed) = open(args)?;
    let cfg = decode_config(args, &tokenizer, &budget)?;
    let expert_bytes = model.total_expert_bytes();
    let slot_bytes = budget.bytes();
    if !streamed && (args.expert_mem.is_some() || args.slots.is_some()) {
        note!("les bench: only `resident` runs, which keeps every expert in RAM: the slot budget is not used");
    }
    note!(
        "les bench: {} ({} layers), experts {:.1} MiB, slots {} = {:.1} MiB ({:.1}% of experts{}), {} threads, {}, {}",
        model.arch.name(),
        model.hp.n_layers,
        mib(expert_bytes as f64),
        budget.slots(),
        mib(slot_bytes as f64),
        100.0 * slot_bytes as f64 / model.expert_slot_bytes().max(1) as f64,
        class_note(&budget.classes),
        cfg.threads,
        match budget.io.engine {
            IoEngine::Threads => format!("{} I/O threads", budget.io.threads),
            IoEngine::Uring => format!("io_uring ({} reads in flight)", budget.io.threads),
            IoEngine::Auto => format!(
                "io_uring where available ({} reads in flight), else as many I/O threads",
                budget.io.threads
            ),
        },
        kernels_note()
    );
    let bw = if streamed {
        let bw = device_bandwidth(&model, &args.model, budget.io, probe_bytes(&model))?;
        note!(
            "les bench: device reads expert extents at {:.0} MiB/s (cold, full queue)",
            mib(bw)
        );
        bw
    } else {
        0.0
    };
    let (runs, identical) = run_interleaved(&model, args, &cfg, bw)?;
    let reports: Vec<&ScheduleReport> = runs.iter().map(|x| &x.median).collect();
    let on_demand = reports.iter().find(|r| r.schedule == Schedule::OnDemand);
    let base = on_demand.map(|r| r.tok_s());
    let optimal = optimal_hit_rate(&model, &reports, &budget.classes, identical);

    if args.json {
        let (schedules, speedup, bound) = schedules_json(&runs, model.hp.n_layers);
        let obj = json!({
            "model": args.model.display().to_string(),
            "slots": budget.slots(),
            "slot_bytes": slot_bytes,
            "slot_classes": classes_json(&budget.classes),
            "expert_bytes": expert_bytes,
            "device_bw": bw,
            "n_tokens": cfg.n_tokens,
            "threads": cfg.threads,
            "kernels": kernels_json(),
            "schedules": schedules,
            "speedup": speedup,
            "speedup_rounds": round_speedups(&runs)
                .into_iter()
                .map(|(s, v)| (s.name().to_string(), json!(v)))
                .collect::<Map<_, _>>(),
            "speedup_bound": bound,
            "optimal_hit_rate": optimal,
            "identical_tokens": identical,
        });
        writeln!(out, "{obj}")?;
        return if identical {
            Ok(())
        } else {
            Err("schedules produced different tokens".into())
        };
    }

    writeln!(
        out,
        "{:<10} {:>8} {:>11} {:>11} {:>8} {:>8} {:>10} {:>8} {:>9} {:>8} {:>8}",
        "schedule",
        "tok/s",
        "MiB/token",
        "stall/tok",
        "hit",
        "ready",
        "read MiB/s",
        "overlap",
        "precision",
        "recall",
        "speedup"
    )?;
    for r in &reports {
        writeln!(
            out,
            "{:<10} {:>8.2} {:>11.2} {:>9.1}ms {:>7.1}% {:>7.1}% {:>10.0} {:>8.2} {:>9} {:>8} {:>8}",
            r.schedule.name(),
            r.tok_s(),
            mib(r.bytes_per_token()),
            1e3 * r.stall_per_token(),
            100.0 * r.hit_rate(),
            100.0 * r.ready_hit_rate(),
            mib(r.effective_bw()),
            r.overlap_efficiency(),
            if r.layers.is_empty() {
                "-".into()
            } else {
                format!("{:.2}", r.mean_precision())
            },
            if r.layers.is_empty() {
                "-".into()
            } else {
                format!("{:.2}", r.mean_recall())
            },
            base.map_or("-".into(), |b| format!("{:.2}x", r.tok_s() / b)),
        )?;
    }
    if args.repeat > 1 {
        for x in &runs {
            let v: Vec<String> = x.tok_s.iter().map(|t| format!("{t:.2}")).collect();
            writeln!(
                out,
                "{}: median of {} runs{} (tok/s {}; spread +-{:.1}%)",
                x.median.schedule.name(),
                x.tok_s.len(),
                if x.tok_s.len() % 2 == 0 {
                    ", the faster middle one"
                } else {
                    ""
                },
                v.join(" "),
                100.0 * x.spread()
            )?;
        }
        // The machine drifts: each round's ratio, measured minutes apart from
        // the others, shows how much of the headline is noise.
        for (s, v) in round_speedups(&runs) {
            if s == Schedule::OnDemand {
                continue;
            }
            let list: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
            writeln!(
                out,
                "{}: speedup per round {} (median {:.2}x)",
                s.name(),
                list.join(" "),
                median(v)
            )?;
        }
    }
    // A decode that starts cold first fills the slots: whether the rate held.
    for r in reports.iter().filter(|r| r.stretches.len() > 1) {
        let rates: Vec<String> = r
            .stretches
            .iter()
            .map(|x| format!("{:.2}", x.tok_s()))
            .collect();
        let bytes: Vec<String> = r
            .stretches
            .iter()
            .map(|x| format!("{:.1}", mib(x.bytes_per_token())))
            .collect();
        writeln!(
            out,
            "{}: tok/s by {} of the decode: {}{}",
            r.schedule.name(),
            if r.stretches.len() == crate::bench::STRETCHES {
                "quarter"
            } else {
                "stretch"
            },
            rates.join(" / "),
            if r.schedule == Schedule::Resident {
                String::new()
            } else {
                format!(" (MiB/token {})", bytes.join(" / "))
            }
        )?;
    }
    if let (Some(od), Some(b)) = (on_demand, base) {
        for r in reports.iter().filter(|r| r.schedule == Schedule::Les) {
            if let Some(x) = r.overlap_bound(od) {
                writeln!(
                    out,
                    "{}: {:.2}x; with perfect overlap about {x:.2}x (on-demand's compute time, \
                     or {}'s bytes at the device's bandwidth plus the output layer's {:.1} ms, \
                     when the next token's reads are not known yet; whichever is longer)",
                    r.schedule.name(),
                    r.tok_s() / b,
                    r.schedule.name(),
                    1e3 * r.output_per_token(),
                )?;
            }
        }
    }
    let busy: Vec<String> = reports
        .iter()
        .filter(|r| r.schedule != Schedule::Resident)
        .map(|r| {
            format!(
                "{} {:.0}%{}",
                r.schedule.name(),
                100.0 * r.busy_share(),
                r.io_engine.map_or(String::new(), |e| format!(" ({e})"))
            )
        })
        .collect();
    if !busy.is_empty() {
        writeln!(
            out,
            "device busy (reads outstanding) while decoding: {}; the rest of the time its \
             bandwidth went unused",
            busy.join(", ")
        )?;
    }
    if reports.len() > 1 {
        let computes: Vec<String> = reports
            .iter()
            .map(|r| {
                format!(
                    "{} {:.1} ms ({:.0} MiB read)",
                    r.schedule.name(),
                    1e3 * r.compute_per_token(),
                    mib(r.bytes_per_token())
                )
            })
            .collect();
        writeln!(
            out,
            "compute per token (decode time less stall): {}; the kernels are the same, so a \
             difference is the schedule's own work and what its reads cost the compute",
            computes.join(", ")
        )?;
    }
    let steals: Vec<(Schedule, f64)> = reports
        .iter()
        .filter_map(|r| Some((r.schedule, r.cpu_steal?)))
        .collect();
    if steals.iter().any(|(_, s)| *s >= STEAL_WORTH_NOTING) {
        let list: Vec<String> = steals
            .iter()
            .map(|(s, x)| format!("{} {:.1}%", s.name(), 100.0 * x))
            .collect();
        writeln!(
            out,
            "cpu time the hypervisor took while decoding (steal): {}; where it grows with \
             the reads that overlap compute, the host emulates the disk on this machine's \
             cores and every byte read slows the compute",
            list.join(", ")
        )?;
    }
    if let Some(h) = optimal {
        let streamed: Vec<String> = reports
            .iter()
            .filter(|r| r.schedule != Schedule::Resident)
            .map(|r| {
                let late = if r.stats.late_hits > 0 {
                    format!(
                        " ({:.1}% counting prefetches still in flight)",
                        100.0 * r.hit_rate()
                    )
                } else {
                    String::new()
                };
                format!(
                    "{} {:.1}%{late}",
                    r.schedule.name(),
                    100.0 * r.ready_hit_rate()
                )
            })
            .collect();
        writeln!(
            out,
            "hit rate of the optimal cache without prediction (Belady's, knowing every \
             future pick): {:.1}%; resident and ready when picked: {}",
            100.0 * h,
            streamed.join(", ")
        )?;
    }
    for r in reports.iter().filter(|r| !r.layers.is_empty()) {
        let mut worst = r.layers.clone();
        worst.sort_by(|a, b| a.precision.total_cmp(&b.precision));
        let w: Vec<String> = worst
            .iter()
            .take(3)
            .map(|l| {
                format!(
                    "layer {} p={:.2} r={:.2}{}",
                    l.layer,
                    l.precision,
                    l.recall,
                    if l.enabled { "" } else { " (prefetch off)" }
                )
            })
            .collect();
        writeln!(
            out,
            "{}: worst predicted layers: {}",
            r.schedule.name(),
            w.join(", ")
        )?;
    }
    for r in reports.iter().filter(|r| !r.layer_costs.is_empty()) {
        let n = r.tokens.len().max(1) as f64;
        let groups = crate::layer_costs::grouped(&r.layer_costs, LAYER_GROUPS);
        let stall: Vec<String> = groups
            .iter()
            .map(|(a, b, c)| format!("{a}-{b} {:.1}", c.stall.as_secs_f64() * 1e3 / n))
            .collect();
        let reads: Vec<String> = groups
            .iter()
            .map(|(a, b, c)| format!("{a}-{b} {:.1}", (c.misses + c.late_hits) as f64 / n))
            .collect();
        writeln!(
            out,
            "{}: stall ms/token by layers: {}",
            r.schedule.name(),
            stall.join(", ")
        )?;
        writeln!(
            out,
            "{}: experts not ready when picked (misses + late prefetches) per token by layers: {}",
            r.schedule.name(),
            reads.join(", ")
        )?;
    }
    for r in &reports {
        if let Some(u) = &r.disk_use {
            write_disk_use(out, r, u, model.hp.n_layers)?;
        }
    }
    writeln!(
        out,
        "identical tokens across schedules: {}",
        if identical { "yes" } else { "NO" }
    )?;
    if !identical {
        return Err("schedules produced different tokens".into());
    }
    Ok(())
}

/// The name of a phase of `disk_use`, with layer groups as
/// [`crate::layer_costs::grouped`] numbers them over `n_layers` layers.
fn phase_name(p: Phase, n_layers: usize) -> String {
    match p {
        Phase::Start => "token start".into(),
        Phase::Layers(g) => {
            let b = group_bounds(n_layers, LAYER_GROUPS);
            let g = g as usize;
            match (b.get(g), b.get(g + 1)) {
                (Some(a), Some(z)) => format!("layers {a}-{}", z - 1),
                _ => format!("layer group {g}"),
            }
        }
        Phase::Output => "output".into(),
    }
}

/// `les bench --trace`'s table: per phase of a token, its time, how busy the
/// device was, the mean reads in flight and the stall (with the part when no
/// read was in flight).
fn write_disk_use(
    out: &mut dyn Write,
    r: &ScheduleReport,
    u: &[(Phase, PhaseUse)],
    n_layers: usize,
) -> Result<(), Box<dyn Error>> {
    let n = r.tokens.len().max(1) as f64;
    let ms = |ns: u64| ns as f64 / 1e6 / n;
    writeln!(
        out,
        "{}: where the device was busy (from the trace), per token:",
        r.schedule.name()
    )?;
    writeln!(
        out,
        "  {:<14} {:>8} {:>10} {:>16} {:>12} {:>22}",
        "phase", "ms", "disk busy", "reads in flight", "stall ms", "stall, nothing read ms"
    )?;
    for &(p, x) in u {
        writeln!(
            out,
            "  {:<14} {:>8.2} {:>9.0}% {:>16.2} {:>12.2} {:>22.3}",
            phase_name(p, n_layers),
            ms(x.time),
            100.0 * x.busy_share(),
            x.mean_reads(),
            ms(x.stall),
            ms(x.stall_idle)
        )?;
    }
    Ok(())
}

/// [`write_disk_use`]'s table as JSON (times in seconds per token).
fn disk_use_json(u: &[(Phase, PhaseUse)], n_layers: usize, tokens: usize) -> Value {
    let n = tokens.max(1) as f64;
    let s = |ns: u64| ns as f64 / 1e9 / n;
    Value::Array(
        u.iter()
            .map(|&(p, x)| {
                json!({
                    "phase": phase_name(p, n_layers),
                    "s_per_token": s(x.time),
                    "disk_busy": x.busy_share(),
                    "reads_in_flight": x.mean_reads(),
                    "stall_s_per_token": s(x.stall),
                    "stall_nothing_read_s_per_token": s(x.stall_idle),
                })
            })
            .collect(),
    )
}

/// Each schedule's median run as JSON (the `schedules` object), the speedups
/// over on-demand and the speedups perfect overlap would give (empty without an
/// on-demand run).
fn schedules_json(runs: &[Runs], n_layers: usize) -> (Value, Value, Value) {
    let on_demand = runs
        .iter()
        .map(|x| &x.median)
        .find(|r| r.schedule == Schedule::OnDemand);
    let base = on_demand.map(|r| r.tok_s());
    let mut schedules = Map::new();
    let mut speedup = Map::new();
    let mut bound = Map::new();
    for x in runs {
        let r = &x.median;
        schedules.insert(
            r.schedule.name().into(),
            json!({
                "tok_s": r.tok_s(),
                "tok_s_runs": x.tok_s,
                "bytes_per_token": r.bytes_per_token(),
                "stall_s_per_token": r.stall_per_token(),
                "compute_s_per_token": r.compute_per_token(),
                "output_layer_s_per_token": r.output_per_token(),
                "hit_rate": r.hit_rate(),
                "ready_hit_rate": r.ready_hit_rate(),
                "effective_read_bw": r.effective_bw(),
                "device_bw": r.device_bw,
                "device_bw_probes": r.probes,
                "overlap_efficiency": r.overlap_efficiency(),
                "prediction_precision": (!r.layers.is_empty()).then(|| r.mean_precision()),
                "prediction_recall": (!r.layers.is_empty()).then(|| r.mean_recall()),
                "demand_bytes": r.stats.demand_bytes,
                "prefetch_bytes": r.stats.prefetch_bytes,
                "useful_prefetches": r.stats.useful_prefetches,
                "prefetches": r.stats.prefetches,
                "hits": r.stats.hits,
                "late_hits": r.stats.late_hits,
                "misses": r.stats.misses,
                "stalls": r.stats.stalls,
                "split_computes": r.stats.split_computes,
                "reads": r.reads,
                "mean_read_s": r.mean_read_time(),
                "cancels": r.stats.cancels,
                "cpu_steal": r.cpu_steal,
                "device_busy_share": r.busy_share(),
                "io_engine": r.io_engine,
                "tokens": r.tokens,
                "stretches": r.stretches.iter().map(|x| json!({
                    "tokens": x.tokens,
                    "tok_s": x.tok_s(),
                    "bytes_per_token": x.bytes_per_token(),
                    "stall_s_per_token": x.stall.as_secs_f64() / x.tokens.max(1) as f64,
                })).collect::<Vec<_>>(),
                "layers": r.layers.iter().map(|l| json!({
                    "layer": l.layer, "precision": l.precision, "recall": l.recall, "prefetch_enabled": l.enabled, "predicted": l.predicted,
                })).collect::<Vec<_>>(),
                "disk_use": r.disk_use.as_ref().map(|u| disk_use_json(u, n_layers, r.tokens.len())),
                "layer_costs": r.layer_costs.iter().enumerate().map(|(layer, c)| json!({
                    "layer": layer,
                    "stall_s_per_token": c.stall.as_secs_f64() / r.tokens.len().max(1) as f64,
                    "hits": c.hits, "late_hits": c.late_hits, "misses": c.misses,
                })).collect::<Vec<_>>(),
            }),
        );
        if let Some(b) = base {
            speedup.insert(r.schedule.name().into(), json!(r.tok_s() / b));
        }
        if let Some(x) = on_demand.and_then(|od| r.overlap_bound(od)) {
            bound.insert(r.schedule.name().into(), json!(x));
        }
    }
    (
        Value::Object(schedules),
        Value::Object(speedup),
        Value::Object(bound),
    )
}

/// Belady's optimal hit rate with `slots` slots over the decode's routing, which
/// every streamed schedule shares when they generated the same tokens (`None`
/// without a streamed schedule or when the tokens differ).
fn optimal_hit_rate(
    model: &Model,
    reports: &[&ScheduleReport],
    classes: &[SlotClass],
    identical: bool,
) -> Option<f64> {
    if !identical {
        return None;
    }
    let r = reports.iter().find(|r| r.schedule != Schedule::Resident)?;
    // Each size class is a cache of its own: its layers' picks, its slots.
    let layer_class: Vec<Option<usize>> = (0..model.hp.n_layers)
        .map(|l| model.slot_class_of(classes, l))
        .collect();
    let mut count = belady::CacheCount::default();
    for (c, class) in classes.iter().enumerate() {
        let in_class = |k: &&ExpertKey| layer_class.get(k.layer as usize) == Some(&Some(c));
        let picks: Vec<ExpertKey> = r.picks.iter().filter(in_class).copied().collect();
        let from = r.picks[..r.decode_from].iter().filter(in_class).count();
        let x = belady::optimal_hits(&picks, class.slots as usize, from);
        count.hits += x.hits;
        count.misses += x.misses;
    }
    Some(count.hit_rate())
}

/// `, in N slot sizes` where the slots come in more than one size.
fn class_note(classes: &[SlotClass]) -> String {
    match classes.len() {
        0 | 1 => String::new(),
        n => format!(", in {n} slot sizes"),
    }
}

/// The compute kernels in use, for the header line: their ISA and how far
/// ahead they prefetch weights (which depends on the CPU; see
/// [`kernel_prefetch`]).
fn kernels_note() -> String {
    let prefetch = match kernel_prefetch() {
        0 => "no weight prefetch".to_string(),
        d => format!("weight prefetch {d} B"),
    };
    format!("kernels {} ({prefetch})", les_core::gemv::Isa::detect())
}

/// The same as JSON: `{"isa": "avx512vnni", "prefetch_bytes": 0}`.
fn kernels_json() -> Value {
    json!({
        "isa": les_core::gemv::Isa::detect().name(),
        "prefetch_bytes": kernel_prefetch(),
    })
}

/// The slot classes as JSON: `[{"slots": N, "bytes": B}, ...]`.
fn classes_json(classes: &[SlotClass]) -> serde_json::Value {
    classes
        .iter()
        .map(|c| json!({"slots": c.slots, "bytes": c.bytes}))
        .collect()
}

/// The median of `v` (the mean of the middle two for an even count; 0 if empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Per schedule, its tok/s over on-demand's in the same round of
/// [`run_interleaved`] (empty without an on-demand run).
fn round_speedups(runs: &[Runs]) -> Vec<(Schedule, Vec<f64>)> {
    let Some(od) = runs
        .iter()
        .find(|x| x.median.schedule == Schedule::OnDemand)
    else {
        return Vec::new();
    };
    runs.iter()
        .map(|x| {
            let v = x.tok_s.iter().zip(&od.tok_s).map(|(a, b)| a / b).collect();
            (x.median.schedule, v)
        })
        .collect()
}

/// Bytes of experts a bandwidth probe reads: 256 MiB, or all of them if fewer.
fn probe_bytes(model: &Model) -> u64 {
    (256u64 << 20).min(model.total_expert_bytes())
}

/// One schedule's runs of [`run_interleaved`].
struct Runs {
    /// The run with the median decode time ([`median_index`]).
    median: ScheduleReport,
    /// Tokens per second of every run, in run order.
    tok_s: Vec<f64>,
}

impl Runs {
    /// Half the spread of the runs' tok/s, relative to their median (0 for one
    /// run).
    fn spread(&self) -> f64 {
        let (lo, hi) = self
            .tok_s
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        if self.tok_s.len() < 2 {
            0.0
        } else {
            (hi - lo) / 2.0 / median(self.tok_s.clone()).max(1e-9)
        }
    }
}

/// Runs every schedule of `args` `args.repeat` times, interleaved; also says
/// whether every run of every schedule generated the same tokens.
fn run_interleaved(
    model: &Model,
    args: &BenchArgs,
    cfg: &BenchConfig,
    bw: f64,
) -> Result<(Vec<Runs>, bool), Box<dyn Error>> {
    let mut all: Vec<Vec<ScheduleReport>> = vec![Vec::new(); args.schedules.len()];
    // The latest probe of the device's bandwidth (0: nothing streamed).
    let mut last_probe = bw;
    // Each run's timeline, with `--trace`, into a file made before the runs (a
    // path that cannot be written fails now, not after them).
    let mut traced: Vec<(String, Vec<Event>)> = Vec::new();
    let trace_file = match &args.trace {
        Some(path) => Some(
            std::fs::File::create(path)
                .map_err(|e| format!("cannot write the trace {}: {e}", path.display()))?,
        ),
        None => None,
    };
    for round in 0..args.repeat {
        for (i, &s) in args.schedules.iter().enumerate() {
            note!("les bench: running {s} ({}/{}) ...", round + 1, args.repeat);
            let before = last_probe;
            let mut r = run_schedule(model, &args.model, cfg, s, before)?;
            if before > 0.0 && s != Schedule::Resident {
                // The device's bandwidth drifts (1.4-2.6 GiB/s minutes apart on
                // this machine's disk): probe it again after each streamed run
                // and take the mean of the probes around it, so the run's overlap
                // is against what the device gave then. That probe is also the
                // next run's "before".
                last_probe =
                    device_bandwidth(model, &args.model, cfg.budget.io, probe_bytes(model))?;
                r.probes = [before, last_probe];
                r.device_bw = (before + last_probe) / 2.0;
                note!(
                    "les bench: {s}: {:.2} tok/s (device {:.0} MiB/s before, {:.0} after)",
                    r.tok_s(),
                    mib(before),
                    mib(last_probe)
                );
            } else {
                note!("les bench: {s}: {:.2} tok/s", r.tok_s());
            }
            if let Some((events, dropped)) = r.trace.take() {
                let bounds = group_bounds(model.hp.n_layers, LAYER_GROUPS);
                let group_of =
                    |l: u16| bounds.iter().rposition(|&b| b <= l as usize).unwrap_or(0) as u16;
                r.disk_use = Some(disk_use(&events, group_of));
                if dropped > 0 {
                    note!("les bench: the trace of {s} had no room for its last {dropped} events");
                }
                traced.push((format!("{s} ({}/{})", round + 1, args.repeat), events));
            }
            all[i].push(r);
        }
    }
    if let (Some(path), Some(f)) = (&args.trace, trace_file) {
        write_chrome(std::io::BufWriter::new(f), &traced)
            .map_err(|e| format!("cannot write the trace {}: {e}", path.display()))?;
        note!(
            "les bench: wrote the trace of {} runs to {} (chrome://tracing, ui.perfetto.dev)",
            traced.len(),
            path.display()
        );
    }
    // The overlap figures need the device's bandwidth. The probe reads scattered
    // extents cold; on-demand's bytes over the time it had reads outstanding
    // measure the bandwidth the decode's own reads got: use the higher (the
    // median over rounds).
    let od = args.schedules.iter().position(|s| *s == Schedule::OnDemand);
    if let Some(i) = od.filter(|_| bw > 0.0) {
        let v: Vec<f64> = all[i].iter().map(ScheduleReport::busy_read_bw).collect();
        if let Some(od_bw) = Some(median(v)).filter(|b| *b > bw) {
            note!(
                "les bench: on-demand read at {:.0} MiB/s while it had reads outstanding, \
                 faster than the probe: the overlap figures use that",
                mib(od_bw)
            );
            for r in all.iter_mut().flatten() {
                r.device_bw = r.device_bw.max(od_bw);
            }
        }
    }
    let first = all.iter().flatten().next().map(|r| &r.tokens);
    let identical = all.iter().flatten().all(|r| Some(&r.tokens) == first);
    let runs = all
        .into_iter()
        .map(|mut v| {
            let tok_s = v.iter().map(ScheduleReport::tok_s).collect();
            v.sort_by_key(|r| r.decode);
            let median = v.swap_remove(median_index(v.len()));
            Runs { median, tok_s }
        })
        .collect();
    Ok((runs, identical))
}

/// The les row of one sweep budget, for the verdicts.
struct SweepRow {
    /// Budget, percent of the expert bytes.
    pct: f64,
    /// les's median tok/s and ready hit rate (picks resident and landed).
    tok_s: f64,
    hit_rate: f64,
    /// on-demand's median tok/s and hit rate (LRU), if it ran.
    base: Option<f64>,
    lru_hit: Option<f64>,
    /// Belady's optimal hit rate without prediction at this budget.
    optimal: Option<f64>,
    /// The largest relative spread of any schedule's runs at this budget.
    noise: f64,
}

/// `les bench --sweep`: each budget, each schedule; speedup over on-demand and
/// whether les's hit rate is at least LRU's (on-demand's) at every budget.
fn sweep(args: &BenchArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let model = Model::open(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(model.gguf())?;
    let prompt = tokenizer.encode(&args.prompt[0], true, true);
    if prompt.is_empty() {
        return Err("the prompt is empty after tokenization".into());
    }
    let expert_bytes = model.total_expert_bytes();
    let threads = args.threads.unwrap_or_else(default_threads).max(1);
    let io = args.io.config()?;
    let bw = device_bandwidth(&model, &args.model, io, probe_bytes(&model))?;
    note!(
        "les bench: {threads} threads, {}; device reads expert extents at {:.0} MiB/s",
        kernels_note(),
        mib(bw)
    );
    let top_k = model.hp.moe.map_or(1, |m| m.top_k);
    let mut rows = Vec::new();
    let mut budgets_json = Vec::new();
    // Budgets whose schedules generated different tokens (an exactness bug).
    let mut differing = Vec::new();
    if !args.json {
        writeln!(
            out,
            "{:>7} {:>6} {:<10} {:>8} {:>7} {:>8} {:>8} {:>9} {:>8} {:>8}",
            "budget",
            "slots",
            "schedule",
            "tok/s",
            "spread",
            "hit",
            "ready",
            "MiB/tok",
            "overlap",
            "speedup"
        )?;
    }
    for &pct in &args.sweep {
        // A budget below one layer's picks of each size runs at that minimum.
        let groups = model.expert_size_groups();
        let bytes = ExpertMem::Percent(pct).bytes(model.expert_slot_bytes());
        let classes = plan_by_bytes(groups.iter().copied(), bytes, top_k as u32)
            .or_else(|_| plan_minimum(groups, top_k as u32))
            .map_err(|e| format!("{pct}%: {e}"))?;
        let budget = crate::supply::SlotBudget {
            classes: classes.to_vec(),
            io,
        };
        let slots = budget.slots();
        let cfg = BenchConfig {
            prompt: prompt.clone(),
            n_tokens: args.n_tokens,
            threads,
            budget,
            lookahead: args.lookahead,
            sampler: sampler(args),
            trace: false,
            kv_types: args.cache.types(),
            swa: args.cache.swa(),
        };
        let mut base = None;
        let mut lru_hit = None;
        note!("les bench: budget {pct}% of the expert bytes ({slots} slots)");
        let (runs, identical) = run_interleaved(&model, args, &cfg, bw)?;
        let medians: Vec<&ScheduleReport> = runs.iter().map(|x| &x.median).collect();
        let optimal = optimal_hit_rate(&model, &medians, &cfg.budget.classes, identical);
        let mut noise = 0f64;
        for x in &runs {
            let (r, s) = (&x.median, x.median.schedule);
            if s == Schedule::OnDemand {
                base = Some(r.tok_s());
                lru_hit = Some(r.hit_rate());
            }
            noise = noise.max(x.spread());
        }
        if args.json {
            let (schedules, speedup, bound) = schedules_json(&runs, model.hp.n_layers);
            budgets_json.push(json!({
                "percent": pct,
                "slots": slots,
                "schedules": schedules,
                "speedup": speedup,
                "speedup_bound": bound,
                "optimal_hit_rate": optimal,
                "identical_tokens": identical,
            }));
        }
        for x in &runs {
            let (r, s) = (&x.median, x.median.schedule);
            if s == Schedule::Les {
                rows.push(SweepRow {
                    pct,
                    tok_s: r.tok_s(),
                    hit_rate: r.ready_hit_rate(),
                    base,
                    lru_hit,
                    optimal,
                    noise,
                });
            }
            if args.json {
                continue;
            }
            writeln!(
                out,
                "{:>6}% {:>6} {:<10} {:>8.2} {:>6.1}% {:>7.1}% {:>7.1}% {:>9.2} {:>8.2} {:>8}",
                percent_label(pct),
                slots,
                s.name(),
                r.tok_s(),
                100.0 * x.spread(),
                100.0 * r.hit_rate(),
                100.0 * r.ready_hit_rate(),
                mib(r.bytes_per_token()),
                r.overlap_efficiency(),
                base.map_or("-".into(), |b| format!("{:.2}x", r.tok_s() / b)),
            )?;
            out.flush()?;
        }
        if !identical {
            differing.push(format!("{pct}%"));
        }
    }
    let (never_slower, hits_ge_lru) = verdicts(&rows);
    let within_noise: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            let b = r.base?;
            let tol = tolerance(r.noise);
            (r.tok_s < b && r.tok_s >= b * (1.0 - tol)).then(|| {
                format!(
                    "{}%: {:.2}x within the +-{:.1}% spread",
                    percent_label(r.pct),
                    r.tok_s / b,
                    100.0 * tol
                )
            })
        })
        .collect();
    if args.json {
        let obj = json!({
            "model": args.model.display().to_string(),
            "expert_bytes": expert_bytes,
            "device_bw": bw,
            "n_tokens": args.n_tokens,
            "threads": threads,
            "kernels": kernels_json(),
            "repeat": args.repeat,
            "budgets": budgets_json,
            "les_never_slower": never_slower,
            "les_hit_rate_at_least_lru": hits_ge_lru,
        });
        writeln!(out, "{obj}")?;
        return different_tokens(&differing);
    }
    writeln!(
        out,
        "les never slower than on-demand: {}{}{}",
        verdict_word(never_slower),
        if args.repeat > 1 {
            format!(" (medians of {} interleaved runs)", args.repeat)
        } else {
            String::new()
        },
        if within_noise.is_empty() {
            String::new()
        } else {
            format!("; {}", within_noise.join(", "))
        }
    )?;
    writeln!(
        out,
        "les hit rate (ready when picked) >= LRU at every budget: {}",
        verdict_word(hits_ge_lru)
    )?;
    let optimal: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            Some(format!(
                "{}% {:.1}%",
                percent_label(r.pct),
                100.0 * r.optimal?
            ))
        })
        .collect();
    if !optimal.is_empty() {
        writeln!(
            out,
            "hit rate of the optimal cache without prediction (Belady's): {}",
            optimal.join(", ")
        )?;
    }
    different_tokens(&differing)
}

/// The largest relative shortfall against on-demand a sweep's verdict calls
/// noise: the budget's run-to-run spread, at most half.
fn tolerance(noise: f64) -> f64 {
    noise.clamp(0.0, 0.5)
}

/// The sweep's verdicts over les's rows: never slower than on-demand (beyond
/// each budget's [`tolerance`]), and a ready hit rate at least LRU's at every
/// budget. `None` where nothing was compared: les or on-demand did not run.
fn verdicts(rows: &[SweepRow]) -> (Option<bool>, Option<bool>) {
    let compared = |f: fn(&SweepRow) -> Option<f64>| rows.iter().any(|r| f(r).is_some());
    let never_slower = compared(|r| r.base).then(|| {
        rows.iter().all(|r| {
            r.base
                .is_none_or(|b| r.tok_s >= b * (1.0 - tolerance(r.noise)))
        })
    });
    let hits = compared(|r| r.lru_hit).then(|| {
        rows.iter()
            .all(|r| r.lru_hit.is_none_or(|h| r.hit_rate >= h))
    });
    (never_slower, hits)
}

/// `yes`, `no`, or why there is no verdict.
fn verdict_word(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "n/a (needs les and on-demand in --schedules)",
    }
}

/// The sweep's verdict on exactness: an error naming the budgets whose
/// schedules generated different tokens.
fn different_tokens(budgets: &[String]) -> Result<(), Box<dyn Error>> {
    if budgets.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "schedules produced different tokens at the {} budget",
            budgets.join(", ")
        )
        .into())
    }
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![1.65, 1.53, 1.56]), 1.56);
        assert_eq!(median(vec![1.65, 1.58]), 1.615);
        assert_eq!(median(vec![2.0]), 2.0);
        assert_eq!(median(Vec::new()), 0.0);
    }
}
