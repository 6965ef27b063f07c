//! `les bench --parallel`: several sequences decoded side by side (each
//! pass reading a layer's experts once for all of them), every schedule at
//! each count, on one model and budget, cold each time.

use std::error::Error;
use std::io::Write;

use serde_json::{json, Value};

use super::bench::{mib, BenchArgs};
use crate::bench::{run_parallel, ParallelReport, SideBySide};
use crate::draft::DraftSource;
use crate::supply::Schedule;

/// Runs `les bench --parallel`.
pub fn parallel(args: &BenchArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let (model, tokenizer, budget, _) = super::bench::open(args)?;
    let cfg = super::bench::decode_config(args, &tokenizer, &budget)?;
    let prompts: Vec<Vec<u32>> = args
        .prompt
        .iter()
        .map(|p| tokenizer.encode(p, true, true))
        .collect();
    if prompts.iter().any(Vec::is_empty) {
        return Err("a prompt is empty after tokenization".into());
    }
    let source = args.spec.source();
    let spec = match source {
        DraftSource::None => None,
        DraftSource::Ngram | DraftSource::Model | DraftSource::Mtp => Some(&args.spec),
    };
    let draft_model = args.spec.open_draft_model(&tokenizer)?;
    let decodes: &[bool] = if spec.is_some() {
        &[false, true]
    } else {
        &[false]
    };
    let settings: Vec<(usize, bool)> = args
        .parallel
        .iter()
        .flat_map(|&n| decodes.iter().map(move |&d| (n, d)))
        .collect();
    let decode = |d: bool| match (d, source) {
        (false, _) => "plain",
        (true, DraftSource::Model) => "model",
        (true, DraftSource::Mtp) => "mtp",
        (true, _) => "ngram",
    };
    let mode = if spec.is_some() {
        format!("plainly and with --speculate {}, ", decode(true))
    } else {
        String::new()
    };
    note!(
        "les bench: {} ({} layers), prompts of {} tokens, {} tokens a sequence, {mode}{}, {} threads",
        model.arch.name(),
        model.hp.n_layers,
        prompts.iter().map(|p| p.len().to_string()).collect::<Vec<_>>().join("/"),
        cfg.n_tokens,
        super::bench::slots_summary(&model, &budget),
        cfg.threads,
    );
    // Rounds of (schedule, count, decode) runs, interleaved; each one's
    // median.
    let all = super::bench::interleaved(
        args.repeat,
        &args.schedules,
        &settings,
        |s, (n, d)| format!("{s}, {n} side by side, {}", decode(d)),
        |s, (n, d)| {
            let run = SideBySide {
                sequences: n,
                prompts: &prompts,
                spec: spec.filter(|_| d),
                draft_model: draft_model.as_ref(),
            };
            run_parallel(&model, &args.model, &cfg, s, run)
        },
        |r| {
            format!(
                "{:.2} tok/s, {:.2} tokens a pass",
                r.tok_s(),
                r.tokens_per_pass()
            )
        },
    )?;
    let identical = same_sequences(all.iter().flatten());
    let medians = super::bench::medians(all, |r| r.time.div_f64(r.generated().max(1) as f64));
    // Each schedule's throughput over its first count, decoded plainly.
    let base = |s: Schedule| {
        medians
            .iter()
            .find(|r| r.schedule == s && !r.speculative)
            .map_or(0.0, ParallelReport::tok_s)
    };
    if args.json {
        let rows: Vec<Value> = medians
            .iter()
            .map(|r| {
                json!({
                    "schedule": r.schedule.name(),
                    "sequences": r.sequences(),
                    "decode": decode(r.speculative),
                    "tok_s": r.tok_s(),
                    "tok_s_per_sequence": r.tok_s() / r.sequences().max(1) as f64,
                    "bytes_per_token": r.bytes_per_token(),
                    "stall_share": r.stall_share(),
                    "passes": r.passes,
                    "drafted": r.drafted,
                    "accepted": r.accepted,
                    "tokens_per_pass": r.tokens_per_pass(),
                    "speedup": r.tok_s() / base(r.schedule).max(1e-12),
                })
            })
            .collect();
        writeln!(
            out,
            "{}",
            json!({
                "model": args.model.display().to_string(),
                "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
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
            "{:<10} {:>9} {:>6} {:>8} {:>13} {:>11} {:>7} {:>9} {:>8}",
            "schedule",
            "sequences",
            "decode",
            "tok/s",
            "tok/s a seq.",
            "MiB/token",
            "stall",
            "tok/pass",
            "speedup"
        )?;
        for r in &medians {
            writeln!(
                out,
                "{:<10} {:>9} {:>6} {:>8.2} {:>13.2} {:>11.2} {:>6.0}% {:>9.2} {:>7.2}x",
                r.schedule.name(),
                r.sequences(),
                decode(r.speculative),
                r.tok_s(),
                r.tok_s() / r.sequences().max(1) as f64,
                mib(r.bytes_per_token()),
                100.0 * r.stall_share(),
                r.tokens_per_pass(),
                r.tok_s() / base(r.schedule).max(1e-12),
            )?;
        }
        writeln!(
            out,
            "tok/s: all sequences together; stall: share of the time blocked on reads; tok/pass: tokens a sequence got from each pass it took part in\nspeedup: over the same schedule's first count ({}), decoded plainly; each sequence's tokens identical in every run that decoded it: {}",
            args.parallel[0],
            if identical { "yes" } else { "NO" }
        )?;
    }
    if identical {
        Ok(())
    } else {
        Err("counts, schedules or drafts decoded a sequence differently".into())
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
            speculative: false,
            tokens,
            time: Duration::from_secs(1),
            bytes_read: 0,
            stall: Duration::ZERO,
            passes: 1,
            drafted: 0,
            accepted: 0,
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
