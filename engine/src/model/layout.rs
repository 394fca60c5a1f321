//! The flat parameter layout: every tensor is a named range of one buffer.
//!
//! Names are Hugging Face's, so import and export are a matter of copying ranges. Tensors a
//! single product reads together are adjacent — q, k, v; gate and up; each expert's three
//! projections — so the model multiplies by them at once, and each layer is one contiguous range
//! (for per-layer collectives later).
//!
//! Weight decay rule: matrices decay (embeddings, projections, router, experts, output head);
//! vectors (RMSNorm and LayerNorm weights, biases) do not.
//!
//! The GPT family uses GPT-2's names (`transformer.h.0.attn.c_attn.weight`, ...) with the
//! engine's shapes: every projection is stored `[out, in]` as `nn.Linear` stores it, while
//! GPT-2's `Conv1D` stores `[in, out]`; import and export transpose (`hf/`). A LayerNorm's bias
//! follows its weight, and each projection's bias has its offset in [`LayerBiases`].

use super::Stage;
use crate::config::{Family, ModelConfig};

/// One named tensor of the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Shape, row-major (`[out, in]` for projections, as PyTorch's `nn.Linear` stores them).
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Whether weight decay applies.
    pub decay: bool,
    /// A norm's weight stored as its offset from one (Gemma: the norm multiplies by `1 + w`),
    /// initialised at zero where other norms' weights start at one.
    pub offset_from_one: bool,
}

impl Tensor {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it is a hidden matrix, which Muon updates (`optim.name = "muon"`): a 2-D weight
    /// of the attention or an MLP (experts' and shared experts' included); not the embeddings,
    /// the output head, a router, a norm or a bias, which AdamW keeps (docs/recipes.md).
    pub fn is_hidden_matrix(&self) -> bool {
        const KEPT: [&str; 6] =
            ["embed_tokens.", "transformer.wte.", "transformer.wpe.", "lm_head.", ".gate.weight", ".router.weight"];
        self.shape.len() == 2 && self.decay && !self.is_buffer() && !KEPT.iter().any(|k| self.name.contains(k))
    }

    /// The logical blocks of rows it stacks, as `(first row, rows)`: the GPT family's packed
    /// `c_attn` (weight and bias) holds q, k and v (multi-head attention: three equal blocks),
    /// which tensor parallelism splits and Muon orthogonalises each on its own; every other
    /// tensor is one block.
    pub fn matrices(&self) -> Vec<(usize, usize)> {
        let rows = self.shape[0];
        if self.name.contains("attn.c_attn.") {
            (0..3).map(|k| (k * rows / 3, rows / 3)).collect()
        } else {
            vec![(0, rows)]
        }
    }

    /// Whether transformers holds it as a buffer, not a parameter: DeepSeek-V3's selection
    /// bias (`mlp.gate.e_score_correction_bias`), moved by the balancing update, never by a
    /// gradient (its gradient stays zero, so AdamW leaves it in place).
    pub fn is_buffer(&self) -> bool {
        self.name.ends_with(".e_score_correction_bias")
    }
}

/// Offsets of one layer's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerOffsets {
    /// `input_layernorm.weight` `[D]`.
    pub ln1: usize,
    /// The attention's tensors, by kind.
    pub attn: AttnOffsets,
    /// `post_attention_layernorm.weight` `[D]` (Gemma 3: `pre_feedforward_layernorm.weight`).
    pub ln2: usize,
    /// The norms of the attention's and the MLP's outputs, before their residual adds
    /// (Gemma 3's sandwich norms); `None` for the other families.
    pub post: Option<PostNorms>,
    /// The MLP's tensors: gate and up (adjacent) and down, or the router and the experts'.
    pub mlp: MlpOffsets,
    /// The projections' biases (the GPT family); `None` for the others. LayerNorm biases are
    /// not here: each follows its weight (`ln1 + D`, `ln2 + D`).
    pub bias: Option<LayerBiases>,
    /// The layer's range of the flat buffer.
    pub range: std::ops::Range<usize>,
}

impl LayerOffsets {
    /// The range of the flat buffer the layer's experts take (the end of the layer's), if it
    /// is a mixture of experts.
    pub fn experts(&self) -> Option<std::ops::Range<usize>> {
        match self.mlp {
            MlpOffsets::Moe { experts, .. } => Some(experts..self.range.end),
            MlpOffsets::Dense { .. } => None,
        }
    }
}

/// Offsets of a layer's sandwich norms (Gemma 3), each `[D]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostNorms {
    /// `post_attention_layernorm.weight`: the attention's output, before `xmid = x + ·`.
    pub attn: usize,
    /// `post_feedforward_layernorm.weight`: the MLP's output, before `out = xmid + ·`.
    pub mlp: usize,
}

/// Offsets of an attention's tensors: its kind, chosen once when the model is laid out
/// (`attention/`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttnOffsets {
    /// Grouped-query attention (`attention/gqa.rs`).
    Gqa(GqaOffsets),
    /// Multi-head latent attention (`attention/mla.rs`).
    Mla(MlaOffsets),
}

impl AttnOffsets {
    /// The grouped-query attention's offsets; panics for another kind (tests and tools that
    /// only lay out grouped-query models).
    pub fn gqa(&self) -> &GqaOffsets {
        match self {
            AttnOffsets::Gqa(o) => o,
            AttnOffsets::Mla(_) => {
                panic!("internal error: latent attention where grouped-query attention was expected")
            }
        }
    }
}

/// Offsets of a latent attention's tensors (DeepSeek-V3), `H` heads, ranks `Rq` and `Rkv`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlaOffsets {
    /// The queries' projections.
    pub q: QueryOffsets,
    /// `self_attn.kv_a_proj_with_mqa.weight` `[Rkv + rope, D]`: the latent's rows, then the
    /// shared RoPE key's.
    pub kv_a: usize,
    /// `self_attn.kv_a_layernorm.weight` `[Rkv]`.
    pub kv_norm: usize,
    /// `self_attn.kv_b_proj.weight` `[H · (nope + v), Rkv]`: each head's key then value rows.
    pub kv_b: usize,
    /// `self_attn.o_proj.weight` `[D, H · v]`.
    pub o: usize,
}

/// How a latent attention projects its queries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryOffsets {
    /// Through a latent: `q_a_proj` `[Rq, D]`, `q_a_layernorm` `[Rq]`, `q_b_proj`
    /// `[H · (nope + rope), Rq]`.
    Latent {
        /// `self_attn.q_a_proj.weight`.
        down: usize,
        /// `self_attn.q_a_layernorm.weight`.
        norm: usize,
        /// `self_attn.q_b_proj.weight`.
        up: usize,
    },
    /// `self_attn.q_proj.weight` `[H · (nope + rope), D]` (`q_lora_rank` 0).
    Direct(usize),
}

/// Offsets of a grouped-query attention's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GqaOffsets {
    /// `q_proj`, `k_proj`, `v_proj` back to back: `[(H + 2 KV) · Dh, D]`.
    pub qkv: usize,
    /// `o_proj` `[D, H · Dh]`.
    pub o: usize,
    /// QK-norm's `self_attn.q_norm.weight` and `self_attn.k_norm.weight` back to back `[2 · Dh]`
    /// (Qwen3); `None` without QK-norm.
    pub qk_norm: Option<usize>,
    /// The projections' biases (GPT-OSS): `q_proj`, `k_proj` and `v_proj`'s back to back
    /// `[(H + 2 KV) · Dh]`, then `o_proj`'s `[D]`; `None` without (GPT's are in
    /// [`LayerBiases`]).
    pub bias: Option<(usize, usize)>,
    /// `self_attn.sinks` `[H]`: each head's learned sink logit (GPT-OSS).
    pub sinks: Option<usize>,
}

/// Offsets of one GPT layer's projection biases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBiases {
    /// `attn.c_attn.bias` `[(H + 2 KV) · Dh]` (q, k, v).
    pub qkv: usize,
    /// `attn.c_proj.bias` `[D]`.
    pub o: usize,
    /// `mlp.c_fc.bias` `[F]`.
    pub up: usize,
    /// `mlp.c_proj.bias` `[D]`.
    pub down: usize,
}

/// Offsets of an MLP's tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MlpOffsets {
    /// SwiGLU: `gate_proj` and `up_proj` back to back `[2F, D]`, then `down_proj` `[D, F]`.
    /// The GPT family's plain MLP: `gate_up` is `c_fc` `[F, D]` (no gate), `down` is
    /// `c_proj` `[D, F]`.
    Dense {
        /// Gate and up projections.
        gate_up: usize,
        /// Down projection.
        down: usize,
    },
    /// Mixture of experts: the router `[E, D]`, then each expert's block of `w1` (gate) and `w3`
    /// (up) back to back `[2F, D]` and `w2` (down) `[D, F]`, for the experts laid out
    /// ([`Layout::experts`]).
    Moe {
        /// `block_sparse_moe.gate.weight` (GPT-OSS: `mlp.router.weight`, its bias `[E]` right
        /// after).
        router: usize,
        /// `mlp.gate.e_score_correction_bias` `[E]` (DeepSeek-V3's selection bias), if any.
        bias: Option<usize>,
        /// `mlp.shared_experts`' gate and up (adjacent, `[2S, D]`) and down (`[D, S]`)
        /// projections, `S = shared_experts · F`, if any.
        shared: Option<(usize, usize)>,
        /// The first expert's block (expert 0's, but on an expert axis).
        experts: usize,
        /// Elements per expert block (`3 · F · D`; with biases, GPT-OSS, `+ 2F + D`: gate's
        /// and up's `[F]` each, then down's `[D]`).
        stride: usize,
    },
}

/// How a family names a mixture-of-experts layer's tensors in checkpoints:
/// `{block}.{router}.weight` and `{block}.experts.E.{gate,up,down}.weight`. (GPT-OSS's
/// checkpoints stack the experts, `mlp.experts.gate_up_proj`: the engine names them per expert
/// as Qwen3-MoE does, and `hf/` stacks them.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    /// The layer's MLP module: Mixtral's `block_sparse_moe`, Qwen3-MoE's `mlp`.
    pub block: &'static str,
    /// The router: `gate`, GPT-OSS's `router`.
    pub router: &'static str,
    /// An expert's gate projection: Mixtral's `w1`, Qwen3-MoE's `gate_proj`.
    pub gate: &'static str,
    /// Its up projection: `w3`, `up_proj`.
    pub up: &'static str,
    /// Its down projection: `w2`, `down_proj`.
    pub down: &'static str,
}

impl ExpertNames {
    /// The names of `family`'s checkpoints.
    pub fn of(family: Family) -> ExpertNames {
        match family {
            Family::Qwen3Moe | Family::DeepseekV3 => {
                ExpertNames { block: "mlp", router: "gate", gate: "gate_proj", up: "up_proj", down: "down_proj" }
            }
            Family::GptOss => {
                ExpertNames { block: "mlp", router: "router", gate: "gate_proj", up: "up_proj", down: "down_proj" }
            }
            _ => ExpertNames { block: "block_sparse_moe", router: "gate", gate: "w1", up: "w3", down: "w2" },
        }
    }
}

/// The parameter layout of a model.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Every tensor, in buffer order.
    pub tensors: Vec<Tensor>,
    /// Total elements.
    pub len: usize,
    /// `model.embed_tokens.weight` `[V, D]` (GPT: `transformer.wte.weight`).
    pub embed: usize,
    /// `transformer.wpe.weight` `[max_seq_len, D]`: the GPT family's learned positions, in the
    /// embedding's unit.
    pub positions: Option<usize>,
    /// Per-layer offsets.
    pub layers: Vec<LayerOffsets>,
    /// `model.norm.weight` `[D]` (GPT: `transformer.ln_f.weight`, its bias right after; last
    /// stage only).
    pub norm: usize,
    /// The output head `[V, D]`: `lm_head.weight`, or the embedding when tied (last stage only).
    pub head: usize,
    /// Whether the output head is the embedding.
    pub tied: bool,
    /// The part of the model laid out: everything, or one pipeline stage's units.
    pub stage: Stage,
    /// The experts of each mixture-of-experts layer laid out: all of them, or on an expert
    /// axis the device's own (whose tensors keep the model's expert numbers); empty for a dense
    /// model.
    pub experts: std::ops::Range<usize>,
}

impl Layout {
    /// Lays out the tensors of a model.
    pub fn new(m: &ModelConfig) -> Layout {
        Layout::stage(m, &Stage::whole(m.n_layers))
    }

    /// Lays out the tensors one pipeline stage holds, in the same order and with the same names
    /// as the whole model's: the embedding on the first stage, the stage's layers, the final
    /// norm and output head on the last. Offsets of units the stage does not hold are 0.
    pub fn stage(m: &ModelConfig, stage: &Stage) -> Layout {
        Layout::stage_with_experts(m, stage, 0..m.moe.as_ref().map_or(0, |moe| moe.num_experts))
    }

    /// [`Layout::stage`] holding only `experts` of each mixture-of-experts layer (a device's
    /// on an expert axis), named as in the whole model; the router keeps every expert's row.
    pub fn stage_with_experts(m: &ModelConfig, stage: &Stage, experts: std::ops::Range<usize>) -> Layout {
        if m.is_gpt() {
            return Layout::gpt(m, stage);
        }
        let (d, v, f) = (m.d_model, m.vocab_size, m.mlp_dim);
        let mut b = Builder { tensors: Vec::new(), len: 0 };
        let embed = if stage.first { b.push("model.embed_tokens.weight", &[v, d], true) } else { 0 };
        let mut layers = Vec::with_capacity(stage.layer_count());
        for i in stage.layer_indices() {
            let p = format!("model.layers.{i}");
            let start = b.len;
            let ln1 = b.norm(m, &format!("{p}.input_layernorm.weight"));
            let attn = match &m.mla {
                None => AttnOffsets::Gqa(b.gqa(m, &p)),
                Some(_) => AttnOffsets::Mla(b.mla(m, &p)),
            };
            let (ln2, post) = if m.sandwich_norms() {
                let attn = b.norm(m, &format!("{p}.post_attention_layernorm.weight"));
                (b.norm(m, &format!("{p}.pre_feedforward_layernorm.weight")), Some(attn))
            } else {
                (b.norm(m, &format!("{p}.post_attention_layernorm.weight")), None)
            };
            let mlp = match &m.moe {
                Some(moe) if !moe.is_dense(i) => {
                    let names = ExpertNames::of(m.family);
                    let block = format!("{p}.{}", names.block);
                    let router = b.push(&format!("{block}.{}.weight", names.router), &[moe.num_experts, d], true);
                    let biased = m.family == Family::GptOss;
                    if biased {
                        b.push(&format!("{block}.{}.bias", names.router), &[moe.num_experts], false);
                    }
                    // A buffer in transformers, trained by the balancing update, not by AdamW:
                    // its gradient stays zero, so the optimizer never moves it.
                    let bias = moe
                        .selection_bias
                        .then(|| b.push(&format!("{block}.gate.e_score_correction_bias"), &[moe.num_experts], false));
                    let shared = (moe.shared_experts > 0)
                        .then(|| b.swiglu(&format!("{block}.shared_experts"), moe.shared_experts * f, d));
                    let first = b.len;
                    for e in experts.clone() {
                        let q = format!("{block}.experts.{e}");
                        b.push(&format!("{q}.{}.weight", names.gate), &[f, d], true);
                        b.push(&format!("{q}.{}.weight", names.up), &[f, d], true);
                        b.push(&format!("{q}.{}.weight", names.down), &[d, f], true);
                        if biased {
                            b.push(&format!("{q}.{}.bias", names.gate), &[f], false);
                            b.push(&format!("{q}.{}.bias", names.up), &[f], false);
                            b.push(&format!("{q}.{}.bias", names.down), &[d], false);
                        }
                    }
                    let stride = 3 * f * d + if biased { 2 * f + d } else { 0 };
                    MlpOffsets::Moe { router, bias, shared, experts: first, stride }
                }
                _ => {
                    let (gate_up, down) = b.swiglu(&format!("{p}.mlp"), m.dense_mlp_dim(), d);
                    MlpOffsets::Dense { gate_up, down }
                }
            };
            let post =
                post.map(|attn| PostNorms { attn, mlp: b.norm(m, &format!("{p}.post_feedforward_layernorm.weight")) });
            layers.push(LayerOffsets { ln1, attn, ln2, post, mlp, bias: None, range: start..b.len });
        }
        let (mut norm, mut head) = (0, 0);
        if stage.last {
            norm = b.norm(m, "model.norm.weight");
            head = if m.tie_embeddings { embed } else { b.push("lm_head.weight", &[v, d], true) };
        }
        Layout {
            tensors: b.tensors,
            len: b.len,
            embed,
            positions: None,
            layers,
            norm,
            head,
            tied: m.tie_embeddings,
            stage: stage.clone(),
            experts: if m.moe.is_some() { experts } else { 0..0 },
        }
    }

    /// The GPT family's layout of a stage, in GPT-2's order and names (shapes `[out, in]`); the
    /// learned positions belong to the embedding's unit.
    fn gpt(m: &ModelConfig, stage: &Stage) -> Layout {
        let (d, v, f, qkv) = (m.d_model, m.vocab_size, m.mlp_dim, m.q_dim() + 2 * m.kv_dim());
        let mut b = Builder { tensors: Vec::new(), len: 0 };
        let (mut embed, mut positions) = (0, None);
        if stage.first {
            embed = b.push("transformer.wte.weight", &[v, d], true);
            positions = Some(b.push("transformer.wpe.weight", &[m.max_seq_len, d], true));
        }
        let mut layers = Vec::with_capacity(stage.layer_count());
        for i in stage.layer_indices() {
            let p = format!("transformer.h.{i}");
            let start = b.len;
            let ln1 = b.push(&format!("{p}.ln_1.weight"), &[d], false);
            b.push(&format!("{p}.ln_1.bias"), &[d], false);
            let qkv_w = b.push(&format!("{p}.attn.c_attn.weight"), &[qkv, d], true);
            let qkv_b = b.push(&format!("{p}.attn.c_attn.bias"), &[qkv], false);
            let o = b.push(&format!("{p}.attn.c_proj.weight"), &[d, m.q_dim()], true);
            let o_b = b.push(&format!("{p}.attn.c_proj.bias"), &[d], false);
            let ln2 = b.push(&format!("{p}.ln_2.weight"), &[d], false);
            b.push(&format!("{p}.ln_2.bias"), &[d], false);
            let up = b.push(&format!("{p}.mlp.c_fc.weight"), &[f, d], true);
            let up_b = b.push(&format!("{p}.mlp.c_fc.bias"), &[f], false);
            let down = b.push(&format!("{p}.mlp.c_proj.weight"), &[d, f], true);
            let down_b = b.push(&format!("{p}.mlp.c_proj.bias"), &[d], false);
            layers.push(LayerOffsets {
                ln1,
                attn: AttnOffsets::Gqa(GqaOffsets { qkv: qkv_w, o, qk_norm: None, bias: None, sinks: None }),
                ln2,
                post: None,
                mlp: MlpOffsets::Dense { gate_up: up, down },
                bias: Some(LayerBiases { qkv: qkv_b, o: o_b, up: up_b, down: down_b }),
                range: start..b.len,
            });
        }
        let (mut norm, mut head) = (0, 0);
        if stage.last {
            norm = b.push("transformer.ln_f.weight", &[d], false);
            b.push("transformer.ln_f.bias", &[d], false);
            head = if m.tie_embeddings { embed } else { b.push("lm_head.weight", &[v, d], true) };
        }
        Layout {
            tensors: b.tensors,
            len: b.len,
            embed,
            positions,
            layers,
            norm,
            head,
            tied: m.tie_embeddings,
            stage: stage.clone(),
            experts: 0..0,
        }
    }

    /// The units of the per-layer collectives, in buffer order: the embedding, each layer, the
    /// head.
    pub fn units(&self) -> Vec<super::Unit> {
        let layers = (0..self.layers.len()).map(super::Unit::Layer);
        std::iter::once(super::Unit::Embed).chain(layers).chain([super::Unit::Head]).collect()
    }

    /// The range of the flat buffer a unit covers.
    pub fn unit_range(&self, unit: super::Unit) -> std::ops::Range<usize> {
        let first = self.layers.first().map_or(self.norm, |l| l.range.start);
        let last = self.layers.last().map_or(if self.stage.last { self.norm } else { self.len }, |l| l.range.end);
        match unit {
            super::Unit::Embed => 0..first,
            super::Unit::Layer(i) => self.layers[i].range.clone(),
            super::Unit::Head => last..self.len,
        }
    }

    /// The tensor with this name.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

struct Builder {
    tensors: Vec<Tensor>,
    len: usize,
}

impl Builder {
    /// A SwiGLU's `{block}.{gate,up,down}_proj.weight` of width `f`: the offsets of gate (up
    /// right after) and down.
    fn swiglu(&mut self, block: &str, f: usize, d: usize) -> (usize, usize) {
        let gate_up = self.push(&format!("{block}.gate_proj.weight"), &[f, d], true);
        self.push(&format!("{block}.up_proj.weight"), &[f, d], true);
        (gate_up, self.push(&format!("{block}.down_proj.weight"), &[d, f], true))
    }

    /// Grouped-query attention's tensors of layer `p` (`model.layers.i`).
    fn gqa(&mut self, m: &ModelConfig, p: &str) -> GqaOffsets {
        let d = m.d_model;
        let qkv = self.push(&format!("{p}.self_attn.q_proj.weight"), &[m.q_dim(), d], true);
        self.push(&format!("{p}.self_attn.k_proj.weight"), &[m.kv_dim(), d], true);
        self.push(&format!("{p}.self_attn.v_proj.weight"), &[m.kv_dim(), d], true);
        let o = self.push(&format!("{p}.self_attn.o_proj.weight"), &[d, m.q_dim()], true);
        let qk_norm = m.qk_norm().then(|| {
            let q = self.push_norm(&format!("{p}.self_attn.q_norm.weight"), m.head_dim, m.norm_offset() != 0.0);
            self.push_norm(&format!("{p}.self_attn.k_norm.weight"), m.head_dim, m.norm_offset() != 0.0);
            q
        });
        let gpt_oss = m.family == Family::GptOss;
        let bias = gpt_oss.then(|| {
            let qkv = self.push(&format!("{p}.self_attn.q_proj.bias"), &[m.q_dim()], false);
            self.push(&format!("{p}.self_attn.k_proj.bias"), &[m.kv_dim()], false);
            self.push(&format!("{p}.self_attn.v_proj.bias"), &[m.kv_dim()], false);
            (qkv, self.push(&format!("{p}.self_attn.o_proj.bias"), &[d], false))
        });
        let sinks = gpt_oss.then(|| self.push(&format!("{p}.self_attn.sinks"), &[m.n_heads], false));
        GqaOffsets { qkv, o, qk_norm, bias, sinks }
    }

    /// Latent attention's tensors of layer `p`, in transformers' names.
    fn mla(&mut self, m: &ModelConfig, p: &str) -> MlaOffsets {
        let (d, h, a) = (m.d_model, m.n_heads, m.mla.as_ref().expect("latent attention"));
        let q = if a.q_lora_rank > 0 {
            let down = self.push(&format!("{p}.self_attn.q_a_proj.weight"), &[a.q_lora_rank, d], true);
            let norm = self.push(&format!("{p}.self_attn.q_a_layernorm.weight"), &[a.q_lora_rank], false);
            let up = self.push(&format!("{p}.self_attn.q_b_proj.weight"), &[h * m.head_dim, a.q_lora_rank], true);
            QueryOffsets::Latent { down, norm, up }
        } else {
            QueryOffsets::Direct(self.push(&format!("{p}.self_attn.q_proj.weight"), &[h * m.head_dim, d], true))
        };
        let kv_a =
            self.push(&format!("{p}.self_attn.kv_a_proj_with_mqa.weight"), &[a.kv_lora_rank + a.rope_dim, d], true);
        let kv_norm = self.push(&format!("{p}.self_attn.kv_a_layernorm.weight"), &[a.kv_lora_rank], false);
        let kv_b =
            self.push(&format!("{p}.self_attn.kv_b_proj.weight"), &[h * (a.nope_dim + a.v_dim), a.kv_lora_rank], true);
        let o = self.push(&format!("{p}.self_attn.o_proj.weight"), &[d, h * a.v_dim], true);
        MlaOffsets { q, kv_a, kv_norm, kv_b, o }
    }

    /// A `[D]` RMSNorm weight, stored as its offset from one in Gemma 3.
    fn norm(&mut self, m: &ModelConfig, name: &str) -> usize {
        self.push_norm(name, m.d_model, m.norm_offset() != 0.0)
    }

    fn push_norm(&mut self, name: &str, len: usize, offset_from_one: bool) -> usize {
        let offset = self.push(name, &[len], false);
        self.tensors.last_mut().expect("just pushed").offset_from_one = offset_from_one;
        offset
    }

    fn push(&mut self, name: &str, shape: &[usize], decay: bool) -> usize {
        let offset = self.len;
        let t = Tensor { name: name.to_owned(), shape: shape.to_vec(), offset, decay, offset_from_one: false };
        self.len += t.len();
        self.tensors.push(t);
        offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::recipe::resolve;

    #[test]
    fn layout_covers_the_parameter_count_without_gaps() {
        for name in [
            "tiny-llama2",
            "tiny-mixtral",
            "tiny-mistral",
            "llama3.2-1b",
            "tiny-gpt",
            "gpt-126m",
            "qwen3-0.6b",
            "tiny-qwen3-moe",
        ] {
            let m = resolve(name, &[]).unwrap().config.model;
            let layout = Layout::new(&m);
            assert_eq!(layout.len as u64, m.param_count().total, "{name}");
            let mut next = 0;
            for t in &layout.tensors {
                assert_eq!(t.offset, next, "{}", t.name);
                next += t.len();
            }
        }
        let tied = Layout::new(&resolve("llama3.2-1b", &[]).unwrap().config.model);
        assert_eq!(tied.head, tied.embed);
        assert!(tied.get("lm_head.weight").is_none());
    }

    /// A stage's layout holds its units' tensors, named as in the whole model.
    #[test]
    fn stage_layouts_hold_their_units_under_the_whole_model_names() {
        let m = resolve("tiny-mixtral", &[]).unwrap().config.model;
        let whole = Layout::new(&m);
        let n = m.n_layers;
        let stages = [
            Stage { layers: 0..1, first: true, last: false, later: vec![] },
            Stage { layers: 1..n, first: false, last: true, later: vec![] },
        ];
        let parts: Vec<Layout> = stages.iter().map(|s| Layout::stage(&m, s)).collect();
        assert_eq!(parts.iter().map(|l| l.len).sum::<usize>(), whole.len);
        assert!(parts[0].get("model.embed_tokens.weight").is_some() && parts[0].get("lm_head.weight").is_none());
        assert!(parts[1].get("model.layers.1.self_attn.o_proj.weight").is_some());
        assert_eq!(parts[1].unit_range(super::super::Unit::Embed), 0..0);
        let head = parts[0].unit_range(super::super::Unit::Head);
        assert!(head.is_empty(), "{head:?}");
        assert_eq!(parts[1].unit_range(super::super::Unit::Head).end, parts[1].len);
    }
}
