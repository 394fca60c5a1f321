//! Running a container: pulls the image when it is not local, requests GPUs when present,
//! streams the container's output and returns its exit code (the container is removed unless
//! asked to keep it; an interrupt stops it).
use super::{connect, runtime};
use crate::error::bad_input;
use crate::oci::platform::Platform;
use crate::progress::Progress;
use crate::registry::auth::{Credential, Credentials};
use crate::registry::reference::Reference;
use anyhow::{Context, Result, bail};
use bollard::Docker;
use bollard::models::{ContainerCreateBody, DeviceRequest, HostConfig};
use bollard::query_parameters::{
    CreateImageOptionsBuilder, KillContainerOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
    WaitContainerOptionsBuilder,
};
use futures_util::StreamExt;
use std::io::Write;
use std::path::Path;

/// Whether to request GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Gpus {
    /// All GPUs when the engine has an NVIDIA runtime or the host has NVIDIA devices.
    Auto,
    /// All GPUs, always (fails where there are none, as `docker run --gpus=all` does).
    All,
    /// No GPUs.
    None,
}

/// Options of `distro run`.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Image to run: a local name, or a reference pulled when not local.
    pub image: String,
    /// Command (empty: the image's default, `engine info`).
    pub cmd: Vec<String>,
    /// `KEY=VALUE` environment additions.
    pub env: Vec<String>,
    /// Whether to request the host's GPUs.
    pub gpus: Gpus,
    /// Keep the container after it exits.
    pub keep: bool,
    /// Platform to pull when the image is not local.
    pub platform: Option<Platform>,
    /// Bind mounts, `HOST_DIR:CONTAINER_DIR[:ro]` (as `docker run -v`).
    pub binds: Vec<String>,
    /// Send the container's stdout to our stderr too (when our stdout carries a result).
    pub stdout_to_stderr: bool,
}

/// Checks a `HOST:CONTAINER[:ro]` bind and makes the host side absolute (Docker requires it).
pub fn bind(spec: &str) -> Result<String> {
    let parts: Vec<&str> = spec.split(':').collect();
    let ok = matches!(parts.as_slice(), [h, c] | [h, c, "ro" | "rw"] if !h.is_empty() && c.starts_with('/'));
    if !ok {
        return Err(bad_input(format!("--volume {spec:?}: expected HOST_DIR:/CONTAINER_DIR[:ro]")));
    }
    let host = std::path::absolute(parts[0]).map_err(|e| bad_input(format!("--volume {spec:?}: {e}")))?;
    Ok(std::iter::once(host.to_string_lossy().into_owned())
        .chain(parts[1..].iter().map(|s| s.to_string()))
        .collect::<Vec<_>>()
        .join(":"))
}

/// The `--gpus=all` device request.
pub fn all_gpus() -> DeviceRequest {
    DeviceRequest {
        driver: Some(String::new()),
        count: Some(-1),
        capabilities: Some(vec![vec!["gpu".into()]]),
        ..Default::default()
    }
}

async fn gpus_present(d: &Docker) -> bool {
    let nvidia_runtime = d.info().await.ok().and_then(|i| i.runtimes).is_some_and(|r| r.contains_key("nvidia"));
    let hook = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|dir| dir.join("nvidia-container-runtime-hook").is_file()));
    nvidia_runtime || (Path::new("/dev/nvidiactl").exists() && hook)
}

/// `distro run`: runs `opts.image`, streaming its output; returns the container's exit code.
pub fn run(opts: &RunOptions, progress: &Progress) -> Result<i64> {
    runtime()?.block_on(async {
        let docker = connect().await?;
        if docker.inspect_image(&opts.image).await.is_err() {
            pull(&docker, &opts.image, opts.platform.as_ref(), progress).await?;
        }
        let gpus = match opts.gpus {
            Gpus::All => true,
            Gpus::None => false,
            Gpus::Auto => gpus_present(&docker).await,
        };
        let body = ContainerCreateBody {
            image: Some(opts.image.clone()),
            cmd: (!opts.cmd.is_empty()).then(|| opts.cmd.clone()),
            env: (!opts.env.is_empty()).then(|| opts.env.clone()),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            host_config: Some(HostConfig {
                device_requests: gpus.then(|| vec![all_gpus()]),
                binds: (!opts.binds.is_empty()).then(|| opts.binds.clone()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let created = docker
            .create_container(None, body)
            .await
            .with_context(|| format!("creating a container of {}", opts.image))?;
        let id = created.id;
        let result = run_container(&docker, &id, opts.stdout_to_stderr).await;
        if !opts.keep {
            let _ =
                docker.remove_container(&id, Some(RemoveContainerOptionsBuilder::default().force(true).build())).await;
        }
        result
    })
}

async fn run_container(docker: &Docker, id: &str, stdout_to_stderr: bool) -> Result<i64> {
    docker.start_container(id, None).await.context("starting the container")?;
    let mut logs = docker.logs(id, Some(LogsOptionsBuilder::default().follow(true).stdout(true).stderr(true).build()));
    let stream_logs = async {
        while let Some(item) = logs.next().await {
            match item.context("reading the container's output")? {
                bollard::container::LogOutput::StdErr { message } => {
                    let mut e = std::io::stderr().lock();
                    e.write_all(&message)?;
                    e.flush()?;
                }
                other if stdout_to_stderr => {
                    let mut e = std::io::stderr().lock();
                    e.write_all(&other.into_bytes())?;
                    e.flush()?;
                }
                other => {
                    let mut o = std::io::stdout().lock();
                    o.write_all(&other.into_bytes())?;
                    o.flush()?;
                }
            }
        }
        anyhow::Ok(())
    };
    tokio::select! {
        r = stream_logs => r?,
        _ = tokio::signal::ctrl_c() => {
            let _ = docker.kill_container(id, Some(KillContainerOptionsBuilder::default().signal("SIGINT").build())).await;
        }
    }
    let mut wait =
        docker.wait_container(id, Some(WaitContainerOptionsBuilder::default().condition("not-running").build()));
    match wait.next().await {
        Some(Ok(r)) => Ok(r.status_code),
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => Ok(code),
        Some(Err(e)) => Err(e).context("waiting for the container"),
        None => bail!("the Docker engine ended the wait without an exit code"),
    }
}

async fn pull(docker: &Docker, image: &str, platform: Option<&Platform>, progress: &Progress) -> Result<()> {
    let r = Reference::parse(image)?;
    let step = progress.step(format!("pulling {image}"));
    let found = Credentials::from_environment(None)?.lookup(r.api_host())?;
    let creds = found.map(|f| {
        let mut c = bollard::auth::DockerCredentials { serveraddress: Some(r.registry.clone()), ..Default::default() };
        match f.credential {
            Credential::Basic { user, password } => {
                c.username = Some(user);
                c.password = Some(password);
            }
            Credential::Identity(t) => c.identitytoken = Some(t),
            Credential::Registry(t) => c.registrytoken = Some(t),
        }
        c
    });
    let mut b = CreateImageOptionsBuilder::default()
        .from_image(&format!("{}", Reference { tag: None, digest: None, ..r.clone() }));
    let t = r.digest.as_ref().map(|d| d.to_string()).or(r.tag.clone()).unwrap_or_else(|| "latest".into());
    b = b.tag(&t);
    if let Some(p) = platform {
        b = b.platform(&p.to_string());
    }
    let mut s = docker.create_image(Some(b.build()), None, creds);
    while let Some(item) = s.next().await {
        item.with_context(|| format!("pulling {image}"))?;
    }
    step.done("pulled");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn binds_are_checked_and_made_absolute() {
        assert_eq!(bind("/data:/triage").unwrap(), "/data:/triage");
        assert_eq!(bind("/data:/triage:ro").unwrap(), "/data:/triage:ro");
        let rel = bind("out:/triage").unwrap();
        assert!(rel.starts_with('/') && rel.ends_with("/out:/triage"), "{rel}");
        for bad in ["/data", "/data:triage", ":/x", "/a:/b:rx"] {
            let e = bind(bad).unwrap_err();
            assert!(crate::error::is_bad_input(&e), "{bad}");
        }
    }

    #[test]
    fn gpu_request_is_the_api_form_of_gpus_all() {
        let hc = HostConfig { device_requests: Some(vec![all_gpus()]), ..Default::default() };
        let v = serde_json::to_value(&hc).unwrap();
        assert_eq!(v["DeviceRequests"], json!([{"Driver": "", "Count": -1, "Capabilities": [["gpu"]]}]));
    }
}
