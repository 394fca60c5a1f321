//! Pulling: manifests and blobs, every one checked against its digest.
use super::auth::Scope;
use super::client::{Client, Request, error_text};
use super::reference::Reference;
use crate::oci::digest::Digest;
use crate::oci::manifest::ACCEPT_MANIFESTS;
use crate::oci::store::{BlobStore, MAX_DOCUMENT_BYTES};
use anyhow::{Context, Result, anyhow, bail};
use reqwest::Method;
use std::sync::atomic::Ordering;

/// A manifest or index as fetched.
#[derive(Clone, Debug)]
pub struct Fetched {
    /// The exact bytes (their digest is the manifest's identity).
    pub bytes: Vec<u8>,
    /// Their digest.
    pub digest: Digest,
    /// Media type (from the document, else from `Content-Type`).
    pub media_type: String,
}

fn pull_scope(r: &Reference) -> Vec<Scope> {
    vec![Scope::repository(&r.repository, &["pull"])]
}

impl Client {
    /// Fetches the manifest `r` names (by digest when it has one, else by tag) and verifies it:
    /// against the requested digest, and against `Docker-Content-Digest` when the registry sends it.
    pub fn fetch_manifest(&self, r: &Reference) -> Result<Fetched> {
        let host = r.api_host();
        let url = self.api_url(host, &r.repository, &format!("manifests/{}", r.manifest_ref()))?;
        let resp =
            self.send(host, &Request::new(Method::GET, url, pull_scope(r)).header("Accept", ACCEPT_MANIFESTS))?;
        if !resp.status().is_success() {
            bail!("{r}: fetching the manifest: {}", error_text(resp));
        }
        let header_digest = resp.headers().get("docker-content-digest").and_then(|v| v.to_str().ok()).map(String::from);
        let content_type = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).map(String::from);
        // A registry may send any length: no more than the cap and one byte is read.
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(resp, MAX_DOCUMENT_BYTES + 1), &mut bytes)
            .with_context(|| format!("{r}: reading the manifest"))?;
        if bytes.len() as u64 > MAX_DOCUMENT_BYTES {
            bail!("{r}: the registry sent a manifest of more than {MAX_DOCUMENT_BYTES} bytes (4 MiB); refusing it");
        }
        let digest = Digest::of(&bytes);
        if let Some(want) = &r.digest
            && want != &digest
        {
            bail!("{r}: the registry returned a manifest with digest {digest}, not the requested one; refusing it");
        }
        if let Some(h) = header_digest
            && h != digest.as_str()
        {
            bail!("{r}: Docker-Content-Digest {h} does not match the manifest's digest {digest}; refusing it");
        }
        let doc: serde_json::Value =
            serde_json::from_slice(&bytes).with_context(|| format!("{r}: the manifest is not JSON"))?;
        let media_type = doc
            .get("mediaType")
            .and_then(|v| v.as_str())
            .map(String::from)
            .or(content_type.map(|c| c.split(';').next().unwrap_or("").trim().to_string()))
            .ok_or_else(|| anyhow!("{r}: the manifest has no media type"))?;
        Ok(Fetched { bytes, digest, media_type })
    }

    /// The digest the registry holds for `r`'s tag or digest, without fetching it (`None` when
    /// absent).
    pub fn manifest_digest(&self, r: &Reference, scopes: Vec<Scope>) -> Result<Option<Digest>> {
        let host = r.api_host();
        let url = self.api_url(host, &r.repository, &format!("manifests/{}", r.manifest_ref()))?;
        let resp = self.send(host, &Request::new(Method::HEAD, url, scopes).header("Accept", ACCEPT_MANIFESTS))?;
        match resp.status().as_u16() {
            200 => {
                let h = resp.headers().get("docker-content-digest").and_then(|v| v.to_str().ok());
                Ok(h.and_then(|h| Digest::parse(h).ok()))
            }
            404 => Ok(None),
            _ => bail!("{r}: checking the manifest: {}", error_text(resp)),
        }
    }

    /// Downloads blob `d` of repository `r` into `store`, verifying digest and size.
    pub fn fetch_blob(&self, r: &Reference, d: &Digest, size: Option<u64>, store: &BlobStore) -> Result<u64> {
        let host = r.api_host();
        let url = self.api_url(host, &r.repository, &format!("blobs/{d}"))?;
        let resp = self.send(host, &Request::new(Method::GET, url, pull_scope(r)))?;
        if !resp.status().is_success() {
            bail!("{}: fetching blob {d}: {}", r.name(), error_text(resp));
        }
        let mut reader = resp;
        let n = store.put_verified(&mut reader, d, size, &format!("blob {d} from {}", r.name()))?;
        self.stats.blob_bytes_received.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }
}
