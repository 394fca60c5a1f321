//! The command line: one file per `distro` subcommand with its arguments (clap) and what it
//! prints; `main.rs` only dispatches here. Results meant for scripts go to stdout, progress and
//! warnings to stderr. Nothing below this folder depends on it.
use crate::error::bad_input;
use crate::registry::reference::Reference;
use crate::sources::{DEFAULT_MANIFEST, Manifest};
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

pub mod build;
pub mod bump;
pub mod fetch;
pub mod load;
pub mod lock;
pub mod patches;
pub mod push;
pub mod retention;
pub mod run;
pub mod sbom;
pub mod sources;
pub mod triage;

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

/// Parses an image reference given on the command line; a bad one is bad input (exit 2).
fn parse_ref(s: &str, what: &str) -> Result<Reference> {
    Reference::parse(s).map_err(|e| bad_input(format!("{what}: {e:#}")))
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
