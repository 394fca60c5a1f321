//! `distro triage`: finds the first dated image where a command fails, then the upstream commit.
//!
//! 1. Dates: the dated tags `NAME-YYYY-MM-DD` of the repository between `--good` and `--bad`;
//!    both ends are checked, then exponential search from the good end and bisection
//!    ([`crate::dated::search`]), pulling and running the command in each image.
//! 2. Commits: the pins of the last good and first bad image (their
//!    `io.github.llm-distro.source.NAME.pin` annotations) are compared; the git sources that
//!    moved are stepped from the good pins to the bad ones, one source at a time, to find the
//!    source that breaks the command, then that source's commits between the two pins are
//!    bisected by rebuilding the image (`distro build --source NAME=URL#COMMIT`, the checkout's
//!    image definition and patches, the bad image's base) and running the command. A commit
//!    that does not build is skipped and reported.
//!
//! The command runs in the container with `$TRIAGE_OUT` (a host directory mounted at
//! `/triage`); with `--metric NAME --threshold X` it must write `$TRIAGE_OUT/metrics.json`, a
//! JSON object with a number under `NAME`, and the point fails when that number is above `X`
//! (below, with `--higher-is-better`) or when the command exits non-zero.
use crate::dated::{DatedTag, Found, Verdict, dated_tags, search};
use crate::docker::{self, Gpus, RunOptions};
use crate::error::{bad_input, one_line};
use crate::git::Git;
use crate::image::build::{BuildOptions, build};
use crate::image::sources::PIN_ANNOTATION_PREFIX;
use crate::image::workspace::Workspace;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use crate::publish::daemon::Daemon;
use crate::publish::layout::OciLayout;
use crate::publish::publish;
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use crate::sources::{Manifest, SourceKind};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where the command finds its output directory inside the container.
pub const TRIAGE_MOUNT: &str = "/triage";

/// What one triage run looks for, checked (the command line's `TriageArgs` after parsing).
#[derive(Clone, Debug)]
pub struct Options {
    /// Repository holding the dated images (no tag, no digest).
    pub repo: Reference,
    /// Image name: the tags are NAME-YYYY-MM-DD.
    pub image: String,
    /// A date whose image passes.
    pub good: String,
    /// A later date whose image fails.
    pub bad: String,
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
    /// The command run in each image; it passes with exit code 0.
    pub command: Vec<String>,
}

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

/// The state of one triage run, which every tested point is recorded in.
struct Triage {
    args: Options,
    criterion: Criterion,
    work: PathBuf,
    progress: Progress,
    host: Platform,
    points: Vec<Point>,
    started: Instant,
}

impl Triage {
    /// Runs the command in `image` (pulled when not local) and judges the result.
    fn run_in(&mut self, kind: &'static str, label: &str, image: &str, build_seconds: f64) -> Point {
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
        match docker::run(&opts, &self.progress) {
            Ok(code) => {
                let metrics = std::fs::read_to_string(out.join("metrics.json")).ok();
                let (v, m, note) = self.criterion.judge(code, metrics.as_deref());
                point.verdict = v;
                point.exit_code = Some(code);
                point.metric = m;
                point.note = note;
            }
            Err(e) => point.note = Some(format!("could not run: {}", one_line(&e))),
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

/// A git source that moved between the two images.
#[derive(Clone, Debug)]
struct Moved {
    name: String,
    url: String,
    good: String,
    bad: String,
    /// Commits after `good` up to `bad` (first parent), oldest first, with subjects.
    commits: Vec<(String, String)>,
}

/// The commits of `url` after `good` up to `bad` (first parent, oldest first) with subjects,
/// from a bare mirror in `dir` (fetched again only when a pin is missing).
fn commits_between(dir: &Path, url: &str, tracking_ref: &str, good: &str, bad: &str) -> Result<Vec<(String, String)>> {
    // A mirror distro owns: isolated commands, fetches with the user's network configuration.
    let git = Git::new(dir);
    if !dir.join("HEAD").exists() {
        std::fs::create_dir_all(dir)?;
        git.run(["init", "-q", "--bare"])?;
    }
    let fetch = |args: &[&str]| git.run_network(args);
    let have = |c: &str| git.has_commit(c);
    if !have(good) || !have(bad) {
        let _ = fetch(&["fetch", "-q", url, &format!("+{tracking_ref}:refs/triage/tracking")]);
        if !have(good) || !have(bad) {
            fetch(&["fetch", "-q", url, good, bad]).with_context(|| format!("fetching {good} and {bad} from {url}"))?;
        }
    }
    let log = git.run(["log", "--first-parent", "--reverse", "--format=%H %s", &format!("{good}..{bad}")])?;
    Ok(log.lines().filter_map(|l| l.split_once(' ').map(|(c, s)| (c.to_string(), s.to_string()))).collect())
}

/// The annotations of a tag's index (or manifest).
fn annotations(client: &Client, r: &Reference) -> Result<BTreeMap<String, String>> {
    let m = client.fetch_manifest(r)?;
    let v: Value = serde_json::from_slice(&m.bytes)?;
    Ok(v.get("annotations")
        .and_then(Value::as_object)
        .map(|o| o.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string()))).collect())
        .unwrap_or_default())
}

fn pins(ann: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    ann.iter()
        .filter_map(|(k, v)| {
            Some((k.strip_prefix(PIN_ANNOTATION_PREFIX)?.strip_suffix(".pin")?.to_string(), v.clone()))
        })
        .collect()
}

/// Runs a triage: prints the culprit line (and the commits that did not build) on stdout and
/// writes the summary, when asked, whatever happened.
pub fn triage(args: Options) -> Result<()> {
    let repo = args.repo.clone();
    let host = Platform::host().ok_or_else(|| anyhow::anyhow!("this machine's architecture has no image platform"))?;
    let ws = Workspace::open(&std::env::current_dir()?).ok();
    let work = match (&args.work_dir, &ws) {
        (Some(w), _) => w.clone(),
        (None, Some(ws)) => crate::image::build::cache_dir(ws).join("triage"),
        (None, None) => std::env::temp_dir().join(format!("distro-triage-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let criterion = args.criterion.clone();
    let client = Client::new(Credentials::from_environment(None)?, args.insecure.clone())?;
    let mut t = Triage {
        args,
        criterion,
        work,
        progress: Progress::plain(),
        host,
        points: Vec::new(),
        started: Instant::now(),
    };
    let mut summary = json!({});
    let result = run(&mut t, &client, &repo, ws.as_ref(), &mut summary);
    // The summary is written whatever happened, with what was tested.
    summary["repo"] = json!(repo.name());
    summary["image"] = json!(t.args.image);
    summary["good"] = json!(t.args.good);
    summary["bad"] = json!(t.args.bad);
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

fn run(t: &mut Triage, client: &Client, repo: &Reference, ws: Option<&Workspace>, summary: &mut Value) -> Result<()> {
    // 1. Dates.
    let tags = client.list_tags(repo)?;
    let dated = dated_tags(&t.args.image, &tags);
    let find = |flag: &str, date: &str| -> Result<usize> {
        dated.iter().position(|d| d.date == date).ok_or_else(|| {
            bad_input(format!(
                "{flag} {date}: {} has no tag {}-{date} ({} dated tags{})",
                repo.name(),
                t.args.image,
                dated.len(),
                match (dated.first(), dated.last()) {
                    (Some(a), Some(b)) => format!(", {} to {}", a.date, b.date),
                    _ => String::new(),
                }
            ))
        })
    };
    let (gi, bi) = (find("--good", &t.args.good)?, find("--bad", &t.args.bad)?);
    let dates: Vec<DatedTag> = dated[gi..=bi].to_vec();
    t.progress.info(format!("triage: {} dated images from {} to {}", dates.len(), t.args.good, t.args.bad));
    let image_of = |d: &DatedTag| repo.with_tag(&d.tag).to_string();
    let good = t.run_in("date", &dates[0].date, &image_of(&dates[0]), 0.0);
    match good.verdict {
        Verdict::Pass => {}
        Verdict::Fail => {
            return Err(bad_input(format!(
                "--good {}: the command fails in {} too; give an earlier good date",
                t.args.good, good.image
            )));
        }
        Verdict::Skip => bail!("--good {}: {}", t.args.good, good.note.unwrap_or_default()),
    }
    let last = dates.len() - 1;
    let bad = t.run_in("date", &dates[last].date, &image_of(&dates[last]), 0.0);
    match bad.verdict {
        Verdict::Fail => {}
        Verdict::Pass => {
            return Err(bad_input(format!(
                "--bad {}: the command passes in {}; give a date that fails",
                t.args.bad, bad.image
            )));
        }
        Verdict::Skip => bail!("--bad {}: {}", t.args.bad, bad.note.unwrap_or_default()),
    }
    let found = search(0, last, &mut |i| t.run_in("date", &dates[i].date, &image_of(&dates[i]), 0.0).verdict);
    let (lg, fb) = (&dates[found.last_pass], &dates[found.first_fail]);
    summary["last_good_date"] = json!(lg.date);
    summary["first_bad_date"] = json!(fb.date);
    summary["untestable_dates"] = json!(found.skipped.iter().map(|&i| &dates[i].date).collect::<Vec<_>>());
    let mut culprit = json!({"date": fb.date});
    if !found.skipped.is_empty() {
        let c: Vec<&str> = found.skipped.iter().map(|&i| dates[i].date.as_str()).collect();
        t.progress.info(format!(
            "triage: the first failing date is one of {} or {} (could not run those)",
            c.join(", "),
            fb.date
        ));
    }
    t.progress.info(format!("triage: first failing date {} (last passing {})", fb.date, lg.date));

    // 2. Upstream commits.
    let outcome = if t.args.dates_only {
        Some("commits not bisected (--dates-only)".to_string())
    } else if let Some(ws) = ws {
        commits(t, client, repo, ws, lg, fb, summary, &mut culprit)?
    } else {
        Some("commits not bisected: not run inside a checkout of the project".to_string())
    };
    if let Some(why) = &outcome {
        t.progress.info(format!("triage: {why}"));
        culprit["note"] = json!(why);
    }
    summary["culprit"] = culprit.clone();
    let mut line = format!("culprit: date {} (last good {})", fb.date, lg.date);
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

/// Stage 2; returns why it stopped short of a commit, if it did.
#[allow(clippy::too_many_arguments)]
fn commits(
    t: &mut Triage,
    client: &Client,
    repo: &Reference,
    ws: &Workspace,
    lg: &DatedTag,
    fb: &DatedTag,
    summary: &mut Value,
    culprit: &mut Value,
) -> Result<Option<String>> {
    let good_ann = annotations(client, &repo.with_tag(&lg.tag))?;
    let bad_ann = annotations(client, &repo.with_tag(&fb.tag))?;
    let (good_pins, bad_pins) = (pins(&good_ann), pins(&bad_ann));
    let rev = |a: &BTreeMap<String, String>| a.get("org.opencontainers.image.revision").cloned().unwrap_or_default();
    summary["revisions"] = json!({"good": rev(&good_ann), "bad": rev(&bad_ann)});
    let manifest_path = ws.root.join(crate::sources::DEFAULT_MANIFEST);
    let manifest = Manifest::load(&manifest_path)?;
    let mut moved: Vec<Moved> = Vec::new();
    let mut notes = Vec::new();
    for (name, bad_pin) in &bad_pins {
        let Some(good_pin) = good_pins.get(name) else {
            notes.push(format!("source {name} is new in {}", fb.date));
            continue;
        };
        if good_pin == bad_pin {
            continue;
        }
        match manifest.sources.get(name).map(|s| &s.kind) {
            Some(SourceKind::Git(g)) => {
                let url = manifest.fetch_url(&g.url);
                let dir = t.work.join("repos").join(name);
                let commits = commits_between(&dir, &url, &g.tracking_ref, good_pin, bad_pin)?;
                moved.push(Moved { name: name.clone(), url, good: good_pin.clone(), bad: bad_pin.clone(), commits });
            }
            Some(SourceKind::Crate(_)) => notes
                .push(format!("crate source {name} moved {good_pin} -> {bad_pin} (crate versions are not bisected)")),
            None => notes.push(format!("source {name} moved but is not in {}", manifest_path.display())),
        }
    }
    for n in &notes {
        t.progress.info(format!("triage: {n}"));
    }
    summary["sources"] = json!(
        moved
            .iter()
            .map(|m| json!({"name": m.name, "good": m.good, "bad": m.bad, "commits": m.commits.len()}))
            .collect::<Vec<_>>()
    );
    summary["source_notes"] = json!(notes);
    if moved.is_empty() {
        return Ok(Some(format!(
            "no git source moved between {} and {}: look at the project's own changes ({}..{})",
            lg.date,
            fb.date,
            rev(&good_ann),
            rev(&bad_ann)
        )));
    }
    let base = match &t.args.base {
        Some(b) => Reference::parse(b).map_err(|e| bad_input(format!("--base {b:?}: {e:#}")))?,
        None => {
            let name = bad_ann.get("org.opencontainers.image.base.name");
            let digest = bad_ann.get("org.opencontainers.image.base.digest");
            match (name, digest) {
                (Some(n), Some(d)) => Reference::parse(&format!("{n}@{d}"))?,
                _ => bail!("{}: the image does not name its base; pass --base", fb.tag),
            }
        }
    };
    // Every git source of the bad image at its bad pin, except the moved ones, which start good.
    let mut env: BTreeMap<String, (String, String)> = BTreeMap::new();
    for (name, pin) in &bad_pins {
        if let Some(SourceKind::Git(g)) = manifest.sources.get(name).map(|s| &s.kind) {
            env.insert(name.clone(), (manifest.fetch_url(&g.url), pin.clone()));
        }
    }
    for m in &moved {
        env.insert(m.name.clone(), (m.url.clone(), m.good.clone()));
    }
    let ctx = Rebuild { ws_root: ws.root.clone(), base, date: fb.date.clone(), image: t.args.image.clone() };
    let start = rebuild_and_run(t, client, &ctx, &env, "all sources at the good pins");
    if start.verdict != Verdict::Pass {
        return Ok(Some(format!(
            "rebuilt with the good image's pins, the command does not pass ({:?}{}): the regression is not in the upstream sources",
            start.verdict,
            start.note.map(|n| format!(": {n}")).unwrap_or_default()
        )));
    }
    // Move one source at a time to its bad pin; the first step that fails names the source.
    let mut guilty = None;
    for (k, m) in moved.iter().enumerate() {
        env.insert(m.name.clone(), (m.url.clone(), m.bad.clone()));
        let label = format!("{}@{}", m.name, short(&m.bad));
        let p = rebuild_and_run(t, client, &ctx, &env, &label);
        match p.verdict {
            Verdict::Fail => {
                guilty = Some(k);
                break;
            }
            Verdict::Pass => {}
            Verdict::Skip => bail!("rebuilding with {label} failed: {}", p.note.unwrap_or_default()),
        }
    }
    let Some(k) = guilty else {
        return Ok(Some(
            "rebuilt with the bad image's pins, the command passes: the failure does not come from the sources".into(),
        ));
    };
    let m = moved[k].clone();
    env.insert(m.name.clone(), (m.url.clone(), m.good.clone()));
    culprit["source"] = json!(m.name);
    // Points: 0 = the good pin (passed), 1..=n the commits, n = the bad pin (failed).
    let n = m.commits.len();
    if n == 0 {
        return Ok(Some(format!(
            "source {} broke it, but {} has no commits after {} (did the pin go back?)",
            m.name,
            short(&m.bad),
            short(&m.good)
        )));
    }
    t.progress.info(format!(
        "triage: source {} broke it; bisecting its {n} commits {}..{}",
        m.name,
        short(&m.good),
        short(&m.bad)
    ));
    let found: Found = crate::dated::bisect(0, n, &mut |i| {
        let (c, _) = &m.commits[i - 1];
        let mut e = env.clone();
        e.insert(m.name.clone(), (m.url.clone(), c.clone()));
        rebuild_and_run(t, client, &ctx, &e, &format!("{}@{}", m.name, short(c))).verdict
    });
    let (commit, subject) = &m.commits[found.first_fail - 1];
    culprit["commit"] = json!(commit);
    culprit["subject"] = json!(subject);
    culprit["candidates"] =
        json!(found.skipped.iter().chain([&found.first_fail]).map(|&i| &m.commits[i - 1].0).collect::<Vec<_>>());
    let last_good = if found.last_pass == 0 { m.good.clone() } else { m.commits[found.last_pass - 1].0.clone() };
    culprit["last_good_commit"] = json!(last_good);
    Ok(None)
}

fn short(c: &str) -> &str {
    &c[..c.len().min(12)]
}

/// What every rebuild shares.
struct Rebuild {
    ws_root: PathBuf,
    base: Reference,
    date: String,
    image: String,
}

/// Rebuilds the image for this machine's platform with the sources at `env`'s pins, loads it
/// into Docker and runs the command; a build failure is a skip.
fn rebuild_and_run(
    t: &mut Triage,
    client: &Client,
    ctx: &Rebuild,
    env: &BTreeMap<String, (String, String)>,
    label: &str,
) -> Point {
    let started = Instant::now();
    let opts = BuildOptions {
        image: ctx.image.clone(),
        platforms: Some(vec![t.host.clone()]),
        date: Some(ctx.date.clone()),
        base: Some(ctx.base.clone()),
        start_dir: ctx.ws_root.clone(),
        source_overrides: env.iter().map(|(n, (url, c))| format!("{n}={url}#{c}")).collect(),
        ..Default::default()
    };
    t.progress.info(format!("triage: rebuilding {label}"));
    let loaded = build(&opts, client, &t.progress).and_then(|built| {
        // The layout stays in the work directory for a look afterwards; Docker gets the image.
        publish(&OciLayout { dir: t.work.join("oci") }, &built.bundle, &t.progress)?;
        let daemon = Daemon {
            refs: vec![format!("{}-{}", ctx.image, ctx.date)],
            platform: Some(t.host.clone()),
            repo: "distro-triage".into(),
            output: None,
        };
        let names = publish(&daemon, &built.bundle, &t.progress)?.names;
        names.into_iter().next().map(|(n, _)| n).ok_or_else(|| anyhow::anyhow!("nothing loaded"))
    });
    let secs = started.elapsed().as_secs_f64();
    match loaded {
        Ok(name) => t.run_in("commit", label, &name, secs),
        Err(e) => {
            let p = Point {
                kind: "commit",
                label: label.to_string(),
                image: String::new(),
                verdict: Verdict::Skip,
                exit_code: None,
                metric: None,
                build_seconds: secs,
                run_seconds: 0.0,
                note: Some(format!("build failed: {}", one_line(&e))),
            };
            t.progress.info(format!("triage: commit {label}: SKIP ({secs:.1}s; {})", p.note.as_deref().unwrap_or("")));
            t.points.push(p.clone());
            p
        }
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

    #[test]
    fn pins_come_from_the_annotations() {
        let ann = BTreeMap::from([
            (format!("{PIN_ANNOTATION_PREFIX}probe.pin"), "abc".to_string()),
            (format!("{PIN_ANNOTATION_PREFIX}probe.tree"), "t".to_string()),
            ("org.opencontainers.image.revision".to_string(), "r".to_string()),
        ]);
        assert_eq!(pins(&ann), BTreeMap::from([("probe".to_string(), "abc".to_string())]));
    }
}
