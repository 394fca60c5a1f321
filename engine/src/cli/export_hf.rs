//! `engine export-hf`: an engine checkpoint → a Hugging Face model directory.

use std::path::PathBuf;

use anyhow::{Result, anyhow};
use clap::Args;
use engine::checkpoint::Checkpoint;
use engine::tensors::FloatType;

#[derive(Args)]
pub struct ExportArgs {
    /// The checkpoint directory (e.g. RUN_DIR/checkpoints/step-000100, or an import-hf output).
    #[arg(value_name = "CKPT")]
    checkpoint: PathBuf,
    /// The model directory to write (must not exist, or be empty).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Weight dtype: f32, bf16 or f16 [default: that of the imported model, else f32].
    #[arg(long, value_name = "DTYPE")]
    dtype: Option<String>,
    /// Split the weights into files of at most this many MB (with model.safetensors.index.json).
    #[arg(long, value_name = "MB", default_value_t = 5000)]
    max_shard_mb: u64,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let dtype = match &args.dtype {
        Some(d) => Some(FloatType::parse(d).ok_or_else(|| anyhow!("--dtype {d}: expected f32, bf16 or f16"))?),
        None => None,
    };
    if args.max_shard_mb == 0 {
        return Err(anyhow!("--max-shard-mb must be at least 1"));
    }
    let ck = Checkpoint::open(&args.checkpoint)?;
    let r = engine::hf::export(&ck, &args.out, dtype, args.max_shard_mb * 1_000_000)?;
    println!(
        "exported {} (step {}) to {} as {} in {}",
        args.checkpoint.display(),
        ck.state.step,
        args.out.display(),
        r.dtype.torch_name(),
        r.files.join(", ")
    );
    Ok(())
}
