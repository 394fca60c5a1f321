//! `distro bump`: move every pin to the tip of its tracking ref (or the newest crate release),
//! re-apply the patches, drop the ones upstream has merged, and write manifest and lock only
//! when every source succeeded.
//!
//! A patch counts as merged upstream when the change it made on the old pin reverse-applies
//! cleanly on the new tip (`git apply --reverse --check`), or when `git am` applies it without
//! changing anything. A dropped patch is removed from the manifest; its file is left in place
//! (the maintainer deletes it with `git rm`, or keeps it for reference), and reported.

use anyhow::{Context, Result};

use super::apply::{self, Base, Conflict, Outcome};
use super::cache::{Cache, Repo};
use super::cargo_pins;
use super::crates;
use super::edit::{SourceEdit, edit_base_digest, edit_manifest};
use super::lock::{Lock, LockedBase, LockedSource, Origin};
use super::manifest::{BaseSpec, Manifest, Source, SourceKind};
use super::patch::{PatchFile, read_source_patches};
use super::status::{LockStatus, base_status, lock_status};
use super::trees::check_no_submodules;
use super::upstream;
use crate::dated::{format_day, today};
use crate::error::bad_input;
use crate::fsutil::write_if_changed;
use std::path::PathBuf;

/// What bump does to one source.
#[derive(Clone, Debug)]
pub struct Change {
    /// The source's name.
    pub name: String,
    /// The old pin (commit or version), if there was one.
    pub old: Option<String>,
    /// The new pin.
    pub new: String,
    /// Patches dropped because upstream has merged them (entries as in the manifest).
    pub dropped: Vec<String>,
    /// The new lock entry.
    pub locked: LockedSource,
}

/// The outcome of planning a bump: nothing is written until [`write`] is called.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Sources whose pin, patches or lock entry change.
    pub changes: Vec<Change>,
    /// Bases whose digest or lock entry change.
    pub base_changes: Vec<BaseChange>,
    /// Sources (and bases) already at their tip with a current lock.
    pub unchanged: Vec<String>,
    /// Patches that do not apply on the new pins; when any, nothing may be written.
    pub conflicts: Vec<Conflict>,
    manifest_text: String,
    lock_text: String,
    /// Workspace `Cargo.toml` files whose exact requirement on a moved crate changes (path, text).
    cargo_toml_edits: Vec<(PathBuf, String)>,
    /// Crates that move in `Cargo.lock`: (crate, old version, new version).
    cargo_lock_moves: Vec<(String, String, String)>,
}

/// Files [`write`] replaced.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// The manifest changed.
    pub manifest: bool,
    /// The lock changed.
    pub lock: bool,
    /// Workspace `Cargo.toml` files rewritten (exact requirements on moved crates).
    pub cargo_toml: Vec<PathBuf>,
    /// `Cargo.lock` moved to the new crate versions.
    pub cargo_lock: bool,
}

/// What bump does to one base image.
#[derive(Clone, Debug)]
pub struct BaseChange {
    /// The base's name.
    pub name: String,
    /// The old digest, if there was one.
    pub old: Option<String>,
    /// The digest the tag resolves to now.
    pub new: String,
    /// The new lock entry.
    pub locked: LockedBase,
}

/// Works out the bump of the selected sources and bases (all when `names` is empty) without
/// writing. `base_digest` resolves a base's tag to its current digest (from its registry: the
/// caller owns the network client, so this module stays below the registry).
pub fn plan(
    manifest: &Manifest,
    lock: Option<&Lock>,
    names: &[String],
    cache: &Cache,
    base_digest: &dyn Fn(&BaseSpec) -> Result<String>,
) -> Result<Plan> {
    let mut changes = Vec::new();
    let mut unchanged = Vec::new();
    let mut conflicts = Vec::new();
    let (source_names, base_names) = manifest.split_names(names)?;
    let selected = match &source_names {
        Some(names) => manifest.select(names)?,
        None => Vec::new(),
    };
    let mut base_changes = Vec::new();
    for name in &base_names {
        let base = &manifest.bases[name];
        let new = base_digest(base).with_context(|| format!("bumping base `{name}`"))?;
        let locked = lock.and_then(|l| l.bases.get(name));
        if base.digest.as_deref() == Some(new.as_str()) && base_status(base, locked) == LockStatus::Current {
            unchanged.push(name.clone());
            continue;
        }
        let since = match locked {
            Some(l) if l.digest == new && l.image == base.image && l.tag == base.tag => l.since.clone(),
            _ => format_day(today()),
        };
        let locked = LockedBase { image: base.image.clone(), tag: base.tag.clone(), digest: new.clone(), since };
        base_changes.push(BaseChange { name: name.clone(), old: base.digest.clone(), new, locked });
    }
    for source in selected {
        let locked = lock.and_then(|l| l.sources.get(&source.name));
        let outcome = match &source.kind {
            SourceKind::Git(_) => bump_git(manifest, source, locked, cache),
            SourceKind::Crate(_) => bump_crate(manifest, source, locked, cache),
        }
        .with_context(|| format!("bumping source `{}`", source.name))?;
        match outcome {
            Outcome3::Unchanged => unchanged.push(source.name.clone()),
            Outcome3::Changed(c) => changes.push(*c),
            Outcome3::Conflict(c) => conflicts.push(*c),
        }
    }

    let original =
        std::fs::read_to_string(&manifest.path).with_context(|| format!("reading {}", manifest.path.display()))?;
    let edits: Vec<SourceEdit> = changes
        .iter()
        .filter(|c| c.old.as_deref() != Some(c.new.as_str()) || !c.dropped.is_empty())
        .map(|c| SourceEdit {
            name: c.name.clone(),
            pin: (pin_key(&manifest.sources[&c.name]), c.new.clone()),
            drop_patches: c.dropped.clone(),
        })
        .collect();
    let mut manifest_text = if edits.is_empty() { original } else { edit_manifest(&original, &edits)? };
    for b in base_changes.iter().filter(|b| b.old.as_deref() != Some(b.new.as_str())) {
        manifest_text = edit_base_digest(&manifest_text, &b.name, &b.new)?;
    }
    let mut new_lock = lock.cloned().unwrap_or_default();
    for c in &changes {
        new_lock.sources.insert(c.name.clone(), c.locked.clone());
    }
    for b in &base_changes {
        new_lock.bases.insert(b.name.clone(), b.locked.clone());
    }
    if names.is_empty() {
        new_lock.sources.retain(|name, _| manifest.sources.contains_key(name));
        new_lock.bases.retain(|name, _| manifest.bases.contains_key(name));
    }
    // A crate that moves moves in the workspace too: its exact requirements and Cargo.lock.
    let mut cargo_toml_edits: Vec<(PathBuf, String)> = Vec::new();
    let mut cargo_lock_moves = Vec::new();
    for c in &changes {
        let (SourceKind::Crate(spec), Some(old)) = (&manifest.sources[&c.name].kind, &c.old) else { continue };
        if *old == c.new {
            continue;
        }
        for (path, text) in cargo_pins::requirement_edits(&manifest.root, &spec.name, &c.new)? {
            if cargo_toml_edits.iter().any(|(p, _)| *p == path) {
                return Err(bad_input(format!(
                    "{} requires two bumped crates exactly; bump them one at a time (`distro bump NAME`)",
                    path.display()
                )));
            }
            cargo_toml_edits.push((path, text));
        }
        cargo_lock_moves.push((spec.name.clone(), old.clone(), c.new.clone()));
    }
    Ok(Plan {
        changes,
        base_changes,
        unchanged,
        conflicts,
        manifest_text,
        lock_text: new_lock.render(),
        cargo_toml_edits,
        cargo_lock_moves,
    })
}

/// Writes the manifest and lock of a conflict-free plan, each atomically and only if its bytes
/// change (the manifest first: if the lock then failed, `distro sources` shows it stale), then
/// the workspace's `Cargo.toml` requirements and `Cargo.lock` for the crates that moved (if
/// `cargo update` then fails, `distro sources` names the disagreeing pin).
pub fn write(manifest: &Manifest, plan: &Plan) -> Result<Written> {
    assert!(plan.conflicts.is_empty(), "a plan with conflicts must not be written");
    let mut written = Written {
        manifest: write_if_changed(&manifest.path, plan.manifest_text.as_bytes())?,
        lock: write_if_changed(&manifest.lock_path(), plan.lock_text.as_bytes())?,
        ..Written::default()
    };
    for (path, text) in &plan.cargo_toml_edits {
        if write_if_changed(path, text.as_bytes())? {
            written.cargo_toml.push(path.clone());
        }
    }
    for (krate, old, new) in &plan.cargo_lock_moves {
        written.cargo_lock |= cargo_pins::update_cargo_lock(&manifest.root, krate, old, new)?;
    }
    Ok(written)
}

enum Outcome3 {
    Unchanged,
    Changed(Box<Change>),
    Conflict(Box<Conflict>),
}

fn pin_key(source: &Source) -> &'static str {
    match source.kind {
        SourceKind::Git(_) => "commit",
        SourceKind::Crate(_) => "version",
    }
}

fn bump_git(manifest: &Manifest, source: &Source, locked: Option<&LockedSource>, cache: &Cache) -> Result<Outcome3> {
    let SourceKind::Git(g) = &source.kind else { unreachable!() };
    let url = manifest.fetch_url(&g.url);
    let repo = cache.open_repo(&upstream::repo_key(&url))?;
    let tip = upstream::fetch_ref(&repo, &url, &g.tracking_ref)?;
    let current = lock_status(manifest, source, locked) == LockStatus::Current;
    if g.commit.as_deref() == Some(tip.as_str()) && current {
        return Ok(Outcome3::Unchanged);
    }
    let patches = read_source_patches(manifest, source)?;
    let old_base = match &g.commit {
        Some(old) if old != &tip => match upstream::ensure_commit(&repo, &url, &g.tracking_ref, old) {
            Ok(()) => Some(Base { commit: old.clone(), label: "the old pin".into() }),
            Err(e) => {
                eprintln!(
                    "distro: warning: source `{}`: the old pin is gone upstream ({e:#}); merged patches are detected only when they change nothing",
                    source.name
                );
                None
            }
        },
        _ => None,
    };
    let new_base = Base { commit: tip.clone(), label: format!("the tip of `{}`", g.tracking_ref) };
    let origin = Origin::Git { url: g.url.clone(), git_ref: g.tracking_ref.clone(), commit: tip.clone() };
    rebase_patches(cache, &repo, source, &patches, old_base, new_base, origin, g.commit.clone(), tip)
}

fn bump_crate(manifest: &Manifest, source: &Source, locked: Option<&LockedSource>, cache: &Cache) -> Result<Outcome3> {
    let SourceKind::Crate(c) = &source.kind else { unreachable!() };
    let newest = crates::resolve(cache, &manifest.root, c, &c.tracking_req)?;
    let current = lock_status(manifest, source, locked) == LockStatus::Current;
    if c.version.as_deref() == Some(newest.version.as_str()) && current {
        return Ok(Outcome3::Unchanged);
    }
    let patches = read_source_patches(manifest, source)?;
    let repo = cache.open_repo(&crates::repo_key(c))?;
    let old_base = match &c.version {
        Some(old) if old != &newest.version => {
            let (commit, _) = crates::import(cache, &manifest.root, &repo, c, old, None)?;
            Some(Base { commit, label: format!("crate {} {old}", c.name) })
        }
        _ => None,
    };
    let (commit, release) = crates::import(cache, &manifest.root, &repo, c, &newest.version, Some(&newest.checksum))?;
    let new_base = Base { commit, label: format!("crate {} {}", c.name, release.version) };
    let origin = Origin::Crate {
        name: c.name.clone(),
        version: release.version.clone(),
        checksum: release.checksum,
        registry: c.registry.clone(),
    };
    rebase_patches(cache, &repo, source, &patches, old_base, new_base, origin, c.version.clone(), release.version)
}

/// Applies `patches` on the new base, skipping those already merged; `old_base` (when the pin
/// moves) tells what each patch changed before, for the merge check.
#[allow(clippy::too_many_arguments)]
fn rebase_patches(
    cache: &Cache,
    repo: &Repo,
    source: &Source,
    patches: &[PatchFile],
    old_base: Option<Base>,
    new_base: Base,
    origin: Origin,
    old_pin: Option<String>,
    new_pin: String,
) -> Result<Outcome3> {
    let name = &source.name;
    let mut effects: Vec<Option<Vec<u8>>> = vec![None; patches.len()];
    if let Some(old) = &old_base {
        let options = apply::Options { record_effects: true, merged_if: None };
        match apply::apply_series(cache, repo, name, old, patches, options)? {
            Ok(applied) => effects = applied.effects,
            Err(c) => eprintln!(
                "distro: warning: source `{name}`: patch {} does not apply to the old pin either; merged patches are detected only when they change nothing",
                c.patch
            ),
        }
    }
    let options = apply::Options { record_effects: false, merged_if: Some(&effects) };
    let applied = match apply::apply_series(cache, repo, name, &new_base, patches, options)? {
        Ok(a) => a,
        Err(conflict) => return Ok(Outcome3::Conflict(Box::new(conflict))),
    };
    check_no_submodules(repo, &applied.tree, name)?;
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    for (p, outcome) in patches.iter().zip(&applied.outcomes) {
        match outcome {
            Outcome::Applied => kept.push(p.locked()),
            Outcome::Merged | Outcome::NoChange => dropped.push(p.entry.clone()),
        }
    }
    for p in patches {
        cache.store_patch(&p.bytes)?;
    }
    let locked = LockedSource { origin, overridden: false, patches: kept, tree: applied.tree, head: applied.head };
    Ok(Outcome3::Changed(Box::new(Change { name: name.clone(), old: old_pin, new: new_pin, dropped, locked })))
}
