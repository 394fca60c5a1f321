//! The base image's own packages, read from the dpkg database in its layers
//! (`var/lib/dpkg/status`, and distroless' `var/lib/dpkg/status.d/*`) and its `os-release`, so
//! that the SBOM lists each as an SPDX package with a package URL
//! (`pkg:deb/ubuntu/NAME@VERSION?arch=ARCH&distro=ubuntu-24.04`) instead of one opaque base.
//!
//! The layers are applied in order with their whiteouts, as a container runtime would, but only
//! for these few files. Reading a CUDA base's layers takes seconds, so the result is cached per
//! platform manifest digest in the build directory.
use crate::oci::digest::Digest;
use crate::oci::manifest::Descriptor;
use crate::oci::store::BlobStore;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// One installed Debian package.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DebPackage {
    /// `Package`.
    pub name: String,
    /// `Version` (with its epoch, if any).
    pub version: String,
    /// `Architecture` (`amd64`, `arm64`, `all`).
    pub arch: String,
}

/// What a base's layers say about its distribution and packages.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseContents {
    /// `ID` of os-release (`ubuntu`, `debian`), if the base has one.
    pub os_id: Option<String>,
    /// `VERSION_ID` of os-release (`24.04`).
    pub os_version: Option<String>,
    /// Installed packages, sorted by name.
    pub packages: Vec<DebPackage>,
}

impl DebPackage {
    /// The package URL, in the purl spec's `deb` type (version percent-encoded).
    pub fn purl(&self, contents: &BaseContents) -> String {
        let namespace = contents.os_id.as_deref().unwrap_or("debian");
        let mut q = format!("arch={}", self.arch);
        if let Some(v) = &contents.os_version {
            q.push_str(&format!("&distro={namespace}-{v}"));
        }
        format!("pkg:deb/{namespace}/{}@{}?{q}", encode(&self.name), encode(&self.version))
    }
}

fn encode(s: &str) -> String {
    s.chars()
        .map(
            |c| {
                if c.is_ascii_alphanumeric() || "-._~".contains(c) {
                    c.to_string()
                } else {
                    format!("%{:02X}", c as u32)
                }
            },
        )
        .collect()
}

/// Reads the base's packages from `layers` (in `store`), caching by `manifest` digest under
/// `cache_dir`.
pub fn base_contents(
    store: &BlobStore,
    layers: &[Descriptor],
    manifest: &Digest,
    cache_dir: &Path,
) -> Result<BaseContents> {
    let cached = cache_dir.join(format!("{}.json", manifest.hex()));
    if let Ok(bytes) = std::fs::read(&cached)
        && let Ok(c) = serde_json::from_slice(&bytes)
    {
        return Ok(c);
    }
    let mut files = Files::default();
    for l in layers {
        let file =
            std::fs::File::open(store.path(&l.digest)).with_context(|| format!("opening base layer {}", l.digest))?;
        let reader: Box<dyn Read> = if l.media_type.ends_with("gzip") {
            Box::new(flate2::read::GzDecoder::new(file))
        } else if l.media_type.ends_with(".tar") || l.media_type.ends_with("tar") {
            Box::new(file)
        } else {
            // zstd and foreign layers are not read; their packages are not listed.
            continue;
        };
        files.apply_layer(reader).with_context(|| format!("reading base layer {}", l.digest))?;
    }
    let contents = files.contents();
    std::fs::create_dir_all(cache_dir)?;
    crate::fsutil::write_atomic(&cached, &serde_json::to_vec(&contents)?)?;
    Ok(contents)
}

/// The files that matter, as the layers so far leave them.
#[derive(Default)]
struct Files {
    status: Option<Vec<u8>>,
    status_d: BTreeMap<String, Vec<u8>>,
    os_release: BTreeMap<String, Vec<u8>>,
}

const STATUS: &str = "var/lib/dpkg/status";
const STATUS_D: &str = "var/lib/dpkg/status.d/";
const OS_RELEASE: [&str; 2] = ["etc/os-release", "usr/lib/os-release"];

impl Files {
    fn apply_layer(&mut self, reader: impl Read) -> Result<()> {
        let mut archive = tar::Archive::new(reader);
        for entry in archive.entries()? {
            let mut entry = entry?;
            let raw = entry.path()?.to_string_lossy().into_owned();
            let path = raw.trim_start_matches("./").trim_start_matches('/').to_owned();
            let (dir, base) = path.rsplit_once('/').unwrap_or(("", path.as_str()));
            if let Some(hidden) = base.strip_prefix(".wh.") {
                let gone = if dir.is_empty() { hidden.to_owned() } else { format!("{dir}/{hidden}") };
                if hidden == ".wh..opq" && format!("{dir}/") == STATUS_D {
                    self.status_d.clear();
                }
                self.remove(&gone);
                continue;
            }
            let kind = entry.header().entry_type();
            let wanted = path == STATUS || OS_RELEASE.contains(&path.as_str()) || path.starts_with(STATUS_D);
            if !wanted {
                continue;
            }
            if !kind.is_file() {
                // A link (os-release is usually one to usr/lib/os-release) or a directory.
                if OS_RELEASE.contains(&path.as_str()) && kind.is_symlink() {
                    self.os_release.remove(&path);
                }
                continue;
            }
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes)?;
            if path == STATUS {
                self.status = Some(bytes);
            } else if let Some(name) = path.strip_prefix(STATUS_D) {
                self.status_d.insert(name.to_owned(), bytes);
            } else {
                self.os_release.insert(path, bytes);
            }
        }
        Ok(())
    }

    fn remove(&mut self, path: &str) {
        if path == STATUS {
            self.status = None;
        } else if path.trim_end_matches('/') == STATUS_D.trim_end_matches('/') {
            self.status_d.clear();
        } else if let Some(name) = path.strip_prefix(STATUS_D) {
            self.status_d.remove(name);
        }
        self.os_release.remove(path);
    }

    fn contents(&self) -> BaseContents {
        let mut packages = Vec::new();
        for text in self.status.iter().chain(self.status_d.values()) {
            packages.extend(parse_status(&String::from_utf8_lossy(text)));
        }
        packages.sort();
        packages.dedup();
        let release =
            OS_RELEASE.iter().find_map(|p| self.os_release.get(*p)).map(|b| String::from_utf8_lossy(b).into_owned());
        let field = |key: &str| {
            release.as_deref().and_then(|r| {
                r.lines()
                    .find_map(|l| l.strip_prefix(key)?.strip_prefix('=').map(|v| v.trim().trim_matches('"').to_owned()))
            })
        };
        BaseContents { os_id: field("ID"), os_version: field("VERSION_ID"), packages }
    }
}

/// The installed packages of a dpkg status file (stanzas whose `Status` ends in `installed`).
pub fn parse_status(text: &str) -> Vec<DebPackage> {
    let mut out = Vec::new();
    for stanza in text.split("\n\n") {
        let mut fields: BTreeMap<&str, &str> = BTreeMap::new();
        for line in stanza.lines() {
            if line.starts_with([' ', '\t']) {
                continue;
            }
            if let Some((k, v)) = line.split_once(':') {
                fields.insert(k.trim(), v.trim());
            }
        }
        let installed = fields.get("Status").is_none_or(|s| s.ends_with(" installed"));
        if let (true, Some(name), Some(version)) = (installed, fields.get("Package"), fields.get("Version")) {
            let arch = fields.get("Architecture").copied().unwrap_or("all");
            out.push(DebPackage { name: (*name).into(), version: (*version).into(), arch: arch.into() });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS_TEXT: &str = "Package: libc6\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.39-0ubuntu8.4\nDescription: GNU C Library\n multi-line\n\nPackage: gone\nStatus: deinstall ok config-files\nVersion: 1\n\nPackage: libnccl2\nStatus: install ok installed\nArchitecture: amd64\nVersion: 2.27.7-1+cuda13.0\n";

    fn layer(files: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, bytes) in files {
            let mut h = tar::Header::new_gnu();
            h.set_size(bytes.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, path, *bytes).unwrap();
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn reads_packages_through_layers_and_whiteouts() {
        let mut f = Files::default();
        f.apply_layer(
            &layer(&[
                ("./etc/os-release", b"ID=ubuntu\nVERSION_ID=\"24.04\"\n"),
                ("var/lib/dpkg/status", b"Package: old\nVersion: 1\n"),
            ])[..],
        )
        .unwrap();
        f.apply_layer(&layer(&[("var/lib/dpkg/status", STATUS_TEXT.as_bytes())])[..]).unwrap();
        let c = f.contents();
        assert_eq!((c.os_id.as_deref(), c.os_version.as_deref()), (Some("ubuntu"), Some("24.04")));
        let names: Vec<&str> = c.packages.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["libc6", "libnccl2"]);
        assert_eq!(
            c.packages[1].purl(&c),
            "pkg:deb/ubuntu/libnccl2@2.27.7-1%2Bcuda13.0?arch=amd64&distro=ubuntu-24.04"
        );
        f.apply_layer(&layer(&[("var/lib/dpkg/.wh.status", b"")])[..]).unwrap();
        assert!(f.contents().packages.is_empty());
    }
}
