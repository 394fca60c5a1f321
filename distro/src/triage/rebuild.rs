//! Rebuilding the image with chosen upstream pins (`--source NAME=URL#COMMIT` for every git
//! source), loading it into Docker and running the command in it.
use super::Triage;
use super::point::Point;
use crate::dated::Verdict;
use crate::error::one_line;
use crate::image::build::{BuildOptions, build};
use crate::publish::daemon::Daemon;
use crate::publish::layout::OciLayout;
use crate::publish::publish;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// What every rebuild shares.
pub(super) struct Rebuild {
    pub(super) ws_root: PathBuf,
    pub(super) base: Reference,
    pub(super) date: String,
    pub(super) image: String,
}

/// Rebuilds the image for this machine's platform with the sources at `env`'s pins, loads it
/// into Docker and runs the command; a build failure is a skip.
pub(super) fn rebuild_and_run(
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
    let built = match &t.build_dir {
        Some(dir) => build(&opts, dir, client, &t.progress),
        None => Err(anyhow::anyhow!("rebuilding needs the project's checkout (run triage inside it)")),
    };
    let loaded = built.and_then(|built| {
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
