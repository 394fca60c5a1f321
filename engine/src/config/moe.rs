//! The `[model.moe]` section (`MoeConfig`): routing and capacity of a mixture of experts.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::{Key, at_least};

section! {
    /// A mixture of experts: Mixtral's and Qwen3-MoE's routing (softmax over all experts, keep
    /// the top k, renormalise or not) or DeepSeek-V3's (sigmoid scores, a selection bias,
    /// group-limited top k, scaled weights, shared experts beside the routed ones); dense
    /// layers among them.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct MoeConfig {
        /// Number of experts per layer.
        pub num_experts: usize = 8,
        /// Experts each token is sent to.
        pub top_k: usize = 2,
        /// Coefficient of the load-balancing auxiliary loss added to the objective.
        pub aux_loss_coef: f64 = 0.02,
        /// Rows each expert keeps, as a multiple of an even share of the slots a device routes
        /// (`ceil(factor · tokens · top_k / experts)`); slots past it are dropped. None: dropless.
        #[serde(skip_serializing_if = "Option::is_none")]
        pub capacity_factor: Option<f64> = None,
        /// Whether the top k probabilities are renormalised to sum to one (Mixtral; Qwen3-MoE's
        /// `norm_topk_prob`); false: each expert's output is weighted by its softmax probability.
        pub renormalize: bool = true,
        /// How the router scores the experts: `"softmax"` over all of them (Mixtral, Qwen3-MoE)
        /// or `"sigmoid"`, one independent score each (DeepSeek-V3, whose load-balancing loss
        /// is none: `aux_loss_coef = 0`).
        pub scoring: Scoring = Scoring::Softmax,
        /// Expert groups (DeepSeek-V3's `n_group`): a token's experts come from its
        /// `top_groups` best groups, a group scored by the sum of its two best scores. 1: no
        /// group limit.
        pub groups: usize = 1,
        /// Groups a token's experts may come from (`topk_group`).
        pub top_groups: usize = 1,
        /// Multiplies the routed experts' weights (DeepSeek-V3's `routed_scaling_factor`).
        pub routed_scale: f64 = 1.0,
        /// Whether each router has a selection bias (`mlp.gate.e_score_correction_bias`,
        /// DeepSeek-V3's): added to the scores to choose the experts, never to weight them;
        /// trained by `bias_update_rate`, not by gradients.
        pub selection_bias: bool = false,
        /// Auxiliary-loss-free balancing (DeepSeek-V3): after each step, each layer's selection
        /// bias moves by `rate · sign(mean load − load of e)`. 0: frozen.
        pub bias_update_rate: f64 = 0.0,
        /// Shared experts (DeepSeek-V3's `n_shared_experts`): one SwiGLU of width
        /// `shared_experts · model.mlp_dim` that every token goes through, unweighted, beside
        /// the routed ones (`mlp.shared_experts`). 0: none.
        pub shared_experts: usize = 0,
        /// Layers whose MLP is dense, a SwiGLU of width `dense_mlp_dim` (DeepSeek-V3's first
        /// `first_k_dense_replace` layers, Qwen3-MoE's `mlp_only_layers`).
        pub dense_layers: Vec<usize> = Vec::new(),
        /// Hidden width of the dense layers' SwiGLU (`intermediate_size`); needed with
        /// `dense_layers`.
        pub dense_mlp_dim: usize = 0,
    }
}

/// How a router scores its experts (`model.moe.scoring`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scoring {
    /// `softmax` over all experts (Mixtral, Qwen3-MoE).
    #[default]
    Softmax,
    /// An independent `sigmoid` per expert (DeepSeek-V3).
    Sigmoid,
}

impl MoeConfig {
    pub(super) fn validate(&self, n_layers: usize) -> Result<()> {
        if self.num_experts == 0 || self.top_k == 0 {
            bail!("model.moe.num_experts and model.moe.top_k must be greater than 0");
        }
        if self.top_k > self.num_experts {
            bail!("model.moe.top_k = {} is larger than model.moe.num_experts = {}", self.top_k, self.num_experts);
        }
        if !at_least(self.aux_loss_coef, 0.0) {
            bail!("model.moe.aux_loss_coef = {} must be a non-negative number", self.aux_loss_coef);
        }
        if let Some(factor) = self.capacity_factor
            && !(factor > 0.0 && factor.is_finite())
        {
            bail!("model.moe.capacity_factor = {factor} must be a positive number; leave it out for dropless routing");
        }
        let (e, g) = (self.num_experts, self.groups);
        if g == 0 || !e.is_multiple_of(g) {
            bail!("model.moe.groups = {g} must divide model.moe.num_experts = {e}");
        }
        if g > 1 {
            if e / g < 2 {
                bail!(
                    "model.moe.groups = {g} leaves {} expert per group; a group is scored by its two best experts",
                    e / g
                );
            }
            if !(1..=g).contains(&self.top_groups) {
                bail!("model.moe.top_groups = {} must be between 1 and model.moe.groups = {g}", self.top_groups);
            }
            if self.top_k > self.top_groups * (e / g) {
                bail!(
                    "model.moe.top_k = {} is more than the {} experts of model.moe.top_groups = {} groups",
                    self.top_k,
                    self.top_groups * (e / g),
                    self.top_groups
                );
            }
        }
        if !(self.routed_scale > 0.0 && self.routed_scale.is_finite()) {
            bail!("model.moe.routed_scale = {} must be a positive number", self.routed_scale);
        }
        if !at_least(self.bias_update_rate, 0.0) {
            bail!("model.moe.bias_update_rate = {} must be a non-negative number", self.bias_update_rate);
        }
        if self.bias_update_rate > 0.0 && !self.selection_bias {
            bail!("model.moe.bias_update_rate is set but model.moe.selection_bias = false: there is no bias to update");
        }
        if self.scoring == Scoring::Sigmoid && self.aux_loss_coef != 0.0 {
            bail!(
                "model.moe.aux_loss_coef = {} with model.moe.scoring = \"sigmoid\": the load-balancing loss is defined for softmax routing; set it to 0 (balance with model.moe.bias_update_rate)",
                self.aux_loss_coef
            );
        }
        if let Some(&l) = self.dense_layers.iter().find(|&&l| l >= n_layers) {
            bail!("model.moe.dense_layers holds layer {l}, but the model has {n_layers} layers");
        }
        if self.dense_layers.windows(2).any(|w| w[0] >= w[1]) {
            bail!("model.moe.dense_layers = {:?} must be increasing", self.dense_layers);
        }
        if self.dense_layers.len() == n_layers {
            bail!("model.moe.dense_layers holds every layer; a model without experts leaves out [model.moe]");
        }
        if !self.dense_layers.is_empty() && self.dense_mlp_dim == 0 {
            bail!(
                "model.moe.dense_layers is set but model.moe.dense_mlp_dim is not: the dense layers' width is needed"
            );
        }
        Ok(())
    }

    /// Rows each expert keeps of the `tokens · top_k` slots a device routes in one pass:
    /// `ceil(capacity_factor · tokens · top_k / experts)` (Megatron's and MaxText's
    /// capacity), all of them without a capacity factor.
    pub fn capacity(&self, tokens: usize) -> usize {
        let slots = tokens * self.top_k;
        match self.capacity_factor {
            None => slots,
            Some(factor) => ((factor * slots as f64 / self.num_experts as f64).ceil() as usize).clamp(1, slots.max(1)),
        }
    }

    /// The most rows a member of an expert group of `members` receives a layer when each
    /// routes `tokens` tokens: every member's `tokens · k` (dropless), or under a capacity
    /// factor each member's [`MoeConfig::capacity`] rows of each of the member's `E / members`
    /// experts, `E · C`, when fewer.
    pub fn most_received(&self, tokens: usize, members: usize) -> usize {
        (members * tokens * self.top_k).min(self.num_experts * self.capacity(tokens))
    }

    /// Whether the routers have a load-balancing loss (softmax scoring, as transformers
    /// computes it for Mixtral and Qwen3-MoE); DeepSeek-V3's sigmoid routing has none.
    pub fn has_aux_loss(&self) -> bool {
        self.scoring == Scoring::Softmax
    }

    /// Whether layer `i` is dense ([`MoeConfig::dense_layers`]).
    pub fn is_dense(&self, i: usize) -> bool {
        self.dense_layers.binary_search(&i).is_ok()
    }

    /// Layers with experts, out of `n_layers` (the load-balancing loss averages over them).
    pub fn moe_layers(&self, n_layers: usize) -> usize {
        n_layers - self.dense_layers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An expert's capacity: `ceil(factor · tokens · top_k / experts)`, at least one row, at most
    /// every slot; all slots without a factor.
    #[test]
    fn capacity_is_an_even_share_of_the_slots_times_the_factor() {
        let moe = |capacity_factor| MoeConfig {
            num_experts: 4,
            top_k: 2,
            aux_loss_coef: 0.0,
            capacity_factor,
            ..MoeConfig::default()
        };
        assert_eq!(moe(None).capacity(64), 128);
        assert_eq!(moe(Some(1.0)).capacity(64), 32);
        assert_eq!(moe(Some(1.25)).capacity(63), 40); // ceil(39.375)
        assert_eq!(moe(Some(1e-6)).capacity(64), 1);
        assert_eq!(moe(Some(100.0)).capacity(64), 128);
    }
}
