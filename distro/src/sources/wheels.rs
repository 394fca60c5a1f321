//! Python wheels as pinned sources (`[wheels.NAME]` of images/manifest.toml): NVIDIA's CUDA
//! libraries as published on PyPI, a second way to get them besides the `nvidia/cuda` base.
//!
//! A wheel is pinned by project, exact version and the sha256 of its file per platform. Fetching
//! asks PyPI's JSON API which file has the pinned sha256 (a pin PyPI does not serve is bad input,
//! naming what it serves instead), streams it into the cache as `wheels/SHA256.whl` while
//! hashing, and keeps it only when the hash is the pinned one; a cached file is hashed again on
//! every use, so nothing unverified reaches an image.
use super::loc::Loc;
use crate::error::bad_input;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use crate::retry::{Failure, Policy, retry};
use anyhow::{Context, Result};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use toml::Spanned;

/// The package index asked for wheel files: `DISTRO_PYPI_URL`, else PyPI.
pub const DEFAULT_INDEX: &str = "https://pypi.org/";

/// One pinned wheel (`[wheels.NAME]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WheelSpec {
    /// The table name: what image definitions list in `wheels`.
    pub name: String,
    /// The PyPI project (`nvidia-cublas`).
    pub project: String,
    /// The exact version (`13.1.0.3`).
    pub version: String,
    /// The sha256 (hex) of the wheel file, by platform (`linux/amd64`).
    pub sha256: BTreeMap<Platform, String>,
    /// Position of the table.
    pub loc: Loc,
}

impl WheelSpec {
    /// The package URL of the SBOM (`pkg:pypi/nvidia-cublas@13.1.0.3`).
    pub fn purl(&self) -> String {
        format!("pkg:pypi/{}@{}", self.project.to_ascii_lowercase().replace(['_', '.'], "-"), self.version)
    }
}

/// The wheels' table of `distro sources`: name, project, version and the pinned platforms.
pub fn table(wheels: &BTreeMap<String, WheelSpec>) -> String {
    let rows: Vec<[String; 4]> = wheels
        .values()
        .map(|w| {
            let platforms: Vec<String> = w.sha256.keys().map(|p| format!("{}/{}", p.os, p.architecture)).collect();
            [w.name.clone(), w.project.clone(), w.version.clone(), platforms.join(",")]
        })
        .collect();
    let header = ["WHEEL".to_string(), "PROJECT".into(), "VERSION".into(), "PLATFORMS".into()];
    let mut widths = [0usize; 4];
    for r in std::iter::once(&header).chain(&rows) {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut out = String::new();
    for r in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = r.iter().zip(widths).map(|(c, w)| format!("{c:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// One wheel as `distro sources --json` prints it.
pub fn json(w: &WheelSpec) -> serde_json::Value {
    let sha: BTreeMap<String, &String> =
        w.sha256.iter().map(|(p, h)| (format!("{}/{}", p.os, p.architecture), h)).collect();
    serde_json::json!({"wheel": w.name, "project": w.project, "version": w.version, "sha256": sha, "purl": w.purl()})
}

/// The raw TOML of a `[wheels.NAME]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWheel {
    project: Spanned<String>,
    version: Spanned<String>,
    sha256: Spanned<BTreeMap<String, Spanned<String>>>,
}

/// Validates `[wheels.NAME]` at byte `table` of the manifest: errors are (offset, message).
pub fn validate(
    name: &str,
    raw: RawWheel,
    table: usize,
    text: &str,
) -> std::result::Result<WheelSpec, (usize, String)> {
    let name_ok = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !name_ok {
        return Err((table, format!("wheel name `{name}` must be letters, digits, `-` and `_`")));
    }
    let project = raw.project.get_ref();
    if project.is_empty() || !project.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err((raw.project.span().start, format!("`project` of wheel `{name}` is not a PyPI name: {project:?}")));
    }
    let version = raw.version.get_ref();
    let exact = !version.is_empty()
        && version.starts_with(|c: char| c.is_ascii_digit())
        && version.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
        && !version.contains("..");
    if !exact {
        return Err((
            raw.version.span().start,
            format!("`version` of wheel `{name}` must be one exact version (`13.0.88`), not {version:?}"),
        ));
    }
    let mut sha256 = BTreeMap::new();
    for (platform, hash) in raw.sha256.get_ref() {
        let p = Platform::parse(platform)
            .map_err(|e| (hash.span().start, format!("wheel `{name}`: sha256.\"{platform}\": {e:#}")))?;
        let h = hash.get_ref();
        if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err((
                hash.span().start,
                format!("wheel `{name}`: sha256.\"{platform}\" must be 64 lowercase hex digits, not {h:?}"),
            ));
        }
        sha256.insert(p, h.clone());
    }
    if sha256.is_empty() {
        return Err((
            raw.sha256.span().start,
            format!("wheel `{name}` pins no file: add sha256.\"linux/amd64\" = \"...\""),
        ));
    }
    Ok(WheelSpec {
        name: name.to_string(),
        project: project.clone(),
        version: version.clone(),
        sha256,
        loc: Loc::at(text, table),
    })
}

/// The file of a release that PyPI's JSON API lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexFile {
    /// The wheel's file name.
    pub filename: String,
    /// Its URL, resolved against the JSON's.
    pub url: String,
    /// Its sha256, as the index states it.
    pub sha256: String,
}

/// Picks the file of `spec`'s release whose sha256 is the one pinned for `platform`, from the
/// text of `GET {index}pypi/PROJECT/json` fetched from `json_url`. A pin the index does not
/// serve is bad input that names, where it can, the file the index serves for that platform.
pub fn pick_file(json: &str, json_url: &str, spec: &WheelSpec, platform: &Platform) -> Result<IndexFile> {
    let what = format!("wheel `{}` ({} {}, {platform})", spec.name, spec.project, spec.version);
    let pin = spec.sha256.get(platform).ok_or_else(|| {
        bad_input(format!(
            "{what}: images/manifest.toml pins no file for {platform} (sha256.\"{platform}\"); pinned: {}",
            spec.sha256.keys().map(Platform::to_string).collect::<Vec<_>>().join(", ")
        ))
    })?;
    let v: serde_json::Value = serde_json::from_str(json).with_context(|| format!("{what}: {json_url} is not JSON"))?;
    let Some(files) = v["releases"][&spec.version].as_array() else {
        return Err(bad_input(format!("{what}: the index has no release {} of {}", spec.version, spec.project)));
    };
    let base = url::Url::parse(json_url).with_context(|| format!("{json_url} is not a URL"))?;
    let mut served = Vec::new();
    for f in files {
        let (Some(name), Some(url), Some(sha)) =
            (f["filename"].as_str(), f["url"].as_str(), f["digests"]["sha256"].as_str())
        else {
            continue;
        };
        if sha == pin {
            let url = base.join(url).with_context(|| format!("{what}: file URL {url:?}"))?.to_string();
            return Ok(IndexFile { filename: name.to_string(), url, sha256: sha.to_string() });
        }
        if name.ends_with(".whl") && name.contains("linux") && name.contains(platform_tag(platform)) {
            served.push(format!("{name} (sha256 {sha})"));
        }
    }
    Err(bad_input(format!(
        "{what}: the pinned sha256 {pin} is not what the index serves{}",
        if served.is_empty() {
            format!("; it has no linux {} wheel of this release", platform_tag(platform))
        } else {
            format!(": it serves {}", served.join(", "))
        }
    )))
}

/// The architecture in a manylinux wheel's platform tag.
fn platform_tag(p: &Platform) -> &'static str {
    match p.architecture.as_str() {
        "arm64" => "aarch64",
        _ => "x86_64",
    }
}

/// Copies `from` into `dest` (through a temporary file beside it) when its sha256 is `expected`;
/// otherwise removes what was written and says so in one line (bad input: the pin).
pub fn store_verified(mut from: impl Read, expected: &str, dest: &Path, what: &str) -> Result<()> {
    let dir = dest.parent().context("a cache file has a directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).with_context(|| format!("writing in {}", dir.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = from.read(&mut buf).with_context(|| format!("reading {what}"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        tmp.write_all(&buf[..n])?;
    }
    let got = crate::hex::hex(&hasher.finalize());
    if got != expected {
        return Err(bad_input(format!("{what}: sha256 is {got}, not the pinned {expected}; nothing was kept")));
    }
    tmp.as_file().sync_all()?;
    tmp.persist(dest).with_context(|| format!("storing {}", dest.display()))?;
    Ok(())
}

/// The sha256 (hex) of a file, read in chunks.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(crate::hex::hex(&hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

/// Fetches pinned wheels into the cache (`CACHE/wheels/SHA256.whl`).
pub struct Fetcher {
    http: reqwest::blocking::Client,
    index: url::Url,
    dir: PathBuf,
    policy: Policy,
}

impl Fetcher {
    /// A fetcher storing into `cache_root/wheels`, asking `DISTRO_PYPI_URL` (else PyPI).
    pub fn new(cache_root: &Path) -> Result<Fetcher> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let index = std::env::var("DISTRO_PYPI_URL").ok().filter(|s| !s.is_empty());
        let index = index.unwrap_or_else(|| DEFAULT_INDEX.into());
        let index = url::Url::parse(&format!("{}/", index.trim_end_matches('/')))
            .map_err(|e| bad_input(format!("DISTRO_PYPI_URL={index:?} is not a URL: {e}")))?;
        let http = reqwest::blocking::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(30))
            .timeout(None)
            .user_agent(concat!("distro/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("creating the HTTP client")?;
        Ok(Fetcher { http, index, dir: cache_root.join("wheels"), policy: Policy::from_env() })
    }

    /// The verified wheel file of `spec` for `platform`: from the cache when its bytes hash to
    /// the pin, else downloaded.
    pub fn fetch(&self, spec: &WheelSpec, platform: &Platform, progress: &Progress) -> Result<PathBuf> {
        let pin = spec.sha256.get(platform).ok_or_else(|| {
            bad_input(format!("wheel `{}`: images/manifest.toml pins no file for {platform}", spec.name))
        })?;
        let path = self.dir.join(format!("{pin}.whl"));
        if path.is_file() {
            if sha256_file(&path)? == *pin {
                return Ok(path);
            }
            progress.info(format!("warning: cached {} does not hash to its name; fetching it again", path.display()));
            std::fs::remove_file(&path)?;
        }
        let json_url = self.index.join(&format!("pypi/{}/json", spec.project))?.to_string();
        let json = retry(self.policy, &format!("GET {json_url}"), || match self.get(&json_url) {
            Err(Failure::Permanent(m)) if m.starts_with("HTTP 404") => Ok(None),
            r => r?.text().map(Some).map_err(transient),
        })?
        .ok_or_else(|| {
            bad_input(format!("wheel `{}`: the index has no project {} ({json_url}: 404)", spec.name, spec.project))
        })?;
        let file = pick_file(&json, &json_url, spec, platform)?;
        let step = progress.step(format!("downloading {}", file.filename));
        let what = format!("{} from {}", file.filename, file.url);
        // A download whose bytes do not hash to the pin is the pin's problem (exit 2), kept
        // aside so that the retry's wrapping does not turn it into a network failure.
        let mut refused = None;
        let fetched = retry(self.policy, &format!("GET {}", file.url), || {
            let resp = self.get(&file.url)?;
            match store_verified(resp, pin, &path, &what) {
                Ok(()) => Ok(()),
                Err(e) if crate::error::is_bad_input(&e) => {
                    let msg = format!("{e:#}");
                    refused = Some(e);
                    Err(Failure::Permanent(msg))
                }
                Err(e) => Err(transient(e)),
            }
        });
        if let Some(e) = refused {
            return Err(e);
        }
        fetched?;
        step.done("sha256 verified");
        Ok(path)
    }

    fn get(&self, url: &str) -> std::result::Result<reqwest::blocking::Response, Failure> {
        let resp = self.http.get(url).send().map_err(transient)?;
        let status = resp.status();
        if status.is_success() {
            Ok(resp)
        } else if status.is_server_error() || status.as_u16() == 429 {
            Err(Failure::Transient(format!("HTTP {status}")))
        } else {
            Err(Failure::Permanent(format!("HTTP {status}")))
        }
    }
}

fn transient(e: impl std::fmt::Display) -> Failure {
    Failure::Transient(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WheelSpec {
        WheelSpec {
            name: "cublas".into(),
            project: "nvidia-cublas".into(),
            version: "13.1.0.3".into(),
            sha256: BTreeMap::from([(Platform::parse("linux/amd64").unwrap(), "a".repeat(64))]),
            loc: Loc::default(),
        }
    }

    const JSON: &str = r#"{"releases": {"13.1.0.3": [
        {"filename": "nvidia_cublas-13.1.0.3-py3-none-manylinux_2_27_x86_64.whl",
         "url": "../../packages/e7/nvidia_cublas-13.1.0.3-py3-none-manylinux_2_27_x86_64.whl",
         "digests": {"sha256": "SHA"}},
        {"filename": "nvidia_cublas-13.1.0.3-py3-none-win_amd64.whl", "url": "w.whl",
         "digests": {"sha256": "bbbb"}}]}}"#;

    #[test]
    fn the_pinned_file_is_picked_and_its_url_resolved() {
        let amd64 = Platform::parse("linux/amd64").unwrap();
        let f = pick_file(
            &JSON.replace("SHA", &"a".repeat(64)),
            "https://pypi.org/pypi/nvidia-cublas/json",
            &spec(),
            &amd64,
        )
        .unwrap();
        assert_eq!(f.url, "https://pypi.org/packages/e7/nvidia_cublas-13.1.0.3-py3-none-manylinux_2_27_x86_64.whl");
        assert_eq!(spec().purl(), "pkg:pypi/nvidia-cublas@13.1.0.3");
    }

    #[test]
    fn a_pin_the_index_does_not_serve_is_one_line_of_bad_input() {
        let amd64 = Platform::parse("linux/amd64").unwrap();
        let e = pick_file(&JSON.replace("SHA", &"c".repeat(64)), "https://pypi.org/pypi/x/json", &spec(), &amd64)
            .unwrap_err();
        assert!(crate::error::is_bad_input(&e));
        let msg = format!("{e:#}");
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains(&format!("pinned sha256 {} is not what the index serves", "a".repeat(64))), "{msg}");
        assert!(msg.contains(&format!("manylinux_2_27_x86_64.whl (sha256 {})", "c".repeat(64))), "{msg}");
        let e = pick_file(r#"{"releases": {}}"#, "https://pypi.org/pypi/x/json", &spec(), &amd64).unwrap_err();
        assert!(format!("{e:#}").contains("no release 13.1.0.3"), "{e:#}");
        let arm64 = Platform::parse("linux/arm64").unwrap();
        let e = pick_file(JSON, "https://pypi.org/pypi/x/json", &spec(), &arm64).unwrap_err();
        assert!(crate::error::is_bad_input(&e) && format!("{e:#}").contains("pins no file for linux/arm64"), "{e:#}");
    }

    #[test]
    fn only_bytes_with_the_pinned_hash_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("w/x.whl");
        let good = crate::hex::hex(&Sha256::digest(b"wheel"));
        let e = store_verified(&b"tampered"[..], &good, &dest, "x.whl").unwrap_err();
        assert!(crate::error::is_bad_input(&e) && format!("{e:#}").contains("not the pinned"), "{e:#}");
        assert!(!dest.exists());
        assert_eq!(std::fs::read_dir(dir.path().join("w")).unwrap().count(), 0, "no temporary file is left");
        store_verified(&b"wheel"[..], &good, &dest, "x.whl").unwrap();
        assert_eq!(sha256_file(&dest).unwrap(), good);
    }

    #[test]
    fn tables_are_validated_with_their_place() {
        let parse = |t: &str| crate::sources::Manifest::parse(Path::new("m.toml"), t);
        let good = format!(
            "[wheels.cublas]\nproject = \"nvidia-cublas\"\nversion = \"13.1.0.3\"\nsha256 = {{ \"linux/amd64\" = \"{}\" }}\n",
            "a".repeat(64)
        );
        let m = parse(&good).unwrap();
        assert_eq!(m.wheels["cublas"].project, "nvidia-cublas");
        assert_eq!(
            table(&m.wheels),
            "WHEEL   PROJECT        VERSION   PLATFORMS\ncublas  nvidia-cublas  13.1.0.3  linux/amd64\n"
        );
        assert_eq!(json(&m.wheels["cublas"])["sha256"]["linux/amd64"], "a".repeat(64));
        let e = format!("{:#}", parse(&good.replace("13.1.0.3", ">=13")).unwrap_err());
        assert!(e.starts_with("m.toml:3:") && e.contains("exact version"), "{e}");
        let e = format!("{:#}", parse(&good.replace("linux/amd64", "linux/s390x")).unwrap_err());
        assert!(e.starts_with("m.toml:4:"), "{e}");
        let e = format!("{:#}", parse(&good.replace(&"a".repeat(64), "abc")).unwrap_err());
        assert!(e.contains("64 lowercase hex"), "{e}");
        let e = format!("{:#}", parse(&good.replace("project", "projet")).unwrap_err());
        assert!(e.starts_with("m.toml:") && e.contains("projet"), "{e}");
    }
}
