//! The `[model]` section (`ModelConfig`), its `[model.rope_scaling]` table (`RopeScaling`) and the
//! model family (`Family`, `Gelu`); `[model.moe]` is in `moe.rs`.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::{Key, MlaConfig, MoeConfig, Yarn, at_least, check_at_most, check_positive, positive_number};

/// Which Hugging Face architecture the model corresponds to (names of tensors and config keys on
/// import and export). Llama, Mistral and Mixtral compute the same family of blocks (RMSNorm,
/// RoPE, SwiGLU); GPT is a second family (LayerNorm, learned positions, GELU, biases).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `LlamaForCausalLM`: Llama 2, Llama 3, 3.1, 3.2 and the AXLearn fuji models.
    #[default]
    Llama,
    /// `MistralForCausalLM`: Llama with an optional sliding attention window.
    Mistral,
    /// `MixtralForCausalLM`: Mistral with a mixture-of-experts MLP.
    Mixtral,
    /// `GPT2LMHeadModel`, and Pax's GPT: LayerNorm with weight and bias, learned absolute position
    /// embeddings (`max_seq_len` rows) added to the token embedding, no RoPE, biases on every
    /// projection, a plain `4·d` GELU MLP (no gate), usually tied embeddings.
    Gpt,
    /// `Qwen3ForCausalLM`: Llama's block with QK-norm (an RMSNorm over each query and key head,
    /// before RoPE: `self_attn.q_norm`, `self_attn.k_norm`).
    Qwen3,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention with a mixture-of-experts MLP (`mlp.gate`,
    /// `mlp.experts.E.{gate,up,down}_proj`).
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
    /// `DeepseekV3ForCausalLM`: multi-head latent attention (`[model.mla]`, YaRN positions) and
    /// DeepSeek's mixture of experts: sigmoid routing with a selection bias, expert groups,
    /// shared experts, dense first layers.
    #[serde(rename = "deepseek_v3")]
    DeepseekV3,
    /// `GptOssForCausalLM`: grouped-query attention with biases on q, k, v and o and a learned
    /// sink per head, sliding-window layers among full ones (`window_pattern`, `layer_types`),
    /// YaRN positions; a mixture of experts whose router and experts have biases, with a
    /// clamped SwiGLU (`glu_limit`, `glu_alpha`).
    #[serde(rename = "gpt_oss")]
    GptOss,
    /// `Gemma3ForCausalLM` (the text model of every Gemma 3 size): QK-norm, sandwich norms
    /// (each of attention and the MLP normed before and after, the output's norm before the
    /// residual add), RMSNorm weights stored as offsets from one (`1 + w`), a GELU-tanh gated
    /// MLP, the embedding scaled by √d, local layers (`sliding_window`, `window_pattern`,
    /// `rope_local_theta`) among global ones (`rope_theta`, `rope_linear_factor`),
    /// `query_pre_attn_scalar`, optional final-logit soft-capping.
    Gemma3,
}

impl Family {
    /// The name recipes write (`model.family`).
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Mixtral => "mixtral",
            Family::Gpt => "gpt",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3_moe",
            Family::DeepseekV3 => "deepseek_v3",
            Family::GptOss => "gpt_oss",
            Family::Gemma3 => "gemma3",
        }
    }

    /// Whether its MLP is a mixture of experts (`[model.moe]`).
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Mixtral | Family::Qwen3Moe | Family::DeepseekV3 | Family::GptOss)
    }

    /// Whether some layers may attend through a sliding window (`model.sliding_window`).
    pub fn has_windows(self) -> bool {
        matches!(self, Family::Mistral | Family::Mixtral | Family::GptOss | Family::Gemma3)
    }
}

/// The GELU of the GPT family's MLP (`model.gelu`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gelu {
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`: Pax's `approximate=True`, Hugging Face's
    /// `gelu_new`, GPT-2's.
    #[default]
    Tanh,
    /// `0.5·x·(1 + erf(x/√2))`, the exact GELU (Hugging Face's `gelu`).
    Erf,
}

impl Gelu {
    /// Whether this is the default (tanh), which configurations leave unwritten.
    pub fn is_tanh(&self) -> bool {
        *self == Gelu::Tanh
    }
}

section! {
    /// The transformer: a decoder-only stack of pre-norm attention and (SwiGLU or MoE) MLP blocks.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct ModelConfig {
        /// Hugging Face architecture the tensors and config map to.
        pub family: Family = Family::Llama,
        /// Number of token ids.
        pub vocab_size: usize = 0,
        /// Width of the residual stream.
        pub d_model: usize = 0,
        /// Number of transformer blocks.
        pub n_layers: usize = 0,
        /// Number of query heads.
        pub n_heads: usize = 0,
        /// Number of key/value heads; must divide `n_heads` (equal: MHA, 1: MQA).
        pub n_kv_heads: usize = 0,
        /// Width of one attention head; independent of `d_model`.
        pub head_dim: usize = 0,
        /// Hidden width of the SwiGLU MLP (of each expert for MoE).
        pub mlp_dim: usize = 0,
        /// RMSNorm epsilon (LayerNorm's for the GPT family).
        pub norm_eps: f64 = 1e-5,
        /// RoPE base (of the global layers when `rope_local_theta` is set).
        pub rope_theta: f64 = 10_000.0,
        /// RoPE base of the sliding-window layers, which no scaling applies to (Gemma 3's
        /// `rope_local_base_freq`); 0: every layer uses `rope_theta`.
        pub rope_local_theta: f64 = 0.0,
        /// Linear RoPE scaling (`rope_type = "linear"`): every frequency of the layers on
        /// `rope_theta` divided by it (Gemma 3 4b-27b: 8); 1: none.
        pub rope_linear_factor: f64 = 1.0,
        /// Llama 3.1 frequency scaling of RoPE; absent means none.
        pub rope_scaling: Option<RopeScaling> = None,
        /// YaRN frequency scaling of RoPE (`rope_type = "yarn"`); absent means none.
        pub yarn: Option<Yarn> = None,
        /// Multi-head latent attention (DeepSeek-V3); absent means grouped-query attention.
        pub mla: Option<MlaConfig> = None,
        /// Longest sequence the model supports (`max_position_embeddings`).
        pub max_seq_len: usize = 0,
        /// Sliding attention window W (query i sees keys j with i - W < j <= i); 0 means none.
        /// Every layer uses it unless `window_pattern` or `layer_types` names full layers.
        pub sliding_window: usize = 0,
        /// Every N-th layer (the N-th, 2N-th, ...) attends to the whole context, the others
        /// through `sliding_window` (Gemma's `sliding_window_pattern`; GPT-OSS: 2); 0: none.
        pub window_pattern: usize = 0,
        /// Each layer's attention, `"sliding"` or `"full"` (transformers' `layer_types`), for
        /// orders no `window_pattern` gives; empty: as `window_pattern` says.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        pub layer_types: Vec<LayerType> = Vec::new(),
        /// Whether the output projection shares the input embedding matrix.
        pub tie_embeddings: bool = false,
        /// Standard deviation of the normal initialisation of weight matrices.
        pub init_std: f64 = 0.02,
        /// Mixture-of-experts MLP; absent means a dense SwiGLU MLP.
        pub moe: Option<MoeConfig> = None,
        /// The GELU of the GPT family's MLP (ignored by the other families); unwritten when tanh.
        #[serde(skip_serializing_if = "Gelu::is_tanh")]
        pub gelu: Gelu = Gelu::Tanh,
        /// GPT-OSS's clamped SwiGLU: the gate is clamped from above and the up projection to
        /// ±`glu_limit` (transformers' `swiglu_limit`).
        pub glu_limit: f64 = 7.0,
        /// GPT-OSS's clamped SwiGLU: `gate · sigmoid(glu_alpha · gate)` (`swiglu_alpha`).
        pub glu_alpha: f64 = 1.702,
        /// Gemma 3: the attention logits are scaled by `query_pre_attn_scalar^-1/2`; 0: by
        /// `head_dim^-1/2`.
        pub query_pre_attn_scalar: f64 = 0.0,
        /// Gemma's final-logit soft-capping: `logits = c · tanh(logits / c)` before the loss
        /// (`final_logit_softcapping`); 0: none.
        pub final_logit_softcap: f64 = 0.0,
    }
}

/// A layer's attention span (`model.layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerType {
    /// Through `model.sliding_window`.
    Sliding,
    /// The whole context.
    Full,
}

impl ModelConfig {
    /// The model's own consistency: sizes, the family's features, the experts.
    pub(super) fn validate(&self) -> Result<()> {
        let positive = [
            ("model.vocab_size", self.vocab_size),
            ("model.d_model", self.d_model),
            ("model.n_layers", self.n_layers),
            ("model.n_heads", self.n_heads),
            ("model.n_kv_heads", self.n_kv_heads),
            ("model.head_dim", self.head_dim),
            ("model.mlp_dim", self.mlp_dim),
            ("model.max_seq_len", self.max_seq_len),
        ];
        check_positive(&positive)?;
        // Bounds well past every published configuration, tight enough that no size computed from
        // them (parameters, bytes, activations, tokens per step) can overflow.
        let at_most = [
            ("model.vocab_size", self.vocab_size, 1 << 24),
            ("model.d_model", self.d_model, 1 << 17),
            ("model.n_layers", self.n_layers, 1 << 12),
            ("model.n_heads", self.n_heads, 1 << 12),
            ("model.head_dim", self.head_dim, 1 << 10),
            ("model.mlp_dim", self.mlp_dim, 1 << 20),
            ("model.max_seq_len", self.max_seq_len, 1 << 24),
            ("model.moe.num_experts", self.moe.as_ref().map_or(1, |e| e.num_experts), 1 << 10),
        ];
        check_at_most(&at_most)?;
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            bail!(
                "model.n_heads = {} is not divisible by model.n_kv_heads = {} (grouped-query attention \
                 shares each key/value head among n_heads / n_kv_heads query heads)",
                self.n_heads,
                self.n_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("model.head_dim = {} must be even (RoPE rotates pairs of dimensions)", self.head_dim);
        }
        let finite_positive = [
            ("model.norm_eps", self.norm_eps),
            ("model.rope_theta", self.rope_theta),
            ("model.init_std", self.init_std),
        ];
        for (key, value) in finite_positive {
            if !positive_number(value) {
                bail!("{key} = {value} must be a positive number");
            }
        }
        if let Some(s) = &self.rope_scaling {
            s.validate()?;
        }
        if let Some(y) = &self.yarn {
            if self.rope_scaling.is_some() {
                bail!("model.yarn and model.rope_scaling are both set; RoPE is scaled one way");
            }
            y.validate()?;
        }
        match (self.family == Family::DeepseekV3, &self.mla) {
            (true, None) => bail!("model.family = \"deepseek_v3\" needs a [model.mla] table (latent attention)"),
            (false, Some(_)) => bail!(
                "model.mla is set but model.family = \"{}\"; latent attention is DeepSeek-V3's (model.family = \"deepseek_v3\")",
                self.family.name()
            ),
            (true, Some(mla)) => mla.validate(self)?,
            (false, None) => {}
        }
        if let Some(moe) = &self.moe
            && self.family != Family::DeepseekV3
        {
            let deepseek_only = [
                ("scoring = \"sigmoid\"", moe.scoring != super::Scoring::Softmax),
                ("groups", moe.groups != 1),
                ("routed_scale", moe.routed_scale != 1.0),
                ("selection_bias", moe.selection_bias),
                ("shared_experts", moe.shared_experts != 0),
            ];
            if let Some((key, _)) = deepseek_only.iter().find(|(_, set)| *set) {
                bail!(
                    "model.moe.{key} is DeepSeek-V3's routing, which model.family = \"{}\" does not have (its checkpoints could not hold it)",
                    self.family.name()
                );
            }
            if self.family == Family::Mixtral && !moe.dense_layers.is_empty() {
                bail!("model.moe.dense_layers is set but Mixtral has experts in every layer");
            }
        }
        match (self.family.is_moe(), &self.moe) {
            (true, None) => {
                bail!("model.family = \"{}\" needs a [model.moe] table (num_experts, top_k)", self.family.name());
            }
            (false, Some(_)) => {
                bail!(
                    "model.moe is set but model.family = \"{}\"; mixture-of-experts models use model.family = \"mixtral\", \"qwen3_moe\" or \"deepseek_v3\"",
                    self.family.name()
                );
            }
            _ => {}
        }
        if !self.family.has_windows() && !self.is_gpt() && self.sliding_window != 0 {
            bail!(
                "model.sliding_window is set but model.family = \"{}\" has no sliding window; use model.family = \"mistral\"",
                self.family.name()
            );
        }
        self.validate_windows()?;
        if self.family == Family::GptOss {
            for (key, value) in [("model.glu_limit", self.glu_limit), ("model.glu_alpha", self.glu_alpha)] {
                if !positive_number(value) {
                    bail!("{key} = {value} must be a positive number");
                }
            }
        }
        self.validate_gemma3()?;
        if self.is_gpt() {
            if self.sliding_window != 0 {
                bail!("model.sliding_window is set but model.family = \"gpt\" has no sliding window");
            }
            if self.rope_scaling.is_some() {
                bail!("model.rope_scaling is set but model.family = \"gpt\" has learned positions, no RoPE");
            }
            if self.n_kv_heads != self.n_heads {
                bail!(
                    "model.family = \"gpt\" has multi-head attention: model.n_kv_heads = {} must equal model.n_heads = {}",
                    self.n_kv_heads,
                    self.n_heads
                );
            }
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.n_layers)?;
        }
        let params = self.param_count().total;
        if params > 1 << 44 {
            bail!("the model has {params} parameters, more than this engine trains (at most {} = 2^44)", 1u64 << 44);
        }
        Ok(())
    }
}

section! {
    /// Llama 3.1 RoPE frequency scaling (`rope_type = "llama3"` in Hugging Face configs).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct RopeScaling {
        /// Divisor of the low frequencies.
        pub factor: f64 = 8.0,
        /// Wavelengths above `original_max_seq_len / low_freq_factor` are divided by `factor`.
        pub low_freq_factor: f64 = 1.0,
        /// Wavelengths below `original_max_seq_len / high_freq_factor` are kept.
        pub high_freq_factor: f64 = 4.0,
        /// Context length the model was pre-trained with before scaling.
        pub original_max_seq_len: usize = 8192,
    }
}

impl RopeScaling {
    fn validate(&self) -> Result<()> {
        if !at_least(self.factor, 1.0) {
            bail!("model.rope_scaling.factor = {} must be at least 1", self.factor);
        }
        if !(positive_number(self.low_freq_factor) && self.high_freq_factor > self.low_freq_factor) {
            bail!(
                "model.rope_scaling.high_freq_factor = {} must be greater than model.rope_scaling.low_freq_factor = {} (and both positive)",
                self.high_freq_factor,
                self.low_freq_factor
            );
        }
        if self.original_max_seq_len == 0 {
            bail!("model.rope_scaling.original_max_seq_len must be greater than 0");
        }
        Ok(())
    }
}

impl ModelConfig {
    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Whether this is the GPT family (LayerNorm, learned positions, GELU, biases).
    pub fn is_gpt(&self) -> bool {
        self.family == Family::Gpt
    }

    /// Whether attention normalises each query and key head before RoPE (QK-norm: Qwen3,
    /// Gemma 3).
    pub fn qk_norm(&self) -> bool {
        matches!(self.family, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3)
    }

    /// What the RMSNorms add to their stored weights before multiplying: 1 for Gemma 3, whose
    /// checkpoints store `w` of `x · rstd · (1 + w)`; 0 for the others.
    pub fn norm_offset(&self) -> f32 {
        if self.family == Family::Gemma3 { 1.0 } else { 0.0 }
    }

    /// Whether the attention's and the MLP's outputs are normed before the residual add
    /// (Gemma 3's `post_attention_layernorm` and `post_feedforward_layernorm`).
    pub fn sandwich_norms(&self) -> bool {
        self.family == Family::Gemma3
    }

    /// What the token embedding is multiplied by: Gemma's √d (computed in f64 and rounded to
    /// f32, as transformers' f32 `embed_scale`); none for the others.
    pub fn embed_scale(&self) -> Option<f32> {
        (self.family == Family::Gemma3).then(|| (self.d_model as f64).sqrt() as f32)
    }

    /// The attention's softmax scale when not `head_dim^-1/2`: `query_pre_attn_scalar^-1/2`
    /// (in f64, rounded to f32 as transformers' `self.scaling`).
    pub fn attn_scale(&self) -> Option<f32> {
        (self.query_pre_attn_scalar > 0.0).then(|| self.query_pre_attn_scalar.powf(-0.5) as f32)
    }

    /// Whether layer `i` rotates by `rope_local_theta`, unscaled (a sliding layer of a model
    /// with a local base); else by `rope_theta` with the model's scaling.
    pub fn local_rope(&self, i: usize) -> bool {
        self.rope_local_theta > 0.0 && self.window(i) != 0
    }

    /// Whether layer `i`'s MLP is a mixture of experts (not one of `model.moe.dense_layers`).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|moe| !moe.is_dense(i))
    }

    /// Hidden width of layer `i`'s dense MLP (`mlp_dim`, or in a mixture of experts
    /// `moe.dense_mlp_dim`).
    pub fn dense_mlp_dim(&self) -> usize {
        self.moe.as_ref().filter(|moe| !moe.dense_layers.is_empty()).map_or(self.mlp_dim, |moe| moe.dense_mlp_dim)
    }

    /// Width of the RoPE rotation: the heads' (`head_dim`), or latent attention's rope part.
    pub fn rope_dim(&self) -> usize {
        self.mla.as_ref().map_or(self.head_dim, |mla| mla.rope_dim)
    }

    /// Number of keys query `i` (0-based) attends to in a sequence, in layer `layer`.
    pub fn keys_attended(&self, layer: usize, i: usize) -> usize {
        match self.window(layer) {
            0 => i + 1,
            w => (i + 1).min(w),
        }
    }

    /// Layer `i`'s attention window: `sliding_window`, or 0 (none) for a full layer.
    pub fn window(&self, i: usize) -> usize {
        if self.is_full_layer(i) { 0 } else { self.sliding_window }
    }

    /// Whether `layer_types` or `window_pattern` makes layer `i` attend to the whole context.
    fn is_full_layer(&self, i: usize) -> bool {
        match (self.layer_types.get(i), self.window_pattern) {
            (Some(t), _) => *t == LayerType::Full,
            (None, 0) => false,
            (None, n) => (i + 1).is_multiple_of(n),
        }
    }

    /// Gemma 3's keys: only its family's (no other checkpoint could hold them), in range.
    fn validate_gemma3(&self) -> Result<()> {
        let gemma = self.family == Family::Gemma3;
        let only = [
            ("rope_local_theta", self.rope_local_theta != 0.0),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar != 0.0),
            ("final_logit_softcap", self.final_logit_softcap != 0.0),
            ("rope_linear_factor", self.rope_linear_factor != 1.0),
        ];
        if let Some((key, _)) = only.iter().find(|(_, set)| *set && !gemma) {
            bail!(
                "model.{key} is Gemma 3's, which model.family = \"{}\" does not have; use model.family = \"gemma3\"",
                self.family.name()
            );
        }
        for (key, value) in [
            ("model.rope_local_theta", self.rope_local_theta),
            ("model.query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("model.final_logit_softcap", self.final_logit_softcap),
        ] {
            if !(value == 0.0 || positive_number(value)) {
                bail!("{key} = {value} must be a positive number (or 0: none)");
            }
        }
        if !at_least(self.rope_linear_factor, 1.0) {
            bail!("model.rope_linear_factor = {} must be at least 1 (1: no scaling)", self.rope_linear_factor);
        }
        if self.rope_linear_factor != 1.0 && (self.rope_scaling.is_some() || self.yarn.is_some()) {
            bail!("model.rope_linear_factor is set with model.rope_scaling or model.yarn; RoPE is scaled one way");
        }
        if gemma && self.rope_local_theta == 0.0 {
            bail!(
                "model.family = \"gemma3\" needs model.rope_local_theta (its local layers' RoPE base, 10000 in every release)"
            );
        }
        Ok(())
    }

    /// `window_pattern` and `layer_types`: one or the other, of the right length, with a window.
    fn validate_windows(&self) -> Result<()> {
        let named = !self.layer_types.is_empty() || self.window_pattern != 0;
        if !named {
            return Ok(());
        }
        if !self.family.has_windows() {
            bail!(
                "model.window_pattern / model.layer_types are set but model.family = \"{}\" has no sliding window",
                self.family.name()
            );
        }
        if !self.layer_types.is_empty() && self.window_pattern != 0 {
            bail!("model.window_pattern and model.layer_types are both set; name the full layers one way");
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.n_layers {
            bail!("model.layer_types lists {} layers but model.n_layers = {}", self.layer_types.len(), self.n_layers);
        }
        if self.sliding_window == 0 && (0..self.n_layers).any(|i| !self.is_full_layer(i)) {
            bail!(
                "model.window_pattern / model.layer_types name sliding layers but model.sliding_window = 0; set the window"
            );
        }
        Ok(())
    }
}
