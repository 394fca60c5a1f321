//! `distro patches refresh`: export upstream-ref patches (`pull/123/head`) to files under
//! `patches/NAME/`, so builds never need the network for patches.

use anyhow::Result;
use serde::Serialize;
use std::fmt;

use super::cache::Cache;
use super::manifest::{Manifest, PatchSpec, SourceKind};
use super::upstream;
use crate::fsutil::write_atomic;

/// What refreshing did to one exported patch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Refresh {
    /// The file did not exist and was written.
    New,
    /// The file's content changed.
    Changed,
    /// The export is byte-identical to the file.
    Unchanged,
    /// The ref has no commits outside the tracking ref (merged upstream); the file was left as
    /// it is, and `distro bump` will drop the patch.
    Merged,
}

impl fmt::Display for Refresh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refresh::New => "new",
            Refresh::Changed => "changed",
            Refresh::Unchanged => "unchanged",
            Refresh::Merged => "merged",
        })
    }
}

/// One refreshed patch.
#[derive(Clone, Debug, Serialize)]
pub struct Refreshed {
    /// The source's name.
    pub source: String,
    /// The upstream ref.
    #[serde(rename = "ref")]
    pub git_ref: String,
    /// The file, relative to the project root.
    pub file: String,
    /// What happened.
    pub status: Refresh,
}

/// Exports every upstream-ref patch of the selected sources (all when `names` is empty). All
/// refs are fetched before anything is written; each file is replaced atomically, and only when
/// its content changes. With `dry_run` nothing is written.
pub fn refresh(manifest: &Manifest, names: &[String], cache: &Cache, dry_run: bool) -> Result<Vec<Refreshed>> {
    let mut exports = Vec::new();
    for source in manifest.select(names)? {
        let SourceKind::Git(g) = &source.kind else {
            continue;
        };
        let refs: Vec<&str> = source
            .patches
            .iter()
            .filter_map(|p| match &p.spec {
                PatchSpec::Ref(r) => Some(r.as_str()),
                PatchSpec::File(_) => None,
            })
            .collect();
        if refs.is_empty() {
            continue;
        }
        let url = manifest.fetch_url(&g.url);
        let repo = cache.open_repo(&upstream::repo_key(&url))?;
        for r in refs {
            let mbox = upstream::export_ref(&repo, &url, &g.tracking_ref, r)?;
            let file = PatchSpec::Ref(r.to_owned()).file(&source.name);
            exports.push((source.name.clone(), r.to_owned(), file, mbox));
        }
    }
    let mut out = Vec::new();
    for (source, git_ref, file, mbox) in exports {
        let path = manifest.project_path(&file);
        let old = std::fs::read(&path).ok();
        let status = match (&mbox, &old) {
            (None, _) => Refresh::Merged,
            (Some(new), Some(old)) if new == old => Refresh::Unchanged,
            (Some(_), Some(_)) => Refresh::Changed,
            (Some(_), None) => Refresh::New,
        };
        if let (Some(new), false, Refresh::New | Refresh::Changed) = (&mbox, dry_run, status) {
            write_atomic(&path, new)?;
        }
        out.push(Refreshed { source, git_ref, file, status });
    }
    Ok(out)
}
