//! Training on many devices: the mesh that places ranks on the data, fsdp, tensor and pipeline
//! axes, the pipeline's stages and schedules, the plan that fixes them for a run, the
//! collectives that combine their work, the strategies that shard the model over them, and the
//! rendezvous and communicators that start a job.

pub mod comm;
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
