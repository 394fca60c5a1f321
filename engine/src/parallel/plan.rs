//! The parallel plan of a run: what its mesh decides for the model and the batch, computed and
//! checked once ([`ParallelPlan::new`], as torchtitan computes its `ParallelDims`), then read by
//! the trainer ([`crate::train::Trainer::new_parallel`]), the memory estimates
//! ([`ParallelPlan::estimate`]) and the commands that show or check them.
//!
//! It holds the mesh; the pipeline's stages, each a contiguous run of layers
//! (`train.pipeline_layers`, else the split `train.pipeline_split` names: the compute one of
//! [`pipeline::split`] or the memory one of [`ParallelPlan::memory_split`]); each stage's
//! schedule; the sequences of each pipeline micro-batch on a device; and the groups that read
//! distinct samples. Under interleaved 1F1B (`train.pipeline_virtual_stages = V`) the layers
//! are split into `P·V` virtual stages (`train.pipeline_layers` lists them all, else they are
//! equal), and each device's stage holds `V` of them ([`pipeline::interleave`]).

use anyhow::{Result, anyhow, bail};

use super::memory::{self, StagePlan};
use super::mesh::{Axis, Mesh};
use super::pipeline::{self, Action, Handoff};
use super::tensor::local_config;
use crate::config::{Config, PipelineSchedule, PipelineSplit};
use crate::model::memory::{Estimate, Target};
use crate::model::{Model, Stage};

/// How the devices of a run share the model and the batch (see the module comment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelPlan {
    /// The mesh.
    pub mesh: Mesh,
    /// The pipeline's stages in order, one a device (each holding its virtual stages under
    /// interleaved 1F1B: [`Stage::later`]); without stages, the one holding every layer.
    pub stages: Vec<Stage>,
    /// Virtual stages per device (`train.pipeline_virtual_stages`; 1 without stages).
    pub virtual_stages: usize,
    /// Each stage's schedule, in the same order.
    pub schedules: Vec<Schedule>,
    /// Sequences in each pipeline micro-batch on a device: a pipeline × tensor × seq group reads
    /// `batch_size · tensor · pipeline · seq` sequences per `grad_accum` micro-batch (the global
    /// batch is `batch_size` × devices), cut into `train.pipeline_microbatches`; a device of a
    /// seq axis keeps two chunks of each ([`ParallelPlan::local_seq_len`] tokens).
    pub microbatch: usize,
    /// Pipeline micro-batches per `grad_accum` micro-batch (`train.pipeline_microbatches`).
    pub microbatches: usize,
    /// Groups of devices that read distinct samples: the mesh's data × fsdp ranks.
    pub batch_shards: usize,
}

/// A stage's passes in one step and the activation slots of its micro-batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    /// The passes, in order ([`pipeline::actions`]).
    pub actions: Vec<Action>,
    /// The virtual stage each pass runs on (all 0 without virtual stages).
    pub chunk_of: Vec<usize>,
    /// The activation slot of each micro-batch on each virtual stage ([`pipeline::slots`]).
    pub slot_of: Vec<Vec<usize>>,
    /// The slots of each virtual stage: the most micro-batches in flight on it at once.
    pub chunk_in_flight: Vec<usize>,
    /// The slots of all of them, each keeping its activations.
    pub in_flight: usize,
    /// When the passes' inputs and outputs go to and from the neighbouring stages
    /// ([`pipeline::handoffs`]).
    pub handoffs: Vec<Handoff>,
}

impl Schedule {
    /// Stage `stage` of `stages` running `microbatches` micro-batches under `kind` over
    /// `virtual_stages`.
    fn new(
        kind: PipelineSchedule,
        stages: usize,
        stage: usize,
        microbatches: usize,
        virtual_stages: usize,
    ) -> Schedule {
        let passes = pipeline::actions(kind, stages, stage, microbatches, virtual_stages);
        let (chunk_of, actions): (Vec<usize>, Vec<Action>) = passes.iter().copied().unzip();
        let (slot_of, chunk_in_flight): (Vec<Vec<usize>>, Vec<usize>) = (0..virtual_stages)
            .map(|c| {
                let mine: Vec<Action> = passes.iter().filter(|p| p.0 == c).map(|p| p.1).collect();
                pipeline::slots(&mine, microbatches)
            })
            .unzip();
        let in_flight = chunk_in_flight.iter().sum();
        let handoffs = pipeline::handoffs(&actions, &chunk_of, stage, stages, virtual_stages);
        Schedule { actions, chunk_of, slot_of, chunk_in_flight, in_flight, handoffs }
    }
}

impl ParallelPlan {
    /// The plan of `config` on `mesh`, once the model splits over it: the split axes divide its
    /// heads, columns and experts, there are no more stages than layers, `train.pipeline_layers`
    /// gives each stage its count, and the batch cuts into whole micro-batches. Each error is
    /// one line that names the numbers.
    pub fn new(config: &Config, mesh: Mesh) -> Result<ParallelPlan> {
        mesh.check_model(&config.model)?;
        check_layers(config, mesh.size(Axis::Pipeline))?;
        check_virtual_stages(config, mesh.size(Axis::Pipeline))?;
        check_chunks(config, &mesh)?;
        let microbatch = microbatch_sequences(config, &mesh)?;
        Ok(ParallelPlan::build(config, mesh, microbatch))
    }

    /// The plan of `config` on its mesh over `nodes` nodes of `devices_per_node` devices
    /// ([`Mesh::resolve`], then [`ParallelPlan::new`]).
    pub fn resolve(config: &Config, devices_per_node: usize, nodes: usize) -> Result<ParallelPlan> {
        let mesh = Mesh::resolve(&config.mesh, devices_per_node, nodes)?;
        ParallelPlan::new(config, mesh)
    }

    /// The plan of one device training `config` alone, whatever its mesh says: the device holds
    /// every layer (whatever `train.pipeline_layers` lists), so only the batch is checked.
    pub fn single(config: &Config) -> Result<ParallelPlan> {
        let mesh = Mesh::single();
        let microbatch = microbatch_sequences(config, &mesh)?;
        Ok(ParallelPlan::build(config, mesh, microbatch))
    }

    /// The plan of a checked `config` and `mesh`.
    fn build(config: &Config, mesh: Mesh, microbatch: usize) -> ParallelPlan {
        let t = &config.train;
        let (stages, microbatches) = (mesh.size(Axis::Pipeline), t.pipeline_microbatches);
        // One device holds every layer, whatever the schedule asks.
        let v = if stages == 1 { 1 } else { t.pipeline_virtual_stages };
        let schedules = (0..stages).map(|s| Schedule::new(t.pipeline_schedule, stages, s, microbatches, v)).collect();
        let mut plan = ParallelPlan {
            mesh,
            stages: Vec::new(),
            virtual_stages: v,
            schedules,
            microbatch,
            microbatches,
            batch_shards: mesh.batch_shards(),
        };
        plan.stages = plan.split(config);
        plan
    }

    /// The stages: `train.pipeline_layers` when it is given, else the automatic split that
    /// `train.pipeline_split` names. Without stages the one device holds every layer. With
    /// virtual stages, those (listed, or equal) laid out on the devices.
    fn split(&self, config: &Config) -> Vec<Stage> {
        let stages = self.schedules.len();
        let layers = &config.train.pipeline_layers;
        if stages == 1 {
            return vec![Stage::whole(config.model.n_layers)];
        }
        let v = self.virtual_stages;
        if v > 1 {
            let n = config.model.n_layers;
            let sizes = if layers.is_empty() { vec![n / (stages * v); stages * v] } else { layers.clone() };
            return pipeline::interleave(&pipeline::from_sizes(&sizes), stages);
        }
        if !layers.is_empty() {
            assert_eq!(layers.len(), stages, "internal error: train.pipeline_layers unchecked");
            return pipeline::from_sizes(layers);
        }
        match config.train.pipeline_split {
            PipelineSplit::Compute => pipeline::split(&config.model, stages),
            PipelineSplit::Memory => pipeline::from_sizes(&self.memory_split(config)),
        }
    }

    /// Tokens of each sequence a device keeps: `train.seq_len`, or its two chunks of it on a
    /// seq axis (`seq_len / seq`).
    pub fn local_seq_len(&self, config: &Config) -> usize {
        config.train.seq_len / self.mesh.size(Axis::Seq)
    }

    /// Sequences of one `grad_accum` micro-batch, all devices together: `batch_size` × devices.
    pub fn global_sequences(&self) -> usize {
        self.microbatch * self.microbatches * self.batch_shards
    }

    /// The share of a step each device of the pipeline is idle, by the schedule (0 on one
    /// stage): [`pipeline::bubble_fraction`], `(P − 1) / (V·M + P − 1)`.
    pub fn bubble_fraction(&self) -> f64 {
        pipeline::bubble_fraction(self.stages.len(), self.microbatches, self.virtual_stages)
    }

    /// The model a device of stage `s` holds: its tensor-parallel slice of the stage's layers,
    /// with the run's recomputation policy and batch shards; on an expert axis, the first
    /// member's experts (every member holds as many).
    pub fn stage_model(&self, config: &Config, s: usize) -> Model {
        self.model_of(config, &self.stages[s])
    }

    /// The model device `rank` holds: [`ParallelPlan::stage_model`] of its stage, with its own
    /// experts on an expert axis.
    pub fn device_model(&self, config: &Config, rank: usize) -> Model {
        let mut model = self.stage_model(config, self.mesh.coords(rank).pipeline);
        if let Some(moe) = &config.model.moe {
            model.hold_experts(self.mesh.held_experts(rank, moe.num_experts));
        }
        model
    }

    /// The model a device would hold for `stage`.
    fn model_of(&self, config: &Config, stage: &Stage) -> Model {
        let mut model = Model::for_stage(&local_config(&config.model, self.mesh.size(Axis::Tensor)), stage);
        model.remat = config.train.remat;
        model.fp8 = crate::model::Fp8Policy::of(&config.train);
        model.logit_max = config.optim.qk_clip > 0.0;
        // FSDP gathers each unit's weights for a pass and gives them back after: a cast kept
        // from the forward pass would hold every unit's whole.
        model.fp8_weight_cache =
            stage.first && stage.last && self.mesh.size(Axis::Fsdp) * self.mesh.size(Axis::Seq) == 1;
        // The delayed recipe's scale is known before the cast: the optimizer writes the casts.
        model.fp8_weight_copies =
            model.fp8_weight_cache && config.train.fp8.recipe == crate::config::Fp8Recipe::Delayed;
        model.fp8_keep_inputs = true;
        // FSDP gathers the weights' casts.
        model.fp8_gathers = !model.fp8_weight_cache && self.mesh.size(Axis::Fsdp) * self.mesh.size(Axis::Seq) > 1;
        #[cfg(test)]
        if NO_FP8_GATHERS.get() {
            model.fp8_gathers = false;
        }
        #[cfg(test)]
        if NO_WEIGHT_COPIES.get() {
            model.fp8_weight_copies = false;
        }
        #[cfg(test)]
        if NO_KEPT_INPUTS.get() {
            model.fp8_keep_inputs = false;
        }
        // The estimate needs only whether the document bounds are kept (8 bytes a token; on a
        // seq axis the whole sequences' bounds and tokens); the EOS id itself is read from the
        // shards when training starts.
        model.documents = config
            .data
            .document_mask
            .then_some(crate::model::Documents { eos: 0, reset_positions: config.data.reset_positions });
        let seq = self.mesh.size(Axis::Seq);
        model.batch_shards = self.batch_shards * seq;
        model.seq = crate::backend::SeqSplit { rank: 0, ranks: seq };
        model.expert_ranks = self.mesh.expert_size();
        if let (Some(moe), true) = (&config.model.moe, model.expert_ranks > 1) {
            model.hold_experts(0..moe.num_experts / model.expert_ranks);
        }
        model
    }

    /// Bytes a device of stage `s` takes on `target` when it holds `stage`.
    fn device_estimate(&self, config: &Config, s: usize, stage: &Stage, target: Target) -> Estimate {
        let model = self.model_of(config, stage);
        // FSDP shards over the fsdp and seq axes together.
        let fsdp = self.mesh.size(Axis::Fsdp) * self.mesh.size(Axis::Seq);
        let in_flight = &self.schedules[s].chunk_in_flight;
        memory::device_estimate(config, &model, self.microbatch, in_flight, fsdp, target)
    }

    /// The memory plan of a device of each stage, for this plan's `config`.
    pub fn stage_estimates(&self, config: &Config, target: Target) -> Vec<StagePlan> {
        let plan = |(s, stage): (usize, &Stage)| StagePlan {
            layers: stage.layers.clone(),
            later: stage.later.clone(),
            in_flight: self.schedules[s].in_flight,
            chunk_in_flight: self.schedules[s].chunk_in_flight.clone(),
            estimate: self.device_estimate(config, s, stage, target),
        };
        self.stages.iter().enumerate().map(plan).collect()
    }

    /// Bytes one device holds to train this plan's `config` on `target`, by what holds them: the
    /// device of the pipeline stage that needs the most.
    pub fn estimate(&self, config: &Config, target: Target) -> Estimate {
        let stages = self.stage_estimates(config, target);
        stages.into_iter().map(|s| s.estimate).max_by_key(Estimate::total).expect("at least one stage")
    }

    /// The layers of each stage that make the fullest stage's estimated GPU memory as small as
    /// possible (`train.pipeline_split = "memory"`). The estimate is the CUDA one whatever the
    /// backend, so that every device of a run computes the same split. A stage's memory grows
    /// with its layer count (their state, and their activations once per micro-batch in
    /// flight): each stage can take the most layers that keep it under a bound, and the least
    /// bound for which those add up to `model.n_layers` is found among the stages' own totals.
    /// The layers are taken as alike (a stage's memory depends on how many it holds, not which).
    pub fn memory_split(&self, config: &Config) -> Vec<usize> {
        let (n, stages) = (config.model.n_layers, self.schedules.len());
        let target = Target::Cuda { sm_count: 132 };
        // bytes[s][k - 1]: stage s holding k layers (each other stage holds at least one).
        let most = n + 1 - stages;
        let bytes: Vec<Vec<usize>> = (0..stages)
            .map(|s| {
                (1..=most)
                    .map(|k| {
                        let stage = Stage { layers: 0..k, first: s == 0, last: s + 1 == stages, later: Vec::new() };
                        self.device_estimate(config, s, &stage, target).total()
                    })
                    .collect()
            })
            .collect();
        // The most layers stage s takes under `bound` (0 when not even one fits).
        let fits = |bound: usize| -> Vec<usize> {
            bytes.iter().map(|b| b.iter().take_while(|&&x| x <= bound).count()).collect()
        };
        let enough = |bound: usize| {
            let k = fits(bound);
            k.iter().all(|&k| k >= 1) && k.iter().sum::<usize>() >= n
        };
        let mut bounds: Vec<usize> = bytes.iter().flatten().copied().collect();
        bounds.sort_unstable();
        bounds.dedup();
        // Every stage at `most` layers is enough, so the search ends on a bound that is.
        let (mut lo, mut hi) = (0, bounds.len() - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if enough(bounds[mid]) { hi = mid } else { lo = mid + 1 }
        }
        let mut sizes = fits(bounds[lo]);
        // Give back the layers beyond n, from the stages holding the most (fewer layers never
        // need more memory), so that the compute stays as even as the bound allows.
        let mut extra = sizes.iter().sum::<usize>() - n;
        while extra > 0 {
            let s = (0..stages).rev().max_by_key(|&s| sizes[s]).expect("at least one stage");
            sizes[s] -= 1;
            extra -= 1;
        }
        sizes
    }
}

/// Sequences in each pipeline micro-batch on `mesh` ([`ParallelPlan::microbatch`]). The error
/// names the numbers.
fn microbatch_sequences(config: &Config, mesh: &Mesh) -> Result<usize> {
    let (tensor, stages, seq) = (mesh.size(Axis::Tensor), mesh.size(Axis::Pipeline), mesh.size(Axis::Seq));
    let t = &config.train;
    let group = t.batch_size.sequences(tensor * stages * seq)?;
    let m = t.pipeline_microbatches;
    if !group.is_multiple_of(m) {
        let seq = if seq > 1 { format!(" x seq {seq}") } else { String::new() };
        bail!(
            "train.pipeline_microbatches = {m} does not divide the {group} sequences each pipeline reads per micro-batch (train.batch_size = {} x tensor {tensor} x pipeline {stages}{seq}); {group} mod {m} = {}",
            t.batch_size,
            group % m
        );
    }
    Ok(group / m)
}

/// Refuses a sequence length that the seq axis cannot cut into two chunks of equal length per
/// device. The error names the numbers.
fn check_chunks(config: &Config, mesh: &Mesh) -> Result<()> {
    let (seq, len) = (mesh.size(Axis::Seq), config.train.seq_len);
    if seq == 1 || len.is_multiple_of(2 * seq) {
        return Ok(());
    }
    Err(anyhow!(
        "train.seq_len = {len} does not split into the 2 x {seq} = {} chunks of the seq axis (mesh.ici_seq x mesh.dcn_seq = {} x {}: each device takes two chunks of equal length, one early and one late); {len} mod {} = {}",
        2 * seq,
        mesh.ici[4],
        mesh.dcn[4],
        2 * seq,
        len % (2 * seq)
    ))
}

/// Refuses a `train.pipeline_layers` that does not give each of the `stages` stages (each of
/// their virtual stages, under interleaved 1F1B) its count (the counts themselves are checked
/// by [`Config::validate`]). The error names the numbers.
fn check_layers(config: &Config, stages: usize) -> Result<()> {
    let layers = &config.train.pipeline_layers;
    let v = if stages > 1 { config.train.pipeline_virtual_stages } else { 1 };
    if layers.is_empty() || layers.len() == stages * v {
        return Ok(());
    }
    if v > 1 {
        bail!(
            "train.pipeline_layers = {layers:?} gives {} virtual stages, but {stages} stages x train.pipeline_virtual_stages = {v} makes {}; give one layer count per virtual stage in model order, or [] to split evenly",
            layers.len(),
            stages * v
        );
    }
    Err(anyhow!(
        "train.pipeline_layers = {layers:?} gives {} stages, but the pipeline axis has {stages} (mesh.ici_pipeline x mesh.dcn_pipeline); give one layer count per stage, or [] to split automatically",
        layers.len()
    ))
}

/// Refuses virtual stages (interleaved 1F1B) that a pipeline cannot have: with micro-batches that are not a multiple of the stages (Megatron-LM's rule: they go
/// through the virtual stages in groups of `P`), more virtual stages than layers, or, without
/// `train.pipeline_layers`, layers that do not split evenly over them. The error names the
/// numbers.
fn check_virtual_stages(config: &Config, stages: usize) -> Result<()> {
    let t = &config.train;
    let (v, m, n) = (t.pipeline_virtual_stages, t.pipeline_microbatches, config.model.n_layers);
    // Without stages every device holds every layer: the keys change nothing.
    if t.pipeline_schedule != PipelineSchedule::Interleaved || stages == 1 {
        return Ok(());
    }
    if !m.is_multiple_of(stages) {
        bail!(
            "train.pipeline_microbatches = {m} is not a multiple of the {stages} pipeline stages, which interleaved 1F1B needs (the micro-batches go through the virtual stages in groups of {stages}); {m} mod {stages} = {}",
            m % stages
        );
    }
    let virtual_stages = stages * v;
    if virtual_stages > n {
        bail!(
            "{stages} stages x train.pipeline_virtual_stages = {v} make {virtual_stages} virtual stages, more than model.n_layers = {n} (each holds at least one layer)"
        );
    }
    if t.pipeline_layers.is_empty() && v > 1 && !n.is_multiple_of(virtual_stages) {
        bail!(
            "model.n_layers = {n} does not split evenly into {stages} stages x train.pipeline_virtual_stages = {v} = {virtual_stages} virtual stages; {n} mod {virtual_stages} = {}; give train.pipeline_layers (one count per virtual stage) or another number of virtual stages",
            n % virtual_stages
        );
    }
    if t.pipeline_layers.is_empty() && v > 1 && t.pipeline_split == PipelineSplit::Memory {
        bail!(
            "train.pipeline_split = \"memory\" splits stages, not the virtual stages of train.pipeline_virtual_stages = {v}; give train.pipeline_layers or use \"compute\" (equal virtual stages)"
        );
    }
    Ok(())
}

// Tests turn the optimizer's FP8 weight casts, the forward passes' kept input casts, or FSDP's
// FP8 gathers off on their thread, to compare with the passes casting them.
#[cfg(test)]
thread_local! {
    pub(crate) static NO_WEIGHT_COPIES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    pub(crate) static NO_KEPT_INPUTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    pub(crate) static NO_FP8_GATHERS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// This thread's FP8 test knobs, to set on the threads it starts ([`set_test_knobs`]).
#[cfg(test)]
pub(crate) fn test_knobs() -> [bool; 3] {
    [NO_WEIGHT_COPIES.get(), NO_KEPT_INPUTS.get(), NO_FP8_GATHERS.get()]
}

/// Sets this thread's FP8 test knobs to another's ([`test_knobs`]).
#[cfg(test)]
pub(crate) fn set_test_knobs([copies, kept, gathers]: [bool; 3]) {
    NO_WEIGHT_COPIES.set(copies);
    NO_KEPT_INPUTS.set(kept);
    NO_FP8_GATHERS.set(gathers);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::recipe::{Override, resolve};

    /// The fullest stage's CUDA estimate under `config`.
    fn fullest(config: &Config, mesh: &Mesh) -> usize {
        let target = Target::Cuda { sm_count: 132 };
        let plan = ParallelPlan::new(config, *mesh).unwrap();
        plan.stage_estimates(config, target).iter().map(|p| p.estimate.total()).max().unwrap()
    }

    /// Under FSDP 8, llama3.1-8b (its recipe: no recomputation, 1 × 8192 a device) plans less
    /// memory a device in FP8 than in bf16, both recipes: the inputs kept cast for the weight
    /// gradients, a byte an element in place of the bf16 inputs' two, outweigh the casts'
    /// scratch. `engine recipes show` prints the same figures.
    #[test]
    fn fp8_plans_less_memory_than_bf16_under_fsdp_8() {
        let total = |precision: &str, recipe: &str| {
            let sets = format!("mesh.ici_fsdp=8 mesh.ici_data=1 train.precision={precision} train.fp8.recipe={recipe}");
            let c = resolve("llama3.1-8b", &Override::from_list(&sets, "test")).unwrap().config;
            assert_eq!(c.train.remat, crate::config::Remat::None);
            ParallelPlan::resolve(&c, 8, 1).unwrap().estimate(&c, Target::Cuda { sm_count: 132 }).total()
        };
        let bf16 = total("bf16", "tensorwise");
        for recipe in ["tensorwise", "delayed"] {
            let fp8 = total("fp8", recipe);
            let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
            assert!(fp8 < bf16, "{recipe}: FP8 plans {:.2} GiB a device, bf16 {:.2} GiB", gib(fp8), gib(bf16));
        }
    }

    /// The memory split is the best of every split of 7 layers into 3 stages, and it gives the
    /// first stage (3 micro-batches in flight, activations dominating) fewer layers than the
    /// compute split does.
    #[test]
    fn the_memory_split_minimises_the_fullest_stage() {
        let sets = "model.n_layers=7 model.vocab_size=64 train.seq_len=64 train.batch_size=2 \
                    train.pipeline_microbatches=6 mesh.ici_data=1 mesh.ici_pipeline=3";
        let mut c = resolve("tiny-llama2", &Override::from_list(sets, "test")).unwrap().config;
        let mesh = ParallelPlan::resolve(&c, 3, 1).unwrap().mesh;
        let compute = ParallelPlan::new(&c, mesh).unwrap().stages;
        let mut best = usize::MAX;
        for a in 1..=5 {
            for b in 1..=6 - a {
                c.train.pipeline_layers = vec![a, b, 7 - a - b];
                best = best.min(fullest(&c, &mesh));
            }
        }
        c.train.pipeline_layers.clear();
        c.train.pipeline_split = crate::config::PipelineSplit::Memory;
        let plan = ParallelPlan::new(&c, mesh).unwrap();
        let memory = plan.stages.clone();
        assert_eq!(memory.iter().map(|s| s.layers.len()).sum::<usize>(), 7);
        assert_eq!(fullest(&c, &mesh), best, "{memory:?}");
        assert!(memory[0].layers.len() < compute[0].layers.len(), "memory {memory:?}, compute {compute:?}");
        // The plans and the trainer see the same split.
        let plans = plan.stage_estimates(&c, Target::Cpu);
        assert_eq!(
            plans.iter().map(|p| p.layers.clone()).collect::<Vec<_>>(),
            memory.iter().map(|s| s.layers.clone()).collect::<Vec<_>>()
        );
    }

    /// Virtual stages the run cannot have are refused in one line that names the numbers; an
    /// interleaved plan keeps Megatron-LM's bubble and each virtual stage's activations.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a device's one later virtual stage
    fn virtual_stages_are_checked_and_planned() {
        let base = "model.n_layers=8 model.vocab_size=64 train.batch_size=2 train.pipeline_microbatches=4 \
                    mesh.ici_data=1 mesh.ici_pipeline=2";
        let refused = |sets: &str| {
            let r = resolve("tiny-llama2", &Override::from_list(&format!("{base} {sets}"), "test"));
            match r {
                Err(e) => format!("{e:#}"),
                Ok(r) => ParallelPlan::resolve(&r.config, 2, 1).unwrap_err().to_string(),
            }
        };
        let e = refused("train.pipeline_virtual_stages=2");
        assert!(e.contains("train.pipeline_virtual_stages = 2 needs train.pipeline_schedule = \"interleaved\""), "{e}");
        let interleaved = "train.pipeline_schedule=\"interleaved\"";
        let e = refused(&format!("{interleaved} train.pipeline_virtual_stages=3"));
        assert!(e.contains("model.n_layers = 8 does not split evenly into 2 stages x train.pipeline_virtual_stages = 3 = 6 virtual stages; 8 mod 6 = 2"), "{e}");
        let e = refused(&format!(
            "{interleaved} train.pipeline_virtual_stages=2 train.batch_size=3 train.pipeline_microbatches=3"
        ));
        assert!(e.contains("train.pipeline_microbatches = 3 is not a multiple of the 2 pipeline stages"), "{e}");
        let e = refused(&format!("{interleaved} train.pipeline_virtual_stages=2 train.pipeline_layers=[4,4]"));
        assert!(e.contains("train.pipeline_layers = [4, 4] gives 2 virtual stages, but 2 stages x train.pipeline_virtual_stages = 2 makes 4"), "{e}");
        let sets = format!("{base} {interleaved} train.pipeline_virtual_stages=2 train.pipeline_layers=[1,3,2,2]");
        let c = resolve("tiny-llama2", &Override::from_list(&sets, "test")).unwrap().config;
        let plan = ParallelPlan::resolve(&c, 2, 1).unwrap();
        assert_eq!((plan.stages[0].layers.clone(), plan.stages[0].later.clone()), (0..1, vec![4..6]));
        assert_eq!((plan.stages[1].layers.clone(), plan.stages[1].later.clone()), (1..4, vec![6..8]));
        assert!((plan.bubble_fraction() - 1.0 / 9.0).abs() < 1e-12);
        // Without a pipeline axis (data 2 here) the virtual stages change nothing.
        let mut data = c.clone();
        (data.mesh.ici_data, data.mesh.ici_pipeline, data.train.pipeline_layers) = (2, 1, Vec::new());
        data.train.pipeline_microbatches = 2;
        let flat = ParallelPlan::resolve(&data, 2, 1).unwrap();
        assert_eq!((flat.virtual_stages, flat.stages.clone()), (1, vec![Stage::whole(8)]));
        // Device 0 keeps 4 micro-batches of its first virtual stage and 2 of its second; a
        // virtual stage's slot holds its own layers' activations.
        assert_eq!(plan.schedules[0].chunk_in_flight, vec![4, 2]);
        let e = plan.stage_estimates(&c, Target::Cpu);
        let mut plain = c.clone();
        (plain.train.pipeline_schedule, plain.train.pipeline_virtual_stages, plain.train.pipeline_layers) =
            (PipelineSchedule::OneFOneB, 1, vec![3, 5]);
        let one_f_one_b = ParallelPlan::resolve(&plain, 2, 1).unwrap().stage_estimates(&plain, Target::Cpu);
        assert_eq!(e[0].estimate.parameters, one_f_one_b[0].estimate.parameters);
        assert!(e[0].estimate.activations > one_f_one_b[0].estimate.activations, "{e:?} {one_f_one_b:?}");
    }

    /// One device holds every layer and reads the whole batch, whatever the mesh and
    /// `train.pipeline_layers` say; a mesh's plan checks the list.
    #[test]
    fn one_device_holds_every_layer() {
        let sets = "model.n_layers=5 train.batch_size=2 train.pipeline_microbatches=2 mesh.ici_data=1 \
                    mesh.ici_pipeline=2 train.pipeline_layers=[1,4]";
        let c = resolve("tiny-llama2", &Override::from_list(sets, "test")).unwrap().config;
        let one = ParallelPlan::single(&c).unwrap();
        assert_eq!((one.stages.clone(), one.microbatch, one.global_sequences()), (vec![Stage::whole(5)], 1, 2));
        let two = ParallelPlan::resolve(&c, 2, 1).unwrap();
        assert_eq!(two.stages.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(), vec![0..1, 1..5]);
        assert_eq!((two.microbatch, two.global_sequences(), two.schedules[0].in_flight), (2, 4, 2));
        let e = ParallelPlan::new(&c, Mesh::single()).unwrap_err().to_string();
        assert!(e.contains("train.pipeline_layers = [1, 4] gives 2 stages, but the pipeline axis has 1"), "{e}");
    }
}
