//! `engine train`: runs a recipe and records every step.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;
use engine::backend::Backend;
use engine::backend::cpu::{self, Cpu};
use engine::config::Override;
use engine::fsutil::write_atomic;
use engine::train::metrics::JsonlWriter;
use engine::train::{StepMetrics, Trainer};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::RecipeArgs;
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
    median_step_time_s: f64,
    tokens_per_s: f64,
    mfu: f64,
    device: String,
    peak_tflops: f64,
}

pub fn run(args: TrainArgs) -> Result<()> {
    let extra: Vec<Override> = args
        .steps
        .map(|s| Override { text: format!("train.steps={s}"), origin: "--steps".into() })
        .into_iter()
        .collect();
    let resolved = args.recipe.resolve(&extra)?;
    let config = &resolved.config;

    // Everything that can fail on bad input fails before the run directory exists.
    let mut trainer = Trainer::new(Cpu::new(), config)?;
    let run_dir = prepare_run_dir(args.run_dir.as_deref(), &resolved.name)?;
    let peak = if config.train.peak_tflops > 0.0 { config.train.peak_tflops } else { cpu::measure_peak_tflops() };
    write_atomic(&run_dir.join("config.toml"), toml::to_string(config)?.as_bytes())?;
    let mut metrics = JsonlWriter::append(&run_dir.join("metrics.jsonl"))?;

    let count = config.model.param_count();
    println!(
        "training {} ({} parameters) on {}, {} tokens per step, peak {:.3} TFLOP/s{}; run directory {}",
        resolved.name,
        group(count.total),
        trainer.backend.describe(),
        trainer.tokens_per_step(),
        peak,
        if config.train.peak_tflops > 0.0 { " (train.peak_tflops)" } else { " (measured f32 GEMM rate)" },
        run_dir.display()
    );
    let steps = config.train.steps;
    let bar = progress_bar(steps);
    let mut history: Vec<StepMetrics> = Vec::with_capacity(steps);
    for _ in 0..steps {
        let m = trainer.train_step(peak);
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
    if let (Some(first), Some(last)) = (history.first(), history.last()) {
        let summary = summarise(&resolved.name, &history, trainer.backend.describe(), peak);
        write_atomic(&run_dir.join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
        println!(
            "done: loss {:.4} -> {:.4} in {} steps; median step {:.3} s, {:.0} tokens/s, MFU {:.1}%",
            first.loss,
            last.loss,
            history.len(),
            summary.median_step_time_s,
            summary.tokens_per_s,
            100.0 * summary.mfu
        );
    }
    Ok(())
}

fn summarise(recipe: &str, history: &[StepMetrics], device: String, peak_tflops: f64) -> Summary {
    // The first step pays one-off costs (page faults, thread start-up): leave it out when others exist.
    let timed = if history.len() > 1 { &history[1..] } else { history };
    let mut times: Vec<f64> = timed.iter().map(|m| m.step_time_s).collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let last = history.last().expect("at least one step");
    Summary {
        recipe: recipe.to_owned(),
        steps: last.step,
        first_loss: history[0].loss,
        final_loss: last.loss,
        median_step_time_s: median,
        tokens_per_s: last.tokens_per_s * last.step_time_s / median,
        mfu: last.mfu * last.step_time_s / median,
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
