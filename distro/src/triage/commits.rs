//! Stage 2: the upstream commit. The pins of the last good and first bad image are compared;
//! the git sources that moved are stepped from good to bad one at a time to find the one that
//! breaks the command, then its commits between the two pins are bisected by rebuilding, in a
//! checkout of the failing image's own revision ([`super::revision`]).
use super::rebuild::{Rebuild, rebuild_and_run};
use super::{Pair, Triage};
use crate::dated::{Found, Verdict};
use crate::error::bad_input;
use crate::git::Git;
use crate::image::pins::PIN_ANNOTATION_PREFIX;
use crate::image::workspace::Workspace;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use crate::sources::{Manifest, SourceKind};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

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
pub(super) fn annotations(client: &Client, r: &Reference) -> Result<BTreeMap<String, String>> {
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

/// Stage 2: the git sources that moved between the two images, the one that breaks the command,
/// then its commit; returns why it stopped short of a commit, if it did.
pub(super) fn find(
    t: &mut Triage,
    client: &Client,
    ws: &Workspace,
    pair: &Pair,
    summary: &mut Value,
    culprit: &mut Value,
) -> Result<Option<String>> {
    let good_ann = annotations(client, &pair.good)?;
    let bad_ann = annotations(client, &pair.bad)?;
    let (good_pins, bad_pins) = (pins(&good_ann), pins(&bad_ann));
    let rev = |a: &BTreeMap<String, String>| a.get("org.opencontainers.image.revision").cloned().unwrap_or_default();
    summary["revisions"] = json!({"good": rev(&good_ann), "bad": rev(&bad_ann)});
    // The project as the failing image was built: its definition, patches, lock and manifest.
    let bad_rev = rev(&bad_ann);
    let Some((commit, dirty)) = super::revision::commit_of(&bad_rev) else {
        bail!(
            "{}: the image records no revision (org.opencontainers.image.revision is {bad_rev:?}), so it cannot be rebuilt as it was",
            pair.bad
        );
    };
    let root = super::revision::checkout(ws, &t.work, commit, &pair.bad.to_string())?;
    t.progress.info(format!(
        "triage: rebuilding at {}'s revision {commit}{}",
        pair.bad_label,
        if dirty { " (it was built from uncommitted changes to it, which cannot be rebuilt)" } else { "" }
    ));
    summary["rebuilt_at"] = json!(commit);
    let manifest_path = root.join(crate::sources::DEFAULT_MANIFEST);
    let manifest = Manifest::load(&manifest_path)?;
    let mut moved: Vec<Moved> = Vec::new();
    let mut notes = Vec::new();
    for (name, bad_pin) in &bad_pins {
        let Some(good_pin) = good_pins.get(name) else {
            notes.push(format!("source {name} is new in {}", pair.bad_label));
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
            pair.good,
            pair.bad,
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
                _ => bail!("{}: the image does not name its base; pass --base", pair.bad),
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
    let ctx = Rebuild { ws_root: root, base, date: pair.date.clone(), image: image_name(&t.args.image, &bad_ann) };
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

/// The image definition a rebuild uses: `--image`, or, when left at its default, the one the
/// failing image names (`org.opencontainers.image.title`, the definition's `name`).
fn image_name(arg: &str, ann: &BTreeMap<String, String>) -> String {
    match ann.get("org.opencontainers.image.title") {
        Some(title) if arg == "engine" && !title.is_empty() => title.clone(),
        _ => arg.to_string(),
    }
}

fn short(c: &str) -> &str {
    &c[..c.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;

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
