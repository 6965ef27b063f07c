//! `les pack IN.gguf -o OUT.gguf`: rewrite a MoE model so that each expert is one
//! aligned extent (see [`crate::pack`]).

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use clap::Args;

use crate::pack::progress::ProgressBar;
use crate::pack::{check_output, ExpertTypes, PackOptions, Packer, Plan, DEFAULT_ALIGN};

/// Arguments of `les pack`.
#[derive(Debug, Args)]
pub struct PackArgs {
    /// The MoE GGUF to pack.
    pub input: PathBuf,
    /// Where to write the packed GGUF (never the input; replaced atomically).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Per-layer expert types: `0-3:q6_k,4-:q4_k` (ranges `a-b`, `a-`, `a`;
    /// later entries override; a ggml type name or `keep`). Unlisted layers keep
    /// their types.
    #[arg(long, value_name = "PLAN", conflicts_with = "bits_per_weight")]
    pub expert_types: Option<String>,
    /// Choose per-layer types that average at most B bits per expert weight,
    /// with the least measured reconstruction error.
    #[arg(long, value_name = "B")]
    pub bits_per_weight: Option<f64>,
    /// Alignment of every expert extent (a power of two, e.g. 4096 or 4KiB).
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_ALIGN, value_parser = super::values::bytes)]
    pub align: u64,
    /// Worker threads (default: all cores).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// No progress bar and no plan report.
    #[arg(short, long)]
    pub quiet: bool,
}

/// Alignment padding above this share of the packed experts gets a warning.
const MAX_QUIET_PADDING: f64 = 0.25;

/// Runs `les pack`: the plan and the progress go to stderr.
pub fn run(args: &PackArgs, _out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let types = match (&args.expert_types, args.bits_per_weight) {
        (Some(plan), _) => ExpertTypes::Plan(plan.parse::<Plan>()?),
        (None, Some(bpw)) => ExpertTypes::BitsPerWeight(bpw),
        (None, None) => ExpertTypes::Keep,
    };
    let opts = PackOptions {
        types,
        align: args.align,
        threads: args.threads,
        ..PackOptions::default()
    };
    check_output(&args.input, &args.output)?;
    // Ctrl-C removes the temporary file; the target name never holds a partial file.
    crate::interrupt::install();
    if !args.quiet && args.bits_per_weight.is_some() {
        note!("planning: measuring the error of each candidate type on a sample of every layer");
    }
    let packer = Packer::open(&args.input, &opts)?;
    let plan = packer.report();
    if !args.quiet {
        note!("{plan}");
    }
    if plan.padding_share() > MAX_QUIET_PADDING {
        note!(
            "warning: {:.0}% of the packed experts' bytes are padding to {}-byte boundaries \
             ({:.1} MiB); 4 KiB (the default) is what O_DIRECT needs",
            plan.padding_share() * 100.0,
            args.align,
            plan.padding_bytes() as f64 / (1 << 20) as f64
        );
    }
    let mut bar =
        ProgressBar::with_enabled("packing", !args.quiet && ProgressBar::stderr_is_terminal());
    let report = packer.write(&args.output, |done, total| bar.update(done, total))?;
    bar.finish();
    if !args.quiet {
        note!(
            "wrote {} ({} bytes)",
            args.output.display(),
            report.file_bytes
        );
    }
    Ok(())
}
