//! Runs' curves overlaid: what `engine plot` reads from each run directory (`metrics.jsonl`,
//! the resolved `config.toml`, `summary.json`'s recipe name) and the figure it makes of them.
//!
//! The legend names each run by its directory and recipe, then the configuration keys whose
//! values differ between the runs (`train.precision=fp8`), so that a comparison says what it
//! compares.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::figure::{Figure, Line};
use crate::config::{Config, flat};
use crate::train::run_dir::{CONFIG, METRICS, SUMMARY};

/// What a curve shows: one field of `metrics.jsonl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// The training loss (`loss`).
    Loss,
    /// The validation loss (`eval_loss`), on the steps that evaluate.
    EvalLoss,
    /// The learning rate (`lr`).
    Lr,
    /// The global gradient norm before clipping (`grad_norm`).
    GradNorm,
    /// Tokens per second, all devices together (`tokens_per_s`).
    TokensPerS,
    /// Model FLOP utilisation (`mfu`).
    Mfu,
    /// The slowest rank's step time (`slowest_step_time_s`; on one device, its `step_time_s`).
    StepTime,
}

impl Metric {
    /// The name on the command line (`--metric`).
    pub fn name(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::EvalLoss => "eval-loss",
            Metric::Lr => "lr",
            Metric::GradNorm => "grad-norm",
            Metric::TokensPerS => "tokens-per-s",
            Metric::Mfu => "mfu",
            Metric::StepTime => "step-time",
        }
    }

    /// The axis' name.
    pub fn axis(self) -> &'static str {
        match self {
            Metric::Loss => "training loss",
            Metric::EvalLoss => "validation loss",
            Metric::Lr => "learning rate",
            Metric::GradNorm => "gradient norm (before clipping)",
            Metric::TokensPerS => "tokens/s (all devices)",
            Metric::Mfu => "MFU",
            Metric::StepTime => "slowest rank's step time (s)",
        }
    }

    /// The metric's value in one record of `metrics.jsonl`, if the record has it.
    fn of(self, record: &serde_json::Map<String, serde_json::Value>) -> Option<f64> {
        let field = |name: &str| record.get(name).and_then(serde_json::Value::as_f64);
        match self {
            Metric::Loss => field("loss"),
            Metric::EvalLoss => field("eval_loss"),
            Metric::Lr => field("lr"),
            Metric::GradNorm => field("grad_norm"),
            Metric::TokensPerS => field("tokens_per_s"),
            Metric::Mfu => field("mfu"),
            Metric::StepTime => field("slowest_step_time_s").or_else(|| field("step_time_s")),
        }
    }
}

/// What the horizontal axis counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XAxis {
    /// Optimizer steps.
    Step,
    /// Tokens trained on, all devices together: the step times the step's tokens
    /// (`tokens_per_s × step_time_s`, which the trainer computes from the global batch).
    Tokens,
}

/// One record of `metrics.jsonl`: its step and its fields.
#[derive(Debug, Clone)]
struct Record {
    step: u64,
    fields: serde_json::Map<String, serde_json::Value>,
}

/// A run directory as the plot reads it.
#[derive(Debug, Clone)]
pub struct Run {
    /// The directory.
    pub dir: PathBuf,
    /// The recipe's name from `summary.json`, when the run completed.
    pub recipe: Option<String>,
    /// The resolved configuration, when `config.toml` is there.
    pub config: Option<Config>,
    /// Its records by step: the last one of each step (a run resumed from an earlier checkpoint
    /// logs some steps again).
    records: BTreeMap<u64, Record>,
}

impl Run {
    /// Reads a run directory; errors name the file and line that is wrong.
    pub fn read(dir: &Path) -> Result<Run> {
        if !dir.is_dir() {
            bail!("{}: not a directory (give run directories, the --run-dir of `engine train`)", dir.display());
        }
        let path = dir.join(METRICS);
        if !path.exists() {
            bail!("{}: no {METRICS} here; is it a run directory?", dir.display());
        }
        let mut records = BTreeMap::new();
        // A step's record is a few hundred bytes: a longer line is not the engine's.
        crate::fsutil::for_each_line(&path, 1 << 20, |n, line| {
            if line.trim().is_empty() {
                return Ok(());
            }
            let at = || format!("{} line {n}", path.display());
            let value: serde_json::Value =
                serde_json::from_str(line).with_context(|| format!("{}: not a JSON object", at()))?;
            let serde_json::Value::Object(fields) = value else { bail!("{}: not a JSON object", at()) };
            let Some(step) = fields.get("step").and_then(serde_json::Value::as_u64) else {
                bail!("{}: no `step` (a whole number)", at())
            };
            records.insert(step, Record { step, fields });
            Ok(())
        })?;
        let config = match std::fs::read_to_string(dir.join(CONFIG)) {
            Ok(t) => Some(
                toml::from_str::<Config>(&t)
                    .map_err(|e| anyhow::anyhow!("{}: {}", dir.join(CONFIG).display(), one_line(&e.to_string())))?,
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", dir.join(CONFIG).display())),
        };
        let recipe = std::fs::read_to_string(dir.join(SUMMARY))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("recipe").and_then(|r| r.as_str()).map(str::to_owned));
        Ok(Run { dir: dir.to_path_buf(), recipe, config, records })
    }

    /// The run's points of `metric` along `x`, in step order.
    pub fn points(&self, metric: Metric, x: XAxis) -> Result<Vec<(f64, f64)>> {
        let mut out = Vec::new();
        for r in self.records.values() {
            let Some(y) = metric.of(&r.fields) else { continue };
            let x = match x {
                XAxis::Step => r.step as f64,
                XAxis::Tokens => {
                    let per_s = r.fields.get("tokens_per_s").and_then(|v| v.as_f64());
                    let time = r.fields.get("step_time_s").and_then(|v| v.as_f64());
                    let (Some(per_s), Some(time)) = (per_s, time) else {
                        bail!(
                            "{} step {}: `--x tokens` needs tokens_per_s and step_time_s, which this record lacks",
                            self.dir.join(METRICS).display(),
                            r.step
                        )
                    };
                    r.step as f64 * (per_s * time).round()
                }
            };
            out.push((x, y));
        }
        Ok(out)
    }

    /// The run's name in a legend: its directory's last component, and its recipe.
    fn name(&self) -> String {
        let dir =
            self.dir.file_name().map_or_else(|| self.dir.display().to_string(), |n| n.to_string_lossy().into_owned());
        match &self.recipe {
            Some(r) if *r != dir => format!("{dir} ({r})"),
            _ => dir,
        }
    }
}

/// How many differing keys a legend entry lists before it says how many more there are.
const LEGEND_KEYS: usize = 4;

/// Each run's legend entry: its name, then `key=value` for every configuration key whose value
/// is not the same in all runs (the description and the run's own paths left out).
pub fn legends(runs: &[Run]) -> Vec<String> {
    let flats: Vec<Option<BTreeMap<String, String>>> =
        runs.iter().map(|r| r.config.as_ref().map(flat::flatten)).collect();
    let keys: std::collections::BTreeSet<&String> = flats.iter().flatten().flat_map(|f| f.keys()).collect();
    let differing: Vec<&String> = keys
        .into_iter()
        .filter(|k| *k != "description")
        .filter(|k| {
            let values: Vec<Option<&String>> = flats.iter().flatten().map(|f| f.get(*k)).collect();
            values.windows(2).any(|w| w[0] != w[1])
        })
        .collect();
    runs.iter()
        .zip(&flats)
        .map(|(run, flat)| {
            let mut label = run.name();
            let Some(flat) = flat else { return label };
            let pairs: Vec<String> =
                differing.iter().map(|k| format!("{k}={}", flat.get(*k).map_or("(unset)", |v| v.as_str()))).collect();
            if !pairs.is_empty() {
                label.push_str(": ");
                label.push_str(&pairs[..pairs.len().min(LEGEND_KEYS)].join(", "));
                if pairs.len() > LEGEND_KEYS {
                    label.push_str(&format!(" and {} more", pairs.len() - LEGEND_KEYS));
                }
            }
            label
        })
        .collect()
}

/// The figure overlaying `metric` of every run along `x`. A run without one point of the metric
/// is an error naming it (a typo'd directory would otherwise vanish from the picture).
pub fn overlay(runs: &[Run], metric: Metric, x: XAxis) -> Result<Figure> {
    let mut lines = Vec::new();
    for (run, label) in runs.iter().zip(legends(runs)) {
        let points = run.points(metric, x)?;
        if points.is_empty() {
            bail!(
                "{}: no record has {} (`--metric {}`){}",
                run.dir.join(METRICS).display(),
                metric.axis(),
                metric.name(),
                if metric == Metric::EvalLoss { "; the run evaluates when train.eval_every is set" } else { "" }
            );
        }
        lines.push(Line { label, points });
    }
    Ok(Figure {
        title: String::new(),
        x_label: match x {
            XAxis::Step => "step".into(),
            XAxis::Tokens => "tokens".into(),
        },
        y_label: metric.axis().into(),
        band: None,
        lines,
        marks: None,
    })
}

/// The first line of a TOML error (its others show the source line), for one-line reports.
fn one_line(text: &str) -> String {
    text.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, lr: f64, lines: &str) -> Run {
        let dir = std::env::temp_dir().join(format!("plot-runs-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(METRICS), lines).unwrap();
        let mut config = Config::default();
        config.optim.lr = lr;
        std::fs::write(dir.join(CONFIG), toml::to_string(&config).unwrap()).unwrap();
        let r = Run::read(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        r
    }

    #[test]
    fn points_follow_steps_and_tokens_and_the_last_record_of_a_step_wins() {
        let r = run(
            "points",
            0.1,
            "{\"step\":1,\"loss\":5.0,\"tokens_per_s\":100.0,\"step_time_s\":0.64}\n\
             {\"step\":2,\"loss\":4.0,\"tokens_per_s\":128.0,\"step_time_s\":0.5,\"eval_loss\":4.5}\n\
             {\"step\":2,\"loss\":3.9,\"tokens_per_s\":128.0,\"step_time_s\":0.5}\n",
        );
        assert_eq!(r.points(Metric::Loss, XAxis::Step).unwrap(), vec![(1.0, 5.0), (2.0, 3.9)]);
        assert_eq!(r.points(Metric::Loss, XAxis::Tokens).unwrap(), vec![(64.0, 5.0), (128.0, 3.9)]);
        assert_eq!(r.points(Metric::StepTime, XAxis::Step).unwrap(), vec![(1.0, 0.64), (2.0, 0.5)]);
        assert!(r.points(Metric::EvalLoss, XAxis::Step).unwrap().is_empty());
    }

    #[test]
    fn legends_name_the_keys_that_differ() {
        let a = run("a", 0.1, "{\"step\":1,\"loss\":5.0}\n");
        let b = run("b", 0.2, "{\"step\":1,\"loss\":5.0}\n");
        let l = legends(&[a.clone(), b]);
        assert!(l[0].ends_with("-a: optim.lr=0.1") && l[1].ends_with("-b: optim.lr=0.2"), "{l:?}");
        assert!(legends(std::slice::from_ref(&a))[0].ends_with("-a"));
    }
}
