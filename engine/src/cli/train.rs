//! `engine train`: runs a recipe and records every step.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;
use engine::backend::Backend;
use engine::backend::traced::{Traced, chrome_trace};
use engine::config::{Override, Resolved};
use engine::fsutil::write_atomic;
use engine::train::metrics::JsonlWriter;
use engine::train::{StepMetrics, Trainer};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::RecipeArgs;
use super::device::{self, DeviceArg, Opened};
use super::recipes::group;

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    recipe: RecipeArgs,
    /// Optimizer steps to run (overrides train.steps).
    #[arg(long, value_name = "N")]
    steps: Option<usize>,
    /// Directory for the resolved config, metrics.jsonl and summary.json
    /// [default: runs/RECIPE, numbered -2, -3, ... when taken].
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
}

/// What `summary.json` holds at the end of a run; its presence marks the run complete.
#[derive(Serialize)]
struct Summary {
    recipe: String,
    steps: u64,
    first_loss: f64,
    final_loss: f64,
    /// Steps the performance figures leave out: the first `train.perf_warmup_steps` and the
    /// profiled one.
    perf_steps_excluded: usize,
    median_step_time_s: f64,
    p90_step_time_s: f64,
    tokens_per_s: f64,
    tflops_per_device: f64,
    mfu: f64,
    device: String,
    peak_tflops: f64,
}

pub fn run(args: TrainArgs, device: DeviceArg) -> Result<()> {
    let extra: Vec<Override> = args
        .steps
        .map(|s| Override { text: format!("train.steps={s}"), origin: "--steps".into() })
        .into_iter()
        .collect();
    let resolved = args.recipe.resolve(&extra)?;
    let opened = device::open(device, Some(&resolved.config))?;
    // Measured (on CPU) before the model's buffers exist, on a quiet heap.
    let peak = device::peak(&opened, &resolved.config);
    match opened {
        Opened::Cpu(be) => train_on(args, &resolved, be, peak),
        Opened::Cuda(be) => train_on(args, &resolved, *be, peak),
    }
}

fn train_on<B: Backend>(
    args: TrainArgs,
    resolved: &Resolved,
    backend: B,
    (peak, peak_source): (f64, String),
) -> Result<()> {
    let config = &resolved.config;
    // Everything that can fail on bad input fails before the run directory exists.
    let mut trainer = Trainer::new(Traced::new(backend), config)?;
    let run_dir = prepare_run_dir(args.run_dir.as_deref(), &resolved.name)?;
    write_atomic(&run_dir.join("config.toml"), toml::to_string(config)?.as_bytes())?;
    let mut metrics = JsonlWriter::append(&run_dir.join("metrics.jsonl"))?;

    let count = config.model.param_count();
    println!(
        "training {} ({} parameters) on {}, {} tokens per step, peak {:.3} TFLOP/s ({peak_source}); run directory {}",
        resolved.name,
        group(count.total),
        trainer.backend.describe(),
        trainer.tokens_per_step(),
        peak,
        run_dir.display()
    );
    let steps = config.train.steps;
    let bar = progress_bar(steps);
    let mut history: Vec<StepMetrics> = Vec::with_capacity(steps);
    for step in 1..=steps {
        let profiled = step == config.train.profile_step;
        if profiled {
            trainer.backend.start();
        }
        let m = trainer.train_step(peak);
        if profiled {
            let trace = chrome_trace(&trainer.backend.stop(), &format!("{} step {step}", resolved.name));
            let path = run_dir.join(format!("trace-step-{step}.json"));
            write_atomic(&path, serde_json::to_string(&trace)?.as_bytes())?;
        }
        if !m.loss.is_finite() {
            bail!("step {}: the loss is {} (diverged); lower optim.lr or raise optim.warmup_steps", m.step, m.loss);
        }
        metrics.write(&m)?;
        let line = m.line(steps);
        match &bar {
            Some(bar) => {
                bar.suspend(|| println!("{line}"));
                bar.inc(1);
            }
            None => println!("{line}"),
        }
        history.push(m);
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if !history.is_empty() {
        let summary =
            summarise(&resolved.name, config, &history, trainer.backend.describe(), peak, trainer.flops_per_step());
        write_atomic(&run_dir.join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
        println!(
            "done: loss {:.4} -> {:.4} in {} steps; step time median {:.3} s, p90 {:.3} s (leaving out {} warm-up/profiled steps); {:.0} tokens/s, {:.3} TFLOP/s, MFU {:.1}%",
            summary.first_loss,
            summary.final_loss,
            summary.steps,
            summary.median_step_time_s,
            summary.p90_step_time_s,
            summary.perf_steps_excluded,
            summary.tokens_per_s,
            summary.tflops_per_device,
            100.0 * summary.mfu
        );
    }
    Ok(())
}

/// The run's summary. Step times leave out the first `perf_warmup_steps` steps and the profiled
/// one, unless that would leave nothing.
fn summarise(
    recipe: &str,
    config: &engine::config::Config,
    history: &[StepMetrics],
    device: String,
    peak_tflops: f64,
    flops_per_step: f64,
) -> Summary {
    let t = &config.train;
    let kept: Vec<f64> = history
        .iter()
        .filter(|m| m.step as usize > t.perf_warmup_steps && m.step as usize != t.profile_step)
        .map(|m| m.step_time_s)
        .collect();
    let mut times = if kept.is_empty() { history.iter().map(|m| m.step_time_s).collect() } else { kept };
    let excluded = history.len() - times.len();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p90 = times[((times.len() as f64 * 0.9).ceil() as usize).clamp(1, times.len()) - 1];
    let tokens_per_step = (t.batch_size * t.seq_len * t.grad_accum) as f64;
    let tflops = flops_per_step / median / 1e12;
    Summary {
        recipe: recipe.to_owned(),
        steps: history.len() as u64,
        first_loss: history[0].loss,
        final_loss: history[history.len() - 1].loss,
        perf_steps_excluded: excluded,
        median_step_time_s: median,
        p90_step_time_s: p90,
        tokens_per_s: tokens_per_step / median,
        tflops_per_device: tflops,
        mfu: if peak_tflops > 0.0 { tflops / peak_tflops } else { 0.0 },
        device,
        peak_tflops,
    }
}

/// A progress bar on an interactive terminal; none otherwise (plain lines only).
fn progress_bar(steps: usize) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40.cyan/blue} {pos}/{len} steps  elapsed {elapsed}  eta {eta}")
            .expect("valid template"),
    );
    Some(bar)
}

/// The run directory: the one asked for (which must not hold a run already), or the first free
/// `runs/RECIPE[-N]`.
fn prepare_run_dir(asked: Option<&Path>, recipe: &str) -> Result<PathBuf> {
    let holds_run = |dir: &Path| dir.join("metrics.jsonl").exists();
    let dir = match asked {
        Some(dir) => {
            if holds_run(dir) {
                bail!("run directory {} already holds a run (metrics.jsonl); choose another --run-dir", dir.display());
            }
            dir.to_path_buf()
        }
        None => (1..)
            .map(|i| {
                if i == 1 {
                    PathBuf::from(format!("runs/{recipe}"))
                } else {
                    PathBuf::from(format!("runs/{recipe}-{i}"))
                }
            })
            .find(|d| !holds_run(d))
            .expect("some name is free"),
    };
    std::fs::create_dir_all(&dir).map_err(|e| anyhow::anyhow!("cannot create run directory {}: {e}", dir.display()))?;
    Ok(dir)
}
