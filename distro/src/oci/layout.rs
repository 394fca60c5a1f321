//! OCI image layouts on disk (`oci-layout`, `index.json`, `blobs/sha256/`).
//!
//! Writing is crash-safe: blobs are content-addressed and land by rename, and `index.json`, the
//! only file that makes anything reachable, is replaced atomically last. A layout interrupted
//! half-way still shows the refs it had before.
use super::digest::Digest;
use super::json::canonical;
use super::manifest::{Descriptor, OCI_INDEX, is_index};
use super::store::BlobStore;
use crate::error::bad_input;
use crate::fsutil::write_atomic;
use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The annotation naming a ref in `index.json`.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// The most of `index.json` that is read.
const INDEX_JSON_LIMIT: u64 = 64 << 20;

const OCI_LAYOUT: &[u8] = br#"{"imageLayoutVersion":"1.0.0"}"#;

/// An OCI layout directory.
pub struct Layout {
    /// The layout's directory (holding `oci-layout`, `index.json` and `blobs/`).
    pub dir: PathBuf,
    /// The layout's `blobs/sha256/` directory as a blob store.
    pub store: BlobStore,
}

impl Layout {
    /// A layout at `dir` (created on write).
    pub fn new(dir: impl Into<PathBuf>) -> Layout {
        let dir = dir.into();
        Layout { store: BlobStore::new(&dir), dir }
    }

    /// Opens an existing layout, checking its `oci-layout` marker.
    pub fn open(dir: &Path) -> Result<Layout> {
        let marker = fs::read(dir.join("oci-layout"))
            .map_err(|e| bad_input(format!("{}: not an OCI image layout ({e})", dir.display())))?;
        let v: Value =
            serde_json::from_slice(&marker).map_err(|e| bad_input(format!("{}/oci-layout: {e}", dir.display())))?;
        if v["imageLayoutVersion"] != "1.0.0" {
            return Err(bad_input(format!(
                "{}/oci-layout: unsupported imageLayoutVersion {}",
                dir.display(),
                v["imageLayoutVersion"]
            )));
        }
        Ok(Layout::new(dir))
    }

    /// The refs in `index.json`: (ref name, descriptor), in file order; unnamed entries get "".
    pub fn refs(&self) -> Result<Vec<(String, Descriptor)>> {
        let path = self.dir.join("index.json");
        // index.json has no descriptor: read at most 64 MiB of it (a link to a device must not
        // be read forever).
        let text = match fs::File::open(&path).and_then(|f| {
            use std::io::Read;
            let mut t = Vec::new();
            f.take(INDEX_JSON_LIMIT + 1).read_to_end(&mut t).map(|_| t)
        }) {
            Ok(t) if t.len() as u64 > INDEX_JSON_LIMIT => {
                return Err(bad_input(format!(
                    "{}: larger than {INDEX_JSON_LIMIT} bytes; not an index",
                    path.display()
                )));
            }
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let v: Value = serde_json::from_slice(&text).map_err(|e| bad_input(format!("{}: {e}", path.display())))?;
        let mut out = Vec::new();
        for m in
            v["manifests"].as_array().ok_or_else(|| bad_input(format!("{}: no manifests array", path.display())))?
        {
            let d: Descriptor =
                serde_json::from_value(m.clone()).map_err(|e| bad_input(format!("{}: {e}", path.display())))?;
            let name = d.annotations.as_ref().and_then(|a| a.get(REF_NAME)).cloned().unwrap_or_default();
            out.push((name, d));
        }
        Ok(out)
    }

    /// Adds `blobs` (from `from`) and sets `refs` (replacing same-named ones, keeping others),
    /// then removes blobs nothing references any more and the temporary files of writers that
    /// were killed. The caller must hold the layout's lock (`fsutil::DirLock`, as `distro build`
    /// does): two writers would remove each other's new blobs and temporaries.
    pub fn write(&self, from: &BlobStore, blobs: &[Digest], refs: &[(String, Descriptor)]) -> Result<()> {
        fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        if fs::read(self.dir.join("oci-layout")).ok().as_deref() != Some(OCI_LAYOUT) {
            write_atomic(&self.dir.join("oci-layout"), OCI_LAYOUT)?;
        }
        for d in blobs {
            if !from.has(d) {
                bail!("blob {d} is missing from {}", from.root().display());
            }
            self.store.link_from(from, d)?;
        }
        let ours: BTreeSet<&str> = refs.iter().map(|(n, _)| n.as_str()).collect();
        let mut entries: Vec<(String, Descriptor)> =
            self.refs()?.into_iter().filter(|(n, _)| !ours.contains(n.as_str())).collect();
        for (name, d) in refs {
            let mut d = d.clone();
            let mut ann = d.annotations.take().unwrap_or_default();
            ann.insert(REF_NAME.to_string(), name.clone());
            d.annotations = Some(ann);
            entries.push((name.clone(), d));
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let index = json!({
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": entries.iter().map(|(_, d)| d).collect::<Vec<_>>(),
        });
        let bytes = canonical(&index);
        if fs::read(self.dir.join("index.json")).ok().as_deref() != Some(bytes.as_slice()) {
            write_atomic(&self.dir.join("index.json"), &bytes)?;
        }
        self.collect_garbage()
    }

    /// Every blob reachable from `root` (itself included): index -> manifests -> config, layers.
    pub fn reachable(&self, root: &Descriptor) -> Result<Vec<Descriptor>> {
        let mut out = Vec::new();
        let mut seen = BTreeSet::new();
        let mut todo = vec![root.clone()];
        while let Some(d) = todo.pop() {
            if !seen.insert(d.digest.clone()) {
                continue;
            }
            if d.media_type.ends_with("+json") && (is_index(&d.media_type) || d.media_type.contains("manifest")) {
                let v: Value = serde_json::from_slice(&self.store.read_document(&d.digest, d.size)?)
                    .with_context(|| format!("{} in {}", d.digest, self.dir.display()))?;
                let children =
                    v["manifests"].as_array().into_iter().flatten().chain(v["layers"].as_array().into_iter().flatten());
                for c in children.chain(v.get("config")) {
                    todo.push(
                        serde_json::from_value(c.clone()).map_err(|e| anyhow!("{}: bad descriptor: {e}", d.digest))?,
                    );
                }
            }
            out.push(d);
        }
        Ok(out)
    }

    fn collect_garbage(&self) -> Result<()> {
        let mut live = BTreeSet::new();
        for (_, d) in self.refs()? {
            for r in self.reachable(&d)? {
                live.insert(r.digest);
            }
        }
        for d in self.store.list()? {
            if !live.contains(&d) {
                fs::remove_file(self.store.path(&d)).with_context(|| format!("removing unreferenced blob {d}"))?;
            }
        }
        // Under the lock, a temporary file (a blob's `.HEX.tmp-PID-N`, `index.json`'s
        // `.distro-*.tmp`) can only be what a killed writer left.
        for dir in [self.dir.join("blobs/sha256"), self.dir.clone()] {
            let Ok(entries) = fs::read_dir(&dir) else { continue };
            for e in entries.filter_map(|e| e.ok()) {
                let name = e.file_name().to_string_lossy().into_owned();
                let temporary = name.starts_with('.') && (name.contains(".tmp-") || name.ends_with(".tmp"));
                if temporary && e.file_type().is_ok_and(|t| t.is_file()) {
                    fs::remove_file(e.path())
                        .with_context(|| format!("removing {}, left by a killed write", e.path().display()))?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::manifest::{OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, image_manifest};
    use std::collections::BTreeMap;

    #[test]
    fn write_replace_and_collect() {
        let src = tempfile::tempdir().unwrap();
        let store = BlobStore::new(src.path());
        let mk = |content: &[u8]| {
            let layer = store.put(content).unwrap();
            let cfg = store.put(b"{}").unwrap();
            let cfg_d = Descriptor {
                media_type: OCI_CONFIG.into(),
                digest: cfg.clone(),
                size: 2,
                platform: None,
                annotations: None,
            };
            let l_d = Descriptor {
                media_type: OCI_LAYER_GZIP.into(),
                digest: layer.clone(),
                size: content.len() as u64,
                platform: None,
                annotations: None,
            };
            let m = image_manifest(&cfg_d, &[l_d], &BTreeMap::new()).unwrap();
            let md = store.put(&m).unwrap();
            (
                vec![layer, cfg, md.clone()],
                Descriptor {
                    media_type: OCI_MANIFEST.into(),
                    digest: md,
                    size: m.len() as u64,
                    platform: None,
                    annotations: None,
                },
            )
        };
        let out = tempfile::tempdir().unwrap();
        let layout = Layout::new(out.path().join("oci"));
        let (blobs1, d1) = mk(b"one");
        layout.write(&store, &blobs1, &[("a".into(), d1.clone()), ("b".into(), d1.clone())]).unwrap();
        let refs = Layout::open(&layout.dir).unwrap().refs().unwrap();
        assert_eq!(refs.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        // Re-pointing "a" keeps "b"; nothing is collected while "b" still needs it.
        let (blobs2, d2) = mk(b"two");
        layout.write(&store, &blobs2, &[("a".into(), d2.clone())]).unwrap();
        assert_eq!(layout.store.list().unwrap().len(), 5);
        // Re-pointing "b" too drops the first image's unique blobs.
        layout.write(&store, &blobs2, &[("b".into(), d2)]).unwrap();
        assert_eq!(layout.store.list().unwrap().len(), 3);
        assert!(!layout.store.has(&blobs1[0]));
        assert!(Layout::open(&out.path().join("nope")).is_err());
        // What killed writes leave is removed by the next write; the lock file stays.
        let leftovers = [
            layout.dir.join("blobs/sha256").join(format!(".{}.tmp-99-0", blobs1[0].hex())),
            layout.dir.join(".distro-AbC123.tmp"),
        ];
        for f in &leftovers {
            fs::write(f, b"partial").unwrap();
        }
        fs::write(layout.dir.join(".lock"), b"1\n").unwrap();
        layout.write(&store, &blobs2, &[]).unwrap();
        assert!(leftovers.iter().all(|f| !f.exists()) && layout.dir.join(".lock").exists());
        assert_eq!(layout.store.list().unwrap().len(), 3);
    }
}
