//! This process's part in a job: the mesh over the job's devices and the communicator that
//! joins its processes. The `engine train` command and the virtual devices call these; the
//! trainer receives the result.

use std::time::Duration;

use anyhow::{Context, Result, anyhow};

use super::mesh::Mesh;
use super::nccl::{self, Nccl};
use super::rendezvous::{self, Job};
use super::tcp::{self, Tcp};
use crate::config::Config;

/// The mesh of `config` over `nodes` nodes of `devices_per_node` devices, checked against the
/// model (the split axes must divide its heads, columns and experts).
pub fn mesh(config: &Config, devices_per_node: usize, nodes: usize) -> Result<Mesh> {
    let mesh = Mesh::resolve(&config.mesh, devices_per_node, nodes).map_err(|e| anyhow!("{e}"))?;
    mesh.check_model(&config.model).map_err(|e| anyhow!("{e}"))?;
    let stages = mesh.size(super::mesh::Axis::Pipeline);
    super::pipeline::check_layers(config, stages).map_err(|e| anyhow!("{e}"))?;
    super::pipeline::microbatch_sequences(config, &mesh).map_err(|e| anyhow!("{e}"))?;
    Ok(mesh)
}

/// How long a rendezvous waits for every rank: `asked` (a command-line flag), else the
/// `ENGINE_RENDEZVOUS_TIMEOUT` variable, else 300 seconds.
pub fn rendezvous_timeout(asked: Option<f64>) -> Result<Duration> {
    let seconds = match (asked, std::env::var("ENGINE_RENDEZVOUS_TIMEOUT")) {
        (Some(s), _) => s,
        (None, Ok(v)) => {
            v.trim().parse().with_context(|| format!("ENGINE_RENDEZVOUS_TIMEOUT = `{v}` is not a number"))?
        }
        (None, Err(_)) => 300.0,
    };
    anyhow::ensure!(
        seconds > 0.0 && seconds.is_finite(),
        "the rendezvous timeout must be a positive number of seconds"
    );
    Ok(Duration::from_secs_f64(seconds))
}

/// The job's TCP collectives, for a multi-process job on CPUs: every rank connects to every
/// other after the rendezvous; collectives wait `ENGINE_COLLECTIVE_TIMEOUT` seconds at most.
pub fn tcp_communicator(job: &Job) -> Result<Tcp> {
    Tcp::connect(job, rendezvous_timeout(None)?, tcp::collective_timeout()?)
}

/// The job's NCCL communicator: rank 0 makes the unique id, the rendezvous hands it to every
/// rank, and each joins with its global rank.
pub fn nccl_communicator(job: &Job) -> Result<Nccl> {
    let id = if job.rank == 0 { nccl::unique_id()? } else { Vec::new() };
    let id = rendezvous::rendezvous(job, rendezvous_timeout(None)?, move || id)?;
    Nccl::init(&id, job.rank, job.world)
}
