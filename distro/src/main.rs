//! The `distro` command line: argument definitions and dispatch to the library.
use clap::{Parser, Subcommand};
use distro::cli;
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
    Sources(cli::sources::SourcesArgs),
    /// Resolve the manifest as pinned (fetch, apply patches) and write the lock.
    Lock(cli::lock::LockArgs),
    /// Materialise the patched source trees, verifying the lock.
    Fetch(cli::fetch::FetchArgs),
    /// Move pins to the tip of their tracking refs, drop patches merged upstream.
    Bump(cli::bump::BumpArgs),
    /// Manage patches.
    #[command(subcommand)]
    Patches(cli::patches::PatchesCommand),
    /// Build the image natively (no Docker daemon): OCI layout and/or push; prints the index digest.
    Build(cli::build::BuildArgs),
    /// Push an OCI image layout to a registry.
    Push(cli::push::PushArgs),
    /// Load an image from an OCI layout into the local Docker engine.
    Load(cli::load::LoadArgs),
    /// Run an image with Docker (all GPUs when present), streaming its output; exits with its code.
    Run(cli::run::RunArgs),
    /// Find the first dated image where a command fails, then the upstream commit.
    Triage(cli::triage::TriageArgs),
    /// Delete dated tags older than N days, keeping the first of each month and the moving tag.
    Retention(cli::retention::RetentionArgs),
    /// Write the SPDX SBOM of the workspace's engine for one platform (used by the Dockerfile).
    Sbom(cli::sbom::SbomArgs),
    /// Show what changed between two images: sources, patches, base and its packages, env, sizes.
    Diff(cli::diff::DiffArgs),
    /// Check the SBOM, provenance (and with --key, the signature) attached to a pushed index.
    Verify(cli::verify::VerifyArgs),
    /// Sign a pushed index with an ECDSA P-256 key, as cosign does (`cosign verify --key` checks it).
    Sign(cli::sign::SignArgs),
    /// Attach test-all's summary.json to a pushed index as an OCI referrer, for `distro report`.
    AttachTest(cli::attach_test::AttachTestArgs),
    /// Write the static dashboard of the dated images (index.html, diff-DATE.html), from the registry.
    Report(cli::report::ReportArgs),
}

fn main() -> ExitCode {
    // Inside `distro build`, cargo runs distro as its RUSTC_WRAPPER (reproducible paths).
    if let Some(code) = distro::image::engine_build::run_as_rustc_wrapper() {
        return code;
    }
    // A panic is a bug in distro: one line saying so, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("error: internal error (a bug in distro, please report it): {info}");
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // A value a flag cannot take is bad input like any other: one line, exit code 2 (clap
        // adds a line pointing at --help).
        Err(e)
            if matches!(e.kind(), clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue) =>
        {
            let text = e.to_string();
            eprintln!("{}", text.lines().next().unwrap_or("error: invalid value"));
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_target(false).without_time().init();
    let done = |r: anyhow::Result<()>| r.map(|()| ExitCode::SUCCESS);
    let result = match cli.command {
        Command::Sources(args) => done(cli::sources::sources(args)),
        Command::Lock(args) => done(cli::lock::lock(args)),
        Command::Fetch(args) => done(cli::fetch::fetch(args)),
        Command::Bump(args) => done(cli::bump::bump(args)),
        Command::Patches(command) => done(cli::patches::patches(command)),
        Command::Build(a) => cli::build::build_cmd(a),
        Command::Push(a) => cli::push::push_cmd(a),
        Command::Load(a) => cli::load::load_cmd(a),
        Command::Run(a) => cli::run::run_cmd(a),
        Command::Sbom(a) => cli::sbom::sbom_cmd(a),
        Command::Diff(a) => cli::diff::diff_cmd(a),
        Command::Verify(a) => cli::verify::verify_cmd(a),
        Command::Sign(a) => cli::sign::sign_cmd(a),
        Command::AttachTest(a) => cli::attach_test::attach_test_cmd(a),
        Command::Report(a) => cli::report::report_cmd(a),
        Command::Triage(a) => cli::triage::triage_cmd(a),
        Command::Retention(a) => cli::retention::retention_cmd(a),
    };
    match result {
        Ok(code) => code,
        Err(err) => distro::error::report(&err),
    }
}
