//! `test-all`: the in-image test suite (docs/test-all.md). A list of named checks — loss curves
//! of the seed tiny configurations against recorded baselines, checkpoint resumption, training
//! on virtual devices with a resharded resume, a Hugging
//! Face round trip, data preparation, CPU↔GPU parity, throughput — run on the best device
//! present, each ending as passed, failed or skipped, with its time and a one-line detail.
//!
//! Adding a check is adding one entry to [`checks`]. [`baselines`] holds the recorded curves, their
//! file format and the choice of the reference a run compares with, [`report`] the table, JUnit
//! XML and JSON summary.

pub mod baselines;
mod checks;
pub mod html;
pub mod report;

/// Writes the report of `--report DIR`: `junit.xml`, `summary.json` and `report.html`, the page
/// drawn by `html.rs` from the same summary (`report.rs` writes, `html.rs` draws: neither
/// imports the other's caller).
pub fn write_report(dir: &std::path::Path, s: &report::Summary) -> anyhow::Result<()> {
    report::write(dir, s, &html::page(s)?)
}

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use crate::backend::cpu;
use crate::backend::cuda::{self, Cuda, discovery};
use baselines::{Curve, Reference};

/// How much work the checks do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Fewer steps: the whole suite in under a minute on two CPU cores.
    Quick,
    /// The recipes' own step counts.
    Full,
}

impl Mode {
    /// `quick` or `full`: also the baseline file's stem.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Quick => "quick",
            Mode::Full => "full",
        }
    }
}

/// The kind of device the checks run on; baselines are recorded per class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceClass {
    /// The f32 CPU reference backend.
    Cpu,
    /// The CUDA backend (bf16) on the first GPU.
    Cuda,
}

impl DeviceClass {
    /// `cpu` or `cuda`: also the baselines' subdirectory.
    pub fn name(self) -> &'static str {
        match self {
            DeviceClass::Cpu => "cpu",
            DeviceClass::Cuda => "cuda",
        }
    }

    /// One line naming the device: the CPU model and thread count, or the GPU.
    pub fn describe(self) -> String {
        match self {
            DeviceClass::Cpu => format!("cpu: {} ({} threads)", cpu::model_name(), rayon::current_num_threads()),
            DeviceClass::Cuda => match discovery::probe() {
                Ok(d) => format!("cuda: {} (sm_{}{})", d[0].name, d[0].capability.0, d[0].capability.1),
                Err(e) => format!("cuda: unavailable ({e})"),
            },
        }
    }
}

/// Where the checks run: the CPU, the first GPU, or the CUDA backend on the CPU emulator of a GPU
/// (`test-all --emulate`: the same host code and kernel sources, bf16 arithmetic, no GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The f32 CPU reference backend.
    Cpu,
    /// The CUDA backend on the first GPU.
    Gpu,
    /// The CUDA backend on the CPU emulator ([`crate::backend::cuda::emulator`]).
    Emulator,
}

impl Target {
    /// The device class: whose baselines apply and which tolerances (the emulator is of the CUDA
    /// class, whose arithmetic it reproduces).
    pub fn class(self) -> DeviceClass {
        match self {
            Target::Cpu => DeviceClass::Cpu,
            Target::Gpu | Target::Emulator => DeviceClass::Cuda,
        }
    }

    /// One line naming the device.
    pub fn describe(self) -> String {
        match self {
            Target::Emulator => {
                format!("cuda: CPU emulator of an sm_90 GPU ({} threads)", rayon::current_num_threads())
            }
            _ => self.class().describe(),
        }
    }

    /// A fresh CUDA backend on this target: the first GPU or the emulator.
    pub fn open_cuda(self) -> Result<Cuda> {
        match self {
            Target::Emulator => Cuda::emulated().map_err(|e| anyhow::anyhow!("cannot open the CUDA emulator: {e}")),
            _ => open_gpu(),
        }
    }
}

/// How a check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// It ran and what it checked held.
    Pass,
    /// It ran and something did not hold (or it could not run).
    Fail,
    /// It did not apply here (e.g. no GPU); the detail says why.
    Skip,
}

/// A check's verdict and its one-line explanation, with the figures the report draws.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// Pass, fail or skip.
    pub status: Status,
    /// Measured figures, the failure, or why it was skipped.
    pub detail: String,
    /// A curve check's loss against its baseline's band.
    pub curve: Option<CurveRecord>,
    /// Figures measured, each against its baseline where it has one (throughput, parity).
    pub measures: Vec<Measure>,
}

impl Verdict {
    /// Passed, with the figures.
    pub fn pass(detail: impl Into<String>) -> Verdict {
        Verdict { status: Status::Pass, detail: detail.into(), curve: None, measures: Vec::new() }
    }
    /// Failed, with what did not hold.
    pub fn fail(detail: impl Into<String>) -> Verdict {
        Verdict { status: Status::Fail, detail: detail.into(), curve: None, measures: Vec::new() }
    }
    /// Skipped, with the reason.
    pub fn skip(detail: impl Into<String>) -> Verdict {
        Verdict { status: Status::Skip, detail: detail.into(), curve: None, measures: Vec::new() }
    }
    /// The same verdict with the curve it compared.
    pub fn with_curve(self, curve: CurveRecord) -> Verdict {
        Verdict { curve: Some(curve), ..self }
    }
    /// The same verdict with the figures it measured.
    pub fn with_measures(self, measures: Vec<Measure>) -> Verdict {
        Verdict { measures, ..self }
    }
}

/// A loss curve as a check compared it: step `i + 1`'s loss, the baseline's, and the relative
/// tolerance that decided that step. A step fails when `|loss - baseline| > tolerance ·
/// |baseline|` (or the difference is not finite); `failing_steps` lists them, 1-based.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CurveRecord {
    /// This run's loss at each step.
    pub loss: Vec<f64>,
    /// The baseline's loss at each step.
    pub baseline: Vec<f64>,
    /// The relative tolerance at each step.
    pub tolerance: Vec<f64>,
    /// The steps outside the tolerance, 1-based.
    pub failing_steps: Vec<usize>,
}

/// One measured figure of a check, for the report's table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measure {
    /// What was measured (`tiny-llama2 tokens/s`, a parity check's name).
    pub name: String,
    /// The value.
    pub value: f64,
    /// Its unit (`tokens/s`, `s`).
    pub unit: &'static str,
    /// The baseline's value, where it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<f64>,
    /// Whether it held.
    pub ok: bool,
    /// What else the check said of it.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub note: String,
}

/// A finished check.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The check's name.
    pub name: String,
    /// How it ended.
    pub status: Status,
    /// Wall time in seconds.
    pub seconds: f64,
    /// Figures, the failure, or the reason for a skip.
    pub detail: String,
    /// A curve check's loss, baseline, tolerance and failing steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub curve: Option<CurveRecord>,
    /// The figures it measured (throughput against the baseline, parity checks).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub measures: Vec<Measure>,
}

/// One entry of the suite.
pub struct Check {
    /// Its name, matched by `--filter`.
    pub name: &'static str,
    /// Whether it compares with the baselines (which must then be present and valid).
    pub needs_baselines: bool,
    /// Runs it. An error is a failure of the check, reported with its message.
    pub run: fn(&mut Ctx) -> Result<Verdict>,
}

/// The suite, in the order it runs. Another check is one more entry here.
pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "tiny-llama2", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-llama2") },
        Check { name: "tiny-mistral", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-mistral") },
        Check { name: "tiny-mixtral", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-mixtral") },
        Check { name: "tiny-gpt", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-gpt") },
        Check { name: "tiny-qwen3", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-qwen3") },
        Check { name: "tiny-qwen3-moe", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-qwen3-moe") },
        Check { name: "tiny-deepseek-v3", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-deepseek-v3") },
        Check { name: "tiny-gpt-oss", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-gpt-oss") },
        Check { name: "tiny-gemma3", needs_baselines: true, run: |c| checks::loss_curve(c, "tiny-gemma3") },
        Check { name: "checkpoint-resume", needs_baselines: false, run: checks::checkpoint_resume },
        Check { name: "virtual-devices", needs_baselines: false, run: checks::virtual_devices },
        Check { name: "hf-roundtrip", needs_baselines: false, run: checks::hf_roundtrip },
        Check { name: "data-prepare", needs_baselines: false, run: checks::data_prepare },
        Check { name: "gpu-parity", needs_baselines: false, run: checks::gpu_parity },
        Check { name: "throughput", needs_baselines: true, run: checks::throughput },
    ]
}

/// The recipes whose loss curves are recorded as baselines.
pub const CURVE_RECIPES: [&str; 9] = [
    "tiny-llama2",
    "tiny-mistral",
    "tiny-mixtral",
    "tiny-gpt",
    "tiny-qwen3",
    "tiny-qwen3-moe",
    "tiny-deepseek-v3",
    "tiny-gpt-oss",
    "tiny-gemma3",
];

/// Why `recipe`'s curve cannot be trained on `class` (`None`: it can): a recipe whose model the
/// CUDA backend refuses ([`cuda_unsuitable`]) has no CUDA curve, and its checks on a GPU or the
/// emulator are skipped.
pub fn curve_unsupported(recipe: &str, class: DeviceClass) -> Result<Option<String>> {
    if class != DeviceClass::Cuda {
        return Ok(None);
    }
    Ok(cuda_unsuitable(&crate::config::resolve(recipe, &[])?.config.model))
}

/// What the checks share: the mode, the target, the reference curves and the curves trained so
/// far (a curve is trained once and read by both its loss check and the throughput check).
pub struct Ctx<'a> {
    /// Quick or full.
    pub mode: Mode,
    /// Where the checks run.
    pub target: Target,
    /// What the curves are compared with, when a selected check needs it.
    pub reference: Option<&'a Reference>,
    /// Progress lines (the command prints them as the checks run).
    pub progress: &'a mut dyn FnMut(&str),
    curves: BTreeMap<String, Curve>,
}

impl<'a> Ctx<'a> {
    /// A context for running checks.
    pub fn new(
        mode: Mode,
        target: Target,
        reference: Option<&'a Reference>,
        progress: &'a mut dyn FnMut(&str),
    ) -> Ctx<'a> {
        Ctx { mode, target, reference, progress, curves: BTreeMap::new() }
    }

    /// The curve of `recipe` if a check has trained it already.
    pub fn trained(&self, recipe: &str) -> Option<&Curve> {
        self.curves.get(recipe)
    }

    /// The loss curve of `recipe` in this mode on this device, trained on first use.
    pub fn curve(&mut self, recipe: &str) -> Result<Curve> {
        if let Some(c) = self.curves.get(recipe) {
            return Ok(c.clone());
        }
        let curve = baselines::train_curve(recipe, self.mode, self.target, &mut *self.progress)?;
        self.curves.insert(recipe.to_owned(), curve.clone());
        Ok(curve)
    }
}

/// Whether check `name` is selected by `pattern`: a glob (`*` any text, `?` one character) when
/// the pattern holds either, else a substring.
pub fn matches(pattern: &str, name: &str) -> bool {
    if !pattern.contains(['*', '?']) {
        return name.contains(pattern);
    }
    // Iterative wildcard matching with backtracking to the last `*`.
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// The checks that `filters` select (all when there is none); a filter that selects nothing is
/// an error naming it and the checks there are.
pub fn select(filters: &[String]) -> Result<Vec<Check>> {
    let all = checks();
    for f in filters {
        if !all.iter().any(|c| matches(f, c.name)) {
            let names: Vec<&str> = all.iter().map(|c| c.name).collect();
            bail!("--filter {f}: no check matches (the checks: {})", names.join(", "));
        }
    }
    Ok(all.into_iter().filter(|c| filters.is_empty() || filters.iter().any(|f| matches(f, c.name))).collect())
}

/// Runs `selected` in order, calling `done` as each ends.
pub fn run(ctx: &mut Ctx, selected: &[Check], done: &mut dyn FnMut(&Outcome)) -> Vec<Outcome> {
    let mut out = Vec::new();
    for check in selected {
        (ctx.progress)(&format!("[{}] running", check.name));
        let start = Instant::now();
        let verdict = (check.run)(ctx).unwrap_or_else(|e| Verdict::fail(format!("{e:#}")));
        let o = Outcome {
            name: check.name.to_owned(),
            status: verdict.status,
            seconds: start.elapsed().as_secs_f64(),
            detail: verdict.detail,
            curve: verdict.curve,
            measures: verdict.measures,
        };
        done(&o);
        out.push(o);
    }
    out
}

/// Opens a backend on `target` (a [`Target`]) and evaluates `body` with it bound to `be` (a
/// dispatch over the backends, whose types differ).
macro_rules! with_backend {
    ($target:expr, |$be:ident| $body:expr) => {
        match $target {
            $crate::testall::Target::Cpu => {
                let $be = $crate::backend::cpu::Cpu::new();
                $body
            }
            t => {
                let $be = t.open_cuda()?;
                $body
            }
        }
    };
}
pub(crate) use with_backend;

/// The first GPU's backend, or an error saying why there is none.
pub fn open_gpu() -> Result<Cuda> {
    Cuda::new(0).map_err(|e| anyhow::anyhow!("cannot open the CUDA GPU: {e}"))
}

/// Whether a recipe's model suits the CUDA kernels (`None`) or why not.
pub fn cuda_unsuitable(model: &crate::config::ModelConfig) -> Option<String> {
    cuda::check_model(model).err().map(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_substrings_or_globs() {
        assert!(matches("llama", "tiny-llama2"));
        assert!(!matches("llama3", "tiny-llama2"));
        assert!(matches("tiny-*", "tiny-mixtral"));
        assert!(matches("*-m?stral", "tiny-mistral"));
        assert!(!matches("tiny-*", "hf-roundtrip"));
        assert!(matches("*", "throughput"));
        assert!(!matches("t?ny", "tiny-llama2"), "a glob matches the whole name");
        assert!(matches("*resume", "checkpoint-resume"));
    }

    #[test]
    fn selection_keeps_the_order_and_refuses_a_filter_that_selects_nothing() {
        let names = |f: &[&str]| {
            let f: Vec<String> = f.iter().map(|s| s.to_string()).collect();
            select(&f).map(|v| v.iter().map(|c| c.name).collect::<Vec<_>>())
        };
        assert_eq!(names(&["hf", "tiny-l*"]).unwrap(), ["tiny-llama2", "hf-roundtrip"]);
        assert_eq!(names(&[]).unwrap().len(), checks().len());
        let e = names(&["nope"]).unwrap_err().to_string();
        assert!(e.contains("--filter nope") && e.contains("tiny-llama2"), "{e}");
    }
}
