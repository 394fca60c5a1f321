//! A training run from its first step (or the checkpoint it resumes) to its summary: the step
//! loop with its evaluations, checkpoints, metrics (JSON lines and TensorBoard), the profiling
//! window and the performance summary. Generic over the backend; the `engine train` command
//! builds the trainer and calls [`run`].

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::metrics::JsonlWriter;
use super::tensorboard::EventWriter;
use super::{StepMetrics, Trainer};
use crate::backend::Backend;
use crate::backend::traced::{Traced, chrome_trace};
use crate::checkpoint::{self, Extras, Saver};
use crate::config::Config;
use crate::fsutil::write_atomic;

/// The subdirectory of a run directory holding its checkpoints.
pub const CHECKPOINTS: &str = "checkpoints";

/// What a run needs besides its trainer.
pub struct Session {
    /// The recipe's name, for messages.
    pub name: String,
    /// Where the config, metrics, event files, checkpoints and summary go.
    pub run_dir: PathBuf,
    /// Peak TFLOP/s of the device, for MFU.
    pub peak_tflops: f64,
    /// Where the peak comes from (`train.peak_tflops`, a device table, a measurement).
    pub peak_source: String,
    /// The checkpoint the trainer was restored from, if the run resumes one.
    pub resumed_from: Option<PathBuf>,
    /// Files every checkpoint carries (the Hugging Face model's config and tokenizer).
    pub extras: Extras,
    /// Whether this process or thread reports: writes the run directory's files and prints.
    /// In a parallel run, rank 0 leads and the other devices only train (and save their
    /// parts of sharded checkpoints).
    pub lead: bool,
}

/// What `summary.json` holds at the end of a run; its presence marks the run complete.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// The recipe.
    pub recipe: String,
    /// Steps run by this process.
    pub steps: u64,
    /// The step this process resumed after (0 for a fresh run).
    pub resumed_after_step: u64,
    /// Loss of the first step run.
    pub first_loss: f64,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Last validation loss, when the run evaluates.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_eval_loss: Option<f64>,
    /// Steps the performance figures leave out: the first `train.perf_warmup_steps` this process
    /// ran and the profiled one.
    pub perf_steps_excluded: usize,
    /// Median step time.
    pub median_step_time_s: f64,
    /// 90th percentile of step time.
    pub p90_step_time_s: f64,
    /// Tokens per second at the median step time.
    pub tokens_per_s: f64,
    /// TFLOP/s per device at the median step time.
    pub tflops_per_device: f64,
    /// Model FLOP utilisation at the median step time.
    pub mfu: f64,
    /// The device.
    pub device: String,
    /// Its peak TFLOP/s.
    pub peak_tflops: f64,
}

/// Runs the steps from the trainer's current step to `train.steps`; returns the summary (none
/// when there was nothing left to run).
pub fn run<B: Backend>(trainer: &mut Trainer<Traced<B>>, s: &Session) -> Result<Option<Summary>> {
    let config = trainer.config.clone();
    let (steps, first) = (config.train.steps, trainer.step);
    let run_dir = &s.run_dir;
    let checkpoints = run_dir.join(CHECKPOINTS);
    let sharded = trainer.parallel.is_some();
    let (mut metrics, mut events) = (None, None);
    if s.lead {
        write_atomic(&run_dir.join("config.toml"), toml::to_string(&config)?.as_bytes())?;
        if first > 0 {
            forget_steps_after(&run_dir.join("metrics.jsonl"), first)?;
        }
        metrics = Some(JsonlWriter::append(&run_dir.join("metrics.jsonl"))?);
        let mut writer = EventWriter::create(run_dir)?;
        if first > 0 {
            writer.session_start(first + 1)?;
        }
        events = Some(writer);
        for stale in checkpoint::remove_temporaries(&checkpoints)? {
            println!("removed {}, left by a save that did not finish", stale.display());
        }
        if first > 0 {
            for moved in checkpoint::set_aside_after(&checkpoints, first)? {
                println!("moved {} aside: it follows step {first}, which this run continues from", moved.display());
            }
        }
    }
    // A single device saves in the background; the devices of a parallel run save their
    // parts together, in the foreground.
    let mut saver = (config.train.checkpoint_every > 0 && s.lead && !sharded)
        .then(|| Saver::new(&checkpoints, &config, &trainer.model.layout, s.extras.clone()));

    let count = config.model.param_count();
    let quiet = !s.lead;
    if !quiet {
        println!(
            "training {} ({} parameters) on {}, {} tokens per step, peak {:.3} TFLOP/s ({}); run directory {}",
            s.name,
            crate::config::count::group(count.total),
            describe(trainer),
            trainer.tokens_per_step(),
            s.peak_tflops,
            s.peak_source,
            run_dir.display()
        );
        if let Some(from) = &s.resumed_from {
            println!("resuming after step {first} from {}", from.display());
        }
    }
    if first as usize >= steps {
        if !quiet {
            println!("nothing to run: step {first} reached train.steps = {steps} (raise it with --steps to train on)");
        }
        return Ok(None);
    }

    let bar = if quiet { None } else { progress_bar(steps, first) };
    let mut history: Vec<StepMetrics> = Vec::with_capacity(steps - first as usize);
    let say = |line: &str| match &bar {
        _ if quiet => {}
        Some(bar) => bar.suspend(|| println!("{line}")),
        None => println!("{line}"),
    };
    for step in first as usize + 1..=steps {
        let profiled = step == config.train.profile_step && s.lead;
        if profiled {
            trainer.backend.start();
        }
        let mut m = trainer.train_step(s.peak_tflops);
        if profiled {
            let trace = chrome_trace(&trainer.backend.stop(), &format!("{} step {step}", s.name));
            let path = run_dir.join(format!("trace-step-{step}.json"));
            write_atomic(&path, serde_json::to_string(&trace)?.as_bytes())?;
        }
        if !m.loss.is_finite() {
            bail!("step {}: the loss is {} (diverged); lower optim.lr or raise optim.warmup_steps", m.step, m.loss);
        }
        let last = step == steps;
        let every = |n: usize| n > 0 && (step.is_multiple_of(n) || last);
        if every(config.train.eval_every) {
            m.eval_loss = Some(trainer.eval_loss(config.train.eval_steps).0);
        }
        if sharded && every(config.train.checkpoint_every) {
            let start = Instant::now();
            let dir = trainer.save_sharded(&checkpoints, &s.extras)?;
            m.checkpoint_s = Some(start.elapsed().as_secs_f64());
            say(&format!(
                "saved sharded checkpoint {} (in the foreground, {:.2} s)",
                dir.display(),
                start.elapsed().as_secs_f64()
            ));
        }
        if let Some(saver) = saver.as_mut().filter(|_| every(config.train.checkpoint_every)) {
            // Waiting for the previous save first lets the snapshot reuse its (warm) buffers.
            let start = Instant::now();
            if let Some(done) = saver.wait()? {
                say(&saved_line(&done));
            }
            let snapshot = trainer.snapshot(saver.take_buffers());
            saver.submit(snapshot)?;
            m.checkpoint_s = Some(start.elapsed().as_secs_f64());
        }
        if let (Some(metrics), Some(events)) = (metrics.as_mut(), events.as_mut()) {
            metrics.write(&m)?;
            events.scalars(m.step, &scalars(&m))?;
        }
        say(&m.line(steps));
        if let Some(done) = saver.as_mut().map(Saver::poll).transpose()?.flatten() {
            say(&saved_line(&done));
        }
        if let Some(bar) = &bar {
            bar.inc(1);
        }
        history.push(m);
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if let Some(saver) = saver.as_mut()
        && let Some(done) = saver.wait()?
    {
        println!("{}", saved_line(&done));
    }
    if quiet {
        return Ok(None);
    }

    let summary = summarise(
        &s.name,
        &config,
        first,
        &history,
        describe(trainer),
        s.peak_tflops,
        trainer.flops_per_step(),
        trainer.tokens_per_step() as f64,
    );
    write_atomic(&run_dir.join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    println!(
        "done: loss {:.4} -> {:.4} in {} steps{}; step time median {:.3} s, p90 {:.3} s (leaving out {} warm-up/profiled steps); {:.0} tokens/s, {:.3} TFLOP/s, MFU {:.1}%",
        summary.first_loss,
        summary.final_loss,
        summary.steps,
        summary.final_eval_loss.map(|e| format!(", eval loss {e:.4}")).unwrap_or_default(),
        summary.median_step_time_s,
        summary.p90_step_time_s,
        summary.perf_steps_excluded,
        summary.tokens_per_s,
        summary.tflops_per_device,
        100.0 * summary.mfu
    );
    Ok(Some(summary))
}

/// The device, and the mesh in a parallel run.
fn describe<B: Backend>(trainer: &Trainer<Traced<B>>) -> String {
    match &trainer.parallel {
        None => trainer.backend.describe(),
        Some(p) => {
            let [d, f, t] = [0, 1, 2].map(|a| p.mesh.ici[a] * p.mesh.dcn[a]);
            format!("{} x {} (mesh data {d} x fsdp {f} x tensor {t})", p.mesh.devices(), trainer.backend.describe())
        }
    }
}

fn saved_line(done: &checkpoint::SaveReport) -> String {
    format!("saved checkpoint {} (written in {:.2} s in the background)", done.dir.display(), done.write_s)
}

/// The TensorBoard scalars of a step.
fn scalars(m: &StepMetrics) -> Vec<(&'static str, f64)> {
    let mut v = vec![
        ("loss", m.loss),
        ("lr", m.lr),
        ("grad_norm", m.grad_norm),
        ("step_time_s", m.step_time_s),
        ("tokens_per_s", m.tokens_per_s),
        ("tflops", m.tflops_per_device),
        ("mfu", m.mfu),
    ];
    v.extend(m.aux_loss.map(|a| ("aux_loss", a)));
    v.extend(m.eval_loss.map(|e| ("eval_loss", e)));
    v
}

/// Drops the records of steps after `step` from a metrics file (those an interrupted run logged
/// after its last checkpoint, which the resumed run computes again).
fn forget_steps_after(path: &Path, step: u64) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    write_atomic(path, kept.as_bytes()).with_context(|| format!("cannot rewrite {}", path.display()))
}

/// The run's summary. Step times leave out the first `perf_warmup_steps` steps this process ran
/// and the profiled one, unless that would leave nothing.
fn summarise(
    recipe: &str,
    config: &Config,
    first: u64,
    history: &[StepMetrics],
    device: String,
    peak_tflops: f64,
    flops_per_step: f64,
    tokens_per_step: f64,
) -> Summary {
    let t = &config.train;
    let kept: Vec<f64> = history
        .iter()
        .filter(|m| (m.step - first) as usize > t.perf_warmup_steps && m.step as usize != t.profile_step)
        .map(|m| m.step_time_s)
        .collect();
    let mut times = if kept.is_empty() { history.iter().map(|m| m.step_time_s).collect() } else { kept };
    let excluded = history.len() - times.len();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p90 = times[((times.len() as f64 * 0.9).ceil() as usize).clamp(1, times.len()) - 1];
    let tflops = flops_per_step / median / 1e12;
    Summary {
        recipe: recipe.to_owned(),
        steps: history.len() as u64,
        resumed_after_step: first,
        first_loss: history[0].loss,
        final_loss: history[history.len() - 1].loss,
        final_eval_loss: history.iter().rev().find_map(|m| m.eval_loss),
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
fn progress_bar(steps: usize, done: u64) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::new(steps as u64);
    bar.set_position(done);
    bar.set_style(
        ProgressStyle::with_template("{bar:40.cyan/blue} {pos}/{len} steps  elapsed {elapsed}  eta {eta}")
            .expect("valid template"),
    );
    Some(bar)
}
