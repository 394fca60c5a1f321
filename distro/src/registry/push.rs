//! Pushing an image: blobs first (HEAD before upload, cross-repository mount when the blob
//! lives in another repository of the same registry, monolithic upload with a chunked
//! fallback), then manifests children-first, then tags.
use super::auth::Scope;
use super::client::{Client, Payload, Request, Stats, error_text, redact};
use super::reference::Reference;
use crate::oci::bundle::ManifestDoc;
use crate::oci::digest::Digest;
use crate::progress::Progress;
use anyhow::{Context, Result, anyhow, bail};
use reqwest::Method;
use reqwest::blocking::Response;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use url::Url;

/// A blob to push, read from a file.
#[derive(Clone, Debug)]
pub struct BlobFile {
    /// Digest the registry checks the upload against.
    pub digest: Digest,
    /// Size in bytes (sent as the upload's length).
    pub size: u64,
    /// Where its bytes are.
    pub path: PathBuf,
    /// Another repository on the target registry that holds it (for a mount).
    pub mount_from: Option<String>,
}

/// Everything one push sends.
#[derive(Clone, Debug, Default)]
pub struct PushPlan {
    /// Blobs (configs and layers), each once.
    pub blobs: Vec<BlobFile>,
    /// Manifests pushed by digest, children before the index that lists them.
    pub manifests: Vec<ManifestDoc>,
    /// Tags, each pointing at one of `manifests` (usually the index).
    pub tags: BTreeMap<String, ManifestDoc>,
}

/// Options for a push.
#[derive(Clone, Debug, Default)]
pub struct PushOptions {
    /// Upload blobs in chunks of this many bytes instead of one request.
    pub chunk_size: Option<u64>,
}

/// What a push did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PushReport {
    /// Blob bytes sent.
    pub blob_bytes_sent: u64,
    /// Blobs uploaded (neither present nor mounted).
    pub uploaded: u64,
    /// Blobs already present.
    pub present: u64,
    /// Blobs mounted from another repository.
    pub mounted: u64,
    /// Bytes of manifests and indexes sent.
    pub manifest_bytes_sent: u64,
}

impl std::fmt::Display for PushReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "blobs: {} uploaded, {} already present, {} mounted; blob bytes sent: {}; manifest bytes sent: {}",
            self.uploaded, self.present, self.mounted, self.blob_bytes_sent, self.manifest_bytes_sent
        )
    }
}

/// Pushes `plan` to repository `target` (its tag and digest are ignored; `plan.tags` name the tags).
pub fn push(
    client: &Client,
    target: &Reference,
    plan: &PushPlan,
    opts: &PushOptions,
    progress: &Progress,
) -> Result<PushReport> {
    let before = snapshot(&client.stats);
    let host = target.api_host();
    for blob in &plan.blobs {
        push_blob(client, target, blob, opts, progress)
            .with_context(|| format!("pushing blob {} to {}", blob.digest, target.name()))?;
    }
    let scopes = push_scopes(target, None);
    for m in &plan.manifests {
        let by_digest = target.with_digest(&m.digest);
        if client.manifest_digest(&by_digest, scopes.clone())?.as_ref() == Some(&m.digest) {
            continue;
        }
        put_manifest(client, host, target, &m.digest.to_string(), m)?;
    }
    for (tag, m) in &plan.tags {
        if client.manifest_digest(&target.with_tag(tag), scopes.clone())?.as_ref() == Some(&m.digest) {
            continue;
        }
        put_manifest(client, host, target, tag, m)?;
    }
    let after = snapshot(&client.stats);
    Ok(PushReport {
        blob_bytes_sent: after.blob_bytes_sent - before.blob_bytes_sent,
        uploaded: after.uploaded - before.uploaded,
        present: after.present - before.present,
        mounted: after.mounted - before.mounted,
        manifest_bytes_sent: after.manifest_bytes_sent - before.manifest_bytes_sent,
    })
}

fn snapshot(s: &Stats) -> PushReport {
    PushReport {
        blob_bytes_sent: Stats::get(&s.blob_bytes_sent),
        uploaded: Stats::get(&s.blobs_uploaded),
        present: Stats::get(&s.blobs_present),
        mounted: Stats::get(&s.blobs_mounted),
        manifest_bytes_sent: Stats::get(&s.manifest_bytes_sent),
    }
}

fn push_scopes(target: &Reference, mount_from: Option<&str>) -> Vec<Scope> {
    let mut s = vec![Scope::repository(&target.repository, &["pull", "push"])];
    if let Some(from) = mount_from {
        s.push(Scope::repository(from, &["pull"]));
    }
    s
}

fn put_manifest(client: &Client, host: &str, target: &Reference, reference: &str, m: &ManifestDoc) -> Result<()> {
    let url = client.api_url(host, &target.repository, &format!("manifests/{reference}"))?;
    let req = Request::new(Method::PUT, url, push_scopes(target, None))
        .header("Content-Type", m.media_type.clone())
        .body(Payload::Bytes(m.bytes.clone()), false);
    let resp = client.send(host, &req)?;
    if resp.status().as_u16() != 201 && !resp.status().is_success() {
        bail!("{}: putting manifest {reference}: {}", target.name(), error_text(resp));
    }
    check_digest_header(&resp, &m.digest, &format!("manifest {reference}"))?;
    client.stats.manifest_bytes_sent.fetch_add(m.bytes.len() as u64, Ordering::Relaxed);
    Ok(())
}

fn check_digest_header(resp: &Response, want: &Digest, what: &str) -> Result<()> {
    if let Some(h) = resp.headers().get("docker-content-digest").and_then(|v| v.to_str().ok())
        && h != want.as_str()
    {
        bail!("{what}: the registry stored digest {h}, expected {want}");
    }
    Ok(())
}

fn push_blob(
    client: &Client,
    target: &Reference,
    blob: &BlobFile,
    opts: &PushOptions,
    progress: &Progress,
) -> Result<()> {
    let host = target.api_host();
    let scopes = push_scopes(target, blob.mount_from.as_deref());
    let head = client.api_url(host, &target.repository, &format!("blobs/{}", blob.digest))?;
    let resp = client.send(host, &Request::new(Method::HEAD, head, scopes.clone()))?;
    match resp.status().as_u16() {
        200 => {
            client.stats.blobs_present.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        404 => {}
        _ => bail!("HEAD: {}", error_text(resp)),
    }
    // Start an upload session, asking for a mount when another repository has the blob.
    let mut start = client.api_url(host, &target.repository, "blobs/uploads/")?;
    if let Some(from) = &blob.mount_from {
        start.query_pairs_mut().append_pair("mount", blob.digest.as_str()).append_pair("from", from);
    }
    let resp = client.send(host, &Request::new(Method::POST, start.clone(), scopes.clone()))?;
    let status = resp.status().as_u16();
    if status == 201 && blob.mount_from.is_some() {
        check_digest_header(&resp, &blob.digest, "mounted blob")?;
        client.stats.blobs_mounted.fetch_add(1, Ordering::Relaxed);
        return Ok(());
    }
    if status != 202 {
        bail!("starting an upload: {}", error_text(resp));
    }
    let session = location(&resp)?;
    let bar = progress.bytes(blob.size, blob.digest.as_str()[..19].to_string());
    *client.progress.lock().expect("progress lock") = Some(bar.clone());
    let result = match opts.chunk_size {
        Some(chunk) => upload_chunked(client, host, &scopes, session, blob, chunk),
        None => match upload_monolithic(client, host, &scopes, session, blob) {
            // Some registries cap request sizes: start over in chunks.
            Err(e) if e.downcast_ref::<TooLarge>().is_some() => {
                let resp = client.send(host, &Request::new(Method::POST, start, scopes.clone()))?;
                if resp.status().as_u16() != 202 {
                    bail!("restarting the upload in chunks: {}", error_text(resp));
                }
                let loc = location(&resp)?;
                upload_chunked(client, host, &scopes, loc, blob, 16 << 20)
            }
            other => other,
        },
    };
    *client.progress.lock().expect("progress lock") = None;
    bar.finish_and_clear();
    result?;
    client.stats.blobs_uploaded.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[derive(Debug)]
struct TooLarge;
impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the registry refused the blob in one request (HTTP 413)")
    }
}
impl std::error::Error for TooLarge {}

fn location(resp: &Response) -> Result<Url> {
    let loc = resp
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| anyhow!("the registry started an upload without a Location"))?;
    // Relative locations resolve against the URL that answered (after any redirect).
    resp.url().join(loc).with_context(|| format!("bad upload Location {loc:?}"))
}

fn with_digest(mut url: Url, d: &Digest) -> Url {
    url.query_pairs_mut().append_pair("digest", d.as_str());
    url
}

fn upload_monolithic(client: &Client, host: &str, scopes: &[Scope], loc: Url, blob: &BlobFile) -> Result<()> {
    let req = Request::new(Method::PUT, with_digest(loc, &blob.digest), scopes.to_vec())
        .header("Content-Type", "application/octet-stream")
        .body(Payload::File { path: blob.path.clone(), offset: 0, len: blob.size }, true);
    let resp = client.send(host, &req)?;
    match resp.status().as_u16() {
        201 | 204 => check_digest_header(&resp, &blob.digest, "uploaded blob"),
        413 => Err(anyhow::Error::new(TooLarge)),
        _ => bail!("uploading: {}", error_text(resp)),
    }
}

fn upload_chunked(
    client: &Client,
    host: &str,
    scopes: &[Scope],
    mut loc: Url,
    blob: &BlobFile,
    chunk: u64,
) -> Result<()> {
    let chunk = chunk.max(1);
    let mut offset = 0;
    while offset < blob.size {
        let len = chunk.min(blob.size - offset);
        let req = Request::new(Method::PATCH, loc.clone(), scopes.to_vec())
            .header("Content-Type", "application/octet-stream")
            .header("Content-Range", format!("{}-{}", offset, offset + len - 1))
            .body(Payload::File { path: blob.path.clone(), offset, len }, true);
        let resp = client.send(host, &req)?;
        if resp.status().as_u16() != 202 {
            bail!("uploading bytes {offset}.. to {}: {}", redact(&loc), error_text(resp));
        }
        loc = location(&resp)?;
        offset += len;
    }
    let resp = client.send(host, &Request::new(Method::PUT, with_digest(loc, &blob.digest), scopes.to_vec()))?;
    match resp.status().as_u16() {
        201 | 204 => check_digest_header(&resp, &blob.digest, "uploaded blob"),
        _ => bail!("finishing a chunked upload: {}", error_text(resp)),
    }
}
