//! `distro patches refresh`: exports upstream-ref patches (`pull/123/head`) to patch files.
use super::ManifestArg;
use crate::sources::{Cache, refresh};
use anyhow::Result;
use clap::{Args, Subcommand};

/// `distro patches ...`.
#[derive(Subcommand, Debug)]
pub enum PatchesCommand {
    /// Export upstream-ref patches (pull/123/head) to patches/NAME/PR-123.patch.
    Refresh(RefreshArgs),
}

/// The arguments of `distro patches refresh`.
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
