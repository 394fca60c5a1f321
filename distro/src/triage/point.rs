//! One tested point: the command run in an image (pulled when not local), with `$TRIAGE_OUT`
//! mounted, and its exit code and metrics judged into a verdict.
use super::{TRIAGE_MOUNT, Triage};
use crate::dated::Verdict;
use crate::docker::{self, RunOptions};
use crate::error::one_line;
use serde::Serialize;
use serde_json::Value;
use std::time::Instant;

/// One tested point.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    /// `date` or `commit`.
    pub kind: &'static str,
    /// The date, or `SOURCE@COMMIT`.
    pub label: String,
    /// The image run.
    pub image: String,
    /// The verdict.
    pub verdict: Verdict,
    /// The command's exit code, when it ran.
    pub exit_code: Option<i64>,
    /// The metric, when asked for and found.
    pub metric: Option<f64>,
    /// Seconds spent building the image (rebuilds only).
    pub build_seconds: f64,
    /// Seconds spent pulling and running the command.
    pub run_seconds: f64,
    /// Why it was skipped or failed without a metric.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// How a point's result becomes a verdict.
#[derive(Clone, Debug)]
pub struct Criterion {
    /// Metric name and threshold.
    pub metric: Option<(String, f64)>,
    /// Fail below the threshold instead of above it.
    pub higher_is_better: bool,
}

impl Criterion {
    /// The verdict for an exit code and the metrics file's text (if the command wrote one);
    /// the metric value and a note come with it.
    pub fn judge(&self, exit_code: i64, metrics: Option<&str>) -> (Verdict, Option<f64>, Option<String>) {
        let Some((name, threshold)) = &self.metric else {
            return (if exit_code == 0 { Verdict::Pass } else { Verdict::Fail }, None, None);
        };
        let value = metrics
            .and_then(|t| serde_json::from_str::<Value>(t).ok())
            .and_then(|v| v.get(name).and_then(Value::as_f64));
        let Some(value) = value else {
            let why = match metrics {
                None => "the command wrote no $TRIAGE_OUT/metrics.json".to_string(),
                Some(_) => format!("$TRIAGE_OUT/metrics.json has no number {name:?}"),
            };
            return (Verdict::Fail, None, Some(why));
        };
        if exit_code != 0 {
            return (Verdict::Fail, Some(value), Some(format!("exit code {exit_code}")));
        }
        let worse = if self.higher_is_better { value < *threshold } else { value > *threshold };
        (if worse { Verdict::Fail } else { Verdict::Pass }, Some(value), None)
    }
}

impl Triage {
    /// Runs the command in `image` (pulled when not local) and judges the result.
    pub(super) fn run_in(&mut self, kind: &'static str, label: &str, image: &str, build_seconds: f64) -> Point {
        let t = Instant::now();
        let out = self.work.join("out").join(format!("{}-{}", self.points.len(), label.replace(['/', '@', ':'], "_")));
        let _ = std::fs::remove_dir_all(&out);
        let mut point = Point {
            kind,
            label: label.to_string(),
            image: image.to_string(),
            verdict: Verdict::Skip,
            exit_code: None,
            metric: None,
            build_seconds,
            run_seconds: 0.0,
            note: None,
        };
        if let Err(e) = std::fs::create_dir_all(&out) {
            point.note = Some(format!("creating {}: {e}", out.display()));
            return point;
        }
        let mut env = vec![format!("TRIAGE_OUT={TRIAGE_MOUNT}")];
        env.extend(self.args.env.iter().cloned());
        let opts = RunOptions {
            image: image.to_string(),
            cmd: self.args.command.clone(),
            env,
            gpus: self.args.gpus,
            keep: false,
            platform: Some(self.host.clone()),
            binds: vec![format!("{}:{TRIAGE_MOUNT}", out.display())],
            stdout_to_stderr: true,
        };
        // The first run, then (with --confirm N) up to N reruns while it keeps failing.
        for attempt in 0..=self.args.confirm {
            let _ = std::fs::remove_file(out.join("metrics.json"));
            match docker::run(&opts, &self.progress) {
                Ok(code) => {
                    let metrics = std::fs::read_to_string(out.join("metrics.json")).ok();
                    let (v, m, note) = self.criterion.judge(code, metrics.as_deref());
                    let flaky = attempt > 0 && v == Verdict::Pass;
                    point.verdict = v;
                    point.exit_code = Some(code);
                    point.metric = m;
                    point.note = if flaky {
                        Some(format!("flaky: failed {attempt} time(s), then passed on rerun {attempt}"))
                    } else if attempt > 0 {
                        Some(format!(
                            "failed {} time(s) (--confirm {}){}",
                            attempt + 1,
                            self.args.confirm,
                            note.map(|n| format!("; {n}")).unwrap_or_default()
                        ))
                    } else {
                        note
                    };
                }
                Err(e) => {
                    point.note = Some(format!("could not run: {}", one_line(&e)));
                    break;
                }
            }
            if point.verdict != Verdict::Fail {
                break;
            }
        }
        point.run_seconds = t.elapsed().as_secs_f64();
        let metric = point.metric.map(|m| format!(", {} = {m}", self.criterion.metric.as_ref().map_or("", |x| &x.0)));
        self.progress.info(format!(
            "triage: {kind} {label}: {}{}{} ({:.1}s{})",
            serde_json::to_value(point.verdict)
                .ok()
                .and_then(|v| v.as_str().map(str::to_uppercase))
                .unwrap_or_default(),
            point.exit_code.map(|c| format!(", exit {c}")).unwrap_or_default(),
            metric.unwrap_or_default(),
            point.build_seconds + point.run_seconds,
            point.note.as_ref().map(|n| format!("; {n}")).unwrap_or_default(),
        ));
        self.points.push(point.clone());
        point
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_code_decides_without_a_metric() {
        let c = Criterion { metric: None, higher_is_better: false };
        assert_eq!(c.judge(0, None).0, Verdict::Pass);
        assert_eq!(c.judge(3, Some("{}")).0, Verdict::Fail);
    }

    #[test]
    fn metric_against_the_threshold() {
        let lower = Criterion { metric: Some(("loss".into(), 2.5)), higher_is_better: false };
        assert_eq!(lower.judge(0, Some(r#"{"loss": 2.4}"#)), (Verdict::Pass, Some(2.4), None));
        assert_eq!(lower.judge(0, Some(r#"{"loss": 2.6}"#)).0, Verdict::Fail);
        assert_eq!(lower.judge(0, Some(r#"{"loss": 2.5}"#)).0, Verdict::Pass, "at the threshold passes");
        assert_eq!(lower.judge(1, Some(r#"{"loss": 1.0}"#)).0, Verdict::Fail, "a failing command fails");
        let (v, _, note) = lower.judge(0, None);
        assert_eq!(v, Verdict::Fail);
        assert!(note.unwrap().contains("metrics.json"));
        assert_eq!(lower.judge(0, Some(r#"{"other": 1}"#)).0, Verdict::Fail);
        let higher = Criterion { metric: Some(("tokens_per_s".into(), 100.0)), higher_is_better: true };
        assert_eq!(higher.judge(0, Some(r#"{"tokens_per_s": 90}"#)).0, Verdict::Fail);
        assert_eq!(higher.judge(0, Some(r#"{"tokens_per_s": 120}"#)).0, Verdict::Pass);
    }
}
