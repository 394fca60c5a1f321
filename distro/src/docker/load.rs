//! Loading images into the Docker engine. The load tar is an OCI layout for one platform plus
//! Docker's `manifest.json`: Docker 25 and later read the layout, older daemons (Debian
//! bookworm ships 20.10) read `manifest.json`, whose `Layers` point at the gzipped layer blobs
//! (those daemons decompress while loading). The tar is streamed to the engine as it is written.
use super::{connect, daemon_platform, runtime};
use crate::error::bad_input;
use crate::oci::bundle::Bundle;
use crate::oci::digest::Digest;
use crate::oci::json::canonical;
use crate::oci::layout::REF_NAME;
use crate::oci::manifest::{Descriptor, OCI_INDEX, is_index};
use crate::oci::platform::Platform;
use crate::oci::store::BlobStore;
use crate::registry::reference::Reference;
use anyhow::{Context, Result, anyhow};
use bollard::query_parameters::ImportImageOptionsBuilder;
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// One image to put in a load tar: its platform manifest and the tags it gets.
#[derive(Clone, Debug)]
pub struct LoadImage {
    /// The platform's image manifest (from the ref's index, or the ref itself).
    pub manifest: Descriptor,
    /// `repo:tag` names.
    pub repo_tags: Vec<String>,
}

/// Picks, from `bundle`, the images to load: for each selected ref (all when `refs` is empty),
/// the manifest for `platform`, tagged `repo:REF`.
pub fn select(bundle: &Bundle, refs: &[String], platform: &Platform, repo: &str) -> Result<Vec<LoadImage>> {
    let all = &bundle.refs;
    if all.is_empty() {
        return Err(bad_input(format!("{}: the layout has no refs", bundle.name)));
    }
    for r in refs {
        if !all.iter().any(|(n, _)| n == r) {
            let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
            return Err(bad_input(format!("{}: no ref {r:?} (refs: {})", bundle.name, names.join(", "))));
        }
    }
    let mut by_manifest: BTreeMap<Digest, LoadImage> = BTreeMap::new();
    for (name, d) in all.iter().filter(|(n, _)| refs.is_empty() || refs.contains(n)) {
        let manifest = if is_index(&d.media_type) {
            let v: Value = serde_json::from_slice(&bundle.store.read(&d.digest)?)?;
            let entry = v["manifests"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|m| m.get("platform").is_some_and(|p| platform.matches(p)))
                .ok_or_else(|| bad_input(format!("ref {name:?} has no {platform} image")))?;
            let mut m: Descriptor = serde_json::from_value(entry.clone())?;
            m.platform = None;
            m
        } else {
            d.clone()
        };
        let tag = if name.is_empty() { "latest" } else { name };
        let r = Reference::parse(&format!("{repo}:{tag}"))?;
        // Docker names Docker Hub images without the registry.
        let display = if r.registry == "docker.io" {
            format!("{}:{tag}", r.repository.strip_prefix("library/").unwrap_or(&r.repository))
        } else {
            format!("{}:{tag}", r.name())
        };
        by_manifest
            .entry(manifest.digest.clone())
            .or_insert_with(|| LoadImage { manifest: Descriptor { annotations: None, ..manifest }, repo_tags: vec![] })
            .repo_tags
            .push(display);
    }
    Ok(by_manifest.into_values().collect())
}

/// Writes the load tar for `images` (blobs from `store`) to `out`.
pub fn write_load_tar(store: &BlobStore, images: &[LoadImage], out: impl Write) -> Result<()> {
    let mut entries: BTreeMap<String, TarSource> = BTreeMap::new();
    let mut docker_manifest = Vec::new();
    let mut index_entries = Vec::new();
    for img in images {
        let m: Value = serde_json::from_slice(&store.read(&img.manifest.digest)?)?;
        let config: Descriptor = serde_json::from_value(m["config"].clone())?;
        let layers: Vec<Descriptor> = serde_json::from_value(m["layers"].clone())?;
        let blob = |d: &Digest| format!("blobs/sha256/{}", d.hex());
        for d in std::iter::once(&img.manifest.digest)
            .chain(std::iter::once(&config.digest))
            .chain(layers.iter().map(|l| &l.digest))
        {
            entries.insert(blob(d), TarSource::File(store.path(d)));
        }
        docker_manifest.push(json!({
            "Config": blob(&config.digest),
            "RepoTags": img.repo_tags,
            "Layers": layers.iter().map(|l| blob(&l.digest)).collect::<Vec<_>>(),
        }));
        for t in &img.repo_tags {
            let tag = t.rsplit_once(':').map(|(_, t)| t).unwrap_or(t);
            let mut d = img.manifest.clone();
            d.annotations = Some(BTreeMap::from([
                ("io.containerd.image.name".to_string(), t.clone()),
                (REF_NAME.to_string(), tag.to_string()),
            ]));
            index_entries.push(d);
        }
    }
    entries.insert("manifest.json".into(), TarSource::Bytes(canonical(&json!(docker_manifest))));
    entries.insert(
        "index.json".into(),
        TarSource::Bytes(canonical(&json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": index_entries}))),
    );
    entries.insert("oci-layout".into(), TarSource::Bytes(br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()));
    let mut b = tar::Builder::new(out);
    let mut dirs = vec!["blobs/".to_string(), "blobs/sha256/".to_string()];
    dirs.retain(|_| entries.keys().any(|k| k.starts_with("blobs/")));
    for d in dirs {
        let mut h = header(tar::EntryType::Directory, 0, 0o755);
        b.append_data(&mut h, d, std::io::empty())?;
    }
    for (name, src) in entries {
        match src {
            TarSource::Bytes(bytes) => {
                let mut h = header(tar::EntryType::Regular, bytes.len() as u64, 0o644);
                b.append_data(&mut h, &name, bytes.as_slice())?;
            }
            TarSource::File(path) => {
                let f = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
                let mut h = header(tar::EntryType::Regular, f.metadata()?.len(), 0o644);
                b.append_data(&mut h, &name, f)?;
            }
        }
    }
    b.into_inner()?.flush()?;
    Ok(())
}

enum TarSource {
    Bytes(Vec<u8>),
    File(std::path::PathBuf),
}

fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

/// What a load did: the images (with their `repo:tag` names) and what the engine said.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The platform whose images were loaded.
    pub platform: Platform,
    /// The images loaded (or written to the tar).
    pub images: Vec<LoadImage>,
    /// The engine's messages (none for a tar).
    pub messages: Vec<String>,
}

/// Imports images of `bundle` into the Docker engine (or writes the tar to `output`): one
/// platform's manifest per selected ref (all when `refs` is empty).
pub fn load(
    bundle: &Bundle,
    refs: &[String],
    platform: Option<&Platform>,
    repo: &str,
    output: Option<&Path>,
) -> Result<Loaded> {
    if let Some(out) = output {
        let p = platform.cloned().or_else(Platform::host).ok_or_else(|| anyhow!("pass --platform"))?;
        let images = select(bundle, refs, &p, repo)?;
        let tmp = crate::fsutil::temp_beside(out);
        let f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let res = write_load_tar(&bundle.store, &images, std::io::BufWriter::new(f))
            .and_then(|_| crate::fsutil::commit_temp(&tmp, out));
        if res.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        res?;
        return Ok(Loaded { platform: p, images, messages: Vec::new() });
    }
    runtime()?.block_on(async {
        let docker = connect().await?;
        let p = match platform {
            Some(p) => p.clone(),
            None => daemon_platform(&docker).await?,
        };
        let images = select(bundle, refs, &p, repo)?;
        // Stream the tar through a pipe: a writer thread produces it while the request sends it.
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<bytes_chunk::Chunk>>(8);
        let writer_store = bundle.store.clone();
        let writer_images = images.clone();
        let writer = std::thread::spawn(move || -> Result<()> {
            let sink = bytes_chunk::ChannelWriter::new(tx);
            write_load_tar(&writer_store, &writer_images, sink)
        });
        let body = bollard::body_try_stream(tokio_stream_from(rx));
        let mut stream = docker.import_image(ImportImageOptionsBuilder::default().quiet(true).build(), body, None);
        let mut messages = Vec::new();
        while let Some(item) = stream.next().await {
            let info = item.context("docker load")?;
            if let Some(s) = info.stream {
                messages.push(s.trim().to_string());
            }
        }
        writer.join().map_err(|_| anyhow!("the tar writer panicked"))??;
        Ok(Loaded { platform: p, images, messages })
    })
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<std::io::Result<bytes_chunk::Chunk>>,
) -> impl futures_util::Stream<Item = std::io::Result<bytes_chunk::Chunk>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

mod bytes_chunk {
    //! A blocking `Write` that feeds an async channel, so a tar written on a thread streams
    //! into the Docker request without landing on disk.
    pub type Chunk = bytes::Bytes;
    pub struct ChannelWriter {
        tx: tokio::sync::mpsc::Sender<std::io::Result<Chunk>>,
        buf: Vec<u8>,
    }
    impl ChannelWriter {
        pub fn new(tx: tokio::sync::mpsc::Sender<std::io::Result<Chunk>>) -> Self {
            ChannelWriter { tx, buf: Vec::with_capacity(1 << 20) }
        }
        fn send(&mut self) -> std::io::Result<()> {
            if self.buf.is_empty() {
                return Ok(());
            }
            let chunk = Chunk::from(std::mem::replace(&mut self.buf, Vec::with_capacity(1 << 20)));
            self.tx.blocking_send(Ok(chunk)).map_err(|_| std::io::Error::other("docker closed the load request"))
        }
    }
    impl std::io::Write for ChannelWriter {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.buf.extend_from_slice(data);
            if self.buf.len() >= 1 << 20 {
                self.send()?;
            }
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.send()
        }
    }
    impl Drop for ChannelWriter {
        fn drop(&mut self) {
            let _ = self.send();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::fixture::arm64_layout;

    #[test]
    fn load_tar_has_layout_and_docker_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let f = arm64_layout(dir.path());
        let (layout, config, layer, md) = (&f.layout, &f.config, &f.layer, &f.manifest);
        let arm = Platform::parse("linux/arm64").unwrap();
        let bundle = Bundle::from_layout(layout, layout.refs().unwrap()).unwrap();
        let images = select(&bundle, &[], &arm, "localhost:5000/distro").unwrap();
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].repo_tags, ["localhost:5000/distro:engine"]);
        assert!(select(&bundle, &[], &Platform::parse("linux/amd64").unwrap(), "distro").is_err());
        assert!(select(&bundle, &["nope".into()], &arm, "distro").is_err());

        let mut tar_bytes = Vec::new();
        write_load_tar(&bundle.store, &select(&bundle, &[], &arm, "distro").unwrap(), &mut tar_bytes).unwrap();
        let mut a = tar::Archive::new(tar_bytes.as_slice());
        let mut files = BTreeMap::new();
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let name = e.path().unwrap().to_string_lossy().into_owned();
            let mut body = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut body).unwrap();
            files.insert(name, body);
        }
        let dm: Value = serde_json::from_slice(&files["manifest.json"]).unwrap();
        assert_eq!(dm[0]["RepoTags"], json!(["distro:engine"]));
        assert_eq!(dm[0]["Config"], format!("blobs/sha256/{}", config.hex()));
        assert_eq!(dm[0]["Layers"], json!([format!("blobs/sha256/{}", layer.hex())]));
        let index: Value = serde_json::from_slice(&files["index.json"]).unwrap();
        assert_eq!(index["manifests"][0]["digest"], md.digest.as_str());
        assert_eq!(index["manifests"][0]["annotations"]["io.containerd.image.name"], "distro:engine");
        assert!(files.contains_key("oci-layout"));
        assert_eq!(files[&format!("blobs/sha256/{}", layer.hex())], b"layer");
    }
}
