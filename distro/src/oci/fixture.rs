//! A test fixture shared by the tests of the folders that read layouts (oci, docker, publish).
use super::digest::Digest;
use super::layout::Layout;
use super::manifest::{Descriptor, OCI_CONFIG, OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST, image_index, image_manifest};
use super::platform::Platform;
use super::store::BlobStore;
use std::collections::BTreeMap;
use std::path::Path;

/// What [`arm64_layout`] wrote.
pub(crate) struct Fixture {
    /// The layout, under `dir/oci`.
    pub(crate) layout: Layout,
    /// The index, tagged `engine`.
    pub(crate) index: Descriptor,
    /// Its one manifest (linux/arm64).
    pub(crate) manifest: Descriptor,
    /// The manifest's config blob.
    pub(crate) config: Digest,
    /// The manifest's one layer blob (the bytes `layer`).
    pub(crate) layer: Digest,
}

/// A layout under `dir/oci` holding one linux/arm64 image in an index tagged `engine`.
pub(crate) fn arm64_layout(dir: &Path) -> Fixture {
    let store = BlobStore::new(dir.join("src"));
    let config = Descriptor::of(OCI_CONFIG, br#"{"architecture":"arm64"}"#);
    let layer = Descriptor::of(OCI_LAYER_GZIP, b"layer");
    store.put(br#"{"architecture":"arm64"}"#).unwrap();
    store.put(b"layer").unwrap();
    let m = image_manifest(&config, std::slice::from_ref(&layer), &BTreeMap::new()).unwrap();
    let manifest = Descriptor::of(OCI_MANIFEST, &m);
    store.put(&m).unwrap();
    let arm = Platform::parse("linux/arm64").unwrap();
    let idx = image_index(&[(arm, manifest.clone())], &BTreeMap::new()).unwrap();
    let index = Descriptor::of(OCI_INDEX, &idx);
    store.put(&idx).unwrap();
    let layout = Layout::new(dir.join("oci"));
    let blobs = [config.digest.clone(), layer.digest.clone(), manifest.digest.clone(), index.digest.clone()];
    layout.write(&store, &blobs, &[("engine".into(), index.clone())]).unwrap();
    Fixture { layout, index, manifest, config: config.digest, layer: layer.digest }
}
