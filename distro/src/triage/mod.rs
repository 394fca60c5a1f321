//! `distro triage`: finds the first dated image where a command fails, then the upstream commit.
//!
//! 1. Dates: the dated tags `NAME-YYYY-MM-DD` of the repository between `--good` and `--bad`;
//!    both ends are checked, then exponential search from the good end and bisection
//!    ([`crate::dated::search`]), pulling and running the command in each image ([`dates`]).
//! 2. Commits: the pins of the last good and first bad image (their
//!    `io.github.llm-distro.source.NAME.pin` annotations) are compared; the git sources that
//!    moved are stepped from the good pins to the bad ones, one source at a time, to find the
//!    source that breaks the command, then that source's commits between the two pins are
//!    bisected by rebuilding the image (`distro build --source NAME=URL#COMMIT`, the checkout's
//!    image definition and patches, the bad image's base) and running the command. A commit
//!    that does not build is skipped and reported ([`commits`], [`rebuild`]).
//!
//! Rebuilds happen in a checkout of the project at the failing image's own recorded revision
//! (`org.opencontainers.image.revision`), so its image definition, patches and lock are the
//! ones it was built with, not the checkout's `HEAD` ([`revision`]).
//!
//! `--good IMAGE --bad IMAGE` compares two given images instead of dates: both are run, then
//! stage 2 runs on them ([`images`]).
//!
//! The command runs in the container with `$TRIAGE_OUT` (a host directory mounted at
//! `/triage`); with `--metric NAME --threshold X` it must write `$TRIAGE_OUT/metrics.json`, a
//! JSON object with a number under `NAME`, and the point fails when that number is above `X`
//! (below, with `--higher-is-better`) or when the command exits non-zero ([`point`]).
use crate::dated::Verdict;
use crate::docker::Gpus;
use crate::error::one_line;
use crate::fsutil::DirLock;
use crate::image::build::{self, BuildDir};
use crate::image::workspace::Workspace;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use anyhow::{Context, Result};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Instant;

pub mod commits;
pub mod dates;
pub mod images;
pub mod point;
pub mod rebuild;
pub mod revision;

pub use point::{Criterion, Point};

/// Where the command finds its output directory inside the container.
pub const TRIAGE_MOUNT: &str = "/triage";

/// What `--good` and `--bad` name.
#[derive(Clone, Debug)]
pub enum Ends {
    /// Two dates of the dated tags `NAME-YYYY-MM-DD` of a repository (no tag, no digest).
    Dates {
        /// The repository (`--repo`).
        repo: Reference,
        /// A date whose image passes.
        good: String,
        /// A later date whose image fails.
        bad: String,
    },
    /// Two given images (`REPO:TAG` or `REPO@DIGEST`): one that passes, one that fails.
    Images {
        /// The image that passes.
        good: Reference,
        /// The image that fails.
        bad: Reference,
    },
}

/// What one triage run looks for, checked (the command line's `TriageArgs` after parsing).
#[derive(Clone, Debug)]
pub struct Options {
    /// The two ends: dates of a repository, or two images.
    pub ends: Ends,
    /// Image name: the tags are NAME-YYYY-MM-DD, and rebuilds use `images/NAME.toml`.
    pub image: String,
    /// How a point's exit code and metrics become a verdict.
    pub criterion: Criterion,
    /// Where to write the JSON summary, if anywhere.
    pub summary: Option<PathBuf>,
    /// Only find the date; do not bisect upstream commits.
    pub dates_only: bool,
    /// Base image for rebuilds (default: the bad image's base, by digest).
    pub base: Option<String>,
    /// Working directory for outputs and rebuilt layouts (default: target/distro/triage).
    pub work_dir: Option<PathBuf>,
    /// `KEY=VALUE` environment of the command's container.
    pub env: Vec<String>,
    /// GPUs for the command's container.
    pub gpus: Gpus,
    /// Registries reachable over plain HTTP.
    pub insecure: Vec<String>,
    /// Reruns of a failing point before its failure counts: a point that passes on any rerun
    /// is a pass (flaky, noted in the summary).
    pub confirm: u32,
    /// The command run in each image; it passes with exit code 0.
    pub command: Vec<String>,
}

/// The state of one triage run, which every tested point is recorded in.
struct Triage {
    /// The workspace's build directory, held for the triage's life (none outside a checkout).
    build_dir: Option<BuildDir>,
    args: Options,
    criterion: Criterion,
    work: PathBuf,
    progress: Progress,
    host: Platform,
    points: Vec<Point>,
    started: Instant,
}

/// Runs a triage: prints the culprit line (and the commits that did not build) on stdout and
/// writes the summary, when asked, whatever happened.
pub fn triage(args: Options) -> Result<()> {
    let host = Platform::host().ok_or_else(|| anyhow::anyhow!("this machine's architecture has no image platform"))?;
    let ws = Workspace::open(&std::env::current_dir()?).ok();
    // The build directory is held for the whole triage (its rebuilds stage and build there), and
    // so is a --work-dir; the default work directory is inside the build directory.
    let build_dir = ws.as_ref().map(BuildDir::lock).transpose()?;
    let work = match (&args.work_dir, &ws) {
        (Some(w), _) => w.clone(),
        (None, Some(ws)) => build::build_dir(ws).join("triage"),
        (None, None) => std::env::temp_dir().join(format!("distro-triage-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let _work_lock = match &args.work_dir {
        Some(w) => {
            Some(DirLock::exclusive(w, "triage work directory", "wait for it to finish, or choose another --work-dir")?)
        }
        None => None,
    };
    let criterion = args.criterion.clone();
    let client = Client::new(Credentials::from_environment(None)?, args.insecure.clone())?;
    let mut t = Triage {
        build_dir,
        args,
        criterion,
        work,
        progress: Progress::plain(),
        host,
        points: Vec::new(),
        started: Instant::now(),
    };
    let mut summary = json!({});
    let result = run(&mut t, &client, ws.as_ref(), &mut summary);
    // The summary is written whatever happened, with what was tested.
    match &t.args.ends {
        Ends::Dates { repo, good, bad } => {
            summary["repo"] = json!(repo.name());
            summary["good"] = json!(good);
            summary["bad"] = json!(bad);
        }
        Ends::Images { good, bad } => {
            summary["good"] = json!(good.to_string());
            summary["bad"] = json!(bad.to_string());
        }
    }
    summary["image"] = json!(t.args.image);
    summary["command"] = json!(t.args.command);
    summary["criterion"] = match &t.criterion.metric {
        Some((m, x)) => {
            json!({"metric": m, "threshold": x, "fails_when": if t.criterion.higher_is_better { "below" } else { "above" }})
        }
        None => json!({"exit_code": 0}),
    };
    summary["points"] = serde_json::to_value(&t.points)?;
    summary["seconds"] = json!(t.started.elapsed().as_secs_f64());
    if let Err(e) = &result {
        summary["error"] = json!(one_line(e));
    }
    if let Some(path) = &t.args.summary {
        let mut bytes = serde_json::to_vec_pretty(&summary)?;
        bytes.push(b'\n');
        crate::fsutil::write_atomic(path, &bytes)?;
    }
    result
}

/// The two images stage 2 compares: the last that passes and the first that fails.
pub(crate) struct Pair {
    /// The passing image.
    pub good: Reference,
    /// The failing image.
    pub bad: Reference,
    /// How the failing one is named in messages (its date, or its reference).
    pub bad_label: String,
    /// The date the rebuilds are tagged with.
    pub date: String,
}

/// Both stages, then the culprit line on stdout.
fn run(t: &mut Triage, client: &Client, ws: Option<&Workspace>, summary: &mut Value) -> Result<()> {
    // 1. The first failing date, or the two given images checked.
    let (pair, mut culprit, mut line) = match t.args.ends.clone() {
        Ends::Dates { repo, good, bad } => {
            let (lg, fb) = dates::find(t, client, &repo, (&good, &bad), summary)?;
            let pair = Pair {
                good: repo.with_tag(&lg.tag),
                bad: repo.with_tag(&fb.tag),
                bad_label: fb.date.clone(),
                date: fb.date.clone(),
            };
            (pair, json!({"date": fb.date}), format!("culprit: date {} (last good {})", fb.date, lg.date))
        }
        Ends::Images { good, bad } => {
            let pair = images::check(t, client, &good, &bad)?;
            (pair, json!({"image": bad.to_string()}), format!("culprit: image {bad} (good {good})"))
        }
    };

    // 2. Upstream commits.
    let outcome = if t.args.dates_only {
        Some("commits not bisected (--dates-only)".to_string())
    } else if let Some(ws) = ws {
        commits::find(t, client, ws, &pair, summary, &mut culprit)?
    } else {
        Some("commits not bisected: not run inside a checkout of the project".to_string())
    };
    if let Some(why) = &outcome {
        t.progress.info(format!("triage: {why}"));
        culprit["note"] = json!(why);
    }
    summary["culprit"] = culprit.clone();
    if let (Some(s), Some(c)) = (culprit["source"].as_str(), culprit["commit"].as_str()) {
        line += &format!(", source {s}, commit {c} {:?}", culprit["subject"].as_str().unwrap_or(""));
    }
    if let Some(others) = culprit["candidates"].as_array().filter(|a| a.len() > 1) {
        line += &format!(" (or one of the {} commits before it that did not build)", others.len() - 1);
    }
    println!("{line}");
    for p in t.points.iter().filter(|p| p.kind == "commit" && p.verdict == Verdict::Skip) {
        println!("skipped (did not build): {}: {}", p.label, p.note.as_deref().unwrap_or(""));
    }
    Ok(())
}
