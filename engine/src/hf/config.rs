//! `config.json` of `LlamaForCausalLM`, `MistralForCausalLM`, `MixtralForCausalLM` and
//! `GPT2LMHeadModel`: read into a [`ModelConfig`] with transformers' defaults for absent keys,
//! and written back.
//!
//! RoPE comes in two spellings: `rope_theta` with an optional `rope_scaling` table (transformers
//! 4), or one `rope_parameters` table holding `rope_theta` and `rope_type` (transformers 5).
//! Types `default` and `llama3` are supported.

use anyhow::{Result, anyhow, bail};
use serde_json::{Map, Value, json};

use crate::config::{Family, Gelu, ModelConfig, MoeConfig, RopeScaling};

/// The architectures (`architectures[0]`) this engine reads and writes.
pub const ARCHITECTURES: [(&str, Family); 6] = [
    ("LlamaForCausalLM", Family::Llama),
    ("MistralForCausalLM", Family::Mistral),
    ("MixtralForCausalLM", Family::Mixtral),
    ("GPT2LMHeadModel", Family::Gpt),
    ("Qwen3ForCausalLM", Family::Qwen3),
    ("Qwen3MoeForCausalLM", Family::Qwen3Moe),
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
    }
}

/// Reads a model configuration from a `config.json` value; `file` names it in errors.
pub fn parse(v: &Value, file: &str) -> Result<ModelConfig> {
    let obj = v.as_object().ok_or_else(|| anyhow!("{file} is not a JSON object"))?;
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
    if family == Family::Gpt {
        return parse_gpt2(obj, file);
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
    let flag = |key: &str| -> Result<bool> {
        match get(key) {
            Some(v) => v.as_bool().ok_or_else(|| anyhow!("{file}: {key} = {v} is not true or false")),
            None => Ok(false),
        }
    };
    if let Some(act) = get("hidden_act").and_then(Value::as_str).filter(|a| *a != "silu") {
        bail!("{file}: hidden_act = \"{act}\" is not supported (the engine's MLP is SwiGLU with silu)");
    }
    for key in ["attention_bias", "mlp_bias"] {
        if flag(key)? {
            bail!("{file}: {key} = true is not supported (the engine's projections have no bias)");
        }
    }
    let d_model = uint("hidden_size", None)?;
    let n_heads = uint("num_attention_heads", None)?;
    if n_heads == 0 {
        bail!("{file}: num_attention_heads must be greater than 0");
    }
    let (default_theta, default_eps, default_max) = match family {
        Family::Llama => (10_000.0, 1e-6, 2048),
        Family::Mistral => (10_000.0, 1e-6, 4096 * 32),
        Family::Mixtral | Family::Gpt => (1_000_000.0, 1e-5, 4096 * 32),
        Family::Qwen3 | Family::Qwen3Moe => (10_000.0, 1e-6, 32768),
    };
    if matches!(family, Family::Qwen3 | Family::Qwen3Moe) {
        qwen3_refusals(obj, file)?;
    }
    let max_seq_len = uint("max_position_embeddings", Some(default_max))?;
    let (rope_theta, rope_scaling) = rope(obj, file, default_theta, max_seq_len)?;
    let sliding_window = match family {
        // Qwen3's window applies only with use_sliding_window = true, which is refused.
        Family::Llama | Family::Qwen3 | Family::Qwen3Moe => 0,
        // MistralConfig's default when the key is absent; null means none.
        Family::Mistral if !obj.contains_key("sliding_window") => 4096,
        _ => uint("sliding_window", Some(0))?,
    };
    let moe = match family {
        Family::Mixtral => Some(MoeConfig {
            num_experts: uint("num_local_experts", Some(8))?,
            top_k: uint("num_experts_per_tok", Some(2))?,
            aux_loss_coef: float("router_aux_loss_coef", 0.001)?,
            // transformers' Mixtral is dropless.
            capacity_factor: None,
            renormalize: true,
        }),
        Family::Qwen3Moe => Some(MoeConfig {
            // Hub configs say `num_experts`; transformers 5 saves `num_local_experts`.
            num_experts: match get("num_local_experts") {
                Some(_) => uint("num_local_experts", None)?,
                None => uint("num_experts", Some(128))?,
            },
            top_k: uint("num_experts_per_tok", Some(8))?,
            aux_loss_coef: float("router_aux_loss_coef", 0.001)?,
            capacity_factor: None,
            renormalize: flag("norm_topk_prob")?,
        }),
        _ => None,
    };
    // Qwen3-MoE's experts are `moe_intermediate_size` wide; `intermediate_size` is that of
    // the dense MLP of `mlp_only_layers`, which the engine refuses (`qwen3_refusals`).
    let mlp_dim = match family {
        Family::Qwen3Moe => uint("moe_intermediate_size", Some(768))?,
        _ => uint("intermediate_size", None)?,
    };
    Ok(ModelConfig {
        family,
        vocab_size: uint("vocab_size", None)?,
        d_model,
        n_layers: uint("num_hidden_layers", None)?,
        n_heads,
        // Absent: the class default (Llama: the heads, the others 8); null: the heads.
        n_kv_heads: match obj.get("num_key_value_heads") {
            Some(Value::Null) => n_heads,
            _ => uint("num_key_value_heads", Some(if family == Family::Llama { n_heads } else { 8 }))?,
        },
        head_dim: uint("head_dim", Some(d_model / n_heads))?,
        mlp_dim,
        norm_eps: float("rms_norm_eps", default_eps)?,
        rope_theta,
        rope_scaling,
        max_seq_len,
        sliding_window,
        tie_embeddings: flag("tie_word_embeddings")?,
        init_std: float("initializer_range", 0.02)?,
        moe,
        gelu: Gelu::Tanh,
    })
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
    if let Some(step) = get("decoder_sparse_step").filter(|v| v.as_u64() != Some(1)) {
        bail!("{file}: decoder_sparse_step = {step} is not supported (every layer a mixture of experts: 1)");
    }
    if let Some(layers) = get("mlp_only_layers").filter(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
        bail!("{file}: mlp_only_layers = {layers} is not supported (dense layers among the experts' layers)");
    }
    Ok(())
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

/// `(rope_theta, llama3 scaling)` from either spelling.
fn rope(
    obj: &Map<String, Value>,
    file: &str,
    default_theta: f64,
    max_seq_len: usize,
) -> Result<(f64, Option<RopeScaling>)> {
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
    let top_theta = match obj.get("rope_theta").filter(|v| !v.is_null()) {
        Some(v) => v.as_f64().ok_or_else(|| anyhow!("{file}: rope_theta = {v} is not a number"))?,
        None => default_theta,
    };
    let Some(t) = table else { return Ok((top_theta, None)) };
    let theta = number(t, "rope_theta", top_theta)?;
    let kind = t.get("rope_type").or_else(|| t.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok((theta, None)),
        "llama3" => Ok((
            theta,
            Some(RopeScaling {
                factor: number(t, "factor", 8.0)?,
                low_freq_factor: number(t, "low_freq_factor", 1.0)?,
                high_freq_factor: number(t, "high_freq_factor", 4.0)?,
                original_max_seq_len: number(t, "original_max_position_embeddings", max_seq_len as f64)? as usize,
            }),
        )),
        other => bail!("{file}: {key}.rope_type = \"{other}\" is not supported (supported: default, llama3)"),
    }
}

/// A `config.json` for `m`: `base` (the imported model's own, if any) with every key the
/// engine knows set from `m`, so that keys it does not know (token ids, ...) survive export.
/// RoPE keeps the spelling `base` used; without a base it is written as `rope_theta` and
/// `rope_scaling`, which transformers 4 and 5 both read.
pub fn write(m: &ModelConfig, base: Option<&Value>, dtype: &str) -> Value {
    let mut o = base.and_then(Value::as_object).cloned().unwrap_or_default();
    let family = m.family;
    if family == Family::Gpt {
        return write_gpt2(m, o, dtype);
    }
    let has_intermediate = o.contains_key("intermediate_size");
    let has_local_experts = o.contains_key("num_local_experts");
    let mut set = |k: &str, v: Value| {
        o.insert(k.to_owned(), v);
    };
    set("architectures", json!([architecture(family)]));
    set("model_type", json!(model_type(family)));
    set("vocab_size", json!(m.vocab_size));
    set("hidden_size", json!(m.d_model));
    // Qwen3-MoE's intermediate_size is the unused dense width: the base's is kept.
    if family != Family::Qwen3Moe || !has_intermediate {
        set("intermediate_size", json!(m.mlp_dim));
    }
    set("num_hidden_layers", json!(m.n_layers));
    set("num_attention_heads", json!(m.n_heads));
    set("num_key_value_heads", json!(m.n_kv_heads));
    set("head_dim", json!(m.head_dim));
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
        _ => set("sliding_window", if m.sliding_window == 0 { Value::Null } else { json!(m.sliding_window) }),
    }
    if let Some(moe) = &m.moe {
        if family == Family::Qwen3Moe {
            set(if has_local_experts { "num_local_experts" } else { "num_experts" }, json!(moe.num_experts));
            set("moe_intermediate_size", json!(m.mlp_dim));
            set("norm_topk_prob", json!(moe.renormalize));
            set("decoder_sparse_step", json!(1));
            set("mlp_only_layers", json!([]));
        } else {
            set("num_local_experts", json!(moe.num_experts));
        }
        set("num_experts_per_tok", json!(moe.top_k));
        set("router_aux_loss_coef", json!(moe.aux_loss_coef));
    }
    let scaling = m.rope_scaling.as_ref().map(|s| {
        json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        })
    });
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
    Value::Object(o)
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
            let written = write(&old, base, "float32");
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
    /// refused by key; export keeps the dense `intermediate_size` and the count's spelling.
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
        let back = write(&m, Some(&v), "float32");
        assert_eq!((back["intermediate_size"].clone(), back["num_local_experts"].clone()), (json!(48), json!(6)));
        assert_eq!(parse(&back, "c").unwrap(), m);
        let mut hub = v.clone();
        hub.as_object_mut().unwrap().remove("num_local_experts");
        hub["num_experts"] = json!(6);
        assert_eq!(parse(&hub, "c").unwrap(), m);
        for (key, value, says) in [
            ("mlp_only_layers", json!([0]), "mlp_only_layers = [0] is not supported"),
            ("decoder_sparse_step", json!(2), "decoder_sparse_step = 2 is not supported"),
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
        let back = write(&m, Some(&v), "float32");
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
        assert!(err(json!({"rope_scaling": {"rope_type": "yarn"}})).contains("rope_scaling.rope_type = \"yarn\""));
        assert!(err(json!({"attention_bias": true})).contains("attention_bias"));
        assert!(err(json!({"hidden_size": "big"})).contains("hidden_size"));
        assert!(err(json!({"hidden_act": "gelu"})).contains("hidden_act"));
    }
}
