//! The base image: resolved from a registry (verifying every digest) into the local blob
//! store, and read back from it without network when it is pinned by digest and cached.
use crate::oci::digest::Digest;
use crate::oci::manifest::{Descriptor, ImageParts, index_entry, is_index, media_type_of};
use crate::oci::platform::Platform;
use crate::oci::store::BlobStore;
use crate::progress::Progress;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use std::collections::BTreeMap;

/// A base image, per platform.
#[derive(Clone, Debug)]
pub struct BaseImage {
    /// The reference as given.
    pub reference: Reference,
    /// Digest of what the reference resolves to (an index, or a single manifest).
    pub digest: Digest,
    /// Per platform: the manifest, config and layers the build stacks its layers on.
    pub platforms: BTreeMap<Platform, BasePlatform>,
}

/// One platform of a base image.
#[derive(Clone, Debug)]
pub struct BasePlatform {
    /// Digest of the platform's manifest.
    pub manifest_digest: Digest,
    /// The image config (parsed).
    pub config: Value,
    /// Digest of the config blob.
    pub config_digest: Digest,
    /// Layer descriptors, with OCI media types.
    pub layers: Vec<Descriptor>,
}

/// Resolves `reference` for `platforms`: manifests, configs and layers end up in `store`.
///
/// With a digest in the reference and everything already in the store, no request is made;
/// a tag is always resolved against the registry (tags move).
pub fn resolve(
    client: &Client,
    reference: &Reference,
    platforms: &[Platform],
    store: &BlobStore,
    progress: &Progress,
) -> Result<BaseImage> {
    let (top_bytes, top_digest, top_type) = match reference.digest.as_ref().filter(|d| store.has(d)) {
        Some(d) => {
            let bytes = store.read(d)?;
            let mt = media_type_of(&bytes).ok_or_else(|| anyhow!("cached manifest {d} has no mediaType"))?;
            (bytes, d.clone(), mt)
        }
        None => {
            let step = progress.step(format!("resolving base {reference}"));
            let f = client.fetch_manifest(reference).with_context(|| format!("pulling base image {reference}"))?;
            store.put(&f.bytes)?;
            step.done(f.digest.to_string());
            (f.bytes, f.digest, f.media_type)
        }
    };
    let mut out = BTreeMap::new();
    if is_index(&top_type) {
        for p in platforms {
            let d = index_entry(&top_bytes, p)
                .with_context(|| format!("{reference}: index"))?
                .ok_or_else(|| anyhow!("base image {reference} has no {p} manifest"))?;
            let bytes = manifest_bytes(client, reference, &d, store)?;
            out.insert(p.clone(), platform_part(client, reference, d, &bytes, store, progress)?);
        }
    } else {
        let part = platform_part(client, reference, top_digest.clone(), &top_bytes, store, progress)?;
        let arch = part.config["architecture"].as_str().unwrap_or("");
        for p in platforms {
            if p.architecture != arch {
                bail!("base image {reference} is a single {arch} image; it has no {p} variant");
            }
            out.insert(p.clone(), part.clone());
        }
    }
    Ok(BaseImage { reference: reference.clone(), digest: top_digest, platforms: out })
}

fn manifest_bytes(client: &Client, r: &Reference, d: &Digest, store: &BlobStore) -> Result<Vec<u8>> {
    if store.has(d) {
        return store.read(d);
    }
    let f = client.fetch_manifest(&r.with_digest(d))?;
    store.put(&f.bytes)?;
    Ok(f.bytes)
}

fn platform_part(
    client: &Client,
    r: &Reference,
    manifest_digest: Digest,
    bytes: &[u8],
    store: &BlobStore,
    progress: &Progress,
) -> Result<BasePlatform> {
    let ImageParts { config: config_desc, layers } =
        ImageParts::parse(bytes).with_context(|| format!("{r}: manifest {manifest_digest}"))?;
    for d in std::iter::once(&config_desc).chain(&layers) {
        if !store.has(&d.digest) {
            let step = progress.step(format!("pulling {} ({} bytes) from {}", d.digest, d.size, r.name()));
            client.fetch_blob(r, &d.digest, Some(d.size), store)?;
            step.done("verified");
        }
    }
    let config: Value = serde_json::from_slice(&store.read(&config_desc.digest)?)
        .with_context(|| format!("{r}: config {} is not JSON", config_desc.digest))?;
    let diff_ids = config["rootfs"]["diff_ids"].as_array().map(Vec::len).unwrap_or(0);
    if diff_ids != layers.len() {
        bail!("{r}: config lists {diff_ids} diff_ids for {} layers", layers.len());
    }
    Ok(BasePlatform { manifest_digest, config, config_digest: config_desc.digest, layers })
}
