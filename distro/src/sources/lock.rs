//! The lock (`images/manifest.lock`): for every source the resolved commit (or crate version and
//! checksum), the SHA-256 of every patch, and the tree and commit ids after patching.
//!
//! The file is TOML written by hand-rolled, fixed-order code: sources sorted by name, fields in a
//! fixed order, no paths outside the project, no timestamps. The same manifest gives the same
//! bytes on any machine, in any directory, at any time. The one date is a base image's `since`:
//! the day its digest was first recorded, which tells the base's age and history; it moves only
//! when the digest does.

use crate::error::bad_input;
use anyhow::Result;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use crate::git::is_object_id;
use crate::hex::is_sha256;

/// The lock format version written in the file.
pub const LOCK_VERSION: u32 = 1;

/// A parsed lock: the resolved state of every source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lock {
    /// Locked sources by name.
    pub sources: BTreeMap<String, LockedSource>,
    /// Locked base images by name.
    pub bases: BTreeMap<String, LockedBase>,
}

/// One base image in the lock: what its tag resolved to, and since when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockedBase {
    /// The repository, as in the manifest.
    pub image: String,
    /// The tag, as in the manifest.
    pub tag: String,
    /// The pinned digest.
    pub digest: String,
    /// The day (UTC, `YYYY-MM-DD`) this digest was first recorded.
    pub since: String,
}

/// Where a locked source's unpatched tree comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A commit of a git repository.
    Git {
        /// The URL as written in the manifest (or on the `--source` command line).
        url: String,
        /// The ref the commit was found on (the manifest's `tracking_ref`, or an override's).
        git_ref: String,
        /// The pinned commit.
        commit: String,
    },
    /// A crate version from a Cargo registry.
    Crate {
        /// The crate's name.
        name: String,
        /// The exact version.
        version: String,
        /// The registry's SHA-256 of the `.crate` file, as Cargo verified it.
        checksum: String,
        /// The registry name from Cargo's configuration, when not Cargo's default.
        registry: Option<String>,
    },
}

/// One source in the lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockedSource {
    /// The unpatched origin.
    pub origin: Origin,
    /// True when a `--source NAME=URL#REF` override replaced the manifest's origin for one run.
    pub overridden: bool,
    /// The patches applied, in order.
    pub patches: Vec<LockedPatch>,
    /// The git tree id of the patched source: the content address of the materialised tree.
    pub tree: String,
    /// The commit id after applying the patches (deterministic: fixed committer and date).
    pub head: String,
}

/// One applied patch in the lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockedPatch {
    /// The entry as written in the manifest (a file path or an upstream ref), or on the
    /// `--patch` command line.
    pub entry: String,
    /// The patch file relative to the project root, when the patch lives in the project.
    pub file: Option<String>,
    /// SHA-256 of the patch file's bytes.
    pub sha256: String,
    /// True for a patch added for one build with `--patch`, not in the manifest.
    pub extra: bool,
}

impl LockedSource {
    /// The pin shown to people: the commit id, or the crate version.
    pub fn pin(&self) -> &str {
        match &self.origin {
            Origin::Git { commit, .. } => commit,
            Origin::Crate { version, .. } => version,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLock {
    version: u32,
    #[serde(default)]
    sources: BTreeMap<String, RawLocked>,
    #[serde(default)]
    bases: BTreeMap<String, RawBase>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBase {
    image: String,
    tag: String,
    digest: String,
    since: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLocked {
    kind: String,
    url: Option<String>,
    #[serde(rename = "ref")]
    git_ref: Option<String>,
    commit: Option<String>,
    #[serde(rename = "crate")]
    krate: Option<String>,
    version: Option<String>,
    checksum: Option<String>,
    registry: Option<String>,
    #[serde(default)]
    overridden: bool,
    tree: String,
    head: String,
    #[serde(default)]
    patches: Vec<RawPatch>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPatch {
    entry: String,
    file: Option<String>,
    sha256: String,
    #[serde(default)]
    extra: bool,
}

impl Lock {
    /// Reads the lock at `path`; `Ok(None)` when there is no such file.
    pub fn load(path: &Path) -> Result<Option<Lock>> {
        match std::fs::read_to_string(path) {
            Ok(text) => Lock::parse(&text).map(Some).map_err(|e| {
                bad_input(format!(
                    "{}: {e:#}; restore it from version control or regenerate it with `distro lock`",
                    path.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(bad_input(format!("reading {}: {e}", path.display()))),
        }
    }

    /// Parses lock text, checking every id and digest.
    pub fn parse(text: &str) -> Result<Lock> {
        let raw: RawLock = toml::from_str(text).map_err(|e| {
            let loc = super::loc::Loc::at(text, e.span().map(|s| s.start).unwrap_or(0));
            anyhow::anyhow!("line {}, column {}: {}", loc.line, loc.column, e.message().trim())
        })?;
        if raw.version != LOCK_VERSION {
            anyhow::bail!("lock format version {} is not supported (this distro writes {LOCK_VERSION})", raw.version);
        }
        let mut sources = BTreeMap::new();
        for (name, r) in raw.sources {
            let need = |v: Option<String>, key: &str| v.ok_or_else(|| anyhow::anyhow!("source `{name}` lacks `{key}`"));
            let origin = match r.kind.as_str() {
                "git" => Origin::Git {
                    url: need(r.url, "url")?,
                    git_ref: need(r.git_ref, "ref")?,
                    commit: need(r.commit, "commit")?,
                },
                "crate" => Origin::Crate {
                    name: need(r.krate, "crate")?,
                    version: need(r.version, "version")?,
                    checksum: need(r.checksum, "checksum")?,
                    registry: r.registry,
                },
                other => anyhow::bail!("source `{name}` has unknown kind `{other}`"),
            };
            let ids_ok = match &origin {
                Origin::Git { commit, .. } => is_object_id(commit),
                Origin::Crate { checksum, .. } => is_sha256(checksum),
            } && is_object_id(&r.tree)
                && is_object_id(&r.head);
            if !ids_ok {
                anyhow::bail!("source `{name}` has a malformed commit, checksum, tree or head");
            }
            let mut patches = Vec::new();
            for p in r.patches {
                if !is_sha256(&p.sha256) {
                    anyhow::bail!("patch `{}` of source `{name}` has a malformed sha256", p.entry);
                }
                patches.push(LockedPatch { entry: p.entry, file: p.file, sha256: p.sha256, extra: p.extra });
            }
            sources
                .insert(name, LockedSource { origin, overridden: r.overridden, patches, tree: r.tree, head: r.head });
        }
        let mut bases = BTreeMap::new();
        for (name, b) in raw.bases {
            let digest_ok = b.digest.strip_prefix("sha256:").is_some_and(is_sha256);
            if !digest_ok || crate::dated::parse_date(&b.since).is_none() {
                anyhow::bail!("base `{name}` has a malformed digest or since date");
            }
            bases.insert(name, LockedBase { image: b.image, tag: b.tag, digest: b.digest, since: b.since });
        }
        Ok(Lock { sources, bases })
    }

    /// The lock as TOML text: deterministic, sorted, stable across machines.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# Generated by `distro lock` / `distro bump` from the manifest next to it; do not edit.\n");
        out.push_str("# Each source: the pinned commit (or crate version and checksum), the SHA-256 of each\n");
        out.push_str("# patch, and the git tree and commit ids after the patches are applied.\n");
        if !self.bases.is_empty() {
            out.push_str("# Each base: the digest its tag resolved to, and the day that digest was first recorded.\n");
        }
        let _ = writeln!(out, "version = {LOCK_VERSION}");
        for (name, s) in &self.sources {
            let _ = writeln!(out, "\n[sources.{}]", key(name));
            match &s.origin {
                Origin::Git { url, git_ref, commit } => {
                    let _ = writeln!(out, "kind = \"git\"");
                    let _ = writeln!(out, "url = {}", string(url));
                    let _ = writeln!(out, "ref = {}", string(git_ref));
                    let _ = writeln!(out, "commit = {}", string(commit));
                }
                Origin::Crate { name: krate, version, checksum, registry } => {
                    let _ = writeln!(out, "kind = \"crate\"");
                    let _ = writeln!(out, "crate = {}", string(krate));
                    let _ = writeln!(out, "version = {}", string(version));
                    let _ = writeln!(out, "checksum = {}", string(checksum));
                    if let Some(r) = registry {
                        let _ = writeln!(out, "registry = {}", string(r));
                    }
                }
            }
            if s.overridden {
                let _ = writeln!(out, "overridden = true");
            }
            let _ = writeln!(out, "tree = {}", string(&s.tree));
            let _ = writeln!(out, "head = {}", string(&s.head));
            if s.patches.is_empty() {
                let _ = writeln!(out, "patches = []");
            }
            for p in &s.patches {
                let _ = writeln!(out, "\n[[sources.{}.patches]]", key(name));
                let _ = writeln!(out, "entry = {}", string(&p.entry));
                if let Some(f) = &p.file {
                    let _ = writeln!(out, "file = {}", string(f));
                }
                let _ = writeln!(out, "sha256 = {}", string(&p.sha256));
                if p.extra {
                    let _ = writeln!(out, "extra = true");
                }
            }
        }
        for (name, b) in &self.bases {
            let _ = writeln!(out, "\n[bases.{}]", key(name));
            let _ = writeln!(out, "image = {}", string(&b.image));
            let _ = writeln!(out, "tag = {}", string(&b.tag));
            let _ = writeln!(out, "digest = {}", string(&b.digest));
            let _ = writeln!(out, "since = {}", string(&b.since));
        }
        out
    }
}

fn string(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

fn key(k: &str) -> String {
    if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        k.to_owned()
    } else {
        string(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Lock {
        let id = |c: char| c.to_string().repeat(40);
        let mut lock = Lock::default();
        lock.sources.insert(
            "foo".into(),
            LockedSource {
                origin: Origin::Git { url: "../up/foo \"q\".git".into(), git_ref: "main".into(), commit: id('a') },
                overridden: false,
                patches: vec![
                    LockedPatch {
                        entry: "pull/1/head".into(),
                        file: Some("patches/foo/PR-1.patch".into()),
                        sha256: "1".repeat(64),
                        extra: false,
                    },
                    LockedPatch { entry: "/tmp/x.patch".into(), file: None, sha256: "2".repeat(64), extra: true },
                ],
                tree: id('b'),
                head: id('c'),
            },
        );
        lock.sources.insert(
            "cudarc".into(),
            LockedSource {
                origin: Origin::Crate {
                    name: "cudarc".into(),
                    version: "0.19.10".into(),
                    checksum: "3".repeat(64),
                    registry: None,
                },
                overridden: false,
                patches: vec![],
                tree: id('d'),
                head: id('e'),
            },
        );
        lock.bases.insert(
            "cuda".into(),
            LockedBase {
                image: "docker.io/nvidia/cuda".into(),
                tag: "13.0.3-cudnn-runtime-ubuntu24.04".into(),
                digest: format!("sha256:{}", "4".repeat(64)),
                since: "2026-11-26".into(),
            },
        );
        lock
    }

    #[test]
    fn render_then_parse_round_trips() {
        let lock = sample();
        let text = lock.render();
        assert_eq!(Lock::parse(&text).unwrap(), lock);
        // Sources are sorted by name whatever the insertion order.
        assert!(text.find("[sources.cudarc]").unwrap() < text.find("[sources.foo]").unwrap());
        assert_eq!(text, Lock::parse(&text).unwrap().render());
    }

    #[test]
    fn malformed_locks_are_rejected() {
        let text = sample().render().replace(&"b".repeat(40), "nothex");
        assert!(Lock::parse(&text).unwrap_err().to_string().contains("malformed"));
        let text = sample().render().replace("version = 1", "version = 9");
        assert!(Lock::parse(&text).unwrap_err().to_string().contains("not supported"));
        let text = sample().render().replace("kind = \"git\"", "kind = \"git\"\nextra_key = 1");
        let e = Lock::parse(&text).unwrap_err().to_string();
        assert!(e.contains("unknown field `extra_key`") && e.starts_with("line "), "{e}");
    }
}
