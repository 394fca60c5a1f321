//! `distro run`: runs an image with Docker, streaming its output; exits with its exit code.
use crate::docker::{self, Gpus, RunOptions};
use crate::error::bad_input;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use anyhow::Result;
use clap::Args;
use std::process::ExitCode;

/// The arguments of `distro run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Image (e.g. distro:engine, or REGISTRY/REPO:engine-YYYY-MM-DD).
    pub image: String,
    /// Command (default: the image's, `engine info`).
    #[arg(last = true, value_name = "CMD")]
    pub cmd: Vec<String>,
    /// Environment variable KEY=VALUE for the container (repeatable).
    #[arg(short, long, value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// GPUs: auto (all, when the Docker engine has an NVIDIA runtime or the host NVIDIA devices),
    /// all, none.
    #[arg(long, value_enum, default_value_t = Gpus::Auto)]
    pub gpus: Gpus,
    /// Keep the container after it exits.
    #[arg(long)]
    pub keep: bool,
    /// Platform to pull when the image is not local.
    #[arg(long, value_name = "P")]
    pub platform: Option<String>,
    /// Bind mount HOST_DIR:CONTAINER_DIR[:ro] (repeatable), as `docker run -v`.
    #[arg(short, long, value_name = "HOST:CONTAINER")]
    pub volume: Vec<String>,
}

/// Runs `distro run`; exits with the container's exit code.
pub fn run_cmd(a: RunArgs) -> Result<ExitCode> {
    let progress = Progress::new();
    docker::check_endpoint()?;
    for e in &a.env {
        if !e.contains('=') {
            return Err(bad_input(format!("--env {e:?}: expected KEY=VALUE")));
        }
    }
    let opts = RunOptions {
        image: a.image,
        cmd: a.cmd,
        env: a.env,
        gpus: a.gpus,
        keep: a.keep,
        platform: a.platform.as_deref().map(Platform::parse).transpose()?,
        binds: a.volume.iter().map(|v| docker::bind(v)).collect::<Result<_>>()?,
        stdout_to_stderr: false,
    };
    let code = docker::run(&opts, &progress)?;
    Ok(ExitCode::from(u8::try_from(code.rem_euclid(256)).unwrap_or(1)))
}
