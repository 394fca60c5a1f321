//! `distro load`: loads refs of an OCI layout into the local Docker engine (or writes the tar
//! `docker load` reads); prints the loaded `REPO:REF` names.
use crate::docker;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// `distro load`.
#[derive(Args, Debug)]
pub struct LoadArgs {
    /// OCI image layout (default: target/distro/oci).
    #[arg(default_value = "target/distro/oci")]
    pub layout: PathBuf,
    /// Ref of the layout to load (repeatable; default: every ref).
    #[arg(long = "ref", value_name = "REF")]
    pub refs: Vec<String>,
    /// Platform to load (default: the Docker engine's).
    #[arg(long, value_name = "P")]
    pub platform: Option<String>,
    /// Repository the loaded images are tagged in: REPO:REF.
    #[arg(long, default_value = "distro", value_name = "REPO")]
    pub repo: String,
    /// Write the tar here (for `docker load -i`) instead of loading it.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// Runs `distro load`; prints the loaded `repo:tag` names.
pub fn load_cmd(a: LoadArgs) -> Result<ExitCode> {
    let progress = Progress::new();
    let platform = a.platform.as_deref().map(Platform::parse).transpose()?;
    let names = docker::load(&a.layout, &a.refs, platform.as_ref(), &a.repo, a.output.as_deref(), &progress)?;
    for n in names {
        println!("{n}");
    }
    Ok(ExitCode::SUCCESS)
}
