//! `les synth`: write a deterministic synthetic model; see [`crate::synth`].

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use les_core::quant::GgmlType;

use crate::gguf::Gguf;
use crate::synth::{
    describe, probe::probe, vocab, write_mmproj, write_model, Arch, Mix, MmprojConfig, Overrides,
    Preset, SynthConfig, WriteOptions,
};
use crate::vision::ProjectorType;

const KNOBS_HELP: &str = "\
Routing realism:
  --router-corr C      layer l+1's router = C * router_l + sqrt(1-C^2) * noise, so
                       consecutive layers favour the same expert ids (default 0.9)
  --popularity-skew S  Zipf-like expert popularity: a direction shared by every token
                       embedding adds -S*ln(1+rank) to each expert's logit (default 0.5)
  --residual-scale R   scale of attn_output / ffn_down*: each block moves the residual
                       stream by ~R, so lookahead (next layer's router on this layer's
                       hidden state) is right most of the time (default 0.5; small
                       0.7, a3b and minicpmv47 0.35: calibrated so plain LRU hits
                       ~72-76% at a 25% budget, as in trained models)
  --router-scale G     spread of the router logits (default 2.0)
Measure them with --probe N (top-k lookahead precision, expert reuse across layers,
share of the most popular 10% of experts).

The same arguments and seed give a byte-identical file. The file is written as
.NAME.PID.tmp next to OUTPUT and renamed when complete.";

fn parse_type(s: &str) -> Result<GgmlType, String> {
    GgmlType::from_name(s).ok_or_else(|| format!("unknown ggml type '{s}' (e.g. q4_k, q8_0, f16)"))
}

/// Arguments of `les synth`.
#[derive(Debug, Args)]
#[command(after_long_help = KNOBS_HELP)]
pub struct SynthArgs {
    /// Architecture (`mixtral` = arch `llama` with experts).
    #[arg(long, value_enum)]
    pub arch: Arch,
    /// Dimensions and types: tiny (~330 KB), small (~560 MB), a3b (Qwen3-30B-A3B, ~18.6 GB),
    /// minicpmv47 (MiniCPM-V 4.7's qwen35moe language model, ~21.7 GB); small, a3b and
    /// minicpmv47 in llama.cpp's Q4_K_M mix (see --mix), tiny q4_0 / q8_0.
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: Preset,
    /// The GGUF file to write.
    #[arg(short, long, required_unless_present = "dry_run")]
    pub output: Option<PathBuf>,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the tensor plan and the file size; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Transformer blocks.
    #[arg(long)]
    pub layers: Option<u64>,
    /// Width of the residual stream.
    #[arg(long)]
    pub embd: Option<u64>,
    /// Query heads.
    #[arg(long)]
    pub heads: Option<u64>,
    /// Key/value heads.
    #[arg(long)]
    pub kv_heads: Option<u64>,
    /// Head size (qwen3moe, llama; tied to embd/heads for olmoe and qwen2moe).
    #[arg(long)]
    pub head_dim: Option<u64>,
    /// Vocabulary size (at least 259).
    #[arg(long)]
    pub vocab: Option<u64>,
    /// context_length.
    #[arg(long)]
    pub context: Option<u64>,
    /// Dense FFN size (feed_forward_length of dense llama, qwen3moe, qwen2moe).
    #[arg(long)]
    pub ff: Option<u64>,
    /// Routed experts per layer (with --arch llama: makes it Mixtral-style).
    #[arg(long)]
    pub experts: Option<u64>,
    /// Experts used per token.
    #[arg(long)]
    pub top_k: Option<u64>,
    /// Hidden size of one routed expert.
    #[arg(long)]
    pub expert_ff: Option<u64>,
    /// Hidden size of the shared expert (qwen2moe, qwen35moe).
    #[arg(long)]
    pub shared_ff: Option<u64>,
    /// RoPE frequency base.
    #[arg(long)]
    pub rope_base: Option<f32>,
    /// Type of the routed experts (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q6_k, mxfp4, f16, bf16, f32).
    #[arg(long, value_parser = parse_type)]
    pub expert_type: Option<GgmlType>,
    /// Type of attention, dense FFN and shared-expert matrices.
    #[arg(long, value_parser = parse_type)]
    pub dense_type: Option<GgmlType>,
    /// Type of token_embd.weight.
    #[arg(long, value_parser = parse_type)]
    pub embd_type: Option<GgmlType>,
    /// Type of output.weight.
    #[arg(long, value_parser = parse_type)]
    pub output_type: Option<GgmlType>,
    /// How types vary inside the expert and dense classes: q4_k_m (llama.cpp's
    /// Q4_K_M recipe over q4_k classes: attn_v and ffn_down of the "more bits"
    /// layers q6_k, ...; default for small, a3b, minicpmv47) or uniform (default
    /// for tiny).
    #[arg(long, value_enum)]
    pub mix: Option<Mix>,
    /// Correlation of consecutive layers' routers, in [0, 1] (default 0.9).
    #[arg(long)]
    pub router_corr: Option<f32>,
    /// Zipf exponent of expert popularity, >= 0 (default 0.5).
    #[arg(long)]
    pub popularity_skew: Option<f32>,
    /// Scale of the blocks' output projections: how fast the residual stream drifts (default 0.5; small 0.7, a3b and minicpmv47 0.35).
    #[arg(long)]
    pub residual_scale: Option<f32>,
    /// Spread of the router logits (default 2.0).
    #[arg(long)]
    pub router_scale: Option<f32>,
    /// Multi-token-prediction blocks after the main stack (qwen35moe, qwen3next,
    /// glm4moe, deepseek2 (none unless asked); 0 = like a `--no-mtp` conversion).
    #[arg(long)]
    pub mtp_layers: Option<u64>,
    /// deepseek2's query compression rank (0: queries projected directly, as
    /// DeepSeek-V2-Lite's); default four times the head size.
    #[arg(long)]
    pub q_lora_rank: Option<u64>,
    /// Write Llama 3.1's RoPE frequency factors (`rope_freqs.weight`, as
    /// llama.cpp's converter computes them: factor 8, low and high frequency
    /// factors 1 and 4), over an original context of 256 positions so that
    /// they matter within a few dozen (llama, mixtral, llama4).
    #[arg(long)]
    pub rope_freqs: bool,
    /// llama4: experts on every N-th layer (`interleave_moe_layer_step`;
    /// default 1 as Llama 4 Scout, 2 as Maverick), dense SwiGLU between.
    #[arg(long, value_name = "N")]
    pub moe_every: Option<u64>,
    /// Omit output.weight (qwen3moe, llama): llama.cpp then uses token_embd.weight.
    #[arg(long)]
    pub tie_embeddings: bool,
    /// Generator threads (0 = all cores; the file does not depend on it).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// After writing, run N random tokens through the model and print routing statistics.
    #[arg(long, value_name = "N")]
    pub probe: Option<usize>,
    /// Always show progress on stderr (default: for files of 256 MiB and more).
    #[arg(long, conflicts_with = "quiet")]
    pub progress: bool,
    /// Never show progress.
    #[arg(long)]
    pub quiet: bool,
    /// Also write a matching synthetic vision projector (mmproj GGUF) here: its
    /// embeddings are the model's width, and the model's vocabulary has the image
    /// marker tokens.
    #[arg(long, value_name = "MMPROJ.gguf")]
    pub mmproj_out: Option<PathBuf>,
    /// The projector type of --mmproj-out: minicpmv4_6, gemma3,
    /// qwen3vl_merger (with as many deepstack mergers as the model's
    /// `n_deepstack_layers`), kimivl (Kimi-VL's) or kimik25 (Kimi K2.5's),
    /// both for `deepseek2`, llama4 (Llama 4's, for `llama4`) or glm4v
    /// (GLM-4.5V's; a `glm4moe` model then gets GLM-4.5V's M-RoPE sections)
    /// or internvl (InternVL's, e.g. for `qwen3moe`: InternVL3.5-30B-A3B; the
    /// model's vocabulary then gets `<img>` and `</img>`) or lfm2 (LFM2-VL's,
    /// for `lfm2`; the vocabulary gets its image and tile markers).
    #[arg(long, default_value = "minicpmv4_6", value_parser = parse_projector, requires = "mmproj_out")]
    pub projector: ProjectorType,
    /// Width of the --mmproj-out vision transformer (default 64).
    #[arg(long, requires = "mmproj_out")]
    pub mmproj_width: Option<u64>,
    /// Blocks of the --mmproj-out vision transformer (default 2; 4 for
    /// qwen3vl_merger, more if it has more deepstack mergers).
    #[arg(long, requires = "mmproj_out")]
    pub mmproj_layers: Option<u64>,
    /// Input (slice) size of the --mmproj-out projector in pixels, a multiple of
    /// 4 patches (default 224; qwen3vl_merger: 256, the side of its table of
    /// position embeddings; llama4: 112, its tile).
    #[arg(long, requires = "mmproj_out")]
    pub mmproj_image_size: Option<u64>,
}

fn parse_projector(s: &str) -> Result<ProjectorType, String> {
    ProjectorType::from_name(s).ok_or_else(|| {
        format!(
            "unknown projector type '{s}' (minicpmv4_6, gemma3, qwen3vl_merger, kimivl, kimik25, llama4, glm4v, internvl or lfm2)"
        )
    })
}

impl SynthArgs {
    /// The configuration these arguments describe.
    pub fn config(&self) -> Result<SynthConfig, Box<dyn Error>> {
        let o = Overrides {
            layers: self.layers,
            embd: self.embd,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            vocab: self.vocab,
            context: self.context,
            ff: self.ff,
            experts: self.experts,
            top_k: self.top_k,
            expert_ff: self.expert_ff,
            shared_ff: self.shared_ff,
            rope_base: self.rope_base,
            expert_type: self.expert_type,
            dense_type: self.dense_type,
            embd_type: self.embd_type,
            output_type: self.output_type,
            mix: self.mix,
            router_corr: self.router_corr,
            popularity_skew: self.popularity_skew,
            residual_scale: self.residual_scale,
            router_scale: self.router_scale,
            tie_embeddings: self.tie_embeddings,
            mtp_layers: self.mtp_layers,
            q_lora_rank: self.q_lora_rank,
            rope_freqs: self.rope_freqs,
            moe_every: self.moe_every,
            // GLM-4.5V's language model rotates by M-RoPE sections.
            mrope: self.arch == Arch::Glm4moe
                && self.mmproj_out.is_some()
                && self.projector == ProjectorType::Glm4v,
            // InternVL's and LFM2-VL's markers go into whichever model
            // they are written for.
            image_tokens: match (&self.mmproj_out, self.projector) {
                (Some(_), ProjectorType::InternVl) => &crate::synth::vocab::INTERNVL_TOKENS,
                (Some(_), ProjectorType::Lfm2) => &crate::synth::vocab::LFM2_VL_TOKENS,
                _ => &[],
            },
        };
        Ok(SynthConfig::new(self.arch, self.preset, &o, self.seed)?)
    }
}

/// Runs `les synth`.
pub fn run(args: &SynthArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let cfg = args.config()?;
    if args.dry_run {
        describe(&cfg, out)?;
        return Ok(());
    }
    let path = args.output.as_ref().ok_or("--output is required")?;
    // Ctrl-C removes the temporary file; the target name never holds a partial file.
    crate::interrupt::install();
    if args.mmproj_out.is_some()
        && (cfg.shape.vocab as usize) < vocab::MIN_VOCAB + vocab::MEDIA_TOKENS.len()
    {
        return Err(format!(
            "--mmproj-out needs a vocabulary of at least {} tokens (for the image markers)",
            vocab::MIN_VOCAB + vocab::MEDIA_TOKENS.len()
        )
        .into());
    }
    let opts = WriteOptions {
        threads: args.threads,
        progress: if args.quiet {
            Some(false)
        } else if args.progress {
            Some(true)
        } else {
            None
        },
    };
    // The projector's shape is checked before the model is written.
    let mmproj = match &args.mmproj_out {
        Some(mp) => {
            let mut mcfg = MmprojConfig::tiny(args.projector, cfg.shape.embd, cfg.seed);
            if args.projector == ProjectorType::Qwen3Vl {
                // The deepstack mergers follow the model (none for a model
                // without deepstack inputs), on the blocks before the last.
                mcfg.deepstack = cfg.n_deepstack_layers();
                mcfg.layers = mcfg.layers.max(mcfg.deepstack + 1);
            }
            if let Some(w) = args.mmproj_width {
                mcfg.width = w;
                mcfg.heads = (w / 64).max(1);
                mcfg.ff = w.saturating_mul(4);
            }
            mcfg.layers = args.mmproj_layers.unwrap_or(mcfg.layers);
            mcfg.image_size = args.mmproj_image_size.unwrap_or(mcfg.image_size);
            mcfg.validate()?;
            Some((mp, mcfg))
        }
        None => None,
    };
    let report = write_model(&cfg, path, &opts)?;
    writeln!(
        out,
        "wrote {}: {} bytes, {} tensors, {} in {:.1}s",
        report.path.display(),
        report.bytes,
        report.tensors,
        cfg.model_name(),
        report.elapsed.as_secs_f64()
    )?;
    if let Some((mp, mcfg)) = mmproj {
        let bytes = write_mmproj(&mcfg, mp)?;
        writeln!(
            out,
            "wrote {}: {bytes} bytes, {} projector for {}-wide embeddings",
            mp.display(),
            args.projector.name(),
            cfg.shape.embd
        )?;
    }
    if let Some(n) = args.probe {
        let g = Gguf::open(path)?;
        let p = probe(&g, n, cfg.seed)?;
        writeln!(out, "probe: {n} tokens at position 0, top-{}", p.top_k)?;
        writeln!(out, "  lookahead precision  {:.3}", p.mean_lookahead())?;
        writeln!(out, "  reuse of ids (l-1)   {:.3}", p.mean_reuse())?;
        writeln!(out, "  top-10% expert share {:.3}", p.top_decile_share)?;
        let per: Vec<String> = p.lookahead.iter().map(|v| format!("{v:.2}")).collect();
        writeln!(out, "  lookahead by layer   {}", per.join(" "))?;
    }
    Ok(())
}
