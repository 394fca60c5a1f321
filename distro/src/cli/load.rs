//! `distro load`: loads refs of an OCI layout into the local Docker engine (or writes the tar
//! `docker load` reads); prints the loaded `REPO:REF` names.
use crate::oci::bundle::Bundle;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use crate::publish::daemon::Daemon;
use crate::publish::publish;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro load`.
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
    if a.output.is_none() {
        crate::docker::check_endpoint()?;
    }
    let (layout, _lock) = super::read_layout(&a.layout)?;
    let bundle = Bundle::from_layout(&layout, layout.refs()?)?;
    let daemon = Daemon { refs: a.refs, platform, repo: a.repo, output: a.output };
    for (name, _) in publish(&daemon, &bundle, &progress)?.names {
        println!("{name}");
    }
    Ok(ExitCode::SUCCESS)
}
