//! `engine test-all` (the image's `test-all`) and `engine baselines create` (docs/test-all.md);
//! the checks are [`engine::testall`]. Exit codes: 0 every check passed or was skipped, 1 some
//! check failed, 2 bad input (a filter matching no check, a missing or bad baselines file,
//! `--emulate` without a C++ compiler).

use std::path::PathBuf;
use std::time::{Instant, SystemTime};

use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use engine::backend::cuda::{discovery, emulator};
use engine::say;
use engine::testall::baselines::{self, Reference, rfc3339_utc};
use engine::testall::{self, Ctx, Mode, Status, Target, report};

use super::device::DeviceArg;

#[derive(Args)]
pub struct TestAllArgs {
    /// Fewer steps: the whole suite in under a minute on two CPU cores.
    #[arg(long)]
    quick: bool,
    /// Run only the checks whose name contains PATTERN, or matches it as a glob when it holds
    /// `*` or `?` (repeatable: a check runs when any pattern selects it).
    #[arg(long, value_name = "PATTERN")]
    filter: Vec<String>,
    /// Directory of the baselines (DIR/cpu/quick.json, ...) [default: $ENGINE_BASELINES, else
    /// /opt/engine/baselines when it exists, else tests/baselines above the binary or the
    /// working directory].
    #[arg(long, value_name = "DIR")]
    baselines: Option<PathBuf>,
    /// Also write DIR/junit.xml (JUnit XML), DIR/summary.json and DIR/report.html (a page that
    /// opens offline: the loss curves over their baselines' bands, the measured figures).
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// The image this runs in, for the report (e.g. REPO@sha256:DIGEST; the image cannot know its
    /// own digest) [env: ENGINE_IMAGE].
    #[arg(long, value_name = "REF")]
    image: Option<String>,
    /// List the checks and exit.
    #[arg(long)]
    list: bool,
    /// Run the GPU class of checks on the CPU emulator of a GPU (the CUDA backend's host code and
    /// kernel sources, bf16 arithmetic), against the CPU baselines within the bf16 tolerance.
    /// Needs a C++20 compiler (`CXX`); slow.
    #[arg(long)]
    emulate: bool,
}

#[derive(Subcommand)]
pub enum BaselinesCommand {
    /// Record the loss curves and throughput test-all compares with, on this device (median of
    /// several runs), as DIR/CLASS/MODE.json.
    Create(CreateArgs),
}

#[derive(Args)]
pub struct CreateArgs {
    /// Directory to write into [default: $ENGINE_BASELINES, else tests/baselines].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Runs to take the medians over.
    #[arg(long, default_value_t = 3, value_name = "K")]
    runs: usize,
    /// Record the quick mode's curves.
    #[arg(long, conflicts_with = "full")]
    quick: bool,
    /// Record the full mode's curves (the default).
    #[arg(long)]
    full: bool,
}

/// The target `arg` selects: a GPU when asked for (an error without one) or, with `auto`, when
/// the CUDA driver finds one; else the CPU.
fn target(arg: DeviceArg) -> Result<Target> {
    Ok(match arg {
        DeviceArg::Cpu => Target::Cpu,
        DeviceArg::Cuda => match discovery::probe() {
            Ok(_) => Target::Gpu,
            Err(e) => bail!("--device cuda: no usable CUDA GPU ({e})"),
        },
        DeviceArg::Auto => match discovery::probe() {
            Ok(_) => Target::Gpu,
            Err(_) => Target::Cpu,
        },
        DeviceArg::Emulate => bail!("test-all --device emulate: use --emulate (the emulator's own shrunk suite)"),
    })
}

/// `--emulate`: the emulator, which takes the place of the device (an explicit other device is
/// a contradiction) and needs a C++ compiler.
fn emulated_target(arg: DeviceArg) -> Result<Target> {
    if arg != DeviceArg::Auto {
        let name = match arg {
            DeviceArg::Cpu => "cpu",
            DeviceArg::Emulate => "emulate",
            _ => "cuda",
        };
        bail!(
            "--emulate runs the checks on the CPU emulator of a GPU, not on --device {name} (given by --device or ENGINE_DEVICE): leave the device at auto"
        );
    }
    if !emulator::compiler_available() {
        bail!("--emulate: the CPU emulator needs a C++20 compiler and none was found (install g++ or set CXX)");
    }
    // A misspelt test hook is bad input now, not a failure of every check later.
    emulator::Fault::from_env()?;
    Ok(Target::Emulator)
}

fn mode(quick: bool) -> Mode {
    if quick { Mode::Quick } else { Mode::Full }
}

pub fn run(args: TestAllArgs, device: DeviceArg) -> Result<()> {
    if args.list {
        for c in testall::checks() {
            println!("{}", c.name);
        }
        return Ok(());
    }
    let selected = testall::select(&args.filter)?;
    let target = if args.emulate { emulated_target(device)? } else { target(device)? };
    let mode = mode(args.quick);
    let reference: Option<Reference> = if selected.iter().any(|c| c.needs_baselines) {
        let dir = match &args.baselines {
            Some(d) => d.clone(),
            None => baselines::default_dir()?,
        };
        Some(baselines::reference(&dir, target, mode)?)
    } else {
        None
    };
    if let Some(dir) = &args.report {
        // Fail on an unusable report directory now, not after the checks.
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("--report {}: {e}", dir.display()))?;
    }

    let started = rfc3339_utc(SystemTime::now());
    let start = Instant::now();
    println!(
        "test-all ({} mode) on {}: {} check(s){}",
        mode.name(),
        target.describe(),
        selected.len(),
        reference
            .as_ref()
            .map(|r| format!(
                "; reference: {} {} (recorded {} on {})",
                r.label(),
                r.file.path.display(),
                r.file.created,
                r.file.device
            ))
            .unwrap_or_default()
    );
    println!("{}", report::header());
    let hook = baselines::hook_entries();
    if !hook.is_empty() {
        say!("{}: the curves are trained with {} as well (a test hook)", baselines::CURVE_HOOK, hook.join(" "));
    }
    let mut progress = |line: &str| say!("{line}");
    let mut ctx = Ctx::new(mode, target, reference.as_ref(), &mut progress);
    let outcomes = testall::run(&mut ctx, &selected, &mut |o| println!("{}", report::row(o)));
    let seconds = start.elapsed().as_secs_f64();
    let mut summary = report::Summary::new(mode, target, reference.as_ref(), started, seconds, &outcomes);
    summary.image = args.image.or_else(|| std::env::var("ENGINE_IMAGE").ok()).filter(|i| !i.trim().is_empty());
    println!("\n{} passed, {} failed, {} skipped in {seconds:.1} s", summary.passed, summary.failed, summary.skipped);
    for o in outcomes.iter().filter(|o| o.status == Status::Fail) {
        println!("FAILED {}: {}", o.name, o.detail);
    }
    if let Some(dir) = &args.report {
        engine::testall::write_report(dir, &summary)?;
        println!(
            "report: {}, {} and {}",
            dir.join(report::HTML).display(),
            dir.join("junit.xml").display(),
            dir.join("summary.json").display()
        );
    }
    if summary.failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}

pub fn baselines(cmd: BaselinesCommand, device: DeviceArg) -> Result<()> {
    let BaselinesCommand::Create(args) = cmd;
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    let target = target(device)?;
    let mode = mode(args.quick);
    let dir = args
        .out
        .or_else(|| std::env::var_os(baselines::ENV).filter(|d| !d.is_empty()).map(PathBuf::from))
        .unwrap_or("tests/baselines".into());
    println!("recording {} baselines on {} ({} runs)", mode.name(), target.describe(), args.runs);
    let path = baselines::create(&dir, target, mode, args.runs, &mut |line| say!("{line}"))?;
    println!("wrote {}", path.display());
    Ok(())
}
