//! `engine train`: runs a recipe and records every step (the loop is
//! [`engine::train::session`]).

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow, bail};
use clap::Args;
use engine::backend::Backend;
use engine::backend::traced::Traced;
use engine::checkpoint::{self, Checkpoint, Extras};
use engine::config::{Config, Override};
use engine::hf::HfModel;
use engine::train::Trainer;
use engine::train::session::{self, CHECKPOINTS, Session};

use super::RecipeArgs;
use super::device::{self, DeviceArg, Opened};

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    recipe: RecipeArgs,
    /// Optimizer steps to run (overrides train.steps).
    #[arg(long, value_name = "N")]
    steps: Option<usize>,
    /// Directory for the resolved config, metrics.jsonl, event files, checkpoints and
    /// summary.json [default: runs/RECIPE, numbered -2, -3, ... when taken].
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// Continue the run in --run-dir from its newest complete checkpoint, or from checkpoint
    /// CKPT (whose run directory is then the default).
    #[arg(long, value_name = "CKPT", num_args = 0..=1)]
    #[allow(clippy::option_option)] // absent; present without a value (newest); with one
    resume: Option<Option<PathBuf>>,
    /// Start from a Hugging Face model (full fine-tuning): DIR/config.json replaces the recipe's
    /// [model] and the weights replace the initialisation.
    #[arg(long, value_name = "DIR")]
    init_from_hf: Option<PathBuf>,
}

pub fn run(args: TrainArgs, device: DeviceArg) -> Result<()> {
    let extra: Vec<Override> = args
        .steps
        .map(|s| Override { text: format!("train.steps={s}"), origin: "--steps".into() })
        .into_iter()
        .collect();
    let mut resolved = args.recipe.resolve(&extra)?;
    let hf = match &args.init_from_hf {
        Some(dir) => {
            let hf = HfModel::open(dir)?;
            if let Some(key) =
                resolved.provenance.iter().find(|(k, o)| k.starts_with("model.") && !o.starts_with("recipe "))
            {
                bail!(
                    "{} ({}) conflicts with --init-from-hf: the model comes from {}/config.json",
                    key.1,
                    key.0,
                    dir.display()
                );
            }
            resolved.config.model = hf.model.clone();
            resolved.config.validate().map_err(|e| anyhow!("--init-from-hf {}: {e}", dir.display()))?;
            Some(hf)
        }
        None => None,
    };
    let config = &resolved.config;

    // Everything that can fail on bad input fails before the run directory is created.
    let resume = args.resume.as_ref().map(Option::as_deref);
    let run_dir = match (&args.run_dir, resume) {
        (Some(dir), _) => dir.clone(),
        (None, Some(Some(ck))) => ck.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_default(),
        (None, Some(None)) => bail!("--resume needs --run-dir DIR (the run to continue) or a checkpoint path"),
        (None, None) => free_run_dir(&resolved.name),
    };
    let checkpoint = match resume {
        Some(explicit) => Some(checkpoint::resume_point(&run_dir.join(CHECKPOINTS), explicit, config)?),
        None => {
            if run_dir.join("metrics.jsonl").exists() {
                bail!(
                    "run directory {} already holds a run (metrics.jsonl); continue it with --resume, or choose another --run-dir",
                    run_dir.display()
                );
            }
            None
        }
    };
    let opened = device::open(device, Some(config))?;
    // Measured (on CPU) before the model's buffers exist, on a quiet heap.
    let peak = device::peak(&opened, config);
    let start = Start { name: resolved.name.clone(), run_dir, hf, checkpoint, peak };
    match opened {
        Opened::Cpu(be) => start.run(be, config),
        Opened::Cuda(be) => start.run(*be, config),
    }
}

/// What a run starts from, once everything that can fail on bad input has been checked.
struct Start {
    name: String,
    run_dir: PathBuf,
    hf: Option<HfModel>,
    checkpoint: Option<Checkpoint>,
    peak: (f64, String),
}

impl Start {
    fn run<B: Backend>(self, backend: B, config: &Config) -> Result<()> {
        let Start { name, run_dir, hf, checkpoint, peak: (peak, peak_source) } = self;
        let mut trainer = Trainer::new(Traced::new(backend), config)?;
        let mut extras = Extras::default();
        if let Some(hf) = &hf {
            trainer.load_params(&hf.params(&trainer.model.layout)?)?;
            extras = hf.extras()?;
        }
        if let Some(ck) = &checkpoint {
            trainer.restore(&ck.snapshot(&trainer.model.layout)?)?;
            if extras.files.is_empty() {
                extras = Extras { files: ck.hf_files()?, hf_dtype: ck.state.hf_dtype.clone() };
            }
        }
        std::fs::create_dir_all(&run_dir)
            .map_err(|e| anyhow!("cannot create run directory {}: {e}", run_dir.display()))?;
        let s =
            Session { name, run_dir, peak_tflops: peak, peak_source, resumed_from: checkpoint.map(|c| c.dir), extras };
        session::run(&mut trainer, &s)?;
        Ok(())
    }
}

/// The first `runs/RECIPE[-N]` that holds no run.
fn free_run_dir(recipe: &str) -> PathBuf {
    (1..)
        .map(
            |i| {
                if i == 1 {
                    PathBuf::from(format!("runs/{recipe}"))
                } else {
                    PathBuf::from(format!("runs/{recipe}-{i}"))
                }
            },
        )
        .find(|d| !d.join("metrics.jsonl").exists())
        .expect("some name is free")
}
