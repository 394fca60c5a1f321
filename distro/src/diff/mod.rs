//! `distro diff OLD NEW`: what changed between two images this tool built, read from the images
//! themselves (an OCI layout or a registry reference each): the upstream sources and patches
//! (their `/opt/distro/manifest.lock`), the base (the index's base annotations and, from each
//! SBOM, the base's Debian packages), the baked environment, the sizes per platform and per
//! layer, and the engine's revision. Nothing is rebuilt; only the `/opt/distro` layer of each
//! platform is downloaded.
use crate::error::bad_input;
use crate::image::build::{GROUP_BASE, LAYER_GROUP_ANNOTATION};
use crate::oci::digest::Digest;
use crate::oci::layer_files::{self, MAX_OPT_DISTRO_INFLATED};
use crate::oci::layout::Layout;
use crate::oci::manifest::{Descriptor, ImageParts, is_index};
use crate::oci::store::BlobStore;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use crate::sources::{Lock, Origin};
use anyhow::{Context, Result, anyhow};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

/// Where an image is read from.
pub enum Source<'a> {
    /// An OCI layout, and the ref in it.
    Layout(Layout, Descriptor),
    /// A registry reference.
    Registry(&'a Client, Reference, BlobStore),
}

impl<'a> Source<'a> {
    /// `DIR` or `DIR:REF` (an OCI layout: its only index, or the ref named) when that directory
    /// exists, else a registry reference. `scratch` holds the blobs pulled from a registry.
    pub fn open(arg: &str, client: &'a Client, scratch: &Path) -> Result<Source<'a>> {
        let (dir, want) = match arg.rsplit_once(':') {
            Some((d, r)) if Path::new(d).join("oci-layout").is_file() => (d, Some(r)),
            _ => (arg, None),
        };
        if Path::new(dir).join("oci-layout").is_file() {
            let layout = Layout::open(Path::new(dir))?;
            let refs = layout.refs()?;
            let names: Vec<&str> = refs.iter().map(|(n, _)| n.as_str()).collect();
            let pick = match want {
                Some(w) => refs.iter().find(|(n, _)| n == w),
                None => refs.iter().find(|(_, d)| is_index(&d.media_type)).or(refs.first()),
            };
            let (_, d) = pick.ok_or_else(|| {
                bad_input(format!("{dir}: no ref {} (refs: {})", want.unwrap_or("with an index"), names.join(", ")))
            })?;
            let d = d.clone();
            return Ok(Source::Layout(layout, d));
        }
        let r = Reference::parse(arg)
            .map_err(|e| bad_input(format!("{arg}: neither an OCI layout directory nor an image reference ({e:#})")))?;
        Ok(Source::Registry(client, r, BlobStore::new(scratch)))
    }

    /// The image, in words: `DIR@DIGEST` or the registry reference.
    fn name(&self) -> String {
        match self {
            Source::Layout(l, d) => format!("{}@{}", l.dir.display(), d.digest),
            Source::Registry(_, r, _) => r.to_string(),
        }
    }

    fn root(&self) -> Result<(Vec<u8>, Digest)> {
        match self {
            Source::Layout(l, d) => Ok((l.store.read_document(&d.digest, d.size)?, d.digest.clone())),
            Source::Registry(c, r, _) => {
                let f = c.fetch_manifest(r)?;
                Ok((f.bytes, f.digest))
            }
        }
    }

    fn manifest(&self, d: &Descriptor) -> Result<Vec<u8>> {
        match self {
            Source::Layout(l, _) => l.store.read_document(&d.digest, d.size),
            Source::Registry(c, r, _) => Ok(c.fetch_manifest(&r.with_digest(&d.digest))?.bytes),
        }
    }

    fn blob_path(&self, d: &Descriptor) -> Result<std::path::PathBuf> {
        match self {
            Source::Layout(l, _) => Ok(l.store.path(&d.digest)),
            Source::Registry(c, r, store) => {
                if !store.has(&d.digest) {
                    c.fetch_blob(r, &d.digest, Some(d.size), store)?;
                }
                Ok(store.path(&d.digest))
            }
        }
    }
}

/// What one image says about itself.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Facts {
    /// The index (or manifest) digest.
    pub digest: String,
    /// The index's annotations (revision, version, base name and digest).
    pub annotations: BTreeMap<String, String>,
    /// Per platform (`linux/amd64`).
    pub platforms: BTreeMap<String, PlatformFacts>,
    /// The manifest lock the image was built with (`/opt/distro/manifest.lock`).
    #[serde(skip)]
    pub lock: Option<Lock>,
}

/// One platform of an image.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PlatformFacts {
    /// The platform manifest's digest.
    pub manifest: String,
    /// The config's environment.
    pub env: BTreeMap<String, String>,
    /// Layers: digest, compressed size, and what made them (the config's history).
    pub layers: Vec<LayerFacts>,
    /// Debian packages of the base (name -> version), from the SBOM.
    pub packages: BTreeMap<String, String>,
}

/// One layer.
#[derive(Clone, Debug, Serialize)]
pub struct LayerFacts {
    /// Its digest.
    pub digest: String,
    /// Its compressed size.
    pub size: u64,
    /// The history's `created_by` (ours start with `distro build:`).
    pub created_by: String,
    /// Its group: the manifest's [`LAYER_GROUP_ANNOTATION`] of it, `base` without one.
    pub group: String,
}

/// Reads the facts of the image at `source`.
pub fn read(source: &Source) -> Result<Facts> {
    let (bytes, digest) = source.root()?;
    let top: Value = serde_json::from_slice(&bytes).context("the image's index is not JSON")?;
    let mut facts = Facts { digest: digest.to_string(), ..Facts::default() };
    facts.annotations = string_map(&top["annotations"]);
    let children: Vec<(String, Descriptor)> = match top["manifests"].as_array() {
        Some(list) => list
            .iter()
            .filter_map(|m| serde_json::from_value::<Descriptor>(m.clone()).ok())
            .filter_map(|d| {
                let p = d.platform.as_ref()?;
                let name = format!("{}/{}", p["os"].as_str()?, p["architecture"].as_str()?);
                let name = match p["variant"].as_str() {
                    Some(v) => format!("{name}/{v}"),
                    None => name,
                };
                Some((name, d))
            })
            .collect(),
        None => vec![("image".into(), Descriptor::of(crate::oci::manifest::OCI_MANIFEST, &bytes))],
    };
    for (platform, d) in children {
        let mbytes = if d.digest == digest { bytes.clone() } else { source.manifest(&d)? };
        let parts = ImageParts::parse(&mbytes).with_context(|| format!("{platform}: manifest {}", d.digest))?;
        let config: Value = serde_json::from_slice(&read_config(source, &parts.config)?)?;
        let env = config["config"]["Env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e.as_str()?.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
            .collect();
        let history: Vec<String> = config["history"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|h| h["empty_layer"] != true)
            .map(|h| h["created_by"].as_str().unwrap_or("").to_owned())
            .collect();
        // ImageParts leaves out the descriptors' annotations; the groups are read from the JSON.
        let raw: Value = serde_json::from_slice(&mbytes)?;
        let layers: Vec<LayerFacts> = parts
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| LayerFacts {
                digest: l.digest.to_string(),
                size: l.size,
                created_by: history.get(i).cloned().unwrap_or_default(),
                group: raw["layers"][i]["annotations"][LAYER_GROUP_ANNOTATION]
                    .as_str()
                    .unwrap_or(GROUP_BASE)
                    .to_owned(),
            })
            .collect();
        // The /opt/distro layer is the last one this tool adds.
        let mut packages = BTreeMap::new();
        if let Some(last) = parts.layers.last() {
            let what = format!("{}: {platform}'s /opt/distro layer {}", source.name(), last.digest);
            let files = opt_distro(&source.blob_path(last)?, &what)?;
            if facts.lock.is_none()
                && let Some(text) = files.get("manifest.lock")
            {
                facts.lock = Some(Lock::parse(text).context("/opt/distro/manifest.lock")?);
            }
            if let Some(sbom) = files.get("sbom.spdx.json") {
                packages = deb_packages(sbom);
            }
        }
        facts.platforms.insert(platform, PlatformFacts { manifest: d.digest.to_string(), env, layers, packages });
    }
    Ok(facts)
}

/// A config blob: its size is checked against the cap before it is read or downloaded.
fn read_config(source: &Source, d: &Descriptor) -> Result<Vec<u8>> {
    crate::oci::store::check_document_size(&d.digest, d.size)?;
    let path = source.blob_path(d)?;
    let file = std::fs::File::open(&path)?;
    let mut bytes = Vec::new();
    file.take(d.size + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 != d.size || Digest::of(&bytes) != d.digest {
        return Err(bad_input(format!("blob {} is corrupt", d.digest)));
    }
    Ok(bytes)
}

/// The text files under `opt/distro/` of a gzip layer (a layer without them gives none), read
/// within [`MAX_OPT_DISTRO_INFLATED`]; `what` names the layer in the error.
fn opt_distro(layer: &Path, what: &str) -> Result<BTreeMap<String, String>> {
    let wanted = ["opt/distro/manifest.lock", "opt/distro/sbom.spdx.json"];
    let files = layer_files::files(layer, &wanted, MAX_OPT_DISTRO_INFLATED, what)?;
    files
        .into_iter()
        .map(|(path, bytes)| {
            let name = path.trim_start_matches("opt/distro/").to_owned();
            let text = String::from_utf8(bytes).map_err(|_| bad_input(format!("{what}: its {path} is not UTF-8")))?;
            Ok((name, text))
        })
        .collect()
}

/// The Debian packages an SBOM lists (those with a `pkg:deb/` purl), by name. Only the fields
/// used are kept: the rest of the document is skipped as it is parsed, not built into a tree.
fn deb_packages(sbom: &str) -> BTreeMap<String, String> {
    #[derive(serde::Deserialize)]
    struct Sbom {
        #[serde(default)]
        packages: Vec<Package>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Package {
        name: Option<String>,
        version_info: Option<String>,
        #[serde(default)]
        external_refs: Vec<ExternalRef>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct ExternalRef {
        reference_locator: Option<String>,
    }
    let Ok(sbom) = serde_json::from_str::<Sbom>(sbom) else { return BTreeMap::new() };
    sbom.packages
        .into_iter()
        .filter(|p| {
            p.external_refs.iter().any(|r| r.reference_locator.as_deref().is_some_and(|l| l.starts_with("pkg:deb/")))
        })
        .filter_map(|p| Some((p.name?, p.version_info?)))
        .collect()
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object().into_iter().flatten().filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned()))).collect()
}

/// One value that changed (or appeared, or went).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Change {
    /// What changed.
    pub name: String,
    /// Before (`None`: added).
    pub old: Option<String>,
    /// After (`None`: removed).
    pub new: Option<String>,
}

/// The differences between two images.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Diff {
    /// The two images' digests.
    pub digest: Vec<Change>,
    /// The engine's revision (`org.opencontainers.image.revision`).
    pub revision: Vec<Change>,
    /// Upstream sources: their pins (crate versions, git commits).
    pub sources: Vec<Change>,
    /// Patches carried, per source (`SOURCE ENTRY`, by content).
    pub patches: Vec<Change>,
    /// The base: its name and digest, and its tracked base entries.
    pub base: Vec<Change>,
    /// Base packages, per platform (`PLATFORM NAME`).
    pub packages: Vec<Change>,
    /// Environment and flags, per platform (`PLATFORM KEY`).
    pub env: Vec<Change>,
    /// Compressed size per platform, and per layer (`PLATFORM #N WHAT`).
    pub sizes: Vec<Change>,
}

fn changes(old: &BTreeMap<String, String>, new: &BTreeMap<String, String>, prefix: &str) -> Vec<Change> {
    let keys: BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    keys.into_iter()
        .filter(|k| old.get(*k) != new.get(*k))
        .map(|k| Change { name: format!("{prefix}{k}"), old: old.get(k).cloned(), new: new.get(k).cloned() })
        .collect()
}

fn pins(lock: Option<&Lock>) -> (BTreeMap<String, String>, BTreeMap<String, String>, BTreeMap<String, String>) {
    let (mut sources, mut patches, mut bases) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for (name, s) in lock.map(|l| &l.sources).into_iter().flatten() {
        let pin = match &s.origin {
            Origin::Git { url, commit, .. } => format!("git {url} {commit}"),
            Origin::Crate { name: c, version, .. } => format!("crate {c} {version}"),
        };
        sources.insert(name.clone(), pin);
        for p in &s.patches {
            patches.insert(format!("{name} {}", p.entry), format!("sha256:{}", p.sha256));
        }
    }
    for (name, b) in lock.map(|l| &l.bases).into_iter().flatten() {
        bases.insert(format!("[bases.{name}]"), format!("{}:{}@{} (since {})", b.image, b.tag, b.digest, b.since));
    }
    (sources, patches, bases)
}

/// Compares two images' facts.
pub fn diff(old: &Facts, new: &Facts) -> Diff {
    let mut d = Diff::default();
    if old.digest != new.digest {
        d.digest.push(Change { name: "index".into(), old: Some(old.digest.clone()), new: Some(new.digest.clone()) });
    }
    let pick = |f: &Facts, keys: &[&str]| -> BTreeMap<String, String> {
        keys.iter().filter_map(|k| f.annotations.get(*k).map(|v| ((*k).to_owned(), v.clone()))).collect()
    };
    d.revision = changes(
        &pick(old, &["org.opencontainers.image.revision", "org.opencontainers.image.version"]),
        &pick(new, &["org.opencontainers.image.revision", "org.opencontainers.image.version"]),
        "",
    );
    let (os, op, ob) = pins(old.lock.as_ref());
    let (ns, np, nb) = pins(new.lock.as_ref());
    d.sources = changes(&os, &ns, "");
    d.patches = changes(&op, &np, "");
    let base_keys = ["org.opencontainers.image.base.name", "org.opencontainers.image.base.digest"];
    d.base = changes(&pick(old, &base_keys), &pick(new, &base_keys), "");
    d.base.extend(changes(&ob, &nb, ""));
    let platforms: BTreeSet<&String> = old.platforms.keys().chain(new.platforms.keys()).collect();
    let empty = PlatformFacts::default();
    for p in platforms {
        let (o, n) = (old.platforms.get(p), new.platforms.get(p));
        if o.is_none() || n.is_none() {
            d.sizes.push(Change {
                name: format!("{p} platform"),
                old: o.map(|_| "present".into()),
                new: n.map(|_| "present".into()),
            });
        }
        let (o, n) = (o.unwrap_or(&empty), n.unwrap_or(&empty));
        d.packages.extend(changes(&o.packages, &n.packages, &format!("{p} ")));
        d.env.extend(changes(&o.env, &n.env, &format!("{p} ")));
        let total = |f: &PlatformFacts| f.layers.iter().map(|l| l.size).sum::<u64>();
        if total(o) != total(n) {
            d.sizes.push(Change {
                name: format!("{p} compressed"),
                old: Some(total(o).to_string()),
                new: Some(total(n).to_string()),
            });
        }
        for i in 0..o.layers.len().max(n.layers.len()) {
            let (ol, nl) = (o.layers.get(i), n.layers.get(i));
            if ol.map(|l| &l.digest) == nl.map(|l| &l.digest) {
                continue;
            }
            let what = nl.or(ol).map(|l| l.created_by.as_str()).unwrap_or("");
            let what =
                if what.starts_with("distro build:") { what.trim_start_matches("distro build: ") } else { "base" };
            let show =
                |l: Option<&LayerFacts>| l.map(|l| format!("{} {}", l.size, &l.digest[..19.min(l.digest.len())]));
            d.sizes.push(Change { name: format!("{p} layer {} ({what})", i + 1), old: show(ol), new: show(nl) });
        }
    }
    d
}

impl Diff {
    /// The diff as text: one section per kind of change, one line per change; `-`/`+`/`~`
    /// for removed, added, changed.
    pub fn text(&self, old: &str, new: &str) -> String {
        let mut out = format!("distro diff {old} {new}\n");
        let sections: [(&str, &Vec<Change>); 8] = [
            ("image", &self.digest),
            ("revision", &self.revision),
            ("sources", &self.sources),
            ("patches", &self.patches),
            ("base", &self.base),
            ("base packages", &self.packages),
            ("environment", &self.env),
            ("sizes (bytes, compressed)", &self.sizes),
        ];
        for (title, list) in sections {
            if list.is_empty() {
                out.push_str(&format!("\n{title}: unchanged\n"));
                continue;
            }
            out.push_str(&format!("\n{title}:\n"));
            for c in list {
                let line = match (&c.old, &c.new) {
                    (None, Some(n)) => format!("  + {} {n}", c.name),
                    (Some(o), None) => format!("  - {} {o}", c.name),
                    (Some(o), Some(n)) => format!("  ~ {}: {o} -> {n}", c.name),
                    (None, None) => continue,
                };
                out.push_str(&line);
                out.push('\n');
            }
        }
        out
    }
}

/// Reads both images and compares them.
pub fn run(old: &Source, new: &Source) -> Result<Diff> {
    let o = read(old).map_err(|e| anyhow!("reading the old image: {e:#}"))?;
    let n = read(new).map_err(|e| anyhow!("reading the new image: {e:#}"))?;
    Ok(diff(&o, &n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_added_removed_and_changed() {
        let a = BTreeMap::from([("A".to_string(), "1".to_string()), ("B".to_string(), "2".to_string())]);
        let b = BTreeMap::from([("B".to_string(), "3".to_string()), ("C".to_string(), "4".to_string())]);
        let c = changes(&a, &b, "x ");
        assert_eq!(c.len(), 3);
        assert_eq!(c[0], Change { name: "x A".into(), old: Some("1".into()), new: None });
        let mut old = Facts::default();
        let mut new = Facts::default();
        old.platforms.insert("linux/amd64".into(), PlatformFacts { env: a, ..Default::default() });
        new.platforms.insert("linux/amd64".into(), PlatformFacts { env: b, ..Default::default() });
        let text = diff(&old, &new).text("OLD", "NEW");
        assert!(
            text.contains("\nenvironment:\n  - linux/amd64 A 1\n  ~ linux/amd64 B: 2 -> 3\n  + linux/amd64 C 4\n"),
            "{text}"
        );
        assert!(text.contains("\nsources: unchanged\n"), "{text}");
    }

    /// A layout whose manifest or config descriptor declares 4,000,000,000 bytes, on a blob
    /// linked to /dev/zero, made `distro diff` read 4 GB into memory before calling it corrupt;
    /// both are refused unread.
    #[test]
    fn huge_manifest_and_config_descriptors_are_refused_unread() {
        use crate::oci::fixture::arm64_layout;
        use crate::oci::manifest::{OCI_INDEX, OCI_MANIFEST, image_index, image_manifest};
        use crate::oci::platform::Platform;
        let dir = tempfile::tempdir().unwrap();
        let f = arm64_layout(dir.path());
        let store = &f.layout.store;
        let huge = |d: &Descriptor| {
            let mut huge = d.clone();
            huge.size = 4_000_000_000;
            std::fs::remove_file(store.path(&d.digest)).unwrap();
            std::os::unix::fs::symlink("/dev/zero", store.path(&d.digest)).unwrap();
            huge
        };
        let arm = Platform::parse("linux/arm64").unwrap();
        let index_of = |manifest: &Descriptor| {
            let index = image_index(&[(arm.clone(), manifest.clone())], &BTreeMap::new()).unwrap();
            store.put(&index).unwrap();
            Descriptor::of(OCI_INDEX, &index)
        };
        // The config first (the manifest naming it is read whole and is small).
        let manifest = store.read_document(&f.manifest.digest, f.manifest.size).unwrap();
        let parts = ImageParts::parse(&manifest).unwrap();
        let m = image_manifest(&huge(&parts.config), &parts.layers, &BTreeMap::new()).unwrap();
        store.put(&m).unwrap();
        let source = Source::Layout(Layout::open(&f.layout.dir).unwrap(), index_of(&Descriptor::of(OCI_MANIFEST, &m)));
        let e = read(&source).err().unwrap();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        assert!(format!("{e:#}").contains("declares 4000000000 bytes, more than the 4194304 bytes"), "{e:#}");
        let source = Source::Layout(Layout::open(&f.layout.dir).unwrap(), index_of(&huge(&f.manifest)));
        let e = format!("{:#}", read(&source).err().unwrap());
        assert!(e.contains(&format!("blob {}: its descriptor declares 4000000000 bytes", f.manifest.digest)), "{e}");
    }

    #[test]
    fn the_sboms_debian_packages_are_read_and_the_rest_skipped() {
        let sbom = r#"{"spdxVersion":"SPDX-2.3","extra":{"deep":[1,2,{"x":null}]},"packages":[
            {"name":"libc6","versionInfo":"2.36-9","externalRefs":[{"referenceLocator":"pkg:deb/debian/libc6@2.36-9"}]},
            {"name":"serde","versionInfo":"1.0.0","externalRefs":[{"referenceLocator":"pkg:cargo/serde@1.0.0"}]},
            {"name":"noversion","externalRefs":[{"referenceLocator":"pkg:deb/debian/noversion"}]},
            {"SPDXID":"SPDXRef-x"}]}"#;
        assert_eq!(deb_packages(sbom), BTreeMap::from([("libc6".to_string(), "2.36-9".to_string())]));
        assert!(deb_packages("not json").is_empty());
    }

    /// A 2.9 MB image whose /opt/distro layer held a 3 GB SBOM made `distro diff` and `distro
    /// report` hold all of it; a layer whose SBOM declares more than the cap is refused unread.
    #[test]
    fn an_opt_distro_layer_over_the_cap_is_refused_unread() {
        use crate::oci::fixture::arm64_layout;
        use crate::oci::manifest::{OCI_INDEX, OCI_LAYER_GZIP, OCI_MANIFEST, image_index, image_manifest};
        use crate::oci::platform::Platform;
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let f = arm64_layout(dir.path());
        let store = &f.layout.store;
        // A tar header declaring a 3 GB SBOM and no data: a few hundred bytes of gzip.
        let mut h = tar::Header::new_gnu();
        h.set_path("opt/distro/sbom.spdx.json").unwrap();
        h.set_size(3_000_000_000);
        h.set_mode(0o644);
        h.set_cksum();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(h.as_bytes()).unwrap();
        let bomb = gz.finish().unwrap();
        store.put(&bomb).unwrap();
        let layer = Descriptor::of(OCI_LAYER_GZIP, &bomb);
        let manifest = store.read_document(&f.manifest.digest, f.manifest.size).unwrap();
        let parts = ImageParts::parse(&manifest).unwrap();
        let m = image_manifest(&parts.config, std::slice::from_ref(&layer), &BTreeMap::new()).unwrap();
        store.put(&m).unwrap();
        let arm = Platform::parse("linux/arm64").unwrap();
        let index = image_index(&[(arm, Descriptor::of(OCI_MANIFEST, &m))], &BTreeMap::new()).unwrap();
        store.put(&index).unwrap();
        let source = Source::Layout(Layout::open(&f.layout.dir).unwrap(), Descriptor::of(OCI_INDEX, &index));
        let e = read(&source).err().unwrap();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        let line = crate::error::one_line(&e);
        assert!(line.contains(&format!("linux/arm64/v8's /opt/distro layer {}", layer.digest)), "{line}");
        assert!(
            line.contains("its opt/distro/sbom.spdx.json declares 3000000000 bytes, more than the 67108864 bytes"),
            "{line}"
        );
    }
}
