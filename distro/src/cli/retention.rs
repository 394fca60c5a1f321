//! `distro retention`: deletes dated tags older than N days, keeping the first image of each
//! month and never the moving `NAME` tag.
//!
//! Registries delete manifests, not tags (`DELETE /v2/<name>/manifests/<digest>`), and every
//! tag pointing at a deleted digest goes with it; so a digest that a kept tag also points at
//! is never deleted (the tag is reported as skipped instead).
use super::parse_repo;
use crate::dated::{dated_tags, expired, format_day};
use crate::dated::{parse_date, utc_date};
use crate::error::bad_input;
use crate::oci::digest::Digest;
use crate::oci::manifest::is_index;
use crate::registry::auth::{Credentials, Scope};
use crate::registry::client::Client;
use anyhow::{Context, Result};
use clap::Args;
use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;

/// The arguments of `distro retention`.
#[derive(Args, Debug)]
pub struct RetentionArgs {
    /// Repository, e.g. ghcr.io/org/distro.
    #[arg(long, value_name = "REPO")]
    pub repo: String,
    /// Image name: the dated tags are NAME-YYYY-MM-DD (and NAME-YYYY-MM-DD-ARCH).
    #[arg(long, default_value = "engine", value_name = "NAME", value_parser = super::image_name)]
    pub image: String,
    /// Keep dated tags at most this many days old (the first image of each month is always kept).
    #[arg(long, value_name = "N")]
    pub keep_days: u32,
    /// The date to count from (default: today, UTC).
    #[arg(long, value_name = "YYYY-MM-DD")]
    pub today: Option<String>,
    /// Print what would be deleted, delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
}

/// The tags of one dated image: `NAME-DATE` and its per-platform `NAME-DATE-ARCH` tags.
fn tags_of_date<'a>(all: &'a [String], dated_tag: &str) -> Vec<&'a String> {
    let arch_prefix = format!("{dated_tag}-");
    all.iter()
        .filter(|t| {
            *t == dated_tag
                || t.strip_prefix(&arch_prefix)
                    .is_some_and(|a| !a.is_empty() && a.bytes().all(|b| b.is_ascii_alphanumeric()))
        })
        .collect()
}

/// Runs `distro retention`; prints `keep`, `delete` (or `would delete`) and `skip` lines.
pub fn retention_cmd(a: RetentionArgs) -> Result<ExitCode> {
    let repo = parse_repo(&a.repo)?;
    let today = match &a.today {
        Some(d) => parse_date(d).ok_or_else(|| bad_input(format!("--today {d:?} is not a date in YYYY-MM-DD form")))?,
        None => {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
            parse_date(&utc_date(now)).context("today's date")?
        }
    };
    let client = Client::new(Credentials::from_environment(Some(repo.api_host()))?, a.insecure.clone())?;
    let all = client.list_tags(&repo)?;
    let dated = dated_tags(&a.image, &all);
    let gone = expired(&dated, today, i64::from(a.keep_days));
    let gone_tags: BTreeSet<&String> = gone.iter().flat_map(|d| tags_of_date(&all, &d.tag)).collect();
    let scopes = || vec![Scope::repository(&repo.repository, &["pull"])];
    let mut digests: BTreeMap<&String, Digest> = BTreeMap::new();
    for t in &all {
        if let Some(d) = client.manifest_digest(&repo.with_tag(t), scopes())? {
            digests.insert(t, d);
        }
    }
    // What a kept tag points at must stay, and so must the platform manifests of a kept index.
    let mut kept_by: BTreeMap<Digest, String> = BTreeMap::new();
    for t in all.iter().filter(|t| !gone_tags.contains(t)) {
        let Some(d) = digests.get(t) else { continue };
        kept_by.entry(d.clone()).or_insert_with(|| format!("kept tag {t} points at the same manifest"));
        if gone_tags.iter().any(|g| digests.get(*g) == Some(d)) {
            // A deleted date shares this index: its children are needed too.
            let m = client.fetch_manifest(&repo.with_digest(d))?;
            if is_index(&m.media_type) {
                let v: serde_json::Value = serde_json::from_slice(&m.bytes)?;
                for c in v["manifests"].as_array().into_iter().flatten() {
                    if let Some(cd) = c["digest"].as_str().and_then(|s| Digest::parse(s).ok()) {
                        kept_by.entry(cd).or_insert_with(|| format!("kept tag {t}'s index references it"));
                    }
                }
            }
        }
    }
    let cutoff = format_day(today - i64::from(a.keep_days));
    for d in &dated {
        if !gone.contains(d) {
            let why = if d.date >= cutoff { format!("since {cutoff}") } else { "first of its month".to_string() };
            println!("keep {} ({why})", d.tag);
        }
    }
    if all.contains(&a.image) {
        println!("keep {} (moving tag)", a.image);
    }
    let mut deleted: BTreeSet<&Digest> = BTreeSet::new();
    let (mut n_deleted, mut n_skipped) = (0, 0);
    for d in &gone {
        // The index first (its dated tag), then the per-platform manifests.
        for t in tags_of_date(&all, &d.tag) {
            let Some(digest) = digests.get(t) else { continue };
            if let Some(k) = kept_by.get(digest) {
                println!("skip {t} {digest} ({k})");
                n_skipped += 1;
                continue;
            }
            if !deleted.insert(digest) {
                continue;
            }
            if a.dry_run {
                println!("would delete {t} {digest}");
            } else {
                client.delete_manifest(&repo, digest)?;
                println!("delete {t} {digest}");
            }
            n_deleted += 1;
        }
    }
    eprintln!(
        "retention: {} dated tags, {} {}, {n_skipped} skipped (shared with a kept tag)",
        dated.len(),
        n_deleted,
        if a.dry_run { "would be deleted" } else { "deleted" }
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_date_owns_its_platform_tags_only() {
        let all: Vec<String> = [
            "engine-2026-01-02",
            "engine-2026-01-02-amd64",
            "engine-2026-01-02-arm64",
            "engine-2026-01-020",
            "engine",
            "engine-2026-01-02-x-y",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let got: Vec<&str> = tags_of_date(&all, "engine-2026-01-02").into_iter().map(String::as_str).collect();
        assert_eq!(got, ["engine-2026-01-02", "engine-2026-01-02-amd64", "engine-2026-01-02-arm64"]);
    }
}
