//! `les mcu-index MODEL.gguf -o MODEL.lesm`: the index a microcontroller firmware
//! reads next to the embedded GGUF (see [`crate::mcu`]).

use std::error::Error;
use std::io::Write;
use std::path::PathBuf;

use clap::Args;

use crate::model::Model;

/// Arguments of `les mcu-index`.
#[derive(Debug, Args)]
pub struct McuIndexArgs {
    /// The model (a packed GGUF, or a plain one: three reads per expert, no checksums).
    pub model: PathBuf,
    /// Where to write the index.
    #[arg(short, long)]
    pub output: PathBuf,
}

/// Runs `les mcu-index`.
pub fn run(args: &McuIndexArgs, out: &mut dyn Write) -> Result<(), Box<dyn Error>> {
    let model = Model::open(&args.model)?;
    let index = crate::mcu::write_index(&model)?;
    std::fs::write(&args.output, &index)?;
    writeln!(
        out,
        "wrote {} ({} bytes) for {} ({} bytes)",
        args.output.display(),
        index.len(),
        args.model.display(),
        model.gguf().bytes().len()
    )?;
    Ok(())
}
