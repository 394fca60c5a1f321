//! What a run shows and records of each step: the `metrics.jsonl` record, the TensorBoard
//! scalars, the printed line and, on an interactive terminal, a progress bar. Only the lead
//! device of a run logs; the others hold a quiet logger.

use std::borrow::Cow;
use std::io::IsTerminal;
use std::path::Path;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::checkpointer::SaveReport;
use super::metrics::{JsonlWriter, StepMetrics};
use super::run_dir::RunDir;
use super::tensorboard::EventWriter;
use crate::fsutil::write_atomic;

/// The run's metrics files, printed lines and progress bar.
pub struct MetricsLogger {
    files: Option<(JsonlWriter, EventWriter)>,
    bar: Option<ProgressBar>,
    quiet: bool,
    total_steps: usize,
}

impl MetricsLogger {
    /// A logger writing into `run_dir` for a run of `total_steps` that continues after `first`
    /// (0 for a fresh run): records of steps after `first` that an interrupted run logged are
    /// dropped, since the run computes them again, and TensorBoard is told a new session starts.
    /// A run that starts again from step 0 over an earlier attempt that saved no checkpoint
    /// (`--resume=auto`) drops all of that attempt's records the same way.
    pub fn open(run_dir: &RunDir, first: u64, total_steps: usize) -> Result<MetricsLogger> {
        let jsonl = run_dir.metrics();
        let replaces = first > 0 || jsonl.exists();
        if replaces {
            forget_steps_after(&jsonl, first)?;
        }
        let metrics = JsonlWriter::append(&jsonl)?;
        let mut events = EventWriter::create(run_dir.path())?;
        if replaces {
            events.session_start(first + 1)?;
        }
        Ok(MetricsLogger { files: Some((metrics, events)), bar: None, quiet: false, total_steps })
    }

    /// A logger that records and prints nothing (the devices of a run other than its lead).
    pub fn quiet() -> MetricsLogger {
        MetricsLogger { files: None, bar: None, quiet: true, total_steps: 0 }
    }

    /// Shows a progress bar from step `done` on, when standard error is a terminal.
    pub fn start_progress(&mut self, done: u64) {
        if self.quiet || !std::io::stderr().is_terminal() {
            return;
        }
        let bar = ProgressBar::new(self.total_steps as u64);
        bar.set_position(done);
        bar.set_style(
            ProgressStyle::with_template("{bar:40.cyan/blue} {pos}/{len} steps  elapsed {elapsed}  eta {eta}")
                .expect("valid template"),
        );
        self.bar = Some(bar);
    }

    /// Prints a line above the progress bar.
    pub fn say(&self, line: &str) {
        match &self.bar {
            _ if self.quiet => {}
            Some(bar) => bar.suspend(|| crate::out!("{line}")),
            None => crate::out!("{line}"),
        }
    }

    /// Records a step: its JSON line, its TensorBoard scalars, its printed line.
    pub fn step(&mut self, m: &StepMetrics) -> Result<()> {
        if let Some((metrics, events)) = &mut self.files {
            metrics.write(m)?;
            let scalars = scalars(m);
            events.scalars(m.step, &scalars.iter().map(|(tag, v)| (tag.as_ref(), *v)).collect::<Vec<_>>())?;
        }
        self.say(&m.line(self.total_steps));
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
        Ok(())
    }

    /// Writes scalars of the run as a whole (goodput) to TensorBoard at `step`.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> Result<()> {
        if let Some((_, events)) = &mut self.files {
            events.scalars(step, &values.iter().map(|(tag, v)| (tag.as_str(), *v)).collect::<Vec<_>>())?;
        }
        Ok(())
    }

    /// Reports a checkpoint that is complete.
    pub fn saved(&self, done: &SaveReport) {
        self.say(&format!(
            "saved checkpoint {} (written in {:.2} s in the background)",
            done.dir.display(),
            done.write_s
        ));
    }

    /// Removes the progress bar (the summary follows as plain lines).
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// The TensorBoard scalars of a step; with a mixture, `data/tokens/<source>`: the tokens trained
/// on from each source so far (the summary's `tokens_by_source`), one curve per source.
fn scalars(m: &StepMetrics) -> Vec<(Cow<'static, str>, f64)> {
    let mut v: Vec<(Cow<'static, str>, f64)> = [
        ("loss", m.loss),
        ("lr", m.lr),
        ("grad_norm", m.grad_norm),
        ("step_time_s", m.step_time_s),
        ("tokens_per_s", m.tokens_per_s),
        ("tflops", m.tflops_per_device),
        ("mfu", m.mfu),
    ]
    .into_iter()
    .map(|(tag, x)| (tag.into(), x))
    .collect();
    v.extend(m.aux_loss.map(|a| ("aux_loss".into(), a)));
    v.extend(m.dropped_fraction.map(|f| ("dropped_fraction".into(), f)));
    v.extend(m.expert_load.map(|l| ("expert_load".into(), l)));
    v.extend(m.eval_loss.map(|e| ("eval_loss".into(), e)));
    v.extend(m.max_logit.map(|l| ("max_logit".into(), l)));
    v.extend(m.clipped_heads.map(|h| ("clipped_heads".into(), h as f64)));
    v.extend(m.slowest_rank.map(|r| ("slowest_rank".into(), r as f64)));
    v.extend(m.slowest_step_time_s.map(|s| ("slowest_step_time_s".into(), s)));
    for (source, tokens) in m.tokens_by_source.iter().flatten() {
        v.push((format!("data/tokens/{source}").into(), *tokens as f64));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A mixture's tokens by source reach TensorBoard as one scalar each, `data/tokens/<source>`,
    /// written into the event file; without a mixture there are none.
    #[test]
    fn tokens_by_source_are_scalars_of_their_own() {
        let mut m = StepMetrics {
            step: 7,
            applied: true,
            loss: 2.0,
            aux_loss: None,
            dropped_fraction: None,
            expert_load: None,
            max_logit: None,
            clipped_heads: None,
            lr: 1e-3,
            grad_norm: 1.0,
            step_time_s: 0.1,
            data_s: 0.0,
            tokens_per_s: 10.0,
            tflops_per_device: 0.0,
            mfu: 0.0,
            eval_loss: None,
            tokens_by_source: None,
            checkpoint_s: None,
            slowest_rank: None,
            slowest_step_time_s: None,
            local_checkpoint_s: None,
            local_checkpoint_write_s: None,
            straggler: None,
        };
        assert!(scalars(&m).iter().all(|(tag, _)| !tag.starts_with("data/")));
        m.tokens_by_source = Some([("c4".to_string(), 3072u64), ("code".to_string(), 1024)].into());
        let got: Vec<(String, f64)> = scalars(&m).into_iter().map(|(t, v)| (t.into_owned(), v)).collect();
        assert!(got.contains(&("data/tokens/c4".into(), 3072.0)), "{got:?}");
        assert!(got.contains(&("data/tokens/code".into(), 1024.0)), "{got:?}");
        let dir = tempfile::tempdir().unwrap();
        let run_dir = RunDir::at(dir.path().join("run"));
        std::fs::create_dir_all(run_dir.path()).unwrap();
        let mut logger = MetricsLogger::open(&run_dir, 0, 10).unwrap();
        logger.quiet = true;
        logger.step(&m).unwrap();
        let events = std::fs::read_dir(run_dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents"))
            .unwrap();
        let bytes = std::fs::read(events).unwrap();
        for (tag, tokens) in [("data/tokens/c4", 3072f32), ("data/tokens/code", 1024.0)] {
            let at = bytes.windows(tag.len()).position(|w| w == tag.as_bytes()).unwrap_or_else(|| panic!("{tag}"));
            assert!(bytes[at..].windows(4).any(|w| w == tokens.to_le_bytes()), "{tag}'s value");
        }
    }
}
