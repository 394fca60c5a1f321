//! Training on many devices: the mesh that places ranks on the data, fsdp and tensor axes, the
//! collectives that combine their work, and the rendezvous that starts a job.

pub mod comm;
pub mod devices;
pub mod mesh;
pub mod nccl;
pub mod rendezvous;
pub mod strategies;
pub mod tensor;
