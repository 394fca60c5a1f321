//! `distro triage`: its arguments, checked before anything runs (every problem is bad input,
//! exit 2); the search itself is [`crate::triage`].
use super::parse_repo;
use crate::dated::parse_date;
use crate::docker::Gpus;
use crate::error::bad_input;
use crate::registry::reference::Reference;
use crate::triage::{Criterion, Ends, Options, triage};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro triage`.
#[derive(Args, Debug)]
pub struct TriageArgs {
    /// Repository holding the dated images, e.g. ghcr.io/org/distro (with dates for --good and --bad).
    #[arg(long, value_name = "REPO")]
    pub repo: Option<String>,
    /// Image name: the tags are NAME-YYYY-MM-DD, and rebuilds use images/NAME.toml.
    #[arg(long, default_value = "engine", value_name = "NAME", value_parser = super::image_name)]
    pub image: String,
    /// A date whose image passes (with --repo), or an image that passes (REPO:TAG or REPO@DIGEST).
    #[arg(long, value_name = "YYYY-MM-DD|IMAGE")]
    pub good: String,
    /// A later date whose image fails (with --repo), or an image that fails.
    #[arg(long, value_name = "YYYY-MM-DD|IMAGE")]
    pub bad: String,
    /// Decide by this number in $TRIAGE_OUT/metrics.json (with --threshold) as well as by exit code.
    #[arg(long, value_name = "NAME", requires = "threshold")]
    pub metric: Option<String>,
    /// A point fails when the metric is above this (below it with --higher-is-better).
    #[arg(long, value_name = "X", requires = "metric")]
    pub threshold: Option<f64>,
    /// The metric is better when higher (e.g. tokens/s): fail below the threshold.
    #[arg(long, requires = "metric")]
    pub higher_is_better: bool,
    /// Write the summary (every point tested, verdicts, timings, the culprit) as JSON here.
    #[arg(long, value_name = "FILE")]
    pub summary: Option<PathBuf>,
    /// Only find the date; do not bisect upstream commits.
    #[arg(long)]
    pub dates_only: bool,
    /// Base image for rebuilds (default: the bad image's base, by digest).
    #[arg(long, value_name = "REF")]
    pub base: Option<String>,
    /// Working directory for outputs and rebuilt layouts (default: target/distro/triage).
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// Environment variable KEY=VALUE for the command's container (repeatable).
    #[arg(short, long, value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// GPUs for the command's container: auto, all, none.
    #[arg(long, value_enum, default_value_t = Gpus::Auto)]
    pub gpus: Gpus,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
    /// Rerun a failing point N more times; its failure counts only if every rerun fails too
    /// (a pass on any rerun makes it a flaky pass).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub confirm: u32,
    /// The command run in each image; it passes with exit code 0.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Runs `distro triage`: checks the arguments, then runs the search ([`triage`]).
pub fn triage_cmd(args: TriageArgs) -> Result<ExitCode> {
    triage(check_args(args)?)?;
    Ok(ExitCode::SUCCESS)
}

/// Parses and checks the arguments; every problem is bad input (exit 2).
fn check_args(a: TriageArgs) -> Result<Options> {
    let ends = ends(a.repo.as_deref(), &a.good, &a.bad)?;
    for e in &a.env {
        if !e.contains('=') {
            return Err(bad_input(format!("--env {e:?}: expected KEY=VALUE")));
        }
    }
    if a.threshold.is_some_and(|t| !t.is_finite()) {
        return Err(bad_input("--threshold must be a finite number"));
    }
    Ok(Options {
        ends,
        criterion: Criterion { metric: a.metric.zip(a.threshold), higher_is_better: a.higher_is_better },
        image: a.image,
        summary: a.summary,
        dates_only: a.dates_only,
        base: a.base,
        work_dir: a.work_dir,
        env: a.env,
        gpus: a.gpus,
        insecure: a.insecure,
        confirm: a.confirm,
        command: a.command,
    })
}

/// `--good` and `--bad`: two dates of `--repo`'s dated tags, or, without `--repo`, two
/// images by tag or digest.
fn ends(repo: Option<&str>, good: &str, bad: &str) -> Result<Ends> {
    let looks_like_date = |s: &str| s.len() == 10 && s.bytes().all(|b| b.is_ascii_digit() || b == b'-');
    if let Some(repo) = repo {
        let repo = parse_repo(repo)?;
        let date = |flag: &str, s: &str| {
            parse_date(s).ok_or_else(|| {
                bad_input(format!(
                    "{flag} {s:?} is not a date in YYYY-MM-DD form (with --repo, --good and --bad are dates)"
                ))
            })
        };
        if date("--good", good)? >= date("--bad", bad)? {
            return Err(bad_input(format!("--good {good} must be before --bad {bad}")));
        }
        return Ok(Ends::Dates { repo, good: good.into(), bad: bad.into() });
    }
    let image = |flag: &str, s: &str| {
        if looks_like_date(s) {
            return Err(bad_input(format!("{flag} {s}: a date needs --repo, the repository of the dated images")));
        }
        let r = Reference::parse(s).map_err(|e| bad_input(format!("{flag} {s:?}: {e:#}")))?;
        if r.tag.is_none() && r.digest.is_none() {
            return Err(bad_input(format!("{flag} {s:?}: name the image by tag or digest (REPO:TAG or REPO@DIGEST)")));
        }
        Ok(r)
    };
    let (good, bad) = (image("--good", good)?, image("--bad", bad)?);
    if good == bad {
        return Err(bad_input(format!("--good and --bad are the same image, {good}")));
    }
    Ok(Ends::Images { good, bad })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::one_line;

    #[test]
    fn arguments_are_checked() {
        let args = |good: &str, bad: &str, repo: &str| TriageArgs {
            repo: (!repo.is_empty()).then(|| repo.into()),
            image: "engine".into(),
            good: good.into(),
            bad: bad.into(),
            metric: None,
            threshold: None,
            higher_is_better: false,
            summary: None,
            dates_only: false,
            base: None,
            work_dir: None,
            env: vec![],
            gpus: Gpus::None,
            insecure: vec![],
            confirm: 0,
            command: vec!["true".into()],
        };
        let msg = |a: TriageArgs| {
            let e = check_args(a).unwrap_err();
            assert_eq!(crate::error::exit_code(&e), 2);
            one_line(&e)
        };
        assert!(msg(args("2026-01-05", "2026-01-02", "localhost:5000/x")).contains("must be before"));
        assert!(msg(args("2026-13-01", "2026-01-02", "localhost:5000/x")).contains("--good"));
        assert!(msg(args("2026-01-01", "2026-01-02", "localhost:5000/x:tag")).contains("without a tag"));
        assert!(check_args(args("2026-01-01", "2026-01-02", "localhost:5000/x")).is_ok());
        // Two images instead of two dates: no --repo, each by tag or digest.
        let o =
            check_args(args("localhost:5000/x:engine-2026-01-01", "localhost:5000/x:engine-2026-01-09", "")).unwrap();
        assert!(matches!(o.ends, Ends::Images { ref bad, .. } if bad.tag.as_deref() == Some("engine-2026-01-09")));
        assert!(msg(args("2026-01-01", "2026-01-02", "")).contains("a date needs --repo"));
        assert!(msg(args("localhost:5000/x:a", "localhost:5000/x", "")).contains("by tag or digest"));
        assert!(msg(args("localhost:5000/x:a", "localhost:5000/x:a", "")).contains("the same image"));
        assert!(
            msg(args("localhost:5000/x:a", "2026-01-02", "localhost:5000/x"))
                .contains("with --repo, --good and --bad are dates")
        );
    }
}
