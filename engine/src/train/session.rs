//! A training run from its first step (or the checkpoint it resumes) to its summary: the step
//! loop with its evaluations, checkpoints, metrics (JSON lines and TensorBoard), the profiling
//! window and the performance summary. Generic over the backend; the `engine train` command
//! builds the trainer and calls [`run`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde::Serialize;

use super::checkpointer::{Checkpointer, SaveReport};
use super::goodput::{self, Startup, Timeline};
use super::local_saver::LocalSaver;
use super::local_tier::LocalTier;
use super::logger::MetricsLogger;
pub use super::run_dir::CHECKPOINTS;
use super::run_dir::{self, RunDir};
use super::signals::{StopRequest, Stopped};
use super::step_times::StepTimes;
use super::stragglers::Stragglers;
use super::{StepMetrics, Trainer};
use crate::backend::Backend;
use crate::backend::traced::{Traced, chrome_trace};
use crate::checkpoint::{self, Extras};
use crate::config::Config;
use crate::fsutil::write_atomic;

/// What a run needs besides its trainer.
pub struct Session {
    /// The recipe's name, for messages.
    pub name: String,
    /// Where the config, metrics, event files, checkpoints and summary go. The lead holds its
    /// lock, for the run's life: a second process training or resuming there is refused instead
    /// of mixing its files with this run's.
    pub run_dir: RunDir,
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
    /// Where the run learns that it is asked to stop (SIGTERM, SIGUSR1, SIGINT): it stops after
    /// the step in progress, which every rank agrees on, with a checkpoint of it.
    pub stop: StopRequest,
    /// How long this attempt took to start, by part (the goodput timeline's start record).
    pub startup: Startup,
    /// The local tier of checkpoints, when `train.local_checkpoint_every` is set.
    pub local_tier: Option<LocalTier>,
}

/// What `summary.json` holds at the end of a run; its presence marks the run complete.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// The recipe's name.
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
    /// With a mixture of datasets: the tokens trained on from each source by the end of the
    /// run (from its start, across resumptions), by source name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_by_source: Option<std::collections::BTreeMap<String, u64>>,
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
    /// The device as the backend describes it, with the mesh in a parallel run.
    pub device: String,
    /// Its peak TFLOP/s.
    pub peak_tflops: f64,
    /// The most memory any device of the run held for its buffers and scratch
    /// ([`Backend::peak_memory_bytes`]).
    pub peak_memory_bytes: u64,
    /// Each device's high-water mark, in rank order.
    pub peak_memory_bytes_per_device: Vec<u64>,
    /// Goodput (productive ÷ wall) and badput by cause, for this attempt and the whole run
    /// across its restarts ([`goodput`]; `engine goodput RUN_DIR` prints the table).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goodput: Option<goodput::Summary>,
}

/// Runs the steps from the trainer's current step to `train.steps`; returns the summary (none
/// when there was nothing left to run, and on every device but the lead).
///
/// Each step is the trainer's step followed by the parts that own the rest: the profiler (one
/// step's trace), the evaluation, the checkpoint manager ([`Checkpointer`]) and the metrics
/// logger ([`MetricsLogger`]).
///
/// At every step boundary the devices exchange one number each ([`agree`]): whether a signal
/// asked this one to stop, whether rank 0's clock says a checkpoint is due
/// (`train.checkpoint_every_minutes`), and its step time. So every rank stops after the same
/// step, saves the same steps, and the lead learns the slowest rank. A run stopped on request
/// saves a checkpoint of the step it stopped after, waits for it, and ends with [`Stopped`]. An
/// evaluation (`train.eval_steps` batches, which may take long) looks for a stop request between
/// its batches, every rank before the same batch: a request abandons it (no `eval_loss` for that
/// step, a line says so) and stops the run after that step. A `train.eval_steps` that reads more
/// validation samples than there are is refused before the first step.
pub fn run<B: Backend>(trainer: &mut Trainer<Traced<B>>, s: &Session) -> Result<Option<Summary>> {
    let config = trainer.config.clone();
    let (steps, first) = (config.train.steps, trainer.step);
    let devices = trainer.devices();
    if config.train.eval_every > 0 {
        // Every rank refuses alike, before its first collective.
        trainer.check_eval_steps()?;
    }
    if devices > 1 {
        // Every process read the run directory on its own: make sure they found the same start.
        let firsts = trainer.parallel.gather_from_world(&mut trainer.backend, first);
        if firsts.iter().any(|&f| f != first) {
            bail!(
                "the ranks start after different steps ({firsts:?}, in rank order): they found different checkpoints in {} (a save sealed while they started?); start the job again",
                s.run_dir.path().display()
            );
        }
    }
    let checkpoints = s.run_dir.checkpoints();
    // An earlier attempt that logged steps and left no checkpoint (--resume=auto starts again).
    let earlier = (s.lead && first == 0 && s.run_dir.holds_run()).then(|| s.run_dir.earlier_attempt());
    let mut log = if s.lead { MetricsLogger::open(&s.run_dir, first, steps)? } else { MetricsLogger::quiet() };
    if s.lead {
        write_atomic(&s.run_dir.join(run_dir::CONFIG), toml::to_string(&config)?.as_bytes())?;
        // What a killed process left of files written atomically (metrics.jsonl, config.toml).
        crate::fsutil::remove_stale_temporaries(s.run_dir.path(), ".")?;
        tidy_checkpoints(&checkpoints, first, &log)?;
        log.say(&format!(
            "training {} ({} parameters) on {}, {} tokens per step, peak {:.3} TFLOP/s ({}); run directory {}",
            s.name,
            crate::config::count::group(config.model.param_count().total),
            describe(trainer),
            trainer.tokens_per_step(),
            s.peak_tflops,
            s.peak_source,
            s.run_dir.path().display()
        ));
        let stages = trainer.parallel.stages();
        if stages > 1 {
            let t = &config.train;
            let schedule = t.pipeline_schedule.name();
            // The layers of every stage, so that a memory or explicit split can be checked.
            let layers: Vec<usize> = trainer.parallel_plan.stages.iter().map(|s| s.layer_count()).collect();
            let (v, formula) = match trainer.parallel_plan.virtual_stages {
                1 => (String::new(), "(P-1)/(M+P-1)"),
                v => (format!(" x {v} virtual stages"), "(P-1)/(V*M+P-1)"),
            };
            log.say(&format!(
                "pipeline: {stages} stages{v} of {layers:?} layers, {} micro-batches per step ({schedule}): bubble {formula} = {:.1} % of each device's step idle",
                t.pipeline_microbatches,
                100.0 * trainer.bubble_fraction()
            ));
        }
        if let Some(from) = &s.resumed_from {
            log.say(&format!("resuming after step {first} from {}", from.display()));
        }
        if let Some(earlier) = earlier {
            log.say(&format!(
                "starting again from step 0: {earlier} (its steps are replaced as they are computed again)"
            ));
        }
        let t = &config.train;
        if devices > 1 && t.checkpoint_every == 0 && t.checkpoint_every_minutes == 0.0 {
            log.say(&format!(
                "no checkpoints: a lost rank loses the whole run of {devices} devices; set train.checkpoint_every or train.checkpoint_every_minutes (a stop signal still saves one)"
            ));
        }
    }
    if first as usize >= steps {
        log.say(&format!(
            "nothing to run: step {first} reached train.steps = {steps} (raise it with --steps to train on)"
        ));
        return Ok(None);
    }

    // The lead appends this attempt to the run's goodput timeline.
    let mut timeline = if s.lead { Some(Timeline::begin(s.run_dir.path(), first, s.startup)?) } else { None };
    let mut saver = Checkpointer::new(&checkpoints, trainer, s.extras.clone(), s.lead);
    let mut local = s.local_tier.clone().map(LocalSaver::new);
    let mut clock = Cadence::new(config.train.checkpoint_every_minutes);
    let mut history: Vec<StepMetrics> = Vec::with_capacity(steps - first as usize);
    log.start_progress(first);
    // The lead names stragglers from every rank's busy time (its step less its waits).
    let mut stragglers = (s.lead && devices > 1).then(|| Stragglers::new(&config.train.diagnostics)).flatten();
    for step in first as usize + 1..=steps {
        let waited_before = trainer.parallel.blocked();
        let mut m = profiled(trainer, s, step)?;
        let waited = trainer.parallel.blocked().zip(waited_before).map_or(0.0, |(a, b)| (a - b).as_secs_f64());
        let busy_s = (m.step_time_s - waited).max(0.0);
        if !m.applied {
            // Every device saw the same loss and norm: all stop here, after the save in flight.
            let (saved, waited_s) = goodput::timed(|| finish_saves(&mut saver, &mut local, trainer));
            saved?.iter().for_each(|done| log.saved(done));
            timeline.as_mut().map(|t| t.end("diverged", waited_s)).transpose()?;
            let kept = match checkpoint::list(&checkpoints)?.last() {
                Some((_, dir)) => format!("the newest checkpoint, {}, is kept", dir.display()),
                None => "no checkpoint was saved".into(),
            };
            bail!(
                "step {}: the loss is {} and the gradient norm {} (diverged): the update was not applied and not saved; {kept}. Lower optim.lr or raise optim.warmup_steps",
                m.step,
                m.loss,
                m.grad_norm
            );
        }
        let (agreed, sync_s) = goodput::timed(|| agree(trainer, &s.stop, m.step_time_s, busy_s, clock.due()));
        if let Some((rank, time)) = agreed.slowest {
            (m.slowest_rank, m.slowest_step_time_s) = (Some(rank), Some(time));
        }
        if let Some(found) = stragglers.as_mut().and_then(|d| d.step(&agreed.busy_s)) {
            log.say(&found.line());
            m.straggler = Some(found);
        }
        let every = |n: usize| n > 0 && (step.is_multiple_of(n) || step == steps);
        let (mut eval_s, mut abandoned) = (0.0, false);
        if every(config.train.eval_every) {
            // A stop request ends the evaluation between two batches, on every rank alike.
            let batches = config.train.eval_steps;
            let (done, took) = goodput::timed(|| trainer.eval_loss_unless_stopped(batches, Some(&s.stop)));
            eval_s = took;
            match done {
                Ok((loss, _)) => m.eval_loss = Some(loss),
                Err(after) => {
                    abandoned = true;
                    log.say(&format!(
                        "step {step}: evaluation abandoned after {after} of {batches} batches ({took:.1} s): the run was asked to stop; no eval_loss for this step"
                    ));
                }
            }
        }
        // The last step ends the run anyway: a request to stop there changes nothing (but the
        // evaluation it abandoned).
        let stop = (agreed.stop || abandoned) && step < steps;
        let due = saver.due(step as u64, steps as u64) || agreed.timed || stop;
        if due {
            clock.restart();
        }
        let (saved, stall) = saver.after_step(trainer, due)?;
        m.checkpoint_s = stall;
        if let Some(local) = local.as_mut() {
            let spent = local.after_step(trainer, step as u64)?;
            (m.local_checkpoint_s, m.local_checkpoint_write_s) = (spent.stall_s, spent.write_s);
        }
        let (logged, logging_s) = goodput::timed(|| log.step(&m));
        logged?;
        if let Some(t) = &mut timeline {
            let checkpoint_s = stall.unwrap_or(0.0) + m.local_checkpoint_s.unwrap_or(0.0);
            let (step_s, data_s) = (m.step_time_s, m.data_s);
            t.step(goodput::Record::Step {
                attempt: 0,
                step: m.step,
                t: 0.0,
                step_s,
                data_s,
                sync_s,
                eval_s,
                checkpoint_s,
                logging_s,
            })?;
        }
        saved.iter().for_each(|done| log.saved(done));
        history.push(m);
        if stop {
            let (saved, waited_s) = goodput::timed(|| finish_saves(&mut saver, &mut local, trainer));
            saved?.iter().for_each(|done| log.saved(done));
            timeline.as_mut().map(|t| t.end("stopped", waited_s)).transpose()?;
            log.finish();
            let checkpoint = checkpoints.join(checkpoint::dir_name(step as u64));
            return Err(Stopped { signal: s.stop.requested(), step: step as u64, checkpoint }.into());
        }
    }
    log.finish();
    let (saved, waited_s) = goodput::timed(|| finish_saves(&mut saver, &mut local, trainer));
    saved?.iter().for_each(|done| log.saved(done));
    // The run is complete: its local tier goes (every rank, at the same point).
    let local_removed = s.local_tier.as_ref().map(|tier| tier.remove(trainer)).unwrap_or_default();
    let peak = trainer.backend.peak_memory_bytes() as u64;
    let peak_memory = trainer.parallel.gather_from_world(&mut trainer.backend, peak);
    let Some(mut timeline) = timeline else { return Ok(None) };
    timeline.end("completed", waited_s)?;
    let report = goodput::Report::of(&goodput::read(&s.run_dir.join(goodput::GOODPUT))?);
    if let Some(r) = &report {
        log.scalars(steps as u64, &r.scalars())?;
    }

    let mut summary = summarise(
        &s.name,
        &config,
        first,
        &history,
        describe(trainer),
        s.peak_tflops,
        trainer.flops_per_step(),
        trainer.tokens_per_step() as f64,
        peak_memory,
    );
    summary.goodput = report.as_ref().map(goodput::Report::summary);
    write_atomic(&s.run_dir.join(run_dir::SUMMARY), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    if let Some(by_source) = &summary.tokens_by_source {
        let total = by_source.values().sum::<u64>().max(1) as f64;
        let each: Vec<String> =
            by_source.iter().map(|(name, &n)| format!("{name} {n} ({:.1}%)", 100.0 * n as f64 / total)).collect();
        log.say(&format!("tokens by source: {}", each.join(", ")));
    }
    log.say(&format!(
        "done: loss {:.4} -> {:.4} in {} steps{}; step time median {:.3} s, p90 {:.3} s (leaving out {} warm-up/profiled steps); {:.0} tokens/s, {:.3} TFLOP/s, MFU {:.1}%; peak memory {:.3} GiB per device{local_removed}",
        summary.first_loss,
        summary.final_loss,
        summary.steps,
        summary.final_eval_loss.map(|e| format!(", eval loss {e:.4}")).unwrap_or_default(),
        summary.median_step_time_s,
        summary.p90_step_time_s,
        summary.perf_steps_excluded,
        summary.tokens_per_s,
        summary.tflops_per_device,
        100.0 * summary.mfu,
        crate::backend::gib(summary.peak_memory_bytes as usize)
    ));
    if let Some(g) = &summary.goodput {
        log.say(&format!(
            "goodput {:.1} % of this attempt, {:.1} % of the run ({} attempts, {} steps recomputed); `engine goodput {}` shows the causes",
            100.0 * g.last_attempt.goodput,
            100.0 * g.run.goodput,
            g.attempts,
            g.run.recomputed_steps,
            s.run_dir.path().display()
        ));
    }
    Ok(Some(summary))
}

/// Completes the saves in flight, persistent and local, on every device at the same point (the
/// run's end, a stop, a divergence): the process must not end while a checkpoint it will say it
/// saved is not in place. Returns the persistent saves that completed.
fn finish_saves<B: Backend>(
    saver: &mut Checkpointer,
    local: &mut Option<LocalSaver>,
    trainer: &mut Trainer<Traced<B>>,
) -> Result<Vec<SaveReport>> {
    let saved = saver.finish(trainer)?;
    if let Some(local) = local {
        local.finish(trainer)?;
    }
    Ok(saved)
}

/// `train.checkpoint_every_minutes` on this device's clock (rank 0's decides for the run).
struct Cadence {
    period: Option<Duration>,
    since: Instant,
}

impl Cadence {
    fn new(minutes: f64) -> Cadence {
        Cadence { period: (minutes > 0.0).then(|| Duration::from_secs_f64(minutes * 60.0)), since: Instant::now() }
    }

    /// Whether the period has passed since the run started or last saved.
    fn due(&self) -> bool {
        self.period.is_some_and(|p| self.since.elapsed() >= p)
    }

    /// A save starts now.
    fn restart(&mut self) {
        self.since = Instant::now();
    }
}

/// What the devices agreed on at a step boundary.
#[derive(Debug, Clone, PartialEq)]
struct Agreed {
    /// Some device was asked to stop.
    stop: bool,
    /// Rank 0's clock says a checkpoint is due.
    timed: bool,
    /// On more than one device: the slowest rank and its step time.
    slowest: Option<(usize, f64)>,
    /// Every rank's busy time ([`super::stragglers`]), seconds, in rank order (empty on one
    /// device).
    busy_s: Vec<f64>,
}

/// The step boundary's one exchange: each device's "asked to stop" flag, its clock's "checkpoint
/// due" flag (rank 0's counts), its step time and its busy time, gathered from every device in
/// one collective (none on one device). Every device calls it once per step.
fn agree<B: Backend>(
    trainer: &mut Trainer<B>,
    stop: &StopRequest,
    step_time_s: f64,
    busy_s: f64,
    timed: bool,
) -> Agreed {
    let stop = stop.requested().is_some();
    if trainer.devices() == 1 {
        return Agreed { stop, timed, slowest: None, busy_s: Vec::new() };
    }
    let mine = [pack(stop, timed, step_time_s), pack(false, false, busy_s)];
    let all = trainer.parallel.gather_many_from_world(&mut trainer.backend, mine);
    combine(&all)
}

/// One device's part of the exchange in 48 bits: bit 0 "asked to stop", bit 1 "checkpoint due",
/// the rest its step time in microseconds (up to about two years).
fn pack(stop: bool, timed: bool, step_time_s: f64) -> u64 {
    let micros = ((step_time_s.max(0.0) * 1e6) as u64).min((1 << 46) - 1);
    (micros << 2) | ((timed as u64) << 1) | stop as u64
}

/// What every device's parts say together: any device's stop, rank 0's clock, the slowest rank
/// (the lowest of equals).
fn combine(all: &[[u64; 2]]) -> Agreed {
    let slowest = (all.iter().enumerate())
        .map(|(rank, [v, _])| (rank, v >> 2))
        .max_by_key(|&(rank, micros)| (micros, std::cmp::Reverse(rank)))
        .map(|(rank, micros)| (rank, micros as f64 / 1e6));
    Agreed {
        stop: all.iter().any(|[v, _]| v & 1 == 1),
        timed: all.first().is_some_and(|[v, _]| v & 2 != 0),
        slowest,
        busy_s: all.iter().map(|[_, busy]| (busy >> 2) as f64 / 1e6).collect(),
    }
}

/// One training step; on the lead, the step `train.profile_step` is traced op by op into
/// `RUN_DIR/trace-step-N.json` (a Chrome trace).
fn profiled<B: Backend>(trainer: &mut Trainer<Traced<B>>, s: &Session, step: usize) -> Result<StepMetrics> {
    let profile = step == trainer.config.train.profile_step && s.lead;
    if profile {
        trainer.backend.start();
    }
    let m = trainer.train_step(s.peak_tflops);
    if profile {
        let trace = chrome_trace(&trainer.backend.stop(), &format!("{} step {step}", s.name));
        let path = s.run_dir.trace(step);
        write_atomic(&path, serde_json::to_string(&trace)?.as_bytes())?;
    }
    Ok(m)
}

/// Before the first step (the lead): removes what interrupted saves left, and moves aside the
/// checkpoints that follow the step a resumed run continues from.
fn tidy_checkpoints(checkpoints: &Path, first: u64, log: &MetricsLogger) -> Result<()> {
    for stale in checkpoint::remove_temporaries(checkpoints)? {
        log.say(&format!("removed {}, left by a save that did not finish", stale.display()));
    }
    if first > 0 {
        for moved in checkpoint::set_aside_after(checkpoints, first)? {
            log.say(&format!(
                "moved {} aside: it follows step {first}, which this run continues from",
                moved.display()
            ));
        }
    }
    Ok(())
}

/// The device, and the mesh in a parallel run; what runs in FP8 if that was asked.
fn describe<B: Backend>(trainer: &Trainer<Traced<B>>) -> String {
    let mesh = &trainer.parallel.mesh;
    let mut fp8 = trainer.model.describe_fp8(&trainer.plan).map_or(String::new(), |f| format!("; {f}"));
    let seq = trainer.plan.seq * trainer.model.seq.ranks;
    if let Some((cast, units)) = trainer.parallel.fp8_gathers().filter(|g| g.0 > 0) {
        fp8 += &format!(", FSDP gathering {cast} of {units} units as their casts");
    }
    if let Some(w) = trainer.model.describe_windows(seq) {
        fp8 += &format!("; {w}");
    }
    if mesh.devices() == 1 {
        return format!("{}{fp8}", trainer.backend.describe());
    }
    let [d, f, t, p, s] = [0, 1, 2, 3, 4].map(|a| mesh.ici[a] * mesh.dcn[a]);
    let stages = if p > 1 { format!(" x pipeline {p}") } else { String::new() };
    let seq = if s > 1 { format!(" x seq {s}") } else { String::new() };
    let devices = trainer.backend.describe();
    format!("{} x {devices} (mesh data {d} x fsdp {f} x tensor {t}{stages}{seq}){fp8}", mesh.devices())
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
    peak_memory: Vec<u64>,
) -> Summary {
    let t = &config.train;
    let kept: Vec<f64> = history
        .iter()
        .filter(|m| (m.step - first) as usize > t.perf_warmup_steps && m.step as usize != t.profile_step)
        .map(|m| m.step_time_s)
        .collect();
    let times = if kept.is_empty() { history.iter().map(|m| m.step_time_s).collect() } else { kept };
    let excluded = history.len() - times.len();
    let stats = StepTimes::of(&times, flops_per_step, tokens_per_step, peak_tflops);
    Summary {
        recipe: recipe.to_owned(),
        steps: history.len() as u64,
        resumed_after_step: first,
        first_loss: history[0].loss,
        final_loss: history[history.len() - 1].loss,
        final_eval_loss: history.iter().rev().find_map(|m| m.eval_loss),
        tokens_by_source: history[history.len() - 1].tokens_by_source.clone(),
        perf_steps_excluded: excluded,
        median_step_time_s: stats.median_s,
        p90_step_time_s: stats.p90_s,
        tokens_per_s: stats.tokens_per_s,
        tflops_per_device: stats.tflops_per_device,
        mfu: stats.mfu,
        device,
        peak_tflops,
        peak_memory_bytes: peak_memory.iter().copied().max().unwrap_or(0),
        peak_memory_bytes_per_device: peak_memory,
        goodput: None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::recipe::{Override, resolve};
    use crate::train::devices;
    use crate::train::signals::StopRequest;

    /// A tiny recipe made small enough for a step to take milliseconds, unprofiled.
    pub(crate) const SMALL: [&str; 8] = [
        "model.vocab_size=512",
        "train.seq_len=32",
        "model.d_model=64",
        "model.mlp_dim=128",
        "model.n_heads=4",
        "model.n_kv_heads=4",
        "model.head_dim=16",
        "train.profile_step=0",
    ];

    /// tiny-llama2 made small ([`SMALL`]), 6 steps.
    pub(crate) fn config(extra: &[&str]) -> Config {
        let base = [&SMALL[..], &["train.steps=6"]].concat();
        resolve("tiny-llama2", &Override::from_list(&[&base[..], extra].concat().join(" "), "test")).unwrap().config
    }

    fn session(dir: &Path, lead: bool, stop: StopRequest) -> Session {
        let mut run_dir = RunDir::at(dir);
        if lead {
            run_dir.create().unwrap();
        }
        let (name, extras) = ("test".to_owned(), Extras::default());
        Session {
            name,
            run_dir,
            peak_tflops: 0.0,
            peak_source: String::new(),
            resumed_from: None,
            extras,
            lead,
            stop,
            startup: Startup::default(),
            local_tier: None,
        }
    }

    /// Only rank 1 of two FSDP devices is asked to stop: both stop after the first step, with
    /// one checkpoint of it, whole, and the step's record names the slowest rank.
    #[test]
    fn every_rank_stops_after_the_same_step_with_one_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let c = config(&["mesh.ici_data=1", "mesh.ici_fsdp=2"]);
        let stopped = devices::run(&c, 2, |rank, t| {
            let stop = StopRequest::own();
            if rank == 1 {
                stop.request(libc::SIGTERM);
            }
            let e = run(t, &session(tmp.path(), rank == 0, stop)).unwrap_err();
            Ok(e.downcast::<Stopped>().unwrap())
        })
        .unwrap();
        assert_eq!(
            stopped.iter().map(|s| (s.step, s.signal)).collect::<Vec<_>>(),
            [(1, None), (1, Some(libc::SIGTERM))]
        );
        let ck = checkpoint::Checkpoint::open(&stopped[0].checkpoint).unwrap();
        assert_eq!((ck.state.step, ck.state.shards), (1, Some(2)));
        let text = std::fs::read_to_string(tmp.path().join(run_dir::METRICS)).unwrap();
        let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(records.len(), 1);
        assert!(records[0]["slowest_rank"].as_u64().is_some_and(|r| r < 2), "{text}");
        assert!(!tmp.path().join(run_dir::SUMMARY).exists(), "a stopped run is not complete");
    }

    /// A stop request during a long evaluation (13,000 batches on the synthetic data, tens of
    /// seconds) ends it within about a second, on one device and on two FSDP devices where only
    /// rank 1 is asked (the evaluation's collectives would wait for the other otherwise): the
    /// step has no eval_loss, the run stops after it with its checkpoint.
    #[test]
    fn a_stop_request_ends_a_long_evaluation_within_a_second() {
        for devices in [1, 2] {
            let tmp = tempfile::tempdir().unwrap();
            let fsdp = format!("mesh.ici_fsdp={devices}");
            // A model 4 times the test's usual per token: the whole evaluation takes tens of seconds.
            let wider = ["model.d_model=128", "model.head_dim=32", "model.mlp_dim=512"];
            let eval = ["data.source=\"synthetic\"", "train.eval_every=1", "train.eval_steps=13000"];
            let c = config(&[&["mesh.ici_data=1", &fsdp][..], &wider, &eval].concat());
            let stopped = devices::run(&c, devices, |rank, t| {
                let stop = StopRequest::own();
                let asked = stop.clone();
                let requester = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(500));
                    if rank + 1 == devices {
                        asked.request(libc::SIGTERM);
                    }
                    Instant::now()
                });
                let e = run(t, &session(tmp.path(), rank == 0, stop)).unwrap_err();
                let after = requester.join().unwrap().elapsed();
                Ok((e.downcast::<Stopped>().unwrap(), after))
            })
            .unwrap();
            for (rank, (s, after)) in stopped.iter().enumerate() {
                eprintln!("{devices} device(s), rank {rank}: stopped {after:?} after the request");
                assert_eq!(s.step, 1, "{devices} device(s), rank {rank}");
                assert!(
                    *after < Duration::from_millis(1500),
                    "{devices} device(s), rank {rank}: {after:?} after the request"
                );
            }
            let text = std::fs::read_to_string(tmp.path().join(run_dir::METRICS)).unwrap();
            let records: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            assert_eq!(records.len(), 1, "{text}");
            assert!(records[0].get("eval_loss").is_none(), "an abandoned evaluation recorded a loss: {text}");
            let ck = checkpoint::Checkpoint::open(&stopped[0].0.checkpoint).unwrap();
            assert_eq!(ck.state.step, 1);
        }
    }

    /// A `train.eval_steps` that reads past the validation split (the embedded corpus holds out
    /// 200 samples of 33 tokens) is refused before the first step, on every rank alike.
    #[test]
    fn eval_steps_past_the_validation_split_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let c = config(&["mesh.ici_data=1", "mesh.ici_fsdp=2", "train.eval_every=2", "train.eval_steps=101"]);
        let refused = devices::run(&c, 2, |rank, t| {
            Ok(run(t, &session(tmp.path(), rank == 0, StopRequest::own())).unwrap_err().to_string())
        })
        .unwrap();
        let want = "train.eval_steps = 101 reads 101 x 2 batch shard(s) x 1 pipeline micro-batch(es) x 1 sequence(s) = 202 validation samples per evaluation, more than the 200 distinct samples of the held-out tail (the last 5 %) of the data (of train.seq_len + 1 = 33 tokens each): past them it would read the same samples again; set train.eval_steps to at most 100";
        assert_eq!(refused, [want, want]);
        assert!(!tmp.path().join(run_dir::METRICS).exists());
        let c = config(&["mesh.ici_data=1", "mesh.ici_fsdp=2", "train.eval_every=6", "train.eval_steps=100"]);
        let tmp = tempfile::tempdir().unwrap();
        let ran = devices::run(&c, 2, |rank, t| run(t, &session(tmp.path(), rank == 0, StopRequest::own())));
        assert!(ran.unwrap()[0].as_ref().is_some_and(|s| s.final_eval_loss.is_some()));
    }

    /// The exchange: any rank's stop counts, only rank 0's clock does, and the slowest rank is
    /// the lowest of the slowest.
    #[test]
    fn ranks_agree_on_stop_cadence_and_the_slowest() {
        let busy = |s: f64| pack(false, false, s);
        let all =
            [[pack(false, false, 0.5), busy(0.5)], [pack(true, true, 1.25), busy(0.25)], [pack(false, false, 1.25), 0]];
        let busy_s = vec![0.5, 0.25, 0.0];
        assert_eq!(combine(&all), Agreed { stop: true, timed: false, slowest: Some((1, 1.25)), busy_s });
        let all = [[pack(false, true, 0.5), busy(0.125)], [pack(false, false, 0.25), busy(0.25)]];
        let busy_s = vec![0.125, 0.25];
        assert_eq!(combine(&all), Agreed { stop: false, timed: true, slowest: Some((0, 0.5)), busy_s });
        assert!(pack(true, true, 1e12) < 1 << 48, "a step time of years still fits");
    }
}
