//! From manifest to lock to patched trees: resolving sources (with one-run overrides and extra
//! patches) and materialising a lock's trees into the cache.

use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::apply::{self, Base, Outcome};
use super::cache::{Cache, Repo};
use super::crates;
use super::lock::{Lock, LockedSource, Origin};
use super::manifest::{CrateSpec, Manifest, Source, SourceKind, fetch_url, is_remote_url};
use super::patch::{PatchFile, read_source_patches};
use super::status::{LockStatus, lock_status};
use super::trees::{check_no_submodules, materialise_tree};
use super::upstream;
use crate::error::bad_input;

/// `--source NAME=URL#REF`: fetch source NAME from another repository or ref for one run (like
/// JAX-Toolbox's `SOURCE_OVERRIDES`). The manifest's patches are still applied on top.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceOverride {
    /// The manifest source to replace.
    pub name: String,
    /// A git URL or local path (made absolute when parsed).
    pub url: String,
    /// A branch, tag, `pull/N/head` or commit id; the source's `tracking_ref` when omitted.
    pub git_ref: Option<String>,
}

impl FromStr for SourceOverride {
    type Err = anyhow::Error;

    /// Parses `NAME=URL#REF` (`#REF` optional; the last `#` separates it); a malformed one is
    /// bad input.
    fn from_str(spec: &str) -> Result<Self> {
        let (name, rest) = spec.split_once('=').ok_or_else(|| bad_input(format!("`{spec}` is not NAME=URL#REF")))?;
        let (url, git_ref) = match rest.rsplit_once('#') {
            Some((u, r)) => (u, Some(r.to_owned())),
            None => (rest, None),
        };
        if name.is_empty() || url.is_empty() || git_ref.as_deref() == Some("") {
            return Err(bad_input(format!("`{spec}` is not NAME=URL#REF")));
        }
        let url = if is_remote_url(url) {
            url.to_owned()
        } else {
            // A local path on the command line is relative to the current directory.
            std::path::absolute(url).map_err(|e| anyhow!("{url}: {e}"))?.to_string_lossy().into_owned()
        };
        Ok(SourceOverride { name: name.to_owned(), url, git_ref })
    }
}

/// `--patch [NAME=]FILE|REF`: a patch applied after the manifest's patches of one source, for
/// one build only. It is recorded in that build's lock (`extra = true`), never in the manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtraPatch {
    /// The source it applies to; inferred when omitted (a file under `patches/NAME/`, or the
    /// only source of the manifest).
    pub source: Option<String>,
    /// A patch file path (relative to the current directory) or an upstream ref
    /// (`pull/123/head`, `refs/...`) exported from the source's repository at build time.
    pub patch: String,
}

impl FromStr for ExtraPatch {
    type Err = anyhow::Error;

    /// Parses `NAME=FILE`, `NAME=REF`, `FILE` or `REF`; a malformed one is bad input.
    fn from_str(spec: &str) -> Result<Self> {
        let (source, patch) = match spec.split_once('=') {
            Some((n, p)) if !n.contains('/') => (Some(n.to_owned()), p.to_owned()),
            _ => (None, spec.to_owned()),
        };
        if patch.is_empty() || source.as_deref() == Some("") {
            return Err(bad_input(format!("`{spec}` is not [NAME=]FILE|REF")));
        }
        Ok(ExtraPatch { source, patch })
    }
}

/// What one run changes relative to the manifest: source overrides and extra patches.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// `--source NAME=URL#REF` overrides.
    pub sources: Vec<SourceOverride>,
    /// `--patch [NAME=]FILE|REF` extra patches, applied in this order after the manifest's.
    pub extra_patches: Vec<ExtraPatch>,
}

impl Overrides {
    /// True when nothing is overridden.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty() && self.extra_patches.is_empty()
    }
}

/// A patched source tree in the cache, ready to build from.
#[derive(Clone, Debug)]
pub struct FetchedSource {
    /// The source's name.
    pub name: String,
    /// The materialised tree (`cache/trees/<tree>`). Shared by every build with the same tree:
    /// read it, never write into it (copy it out to modify it).
    pub dir: PathBuf,
    /// The git tree id of `dir`.
    pub tree: String,
    /// The patched commit id.
    pub head: String,
    /// Where the unpatched source came from.
    pub origin: Origin,
}

/// Resolves the selected sources (all when `names` is empty) as the manifest pins them, with
/// `overrides` applied: fetches each pin, applies its patches and records the result. This is
/// `distro lock`; the lock it returns holds only the selected sources.
///
/// Fails with a [`apply::Conflict`] in the error chain when a patch does not apply.
pub fn resolve(manifest: &Manifest, names: &[String], overrides: &Overrides, cache: &Cache) -> Result<Lock> {
    let extras = assign_extra_patches(manifest, overrides)?;
    let mut lock = Lock::default();
    for source in selection(manifest, names, overrides)? {
        let entry = resolve_source(manifest, source, overrides, &extras, cache, None)?;
        lock.sources.insert(source.name.clone(), entry);
    }
    Ok(lock)
}

/// The lock one run (a build, `distro fetch`) uses: the lock of record for every selected source,
/// except that overridden sources, and sources with extra patches, are resolved afresh and
/// marked as such. A selected source whose lock entry is stale or missing is an error: the
/// lock of record must match the manifest (run `distro lock`).
///
/// This is how `distro build --source ... --patch ...` records its extra patches: pass them in
/// `overrides`, write the returned lock into the image, and [`materialise`] it.
pub fn lock_for_run(
    manifest: &Manifest,
    lock: Option<&Lock>,
    names: &[String],
    overrides: &Overrides,
    cache: &Cache,
) -> Result<Lock> {
    let extras = assign_extra_patches(manifest, overrides)?;
    let mut out = Lock::default();
    for source in selection(manifest, names, overrides)? {
        let touched =
            overrides.sources.iter().any(|o| o.name == source.name) || extras.iter().any(|(n, _)| n == &source.name);
        let locked = lock.and_then(|l| l.sources.get(&source.name));
        let status = lock_status(manifest, source, locked);
        let entry = if touched {
            // A current entry still vouches for the pin (e.g. the crate's checksum).
            let recorded = locked.filter(|_| status == LockStatus::Current);
            resolve_source(manifest, source, overrides, &extras, cache, recorded)?
        } else {
            match status {
                LockStatus::Current => locked.cloned().expect("current implies present"),
                LockStatus::Missing => {
                    return Err(bad_input(format!(
                        "{} has no entry for source `{}`; run `distro lock {}` to resolve it",
                        manifest.lock_path().display(),
                        source.name,
                        source.name
                    )));
                }
                LockStatus::Stale(why) => {
                    return Err(bad_input(format!(
                        "the lock entry for source `{}` is stale ({why}); run `distro lock {}` to update {}",
                        source.name,
                        source.name,
                        manifest.lock_path().display()
                    )));
                }
            }
        };
        out.sources.insert(source.name.clone(), entry);
    }
    // The bases the lock of record pins go into the build's lock as they are.
    out.bases = lock.map(|l| l.bases.clone()).unwrap_or_default();
    Ok(out)
}

/// Materialises every source of `lock` into the cache and verifies it: each tree is rebuilt from
/// its pin and patches unless an intact copy is already cached, and the result must have the
/// tree and commit ids the lock records. `root` is the project root (patch files are read from
/// there when they are not in the cache's patch store).
pub fn materialise(lock: &Lock, root: &Path, cache: &Cache) -> Result<Vec<FetchedSource>> {
    lock.sources
        .iter()
        .map(|(name, locked)| {
            materialise_source(name, locked, root, cache).with_context(|| format!("fetching source `{name}`"))
        })
        .collect()
}

fn materialise_source(name: &str, locked: &LockedSource, root: &Path, cache: &Cache) -> Result<FetchedSource> {
    let fetched = |dir: PathBuf| FetchedSource {
        name: name.to_owned(),
        dir,
        tree: locked.tree.clone(),
        head: locked.head.clone(),
        origin: locked.origin.clone(),
    };
    let (repo, base) = match &locked.origin {
        Origin::Git { url, git_ref, commit } => {
            let url = fetch_url(url, root);
            let repo = cache.open_repo(&upstream::repo_key(&url))?;
            if let Some(dir) = cached_tree(cache, &repo, &locked.tree)? {
                return Ok(fetched(dir));
            }
            upstream::ensure_commit(&repo, &url, git_ref, commit)?;
            (repo, Base { commit: commit.clone(), label: format!("the locked commit on `{git_ref}`") })
        }
        Origin::Crate { name: krate, version, checksum, registry } => {
            let spec = crate_spec(krate, registry.clone());
            let repo = cache.open_repo(&crates::repo_key(&spec))?;
            if let Some(dir) = cached_tree(cache, &repo, &locked.tree)? {
                return Ok(fetched(dir));
            }
            let (commit, _) = crates::import(cache, root, &repo, &spec, version, Some(checksum))?;
            (repo, Base { commit, label: format!("crate {krate} {version}") })
        }
    };
    let patches = locked
        .patches
        .iter()
        .map(|lp| {
            if let Some(bytes) = cache.stored_patch(&lp.sha256) {
                return Ok(PatchFile::new(lp.entry.clone(), lp.file.clone(), bytes, lp.extra));
            }
            let Some(file) = &lp.file else {
                bail!("patch {} (sha256 {}) was an extra patch of one build and is no longer in the cache at {}", lp.entry, lp.sha256, cache.root().display());
            };
            let path = super::manifest::lexical_join(root, Path::new(file));
            let bytes = std::fs::read(&path).map_err(|e| bad_input(format!("patch file {} of source `{name}`: {e}", path.display())))?;
            let p = PatchFile::new(lp.entry.clone(), lp.file.clone(), bytes, lp.extra);
            if p.sha256 != lp.sha256 {
                return Err(bad_input(format!(
                    "patch file {} has sha256 {} but the lock records {}; run `distro lock {name}` if the change is intended",
                    path.display(),
                    p.sha256,
                    lp.sha256
                )));
            }
            Ok(p)
        })
        .collect::<Result<Vec<_>>>()?;
    let applied = apply_strict(cache, &repo, name, &base, &patches)?;
    if applied.tree != locked.tree || applied.head != locked.head {
        bail!(
            "applying the patches gives tree {} (commit {}) but the lock records tree {} (commit {}); the lock does not match its inputs: regenerate it with `distro lock {name}` and review the change",
            applied.tree,
            applied.head,
            locked.tree,
            locked.head
        );
    }
    Ok(fetched(materialise_tree(cache, &repo, &locked.tree)?))
}

/// Opens the cache repository a locked origin lives in.
pub(crate) fn repo_for_origin(cache: &Cache, origin: &Origin, root: &Path) -> Result<Repo> {
    match origin {
        Origin::Git { url, .. } => cache.open_repo(&upstream::repo_key(&fetch_url(url, root))),
        Origin::Crate { name, registry, .. } => cache.open_repo(&crates::repo_key(&crate_spec(name, registry.clone()))),
    }
}

/// The cached tree `tree` if it is present and intact.
fn cached_tree(cache: &Cache, repo: &Repo, tree: &str) -> Result<Option<PathBuf>> {
    let dir = cache.tree_dir(tree);
    if !dir.is_dir() || !repo.git.succeeds(["cat-file", "-e", &format!("{tree}^{{tree}}")]) {
        return Ok(None);
    }
    // materialise_tree verifies the copy and rebuilds it from the object if it was modified.
    materialise_tree(cache, repo, tree).map(Some)
}

fn crate_spec(name: &str, registry: Option<String>) -> CrateSpec {
    CrateSpec {
        name: name.to_owned(),
        version: None,
        version_loc: Default::default(),
        tracking_req: "*".into(),
        registry,
    }
}

/// The selected sources plus every source an override names.
fn selection<'m>(manifest: &'m Manifest, names: &[String], overrides: &Overrides) -> Result<Vec<&'m Source>> {
    let mut wanted: Vec<String> = names.to_vec();
    if !names.is_empty() {
        wanted.extend(overrides.sources.iter().map(|o| o.name.clone()));
        wanted.extend(overrides.extra_patches.iter().filter_map(|p| p.source.clone()));
    }
    for o in &overrides.sources {
        manifest.source(&o.name).map_err(|e| e.context(format!("--source {}", o.name)))?;
    }
    manifest.select(&wanted)
}

/// Pairs every extra patch with its source (inferring it where possible).
fn assign_extra_patches(manifest: &Manifest, overrides: &Overrides) -> Result<Vec<(String, ExtraPatch)>> {
    overrides
        .extra_patches
        .iter()
        .map(|p| {
            let name = match &p.source {
                Some(n) => n.clone(),
                None => infer_source(manifest, &p.patch).ok_or_else(|| {
                    bad_input(format!(
                        "--patch {}: cannot tell which source it is for; write it as NAME={}",
                        p.patch, p.patch
                    ))
                })?,
            };
            manifest.source(&name)?;
            Ok((name, p.clone()))
        })
        .collect()
}

fn infer_source(manifest: &Manifest, patch: &str) -> Option<String> {
    let parts: Vec<&str> = patch.split('/').collect();
    for pair in parts.windows(2) {
        if pair[0] == "patches" && manifest.sources.contains_key(pair[1]) {
            return Some(pair[1].to_owned());
        }
    }
    (manifest.sources.len() == 1).then(|| manifest.sources.keys().next().cloned()).flatten()
}

fn is_ref_spec(patch: &str) -> bool {
    (patch.starts_with("pull/") || patch.starts_with("refs/") || patch.starts_with("merge-requests/"))
        && !Path::new(patch).exists()
}

/// Resolves one source with the overrides that concern it. `recorded` is its current lock
/// entry, if any: a crate must still have the checksum recorded there.
fn resolve_source(
    manifest: &Manifest,
    source: &Source,
    overrides: &Overrides,
    extras: &[(String, ExtraPatch)],
    cache: &Cache,
    recorded: Option<&LockedSource>,
) -> Result<LockedSource> {
    let name = &source.name;
    let mut patches = read_source_patches(manifest, source)?;
    let extra: Vec<&ExtraPatch> = extras.iter().filter(|(n, _)| n == name).map(|(_, p)| p).collect();
    let over = overrides.sources.iter().find(|o| &o.name == name);
    let overridden = over.is_some();

    let (repo, base, origin) = if let Some(o) = over {
        let git_ref = match (&o.git_ref, &source.kind) {
            (Some(r), _) => r.clone(),
            (None, SourceKind::Git(g)) => g.tracking_ref.clone(),
            (None, SourceKind::Crate(_)) => {
                return Err(bad_input(format!(
                    "--source {name}={}: crate source `{name}` has no tracking ref; add #REF",
                    o.url
                )));
            }
        };
        let url = fetch_url(&o.url, Path::new("."));
        let repo = cache.open_repo(&upstream::repo_key(&url))?;
        let commit = upstream::fetch_ref(&repo, &url, &git_ref)?;
        eprintln!("distro: source `{name}` overridden for this run: {}#{git_ref} ({commit})", o.url);
        let base = Base { commit: commit.clone(), label: format!("`{git_ref}` of {}", o.url) };
        (repo, base, Origin::Git { url: o.url.clone(), git_ref, commit })
    } else {
        match &source.kind {
            SourceKind::Git(g) => {
                let Some(commit) = &g.commit else {
                    return Err(bad_input(format!(
                        "{}: source `{name}` has no `commit` yet; run `distro bump {name}` to pin the tip of `{}`",
                        manifest.at(source.loc),
                        g.tracking_ref
                    )));
                };
                let url = manifest.fetch_url(&g.url);
                let repo = cache.open_repo(&upstream::repo_key(&url))?;
                upstream::ensure_commit(&repo, &url, &g.tracking_ref, commit)
                    .map_err(|e| e.context(manifest.at(g.commit_loc)))?;
                let base = Base { commit: commit.clone(), label: "the pinned commit".into() };
                (
                    repo,
                    base,
                    Origin::Git { url: g.url.clone(), git_ref: g.tracking_ref.clone(), commit: commit.clone() },
                )
            }
            SourceKind::Crate(c) => {
                let Some(version) = &c.version else {
                    return Err(bad_input(format!(
                        "{}: crate source `{name}` has no `version` yet; run `distro bump {name}` to pin the newest release",
                        manifest.at(source.loc)
                    )));
                };
                let repo = cache.open_repo(&crates::repo_key(c))?;
                let expected = recorded.and_then(|r| match &r.origin {
                    Origin::Crate { checksum, .. } => Some(checksum.as_str()),
                    Origin::Git { .. } => None,
                });
                let (commit, release) = crates::import(cache, &manifest.root, &repo, c, version, expected)?;
                let base = Base { commit, label: format!("crate {} {version}", c.name) };
                let origin = Origin::Crate {
                    name: c.name.clone(),
                    version: release.version,
                    checksum: release.checksum,
                    registry: c.registry.clone(),
                };
                (repo, base, origin)
            }
        }
    };

    for p in extra {
        patches.push(read_extra_patch(manifest, source, p, &repo, &origin)?);
    }
    let applied = apply_strict(cache, &repo, name, &base, &patches)?;
    check_no_submodules(&repo, &applied.tree, name)?;
    for p in &patches {
        cache.store_patch(&p.bytes)?;
    }
    Ok(LockedSource {
        origin,
        overridden,
        patches: patches.iter().map(PatchFile::locked).collect(),
        tree: applied.tree,
        head: applied.head,
    })
}

/// Reads an extra patch: a file, or an upstream ref exported from the source's repository.
fn read_extra_patch(
    manifest: &Manifest,
    source: &Source,
    p: &ExtraPatch,
    repo: &Repo,
    origin: &Origin,
) -> Result<PatchFile> {
    if is_ref_spec(&p.patch) {
        let Origin::Git { url, git_ref, .. } = origin else {
            return Err(bad_input(format!(
                "--patch {}: crate source `{}` has no upstream refs; pass a patch file",
                p.patch, source.name
            )));
        };
        let fetch = fetch_url(url, &manifest.root);
        let bytes = upstream::export_ref(repo, &fetch, git_ref, &p.patch)?.ok_or_else(|| {
            bad_input(format!("--patch {}: it has no commits that are not already on `{git_ref}`", p.patch))
        })?;
        return Ok(PatchFile::new(p.patch.clone(), None, bytes, true));
    }
    let path = Path::new(&p.patch);
    let bytes = std::fs::read(path).map_err(|e| bad_input(format!("--patch {}: {e}", p.patch)))?;
    // A file inside the project is recorded by its project path; others only by their hash.
    let file = match (path.canonicalize(), manifest.root.canonicalize()) {
        (Ok(abs), Ok(root)) => abs.strip_prefix(&root).ok().map(|r| r.to_string_lossy().into_owned()),
        _ => None,
    };
    Ok(PatchFile::new(p.patch.clone(), file, bytes, true))
}

/// Applies a series where every patch must apply; a conflict is reported on stderr in detail
/// and becomes the error.
fn apply_strict(cache: &Cache, repo: &Repo, name: &str, base: &Base, patches: &[PatchFile]) -> Result<apply::Applied> {
    match apply::apply_series(cache, repo, name, base, patches, apply::Options::default())? {
        Ok(applied) => {
            for (p, o) in patches.iter().zip(&applied.outcomes) {
                if *o == Outcome::NoChange {
                    eprintln!(
                        "distro: warning: patch {} of source `{name}` changes nothing on {} (already upstream?); `distro bump` drops such patches",
                        p.label(),
                        base.label
                    );
                }
            }
            Ok(applied)
        }
        Err(conflict) => {
            eprint!("{}", conflict.report());
            Err(anyhow::Error::new(conflict))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_overrides_parse() {
        let o: SourceOverride = "foo=https://h/x.git#pull/1/head".parse().unwrap();
        assert_eq!(
            o,
            SourceOverride { name: "foo".into(), url: "https://h/x.git".into(), git_ref: Some("pull/1/head".into()) }
        );
        let o: SourceOverride = "foo=https://h/x.git".parse().unwrap();
        assert_eq!(o.git_ref, None);
        let o: SourceOverride = "foo=../up#main".parse().unwrap();
        assert!(Path::new(&o.url).is_absolute());
        assert!("foo".parse::<SourceOverride>().is_err());
        assert!("foo=x#".parse::<SourceOverride>().is_err());
    }

    #[test]
    fn extra_patches_parse_and_infer_their_source() {
        let p: ExtraPatch = "foo=pull/2/head".parse().unwrap();
        assert_eq!(p, ExtraPatch { source: Some("foo".into()), patch: "pull/2/head".into() });
        let p: ExtraPatch = "patches/bar/x.patch".parse().unwrap();
        assert_eq!(p.source, None);
        let m = Manifest::parse(
            Path::new("images/manifest.toml"),
            "[sources.foo]\nurl = \"u\"\ntracking_ref = \"main\"\n[sources.bar]\nurl = \"v\"\ntracking_ref = \"main\"\n",
        )
        .unwrap();
        assert_eq!(infer_source(&m, "patches/bar/x.patch").as_deref(), Some("bar"));
        assert_eq!(infer_source(&m, "/tmp/x.patch"), None);
        let err = assign_extra_patches(
            &m,
            &Overrides { sources: vec![], extra_patches: vec![p.clone(), "pull/1/head".parse().unwrap()] },
        )
        .unwrap_err();
        assert!(err.to_string().contains("write it as NAME=pull/1/head"), "{err}");
        let over = Overrides { sources: vec!["nope=/x#main".parse().unwrap()], extra_patches: vec![] };
        let err = selection(&m, &[], &over).unwrap_err();
        assert_eq!(crate::error::exit_code(&err), 2, "{err:#}");
    }
}
