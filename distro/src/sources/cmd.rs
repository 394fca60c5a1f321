//! The `distro` subcommands that deal with sources: their arguments (clap) and what they print.
//! Progress and warnings go to stderr; results meant for scripts go to stdout.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

use super::cache::Cache;
use super::fsutil::write_if_changed;
use super::lock::Lock;
use super::manifest::{DEFAULT_MANIFEST, Manifest};
use super::resolve::{ExtraPatch, Overrides, SourceOverride, lock_for_run, materialise, resolve};
use super::{bump, out, refresh, status};
use crate::error::bad_input;

/// `--manifest FILE`, shared by every sources command.
#[derive(Args, Debug, Clone)]
pub struct ManifestArg {
    /// The manifest of upstream sources; its lock is the same path with the `.lock` extension.
    #[arg(long, value_name = "FILE", default_value = DEFAULT_MANIFEST)]
    pub manifest: PathBuf,
}

impl ManifestArg {
    /// Loads the manifest.
    pub fn load(&self) -> Result<Manifest> {
        Manifest::load(&self.manifest)
    }
}

/// `distro sources`: the table of sources and lock status.
#[derive(Args, Debug)]
pub struct SourcesArgs {
    #[command(flatten)]
    manifest: ManifestArg,
    /// Print JSON (one object per source, full pins) instead of the table.
    #[arg(long)]
    json: bool,
}

/// `distro lock`: resolve the manifest as pinned and write the lock.
#[derive(Args, Debug)]
pub struct LockArgs {
    #[command(flatten)]
    manifest: ManifestArg,
    /// Sources to lock (default: all; other entries of the lock are kept).
    #[arg(value_name = "NAME")]
    names: Vec<String>,
    /// Write nothing; fail (exit 1) if the lock is not what the manifest gives.
    #[arg(long)]
    check: bool,
}

/// `distro fetch`: materialise the patched source trees, verifying the lock.
#[derive(Args, Debug)]
pub struct FetchArgs {
    #[command(flatten)]
    manifest: ManifestArg,
    /// Sources to fetch (default: all).
    #[arg(value_name = "NAME")]
    names: Vec<String>,
    /// Copy each patched tree to DIR/NAME (the trees otherwise stay in the cache).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// For this run only, take source NAME from URL at REF (branch, tag, pull/N/head, commit);
    /// the manifest's patches still apply. Repeatable.
    #[arg(long = "source", value_name = "NAME=URL#REF")]
    sources: Vec<SourceOverride>,
    /// For this run only, apply one more patch (a file, or an upstream ref) after the manifest's
    /// patches of source NAME. Repeatable.
    #[arg(long = "patch", value_name = "[NAME=]FILE|REF")]
    patches: Vec<ExtraPatch>,
    /// Write the lock of this run (with overrides and extra patches) to FILE.
    #[arg(long, value_name = "FILE")]
    lock_out: Option<PathBuf>,
}

/// `distro bump`: move pins to their tracking refs' tips.
#[derive(Args, Debug)]
pub struct BumpArgs {
    #[command(flatten)]
    manifest: ManifestArg,
    /// Sources to bump (default: all).
    #[arg(value_name = "NAME")]
    names: Vec<String>,
    /// Show what would change; write nothing.
    #[arg(long)]
    dry_run: bool,
}

/// `distro patches ...`.
#[derive(Subcommand, Debug)]
pub enum PatchesCommand {
    /// Export upstream-ref patches (pull/123/head) to patches/NAME/PR-123.patch.
    Refresh(RefreshArgs),
}

/// `distro patches refresh`.
#[derive(Args, Debug)]
pub struct RefreshArgs {
    #[command(flatten)]
    manifest: ManifestArg,
    /// Sources whose ref patches to export (default: all).
    #[arg(value_name = "NAME")]
    names: Vec<String>,
    /// Show what would change; write nothing.
    #[arg(long)]
    dry_run: bool,
}

/// Runs `distro sources`.
pub fn sources(args: SourcesArgs) -> Result<()> {
    let manifest = args.manifest.load()?;
    let lock = Lock::load(&manifest.lock_path())?;
    let rows = status::rows(&manifest, lock.as_ref());
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", status::table(&rows));
    }
    if let Some(lock) = &lock {
        for name in lock.sources.keys().filter(|n| !manifest.sources.contains_key(*n)) {
            eprintln!(
                "distro: the lock has an entry for `{name}`, which is not in the manifest; `distro lock` removes it"
            );
        }
    }
    Ok(())
}

/// Runs `distro lock`.
pub fn lock(args: LockArgs) -> Result<()> {
    let manifest = args.manifest.load()?;
    let cache = Cache::from_env()?;
    let old = Lock::load(&manifest.lock_path())?;
    let fresh = resolve(&manifest, &args.names, &Overrides::default(), &cache)?;
    let mut new = if args.names.is_empty() { Lock::default() } else { old.clone().unwrap_or_default() };
    for (name, entry) in &fresh.sources {
        new.sources.insert(name.clone(), entry.clone());
        println!("{name}\t{}", entry.tree);
    }
    let path = manifest.lock_path();
    if args.check {
        if old.as_ref() != Some(&new) {
            anyhow::bail!("{} is not what the manifest gives; run `distro lock` and commit the result", path.display());
        }
        eprintln!("distro: {} is current", path.display());
    } else if write_if_changed(&path, new.render().as_bytes())? {
        eprintln!("distro: wrote {}", path.display());
    } else {
        eprintln!("distro: {} unchanged", path.display());
    }
    Ok(())
}

/// Runs `distro fetch`.
pub fn fetch(args: FetchArgs) -> Result<()> {
    let manifest = args.manifest.load()?;
    let cache = Cache::from_env()?;
    manifest.select(&args.names)?;
    let lock = Lock::load(&manifest.lock_path())?;
    if lock.is_none() && args.sources.is_empty() && args.patches.is_empty() {
        return Err(bad_input(format!(
            "{} does not exist; run `distro lock` to create it",
            manifest.lock_path().display()
        )));
    }
    let overrides = Overrides { sources: args.sources, extra_patches: args.patches };
    let run_lock = lock_for_run(&manifest, lock.as_ref(), &args.names, &overrides, &cache)?;
    let fetched = materialise(&run_lock, &manifest.root, &cache)?;
    let dirs = match &args.out {
        Some(dir) => out::copy_out(&fetched, dir, &manifest.root, &cache)?,
        None => fetched.iter().map(|f| f.dir.clone()).collect(),
    };
    if let Some(path) = &args.lock_out {
        write_if_changed(path, run_lock.render().as_bytes()).with_context(|| format!("writing {}", path.display()))?;
    }
    for (f, dir) in fetched.iter().zip(&dirs) {
        println!("{}\t{}\t{}", f.name, f.tree, dir.display());
    }
    Ok(())
}

/// Runs `distro bump`.
pub fn bump(args: BumpArgs) -> Result<()> {
    let manifest = args.manifest.load()?;
    let cache = Cache::from_env()?;
    let lock = Lock::load(&manifest.lock_path())?;
    let plan = bump::plan(&manifest, lock.as_ref(), &args.names, &cache)?;
    if !plan.conflicts.is_empty() {
        for c in &plan.conflicts {
            eprint!("{}", c.report());
        }
        for c in &plan.changes {
            for d in &c.dropped {
                eprintln!("distro: (would drop {d} from `{}`: merged upstream)", c.name);
            }
        }
        let first = &plan.conflicts[0];
        anyhow::bail!(
            "{} patch{} no longer appl{}; nothing was written. First: {first}. Refresh or rebase the patch, or remove it from the manifest, then run `distro bump` again",
            plan.conflicts.len(),
            if plan.conflicts.len() == 1 { "" } else { "es" },
            if plan.conflicts.len() == 1 { "ies" } else { "y" },
        );
    }
    for c in &plan.changes {
        let old = c.old.as_deref().unwrap_or("(unpinned)");
        if c.old.as_deref() == Some(c.new.as_str()) {
            println!("{}\t{}\trelocked", c.name, c.new);
        } else {
            println!("{}\t{old} -> {}", c.name, c.new);
        }
        for d in &c.dropped {
            println!("{}\tdropped {d} (merged upstream)", c.name);
        }
    }
    for name in &plan.unchanged {
        eprintln!("distro: `{name}` is at the tip of what it tracks; unchanged");
    }
    if args.dry_run {
        eprintln!("distro: dry run: nothing written");
        return Ok(());
    }
    let written = bump::write(&manifest, &plan)?;
    if written.manifest {
        eprintln!("distro: wrote {}", manifest.path.display());
    }
    if written.lock {
        eprintln!("distro: wrote {}", manifest.lock_path().display());
    }
    if !written.manifest && !written.lock {
        eprintln!("distro: nothing to change");
    }
    for c in &plan.changes {
        for d in &c.dropped {
            let file =
                manifest.sources[&c.name].patches.iter().find(|p| p.spec.text() == d).map(|p| p.spec.file(&c.name));
            if let Some(file) = file.filter(|f| manifest.project_path(f).exists()) {
                eprintln!("distro: {file} is no longer used; delete it with `git rm {file}` when you are ready");
            }
        }
    }
    Ok(())
}

/// Runs `distro patches ...`.
pub fn patches(command: PatchesCommand) -> Result<()> {
    match command {
        PatchesCommand::Refresh(args) => {
            let manifest = args.manifest.load()?;
            let cache = Cache::from_env()?;
            let done = refresh::refresh(&manifest, &args.names, &cache, args.dry_run)?;
            for r in &done {
                println!("{}\t{}\t{}\t{}", r.status, r.source, r.git_ref, r.file);
            }
            if done.is_empty() {
                eprintln!("distro: no upstream-ref patches in the selected sources");
            }
            if done.iter().any(|r| matches!(r.status, refresh::Refresh::New | refresh::Refresh::Changed))
                && !args.dry_run
            {
                eprintln!("distro: patches changed; run `distro lock` (or `distro bump`) to update the lock");
            }
            Ok(())
        }
    }
}
