//! A bundle: an image (usually a multi-arch index) with every blob it references and the refs it
//! is tagged with. The build returns one; every publisher (a layout, a registry, the Docker
//! engine) takes one, and so does `distro push`, which reads it back from a layout.
use super::digest::Digest;
use super::layout::Layout;
use super::manifest::{Descriptor, OCI_INDEX, OCI_MANIFEST, is_index};
use super::store::BlobStore;
use anyhow::Result;
use std::collections::BTreeSet;
use std::sync::Arc;

/// A manifest or index, with its exact bytes (its digest is theirs).
#[derive(Clone, Debug)]
pub struct ManifestDoc {
    /// Digest of `bytes`: what the document is pushed and referenced by.
    pub digest: Digest,
    /// Media type it is served with.
    pub media_type: String,
    /// The exact bytes (re-serialising would change the digest).
    pub bytes: Arc<Vec<u8>>,
}

impl ManifestDoc {
    /// A document from its bytes.
    pub fn new(media_type: &str, bytes: Vec<u8>) -> ManifestDoc {
        ManifestDoc { digest: Digest::of(&bytes), media_type: media_type.into(), bytes: Arc::new(bytes) }
    }
}

/// Where a blob already lives on some registry (a base image layer), so a registry publisher on
/// the same registry can mount it instead of uploading it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobOrigin {
    /// The registry's API host (`registry-1.docker.io` for Docker Hub).
    pub api_host: String,
    /// The repository on that registry that holds the blob.
    pub repository: String,
}

/// A config or layer blob of a bundle.
#[derive(Clone, Debug)]
pub struct BundleBlob {
    /// Its digest (its file in the bundle's store).
    pub digest: Digest,
    /// Its size in bytes.
    pub size: u64,
    /// The registry repository it came from, when it is a base image blob.
    pub origin: Option<BlobOrigin>,
}

/// An image ready to publish.
#[derive(Clone, Debug)]
pub struct Bundle {
    /// Where it came from, for messages (a layout directory, or the build).
    pub name: String,
    /// The store holding every blob and manifest below.
    pub store: BlobStore,
    /// Configs and layers, each once, in the order they are first referenced.
    pub blobs: Vec<BundleBlob>,
    /// Manifests and indexes, each once, children before the index that lists them.
    pub manifests: Vec<ManifestDoc>,
    /// The refs (tag names) and what each points at, one of `manifests`.
    pub refs: Vec<(String, Descriptor)>,
}

impl Bundle {
    /// Every digest in the bundle: blobs, then manifests.
    pub fn digests(&self) -> Vec<Digest> {
        self.blobs.iter().map(|b| b.digest.clone()).chain(self.manifests.iter().map(|m| m.digest.clone())).collect()
    }

    /// The ref names, in order.
    pub fn tags(&self) -> Vec<String> {
        self.refs.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The manifest document a ref points at.
    pub fn document(&self, d: &Descriptor) -> Option<&ManifestDoc> {
        self.manifests.iter().find(|m| m.digest == d.digest)
    }

    /// The bundle of `refs` (some of `layout`'s refs): everything reachable from them, blobs
    /// first, then platform manifests, then each root, so that nothing comes before what it
    /// references.
    pub fn from_layout(layout: &Layout, refs: Vec<(String, Descriptor)>) -> Result<Bundle> {
        let mut bundle = Bundle {
            name: layout.dir.display().to_string(),
            store: layout.store.clone(),
            blobs: Vec::new(),
            manifests: Vec::new(),
            refs: Vec::new(),
        };
        let mut seen = BTreeSet::new();
        for (name, d) in refs {
            let all = layout.reachable(&d)?;
            for x in all.iter().filter(|x| !x.media_type.contains("manifest") && !is_index(&x.media_type)) {
                if seen.insert(x.digest.clone()) {
                    bundle.blobs.push(BundleBlob { digest: x.digest.clone(), size: x.size, origin: None });
                }
            }
            for x in all.iter().filter(|x| x.media_type == OCI_MANIFEST) {
                if seen.insert(x.digest.clone()) {
                    bundle
                        .manifests
                        .push(ManifestDoc::new(&x.media_type, layout.store.read_document(&x.digest, x.size)?));
                }
            }
            if seen.insert(d.digest.clone()) {
                let media_type = if is_index(&d.media_type) { OCI_INDEX } else { &d.media_type };
                bundle.manifests.push(ManifestDoc::new(media_type, layout.store.read_document(&d.digest, d.size)?));
            }
            bundle.refs.push((name, d));
        }
        Ok(bundle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::fixture::arm64_layout;

    #[test]
    fn a_layout_bundle_lists_blobs_then_children_then_roots_each_once() {
        let dir = tempfile::tempdir().unwrap();
        let f = arm64_layout(dir.path());
        let bundle = Bundle::from_layout(&f.layout, f.layout.refs().unwrap()).unwrap();
        let blobs: Vec<&Digest> = bundle.blobs.iter().map(|b| &b.digest).collect();
        assert_eq!(blobs.len(), 2);
        assert!(blobs.contains(&&f.config) && blobs.contains(&&f.layer));
        let order: Vec<&Digest> = bundle.manifests.iter().map(|m| &m.digest).collect();
        assert_eq!(order, [&f.manifest.digest, &f.index.digest], "the manifest before the index that lists it");
        assert_eq!(bundle.manifests[1].media_type, OCI_INDEX);
        assert_eq!(bundle.tags(), ["engine"]);
        let doc = bundle.document(&f.manifest).unwrap();
        assert_eq!(doc.bytes.as_slice(), f.layout.store.read(&f.manifest.digest).unwrap());
        assert_eq!(bundle.digests().len(), 4);
    }
}
