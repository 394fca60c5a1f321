//! `--device auto|cpu|cuda|emulate`: the backend a command runs on, and the device's peak for
//! MFU.

use anyhow::{Result, bail};
use engine::backend::cpu::{self, Cpu};
use engine::backend::cuda::{self, Cuda, discovery};
use engine::backend::gib;
use engine::config::Config;
use engine::model::memory::Target;
use engine::parallel::plan::ParallelPlan;

/// Which device to run on.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceArg {
    /// The first CUDA GPU when the driver and a device are present, else the CPU.
    #[default]
    Auto,
    /// The f32 CPU reference.
    Cpu,
    /// The first CUDA GPU (an error when there is none).
    Cuda,
    /// The CUDA backend on the CPU emulator of a GPU: its kernels and host code, very slowly
    /// (tiny shapes; to run a GPU path, such as `tests/gpu.sh quick`, where there is no GPU).
    Emulate,
}

impl DeviceArg {
    /// `ENGINE_DEVICE`, when the flag is not given.
    pub fn from_env() -> Result<Option<DeviceArg>> {
        match std::env::var("ENGINE_DEVICE") {
            Err(_) => Ok(None),
            Ok(v) => match v.trim() {
                "auto" => Ok(Some(DeviceArg::Auto)),
                "cpu" => Ok(Some(DeviceArg::Cpu)),
                "cuda" => Ok(Some(DeviceArg::Cuda)),
                "emulate" => Ok(Some(DeviceArg::Emulate)),
                other => bail!("ENGINE_DEVICE = `{other}` is not one of auto, cpu, cuda, emulate"),
            },
        }
    }
}

/// An opened backend.
pub enum Opened {
    /// The CPU.
    Cpu(Cpu),
    /// A GPU.
    Cuda(Box<Cuda>),
}

/// The device's peak TFLOP/s for MFU and where the figure comes from: `train.peak_tflops` when
/// set; else the dense bf16 table for a GPU, or a measured f32 GEMM rate on CPU.
pub fn peak(opened: &Opened, config: &Config) -> (f64, String) {
    if config.train.peak_tflops > 0.0 {
        return (config.train.peak_tflops, "train.peak_tflops".into());
    }
    match opened {
        Opened::Cpu(_) => (cpu::measure_peak_tflops(), "measured f32 GEMM rate".into()),
        Opened::Cuda(gpu) => match gpu.peak_tflops() {
            Some(p) => (p, format!("dense bf16 of {}", gpu.info().name)),
            None => (0.0, format!("{} is not in the peak table: set train.peak_tflops for MFU", gpu.info().name)),
        },
    }
}

/// Opens the device `arg` names for training `config` (when given): on a GPU, the model must
/// suit the kernels and its estimated memory must fit.
pub fn open(arg: DeviceArg, config: Option<&Config>) -> Result<Opened> {
    let cpu = || -> Result<Opened> {
        if let Some(c) = config {
            check_cpu_memory(c, 1)?;
        }
        Ok(Opened::Cpu(Cpu::new()))
    };
    let gpu = match arg {
        DeviceArg::Cpu => return cpu(),
        DeviceArg::Emulate => {
            if let Some(c) = config {
                cuda::check_run(c).map_err(|e| anyhow::anyhow!("--device emulate: {e}"))?;
                check_cpu_memory(c, 1)?;
            }
            let backend = Cuda::emulated().map_err(|e| anyhow::anyhow!("--device emulate: {e}"))?;
            return Ok(Opened::Cuda(Box::new(backend)));
        }
        DeviceArg::Auto if discovery::probe().is_err() => return cpu(),
        DeviceArg::Auto => "a CUDA GPU was found but",
        DeviceArg::Cuda => "--device cuda:",
    };
    if let Some(c) = config {
        cuda::check_run(c).map_err(|e| anyhow::anyhow!("{gpu} {e}"))?;
    }
    let backend = Cuda::new(0).map_err(|e| {
        let hint = if arg == DeviceArg::Auto { " (--device cpu runs on the CPU)" } else { "" };
        anyhow::anyhow!("{gpu} {e}{hint}")
    })?;
    if let Some(c) = config.filter(|c| c.train.memory_check) {
        let target = Target::Cuda { sm_count: backend.info().sm_count as usize };
        let need = ParallelPlan::single(c)?.estimate(c, target).total();
        let (free, total) = backend.device_memory();
        if need > free {
            bail!(
                "training needs about {:.1} GiB of GPU memory but {} has {:.1} GiB free of {:.1} GiB: lower \
                 train.batch_size (raise train.grad_accum to keep the tokens per step), set train.remat=minimal or \
                 full (engine recipes show prints the estimates; train.memory_check=false skips this check)",
                gib(need),
                backend.info().name,
                gib(free),
                gib(total)
            );
        }
    }
    Ok(Opened::Cuda(Box::new(backend)))
}

/// Refuses a CPU run of `devices` virtual devices (one process) whose estimated memory exceeds
/// what this process can have: the available RAM (`MemAvailable`) and the address-space limit
/// (`ulimit -v`), before anything is allocated.
pub fn check_cpu_memory(c: &Config, devices: usize) -> Result<()> {
    // One device trains alone whatever the recipe's mesh says.
    let plan = if devices > 1 { ParallelPlan::resolve(c, devices, 1)? } else { ParallelPlan::single(c)? };
    check_cpu_memory_of_rank(c, &plan, devices)
}

/// Refuses a CPU device of `plan` (`c`'s) when `devices` such devices (this machine's share of
/// the job: the processes of a node, or the virtual devices of one process) would need more
/// memory than this process can have.
pub fn check_cpu_memory_of_rank(c: &Config, plan: &ParallelPlan, devices: usize) -> Result<()> {
    if !c.train.memory_check {
        return Ok(());
    }
    let one = plan.estimate(c, Target::Cpu);
    let need = one.total() as u64 * devices as u64;
    let Some((limit, what)) = engine::host::memory_limit() else { return Ok(()) };
    if need > limit {
        let per_device =
            if devices > 1 { format!(" ({devices} devices of {:.1} GiB)", gib(one.total())) } else { String::new() };
        bail!(
            "training needs about {:.1} GiB on the CPU{per_device}: parameters {:.1}, gradients {:.1}, optimizer {:.1}, \
             activations {:.1} GiB; this process can have {:.1} GiB ({what}): lower train.batch_size (raise \
             train.grad_accum to keep the tokens per step), set train.remat=minimal or full, or train a smaller model \
             (train.memory_check=false skips this check)",
            gib(need as usize),
            gib(one.parameters),
            gib(one.gradients),
            gib(one.optimizer),
            gib(one.activations),
            gib(limit as usize)
        );
    }
    Ok(())
}
