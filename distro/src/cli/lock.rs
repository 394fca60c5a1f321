//! `distro lock`: resolves the manifest as pinned and writes (or, with `--check`, verifies) the
//! lock; prints `NAME<TAB>TREE` per locked source.
use super::ManifestArg;
use crate::dated::{format_day, today};
use crate::error::bad_input;
use crate::fsutil::write_if_changed;
use crate::sources::lock::LockedBase;
use crate::sources::status::base_status;
use crate::sources::{Cache, Lock, LockStatus, Overrides, resolve};
use anyhow::Result;
use clap::Args;

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

/// Runs `distro lock`: resolves the selected sources and writes the lock only when it changed.
pub fn lock(args: LockArgs) -> Result<()> {
    let manifest = args.manifest.load()?;
    let cache = Cache::from_env()?;
    let old = Lock::load(&manifest.lock_path())?;
    let (source_names, base_names) = manifest.split_names(&args.names)?;
    let fresh = match &source_names {
        Some(names) => resolve(&manifest, names, &Overrides::default(), &cache)?,
        None => Lock::default(),
    };
    let mut new = if args.names.is_empty() { Lock::default() } else { old.clone().unwrap_or_default() };
    for (name, entry) in &fresh.sources {
        new.sources.insert(name.clone(), entry.clone());
        println!("{name}\t{}", entry.tree);
    }
    // A base is locked as the manifest pins it; its `since` moves only with its digest.
    for name in &base_names {
        let base = &manifest.bases[name];
        let Some(digest) = &base.digest else {
            return Err(bad_input(format!(
                "{}: base `{name}` has no digest; run `distro bump {name}` to pin what its tag resolves to",
                manifest.path.display()
            )));
        };
        let kept =
            old.as_ref().and_then(|l| l.bases.get(name)).filter(|l| base_status(base, Some(l)) == LockStatus::Current);
        let entry = kept.cloned().unwrap_or_else(|| LockedBase {
            image: base.image.clone(),
            tag: base.tag.clone(),
            digest: digest.clone(),
            since: format_day(today()),
        });
        println!("{name}\t{}", entry.digest);
        new.bases.insert(name.clone(), entry);
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
