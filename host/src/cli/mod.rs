//! The `les` command line: argument parsing and one module per subcommand.

mod bench;
mod inspect;
mod mcu;
mod pack;
mod parallel;
mod perplexity;
mod prefill;
mod run;
mod serve;
mod speculate;
mod synth;
pub(crate) mod values;

use std::error::Error;
use std::io::{self, Write};
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub use bench::BenchArgs;
pub use inspect::InspectArgs;
pub use mcu::McuIndexArgs;
pub use pack::PackArgs;
pub use perplexity::PerplexityArgs;
pub use run::{NpyWriter, RunArgs};
pub use serve::{BatchArgs, EngineArgs, ServeArgs};
pub use synth::SynthArgs;

/// LES: large MoE models on small devices, experts streamed from flash.
#[derive(Debug, Parser)]
#[command(name = "les", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print a GGUF file's architecture, hyperparameters, tensors and expert sizes.
    Inspect(InspectArgs),
    /// Rewrite a MoE GGUF so each expert is one aligned extent, optionally requantized.
    Pack(PackArgs),
    /// Generate text from a prompt.
    Run(Box<RunArgs>),
    /// Serve the model over HTTP with llama-server's OpenAI-style endpoints.
    Serve(Box<ServeArgs>),
    /// Answer a file of requests (OpenAI's Batch API format), side by side with --parallel.
    Batch(Box<BatchArgs>),
    /// Compare expert schedules on one model and budget, cold cache.
    Bench(Box<BenchArgs>),
    /// A model's perplexity over a text, or its KL divergence from a base model's.
    Perplexity(Box<PerplexityArgs>),
    /// Write a deterministic synthetic model (random weights) of a real architecture.
    Synth(Box<SynthArgs>),
    /// Write the compact model index a microcontroller firmware reads (no GGUF parser needed).
    McuIndex(McuIndexArgs),
}

/// Runs a parsed command line, writing its report to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    match &cli.command {
        Command::Inspect(args) => inspect::run(args, out),
        Command::Pack(args) => pack::run(args, out),
        Command::Run(args) => run::run(args, out),
        Command::Serve(args) => serve::run(args, out),
        Command::Batch(args) => serve::batch(args, out),
        Command::Bench(args) => bench::run(args, out),
        Command::Perplexity(args) => perplexity::run(args, out),
        Command::Synth(args) => synth::run(args, out),
        Command::McuIndex(args) => mcu::run(args, out),
    }
}

/// The binary's entry point: parses `std::env::args`, runs, and reports an error
/// as one `error: ...` line on stderr with a non-zero exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = crate::compute::prefetch_from_env() {
        note!("error: {e}");
        return ExitCode::FAILURE;
    }
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let result = run(&cli, &mut out).and_then(|()| Ok(out.flush()?));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`les inspect m.gguf | head`) is not a failure.
        Err(e)
            if e.downcast_ref::<io::Error>()
                .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            note!("error: {}", one_line(&e.to_string()));
            ExitCode::FAILURE
        }
    }
}

/// `text` as one printable line: line breaks become spaces, and every other
/// control character (an error can quote a key or tensor name read from an
/// untrusted file, which could move the cursor or retitle the terminal) its
/// escape, as `\u{1b}`.
pub(crate) fn one_line(text: &str) -> String {
    printable(&text.replace(['\n', '\r'], " "))
}

/// `text` with every control character escaped (`\u{1b}`, `\n`): names read
/// from a file, safe to print on a terminal.
pub(crate) fn printable(text: &str) -> String {
    let mut line = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            line.extend(c.escape_default());
        } else {
            line.push(c);
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn errors_print_as_one_line_without_control_characters() {
        assert_eq!(one_line("a\nb\r\nc"), "a b  c");
        assert_eq!(
            one_line("tensor '\u{1b}]0;pwned\u{7}\u{1b}[2K\u{c}x\u{0}': bad"),
            "tensor '\\u{1b}]0;pwned\\u{7}\\u{1b}[2K\\u{c}x\\u{0}': bad"
        );
        assert_eq!(one_line("Grüße, 日本 \t"), "Grüße, 日本 \\t");
    }
}
