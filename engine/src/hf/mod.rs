//! Hugging Face models: `LlamaForCausalLM`, `MistralForCausalLM`, `MixtralForCausalLM`,
//! `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM`, `GptOssForCausalLM`
//! (its stacked experts and MXFP4 blocks: `gpt_oss.rs`), `Gemma3ForCausalLM` (and the text model
//! of `Gemma3ForConditionalGeneration`, its tensors under `language_model.model.`, its vision
//! tower ignored, exported as a `Gemma3ForCausalLM`: `gemma3.rs`) and `GPT2LMHeadModel`
//! directories (`config.json` and `model.safetensors` or a sharded
//! `model.safetensors.index.json`) read into the engine's layout, and written back.
//!
//! The engine's tensor names are Hugging Face's, so import and export copy ranges of the flat
//! parameter buffer. Experts are read under both spellings: the per-expert tensors of checkpoints
//! (what transformers writes: Mixtral's `block_sparse_moe.experts.E.w1/w2/w3.weight`,
//! Qwen3-MoE's `mlp.experts.E.gate_proj/up_proj/down_proj.weight`) and the fused
//! `mlp.experts.gate_up_proj` / `down_proj` of transformers 5's modules (which it saves again
//! when it loaded them so); they are written per expert. GPT-2's `Conv1D` weights (`c_attn`, `c_proj`, `c_fc`) are stored
//! `[in, out]`, the transpose of the engine's `[out, in]`: they are transposed on the way in and
//! out ([`hf_tensor`]). GPT-2 tensors are read under both spellings, `transformer.h.0...` (what
//! transformers writes) and the original hub checkpoint's `h.0...`, whose `attn.bias` and
//! `attn.masked_bias` buffers (the causal mask) are ignored; they are written as `transformer.`.
//! Tensors are read as f32 from F32, BF16 or F16 and written in the dtype the
//! model was imported in (so an import/export round trip is byte-exact) or the one asked for.

pub mod config;
pub mod gemma3;
pub mod gpt_oss;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};

use crate::checkpoint::{self, Checkpoint, Extras, Snapshot};
use crate::config::{Config, Family, ModelConfig, TrainConfig};
use crate::fsutil;
use crate::model::{ExpertNames, Layout, MlpOffsets, Tensor};
use crate::tensors::{self, FloatType, Mapped};

/// Files of a model directory that travel with the model through import, training and export.
pub const CARRIED: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
];

/// A Hugging Face model directory, opened.
pub struct HfModel {
    /// The directory holding `config.json`, the weights and the tokenizer files.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub raw_config: Value,
    /// The architecture it describes.
    pub model: ModelConfig,
    /// The dtype of its weights (that of the embedding).
    pub dtype: FloatType,
    /// Where its files must lie once symbolic links are followed ([`confinement`]).
    root: PathBuf,
    files: Vec<Mapped>,
    /// Tensor name → index into `files`.
    index: BTreeMap<String, usize>,
    /// Where a multimodal Gemma 3 keeps the text model's `model.` tensors
    /// ([`gemma3::TEXT_PREFIXES`]); `None`: under `model.`.
    text_prefix: Option<&'static str>,
}

impl HfModel {
    /// Opens a model directory: reads `config.json`, maps the weight files, checks dtypes.
    pub fn open(dir: &Path) -> Result<HfModel> {
        let d = dir.display();
        let root = confinement(dir)?;
        let config_path = dir.join("config.json");
        inside(&config_path, &root)?;
        let text = fs::read(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
        let raw_config: Value =
            serde_json::from_slice(&text).map_err(|e| anyhow!("{} is not valid JSON: {e}", config_path.display()))?;
        let file_label = config_path.display().to_string();
        let model = config::parse(&raw_config, &file_label)?;
        engine_config(&model, "").validate().map_err(|e| anyhow!("{file_label}: {e}"))?;

        let index_path = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if index_path.exists() {
            inside(&index_path, &root)?;
            let index: Value = serde_json::from_slice(&fs::read(&index_path)?)
                .map_err(|e| anyhow!("{} is not valid JSON: {e}", index_path.display()))?;
            let map =
                index["weight_map"].as_object().ok_or_else(|| anyhow!("{} has no weight_map", index_path.display()))?;
            let files: BTreeSet<String> = map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
            // Every weight file is a plain name inside the model directory.
            let plain = |f: &str| matches!(Path::new(f).components().collect::<Vec<_>>()[..], [Component::Normal(_)]);
            if let Some(bad) = files.iter().find(|f| !plain(f)) {
                bail!("{}: weight_map names {bad}, which is not a file of {d}", index_path.display());
            }
            files.into_iter().collect()
        } else if dir.join("model.safetensors").exists() {
            vec!["model.safetensors".into()]
        } else {
            bail!(
                "{d} holds neither model.safetensors nor model.safetensors.index.json (only safetensors weights are read; \
                 save the model with transformers' save_pretrained to get them)"
            );
        };
        let mut files = Vec::new();
        let mut index = BTreeMap::new();
        for name in names {
            inside(&dir.join(&name), &root)?;
            let mapped = Mapped::open(&dir.join(&name))?;
            for (tensor, view) in mapped.tensors().iter() {
                // GPT-OSS's MXFP4 experts are bytes, read as such ([`HfModel::read_u8`]).
                let mxfp4 = model.family == Family::GptOss
                    && (tensor.ends_with("_blocks") || tensor.ends_with("_scales"))
                    && view.dtype() == safetensors::Dtype::U8;
                if !mxfp4 {
                    tensors::float_type(tensor, &view).with_context(|| format!("{}", dir.join(&name).display()))?;
                }
                index.insert(tensor.to_owned(), files.len());
            }
            files.push(mapped);
        }
        let text_prefix = match model.family {
            Family::Gemma3 => gemma3::text_prefix(|n| index.contains_key(n)),
            _ => None,
        };
        let embed = if model.is_gpt() {
            ["transformer.wte.weight", "wte.weight"].into_iter().find(|n| index.contains_key(*n)).map(str::to_owned)
        } else {
            Some(stored_name(text_prefix, "model.embed_tokens.weight", |n| index.contains_key(n)))
                .filter(|n| index.contains_key(n))
        };
        let dtype = match embed.map(|n| (index[&n], n)) {
            Some((f, name)) => {
                let st = files[f].tensors();
                tensors::float_type(&name, &st.tensor(&name)?)?
            }
            None => bail!("{d}: tensor {} is missing", Layout::new(&model).tensors[0].name),
        };
        Ok(HfModel { dir: dir.to_path_buf(), raw_config, model, dtype, root, files, index, text_prefix })
    }

    /// The name the files give layout tensor `name` ([`stored_name`]).
    fn stored(&self, name: &str) -> String {
        stored_name(self.text_prefix, name, |n| self.index.contains_key(n))
    }

    /// Reads tensor `name` (whose shape must be `shape`) as f32 into `out`.
    fn read(&self, name: &str, shape: &[usize], out: &mut [f32]) -> Result<()> {
        let &f = self.index.get(name).ok_or_else(|| anyhow!("{}: tensor {name} is missing", self.dir.display()))?;
        let st = self.files[f].tensors();
        let view = st.tensor(name)?;
        if view.shape() != shape {
            bail!(
                "{}: tensor {name} has shape {:?}, config.json implies {shape:?}",
                self.files[f].path.display(),
                view.shape()
            );
        }
        tensors::read_f32(name, &view, out)
    }

    /// Reads tensor `name` of unsigned bytes (MXFP4 blocks and scales), whose shape must be
    /// `shape`.
    fn read_u8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>> {
        let &f = self.index.get(name).ok_or_else(|| anyhow!("{}: tensor {name} is missing", self.dir.display()))?;
        let st = self.files[f].tensors();
        let view = st.tensor(name)?;
        if view.dtype() != safetensors::Dtype::U8 || view.shape() != shape {
            bail!(
                "{}: tensor {name} is {:?} {:?}; MXFP4 {} are U8 {shape:?}",
                self.files[f].path.display(),
                view.dtype(),
                view.shape(),
                if name.ends_with("_scales") { "scales" } else { "blocks" }
            );
        }
        Ok(view.data().to_vec())
    }

    /// A GPT-OSS layer's stacked experts under `prefix` (`model.layers.i.mlp.experts`): their
    /// weights in bf16 or f32, or in MXFP4 blocks and scales (decoded as transformers does).
    fn gpt_oss_experts(
        &self,
        prefix: &str,
        e: usize,
        (f, d): (usize, usize),
        used: &mut BTreeSet<String>,
    ) -> Result<gpt_oss::Stacked> {
        let [(gate_up, gu_shape), (gate_up_bias, gub_shape), (down, down_shape), (down_bias, db_shape)] =
            gpt_oss::names(prefix, e, f, d);
        // (name, [E, out, in] of the quantized form, values)
        let mut read = |name: &str, shape: &[usize], rows: usize, cols: usize| -> Result<Vec<f32>> {
            let blocks = format!("{name}_blocks");
            if self.index.contains_key(name) || !self.index.contains_key(&blocks) {
                let mut v = vec![0f32; shape.iter().product()];
                self.read(name, shape, &mut v)?;
                used.insert(name.to_owned());
                return Ok(v);
            }
            if !cols.is_multiple_of(32) {
                bail!(
                    "{}: {blocks}: MXFP4 blocks of 32 need an input width divisible by 32, not {cols}",
                    self.dir.display()
                );
            }
            let scales = format!("{name}_scales");
            let g = cols / 32;
            let b = self.read_u8(&blocks, &[e, rows, g, 16])?;
            let s = self.read_u8(&scales, &[e, rows, g])?;
            used.extend([blocks.clone(), scales]);
            gpt_oss::mxfp4_decode(&blocks, &b, &s, e, rows, g)
        };
        let gate_up = read(&gate_up, &gu_shape, 2 * f, d)?;
        let down = read(&down, &down_shape, d, f)?;
        let mut bias = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let mut v = vec![0f32; shape.iter().product()];
            self.read(name, shape, &mut v)?;
            used.insert(name.to_owned());
            Ok(v)
        };
        let gate_up_bias = bias(&gate_up_bias, &gub_shape)?;
        let down_bias = bias(&down_bias, &db_shape)?;
        Ok(gpt_oss::Stacked { gate_up, gate_up_bias, down, down_bias })
    }

    /// The parameters in the layout of `layout` (made from this model's config). Every tensor
    /// must be present with its shape, every tensor of the files must be used, and every value
    /// must be finite (a NaN or infinite weight is an error naming its tensor).
    pub fn params(&self, layout: &Layout) -> Result<Vec<f32>> {
        let m = &self.model;
        let mut out = vec![0f32; layout.len];
        let mut used = BTreeSet::new();
        // transformers 5's fused experts, when the files hold them instead of per-expert tensors.
        let mut fused_layers = BTreeSet::new();
        for (i, l) in layout.layers.iter().enumerate() {
            let MlpOffsets::Moe { experts, stride, .. } = l.mlp else { continue };
            if m.family == Family::GptOss {
                let (e, f, d) = (m.moe.as_ref().expect("MoE layout").num_experts, m.mlp_dim, m.d_model);
                let prefix = format!("model.layers.{i}.mlp.experts");
                let stacked = self.gpt_oss_experts(&prefix, e, (f, d), &mut used)?;
                gpt_oss::unstack(&stacked, e, (f, d), &mut out, experts, stride);
                fused_layers.insert(format!("{prefix}."));
                continue;
            }
            let gate_up = format!("model.layers.{i}.mlp.experts.gate_up_proj");
            if !self.index.contains_key(&gate_up) {
                continue;
            }
            let (e, f, d) = (m.moe.as_ref().expect("MoE layout").num_experts, m.mlp_dim, m.d_model);
            let down = format!("model.layers.{i}.mlp.experts.down_proj");
            let mut buf = vec![0f32; e * 2 * f * d];
            self.read(&gate_up, &[e, 2 * f, d], &mut buf)?;
            for x in 0..e {
                let at = experts + x * stride;
                out[at..at + 2 * f * d].copy_from_slice(&buf[x * 2 * f * d..(x + 1) * 2 * f * d]);
            }
            buf.truncate(e * d * f);
            self.read(&down, &[e, d, f], &mut buf)?;
            for x in 0..e {
                let at = experts + x * stride + 2 * f * d;
                out[at..at + d * f].copy_from_slice(&buf[x * d * f..(x + 1) * d * f]);
            }
            used.extend([gate_up, down]);
            fused_layers.insert(format!("model.layers.{i}.{}.experts.", ExpertNames::of(m.family).block));
        }
        for t in &layout.tensors {
            if fused_layers.iter().any(|p| t.name.starts_with(p.as_str())) {
                continue;
            }
            let stored = self.stored(&t.name);
            // The router is `block_sparse_moe.gate` in checkpoints, `mlp.gate` in transformers 5.
            let name = if self.index.contains_key(&stored) {
                stored.clone()
            } else {
                stored.replace(".block_sparse_moe.gate.", ".mlp.gate.")
            };
            let name = if self.index.contains_key(&name) { name } else { stored };
            // GPT-2: the original hub checkpoint names the body without `transformer.`.
            let name = match name.strip_prefix("transformer.") {
                Some(bare) if !self.index.contains_key(&name) && self.index.contains_key(bare) => bare.to_owned(),
                _ => name,
            };
            let dst = &mut out[t.offset..t.offset + t.len()];
            if conv1d(t) {
                let mut stored = vec![0f32; t.len()];
                self.read(&name, &[t.shape[1], t.shape[0]], &mut stored)?;
                transpose(&stored, t.shape[1], t.shape[0], dst);
            } else {
                self.read(&name, &t.shape, dst)?;
            }
            used.insert(name);
        }
        let buffer = |n: &str| m.is_gpt() && (n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias"));
        // A multimodal Gemma 3's vision tower and projector.
        let vision = |n: &str| self.text_prefix.is_some() && gemma3::is_vision(n);
        let head =
            |n: &str| n == "lm_head.weight" || self.text_prefix.is_some() && n == "language_model.lm_head.weight";
        let unexpected: Vec<&String> = (self.index.keys())
            .filter(|n| !used.contains(*n))
            .filter(|n| !(n.ends_with("rotary_emb.inv_freq") || m.tie_embeddings && head(n) || buffer(n) || vision(n)))
            .collect();
        // DeepSeek-V3's hub checkpoints hold their multi-token prediction module as the layers
        // past the last (`model.layers.61.*`), which transformers drops on load.
        let mtp = format!("model.layers.{}.", m.n_layers);
        if m.family == crate::config::Family::DeepseekV3
            && let Some(first) = unexpected.iter().find(|n| n.starts_with(&mtp))
        {
            bail!(
                "{}: {first} is a multi-token prediction layer (num_nextn_predict_layers), which the engine does not train; remove the model.layers.{}.* tensors to import the rest",
                self.dir.display(),
                m.n_layers
            );
        }
        if !unexpected.is_empty() {
            let shown: Vec<&str> = unexpected.iter().take(5).map(|s| s.as_str()).collect();
            bail!(
                "{}: {} tensor(s) that a {} with this config.json does not have: {}{}",
                self.dir.display(),
                unexpected.len(),
                config::ARCHITECTURES.iter().find(|a| a.1 == m.family).expect("known").0,
                shown.join(", "),
                if unexpected.len() > 5 { ", ..." } else { "" }
            );
        }
        if let Some(i) = out.iter().position(|x| !x.is_finite()) {
            let t = layout.tensors.iter().find(|t| i < t.offset + t.len()).expect("in a tensor");
            bail!("{}: tensor {} holds a non-finite weight (NaN or infinite)", self.dir.display(), t.name);
        }
        Ok(out)
    }

    /// The files that travel with the model ([`CARRIED`]), under `hf/`, and its dtype.
    pub fn extras(&self) -> Result<Extras> {
        let mut files = Vec::new();
        for name in CARRIED {
            let path = self.dir.join(name);
            if fs::symlink_metadata(&path).is_ok() {
                inside(&path, &self.root)?;
                files.push((
                    format!("hf/{name}"),
                    fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?,
                ));
            }
        }
        Ok(Extras { files, hf_dtype: Some(self.dtype.torch_name().into()) })
    }
}

/// The name a model's files give layout tensor `name`: itself, but in a multimodal Gemma 3
/// (`text_prefix`, [`gemma3::TEXT_PREFIXES`]) the text model's `model.X` is `{text_prefix}X`, and
/// an untied head `language_model.lm_head.weight` where the files (`has`) hold that.
fn stored_name(text_prefix: Option<&str>, name: &str, has: impl Fn(&str) -> bool) -> String {
    let Some(prefix) = text_prefix else { return name.to_owned() };
    match name.strip_prefix("model.") {
        Some(rest) => format!("{prefix}{rest}"),
        None if name == "lm_head.weight" && has("language_model.lm_head.weight") => {
            "language_model.lm_head.weight".into()
        }
        None => name.to_owned(),
    }
}

/// The directory that the files of model directory `dir` must lie in once symbolic links are
/// followed: `dir` itself, or, when `dir` is (or is under) a snapshot of a Hugging Face cache,
/// `…/models--ORG--NAME/snapshots/REV/`, whose files are relative links to
/// `../../blobs/HASH`, that repository's cache folder `…/models--ORG--NAME/` (the parent of a
/// `snapshots` directory beside a `blobs` one). Canonical, as [`fs::canonicalize`] gives it.
fn confinement(dir: &Path) -> Result<PathBuf> {
    let root = fs::canonicalize(dir).map_err(|e| anyhow!("cannot read {}: {e}", dir.display()))?;
    let repo = root
        .ancestors()
        .skip(1)
        .filter(|a| a.file_name().is_some_and(|n| n == "snapshots"))
        .filter_map(Path::parent)
        .find(|repo| repo.join("blobs").is_dir());
    Ok(repo.map_or(root.clone(), Path::to_path_buf))
}

/// Refuses a file of a model directory that is not a regular file inside `root` once symbolic
/// links are followed (a link to `/etc/passwd` would otherwise be copied into a checkpoint and
/// published again by export-hf).
fn inside(path: &Path, root: &Path) -> Result<()> {
    fsutil::regular_file_under(path, root)
        .map(|_| ())
        .map_err(|e| anyhow!("{e}; only files inside the model directory are read"))
}

/// Whether a layout tensor is one of GPT-2's `Conv1D` weights, stored `[in, out]` by Hugging Face.
fn conv1d(t: &Tensor) -> bool {
    t.name.starts_with("transformer.h.")
        && ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]
            .iter()
            .any(|s| t.name.ends_with(s))
}

/// `out[c, r] = x[r, c]` for `x` of `rows × cols`.
fn transpose(x: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c];
        }
    }
}

/// A layout tensor's values and shape as Hugging Face stores them: GPT-2's `Conv1D` weights
/// transposed to `[in, out]`, every other tensor as it is.
pub fn hf_tensor<'a>(t: &Tensor, values: &'a [f32]) -> (std::borrow::Cow<'a, [f32]>, Vec<usize>) {
    if conv1d(t) {
        let mut out = vec![0f32; values.len()];
        transpose(values, t.shape[0], t.shape[1], &mut out);
        (out.into(), vec![t.shape[1], t.shape[0]])
    } else {
        (values.into(), t.shape.clone())
    }
}

/// Tensors as a Hugging Face checkpoint stores them, in `tensors`' order: each by
/// [`hf_tensor`], but GPT-OSS's experts, which its checkpoints stack per layer
/// ([`gpt_oss::stack`]: four tensors in place of the layer's per-expert ones).
pub fn hf_tensors<'a>(
    m: &ModelConfig,
    layout: &Layout,
    tensors: &[&'a Tensor],
    values: &'a [f32],
) -> Vec<(String, std::borrow::Cow<'a, [f32]>, Vec<usize>)> {
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let stacked = (m.family == Family::GptOss)
            .then(|| layout.layers.iter().enumerate().find(|(_, l)| l.experts().is_some_and(|r| r.contains(&t.offset))))
            .flatten();
        if let Some((i, l)) = stacked {
            let MlpOffsets::Moe { experts, stride, .. } = l.mlp else { unreachable!("a layer with experts") };
            if t.offset == experts {
                let (e, f, d) = (layout.experts.len(), m.mlp_dim, m.d_model);
                let layer = layout.stage.layer_indices().nth(i).expect("a layer of the stage");
                let s = gpt_oss::stack(values, e, (f, d), experts, stride);
                let names = gpt_oss::names(&format!("model.layers.{layer}.mlp.experts"), e, f, d);
                let tensors = [s.gate_up, s.gate_up_bias, s.down, s.down_bias];
                out.extend(names.into_iter().zip(tensors).map(|((n, shape), v)| (n, v.into(), shape)));
            }
            continue;
        }
        let (v, shape) = hf_tensor(t, &values[t.offset..t.offset + t.len()]);
        out.push((t.name.clone(), v, shape));
    }
    out
}

/// A configuration holding `model`, with the training defaults and a sequence length the model
/// supports (what an imported checkpoint records).
pub fn engine_config(model: &ModelConfig, description: &str) -> Config {
    Config {
        description: description.into(),
        model: model.clone(),
        train: TrainConfig { seq_len: model.max_seq_len.min(2048), ..TrainConfig::default() },
        ..Config::default()
    }
}

/// What an import did.
#[derive(Debug)]
pub struct ImportReport {
    /// The model configuration read from `config.json`.
    pub model: ModelConfig,
    /// Parameters read.
    pub params: usize,
    /// The dtype of the weights read.
    pub dtype: FloatType,
}

/// `engine import-hf DIR --out CKPT`: writes the model as a checkpoint directory (no optimizer
/// state, step 0), carrying its config and tokenizer files for a later export.
pub fn import(dir: &Path, out: &Path) -> Result<ImportReport> {
    let hf = HfModel::open(dir)?;
    let layout = Layout::new(&hf.model);
    let params = hf.params(&layout)?;
    let config = engine_config(&hf.model, &format!("imported from {}", dir.display()));
    let snap = Snapshot { params, ..Snapshot::default() };
    checkpoint::write_dir(out, &config, &layout, &snap, &hf.extras()?, None)?;
    Ok(ImportReport { params: layout.len, model: hf.model, dtype: hf.dtype })
}

/// What an export wrote.
#[derive(Debug)]
pub struct ExportReport {
    /// The weight files, in order.
    pub files: Vec<String>,
    /// Their dtype.
    pub dtype: FloatType,
}

/// `engine export-hf CKPT --out DIR`: `config.json`, the weights (one `model.safetensors`, or
/// shards of at most `max_shard_bytes` with an index) and the carried files, written into a
/// temporary directory and renamed to `out`. `dtype` defaults to the imported model's, else f32.
pub fn export(ck: &Checkpoint, out: &Path, dtype: Option<FloatType>, max_shard_bytes: u64) -> Result<ExportReport> {
    if out.exists() && fs::read_dir(out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("--out {} already exists and is not empty; choose another directory", out.display());
    }
    let dtype = dtype.or_else(|| ck.state.hf_dtype.as_deref().and_then(FloatType::parse)).unwrap_or(FloatType::F32);
    let layout = Layout::new(&ck.config.model);
    let params = ck.params(&layout)?;
    let carried = ck.hf_files()?;
    let base: Option<Value> = carried
        .iter()
        .find(|(n, _)| n == "hf/config.json")
        .map(|(_, b)| serde_json::from_slice(b))
        .transpose()
        .context("the checkpoint's hf/config.json is not valid JSON")?;
    let config_json = config::write(&ck.config.model, base.as_ref(), dtype.torch_name())?;

    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let name = out.file_name().context("--out has no name")?.to_string_lossy();
    // What killed exports into this --out left behind.
    fsutil::remove_stale_temporaries(parent, &format!(".{name}.tmp-"))?;
    // A temporary directory no one can plant a link at: a random name, created new (mkdir does
    // not follow a link), this user's alone until complete, in a directory of its own or root's.
    fsutil::check_dir_owner(parent)?;
    let tmp = parent.join(format!(".{name}.tmp-{}-{:016x}", std::process::id(), fsutil::random_u64()));
    std::os::unix::fs::DirBuilderExt::mode(&mut fs::DirBuilder::new(), 0o700)
        .create(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = (|| -> Result<Vec<String>> {
        let width = if dtype == FloatType::F32 { 4 } else { 2 };
        let all: Vec<&Tensor> = layout.tensors.iter().collect();
        let stored = hf_tensors(&ck.config.model, &layout, &all, &params);
        let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
        let mut size = 0u64;
        for (k, (_, v, _)) in stored.iter().enumerate() {
            let bytes = (v.len() * width) as u64;
            if size > 0 && size + bytes > max_shard_bytes {
                shards.push(Vec::new());
                size = 0;
            }
            shards.last_mut().expect("one shard").push(k);
            size += bytes;
        }
        let n = shards.len();
        let mut names = Vec::new();
        let mut weight_map = serde_json::Map::new();
        for (i, shard) in shards.iter().enumerate() {
            let file = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", i + 1)
            };
            let list: Vec<(String, &[f32], Vec<usize>)> =
                shard.iter().map(|&k| (stored[k].0.clone(), &stored[k].1[..], stored[k].2.clone())).collect();
            tensors::write(&tmp.join(&file), &list, dtype)?;
            for &k in shard {
                weight_map.insert(stored[k].0.clone(), json!(file));
            }
            names.push(file);
        }
        if n > 1 {
            let total: usize = layout.tensors.iter().map(|t| t.len() * width).sum();
            let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            fsutil::write_atomic(
                &tmp.join("model.safetensors.index.json"),
                serde_json::to_string_pretty(&index)?.as_bytes(),
            )?;
        }
        fsutil::write_atomic(&tmp.join("config.json"), serde_json::to_string_pretty(&config_json)?.as_bytes())?;
        for (file, bytes) in &carried {
            let file = file.strip_prefix("hf/").expect("hf_files lists hf/ files");
            if file != "config.json" {
                fsutil::write_atomic(&tmp.join(file), bytes)?;
            }
        }
        fsutil::sync_dir(&tmp)?;
        let mode = 0o777 & !fsutil::umask();
        fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
        if out.exists() {
            fs::remove_dir(out)?;
        }
        fs::rename(&tmp, out)?;
        fsutil::sync_dir(parent)?;
        Ok(names)
    })();
    match result {
        Ok(files) => Ok(ExportReport { files, dtype }),
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(e.context(format!("cannot export to {}", out.display())))
        }
    }
}
