//! `distro diff OLD NEW`: what changed between two images (OCI layouts or registry references):
//! sources, patches, base and its packages, environment, sizes, revision; text or `--json`.
use crate::diff::{self, Source};
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use anyhow::Result;
use clap::Args;
use std::process::ExitCode;

/// The arguments of `distro diff`.
#[derive(Args, Debug)]
pub struct DiffArgs {
    /// The old image: an OCI layout directory (`DIR` or `DIR:REF`) or a registry reference.
    #[arg(value_name = "OLD")]
    pub old: String,
    /// The new image, as OLD.
    #[arg(value_name = "NEW")]
    pub new: String,
    /// Print JSON (the same changes, one array per kind) instead of text.
    #[arg(long)]
    pub json: bool,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
}

/// Runs `distro diff`; prints the changes on stdout. Exit 0 whether or not anything changed.
pub fn diff_cmd(a: DiffArgs) -> Result<ExitCode> {
    let client = Client::new(Credentials::from_environment(None)?, a.insecure.clone())?;
    let scratch = tempfile::tempdir()?;
    let old = Source::open(&a.old, &client, &scratch.path().join("old"))?;
    let new = Source::open(&a.new, &client, &scratch.path().join("new"))?;
    let d = diff::run(&old, &new)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print!("{}", d.text(&a.old, &a.new));
    }
    Ok(ExitCode::SUCCESS)
}
