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

/// Refuses, in one line, a Docker endpoint this tool cannot reach, instead of silently using the
/// local socket: `DOCKER_HOST` other than `unix://` (tcp, ssh, npipe), or a Docker context other
/// than `default` (`DOCKER_CONTEXT`, or `currentContext` of the CLI's config.json), which the
/// docker CLI would follow. `DOCKER_HOST=unix://PATH` is honoured, as the docker CLI does.
pub fn check_endpoint() -> Result<()> {
    let config_dir = std::env::var_os("DOCKER_CONFIG")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".docker")));
    let current = config_dir
        .and_then(|d| std::fs::read(d.join("config.json")).ok())
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["currentContext"].as_str().map(String::from));
    let host = std::env::var("DOCKER_HOST").ok();
    let context = std::env::var("DOCKER_CONTEXT").ok();
    match endpoint_problem(host.as_deref(), context.as_deref(), current.as_deref()) {
        Some(p) => Err(crate::error::bad_input(p)),
        None => Ok(()),
    }
}

fn endpoint_problem(host: Option<&str>, context: Option<&str>, config_context: Option<&str>) -> Option<String> {
    const ONLY: &str = "distro load and distro run reach the Docker engine through a local unix:// socket only";
    const INSTEAD: &str = "or write the image with `distro load --output FILE` and `docker load -i FILE`";
    if let Some(h) = host.filter(|h| !h.is_empty()) {
        return (!h.starts_with("unix://")).then(|| format!("DOCKER_HOST={h}: {ONLY}; unset it, {INSTEAD}"));
    }
    let (name, value) = match (context.filter(|c| !c.is_empty()), config_context.filter(|c| !c.is_empty())) {
        (Some(c), _) => ("DOCKER_CONTEXT", c),
        (None, Some(c)) => ("the docker CLI's currentContext", c),
        (None, None) => return None,
    };
    (value != "default")
        .then(|| format!("{name} is {value:?}: {ONLY}, not a context's endpoint; use the default context, {INSTEAD}"))
}

/// Connects to the engine (`DOCKER_HOST` or the local socket) and negotiates the API version.
pub(crate) async fn connect() -> Result<Docker> {
    check_endpoint()?;
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

#[cfg(test)]
mod tests {
    use super::endpoint_problem;

    #[test]
    fn only_a_local_socket_is_reached_and_anything_else_is_refused() {
        assert_eq!(endpoint_problem(None, None, None), None);
        assert_eq!(endpoint_problem(Some("unix:///run/user/1/docker.sock"), Some("remote"), None), None);
        assert_eq!(endpoint_problem(None, Some("default"), Some("default")), None);
        let p = endpoint_problem(Some("tcp://10.0.0.2:2376"), None, None).unwrap();
        assert!(p.starts_with("DOCKER_HOST=tcp://10.0.0.2:2376: distro load and distro run reach"), "{p}");
        assert!(endpoint_problem(Some("ssh://me@host"), None, None).is_some());
        let p = endpoint_problem(None, None, Some("remote")).unwrap();
        assert!(p.starts_with("the docker CLI's currentContext is \"remote\""), "{p}");
        assert!(endpoint_problem(None, Some("remote"), Some("default")).unwrap().starts_with("DOCKER_CONTEXT"));
    }
}
