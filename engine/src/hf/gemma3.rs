//! Gemma 3's `config.json`: `Gemma3ForCausalLM` (`model_type` `gemma3_text`, the 270m and 1b
//! checkpoints) and the text model of `Gemma3ForConditionalGeneration` (`model_type` `gemma3`,
//! 4b, 12b and 27b: its nested `text_config`, whose absent keys take `Gemma3TextConfig`'s
//! defaults), read into a [`ModelConfig`] as transformers 5.25 reads them, and written back as a
//! `Gemma3ForCausalLM`.
//!
//! RoPE comes per layer type. transformers 5 writes `rope_parameters` =
//! `{"full_attention": {...}, "sliding_attention": {...}}`; the published checkpoints write
//! `rope_theta` (global layers), `rope_local_base_freq` (sliding layers) and `rope_scaling`, which
//! transformers merges into the global layers' table only (`convert_rope_params_to_dict`). The
//! global layers may be `linear`-scaled (`model.rope_linear_factor`); the local ones are unscaled.
//! Which layers slide is `layer_types`, or else every `sliding_window_pattern`-th (default 6) layer
//! is global.
//!
//! The multimodal checkpoints keep the text model's tensors under `language_model.model.`
//! (what transformers 5.25 still saves, through its `llava` conversion mapping) or, as the
//! modules name them in memory, `model.language_model.`; their vision tower and projector are
//! ignored ([`text_prefix`], [`is_vision`]).

use anyhow::{Result, anyhow, bail};
use serde_json::{Map, Value, json};

use super::config::{pattern_of, read_layer_types};
use crate::config::{Family, LayerType, ModelConfig};

/// The multimodal architecture, whose text model is read.
pub const MULTIMODAL: &str = "Gemma3ForConditionalGeneration";

/// Where a multimodal checkpoint keeps the text model's `model.` tensors: the published
/// spelling first, then the modules' own.
pub const TEXT_PREFIXES: [&str; 2] = ["language_model.model.", "model.language_model."];

/// The prefix of [`TEXT_PREFIXES`] whose embedding `has` holds, if any.
pub fn text_prefix(has: impl Fn(&str) -> bool) -> Option<&'static str> {
    TEXT_PREFIXES.into_iter().find(|p| has(&format!("{p}embed_tokens.weight")))
}

/// Whether a tensor of a multimodal checkpoint belongs to its vision tower or projector.
pub fn is_vision(name: &str) -> bool {
    ["vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."]
        .iter()
        .any(|p| name.starts_with(p))
}

/// Whether `obj` describes a `Gemma3ForConditionalGeneration` (by its architecture, or without
/// one by `model_type` `gemma3`).
pub fn is_multimodal(obj: &Map<String, Value>) -> bool {
    match obj.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str) {
        Some(arch) => arch == MULTIMODAL,
        None => obj.get("model_type").and_then(Value::as_str) == Some("gemma3"),
    }
}

/// The text model of a `Gemma3ForConditionalGeneration`: its `text_config` (absent or null: all
/// defaults), tied as the top-level `tie_word_embeddings` says (transformers ties the
/// multimodal model's head by that flag alone, default true; `text_config`'s is ignored).
pub fn parse_multimodal(obj: &Map<String, Value>, file: &str) -> Result<ModelConfig> {
    let empty = Map::new();
    let text = match obj.get("text_config") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(t)) => t,
        Some(other) => bail!("{file}: text_config = {other} is not a table"),
    };
    let mut m = parse(text, file, "text_config.")?;
    m.tie_embeddings = match obj.get("tie_word_embeddings") {
        None => true,
        Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| anyhow!("{file}: tie_word_embeddings = {v} is not true or false"))?,
    };
    Ok(m)
}

/// A `Gemma3TextConfig` (`obj`, whose keys are named `{at}key` in errors), with its defaults for
/// absent keys. What transformers computes otherwise than the engine is refused by key.
pub fn parse(obj: &Map<String, Value>, file: &str, at: &str) -> Result<ModelConfig> {
    let get = |key: &str| obj.get(key).filter(|v| !v.is_null());
    let uint = |key: &str, default: usize| -> Result<usize> {
        match get(key) {
            Some(v) => {
                v.as_u64().map(|x| x as usize).ok_or_else(|| anyhow!("{file}: {at}{key} = {v} is not a whole number"))
            }
            None => Ok(default),
        }
    };
    let float = |key: &str, default: f64| -> Result<f64> {
        match get(key) {
            Some(v) => v.as_f64().ok_or_else(|| anyhow!("{file}: {at}{key} = {v} is not a number")),
            None => Ok(default),
        }
    };
    // Absent: the default; null: false, as Python's `if config.key:` reads None.
    let flag = |key: &str, default: bool| -> Result<bool> {
        match obj.get(key) {
            None => Ok(default),
            Some(Value::Null) => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| anyhow!("{file}: {at}{key} = {v} is not true or false")),
        }
    };
    if let Some(q) = get("quantization_config") {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("absent");
        bail!(
            "{file}: quantization_config with quant_method {method} is not supported (import a bf16 or f32 checkpoint)"
        );
    }
    // Gemma3MLP reads `hidden_activation` (a `hidden_act` key, which older Gemma configs carry,
    // is unused by it).
    if let Some(act) = obj.get("hidden_activation").filter(|a| a.as_str() != Some("gelu_pytorch_tanh")) {
        bail!(
            "{file}: {at}hidden_activation = {act} is not supported (Gemma 3's MLP is GeGLU with \"gelu_pytorch_tanh\")"
        );
    }
    if flag("attention_bias", false)? {
        bail!("{file}: {at}attention_bias = true is not supported (the engine's projections have no bias)");
    }
    // The embedding-model mode: bidirectional attention over a window transformers halves.
    if flag("use_bidirectional_attention", false)? {
        bail!("{file}: {at}use_bidirectional_attention = true is not supported (the engine's attention is causal)");
    }
    // `attn_logit_softcapping` is accepted and ignored, as transformers 5.25's Gemma 3 ignores it:
    // Gemma3Attention never passes it to the attention function (Gemma 2 did; Gemma 3 replaced
    // the capping by QK-norm, and every published Gemma 3 config has it null).

    let d_model = uint("hidden_size", 2304)?;
    let n_heads = uint("num_attention_heads", 8)?;
    if n_heads == 0 {
        bail!("{file}: {at}num_attention_heads must be greater than 0");
    }
    let n_layers = uint("num_hidden_layers", 26)?;
    let n_kv_heads = match obj.get("num_key_value_heads") {
        Some(Value::Null) => n_heads,
        _ => uint("num_key_value_heads", 4)?,
    };
    let types = layer_types(obj, file, at, n_layers)?;
    let any_sliding = types.contains(&LayerType::Sliding);
    let sliding_window = match obj.get("sliding_window") {
        // transformers fails on a null window with sliding layers; without any it is unused.
        Some(Value::Null) if any_sliding => {
            bail!("{file}: {at}sliding_window = null is not supported with sliding layers (a window of at least 1)")
        }
        Some(Value::Null) => 0,
        None => 4096,
        Some(v) => match v.as_u64() {
            Some(w) if w >= 1 => w as usize,
            _ => bail!("{file}: {at}sliding_window = {v} is not supported (a whole number of at least 1)"),
        },
    };
    let (window_pattern, layer_types) = match pattern_of(&types) {
        Some(n) => (n, Vec::new()),
        None => (0, types),
    };
    let (rope_theta, rope_linear_factor, rope_local_theta) = rope(obj, file, at)?;
    let query_pre_attn_scalar = match get("query_pre_attn_scalar") {
        None => 256.0,
        Some(v) => match v.as_u64() {
            Some(q) if q >= 1 => q as f64,
            _ => bail!("{file}: {at}query_pre_attn_scalar = {v} is not supported (a whole number of at least 1)"),
        },
    };
    let final_logit_softcap = match get("final_logit_softcapping") {
        None => 0.0,
        Some(v) => match v.as_f64() {
            Some(c) if c > 0.0 => c,
            _ => bail!("{file}: {at}final_logit_softcapping = {v} is not supported (a positive number, or null: none)"),
        },
    };
    Ok(ModelConfig {
        family: Family::Gemma3,
        vocab_size: uint("vocab_size", 262_208)?,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim: uint("head_dim", 256)?,
        mlp_dim: uint("intermediate_size", 9216)?,
        norm_eps: float("rms_norm_eps", 1e-6)?,
        rope_theta,
        rope_local_theta,
        rope_linear_factor,
        max_seq_len: uint("max_position_embeddings", 131_072)?,
        sliding_window,
        window_pattern,
        layer_types,
        tie_embeddings: flag("tie_word_embeddings", true)?,
        init_std: float("initializer_range", 0.02)?,
        query_pre_attn_scalar,
        final_logit_softcap,
        ..ModelConfig::default()
    })
}

/// Each layer's attention: `layer_types`, or else every `sliding_window_pattern`-th layer full
/// (`Gemma3TextConfig.__post_init__`, default 6). transformers 5.25 reads the pattern only under
/// that key: a `_sliding_window_pattern` (which it saves beside `layer_types`) alone is ignored,
/// so one that disagrees with the layers it gives is refused rather than guessed at.
fn layer_types(obj: &Map<String, Value>, file: &str, at: &str, n_layers: usize) -> Result<Vec<LayerType>> {
    if obj.get("layer_types").is_some_and(|v| !v.is_null()) {
        return read_layer_types(obj, file, at, n_layers);
    }
    let pattern = |key: &str| -> Result<Option<usize>> {
        match obj.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => Ok(Some(n as usize)),
                _ => bail!("{file}: {at}{key} = {v} is not supported (a whole number of at least 1)"),
            },
        }
    };
    let n = pattern("sliding_window_pattern")?.unwrap_or(6);
    if let Some(saved) = pattern("_sliding_window_pattern")?
        && saved != n
    {
        bail!(
            "{file}: {at}_sliding_window_pattern = {saved} is not read by transformers, which takes sliding_window_pattern = {n}{}; write layer_types",
            if obj.contains_key("sliding_window_pattern") { "" } else { " (its default)" }
        );
    }
    Ok((0..n_layers).map(|i| if (i + 1) % n == 0 { LayerType::Full } else { LayerType::Sliding }).collect())
}

/// `(global base, linear factor of the global layers, local base)`, as
/// `Gemma3TextConfig.convert_rope_params_to_dict` reads either spelling.
fn rope(obj: &Map<String, Value>, file: &str, at: &str) -> Result<(f64, f64, f64)> {
    let table = |key: &str| -> Result<Option<&Map<String, Value>>> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(t)) => Ok(Some(t)),
            Some(other) => bail!("{file}: {at}{key} = {other} is not a table"),
        }
    };
    let top = |key: &str| -> Result<Option<f64>> {
        match obj.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => Ok(Some(v.as_f64().ok_or_else(|| anyhow!("{file}: {at}{key} = {v} is not a number"))?)),
        }
    };
    if let Some(p) = top("partial_rotary_factor")?.filter(|p| *p != 1.0) {
        bail!("{file}: {at}partial_rotary_factor = {p} is not supported (RoPE over the whole head: 1)");
    }
    let params = table("rope_parameters")?;
    if let Some((k, _)) =
        params.and_then(|p| p.iter().find(|(k, _)| !["full_attention", "sliding_attention"].contains(&k.as_str())))
    {
        bail!(
            "{file}: {at}rope_parameters.{k} is not supported (Gemma 3's RoPE is given per layer type: rope_parameters.full_attention and rope_parameters.sliding_attention)"
        );
    }
    let nested = |kind: &str| -> Result<Option<&Map<String, Value>>> {
        match params.and_then(|p| p.get(kind)) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(t)) => Ok(Some(t)),
            Some(other) => bail!("{file}: {at}rope_parameters.{kind} = {other} is not a table"),
        }
    };
    // (key, value, where it is named) of each layer type's table; `rope_scaling` is merged into
    // the global layers' only, over what rope_parameters says.
    let mut full: Vec<(String, Value, String)> = Vec::new();
    if let Some(t) = nested("full_attention")? {
        full.extend(t.iter().map(|(k, v)| (k.clone(), v.clone(), format!("rope_parameters.full_attention.{k}"))));
    }
    if let Some(s) = table("rope_scaling")? {
        // transformers starts from {"rope_type": "default"} and updates it with the table: a
        // legacy `type` alone leaves the default type, and the RoPE unscaled.
        if let Some(t) = s.get("type").filter(|t| t.as_str() != Some("default"))
            && !s.contains_key("rope_type")
        {
            bail!(
                "{file}: {at}rope_scaling.type = {t} without rope_type is not supported (transformers 5.25 keeps Gemma 3's default rope_type under it, unscaled); write rope_type"
            );
        }
        for (k, v) in s {
            full.retain(|(x, _, _)| x != k);
            full.push((k.clone(), v.clone(), format!("rope_scaling.{k}")));
        }
    }
    let local: Vec<(String, Value, String)> = nested("sliding_attention")?
        .map(|t| {
            t.iter().map(|(k, v)| (k.clone(), v.clone(), format!("rope_parameters.sliding_attention.{k}"))).collect()
        })
        .unwrap_or_default();
    let field = |t: &[(String, Value, String)], k: &str| t.iter().find(|(x, v, _)| x == k && !v.is_null()).cloned();
    let number = |t: &[(String, Value, String)], k: &str| -> Result<Option<f64>> {
        match field(t, k) {
            None => Ok(None),
            Some((_, v, name)) => {
                Ok(Some(v.as_f64().ok_or_else(|| anyhow!("{file}: {at}{name} = {v} is not a number"))?))
            }
        }
    };
    for t in [&full, &local] {
        if let Some((_, v, name)) = field(t, "partial_rotary_factor").filter(|(_, v, _)| v.as_f64() != Some(1.0)) {
            bail!("{file}: {at}{name} = {v} is not supported (RoPE over the whole head: 1)");
        }
    }
    let global_theta = match number(&full, "rope_theta")? {
        Some(t) => t,
        None => top("rope_theta")?.unwrap_or(1_000_000.0),
    };
    let local_theta = match number(&local, "rope_theta")? {
        Some(t) => t,
        None => top("rope_local_base_freq")?.unwrap_or(10_000.0),
    };
    // (type, where it is named)
    let kind = |t: &[(String, Value, String)]| -> Result<(String, String)> {
        match field(t, "rope_type").or_else(|| field(t, "type")) {
            None => Ok(("default".into(), String::new())),
            Some((_, v, name)) => match v.as_str() {
                Some(s) => Ok((s.to_owned(), name)),
                None => bail!("{file}: {at}{name} = {v} is not supported (Gemma 3: \"default\" or \"linear\")"),
            },
        }
    };
    let factor = |t: &[(String, Value, String)], kind_at: &str| -> Result<f64> {
        let name = kind_at.rsplit_once('.').map_or(String::new(), |(table, _)| format!("{table}.factor"));
        number(t, "factor")?.ok_or_else(|| anyhow!("{file}: {at}{name} is missing (linear RoPE divides by it)"))
    };
    let linear = match kind(&full)? {
        (k, _) if k == "default" => 1.0,
        (k, name) if k == "linear" => factor(&full, &name)?,
        (k, name) => {
            bail!("{file}: {at}{name} = \"{k}\" is not supported (Gemma 3's global layers: \"default\" or \"linear\")")
        }
    };
    match kind(&local)? {
        (k, _) if k == "default" => {}
        (k, name) if k == "linear" && factor(&local, &name)? == 1.0 => {}
        (k, name) => bail!(
            "{file}: {at}{name} = \"{k}\" is not supported (the engine's sliding layers rotate unscaled: \"default\")"
        ),
    }
    Ok((global_theta, linear, local_theta))
}

/// A `Gemma3ForCausalLM` `config.json` for `m`, over `base` (the imported model's own; that of a
/// `Gemma3ForConditionalGeneration` gives its `text_config`, the weights exported being the text
/// model's). RoPE keeps `base`'s spelling: the published one (`rope_theta`,
/// `rope_local_base_freq`, `rope_scaling`) when `base` has it, else transformers 5's nested
/// `rope_parameters`. `layer_types` is always written; a `sliding_window_pattern` of `base` is
/// kept when a pattern gives the layers, and dropped when none does.
pub fn write(m: &ModelConfig, base: Map<String, Value>, dtype: &str) -> Result<Value> {
    let cannot = "cannot export as Gemma3ForCausalLM";
    if m.rope_scaling.is_some() || m.yarn.is_some() {
        bail!(
            "{cannot}: its RoPE is scaled linearly only (model.rope_linear_factor), not by model.rope_scaling or model.yarn"
        );
    }
    if !m.d_model.is_multiple_of(m.n_heads) {
        bail!(
            "{cannot}: model.d_model = {} is not a multiple of model.n_heads = {} (transformers' Gemma3TextConfig requires it)",
            m.d_model,
            m.n_heads
        );
    }
    // transformers' query_pre_attn_scalar is an int; 0 here means head_dim^-1/2.
    let q = m.query_pre_attn_scalar;
    let qpas = if q == 0.0 {
        m.head_dim as u64
    } else if q.fract() == 0.0 && (1.0..9e15).contains(&q) {
        q as u64
    } else {
        bail!("{cannot}: model.query_pre_attn_scalar = {q} is not a whole number (transformers stores an int)");
    };
    let mut o = match base.get("text_config") {
        _ if !is_multimodal(&base) => base,
        Some(Value::Object(t)) => t.clone(),
        _ => Map::new(),
    };
    let types: Vec<LayerType> =
        (0..m.n_layers).map(|i| if m.window(i) == 0 { LayerType::Full } else { LayerType::Sliding }).collect();
    let published = !o.contains_key("rope_parameters")
        && ["rope_theta", "rope_local_base_freq", "rope_scaling"].iter().any(|k| o.contains_key(*k));
    let dtype_key = if o.contains_key("torch_dtype") { "torch_dtype" } else { "dtype" };
    let pattern = pattern_of(&types).filter(|n| *n > 0);
    for key in ["sliding_window_pattern", "_sliding_window_pattern"] {
        if o.contains_key(key) {
            match pattern {
                Some(n) => o.insert(key.into(), json!(n)),
                None => o.remove(key),
            };
        }
    }
    let mut set = |k: &str, v: Value| {
        o.insert(k.to_owned(), v);
    };
    set("architectures", json!(["Gemma3ForCausalLM"]));
    set("model_type", json!("gemma3_text"));
    set("vocab_size", json!(m.vocab_size));
    set("hidden_size", json!(m.d_model));
    set("intermediate_size", json!(m.mlp_dim));
    set("num_hidden_layers", json!(m.n_layers));
    set("num_attention_heads", json!(m.n_heads));
    set("num_key_value_heads", json!(m.n_kv_heads));
    set("head_dim", json!(m.head_dim));
    set("hidden_activation", json!("gelu_pytorch_tanh"));
    set("max_position_embeddings", json!(m.max_seq_len));
    set("rms_norm_eps", json!(m.norm_eps));
    set("initializer_range", json!(m.init_std));
    set("tie_word_embeddings", json!(m.tie_embeddings));
    set("attention_bias", json!(false));
    set("use_bidirectional_attention", json!(false));
    set("query_pre_attn_scalar", json!(qpas));
    set("sliding_window", if m.sliding_window == 0 { Value::Null } else { json!(m.sliding_window) });
    let names: Vec<&str> =
        types.iter().map(|t| if *t == LayerType::Full { "full_attention" } else { "sliding_attention" }).collect();
    set("layer_types", json!(names));
    set(
        "final_logit_softcapping",
        if m.final_logit_softcap == 0.0 { Value::Null } else { json!(m.final_logit_softcap) },
    );
    set(dtype_key, json!(dtype));
    let scaled = m.rope_linear_factor != 1.0;
    if published {
        set("rope_theta", json!(m.rope_theta));
        set("rope_local_base_freq", json!(m.rope_local_theta));
        set(
            "rope_scaling",
            if scaled { json!({"rope_type": "linear", "factor": m.rope_linear_factor}) } else { Value::Null },
        );
        o.remove("rope_parameters");
    } else {
        let mut full = json!({"rope_type": "default", "rope_theta": m.rope_theta});
        if scaled {
            full = json!({"rope_type": "linear", "factor": m.rope_linear_factor, "rope_theta": m.rope_theta});
        }
        let local = json!({"rope_type": "default", "rope_theta": m.rope_local_theta});
        set("rope_parameters", json!({"full_attention": full, "sliding_attention": local}));
        for k in ["rope_theta", "rope_local_base_freq", "rope_scaling"] {
            o.remove(k);
        }
    }
    Ok(Value::Object(o))
}
