//! Building the engine for each platform from the locked workspace and the patched sources.
//!
//! The build runs in a *stage*: a content-synced copy of the git-tracked workspace files under
//! the cache (unchanged files keep their mtime, so cargo's no-op build stays a no-op), plus the
//! patched source trees. The stage exists because of `--locked`: wiring a patched crate in
//! through `[patch.crates-io]` turns its lock entry into a path entry (no source, no checksum),
//! so the committed `Cargo.lock` cannot be used as is, and cargo has no stable way to use a lock
//! file elsewhere than beside the workspace's `Cargo.toml`. So the stage gets a *derived* lock:
//! cargo re-resolves the committed lock with the patches in place, and the derivation is then
//! checked entry by entry: only the patched crates may change (they become path entries); any
//! other difference (a version moved, a package added or dropped) is an error, and a patch
//! cargo did not use is an error. The build itself then runs with `--locked` against the
//! derived lock, which is shipped in the image (`/opt/distro/Cargo.lock`) and feeds the SBOM.
//! Without patches the derived lock is the committed one, byte for byte.
//!
//! Reproducibility: `--remap-path-prefix` on every rustc run (distro is cargo's `RUSTC_WRAPPER`,
//! so proc macros and build scripts get it too; `-ffile-prefix-map` in `CFLAGS`/`CXXFLAGS` for
//! C code built by build scripts) maps the stage, the cargo target dir, `CARGO_HOME` and
//! `RUSTUP_HOME` to fixed names, the patched trees sit inside the stage (cargo hashes paths
//! inside the workspace relative to it, so symbol names do not depend on where the project
//! lives), and the user's RUSTFLAGS are not let in.
use super::def::Binary;
use super::workspace::Workspace;
use crate::error::bad_input;
use crate::fsutil::{write_atomic, write_if_changed};
use crate::oci::digest::KeyHasher;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A patched crate to wire in with `[patch.crates-io]`.
#[derive(Clone, Debug)]
pub struct CratePatch {
    /// The crate's name (as in `Cargo.lock`).
    pub krate: String,
    /// The manifest source it comes from (names the stage directory).
    pub source: String,
    /// The materialised, patched tree of the source.
    pub tree_dir: PathBuf,
    /// Content identity of the tree (its git tree id), for cache keys.
    pub tree_id: String,
    /// Directory of the crate inside the tree (empty when at the root).
    pub subdir: String,
}

/// Set (to the `FROM=TO` remaps, separated by 0x1f) when distro runs as cargo's `RUSTC_WRAPPER`.
pub const WRAPPER_REMAPS_ENV: &str = "DISTRO_RUSTC_WRAPPER_REMAPS";
/// The user's own `RUSTC_WRAPPER` (e.g. sccache), which distro's wrapper calls in turn.
pub const WRAPPER_INNER_ENV: &str = "DISTRO_RUSTC_WRAPPER_INNER";
/// Overrides the program used as the wrapper (default: the running distro executable; tests
/// that drive the library set it to the distro binary).
pub const WRAPPER_EXE_ENV: &str = "DISTRO_RUSTC_WRAPPER_EXE";

fn wrapper_program() -> PathBuf {
    std::env::var_os(WRAPPER_EXE_ENV)
        .map(PathBuf::from)
        .or_else(|| std::env::current_exe().ok())
        .unwrap_or_else(|| PathBuf::from("distro"))
}

/// When distro runs as cargo's `RUSTC_WRAPPER` for a stage build (`argv` = distro, rustc,
/// rustc's arguments), runs rustc with the stage's `--remap-path-prefix` flags added and never
/// returns; otherwise returns `None`. `main` calls this first.
pub fn run_as_rustc_wrapper() -> Option<std::process::ExitCode> {
    use std::os::unix::process::CommandExt;
    let remaps = std::env::var(WRAPPER_REMAPS_ENV).ok()?;
    let mut args = std::env::args_os().skip(1);
    let rustc = args.next()?;
    let mut cmd = match std::env::var_os(WRAPPER_INNER_ENV) {
        Some(inner) => {
            let mut c = Command::new(inner);
            c.arg(&rustc);
            c
        }
        None => Command::new(&rustc),
    };
    cmd.args(args);
    for r in remaps.split('\x1f').filter(|r| !r.is_empty()) {
        cmd.arg(format!("--remap-path-prefix={r}"));
    }
    let err = cmd.exec();
    eprintln!("error: distro (as RUSTC_WRAPPER) could not run {}: {err}", Path::new(&rustc).display());
    Some(std::process::ExitCode::from(1))
}

/// Version of the way the stage runs rustc; bump it when that changes (see `Stage::target_dir`).
pub const BUILD_SCHEME: &str = "v2";

/// Directory in the stage holding patched trees.
const STAGE_SOURCES: &str = ".distro-sources";

/// A prepared build stage.
pub struct Stage {
    /// The stage's workspace root.
    pub dir: PathBuf,
    /// Cargo's target directory for image builds.
    pub target_dir: PathBuf,
    cache: PathBuf,
    patches: Vec<(String, PathBuf)>,
    lock: Vec<u8>,
    manifests_key: String,
}

impl Stage {
    /// Syncs the stage with the workspace and the patched trees, and derives the lock.
    pub fn prepare(ws: &Workspace, cache: &Path, patches: &[CratePatch], progress: &Progress) -> Result<Stage> {
        let dir = cache.join("stage/ws");
        let mut keep: BTreeSet<PathBuf> = BTreeSet::new();
        let mut manifests = KeyHasher::new("manifests-v1");
        for f in &ws.files {
            let src = ws.root.join(f);
            let dst = dir.join(f);
            if f == "Cargo.lock" {
                // Written once below: the committed or the derived lock.
                keep.insert(dst);
                continue;
            }
            sync_file(&src, &dst)?;
            if f == "Cargo.toml" || f.ends_with("/Cargo.toml") {
                manifests.part(f.as_bytes()).part(&fs::read(&src)?);
            }
            keep.insert(dst);
        }
        let mut staged_patches = Vec::new();
        for p in patches {
            let base = dir.join(STAGE_SOURCES).join(&p.source);
            for rel in walk_files(&p.tree_dir)? {
                let dst = base.join(&rel);
                sync_file(&p.tree_dir.join(&rel), &dst)?;
                keep.insert(dst);
            }
            let crate_dir = if p.subdir.is_empty() { base } else { base.join(&p.subdir) };
            manifests.part(p.krate.as_bytes()).part(p.tree_id.as_bytes()).part(p.subdir.as_bytes());
            staged_patches.push((p.krate.clone(), crate_dir));
        }
        remove_stale(&dir, &keep)?;

        let original = fs::read(ws.root.join("Cargo.lock")).map_err(|e| {
            bad_input(format!("{}/Cargo.lock: {e} (the build needs the committed lock)", ws.root.display()))
        })?;
        let mut stage = Stage {
            // The name carries the build scheme's version: how rustc is invoked (the wrapper and
            // its remaps) is not part of cargo's fingerprints, so a new scheme needs a fresh dir.
            target_dir: cache.join(format!("cargo-target-{BUILD_SCHEME}")),
            dir,
            cache: cache.to_path_buf(),
            patches: staged_patches,
            lock: original.clone(),
            manifests_key: String::new(),
        };
        if !stage.patches.is_empty() {
            let mut k = KeyHasher::new("derived-lock-v1");
            k.part(&original);
            for p in patches {
                k.part(p.krate.as_bytes()).part(p.tree_id.as_bytes()).part(p.subdir.as_bytes());
            }
            let cached = cache.join("locks").join(k.finish());
            stage.lock = match fs::read(&cached) {
                Ok(l) => l,
                Err(_) => {
                    let step = progress.step("deriving the lock with patched crates");
                    write_if_changed(&stage.dir.join("Cargo.lock"), &original)?;
                    let out =
                        stage.cargo().args(["metadata", "--format-version", "1"]).stdout(Stdio::null()).output()?;
                    if !out.status.success() {
                        bail!(
                            "cargo could not resolve the workspace with the patched crates: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        );
                    }
                    let derived = fs::read(stage.dir.join("Cargo.lock"))?;
                    let names: Vec<&str> = patches.iter().map(|p| p.krate.as_str()).collect();
                    check_derived_lock(&original, &derived, &names)?;
                    write_atomic(&cached, &derived)?;
                    step.done("only the patched crates changed");
                    derived
                }
            };
        }
        write_if_changed(&stage.dir.join("Cargo.lock"), &stage.lock)?;
        manifests.part(&stage.lock);
        stage.manifests_key = manifests.finish();
        Ok(stage)
    }

    /// The lock the build uses (the committed one, or the derived one with patches).
    pub fn lock(&self) -> &[u8] {
        &self.lock
    }

    /// A cargo command in the stage with the reproducibility settings and the patches.
    fn cargo(&self) -> Command {
        let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        c.current_dir(&self.dir);
        for (krate, path) in &self.patches {
            c.arg("--config").arg(format!("patch.crates-io.{krate}.path={}", toml_string(&path.to_string_lossy())));
        }
        for v in ["RUSTFLAGS", "CARGO_BUILD_RUSTFLAGS", "CARGO_ENCODED_RUSTFLAGS", "CARGO_BUILD_TARGET"] {
            c.env_remove(v);
        }
        c.env("CARGO_TARGET_DIR", &self.target_dir);
        let mut remaps = vec![
            (self.dir.clone(), "/build".to_string()),
            (self.target_dir.clone(), "/target".to_string()),
            (cargo_home(), "/cargo".to_string()),
        ];
        if let Some(r) = rustup_home() {
            remaps.push((r, "/rustup".to_string()));
        }
        // Every rustc run, for the target and for the host (proc macros and build scripts, which
        // RUSTFLAGS would not reach under --target), goes through distro as RUSTC_WRAPPER, which
        // adds the remaps: a proc macro's crate hash depends on its OUT_DIR path, and dependents
        // record that hash, so unremapped host artifacts would make the engine path-dependent.
        let maps: Vec<String> = remaps.iter().map(|(from, to)| format!("{}={to}", from.display())).collect();
        c.env(WRAPPER_REMAPS_ENV, maps.join("\x1f"));
        if let Some(inner) = std::env::var_os("RUSTC_WRAPPER").filter(|w| !w.is_empty()) {
            c.env(WRAPPER_INNER_ENV, inner);
        }
        c.env("RUSTC_WRAPPER", wrapper_program());
        // The same for C and C++ compiled by build scripts (cc-rs reads CFLAGS/CXXFLAGS):
        // `-ffile-prefix-map` covers both debug info and `__FILE__`.
        let c_maps: Vec<String> =
            remaps.iter().map(|(from, to)| format!("-ffile-prefix-map={}={to}", from.display())).collect();
        for var in ["CFLAGS", "CXXFLAGS"] {
            let mut v = std::env::var(var).unwrap_or_default();
            for m in &c_maps {
                v = format!("{v} {m}");
            }
            c.env(var, v.trim());
        }
        c
    }

    /// Refuses, before cargo runs, a platform this machine cannot build for: its Rust target's
    /// standard library (in the sysroot of the rustc cargo would use here) or its cross linker
    /// is missing. Otherwise cargo fails deep in its output (`can't find crate for core`).
    fn check_cross_tools(&self, platforms: &[Platform], host: Option<&Platform>) -> Result<()> {
        let foreign: Vec<&Platform> =
            platforms.iter().filter(|p| host.is_none_or(|h| h.architecture != p.architecture)).collect();
        if foreign.is_empty() {
            return Ok(());
        }
        let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
        let sysroot = Command::new(rustc)
            .args(["--print", "sysroot"])
            .current_dir(&self.dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
        let path = std::env::var_os("PATH").unwrap_or_default();
        for p in foreign {
            let var = format!("CARGO_TARGET_{}_LINKER", p.rust_target().to_uppercase().replace('-', "_"));
            let linker = std::env::var(&var).unwrap_or_else(|_| p.cross_linker().to_owned());
            let missing = missing_cross_tools(p, sysroot.as_deref(), &linker, &path);
            if !missing.is_empty() {
                return Err(bad_input(format!(
                    "building for {p} on this machine needs {}; install them, or build for this machine only with --platform {}",
                    missing.join(" and "),
                    host.map_or("linux/amd64".to_owned(), |h| h.to_string())
                )));
            }
        }
        Ok(())
    }

    /// Builds `binaries` for `platforms` in one cargo run; returns each binary's path by
    /// (platform, binary name). `revision` reaches the engine as `ENGINE_REVISION` (what
    /// `engine info` prints).
    pub fn build(
        &self,
        platforms: &[Platform],
        binaries: &[Binary],
        revision: &str,
        progress: &Progress,
    ) -> Result<BTreeMap<(Platform, String), PathBuf>> {
        let mut c = self.cargo();
        c.env("ENGINE_REVISION", revision);
        c.args(["build", "--release", "--locked"]);
        let packages: BTreeSet<&str> = binaries.iter().map(|b| b.package.as_str()).collect();
        for p in packages {
            c.args(["-p", p]);
        }
        for b in binaries {
            c.args(["--bin", b.bin_name()]);
        }
        let host = Platform::host();
        self.check_cross_tools(platforms, host.as_ref())?;
        for p in platforms {
            c.args(["--target", p.rust_target()]);
            let var = format!("CARGO_TARGET_{}_LINKER", p.rust_target().to_uppercase().replace('-', "_"));
            if host.as_ref().map(|h| h.architecture != p.architecture).unwrap_or(true)
                && std::env::var_os(&var).is_none()
            {
                c.env(var, p.cross_linker());
            }
        }
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            c.args(["--color", "never"]);
        }
        let names: Vec<String> = platforms.iter().map(|p| p.to_string()).collect();
        let step = progress.step(format!(
            "building {} for {}",
            binaries.iter().map(|b| b.bin_name()).collect::<Vec<_>>().join(", "),
            names.join(", ")
        ));
        let status = c.stdin(Stdio::null()).status().context("running cargo")?;
        if !status.success() {
            bail!("cargo build failed ({status}); see the cargo output above");
        }
        step.done("done");
        let mut out = BTreeMap::new();
        for p in platforms {
            for b in binaries {
                let path = self.target_dir.join(p.rust_target()).join("release").join(b.bin_name());
                if !path.is_file() {
                    bail!("cargo did not produce {}", path.display());
                }
                out.insert((p.clone(), b.bin_name().to_string()), path);
            }
        }
        Ok(out)
    }

    /// `cargo metadata` for `platform` (dependency graph and licenses, for the SBOM), cached by
    /// the stage's manifests and lock.
    pub fn metadata(&self, platform: &Platform) -> Result<Value> {
        let mut k = KeyHasher::new("metadata-v1");
        k.part(self.manifests_key.as_bytes()).part(platform.rust_target().as_bytes());
        let cached = self.cache.join("metadata").join(format!("{}.json", k.finish()));
        let bytes = match fs::read(&cached) {
            Ok(b) => b,
            Err(_) => {
                let out = self
                    .cargo()
                    .args([
                        "metadata",
                        "--format-version",
                        "1",
                        "--locked",
                        "--filter-platform",
                        platform.rust_target(),
                    ])
                    .output()
                    .context("running cargo metadata")?;
                if !out.status.success() {
                    bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr).trim());
                }
                write_atomic(&cached, &out.stdout)?;
                out.stdout
            }
        };
        serde_json::from_slice(&bytes).context("parsing cargo metadata")
    }
}

/// Checks that `derived` differs from `original` only in the entries of `patched` crates, each
/// of which must now be a path entry (a patch cargo did not use is an error).
pub fn check_derived_lock(original: &[u8], derived: &[u8], patched: &[&str]) -> Result<()> {
    let parse = |b: &[u8], what: &str| -> Result<BTreeMap<(String, String), toml::Table>> {
        let t: toml::Table =
            toml::from_str(std::str::from_utf8(b)?).with_context(|| format!("parsing the {what} lock"))?;
        let mut m = BTreeMap::new();
        for p in t.get("package").and_then(|p| p.as_array()).cloned().unwrap_or_default() {
            let p = p.as_table().cloned().unwrap_or_default();
            let name = p.get("name").and_then(|v| v.as_str()).unwrap_or("").to_string();
            let version = p.get("version").and_then(|v| v.as_str()).unwrap_or("").to_string();
            m.insert((name, version), p);
        }
        Ok(m)
    };
    let (o, d) = (parse(original, "committed")?, parse(derived, "derived")?);
    let is_patched = |name: &str| patched.contains(&name);
    let deps_without_patched = |t: &toml::Table| -> Vec<String> {
        t.get("dependencies")
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str())
                    .filter(|s| !is_patched(s.split(' ').next().unwrap_or("")))
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut problems = Vec::new();
    for ((name, version), entry) in &o {
        if is_patched(name) {
            continue;
        }
        match d.get(&(name.clone(), version.clone())) {
            None => problems.push(format!("{name} {version} left the lock")),
            Some(e) => {
                let mut a = entry.clone();
                let mut b = e.clone();
                a.remove("dependencies");
                b.remove("dependencies");
                if a != b || deps_without_patched(entry) != deps_without_patched(e) {
                    problems.push(format!("{name} {version} changed"));
                }
            }
        }
    }
    for (name, version) in d.keys() {
        if !is_patched(name) && !o.contains_key(&(name.clone(), version.clone())) {
            problems.push(format!("{name} {version} was added"));
        }
    }
    for p in patched {
        let used = d.iter().any(|((n, _), e)| n == p && !e.contains_key("source"));
        if !used {
            problems.push(format!("the patched {p} was not used (its version does not satisfy the workspace's requirement, or nothing depends on it)"));
        }
    }
    if !problems.is_empty() {
        return Err(bad_input(format!(
            "patching crates changes Cargo.lock beyond the patched crates: {}; update the workspace's Cargo.lock (or the patch) first",
            problems.join("; ")
        )));
    }
    Ok(())
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo"))
}

fn rustup_home() -> Option<PathBuf> {
    std::env::var_os("RUSTUP_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".rustup")))
}

/// Copies `src` to `dst` when their contents differ (keeping the executable bit), so untouched
/// files keep their mtime.
fn sync_file(src: &Path, dst: &Path) -> Result<()> {
    let meta = fs::symlink_metadata(src).with_context(|| format!("reading {}", src.display()))?;
    if meta.file_type().is_symlink() {
        let target = fs::read_link(src)?;
        if fs::read_link(dst).ok().as_ref() != Some(&target) {
            let _ = fs::remove_file(dst);
            fs::create_dir_all(dst.parent().expect("has parent"))?;
            std::os::unix::fs::symlink(&target, dst)?;
        }
        return Ok(());
    }
    let bytes = fs::read(src).with_context(|| format!("reading {}", src.display()))?;
    if fs::symlink_metadata(dst).is_ok_and(|m| m.file_type().is_symlink()) {
        fs::remove_file(dst)?;
    }
    write_if_changed(dst, &bytes)?;
    let mode = if meta.permissions().mode() & 0o111 != 0 { 0o755 } else { 0o644 };
    if fs::metadata(dst)?.permissions().mode() & 0o777 != mode {
        fs::set_permissions(dst, fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// Every file under `dir` (relative paths), skipping `.git` (and a top-level `target`, which
/// is never a tracked file and must never be cleaned as if it were one).
pub fn walk_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        for e in fs::read_dir(dir.join(&rel)).with_context(|| format!("reading {}", dir.join(&rel).display()))? {
            let e = e?;
            let name = e.file_name();
            if name == ".git" || (rel.as_os_str().is_empty() && name == "target") {
                continue;
            }
            let r = rel.join(&name);
            if e.file_type()?.is_dir() { todo.push(r) } else { out.push(r) }
        }
    }
    out.sort();
    Ok(out)
}

/// Removes files in the stage that are no longer tracked (then empty directories).
fn remove_stale(dir: &Path, keep: &BTreeSet<PathBuf>) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for rel in walk_files(dir)? {
        let p = dir.join(&rel);
        if !keep.contains(&p) {
            fs::remove_file(&p).with_context(|| format!("removing stale {}", p.display()))?;
        }
    }
    Ok(())
}

/// What building for `p` lacks here: the Rust target's standard library under `sysroot`, and
/// the `linker` on `path` (a path or a name searched in `path`), each with how to install it.
fn missing_cross_tools(p: &Platform, sysroot: Option<&Path>, linker: &str, path: &std::ffi::OsStr) -> Vec<String> {
    let mut missing = Vec::new();
    let target = p.rust_target();
    if sysroot.is_none_or(|s| !s.join("lib/rustlib").join(target).join("lib").is_dir()) {
        missing.push(format!("the Rust target {target} (`rustup target add {target}`)"));
    }
    let found = if linker.contains('/') {
        Path::new(linker).is_file()
    } else {
        std::env::split_paths(path).any(|d| d.join(linker).is_file())
    };
    if !found {
        let package = linker.trim_end_matches("-gcc").replace('_', "-");
        missing.push(format!("the linker {linker} (Debian's gcc-{package})"));
    }
    missing
}

#[cfg(test)]
mod tests {
    #[test]
    fn missing_cross_tools_are_named_with_how_to_install_them() {
        let arm = Platform::parse("linux/arm64").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (sysroot, bin) = (dir.path().join("sysroot"), dir.path().join("bin"));
        let path = std::ffi::OsString::from(bin.as_os_str());
        let missing = missing_cross_tools(&arm, Some(&sysroot), "aarch64-linux-gnu-gcc", &path);
        assert_eq!(
            missing,
            [
                "the Rust target aarch64-unknown-linux-gnu (`rustup target add aarch64-unknown-linux-gnu`)",
                "the linker aarch64-linux-gnu-gcc (Debian's gcc-aarch64-linux-gnu)"
            ]
        );
        fs::create_dir_all(sysroot.join("lib/rustlib/aarch64-unknown-linux-gnu/lib")).unwrap();
        fs::create_dir_all(&bin).unwrap();
        fs::write(bin.join("aarch64-linux-gnu-gcc"), b"").unwrap();
        assert!(missing_cross_tools(&arm, Some(&sysroot), "aarch64-linux-gnu-gcc", &path).is_empty());
    }

    use super::*;

    const ORIGINAL: &str = r#"version = 4

[[package]]
name = "a"
version = "1.0.0"
source = "registry+https://github.com/rust-lang/crates.io-index"
checksum = "aa"
dependencies = ["b"]

[[package]]
name = "b"
version = "2.0.0"
source = "registry+https://github.com/rust-lang/crates.io-index"
checksum = "bb"
"#;

    #[test]
    fn derived_lock_may_only_change_patched_crates() {
        let patched_b = ORIGINAL
            .replace("source = \"registry+https://github.com/rust-lang/crates.io-index\"\nchecksum = \"bb\"\n", "");
        check_derived_lock(ORIGINAL.as_bytes(), patched_b.as_bytes(), &["b"]).unwrap();
        // The patch was not used: b still comes from the registry.
        let e = check_derived_lock(ORIGINAL.as_bytes(), ORIGINAL.as_bytes(), &["b"]).unwrap_err();
        assert!(format!("{e}").contains("not used"), "{e}");
        // Another crate moved.
        let moved = patched_b.replace("checksum = \"aa\"", "checksum = \"a2\"");
        let e = check_derived_lock(ORIGINAL.as_bytes(), moved.as_bytes(), &["b"]).unwrap_err();
        assert!(format!("{e}").contains("a 1.0.0 changed"), "{e}");
        // A package appeared.
        let added = format!("{patched_b}\n[[package]]\nname = \"c\"\nversion = \"0.1.0\"\n");
        let e = check_derived_lock(ORIGINAL.as_bytes(), added.as_bytes(), &["b"]).unwrap_err();
        assert!(format!("{e}").contains("c 0.1.0 was added"), "{e}");
    }
}
