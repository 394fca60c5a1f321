//! Crate sources, obtained with Cargo itself (which verifies the registry's checksum) and
//! imported into a git repository with a deterministic commit, so patches apply with `git am`
//! exactly as they do for git sources.
//!
//! Cargo runs in a throwaway project: `cargo generate-lockfile` resolves the version and gives
//! the checksum, `cargo vendor --versioned-dirs --respect-source-config` downloads and unpacks
//! the crate (a mirror or source replacement in Cargo's configuration is honoured). Registry
//! names come from Cargo's configuration; distro names no registry host itself.

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::process::Command;

use super::cache::{Cache, Repo};
use super::manifest::CrateSpec;
use crate::error::bad_input;
use crate::git::Git;
use crate::hex::is_sha256;
use crate::retry;

/// A resolved crate release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    /// The exact version.
    pub version: String,
    /// SHA-256 of the `.crate` file, from the registry index (Cargo verified the download).
    pub checksum: String,
}

/// The cache repository key for a crate (per registry, since two registries may differ).
pub fn repo_key(spec: &CrateSpec) -> String {
    match &spec.registry {
        Some(r) => format!("crate-{}-{r}", spec.name),
        None => format!("crate-{}", spec.name),
    }
}

/// Where the import commit of one release is kept in the cache repository.
fn import_ref(version: &str, checksum: &str) -> String {
    format!("refs/distro/crates/{version}-{checksum}")
}

/// Writes a throwaway Cargo project depending on `spec.name` with `requirement`.
fn scratch_project(dir: &Path, spec: &CrateSpec, requirement: &str) -> Result<()> {
    let mut dep = toml_edit::InlineTable::new();
    dep.insert("version", requirement.into());
    dep.insert("default-features", false.into());
    if let Some(r) = &spec.registry {
        dep.insert("registry", r.as_str().into());
    }
    let mut doc = toml_edit::DocumentMut::new();
    doc["package"]["name"] = toml_edit::value("distro-crate-fetch");
    doc["package"]["version"] = toml_edit::value("0.0.0");
    doc["package"]["edition"] = toml_edit::value("2021");
    doc["package"]["publish"] = toml_edit::value(false);
    doc["dependencies"][spec.name.as_str()] = toml_edit::value(dep);
    // Its own workspace, so no Cargo.toml above the cache can adopt it; resolver 2 picks the
    // newest release whatever Rust version it declares.
    doc["workspace"]["resolver"] = toml_edit::value("2");
    fs::create_dir_all(dir.join("src"))?;
    fs::write(dir.join("src").join("lib.rs"), "")?;
    fs::write(dir.join("Cargo.toml"), doc.to_string())?;
    Ok(())
}

fn is_permanent(stderr: &str) -> bool {
    const PERMANENT: &[&str] = &[
        "failed to select a version",
        "no matching package named",
        "could not find `",
        "is yanked",
        "no such registry",
        "registry index was not found",
        "failed to parse manifest",
        "checksum for",
    ];
    PERMANENT.iter().any(|p| stderr.contains(p))
}

/// Runs `cargo SUBCOMMAND --manifest-path PROJECT/Cargo.toml ARGS` for the scratch `project`,
/// with retries; permanent failures are bad input.
///
/// Cargo runs in the project root (`cwd`), so the project's `rust-toolchain.toml` picks the same
/// Cargo on every machine (how it unpacks crates decides the tree ids in the lock), and the
/// project's `.cargo/config.toml` (mirrors, source replacement) applies.
pub(super) fn cargo(cwd: &Path, project: &Path, subcommand: &str, args: &[&str], what: &str) -> Result<()> {
    let cwd = if cwd.is_dir() { cwd } else { project };
    let manifest = project.join("Cargo.toml");
    let result = retry::retry(retry::Policy::from_env(), what, || {
        let mut cmd = Command::new("cargo");
        cmd.current_dir(cwd)
            .arg(subcommand)
            .arg("--manifest-path")
            .arg(&manifest)
            .args(args)
            .env("CARGO_TERM_COLOR", "never")
            .env_remove("CARGO_TARGET_DIR");
        retry::command_attempt(&mut cmd, is_permanent)
    });
    result.map_err(|e| {
        let text = e.to_string();
        if is_permanent(&text) { bad_input(text) } else { e }
    })
}

#[derive(Deserialize)]
struct CargoLock {
    #[serde(default)]
    package: Vec<LockedPackage>,
}

#[derive(Deserialize)]
struct LockedPackage {
    name: String,
    version: String,
    source: Option<String>,
    checksum: Option<String>,
}

/// Resolves the newest release of `spec.name` matching `requirement` (Cargo's syntax:
/// `*`, `0.19`, `=0.19.10`, ...). Yanked and pre-release versions are skipped as Cargo does.
/// `root` is the project root Cargo runs in.
pub fn resolve(cache: &Cache, root: &Path, spec: &CrateSpec, requirement: &str) -> Result<Release> {
    let scratch = cache.scratch()?;
    resolve_in(root, scratch.path(), spec, requirement)
}

fn resolve_in(root: &Path, dir: &Path, spec: &CrateSpec, requirement: &str) -> Result<Release> {
    scratch_project(dir, spec, requirement)?;
    eprintln!("distro: resolving crate {} {requirement}", spec.name);
    cargo(root, dir, "generate-lockfile", &["--quiet"], &format!("resolving crate {} {requirement}", spec.name))?;
    let text = fs::read_to_string(dir.join("Cargo.lock")).context("reading the scratch Cargo.lock")?;
    let lock: CargoLock = toml::from_str(&text).context("parsing the scratch Cargo.lock")?;
    let pkg = lock
        .package
        .into_iter()
        .find(|p| p.name == spec.name && p.source.is_some())
        .ok_or_else(|| anyhow!("cargo did not resolve crate {}", spec.name))?;
    let checksum = pkg
        .checksum
        .filter(|c| is_sha256(c))
        .ok_or_else(|| anyhow!("the registry gave no SHA-256 checksum for crate {} {}", spec.name, pkg.version))?;
    Ok(Release { version: pkg.version, checksum })
}

#[derive(Deserialize)]
struct VendorChecksums {
    package: Option<String>,
}

/// Makes sure release `version` of the crate is imported in `repo` and returns the import
/// commit and the release. With `expected_checksum` (from the lock) a registry that now serves
/// different bytes is an error. `root` is the project root Cargo runs in.
pub fn import(
    cache: &Cache,
    root: &Path,
    repo: &Repo,
    spec: &CrateSpec,
    version: &str,
    expected_checksum: Option<&str>,
) -> Result<(String, Release)> {
    if let Some(sum) = expected_checksum {
        let r = import_ref(version, sum);
        if let Ok(commit) = repo.git.rev_parse(&r) {
            return Ok((commit, Release { version: version.to_owned(), checksum: sum.to_owned() }));
        }
    }
    let scratch = cache.scratch()?;
    let release = resolve_in(root, scratch.path(), spec, &format!("={version}"))?;
    if let Some(sum) = expected_checksum
        && sum != release.checksum
    {
        bail!(
            "crate {} {version}: the registry's checksum is {} but the lock records {sum}; the registry (or Cargo's source replacement) serves different bytes than when the lock was written",
            spec.name,
            release.checksum
        );
    }
    let r = import_ref(version, &release.checksum);
    if let Ok(commit) = repo.git.rev_parse(&r) {
        return Ok((commit, release));
    }
    eprintln!("distro: downloading crate {} {version}", spec.name);
    let vendor = scratch.path().join("vendor");
    let vendor_arg = vendor.to_str().context("non-UTF-8 cache path")?;
    cargo(
        root,
        scratch.path(),
        "vendor",
        &["--quiet", "--versioned-dirs", "--respect-source-config", vendor_arg],
        &format!("downloading crate {} {version}", spec.name),
    )?;
    let unpacked = vendor.join(format!("{}-{version}", spec.name));
    let sums_path = unpacked.join(".cargo-checksum.json");
    let sums: VendorChecksums =
        serde_json::from_slice(&fs::read(&sums_path).with_context(|| format!("reading {}", sums_path.display()))?)
            .with_context(|| format!("parsing {}", sums_path.display()))?;
    if sums.package.as_deref() != Some(release.checksum.as_str()) {
        bail!(
            "crate {} {version}: cargo vendor unpacked a crate with checksum {:?}, expected {}",
            spec.name,
            sums.package,
            release.checksum
        );
    }
    // The checksum file is Cargo's vendoring metadata, not part of the crate.
    fs::remove_file(&sums_path)?;
    let commit = commit_directory(repo, &unpacked, spec, &release)?;
    repo.git.run(["update-ref", &r, &commit])?;
    Ok((commit, release))
}

/// Commits every file of `dir` as a root commit with the fixed identity and date, so the
/// import of a release has the same id everywhere.
fn commit_directory(repo: &Repo, dir: &Path, spec: &CrateSpec, release: &Release) -> Result<String> {
    let index = dir.parent().unwrap_or(dir).join("distro-import.index");
    let git_dir = format!("--git-dir={}", repo.git_dir().display());
    let env: [(&str, &OsStr); 1] = [("GIT_INDEX_FILE", index.as_os_str())];
    let in_dir = Git::new(dir);
    in_dir.run_env([git_dir.as_str(), "--work-tree=.", "add", "--all", "--force", "--", "."], &env)?;
    let tree = in_dir.run_env([git_dir.as_str(), "write-tree"], &env)?;
    let message =
        format!("Import crate {} {}\n\nsha256 of the .crate file: {}\n", spec.name, release.version, release.checksum);
    repo.git.run(["commit-tree", &tree, "-m", &message])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(registry: Option<&str>) -> CrateSpec {
        CrateSpec {
            name: "cudarc".into(),
            version: None,
            version_loc: Default::default(),
            tracking_req: "*".into(),
            registry: registry.map(str::to_owned),
        }
    }

    #[test]
    fn scratch_project_pins_the_requirement() {
        let dir = tempfile::tempdir().unwrap();
        scratch_project(dir.path(), &spec(Some("mirror")), "=0.19.10").unwrap();
        let text = fs::read_to_string(dir.path().join("Cargo.toml")).unwrap();
        let doc: toml::Table = toml::from_str(&text).unwrap();
        let dep = &doc["dependencies"]["cudarc"];
        assert_eq!(dep["version"].as_str(), Some("=0.19.10"));
        assert_eq!(dep["registry"].as_str(), Some("mirror"));
        assert_eq!(dep["default-features"].as_bool(), Some(false));
        assert!(doc.contains_key("workspace"));
    }

    #[test]
    fn keys_and_refs() {
        assert_eq!(repo_key(&spec(None)), "crate-cudarc");
        assert_eq!(repo_key(&spec(Some("m"))), "crate-cudarc-m");
        assert_eq!(import_ref("1.0.0", "ab"), "refs/distro/crates/1.0.0-ab");
    }

    #[test]
    fn resolution_failures_that_retrying_cannot_fix() {
        assert!(is_permanent("error: failed to select a version for the requirement `x = \"=9.9.9\"`"));
        assert!(is_permanent("error: no matching package named `nope` found"));
        assert!(!is_permanent("error: failed to download from `https://h/x`: timed out"));
    }
}
