//! Device memory a training run takes, by what it holds, computed from the same activation plan
//! and element sizes the backends use (no allocation).
//!
//! CUDA: parameters 6 bytes each (f32 master + bf16 copy), gradients 4, AdamW moments 8;
//! activations 2 bytes (bf16), statistics and indices 4; plus the backend's scratch (the
//! cuBLASLt workspace, reduction partials, the attention backward pass's f32 dQ). The CUDA
//! context itself (about 0.5 GiB, more with many kernels loaded) and memory other processes
//! hold come on top. CPU: everything f32.

use super::Model;
use crate::backend::BufKind;
use crate::backend::cuda;

/// Where the run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The f32 reference.
    Cpu,
    /// A GPU with this many multiprocessors (it sizes a scratch buffer).
    Cuda {
        /// Streaming multiprocessors.
        sm_count: usize,
    },
}

/// Bytes per category.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// Parameters (on CUDA: the f32 master and the bf16 copy); under FSDP this device's pieces
    /// and the buffers of the units gathered at once.
    pub parameters: usize,
    /// Gradients (f32); under FSDP this device's pieces and the buffers of the units whose
    /// gradient is being accumulated.
    pub gradients: usize,
    /// AdamW's two moments (f32).
    pub optimizer: usize,
    /// Activations, statistics, tokens and routing tables for one micro-batch, RoPE table.
    pub activations: usize,
    /// The backend's own scratch.
    pub scratch: usize,
    /// Buffers the parallel strategies keep only to communicate: none today (FSDP's collectives
    /// work in place in the buffers it lends the units, counted with the parameters and
    /// gradients; NCCL's own buffers are part of the CUDA context).
    pub communication: usize,
}

impl Estimate {
    /// Everything together.
    pub fn total(&self) -> usize {
        self.parameters + self.gradients + self.optimizer + self.activations + self.scratch + self.communication
    }
}

/// Bytes per element of a buffer of `kind` on `target` (on CUDA, parameters count their bf16
/// copy too).
pub fn element_bytes(kind: BufKind, target: Target) -> usize {
    match target {
        Target::Cpu => 4,
        Target::Cuda { .. } => cuda::bytes_per_element(kind),
    }
}

/// Elements of a plan's RoPE table for `seq` positions: the rotated width's (latent attention's
/// rope part), none for the GPT family's learned positions.
pub(crate) fn rope_elements(m: &crate::config::ModelConfig, seq: usize) -> usize {
    // A second table for the local layers' base (Gemma 3).
    let tables = if m.rope_local_theta > 0.0 { 2 } else { 1 };
    if m.is_gpt() { 0 } else { tables * seq * m.rope_dim() }
}

/// The memory `model` (with its recomputation policy) takes to train micro-batches of `batch`
/// sequences of `seq` tokens on `target`.
pub fn estimate(model: &Model, batch: usize, seq: usize, target: Target) -> Estimate {
    let p = model.layout.len;
    let a = model.activation_elements(batch, seq);
    let rope = rope_elements(&model.config, seq);
    let bytes = |kind| element_bytes(kind, target);
    let scratch = match target {
        // The reduction partials; the other scratch is a few rows.
        Target::Cpu => p.div_ceil(1 << 14) * 8,
        Target::Cuda { sm_count } => cuda::scratch_bytes(&model.config, batch, seq, sm_count),
    };
    Estimate {
        parameters: p * bytes(BufKind::Params),
        gradients: p * bytes(BufKind::Grads),
        optimizer: 2 * p * bytes(BufKind::OptState),
        activations: a.activations * bytes(BufKind::Activations)
            + (a.scalars + rope) * bytes(BufKind::Scalars)
            + a.fp8 * bytes(BufKind::Fp8)
            + a.indices * 4,
        scratch,
        communication: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Remat, recipe::resolve};

    #[test]
    fn a_1b_model_needs_18_bytes_a_parameter_before_activations_on_cuda() {
        let c = resolve("llama3.2-1b", &[]).unwrap().config;
        let model = Model::new(&c.model);
        let e = estimate(&model, 1, 4096, Target::Cuda { sm_count: 132 });
        let p = model.layout.len;
        assert_eq!(e.parameters + e.gradients + e.optimizer, 18 * p);
        // 16 layers keep ~38k bf16 elements per token each, plus the bf16 logits.
        let per_token = e.activations as f64 / 4096.0;
        assert!((1.4e6..1.8e6).contains(&per_token), "{per_token} bytes per token");
        let cpu = estimate(&model, 1, 4096, Target::Cpu);
        assert_eq!(cpu.parameters + cpu.gradients + cpu.optimizer, 16 * p);
    }

    #[test]
    fn recomputation_shrinks_the_activations() {
        let c = resolve("llama3.2-1b", &[]).unwrap().config;
        let mut model = Model::new(&c.model);
        let target = Target::Cuda { sm_count: 132 };
        let none = estimate(&model, 2, 2048, target).activations;
        model.remat = Remat::Minimal;
        let minimal = estimate(&model, 2, 2048, target).activations;
        model.remat = Remat::Full;
        let full = estimate(&model, 2, 2048, target).activations;
        assert!(full < minimal && minimal < none, "{full} {minimal} {none}");
    }
}
