//! `les bench --prefill-batches`: a prompt's evaluation at several batch sizes,
//! every schedule at each, on one model and budget, cold each time.

use std::error::Error;
use std::io::Write;

use serde_json::{json, Value};

use super::bench::{mib, BenchArgs};
use crate::bench::{run_prefill, BenchConfig, PrefillReport};
use crate::compute::default_threads;
use crate::supply::Schedule;

/// Runs `les bench --prefill-batches`.
pub fn prefill(args: &BenchArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let (model, tokenizer, budget, _) = super::bench::open(args)?;
    let text = crate::synth::vocab::SAMPLE;
    let first = tokenizer.encode(text, true, false);
    let again = tokenizer.encode(text, false, false);
    if again.is_empty() {
        return Err("the built-in prompt text is empty after tokenization".into());
    }
    let prompt: Vec<u32> = first
        .into_iter()
        .chain(again.into_iter().cycle())
        .take(args.prefill_tokens)
        .collect();
    let cfg = BenchConfig {
        prompt,
        n_tokens: 0,
        threads: args.threads.unwrap_or_else(default_threads).max(1),
        budget: budget.clone(),
        lookahead: args.lookahead,
        sampler: crate::sampling::SamplerConfig::greedy(),
        trace: false,
        kv_types: args.cache.types(),
        swa: args.cache.swa(),
    };
    note!(
        "les bench: {} ({} layers), prompt of {} tokens, {}, {} threads",
        model.arch.name(),
        model.hp.n_layers,
        cfg.prompt.len(),
        super::bench::slots_summary(&model, &budget),
        cfg.threads,
    );
    // Rounds of (schedule, batch) runs, interleaved; each pair's median.
    let all = super::bench::interleaved(
        args.repeat,
        &args.schedules,
        &args.prefill_batches,
        |s, b| format!("prefill with {s}, batches of {b}"),
        |s, b| run_prefill(&model, &args.model, &cfg, s, b),
        |r| format!("{:.2} tok/s", r.tok_s()),
    )?;
    let first = &all[0][0].logits;
    let identical = all.iter().flatten().all(|r| {
        r.logits
            .iter()
            .map(|v| v.to_bits())
            .eq(first.iter().map(|v| v.to_bits()))
    });
    let medians = super::bench::medians(all, |r| r.time);
    // Each schedule's speedup over its first batch size.
    let base = |s: Schedule| {
        medians
            .iter()
            .find(|r| r.schedule == s)
            .map_or(0.0, PrefillReport::tok_s)
    };
    if args.json {
        let rows: Vec<Value> = medians
            .iter()
            .map(|r| {
                json!({
                    "schedule": r.schedule.name(),
                    "batch": r.batch,
                    "tok_s": r.tok_s(),
                    "bytes_per_token": r.bytes_per_token(),
                    "stall_share": r.stall_share(),
                    "busy_share": r.busy_share(),
                    "speedup": r.tok_s() / base(r.schedule).max(1e-12),
                })
            })
            .collect();
        writeln!(
            out,
            "{}",
            json!({
                "model": args.model.display().to_string(),
                "prompt_tokens": cfg.prompt.len(),
                "slots": budget.slots(),
                "slot_bytes": budget.bytes(),
                "threads": cfg.threads,
                "runs": rows,
                "identical_logits": identical,
            })
        )?;
    } else {
        writeln!(
            out,
            "{:<10} {:>6} {:>13} {:>11} {:>7} {:>7} {:>8}",
            "schedule", "batch", "prompt tok/s", "MiB/token", "stall", "busy", "speedup"
        )?;
        for r in &medians {
            writeln!(
                out,
                "{:<10} {:>6} {:>13.2} {:>11.2} {:>6.0}% {:>6.0}% {:>7.2}x",
                r.schedule.name(),
                r.batch,
                r.tok_s(),
                mib(r.bytes_per_token()),
                100.0 * r.stall_share(),
                100.0 * r.busy_share(),
                r.tok_s() / base(r.schedule).max(1e-12),
            )?;
        }
        writeln!(
            out,
            "stall: share of the time blocked on reads; busy: share with reads outstanding\nspeedup: over the same schedule's first batch size ({}); identical last-position logits across all runs: {}",
            args.prefill_batches[0],
            if identical { "yes" } else { "NO" }
        )?;
    }
    if identical {
        Ok(())
    } else {
        Err("batch sizes or schedules produced different logits".into())
    }
}
