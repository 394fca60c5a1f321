//! The training configuration: what a recipe says once defaults, `extends` and overrides are applied.
//!
//! Every key is documented in `docs/recipes.md`; the doc comments here are the short form of it.
//! A [`Config`] is plain data. [`recipe`] builds one from TOML layers and [`Config::validate`]
//! rejects what cannot train, naming the keys involved.

pub mod count;
pub mod recipe;

use serde::{Deserialize, Serialize};

pub use recipe::{Override, Resolved, resolve};

/// A full training configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// One line on what the recipe is for.
    pub description: String,
    /// A recipe this one starts from: a built-in name or a path relative to this file. Its keys
    /// apply first; this file's keys win.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extends: Option<String>,
    /// The model architecture.
    pub model: ModelConfig,
    /// Batch shape, length of the run and seeding.
    pub train: TrainConfig,
    /// AdamW and the learning-rate schedule.
    pub optim: OptimConfig,
    /// Where training tokens come from.
    pub data: DataConfig,
    /// How devices split the work: data, fsdp and tensor axes, within and across nodes.
    pub mesh: MeshConfig,
}

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

/// The transformer: a decoder-only stack of pre-norm attention and (SwiGLU or MoE) MLP blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Hugging Face architecture the tensors and config map to.
    pub family: Family,
    /// Number of token ids.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Number of query heads.
    pub n_heads: usize,
    /// Number of key/value heads; must divide `n_heads` (equal: MHA, 1: MQA).
    pub n_kv_heads: usize,
    /// Width of one attention head; independent of `d_model`.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU MLP (of each expert for MoE).
    pub mlp_dim: usize,
    /// RMSNorm epsilon (LayerNorm's for the GPT family).
    pub norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama 3.1 frequency scaling of RoPE; absent means none.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest sequence the model supports (`max_position_embeddings`).
    pub max_seq_len: usize,
    /// Sliding attention window W (query i sees keys j with i - W < j <= i); 0 means none.
    pub sliding_window: usize,
    /// Whether the output projection shares the input embedding matrix.
    pub tie_embeddings: bool,
    /// Standard deviation of the normal initialisation of weight matrices.
    pub init_std: f64,
    /// Mixture-of-experts MLP; absent means a dense SwiGLU MLP.
    pub moe: Option<MoeConfig>,
    /// The GELU of the GPT family's MLP (ignored by the other families); unwritten when tanh.
    #[serde(skip_serializing_if = "Gelu::is_tanh")]
    pub gelu: Gelu,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            family: Family::Llama,
            vocab_size: 0,
            d_model: 0,
            n_layers: 0,
            n_heads: 0,
            n_kv_heads: 0,
            head_dim: 0,
            mlp_dim: 0,
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_seq_len: 0,
            sliding_window: 0,
            tie_embeddings: false,
            init_std: 0.02,
            moe: None,
            gelu: Gelu::Tanh,
        }
    }
}

/// Llama 3.1 RoPE frequency scaling (`rope_type = "llama3"` in Hugging Face configs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RopeScaling {
    /// Divisor of the low frequencies.
    pub factor: f64,
    /// Wavelengths above `original_max_seq_len / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_seq_len / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// Context length the model was pre-trained with before scaling.
    pub original_max_seq_len: usize,
}

impl Default for RopeScaling {
    fn default() -> Self {
        RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_seq_len: 8192 }
    }
}

/// Mixtral-style mixture of experts: softmax over all experts, keep the top k, renormalise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MoeConfig {
    /// Number of experts per layer.
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Coefficient of the load-balancing auxiliary loss added to the objective.
    pub aux_loss_coef: f64,
}

impl Default for MoeConfig {
    fn default() -> Self {
        MoeConfig { num_experts: 8, top_k: 2, aux_loss_coef: 0.02 }
    }
}

/// `train.batch_size`: sequences per device per micro-batch, as Pax's `PERCORE_BATCH_SIZE`. The
/// global batch is `batch_size × devices` whatever the strategies; the devices of a tensor group
/// read their samples together, `batch_size × tensor` sequences, which must be a whole number:
/// with tensor parallelism 4, `batch_size = 0.25` gives each group one sequence.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
pub struct BatchSize(pub f64);

impl BatchSize {
    /// Sequences a group of `devices` devices that share their samples reads per micro-batch;
    /// an error with the arithmetic when that is not a whole number.
    pub fn sequences(self, devices: usize) -> Result<usize, String> {
        let n = self.0 * devices as f64;
        if n.fract() != 0.0 || n < 1.0 {
            return Err(format!(
                "train.batch_size = {self} x {devices} device(s) sharing their samples = {n} sequences: each data or \
                 FSDP group needs a whole number of sequences (the global batch is batch_size x devices)"
            ));
        }
        Ok(n as usize)
    }

    /// `sequences(devices)`, rounded up where it is not whole (for estimates).
    pub fn per_group(self, devices: usize) -> usize {
        (self.0 * devices as f64).ceil() as usize
    }
}

impl std::fmt::Display for BatchSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// `batch_size × n`: the same global batch on `n` times fewer devices.
impl std::ops::Mul<usize> for BatchSize {
    type Output = BatchSize;
    fn mul(self, n: usize) -> BatchSize {
        BatchSize(self.0 * n as f64)
    }
}

impl std::ops::MulAssign<usize> for BatchSize {
    fn mul_assign(&mut self, n: usize) {
        *self = *self * n;
    }
}

/// A whole batch size is written as an integer (`4`, as configurations always had it), a fraction
/// as a float.
impl Serialize for BatchSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.fract() == 0.0 && self.0.abs() < 9.0e15 {
            s.serialize_u64(self.0 as u64)
        } else {
            s.serialize_f64(self.0)
        }
    }
}

impl<'de> Deserialize<'de> for BatchSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        f64::deserialize(d).map(BatchSize)
    }
}

/// The shape of a step and the length of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per device per micro-batch (Pax's `PERCORE_BATCH_SIZE`), possibly a fraction
    /// when devices share samples: see [`BatchSize`].
    pub batch_size: BatchSize,
    /// Micro-batches accumulated into one optimizer step.
    pub grad_accum: usize,
    /// Optimizer steps to run.
    pub steps: usize,
    /// Seed of initialisation and data order.
    pub seed: u64,
    /// Peak TFLOP/s of one device used for MFU; 0 means the device table (GPU) or a measured
    /// GEMM rate (CPU).
    pub peak_tflops: f64,
    /// Steps left out of the run's performance summary (warm-up, compilation, profiling).
    pub perf_warmup_steps: usize,
    /// Step (1-based) whose per-op times are written as a Chrome trace; 0 disables profiling.
    pub profile_step: usize,
    /// Save a checkpoint every this many steps (and at the last step); 0 disables checkpoints.
    pub checkpoint_every: usize,
    /// Also save a checkpoint when this many minutes have passed since the run started or last
    /// saved, as rank 0's clock says (MaxText's and AXLearn's time-based cadence for long jobs);
    /// 0 disables it.
    pub checkpoint_every_minutes: f64,
    /// Complete checkpoints kept in the run directory (the oldest are removed); 0 keeps all.
    pub keep_last: usize,
    /// Checkpoints of steps that are multiples of this are kept for good, whatever `keep_last`
    /// says (AXLearn's `keep_every_n_steps`); 0 keeps none beyond `keep_last`.
    pub keep_every_n_steps: usize,
    /// Evaluate on the validation split every this many steps (and at the last step); 0 never.
    pub eval_every: usize,
    /// Batches of `batch_size` validation sequences one evaluation reads.
    pub eval_steps: usize,
    /// Activation recomputation: which activations the backward pass recomputes instead of
    /// keeping them from the forward pass.
    pub remat: Remat,
    /// Record each micro-batch's forward and backward pass once as a CUDA graph and replay it
    /// (CUDA only; ignored on CPU).
    pub cuda_graphs: bool,
    /// Which kernels run attention on a GPU (ignored on CPU).
    pub attention: AttentionImpl,
    /// Refuse, before allocating, a run whose estimated memory exceeds what the device has
    /// (GPU: free memory; CPU: available RAM and `ulimit -v`); `false` skips the check.
    pub memory_check: bool,
    /// Micro-batches each step's batch is split into for the pipeline (JaxPP's
    /// `num_pipeline_microbatches`): the sequences a pipeline reads per `grad_accum`
    /// micro-batch, `batch_size × tensor × pipeline`, must divide by it. 1 without stages.
    pub pipeline_microbatches: usize,
    /// The order in which pipeline stages run their micro-batches' passes.
    pub pipeline_schedule: PipelineSchedule,
    /// Virtual stages per pipeline device (Megatron-LM's interleaved 1F1B): device `d` of `P`
    /// holds the model chunks `d, d + P, d + 2P, …`, which cuts the bubble `V` times. More
    /// than 1 only with `pipeline_schedule = "interleaved"`.
    pub pipeline_virtual_stages: usize,
    /// Layers of each pipeline stage, first to last (one number per stage, each at least 1,
    /// summing to `model.n_layers`); empty: split automatically, balancing compute. An explicit
    /// split lets the stages that keep more micro-batches in flight hold fewer layers.
    pub pipeline_layers: Vec<usize>,
    /// How the layers are split into stages when `pipeline_layers` is empty.
    pub pipeline_split: PipelineSplit,
}

/// The automatic split of the layers into pipeline stages (`train.pipeline_split`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PipelineSplit {
    /// Balance each stage's compute (its layers, and the output head on the last).
    #[default]
    Compute,
    /// Make the fullest stage's estimated memory (on a GPU) as small as possible: the stages that
    /// keep more micro-batches in flight, and the first with the embedding, get fewer layers.
    Memory,
}

/// Pipeline schedule (`train.pipeline_schedule`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum PipelineSchedule {
    /// One forward, one backward: stage `s` of `P` runs `P − s − 1` forward passes ahead, then
    /// alternates, so at most `P − s` micro-batches are in flight on it.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Every forward pass, then every backward pass: all micro-batches in flight at once.
    #[serde(rename = "gpipe")]
    GPipe,
    /// Megatron-LM's interleaved 1F1B over `pipeline_virtual_stages` model chunks per device:
    /// the micro-batches go through the chunks in groups of `P`, and the bubble shrinks to
    /// `(P − 1) / (V·M + P − 1)`.
    #[serde(rename = "interleaved")]
    Interleaved,
}

impl PipelineSchedule {
    /// The schedule's usual name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            PipelineSchedule::OneFOneB => "1F1B",
            PipelineSchedule::GPipe => "GPipe",
            PipelineSchedule::Interleaved => "interleaved 1F1B",
        }
    }
}

/// The kernels that run attention on a GPU (`train.attention`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionImpl {
    /// cuDNN's fused flash attention where the library loads, is 9.2 or newer, builds plans for
    /// the model's shapes and passes a check against the CPU reference; else the native kernels,
    /// saying why.
    #[default]
    Auto,
    /// cuDNN's, or an error saying why not.
    Cudnn,
    /// The engine's own flash-attention kernels.
    Native,
}

/// Activation recomputation policy (`train.remat`): memory traded for compute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Remat {
    /// Keep every activation the backward pass reads.
    #[default]
    None,
    /// Recompute the cheap element-wise activations (both RMSNorm outputs and the SwiGLU output)
    /// from what is kept; one buffer of each serves all layers.
    Minimal,
    /// Keep only each layer's input; the backward pass runs the layer's forward pass again
    /// (about a third more matrix FLOPs, which MFU does not count).
    Full,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seq_len: 0,
            batch_size: BatchSize(1.0),
            grad_accum: 1,
            steps: 100,
            seed: 1234,
            peak_tflops: 0.0,
            perf_warmup_steps: 7,
            profile_step: 6,
            checkpoint_every: 0,
            checkpoint_every_minutes: 0.0,
            keep_last: 3,
            keep_every_n_steps: 0,
            eval_every: 0,
            eval_steps: 10,
            remat: Remat::None,
            cuda_graphs: true,
            attention: AttentionImpl::Auto,
            memory_check: true,
            pipeline_microbatches: 1,
            pipeline_schedule: PipelineSchedule::OneFOneB,
            pipeline_virtual_stages: 1,
            pipeline_layers: Vec::new(),
            pipeline_split: PipelineSplit::Compute,
        }
    }
}

/// Shape of the learning rate over the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Linear warmup, then cosine decay to `lr * min_lr_ratio` at `decay_steps`.
    #[default]
    Cosine,
    /// Linear warmup, then constant.
    Constant,
}

/// AdamW with decoupled weight decay and global-norm gradient clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Learning-rate schedule after warmup.
    pub schedule: Schedule,
    /// Steps of linear warmup from 0 to `lr`.
    pub warmup_steps: usize,
    /// Step at which the cosine reaches its floor; 0 means `train.steps`.
    pub decay_steps: usize,
    /// Floor of the cosine as a fraction of `lr`.
    pub min_lr_ratio: f64,
    /// Decay rate of the first moment.
    pub beta1: f64,
    /// Decay rate of the second moment.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay of matrices (embeddings and projections); norms never decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub grad_clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 3e-4,
            schedule: Schedule::Cosine,
            warmup_steps: 0,
            decay_steps: 0,
            min_lr_ratio: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
        }
    }
}

/// Where the training tokens come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The public-domain English text embedded in the binary, as byte tokens.
    #[default]
    Embedded,
    /// Uniformly random tokens from the seed.
    Synthetic,
    /// Token shards written by `engine data prepare` (`data.path`).
    Shards,
}

/// The training data.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Document masking: attention inside a packed sequence stops at each EOS (the id the
    /// shards record), so that a token attends only to its own document's (docs/data.md).
    pub document_mask: bool,
    /// With `document_mask`: positions restart at 0 at each document (the GPT family's learned
    /// positions).
    pub reset_positions: bool,
    /// Token source.
    pub source: DataSource,
    /// With `source = "shards"`: a directory of shards (read in name order) or one shard file.
    /// A relative path is relative to the working directory.
    pub path: String,
    /// With `source = "shards"`, in place of `path`: several prepared datasets, each sequence
    /// read from one of them in proportion to the weights ([`crate::data::mixture`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mixture: Vec<MixtureSource>,
    /// Prepared shards that `eval_loss` reads instead of a held-out tail of the training data
    /// (none is held out then). Empty: the tail.
    pub validation_path: String,
}

/// One dataset of a mixture (`[[data.mixture]]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixtureSource {
    /// A directory of shards or one shard file, as `data.path`.
    pub path: String,
    /// Its relative share of the training sequences: positive; the weights need not sum to 1.
    pub weight: f64,
    /// Its name in `tokens_by_source` and checkpoints; the path when unset.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
}

impl MixtureSource {
    /// The source's name: `name`, else its path.
    pub fn name(&self) -> &str {
        if self.name.is_empty() { &self.path } else { &self.name }
    }
}

/// The device mesh: five parallel axes (data, fsdp, tensor, pipeline, seq), each split into an
/// intra-node (`ici`) and an inter-node (`dcn`) size, as in MaxText, Pax and AXLearn. The `ici` sizes multiply to the
/// devices per node and the `dcn` sizes to the number of nodes; one size per group may be -1,
/// meaning "whatever fills it".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MeshConfig {
    /// Data parallelism within a node: replicas that all-reduce gradients.
    pub ici_data: i64,
    /// Fully sharded data parallelism within a node: parameters, gradients and optimizer state
    /// sharded, parameters gathered per layer.
    pub ici_fsdp: i64,
    /// Tensor parallelism within a node: attention heads, MLP columns and experts split.
    pub ici_tensor: i64,
    /// Data parallelism across nodes.
    pub dcn_data: i64,
    /// Fully sharded data parallelism across nodes.
    pub dcn_fsdp: i64,
    /// Tensor parallelism across nodes.
    pub dcn_tensor: i64,
    /// Pipeline stages within a node (AXLearn's `pipeline` axis): the layers are split into
    /// contiguous stages, each device holding one stage's parameters, gradients and moments.
    pub ici_pipeline: i64,
    /// Pipeline stages across nodes.
    pub dcn_pipeline: i64,
    /// Sequence (context) parallelism within a node (AXLearn's `seq` axis): each sequence is
    /// cut into two chunks per device, one early and one late (Llama 3's load-balanced causal
    /// split), and attention all-gathers the keys and values over the axis.
    pub ici_seq: i64,
    /// Sequence parallelism across nodes.
    pub dcn_seq: i64,
    /// FSDP: whether the forward pass releases each layer's gathered parameters once done with
    /// it (and the backward pass gathers them again), as FSDP2's `reshard_after_forward`. Off,
    /// the gathered parameters stay until the backward pass is done with them: one gather per
    /// unit and micro-batch instead of two, for the memory of the whole (tensor-local) model.
    pub fsdp_reshard_after_forward: bool,
    /// FSDP: whether the next unit's gather starts before the current unit computes, so that
    /// they overlap, at the memory of one more unit gathered at a time.
    pub fsdp_prefetch: bool,
}

impl Default for MeshConfig {
    fn default() -> Self {
        MeshConfig {
            ici_data: -1,
            ici_fsdp: 1,
            ici_tensor: 1,
            dcn_data: -1,
            dcn_fsdp: 1,
            dcn_tensor: 1,
            ici_pipeline: 1,
            dcn_pipeline: 1,
            ici_seq: 1,
            dcn_seq: 1,
            fsdp_reshard_after_forward: true,
            fsdp_prefetch: true,
        }
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

    /// Number of keys query `i` (0-based) attends to in a sequence.
    pub fn keys_attended(&self, i: usize) -> usize {
        match self.sliding_window {
            0 => i + 1,
            w => (i + 1).min(w),
        }
    }
}

impl Config {
    /// Checks everything a training run needs to be consistent; errors name the keys involved.
    pub fn validate(&self) -> Result<(), String> {
        let m = &self.model;
        let positive = [
            ("model.vocab_size", m.vocab_size),
            ("model.d_model", m.d_model),
            ("model.n_layers", m.n_layers),
            ("model.n_heads", m.n_heads),
            ("model.n_kv_heads", m.n_kv_heads),
            ("model.head_dim", m.head_dim),
            ("model.mlp_dim", m.mlp_dim),
            ("model.max_seq_len", m.max_seq_len),
            ("train.seq_len", self.train.seq_len),
            ("train.grad_accum", self.train.grad_accum),
            ("train.pipeline_microbatches", self.train.pipeline_microbatches),
            ("train.pipeline_virtual_stages", self.train.pipeline_virtual_stages),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(format!("{key} must be greater than 0"));
            }
        }
        // Bounds well past every published configuration, tight enough that no size computed from
        // them (parameters, bytes, activations, tokens per step) can overflow.
        let at_most = [
            ("model.vocab_size", m.vocab_size, 1 << 24),
            ("model.d_model", m.d_model, 1 << 17),
            ("model.n_layers", m.n_layers, 1 << 12),
            ("model.n_heads", m.n_heads, 1 << 12),
            ("model.head_dim", m.head_dim, 1 << 10),
            ("model.mlp_dim", m.mlp_dim, 1 << 20),
            ("model.max_seq_len", m.max_seq_len, 1 << 24),
            ("model.moe.num_experts", m.moe.as_ref().map_or(1, |e| e.num_experts), 1 << 10),
            ("train.grad_accum", self.train.grad_accum, 1 << 20),
            ("train.pipeline_microbatches", self.train.pipeline_microbatches, 1 << 16),
            ("train.pipeline_virtual_stages", self.train.pipeline_virtual_stages, 1 << 12),
        ];
        for (key, value, max) in at_most {
            if value > max {
                return Err(format!("{key} = {value} is more than this engine trains (at most {max})"));
            }
        }
        let (v, schedule) = (self.train.pipeline_virtual_stages, self.train.pipeline_schedule);
        if v > 1 && schedule != PipelineSchedule::Interleaved {
            return Err(format!(
                "train.pipeline_virtual_stages = {v} needs train.pipeline_schedule = \"interleaved\" (it is \"{}\")",
                schedule.name()
            ));
        }
        let layers = &self.train.pipeline_layers;
        if !layers.is_empty() {
            let list = format!("{layers:?}");
            if let Some(s) = layers.iter().position(|&k| k == 0) {
                return Err(format!(
                    "train.pipeline_layers = {list} gives stage {s} no layers (each stage holds at least one)"
                ));
            }
            // Saturating: absurd entries must not overflow before they are refused.
            let sum = layers.iter().fold(0usize, |a, &k| a.saturating_add(k));
            if sum != m.n_layers {
                return Err(format!(
                    "train.pipeline_layers = {list} sums to {sum} layers, but model.n_layers = {}",
                    m.n_layers
                ));
            }
        }
        let batch = self.train.batch_size.0;
        if !(batch > 0.0 && batch.is_finite()) {
            return Err(format!("train.batch_size = {batch} must be a positive number"));
        }
        if batch > (1 << 20) as f64 {
            return Err(format!("train.batch_size = {batch} is more than this engine trains (at most {})", 1 << 20));
        }
        let tokens = (batch * self.train.seq_len as f64).ceil() as u64;
        if tokens > 1 << 26 {
            return Err(format!(
                "train.batch_size x train.seq_len = {} x {} = {tokens} tokens per device and micro-batch, more than this engine trains (at most {}); raise train.grad_accum instead",
                self.train.batch_size,
                self.train.seq_len,
                1u64 << 26
            ));
        }
        if !m.n_heads.is_multiple_of(m.n_kv_heads) {
            return Err(format!(
                "model.n_heads = {} is not divisible by model.n_kv_heads = {} (grouped-query attention \
                 shares each key/value head among n_heads / n_kv_heads query heads)",
                m.n_heads, m.n_kv_heads
            ));
        }
        if !m.head_dim.is_multiple_of(2) {
            return Err(format!("model.head_dim = {} must be even (RoPE rotates pairs of dimensions)", m.head_dim));
        }
        if self.train.seq_len > m.max_seq_len {
            return Err(format!(
                "train.seq_len = {} is longer than model.max_seq_len = {}",
                self.train.seq_len, m.max_seq_len
            ));
        }
        let finite_positive =
            [("model.norm_eps", m.norm_eps), ("model.rope_theta", m.rope_theta), ("model.init_std", m.init_std)];
        for (key, value) in finite_positive {
            if !positive_number(value) {
                return Err(format!("{key} = {value} must be a positive number"));
            }
        }
        if let Some(s) = &m.rope_scaling {
            if !at_least(s.factor, 1.0) {
                return Err(format!("model.rope_scaling.factor = {} must be at least 1", s.factor));
            }
            if !(positive_number(s.low_freq_factor) && s.high_freq_factor > s.low_freq_factor) {
                return Err(format!(
                    "model.rope_scaling.high_freq_factor = {} must be greater than model.rope_scaling.low_freq_factor = {} (and both positive)",
                    s.high_freq_factor, s.low_freq_factor
                ));
            }
            if s.original_max_seq_len == 0 {
                return Err("model.rope_scaling.original_max_seq_len must be greater than 0".into());
            }
        }
        let d = &self.data;
        if d.reset_positions && !d.document_mask {
            return Err(
                "data.reset_positions = true needs data.document_mask = true (positions restart at each document)"
                    .into(),
            );
        }
        if d.document_mask {
            if d.source != DataSource::Shards {
                return Err("data.document_mask = true needs an EOS id, which only prepared shards record; set data.source = \"shards\"".into());
            }
            if self.mesh.ici_seq != 1 || self.mesh.dcn_seq != 1 {
                return Err(format!(
                    "data.document_mask = true with mesh.ici_seq = {} and mesh.dcn_seq = {}: document masking does not take the sequence axis's chunks yet; set both to 1",
                    self.mesh.ici_seq, self.mesh.dcn_seq
                ));
            }
            if d.reset_positions && !m.is_gpt() {
                return Err("data.reset_positions = true is for learned positions (model.family = \"gpt\"): RoPE's scores depend only on the distance between tokens, which the mask keeps within a document".into());
            }
        }
        match (m.family, &m.moe) {
            (Family::Mixtral, None) => {
                return Err("model.family = \"mixtral\" needs a [model.moe] table (num_experts, top_k)".into());
            }
            (Family::Llama | Family::Mistral | Family::Gpt, Some(_)) => {
                return Err(format!(
                    "model.moe is set but model.family = \"{}\"; mixture-of-experts models use model.family = \"mixtral\"",
                    match m.family {
                        Family::Llama => "llama",
                        Family::Mistral => "mistral",
                        _ => "gpt",
                    }
                ));
            }
            _ => {}
        }
        if m.family == Family::Llama && m.sliding_window != 0 {
            return Err(
                "model.sliding_window is set but model.family = \"llama\" has no sliding window; use model.family = \"mistral\""
                    .into(),
            );
        }
        if m.is_gpt() {
            if m.sliding_window != 0 {
                return Err("model.sliding_window is set but model.family = \"gpt\" has no sliding window".into());
            }
            if m.rope_scaling.is_some() {
                return Err(
                    "model.rope_scaling is set but model.family = \"gpt\" has learned positions, no RoPE".into()
                );
            }
            if m.n_kv_heads != m.n_heads {
                return Err(format!(
                    "model.family = \"gpt\" has multi-head attention: model.n_kv_heads = {} must equal model.n_heads = {}",
                    m.n_kv_heads, m.n_heads
                ));
            }
            let tensor = |v: i64| v != 1;
            if tensor(self.mesh.ici_tensor) || tensor(self.mesh.dcn_tensor) {
                return Err(format!(
                    "mesh.ici_tensor = {} and mesh.dcn_tensor = {}: model.family = \"gpt\" trains with data and FSDP \
                     parallelism only (its biases are not split); set both to 1",
                    self.mesh.ici_tensor, self.mesh.dcn_tensor
                ));
            }
        }
        if let Some(moe) = &m.moe {
            if moe.num_experts == 0 || moe.top_k == 0 {
                return Err("model.moe.num_experts and model.moe.top_k must be greater than 0".into());
            }
            if moe.top_k > moe.num_experts {
                return Err(format!(
                    "model.moe.top_k = {} is larger than model.moe.num_experts = {}",
                    moe.top_k, moe.num_experts
                ));
            }
            if !at_least(moe.aux_loss_coef, 0.0) {
                return Err(format!("model.moe.aux_loss_coef = {} must be a non-negative number", moe.aux_loss_coef));
            }
        }
        let params = m.param_count().total;
        if params > 1 << 44 {
            return Err(format!(
                "the model has {params} parameters, more than this engine trains (at most {} = 2^44)",
                1u64 << 44
            ));
        }
        let o = &self.optim;
        if !at_least(o.lr, 0.0) {
            return Err(format!("optim.lr = {} must be a non-negative number", o.lr));
        }
        if !(0.0..1.0).contains(&o.beta1) || !(0.0..1.0).contains(&o.beta2) {
            return Err(format!("optim.beta1 = {} and optim.beta2 = {} must lie in [0, 1)", o.beta1, o.beta2));
        }
        if !positive_number(o.eps) {
            return Err(format!("optim.eps = {} must be positive", o.eps));
        }
        if !at_least(o.weight_decay, 0.0) || !at_least(o.grad_clip, 0.0) {
            return Err("optim.weight_decay and optim.grad_clip must be non-negative".into());
        }
        if !(0.0..=1.0).contains(&o.min_lr_ratio) {
            return Err(format!("optim.min_lr_ratio = {} must lie in [0, 1]", o.min_lr_ratio));
        }
        self.data.check_mixture()?;
        match (self.data.source, self.data.path.is_empty() && self.data.mixture.is_empty()) {
            (DataSource::Shards, true) => {
                return Err(
                    "data.source = \"shards\" needs data.path (a directory written by `engine data prepare`) or [[data.mixture]] entries".into()
                );
            }
            (DataSource::Embedded | DataSource::Synthetic, false) => {
                return Err("data.path is set but data.source is not \"shards\"; set data.source = \"shards\"".into());
            }
            _ => {}
        }
        if self.train.eval_every > 0 && self.train.eval_steps == 0 {
            return Err("train.eval_every is set but train.eval_steps = 0; evaluate at least one batch".into());
        }
        if !at_least(self.train.peak_tflops, 0.0) {
            return Err(format!("train.peak_tflops = {} must be non-negative", self.train.peak_tflops));
        }
        if !at_least(self.train.checkpoint_every_minutes, 0.0) {
            return Err(format!(
                "train.checkpoint_every_minutes = {} must be non-negative (0: no time-based checkpoints)",
                self.train.checkpoint_every_minutes
            ));
        }
        Ok(())
    }
}

impl DataConfig {
    /// A mixture's entries: each with a path and a positive weight, names unique, in place of
    /// `data.path` and with shards only.
    fn check_mixture(&self) -> Result<(), String> {
        if self.mixture.is_empty() {
            return Ok(());
        }
        if !self.path.is_empty() {
            return Err(format!(
                "data.path = {} and data.mixture are both set; a run reads data.path or the mixture's datasets, not both",
                self.path
            ));
        }
        if self.source != DataSource::Shards {
            return Err("data.mixture is set but data.source is not \"shards\"; set data.source = \"shards\"".into());
        }
        for (i, m) in self.mixture.iter().enumerate() {
            if m.path.is_empty() {
                return Err(format!(
                    "data.mixture[{i}].path is empty; name a directory written by `engine data prepare`"
                ));
            }
            if !positive_number(m.weight) {
                return Err(format!(
                    "data.mixture[{i}].weight = {} ({}) must be a positive number",
                    m.weight,
                    m.name()
                ));
            }
            if let Some(j) = self.mixture[..i].iter().position(|o| o.name() == m.name()) {
                return Err(format!(
                    "data.mixture[{j}] and data.mixture[{i}] are both named {}; give one a distinct `name`",
                    m.name()
                ));
            }
        }
        Ok(())
    }
}

/// Finite and greater than zero (false for NaN).
fn positive_number(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Finite and at least `min` (false for NaN).
fn at_least(x: f64, min: f64) -> bool {
    x.is_finite() && x >= min
}
