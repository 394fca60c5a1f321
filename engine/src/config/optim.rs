//! The `[optim]` section (`OptimConfig`), its learning-rate `Schedule`, the optimizer's name
//! (`OptimName`) and `[optim.muon]` (`MuonConfig`, `AdjustLr`).

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::{Key, at_least, positive_number};

/// Shape of the learning rate over the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Linear warmup, then cosine decay to `lr * min_lr_ratio` at `decay_steps`.
    #[default]
    Cosine,
    /// Linear warmup, then constant.
    Constant,
}

/// Which optimizer updates the hidden matrices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimName {
    /// AdamW on every tensor.
    #[default]
    Adamw,
    /// Muon on the hidden matrices (`[optim.muon]`), AdamW with this section's keys on the
    /// rest: embeddings, the output head, norms, biases, routers.
    Muon,
}

/// How Muon scales its learning rate by a matrix's shape `[A, B]` (`[out, in]`), as
/// `torch.optim.Muon`'s `adjust_lr_fn` does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdjustLr {
    /// `lr · √max(1, A / B)` (Keller Jordan's original Muon).
    #[default]
    Original,
    /// `lr · 0.2 · √max(A, B)`: the update's RMS matches AdamW's, so AdamW's learning rate and
    /// weight decay carry over (Moonlight's "Muon is Scalable for LLM Training").
    MatchRmsAdamw,
}

/// How the devices that hold pieces of a matrix (FSDP, tensor parallelism) orthogonalise it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MuonDistribution {
    /// Each matrix is assembled on one owner, round-robin over the group (a reduce-scatter),
    /// orthogonalised there, and its update gathered back: the iterations' work is divided
    /// over the group (Moonlight's distributed Muon).
    #[default]
    Owner,
    /// Every device assembles every matrix (an all-reduce) and orthogonalises all of them.
    Everywhere,
}

section! {
    /// Muon: momentum orthogonalised by Newton–Schulz iterations, on the hidden matrices
    /// (`optim.name = "muon"`); `torch.optim.Muon`'s defaults and meanings.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct MuonConfig {
        /// Peak learning rate of the matrices Muon updates, following `optim.schedule`; 0 means
        /// `optim.lr`.
        pub lr: f64 = 0.0,
        /// Momentum of the buffer: `B ← μ B + (1 − μ) g`.
        pub momentum: f64 = 0.95,
        /// Nesterov momentum: orthogonalise `(1 − μ) g + μ B` instead of `B`.
        pub nesterov: bool = true,
        /// The quintic Newton–Schulz iteration's coefficients `(a, b, c)`:
        /// `X ← a X + (b X Xᵀ + c (X Xᵀ)²) X`.
        pub ns_coefficients: [f64; 3] = [3.4445, -4.7750, 2.0315],
        /// Newton–Schulz iterations.
        pub ns_steps: usize = 5,
        /// The matrix is divided by `max(‖X‖_F, eps)` before the iterations.
        pub eps: f64 = 1e-7,
        /// Decoupled weight decay of the matrices Muon updates: `p ← p · (1 − lr · wd)`.
        pub weight_decay: f64 = 0.1,
        /// The learning rate's adjustment by the matrix's shape.
        pub adjust_lr_fn: AdjustLr = AdjustLr::Original,
        /// How devices holding pieces of a matrix orthogonalise it (FSDP, tensor parallelism).
        @resumable
        pub distribution: MuonDistribution = MuonDistribution::Owner,
    }
}

impl MuonConfig {
    fn validate(&self) -> Result<()> {
        if !at_least(self.lr, 0.0) {
            bail!("optim.muon.lr = {} must be a non-negative number (0: optim.lr)", self.lr);
        }
        if !(0.0..1.0).contains(&self.momentum) {
            bail!("optim.muon.momentum = {} must lie in [0, 1)", self.momentum);
        }
        if self.ns_steps == 0 || self.ns_steps >= 100 {
            bail!(
                "optim.muon.ns_steps = {}: at least 1 Newton–Schulz iteration and fewer than 100 (5 is the default)",
                self.ns_steps
            );
        }
        if self.ns_coefficients.iter().any(|c| !c.is_finite()) {
            bail!("optim.muon.ns_coefficients = {:?} must be finite numbers", self.ns_coefficients);
        }
        if !positive_number(self.eps) {
            bail!("optim.muon.eps = {} must be positive", self.eps);
        }
        if !at_least(self.weight_decay, 0.0) {
            bail!("optim.muon.weight_decay = {} must be non-negative", self.weight_decay);
        }
        Ok(())
    }
}

section! {
    /// The optimizer (AdamW, or Muon with AdamW on what it does not take), global-norm
    /// gradient clipping and the learning-rate schedule.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct OptimConfig {
        /// The optimizer: `adamw`, or `muon` on the hidden matrices with AdamW on the rest.
        pub name: OptimName = OptimName::Adamw,
        /// Peak learning rate.
        pub lr: f64 = 3e-4,
        /// Learning-rate schedule after warmup.
        pub schedule: Schedule = Schedule::Cosine,
        /// Steps of linear warmup from 0 to `lr`.
        pub warmup_steps: usize = 0,
        /// Step at which the cosine reaches its floor; 0 means `train.steps`.
        pub decay_steps: usize = 0,
        /// Floor of the cosine as a fraction of `lr`.
        pub min_lr_ratio: f64 = 0.1,
        /// Decay rate of the first moment.
        pub beta1: f64 = 0.9,
        /// Decay rate of the second moment.
        pub beta2: f64 = 0.95,
        /// Added to the root of the second moment.
        pub eps: f64 = 1e-8,
        /// Decoupled weight decay of matrices (embeddings and projections); norms never decay.
        pub weight_decay: f64 = 0.1,
        /// Clip the global gradient norm to this value; 0 disables clipping.
        pub grad_clip: f64 = 1.0,
        /// QK-clip (Kimi K2's MuonClip with `name = "muon"`; any optimizer takes it): after each
        /// step, the q and k projections of every head whose largest attention logit `S` went
        /// past this threshold are rescaled so that it comes back to it (`η = τ / S`); 0
        /// disables it. Kimi K2 trained with 100. Not with `model.qk_norm`, whose norms undo it.
        @resumable
        pub qk_clip: f64 = 0.0,
        /// How QK-clip shares `η` between a head's queries (`η^α`) and keys (`η^(1−α)`).
        @resumable
        pub qk_clip_alpha: f64 = 0.5,
        /// Muon's keys (`name = "muon"`).
        pub muon: MuonConfig = MuonConfig::default(),
    }
}

impl OptimConfig {
    pub(super) fn validate(&self) -> Result<()> {
        if !at_least(self.lr, 0.0) {
            bail!("optim.lr = {} must be a non-negative number", self.lr);
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            bail!("optim.beta1 = {} and optim.beta2 = {} must lie in [0, 1)", self.beta1, self.beta2);
        }
        if !positive_number(self.eps) {
            bail!("optim.eps = {} must be positive", self.eps);
        }
        if !at_least(self.weight_decay, 0.0) || !at_least(self.grad_clip, 0.0) {
            bail!("optim.weight_decay and optim.grad_clip must be non-negative");
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            bail!("optim.min_lr_ratio = {} must lie in [0, 1]", self.min_lr_ratio);
        }
        if !at_least(self.qk_clip, 0.0) {
            bail!(
                "optim.qk_clip = {} must be a non-negative number (a logit threshold such as 100; 0 disables it)",
                self.qk_clip
            );
        }
        if !(0.0..=1.0).contains(&self.qk_clip_alpha) {
            bail!("optim.qk_clip_alpha = {} must lie in [0, 1] (0.5 shares the rescaling equally)", self.qk_clip_alpha);
        }
        self.muon.validate()
    }

    /// The peak learning rate of the matrices Muon updates.
    pub fn muon_lr(&self) -> f64 {
        if self.muon.lr > 0.0 { self.muon.lr } else { self.lr }
    }
}
