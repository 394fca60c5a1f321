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
/// ([`tcp::COLLECTIVE_FAILED`], as a collective that fails), which launchers and schedulers
/// retry, where bad input (exit 2) would only fail again.
#[derive(Debug)]
pub struct Transient(pub String);

impl std::fmt::Display for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Transient {}
