//! The command line: one file per `distro` subcommand with its arguments (clap) and what it
//! prints; `main.rs` only dispatches here. Results meant for scripts go to stdout, progress and
//! warnings to stderr. Nothing below this folder depends on it.
use crate::error::bad_input;
use crate::fsutil::DirLock;
use crate::oci::layout::Layout;
use crate::registry::reference::Reference;
use crate::sources::{DEFAULT_MANIFEST, Manifest};
use anyhow::Result;
use clap::Args;
use std::path::{Path, PathBuf};

pub mod attach_test;
pub mod build;
pub mod bump;
pub mod diff;
pub mod fetch;
pub mod load;
pub mod lock;
pub mod patches;
pub mod push;
pub mod report;
pub mod retention;
pub mod run;
pub mod sbom;
pub mod sign;
pub mod sources;
pub mod triage;
pub mod verify;

/// `--manifest FILE`, shared by every sources command.
#[derive(Args, Debug, Clone)]
pub struct ManifestArg {
    /// The manifest of upstream sources; its lock is the same path with the `.lock` extension.
    #[arg(long, value_name = "FILE", default_value = DEFAULT_MANIFEST)]
    pub manifest: PathBuf,
}

impl ManifestArg {
    /// Loads the manifest.
    pub fn load(&self) -> Result<Manifest> {
        Manifest::load(&self.manifest)
    }
}

/// `--image NAME`: an image definition `images/NAME.toml` or a tag prefix, by name, never a
/// path (`../../x` would read or tag outside the definitions). Like the value parsers below, its
/// error is bad input, which clap prints after the option's name.
pub fn image_name(s: &str) -> Result<String> {
    let ok = s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    ok.then(|| s.to_owned()).ok_or_else(|| {
        bad_input(format!(
            "`{s}` is not an image name: letters, digits, '.', '_' and '-', starting with a letter or digit"
        ))
    })
}

/// `--date YYYY-MM-DD`: a real date from 1970-01-01 on (tags and build times count from the
/// Unix epoch).
pub fn date_arg(s: &str) -> Result<String> {
    match crate::dated::parse_date(s) {
        Some(days) if days >= 0 => Ok(s.to_owned()),
        _ => Err(bad_input(format!("`{s}` is not a date YYYY-MM-DD from 1970-01-01 on"))),
    }
}

/// `--insecure HOST[:PORT]`: a registry host, without a scheme or a path.
pub fn registry_host(s: &str) -> Result<String> {
    if s.is_empty() || s.contains("://") || s.contains('/') {
        return Err(bad_input(format!(
            "`{s}` is not HOST[:PORT] (no scheme, no path): e.g. --insecure registry.lan:5000"
        )));
    }
    Ok(s.to_owned())
}

/// `--chunk-size BYTES`: at least one byte (0 would mean a request per byte, or none at all).
pub fn chunk_size(s: &str) -> Result<u64> {
    match s.parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad_input(format!("`{s}` is not a chunk size: a number of bytes of at least 1"))),
    }
}

/// Opens the layout `dir` for reading, held shared for the command's life: pushes and loads of
/// one layout run side by side, and none while a build writes it (its garbage collection would
/// remove blobs under them). The lock is taken first when the directory is a layout or holds a
/// lock (a build may be creating it), so a path that is no layout is left untouched.
fn read_layout(dir: &Path) -> Result<(Layout, Option<DirLock>)> {
    let lock = if dir.join("oci-layout").is_file() || dir.join(crate::fsutil::LOCK_FILE).is_file() {
        DirLock::shared(dir, "OCI layout", "wait for it to finish")?
    } else {
        None
    };
    Ok((Layout::open(dir)?, lock))
}

/// Parses an image reference given on the command line; a bad one is bad input (exit 2).
fn parse_ref(s: &str, what: &str) -> Result<Reference> {
    Reference::parse(s).map_err(|e| bad_input(format!("{what}: {e:#}")))
}

/// Parses `IMAGE`, a pushed index named by tag or digest (`REPO:TAG` or `REPO@DIGEST`); a bad
/// one, or one naming neither, is bad input (exit 2).
fn parse_index_ref(s: &str) -> Result<Reference> {
    let r = parse_ref(s, "IMAGE")?;
    if r.tag.is_none() && r.digest.is_none() {
        return Err(bad_input(format!("IMAGE {s}: name the index by tag or digest (REPO:TAG or REPO@DIGEST)")));
    }
    Ok(r)
}

/// Parses `--repo`: a repository without a tag or digest (the dated tags are found in it); a bad
/// one is bad input (exit 2).
fn parse_repo(s: &str) -> Result<Reference> {
    let repo = Reference::parse(s).map_err(|e| bad_input(format!("--repo {s:?}: {e:#}")))?;
    if repo.tag.is_some() || repo.digest.is_some() {
        return Err(bad_input(format!("--repo {s:?}: give the repository without a tag or digest")));
    }
    Ok(repo)
}
