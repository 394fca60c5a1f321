//! The pins of an image build: what the pinned upstream sources (the `sources` folder)
//! contribute to it: the build's lock (the lock of record plus any `--patch`/`--source`
//! override), the patch files it applied, the patched crates to wire into the engine build, the
//! patched trees, and annotations with the pins.
use super::engine_build::CratePatch;
use super::workspace::Workspace;
use crate::error::bad_input;
use crate::progress::Progress;
use crate::sources::{
    Cache, ExtraPatch, FetchedSource, Lock, Manifest, Origin, Overrides, SourceOverride, lock_for_run, materialise,
};
use anyhow::{Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Prefix of the annotations that carry upstream pins.
pub const PIN_ANNOTATION_PREFIX: &str = "io.github.llm-distro.source.";

/// What the pinned sources contribute to a build (from the sources library: the build's
/// manifest lock, the patch files it applied, the patched crates to wire in, the pins).
#[derive(Clone, Debug, Default)]
pub struct PinnedSources {
    /// Text of the build's manifest lock (`/opt/distro/manifest.lock`), when there is a manifest.
    pub lock_text: Option<String>,
    /// Applied patch files: path relative to `patches/` and bytes (`/opt/distro/patches/`).
    pub patch_files: Vec<(String, Vec<u8>)>,
    /// Patched crates wired into the engine build.
    pub crate_patches: Vec<CratePatch>,
    /// Annotations describing each source's pin (`io.github.llm-distro.source.NAME.*`).
    pub annotations: BTreeMap<String, String>,
    /// The materialised, patched tree of each source (read only), for `[[source_tree]]`.
    pub trees: BTreeMap<String, PathBuf>,
}

/// Resolves the build's sources. Without `images/manifest.toml` there is nothing to add (and
/// `--patch`/`--source` are errors).
pub fn collect(ws: &Workspace, patches: &[String], overrides: &[String], progress: &Progress) -> Result<PinnedSources> {
    let manifest_path = ws.root.join(crate::sources::DEFAULT_MANIFEST);
    if !manifest_path.exists() {
        if let Some(p) = patches.first().or(overrides.first()) {
            return Err(bad_input(format!(
                "{p:?}: --patch and --source need {}, and this checkout has none",
                manifest_path.display()
            )));
        }
        return Ok(PinnedSources::default());
    }
    let manifest = Manifest::load(&manifest_path)?;
    let lock = Lock::load(&manifest.lock_path())?;
    let overrides = Overrides {
        sources: overrides
            .iter()
            .map(|s| s.parse::<SourceOverride>().map_err(|e| bad_input(format!("--source {s:?}: {e}"))))
            .collect::<Result<_>>()?,
        extra_patches: patches
            .iter()
            .map(|s| s.parse::<ExtraPatch>().map_err(|e| bad_input(format!("--patch {s:?}: {e}"))))
            .collect::<Result<_>>()?,
    };
    let cache = Cache::from_env()?;
    let step = progress.step("resolving the pinned sources");
    let build_lock = lock_for_run(&manifest, lock.as_ref(), &[], &overrides, &cache)?;
    let trees = materialise(&build_lock, &manifest.root, &cache)?;
    step.done(format!("{} sources", trees.len()));

    let mut input = PinnedSources { lock_text: Some(build_lock.render()), ..Default::default() };
    for (name, locked) in &build_lock.sources {
        let p = format!("{PIN_ANNOTATION_PREFIX}{name}.");
        input.annotations.insert(format!("{p}pin"), locked.pin().to_string());
        input.annotations.insert(format!("{p}tree"), locked.tree.clone());
        input.annotations.insert(format!("{p}patches"), locked.patches.len().to_string());
        if locked.overridden {
            input.annotations.insert(format!("{p}overridden"), "true".into());
        }
        for patch in &locked.patches {
            let bytes = match &patch.file {
                Some(f) => std::fs::read(manifest.root.join(f)).ok(),
                None => None,
            }
            .or_else(|| cache.stored_patch(&patch.sha256))
            .ok_or_else(|| {
                anyhow::anyhow!("source {name}: patch {} is neither in the project nor in the cache", patch.entry)
            })?;
            // The patch's own file name (project file, or a `--patch` path); a ref has none.
            let named = patch.file.as_deref().or(Some(patch.entry.as_str()).filter(|e| e.ends_with(".patch")));
            let mut file_name = named
                .and_then(|f| Path::new(f).file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| format!("{}.patch", &patch.sha256[..12]));
            if input.patch_files.iter().any(|(p, _)| *p == format!("{name}/{file_name}")) {
                file_name = format!("{}-{file_name}", &patch.sha256[..12]);
            }
            input.patch_files.push((format!("{name}/{file_name}"), bytes));
        }
    }
    let lock_text = std::fs::read_to_string(ws.root.join("Cargo.lock")).unwrap_or_default();
    let in_lock = cargo_lock_packages(&lock_text);
    for t in &trees {
        input.trees.insert(t.name.clone(), t.dir.clone());
        input.crate_patches.extend(crate_patches(t, &build_lock, &in_lock, progress)?);
    }
    Ok(input)
}

/// (name -> [(version, checksum)]) of the crates.io packages in a `Cargo.lock`.
fn cargo_lock_packages(text: &str) -> BTreeMap<String, Vec<(String, Option<String>)>> {
    let mut out: BTreeMap<String, Vec<(String, Option<String>)>> = BTreeMap::new();
    let Ok(t) = text.parse::<toml::Table>() else { return out };
    for p in t.get("package").and_then(|p| p.as_array()).into_iter().flatten() {
        let (Some(n), Some(v)) = (p.get("name").and_then(|x| x.as_str()), p.get("version").and_then(|x| x.as_str()))
        else {
            continue;
        };
        if p.get("source").and_then(|s| s.as_str()).is_some_and(|s| s.starts_with("registry+")) {
            out.entry(n.into())
                .or_default()
                .push((v.into(), p.get("checksum").and_then(|c| c.as_str()).map(String::from)));
        }
    }
    out
}

/// The crates of one source tree to wire in with `[patch.crates-io]`.
///
/// An unpatched crate source is not wired: the build uses the crates.io package, which must then
/// be exactly the pinned one (same version and checksum in `Cargo.lock`). A patched crate, or
/// any crate from a git source, is wired from its materialised tree. Crates the workspace does
/// not depend on are recorded in the lock only.
fn crate_patches(
    t: &FetchedSource,
    lock: &Lock,
    in_lock: &BTreeMap<String, Vec<(String, Option<String>)>>,
    progress: &Progress,
) -> Result<Vec<CratePatch>> {
    let locked = &lock.sources[&t.name];
    let mut out = Vec::new();
    match &t.origin {
        Origin::Crate { name, version, checksum, .. } => {
            let Some(versions) = in_lock.get(name) else {
                progress.info(format!(
                    "source {}: crate {name} is not a dependency of the workspace; recorded in the lock only",
                    t.name
                ));
                return Ok(out);
            };
            if locked.patches.is_empty() && !locked.overridden {
                let pinned = versions.iter().any(|(v, c)| v == version && c.as_deref() == Some(checksum.as_str()));
                if !pinned {
                    let have: Vec<&str> = versions.iter().map(|(v, _)| v.as_str()).collect();
                    return Err(bad_input(format!(
                        "Cargo.lock has {name} {} but images/manifest.lock pins {name} {version}: run `cargo update -p {name} --precise {version}` (or `distro bump`)",
                        have.join(", ")
                    )));
                }
                return Ok(out);
            }
            out.push(CratePatch {
                krate: name.clone(),
                source: t.name.clone(),
                tree_dir: t.dir.clone(),
                tree_id: t.tree.clone(),
                subdir: String::new(),
            });
        }
        Origin::Git { .. } => {
            for (krate, subdir) in crates_in_tree(&t.dir)? {
                if in_lock.contains_key(&krate) {
                    out.push(CratePatch {
                        krate,
                        source: t.name.clone(),
                        tree_dir: t.dir.clone(),
                        tree_id: t.tree.clone(),
                        subdir,
                    });
                }
            }
            if out.is_empty() {
                progress.info(format!(
                    "source {}: no crate of its tree is a dependency of the workspace; recorded in the lock only",
                    t.name
                ));
            }
        }
    }
    Ok(out)
}

/// The packages of a source tree: its root package and its workspace members (name, subdir).
fn crates_in_tree(dir: &Path) -> Result<Vec<(String, String)>> {
    let read = |sub: &str| -> Result<Option<toml::Table>> {
        let p = dir.join(sub).join("Cargo.toml");
        match std::fs::read_to_string(&p) {
            Ok(t) => Ok(Some(t.parse::<toml::Table>().with_context(|| format!("parsing {}", p.display()))?)),
            Err(_) => Ok(None),
        }
    };
    let Some(root) = read("")? else { return Ok(Vec::new()) };
    let mut out = BTreeSet::new();
    if let Some(n) = root.get("package").and_then(|p| p.get("name")).and_then(|n| n.as_str()) {
        out.insert((n.to_string(), String::new()));
    }
    let members =
        root.get("workspace").and_then(|w| w.get("members")).and_then(|m| m.as_array()).cloned().unwrap_or_default();
    for m in members.iter().filter_map(|m| m.as_str()) {
        // Plain paths and one trailing `*` (`crates/*`), the forms workspaces use.
        let subs: Vec<String> = match m.strip_suffix("/*") {
            Some(parent) => std::fs::read_dir(dir.join(parent))
                .map(|rd| {
                    rd.filter_map(|e| e.ok()).map(|e| format!("{parent}/{}", e.file_name().to_string_lossy())).collect()
                })
                .unwrap_or_default(),
            None => vec![m.to_string()],
        };
        for sub in subs {
            if let Some(t) = read(&sub)?
                && let Some(n) = t.get("package").and_then(|p| p.get("name")).and_then(|n| n.as_str())
            {
                out.insert((n.to_string(), sub));
            }
        }
    }
    Ok(out.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_root_and_member_crates() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("Cargo.toml"), "[workspace]\nmembers = [\"core\", \"crates/*\"]\n").unwrap();
        for (sub, name) in [("core", "x-core"), ("crates/a", "x-a"), ("crates/b", "x-b")] {
            std::fs::create_dir_all(d.path().join(sub)).unwrap();
            std::fs::write(d.path().join(sub).join("Cargo.toml"), format!("[package]\nname = \"{name}\"\n")).unwrap();
        }
        let found = crates_in_tree(d.path()).unwrap();
        let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["x-a", "x-b", "x-core"]);
        assert_eq!(found[0].1, "crates/a");
    }

    #[test]
    fn lock_packages_only_from_registries() {
        let m = cargo_lock_packages(
            "version = 4\n[[package]]\nname = \"a\"\nversion = \"1.0.0\"\nsource = \"registry+https://github.com/rust-lang/crates.io-index\"\nchecksum = \"c\"\n[[package]]\nname = \"engine\"\nversion = \"0.1.0\"\n",
        );
        assert_eq!(m["a"], vec![("1.0.0".to_string(), Some("c".to_string()))]);
        assert!(!m.contains_key("engine"));
    }
}
