//! `distro sources`: the table of upstream sources (kind, pin, tracking ref, patches, lock status)
//! on stdout, or JSON with `--json`.
use super::ManifestArg;
use crate::error::bad_input;
use crate::sources::Lock;
use crate::sources::cargo_pins;
use crate::sources::status;
use anyhow::Result;
use clap::Args;

/// `distro sources`: the table of sources and lock status.
#[derive(Args, Debug)]
pub struct SourcesArgs {
    #[command(flatten)]
    manifest: ManifestArg,
    /// Print JSON (one object per source, full pins) instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs `distro sources`: the table (or JSON) on stdout, stale lock entries warned about.
pub fn sources(args: SourcesArgs) -> Result<()> {
    let manifest = args.manifest.load()?;
    let lock = Lock::load(&manifest.lock_path())?;
    let rows = status::rows(&manifest, lock.as_ref());
    let bases = status::base_rows(&manifest, lock.as_ref(), crate::dated::today());
    if args.json {
        let mut all: Vec<serde_json::Value> = rows.iter().map(serde_json::to_value).collect::<Result<_, _>>()?;
        all.extend(bases.iter().map(serde_json::to_value).collect::<Result<Vec<_>, _>>()?);
        all.extend(manifest.wheels.values().map(crate::sources::wheels::json));
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        if !rows.is_empty() || bases.is_empty() {
            print!("{}", status::table(&rows));
        }
        if !bases.is_empty() {
            if !rows.is_empty() {
                println!();
            }
            print!("{}", status::base_table(&bases));
        }
        if !manifest.wheels.is_empty() {
            println!();
            print!("{}", crate::sources::wheels::table(&manifest.wheels));
        }
    }
    // The crate sources' pins must agree with the workspace's Cargo.toml and Cargo.lock.
    let problems = cargo_pins::check(&manifest)?;
    if let Some((first, rest)) = problems.split_first() {
        for p in rest {
            eprintln!("distro: {p}");
        }
        return Err(bad_input(first.clone()));
    }
    if let Some(lock) = &lock {
        let gone_bases = lock.bases.keys().filter(|n| !manifest.bases.contains_key(*n));
        for name in lock.sources.keys().filter(|n| !manifest.sources.contains_key(*n)).chain(gone_bases) {
            eprintln!(
                "distro: the lock has an entry for `{name}`, which is not in the manifest; `distro lock` removes it"
            );
        }
    }
    Ok(())
}
