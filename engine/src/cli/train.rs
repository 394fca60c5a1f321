//! `engine train`: runs a recipe and records every step (the loop is
//! [`engine::train::session`]).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Result, anyhow, bail};
use clap::Args;
use engine::backend::Backend;
use engine::backend::traced::Traced;
use engine::checkpoint::{Checkpoint, Extras};
use engine::config::{Config, Override};
use engine::hf::HfModel;
use engine::model::Layout;
use engine::parallel::comm::Collectives;
use engine::parallel::{self, flight, rendezvous::Job};
use engine::train::Trainer;
use engine::train::goodput::{Startup, timed};
use engine::train::local_tier::LocalTier;
use engine::train::run_dir::{Decision, Resume, RunDir};
use engine::train::session::{self, Session};
use engine::train::signals::{self, STOPPED_EXIT, StopRequest, Stopped};

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
    /// summary.json [default: runs/RECIPE, numbered -2, -3, ... when taken; runs/RECIPE for
    /// every process of a multi-process job].
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// Continue the run in --run-dir from its newest complete checkpoint, or from checkpoint
    /// CKPT (whose run directory is then the default). --resume=auto: from the newest complete
    /// checkpoint if there is one, else start fresh there (what a restarted job runs).
    #[arg(long, value_name = "CKPT|auto", num_args = 0..=1)]
    #[allow(clippy::option_option)] // absent; present without a value (newest); with one
    resume: Option<Option<PathBuf>>,
    /// With --resume: start the optimizer's state afresh (AdamW's moments, Muon's momentum, all
    /// zero) instead of the checkpoint's, which lets the [optim] keys differ from the
    /// checkpoint's (switching between AdamW and Muon). The parameters, step, schedule and data
    /// position continue; AdamW's bias correction continues from the run's step count.
    #[arg(long)]
    reset_optimizer: bool,
    /// Start from a Hugging Face model (full fine-tuning): DIR/config.json replaces the recipe's
    /// [model] and the weights replace the initialisation.
    #[arg(long, value_name = "DIR")]
    init_from_hf: Option<PathBuf>,
    /// Train on N virtual CPU devices (threads of this process) laid out by the recipe's
    /// [mesh]: every parallel strategy without GPUs. The global batch is train.batch_size × N.
    #[arg(long, value_name = "N", default_value_t = 1)]
    devices: usize,
}

/// `engine train`. SIGTERM, SIGUSR1 and SIGINT stop the run after the step in progress with a
/// checkpoint of it, and the command exits with [`STOPPED_EXIT`]; a second signal exits at once
/// ([`signals`]).
pub fn run(args: TrainArgs, device: DeviceArg) -> Result<()> {
    signals::install()?;
    // SIGUSR2 asks a job's ranks for their flight records; a rank of a multi-process job
    // installs the recorder's handler in place of this one. Here it must not end the run.
    signals::on_sigusr2(|| {
        engine::say!("engine: SIGUSR2: this process keeps no flight record (a job's ranks do); training on")
    })?;
    match train(args, device) {
        Err(e) => match e.downcast_ref::<Stopped>() {
            Some(stopped) => {
                engine::say!("engine: {stopped}");
                std::process::exit(STOPPED_EXIT.into())
            }
            None => Err(e),
        },
        done => done,
    }
}

fn train(args: TrainArgs, device: DeviceArg) -> Result<()> {
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
            if let Some(key) = resolved.provenance.iter().find(|(k, o)| k.starts_with("model.") && !o.is_recipe()) {
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

    // Everything that can fail on bad input fails before the run directory is created (a
    // default one is claimed just before the run starts).
    let resume = Resume::of(args.resume.as_ref().map(Option::as_deref));
    if args.reset_optimizer && resume == Resume::No {
        bail!("--reset-optimizer resets a resumed run's optimizer state: add --resume (or --resume=auto)");
    }
    let job = parallel::rendezvous::discover(|k| std::env::var(k).ok())?;
    let default = RunDir::default_path(&resolved.name);
    let (path, claim) = match (&args.run_dir, &resume) {
        (Some(dir), _) => (dir.clone(), None),
        (None, Resume::From(ck)) => {
            (ck.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_default(), None)
        }
        (None, Resume::Newest) => bail!("--resume needs --run-dir DIR (the run to continue) or a checkpoint path"),
        (None, Resume::Auto) => bail!("--resume=auto needs --run-dir DIR (the run to continue or start)"),
        // The processes of a job cannot each take the first free name: they share runs/RECIPE.
        (None, Resume::No) if job.world > 1 => (default, None),
        (None, Resume::No) => (default.clone(), Some(default)),
    };
    let mut run_dir = RunDir::at(path).resetting_optimizer(args.reset_optimizer);
    // The lead process owns the run directory from here on (or from its creation, for a new one).
    if job.rank == 0 && claim.is_none() && run_dir.path().is_dir() {
        run_dir.lock()?;
    }
    // Every process of a job decides alike, reading the same directory.
    // Finding and verifying the checkpoint is the first part of loading it. With the local tier
    // under --resume=auto, the persistent tier's newest checkpoint is only named here, and read
    // and verified in `Start::prepare` if the local tier has no step as new: a restart from
    // node-local copies does not read shared storage.
    let auto = resume == Resume::Auto;
    let deferred = match (auto && config.train.local_checkpoint_every > 0, &claim) {
        (true, None) => engine::checkpoint::list(&run_dir.checkpoints())?.last().map(|(step, _)| *step),
        _ => None,
    };
    let (decision, decided_s) = timed(|| match claim {
        Some(_) => Ok(Decision::Fresh { restart: false }),
        None if deferred.is_some() => Ok(Decision::Fresh { restart: false }),
        None => run_dir.decide(&resume, config, args.devices * job.world),
    });
    let decision = decision?;
    let (checkpoint, restart) = match decision {
        Decision::Fresh { restart } => (None, restart),
        Decision::Resume(ck) => (Some(*ck), false),
    };
    let checkpoint_load_s = if checkpoint.is_some() { decided_s } else { 0.0 };
    // The peak for MFU is measured once the device is known.
    let mut start = Start {
        name: resolved.name.clone(),
        run_dir: Mutex::new(run_dir),
        claim,
        restart,
        auto,
        deferred,
        hf,
        checkpoint,
        peak: (0.0, String::new()),
        startup: Startup { checkpoint_load_s, ..Startup::default() },
        reset_optimizer: args.reset_optimizer,
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
        if matches!(device, DeviceArg::Cuda | DeviceArg::Emulate) {
            bail!(
                "--devices runs virtual CPU devices; on GPUs, start one process per GPU with `engine launch --nproc N -- train ...`"
            );
        }
        device::check_cpu_memory(config, args.devices)?;
        return start.run_virtual(config, args.devices);
    }
    let (opened, opened_s) = timed(|| device::open(device, Some(config)));
    let opened = opened?;
    // Measured (on CPU) before the model's buffers exist, on a quiet heap.
    let peak_s;
    (start.peak, peak_s) = timed(|| device::peak(&opened, config));
    start.startup.device_setup_s += opened_s + peak_s;
    match opened {
        Opened::Cpu(be) => start.run(be, config),
        Opened::Cuda(be) => start.run(*be, config),
    }
}

/// What a run starts from, once everything that can fail on bad input has been checked.
struct Start {
    name: String,
    /// The run directory, with its lock when it existed before this run or was claimed (else
    /// taken on creation); the lead device's session takes it.
    run_dir: Mutex<RunDir>,
    /// Without --run-dir (one process): `runs/RECIPE`, of which the first free of it, `-2`,
    /// `-3`, ... is claimed just before the run starts ([`Start::claim`]).
    claim: Option<PathBuf>,
    /// Whether a fresh start replaces an earlier attempt that saved no checkpoint
    /// (`--resume=auto`).
    restart: bool,
    /// `--resume=auto`: the local tier may hold a newer step than `checkpoint`.
    auto: bool,
    /// Under `--resume=auto` with the local tier: the persistent tier's newest step, whose
    /// checkpoint is verified and read only if the local tier has no step as new.
    deferred: Option<u64>,
    hf: Option<HfModel>,
    checkpoint: Option<Checkpoint>,
    peak: (f64, String),
    /// The parts of the start-up measured so far (the goodput timeline's start record).
    startup: Startup,
    /// `--reset-optimizer`: the optimizer's state starts afresh after the resume.
    reset_optimizer: bool,
}

impl Start {
    /// Claims the default run directory (created and locked at once, so that runs started
    /// together take one each), when no --run-dir was given.
    fn claim(&mut self) -> Result<()> {
        if let Some(base) = self.claim.take() {
            let claimed = RunDir::claim(&base)?;
            *self.run_dir.get_mut().map_err(|_| anyhow!("a device thread panicked"))? = claimed;
        }
        Ok(())
    }

    fn run<B: Backend>(mut self, backend: B, config: &Config) -> Result<()> {
        self.claim()?;
        let (trainer, allocated_s) = timed(|| Trainer::new(Traced::new(backend), config));
        let mut trainer = trainer?;
        self.startup.device_setup_s += allocated_s;
        let session = self.prepare(&mut trainer, true, 1)?;
        session::run(&mut trainer, &session)?;
        Ok(())
    }

    /// Runs `devices` virtual CPU devices, rank 0 reporting; the peak for MFU is measured once.
    fn run_virtual(mut self, config: &Config, devices: usize) -> Result<()> {
        self.claim()?;
        let peak_s;
        (self.peak, peak_s) = timed(|| device::peak(&Opened::Cpu(engine::backend::cpu::Cpu::new()), config));
        self.startup.device_setup_s += peak_s;
        engine::train::devices::run(config, devices, |rank, trainer| {
            let session = self.prepare(trainer, rank == 0, devices)?;
            session::run(trainer, &session)
        })?;
        Ok(())
    }

    /// One process of a multi-process job, with the parallel plan over the job's nodes: on a
    /// GPU (the local rank) joined by NCCL (the unique id travels with the rendezvous), or on
    /// the CPU joined by the TCP collectives.
    fn run_job(mut self, config: &Config, job: &Job, device: DeviceArg) -> Result<()> {
        let plan = parallel::plan::ParallelPlan::resolve(config, job.local_world, job.nodes())?;
        if device == DeviceArg::Emulate {
            bail!("--device emulate runs one process; a launched job runs on GPUs (cuda) or the CPU (cpu)");
        }
        let gpu = device == DeviceArg::Cuda
            || (device == DeviceArg::Auto && engine::backend::cuda::discovery::probe().is_ok());
        if !gpu {
            device::check_cpu_memory_of_rank(config, &plan, job.local_world)?;
            let peak_s;
            (self.peak, peak_s) = timed(|| device::peak(&Opened::Cpu(engine::backend::cpu::Cpu::new()), config));
            self.startup.device_setup_s += peak_s;
            let (comm, rendezvous_s) = timed(|| {
                signals::exit_on_stop_during("during the rendezvous", || parallel::job::tcp_communicator(job, config))
            });
            self.startup.rendezvous_s += rendezvous_s;
            let comm = self.recorded(comm?, config, job)?;
            return self.run_rank(engine::backend::cpu::Cpu::new(), comm, config, plan, job);
        }
        engine::backend::cuda::check_run(config).map_err(|e| anyhow!("--device cuda: {e}"))?;
        let (gpu, gpu_s) = timed(|| engine::backend::cuda::Cuda::new(job.local_rank));
        let gpu = gpu.map_err(|e| anyhow!("rank {} (local rank {}): {e}", job.rank, job.local_rank))?;
        let opened = Opened::Cuda(Box::new(gpu));
        let peak_s;
        (self.peak, peak_s) = timed(|| device::peak(&opened, config));
        self.startup.device_setup_s += gpu_s + peak_s;
        let Opened::Cuda(gpu) = opened else { unreachable!() };
        let (comm, rendezvous_s) = timed(|| {
            signals::exit_on_stop_during("during the rendezvous", || parallel::job::nccl_communicator(job, config))
        });
        self.startup.rendezvous_s += rendezvous_s;
        let comm = self.recorded(comm?, config, job)?;
        self.run_rank(*gpu, comm, config, plan, job)
    }

    /// This rank's collectives with the flight recorder around them: it writes
    /// `RUN_DIR/flight/rank-R.json` when a watchdog fails the rank, and on SIGUSR2 (unless
    /// `train.diagnostics.flight_recorder = 0`), and times the waits the straggler detector
    /// subtracts (unless its window is 0 too, when nothing is wrapped).
    fn recorded<B: Backend, C: Collectives<Traced<B>> + Send + 'static>(
        &self,
        comm: C,
        config: &Config,
        job: &Job,
    ) -> Result<Box<dyn Collectives<Traced<B>> + Send>> {
        let diagnostics = &config.train.diagnostics;
        let capacity = diagnostics.flight_recorder;
        if capacity == 0 && diagnostics.straggler_window == 0 {
            return Ok(Box::new(comm));
        }
        let run_dir = self.run_dir.lock().map_err(|_| anyhow!("a device thread panicked"))?.path().to_path_buf();
        let recorder = flight::Recorder::new(job.rank, job.world, capacity, Some(run_dir.join(flight::DIR)));
        if capacity > 0 {
            flight::install(recorder.clone());
            signals::on_sigusr2(|| {
                flight::dump_process("SIGUSR2", &[], false);
            })?;
        }
        Ok(Box::new(flight::Flight::new(comm, recorder)?))
    }

    /// Trains this rank of a job; rank 0 ends with the bytes it sent, where the communicator
    /// counts them.
    fn run_rank<B: Backend>(
        mut self,
        backend: B,
        comm: Box<dyn Collectives<Traced<B>> + Send>,
        config: &Config,
        plan: parallel::plan::ParallelPlan,
        job: &Job,
    ) -> Result<()> {
        let (trainer, allocated_s) = timed(|| Trainer::new_parallel(Traced::new(backend), config, comm, plan));
        let mut trainer = trainer?;
        self.startup.device_setup_s += allocated_s;
        let session = self.prepare(&mut trainer, job.rank == 0, job.local_world)?;
        let first = trainer.step;
        session::run(&mut trainer, &session)?;
        let steps = trainer.step - first;
        if let (0, Some(sent), 1..) = (job.rank, trainer.parallel.bytes_sent(), steps) {
            let mib = sent as f64 / (1 << 20) as f64;
            engine::out!("collectives: rank 0 sent {mib:.3} MiB to its peers, {:.3} MiB per step", mib / steps as f64);
        }
        Ok(())
    }

    /// Loads the starting point into `trainer` and describes the session; the lead (rank 0)
    /// creates the run directory. Under `--resume=auto` the local tier's newest step that
    /// every rank can restore replaces the persistent checkpoint when it is at least as new
    /// (`local_world`: the ranks of this node).
    fn prepare<B: Backend>(&self, trainer: &mut Trainer<B>, lead: bool, local_world: usize) -> Result<Session> {
        let mut extras = Extras::default();
        if let Some(hf) = &self.hf {
            trainer.load_params(&hf.params(&Layout::new(&trainer.config.model))?)?;
            extras = hf.extras()?;
        }
        let mut startup = self.startup;
        let run_path = self.run_dir.lock().map_err(|_| anyhow!("a device thread panicked"))?.path().to_path_buf();
        let mut local = LocalTier::open(trainer, &run_path, local_world)?;
        let mut restored = None;
        if let Some(tier) = local.as_mut().filter(|_| self.auto && RunDir::at(&run_path).holds_run()) {
            let persistent = self.checkpoint.as_ref().map(|ck| ck.state.step).or(self.deferred);
            let (found, took) = timed(|| tier.restore(trainer, persistent, lead));
            restored = found?;
            startup.checkpoint_load_s += took;
        }
        let mut verified = None;
        if restored.is_none() && self.deferred.is_some() {
            let devices = trainer.devices();
            let (decision, took) = timed(|| RunDir::at(&run_path).decide(&Resume::Auto, &trainer.config, devices));
            startup.checkpoint_load_s += took;
            if let Decision::Resume(ck) = decision? {
                verified = Some(*ck);
            }
        }
        let checkpoint = restored.as_ref().or(verified.as_ref()).or(self.checkpoint.as_ref());
        if let Some(ck) = checkpoint {
            let (resumed, read_s) = timed(|| trainer.resume_from(ck));
            resumed?;
            if self.reset_optimizer {
                trainer.reset_optimizer();
            }
            startup.checkpoint_load_s += read_s;
            if extras.files.is_empty() {
                extras = Extras { files: ck.hf_files()?, hf_dtype: ck.state.hf_dtype.clone() };
            }
        }
        let mut run_dir = {
            let mut shared = self.run_dir.lock().map_err(|_| anyhow!("a device thread panicked"))?;
            let held = if lead { shared.take_lock() } else { None };
            shared.unlocked().with_lock(held)
        };
        if lead && !run_dir.is_locked() {
            run_dir.create()?;
            // Checked again under the lock: another run may have started here meanwhile.
            if checkpoint.is_none() && !self.restart {
                run_dir.ensure_fresh()?;
            }
        }
        if let Some(tier) = &mut local {
            tier.discard_after(trainer.step)?;
            tier.extras = std::sync::Arc::new(extras.clone());
        }
        Ok(Session {
            name: self.name.clone(),
            run_dir,
            peak_tflops: self.peak.0,
            peak_source: self.peak.1.clone(),
            resumed_from: checkpoint.map(|c| c.dir.clone()),
            extras,
            lead,
            stop: StopRequest::signals(),
            startup,
            local_tier: local,
        })
    }
}
