//! `les bench --parallel`: several sequences decoded side by side (each
//! pass reading a layer's experts once for all of them), every schedule at
//! each count, on one model and budget, cold each time.

use std::error::Error;
use std::io::Write;

use serde_json::{json, Value};

use super::bench::{mib, BenchArgs};
use crate::bench::{run_parallel, ParallelReport};
use crate::supply::Schedule;

/// Runs `les bench --parallel`.
pub fn parallel(args: &BenchArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let (model, tokenizer, budget, _) = super::bench::open(args)?;
    let cfg = super::bench::decode_config(args, &tokenizer, &budget)?;
    note!(
        "les bench: {} ({} layers), prompt of {} tokens, {} tokens a sequence, {}, {} threads",
        model.arch.name(),
        model.hp.n_layers,
        cfg.prompt.len(),
        cfg.n_tokens,
        super::bench::slots_summary(&model, &budget),
        cfg.threads,
    );
    // Rounds of (schedule, count) runs, interleaved; each pair's median.
    let all = super::bench::interleaved(
        args.repeat,
        &args.schedules,
        &args.parallel,
        |s, n| format!("{s}, {n} side by side"),
        |s, n| run_parallel(&model, &args.model, &cfg, s, n),
        |r| format!("{:.2} tok/s", r.tok_s()),
    )?;
    let identical = same_sequences(all.iter().flatten());
    let medians = super::bench::medians(all, |r| r.time.div_f64(r.generated().max(1) as f64));
    // Each schedule's throughput over its first count.
    let base = |s: Schedule| {
        medians
            .iter()
            .find(|r| r.schedule == s)
            .map_or(0.0, ParallelReport::tok_s)
    };
    if args.json {
        let rows: Vec<Value> = medians
            .iter()
            .map(|r| {
                json!({
                    "schedule": r.schedule.name(),
                    "sequences": r.sequences(),
                    "tok_s": r.tok_s(),
                    "tok_s_per_sequence": r.tok_s() / r.sequences().max(1) as f64,
                    "bytes_per_token": r.bytes_per_token(),
                    "stall_share": r.stall_share(),
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
                "n_tokens": cfg.n_tokens,
                "slots": budget.slots(),
                "slot_bytes": budget.bytes(),
                "threads": cfg.threads,
                "runs": rows,
                "identical_tokens": identical,
            })
        )?;
    } else {
        writeln!(
            out,
            "{:<10} {:>9} {:>8} {:>13} {:>11} {:>7} {:>8}",
            "schedule", "sequences", "tok/s", "tok/s a seq.", "MiB/token", "stall", "speedup"
        )?;
        for r in &medians {
            writeln!(
                out,
                "{:<10} {:>9} {:>8.2} {:>13.2} {:>11.2} {:>6.0}% {:>7.2}x",
                r.schedule.name(),
                r.sequences(),
                r.tok_s(),
                r.tok_s() / r.sequences().max(1) as f64,
                mib(r.bytes_per_token()),
                100.0 * r.stall_share(),
                r.tok_s() / base(r.schedule).max(1e-12),
            )?;
        }
        writeln!(
            out,
            "tok/s: all sequences together; stall: share of the time blocked on reads\nspeedup: over the same schedule's first count ({}); each sequence's tokens identical in every run that decoded it: {}",
            args.parallel[0],
            if identical { "yes" } else { "NO" }
        )?;
    }
    if identical {
        Ok(())
    } else {
        Err("counts or schedules decoded a sequence differently".into())
    }
}

/// Whether every run that decoded sequence `i` gave it the same tokens.
fn same_sequences<'r>(runs: impl Iterator<Item = &'r ParallelReport> + Clone) -> bool {
    let longest = runs
        .clone()
        .map(ParallelReport::sequences)
        .max()
        .unwrap_or(0);
    (0..longest).all(|i| {
        let mut seen = runs.clone().filter_map(|r| r.tokens.get(i));
        let first = seen.next();
        seen.all(|t| Some(t) == first)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn report(tokens: Vec<Vec<u32>>) -> ParallelReport {
        ParallelReport {
            schedule: Schedule::Les,
            tokens,
            time: Duration::from_secs(1),
            bytes_read: 0,
            stall: Duration::ZERO,
        }
    }

    #[test]
    fn a_sequence_is_compared_in_every_run_that_decoded_it() {
        let one = report(vec![vec![1, 2]]);
        let two = report(vec![vec![1, 2], vec![3, 4]]);
        let three = report(vec![vec![1, 2], vec![3, 4], vec![5]]);
        assert!(same_sequences([&one, &two, &three].into_iter()));
        let other = report(vec![vec![1, 2], vec![3, 5]]);
        assert!(!same_sequences([&one, &two, &other].into_iter()));
        let first_differs = report(vec![vec![1, 3]]);
        assert!(!same_sequences([&first_differs, &three].into_iter()));
    }
}
