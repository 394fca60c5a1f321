//! The training configuration: what a recipe says once defaults, `extends` and overrides are applied.
//!
//! Every key is documented in `docs/recipes.md`; the doc comments here are the short form of it.
//! A [`Config`] is plain data. [`recipe`] builds one from TOML layers and [`Config::validate`]
//! rejects what cannot train, naming the keys involved.
//!
//! A key is defined in one place, its field: each section is declared with `section!`, which
//! keeps a field's doc, its default and whether a resumed run may change it together, and
//! validates itself beside its struct. A unit test holds docs/recipes.md's tables to the fields.

pub mod count;
pub mod flat;
pub mod recipe;

use anyhow::{Result, anyhow, bail};
use serde::{Deserialize, Serialize};

pub use recipe::{Origin, Override, Resolved, resolve};

/// One key of a configuration section, as its field declares it.
#[derive(Debug, Clone, Copy)]
pub struct Key {
    /// The field's name (the key within its section).
    pub name: &'static str,
    /// Whether a resumed run may give it another value than the checkpoint's: it does not
    /// change what the next step computes (a run control, where the data lives, how the same
    /// global batch is cut over devices). The others must match (`checkpoint/resume.rs`).
    pub resumable: bool,
    /// Its default as TOML (`None` for an absent optional key), for the test that holds
    /// docs/recipes.md to the code.
    pub default: fn() -> Option<toml::Value>,
}

/// Declares a configuration section: the struct, its `Default` from the defaults written beside
/// the fields (`pub name: Type = default,`), and its [`Key`]s (`SECTION::KEYS`). `@resumable`
/// before a field marks a key that a resumed run may change ([`Config::resumable`]).
macro_rules! section {
    (@resumable resumable) => { true };
    (@resumable) => { false };
    (
        $(#[$attr:meta])*
        pub struct $name:ident {
            $(
                $(#[$field_attr:meta])*
                $(@$flag:ident)?
                pub $field:ident: $ty:ty = $default:expr
            ),* $(,)?
        }
    ) => {
        $(#[$attr])*
        pub struct $name {
            $($(#[$field_attr])* pub $field: $ty,)*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $($field: $default,)* }
            }
        }

        impl $name {
            /// This section's keys, in the order of its fields.
            pub const KEYS: &'static [Key] = &[$(Key {
                name: stringify!($field),
                resumable: section!(@resumable $($flag)?),
                default: || toml::Value::try_from(<$name as Default>::default().$field).ok(),
            },)*];
        }
    };
}

/// Every section's keys by the section's dotted name (`""`: the top level).
pub const SECTIONS: [(&str, &[Key]); 10] = [
    ("", Config::KEYS),
    ("model", ModelConfig::KEYS),
    ("model.rope_scaling", RopeScaling::KEYS),
    ("model.moe", MoeConfig::KEYS),
    ("train", TrainConfig::KEYS),
    ("train.fp8", Fp8Config::KEYS),
    ("train.diagnostics", DiagnosticsConfig::KEYS),
    ("optim", OptimConfig::KEYS),
    ("data", DataConfig::KEYS),
    ("mesh", MeshConfig::KEYS),
];

section! {
    /// A full training configuration.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct Config {
        /// One line on what the recipe is for.
        @resumable
        pub description: String = String::new(),
        /// A recipe this one starts from: a built-in name or a path relative to this file. Its keys
        /// apply first; this file's keys win.
        #[serde(skip_serializing_if = "Option::is_none")]
        @resumable
        pub extends: Option<String> = None,
        /// The model architecture.
        pub model: ModelConfig = ModelConfig::default(),
        /// Batch shape, length of the run and seeding.
        pub train: TrainConfig = TrainConfig::default(),
        /// AdamW and the learning-rate schedule.
        pub optim: OptimConfig = OptimConfig::default(),
        /// Where training tokens come from.
        pub data: DataConfig = DataConfig::default(),
        /// How devices split the work: data, fsdp and tensor axes, within and across nodes.
        pub mesh: MeshConfig = MeshConfig::default(),
    }
}

impl Config {
    /// Checks everything a training run needs to be consistent, section by section; errors name
    /// the keys involved.
    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.train.validate(&self.model)?;
        self.optim.validate()?;
        // The mesh's sizes are checked against the devices and the model when a run starts
        // (`parallel/mesh.rs`): the tensor axis splits every family, GPT's biases included.
        self.data.validate(&self.model)
    }

    /// Whether a resumed run may change the dotted `key` (`train.steps`): whether its field is
    /// declared `@resumable`. An unknown key is not.
    pub fn resumable(key: &str) -> bool {
        let (section, name) = key.rsplit_once('.').unwrap_or(("", key));
        SECTIONS.iter().any(|(s, keys)| *s == section && keys.iter().any(|k| k.name == name && k.resumable))
    }
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
    /// `Qwen3ForCausalLM`: Llama's block with QK-norm (an RMSNorm over each query and key head,
    /// before RoPE: `self_attn.q_norm`, `self_attn.k_norm`).
    Qwen3,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention with a mixture-of-experts MLP (`mlp.gate`,
    /// `mlp.experts.E.{gate,up,down}_proj`).
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
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
        }
    }

    /// Whether its MLP is a mixture of experts (`[model.moe]`).
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Mixtral | Family::Qwen3Moe)
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
        /// RoPE base.
        pub rope_theta: f64 = 10_000.0,
        /// Llama 3.1 frequency scaling of RoPE; absent means none.
        pub rope_scaling: Option<RopeScaling> = None,
        /// Longest sequence the model supports (`max_position_embeddings`).
        pub max_seq_len: usize = 0,
        /// Sliding attention window W (query i sees keys j with i - W < j <= i); 0 means none.
        pub sliding_window: usize = 0,
        /// Whether the output projection shares the input embedding matrix.
        pub tie_embeddings: bool = false,
        /// Standard deviation of the normal initialisation of weight matrices.
        pub init_std: f64 = 0.02,
        /// Mixture-of-experts MLP; absent means a dense SwiGLU MLP.
        pub moe: Option<MoeConfig> = None,
        /// The GELU of the GPT family's MLP (ignored by the other families); unwritten when tanh.
        #[serde(skip_serializing_if = "Gelu::is_tanh")]
        pub gelu: Gelu = Gelu::Tanh,
    }
}

impl ModelConfig {
    /// The model's own consistency: sizes, the family's features, the experts.
    fn validate(&self) -> Result<()> {
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
        match (self.family.is_moe(), &self.moe) {
            (true, None) => {
                bail!("model.family = \"{}\" needs a [model.moe] table (num_experts, top_k)", self.family.name());
            }
            (false, Some(_)) => {
                bail!(
                    "model.moe is set but model.family = \"{}\"; mixture-of-experts models use model.family = \"mixtral\" or \"qwen3_moe\"",
                    self.family.name()
                );
            }
            _ => {}
        }
        if matches!(self.family, Family::Llama | Family::Qwen3 | Family::Qwen3Moe) && self.sliding_window != 0 {
            bail!(
                "model.sliding_window is set but model.family = \"{}\" has no sliding window; use model.family = \"mistral\"",
                self.family.name()
            );
        }
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
            moe.validate()?;
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

section! {
    /// A mixture of experts, Mixtral's and Qwen3-MoE's routing: softmax over all experts, keep the
    /// top k, renormalise (or not).
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
    }
}

impl MoeConfig {
    fn validate(&self) -> Result<()> {
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
    pub fn sequences(self, devices: usize) -> Result<usize> {
        let n = self.0 * devices as f64;
        if n.fract() != 0.0 || n < 1.0 {
            bail!(
                "train.batch_size = {self} x {devices} device(s) sharing their samples = {n} sequences: each data or \
                 FSDP group needs a whole number of sequences (the global batch is batch_size x devices)"
            );
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

section! {
    /// The shape of a step and the length of the run.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct TrainConfig {
        /// Tokens per sequence.
        pub seq_len: usize = 0,
        /// Sequences per device per micro-batch (Pax's `PERCORE_BATCH_SIZE`), possibly a fraction
        /// when devices share samples: see [`BatchSize`].
        pub batch_size: BatchSize = BatchSize(1.0),
        /// Micro-batches accumulated into one optimizer step.
        pub grad_accum: usize = 1,
        /// Optimizer steps to run. A resumed run may move the end (and with it a cosine schedule
        /// whose `optim.decay_steps` is 0).
        @resumable
        pub steps: usize = 100,
        /// Seed of initialisation and data order.
        pub seed: u64 = 1234,
        /// Peak TFLOP/s of one device used for MFU; 0 means the device table (GPU) or a measured
        /// GEMM rate (CPU).
        @resumable
        pub peak_tflops: f64 = 0.0,
        /// Steps left out of the run's performance summary (warm-up, compilation, profiling).
        @resumable
        pub perf_warmup_steps: usize = 7,
        /// Step (1-based) whose per-op times are written as a Chrome trace; 0 disables profiling.
        @resumable
        pub profile_step: usize = 6,
        /// Save a checkpoint every this many steps (and at the last step); 0 disables checkpoints.
        @resumable
        pub checkpoint_every: usize = 0,
        /// Also save a checkpoint when this many minutes have passed since the run started or last
        /// saved, as rank 0's clock says (MaxText's and AXLearn's time-based cadence for long jobs);
        /// 0 disables it.
        @resumable
        pub checkpoint_every_minutes: f64 = 0.0,
        /// Save each rank's part to the node-local tier every this many steps
        /// (`train/local_tier.rs`), in the background (`train/local_saver.rs`: the step loop
        /// pays the copy to the host and the exchange): sealed, replicated to a peer rank,
        /// restored by `--resume=auto` when newer than the persistent tier; 0 disables it.
        @resumable
        pub local_checkpoint_every: usize = 0,
        /// Directory of the local tier on each node; empty: `/dev/shm/engine-local-HASH`, keyed
        /// by the run directory's canonical path.
        @resumable
        pub local_checkpoint_dir: String = String::new(),
        /// Complete checkpoints kept in the run directory (the oldest are removed); 0 keeps all.
        @resumable
        pub keep_last: usize = 3,
        /// Checkpoints of steps that are multiples of this are kept for good, whatever `keep_last`
        /// says (AXLearn's `keep_every_n_steps`); 0 keeps none beyond `keep_last`.
        @resumable
        pub keep_every_n_steps: usize = 0,
        /// Evaluate on the validation split every this many steps (and at the last step); 0 never.
        @resumable
        pub eval_every: usize = 0,
        /// Batches of `batch_size` validation sequences one evaluation reads.
        @resumable
        pub eval_steps: usize = 10,
        /// Activation recomputation: which activations the backward pass recomputes instead of
        /// keeping them from the forward pass.
        pub remat: Remat = Remat::None,
        /// Record each micro-batch's forward and backward pass once as a CUDA graph and replay it
        /// (CUDA only; ignored on CPU).
        pub cuda_graphs: bool = true,
        /// Which kernels run attention on a GPU (ignored on CPU).
        pub attention: AttentionImpl = AttentionImpl::Auto,
        /// The operands of the decoder's linear layers: `"bf16"` (on the CPU reference, f32) or
        /// `"fp8"` (E4M3 activations and weights, E5M2 gradients, scaled per `[train.fp8]`). A
        /// resumed run may switch: the master weights stay f32 either way.
        @resumable
        pub precision: Precision = Precision::Bf16,
        /// How FP8 products are scaled, and which products are FP8 (`precision = "fp8"`); its
        /// keys say themselves whether a resumed run may change them (all may).
        pub fp8: Fp8Config = Fp8Config::default(),
        /// What a job keeps to explain its failures and slow ranks: the flight recorder of
        /// collectives and the straggler detector; its keys say themselves whether a resumed run
        /// may change them (all may).
        pub diagnostics: DiagnosticsConfig = DiagnosticsConfig::default(),
        /// Refuse, before allocating, a run whose estimated memory exceeds what the device has
        /// (GPU: free memory; CPU: available RAM and `ulimit -v`); `false` skips the check.
        @resumable
        pub memory_check: bool = true,
        /// Micro-batches each step's batch is split into for the pipeline (JaxPP's
        /// `num_pipeline_microbatches`): the sequences a pipeline reads per `grad_accum`
        /// micro-batch, `batch_size × tensor × pipeline`, must divide by it. 1 without stages.
        /// This and the other pipeline keys may change on resuming: they cut the same global
        /// batch differently (a pipeline run resumes on one device).
        @resumable
        pub pipeline_microbatches: usize = 1,
        /// The order in which pipeline stages run their micro-batches' passes.
        @resumable
        pub pipeline_schedule: PipelineSchedule = PipelineSchedule::OneFOneB,
        /// Virtual stages per pipeline device (Megatron-LM's interleaved 1F1B): device `d` of `P`
        /// holds the model chunks `d, d + P, d + 2P, …`, which cuts the bubble `V` times. More
        /// than 1 only with `pipeline_schedule = "interleaved"`.
        @resumable
        pub pipeline_virtual_stages: usize = 1,
        /// Layers of each pipeline stage, first to last (one number per stage, each at least 1,
        /// summing to `model.n_layers`); empty: split automatically, balancing compute. An explicit
        /// split lets the stages that keep more micro-batches in flight hold fewer layers.
        @resumable
        pub pipeline_layers: Vec<usize> = Vec::new(),
        /// How the layers are split into stages when `pipeline_layers` is empty.
        @resumable
        pub pipeline_split: PipelineSplit = PipelineSplit::Compute,
    }
}

impl TrainConfig {
    /// The step's shape and the run's controls, against the model they train.
    fn validate(&self, model: &ModelConfig) -> Result<()> {
        let positive = [
            ("train.seq_len", self.seq_len),
            ("train.grad_accum", self.grad_accum),
            ("train.pipeline_microbatches", self.pipeline_microbatches),
            ("train.pipeline_virtual_stages", self.pipeline_virtual_stages),
        ];
        check_positive(&positive)?;
        self.fp8.validate()?;
        self.diagnostics.validate()?;
        let at_most = [
            ("train.grad_accum", self.grad_accum, 1 << 20),
            ("train.pipeline_microbatches", self.pipeline_microbatches, 1 << 16),
            ("train.pipeline_virtual_stages", self.pipeline_virtual_stages, 1 << 12),
        ];
        check_at_most(&at_most)?;
        let (v, schedule) = (self.pipeline_virtual_stages, self.pipeline_schedule);
        if v > 1 && schedule != PipelineSchedule::Interleaved {
            bail!(
                "train.pipeline_virtual_stages = {v} needs train.pipeline_schedule = \"interleaved\" (it is \"{}\")",
                schedule.name()
            );
        }
        let layers = &self.pipeline_layers;
        if !layers.is_empty() {
            let list = format!("{layers:?}");
            if let Some(s) = layers.iter().position(|&k| k == 0) {
                bail!("train.pipeline_layers = {list} gives stage {s} no layers (each stage holds at least one)");
            }
            // Saturating: absurd entries must not overflow before they are refused.
            let sum = layers.iter().fold(0usize, |a, &k| a.saturating_add(k));
            if sum != model.n_layers {
                bail!("train.pipeline_layers = {list} sums to {sum} layers, but model.n_layers = {}", model.n_layers);
            }
        }
        let batch = self.batch_size.0;
        if !(batch > 0.0 && batch.is_finite()) {
            bail!("train.batch_size = {batch} must be a positive number");
        }
        if batch > (1 << 20) as f64 {
            bail!("train.batch_size = {batch} is more than this engine trains (at most {})", 1 << 20);
        }
        let tokens = (batch * self.seq_len as f64).ceil() as u64;
        if tokens > 1 << 26 {
            bail!(
                "train.batch_size x train.seq_len = {} x {} = {tokens} tokens per device and micro-batch, more than this engine trains (at most {}); raise train.grad_accum instead",
                self.batch_size,
                self.seq_len,
                1u64 << 26
            );
        }
        if self.seq_len > model.max_seq_len {
            bail!("train.seq_len = {} is longer than model.max_seq_len = {}", self.seq_len, model.max_seq_len);
        }
        if self.eval_every > 0 && self.eval_steps == 0 {
            bail!("train.eval_every is set but train.eval_steps = 0; evaluate at least one batch");
        }
        if !at_least(self.peak_tflops, 0.0) {
            bail!("train.peak_tflops = {} must be non-negative", self.peak_tflops);
        }
        if !at_least(self.checkpoint_every_minutes, 0.0) {
            bail!(
                "train.checkpoint_every_minutes = {} must be non-negative (0: no time-based checkpoints)",
                self.checkpoint_every_minutes
            );
        }
        Ok(())
    }
}

/// The operands of the decoder's linear layers (`train.precision`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 operands with f32 accumulation on a GPU; f32 on the CPU reference.
    #[default]
    Bf16,
    /// FP8 operands for q/k/v/o and gate/up/down (E4M3 forward, E5M2 gradients), f32
    /// accumulation; the embedding, head, router, attention core and norms stay as in bf16.
    Fp8,
}

/// How an FP8 operand's scale is chosen (`train.fp8.recipe`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Recipe {
    /// Dynamic ("current") scaling, torchao's and Transformer Engine's: one scale per tensor and
    /// use, `max / amax` of the tensor itself.
    #[default]
    Tensorwise,
    /// Transformer Engine's delayed scaling: a step uses the scale its predecessors' amaxes give
    /// (`max / max(history) / 2^margin`), and records its own into the history.
    Delayed,
}

section! {
    /// FP8 products (`train.precision = "fp8"`): the scaling recipe and which products qualify.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct Fp8Config {
        /// How scales are chosen: `"tensorwise"` or `"delayed"`.
        @resumable
        pub recipe: Fp8Recipe = Fp8Recipe::Tensorwise,
        /// Steps of amax history the delayed recipe takes the maximum of (Transformer Engine's
        /// `amax_history_len`).
        @resumable
        pub amax_history: usize = 1024,
        /// The delayed recipe's scales are divided by `2^margin`, leaving headroom for growth.
        @resumable
        pub margin: u32 = 0,
        /// A linear layer runs in FP8 only when its input and output widths both reach this;
        /// smaller products lose more to the casts than FP8 gains (they stay bf16). Widths must
        /// also be multiples of 16 (cuBLASLt's rule), as must the tokens of a micro-batch.
        @resumable
        pub min_dim: usize = 2048,
    }
}

impl Fp8Config {
    fn validate(&self) -> Result<()> {
        check_positive(&[("train.fp8.amax_history", self.amax_history)])?;
        check_at_most(&[
            ("train.fp8.amax_history", self.amax_history, 1 << 16),
            ("train.fp8.margin", self.margin as usize, 64),
        ])
    }
}

section! {
    /// A job's flight recorder of collectives and its straggler detector
    /// (`engine/src/parallel/flight.rs`, `engine/src/train/stragglers.rs`).
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct DiagnosticsConfig {
        /// Collective operations each rank keeps (a ring), written to `RUN_DIR/flight/rank-R.json`
        /// on a watchdog timeout, a peer's departure or SIGUSR2; 0 records nothing.
        @resumable
        pub flight_recorder: usize = 2048,
        /// Steps over which the straggler detector looks for a rank slowest most of the time;
        /// 0 turns it off.
        @resumable
        pub straggler_window: usize = 20,
        /// The share of the window's steps in which one rank must be the slowest.
        @resumable
        pub straggler_fraction: f64 = 0.5,
        /// How much slower than the other ranks' median a straggler's median busy time is, as a
        /// fraction of that median (0.25: 25 % slower).
        @resumable
        pub straggler_threshold: f64 = 0.25,
    }
}

impl DiagnosticsConfig {
    fn validate(&self) -> Result<()> {
        check_at_most(&[("train.diagnostics.flight_recorder", self.flight_recorder, 1 << 16)])?;
        if !(self.straggler_fraction > 0.0 && self.straggler_fraction <= 1.0) {
            bail!(
                "train.diagnostics.straggler_fraction = {} must be in (0, 1]: the share of the window's steps in which a rank is the slowest",
                self.straggler_fraction
            );
        }
        if !at_least(self.straggler_threshold, 0.0) {
            bail!(
                "train.diagnostics.straggler_threshold = {} must be non-negative (a fraction of the median step time)",
                self.straggler_threshold
            );
        }
        Ok(())
    }
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

section! {
    /// AdamW with decoupled weight decay and global-norm gradient clipping.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct OptimConfig {
        /// Peak learning rate.
        pub lr: f64 = 3e-4,
        /// Learning-rate schedule after warmup.
        pub schedule: Schedule = Schedule::Cosine,
        /// Steps of linear warmup from 0 to `lr`.
        pub warmup_steps: usize = 0,
        /// Step at which the cosine reaches its floor; 0 means `train.steps`.
        pub decay_steps: usize = 0,
        /// Floor of the cosine as a fraction of `lr`.
        pub min_lr_ratio: f64 = 0.1,
        /// Decay rate of the first moment.
        pub beta1: f64 = 0.9,
        /// Decay rate of the second moment.
        pub beta2: f64 = 0.95,
        /// Added to the root of the second moment.
        pub eps: f64 = 1e-8,
        /// Decoupled weight decay of matrices (embeddings and projections); norms never decay.
        pub weight_decay: f64 = 0.1,
        /// Clip the global gradient norm to this value; 0 disables clipping.
        pub grad_clip: f64 = 1.0,
    }
}

impl OptimConfig {
    fn validate(&self) -> Result<()> {
        if !at_least(self.lr, 0.0) {
            bail!("optim.lr = {} must be a non-negative number", self.lr);
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            bail!("optim.beta1 = {} and optim.beta2 = {} must lie in [0, 1)", self.beta1, self.beta2);
        }
        if !positive_number(self.eps) {
            bail!("optim.eps = {} must be positive", self.eps);
        }
        if !at_least(self.weight_decay, 0.0) || !at_least(self.grad_clip, 0.0) {
            bail!("optim.weight_decay and optim.grad_clip must be non-negative");
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            bail!("optim.min_lr_ratio = {} must lie in [0, 1]", self.min_lr_ratio);
        }
        Ok(())
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

section! {
    /// The training data.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct DataConfig {
        /// Document masking: attention inside a packed sequence stops at each EOS (the id the
        /// shards record), so that a token attends only to its own document's (docs/data.md).
        pub document_mask: bool = false,
        /// With `document_mask`: positions restart at 0 at each document (the GPT family's learned
        /// positions).
        pub reset_positions: bool = false,
        /// Token source.
        pub source: DataSource = DataSource::Embedded,
        /// With `source = "shards"`: a directory of shards (read in name order) or one shard file.
        /// A relative path is relative to the working directory. The data may move between a run
        /// and its resumption; it may not change (its shards are checked).
        @resumable
        pub path: String = String::new(),
        /// With `source = "shards"`, in place of `path`: several prepared datasets, each sequence
        /// read from one of them in proportion to the weights ([`crate::data::mixture`]).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        pub mixture: Vec<MixtureSource> = Vec::new(),
        /// Prepared shards that `eval_loss` reads instead of a held-out tail of the training data
        /// (none is held out then). Empty: the tail.
        pub validation_path: String = String::new(),
    }
}

impl DataConfig {
    /// The source and its paths, and document masking against the model it runs on.
    fn validate(&self, model: &ModelConfig) -> Result<()> {
        if self.reset_positions && !self.document_mask {
            bail!("data.reset_positions = true needs data.document_mask = true (positions restart at each document)");
        }
        if self.document_mask {
            if self.source != DataSource::Shards {
                bail!(
                    "data.document_mask = true needs an EOS id, which only prepared shards record; set data.source = \"shards\""
                );
            }
            if self.reset_positions && !model.is_gpt() {
                bail!(
                    "data.reset_positions = true is for learned positions (model.family = \"gpt\"): RoPE's scores depend only on the distance between tokens, which the mask keeps within a document"
                );
            }
        }
        self.check_mixture()?;
        match (self.source, self.path.is_empty() && self.mixture.is_empty()) {
            (DataSource::Shards, true) => {
                bail!(
                    "data.source = \"shards\" needs data.path (a directory written by `engine data prepare`) or [[data.mixture]] entries"
                );
            }
            (DataSource::Embedded | DataSource::Synthetic, false) => {
                bail!("data.path is set but data.source is not \"shards\"; set data.source = \"shards\"");
            }
            _ => {}
        }
        Ok(())
    }
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

section! {
    /// The device mesh: five parallel axes (data, fsdp, tensor, pipeline, seq), each split into an
    /// intra-node (`ici`) and an inter-node (`dcn`) size, as in MaxText, Pax and AXLearn. The `ici` sizes multiply to the
    /// devices per node and the `dcn` sizes to the number of nodes; one size per group may be -1,
    /// meaning "whatever fills it". Every key may change when a run resumes: checkpoints hold the
    /// whole, unsharded state, and the data position counts the samples of all ranks.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields, default)]
    pub struct MeshConfig {
        /// Data parallelism within a node: replicas that all-reduce gradients.
        @resumable
        pub ici_data: i64 = -1,
        /// Fully sharded data parallelism within a node: parameters, gradients and optimizer state
        /// sharded, parameters gathered per layer.
        @resumable
        pub ici_fsdp: i64 = 1,
        /// Tensor parallelism within a node: attention heads, MLP columns and experts split.
        @resumable
        pub ici_tensor: i64 = 1,
        /// Data parallelism across nodes.
        @resumable
        pub dcn_data: i64 = -1,
        /// Fully sharded data parallelism across nodes.
        @resumable
        pub dcn_fsdp: i64 = 1,
        /// Tensor parallelism across nodes.
        @resumable
        pub dcn_tensor: i64 = 1,
        /// Pipeline stages within a node (AXLearn's `pipeline` axis): the layers are split into
        /// contiguous stages, each device holding one stage's parameters, gradients and moments.
        @resumable
        pub ici_pipeline: i64 = 1,
        /// Pipeline stages across nodes.
        @resumable
        pub dcn_pipeline: i64 = 1,
        /// Sequence (context) parallelism within a node (AXLearn's `seq` axis): each sequence is
        /// cut into two chunks per device, one early and one late (Llama 3's load-balanced causal
        /// split), and attention all-gathers the keys and values over the axis.
        @resumable
        pub ici_seq: i64 = 1,
        /// Sequence parallelism across nodes.
        @resumable
        pub dcn_seq: i64 = 1,
        /// Expert parallelism within a node, carved out of the data axis (as Megatron-Core's
        /// `--expert-model-parallel-size`): each group of this many data ranks holds every expert
        /// once, whole experts divided among them, and a device holds only its own experts'
        /// parameters, gradients and moments. It must divide `ici_data` and
        /// `model.moe.num_experts`, and needs a mixture-of-experts model.
        @resumable
        pub ici_expert: i64 = 1,
        /// Expert parallelism across nodes, carved out of `dcn_data` likewise.
        @resumable
        pub dcn_expert: i64 = 1,
        /// FSDP: whether the forward pass releases each layer's gathered parameters once done with
        /// it (and the backward pass gathers them again), as FSDP2's `reshard_after_forward`. Off,
        /// the gathered parameters stay until the backward pass is done with them: one gather per
        /// unit and micro-batch instead of two, for the memory of the whole (tensor-local) model.
        @resumable
        pub fsdp_reshard_after_forward: bool = true,
        /// FSDP: whether the next unit's gather starts before the current unit computes, so that
        /// they overlap, at the memory of one more unit gathered at a time.
        @resumable
        pub fsdp_prefetch: bool = true,
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

    /// Whether attention normalises each query and key head before RoPE (QK-norm: Qwen3).
    pub fn qk_norm(&self) -> bool {
        matches!(self.family, Family::Qwen3 | Family::Qwen3Moe)
    }

    /// Number of keys query `i` (0-based) attends to in a sequence.
    pub fn keys_attended(&self, i: usize) -> usize {
        match self.sliding_window {
            0 => i + 1,
            w => (i + 1).min(w),
        }
    }
}

impl DataConfig {
    /// A mixture's entries: each with a path and a positive weight, names unique, in place of
    /// `data.path` and with shards only.
    fn check_mixture(&self) -> Result<()> {
        if self.mixture.is_empty() {
            return Ok(());
        }
        if !self.path.is_empty() {
            bail!(
                "data.path = {} and data.mixture are both set; a run reads data.path or the mixture's datasets, not both",
                self.path
            );
        }
        if self.source != DataSource::Shards {
            bail!("data.mixture is set but data.source is not \"shards\"; set data.source = \"shards\"");
        }
        for (i, m) in self.mixture.iter().enumerate() {
            if m.path.is_empty() {
                bail!("data.mixture[{i}].path is empty; name a directory written by `engine data prepare`");
            }
            if !positive_number(m.weight) {
                bail!("data.mixture[{i}].weight = {} ({}) must be a positive number", m.weight, m.name());
            }
            if let Some(j) = self.mixture[..i].iter().position(|o| o.name() == m.name()) {
                bail!(
                    "data.mixture[{j}] and data.mixture[{i}] are both named {}; give one a distinct `name`",
                    m.name()
                );
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

/// The first of `keys` whose value is 0, as an error.
fn check_positive(keys: &[(&str, usize)]) -> Result<()> {
    match keys.iter().find(|(_, value)| *value == 0) {
        Some((key, _)) => Err(anyhow!("{key} must be greater than 0")),
        None => Ok(()),
    }
}

/// The first of `keys` whose value is above its bound, as an error.
fn check_at_most(keys: &[(&str, usize, usize)]) -> Result<()> {
    match keys.iter().find(|(_, value, max)| value > max) {
        Some((key, value, max)) => Err(anyhow!("{key} = {value} is more than this engine trains (at most {max})")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use toml::Value;

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
            renormalize: true,
        };
        assert_eq!(moe(None).capacity(64), 128);
        assert_eq!(moe(Some(1.0)).capacity(64), 32);
        assert_eq!(moe(Some(1.25)).capacity(63), 40); // ceil(39.375)
        assert_eq!(moe(Some(1e-6)).capacity(64), 1);
        assert_eq!(moe(Some(100.0)).capacity(64), 128);
    }

    /// docs/recipes.md's tables of keys, as the code declares them: every key documented once,
    /// with its default; no key documented that the code lacks; a section for every nested
    /// table. `—` (required) stands for a default of 0, which validation refuses; `none` for an
    /// absent optional key or an empty list.
    #[test]
    fn docs_recipes_md_documents_every_key_with_its_default() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/recipes.md");
        let text = std::fs::read_to_string(path).unwrap();
        let (mut section, mut headings, mut rows) = (None, BTreeSet::new(), BTreeMap::new());
        for line in text.lines() {
            if line.starts_with('#') {
                let title = line.trim_start_matches('#').trim();
                section = match title {
                    "Top level" => Some(String::new()),
                    _ => title.strip_prefix("`[").and_then(|t| t.split_once("]`")).map(|(s, _)| s.to_owned()),
                };
                headings.extend(section.clone());
                continue;
            }
            let Some(section) = &section else { continue };
            if !line.starts_with("| `") {
                continue;
            }
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`').trim_start_matches("[[").trim_end_matches("]]");
            let key = if section.is_empty() { name.to_owned() } else { format!("{section}.{name}") };
            assert!(rows.insert(key.clone(), cells[3].to_owned()).is_none(), "docs/recipes.md lists {key} twice");
        }
        let number = |v: &Value| v.as_float().or_else(|| v.as_integer().map(|i| i as f64));
        for (section, keys) in SECTIONS {
            for key in keys {
                let dotted = if section.is_empty() { key.name.to_owned() } else { format!("{section}.{}", key.name) };
                if SECTIONS.iter().any(|(s, _)| *s == dotted) {
                    assert!(headings.contains(&dotted), "docs/recipes.md has no section for [{dotted}]");
                    continue;
                }
                let cell = rows.remove(&dotted).unwrap_or_else(|| panic!("docs/recipes.md does not document {dotted}"));
                let default = (key.default)();
                match cell.as_str() {
                    "—" => assert_eq!(default, Some(Value::Integer(0)), "{dotted} is documented as required"),
                    "none" => assert!(
                        default.is_none() || default == Some(Value::Array(Vec::new())),
                        "{dotted} is documented with no default, the code's is {default:?}"
                    ),
                    cell => {
                        let written = cell.trim_matches('`');
                        let mut doc: toml::Table = format!("v = {written}")
                            .parse()
                            .unwrap_or_else(|e| panic!("{dotted}: default {cell} is not TOML: {e}"));
                        let doc = doc.remove("v").unwrap();
                        let code = default.unwrap_or_else(|| panic!("{dotted} has no default in the code"));
                        let same = match (number(&doc), number(&code)) {
                            (Some(a), Some(b)) => a == b,
                            _ => doc == code,
                        };
                        assert!(same, "{dotted}: docs/recipes.md says the default is {written}, the code {code}");
                    }
                }
            }
        }
        assert!(rows.is_empty(), "docs/recipes.md documents keys the configuration lacks: {:?}", rows.keys());
    }

    /// Resumability is the field's: run controls and the mesh may change, what the next step
    /// computes may not; nested and unknown keys are not resumable.
    #[test]
    fn keys_say_whether_a_resumed_run_may_change_them() {
        for key in ["description", "extends", "train.steps", "train.keep_last", "data.path", "mesh.ici_data"] {
            assert!(Config::resumable(key), "{key}");
        }
        for key in ["model.d_model", "train.seq_len", "train.batch_size", "optim.lr", "model.moe.top_k", "mesh", "x.y"]
        {
            assert!(!Config::resumable(key), "{key}");
        }
        let mesh = MeshConfig::KEYS.iter().filter(|k| !k.resumable).map(|k| k.name).collect::<Vec<_>>();
        assert!(mesh.is_empty(), "every mesh key is resumable: {mesh:?}");
    }
}
