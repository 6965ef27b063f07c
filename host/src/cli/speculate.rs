//! `les bench --speculate`: each schedule decoding plainly and speculatively,
//! interleaved, on one model, budget and prompt, cold each time.

use std::error::Error;
use std::io::Write;

use serde_json::{json, Value};

use super::bench::{mib, BenchArgs};
use crate::bench::{run_speculative, SpecReport};
use crate::supply::Schedule;

/// Runs `les bench --speculate`.
pub fn speculate(args: &BenchArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let (model, tokenizer, budget, _) = super::bench::open(args)?;
    let draft_model = args.spec.open_draft_model(&tokenizer)?;
    let cfg = super::bench::decode_config(args, &tokenizer, &budget)?;
    let mode = format!("{:?}", args.spec.source()).to_lowercase();
    note!(
        "les bench: {} ({} layers), {} tokens plain and with --speculate {mode} (drafts of up to {}{}), {}, {} threads",
        model.arch.name(),
        model.hp.n_layers,
        cfg.n_tokens,
        args.spec.draft_max(),
        if args.spec.draft_fixed { ", whole" } else { ", cut to what pays" },
        super::bench::slots_summary(&model, &budget),
        cfg.threads,
    );
    let all = super::bench::interleaved(
        args.repeat,
        &args.schedules,
        &[false, true],
        |s, spec| format!("{s}, {}", if spec { mode.as_str() } else { "plain" }),
        |s, spec| {
            run_speculative(
                &model,
                &args.model,
                &cfg,
                s,
                spec.then_some(&args.spec),
                draft_model.as_ref(),
            )
        },
        |r| {
            format!(
                "{:.2} tok/s, {:.2} tokens a pass",
                r.tok_s(),
                r.tokens_per_pass()
            )
        },
    )?;
    let identical = all.iter().flatten().all(|r| r.tokens == all[0][0].tokens);
    let medians = super::bench::medians(all, |r| r.time);
    let plain = |s: Schedule| {
        medians
            .iter()
            .find(|r| r.schedule == s && !r.speculative)
            .map_or(0.0, SpecReport::tok_s)
    };
    if args.json {
        let rows: Vec<Value> = medians
            .iter()
            .map(|r| {
                json!({
                    "schedule": r.schedule.name(),
                    "speculative": r.speculative,
                    "tok_s": r.tok_s(),
                    "bytes_per_token": r.bytes_per_token(),
                    "drafted": r.stats.drafted,
                    "accepted": r.stats.accepted,
                    "verify_passes": r.stats.verify_passes,
                    "tokens_per_pass": r.tokens_per_pass(),
                    "speedup": r.tok_s() / plain(r.schedule).max(1e-12),
                })
            })
            .collect();
        writeln!(
            out,
            "{}",
            json!({
                "model": args.model.display().to_string(),
                "n_tokens": cfg.n_tokens,
                "speculate": mode,
                "draft_max": args.spec.draft_max(),
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
            "{:<10} {:<7} {:>8} {:>10} {:>16} {:>9} {:>8}",
            "schedule", "decode", "tok/s", "MiB/token", "drafts accepted", "tok/pass", "speedup"
        )?;
        for r in &medians {
            let accepted = if r.speculative {
                format!(
                    "{}/{} ({:.0}%)",
                    r.stats.accepted,
                    r.stats.drafted,
                    100.0 * r.stats.acceptance()
                )
            } else {
                "-".into()
            };
            writeln!(
                out,
                "{:<10} {:<7} {:>8.2} {:>10.2} {:>16} {:>9.2} {:>7.2}x",
                r.schedule.name(),
                if r.speculative {
                    mode.as_str()
                } else {
                    "plain"
                },
                r.tok_s(),
                mib(r.bytes_per_token()),
                accepted,
                r.tokens_per_pass(),
                r.tok_s() / plain(r.schedule).max(1e-12),
            )?;
        }
        writeln!(
            out,
            "speedup: over the same schedule's plain decode; identical tokens across all runs: {}",
            if identical { "yes" } else { "NO" }
        )?;
    }
    if identical {
        Ok(())
    } else {
        Err("speculative and plain decoding produced different tokens".into())
    }
}
