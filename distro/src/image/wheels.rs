//! The CUDA libraries of an image from NVIDIA's PyPI wheels (a definition's `wheels = [...]`,
//! pinned in `[wheels.NAME]` of images/manifest.toml): one layer per wheel and platform holding
//! the wheel's shared libraries (`nvidia/*/lib/*.so*`) in [`LIB_DIR`] and its license files in
//! `LICENSE_DIR/PROJECT/`. Headers, static archives and Python files are left out.
//!
//! Every extracted file is checked against the wheel's `RECORD` (its sha256 and size), on top
//! of the pinned sha256 of the wheel itself. A layer is cached by the wheel's sha256, the paths
//! and the epoch, so a rebuild with the same pins neither unzips nor compresses anything.
use super::def::ImageDef;
use super::layer::{GZIP_LEVEL, Layer, LayerSpec, MODE_EXEC, MODE_FILE};
use crate::error::bad_input;
use crate::oci::digest::KeyHasher;
use crate::oci::platform::Platform;
use crate::oci::store::BlobStore;
use crate::progress::Progress;
use crate::sources::wheels::{Fetcher, WheelSpec};
use anyhow::{Context, Result};
use base64::Engine as _;
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// Where the wheels' shared libraries go: one directory for all, as the engine's
/// `ENGINE_CUDA_LIB_PATH` and the loader's `LD_LIBRARY_PATH` name it in the definition's env.
pub const LIB_DIR: &str = "/opt/nvidia/lib";
/// Where each wheel's license files go (`LICENSE_DIR/PROJECT/...`).
pub const LICENSE_DIR: &str = "/opt/nvidia/licenses";

/// The wheels `def` names, from `root`/images/manifest.toml, each fetched (or found in the
/// cache) and verified for every platform, so that a bad pin fails the build before the engine
/// is compiled. A name the manifest lacks, or a platform of the build the manifest pins no file
/// for, is bad input naming the definition.
pub fn specs(
    root: &Path,
    def: &ImageDef,
    def_path: &Path,
    platforms: &[Platform],
    progress: &Progress,
) -> Result<Vec<WheelSpec>> {
    if def.wheels.is_empty() {
        return Ok(Vec::new());
    }
    let manifest = crate::sources::Manifest::load(&root.join(crate::sources::DEFAULT_MANIFEST))?;
    let mut out = Vec::new();
    for name in &def.wheels {
        let w = manifest.wheels.get(name).ok_or_else(|| {
            bad_input(format!(
                "{}: wheels: {name:?} has no [wheels.{name}] in {} (wheels: {})",
                def_path.display(),
                manifest.path.display(),
                manifest.wheels.keys().cloned().collect::<Vec<_>>().join(", ")
            ))
        })?;
        if let Some(p) = platforms.iter().find(|p| !w.sha256.contains_key(p)) {
            return Err(bad_input(format!(
                "{}: wheel `{name}` pins no file for {p} (add sha256.\"{p}\" to [wheels.{name}])",
                manifest.at(w.loc)
            )));
        }
        out.push(w.clone());
    }
    let fetcher = Fetcher::new(crate::sources::Cache::from_env()?.root())?;
    for p in platforms {
        for w in &out {
            fetcher.fetch(w, p, progress)?;
        }
    }
    Ok(out)
}

/// The layers of `wheels` for `platform`, with what each holds (for the config's history),
/// fetching the wheels first when they are not cached.
pub fn layers(
    wheels: &[WheelSpec],
    platform: &Platform,
    epoch: u64,
    cache: &Path,
    store: &BlobStore,
    progress: &Progress,
) -> Result<Vec<(Layer, String)>> {
    if wheels.is_empty() {
        return Ok(Vec::new());
    }
    let fetcher = Fetcher::new(crate::sources::Cache::from_env()?.root())?;
    let mut out = Vec::new();
    for w in wheels {
        let sha = &w.sha256[platform];
        let mut k = KeyHasher::new("wheel-layer-v1");
        k.part(sha.as_bytes()).part(LIB_DIR.as_bytes()).part(LICENSE_DIR.as_bytes());
        k.part(w.project.as_bytes()).part(w.version.as_bytes());
        k.part(&epoch.to_le_bytes()).part(&GZIP_LEVEL.to_le_bytes()).part(env!("CARGO_PKG_VERSION").as_bytes());
        let meta = cache.join("layers").join(format!("{}.json", k.finish()));
        let layer = match Layer::cached(&meta, store) {
            Some(l) => l,
            None => {
                let path = fetcher.fetch(w, platform, progress)?;
                let step = progress.step(format!("unpacking {} {} ({platform})", w.project, w.version));
                let spec = wheel_layer(&path, &w.project, &w.version)?;
                let (layer, gz) = spec.build(epoch)?;
                store.put(&gz)?;
                layer.record(&meta)?;
                step.done(format!("{} bytes compressed", layer.size));
                layer
            }
        };
        out.push((layer, format!("wheel {} {}: {LIB_DIR}", w.project, w.version)));
    }
    Ok(out)
}

/// The layer of one wheel file: its shared libraries under [`LIB_DIR`] (mode 0755) and its
/// license files under `LICENSE_DIR/project/`, each checked against the wheel's `RECORD`.
pub fn wheel_layer(path: &Path, project: &str, version: &str) -> Result<LayerSpec> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|e| bad_input(format!("{}: not a wheel (zip): {e}", path.display())))?;
    let names: Vec<String> = zip
        .file_names()
        .map(|n| n.map(|n| n.into_owned()))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad_input(format!("{}: not a wheel (zip): {e}", path.display())))?;
    let record_name = names
        .iter()
        .find(|n| n.ends_with(".dist-info/RECORD") && n.matches('/').count() == 1)
        .ok_or_else(|| bad_input(format!("{}: a wheel without a .dist-info/RECORD", path.display())))?
        .clone();
    // The file is the pinned one by its hash; its own name and version must be the pin's too,
    // or the SBOM and the license directory would name another package.
    let info = record_name.trim_end_matches(".dist-info/RECORD");
    let normal = |n: &str| n.to_ascii_lowercase().replace(['_', '.'], "-");
    if info.rsplit_once('-').is_none_or(|(n, v)| normal(n) != normal(project) || v != version) {
        return Err(bad_input(format!(
            "{}: the wheel is {info}, not {project} {version} as images/manifest.toml says",
            path.display()
        )));
    }
    let record = read_entry(&mut zip, &record_name, path)?;
    let record_text = String::from_utf8_lossy(&record).into_owned();
    let record = parse_record(&record_text);
    let mut spec = LayerSpec::new();
    let mut libs = 0;
    for name in &names {
        let dest = match dest_of(name, project) {
            Some(d) => d,
            None => continue,
        };
        let bytes = read_entry(&mut zip, name, path)?;
        let Some((hash, size)) = record.get(name.as_str()) else {
            return Err(bad_input(format!("{}: {name} is not listed in {record_name}", path.display())));
        };
        let got = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(&bytes));
        if got != *hash || size.is_some_and(|s| s != bytes.len() as u64) {
            return Err(bad_input(format!("{}: {name} does not match its {record_name} entry", path.display())));
        }
        let lib = dest.starts_with(LIB_DIR);
        libs += usize::from(lib);
        spec.add_file(&dest, Arc::new(bytes), if lib { MODE_EXEC } else { MODE_FILE })
            .with_context(|| format!("{}: {name}", path.display()))?;
    }
    if libs == 0 {
        return Err(bad_input(format!("{}: no shared library (nvidia/*/lib/*.so*) in this wheel", path.display())));
    }
    Ok(spec)
}

/// Where a wheel entry goes in the image, or `None` when it is left out.
fn dest_of(name: &str, project: &str) -> Option<String> {
    let parts: Vec<&str> = name.split('/').collect();
    match parts.as_slice() {
        ["nvidia", _, "lib", file] if file.contains(".so") && !file.starts_with('.') => {
            Some(format!("{LIB_DIR}/{file}"))
        }
        [info, rest @ ..]
            if info.ends_with(".dist-info")
                && !rest.is_empty()
                && rest.iter().all(|c| !c.is_empty() && *c != "..")
                && (rest[0] == "licenses" || rest[0].to_ascii_lowercase().starts_with("licen")) =>
        {
            let rest = if rest[0] == "licenses" && rest.len() > 1 { &rest[1..] } else { rest };
            Some(format!("{LICENSE_DIR}/{project}/{}", rest.join("/")))
        }
        _ => None,
    }
}

/// The most memory reserved for an entry before its bytes are read.
const ENTRY_RESERVE: u64 = 64 << 20;

/// Reads entry `name` of a wheel. Its declared size is believed no further than its content
/// bears it out: at most [`ENTRY_RESERVE`] is reserved up front (a declared size near 2^64 made
/// `Vec::with_capacity` panic, one of 4 GiB was allocated before a byte was read), at most one
/// byte past the declared size is read, and an entry whose content is not its declared size is
/// refused as damaged.
fn read_entry<R: Read + std::io::Seek>(zip: &mut zip::ZipArchive<R>, name: &str, path: &Path) -> Result<Vec<u8>> {
    let damaged = |e: &dyn std::fmt::Display| bad_input(format!("{}: {name}: {e}", path.display()));
    let mut f = zip.by_name(name).map_err(|e| damaged(&e))?;
    let declared = f.size();
    let mut bytes = Vec::with_capacity(declared.min(ENTRY_RESERVE) as usize);
    (&mut f).take(declared.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| damaged(&e))?;
    if bytes.len() as u64 != declared {
        let held =
            if bytes.len() as u64 > declared { format!("more than {declared}") } else { bytes.len().to_string() };
        return Err(damaged(&format_args!(
            "it holds {held} bytes where the zip's directory declares {declared}; the wheel is damaged"
        )));
    }
    Ok(bytes)
}

/// `RECORD` lines `path,sha256=URLSAFE_B64,size`, by path (entries without a hash omitted).
fn parse_record(text: &str) -> BTreeMap<&str, (&str, Option<u64>)> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let mut it = line.rsplitn(3, ',');
        let (size, hash, path) = (it.next(), it.next(), it.next());
        if let (Some(size), Some(hash), Some(path)) = (size, hash, path)
            && let Some(h) = hash.strip_prefix("sha256=")
        {
            out.insert(path.trim_matches('"'), (h, size.trim().parse().ok()));
        }
    }
    out
}

/// `sbom` with each wheel added as a package (`pkg:pypi/NAME@VERSION`, the wheel's sha256)
/// that the image contains.
pub fn add_to_sbom(sbom: Vec<u8>, wheels: &[WheelSpec], platform: &Platform) -> Result<Vec<u8>> {
    if wheels.is_empty() {
        return Ok(sbom);
    }
    let mut doc: serde_json::Value = serde_json::from_slice(&sbom).context("the SBOM is not JSON")?;
    for w in wheels {
        let id = format!("SPDXRef-Wheel-{}-{}", w.project, w.version.replace('.', "-"));
        let pkg = serde_json::json!({
            "SPDXID": id,
            "name": w.project,
            "versionInfo": w.version,
            "downloadLocation": format!("https://pypi.org/project/{}/{}/", w.project, w.version),
            "filesAnalyzed": false,
            "licenseConcluded": "NOASSERTION",
            "licenseDeclared": "LicenseRef-NVIDIA-Proprietary",
            "copyrightText": "NOASSERTION",
            "primaryPackagePurpose": "LIBRARY",
            "comment": format!("shared libraries in {LIB_DIR}, license in {LICENSE_DIR}/{}", w.project),
            "checksums": [{"algorithm": "SHA256", "checksumValue": w.sha256[platform]}],
            "externalRefs": [{"referenceCategory": "PACKAGE-MANAGER", "referenceType": "purl", "referenceLocator": w.purl()}],
        });
        doc["packages"].as_array_mut().context("SBOM packages")?.push(pkg);
        let rel = serde_json::json!({"spdxElementId": "SPDXRef-Image", "relationshipType": "CONTAINS", "relatedSpdxElement": id});
        doc["relationships"].as_array_mut().context("SBOM relationships")?.push(rel);
    }
    if let Some(rels) = doc["relationships"].as_array_mut() {
        rels.sort_by_key(|r| r.to_string());
    }
    Ok(crate::oci::json::canonical(&doc))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    /// A small wheel: a library, a header, a static archive, a license and a RECORD (whose
    /// entry for the library is `record_lib`, or the right one).
    pub(crate) fn wheel(dir: &Path, record_lib: Option<&str>) -> std::path::PathBuf {
        let files: [(&str, &[u8]); 4] = [
            ("nvidia/x/lib/libx.so.1", b"\x7fELF fake library"),
            ("nvidia/x/include/x.h", b"int x;"),
            ("nvidia/x/lib/libx_static.a", b"!<arch>"),
            ("nvidia_x-1.0.dist-info/licenses/License.txt", b"license"),
        ];
        let path = dir.join("nvidia_x-1.0-py3-none-manylinux_2_17_x86_64.whl");
        let mut z = zip::ZipWriter::new(std::fs::File::create(&path).unwrap());
        let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        let mut record = String::new();
        for (name, bytes) in files {
            z.start_file(name, opts).unwrap();
            z.write_all(bytes).unwrap();
            let h = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(bytes));
            let h = match record_lib {
                Some(bad) if name.ends_with(".so.1") => bad.to_string(),
                _ => h,
            };
            record.push_str(&format!("{name},sha256={h},{}\n", bytes.len()));
        }
        record.push_str("nvidia_x-1.0.dist-info/RECORD,,\n");
        z.start_file("nvidia_x-1.0.dist-info/RECORD", opts).unwrap();
        z.write_all(record.as_bytes()).unwrap();
        z.finish().unwrap();
        path
    }

    #[test]
    fn a_wheel_unpacks_to_its_libraries_and_license_deterministically() {
        let dir = tempfile::tempdir().unwrap();
        let path = wheel(dir.path(), None);
        let spec = wheel_layer(&path, "nvidia-x", "1.0").unwrap();
        let files: Vec<&str> = spec
            .entries()
            .filter(|(_, e)| matches!(e.kind, super::super::layer::EntryKind::File(_)))
            .map(|(p, _)| p.as_str())
            .collect();
        assert_eq!(files, ["opt/nvidia/lib/libx.so.1", "opt/nvidia/licenses/nvidia-x/License.txt"]);
        let (a, ga) = spec.build(7).unwrap();
        let (b, gb) = wheel_layer(&path, "nvidia-x", "1.0").unwrap().build(7).unwrap();
        assert_eq!((a.digest, ga), (b.digest, gb), "same wheel, same layer bytes");
        for (project, version) in [("nvidia-y", "1.0"), ("nvidia-x", "1.1")] {
            let e = wheel_layer(&path, project, version).unwrap_err();
            assert!(format!("{e:#}").contains(&format!("the wheel is nvidia_x-1.0, not {project} {version}")), "{e:#}");
        }
    }

    #[test]
    fn a_file_that_differs_from_its_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = wheel(dir.path(), Some("AAAA"));
        let e = wheel_layer(&path, "nvidia-x", "1.0").unwrap_err();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        assert!(format!("{e:#}").contains("nvidia/x/lib/libx.so.1 does not match its"), "{e:#}");
        std::fs::write(&path, b"not a zip").unwrap();
        assert!(crate::error::is_bad_input(&wheel_layer(&path, "nvidia-x", "1.0").unwrap_err()));
    }

    /// An entry whose zip directory declares 4 GiB was given a buffer of that size before a
    /// byte was read, and its content was taken whatever its size; now the declared size must
    /// be the content's.
    #[test]
    fn an_entry_is_not_believed_beyond_its_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = wheel(dir.path(), None);
        let mut bytes = std::fs::read(&path).unwrap();
        // The library's uncompressed size, in its local header (offset 22) and in the central
        // directory (offset 24), set to 4 GiB - 2.
        let name = b"nvidia/x/lib/libx.so.1";
        for (signature, at) in [(b"PK\x03\x04", 22), (b"PK\x01\x02", 24)] {
            let header = (0..bytes.len() - name.len())
                .find(|&i| {
                    bytes[i..].starts_with(signature) && bytes[i..].windows(name.len()).take(100).any(|w| w == name)
                })
                .unwrap();
            bytes[header + at..header + at + 4].copy_from_slice(&0xffff_fffeu32.to_le_bytes());
        }
        std::fs::write(&path, &bytes).unwrap();
        let e = wheel_layer(&path, "nvidia-x", "1.0").unwrap_err();
        assert!(crate::error::is_bad_input(&e), "{e:#}");
        assert!(
            format!("{e:#}").contains(
                "libx.so.1: it holds 17 bytes where the zip's directory declares 4294967294; the wheel is damaged"
            ),
            "{e:#}"
        );
    }

    #[test]
    fn wheels_enter_the_sbom_as_pypi_packages() {
        let amd64 = Platform::parse("linux/amd64").unwrap();
        let w = WheelSpec {
            name: "cublas".into(),
            project: "nvidia-cublas".into(),
            version: "13.1.0.3".into(),
            sha256: BTreeMap::from([(amd64.clone(), "a".repeat(64))]),
            loc: Default::default(),
        };
        let doc = br#"{"packages":[{"SPDXID":"SPDXRef-Image"}],"relationships":[]}"#.to_vec();
        let out: serde_json::Value = serde_json::from_slice(&add_to_sbom(doc, &[w], &amd64).unwrap()).unwrap();
        let p = &out["packages"][1];
        assert_eq!(p["externalRefs"][0]["referenceLocator"], "pkg:pypi/nvidia-cublas@13.1.0.3");
        assert_eq!(p["checksums"][0]["checksumValue"], "a".repeat(64));
        assert_eq!(out["relationships"][0]["relatedSpdxElement"], p["SPDXID"]);
    }
}
