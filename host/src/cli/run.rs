//! `les run`: generate text from a prompt.

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use les_core::gemv::Isa;
use les_core::model::forward::{Lookahead, TokenInput};
use serde_json::json;

use super::values;
use crate::compute::{default_threads, ThreadedMatVec};
use crate::draft::{Drafter, Speculation};
use crate::engine::{generate_from, Control, Session};
use crate::flash::{FileDeviceConfig, IoEngine};
use crate::grammar::{json_schema_to_gbnf, Grammar, GrammarError, TokenGrammar};
use crate::model::Model;
use crate::reply::Reply;
use crate::sampling::{Dry, DrySettings, Penalties, Sampler, SamplerConfig, DEFAULT_BREAKERS};
use crate::supply::{parse_size, Schedule, SlotBudget, Supply};
use crate::tokenizer::{Conversation, Tokenizer};
use crate::vision::{self, ClipModel, EncodedImage, MultimodalPrompt, MEDIA_MARKER};
use les_core::slot_classes::{plan_by_bytes, plan_by_count};

/// Arguments of `les run`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("prompt_source").args(["prompt", "file"])))]
#[command(group(clap::ArgGroup::new("chat_mode").multiple(true).args(["chat", "conversation"])))]
pub struct RunArgs {
    /// The model (GGUF).
    #[arg(short, long)]
    pub model: PathBuf,
    /// The prompt, used raw (completion mode) unless `--chat`. Escapes are
    /// read as llama.cpp does (`\n`, `\t`, `\\`, `\xHH`...) unless
    /// --no-escape.
    #[arg(short, long, required_unless_present_any = ["file", "conversation"])]
    pub prompt: Option<String>,
    /// Read the prompt from this file instead (UTF-8; one trailing newline is
    /// dropped, as llama.cpp's `-f` does).
    #[arg(short = 'f', long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_predict: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8, value_parser = super::values::non_negative)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 0.95, value_parser = super::values::non_negative)]
    pub top_p: f32,
    /// Keep the tokens at least this times as likely as the most likely one
    /// (0 = off).
    #[arg(long, default_value_t = 0.05, value_parser = super::values::probability)]
    pub min_p: f32,
    /// Locally typical sampling: keep the tokens whose surprise is nearest
    /// the distribution's entropy, up to this probability mass (1 = off;
    /// llama.cpp's --typical).
    #[arg(long = "typical", value_name = "P", default_value_t = 1.0, value_parser = super::values::probability)]
    pub typical_p: f32,
    /// Keep the tokens whose logit is within N standard deviations of the
    /// highest (0 or less = off; llama.cpp's --top-nsigma).
    #[arg(long = "top-nsigma", value_name = "N", default_value_t = -1.0, allow_negative_numbers = true, value_parser = super::values::finite)]
    pub top_n_sigma: f32,
    /// XTC: the chance, each token, of dropping the most likely tokens above
    /// --xtc-threshold but the least likely of them (0 = off; llama.cpp's).
    #[arg(long, value_name = "P", default_value_t = 0.0, value_parser = super::values::probability)]
    pub xtc_probability: f32,
    /// XTC's threshold of probability (above 0.5, XTC is off).
    #[arg(long, value_name = "P", default_value_t = 0.1, value_parser = super::values::probability)]
    pub xtc_threshold: f32,
    /// Mirostat instead of the sampler chain (llama.cpp's --mirostat): 0
    /// off, 1 or 2. The logit biases and the temperature still apply; the
    /// penalties, DRY and the filters do not, as in llama.cpp.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub mirostat: u8,
    /// Mirostat's learning rate, eta (llama.cpp's --mirostat-lr).
    #[arg(long = "mirostat-lr", value_name = "ETA", default_value_t = 0.1, value_parser = super::values::non_negative)]
    pub mirostat_eta: f32,
    /// Mirostat's target entropy, tau (llama.cpp's --mirostat-ent).
    #[arg(long = "mirostat-ent", value_name = "TAU", default_value_t = 5.0, value_parser = super::values::non_negative)]
    pub mirostat_tau: f32,
    /// Divide the positive logits (multiply the negative ones) of the tokens
    /// among the last --repeat-last-n, the prompt's included, by this (1 = off).
    #[arg(long, default_value_t = 1.0, value_parser = super::values::positive)]
    pub repeat_penalty: f32,
    /// Subtract this from the logits of the tokens among the last
    /// --repeat-last-n, once per time each is there (0 = off; llama.cpp's).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = super::values::finite)]
    pub frequency_penalty: f32,
    /// Subtract this once from the logits of the tokens among the last
    /// --repeat-last-n (0 = off; llama.cpp's; Qwen's models suggest up to
    /// 1.5 against endless repetition).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = super::values::finite)]
    pub presence_penalty: f32,
    /// How many of the last tokens the penalties look at (0 = off).
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// DRY: lower the logits of tokens that would extend a repetition of
    /// the recent text, by this times --dry-base to the power of the
    /// repeat's length past --dry-allowed-length (0 = off; llama.cpp's).
    #[arg(long, value_name = "M", default_value_t = 0.0, value_parser = super::values::non_negative)]
    pub dry_multiplier: f32,
    /// DRY's base (below 1: off).
    #[arg(long, value_name = "B", default_value_t = 1.75, value_parser = super::values::finite)]
    pub dry_base: f32,
    /// Repeats up to this many tokens long go unpenalized by DRY.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub dry_allowed_length: usize,
    /// Tokens DRY looks back over (-1: the model's context; 0: off).
    #[arg(long, value_name = "N", default_value_t = -1, allow_negative_numbers = true, value_parser = super::values::last_n)]
    pub dry_penalty_last_n: i64,
    /// A text that stops a repetition for DRY (repeatable; the first one
    /// given replaces the defaults "\n", ":", "\"" and "*"; "none" for
    /// none; escapes read unless --no-escape).
    #[arg(long = "dry-sequence-breaker", value_name = "TEXT")]
    pub dry_sequence_breakers: Vec<String>,
    /// Never sample an end-of-generation token: generate until -n or the
    /// context is full.
    #[arg(long)]
    pub ignore_eos: bool,
    /// End the reply (or the conversation's turn) where its text contains
    /// TEXT, which is not printed (repeatable; escapes read as in -p).
    #[arg(short = 'r', long, visible_alias = "reverse-prompt", value_name = "TEXT", value_parser = super::values::stop_string)]
    pub stop: Vec<String>,
    /// Read -p, --stop and the conversation's lines as they are: no escapes.
    #[arg(long)]
    pub no_escape: bool,
    /// Add BIAS to a token's logit before sampling, as llama.cpp's
    /// (repeatable): `15043+1` favours token 15043, `15043-inf` bans it.
    #[arg(short = 'l', long, value_name = "TOKEN_ID(+/-)BIAS", value_parser = super::values::logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Generate only text a GBNF grammar derives (llama.cpp's `--grammar`:
    /// rules `name ::= ...` from `root`; see grammars/ for examples). The
    /// reply ends where the grammar is complete and the model ends it.
    #[arg(long, value_name = "GBNF", conflicts_with = "grammar_file")]
    pub grammar: Option<String>,
    /// --grammar, read from a file.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json_schema", "json_schema_file"])]
    pub grammar_file: Option<PathBuf>,
    /// Generate only JSON that a JSON Schema allows (llama.cpp's `-j`):
    /// the schema becomes a grammar (`type`, `properties`, `required`,
    /// `items`, `enum`, `const`, `anyOf`, `$ref`, string `pattern`s...; other
    /// constraints are an error).
    #[arg(short = 'j', long, value_name = "SCHEMA", conflicts_with_all = ["grammar", "json_schema_file"])]
    pub json_schema: Option<String>,
    /// --json-schema, read from a file.
    #[arg(
        long,
        visible_alias = "jf",
        value_name = "FILE",
        conflicts_with = "grammar"
    )]
    pub json_schema_file: Option<PathBuf>,
    /// Random seed (default: from the clock, printed in the stats).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Compute threads (default: physical cores).
    #[arg(short, long, value_parser = super::values::threads)]
    pub threads: Option<usize>,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A system message before the prompt (with --chat). Where the template
    /// has no system role it goes before the user's message, on a line of its
    /// own, as llama.cpp does.
    #[arg(
        long,
        visible_alias = "system",
        value_name = "TEXT",
        requires = "chat_mode"
    )]
    pub system_prompt: Option<String>,
    /// Chat template overrides (with --chat or --conversation).
    #[command(flatten)]
    pub template: TemplateArgs,
    /// A conversation in the chat template (llama-cli's `-cnv`): the prompt,
    /// if any, is the first user message, then each line read from stdin is
    /// the next one, answered after the replies so far (kept in the KV cache:
    /// only each new turn is evaluated), until end of input. A line ending in
    /// `\` goes on on the next line; `/image PATH` adds an image to the next
    /// message (with --mmproj), `/clear` starts over, `/quit` ends. The
    /// context is --ctx, or the training context up to 4096 positions.
    #[arg(long, visible_alias = "cnv", conflicts_with_all = ["json", "logits_out"])]
    pub conversation: bool,
    /// Print one JSON object with tokens, text and stats instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Write the logits of every sampled position as float32 .npy (n, vocab); n
    /// counts the generated tokens plus a final end-of-generation token if any.
    #[arg(long)]
    pub logits_out: Option<PathBuf>,
    /// Where the experts live.
    #[command(flatten)]
    pub experts: ExpertArgs,
    /// Context size in positions (default: prompt + n, at most the model's
    /// training context); generation stops when it is full.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// KV cache types.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Prompt positions evaluated at once, layer by layer (each layer's experts
    /// read and used once for all of them); 1 = one at a time, with lookahead
    /// prefetching. The output is the same whatever the size.
    #[arg(short = 'b', long, default_value_t = crate::engine::DEFAULT_PREFILL_BATCH,
          value_parser = super::values::batch)]
    pub batch_size: usize,
    /// Lookahead prediction (les schedule).
    #[command(flatten)]
    pub lookahead: crate::bench::LookaheadArgs,
    /// Speculative decoding.
    #[command(flatten)]
    pub spec: crate::draft::SpecArgs,
    /// Vision projector (mmproj GGUF, `general.architecture = clip`) for --image.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// An image (PNG, JPEG, GIF, BMP, PPM) for the prompt; repeat for several. Each replaces
    /// one `<__media__>` marker in the prompt, in order; without markers the
    /// images go before the prompt text.
    #[arg(long = "image", requires = "mmproj")]
    pub images: Vec<PathBuf>,
    /// Tokens an image may take.
    #[command(flatten)]
    pub image_tokens: ImageTokenArgs,
    /// Keep the prompt's evaluated state in FILE (llama-cli's
    /// --prompt-cache): a later run whose prompt starts with the same tokens
    /// restores them instead of evaluating them (exactly: the same logits),
    /// and the file is rewritten after a prompt it did not hold whole. Text
    /// prompts only; not with --speculate mtp.
    #[arg(long, value_name = "FILE", conflicts_with = "images")]
    pub prompt_cache: Option<PathBuf>,
    /// Only read --prompt-cache, never rewrite it.
    #[arg(long, requires = "prompt_cache")]
    pub prompt_cache_ro: bool,
}

/// A little-endian float32 `.npy` of rows of `cols` floats, written as the rows
/// come (memory stays one row, however long the generation). The header is
/// sized for any row count and rewritten in place after every row, so the file
/// is a valid array of the rows so far even if the run is interrupted.
pub struct NpyWriter {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
    cols: usize,
    rows: usize,
}

/// `e`, its message prefixed with `path`.
fn with_path(path: &std::path::Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Bytes of the `.npy` preamble and header (a multiple of 64, room for any
/// `u64` row count).
const NPY_HEADER: usize = 128;

impl NpyWriter {
    /// Creates `path` (errors name it).
    pub fn create(path: &std::path::Path, cols: usize) -> std::io::Result<NpyWriter> {
        let named = |e| with_path(path, e);
        // The header is rewritten with the row count, which needs a file to
        // seek in (and opening a pipe to write would wait for a reader).
        if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
            return Err(named(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file (the .npy header is rewritten as rows come)",
            )));
        }
        let file = std::fs::File::create(path).map_err(named)?;
        let mut w = NpyWriter {
            file: std::io::BufWriter::new(file),
            path: path.to_owned(),
            cols,
            rows: 0,
        };
        let header = w.header();
        w.file.write_all(&header).map_err(named)?;
        Ok(w)
    }

    fn named(&self, e: std::io::Error) -> std::io::Error {
        with_path(&self.path, e)
    }

    /// The preamble and header for the rows so far, [`NPY_HEADER`] bytes.
    fn header(&self) -> Vec<u8> {
        let mut header = format!(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {}), }}",
            self.rows, self.cols
        );
        // Magic (6) + version (2) + length (2) + header + '\n'.
        while 10 + header.len() + 1 < NPY_HEADER {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out
    }

    /// Appends one row (`cols` floats), then counts it in the header: the
    /// header never counts a row not yet on the file.
    pub fn push(&mut self, row: &[f32]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        debug_assert_eq!(row.len(), self.cols);
        let r = (|| {
            for v in row {
                self.file.write_all(&v.to_le_bytes())?;
            }
            self.file.flush()?;
            self.rows += 1;
            self.file.get_ref().write_all_at(&self.header(), 0)
        })();
        r.map_err(|e| self.named(e))
    }

    /// Flushes; the header already holds the row count.
    pub fn finish(mut self) -> std::io::Result<()> {
        self.file.flush().map_err(|e| self.named(e))
    }
}

/// Chat template overrides (`les run`, `les serve`), as llama.cpp's.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TemplateArgs {
    /// A Jinja chat template to use instead of the model's (llama.cpp's
    /// `--chat-template-file`): for a file without one, or with a broken one.
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// Variables for the chat template, a JSON object (llama.cpp's
    /// `--chat-template-kwargs`), e.g. '{"enable_thinking": false}' for
    /// Qwen3's templates.
    #[arg(long, value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
}

impl TemplateArgs {
    /// Whether any override is given.
    pub fn any(&self) -> bool {
        self.chat_template_file.is_some() || self.chat_template_kwargs.is_some()
    }

    /// Sets the overrides on `tokenizer`: every chat prompt it renders then
    /// follows them.
    pub fn apply(&self, tokenizer: &mut Tokenizer) -> Result<(), Box<dyn Error>> {
        if let Some(path) = &self.chat_template_file {
            let len = std::fs::metadata(path)
                .map_err(|e| format!("--chat-template-file {}: {e}", path.display()))?
                .len();
            if len > crate::tokenizer::MAX_TEMPLATE_LEN as u64 {
                return Err(format!(
                    "--chat-template-file {}: {len} bytes, more than the {} a template may have",
                    path.display(),
                    crate::tokenizer::MAX_TEMPLATE_LEN
                )
                .into());
            }
            let source = std::fs::read_to_string(path)
                .map_err(|e| format!("--chat-template-file {}: {e}", path.display()))?;
            tokenizer
                .set_chat_template(&source)
                .map_err(|e| format!("--chat-template-file {}: {e}", path.display()))?;
        }
        if let Some(text) = &self.chat_template_kwargs {
            match serde_json::from_str(text) {
                Ok(serde_json::Value::Object(m)) => tokenizer.set_chat_template_kwargs(m),
                Ok(_) => return Err("--chat-template-kwargs must be a JSON object".into()),
                Err(e) => return Err(format!("--chat-template-kwargs is not JSON: {e}").into()),
            }
        }
        Ok(())
    }
}

/// The KV cache's element types (`les run`, `les bench`), as llama.cpp's
/// `--cache-type-k` / `--cache-type-v`.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct CacheArgs {
    /// KV cache type of the keys: f16 (llama.cpp's default: half the memory
    /// and half the bytes attention reads a token) or f32.
    #[arg(long = "cache-type-k", value_name = "TYPE", default_value = "f16", value_parser = super::values::kv_type)]
    pub k: les_core::model::forward::KvType,
    /// KV cache type of the values: f16 or f32.
    #[arg(long = "cache-type-v", value_name = "TYPE", default_value = "f16", value_parser = super::values::kv_type)]
    pub v: les_core::model::forward::KvType,
    /// Keep every position of the sliding-window layers (gpt-oss's even
    /// layers) and chunked ones (Llama 4's), as llama.cpp's --swa-full:
    /// without it they keep only their window or chunk plus a batch, half
    /// to three quarters of the KV memory at long contexts, and a
    /// --prompt-cache restores only a prompt that starts with all its tokens.
    #[arg(long = "swa-full")]
    pub swa_full: bool,
}

impl CacheArgs {
    /// How the session keeps the sliding-window layers' keys and values.
    pub fn swa(&self) -> crate::engine::SwaCache {
        if self.swa_full {
            crate::engine::SwaCache::Full
        } else {
            crate::engine::SwaCache::Window
        }
    }

    /// The session's KV types.
    pub fn types(&self) -> crate::engine::KvTypes {
        crate::engine::KvTypes {
            k: self.k,
            v: self.v,
        }
    }
}

/// Where the experts of `les run` and `les perplexity` live: the schedule and
/// its slot budget.
#[derive(Debug, Clone, clap::Args)]
pub struct ExpertArgs {
    /// Expert schedule: resident, on-demand or les.
    #[arg(long)]
    pub schedule: Option<Schedule>,
    /// RAM for expert slots: a size (e.g. 2GiB) or a share of the model's
    /// expert bytes (e.g. 25%); experts stream from the file. Experts of
    /// different sizes get slots of their size, each size the same share.
    #[arg(long)]
    pub expert_mem: Option<String>,
    /// Number of expert slots (instead of --expert-mem), split across expert
    /// sizes by their expert counts.
    #[arg(long, conflicts_with = "expert_mem")]
    pub slots: Option<usize>,
    /// The file device's I/O settings.
    #[command(flatten)]
    pub io: IoArgs,
}

impl ExpertArgs {
    /// Refuses a budget with `--schedule resident` (before the model loads).
    pub fn check(&self) -> Result<(), Box<dyn Error>> {
        if self.schedule == Some(Schedule::Resident)
            && (self.expert_mem.is_some() || self.slots.is_some())
        {
            return Err(
                "--expert-mem and --slots size the slots of on-demand and les; \
                        --schedule resident keeps every expert in RAM"
                    .into(),
            );
        }
        Ok(())
    }

    /// The schedule and slot budget for `model` ([`resolve_budget`]).
    pub fn resolve(&self, model: &Model) -> Result<(Schedule, SlotBudget), Box<dyn Error>> {
        resolve_budget(
            model,
            self.schedule,
            self.expert_mem.as_deref(),
            self.slots,
            &self.io,
        )
    }
}

/// I/O settings of `les run` and `les bench` (the file device).
#[derive(Debug, Clone, clap::Args)]
pub struct IoArgs {
    /// How expert reads are issued: `uring` (io_uring from the compute thread, no
    /// I/O threads; needs O_DIRECT), `threads` (a pool of blocking readers), or
    /// `auto`: uring where the kernel and file allow it and every expert is one
    /// read of at most --io-chunk (its reads then start without waking a
    /// thread), else threads (which start each next chunk of a larger expert
    /// the moment one finishes)
    #[arg(long, default_value = "auto", value_parser = ["auto", "uring", "threads"])]
    pub io_engine: String,
    /// I/O threads of the file device (with `--io-engine uring`: reads in flight).
    #[arg(long, default_value_t = 4, value_parser = super::values::threads)]
    pub io_threads: usize,
    /// Split aligned reads (packed experts) into chunks of this size, read in
    /// parallel (e.g. 512KiB; 0 = one read per extent).
    #[arg(long, default_value = "512KiB")]
    pub io_chunk: String,
}

impl IoArgs {
    /// The file device settings these arguments ask for.
    pub fn config(&self) -> Result<FileDeviceConfig, Box<dyn Error>> {
        let chunk = parse_size(&self.io_chunk)?;
        if chunk != 0 && chunk < 4096 {
            return Err(format!("--io-chunk {}: at least 4KiB (or 0)", self.io_chunk).into());
        }
        let engine = match self.io_engine.as_str() {
            "uring" => IoEngine::Uring,
            "threads" => IoEngine::Threads,
            _ => IoEngine::Auto,
        };
        Ok(FileDeviceConfig {
            engine,
            threads: self.io_threads.max(1),
            chunk_bytes: chunk.min(1 << 30) as usize,
            ..FileDeviceConfig::default()
        })
    }
}

/// The slots a budget buys (sized per expert size, see
/// `les_core::slot_classes`), and the schedule it implies.
pub fn resolve_budget(
    model: &Model,
    schedule: Option<Schedule>,
    expert_mem: Option<&str>,
    slots: Option<usize>,
    io: &IoArgs,
) -> Result<(Schedule, SlotBudget), Box<dyn Error>> {
    let budgeted = expert_mem.is_some() || slots.is_some();
    let schedule = match (schedule, budgeted) {
        (Some(s), _) => s,
        (None, true) => Schedule::Les,
        (None, false) => Schedule::Resident,
    };
    let io = io.config()?;
    if schedule == Schedule::Resident {
        return Ok((schedule, SlotBudget::none(io)));
    }
    let top_k = model.hp.moe.map_or(1, |m| m.top_k) as u32;
    let groups = model.expert_size_groups();
    if groups.is_empty() {
        return Err("the model has no experts to stream; use --schedule resident".into());
    }
    let classes = match (expert_mem, slots) {
        (Some(m), _) => {
            let mem = values::expert_mem(m).map_err(|e| format!("--expert-mem {m:?}: {e}"))?;
            plan_by_bytes(groups, mem.bytes(model.expert_slot_bytes()), top_k)
        }
        (None, Some(n)) => plan_by_count(groups, n.min(u32::MAX as usize) as u32, top_k),
        (None, None) => {
            return Err("--schedule on-demand and les need --expert-mem or --slots".into())
        }
    }
    .map_err(|e| format!("{e} (--expert-mem / --slots)"))?;
    let largest = classes.iter().map(|c| c.bytes as usize).max().unwrap_or(0);
    Ok((
        schedule,
        SlotBudget {
            classes: classes.to_vec(),
            io: io.for_reads(largest),
        },
    ))
}

/// Largest prompt file `-f` reads: far more text than any context holds.
pub const MAX_PROMPT_FILE: u64 = 64 << 20;

/// `sampler`'s pick; where it broke the grammar (no token allowed), the
/// reason goes to `stuck` for the token callback to stop on.
fn sample_in_grammar(
    sampler: &mut Sampler,
    logits: &[f32],
    stuck: &std::cell::RefCell<Option<GrammarError>>,
) -> u32 {
    let token = sampler.sample(logits);
    if let Some(e) = sampler.grammar_error() {
        *stuck.borrow_mut() = Some(e);
    }
    token
}

/// Largest grammar or schema `--grammar-file` and `--json-schema-file` read.
pub const MAX_GRAMMAR_FILE: u64 = 1 << 20;

/// The grammar of `--grammar`, `--grammar-file`, `--json-schema` or
/// `--json-schema-file` over `tokenizer`'s vocabulary, if one is given;
/// errors name the flag or file.
fn read_grammar(
    args: &RunArgs,
    tokenizer: &Tokenizer,
) -> Result<Option<TokenGrammar>, Box<dyn Error>> {
    let read = |path: &std::path::Path, what: &str| read_text_file(path, MAX_GRAMMAR_FILE, what);
    let schema =
        |text: &str, source: &str| json_schema_to_gbnf(text).map_err(|e| format!("{source}: {e}"));
    let (text, source) = match (
        &args.grammar,
        &args.grammar_file,
        &args.json_schema,
        &args.json_schema_file,
    ) {
        (Some(text), ..) => (text.clone(), "--grammar".to_string()),
        (None, Some(path), ..) => (read(path, "grammar")?, path.display().to_string()),
        (None, None, Some(text), _) => (schema(text, "--json-schema")?, "--json-schema".into()),
        (None, None, None, Some(path)) => {
            let source = path.display().to_string();
            (schema(&read(path, "schema")?, &source)?, source)
        }
        (None, None, None, None) => return Ok(None),
    };
    let grammar = Grammar::parse(&text).map_err(|e| format!("{source}: {e}"))?;
    Ok(Some(
        TokenGrammar::new(grammar, tokenizer).map_err(|e| format!("{source}: {e}"))?,
    ))
}

/// The text in `path`, at most `max` bytes: errors name the file, and a
/// larger file or one that is not UTF-8 is refused (`what` names the text).
fn read_text_file(path: &std::path::Path, max: u64, what: &str) -> Result<String, Box<dyn Error>> {
    use std::io::Read;
    let named = |e: std::io::Error| with_path(path, e);
    let file = std::fs::File::open(path).map_err(named)?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(named)?;
    if bytes.len() as u64 > max {
        return Err(format!(
            "{}: {what} file larger than {} MiB",
            path.display(),
            max >> 20
        )
        .into());
    }
    Ok(String::from_utf8(bytes)
        .map_err(|e| format!("{}: {what} is not UTF-8 ({e})", path.display()))?)
}

/// The prompt in `path` (`-f`), without one trailing newline (`\n` or
/// `\r\n`); errors name the file, and a file over [`MAX_PROMPT_FILE`] or not
/// UTF-8 is refused.
pub fn read_prompt_file(path: &std::path::Path) -> Result<String, Box<dyn Error>> {
    let mut text = read_text_file(path, MAX_PROMPT_FILE, "prompt")?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

/// The context for a prompt of `prompt_len` positions: `--ctx`, else the
/// prompt plus `-n`, at most the model's training context `n_ctx_train`; an
/// error if the prompt does not fit. Generation stops when it is full.
fn context_size(prompt_len: usize, args: &RunArgs, n_ctx_train: usize) -> Result<usize, String> {
    let needed = prompt_len.saturating_add(args.n_predict);
    let train = n_ctx_train.max(1);
    // A conversation needs room for the turns to come, not just this one.
    let default = if args.conversation {
        needed.max(train.min(4096)).min(train)
    } else {
        needed.min(train)
    };
    let ctx = args.ctx.unwrap_or(default);
    if prompt_len > ctx {
        return Err(format!(
            "the prompt ({prompt_len} tokens) does not fit the context of {ctx} positions{}",
            if args.ctx.is_some() {
                " (--ctx)"
            } else {
                " the model was trained for (raise it with --ctx)"
            }
        ));
    }
    Ok(ctx)
}

/// llama.cpp's bounds on the tokens of one image, for projectors that size
/// images dynamically (Qwen3-VL, GLM-4.xV, Kimi-VL, LFM2-VL); the others
/// take images at fixed sizes.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct ImageTokenArgs {
    /// Fewest tokens one image may take, where the projector sizes images
    /// (Qwen3-VL: 8 by default, LFM2-VL: 64; llama.cpp suggests 1024 for
    /// Qwen-VL's grounding).
    #[arg(long, value_name = "N", requires = "mmproj")]
    pub image_min_tokens: Option<usize>,
    /// Most tokens one image may take, where the projector sizes images
    /// (Qwen3-VL: 4096 by default, LFM2-VL: 256, its tiles past twice that;
    /// at most 16384).
    #[arg(long, value_name = "N", requires = "mmproj")]
    pub image_max_tokens: Option<usize>,
}

/// The vision projector in `path`, which must make `model`'s embeddings,
/// with the image token bounds of `tokens`.
pub(super) fn open_projector(
    path: &std::path::Path,
    model: &Model,
    tokens: ImageTokenArgs,
) -> Result<ClipModel, Box<dyn Error>> {
    let mut clip = ClipModel::open(path)?;
    clip.set_image_tokens(tokens.image_min_tokens, tokens.image_max_tokens)?;
    if clip.hp.n_mmproj_embd != model.hp.n_embd {
        return Err(format!(
            "the projector {} makes {}-wide embeddings, the model's are {} wide",
            path.display(),
            clip.hp.n_mmproj_embd,
            model.hp.n_embd
        )
        .into());
    }
    // Deepstack features (Qwen3-VL) go to as many of the model's layers.
    if clip.row_width() != model.n_embd_inp() {
        return Err(format!(
            "the projector {} gives {} deepstack feature(s) an embedding, the model takes {}",
            path.display(),
            clip.hp.n_deepstack,
            model.hybrid.n_deepstack
        )
        .into());
    }
    Ok(clip)
}

/// Runs `les run`.
pub fn run(args: &RunArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let t0 = Instant::now();
    if args.conversation {
        note!("{CONVERSATION_HELP}");
    }
    // The images of the first message: --image's, then a conversation's
    // /image lines before its first message.
    let mut image_paths = args.images.clone();
    // Before the model loads: a bad prompt file fails at once.
    let escaped = |s: &str| {
        if args.no_escape {
            Ok(s.to_string())
        } else {
            super::values::process_escapes(s)
        }
    };
    let stops = args
        .stop
        .iter()
        .map(|s| escaped(s).map_err(|e| format!("--stop: {e}")))
        .collect::<Result<Vec<String>, String>>()?;
    let prompt_arg = match (&args.prompt, &args.file) {
        (Some(p), _) => escaped(p).map_err(|e| format!("-p: {e}"))?,
        (None, Some(path)) => read_prompt_file(path)?,
        (None, None) if args.conversation => {
            match first_message(&mut image_paths, args.mmproj.is_some(), args.no_escape)? {
                Some(message) => message,
                None => return Ok(()),
            }
        }
        (None, None) => return Err("give a prompt: -p TEXT or -f FILE".into()),
    };
    args.experts.check()?;
    let model = Model::open(&args.model)?;
    // Created before the work (slots, images, prompt), so a bad path fails at once.
    let mut npy = match &args.logits_out {
        Some(path) => Some(NpyWriter::create(path, model.hp.n_vocab)?),
        None => None,
    };
    let mut tokenizer = Tokenizer::from_gguf(model.gguf())?;
    if args.template.any() && !(args.chat || args.conversation) {
        return Err(
            "--chat-template-file and --chat-template-kwargs apply with --chat or --conversation"
                .into(),
        );
    }
    args.template.apply(&mut tokenizer)?;
    let tokenizer = tokenizer;
    let (schedule, budget) = args.experts.resolve(&model)?;
    let clip = args
        .mmproj
        .as_deref()
        .map(|path| open_projector(path, &model, args.image_tokens))
        .transpose()?;
    // Each image's size from its header: the prompt's length, and whether it
    // fits the context, are known before any image is decoded or encoded.
    let image_sizes = image_paths
        .iter()
        .map(|p| vision::probe_image(p))
        .collect::<Result<Vec<_>, _>>()?;
    let n_images = image_sizes.len();
    let content = vision::place_markers(&prompt_arg, n_images);
    // With --chat, a conversation of one turn.
    let mut conv = if args.chat || args.conversation {
        let template = tokenizer.chat_template()?;
        if args.system_prompt.is_some() && !template.supports_system_role() {
            note!(
                "les: the chat template has no system role: the system prompt \
                 goes before the user's message"
            );
        }
        Some(Conversation::new(
            &tokenizer,
            template,
            args.system_prompt.as_deref(),
        ))
    } else {
        None
    };
    let prompt_text = match &mut conv {
        Some(conv) => conv.ask(&content)?.text,
        None => content,
    };
    let context = |prompt_len: usize| context_size(prompt_len, args, model.n_ctx_train);
    let threads = args.threads.unwrap_or_else(default_threads).max(1);
    let mut mv = ThreadedMatVec::new(threads, Isa::detect());
    let mut image_encode = std::time::Duration::ZERO;
    let prompt = match &clip {
        Some(clip) if n_images > 0 => {
            let layouts: Vec<_> = image_sizes
                .iter()
                .map(|&size| vision::image_layout(clip, size))
                .collect();
            context(vision::prompt_positions(
                &tokenizer,
                clip.hp.projector,
                &prompt_text,
                true,
                &layouts,
            )?)?;
            let mut encoded = Vec::with_capacity(n_images);
            let isa = mv.isa();
            let mut ctx = vision::Ctx {
                pool: mv.pool(),
                isa,
            };
            let t_img = Instant::now();
            // One image's pixels in memory at a time.
            for path in &image_paths {
                let img = vision::load_image(path)?;
                encoded.push(vision::encode_image(&mut ctx, clip, &img)?);
            }
            image_encode = t_img.elapsed();
            vision::build_prompt(
                &tokenizer,
                clip.hp.projector,
                &prompt_text,
                true,
                &encoded,
                model.n_embd_inp(),
            )?
        }
        _ => MultimodalPrompt::from_tokens(
            tokenizer.encode(&prompt_text, true, true),
            model.n_embd_inp(),
        ),
    };
    let prompt_tokens = prompt.tokens();
    if prompt.is_empty() {
        return Err("the prompt is empty after tokenization".into());
    }
    // Checked again on the prompt as built (an image file may have changed).
    let ctx = context(prompt.len())?;
    if model.n_ctx_train > 0 && ctx > model.n_ctx_train {
        // As llama.cpp, which warns of a "possible training context overflow".
        note!(
            "les: warning: the context of {ctx} positions (--ctx) is longer than the {} \
             the model was trained on; generation past them may degrade",
            model.n_ctx_train
        );
    }
    // The last generated token is not evaluated: n tokens take n - 1 positions.
    let n_predict = args.n_predict.min(ctx + 1 - prompt.len());
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: Some(args.min_p),
        typical_p: args.typical_p,
        top_n_sigma: args.top_n_sigma,
        xtc_probability: args.xtc_probability,
        xtc_threshold: args.xtc_threshold,
        penalties: Some(Penalties {
            repeat: args.repeat_penalty,
            frequency: args.frequency_penalty,
            presence: args.presence_penalty,
            last_n: args.repeat_last_n,
        }),
        mirostat: crate::sampling::Mirostat::of(
            args.mirostat,
            args.mirostat_tau,
            args.mirostat_eta,
        ),
        seed,
    });
    let dry = DrySettings {
        multiplier: args.dry_multiplier,
        base: args.dry_base,
        allowed_length: args.dry_allowed_length,
        // -1: the model's context, which also bounds any other value (as in
        // llama.cpp).
        last_n: match (usize::try_from(args.dry_penalty_last_n), model.n_ctx_train) {
            (Ok(n), 0) => n,
            (Ok(n), train) => n.min(train),
            (Err(_), 0) => ctx,
            (Err(_), train) => train,
        },
    };
    if dry.enabled() {
        let breakers = if args.dry_sequence_breakers.is_empty() {
            DEFAULT_BREAKERS.iter().map(|b| b.to_string()).collect()
        } else if args.dry_sequence_breakers.iter().any(|b| b == "none") {
            Vec::new()
        } else {
            args.dry_sequence_breakers
                .iter()
                .map(|b| escaped(b).map_err(|e| format!("--dry-sequence-breaker: {e}")))
                .collect::<Result<Vec<String>, String>>()?
        };
        sampler.set_dry(Dry::new(dry, &breakers, &tokenizer));
    }
    if args.ignore_eos {
        sampler.ban((0..model.hp.n_vocab as u32).filter(|&t| tokenizer.is_eog(t)));
    }
    for &(token, bias) in &args.logit_bias {
        if token as usize >= model.hp.n_vocab {
            return Err(format!(
                "--logit-bias: token {token} is outside the vocabulary ({} tokens)",
                model.hp.n_vocab
            )
            .into());
        }
        sampler.bias(token, bias);
    }
    if let Some(grammar) = read_grammar(args, &tokenizer)? {
        sampler.constrain(grammar);
    }
    let mut supply = Supply::new(&model, &args.model, schedule, budget.clone())?;
    model.populate_resident();
    let lookahead = crate::bench::lookahead(&model, &args.lookahead);
    let mut session = Session::with_kv(&model, ctx, args.cache.types(), args.cache.swa())?;
    session.set_prefill_batch(args.batch_size)?;
    let draft_model = args.spec.open_draft_model(&tokenizer)?;
    let mut drafter = args
        .spec
        .drafter(&model, &args.model, draft_model.as_ref(), ctx, threads)?;
    let max_draft = match drafter {
        Some(_) => session.set_max_draft(args.spec.draft_max() as usize)?,
        None => 0,
    };
    let io_engine = supply.device().map(crate::flash::FileDevice::engine_name);
    note!(
        "les: {} ({} layers, {} experts), schedule {schedule}{}{}, {threads} threads, \
         KV cache {ctx} positions {}/{}{} ({:.1} MiB), loaded in {:.2?}",
        model.arch.name(),
        model.hp.n_layers,
        model.hp.moe.map_or(0, |m| m.n_experts),
        match budget.classes.as_slice() {
            [] => String::new(),
            [c] => format!(", {} slots of {} KiB", c.slots, c.bytes / 1024),
            cs => format!(
                ", {} slots ({})",
                budget.slots(),
                cs.iter()
                    .map(|c| format!("{} of {} KiB", c.slots, c.bytes / 1024))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
        match supply.device() {
            Some(d) if d.uses_uring() => " read by io_uring".to_string(),
            Some(_) => format!(" read by {} I/O threads", budget.io.threads),
            None => String::new(),
        },
        args.cache.k.name(),
        args.cache.v.name(),
        match session.kv_ring() {
            Some(r) => format!(", sliding-window layers in rings of {} positions", r.span),
            None => String::new(),
        },
        session.kv_bytes() as f64 / (1 << 20) as f64,
        t0.elapsed().saturating_sub(image_encode)
    );
    if let Some(clip) = &clip {
        if n_images > 0 {
            note!(
                "les: {} image(s) through {} ({} layers, width {}): {} embeddings in {:.2?}",
                n_images,
                clip.hp.projector.name(),
                clip.hp.n_layer,
                clip.hp.n_embd,
                prompt.n_image_tokens(),
                image_encode
            );
        }
    }
    let inputs = prompt.inputs();
    let places = prompt.places();
    // As llama.cpp: the prompt's tokens count for the repeat penalty.
    for input in &inputs {
        if let TokenInput::Token(t) = input {
            sampler.accept(*t);
        }
    }

    // With --prompt-cache, all but the last prompt token are restored or
    // evaluated (and saved) first; generation evaluates the last.
    let prompt_ids = prompt.token_ids(model.hp.n_vocab as u32);
    let cached = match &args.prompt_cache {
        Some(path) => Some(use_prompt_cache(
            path,
            args,
            &model,
            &mut session,
            &mut mv,
            &mut supply,
            &lookahead,
            &prompt,
            drafter.as_ref().is_some_and(|d| d.wants_hidden()),
        )?),
        None => None,
    };
    let pre = cached.map_or(0, |c| c.evaluated + c.restored);
    let mut reply = Reply::new(&tokenizer, &stops);
    // Set by the sampler's closure where the grammar allows no token; the
    // token closure then stops before taking it.
    let grammar_stuck: std::cell::RefCell<Option<GrammarError>> = Default::default();
    let mut stats = generate_from(
        &mut session,
        &mut mv,
        &mut supply,
        Some(&lookahead),
        &inputs[pre..],
        &places[pre..],
        drafter.as_deref_mut().map(|d| Speculation {
            drafter: d,
            max_draft,
            adaptive: !args.spec.draft_fixed,
            context: &prompt_ids[..pre],
        }),
        n_predict,
        |logits| sample_in_grammar(&mut sampler, logits, &grammar_stuck),
        |t, logits| {
            if grammar_stuck.borrow().is_some() {
                return Control::Stop;
            }
            if let Some(npy) = &mut npy {
                if let Err(e) = npy.push(logits) {
                    reply.write_err = Some(e);
                    return Control::Stop;
                }
            }
            reply.take(t, (!args.json).then_some(&mut *out))
        },
    )?;
    if let Some(c) = cached {
        stats.prompt_tokens += c.evaluated;
        stats.prefill += c.time;
    }
    let tail = reply.finish()?;
    let Reply {
        tokens,
        text,
        eog,
        stopped,
        ..
    } = reply;
    let stuck = grammar_stuck.into_inner();
    if let Some(e) = &stuck {
        note!("\nles: {e}; stopping");
    }
    let stop = if eog.is_some() {
        "eog"
    } else if stuck.is_some() {
        "grammar"
    } else if stopped.is_some() {
        "string"
    } else if n_predict < args.n_predict && stats.generated == n_predict {
        note!("\nles: the context is full ({ctx} positions); raise it with --ctx");
        "ctx"
    } else {
        "length"
    };
    if let Some(npy) = npy {
        npy.finish()?;
    }
    let io = supply.stats();
    if args.json {
        let mut st = json!({
            "prefill_tok_s": stats.prefill_tok_s(),
            "decode_tok_s": stats.decode_tok_s(),
            "prompt_tokens": stats.prompt_tokens,
            "generated": stats.generated,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "verify_passes": stats.verify_passes,
            "schedule": schedule.name(),
            "threads": threads,
            "seed": seed,
            "stop": stop,
            "kv_cache": {
                "k": args.cache.k.name(),
                "v": args.cache.v.name(),
                "bytes": session.kv_bytes(),
                "swa_ring_positions": session.kv_ring().map(|r| r.span),
            },
            "peak_rss_bytes": crate::engine::peak_rss_bytes(),
            "resident_weight_bytes": model.gguf().bytes().len() as u64 - model.total_expert_bytes(),
            "slot_bytes": budget.bytes(),
        });
        if let Some(c) = cached {
            st["prompt_cache_restored"] = json!(c.restored);
        }
        if let Some((i, _)) = &stopped {
            st["stop_string"] = json!(stops[*i]);
        }
        if n_images > 0 {
            st["images"] = json!(n_images);
            st["image_tokens"] = json!(prompt.n_image_tokens());
            st["image_encode_ms"] = json!(image_encode.as_secs_f64() * 1e3);
        }
        if let Some(s) = io {
            st["slots"] = json!(budget.slots());
            st["io_engine"] = json!(io_engine);
            st["hit_rate"] = json!(s.hit_rate());
            st["ready_hit_rate"] = json!(s.ready_hit_rate());
            st["demand_bytes"] = json!(s.demand_bytes);
            st["prefetch_bytes"] = json!(s.prefetch_bytes);
            st["split_computes"] = json!(s.split_computes);
            // Demand reads retried after transient errors, and picked
            // experts read again after a checksum mismatch.
            st["retries"] = json!(s.retries);
            st["rereads"] = json!(s.rereads);
        }
        let obj = json!({
            "prompt_tokens": prompt_tokens,
            "tokens": tokens,
            "text": text,
            "stats": st,
        });
        writeln!(out, "{obj}")?;
    } else {
        write!(out, "{tail}")?;
        writeln!(out)?;
        out.flush()?;
        note!(
            "les: prompt {} tokens at {:.1} tok/s, generated {} tokens at {:.2} tok/s (seed {seed})",
            stats.prompt_tokens,
            stats.prefill_tok_s(),
            stats.generated,
            stats.decode_tok_s()
        );
        if drafter.is_some() {
            note!(
                "les: speculative: {} of {} draft tokens accepted ({:.1}%) in {} passes",
                stats.accepted,
                stats.drafted,
                100.0 * stats.acceptance(),
                stats.verify_passes
            );
        }
        if let Some(s) = io {
            note!(
                "les: slot hit rate {:.1}% ({:.1}% resident and ready when picked), read {:.1} MiB on demand + {:.1} MiB prefetched",
                100.0 * s.hit_rate(),
                100.0 * s.ready_hit_rate(),
                s.demand_bytes as f64 / (1 << 20) as f64,
                s.prefetch_bytes as f64 / (1 << 20) as f64
            );
        }
    }
    if let Some(conv) = conv.as_mut().filter(|_| args.conversation) {
        if stop == "ctx" {
            return Err(context_full(ctx).into());
        }
        conv.fed(&prompt_ids);
        conv.replied(&tokens, &text, eog);
        converse(
            Turns {
                args,
                model: &model,
                tokenizer: &tokenizer,
                clip: clip.as_ref(),
                session: &mut session,
                mv: &mut mv,
                supply: &mut supply,
                lookahead: &lookahead,
                drafter: drafter.as_deref_mut(),
                max_draft,
                sampler: &mut sampler,
                stops: &stops,
            },
            conv,
            out,
        )?;
    }
    Ok(())
}

/// What `--prompt-cache` did before generation.
#[derive(Clone, Copy, Debug)]
struct PromptCacheUse {
    /// Prompt positions restored from the file, then evaluated.
    restored: usize,
    evaluated: usize,
    /// The time evaluating (and saving) took.
    time: std::time::Duration,
}

/// Restores what the prompt cache `path` holds of `prompt`'s first tokens
/// (all but the last), evaluates the rest of them, and saves their state
/// unless the file held them already (or --prompt-cache-ro).
#[allow(clippy::too_many_arguments)]
fn use_prompt_cache<'m>(
    path: &std::path::Path,
    args: &RunArgs,
    model: &'m Model,
    session: &mut Session<'m>,
    mv: &mut ThreadedMatVec,
    supply: &mut Supply<'m>,
    lookahead: &Lookahead,
    prompt: &MultimodalPrompt,
    mtp: bool,
) -> Result<PromptCacheUse, Box<dyn Error>> {
    use crate::prompt_cache::{self, CacheMiss};
    if mtp {
        return Err(
            "--prompt-cache keeps no state of the multi-token-prediction block; \
                    use it or --speculate mtp"
                .into(),
        );
    }
    if prompt.n_image_tokens() > 0 {
        return Err("--prompt-cache keeps text prompts only, and this one has images".into());
    }
    let ids = prompt.token_ids(model.hp.n_vocab as u32);
    let head = &ids[..ids.len() - 1];
    let kv = args.cache.types();
    let (restored, cached) = match prompt_cache::restore(path, model, session, kv, head)? {
        Ok(r) => (r.positions, Some(r.cached)),
        Err(CacheMiss::Absent) => (0, None),
        Err(CacheMiss::Stale(why)) => {
            note!("les: prompt cache {}: {why}; not used", path.display());
            (0, None)
        }
    };
    let t = Instant::now();
    let inputs = prompt.inputs();
    let mut logits = vec![0f32; model.hp.n_vocab];
    crate::engine::prefill(
        session,
        mv,
        supply,
        Some(lookahead),
        &inputs[restored..head.len()],
        &mut logits,
    )?;
    // Saved unless the file holds exactly these tokens.
    let held = restored == head.len() && cached == Some(head.len());
    let save = !args.prompt_cache_ro && !head.is_empty() && !held;
    if save {
        prompt_cache::save(path, model, session, kv, head)?;
    }
    note!(
        "les: prompt cache {}: {restored} of {} prompt tokens restored{}",
        path.display(),
        ids.len(),
        if save { ", the state saved" } else { "" }
    );
    Ok(PromptCacheUse {
        restored,
        evaluated: head.len() - restored,
        time: t.elapsed(),
    })
}

fn context_full(ctx: usize) -> String {
    format!("the conversation filled the context ({ctx} positions; raise it with --ctx)")
}

/// What `les run --conversation` decodes its turns with.
struct Turns<'a, 'm, 'd> {
    args: &'a RunArgs,
    model: &'m Model,
    tokenizer: &'a Tokenizer,
    clip: Option<&'a ClipModel>,
    session: &'a mut Session<'m>,
    mv: &'a mut ThreadedMatVec,
    supply: &'a mut Supply<'m>,
    lookahead: &'a Lookahead,
    drafter: Option<&'a mut (dyn Drafter + 'd)>,
    max_draft: usize,
    sampler: &'a mut Sampler,
    /// The stop strings, escapes read.
    stops: &'a [String],
}

/// The conversation after its first reply: each message read from stdin is
/// answered in the same session, until `/quit` or the end of input.
fn converse(
    t: Turns<'_, '_, '_>,
    conv: &mut Conversation<'_>,
    out: &mut dyn Write,
) -> Result<(), Box<dyn Error>> {
    let Turns {
        args,
        model,
        tokenizer,
        clip,
        session,
        mv,
        supply,
        lookahead,
        mut drafter,
        max_draft,
        sampler,
        stops,
    } = t;
    let ctx = session.max_positions();
    let (n_embd, n_vocab) = (model.n_embd_inp(), model.hp.n_vocab as u32);
    // The images of the next message, encoded as they are named.
    let mut images: Vec<EncodedImage> = Vec::new();
    loop {
        let message = match read_input()? {
            Input::Quit => return Ok(()),
            Input::Clear => {
                session.rewind(0)?;
                sampler.reset();
                conv.clear();
                images.clear();
                note!("les: the conversation is cleared");
                continue;
            }
            Input::Image(path) => {
                let Some(clip) = clip else {
                    note!("les: /image needs a vision projector (--mmproj)");
                    continue;
                };
                let mut vctx = vision::Ctx {
                    isa: mv.isa(),
                    pool: mv.pool(),
                };
                let t_img = Instant::now();
                match vision::load_image(&path)
                    .and_then(|img| vision::encode_image(&mut vctx, clip, &img))
                {
                    Ok(image) => {
                        note!(
                            "les: {}: {} embeddings in {:.2?}, for the next message",
                            path.display(),
                            image.n_tokens(),
                            t_img.elapsed()
                        );
                        images.push(image);
                    }
                    Err(e) => note!("les: {e}"),
                }
                continue;
            }
            Input::Message(message) => match line_escapes(message, args.no_escape) {
                Some(message) => message,
                None => continue,
            },
        };
        let content = vision::place_markers(&message, images.len());
        let markers = content.matches(MEDIA_MARKER).count();
        if markers != images.len() {
            note!(
                "les: the message has {markers} image marker(s) {MEDIA_MARKER} for {} \
                 image(s); it was not sent",
                images.len()
            );
            continue;
        }
        let turn = conv.ask(&content)?;
        let prompt = vision::build_turn(
            tokenizer,
            clip.map(|c| c.hp.projector),
            &turn,
            &std::mem::take(&mut images),
            n_embd,
        )?;
        let room = ctx.saturating_sub(session.position());
        if prompt.len() >= room {
            return Err(context_full(ctx).into());
        }
        let inputs = prompt.inputs();
        for input in &inputs {
            if let TokenInput::Token(t) = input {
                sampler.accept(*t);
            }
        }
        let n_turn = args.n_predict.min(room + 1 - prompt.len());
        let mut reply = Reply::new(tokenizer, stops);
        // Each reply follows the grammar from its start.
        sampler.reset_grammar();
        let grammar_stuck: std::cell::RefCell<Option<GrammarError>> = Default::default();
        let st = generate_from(
            session,
            mv,
            supply,
            Some(lookahead),
            &inputs,
            &prompt.places(),
            drafter.as_deref_mut().map(|d| Speculation {
                drafter: d,
                max_draft,
                adaptive: !args.spec.draft_fixed,
                context: conv.held(),
            }),
            n_turn,
            |logits| sample_in_grammar(sampler, logits, &grammar_stuck),
            |t, _| {
                if grammar_stuck.borrow().is_some() {
                    return Control::Stop;
                }
                reply.take(t, Some(&mut *out))
            },
        )?;
        if let Some(e) = grammar_stuck.take() {
            note!("\nles: {e}; the turn ends");
        }
        let tail = reply.finish()?;
        writeln!(out, "{tail}")?;
        out.flush()?;
        note!(
            "les: turn of {} tokens at {:.1} tok/s, {} generated at {:.2} tok/s, \
             {} of {ctx} positions used",
            st.prompt_tokens,
            st.prefill_tok_s(),
            st.generated,
            st.decode_tok_s(),
            session.position()
        );
        conv.fed(&prompt.token_ids(n_vocab));
        // The session holds the text cut at a stop string too.
        let held = match &reply.stopped {
            Some((_, cut)) => format!("{}{cut}", reply.text),
            None => reply.text.clone(),
        };
        conv.replied(&reply.tokens, &held, reply.eog);
        if reply.eog.is_none() && reply.stopped.is_none() && st.generated < args.n_predict {
            return Err(context_full(ctx).into());
        }
    }
}

/// What `--conversation` prints before it reads stdin.
const CONVERSATION_HELP: &str = "les: conversation: each line is a message (end it with \\ to \
     go on on the next line); /image PATH adds an image to the next message, /clear starts \
     over, /quit or the end of input ends";

/// One input of the conversation.
#[derive(Debug, PartialEq)]
enum Input {
    /// A message (its lines joined).
    Message(String),
    /// `/image PATH`: an image for the next message.
    Image(PathBuf),
    /// `/clear`: start over.
    Clear,
    /// `/quit`, `/exit` or the end of input.
    Quit,
}

/// The next input of the conversation from stdin (a `> ` prompt on stderr
/// first).
fn read_input() -> std::io::Result<Input> {
    use std::io::BufRead as _;
    let mut stdin = std::io::stdin().lock();
    parse_input(&mut || {
        eprint!("\n> ");
        let mut line = String::new();
        Ok((stdin.read_line(&mut line)? > 0).then_some(line))
    })
}

/// The next input from the lines `next_line` returns (`None` at the end):
/// empty lines are skipped, a line ending in `\` goes on on the next one, and
/// a line that is exactly a command (`/clear`, `/quit`, `/exit`, or `/image`
/// and a path) is that command.
fn parse_input(
    next_line: &mut dyn FnMut() -> std::io::Result<Option<String>>,
) -> std::io::Result<Input> {
    let mut message = String::new();
    loop {
        let Some(line) = next_line()? else {
            // What was typed before the end of input is still a message.
            return Ok(if message.is_empty() {
                Input::Quit
            } else {
                Input::Message(message)
            });
        };
        let line = line.trim_end_matches(['\n', '\r']);
        if message.is_empty() {
            match line.trim() {
                "" => continue,
                "/clear" => return Ok(Input::Clear),
                "/quit" | "/exit" => return Ok(Input::Quit),
                "/image" => {
                    note!("les: /image PATH: the image file (PNG, JPEG, GIF, BMP, PPM) for the next message");
                    continue;
                }
                command => {
                    if let Some(path) = command.strip_prefix("/image ") {
                        return Ok(Input::Image(PathBuf::from(path.trim())));
                    }
                }
            }
        }
        match line.strip_suffix('\\') {
            Some(part) => {
                message.push_str(part);
                message.push('\n');
            }
            None => {
                message.push_str(line);
                return Ok(Input::Message(message));
            }
        }
    }
}

/// A conversation line with the escapes -p reads read too (as llama-cli
/// does), unless `no_escape`; `None`, noted, where they are not UTF-8 (the
/// line is not sent).
fn line_escapes(message: String, no_escape: bool) -> Option<String> {
    if no_escape {
        return Some(message);
    }
    match values::process_escapes(&message) {
        Ok(message) => Some(message),
        Err(e) => {
            note!("les: {e}; the message was not sent");
            None
        }
    }
}

/// A conversation's first message, read from stdin before the model loads:
/// the images named before it (by `/image`, checked at once: a missing or
/// unreadable file is reported and left out) go to `images`; `None` if the
/// input ends (or is `/quit`) first.
fn first_message(
    images: &mut Vec<PathBuf>,
    has_projector: bool,
    no_escape: bool,
) -> Result<Option<String>, Box<dyn Error>> {
    let given = images.len();
    loop {
        match read_input()? {
            Input::Message(message) => {
                if let Some(message) = line_escapes(message, no_escape) {
                    return Ok(Some(message));
                }
            }
            Input::Quit => return Ok(None),
            Input::Clear => images.truncate(given),
            Input::Image(_) if !has_projector => {
                note!("les: /image needs a vision projector (--mmproj)");
            }
            Input::Image(path) => match vision::probe_image(&path) {
                Ok((w, h)) => {
                    note!("les: {}: {w}x{h}, for the next message", path.display());
                    images.push(path);
                }
                Err(e) => note!("les: {e}"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, contents: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("les-run-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    fn input(lines: &[&str]) -> Input {
        let mut lines = lines.iter().map(|l| l.to_string());
        parse_input(&mut || Ok(lines.next())).unwrap()
    }

    #[test]
    fn conversation_inputs_are_messages_or_commands() {
        let msg = |m: &str| Input::Message(m.into());
        assert_eq!(input(&["hi\n"]), msg("hi"));
        assert_eq!(input(&["\n", "\r\n", "hi\r\n", "more\n"]), msg("hi"));
        assert_eq!(input(&["a \\\n", "b\\\n", "c\n"]), msg("a \nb\nc"));
        // Input that ends inside a message still sends it.
        assert_eq!(input(&["a\\\n"]), msg("a\n"));
        assert_eq!(input(&[]), Input::Quit);
        assert_eq!(input(&["\n"]), Input::Quit);
        assert_eq!(input(&["/clear\n"]), Input::Clear);
        assert_eq!(input(&[" /quit \n"]), Input::Quit);
        assert_eq!(input(&["/exit"]), Input::Quit);
        assert_eq!(
            input(&["/image  dir/a b.png \n"]),
            Input::Image("dir/a b.png".into())
        );
        // A bare /image is told its use and skipped.
        assert_eq!(input(&["/image\n", "hi\n"]), msg("hi"));
        // Commands are whole first lines; anything else is text.
        assert_eq!(input(&["/images are\n"]), msg("/images are"));
        assert_eq!(input(&["/clearly\n"]), msg("/clearly"));
        assert_eq!(input(&["a\\\n", "/clear\n"]), msg("a\n/clear"));
    }

    #[test]
    fn prompt_files_drop_one_trailing_newline() {
        for (contents, want) in [
            (&b"a b"[..], "a b"),
            (b"a b\n", "a b"),
            (b"a b\r\n", "a b"),
            (b"a b\n\n", "a b\n"),
            (b"\n", ""),
            (b"", ""),
            (b"caf\xc3\xa9\r", "caf\u{e9}\r"),
        ] {
            let path = file("p.txt", contents);
            assert_eq!(read_prompt_file(&path).unwrap(), want, "{contents:?}");
        }
    }

    #[test]
    fn bad_prompt_files_are_errors_naming_them() {
        let missing = std::env::temp_dir().join("les-no-such-prompt.txt");
        let err = read_prompt_file(&missing).unwrap_err().to_string();
        assert!(err.contains("les-no-such-prompt.txt"), "{err}");

        let latin1 = file("latin1.txt", b"caf\xe9");
        let err = read_prompt_file(&latin1).unwrap_err().to_string();
        assert!(err.contains("latin1.txt") && err.contains("UTF-8"), "{err}");

        // A sparse file one byte over the limit: refused without holding more.
        let big = file("big.txt", b"");
        std::fs::File::options()
            .write(true)
            .open(&big)
            .unwrap()
            .set_len(MAX_PROMPT_FILE + 1)
            .unwrap();
        let err = read_prompt_file(&big).unwrap_err().to_string();
        assert!(err.contains("big.txt") && err.contains("64 MiB"), "{err}");
        std::fs::remove_file(&big).unwrap();
    }
}
