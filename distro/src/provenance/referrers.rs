//! Attaching artifacts to an index as OCI referrers, and listing them back.
//!
//! An artifact manifest names the index as its `subject`. A registry with the referrers API
//! (OCI distribution spec 1.1: `GET /v2/NAME/referrers/DIGEST`) indexes it by itself. One
//! without (the distribution registry 2.8, Debian's `docker-registry`) gets the spec's
//! tag-schema fallback: an image index tagged `sha256-HEX` (the subject's digest) that lists
//! the referrers, which the pusher reads, extends and pushes again.
use super::Artifact;
use crate::oci::bundle::ManifestDoc;
use crate::oci::digest::Digest;
use crate::oci::json::canonical;
use crate::oci::manifest::{OCI_INDEX, OCI_MANIFEST};
use crate::oci::store::BlobStore;
use crate::progress::Progress;
use crate::registry::auth::Scope;
use crate::registry::client::{Client, Request, error_text};
use crate::registry::push::{BlobFile, PushOptions, PushPlan, push};
use crate::registry::reference::Reference;
use anyhow::{Context, Result, bail};
use reqwest::Method;
use serde_json::{Value, json};

/// The fallback tag of `subject`: `sha256-HEX`.
pub fn fallback_tag(subject: &Digest) -> String {
    subject.as_str().replacen(':', "-", 1)
}

/// The referrers of `subject` in `repo` (index entries: `mediaType`, `digest`, `size`,
/// `artifactType`, `annotations`), and how they were found: `referrers API` or the fallback tag.
pub fn list(client: &Client, repo: &Reference, subject: &Digest) -> Result<(Vec<Value>, String)> {
    if let Some(index) = api(client, repo, subject)? {
        return Ok((entries(&index), "referrers API".into()));
    }
    let tag = fallback_tag(subject);
    let found = match client
        .manifest_digest(&repo.with_tag(&tag), vec![Scope::repository(&repo.repository, &["pull"])])?
    {
        Some(_) => {
            let f = client.fetch_manifest(&repo.with_tag(&tag))?;
            entries(&serde_json::from_slice(&f.bytes).with_context(|| format!("{}:{tag} is not JSON", repo.name()))?)
        }
        None => Vec::new(),
    };
    Ok((found, format!("tag {tag}")))
}

/// The referrers API's answer for `subject`, or `None` when the registry has no such API (it
/// answers 404 or another client error to the route).
fn api(client: &Client, repo: &Reference, subject: &Digest) -> Result<Option<Value>> {
    let host = repo.api_host();
    let url = client.api_url(host, &repo.repository, &format!("referrers/{subject}"))?;
    let req = Request::new(Method::GET, url, vec![Scope::repository(&repo.repository, &["pull"])])
        .header("Accept", OCI_INDEX);
    let resp = client.send(host, &req)?;
    if !resp.status().is_success() {
        if resp.status().is_client_error() {
            return Ok(None);
        }
        bail!("{}: listing the referrers of {subject}: {}", repo.name(), error_text(resp));
    }
    let is_index =
        resp.headers().get("content-type").and_then(|v| v.to_str().ok()).is_some_and(|c| c.starts_with(OCI_INDEX));
    let bytes = resp.bytes()?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(v) if is_index || v["mediaType"] == OCI_INDEX => Ok(Some(v)),
        _ => Ok(None),
    }
}

fn entries(index: &Value) -> Vec<Value> {
    index["manifests"].as_array().cloned().unwrap_or_default()
}

/// Pushes `artifacts` (whose subject is `subject`) to `repo`, and, where the registry has no
/// referrers API, adds them to the fallback tag's index. `store` holds the blobs on their way.
/// Returns how they were attached. Pushing the same artifacts again sends nothing new.
pub fn attach(
    client: &Client,
    repo: &Reference,
    subject: &Digest,
    artifacts: &[Artifact],
    store: &BlobStore,
    progress: &Progress,
) -> Result<String> {
    let mut plan = PushPlan::default();
    for a in artifacts {
        for b in &a.blobs {
            let digest = store.put(b)?;
            if !plan.blobs.iter().any(|f: &BlobFile| f.digest == digest) {
                plan.blobs.push(BlobFile { path: store.path(&digest), digest, size: b.len() as u64, mount_from: None });
            }
        }
        plan.manifests.push(ManifestDoc::new(OCI_MANIFEST, a.manifest.clone()));
    }
    let how = if api(client, repo, subject)?.is_some() {
        "referrers API".to_string()
    } else {
        let (mut list, how) = list(client, repo, subject)?;
        for (a, doc) in artifacts.iter().zip(&plan.manifests) {
            if list.iter().any(|e| e["digest"] == json!(doc.digest)) {
                continue;
            }
            let m: Value = serde_json::from_slice(&a.manifest)?;
            let mut e = json!({"mediaType": OCI_MANIFEST, "digest": doc.digest, "size": a.manifest.len(), "artifactType": a.artifact_type});
            if m["annotations"].is_object() {
                e["annotations"] = m["annotations"].clone();
            }
            list.push(e);
        }
        let index = ManifestDoc::new(
            OCI_INDEX,
            canonical(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list})),
        );
        plan.manifests.push(index.clone());
        plan.tags.insert(fallback_tag(subject), index);
        how
    };
    push(client, repo, &plan, &PushOptions::default(), progress).with_context(|| {
        let kinds: Vec<&str> = artifacts.iter().map(|a| a.artifact_type).collect();
        format!("attaching {} to {}", kinds.join(" and "), repo.with_digest(subject))
    })?;
    Ok(how)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_tag_is_the_digest_with_a_dash() {
        let d = Digest::of(b"index");
        assert_eq!(fallback_tag(&d), format!("sha256-{}", d.hex()));
        assert!(crate::cli::push::is_tag(&fallback_tag(&d)));
    }
}
