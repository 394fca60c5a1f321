//! The `[mesh]` section (`MeshConfig`); its sizes are checked against the devices and the model
//! when a run starts (`parallel/mesh.rs`).

use serde::{Deserialize, Serialize};

use super::Key;

section! {
    /// The device mesh: five parallel axes (data, fsdp, tensor, pipeline, seq), each split into an
    /// intra-node (`ici`) and an inter-node (`dcn`) size, as in MaxText, Pax and AXLearn. The `ici` sizes multiply to the
    /// devices per node and the `dcn` sizes to the number of nodes; one size per group may be -1,
    /// meaning "whatever fills it". Every key may change when a run resumes: checkpoints hold the
    /// whole, unsharded state, and the data position counts the samples of all ranks.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct MeshConfig {
        /// Data parallelism within a node: replicas that all-reduce gradients.
        @resumable
        pub ici_data: i64 = -1,
        /// Fully sharded data parallelism within a node: parameters, gradients and optimizer state
        /// sharded, parameters gathered per layer.
        @resumable
        pub ici_fsdp: i64 = 1,
        /// Tensor parallelism within a node: attention heads, MLP columns and experts split.
        @resumable
        pub ici_tensor: i64 = 1,
        /// Data parallelism across nodes.
        @resumable
        pub dcn_data: i64 = -1,
        /// Fully sharded data parallelism across nodes.
        @resumable
        pub dcn_fsdp: i64 = 1,
        /// Tensor parallelism across nodes.
        @resumable
        pub dcn_tensor: i64 = 1,
        /// Pipeline stages within a node (AXLearn's `pipeline` axis): the layers are split into
        /// contiguous stages, each device holding one stage's parameters, gradients and moments.
        @resumable
        pub ici_pipeline: i64 = 1,
        /// Pipeline stages across nodes.
        @resumable
        pub dcn_pipeline: i64 = 1,
        /// Sequence (context) parallelism within a node (AXLearn's `seq` axis): each sequence is
        /// cut into two chunks per device, one early and one late (Llama 3's load-balanced causal
        /// split), and attention all-gathers the keys and values over the axis.
        @resumable
        pub ici_seq: i64 = 1,
        /// Sequence parallelism across nodes.
        @resumable
        pub dcn_seq: i64 = 1,
        /// Expert parallelism within a node, carved out of the data axis (as Megatron-Core's
        /// `--expert-model-parallel-size`): each group of this many data ranks holds every expert
        /// once, whole experts divided among them, and a device holds only its own experts'
        /// parameters, gradients and moments. It must divide `ici_data` and
        /// `model.moe.num_experts`, and needs a mixture-of-experts model.
        @resumable
        pub ici_expert: i64 = 1,
        /// Expert parallelism across nodes, carved out of `dcn_data` likewise.
        @resumable
        pub dcn_expert: i64 = 1,
        /// FSDP: whether the forward pass releases each layer's gathered parameters once done with
        /// it (and the backward pass gathers them again), as FSDP2's `reshard_after_forward`. Off,
        /// the gathered parameters stay until the backward pass is done with them: one gather per
        /// unit and micro-batch instead of two, for the memory of the whole (tensor-local) model.
        @resumable
        pub fsdp_reshard_after_forward: bool = true,
        /// FSDP: whether the next unit's gather starts before the current unit computes, so that
        /// they overlap, at the memory of one more unit gathered at a time.
        @resumable
        pub fsdp_prefetch: bool = true,
    }
}
