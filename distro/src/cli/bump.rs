//! `distro bump`: moves pins to the tips of their tracking refs and drops patches merged
//! upstream; writes nothing when a patch no longer applies.
use super::ManifestArg;
use crate::error::bad_input;
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use crate::registry::reference::Reference;
use crate::sources::{BaseSpec, Cache, Lock, bump};
use anyhow::Result;
use clap::Args;

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
    /// Registry reachable over plain HTTP, for a base's tag (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    insecure: Vec<String>,
}

/// Runs `distro bump`: the changes on stdout, then writes the manifest and lock (unless
/// `--dry-run`); a patch that no longer applies fails it before anything is written.
pub fn bump(args: BumpArgs) -> Result<()> {
    let manifest = args.manifest.load()?;
    let cache = Cache::from_env()?;
    let lock = Lock::load(&manifest.lock_path())?;
    let client = Client::new(Credentials::from_environment(None)?, args.insecure.clone())?;
    let base_digest = |b: &BaseSpec| -> Result<String> {
        let reference = Reference::parse(&format!("{}:{}", b.image, b.tag))
            .map_err(|e| bad_input(format!("{}: base `{}`: {e:#}", manifest.path.display(), b.name)))?;
        eprintln!("distro: resolving base {reference}");
        Ok(client.fetch_manifest(&reference)?.digest.to_string())
    };
    let plan = bump::plan(&manifest, lock.as_ref(), &args.names, &cache, &base_digest)?;
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
    for b in &plan.base_changes {
        match &b.old {
            Some(old) if *old == b.new => println!("{}\t{}\trelocked", b.name, b.new),
            old => println!("{}\t{} -> {}", b.name, old.as_deref().unwrap_or("(unpinned)"), b.new),
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
    for path in &written.cargo_toml {
        eprintln!("distro: wrote {}", path.display());
    }
    if written.cargo_lock {
        eprintln!("distro: wrote {}", manifest.root.join("Cargo.lock").display());
    }
    if !written.manifest && !written.lock && written.cargo_toml.is_empty() && !written.cargo_lock {
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
