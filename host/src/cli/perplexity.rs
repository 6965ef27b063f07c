//! `les perplexity`: a model's perplexity over a text, and its KL divergence
//! from a base model's distributions, as llama.cpp's `llama-perplexity`
//! computes them (the numbers and the base files compare across the tools).

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use les_core::gemv::Isa;
use les_core::model::forward::{Lookahead, TokenInput};
use serde_json::json;

use super::run::{read_prompt_file, CacheArgs, ExpertArgs};
use crate::compute::{default_threads, ThreadedMatVec};
use crate::engine::Session;
use crate::model::Model;
use crate::perplexity::{percentile, row_len, BaseReader, BaseWriter, KlDivergence, Perplexity};
use crate::supply::Supply;
use crate::tokenizer::Tokenizer;

/// Arguments of `les perplexity`.
#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// The model (GGUF).
    #[arg(short, long)]
    pub model: PathBuf,
    /// The text (UTF-8), e.g. wikitext-2's `wiki.test.raw`. Not needed with
    /// --kl-divergence, which takes the base file's tokens.
    #[arg(short, long, required_unless_present = "kl_divergence")]
    pub file: Option<PathBuf>,
    /// Positions per chunk (llama-perplexity's -c); the second half of each
    /// chunk is scored. With --kl-divergence, the base file's.
    #[arg(short = 'c', long = "ctx", default_value_t = 512, value_parser = clap::value_parser!(u32).range(4..=1 << 20))]
    pub ctx: u32,
    /// Most chunks to evaluate (default: all the text fills).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub chunks: Option<u32>,
    /// Positions evaluated at once, layer by layer (the results do not
    /// depend on it); 1 = one at a time, with lookahead prefetching.
    #[arg(short = 'b', long, default_value_t = crate::engine::DEFAULT_PREFILL_BATCH,
          value_parser = super::values::batch)]
    pub batch_size: usize,
    /// Compute threads (default: the available cores).
    #[arg(short, long, value_parser = super::values::threads)]
    pub threads: Option<usize>,
    /// Without --kl-divergence: write the model's log-probabilities of every
    /// scored position to FILE (llama.cpp's format, which llama-perplexity
    /// --kl-divergence reads too). With it: the base file to compare with.
    #[arg(long, value_name = "FILE")]
    pub kl_divergence_base: Option<PathBuf>,
    /// Compare the model's distributions with --kl-divergence-base's: KL
    /// divergence, perplexity ratio, top-token agreement, probability change.
    #[arg(long, requires = "kl_divergence_base", conflicts_with = "file")]
    pub kl_divergence: bool,
    /// Print one JSON object with the results instead of text.
    #[arg(long)]
    pub json: bool,
    /// Where the experts live.
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// KV cache types.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Lookahead prediction (les schedule, batches of one).
    #[command(flatten)]
    pub lookahead: crate::bench::LookaheadArgs,
}

/// Scores position `j` from its logits.
type Score<'s> = dyn FnMut(usize, &[f32]) -> Result<(), Box<dyn Error>> + 's;

/// What evaluates the chunks.
struct Evaluator<'a, 'm> {
    session: Session<'m>,
    mv: ThreadedMatVec,
    supply: Supply<'m>,
    lookahead: &'a Lookahead,
    logits: Vec<f32>,
    n_vocab: usize,
}

impl Evaluator<'_, '_> {
    /// Evaluates `chunk` from position 0 and calls `score(j, logits)` for each
    /// position `j` from `first` to the last but one (whose logits predict
    /// token `j + 1`).
    fn chunk(
        &mut self,
        chunk: &[TokenInput<'_>],
        first: usize,
        score: &mut Score<'_>,
    ) -> Result<(), Box<dyn Error>> {
        let v = self.n_vocab;
        self.session.rewind(0)?;
        let batch = self.session.prefill_batch().max(1);
        let mut pos = 0;
        while pos < chunk.len() {
            let n = batch.min(chunk.len() - pos);
            let inputs = &chunk[pos..pos + n];
            let scored = pos + n > first;
            if n == 1 {
                let out = &mut self.logits[..v];
                self.session.eval(
                    &mut self.mv,
                    &mut self.supply,
                    Some(self.lookahead),
                    inputs[0],
                    out,
                )?;
            } else {
                // Every position's logits only where some are scored.
                let out = &mut self.logits[..if scored { n * v } else { v }];
                self.session
                    .eval_batch(&mut self.mv, &mut self.supply, inputs, out)?;
            }
            if scored {
                for j in pos.max(first)..(pos + n).min(chunk.len() - 1) {
                    score(j, &self.logits[(j - pos) * v..(j - pos + 1) * v])?;
                }
            }
            pos += n;
        }
        Ok(())
    }
}

/// Runs `les perplexity`.
pub fn run(args: &PerplexityArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let t0 = Instant::now();
    args.experts.check()?;
    let text = args.file.as_deref().map(read_prompt_file).transpose()?;
    let model = Model::open(&args.model)?;
    let n_vocab = model.hp.n_vocab;
    let tokenizer = Tokenizer::from_gguf(model.gguf())?;
    if tokenizer.add_eos() {
        return Err(
            "the model adds an EOS token to every text; perplexity over chunks \
                    cannot use it (llama-perplexity refuses it too)"
                .into(),
        );
    }
    // The base file to compare with, or the text's tokens.
    let mut base = match (&args.kl_divergence_base, args.kl_divergence) {
        (Some(path), true) => Some(BaseReader::open(path, n_vocab)?),
        _ => None,
    };
    let (n_ctx, tokens) = match (&mut base, &text) {
        (Some(b), _) => (b.n_ctx, std::mem::take(&mut b.tokens)),
        (None, Some(text)) => (args.ctx as usize, tokenizer.encode(text, true, false)),
        (None, None) => unreachable!("clap requires --file without --kl-divergence"),
    };
    if base.is_none() && tokens.len() < 2 * n_ctx {
        return Err(format!(
            "the text is {} tokens; a context of {n_ctx} needs at least {} (lower --ctx)",
            tokens.len(),
            2 * n_ctx
        )
        .into());
    }
    let available = match &base {
        Some(b) => b.n_chunk,
        None => tokens.len() / n_ctx,
    };
    if model.n_ctx_train > 0 && n_ctx > model.n_ctx_train {
        note!(
            "les: warning: chunks of {n_ctx} positions are longer than the {} the model was \
             trained on",
            model.n_ctx_train
        );
    }
    let n_chunk = args
        .chunks
        .map_or(available, |c| (c as usize).min(available));
    let first = n_ctx / 2;
    let (schedule, budget) = args.experts.resolve(&model)?;
    let threads = args.threads.unwrap_or_else(default_threads).max(1);
    let lookahead = crate::bench::lookahead(&model, &args.lookahead);
    let mut session = Session::with_kv(&model, n_ctx, args.cache.types(), args.cache.swa())?;
    let batch = session.set_prefill_batch(args.batch_size.min(n_ctx))?;
    let supply = Supply::new(&model, &args.model, schedule, budget.clone())?;
    model.populate_resident();
    let mut eval = Evaluator {
        session,
        mv: ThreadedMatVec::new(threads, Isa::detect()),
        supply,
        lookahead: &lookahead,
        logits: vec![0f32; batch.max(1) * n_vocab],
        n_vocab,
    };
    let mut writer = match (&args.kl_divergence_base, args.kl_divergence) {
        (Some(path), false) => Some({
            crate::interrupt::install();
            BaseWriter::create(path, n_ctx, n_vocab, &tokens[..n_chunk * n_ctx])?
        }),
        _ => None,
    };
    note!(
        "les: perplexity of {} ({} layers) over {n_chunk} chunks of {n_ctx} positions \
         ({} of {} tokens), the last {} of each scored; batch {batch}, schedule {schedule}{}, \
         {threads} threads, loaded in {:.2?}",
        model.arch.name(),
        model.hp.n_layers,
        n_chunk * n_ctx,
        tokens.len(),
        n_ctx - 1 - first,
        match budget.slots() {
            0 => String::new(),
            n => format!(", {n} slots"),
        },
        t0.elapsed()
    );
    let bos = tokenizer.bos().filter(|_| tokenizer.add_bos());
    let mut ppl = Perplexity::default();
    let mut kld = KlDivergence::default();
    let mut rows: Vec<u16> = Vec::new();
    let row = row_len(n_vocab);
    let mut running = Vec::with_capacity(n_chunk);
    let t_eval = Instant::now();
    for c in 0..n_chunk {
        let t_chunk = Instant::now();
        let chunk = &tokens[c * n_ctx..(c + 1) * n_ctx];
        // The chunk starts a sequence: BOS in place of its first token.
        let inputs: Vec<TokenInput<'_>> = chunk
            .iter()
            .enumerate()
            .map(|(i, &t)| TokenInput::Token(if i == 0 { bos.unwrap_or(t) } else { t }))
            .collect();
        if let Some(b) = &mut base {
            b.next_chunk(&mut rows)?;
        }
        eval.chunk(&inputs, first, &mut |j, logits| {
            let next = chunk[j + 1];
            match (&mut writer, base.is_some()) {
                (Some(w), _) => ppl.add(w.push(logits, next)?),
                (None, true) => {
                    let r = (j - first) * row;
                    kld.add(logits, &rows[r..r + row], next);
                }
                (None, false) => ppl.add(crate::perplexity::nll(logits, next)),
            }
            Ok(())
        })?;
        if c == 0 {
            let s = t_chunk.elapsed().as_secs_f64();
            note!(
                "les: {s:.2} s a chunk, about {:.2} minutes in all",
                s * n_chunk as f64 / 60.0
            );
        }
        if base.is_some() {
            running.push(kld.log_ppl().0.exp());
            if !args.json {
                kl_chunk_line(out, c, &kld)?;
            }
        } else {
            running.push(ppl.ppl());
            if !args.json {
                write!(out, "[{}]{:.4},", c + 1, ppl.ppl())?;
                out.flush()?;
            }
        }
    }
    if let Some(w) = writer {
        w.finish()?;
    }
    let elapsed = t_eval.elapsed().as_secs_f64();
    let evaluated = n_chunk * n_ctx;
    let io = eval.supply.stats();
    if let Some(s) = &io {
        note!(
            "les: slot hit rate {:.1}%, read {:.1} MiB on demand + {:.1} MiB prefetched",
            100.0 * s.hit_rate(),
            s.demand_bytes as f64 / (1 << 20) as f64,
            s.prefetch_bytes as f64 / (1 << 20) as f64
        );
    }
    note!(
        "les: {evaluated} positions in {elapsed:.2} s ({:.1} tok/s)",
        evaluated as f64 / elapsed
    );
    if args.json {
        let mut obj = json!({
            "n_ctx": n_ctx,
            "chunks": n_chunk,
            "scored": if base.is_some() { kld.count() } else { ppl.count },
            "running_ppl": running,
            "tok_s": evaluated as f64 / elapsed,
            "schedule": schedule.name(),
        });
        if base.is_some() {
            obj["kld"] = kl_json(&mut kld);
        } else {
            obj["ppl"] = json!(ppl.ppl());
            obj["ppl_uncertainty"] = json!(ppl.uncertainty());
        }
        writeln!(out, "{obj}")?;
    } else if base.is_some() {
        kl_summary(out, &mut kld)?;
    } else {
        writeln!(out)?;
        match ppl.uncertainty() {
            Some(u) => writeln!(out, "Final estimate: PPL = {:.4} +/- {u:.5}", ppl.ppl())?,
            None => writeln!(out, "Final estimate: PPL = {:.4}", ppl.ppl())?,
        }
    }
    Ok(())
}

/// One chunk's line of the KL divergence table (llama-perplexity's).
fn kl_chunk_line(out: &mut dyn Write, c: usize, k: &KlDivergence) -> std::io::Result<()> {
    if c == 0 {
        writeln!(
            out,
            "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
        )?;
    }
    let (lp, dlp) = k.log_ppl();
    let (r, dr) = k.log_ppl_ratio();
    let (d, dd) = k.kld();
    let (rms, drms) = k.p_diff_rms();
    let (top, dtop) = k.same_top();
    writeln!(
        out,
        "{:4}    {:9.4} ± {:9.4}    {r:10.5} ± {dr:10.5}    {d:10.5} ± {dd:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
        c + 1,
        lp.exp(),
        lp.exp() * dlp,
        100.0 * rms,
        100.0 * drms,
        100.0 * top,
        100.0 * dtop
    )?;
    out.flush()
}

/// The percentiles of the statistics' tails: (label, fraction).
const KL_PERCENTILES: [(&str, f32); 4] = [
    ("99.9%", 0.999),
    ("99.0%", 0.99),
    ("95.0%", 0.95),
    ("90.0%", 0.9),
];
const KL_LOW_PERCENTILES: [(&str, f32); 4] = [
    ("10.0%", 0.1),
    (" 5.0%", 0.05),
    (" 1.0%", 0.01),
    (" 0.1%", 0.001),
];

/// The median of sorted `v` (the mean of the middle two for an even count).
fn median(v: &[f32]) -> f32 {
    match v.len() {
        0 => 0.0,
        n if n % 2 == 0 => 0.5 * (v[n / 2] + v[n / 2 - 1]),
        n => v[n / 2],
    }
}

/// llama-perplexity's statistics after a comparison.
fn kl_summary(out: &mut dyn Write, k: &mut KlDivergence) -> std::io::Result<()> {
    k.klds.sort_by(f32::total_cmp);
    k.p_diffs.sort_by(f32::total_cmp);
    let (lp, dlp) = k.log_ppl();
    let (lb, dlb) = k.log_ppl_base();
    let (r, dr) = k.log_ppl_ratio();
    let cov = k.log_ppl_cov();
    let (ppl, dppl) = (lp.exp(), lp.exp() * dlp);
    let (base, dbase) = (lb.exp(), lb.exp() * dlb);
    writeln!(out, "\n====== Perplexity statistics ======")?;
    writeln!(
        out,
        "Mean PPL(Q)                   : {ppl:10.6} ± {dppl:10.6}"
    )?;
    writeln!(
        out,
        "Mean PPL(base)                : {base:10.6} ± {dbase:10.6}"
    )?;
    writeln!(
        out,
        "Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%",
        100.0 * cov / (dlp * dlb)
    )?;
    writeln!(out, "Mean ln(PPL(Q)/PPL(base))     : {r:10.6} ± {dr:10.6}")?;
    writeln!(
        out,
        "Mean PPL(Q)/PPL(base)         : {:10.6} ± {:10.6}",
        r.exp(),
        r.exp() * dr
    )?;
    let ddiff = (dppl * dppl + dbase * dbase - 2.0 * ppl * base * cov)
        .max(0.0)
        .sqrt();
    writeln!(
        out,
        "Mean PPL(Q)-PPL(base)         : {:10.6} ± {ddiff:10.6}",
        ppl - base
    )?;
    writeln!(out, "\n====== KL divergence statistics ======")?;
    let (d, dd) = k.kld();
    let v = &k.klds;
    writeln!(out, "Mean    KLD: {d:10.6} ± {dd:10.6}")?;
    writeln!(
        out,
        "Maximum KLD: {:10.6}",
        v.last().copied().unwrap_or(0.0)
    )?;
    for (label, f) in KL_PERCENTILES {
        writeln!(out, "{label:<7} KLD: {:10.6}", percentile(v, f))?;
    }
    writeln!(out, "Median  KLD: {:10.6}", median(v))?;
    for (label, f) in KL_LOW_PERCENTILES {
        writeln!(out, "{label:<7} KLD: {:10.6}", percentile(v, f))?;
    }
    writeln!(
        out,
        "Minimum KLD: {:10.6}",
        v.first().copied().unwrap_or(0.0)
    )?;
    writeln!(out, "\n====== Token probability statistics ======")?;
    let (m, dm) = k.p_diff();
    let v = &k.p_diffs;
    let pct = |x: f32| 100.0 * f64::from(x);
    writeln!(out, "Mean    Δp: {:6.3} ± {:5.3} %", 100.0 * m, 100.0 * dm)?;
    writeln!(
        out,
        "Maximum Δp: {:6.3}%",
        pct(v.last().copied().unwrap_or(0.0))
    )?;
    for (label, f) in KL_PERCENTILES {
        writeln!(out, "{label:<7} Δp: {:6.3}%", pct(percentile(v, f)))?;
    }
    writeln!(out, "75.0%   Δp: {:6.3}%", pct(percentile(v, 0.75)))?;
    writeln!(out, "Median  Δp: {:6.3}%", pct(median(v)))?;
    writeln!(out, "25.0%   Δp: {:6.3}%", pct(percentile(v, 0.25)))?;
    for (label, f) in KL_LOW_PERCENTILES {
        writeln!(out, "{label:<7} Δp: {:6.3}%", pct(percentile(v, f)))?;
    }
    writeln!(
        out,
        "Minimum Δp: {:6.3}%",
        pct(v.first().copied().unwrap_or(0.0))
    )?;
    let (rms, drms) = k.p_diff_rms();
    let (top, dtop) = k.same_top();
    writeln!(
        out,
        "RMS Δp    : {:6.3} ± {:5.3} %",
        100.0 * rms,
        100.0 * drms
    )?;
    writeln!(
        out,
        "Same top p: {:6.3} ± {:5.3} %",
        100.0 * top,
        100.0 * dtop
    )?;
    Ok(())
}

fn kl_json(k: &mut KlDivergence) -> serde_json::Value {
    k.klds.sort_by(f32::total_cmp);
    let (lp, _) = k.log_ppl();
    let (lb, _) = k.log_ppl_base();
    let (r, dr) = k.log_ppl_ratio();
    let (d, dd) = k.kld();
    let (rms, _) = k.p_diff_rms();
    let (top, _) = k.same_top();
    json!({
        "ppl": lp.exp(),
        "ppl_base": lb.exp(),
        "ln_ppl_ratio": r,
        "ln_ppl_ratio_uncertainty": dr,
        "mean": d,
        "uncertainty": dd,
        "max": k.klds.last(),
        "median": median(&k.klds),
        "p99": percentile(&k.klds, 0.99),
        "rms_p_diff": rms,
        "max_p_diff": k.max_p_diff(),
        "same_top": top,
    })
}
