//! Evaluation of a model on the CPU reference backend (f32): the loss of token sequences, with
//! the logits and the gradients of the training objective on request ([`evaluate`]), and
//! LAMBADA's last-word accuracy ([`lambada`]).
//!
//! The loss is transformers' for `labels = input_ids`: the mean next-token cross-entropy over
//! all predicted positions (every position but the last of each sequence). For mixture-of-experts
//! models the load-balancing loss is Mixtral's, over all tokens of the batch and all layers, and
//! the gradient is that of `loss + router_aux_loss_coef · aux_loss`.
//!
//! With document masking ([`Loaded::mask_documents`], `engine eval --document-mask`) attention
//! stays within each EOS-ended document of a sequence, as in training with
//! `data.document_mask`; the loss is unchanged (every predicted position counts, an EOS
//! predicting the next document's first token).

pub mod lambada;

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::Serialize;

use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::data::shard::Shard;
use crate::hf::HfModel;
use crate::model::{Documents, Model, Plan};
pub use lambada::{LambadaResult, lambada};

/// A model's architecture and parameters, loaded from a checkpoint or a Hugging Face directory.
pub struct Loaded {
    /// The model's configuration and parameter layout.
    pub model: Model,
    /// Its parameters in layout order.
    pub params: Vec<f32>,
    /// Where it came from, for messages.
    pub source: String,
    /// The EOS id its `config.json` names (`eos_token_id`; the first of a list), if any.
    pub eos: Option<u32>,
}

impl Loaded {
    /// Loads an engine checkpoint (verified) or a Hugging Face model directory.
    pub fn open(checkpoint: Option<&Path>, hf: Option<&Path>) -> Result<Loaded> {
        match (checkpoint, hf) {
            (Some(dir), None) => {
                let ck = Checkpoint::open(dir)?;
                let model = Model::new(&ck.config.model);
                let params = ck.params(&model.layout)?;
                let eos = config_eos(&dir.join("hf"))?;
                Ok(Loaded { model, params, source: dir.display().to_string(), eos })
            }
            (None, Some(dir)) => {
                let hf = HfModel::open(dir)?;
                let model = Model::new(&hf.model);
                // Refuses a non-finite weight, naming its tensor.
                let params = hf.params(&model.layout)?;
                Ok(Loaded { model, params, source: dir.display().to_string(), eos: config_eos(dir)? })
            }
            _ => bail!("name the model with exactly one of --checkpoint CKPT and --hf DIR"),
        }
    }

    /// The model configuration the parameters belong to.
    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Masks attention at documents' ends (`--document-mask`): EOS id `eos`, else the one the
    /// model's `config.json` names; with `reset_positions`, positions restart at each document
    /// (learned positions only, as `data.reset_positions`).
    pub fn mask_documents(&mut self, eos: Option<u32>, reset_positions: bool) -> Result<()> {
        let Some(eos) = eos.or(self.eos) else {
            bail!("--document-mask needs --eos ID: the config.json of {} names no eos_token_id", self.source);
        };
        let v = self.config().vocab_size;
        if eos as usize >= v {
            bail!("--eos {eos} is outside the vocabulary of {v}");
        }
        if reset_positions && !self.config().is_gpt() {
            bail!(
                "--reset-positions is for learned positions (GPT models): RoPE's scores depend only on the distance between tokens, which the mask keeps within a document"
            );
        }
        self.model.documents = Some(Documents { eos, reset_positions });
        Ok(())
    }
}

/// `eos_token_id` of `dir/config.json` (the first of a list), if the file names one.
fn config_eos(dir: &Path) -> Result<Option<u32>> {
    let path = dir.join("config.json");
    let Ok(bytes) = std::fs::read(&path) else { return Ok(None) };
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{} is not JSON", path.display()))?;
    let id = match &json["eos_token_id"] {
        serde_json::Value::Array(ids) => ids.first().cloned().unwrap_or_default(),
        id => id.clone(),
    };
    Ok(id.as_u64().and_then(|id| u32::try_from(id).ok()))
}

/// Sequences of equal length, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// All tokens, `rows · seq`.
    pub tokens: Vec<u32>,
    /// Sequences.
    pub rows: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

/// Reads `FILE` of `--tokens`: a JSON array of equally long token-id arrays, or a token shard
/// cut into consecutive sequences of `seq_len` tokens (a last partial one is dropped).
pub fn read_tokens(path: &Path, seq_len: usize) -> Result<Batch> {
    let p = path.display();
    let mut magic = [0u8; 8];
    let is_shard = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .map(|()| &magic == crate::data::shard::MAGIC)
        .unwrap_or(false);
    if is_shard {
        let shard = Shard::open(path)?;
        let rows = shard.len() / seq_len;
        if rows == 0 {
            bail!("{p} holds {} tokens, fewer than one sequence of --seq-len {seq_len}", shard.len());
        }
        let mut tokens = vec![0; rows * seq_len];
        shard.read(0, &mut tokens);
        return Ok(Batch { tokens, rows, seq: seq_len });
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {p}"))?;
    let rows: Vec<Vec<u64>> = serde_json::from_slice(&bytes)
        .map_err(|e| anyhow!("{p} is neither a token shard nor a JSON array of token-id arrays: {e}"))?;
    let seq = rows.first().map_or(0, Vec::len);
    if rows.is_empty() || seq < 2 {
        bail!("{p}: give at least one sequence of at least two tokens");
    }
    if let Some(i) = rows.iter().position(|r| r.len() != seq) {
        bail!("{p}: sequence {i} has {} tokens, sequence 0 has {seq}; all must be equally long", rows[i].len());
    }
    let tokens = rows.iter().flatten().map(|&t| u32::try_from(t).unwrap_or(u32::MAX)).collect();
    Ok(Batch { tokens, rows: rows.len(), seq })
}

/// What `engine eval` prints.
#[derive(Debug, Clone, Serialize)]
pub struct EvalResult {
    /// Mean next-token cross-entropy over the predicted positions.
    pub loss: f64,
    /// Mixtral's load-balancing loss (mixture-of-experts models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Predicted positions: `sequences · (seq_len - 1)`.
    pub tokens: usize,
    /// Sequences.
    pub sequences: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
}

/// Logits and gradients, when asked for.
#[derive(Debug, Default)]
pub struct Dumps {
    /// `[rows, seq, vocab]`.
    pub logits: Option<Vec<f32>>,
    /// The gradient of the objective, in layout order.
    pub grads: Option<Vec<f32>>,
}

/// Evaluates `batch` in one pass (so that the load-balancing loss covers the whole batch, as in
/// transformers).
pub fn evaluate(m: &Loaded, batch: &Batch, want_logits: bool, want_grads: bool) -> Result<(EvalResult, Dumps)> {
    let c = m.config();
    let (rows, seq, v) = (batch.rows, batch.seq, c.vocab_size);
    if seq > c.max_seq_len {
        bail!("sequences of {seq} tokens are longer than the model's max_position_embeddings = {}", c.max_seq_len);
    }
    if let Some(i) = batch.tokens.iter().position(|&t| t as usize >= v) {
        bail!(
            "token {} (sequence {}, position {}) is outside the vocabulary of {v}",
            batch.tokens[i],
            i / seq,
            i % seq
        );
    }
    let mut cpu = Cpu::new();
    let plan = m.model.plan(&mut cpu, rows, seq);
    cpu.upload(plan.params, &m.params);
    // Targets: the next token; the last position of each sequence has none (masked below).
    let targets: Vec<u32> = (0..rows * seq).map(|i| if i % seq + 1 < seq { batch.tokens[i + 1] } else { 0 }).collect();
    cpu.upload_idx(plan.tokens, &batch.tokens);
    cpu.upload_idx(plan.targets, &targets);
    let predicted = rows * (seq - 1);

    m.model.forward(&mut cpu, &plan, None, &mut crate::model::Alone);
    let mut losses = vec![0f32; rows * seq];
    cpu.download(plan.losses, &mut losses);
    let loss = losses.iter().enumerate().filter(|(i, _)| i % seq + 1 < seq).map(|(_, &l)| l as f64).sum::<f64>()
        / predicted as f64;
    if !loss.is_finite() {
        bail!("the loss of {} on these tokens is {loss}: the model's outputs overflow", m.source);
    }
    let aux_loss = c.moe.as_ref().filter(|moe| moe.has_aux_loss()).map(|_| m.model.aux_loss(&mut cpu, &plan));
    let mut dumps = Dumps::default();
    if want_logits {
        let mut logits = vec![0f32; rows * seq * v];
        cpu.download(plan.logits, &mut logits);
        dumps.logits = Some(logits);
    }
    if want_grads {
        dumps.grads = Some(gradient(m, &mut cpu, &plan, seq, predicted));
    }
    let result =
        EvalResult { loss, aux_loss, perplexity: loss.exp(), tokens: predicted, sequences: rows, seq_len: seq };
    Ok((result, dumps))
}

/// The gradient of `mean cross-entropy + coef · aux` with respect to every parameter.
fn gradient(m: &Loaded, cpu: &mut Cpu, plan: &Plan, seq: usize, predicted: usize) -> Vec<f32> {
    let v = m.config().vocab_size;
    cpu.fill(plan.grads, 0.0);
    m.model.forward(cpu, plan, Some(1.0 / predicted as f32), &mut crate::model::Alone);
    // The logits now hold their gradient; the last position of each sequence predicts nothing.
    let mut dlogits = vec![0f32; plan.logits.len];
    cpu.download(plan.logits, &mut dlogits);
    for row in dlogits.chunks_exact_mut(v).skip(seq - 1).step_by(seq) {
        row.fill(0.0);
    }
    cpu.upload(plan.logits, &dlogits);
    let aux = m.model.aux_scale(plan, 1.0);
    m.model.backward(cpu, plan, aux, &mut crate::model::Alone);
    let mut grads = vec![0f32; plan.grads.len];
    cpu.download(plan.grads, &mut grads);
    grads
}

/// Writes the dumps as safetensors: `logits` `[rows, seq, vocab]`, and one tensor per parameter
/// under its Hugging Face name and in its Hugging Face shape (GPT-2's `Conv1D` transposed).
pub fn write_dumps(
    m: &Loaded,
    batch: &Batch,
    dumps: &Dumps,
    logits: Option<&Path>,
    grads: Option<&Path>,
) -> Result<()> {
    use crate::tensors::{FloatType, write};
    if let (Some(path), Some(l)) = (logits, &dumps.logits) {
        let shape = vec![batch.rows, batch.seq, m.config().vocab_size];
        write(path, &[("logits".into(), l.as_slice(), shape)], FloatType::F32)?;
    }
    if let (Some(path), Some(g)) = (grads, &dumps.grads) {
        // Parameters only: the buffers have no gradient in transformers.
        let tensors: Vec<_> = m.model.layout.tensors.iter().filter(|t| !t.is_buffer()).collect();
        let stored = crate::hf::hf_tensors(m.config(), &m.model.layout, &tensors, g);
        let list: Vec<(String, &[f32], Vec<usize>)> =
            stored.iter().map(|(name, v, shape)| (name.clone(), &v[..], shape.clone())).collect();
        write(path, &list, FloatType::F32)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Family;
    use crate::model::init;

    const EOS: u32 = 36;

    fn loaded(family: Family) -> Loaded {
        let config = ModelConfig {
            family,
            vocab_size: 37,
            d_model: 16,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: if family == Family::Gpt { 4 } else { 2 },
            head_dim: 6,
            mlp_dim: 24,
            max_seq_len: 64,
            init_std: 0.3,
            norm_eps: 1e-5,
            ..ModelConfig::default()
        };
        let model = Model::new(&config);
        let params = init::params(&model, 5);
        Loaded { model, params, source: "test".into(), eos: None }
    }

    /// `--document-mask`: the logits of a document packed behind another are those it has alone
    /// (within 1e-4), under RoPE (whose scores see only distances) and under learned positions
    /// restarted at each document; without the mask they are not.
    #[test]
    fn a_document_packed_behind_another_has_the_logits_it_has_alone() {
        let (first, second) = (vec![5, 7, 11, 2, EOS], vec![3, 8, 13, 21, 34, 1, 9]);
        let packed = Batch { tokens: [first.clone(), second.clone()].concat(), rows: 1, seq: 12 };
        let alone = Batch { tokens: second, rows: 1, seq: 7 };
        let logits = |m: &Loaded, b: &Batch| evaluate(m, b, true, false).unwrap().1.logits.unwrap();
        let v = 37;
        for (family, reset) in [(Family::Llama, false), (Family::Gpt, true)] {
            let mut m = loaded(family);
            let unmasked = logits(&m, &packed);
            m.mask_documents(Some(EOS), reset).unwrap();
            let (masked, want) = (logits(&m, &packed), logits(&m, &alone));
            let diff = |a: &[f32]| a.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(diff(&masked[first.len() * v..]) <= 1e-4, "{family:?}: {}", diff(&masked[first.len() * v..]));
            assert!(diff(&unmasked[first.len() * v..]) > 1e-2, "{family:?}: the mask changed nothing");
        }
    }

    /// A training run with `data.document_mask` (and reset positions) differs from one without
    /// at every step, on the same shard, seed and samples: the mask reaches the trainer's passes.
    #[test]
    fn a_training_run_with_the_mask_differs_from_one_without() {
        use crate::config::{Override, resolve};
        use crate::data::shard::ShardWriter;
        use crate::train::Trainer;
        let dir = std::env::temp_dir().join(format!("engine-document-mask-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shard = dir.join("shard-00000.tok");
        let mut w = ShardWriter::create(&shard, 64, 1).unwrap();
        for d in 0..200u32 {
            let doc: Vec<u32> = (0..3 + d % 17).map(|i| (d * 31 + i * 7) % 60 + 2).chain([1]).collect();
            w.push_document(&doc).unwrap();
        }
        w.finish().unwrap();
        let losses = |mask: bool| {
            let sets = format!(
                "model.vocab_size=64 train.seq_len=32 train.batch_size=2 data.source=shards data.path={} \
                 data.document_mask={mask} data.reset_positions={mask}",
                shard.display()
            );
            let config = resolve("tiny-gpt", &Override::from_list(&sets, "test")).unwrap().config;
            let mut t = Trainer::new(Cpu::new(), &config).unwrap();
            (0..3).map(|_| t.train_step(0.0).loss).collect::<Vec<_>>()
        };
        let (with, without) = (losses(true), losses(false));
        std::fs::remove_dir_all(&dir).ok();
        assert!(with.iter().zip(&without).all(|(a, b)| a != b), "masked {with:?}, unmasked {without:?}");
        assert!(with.iter().all(|l| l.is_finite()), "{with:?}");
    }

    #[test]
    fn document_masking_refuses_what_it_cannot_do_in_one_line() {
        let mut m = loaded(Family::Llama);
        let err = |r: Result<()>| r.unwrap_err().to_string();
        assert!(err(m.mask_documents(None, false)).starts_with("--document-mask needs --eos ID"));
        assert_eq!(err(m.mask_documents(Some(37), false)), "--eos 37 is outside the vocabulary of 37");
        assert!(err(m.mask_documents(Some(EOS), true)).starts_with("--reset-positions is for learned positions"));
        m.eos = Some(EOS);
        m.mask_documents(None, false).unwrap();
        assert_eq!(m.model.documents.map(|d| d.eos), Some(EOS));
    }
}
