//! `engine export-hf`: an engine checkpoint → a Hugging Face model directory.

use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};
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
    /// Split the weights into files of at most this size (with model.safetensors.index.json),
    /// as transformers' max_shard_size: a number of bytes with an optional unit (KB, MB, GB,
    /// powers of 1000; KiB, MiB, GiB, powers of 1024).
    #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = parse_size)]
    max_shard_size: u64,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let dtype = match &args.dtype {
        Some(d) => Some(FloatType::parse(d).ok_or_else(|| anyhow!("--dtype {d}: expected f32, bf16 or f16"))?),
        None => None,
    };
    let ck = Checkpoint::open(&args.checkpoint)?;
    let r = engine::hf::export(&ck, &args.out, dtype, args.max_shard_size)?;
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

/// `5GB` → 5·10⁹, `40KiB` → 40960, `123` → 123 (clap prints the error after the option's name).
fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number.parse().map_err(|_| anyhow!("`{text}` is not a size such as 5GB or 500MB"))?;
    let scale = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        other => bail!("unknown unit `{other}` (use KB, MB, GB, KiB, MiB or GiB)"),
    };
    let bytes = (number * scale) as u64;
    if bytes == 0 {
        bail!("the size must be at least one byte");
    }
    Ok(bytes)
}
