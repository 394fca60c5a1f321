//! `distro`: command-line definitions and dispatch only; the work lives in the library.
use clap::{Parser, Subcommand};
use distro::image::cli;
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
    /// Build the image natively (no Docker daemon): OCI layout and/or push; prints the index digest.
    Build(cli::BuildArgs),
    /// Push an OCI image layout to a registry.
    Push(cli::PushArgs),
    /// Load an image from an OCI layout into the local Docker engine.
    Load(cli::LoadArgs),
    /// Run an image with Docker (all GPUs when present), streaming its output; exits with its code.
    Run(cli::RunArgs),
    /// Write the SPDX SBOM of the workspace's engine for one platform (used by the Dockerfile).
    Sbom(cli::SbomArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_target(false).without_time().init();
    let result = match cli.command {
        Command::Build(a) => cli::build_cmd(a),
        Command::Push(a) => cli::push_cmd(a),
        Command::Load(a) => cli::load_cmd(a),
        Command::Run(a) => cli::run_cmd(a),
        Command::Sbom(a) => cli::sbom_cmd(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let line = format!("{e:#}").lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("; ");
            eprintln!("error: {line}");
            ExitCode::from(if distro::image::error::is_bad_input(&e) { 2 } else { 1 })
        }
    }
}
