//! Publishing to a registry repository: the bundle becomes a push plan (blobs, manifests
//! children first, tags), and base image blobs are mounted when the base lives on the same
//! registry.
use super::{Published, Publisher};
use crate::oci::bundle::Bundle;
use crate::progress::Progress;
use crate::registry::client::Client;
use crate::registry::push::{BlobFile, PushOptions, PushPlan, push};
use crate::registry::reference::Reference;
use anyhow::{Result, anyhow};

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
        let plan = self.plan(bundle)?;
        let report = push(self.client, &self.repo, &plan, &PushOptions { chunk_size: self.chunk_size }, progress)?;
        Ok(Published {
            names: plan.tags.iter().map(|(t, doc)| (format!("{}:{t}", self.repo.name()), doc.digest.clone())).collect(),
            summary: report.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::bundle::{BlobOrigin, BundleBlob, ManifestDoc};
    use crate::oci::digest::Digest;
    use crate::oci::manifest::{Descriptor, OCI_MANIFEST};
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
}
