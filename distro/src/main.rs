//! The `distro` command line: argument definitions and dispatch to the library.
use clap::{Parser, Subcommand};
use distro::sources::cmd;
use std::process::ExitCode;

/// Builds reproducible, dated, multi-arch OCI images of the engine.
#[derive(Parser)]
#[command(name = "distro", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the upstream sources: kind, pin, tracking ref, patch count, lock status.
    Sources(cmd::SourcesArgs),
    /// Resolve the manifest as pinned (fetch, apply patches) and write the lock.
    Lock(cmd::LockArgs),
    /// Materialise the patched source trees, verifying the lock.
    Fetch(cmd::FetchArgs),
    /// Move pins to the tip of their tracking refs, drop patches merged upstream.
    Bump(cmd::BumpArgs),
    /// Manage patches.
    #[command(subcommand)]
    Patches(cmd::PatchesCommand),
}

fn main() -> ExitCode {
    // A panic is a bug in distro: one line saying so, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("error: internal error (a bug in distro, please report it): {info}");
    }));
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Sources(args) => cmd::sources(args),
        Command::Lock(args) => cmd::lock(args),
        Command::Fetch(args) => cmd::fetch(args),
        Command::Bump(args) => cmd::bump(args),
        Command::Patches(command) => cmd::patches(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => distro::error::report(&err),
    }
}
