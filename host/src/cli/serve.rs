//! `les serve`: llama-server's OpenAI-style endpoints over one model
//! ([`crate::serve`]).

use std::error::Error;
use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use les_core::gemv::Isa;

use super::run::{CacheArgs, ExpertArgs};
use crate::compute::{default_threads, ThreadedMatVec};
use crate::engine::Session;
use crate::model::Model;
use crate::serve::batch::run_batch;
use crate::serve::{http::Limits, serve, Engine, ServeOptions};
use crate::supply::Supply;
use crate::tokenizer::Tokenizer;

/// Arguments of `les serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The model and how it runs.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key (`Authorization: Bearer KEY`) of every request but
    /// `/health` (llama-server's --api-key); also read from `LES_API_KEY`.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Answer `GET /metrics` in Prometheus' format (llama-server's
    /// `--metrics`: tokens and seconds of prompts and generation, the
    /// completions answered and waiting).
    #[arg(long)]
    pub metrics: bool,
    /// Connections served at once; more are answered 503.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    pub max_connections: u16,
}

/// Arguments of `les batch`.
#[derive(Debug, Args)]
pub struct BatchArgs {
    /// The model and how it runs (--parallel N: requests side by side).
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The requests: OpenAI's Batch API input, a JSON request a line
    /// (`custom_id`, `method` POST, `url` /v1/chat/completions,
    /// /v1/completions or /v1/responses, `body`); `-`: standard input.
    #[arg(short = 'i', long, value_name = "JSONL")]
    pub input_file: PathBuf,
    /// Where the results go, a line a request in the requests' order
    /// (default: standard output).
    #[arg(short = 'o', long, value_name = "JSONL")]
    pub output_file: Option<PathBuf>,
}

/// Runs `les batch`: every request of the input answered, its result
/// written as soon as those before it are.
pub fn batch(args: &BatchArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let path = &args.input_file;
    let mut input: Box<dyn std::io::BufRead + Send> = if path.as_os_str() == "-" {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        let f = std::fs::File::open(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Box::new(std::io::BufReader::new(f))
    };
    if let Some(o) = &args.output_file {
        if same_file(path, o) {
            return Err(format!("the output {} is the input", o.display()).into());
        }
    }
    with_engine(&args.engine, |engine, model_id| {
        let opts = ServeOptions {
            model_id,
            metrics: false,
            limits: Limits::default(),
            max_connections: 1,
            api_key: None,
        };
        let summary = match &args.output_file {
            Some(o) => {
                let f = std::fs::File::create(o)
                    .map_err(|e| format!("cannot write {}: {e}", o.display()))?;
                let mut w = std::io::BufWriter::new(f);
                run_batch(engine, &mut *input, &mut w, &opts)?
            }
            None => run_batch(engine, &mut *input, out, &opts)?,
        };
        if summary.succeeded < summary.requests {
            note!(
                "les batch: {} of {} requests failed (their result lines say why)",
                summary.requests - summary.succeeded,
                summary.requests
            );
        }
        Ok(())
    })
}

/// Whether `a` and `b` name one existing file.
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// The model and the engine that answers completions, for `les serve` and
/// `les batch`.
#[derive(Debug, Args)]
pub struct EngineArgs {
    /// The model (GGUF).
    #[arg(short, long)]
    pub model: PathBuf,
    /// Vision projector (mmproj GGUF): chat messages may then carry images
    /// (`image_url` parts with base64 `data:` URLs).
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// Tokens an image may take.
    #[command(flatten)]
    pub image_tokens: super::run::ImageTokenArgs,
    /// The model's name in answers and `/v1/models` (default: its file name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Context size in positions, shared by a request's prompt and reply
    /// (default: the model's training context, at most 4096).
    #[arg(long, value_parser = super::values::tokens)]
    pub ctx: Option<usize>,
    /// Compute threads (default: physical cores).
    #[arg(short, long, value_parser = super::values::threads)]
    pub threads: Option<usize>,
    /// Where the experts live.
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// KV cache types.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Prompt positions evaluated at once (see `les run -b`).
    #[arg(short = 'b', long, default_value_t = crate::engine::DEFAULT_PREFILL_BATCH,
          value_parser = super::values::batch)]
    pub batch_size: usize,
    /// Lookahead prediction (les schedule).
    #[command(flatten)]
    pub lookahead: crate::bench::LookaheadArgs,
    /// Speculative decoding (the answers stay the same).
    #[command(flatten)]
    pub spec: crate::draft::SpecArgs,
    /// Chat template overrides (a request's `chat_template_kwargs` go over
    /// --chat-template-kwargs).
    #[command(flatten)]
    pub template: super::run::TemplateArgs,
    /// `auto`: the reasoning of models that mark it (`<think>` tags,
    /// gpt-oss's analysis channel) goes to `reasoning_content`, apart from
    /// the answer, unless a request says `reasoning_format: none`; `none`:
    /// it stays in the answer as generated.
    #[arg(long, default_value = "auto", value_parser = ["auto", "none"])]
    pub reasoning_format: String,
    /// Slots: sessions of --ctx positions each, with their own KV cache
    /// (llama-server's --parallel). Completions run side by side, one pass
    /// of the model for all their next tokens (each layer's experts read
    /// once for all), prompts in chunks beside them, each verifying its own
    /// drafts (--speculate ngram, model or mtp: a draft model session, an
    /// MTP cache a slot). A
    /// request goes to the free slot whose
    /// cache it keeps best (the most of its prompt held, less what would be
    /// dropped), so chats that take turns keep their caches.
    #[arg(long, visible_alias = "np", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub parallel: u16,
}

/// Runs `les serve` until the process is stopped.
pub fn run(args: &ServeArgs, _out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    with_engine(&args.engine, |engine, model_id| {
        let listener = TcpListener::bind((args.host.as_str(), args.port))
            .map_err(|e| format!("cannot listen on {}:{}: {e}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        note!(
            "les: listening on http://{addr} (POST /v1/chat/completions, /v1/completions, \
             /completion, /infill; GET /v1/models, /health, /slots)"
        );
        serve(
            listener,
            engine,
            &ServeOptions {
                model_id,
                metrics: args.metrics,
                limits: Limits::default(),
                max_connections: usize::from(args.max_connections),
                api_key: args
                    .api_key
                    .clone()
                    .or_else(|| std::env::var("LES_API_KEY").ok())
                    .filter(|k| !k.is_empty()),
            },
        );
        Ok(())
    })
}

/// Opens the model `args` names and runs `f` on an engine over it, with the
/// model's name in answers.
pub(super) fn with_engine(
    args: &EngineArgs,
    f: impl FnOnce(&mut Engine<'_>, String) -> Result<(), Box<dyn Error>>,
) -> Result<(), Box<dyn Error>> {
    let t0 = Instant::now();
    args.experts.check()?;
    let model = Model::open(&args.model)?;
    let mut tokenizer = Tokenizer::from_gguf(model.gguf())?;
    args.template.apply(&mut tokenizer)?;
    let tokenizer = tokenizer;
    let draft_model = args.spec.open_draft_model(&tokenizer)?;
    let clip = args
        .mmproj
        .as_deref()
        .map(|path| super::run::open_projector(path, &model, args.image_tokens))
        .transpose()?;
    let train = model.n_ctx_train.max(1);
    let ctx = args.ctx.unwrap_or(train.min(4096)).max(2);
    if ctx > train {
        note!(
            "les: warning: the context of {ctx} positions (--ctx) is longer than the {train} \
             the model was trained on; generation past them may degrade"
        );
    }
    let (schedule, budget) = args.experts.resolve(&model)?;
    let threads = args.threads.unwrap_or_else(default_threads).max(1);
    let mv = ThreadedMatVec::new(threads, Isa::detect());
    let supply = Supply::new(&model, &args.model, schedule, budget.clone())?;
    model.populate_resident();
    let lookahead = crate::bench::lookahead(&model, &args.lookahead);
    let drafter = args
        .spec
        .drafter(&model, &args.model, draft_model.as_ref(), ctx, threads)?;
    let mut sessions = Vec::with_capacity(usize::from(args.parallel));
    let mut max_draft = 0;
    for _ in 0..args.parallel {
        let mut session = Session::with_kv(&model, ctx, args.cache.types(), args.cache.swa())?;
        session.set_prefill_batch(args.batch_size)?;
        if drafter.is_some() {
            max_draft = session.set_max_draft(args.spec.draft_max() as usize)?;
        }
        sessions.push(session);
    }
    let kv_bytes: usize = sessions.iter().map(Session::kv_bytes).sum();
    let mut sessions = sessions.into_iter();
    let session = sessions.next().expect("--parallel is at least 1");
    let model_id = args.alias.clone().unwrap_or_else(|| {
        args.model
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
    });
    note!(
        "les: {} ({} layers, {} experts), schedule {schedule}, {threads} threads, KV cache {ctx} \
         positions x {} slot(s) ({:.1} MiB), loaded in {:.2?}",
        model.arch.name(),
        model.hp.n_layers,
        model.hp.moe.map_or(0, |m| m.n_experts),
        args.parallel,
        kv_bytes as f64 / (1 << 20) as f64,
        t0.elapsed()
    );
    let mut engine = Engine::new(
        &model,
        &tokenizer,
        clip.as_ref(),
        session,
        mv,
        supply,
        lookahead,
    )
    .with_slots(sessions);
    if args.reasoning_format == "none" {
        engine = engine.without_reasoning();
    }
    if let Some(drafter) = drafter {
        engine = engine.with_drafter(drafter, max_draft, !args.spec.draft_fixed);
    }
    f(&mut engine, model_id)
}
