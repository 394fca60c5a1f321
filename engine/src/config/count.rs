//! Parameter counts and training FLOPs of a model, by formula (no allocation).
//!
//! FLOP convention (written in `docs/recipes.md` too): a multiply-add is 2 FLOPs and a training
//! step (forward + backward) costs 3 forward passes, so a token costs
//!
//! ```text
//! 6 · N_matmul  +  6 · L · H · (Dh + Dv) · K̄
//! ```
//!
//! where `N_matmul` counts the weights that take part in a matrix product for that token (every
//! projection and the output head, only the `top_k` experts a token is routed to, not the input
//! embedding, which is a lookup), and `K̄` is the mean number of keys a query attends to. Causal
//! `Dv` is the values' head width (`Dh` but under latent attention, whose `Dh` is the query and key
//! width). Causal
//! halving is applied: with the causal mask `K̄ = (S + 1) / 2`, and with a sliding window `W` each
//! query counts `min(i + 1, W)` keys. Element-wise work (norms, softmax, RoPE, the optimizer) is not
//! counted, as in MaxText, torchtitan and llm.c.
//!
//! The GPT family: parameters count everything stored — the position table (`max_seq_len · D`,
//! counted with the embedding), the projections' biases and the LayerNorms' weights and biases.
//! FLOPs count neither the position table (a lookup, like the token embedding) nor the biases
//! (additions, element-wise work): `N_matmul` is the projection matrices and the head, as for
//! Llama.

use super::ModelConfig;

/// Parameter counts of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCount {
    /// Every parameter stored.
    pub total: u64,
    /// Parameters a single token uses (differs from `total` only for mixture-of-experts models).
    pub active: u64,
    /// The input embedding table (counted once when tied to the output head), and the GPT
    /// family's position table.
    pub embedding: u64,
}

impl ModelConfig {
    /// Parameters of one attention block's projections (q, k, v, o; latent attention's six).
    fn attention_params(&self) -> u64 {
        let (d, q, kv) = (self.d_model as u64, self.q_dim() as u64, self.kv_dim() as u64);
        let Some(a) = &self.mla else {
            return d * q + 2 * d * kv + q * d;
        };
        let (h, rq, rkv) = (self.n_heads as u64, a.q_lora_rank as u64, a.kv_lora_rank as u64);
        let queries = if rq > 0 { d * rq + rq * q } else { d * q };
        let keys_values = d * (rkv + a.rope_dim as u64) + rkv * h * (a.nope_dim + a.v_dim) as u64;
        queries + keys_values + h * a.v_dim as u64 * d
    }

    /// Norm weights of one attention block: QK-norm's two of a head's width, latent
    /// attention's two latents'.
    fn attention_norm_params(&self) -> u64 {
        match &self.mla {
            Some(a) => (a.q_lora_rank + a.kv_lora_rank) as u64,
            None if self.qk_norm() => 2 * self.head_dim as u64,
            None => 0,
        }
    }

    /// `(total, active)` parameters of layer `i`'s MLP: a dense SwiGLU; or the router (and its
    /// selection bias), the shared experts and all (`top_k`) routed experts.
    fn layer_mlp_params(&self, i: usize) -> (u64, u64) {
        let d = self.d_model as u64;
        match &self.moe {
            None => (self.mlp_params(), self.mlp_params()),
            Some(moe) if moe.is_dense(i) => (3 * d * moe.dense_mlp_dim as u64, 3 * d * moe.dense_mlp_dim as u64),
            Some(moe) => {
                let e = moe.num_experts as u64;
                let router = d * e + self.router_vector_params();
                let shared = moe.shared_experts as u64 * self.mlp_params();
                let each = self.mlp_params() + self.expert_bias_params();
                (router + shared + e * each, router + shared + moe.top_k as u64 * each)
            }
        }
    }

    /// The router's vectors of an expert layer: DeepSeek-V3's selection bias, GPT-OSS's bias.
    fn router_vector_params(&self) -> u64 {
        let e = self.moe.as_ref().map_or(0, |m| m.num_experts as u64);
        let selection = self.moe.as_ref().is_some_and(|m| m.selection_bias);
        if selection || self.family == super::Family::GptOss { e } else { 0 }
    }

    /// An expert's biases (GPT-OSS: gate's and up's `F` each, down's `D`).
    fn expert_bias_params(&self) -> u64 {
        match self.family {
            super::Family::GptOss => 2 * self.mlp_dim as u64 + self.d_model as u64,
            _ => 0,
        }
    }

    /// Parameters of one SwiGLU MLP (gate, up, down), or of the GPT family's (up, down) without
    /// biases.
    fn mlp_params(&self) -> u64 {
        let matrices = if self.is_gpt() { 2 } else { 3 };
        matrices * self.d_model as u64 * self.mlp_dim as u64
    }

    /// The vectors per layer beyond the matrices and norm weights: the GPT family's four
    /// projections' biases and the two LayerNorms' biases; GPT-OSS's attention biases and
    /// sinks.
    fn layer_bias_params(&self) -> u64 {
        let (d, qkv) = (self.d_model as u64, (self.q_dim() + 2 * self.kv_dim()) as u64);
        match self.family {
            super::Family::Gpt => qkv + d + self.mlp_dim as u64 + d + 2 * d,
            super::Family::GptOss => qkv + d + self.n_heads as u64,
            _ => 0,
        }
    }

    /// Matrix parameters of a layer that a token multiplies with: attention, the router and the
    /// MLPs of the experts it is sent to (the shared ones too), the mean over the layers when
    /// some are dense among experts' layers.
    pub(crate) fn layer_matmul_params_active(&self) -> u64 {
        let mlp: u64 = (0..self.n_layers).map(|i| self.layer_mlp_params(i).1).sum();
        // The router's and the experts' vectors are no product's.
        let top_k = self.moe.as_ref().map_or(0, |m| m.top_k as u64);
        let vectors = self.router_vector_params() + top_k * self.expert_bias_params();
        let layers = self.n_layers.max(1) as u64;
        let moe_layers = self.moe.as_ref().map_or(0, |m| m.moe_layers(self.n_layers)) as u64;
        self.attention_params() + (mlp - moe_layers * vectors) / layers
    }

    /// Parameters of every layer's routed experts (0 for a dense model): what an expert axis
    /// divides.
    pub fn expert_params(&self) -> u64 {
        self.moe.as_ref().map_or(0, |moe| {
            let each = self.mlp_params() + self.expert_bias_params();
            moe.moe_layers(self.n_layers) as u64 * moe.num_experts as u64 * each
        })
    }

    /// Counts the model's parameters.
    pub fn param_count(&self) -> ParamCount {
        let d = self.d_model as u64;
        let tokens = self.vocab_size as u64 * d;
        let positions = if self.is_gpt() { self.max_seq_len as u64 * d } else { 0 };
        let embedding = tokens + positions;
        let head = if self.tie_embeddings { 0 } else { tokens };
        // Two norms a layer (four with Gemma 3's sandwich norms).
        let norms = if self.sandwich_norms() { 4 } else { 2 };
        let norms_per_layer = norms * d + self.attention_norm_params() + self.layer_bias_params();
        // The final norm: RMSNorm's weight, or LayerNorm's weight and bias.
        let final_norm = if self.is_gpt() { 2 * d } else { d };
        let (mlp_total, mlp_active) =
            (0..self.n_layers).map(|i| self.layer_mlp_params(i)).fold((0, 0), |(t, a), (lt, la)| (t + lt, a + la));
        let layers = self.n_layers as u64 * (self.attention_params() + norms_per_layer);
        let total = embedding + head + layers + mlp_total + final_norm;
        let active = embedding + head + layers + mlp_active + final_norm;
        ParamCount { total, active, embedding }
    }

    /// Mean number of keys a query attends to in a sequence of `seq_len` tokens (`K̄`), over
    /// the layers (sliding and full ones).
    pub fn mean_keys_attended(&self, seq_len: usize) -> f64 {
        if seq_len == 0 || self.n_layers == 0 {
            return 0.0;
        }
        let sum: u64 =
            (0..self.n_layers).map(|l| (0..seq_len).map(|i| self.keys_attended(l, i) as u64).sum::<u64>()).sum();
        sum as f64 / (seq_len * self.n_layers) as f64
    }

    /// Training FLOPs per token at sequence length `seq_len`, by the convention in this module.
    pub fn train_flops_per_token(&self, seq_len: usize) -> f64 {
        let matmul =
            self.n_layers as f64 * self.layer_matmul_params_active() as f64 + (self.vocab_size * self.d_model) as f64;
        // q·k over the query and key width, the weighted sum over the values' (the same but
        // under latent attention).
        let v_dim = self.mla.as_ref().map_or(self.head_dim, |a| a.v_dim);
        let attention = 6.0
            * self.n_layers as f64
            * self.n_heads as f64
            * (self.head_dim + v_dim) as f64
            * self.mean_keys_attended(seq_len);
        6.0 * matmul + attention
    }
}

/// `n` with thousands separators: `8,030,261,248`.
pub fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::{Family, ModelConfig, MoeConfig};

    fn llama(vocab: usize, d: usize, layers: usize, heads: usize, kv: usize, mlp: usize) -> ModelConfig {
        ModelConfig {
            vocab_size: vocab,
            d_model: d,
            n_layers: layers,
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: d / heads,
            mlp_dim: mlp,
            max_seq_len: 4096,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn published_parameter_counts() {
        assert_eq!(llama(128256, 4096, 32, 32, 8, 14336).param_count().total, 8_030_261_248);
        assert_eq!(llama(32000, 4096, 32, 32, 32, 11008).param_count().total, 6_738_415_616);
        let mistral =
            ModelConfig { family: Family::Mistral, sliding_window: 4096, ..llama(32000, 4096, 32, 32, 8, 14336) };
        assert_eq!(mistral.param_count().total, 7_241_732_096);
        let mixtral = ModelConfig {
            family: Family::Mixtral,
            moe: Some(MoeConfig {
                num_experts: 8,
                top_k: 2,
                aux_loss_coef: 0.02,
                capacity_factor: None,
                ..MoeConfig::default()
            }),
            ..llama(32000, 4096, 32, 32, 8, 14336)
        };
        let count = mixtral.param_count();
        assert_eq!(count.total, 46_702_792_704);
        assert_eq!(count.active, 12_879_925_248);
        let tied = ModelConfig { tie_embeddings: true, ..llama(128256, 2048, 16, 32, 8, 8192) };
        assert_eq!(tied.param_count().total, 1_235_814_400, "llama3.2-1b");
    }

    /// The GPT-OSS recipes against OpenAI's model card: 20.9 B total and 3.6 B active, 116.8 B
    /// and 5.1 B; the card's active parameters leave the input embedding aside (a lookup).
    #[test]
    fn gpt_oss_recipes_match_the_model_card() {
        for (name, total, active) in [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)] {
            let count = crate::config::recipe::resolve(name, &[]).unwrap().config.model.param_count();
            let billions = |x: u64| x as f64 / 1e9;
            assert!((billions(count.total) - total).abs() < 0.01, "{name}: {} total", count.total);
            let without = count.active - count.embedding;
            assert!((billions(without) - active).abs() < 0.01, "{name}: {without} active without the embedding");
        }
    }

    /// The Qwen3 recipes against their model cards' figures (total, and active where they
    /// differ), in billions as the cards round them.
    #[test]
    fn qwen3_recipes_match_the_model_cards() {
        let cards = [
            ("qwen3-0.6b", 0.6, None),
            ("qwen3-1.7b", 1.7, None),
            ("qwen3-4b", 4.0, None),
            ("qwen3-8b", 8.2, None),
            ("qwen3-14b", 14.8, None),
            ("qwen3-32b", 32.8, None),
            ("qwen3-30b-a3b", 30.5, Some(3.3)),
            ("qwen3-235b-a22b", 235.0, Some(22.0)),
        ];
        for (name, total, active) in cards {
            let count = crate::config::recipe::resolve(name, &[]).unwrap().config.model.param_count();
            // The cards give one decimal (rounded or cut: 3.35 B active is "3.3B") or, for 22
            // and 235, none: within a little more than half their last digit.
            let near = |x: u64, card: f64| {
                let unit = if card.fract() == 0.0 && card >= 10.0 { 1.0 } else { 0.1 };
                (x as f64 / 1e9 - card).abs() <= 0.6 * unit
            };
            assert!(near(count.total, total), "{name}: {} parameters, the card says {total} B", count.total);
            let want = active.unwrap_or(total);
            assert!(near(count.active, want), "{name}: {} active parameters, the card says {want} B", count.active);
        }
    }

    /// GPT-2 small as transformers counts it (124,439,808 with the tied head counted once), and
    /// Pax's GPT126M with its padded vocabulary and 2k positions.
    #[test]
    fn gpt_parameter_counts() {
        let gpt2 = ModelConfig {
            family: Family::Gpt,
            vocab_size: 50257,
            max_seq_len: 1024,
            tie_embeddings: true,
            ..llama(50257, 768, 12, 12, 12, 3072)
        };
        assert_eq!(gpt2.param_count().total, 124_439_808);
        let pax = ModelConfig { vocab_size: 50304, max_seq_len: 2048, ..gpt2.clone() };
        assert_eq!(pax.param_count().total, 124_439_808 + 47 * 768 + 1024 * 768);
        // FLOPs: the 12 layers' 4·768² + 2·768·3072 matrices and the head, no biases, no positions.
        let matmul = 12.0 * (4.0 * 768.0 * 768.0 + 2.0 * 768.0 * 3072.0) + 50304.0 * 768.0;
        assert_eq!(pax.train_flops_per_token(2048), 6.0 * matmul + 12.0 * 12.0 * 12.0 * 64.0 * 1024.5);
    }

    #[test]
    fn flops_follow_the_convention() {
        let m = llama(32000, 1024, 1, 8, 8, 11008);
        // 6 * (attention 4*1024^2 + mlp 3*1024*11008 + head 32000*1024) + 12*8*128*32.5 at S = 64.
        let expected =
            6.0 * (4.0 * 1024.0 * 1024.0 + 3.0 * 1024.0 * 11008.0 + 32000.0 * 1024.0) + 12.0 * 8.0 * 128.0 * 32.5;
        assert_eq!(m.train_flops_per_token(64), expected);
        let windowed = ModelConfig { sliding_window: 4, ..m.clone() };
        // keys per query: 1, 2, 3, 4, 4, 4, 4, 4 -> mean 3.25
        assert_eq!(windowed.mean_keys_attended(8), 3.25);
    }
}
