//! Deterministic layers: a sorted tar of fixed-metadata entries, gzipped with fixed settings.
//!
//! Same entries + same epoch -> same bytes -> same digest, on any machine: entries are sorted
//! by path, every header has uid/gid 0, no user/group names, mtime = the epoch, a fixed mode, and
//! no extended attributes or PAX records; the gzip header has mtime 0, no file name and OS 255,
//! and compression runs through flate2's pure-Rust backend (miniz_oxide) at a pinned level.
use crate::error::bad_input;
use crate::fsutil::write_atomic;
use crate::oci::digest::{Digest, KeyHasher};
use crate::oci::store::BlobStore;
use anyhow::{Context, Result};
use flate2::{Compression, GzBuilder};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// The gzip level every layer is compressed with. Changing it changes every digest.
pub const GZIP_LEVEL: u32 = 6;
/// OCI media type of our layers.
pub const MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// Mode of directories and executables.
pub const MODE_EXEC: u32 = 0o755;
/// Mode of ordinary files.
pub const MODE_FILE: u32 = 0o644;

/// What a tar entry is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A directory entry (mode 0755).
    Dir,
    /// A regular file with its content (shared, since binaries are large).
    File(Arc<Vec<u8>>),
    /// A symbolic link to the given target.
    Symlink(String),
}

/// One entry of a layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// What the entry is.
    pub kind: EntryKind,
    /// Permission bits (no setuid/setgid/sticky).
    pub mode: u32,
}

/// The contents of one layer, keyed by path relative to `/` (no leading or trailing slash).
#[derive(Clone, Debug, Default)]
pub struct LayerSpec {
    entries: BTreeMap<String, Entry>,
}

/// A finished layer: what the config and the manifest need to reference it. It is also the
/// layer's record in the build directory's `layers/KEY.json` (see [`cached_layer`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Layer {
    /// Digest of the compressed blob (what manifests reference).
    pub digest: Digest,
    /// Digest of the uncompressed tar (what the config's `rootfs.diff_ids` lists).
    pub diff_id: Digest,
    /// Size in bytes of the compressed blob.
    pub size: u64,
}

impl LayerSpec {
    /// A layer spec with no entries yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a file at absolute path `dest` with `mode`, plus any missing parent directories.
    pub fn add_file(&mut self, dest: &str, content: Arc<Vec<u8>>, mode: u32) -> Result<()> {
        let path = normalize(dest)?;
        self.add_parents(&path);
        self.insert(path, Entry { kind: EntryKind::File(content), mode: mode & 0o777 })
    }

    /// Adds a directory (and its parents).
    pub fn add_dir(&mut self, dest: &str) -> Result<()> {
        let path = normalize(dest)?;
        self.add_parents(&path);
        self.insert(path, Entry { kind: EntryKind::Dir, mode: MODE_EXEC })
    }

    /// Adds a symbolic link at `dest` pointing to `target`.
    pub fn add_symlink(&mut self, dest: &str, target: &str) -> Result<()> {
        let path = normalize(dest)?;
        self.add_parents(&path);
        self.insert(path, Entry { kind: EntryKind::Symlink(target.to_string()), mode: 0o777 })
    }

    fn add_parents(&mut self, path: &str) {
        let mut end = 0;
        while let Some(i) = path[end..].find('/') {
            end += i;
            self.entries.entry(path[..end].to_string()).or_insert(Entry { kind: EntryKind::Dir, mode: MODE_EXEC });
            end += 1;
        }
    }

    fn insert(&mut self, path: String, entry: Entry) -> Result<()> {
        match self.entries.get(&path) {
            Some(old) if old.kind == EntryKind::Dir && entry.kind == EntryKind::Dir => Ok(()),
            Some(_) => Err(bad_input(format!("two entries for /{path} in one layer"))),
            None => {
                self.entries.insert(path, entry);
                Ok(())
            }
        }
    }

    /// True when nothing was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries in tar order.
    pub fn entries(&self) -> impl Iterator<Item = (&String, &Entry)> {
        self.entries.iter()
    }

    /// A key that changes whenever the layer's bytes would: entries, modes, contents, the epoch
    /// and the compression settings.
    pub fn cache_key(&self, epoch: u64) -> String {
        let mut k = KeyHasher::new("layer-v1");
        k.part(&epoch.to_le_bytes()).part(&GZIP_LEVEL.to_le_bytes());
        k.part(env!("CARGO_PKG_VERSION").as_bytes());
        for (path, e) in &self.entries {
            k.part(path.as_bytes()).part(&e.mode.to_le_bytes());
            match &e.kind {
                EntryKind::Dir => k.part(b"d"),
                EntryKind::File(c) => k.part(b"f").part(Digest::of(c).as_str().as_bytes()),
                EntryKind::Symlink(t) => k.part(b"l").part(t.as_bytes()),
            };
        }
        k.finish()
    }

    /// The uncompressed tar of the entries, sorted, with every mtime set to `epoch`.
    pub fn tar(&self, epoch: u64) -> Result<Vec<u8>> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, e) in &self.entries {
            let mut h = tar::Header::new_gnu();
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(epoch);
            h.set_mode(e.mode);
            match &e.kind {
                EntryKind::Dir => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    b.append_data(&mut h, format!("{path}/"), std::io::empty())
                }
                EntryKind::File(c) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(c.len() as u64);
                    b.append_data(&mut h, path, c.as_slice())
                }
                EntryKind::Symlink(t) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    b.append_link(&mut h, path, t)
                }
            }
            .with_context(|| format!("adding /{path} to a layer"))?;
        }
        Ok(b.into_inner()?)
    }

    /// Builds the layer: tar, gzip, digests. Returns the layer and its compressed bytes.
    pub fn build(&self, epoch: u64) -> Result<(Layer, Vec<u8>)> {
        let tar = self.tar(epoch)?;
        let diff_id = Digest::of(&tar);
        let gz = gzip(&tar)?;
        Ok((Layer { digest: Digest::of(&gz), diff_id, size: gz.len() as u64 }, gz))
    }
}

impl Layer {
    /// The layer recorded in `record`, when the file parses and `store` holds its blob at the
    /// recorded size; `None` sends the caller to build it again.
    pub fn cached(record: &Path, store: &BlobStore) -> Option<Layer> {
        let layer: Layer = serde_json::from_slice(&std::fs::read(record).ok()?).ok()?;
        (store.size(&layer.digest) == Some(layer.size)).then_some(layer)
    }

    /// Writes the record that [`Layer::cached`] reads.
    pub fn record(&self, record: &Path) -> Result<()> {
        write_atomic(record, &serde_json::to_vec(self)?)
    }
}

/// The layer of `spec`, cached by its key under `cache/layers/`: built (tar + gzip) and stored
/// only when no record with that key names a blob the store holds.
pub fn cached_layer(spec: &LayerSpec, epoch: u64, cache: &Path, store: &BlobStore) -> Result<Layer> {
    let record = cache.join("layers").join(format!("{}.json", spec.cache_key(epoch)));
    if let Some(layer) = Layer::cached(&record, store) {
        return Ok(layer);
    }
    let (layer, gz) = spec.build(epoch)?;
    store.put(&gz)?;
    layer.record(&record)?;
    Ok(layer)
}

/// Gzip with a fixed header (mtime 0, no name, OS "unknown") and the pinned level.
pub fn gzip(data: &[u8]) -> Result<Vec<u8>> {
    let mut enc = GzBuilder::new()
        .mtime(0)
        .operating_system(255)
        .write(Vec::with_capacity(data.len() / 2), Compression::new(GZIP_LEVEL));
    enc.write_all(data)?;
    Ok(enc.finish()?)
}

/// `/usr/local/bin/engine` -> `usr/local/bin/engine`; refuses relative paths and `..`.
fn normalize(dest: &str) -> Result<String> {
    let Some(rel) = dest.strip_prefix('/') else {
        return Err(bad_input(format!("image path {dest:?} must be absolute")));
    };
    let rel = rel.trim_end_matches('/');
    if rel.is_empty() || rel.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err(bad_input(format!("image path {dest:?} is not a clean absolute path")));
    }
    Ok(rel.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn sample() -> LayerSpec {
        let mut s = LayerSpec::new();
        // Added out of order on purpose.
        s.add_file("/usr/local/bin/test-all", Arc::new(b"#!/bin/sh\n".to_vec()), 0o755).unwrap();
        s.add_file("/opt/engine/recipes/a.toml", Arc::new(b"x = 1\n".to_vec()), 0o644).unwrap();
        s.add_symlink("/opt/engine/latest", "recipes").unwrap();
        s.add_file(&format!("/opt/{}", "long/".repeat(40) + "file"), Arc::new(vec![7; 3000]), 0o600).unwrap();
        s
    }

    #[test]
    fn tar_is_sorted_with_fixed_metadata() {
        let tar = sample().tar(1_700_000_000).unwrap();
        let mut a = tar::Archive::new(tar.as_slice());
        let mut paths = Vec::new();
        for e in a.entries().unwrap() {
            let e = e.unwrap();
            let h = e.header();
            assert_eq!(h.uid().unwrap(), 0);
            assert_eq!(h.gid().unwrap(), 0);
            assert_eq!(h.mtime().unwrap(), 1_700_000_000);
            assert!(h.username().unwrap().unwrap_or("").is_empty());
            assert!(!e.path_bytes().is_empty());
            paths.push(e.path().unwrap().to_string_lossy().trim_end_matches('/').to_string());
        }
        let mut sorted = paths.clone();
        sorted.sort();
        assert_eq!(paths, sorted);
        assert_eq!(paths[0], "opt");
        assert!(paths.contains(&"usr/local/bin".to_string()));
        assert!(paths.iter().any(|p| p.len() > 100), "long names survive");
    }

    #[test]
    fn same_entries_same_digest_and_epoch_matters() {
        let (a, ga) = sample().build(1).unwrap();
        let (b, gb) = sample().build(1).unwrap();
        assert_eq!(a.digest, b.digest);
        assert_eq!(ga, gb);
        let (c, _) = sample().build(2).unwrap();
        assert_ne!(a.digest, c.digest);
        assert_eq!(sample().cache_key(1), sample().cache_key(1));
        assert_ne!(sample().cache_key(1), sample().cache_key(2));
    }

    #[test]
    fn modes_are_fixed_not_inherited() {
        let tar = sample().tar(0).unwrap();
        let mut a = tar::Archive::new(tar.as_slice());
        for e in a.entries().unwrap() {
            let e = e.unwrap();
            let mode = e.header().mode().unwrap();
            match e.header().entry_type() {
                tar::EntryType::Directory => assert_eq!(mode, 0o755),
                tar::EntryType::Symlink => assert_eq!(mode, 0o777),
                _ => assert!(mode == 0o755 || mode == 0o644 || mode == 0o600),
            }
        }
    }

    #[test]
    fn gzip_header_is_fixed() {
        let gz = gzip(b"hello").unwrap();
        // magic, CM=deflate, FLG=0 (no name/comment/extra), MTIME=0, XFL, OS=255.
        assert_eq!(&gz[..4], &[0x1f, 0x8b, 8, 0]);
        assert_eq!(&gz[4..8], &[0, 0, 0, 0]);
        assert_eq!(gz[9], 255);
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(gz.as_slice()).read_to_end(&mut out).unwrap();
        assert_eq!(out, b"hello");
    }

    #[test]
    fn gzip_backend_is_pinned() {
        // A golden digest: if a dependency switches flate2 to a C zlib, or miniz_oxide changes
        // its output, every layer digest changes; this test says so first.
        let data: Vec<u8> =
            (0..100_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8 ^ (i % 7) as u8).collect();
        let gz = gzip(&data).unwrap();
        assert_eq!(Digest::of(&gz).as_str(), GOLDEN);
    }
    const GOLDEN: &str = "sha256:93856309683988365c954a3400e5e59f9c9858c40506b75289f0124fabae8000";

    #[test]
    fn a_layer_is_built_once_and_then_read_from_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = BlobStore::new(dir.path().join("store"));
        let built = cached_layer(&sample(), 1, dir.path(), &store).unwrap();
        assert_eq!(store.size(&built.digest), Some(built.size));
        let record = dir.path().join("layers").join(format!("{}.json", sample().cache_key(1)));
        let again = Layer::cached(&record, &store).unwrap();
        assert_eq!((&again.digest, &again.diff_id, again.size), (&built.digest, &built.diff_id, built.size));

        // The record, not a rebuild, answers: one naming another stored blob is believed.
        let other = store.put(b"other").unwrap();
        let fake = Layer { digest: other.clone(), diff_id: built.diff_id.clone(), size: 5 };
        fake.record(&record).unwrap();
        assert_eq!(cached_layer(&sample(), 1, dir.path(), &store).unwrap().digest, other);

        // A record whose blob is gone or of another size, or that does not parse, is rebuilt.
        for bad in [
            Layer { digest: other.clone(), diff_id: built.diff_id.clone(), size: 6 },
            Layer { digest: Digest::of(b"gone"), diff_id: built.diff_id.clone(), size: 4 },
        ] {
            bad.record(&record).unwrap();
            assert_eq!(cached_layer(&sample(), 1, dir.path(), &store).unwrap().digest, built.digest);
        }
        std::fs::write(&record, br#"{"digest": "sha256:nothex", "diff_id": 1, "size": "x"}"#).unwrap();
        assert_eq!(cached_layer(&sample(), 1, dir.path(), &store).unwrap().digest, built.digest);
        assert!(Layer::cached(&record, &store).is_some(), "the rebuild wrote its record again");
    }

    #[test]
    fn bad_paths_are_refused() {
        let mut s = LayerSpec::new();
        assert!(s.add_file("relative", Arc::new(vec![]), 0o644).is_err());
        assert!(s.add_file("/a/../b", Arc::new(vec![]), 0o644).is_err());
        s.add_file("/a/b", Arc::new(vec![]), 0o644).unwrap();
        assert!(s.add_file("/a/b", Arc::new(vec![1]), 0o644).is_err());
        assert!(s.add_file("/a", Arc::new(vec![]), 0o644).is_err(), "a file over a directory");
    }
}
