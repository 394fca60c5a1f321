//! The attention's own tables of `[model]`: `[model.mla]` (multi-head latent attention,
//! [`MlaConfig`]) and `[model.yarn]` (YaRN RoPE scaling, [`Yarn`]).

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::{Key, ModelConfig, at_least, check_at_most, check_positive, positive_number};

section! {
    /// YaRN RoPE scaling (`rope_type = "yarn"`), as transformers computes it
    /// (`_compute_yarn_parameters`): frequencies of short wavelengths are kept, long ones
    /// divided by `factor`, a linear ramp between (from `beta_fast` to `beta_slow` rotations
    /// over the original context); cos and sin are multiplied by the attention factor.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct Yarn {
        /// Context extension factor.
        pub factor: f64 = 1.0,
        /// Context length of pre-training (`original_max_position_embeddings`).
        pub original_max_seq_len: usize = 4096,
        /// Rotations over the original context below which frequencies are interpolated.
        pub beta_fast: f64 = 32.0,
        /// Rotations above which frequencies are kept.
        pub beta_slow: f64 = 1.0,
        /// `mscale`: the attention factor is `m(factor, mscale) / m(factor, mscale_all_dim)`
        /// (`m(f, s) = 0.1 · s · ln f + 1`) when both are set, else `m(factor, 1)`.
        pub mscale: f64 = 1.0,
        /// `mscale_all_dim`; nonzero, latent attention's softmax scale is also multiplied by
        /// `m(factor, mscale_all_dim)²`.
        pub mscale_all_dim: f64 = 0.0,
        /// The attention factor, given (`attention_factor`); absent: from the mscales.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub attention_factor: Option<f64> = None,
        /// Whether the ramp's ends are rounded to whole dimensions (transformers' `truncate`).
        pub truncate: bool = true,
    }
}

impl Yarn {
    pub(super) fn validate(&self) -> Result<()> {
        if !at_least(self.factor, 1.0) {
            bail!("model.yarn.factor = {} must be at least 1", self.factor);
        }
        if self.original_max_seq_len == 0 {
            bail!("model.yarn.original_max_seq_len must be greater than 0");
        }
        if !(positive_number(self.beta_fast) && positive_number(self.beta_slow) && self.beta_fast > self.beta_slow) {
            bail!(
                "model.yarn.beta_fast = {} must be greater than model.yarn.beta_slow = {} (both positive)",
                self.beta_fast,
                self.beta_slow
            );
        }
        for (key, v) in [("mscale", self.mscale), ("mscale_all_dim", self.mscale_all_dim)] {
            if !at_least(v, 0.0) {
                bail!("model.yarn.{key} = {v} must be a non-negative number");
            }
        }
        if let Some(a) = self.attention_factor
            && !positive_number(a)
        {
            bail!("model.yarn.attention_factor = {a} must be a positive number");
        }
        Ok(())
    }
}

section! {
    /// Multi-head latent attention (DeepSeek-V3): queries through a low-rank latent
    /// (`q_lora_rank`, or one `q_proj` when 0), keys and values through one shared latent
    /// (`kv_lora_rank`), each latent RMSNormed; a RoPE key of `rope_dim` shared by all heads
    /// beside each head's `nope_dim` key; values `v_dim` wide. `model.head_dim` is the query
    /// and key width, `nope_dim + rope_dim`, and `model.n_kv_heads = model.n_heads`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct MlaConfig {
        /// Rank of the query latent (`q_lora_rank`); 0: queries by one projection (`q_proj`).
        pub q_lora_rank: usize = 0,
        /// Rank of the key-value latent (`kv_lora_rank`).
        pub kv_lora_rank: usize = 0,
        /// Per-head query and key width without RoPE (`qk_nope_head_dim`).
        pub nope_dim: usize = 0,
        /// Width of the RoPE part of queries and of the shared RoPE key (`qk_rope_head_dim`).
        pub rope_dim: usize = 0,
        /// Per-head value width (`v_head_dim`), at most `model.head_dim`.
        pub v_dim: usize = 0,
        /// Whether RoPE pairs adjacent dimensions (`rope_interleave`, DeepSeek's default);
        /// false: the first half with the second.
        pub interleave: bool = true,
        /// Epsilon of the latents' RMSNorms (transformers builds them with its default, 1e-6,
        /// not `rms_norm_eps`).
        pub latent_norm_eps: f64 = 1e-6,
    }
}

impl MlaConfig {
    pub(super) fn validate(&self, m: &ModelConfig) -> Result<()> {
        check_positive(&[
            ("model.mla.kv_lora_rank", self.kv_lora_rank),
            ("model.mla.nope_dim", self.nope_dim),
            ("model.mla.rope_dim", self.rope_dim),
            ("model.mla.v_dim", self.v_dim),
        ])?;
        check_at_most(&[
            ("model.mla.q_lora_rank", self.q_lora_rank, 1 << 16),
            ("model.mla.kv_lora_rank", self.kv_lora_rank, 1 << 16),
        ])?;
        if !self.rope_dim.is_multiple_of(2) {
            bail!("model.mla.rope_dim = {} must be even (RoPE rotates pairs of dimensions)", self.rope_dim);
        }
        if m.head_dim != self.nope_dim + self.rope_dim {
            bail!(
                "model.head_dim = {} must be model.mla.nope_dim + model.mla.rope_dim = {} under latent attention",
                m.head_dim,
                self.nope_dim + self.rope_dim
            );
        }
        if self.v_dim > m.head_dim {
            bail!(
                "model.mla.v_dim = {} is wider than the query and key heads (model.head_dim = {})",
                self.v_dim,
                m.head_dim
            );
        }
        if m.n_kv_heads != m.n_heads {
            bail!(
                "model.n_kv_heads = {} must equal model.n_heads = {} under latent attention (every head has its keys)",
                m.n_kv_heads,
                m.n_heads
            );
        }
        if !positive_number(self.latent_norm_eps) {
            bail!("model.mla.latent_norm_eps = {} must be a positive number", self.latent_norm_eps);
        }
        Ok(())
    }
}
