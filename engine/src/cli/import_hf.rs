//! `engine import-hf`: a Hugging Face model directory → an engine checkpoint.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use engine::config::count::group;

#[derive(Args)]
pub struct ImportArgs {
    /// The model directory: config.json and model.safetensors (or model.safetensors.index.json).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// The checkpoint directory to write (must not exist).
    #[arg(long, value_name = "CKPT")]
    out: PathBuf,
}

pub fn run(args: ImportArgs) -> Result<()> {
    let r = engine::hf::import(&args.dir, &args.out)?;
    println!(
        "imported {:?} model ({} parameters, {}) from {} into {}",
        r.model.family,
        group(r.params as u64),
        r.dtype.torch_name(),
        args.dir.display(),
        args.out.display()
    );
    Ok(())
}
