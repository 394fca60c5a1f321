//! Publishing to a registry repository: the bundle becomes a push plan (blobs, manifests
//! children first, tags), and base image blobs are mounted when the base lives on the same
//! registry. After the push, the SBOM and provenance are attached to the index as referrers
//! ([`crate::provenance`]).
use super::{Published, Publisher};
use crate::error::bad_input;
use crate::oci::bundle::Bundle;
use crate::oci::manifest::is_index;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use crate::provenance::referrers::attach;
use crate::provenance::{Subject, artifacts};
use crate::registry::client::Client;
use crate::registry::push::{BlobFile, PushOptions, PushPlan, push};
use crate::registry::reference::Reference;
use anyhow::{Result, anyhow};
use serde_json::Value;

/// The index annotation listing every platform of the image definition (comma-separated), which
/// `distro build` writes and a registry publisher checks the index's entries against.
pub const PLATFORMS_ANNOTATION: &str = "io.github.llm-distro.platforms";

/// Refuses a bundle whose tagged index lacks a platform its definition lists
/// ([`PLATFORMS_ANNOTATION`]): a published multi-arch tag holds every platform, so that one
/// cannot silently lose arm64 (as JAX-Toolbox's tags did, its #2224 and #1711). An index
/// without the annotation (built before it existed, or by another tool) is not checked.
pub fn check_platforms(bundle: &Bundle) -> Result<()> {
    for (tag, d) in bundle.refs.iter().filter(|(_, d)| is_index(&d.media_type)) {
        let Some(doc) = bundle.document(d) else { continue };
        let v: Value = serde_json::from_slice(&doc.bytes)?;
        let Some(listed) = v["annotations"][PLATFORMS_ANNOTATION].as_str() else { continue };
        let entries = v["manifests"].as_array().cloned().unwrap_or_default();
        for name in listed.split(',').filter(|s| !s.is_empty()) {
            let p = Platform::parse(name)?;
            if !entries.iter().any(|e| p.matches(&e["platform"])) {
                return Err(bad_input(format!(
                    "{}: the index tagged {tag} lacks {p}, a platform of its image definition ({PLATFORMS_ANNOTATION} = \"{listed}\"); a published index holds every platform: build them all, then push",
                    bundle.name
                )));
            }
        }
    }
    Ok(())
}

/// A repository on a registry; the bundle's refs become its tags.
pub struct Registry<'a> {
    /// The client that pushes (credentials, plain-HTTP registries).
    pub client: &'a Client,
    /// The repository (its tag and digest, if any, are ignored).
    pub repo: Reference,
    /// Upload blobs in chunks of this many bytes instead of one request each.
    pub chunk_size: Option<u64>,
}

impl Registry<'_> {
    /// The push plan of `bundle` for this repository.
    pub fn plan(&self, bundle: &Bundle) -> Result<PushPlan> {
        let host = self.repo.api_host();
        let blobs = bundle
            .blobs
            .iter()
            .map(|b| BlobFile {
                digest: b.digest.clone(),
                size: b.size,
                path: bundle.store.path(&b.digest),
                // Mounts only work within one registry.
                mount_from: b.origin.as_ref().filter(|o| o.api_host == host).map(|o| o.repository.clone()),
            })
            .collect();
        let tags = bundle
            .refs
            .iter()
            .map(|(t, d)| {
                let doc = bundle.document(d).ok_or_else(|| anyhow!("ref {t}: {} is not in the bundle", d.digest))?;
                Ok((t.clone(), doc.clone()))
            })
            .collect::<Result<_>>()?;
        Ok(PushPlan { blobs, manifests: bundle.manifests.clone(), tags })
    }
}

impl Publisher for Registry<'_> {
    fn describe(&self, bundle: &Bundle) -> String {
        format!("pushing {} to {}", bundle.name, self.repo.name())
    }

    fn publish(&self, bundle: &Bundle, progress: &Progress) -> Result<Published> {
        check_platforms(bundle)?;
        let plan = self.plan(bundle)?;
        let report = push(self.client, &self.repo, &plan, &PushOptions { chunk_size: self.chunk_size }, progress)?;
        let mut summary = report.to_string();
        // The SBOM and provenance, attached to the index pushed (once, whatever tags it has).
        if let Some((_, index)) = bundle.refs.iter().find(|(_, d)| is_index(&d.media_type))
            && let Some(doc) = bundle.document(index)
        {
            let subject = Subject::read(
                &doc.media_type,
                &doc.bytes,
                |d| {
                    let m = bundle.document(d).ok_or_else(|| anyhow!("manifest {} is not in the bundle", d.digest))?;
                    Ok(m.bytes.to_vec())
                },
                |d| Ok(bundle.store.path(&d.digest)),
            )?;
            let how = attach(self.client, &self.repo, &doc.digest, &artifacts(&subject), &bundle.store, progress)?;
            summary += &format!("; SBOM and provenance attached to {} ({how})", doc.digest);
        }
        Ok(Published {
            names: plan.tags.iter().map(|(t, doc)| (format!("{}:{t}", self.repo.name()), doc.digest.clone())).collect(),
            summary,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::bundle::{BlobOrigin, BundleBlob, ManifestDoc};
    use crate::oci::digest::Digest;
    use crate::oci::manifest::{Descriptor, OCI_INDEX, OCI_MANIFEST};
    use crate::oci::store::BlobStore;
    use crate::registry::auth::Credentials;

    #[test]
    fn base_blobs_are_mounted_only_within_their_registry_and_refs_become_tags() {
        let doc = ManifestDoc::new(OCI_MANIFEST, b"{}".to_vec());
        let origin = BlobOrigin { api_host: "localhost:5000".into(), repository: "base".into() };
        let bundle = Bundle {
            name: "engine-2026-01-01".into(),
            store: BlobStore::new("/nonexistent"),
            blobs: vec![
                BundleBlob { digest: Digest::of(b"base layer"), size: 10, origin: Some(origin) },
                BundleBlob { digest: Digest::of(b"ours"), size: 4, origin: None },
            ],
            manifests: vec![doc.clone()],
            refs: vec![("engine".into(), Descriptor::of(OCI_MANIFEST, &doc.bytes))],
        };
        let client = Client::new(Credentials::default(), vec![]).unwrap();
        let plan = |repo: &str| {
            Registry { client: &client, repo: Reference::parse(repo).unwrap(), chunk_size: None }.plan(&bundle).unwrap()
        };
        let same = plan("localhost:5000/distro");
        assert_eq!(same.blobs[0].mount_from.as_deref(), Some("base"));
        assert_eq!(same.blobs[1].mount_from, None);
        assert_eq!(same.blobs[0].path, bundle.store.path(&bundle.blobs[0].digest));
        assert_eq!(plan("localhost:5001/distro").blobs[0].mount_from, None, "another registry");
        assert_eq!(same.tags["engine"].digest, doc.digest);
        assert_eq!(same.manifests.len(), 1);
    }

    #[test]
    fn an_index_lacking_a_platform_of_its_definition_is_refused() {
        let index = |entries: &[&str], listed: Option<&str>| {
            let manifests: Vec<Value> = entries
                .iter()
                .map(|a| {
                    let p = Platform::parse(&format!("linux/{a}")).unwrap();
                    serde_json::json!({"mediaType": OCI_MANIFEST, "digest": Digest::of(a.as_bytes()).to_string(), "size": 1, "platform": p.to_json()})
                })
                .collect();
            let mut v = serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
            if let Some(l) = listed {
                v["annotations"] = serde_json::json!({PLATFORMS_ANNOTATION: l});
            }
            let doc = ManifestDoc::new(OCI_INDEX, serde_json::to_vec(&v).unwrap());
            Bundle {
                name: "engine-2026-01-01".into(),
                store: BlobStore::new("/nonexistent"),
                blobs: vec![],
                manifests: vec![doc.clone()],
                refs: vec![("engine-2026-01-01".into(), Descriptor::of(OCI_INDEX, &doc.bytes))],
            }
        };
        let both = "linux/amd64,linux/arm64/v8";
        assert!(check_platforms(&index(&["amd64", "arm64"], Some(both))).is_ok());
        assert!(check_platforms(&index(&["amd64"], None)).is_ok(), "no annotation: not checked");
        assert!(check_platforms(&index(&["amd64"], Some("linux/amd64"))).is_ok());
        let e = check_platforms(&index(&["amd64"], Some(both))).unwrap_err();
        assert_eq!(crate::error::exit_code(&e), 2);
        let line = crate::error::one_line(&e);
        assert!(line.contains("the index tagged engine-2026-01-01 lacks linux/arm64/v8"), "{line}");
        assert!(!line.contains('\n'));
    }
}
