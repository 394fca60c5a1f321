//! `distro push`: publishes an OCI layout's refs to a registry; prints `REPO:TAG DIGEST` per
//! tag and the multi-arch index's digest last.
use super::parse_ref;
use crate::error::bad_input;
use crate::oci::bundle::Bundle;
use crate::oci::manifest::{Descriptor, is_index};
use crate::progress::Progress;
use crate::publish::publish;
use crate::publish::registry::Registry;
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro push`.
#[derive(Args, Debug)]
pub struct PushArgs {
    /// OCI image layout to push.
    pub layout: PathBuf,
    /// Repository, with :TAG to push only that ref of the layout (default: every ref).
    #[arg(value_name = "REPO[:TAG]")]
    pub repo: String,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
    /// Upload blobs in chunks of this many bytes (default: one request per blob).
    #[arg(long, value_name = "BYTES", value_parser = super::chunk_size)]
    pub chunk_size: Option<u64>,
}

/// Runs `distro push`; prints `REPO:TAG DIGEST` per tag on stdout, the multi-arch index's
/// digest last.
pub fn push_cmd(a: PushArgs) -> Result<ExitCode> {
    let progress = Progress::new();
    let target = parse_ref(&a.repo, "REPO")?;
    if target.digest.is_some() {
        return Err(bad_input("REPO: push to a repository or REPO:TAG, not a digest"));
    }
    let (layout, _lock) = super::read_layout(&a.layout)?;
    let refs = layout.refs()?;
    let selected: Vec<(String, Descriptor)> = match &target.tag {
        Some(t) => match refs.iter().find(|(n, _)| n == t) {
            Some(r) => vec![r.clone()],
            None => {
                let names: Vec<&str> = refs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(bad_input(format!("{}: no ref {t:?} (refs: {})", a.layout.display(), names.join(", "))));
            }
        },
        None => refs.into_iter().filter(|(n, _)| !n.is_empty()).collect(),
    };
    // A layout's ref names are whatever its index.json says; a tag must be a tag.
    if let Some((bad, _)) = selected.iter().find(|(n, _)| !is_tag(n)) {
        return Err(bad_input(format!(
            "{}: ref {bad:?} is not a valid tag ([A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}); rename it or push another ref with REPO:TAG",
            a.layout.display()
        )));
    }
    if selected.is_empty() {
        return Err(bad_input(format!("{}: nothing to push (no named refs)", a.layout.display())));
    }
    let bundle = Bundle::from_layout(&layout, selected)?;
    // Before any connection: an index lacking a platform of its definition is not published.
    crate::publish::registry::check_platforms(&bundle)?;
    let client = Client::new(Credentials::from_environment(Some(target.api_host()))?, a.insecure)?;
    let published = publish(&Registry { client: &client, repo: target, chunk_size: a.chunk_size }, &bundle, &progress)?;
    for (name, digest) in &published.names {
        println!("{name} {digest}");
    }
    // Last: the multi-arch index (what build prints), else the one image pushed.
    let mut refs = bundle.refs.clone();
    refs.sort_by(|a, b| a.0.cmp(&b.0));
    let last = refs.iter().find(|(_, d)| is_index(&d.media_type)).or(refs.first());
    if let Some((_, d)) = last {
        println!("{}", d.digest);
    }
    Ok(ExitCode::SUCCESS)
}

/// A tag as the distribution spec defines it: `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn is_tag(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"_.-".contains(c))
}
