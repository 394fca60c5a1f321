//! `distro fetch`: materialises the patched source trees (verifying the lock); prints
//! `NAME<TAB>TREE<TAB>DIR` per source.
use super::ManifestArg;
use crate::error::bad_input;
use crate::fsutil::{DirLock, write_if_changed};
use crate::sources::{Cache, ExtraPatch, Lock, Overrides, SourceOverride, lock_for_run, materialise, out};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

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

/// Runs `distro fetch`: materialises the trees (copied out with `--out`) and lists them.
pub fn fetch(args: FetchArgs) -> Result<()> {
    // --out DIR has one writer at a time (a copy there is replaced by removal and rename).
    let _out_lock = match &args.out {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            Some(DirLock::exclusive(dir, "fetch output directory", "wait for it to finish, or choose another --out")?)
        }
        None => None,
    };
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
