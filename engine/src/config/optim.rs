//! The `[optim]` section (`OptimConfig`) and its learning-rate `Schedule`.

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

section! {
    /// AdamW with decoupled weight decay and global-norm gradient clipping.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct OptimConfig {
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
        Ok(())
    }
}
