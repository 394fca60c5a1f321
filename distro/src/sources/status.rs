//! Whether the lock matches the manifest, per source (`current`, `stale`, `missing`), and the
//! `distro sources` table.

use serde::Serialize;
use std::fmt;

use super::lock::{Lock, LockedBase, LockedSource, Origin};
use super::manifest::{BaseSpec, Manifest, Source, SourceKind};
use crate::hex::sha256_hex;

/// How a source's lock entry relates to its manifest entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LockStatus {
    /// The lock records exactly the manifest's pin and patches (same bytes).
    Current,
    /// The lock records something else; the reason says what.
    Stale(String),
    /// The lock has no entry for the source.
    Missing,
}

impl fmt::Display for LockStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockStatus::Current => "current",
            LockStatus::Stale(_) => "stale",
            LockStatus::Missing => "missing",
        })
    }
}

/// Compares `source` with its lock entry. Cheap: no network, no git; patch files are hashed.
pub fn lock_status(manifest: &Manifest, source: &Source, locked: Option<&LockedSource>) -> LockStatus {
    let Some(locked) = locked else {
        return LockStatus::Missing;
    };
    if locked.overridden || locked.patches.iter().any(|p| p.extra) {
        return LockStatus::Stale("the lock holds a one-run override or extra patch".into());
    }
    let origin_matches = match (&source.kind, &locked.origin) {
        (SourceKind::Git(g), Origin::Git { url, git_ref, commit }) => {
            if g.url != *url || g.tracking_ref != *git_ref {
                return LockStatus::Stale("url or tracking_ref changed".into());
            }
            g.commit.as_deref() == Some(commit.as_str())
        }
        (SourceKind::Crate(c), Origin::Crate { name, version, registry, .. }) => {
            if c.name != *name || c.registry != *registry {
                return LockStatus::Stale("crate or registry changed".into());
            }
            c.version.as_deref() == Some(version.as_str())
        }
        _ => return LockStatus::Stale("the kind of source changed".into()),
    };
    if !origin_matches {
        return LockStatus::Stale("the pin changed".into());
    }
    if source.patches.len() != locked.patches.len() {
        return LockStatus::Stale("the patch list changed".into());
    }
    for (entry, lp) in source.patches.iter().zip(&locked.patches) {
        let file = entry.spec.file(&source.name);
        if entry.spec.text() != lp.entry || lp.file.as_deref() != Some(file.as_str()) {
            return LockStatus::Stale("the patch list changed".into());
        }
        match std::fs::read(manifest.project_path(&file)) {
            Ok(bytes) if sha256_hex(&bytes) == lp.sha256 => {}
            Ok(_) => return LockStatus::Stale(format!("{file} changed")),
            Err(_) => return LockStatus::Stale(format!("{file} is missing")),
        }
    }
    LockStatus::Current
}

/// Compares base `base` with its lock entry: current when image, tag and digest are the same.
pub fn base_status(base: &BaseSpec, locked: Option<&LockedBase>) -> LockStatus {
    let Some(locked) = locked else { return LockStatus::Missing };
    if base.image != locked.image || base.tag != locked.tag {
        return LockStatus::Stale("image or tag changed".into());
    }
    match &base.digest {
        None => LockStatus::Stale("the manifest does not pin a digest; run `distro bump`".into()),
        Some(d) if *d != locked.digest => LockStatus::Stale("the digest changed".into()),
        Some(_) => LockStatus::Current,
    }
}

/// One base image of `distro sources`.
#[derive(Clone, Debug, Serialize)]
pub struct BaseRow {
    /// Base name.
    pub name: String,
    /// Always `base`, so that `--json` readers tell the rows apart.
    pub kind: &'static str,
    /// The repository.
    pub image: String,
    /// The tag followed.
    pub tag: String,
    /// The pinned digest (empty when not pinned yet).
    pub digest: String,
    /// `current`, `stale` or `missing`.
    pub lock: String,
    /// Why the lock is stale, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The day the locked digest was first recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Days from `since` to `today`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub age_days: Option<i64>,
}

/// The base rows of `distro sources`, in name order; `today` is days since 1970-01-01.
pub fn base_rows(manifest: &Manifest, lock: Option<&Lock>, today: i64) -> Vec<BaseRow> {
    manifest
        .bases
        .values()
        .map(|b| {
            let locked = lock.and_then(|l| l.bases.get(&b.name));
            let status = base_status(b, locked);
            let since = locked.filter(|_| status == LockStatus::Current).map(|l| l.since.clone());
            let age_days = since.as_deref().and_then(crate::dated::parse_date).map(|d| today - d);
            BaseRow {
                name: b.name.clone(),
                kind: "base",
                image: b.image.clone(),
                tag: b.tag.clone(),
                digest: b.digest.clone().unwrap_or_default(),
                lock: status.to_string(),
                reason: match status {
                    LockStatus::Stale(r) => Some(r),
                    _ => None,
                },
                since,
                age_days,
            }
        })
        .collect()
}

/// The base rows as an aligned table (digests shortened to 12 digits), with the base's age.
pub fn base_table(rows: &[BaseRow]) -> String {
    let header = ["BASE", "IMAGE", "TAG", "DIGEST", "LOCK", "SINCE", "AGE"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let digest = if r.digest.len() > 19 { r.digest[..19].to_owned() } else { r.digest.clone() };
            vec![
                r.name.clone(),
                r.image.clone(),
                r.tag.clone(),
                if digest.is_empty() { "-".into() } else { digest },
                r.lock.clone(),
                r.since.clone().unwrap_or_else(|| "-".into()),
                r.age_days.map_or_else(|| "-".into(), |d| format!("{d} day{}", if d == 1 { "" } else { "s" })),
            ]
        })
        .collect();
    aligned(&header, &cells)
}

fn aligned(header: &[&str], cells: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let mut line = |cols: Vec<&str>| {
        let text: Vec<String> = cols.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(text.join("  ").trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in cells {
        line(row.iter().map(String::as_str).collect());
    }
    out
}

/// One row of `distro sources`.
#[derive(Clone, Debug, Serialize)]
pub struct SourceRow {
    /// Source name.
    pub name: String,
    /// `git` or `crate`.
    pub kind: &'static str,
    /// The pinned commit or version (empty when not pinned yet).
    pub pin: String,
    /// The tracking ref (git) or version requirement (crate).
    pub tracking: String,
    /// Number of patches in the manifest.
    pub patches: usize,
    /// `current`, `stale` or `missing`.
    pub lock: String,
    /// Why the lock is stale, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The rows of `distro sources`, in name order.
pub fn rows(manifest: &Manifest, lock: Option<&Lock>) -> Vec<SourceRow> {
    manifest
        .sources
        .values()
        .map(|s| {
            let status = lock_status(manifest, s, lock.and_then(|l| l.sources.get(&s.name)));
            let (kind, pin, tracking) = match &s.kind {
                SourceKind::Git(g) => ("git", g.commit.clone().unwrap_or_default(), g.tracking_ref.clone()),
                SourceKind::Crate(c) => ("crate", c.version.clone().unwrap_or_default(), c.tracking_req.clone()),
            };
            SourceRow {
                name: s.name.clone(),
                kind,
                pin,
                tracking,
                patches: s.patches.len(),
                lock: status.to_string(),
                reason: match status {
                    LockStatus::Stale(r) => Some(r),
                    _ => None,
                },
            }
        })
        .collect()
}

/// The rows as an aligned text table with a header (commit ids shortened to 12 digits).
pub fn table(rows: &[SourceRow]) -> String {
    let header = ["NAME", "KIND", "PIN", "TRACKING", "PATCHES", "LOCK"];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let pin = if r.kind == "git" && r.pin.len() > 12 { r.pin[..12].to_owned() } else { r.pin.clone() };
            let pin = if pin.is_empty() { "-".into() } else { pin };
            vec![r.name.clone(), r.kind.into(), pin, r.tracking.clone(), r.patches.to_string(), r.lock.clone()]
        })
        .collect();
    aligned(&header, &cells)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::lock::LockedPatch;
    use std::path::Path;

    fn manifest(dir: &Path, commit: &str) -> Manifest {
        std::fs::create_dir_all(dir.join("patches/foo")).unwrap();
        std::fs::write(dir.join("patches/foo/a.patch"), "A").unwrap();
        let text = format!(
            "root = \".\"\n[sources.foo]\nurl = \"u\"\ntracking_ref = \"main\"\ncommit = \"{commit}\"\npatches = [\"patches/foo/a.patch\"]\n[sources.c]\ncrate = \"c\"\nversion = \"1.0.0\"\n"
        );
        Manifest::parse(&dir.join("manifest.toml"), &text).unwrap()
    }

    fn locked(commit: &str) -> LockedSource {
        LockedSource {
            origin: Origin::Git { url: "u".into(), git_ref: "main".into(), commit: commit.into() },
            overridden: false,
            patches: vec![LockedPatch {
                entry: "patches/foo/a.patch".into(),
                file: Some("patches/foo/a.patch".into()),
                sha256: sha256_hex(b"A"),
                extra: false,
            }],
            tree: "b".repeat(40),
            head: "c".repeat(40),
        }
    }

    #[test]
    fn current_stale_and_missing() {
        let dir = tempfile::tempdir().unwrap();
        let a = "a".repeat(40);
        let m = manifest(dir.path(), &a);
        let foo = &m.sources["foo"];
        assert_eq!(lock_status(&m, foo, Some(&locked(&a))), LockStatus::Current);
        assert_eq!(lock_status(&m, foo, None), LockStatus::Missing);
        assert!(matches!(lock_status(&m, foo, Some(&locked(&"d".repeat(40)))), LockStatus::Stale(_)));
        std::fs::write(dir.path().join("patches/foo/a.patch"), "changed").unwrap();
        assert_eq!(lock_status(&m, foo, Some(&locked(&a))), LockStatus::Stale("patches/foo/a.patch changed".into()));
    }

    #[test]
    fn table_is_aligned_and_shortens_commits() {
        let dir = tempfile::tempdir().unwrap();
        let a = "a".repeat(40);
        let m = manifest(dir.path(), &a);
        let mut lock = Lock::default();
        lock.sources.insert("foo".into(), locked(&a));
        let text = table(&rows(&m, Some(&lock)));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "NAME  KIND   PIN           TRACKING  PATCHES  LOCK");
        assert_eq!(lines[1], "c     crate  1.0.0         *         0        missing");
        assert_eq!(lines[2], "foo   git    aaaaaaaaaaaa  main      1        current");
    }

    #[test]
    fn bases_show_their_lock_and_age() {
        let dir = tempfile::tempdir().unwrap();
        let d = format!("sha256:{}", "a".repeat(64));
        let text = format!("root = \".\"\n[bases.cuda]\nimage = \"r.io/cuda\"\ntag = \"13\"\ndigest = \"{d}\"\n");
        let m = Manifest::parse(&dir.path().join("manifest.toml"), &text).unwrap();
        let mut lock = Lock::default();
        let locked =
            LockedBase { image: "r.io/cuda".into(), tag: "13".into(), digest: d.clone(), since: "2026-11-20".into() };
        lock.bases.insert("cuda".into(), locked.clone());
        let today = crate::dated::parse_date("2026-11-26").unwrap();
        let text = base_table(&base_rows(&m, Some(&lock), today));
        assert_eq!(
            text,
            "BASE  IMAGE      TAG  DIGEST               LOCK     SINCE       AGE\ncuda  r.io/cuda  13   sha256:aaaaaaaaaaaa  current  2026-11-20  6 days\n"
        );
        lock.bases.get_mut("cuda").unwrap().digest = format!("sha256:{}", "b".repeat(64));
        let rows = base_rows(&m, Some(&lock), today);
        assert_eq!((rows[0].lock.as_str(), rows[0].age_days), ("stale", None));
        assert_eq!(base_status(&m.bases["cuda"], None), LockStatus::Missing);
    }
}
