//! `distro push`: publishes an OCI layout's refs to a registry; prints `REPO:TAG DIGEST` per
//! tag and the multi-arch index's digest last.
use super::parse_ref;
use crate::error::bad_input;
use crate::oci::layout::Layout;
use crate::oci::manifest::{Descriptor, OCI_INDEX, OCI_MANIFEST, is_index};
use crate::progress::Progress;
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use crate::registry::push::{BlobFile, ManifestDoc, PushOptions, PushPlan, push};
use anyhow::Result;
use clap::Args;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

/// `distro push`.
#[derive(Args, Debug)]
pub struct PushArgs {
    /// OCI image layout to push.
    pub layout: PathBuf,
    /// Repository, with :TAG to push only that ref of the layout (default: every ref).
    #[arg(value_name = "REPO[:TAG]")]
    pub repo: String,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]")]
    pub insecure: Vec<String>,
    /// Upload blobs in chunks of this many bytes (default: one request per blob).
    #[arg(long, value_name = "BYTES")]
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
    let layout = Layout::open(&a.layout)?;
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
    if selected.is_empty() {
        return Err(bad_input(format!("{}: nothing to push (no named refs)", a.layout.display())));
    }
    let mut plan = PushPlan::default();
    let mut seen = std::collections::BTreeSet::new();
    for (name, d) in &selected {
        // Blobs first, then platform manifests, then the root (index), so that nothing is
        // pushed before what it references.
        let all = layout.reachable(d)?;
        for x in all.iter().filter(|x| !x.media_type.contains("manifest") && !is_index(&x.media_type)) {
            if seen.insert(x.digest.clone()) {
                plan.blobs.push(BlobFile {
                    digest: x.digest.clone(),
                    size: x.size,
                    path: layout.store.path(&x.digest),
                    mount_from: None,
                });
            }
        }
        for x in all.iter().filter(|x| x.media_type == OCI_MANIFEST) {
            if seen.insert(x.digest.clone()) {
                plan.manifests.push(ManifestDoc::new(&x.media_type, layout.store.read(&x.digest)?));
            }
        }
        let root = ManifestDoc::new(
            if is_index(&d.media_type) { OCI_INDEX } else { &d.media_type },
            layout.store.read(&d.digest)?,
        );
        if seen.insert(d.digest.clone()) {
            plan.manifests.push(root.clone());
        }
        plan.tags.insert(name.clone(), root);
    }
    let client = Client::new(Credentials::from_environment(Some(target.api_host()))?, a.insecure)?;
    let step = progress.step(format!("pushing {} to {}", a.layout.display(), target.name()));
    let report = push(&client, &target, &plan, &PushOptions { chunk_size: a.chunk_size }, &progress)?;
    step.done(report.to_string());
    let by_tag: BTreeMap<&String, &ManifestDoc> = plan.tags.iter().collect();
    for (tag, doc) in &by_tag {
        println!("{}:{tag} {}", target.name(), doc.digest);
    }
    // Last: the multi-arch index (what build prints), else the one image pushed.
    let last = by_tag.values().find(|d| d.media_type == OCI_INDEX).or(by_tag.values().next());
    if let Some(d) = last {
        println!("{}", d.digest);
    }
    Ok(ExitCode::SUCCESS)
}
