//! Whether the lock matches the manifest, per source (`current`, `stale`, `missing`), and the
//! `distro sources` table.

use serde::Serialize;
use std::fmt;

use super::lock::{Lock, LockedSource, Origin};
use super::manifest::{Manifest, Source, SourceKind};
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
    let cells: Vec<[String; 6]> = rows
        .iter()
        .map(|r| {
            let pin = if r.kind == "git" && r.pin.len() > 12 { r.pin[..12].to_owned() } else { r.pin.clone() };
            let pin = if pin.is_empty() { "-".into() } else { pin };
            [r.name.clone(), r.kind.into(), pin, r.tracking.clone(), r.patches.to_string(), r.lock.clone()]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    let mut line = |cols: Vec<&str>| {
        let text: Vec<String> = cols.iter().zip(widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(text.join("  ").trim_end());
        out.push('\n');
    };
    line(header.to_vec());
    for row in &cells {
        line(row.iter().map(String::as_str).collect());
    }
    out
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
}
