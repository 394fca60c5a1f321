//! `config.json` of `LlamaForCausalLM`, `MistralForCausalLM`, `MixtralForCausalLM`,
//! `GPT2LMHeadModel`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM`,
//! `GptOssForCausalLM` and Gemma 3 (`Gemma3ForCausalLM` and the text model of
//! `Gemma3ForConditionalGeneration`: `gemma3.rs`): read into a [`ModelConfig`] with transformers'
//! (5.25) defaults for absent keys, and written back. Keys whose values change the math in ways
//! the engine does not compute are refused by name.
//!
//! RoPE comes in two spellings: `rope_theta` with an optional `rope_scaling` table (transformers
//! 4), or one `rope_parameters` table holding `rope_theta` and `rope_type` (transformers 5).
//! Types `default`, `llama3` and `yarn` are supported. As in transformers, a top-level
//! `original_max_position_embeddings` takes precedence over the table's; YaRN's defaults are
//! those of `_compute_yarn_parameters` (`factor` null: `max_position_embeddings / original`;
//! `beta_fast` 32 and `beta_slow` 1 when absent, null or 0; `mscale` and `mscale_all_dim` absent
//! mean 0, "unset"; `truncate` true when absent, false when null).
//!
//! Qwen3-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`) become
//! `moe.dense_layers`, written back as `mlp_only_layers` with a step of 1.
//!
//! DeepSeek-V3: latent attention (`q_lora_rank` (null: one `q_proj`), `kv_lora_rank`,
//! `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`) into
//! [`MlaConfig`], `head_dim` = nope + rope (the file's `head_dim`, which transformers sets to the
//! rope width, is ignored on import and written so on export); routing by sigmoid with a
//! selection bias, `n_group`/`topk_group`, `routed_scaling_factor`, `n_shared_experts`, and
//! `first_k_dense_replace` dense layers of `intermediate_size`. Keys transformers stores but
//! ignores: `scoring_func`, `topk_method` and `moe_layer_freq` are refused unless standard
//! (`sigmoid`, `noaux_tc`, 1); `seq_aux`, `aux_loss_alpha`, `ep_size` and the multi-token
//! prediction layers (`num_nextn_predict_layers`, `num_mtp_layers`) are accepted and ignored.

use anyhow::{Result, anyhow, bail};
use serde_json::{Map, Value, json};

use super::gemma3;
use crate::config::{Family, Gelu, LayerType, MlaConfig, ModelConfig, MoeConfig, RopeScaling, Scoring, Yarn};

/// The architectures (`architectures[0]`) this engine reads and writes.
pub const ARCHITECTURES: [(&str, Family); 10] = [
    ("LlamaForCausalLM", Family::Llama),
    ("MistralForCausalLM", Family::Mistral),
    ("MixtralForCausalLM", Family::Mixtral),
    ("GPT2LMHeadModel", Family::Gpt),
    ("Qwen3ForCausalLM", Family::Qwen3),
    ("Qwen3MoeForCausalLM", Family::Qwen3Moe),
    ("DeepseekV3ForCausalLM", Family::DeepseekV3),
    ("GptOssForCausalLM", Family::GptOss),
    ("Gemma3ForCausalLM", Family::Gemma3),
    // Its text model ([`gemma3::parse_multimodal`]); exported as the line above.
    (gemma3::MULTIMODAL, Family::Gemma3),
];

fn architecture(f: Family) -> &'static str {
    ARCHITECTURES.iter().find(|(_, x)| *x == f).expect("every family has an architecture").0
}

fn model_type(f: Family) -> &'static str {
    match f {
        Family::Llama => "llama",
        Family::Mistral => "mistral",
        Family::Mixtral => "mixtral",
        Family::Gpt => "gpt2",
        Family::Qwen3 => "qwen3",
        Family::Qwen3Moe => "qwen3_moe",
        Family::DeepseekV3 => "deepseek_v3",
        Family::GptOss => "gpt_oss",
        Family::Gemma3 => "gemma3_text",
    }
}

/// Reads a model configuration from a `config.json` value; `file` names it in errors.
pub fn parse(v: &Value, file: &str) -> Result<ModelConfig> {
    let obj = v.as_object().ok_or_else(|| anyhow!("{file} is not a JSON object"))?;
    if gemma3::is_multimodal(obj) {
        return gemma3::parse_multimodal(obj, file);
    }
    let family = match obj.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str) {
        Some(arch) => match ARCHITECTURES.iter().find(|(name, _)| *name == arch) {
            Some((_, f)) => *f,
            None => bail!(
                "{file}: architecture `{arch}` is not supported (supported: {})",
                ARCHITECTURES.map(|a| a.0).join(", ")
            ),
        },
        None => match obj.get("model_type").and_then(Value::as_str) {
            Some(t) if let Some((_, f)) = ARCHITECTURES.iter().find(|(_, f)| model_type(*f) == t) => *f,
            other => bail!(
                "{file}: no `architectures` and model_type {} is not supported (supported: {})",
                other.map_or("absent".into(), |t| format!("`{t}`")),
                ARCHITECTURES.map(|a| a.0).join(", ")
            ),
        },
    };
    match family {
        Family::Gpt => return parse_gpt2(obj, file),
        Family::Gemma3 => return gemma3::parse(obj, file, ""),
        _ => {}
    }
    // A key that is absent or null takes transformers' default.
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let uint = |key: &str, default: Option<usize>| -> Result<usize> {
        match get(key) {
            Some(v) => {
                v.as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("{file}: {key} = {v} is not a whole number"))
            }
            None => default.ok_or_else(|| anyhow!("{file}: {key} is missing")),
        }
    };
    let float = |key: &str, default: f64| -> Result<f64> {
        match get(key) {
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("{file}: {key} = {v} is not a number")),
            None => Ok(default),
        }
    };
    // Absent: the class default; null: false, as Python's `if config.key:` reads None.
    let flag = |key: &str, default: bool| -> Result<bool> {
        match obj.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| anyhow!("{file}: {key} = {v} is not true or false")),
        }
    };
    if let Some(q) = get("quantization_config") {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("absent");
        if !(family == Family::GptOss && method == "mxfp4") {
            bail!(
                "{file}: quantization_config with quant_method {method} is not supported (GPT-OSS's \"mxfp4\" experts are; import a bf16 or f32 checkpoint)"
            );
        }
    }
    if let Some(act) = get("hidden_act").and_then(Value::as_str).filter(|a| *a != "silu") {
        bail!("{file}: hidden_act = \"{act}\" is not supported (the engine's MLP is SwiGLU with silu)");
    }
    for key in ["attention_bias", "mlp_bias"] {
        // GPT-OSS's attention has biases (its default); it has no `mlp_bias`.
        if family == Family::GptOss && key == "attention_bias" {
            if !flag(key, true)? {
                bail!("{file}: attention_bias = false is not supported (GPT-OSS's projections have biases)");
            }
            continue;
        }
        if flag(key, false)? {
            bail!("{file}: {key} = true is not supported (the engine's projections have no bias)");
        }
    }
    let d_model = uint("hidden_size", None)?;
    let n_heads = uint("num_attention_heads", None)?;
    if n_heads == 0 {
        bail!("{file}: num_attention_heads must be greater than 0");
    }
    let n_layers = uint("num_hidden_layers", None)?;
    let (default_theta, default_eps, default_max) = match family {
        Family::Llama => (10_000.0, 1e-6, 2048),
        Family::Mistral => (10_000.0, 1e-6, 4096 * 32),
        Family::Mixtral | Family::Gpt => (1_000_000.0, 1e-5, 4096 * 32),
        Family::Qwen3 | Family::Qwen3Moe => (10_000.0, 1e-6, 32768),
        Family::DeepseekV3 => (10_000.0, 1e-6, 4096),
        Family::GptOss => (150_000.0, 1e-5, 131_072),
        Family::Gemma3 => (1_000_000.0, 1e-6, 131_072),
    };
    match family {
        Family::Qwen3 | Family::Qwen3Moe => qwen3_refusals(obj, file)?,
        Family::DeepseekV3 => deepseek_refusals(obj, file)?,
        _ => {}
    }
    let max_seq_len = uint("max_position_embeddings", Some(default_max))?;
    let (rope_theta, rope_scaling, yarn) = rope(obj, file, family, default_theta, max_seq_len)?;
    let sliding_window = match family {
        // Qwen3's window applies only with use_sliding_window = true, which is refused.
        Family::Llama | Family::Qwen3 | Family::Qwen3Moe | Family::DeepseekV3 => 0,
        // MistralConfig's default when the key is absent; null means none.
        Family::Mistral if !obj.contains_key("sliding_window") => 4096,
        Family::GptOss => uint("sliding_window", Some(128))?,
        _ => uint("sliding_window", Some(0))?,
    };
    let layer_types = match family {
        Family::GptOss => gpt_oss_layer_types(obj, file, n_layers)?,
        _ => Vec::new(),
    };
    // Absent: the class default (Llama: the heads, DeepSeek-V3 128, the others 8); null: the heads.
    let n_kv_heads = match (family, obj.get("num_key_value_heads")) {
        (_, Some(Value::Null)) => n_heads,
        (Family::Llama, _) => uint("num_key_value_heads", Some(n_heads))?,
        (Family::DeepseekV3, _) => uint("num_key_value_heads", Some(128))?,
        (Family::GptOss, _) => uint("num_key_value_heads", Some(8))?,
        _ => uint("num_key_value_heads", Some(8))?,
    };
    if family == Family::DeepseekV3 && n_kv_heads != n_heads {
        let absent = if obj.contains_key("num_key_value_heads") { "" } else { " (DeepseekV3Config's default)" };
        bail!(
            "{file}: num_key_value_heads = {n_kv_heads}{absent} must equal num_attention_heads = {n_heads} \
             (latent attention gives every head its keys; transformers fails on other values)"
        );
    }
    let mla = match family {
        Family::DeepseekV3 => Some(deepseek_mla(obj, file)?),
        _ => None,
    };
    let moe = match family {
        Family::Mixtral => Some(MoeConfig {
            num_experts: uint("num_local_experts", Some(8))?,
            top_k: uint("num_experts_per_tok", Some(2))?,
            aux_loss_coef: float("router_aux_loss_coef", 0.001)?,
            // transformers' Mixtral is dropless.
            capacity_factor: None,
            renormalize: true,
            ..MoeConfig::default()
        }),
        // The router's softmax over its top-k logits is the renormalised softmax's top-k.
        Family::GptOss => Some(MoeConfig {
            num_experts: match get("num_local_experts") {
                Some(_) => uint("num_local_experts", None)?,
                None => uint("num_experts", Some(128))?,
            },
            top_k: uint("num_experts_per_tok", Some(4))?,
            aux_loss_coef: float("router_aux_loss_coef", 0.001)?,
            capacity_factor: None,
            renormalize: true,
            ..MoeConfig::default()
        }),
        Family::Qwen3Moe => {
            // Hub configs say `num_experts`; transformers 5 saves `num_local_experts`.
            let num_experts = match get("num_local_experts") {
                Some(_) => uint("num_local_experts", None)?,
                None => uint("num_experts", Some(128))?,
            };
            let step = uint("decoder_sparse_step", Some(1))?;
            if step == 0 {
                bail!(
                    "{file}: decoder_sparse_step = 0 is not supported (layer i has experts when (i + 1) % step == 0)"
                );
            }
            let mlp_only: Vec<u64> = match get("mlp_only_layers") {
                None => Vec::new(),
                Some(Value::Array(a)) => a.iter().map(Value::as_u64).collect::<Option<_>>().ok_or_else(|| {
                    anyhow!("{file}: mlp_only_layers = {} is not a list of layer indices", Value::Array(a.clone()))
                })?,
                Some(other) => bail!("{file}: mlp_only_layers = {other} is not a list of layer indices"),
            };
            // Qwen3MoeDecoderLayer's test, as transformers writes it.
            let dense_layers: Vec<usize> = (0..n_layers)
                .filter(|&i| mlp_only.contains(&(i as u64)) || num_experts == 0 || !(i + 1).is_multiple_of(step))
                .collect();
            Some(MoeConfig {
                num_experts,
                top_k: uint("num_experts_per_tok", Some(8))?,
                aux_loss_coef: float("router_aux_loss_coef", 0.001)?,
                capacity_factor: None,
                renormalize: flag("norm_topk_prob", false)?,
                dense_mlp_dim: if dense_layers.is_empty() { 0 } else { uint("intermediate_size", Some(6144))? },
                dense_layers,
                ..MoeConfig::default()
            })
        }
        Family::DeepseekV3 => {
            let num_experts = uint("n_routed_experts", Some(256))?;
            let groups = uint("n_group", Some(8))?;
            if groups == 0 || !num_experts.is_multiple_of(groups) {
                bail!("{file}: n_group = {groups} must divide n_routed_experts = {num_experts} (groups of equal size)");
            }
            let top_groups = uint("topk_group", Some(4))?;
            if !(1..=groups).contains(&top_groups) {
                bail!("{file}: topk_group = {top_groups} must be between 1 and n_group = {groups}");
            }
            // Layer i has experts when i >= first_k_dense_replace.
            let dense_layers: Vec<usize> = (0..uint("first_k_dense_replace", Some(3))?.min(n_layers)).collect();
            Some(MoeConfig {
                num_experts,
                top_k: uint("num_experts_per_tok", Some(8))?,
                // transformers' DeepSeek-V3 adds no load-balancing loss and drops nothing.
                aux_loss_coef: 0.0,
                capacity_factor: None,
                renormalize: flag("norm_topk_prob", true)?,
                scoring: Scoring::Sigmoid,
                groups,
                top_groups,
                routed_scale: float("routed_scaling_factor", 2.5)?,
                selection_bias: true,
                bias_update_rate: 0.0,
                shared_experts: uint("n_shared_experts", Some(1))?,
                dense_mlp_dim: if dense_layers.is_empty() { 0 } else { uint("intermediate_size", Some(18432))? },
                dense_layers,
            })
        }
        _ => None,
    };
    // The experts' width is `moe_intermediate_size` in Qwen3-MoE and DeepSeek-V3, whose
    // `intermediate_size` is that of their dense layers (`moe.dense_mlp_dim`).
    let mlp_dim = match family {
        Family::Qwen3Moe => uint("moe_intermediate_size", Some(768))?,
        Family::DeepseekV3 => uint("moe_intermediate_size", Some(2048))?,
        _ => uint("intermediate_size", None)?,
    };
    let (window_pattern, layer_types) = match pattern_of(&layer_types) {
        Some(n) => (n, Vec::new()),
        None => (0, layer_types),
    };
    Ok(ModelConfig {
        family,
        vocab_size: uint("vocab_size", None)?,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        // DeepSeek-V3's file says the rope width; its heads are nope + rope wide.
        head_dim: match &mla {
            Some(mla) => mla.nope_dim + mla.rope_dim,
            None => uint("head_dim", Some(d_model / n_heads))?,
        },
        mlp_dim,
        norm_eps: float("rms_norm_eps", default_eps)?,
        rope_theta,
        rope_scaling,
        max_seq_len,
        sliding_window,
        window_pattern,
        layer_types,
        glu_limit: float("swiglu_limit", 7.0)?,
        glu_alpha: float("swiglu_alpha", 1.702)?,
        tie_embeddings: flag("tie_word_embeddings", false)?,
        init_std: float("initializer_range", 0.02)?,
        moe,
        gelu: Gelu::Tanh,
        yarn,
        mla,
        rope_local_theta: 0.0,
        rope_linear_factor: 1.0,
        query_pre_attn_scalar: 0.0,
        final_logit_softcap: 0.0,
    })
}

/// GPT-OSS's `layer_types` (absent: sliding and full in turn, layer 0 sliding), checked.
fn gpt_oss_layer_types(obj: &Map<String, Value>, file: &str, n_layers: usize) -> Result<Vec<LayerType>> {
    if obj.get("layer_types").is_none_or(Value::is_null) {
        return Ok((0..n_layers)
            .map(|i| if (i + 1) % 2 == 0 { LayerType::Full } else { LayerType::Sliding })
            .collect());
    }
    read_layer_types(obj, file, "", n_layers)
}

/// The `layer_types` list of `obj` (present, named `{at}layer_types` in errors): one
/// `"sliding_attention"` or `"full_attention"` per layer.
pub(super) fn read_layer_types(
    obj: &Map<String, Value>,
    file: &str,
    at: &str,
    n_layers: usize,
) -> Result<Vec<LayerType>> {
    let types = &obj["layer_types"];
    let list = types.as_array().ok_or_else(|| anyhow!("{file}: {at}layer_types = {types} is not a list"))?;
    if list.len() != n_layers {
        bail!("{file}: {at}layer_types lists {} layers but {at}num_hidden_layers = {n_layers}", list.len());
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("sliding_attention") => Ok(LayerType::Sliding),
            Some("full_attention") => Ok(LayerType::Full),
            _ => bail!(
                "{file}: {at}layer_types[{i}] = {t} is not supported (\"sliding_attention\" or \"full_attention\")"
            ),
        })
        .collect()
}

/// The `window_pattern` that gives `types` (every N-th layer full, the others sliding; 0 when
/// none is full), if one does.
pub(super) fn pattern_of(types: &[LayerType]) -> Option<usize> {
    let Some(first_full) = types.iter().position(|t| *t == LayerType::Full) else {
        return Some(0);
    };
    let n = first_full + 1;
    let by_pattern = |i: usize| if (i + 1).is_multiple_of(n) { LayerType::Full } else { LayerType::Sliding };
    types.iter().enumerate().all(|(i, t)| *t == by_pattern(i)).then_some(n)
}

/// The keys of `Qwen3Config` and `Qwen3MoeConfig` whose values change the math in ways the
/// engine does not compute, refused by name.
fn qwen3_refusals(obj: &Map<String, Value>, file: &str) -> Result<()> {
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    if get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        bail!("{file}: use_sliding_window = true is not supported (Qwen3's per-layer sliding window)");
    }
    if let Some(types) = get("layer_types").and_then(Value::as_array)
        && let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention"))
    {
        bail!("{file}: layer_types holds {t}, which is not supported (every layer \"full_attention\")");
    }
    Ok(())
}

/// The keys `DeepseekV3Config` stores but transformers' model ignores (it always routes by
/// sigmoid with `noaux_tc` selection, experts in every layer from `first_k_dense_replace`):
/// other values would mean a model transformers does not compute, refused by name.
fn deepseek_refusals(obj: &Map<String, Value>, file: &str) -> Result<()> {
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    for (key, wanted) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
        if let Some(v) = get(key).filter(|v| v.as_str() != Some(wanted)) {
            bail!("{file}: {key} = {v} is not supported (DeepSeek-V3's routing: \"{wanted}\")");
        }
    }
    if let Some(v) = get("moe_layer_freq").filter(|v| v.as_f64() != Some(1.0)) {
        bail!("{file}: moe_layer_freq = {v} is not supported (experts in every layer past first_k_dense_replace: 1)");
    }
    Ok(())
}

/// DeepSeek-V3's latent attention, with `DeepseekV3Config`'s defaults for absent keys.
fn deepseek_mla(obj: &Map<String, Value>, file: &str) -> Result<MlaConfig> {
    let uint = |key: &str, default: usize| -> Result<usize> {
        match obj.get(key).filter(|v| !v.is_null()) {
            Some(v) => {
                v.as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("{file}: {key} = {v} is not a whole number"))
            }
            None => Ok(default),
        }
    };
    let q_lora_rank = match obj.get("q_lora_rank") {
        // Null: queries by one projection, `q_proj`.
        Some(Value::Null) => 0,
        _ => match uint("q_lora_rank", 1536)? {
            0 => bail!("{file}: q_lora_rank = 0 is not supported (a query latent of rank 0; null means one q_proj)"),
            r => r,
        },
    };
    let (nope_dim, rope_dim) = (uint("qk_nope_head_dim", 128)?, uint("qk_rope_head_dim", 64)?);
    // transformers recomputes qk_head_dim (and sets head_dim to the rope width); one that
    // disagrees means a file edited by hand.
    if let Some(q) = obj.get("qk_head_dim").filter(|v| !v.is_null())
        && q.as_u64() != Some((nope_dim + rope_dim) as u64)
    {
        bail!("{file}: qk_head_dim = {q} disagrees with qk_nope_head_dim + qk_rope_head_dim = {nope_dim} + {rope_dim}");
    }
    let interleave = match obj.get("rope_interleave") {
        None => true,
        // `if config.rope_interleave:` reads None as false.
        Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| anyhow!("{file}: rope_interleave = {v} is not true or false"))?,
    };
    Ok(MlaConfig {
        q_lora_rank,
        kv_lora_rank: uint("kv_lora_rank", 512)?,
        nope_dim,
        rope_dim,
        v_dim: uint("v_head_dim", 128)?,
        interleave,
        ..MlaConfig::default()
    })
}

/// `GPT2Config`: `n_embd`, `n_layer`, `n_head`, `n_inner` (null: `4 · n_embd`), `n_positions`,
/// `layer_norm_epsilon`, `activation_function`, `tie_word_embeddings` (default true), with
/// transformers' defaults for absent keys. Variants the engine does not compute are refused.
fn parse_gpt2(obj: &Map<String, Value>, file: &str) -> Result<ModelConfig> {
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let uint = |key: &str, default: usize| -> Result<usize> {
        match get(key) {
            Some(v) => {
                v.as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("{file}: {key} = {v} is not a whole number"))
            }
            None => Ok(default),
        }
    };
    let float = |key: &str, default: f64| -> Result<f64> {
        match get(key) {
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("{file}: {key} = {v} is not a number")),
            None => Ok(default),
        }
    };
    let flag = |key: &str, default: bool| -> Result<bool> {
        match get(key) {
            Some(v) => v.as_bool().ok_or_else(|| anyhow!("{file}: {key} = {v} is not true or false")),
            None => Ok(default),
        }
    };
    let gelu = match get("activation_function").map(|v| v.as_str().unwrap_or("")).unwrap_or("gelu_new") {
        "gelu_new" | "gelu_pytorch_tanh" => Gelu::Tanh,
        "gelu" => Gelu::Erf,
        other => bail!(
            "{file}: activation_function = \"{other}\" is not supported (supported: gelu_new, gelu_pytorch_tanh, gelu)"
        ),
    };
    for (key, wanted) in
        [("scale_attn_weights", true), ("scale_attn_by_inverse_layer_idx", false), ("add_cross_attention", false)]
    {
        if flag(key, wanted)? != wanted {
            bail!("{file}: {key} = {} is not supported (the engine computes {key} = {wanted})", !wanted);
        }
    }
    let d_model = uint("n_embd", 768)?;
    let n_heads = uint("n_head", 12)?;
    if n_heads == 0 || !d_model.is_multiple_of(n_heads) {
        bail!("{file}: n_head = {n_heads} must be greater than 0 and divide n_embd = {d_model}");
    }
    Ok(ModelConfig {
        family: Family::Gpt,
        vocab_size: uint("vocab_size", 50257)?,
        d_model,
        n_layers: uint("n_layer", 12)?,
        n_heads,
        n_kv_heads: n_heads,
        head_dim: d_model / n_heads,
        mlp_dim: uint("n_inner", 4 * d_model)?,
        norm_eps: float("layer_norm_epsilon", 1e-5)?,
        max_seq_len: uint("n_positions", 1024)?,
        tie_embeddings: flag("tie_word_embeddings", true)?,
        init_std: float("initializer_range", 0.02)?,
        gelu,
        ..ModelConfig::default()
    })
}

/// `config.json` keys of a `GPT2LMHeadModel` for `m`, over `base`'s.
fn write_gpt2(m: &ModelConfig, mut o: Map<String, Value>, dtype: &str) -> Value {
    let mut set = |k: &str, v: Value| {
        o.insert(k.to_owned(), v);
    };
    set("architectures", json!(["GPT2LMHeadModel"]));
    set("model_type", json!("gpt2"));
    set("vocab_size", json!(m.vocab_size));
    set("n_embd", json!(m.d_model));
    set("n_layer", json!(m.n_layers));
    set("n_head", json!(m.n_heads));
    set("n_inner", json!(m.mlp_dim));
    set("n_positions", json!(m.max_seq_len));
    set("layer_norm_epsilon", json!(m.norm_eps));
    set("activation_function", json!(if m.gelu == Gelu::Tanh { "gelu_new" } else { "gelu" }));
    set("initializer_range", json!(m.init_std));
    set("tie_word_embeddings", json!(m.tie_embeddings));
    let dtype_key = if o.contains_key("torch_dtype") { "torch_dtype" } else { "dtype" };
    o.insert(dtype_key.to_owned(), json!(dtype));
    Value::Object(o)
}

/// `(rope_theta, llama3 scaling, YaRN)` from either spelling, as transformers'
/// `standardize_rope_params` and `_compute_yarn_parameters` read them.
fn rope(
    obj: &Map<String, Value>,
    file: &str,
    family: Family,
    default_theta: f64,
    max_seq_len: usize,
) -> Result<(f64, Option<RopeScaling>, Option<Yarn>)> {
    let (table, key) = match obj.get("rope_parameters").filter(|v| !v.is_null()) {
        Some(t) => (Some(t), "rope_parameters"),
        None => (obj.get("rope_scaling").filter(|v| !v.is_null()), "rope_scaling"),
    };
    let table = match table {
        Some(Value::Object(t)) => Some(t),
        Some(other) => bail!("{file}: {key} = {other} is not a table"),
        None => None,
    };
    let number = |t: &Map<String, Value>, k: &str, default: f64| -> Result<f64> {
        match t.get(k).filter(|v| !v.is_null()) {
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("{file}: {key}.{k} = {v} is not a number")),
            None => Ok(default),
        }
    };
    let top = |k: &str| -> Result<Option<f64>> {
        match obj.get(k).filter(|v| !v.is_null()) {
            Some(v) => Ok(Some(v.as_f64().ok_or_else(|| anyhow!("{file}: {k} = {v} is not a number"))?)),
            None => Ok(None),
        }
    };
    // Rotating part of each head only: the engine rotates all of it.
    for (where_, p) in [
        ("", top("partial_rotary_factor")?),
        (key, table.map(|t| number(t, "partial_rotary_factor", 1.0)).transpose()?),
    ] {
        if let Some(p) = p.filter(|p| *p != 1.0) {
            let dot = if where_.is_empty() { "" } else { "." };
            bail!("{file}: {where_}{dot}partial_rotary_factor = {p} is not supported (RoPE over the whole head: 1)");
        }
    }
    let top_theta = top("rope_theta")?.unwrap_or(default_theta);
    let Some(t) = table else { return Ok((top_theta, None, None)) };
    let theta = number(t, "rope_theta", top_theta)?;
    // transformers gives a top-level `original_max_position_embeddings` precedence over the table's.
    let original = match top("original_max_position_embeddings")? {
        Some(o) => o,
        None => number(t, "original_max_position_embeddings", max_seq_len as f64)?,
    } as usize;
    let kind = t.get("rope_type").or_else(|| t.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok((theta, None, None)),
        "llama3" => {
            // DeepSeek-V3's softmax scale takes mscale_all_dim under any non-default type.
            if family == Family::DeepseekV3 && number(t, "mscale_all_dim", 0.0)? != 0.0 {
                bail!("{file}: {key}.mscale_all_dim with rope_type \"llama3\" is not supported (it is YaRN's)");
            }
            Ok((
                theta,
                Some(RopeScaling {
                    factor: number(t, "factor", 8.0)?,
                    low_freq_factor: number(t, "low_freq_factor", 1.0)?,
                    high_freq_factor: number(t, "high_freq_factor", 4.0)?,
                    original_max_seq_len: original,
                }),
                None,
            ))
        }
        "yarn" => Ok((theta, None, Some(yarn(t, file, key, family, max_seq_len, original)?))),
        other => bail!("{file}: {key}.rope_type = \"{other}\" is not supported (supported: default, llama3, yarn)"),
    }
}

/// A `yarn` table `t` (named `key`), with `_compute_yarn_parameters`' defaults: `factor` null
/// is `max_position_embeddings / original`; `beta_fast` and `beta_slow` absent, null or 0 are
/// 32 and 1 (`or 32`); `mscale` and `mscale_all_dim` absent or null are 0, which the engine
/// reads as transformers reads None (unset); `truncate` absent is true, null false.
fn yarn(
    t: &Map<String, Value>,
    file: &str,
    key: &str,
    family: Family,
    max_seq_len: usize,
    original: usize,
) -> Result<Yarn> {
    let number = |k: &str, default: f64| -> Result<f64> {
        match t.get(k).filter(|v| !v.is_null()) {
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("{file}: {key}.{k} = {v} is not a number")),
            None => Ok(default),
        }
    };
    if original == 0 {
        bail!("{file}: {key}.original_max_position_embeddings must be greater than 0");
    }
    let given_factor = t.get("factor").filter(|v| !v.is_null()).is_some();
    let factor = number("factor", max_seq_len as f64 / original as f64)?;
    if !(factor >= 1.0 && factor.is_finite()) {
        bail!("{file}: {key}.factor = {factor} is not supported (YaRN extends the context: at least 1)");
    }
    let or_default = |k: &str, default: f64| -> Result<f64> {
        let v = number(k, 0.0)?;
        Ok(if v == 0.0 { default } else { v })
    };
    let (beta_fast, beta_slow) = (or_default("beta_fast", 32.0)?, or_default("beta_slow", 1.0)?);
    if !(beta_slow > 0.0 && beta_fast > beta_slow) {
        bail!(
            "{file}: {key}.beta_fast = {beta_fast} must be greater than {key}.beta_slow = {beta_slow} (both positive)"
        );
    }
    // JSON numbers are finite.
    let non_negative = |k: &str| -> Result<f64> {
        match number(k, 0.0)? {
            m if m < 0.0 => bail!("{file}: {key}.{k} = {m} is not supported (a non-negative number)"),
            m => Ok(m),
        }
    };
    let (mscale, mscale_all_dim) = (non_negative("mscale")?, non_negative("mscale_all_dim")?);
    // DeepSeek-V3 scales its softmax by yarn_get_mscale(factor, mscale_all_dim)², reading the
    // table's factor itself: null fails in transformers.
    if family == Family::DeepseekV3 && mscale_all_dim != 0.0 && !given_factor {
        bail!("{file}: {key}.factor is missing; DeepSeek-V3 needs it with mscale_all_dim = {mscale_all_dim}");
    }
    let attention_factor = match t.get("attention_factor").filter(|v| !v.is_null()) {
        None => None,
        Some(_) => match number("attention_factor", 0.0)? {
            a if a > 0.0 && a.is_finite() => Some(a),
            a => bail!("{file}: {key}.attention_factor = {a} is not supported (a positive number)"),
        },
    };
    let truncate = match t.get("truncate") {
        None => true,
        // `if truncate:` reads None as false.
        Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| anyhow!("{file}: {key}.truncate = {v} is not true or false"))?,
    };
    Ok(Yarn {
        factor,
        original_max_seq_len: original,
        beta_fast,
        beta_slow,
        mscale,
        mscale_all_dim,
        attention_factor,
        truncate,
    })
}

/// What of `m` a `DeepseekV3ForCausalLM` cannot hold, refused on export: its latent attention,
/// its sigmoid routing with a selection bias, and dense layers that are the first ones.
fn deepseek_export(m: &ModelConfig) -> Result<(&MlaConfig, &MoeConfig)> {
    let (Some(mla), Some(moe)) = (&m.mla, &m.moe) else {
        bail!("model.family = \"deepseek_v3\" needs [model.mla] and [model.moe] to export as DeepseekV3ForCausalLM");
    };
    if moe.scoring != Scoring::Sigmoid || !moe.selection_bias {
        bail!(
            "cannot export as DeepseekV3ForCausalLM: its router scores by sigmoid with a selection bias \
             (model.moe.scoring = \"sigmoid\", model.moe.selection_bias = true)"
        );
    }
    if moe.dense_layers.iter().enumerate().any(|(i, &l)| i != l) {
        bail!(
            "cannot export as DeepseekV3ForCausalLM: model.moe.dense_layers = {:?} are not the first layers \
             (config.json's first_k_dense_replace = k makes layers 0..k dense)",
            moe.dense_layers
        );
    }
    if m.n_kv_heads != m.n_heads {
        bail!("cannot export as DeepseekV3ForCausalLM: model.n_kv_heads must equal model.n_heads");
    }
    Ok((mla, moe))
}

/// A `config.json` for `m`: `base` (the imported model's own, if any) with every key the
/// engine knows set from `m`, so that keys it does not know (token ids, ...) survive export.
/// RoPE keeps the spelling `base` used; without a base it is written as `rope_theta` and
/// `rope_scaling`, which transformers 4 and 5 both read. Fails where the architecture cannot
/// hold `m` (DeepSeek-V3's dense layers other than the first ones, ...).
pub fn write(m: &ModelConfig, base: Option<&Value>, dtype: &str) -> Result<Value> {
    let mut o = base.and_then(Value::as_object).cloned().unwrap_or_default();
    let family = m.family;
    match family {
        Family::Gpt => return Ok(write_gpt2(m, o, dtype)),
        Family::Gemma3 => return gemma3::write(m, o, dtype),
        _ => {}
    }
    if m.rope_scaling.is_some() && m.yarn.is_some() {
        bail!("model.yarn and model.rope_scaling are both set; RoPE is scaled one way");
    }
    let deepseek = if family == Family::DeepseekV3 { Some(deepseek_export(m)?) } else { None };
    let dense_layers = m.moe.as_ref().map_or(&[][..], |moe| &moe.dense_layers[..]);
    // `intermediate_size` of Qwen3-MoE and DeepSeek-V3 is the dense layers' width; without
    // dense layers no layer uses it, and the base's is kept.
    let intermediate = match family {
        Family::Qwen3Moe | Family::DeepseekV3 if !dense_layers.is_empty() => Some(m.dense_mlp_dim()),
        Family::Qwen3Moe | Family::DeepseekV3 if o.contains_key("intermediate_size") => None,
        _ => Some(m.mlp_dim),
    };
    let has_local_experts = o.contains_key("num_local_experts");
    // The weights are written in bf16 or f32, not in an imported checkpoint's MXFP4.
    o.remove("quantization_config");
    let mut set = |k: &str, v: Value| {
        o.insert(k.to_owned(), v);
    };
    set("architectures", json!([architecture(family)]));
    set("model_type", json!(model_type(family)));
    set("vocab_size", json!(m.vocab_size));
    set("hidden_size", json!(m.d_model));
    if let Some(i) = intermediate {
        set("intermediate_size", json!(i));
    }
    set("num_hidden_layers", json!(m.n_layers));
    set("num_attention_heads", json!(m.n_heads));
    set("num_key_value_heads", json!(m.n_kv_heads));
    // DeepseekV3Config writes the rope width as head_dim.
    set("head_dim", json!(m.rope_dim()));
    set("hidden_act", json!("silu"));
    set("max_position_embeddings", json!(m.max_seq_len));
    set("rms_norm_eps", json!(m.norm_eps));
    set("initializer_range", json!(m.init_std));
    set("tie_word_embeddings", json!(m.tie_embeddings));
    match family {
        Family::Llama => {
            set("attention_bias", json!(false));
            set("mlp_bias", json!(false));
        }
        Family::Qwen3 | Family::Qwen3Moe => {
            set("attention_bias", json!(false));
            set("use_sliding_window", json!(false));
        }
        Family::DeepseekV3 => set("attention_bias", json!(false)),
        Family::GptOss => {
            set("attention_bias", json!(true));
            set("sliding_window", json!(m.sliding_window));
            let types: Vec<&str> = (0..m.n_layers)
                .map(|i| if m.window(i) == 0 { "full_attention" } else { "sliding_attention" })
                .collect();
            set("layer_types", json!(types));
            set("swiglu_limit", json!(m.glu_limit));
            set("swiglu_alpha", json!(m.glu_alpha));
        }
        _ => set("sliding_window", if m.sliding_window == 0 { Value::Null } else { json!(m.sliding_window) }),
    }
    if let Some((mla, moe)) = deepseek {
        set("q_lora_rank", if mla.q_lora_rank == 0 { Value::Null } else { json!(mla.q_lora_rank) });
        set("kv_lora_rank", json!(mla.kv_lora_rank));
        set("qk_nope_head_dim", json!(mla.nope_dim));
        set("qk_rope_head_dim", json!(mla.rope_dim));
        set("qk_head_dim", json!(mla.nope_dim + mla.rope_dim));
        set("v_head_dim", json!(mla.v_dim));
        set("rope_interleave", json!(mla.interleave));
        set("n_routed_experts", json!(moe.num_experts));
        set("num_experts_per_tok", json!(moe.top_k));
        set("n_group", json!(moe.groups));
        set("topk_group", json!(moe.top_groups));
        set("routed_scaling_factor", json!(moe.routed_scale));
        set("norm_topk_prob", json!(moe.renormalize));
        set("n_shared_experts", json!(moe.shared_experts));
        set("moe_intermediate_size", json!(m.mlp_dim));
        set("first_k_dense_replace", json!(moe.dense_layers.len()));
    } else if let Some(moe) = &m.moe {
        if family == Family::Qwen3Moe {
            set(if has_local_experts { "num_local_experts" } else { "num_experts" }, json!(moe.num_experts));
            set("moe_intermediate_size", json!(m.mlp_dim));
            set("norm_topk_prob", json!(moe.renormalize));
            set("decoder_sparse_step", json!(1));
            set("mlp_only_layers", json!(moe.dense_layers));
        } else {
            set("num_local_experts", json!(moe.num_experts));
        }
        set("num_experts_per_tok", json!(moe.top_k));
        set("router_aux_loss_coef", json!(moe.aux_loss_coef));
    }
    let scaling = match (&m.rope_scaling, &m.yarn) {
        (Some(s), _) => Some(json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        })),
        (None, Some(y)) => {
            let mut t = json!({
                "rope_type": "yarn",
                "factor": y.factor,
                "original_max_position_embeddings": y.original_max_seq_len,
                "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow,
                "mscale": y.mscale,
                "mscale_all_dim": y.mscale_all_dim,
                "truncate": y.truncate,
            });
            if let Some(a) = y.attention_factor {
                t["attention_factor"] = json!(a);
            }
            Some(t)
        }
        (None, None) => None,
    };
    // A top-level original_max_position_embeddings overrides the table's in transformers.
    if let Some(s) = &scaling
        && o.get("original_max_position_embeddings").is_some_and(|v| !v.is_null())
    {
        o.insert("original_max_position_embeddings".into(), s["original_max_position_embeddings"].clone());
    }
    let dtype_key = if o.contains_key("torch_dtype") { "torch_dtype" } else { "dtype" };
    let rope_parameters = o.contains_key("rope_parameters");
    let mut set = |k: &str, v: Value| {
        o.insert(k.to_owned(), v);
    };
    set(dtype_key, json!(dtype));
    if rope_parameters {
        let mut p = scaling.unwrap_or_else(|| json!({"rope_type": "default"}));
        p["rope_theta"] = json!(m.rope_theta);
        set("rope_parameters", p);
        o.remove("rope_theta");
        o.remove("rope_scaling");
    } else {
        set("rope_theta", json!(m.rope_theta));
        set("rope_scaling", scaling.unwrap_or(Value::Null));
    }
    Ok(Value::Object(o))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
            "tie_word_embeddings": true, "bos_token_id": 5
        })
    }

    #[test]
    fn both_rope_spellings_read_the_same() {
        let old = parse(&llama(), "config.json").unwrap();
        assert_eq!((old.head_dim, old.norm_eps, old.rope_theta), (16, 1e-6, 500000.0));
        assert_eq!(old.rope_scaling.as_ref().unwrap().original_max_seq_len, 64);
        let mut new = llama();
        let o = new.as_object_mut().unwrap();
        let mut params = o.remove("rope_scaling").unwrap();
        params["rope_theta"] = o.remove("rope_theta").unwrap();
        o.insert("rope_parameters".into(), params);
        assert_eq!(parse(&new, "config.json").unwrap(), old);
        // And what is written reads back, keeping keys the engine does not know.
        for base in [Some(&llama()), Some(&new), None] {
            let written = write(&old, base, "float32").unwrap();
            assert_eq!(parse(&written, "out").unwrap(), old);
            if base.is_some() {
                assert_eq!(written["bos_token_id"], 5);
            }
            assert_eq!(written.get("rope_parameters").is_some(), base == Some(&new));
        }
    }

    #[test]
    fn mistral_and_mixtral_defaults_follow_transformers() {
        let mut v = llama();
        v["architectures"] = json!(["MistralForCausalLM"]);
        v.as_object_mut().unwrap().remove("rope_scaling");
        assert_eq!(parse(&v, "c").unwrap().sliding_window, 4096);
        v["sliding_window"] = Value::Null;
        assert_eq!(parse(&v, "c").unwrap().sliding_window, 0);
        v["architectures"] = json!(["MixtralForCausalLM"]);
        v.as_object_mut().unwrap().remove("rope_theta");
        let m = parse(&v, "c").unwrap();
        assert_eq!((m.rope_theta, m.moe.unwrap().aux_loss_coef), (1e6, 0.001));
    }

    /// Qwen3-MoE: the expert count under both spellings, the experts' width from
    /// `moe_intermediate_size`, `norm_topk_prob` false by default; what it cannot compute is
    /// refused by key; export keeps the unused dense `intermediate_size` and the count's spelling.
    #[test]
    fn qwen3_moe_keys_and_refusals() {
        let v = json!({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                       "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "num_local_experts": 6, "num_experts_per_tok": 2, "mlp_only_layers": [],
                       "decoder_sparse_step": 1, "use_sliding_window": false});
        let m = parse(&v, "c").unwrap();
        let moe = m.moe.clone().unwrap();
        assert!(m.qk_norm() && (m.mlp_dim, moe.num_experts, moe.renormalize) == (16, 6, false));
        let back = write(&m, Some(&v), "float32").unwrap();
        assert_eq!((back["intermediate_size"].clone(), back["num_local_experts"].clone()), (json!(48), json!(6)));
        assert_eq!(parse(&back, "c").unwrap(), m);
        let mut hub = v.clone();
        hub.as_object_mut().unwrap().remove("num_local_experts");
        hub["num_experts"] = json!(6);
        assert_eq!(parse(&hub, "c").unwrap(), m);
        for (key, value, says) in [
            ("decoder_sparse_step", json!(0), "decoder_sparse_step = 0 is not supported"),
            ("mlp_only_layers", json!([0, "one"]), "mlp_only_layers = [0,\"one\"] is not a list of layer indices"),
            ("use_sliding_window", json!(true), "use_sliding_window = true"),
            ("layer_types", json!(["full_attention", "sliding_attention"]), "layer_types holds \"sliding_attention\""),
            ("attention_bias", json!(true), "attention_bias = true"),
        ] {
            let mut bad = v.clone();
            bad[key] = value;
            let e = parse(&bad, "config.json").unwrap_err().to_string();
            assert!(e.starts_with("config.json: ") && e.contains(says), "{key}: {e}");
        }
    }

    /// GPT2Config's defaults: n_inner null is 4 · n_embd, the head is tied, GELU is tanh.
    #[test]
    fn gpt2_defaults_and_round_trip() {
        let v = json!({"architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_head": 2, "n_layer": 3,
                       "n_inner": null, "vocab_size": 101, "n_positions": 24});
        let m = parse(&v, "c").unwrap();
        assert_eq!((m.mlp_dim, m.head_dim, m.n_kv_heads, m.max_seq_len), (128, 16, 2, 24));
        assert!(m.tie_embeddings && m.gelu == Gelu::Tanh && m.is_gpt());
        let back = write(&m, Some(&v), "float32").unwrap();
        assert_eq!(parse(&back, "c").unwrap(), m);
        assert_eq!(back["activation_function"], "gelu_new");
        let erf = parse(&json!({"architectures": ["GPT2LMHeadModel"], "activation_function": "gelu"}), "c").unwrap();
        assert_eq!((erf.gelu, erf.d_model, erf.vocab_size), (Gelu::Erf, 768, 50257));
    }

    #[test]
    fn unsupported_models_are_named() {
        let err = |patch: Value| {
            let mut v = llama();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            parse(&v, "config.json").unwrap_err().to_string()
        };
        assert!(
            err(json!({"architectures": ["GPTNeoXForCausalLM"]}))
                .contains("architecture `GPTNeoXForCausalLM` is not supported")
        );
        let gpt2 = |patch: Value| {
            err(json!({"architectures": ["GPT2LMHeadModel"]})
                .as_object()
                .unwrap()
                .clone()
                .into_iter()
                .chain(patch.as_object().unwrap().clone())
                .collect())
        };
        assert!(
            gpt2(json!({"activation_function": "relu"})).contains("activation_function = \"relu\" is not supported")
        );
        assert!(
            gpt2(json!({"scale_attn_by_inverse_layer_idx": true})).contains("scale_attn_by_inverse_layer_idx = true")
        );
        assert!(
            gpt2(json!({"n_embd": 30, "n_head": 4}))
                .contains("n_head = 4 must be greater than 0 and divide n_embd = 30")
        );
        assert!(
            err(json!({"rope_scaling": {"rope_type": "longrope"}}))
                .contains("rope_scaling.rope_type = \"longrope\" is not supported (supported: default, llama3, yarn)")
        );
        assert!(err(json!({"partial_rotary_factor": 0.5})).contains("partial_rotary_factor = 0.5 is not supported"));
        assert!(err(json!({"attention_bias": true})).contains("attention_bias"));
        assert!(err(json!({"hidden_size": "big"})).contains("hidden_size"));
        assert!(err(json!({"hidden_act": "gelu"})).contains("hidden_act"));
    }

    const DEEPSEEK_V3: &str = include_str!("../../../tests/fixtures/hf/deepseek-v3/config.json");
    const DEEPSEEK_V3_PLAIN: &str = include_str!("../../../tests/fixtures/hf/deepseek-v3-plain/config.json");
    const QWEN3_MOE_DENSE: &str = include_str!("../../../tests/fixtures/hf/qwen3-moe-dense/config.json");

    fn fixture(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    /// `written` holds every key of `file` with its value (numbers compared as numbers: 32 is 32.0).
    fn holds(written: &Value, file: &Value, path: &str) {
        match (written, file) {
            (Value::Object(w), Value::Object(f)) => {
                for (k, v) in f {
                    let path = format!("{path}.{k}");
                    holds(w.get(k).unwrap_or_else(|| panic!("{path} is not written")), v, &path);
                }
            }
            (Value::Array(w), Value::Array(f)) if w.len() == f.len() => {
                w.iter().zip(f).for_each(|(w, f)| holds(w, f, path));
            }
            (Value::Number(w), Value::Number(f)) => assert_eq!(w.as_f64(), f.as_f64(), "{path}"),
            _ => assert_eq!(written, file, "{path}"),
        }
    }

    /// `m`, read from transformers' `file`, passes the engine's validation, is written back as
    /// `file` (every key of it, with its value) and reads back the same, with and without base.
    fn round_trip(file: &Value, m: &ModelConfig) {
        crate::hf::engine_config(m, "").validate().unwrap();
        let written = write(m, Some(file), file["dtype"].as_str().unwrap()).unwrap();
        holds(&written, file, "config.json");
        assert_eq!(parse(&written, "out").unwrap(), *m);
        let bare = write(m, None, "float32").unwrap();
        assert_eq!(parse(&bare, "out").unwrap(), *m);
    }

    /// The tiny DeepSeek-V3 of tests/fixtures/hf/deepseek-v3: every mapped key.
    fn deepseek_v3() -> ModelConfig {
        ModelConfig {
            family: Family::DeepseekV3,
            vocab_size: 88,
            d_model: 32,
            n_layers: 3,
            n_heads: 4,
            n_kv_heads: 4,
            head_dim: 12,
            mlp_dim: 12,
            norm_eps: 1e-6,
            rope_theta: 1000.0,
            rope_scaling: None,
            yarn: Some(Yarn {
                factor: 4.0,
                original_max_seq_len: 8,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
                mscale_all_dim: 0.8,
                attention_factor: None,
                truncate: true,
            }),
            mla: Some(MlaConfig {
                q_lora_rank: 16,
                kv_lora_rank: 12,
                nope_dim: 8,
                rope_dim: 4,
                v_dim: 6,
                interleave: true,
                latent_norm_eps: 1e-6,
            }),
            max_seq_len: 32,
            sliding_window: 0,
            window_pattern: 0,
            layer_types: Vec::new(),
            glu_limit: 7.0,
            glu_alpha: 1.702,
            tie_embeddings: false,
            init_std: 0.02,
            moe: Some(MoeConfig {
                num_experts: 8,
                top_k: 3,
                aux_loss_coef: 0.0,
                capacity_factor: None,
                renormalize: true,
                scoring: Scoring::Sigmoid,
                groups: 4,
                top_groups: 2,
                routed_scale: 2.5,
                selection_bias: true,
                bias_update_rate: 0.0,
                shared_experts: 1,
                dense_layers: vec![0],
                dense_mlp_dim: 40,
            }),
            gelu: Gelu::Tanh,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn deepseek_v3_fixture_maps_every_key() {
        let file = fixture(DEEPSEEK_V3);
        let m = parse(&file, "config.json").unwrap();
        assert_eq!(m, deepseek_v3());
        round_trip(&file, &m);
        // head_dim is the rope width in the file, q_lora_rank is written as read.
        let back = write(&m, None, "float32").unwrap();
        assert_eq!((back["head_dim"].clone(), back["qk_head_dim"].clone()), (json!(4), json!(12)));
        assert_eq!((back["first_k_dense_replace"].clone(), back["intermediate_size"].clone()), (json!(1), json!(40)));
        assert_eq!(back["rope_scaling"]["mscale_all_dim"], json!(0.8));
        // The softmax and cos/sin factors transformers computes from it.
        let y = m.yarn.as_ref().unwrap();
        assert_eq!(crate::model::rope::yarn_attention_factor(y), 1.0249579607969668);
    }

    /// No query latent (`q_lora_rank` null), rotate_half, no dense layers, no scaling, tied.
    #[test]
    fn deepseek_v3_plain_fixture_maps_every_key() {
        let file = fixture(DEEPSEEK_V3_PLAIN);
        let m = parse(&file, "config.json").unwrap();
        let mut want = deepseek_v3();
        want.yarn = None;
        want.tie_embeddings = true;
        want.mla = Some(MlaConfig { q_lora_rank: 0, interleave: false, ..want.mla.unwrap() });
        want.moe = Some(MoeConfig {
            num_experts: 4,
            top_k: 2,
            renormalize: false,
            groups: 1,
            top_groups: 1,
            routed_scale: 1.0,
            shared_experts: 2,
            dense_layers: vec![],
            dense_mlp_dim: 0,
            ..want.moe.unwrap()
        });
        assert_eq!(m, want);
        round_trip(&file, &m);
        let back = write(&m, Some(&file), "float32").unwrap();
        assert_eq!((back["q_lora_rank"].clone(), back["intermediate_size"].clone()), (Value::Null, json!(40)));
    }

    /// What transformers stores but ignores is accepted when standard, refused by key otherwise;
    /// what it fails on is refused by key.
    #[test]
    fn deepseek_v3_refusals_name_the_key() {
        let file = fixture(DEEPSEEK_V3);
        let mut hub = file.clone();
        for (k, v) in [
            ("scoring_func", json!("sigmoid")),
            ("topk_method", json!("noaux_tc")),
            ("moe_layer_freq", json!(1)),
            ("seq_aux", json!(true)),
            ("aux_loss_alpha", json!(0.001)),
            ("ep_size", json!(1)),
            ("num_nextn_predict_layers", json!(1)),
            ("num_key_value_heads", Value::Null),
            ("qk_head_dim", Value::Null),
        ] {
            hub[k] = v;
        }
        assert_eq!(parse(&hub, "c").unwrap(), deepseek_v3());
        for (key, value, says) in [
            ("n_group", json!(3), "n_group = 3 must divide n_routed_experts = 8"),
            ("topk_group", json!(5), "topk_group = 5 must be between 1 and n_group = 4"),
            ("scoring_func", json!("softmax"), "scoring_func = \"softmax\" is not supported"),
            ("topk_method", json!("greedy"), "topk_method = \"greedy\" is not supported"),
            ("moe_layer_freq", json!(2), "moe_layer_freq = 2 is not supported"),
            ("num_key_value_heads", json!(2), "num_key_value_heads = 2 must equal num_attention_heads = 4"),
            ("qk_head_dim", json!(16), "qk_head_dim = 16 disagrees with qk_nope_head_dim + qk_rope_head_dim = 8 + 4"),
            ("q_lora_rank", json!(0), "q_lora_rank = 0 is not supported"),
            ("attention_bias", json!(true), "attention_bias = true is not supported"),
            ("hidden_act", json!("gelu"), "hidden_act = \"gelu\" is not supported"),
            (
                "rope_parameters",
                json!({"rope_type": "longrope", "factor": 4.0}),
                "rope_parameters.rope_type = \"longrope\" is not supported (supported: default, llama3, yarn)",
            ),
            (
                "rope_parameters",
                json!({"rope_type": "yarn", "original_max_position_embeddings": 8, "mscale_all_dim": 1.0}),
                "rope_parameters.factor is missing",
            ),
            (
                "rope_parameters",
                json!({"rope_type": "llama3", "factor": 4.0, "mscale_all_dim": 1.0}),
                "rope_parameters.mscale_all_dim with rope_type \"llama3\" is not supported",
            ),
        ] {
            let mut bad = file.clone();
            bad[key] = value;
            let e = parse(&bad, "config.json").unwrap_err().to_string();
            assert!(e.starts_with("config.json: ") && e.contains(says), "{key}: {e}");
        }
        let mut absent = file.clone();
        absent.as_object_mut().unwrap().remove("num_key_value_heads");
        let e = parse(&absent, "c").unwrap_err().to_string();
        assert!(e.contains("num_key_value_heads = 128 (DeepseekV3Config's default) must equal"), "{e}");
    }

    /// Export refuses what `DeepseekV3ForCausalLM` cannot hold: dense layers that are not the
    /// first ones, softmax routing.
    #[test]
    fn deepseek_v3_export_refusals() {
        let mut m = deepseek_v3();
        m.moe.as_mut().unwrap().dense_layers = vec![1];
        let e = write(&m, None, "float32").unwrap_err().to_string();
        assert!(
            e.contains("dense_layers = [1] are not the first layers") && e.contains("first_k_dense_replace"),
            "{e}"
        );
        let mut m = deepseek_v3();
        m.moe.as_mut().unwrap().scoring = Scoring::Softmax;
        assert!(write(&m, None, "float32").unwrap_err().to_string().contains("sigmoid"));
        let mut m = deepseek_v3();
        m.moe.as_mut().unwrap().dense_layers = vec![0, 1];
        assert_eq!(write(&m, None, "float32").unwrap()["first_k_dense_replace"], json!(2));
    }

    /// Qwen3-MoE's dense layers, as `Qwen3MoeDecoderLayer` decides: not in `mlp_only_layers`
    /// and `(i + 1) % decoder_sparse_step == 0` has experts; the rest `intermediate_size` wide.
    #[test]
    fn qwen3_moe_dense_layers_follow_transformers() {
        let file = fixture(QWEN3_MOE_DENSE);
        let m = parse(&file, "config.json").unwrap();
        let want = ModelConfig {
            family: Family::Qwen3Moe,
            vocab_size: 88,
            d_model: 32,
            n_layers: 3,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 12,
            mlp_dim: 20,
            norm_eps: 1e-6,
            rope_theta: 1000.0,
            max_seq_len: 64,
            init_std: 0.02,
            moe: Some(MoeConfig {
                num_experts: 4,
                top_k: 2,
                aux_loss_coef: 0.02,
                capacity_factor: None,
                renormalize: true,
                dense_layers: vec![0],
                dense_mlp_dim: 40,
                ..MoeConfig::default()
            }),
            ..ModelConfig::default()
        };
        assert_eq!(m, want);
        round_trip(&file, &m);

        let mut v = file.clone();
        v["num_hidden_layers"] = json!(4);
        v["mlp_only_layers"] = json!([]);
        v["decoder_sparse_step"] = json!(2);
        assert_eq!(parse(&v, "c").unwrap().moe.unwrap().dense_layers, [0, 2]);
        v["mlp_only_layers"] = json!([3, 7]);
        let m = parse(&v, "c").unwrap();
        assert_eq!((m.moe.as_ref().unwrap().dense_layers.clone(), m.dense_mlp_dim()), (vec![0, 2, 3], 40));
        let back = write(&m, Some(&v), "float32").unwrap();
        assert_eq!(
            (back["mlp_only_layers"].clone(), back["decoder_sparse_step"].clone()),
            (json!([0, 2, 3]), json!(1))
        );
        assert_eq!(parse(&back, "c").unwrap(), m);
        // Absent intermediate_size: Qwen3MoeConfig's 6144.
        v.as_object_mut().unwrap().remove("intermediate_size");
        assert_eq!(parse(&v, "c").unwrap().moe.unwrap().dense_mlp_dim, 6144);
    }

    /// `_compute_yarn_parameters`' defaults, its attention factor, and a top-level
    /// `original_max_position_embeddings` taking precedence, as transformers 5.25 reads them.
    #[test]
    fn yarn_defaults_follow_transformers() {
        let with = |table: Value, top: Value| {
            let mut v = llama();
            v["rope_scaling"] = table;
            for (k, x) in top.as_object().unwrap() {
                v[k] = x.clone();
            }
            parse(&v, "config.json")
        };
        let yarn = |table: Value| with(table, json!({})).unwrap().yarn.unwrap();
        let af = |table: Value| crate::model::rope::yarn_attention_factor(&yarn(table));
        // Only a factor (legacy `type`): the original context is max_position_embeddings, the
        // mscales are unset.
        assert_eq!(
            yarn(json!({"type": "yarn", "factor": 4.0})),
            Yarn {
                factor: 4.0,
                original_max_seq_len: 256,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 0.0,
                mscale_all_dim: 0.0,
                attention_factor: None,
                truncate: true,
            }
        );
        // The attention factors transformers computes (printed by transformers 5.25).
        for (table, factor) in [
            (json!({"rope_type": "yarn", "factor": 4.0}), 1.138629436111989),
            (json!({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.8}), 1.138629436111989),
            (json!({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8}), 1.0249579607969668),
            (json!({"rope_type": "yarn", "factor": 4.0, "mscale": 0.707}), 1.138629436111989),
            (
                json!({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8, "attention_factor": 0.5}),
                0.5,
            ),
            (json!({"rope_type": "yarn", "factor": null, "original_max_position_embeddings": 64}), 1.138629436111989),
        ] {
            assert!((af(table.clone()) - factor).abs() < 1e-15, "{table}");
        }
        // factor null: max / original; a top-level original wins over the table's.
        let y = yarn(json!({"rope_type": "yarn", "factor": null, "original_max_position_embeddings": 64}));
        assert_eq!((y.factor, y.original_max_seq_len), (4.0, 64));
        let top = json!({"original_max_position_embeddings": 32});
        let m = with(json!({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}), top).unwrap();
        assert_eq!(m.yarn.as_ref().map(|y| (y.factor, y.original_max_seq_len)), Some((2.0, 32)));
        // `or 32`, `or 1`: 0 and null are the defaults; truncate null is false.
        let y = yarn(json!({"rope_type": "yarn", "factor": 2.0, "beta_fast": 0, "beta_slow": null, "truncate": null}));
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, false));
        for (table, says) in [
            (json!({"rope_type": "yarn", "factor": 0.5}), "rope_scaling.factor = 0.5 is not supported"),
            (
                json!({"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.0}),
                "attention_factor = 0 is not supported",
            ),
            (json!({"rope_type": "yarn", "factor": 2.0, "mscale": -1.0}), "rope_scaling.mscale = -1 is not supported"),
            (json!({"rope_type": "yarn", "factor": 2.0, "beta_fast": 1.0, "beta_slow": 2.0}), "beta_fast = 1 must be"),
            (json!({"rope_type": "yarn", "factor": 2.0, "truncate": "yes"}), "rope_scaling.truncate = \"yes\""),
        ] {
            let e = with(table, json!({})).unwrap_err().to_string();
            assert!(e.starts_with("config.json: ") && e.contains(says), "{e}");
        }
        // Written back under each family and spelling, the top-level original following.
        let table = json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                           "mscale": 0.9, "attention_factor": 1.5, "truncate": false});
        for arch in
            ["LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
        {
            let mut v = llama();
            v["architectures"] = json!([arch]);
            v["rope_scaling"] = table.clone();
            let m = parse(&v, arch).unwrap();
            assert_eq!(m.yarn.as_ref().map(|y| (y.beta_fast, y.attention_factor)), Some((16.0, Some(1.5))), "{arch}");
            let mut new = v.clone();
            let o = new.as_object_mut().unwrap();
            let mut params = o.remove("rope_scaling").unwrap();
            params["rope_theta"] = o.remove("rope_theta").unwrap();
            o.insert("rope_parameters".into(), params);
            o.insert("original_max_position_embeddings".into(), json!(64));
            assert_eq!(parse(&new, arch).unwrap(), m, "{arch}");
            for base in [Some(&v), Some(&new), None] {
                let written = write(&m, base, "float32").unwrap();
                assert_eq!(parse(&written, "out").unwrap(), m, "{arch}");
            }
            let mut moved = m.clone();
            moved.yarn.as_mut().unwrap().original_max_seq_len = 16;
            let written = write(&moved, Some(&new), "float32").unwrap();
            assert_eq!(written["original_max_position_embeddings"], json!(16));
            assert_eq!(parse(&written, "out").unwrap(), moved, "{arch}");
        }
    }

    /// GPT-OSS's config.json: the window's layers, the clamped SwiGLU, the router; what the
    /// engine cannot compute is refused by name.
    #[test]
    fn gpt_oss_maps_its_layers_and_refuses_what_it_cannot_compute() {
        let v = json!({
            "architectures": ["GptOssForCausalLM"], "vocab_size": 96, "hidden_size": 32, "intermediate_size": 24,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5, "swiglu_limit": 1.0,
            "swiglu_alpha": 1.6, "router_aux_loss_coef": 0.05, "max_position_embeddings": 256,
            "rope_theta": 1000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 64, "truncate": false}
        });
        let m = parse(&v, "c").unwrap();
        assert_eq!(
            (m.family, m.sliding_window, m.window_pattern),
            (Family::GptOss, 5, 2),
            "absent layer_types: in turn"
        );
        assert_eq!((0..4).map(|i| m.window(i)).collect::<Vec<_>>(), [5, 0, 5, 0]);
        assert_eq!((m.glu_limit, m.glu_alpha), (1.0, 1.6));
        let moe = m.moe.as_ref().unwrap();
        assert!(moe.renormalize && moe.num_experts == 4 && moe.top_k == 2 && moe.aux_loss_coef == 0.05);
        assert!(!m.yarn.as_ref().unwrap().truncate);
        // An order no pattern gives is kept as a list, and written back as it was.
        let mut odd = v.clone();
        odd["layer_types"] = json!(["full_attention", "sliding_attention", "sliding_attention", "full_attention"]);
        let m = parse(&odd, "c").unwrap();
        assert_eq!((m.window_pattern, (0..4).map(|i| m.window(i)).collect::<Vec<_>>()), (0, vec![0, 5, 5, 0]));
        assert_eq!(write(&m, Some(&odd), "float32").unwrap()["layer_types"], odd["layer_types"]);
        assert_eq!(parse(&write(&m, None, "float32").unwrap(), "out").unwrap(), m);
        let err = |edit: &dyn Fn(&mut Value)| {
            let mut x = v.clone();
            edit(&mut x);
            parse(&x, "c").unwrap_err().to_string()
        };
        assert!(
            err(&|x| x["layer_types"] = json!(["full_attention"]))
                .contains("layer_types lists 1 layers but num_hidden_layers = 4")
        );
        assert!(err(&|x| x["layer_types"] = json!(["a", "b", "c", "d"])).contains("layer_types[0] = \"a\""));
        assert!(err(&|x| x["attention_bias"] = json!(false)).contains("attention_bias = false"));
        assert!(
            err(&|x| x["quantization_config"] = json!({"quant_method": "bitsandbytes"}))
                .contains("quant_method bitsandbytes")
        );
        let mut zero = v.clone();
        zero["sliding_window"] = json!(0);
        let m = parse(&zero, "c").unwrap();
        let e = crate::hf::engine_config(&m, "test").validate().unwrap_err().to_string();
        assert!(e.contains("model.sliding_window = 0"), "{e}");
    }

    const GEMMA3: &str = include_str!("../../../tests/fixtures/hf/gemma3/config.json");
    const GEMMA3_SOFTCAP: &str = include_str!("../../../tests/fixtures/hf/gemma3-softcap/config.json");
    const GEMMA3_MULTIMODAL: &str = include_str!("../../../tests/fixtures/hf/gemma3-multimodal/config.json");

    /// The tiny Gemma 3 of tests/fixtures/hf/gemma3: every mapped key.
    fn gemma3() -> ModelConfig {
        ModelConfig {
            family: Family::Gemma3,
            vocab_size: 96,
            d_model: 32,
            n_layers: 6,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 12,
            mlp_dim: 48,
            norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_local_theta: 100.0,
            rope_linear_factor: 4.0,
            max_seq_len: 256,
            sliding_window: 5,
            window_pattern: 6,
            tie_embeddings: true,
            init_std: 0.02,
            query_pre_attn_scalar: 20.0,
            final_logit_softcap: 0.0,
            ..ModelConfig::default()
        }
    }

    /// Both Gemma 3 fixtures: transformers 5's spelling (layer_types, rope_parameters per layer
    /// type) and the published one (sliding_window_pattern, rope_theta, rope_local_base_freq,
    /// rope_scaling on the global layers), each written back in its own spelling.
    #[test]
    fn gemma3_fixtures_map_every_key() {
        let file = fixture(GEMMA3);
        let m = parse(&file, "config.json").unwrap();
        assert_eq!(m, gemma3());
        assert_eq!((0..6).map(|i| m.window(i)).collect::<Vec<_>>(), [5, 5, 5, 5, 5, 0]);
        assert!((0..5).all(|i| m.local_rope(i)) && !m.local_rope(5));
        round_trip(&file, &m);
        let bare = write(&m, None, "float32").unwrap();
        assert_eq!(
            bare["rope_parameters"],
            json!({"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
        );
        assert!(bare["query_pre_attn_scalar"].is_u64() && bare["final_logit_softcapping"].is_null());
        assert_eq!(
            (bare["architectures"].clone(), bare["model_type"].clone()),
            (json!(["Gemma3ForCausalLM"]), json!("gemma3_text"))
        );
        assert!(bare.get("rope_theta").is_none() && bare.get("sliding_window_pattern").is_none());

        let file = fixture(GEMMA3_SOFTCAP);
        let m = parse(&file, "config.json").unwrap();
        let want = ModelConfig {
            d_model: 48,
            n_layers: 4,
            n_kv_heads: 1,
            head_dim: 16,
            rope_local_theta: 10.0,
            rope_linear_factor: 2.0,
            sliding_window: 6,
            window_pattern: 3,
            query_pre_attn_scalar: 24.0,
            final_logit_softcap: 3.0,
            ..gemma3()
        };
        assert_eq!(m, want);
        assert_eq!((0..4).map(|i| m.window(i)).collect::<Vec<_>>(), [6, 6, 0, 6]);
        round_trip(&file, &m);
        let back = write(&m, Some(&file), "bfloat16").unwrap();
        assert!(back.get("rope_parameters").is_none() && back["rope_local_base_freq"] == json!(10.0));
        assert_eq!(back["sliding_window_pattern"], json!(3));
        // Layers no pattern gives: written as a list, the pattern dropped.
        let mut odd = m.clone();
        (odd.window_pattern, odd.layer_types) =
            (0, vec![LayerType::Full, LayerType::Sliding, LayerType::Full, LayerType::Sliding]);
        let back = write(&odd, Some(&file), "bfloat16").unwrap();
        assert!(back.get("sliding_window_pattern").is_none());
        assert_eq!(parse(&back, "out").unwrap(), odd);
        // No window: every layer full, the window null.
        let mut none = m.clone();
        none.sliding_window = 0;
        let back = write(&none, None, "float32").unwrap();
        assert!(back["sliding_window"].is_null());
        let again = parse(&back, "out").unwrap();
        assert_eq!((again.sliding_window, (0..4).map(|i| again.window(i)).max()), (0, Some(0)));
    }

    /// Gemma3ForConditionalGeneration: its sparse text_config with Gemma3TextConfig's defaults,
    /// tied by the top-level flag, exported as the text model.
    #[test]
    fn gemma3_multimodal_reads_its_text_config() {
        let file = fixture(GEMMA3_MULTIMODAL);
        let m = parse(&file, "config.json").unwrap();
        assert_eq!(m, gemma3());
        let back = write(&m, Some(&file), "float32").unwrap();
        assert_eq!(
            (back["architectures"].clone(), back["model_type"].clone()),
            (json!(["Gemma3ForCausalLM"]), json!("gemma3_text"))
        );
        assert!(
            ["text_config", "vision_config", "mm_tokens_per_image"].iter().all(|k| back.get(k).is_none()),
            "{back}"
        );
        assert!(
            back.get("rope_parameters").is_none()
                && back["rope_scaling"] == json!({"rope_type": "linear", "factor": 4.0})
        );
        assert_eq!(parse(&back, "out").unwrap(), m);
        // gemma-3-4b's text_config, as published: the rest are defaults.
        let published = json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                            "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}
        });
        let m = parse(&published, "c").unwrap();
        let want = ModelConfig {
            vocab_size: 262_208,
            d_model: 2560,
            n_layers: 34,
            n_heads: 8,
            n_kv_heads: 4,
            head_dim: 256,
            mlp_dim: 10240,
            rope_theta: 1e6,
            rope_local_theta: 1e4,
            rope_linear_factor: 8.0,
            max_seq_len: 131_072,
            sliding_window: 1024,
            query_pre_attn_scalar: 256.0,
            ..gemma3()
        };
        assert_eq!(m, want);
        // No text_config at all: Gemma3TextConfig's defaults; the head tied by the top-level flag.
        let m = parse(&json!({"model_type": "gemma3", "tie_word_embeddings": false}), "c").unwrap();
        assert_eq!(
            (m.d_model, m.n_layers, m.mlp_dim, m.tie_embeddings, m.sliding_window),
            (2304, 26, 9216, false, 4096)
        );
        let mut untied_text = published.clone();
        untied_text["text_config"]["tie_word_embeddings"] = json!(false);
        assert!(parse(&untied_text, "c").unwrap().tie_embeddings, "transformers ties by the top-level flag");
        let mut bad = published.clone();
        bad["text_config"]["sliding_window"] = json!(0);
        let e = parse(&bad, "config.json").unwrap_err().to_string();
        assert!(e.starts_with("config.json: text_config.sliding_window = 0 is not supported"), "{e}");
        bad["text_config"] = json!([1]);
        assert!(parse(&bad, "c").unwrap_err().to_string().contains("text_config = [1] is not a table"));
    }

    /// Gemma3TextConfig's defaults and its two RoPE spellings merged as
    /// `convert_rope_params_to_dict` merges them; what transformers computes otherwise than the
    /// engine (or fails on) is refused by key, what it ignores is accepted.
    #[test]
    fn gemma3_defaults_and_refusals_name_the_key() {
        let file = fixture(GEMMA3);
        let with = |patch: Value, remove: &[&str]| {
            let mut v = file.clone();
            for k in remove {
                v.as_object_mut().unwrap().remove(*k);
            }
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            parse(&v, "config.json")
        };
        // No RoPE keys: 1e6 global, 1e4 local, unscaled. No layer_types: every 6th layer full.
        let m = with(json!({"num_hidden_layers": 12}), &["rope_parameters", "layer_types"]).unwrap();
        assert_eq!((m.rope_theta, m.rope_local_theta, m.rope_linear_factor, m.window_pattern), (1e6, 1e4, 1.0, 6));
        // rope_scaling updates the global table of rope_parameters; top-level thetas fill what
        // the tables leave out.
        let m = with(
            json!({"rope_parameters": {"full_attention": {"rope_type": "default"}},
                   "rope_scaling": {"rope_type": "linear", "factor": 3.0}, "rope_theta": 500.0,
                   "rope_local_base_freq": 50.0}),
            &[],
        )
        .unwrap();
        assert_eq!((m.rope_theta, m.rope_local_theta, m.rope_linear_factor), (500.0, 50.0, 3.0));
        // Ignored by transformers' Gemma 3: attn_logit_softcapping, hidden_act; a local linear factor of 1.
        let ignored = json!({"attn_logit_softcapping": 50.0, "hidden_act": "relu",
                             "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                                 "sliding_attention": {"rope_type": "linear", "factor": 1.0, "rope_theta": 100.0}}});
        assert_eq!(with(ignored, &[]).unwrap(), gemma3());
        // `_sliding_window_pattern` alone is not read by transformers: agreeing with the default it is harmless.
        let m = with(json!({"_sliding_window_pattern": 6}), &["layer_types"]).unwrap();
        assert_eq!(m.window_pattern, 6);
        let m = with(json!({"sliding_window_pattern": 2, "_sliding_window_pattern": 2}), &["layer_types"]).unwrap();
        assert_eq!(m.window_pattern, 2);
        for (patch, remove, says) in [
            (json!({"sliding_window": 0}), &[][..], "sliding_window = 0 is not supported"),
            (json!({"sliding_window": -2}), &[][..], "sliding_window = -2 is not supported"),
            (json!({"sliding_window": null}), &[][..], "sliding_window = null is not supported with sliding layers"),
            (
                json!({"layer_types": ["full_attention"]}),
                &[][..],
                "layer_types lists 1 layers but num_hidden_layers = 6",
            ),
            (
                json!({"layer_types": ["a", "b", "c", "d", "e", "f"]}),
                &[][..],
                "layer_types[0] = \"a\" is not supported",
            ),
            (json!({"sliding_window_pattern": 0}), &["layer_types"][..], "sliding_window_pattern = 0 is not supported"),
            (
                json!({"_sliding_window_pattern": 3}),
                &["layer_types"][..],
                "_sliding_window_pattern = 3 is not read by transformers, which takes sliding_window_pattern = 6 (its default)",
            ),
            (
                json!({"use_bidirectional_attention": true}),
                &[][..],
                "use_bidirectional_attention = true is not supported",
            ),
            (json!({"hidden_activation": "gelu"}), &[][..], "hidden_activation = \"gelu\" is not supported"),
            (json!({"hidden_activation": null}), &[][..], "hidden_activation = null is not supported"),
            (json!({"attention_bias": true}), &[][..], "attention_bias = true is not supported"),
            (json!({"query_pre_attn_scalar": 20.5}), &[][..], "query_pre_attn_scalar = 20.5 is not supported"),
            (json!({"final_logit_softcapping": 0.0}), &[][..], "final_logit_softcapping = 0.0 is not supported"),
            (json!({"quantization_config": {"quant_method": "fp8"}}), &[][..], "quant_method fp8 is not supported"),
            (
                json!({"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}}),
                &[][..],
                "rope_parameters.rope_theta is not supported (Gemma 3's RoPE is given per layer type",
            ),
            (
                json!({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}),
                &[][..],
                "rope_parameters.full_attention.rope_type = \"yarn\" is not supported (Gemma 3's global layers: \"default\" or \"linear\")",
            ),
            (
                json!({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}),
                &[][..],
                "rope_parameters.sliding_attention.rope_type = \"linear\" is not supported",
            ),
            (
                json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
                &["rope_parameters"][..],
                "rope_scaling.rope_type = \"dynamic\" is not supported",
            ),
            (
                json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
                &["rope_parameters"][..],
                "rope_scaling.type = \"linear\" without rope_type is not supported",
            ),
            (
                json!({"rope_scaling": {"rope_type": "linear"}}),
                &["rope_parameters"][..],
                "rope_scaling.factor is missing",
            ),
            (
                json!({"rope_parameters": {"full_attention": {"partial_rotary_factor": 0.5}}}),
                &[][..],
                "rope_parameters.full_attention.partial_rotary_factor = 0.5 is not supported",
            ),
        ] {
            let e = with(patch.clone(), remove).unwrap_err().to_string();
            assert!(e.starts_with("config.json: ") && e.contains(says) && !e.contains('\n'), "{patch}: {e}");
        }
        // What a Gemma3ForCausalLM cannot hold is refused on export.
        let mut m = gemma3();
        m.query_pre_attn_scalar = 20.5;
        assert!(
            write(&m, None, "float32")
                .unwrap_err()
                .to_string()
                .contains("query_pre_attn_scalar = 20.5 is not a whole number")
        );
        m.query_pre_attn_scalar = 0.0;
        assert_eq!(write(&m, None, "float32").unwrap()["query_pre_attn_scalar"], json!(12), "head_dim^-1/2");
        let mut m = gemma3();
        m.d_model = 30;
        assert!(
            write(&m, None, "float32")
                .unwrap_err()
                .to_string()
                .contains("d_model = 30 is not a multiple of model.n_heads = 4")
        );
    }
}
