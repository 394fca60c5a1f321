//! `distro report`: the static dashboard of the dated images of a repository, read from the
//! registry alone: the dated tags (`NAME-YYYY-MM-DD`), each index and its platforms' manifests
//! and configs (what [`crate::diff::read`] reads, which also gives `distro diff` between
//! consecutive dates), and the `test-all` summaries attached to each index as referrers
//! ([`crate::provenance::test_summary`]).
//!
//! - [`collect`] reads the dates into [`Night`]s;
//! - [`html`] writes the page: one row per date, then the trends;
//! - [`trends`] draws the trends (`plotters`, SVG back-end);
//! - [`write_site`] writes `index.html` and one `diff-DATE.html` per date with an earlier one.
use crate::dated::{DatedTag, dated_tags};
use crate::diff::{self, Facts, PlatformFacts, Source};
use crate::error::bad_input;
use crate::oci::digest::Digest;
use crate::oci::manifest::Descriptor;
use crate::oci::store::BlobStore;
use crate::provenance::PLATFORM_ANNOTATION;
use crate::provenance::referrers;
use crate::provenance::test_summary::{TEST_SUMMARY_TYPE, TestSummary};
use crate::registry::client::{Client, mark_transient};
use crate::registry::reference::Reference;
use anyhow::{Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

pub mod html;
pub mod trends;

/// The layer groups, in the order the page lists them ([`crate::image::build`] annotates them).
pub const GROUPS: [&str; 3] =
    [crate::image::build::GROUP_BASE, crate::image::build::GROUP_ENGINE, crate::image::build::GROUP_CUDA];

/// One dated image and what is attached to it.
#[derive(Clone, Debug)]
pub struct Night {
    /// `YYYY-MM-DD`.
    pub date: String,
    /// `NAME-YYYY-MM-DD`.
    pub tag: String,
    /// What the image says about itself (digest, platforms, layers).
    pub facts: Facts,
    /// The test summaries attached to it: the newest of each platform and device class.
    pub tests: Vec<TestRun>,
    /// What was left out of it, one line each (an attached summary that is too large or does
    /// not parse): `distro report` prints them and the page shows them in the row.
    pub notes: Vec<String>,
}

/// One attached `test-all` summary.
#[derive(Clone, Debug, PartialEq)]
pub struct TestRun {
    /// The platform it ran on (its layer's annotation).
    pub platform: String,
    /// The summary.
    pub summary: TestSummary,
}

/// Compressed bytes per layer group of one platform's image: every group of [`GROUPS`] (zero
/// when it has no layer), and any other group a newer build may write.
pub fn group_sizes(p: &PlatformFacts) -> BTreeMap<String, u64> {
    let mut sizes: BTreeMap<String, u64> = GROUPS.iter().map(|g| (g.to_string(), 0)).collect();
    for l in &p.layers {
        *sizes.entry(l.group.clone()).or_default() += l.size;
    }
    sizes
}

/// Reads the dated images of `image` in `repo` from day `since` on (all when `None`), oldest
/// first, and the one before the first (to diff against), if any.
pub fn collect(
    client: &Client,
    repo: &Reference,
    image: &str,
    since: Option<i64>,
) -> Result<(Vec<Night>, Option<Night>)> {
    let tags = client.list_tags(repo).map_err(mark_transient)?;
    let dated = dated_tags(image, &tags);
    if dated.is_empty() {
        return Err(bad_input(format!(
            "{}: no dated tags {image}-YYYY-MM-DD ({} tag(s) in all): check --repo and --image",
            repo.name(),
            tags.len()
        )));
    }
    let first = dated.iter().position(|d| since.is_none_or(|s| d.day >= s));
    let Some(first) = first else {
        let newest = &dated[dated.len() - 1].date;
        return Err(bad_input(format!("{}: no dated tag from --since on (the newest is {newest})", repo.name())));
    };
    let scratch = tempfile::tempdir()?;
    let read = |d: &DatedTag| night(client, repo, d, scratch.path()).map_err(mark_transient);
    let before = if first > 0 { Some(read(&dated[first - 1])?) } else { None };
    let nights = dated[first..].iter().map(read).collect::<Result<Vec<_>>>()?;
    Ok((nights, before))
}

fn night(client: &Client, repo: &Reference, d: &DatedTag, scratch: &Path) -> Result<Night> {
    let r = repo.with_tag(&d.tag);
    let source = Source::Registry(client, r.clone(), BlobStore::new(scratch));
    let facts = diff::read(&source).with_context(|| format!("reading {r}"))?;
    let digest = Digest::parse(&facts.digest)?;
    let (tests, notes) =
        tests(client, repo, &digest, &BlobStore::new(scratch)).with_context(|| format!("{r}: its test results"))?;
    Ok(Night { date: d.date.clone(), tag: d.tag.clone(), facts, tests, notes })
}

/// The test summaries attached to `index`, the newest (by `started`) of each platform and
/// device class, and a note for each one left out: one too large to read, or that does not
/// parse. A bad summary costs its own cell, not the site.
fn tests(client: &Client, repo: &Reference, index: &Digest, store: &BlobStore) -> Result<(Vec<TestRun>, Vec<String>)> {
    let (entries, _) = referrers::list(client, repo, index)?;
    let mut newest: BTreeMap<(String, String), TestRun> = BTreeMap::new();
    let mut notes = Vec::new();
    for e in entries.iter().filter(|e| e["artifactType"] == TEST_SUMMARY_TYPE) {
        let Some(d) = e["digest"].as_str().and_then(|d| Digest::parse(d).ok()) else { continue };
        let m: Value = serde_json::from_slice(&client.fetch_manifest(&repo.with_digest(&d))?.bytes)?;
        if m["subject"]["digest"] != index.as_str() {
            tracing::warn!("{}: referrer {d} names another subject; left out", repo.name());
            continue;
        }
        for l in m["layers"].as_array().into_iter().flatten() {
            let Ok(ld) = serde_json::from_value::<Descriptor>(l.clone()) else { continue };
            let platform = l["annotations"][PLATFORM_ANNOTATION].as_str().unwrap_or("unknown").to_owned();
            match summary_of(client, repo, &ld, store) {
                Ok(summary) => {
                    let key = (platform.clone(), summary.device_class.clone());
                    if newest.get(&key).is_none_or(|t| t.summary.started < summary.started) {
                        newest.insert(key, TestRun { platform, summary });
                    }
                }
                Err(e) if crate::error::is_bad_input(&e) => {
                    notes.push(format!(
                        "{platform} test summary (referrer {d}) left out: {}",
                        crate::error::one_line(&e)
                    ));
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok((newest.into_values().collect(), notes))
}

/// One attached summary: refused unread when its descriptor declares more than
/// [`crate::oci::store::MAX_DOCUMENT_BYTES`] (the most `attach-test` sends; older versions sent
/// more), else fetched and parsed; either refusal is bad input.
fn summary_of(client: &Client, repo: &Reference, ld: &Descriptor, store: &BlobStore) -> Result<TestSummary> {
    let max = crate::oci::store::MAX_DOCUMENT_BYTES;
    if ld.size > max {
        return Err(bad_input(format!(
            "test summary {}: its descriptor declares {} bytes, more than the {max} bytes (4 MiB) a test summary may have; refusing it unread",
            ld.digest, ld.size
        )));
    }
    if !store.has(&ld.digest) {
        client.fetch_blob(repo, &ld.digest, Some(ld.size), store)?;
    }
    TestSummary::parse(&store.read(&ld.digest)?, &format!("test summary {}", ld.digest))
}

/// The diff page's file name of a date.
pub fn diff_page(date: &str) -> String {
    format!("diff-{date}.html")
}

/// Writes the site under `out`: `index.html`, and `diff-DATE.html` for each date with an
/// earlier one (`before` is the one before the first of `nights`). Returns the files written.
pub fn write_site(out: &Path, repo: &Reference, nights: &[Night], before: Option<&Night>) -> Result<Vec<String>> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    let mut diffs = BTreeMap::new();
    let mut prev = before;
    for n in nights {
        if let Some(p) = prev {
            let d = diff::diff(&p.facts, &n.facts);
            let (old, new) = (format!("{}:{}", repo.name(), p.tag), format!("{}:{}", repo.name(), n.tag));
            let name = diff_page(&n.date);
            crate::fsutil::write_atomic(
                &out.join(&name),
                html::diff_page(&d.text(&old, &new), &p.date, &n.date).as_bytes(),
            )?;
            diffs.insert(n.date.clone(), (name.clone(), p.date.clone()));
            written.push(name);
        }
        prev = Some(n);
    }
    let page = html::page(repo, nights, &diffs)?;
    crate::fsutil::write_atomic(&out.join("index.html"), page.as_bytes())?;
    written.push("index.html".into());
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diff::LayerFacts;

    fn layer(size: u64, group: &str) -> LayerFacts {
        LayerFacts { digest: format!("sha256:{size:064}"), size, created_by: String::new(), group: group.into() }
    }

    #[test]
    fn each_group_sums_its_layers_and_every_group_is_listed() {
        let p = PlatformFacts {
            layers: vec![layer(100, "base"), layer(20, "base"), layer(7, "engine"), layer(3, "engine")],
            ..Default::default()
        };
        let sizes = group_sizes(&p);
        assert_eq!(sizes, BTreeMap::from([("base".into(), 120), ("cuda".into(), 0), ("engine".into(), 10)]));
        assert_eq!(sizes.values().sum::<u64>(), p.layers.iter().map(|l| l.size).sum::<u64>());
        let p = PlatformFacts { layers: vec![layer(5, "cuda"), layer(1, "firmware")], ..Default::default() };
        assert_eq!(group_sizes(&p)["cuda"], 5);
        assert_eq!(group_sizes(&p)["firmware"], 1, "a group this version does not know is kept");
    }
}
