//! `engine train`: runs a recipe and records every step (the loop is
//! [`engine::train::session`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Result, anyhow, bail};
use clap::Args;
use engine::backend::Backend;
use engine::backend::traced::Traced;
use engine::checkpoint::{self, Checkpoint, Extras};
use engine::config::{Config, Override};
use engine::fsutil::DirLock;
use engine::hf::HfModel;
use engine::model::Layout;
use engine::parallel::{self, rendezvous::Job};
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
    /// Train on N virtual CPU devices (threads of this process) laid out by the recipe's
    /// [mesh]: every parallel strategy without GPUs. The global batch is train.batch_size × N.
    #[arg(long, value_name = "N", default_value_t = 1)]
    devices: usize,
}

pub fn run(args: TrainArgs, device: DeviceArg) -> Result<()> {
    let extra: Vec<Override> = args
        .steps
        .map(|s| Override { text: format!("train.steps={s}"), origin: "--steps".into() })
        .into_iter()
        .collect();
    if args.devices == 0 {
        bail!("--devices 0: a run needs at least one device");
    }
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
    let job = parallel::rendezvous::discover(|k| std::env::var(k).ok())?;
    // The lead process owns the run directory from here on (or from its creation, for a new one).
    let lock = if job.rank == 0 && run_dir.is_dir() { Some(lock_run_dir(&run_dir)?) } else { None };
    let checkpoint = match resume {
        Some(explicit) => Some(checkpoint::resume_point(&run_dir.join(CHECKPOINTS), explicit, config, args.devices)?),
        None => {
            ensure_fresh(&run_dir)?;
            None
        }
    };
    // The peak for MFU is measured once the device is known.
    let mut start = Start {
        name: resolved.name.clone(),
        run_dir,
        hf,
        checkpoint,
        peak: (0.0, String::new()),
        lock: Mutex::new(lock),
    };
    if job.world > 1 {
        if args.devices > 1 {
            bail!(
                "this process is rank {} of {} ({}): a process of a job trains one device; --devices N runs N virtual devices in one process, without a launcher",
                job.rank,
                job.world,
                job.convention
            );
        }
        return start.run_job(config, &job, device);
    }
    if args.devices > 1 {
        if device == DeviceArg::Cuda {
            bail!(
                "--devices runs virtual CPU devices; on GPUs, start one process per GPU with `engine launch --nproc N -- train ...`"
            );
        }
        parallel::job::mesh(config, args.devices, 1)?;
        device::check_cpu_memory(config, args.devices)?;
        return start.run_virtual(config, args.devices);
    }
    let opened = device::open(device, Some(config))?;
    // Measured (on CPU) before the model's buffers exist, on a quiet heap.
    start.peak = device::peak(&opened, config);
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
    /// The run directory's lock, when it existed before this run (else taken on creation); the
    /// lead device's session takes it.
    lock: Mutex<Option<DirLock>>,
}

impl Start {
    fn run<B: Backend>(self, backend: B, config: &Config) -> Result<()> {
        let mut trainer = Trainer::new(Traced::new(backend), config)?;
        let session = self.prepare(&mut trainer, true)?;
        session::run(&mut trainer, &session)?;
        Ok(())
    }

    /// Runs `devices` virtual CPU devices, rank 0 reporting; the peak for MFU is measured once.
    fn run_virtual(mut self, config: &Config, devices: usize) -> Result<()> {
        self.peak = device::peak(&Opened::Cpu(engine::backend::cpu::Cpu::new()), config);
        engine::train::devices::run(config, devices, |rank, trainer| {
            let session = self.prepare(trainer, rank == 0)?;
            session::run(trainer, &session)
        })?;
        Ok(())
    }

    /// One process of a multi-process job: its GPU (the local rank), the NCCL communicator
    /// (the unique id travels with the rendezvous), and the mesh over the job's nodes.
    fn run_job(mut self, config: &Config, job: &Job, device: DeviceArg) -> Result<()> {
        let mesh = parallel::job::mesh(config, job.local_world, job.nodes())?;
        let gpu = device == DeviceArg::Cuda
            || (device == DeviceArg::Auto && engine::backend::cuda::device::probe().is_ok());
        if !gpu {
            // One CPU device per process, joined by the TCP collectives.
            device::check_cpu_memory_of_rank(config, &mesh, job.local_world)?;
            self.peak = device::peak(&Opened::Cpu(engine::backend::cpu::Cpu::new()), config);
            let comm = parallel::job::tcp_communicator(job)?;
            let mut trainer =
                Trainer::new_parallel(Traced::new(engine::backend::cpu::Cpu::new()), config, Box::new(comm), mesh)?;
            let session = self.prepare(&mut trainer, job.rank == 0)?;
            session::run(&mut trainer, &session)?;
            return Ok(());
        }
        engine::backend::cuda::check_model(&config.model).map_err(|e| anyhow!("--device cuda: {e}"))?;
        let gpu = engine::backend::cuda::Cuda::new(job.local_rank)
            .map_err(|e| anyhow!("rank {} (local rank {}): {e}", job.rank, job.local_rank))?;
        let opened = Opened::Cuda(Box::new(gpu));
        self.peak = device::peak(&opened, config);
        let Opened::Cuda(gpu) = opened else { unreachable!() };
        let comm = parallel::job::nccl_communicator(job)?;
        let mut trainer = Trainer::new_parallel(Traced::new(*gpu), config, Box::new(comm), mesh)?;
        let session = self.prepare(&mut trainer, job.rank == 0)?;
        session::run(&mut trainer, &session)?;
        Ok(())
    }

    /// Loads the starting point into `trainer` and describes the session; the lead (rank 0)
    /// creates the run directory.
    fn prepare<B: Backend>(&self, trainer: &mut Trainer<B>, lead: bool) -> Result<Session> {
        let mut extras = Extras::default();
        if let Some(hf) = &self.hf {
            trainer.load_params(&hf.params(&Layout::new(&trainer.config.model))?)?;
            extras = hf.extras()?;
        }
        if let Some(ck) = &self.checkpoint {
            trainer.resume_from(ck)?;
            if extras.files.is_empty() {
                extras = Extras { files: ck.hf_files()?, hf_dtype: ck.state.hf_dtype.clone() };
            }
        }
        let held = self.lock.lock().map_err(|_| anyhow!("a device thread panicked"))?.take();
        let lock = match (lead, held) {
            (true, Some(lock)) => Some(lock),
            (true, None) => {
                std::fs::create_dir_all(&self.run_dir)
                    .map_err(|e| anyhow!("cannot create run directory {}: {e}", self.run_dir.display()))?;
                let lock = lock_run_dir(&self.run_dir)?;
                // Checked again under the lock: another run may have started here meanwhile.
                if self.checkpoint.is_none() {
                    ensure_fresh(&self.run_dir)?;
                }
                Some(lock)
            }
            (false, _) => None,
        };
        Ok(Session {
            name: self.name.clone(),
            run_dir: self.run_dir.clone(),
            peak_tflops: self.peak.0,
            peak_source: self.peak.1.clone(),
            resumed_from: self.checkpoint.as_ref().map(|c| c.dir.clone()),
            extras,
            lead,
            lock,
        })
    }
}

/// The exclusive hold on a run directory, for this process's life.
fn lock_run_dir(run_dir: &Path) -> Result<DirLock> {
    DirLock::acquire(run_dir, "run directory", "wait for it to finish, or choose another --run-dir")
}

/// Refuses a run directory that already holds a run, unless the run resumes.
fn ensure_fresh(run_dir: &Path) -> Result<()> {
    if run_dir.join("metrics.jsonl").exists() {
        bail!(
            "run directory {} already holds a run (metrics.jsonl); continue it with --resume, or choose another --run-dir",
            run_dir.display()
        );
    }
    Ok(())
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
