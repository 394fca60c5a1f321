//! The local Docker engine: loading images into it ([`load`]: the tar `docker load` accepts) and
//! running containers ([`run`]: GPUs when present, output streamed, the exit code returned).
//! Both talk to the engine through one connection setup, here.
use crate::oci::platform::Platform;
use anyhow::{Context, Result, bail};
use bollard::Docker;
use std::time::Duration;

pub mod load;
pub mod run;

pub use load::{LoadImage, Loaded, load};
pub use run::{Gpus, RunOptions, bind, run};

/// A single-threaded async runtime for one call into the engine.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")
}

/// Connects to the engine (`DOCKER_HOST` or the local socket) and negotiates the API version.
pub(crate) async fn connect() -> Result<Docker> {
    // Containers run for hours (training); the client's default two-minute timeout would cut
    // the log stream.
    let d = Docker::connect_with_local_defaults()
        .context("connecting to the Docker engine")?
        .with_timeout(Duration::from_secs(60 * 60 * 24 * 365));
    d.negotiate_version().await.context("connecting to the Docker engine (is dockerd running? DOCKER_HOST?)")
}

/// The daemon's platform.
pub(crate) async fn daemon_platform(d: &Docker) -> Result<Platform> {
    let info = d.info().await.context("docker info")?;
    match info.architecture.as_deref() {
        Some("x86_64") | Some("amd64") => Platform::parse("linux/amd64"),
        Some("aarch64") | Some("arm64") => Platform::parse("linux/arm64"),
        other => bail!("the Docker engine runs on {other:?}, which this tool does not build for"),
    }
}
