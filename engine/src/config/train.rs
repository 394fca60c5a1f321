//! The `[train]` section (`TrainConfig`, `BatchSize`) with its `[train.fp8]` (`Fp8Config`) and
//! `[train.diagnostics]` (`DiagnosticsConfig`) tables, and the enums of its keys.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use super::{Key, ModelConfig, at_least, check_at_most, check_positive};

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
        /// Directory of the local tier on each node; empty: `/dev/shm/engine-local-UID-HASH`, of
        /// the user and keyed by the run directory's canonical path. Created 0700 when missing;
        /// this user's alone (directories 0700, files 0600): one that is a symbolic link, that
        /// another user owns or that others can write is refused. A completed run removes its
        /// parts, and the directory once empty; parts of another run or mesh are skipped.
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
    pub(super) fn validate(&self, model: &ModelConfig) -> Result<()> {
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
        /// Steps over which the straggler detector looks for a rank slowest most of the time
        /// (at most 65536); 0 turns it off.
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
        // Both are allocated up front (a ring, a window of steps): bounded, not left to overflow.
        check_at_most(&[
            ("train.diagnostics.flight_recorder", self.flight_recorder, 1 << 16),
            ("train.diagnostics.straggler_window", self.straggler_window, 1 << 16),
        ])?;
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
