//! The memory plan of one device of a mesh: the model's estimate ([`crate::model::memory`]) for
//! the device's pipeline stage and tensor-parallel slice and its share of the batch, with the
//! strategies' own buffers. It follows what [`super::strategies::Parallel`] allocates
//! ([`fsdp_sizes`]): under FSDP a device keeps its pieces of the parameters, gradients and
//! moments, and the buffers it lends the passes for the units in use (gathered parameters, in
//! the precision the ops read: bf16 on a GPU; gradients being accumulated, in f32), but never
//! the whole model. A pipeline stage holds its own units only, and the activations of every
//! micro-batch its schedule keeps in flight ([`super::pipeline::slots`]); under interleaved
//! 1F1B, each virtual stage's micro-batches in flight, each with that virtual stage's layers'
//! activations.
//!
//! The plan's stages, micro-batch and schedules come from [`super::plan::ParallelPlan`], whose
//! [`estimate`](super::plan::ParallelPlan::estimate) and
//! [`stage_estimates`](super::plan::ParallelPlan::stage_estimates) call [`device_estimate`] for
//! each stage.

use super::strategies::{FsdpOptions, fsdp_sizes};
use crate::backend::BufKind;
use crate::config::Config;
use crate::model::Model;
use crate::model::memory::{self, Estimate, Target, element_bytes};

/// One pipeline stage's plan.
#[derive(Debug, Clone)]
pub struct StagePlan {
    /// Its layers.
    pub layers: std::ops::Range<usize>,
    /// The layers of its later virtual stages (interleaved 1F1B; empty without).
    pub later: Vec<std::ops::Range<usize>>,
    /// Micro-batches its schedule keeps in flight (each with its activations), all its
    /// virtual stages together.
    pub in_flight: usize,
    /// Those of each virtual stage, its own slots (one entry without virtual stages).
    pub chunk_in_flight: Vec<usize>,
    /// Bytes one of its devices holds.
    pub estimate: Estimate,
}

/// Bytes a device holding `model` (its tensor-parallel slice of a pipeline stage:
/// [`super::plan::ParallelPlan::stage_model`]) takes on `target` to train `config`'s
/// micro-batches of `batch` sequences, `in_flight[c]` of them at once on its virtual stage `c`
/// (one entry without virtual stages), with its parameters, gradients and moments sharded over
/// `fsdp` devices.
///
/// With virtual stages (interleaved 1F1B) each virtual stage keeps its own activation slots,
/// sized for its layers alone ([`super::pipeline::chunk_models`]); the first slot of the first
/// holds the backward scratch they share, as the trainer plans them.
pub fn device_estimate(
    config: &Config,
    model: &Model,
    batch: usize,
    in_flight: &[usize],
    fsdp: usize,
    target: Target,
) -> Estimate {
    let (mut e, slot) = device_estimate_slots(config, model, batch, fsdp, target);
    // Each further micro-batch in flight keeps its own activations and inputs.
    if let [one] = in_flight {
        e.activations += (one - 1) * slot;
    } else {
        let seq_len = config.train.seq_len / model.seq.ranks;
        let chunks = super::pipeline::chunk_models(model);
        assert_eq!(chunks.len(), in_flight.len(), "internal error: virtual stages and their slots");
        e.activations = memory::estimate(&chunks[0], batch, seq_len, target).activations;
        for (c, (chunk, &n)) in chunks.iter().zip(in_flight).enumerate() {
            e.activations += (n - usize::from(c == 0)) * slot_bytes(config, chunk, batch, target);
        }
    }
    e
}

/// [`device_estimate`] without virtual stages, in two parts: the bytes with one micro-batch in
/// flight, and those each further one adds (its slot); `n` in flight take `e + (n − 1) · slot`.
pub fn device_estimate_slots(
    config: &Config,
    model: &Model,
    batch: usize,
    fsdp: usize,
    target: Target,
) -> (Estimate, usize) {
    // A device of a seq axis keeps two chunks of each sequence.
    let seq_len = config.train.seq_len / model.seq.ranks;
    let mut e = memory::estimate(model, batch, seq_len, target);
    if fsdp > 1 {
        let casts = model.fp8_cast_weights(batch * seq_len, None);
        let f = fsdp_sizes(&model.layout, fsdp, FsdpOptions::of(&config.mesh), &casts);
        let bytes = |kind| element_bytes(kind, target);
        e.parameters = f.shard * bytes(BufKind::Params)
            + f.gathered * bytes(BufKind::Gathered)
            + f.gathered_fp8 * bytes(BufKind::Fp8);
        e.gradients = (f.shard + f.accumulating) * bytes(BufKind::Grads);
        e.optimizer = 2 * f.shard * bytes(BufKind::OptState);
    }
    if config.optim.name == crate::config::OptimName::Muon {
        // Muon's assembly buffer and Newton–Schulz scratch, in the activations' type.
        let muon = super::strategies::MatrixScratch::of_model(config, model, fsdp);
        e.optimizer +=
            muon.total() * element_bytes(BufKind::Activations, target) + element_bytes(BufKind::Scalars, target);
    }
    (e, slot_bytes(config, model, batch, target))
}

/// Bytes of one more micro-batch in flight on a device holding `model`: its activations, its
/// statistics and RoPE table, its FP8 inputs kept for the backward pass, its indices.
fn slot_bytes(config: &Config, model: &Model, batch: usize, target: Target) -> usize {
    let seq_len = config.train.seq_len / model.seq.ranks;
    let rope = crate::model::memory::rope_elements(&config.model, seq_len);
    let more = model.slot_activation_elements(batch, seq_len);
    more.activations * element_bytes(BufKind::Activations, target)
        + (more.scalars + rope) * element_bytes(BufKind::Scalars, target)
        + more.fp8 * element_bytes(BufKind::Fp8, target)
        + more.indices * 4
}
