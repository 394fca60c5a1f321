//! Training on many devices: the mesh that places ranks on the data, fsdp, tensor and pipeline
//! axes, the pipeline's stages and schedules, the plan that fixes them for a run, the
//! collectives that combine their work, the strategies that shard the model over them, and the
//! rendezvous and communicators that start a job.

pub mod comm;
pub mod experts;
pub mod flight;
pub mod job;
pub mod memory;
pub mod mesh;
pub mod nccl;
pub mod pipeline;
pub mod plan;
pub mod planner;
pub mod rendezvous;
pub mod strategies;
pub mod tcp;
pub mod tensor;

/// A fault of the job rather than of its input: a rank that never arrived at the rendezvous or
/// left during it, a peer that did not connect. The command ends with exit code 75
/// ([`COLLECTIVE_FAILED`], as a collective that fails), which launchers and schedulers
/// retry, where bad input (exit 2) would only fail again.
#[derive(Debug)]
pub struct Transient(pub String);

/// The exit code of a rank whose collective failed (a peer left, or did not answer in time):
/// 75, `EX_TEMPFAIL`: the job can be restarted and resume from its last checkpoint. Here, below
/// `job`, `rendezvous`, `tcp` and `nccl`, which all use it, so that none imports another for it.
pub const COLLECTIVE_FAILED: i32 = 75;

/// This engine's version and the revision it was built from, as `engine info` prints them and
/// the rendezvous compares them.
pub fn engine_version() -> String {
    format!("{} ({})", env!("CARGO_PKG_VERSION"), option_env!("ENGINE_REVISION").unwrap_or("revision unknown"))
}

impl std::fmt::Display for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Transient {}
