//! `engine recipes plan`: the meshes, recomputation policies and batch splits under which a
//! recipe fits a given memory per device, ranked by an estimated step time.
//!
//! **What is searched.** Within a node (`ici`): tensor `t` and seq `s` dividing the devices per
//! node, the rest all FSDP or all data; for a mixture of experts, an expert axis `e` carved out
//! of the node's data axis (each divisor of it that divides the experts). Across nodes (`dcn`): pipeline stages `p` dividing the
//! nodes (memory split), the rest all FSDP or all data. For each, `train.remat` (full, minimal,
//! none), the sequences of a pipeline micro-batch (1, 2, 4, 8) and, with stages, the
//! micro-batches `M` per round (P/2, P, 2P, 4P) and the virtual stages `V` per device (1, or
//! interleaved 1F1B's 2 and 4 with layers split evenly over them, `M` a multiple of `P`: a bubble
//! of (P − 1)/(V·M + P − 1) for V times the pipeline's sends). The global batch (sequences per optimizer step)
//! is fixed: the recipe's `batch_size × devices × grad_accum` unless given, and `grad_accum`
//! takes what a round does not. A candidate fits when the CUDA memory estimate of its fullest
//! device ([`ParallelPlan::estimate`], what `engine recipes show` prints) plus a reserve for the
//! CUDA context and NCCL is at most the memory given. Memory grows with the micro-batch and the
//! micro-batches in flight, so each mesh and policy stops at the first that does not fit.
//!
//! **How the search is bounded** (it finds the same plans as estimating every candidate):
//! - a mesh whose parameters, gradients and moments alone (18 bytes an element, divided as the
//!   device's layout divides them over tensor, expert, pipeline and FSDP × seq) plus FSDP's
//!   buffers for the widest unit it holds exceed the memory is skipped before any estimate
//!   ([`Plans::pruned`], and the command says how many); when nothing fits, the skipped meshes
//!   whose bound is below the closest candidate's memory are estimated after all;
//! - the memory split of a 1F1B pipeline is computed as [`ParallelPlan::memory_split`] does,
//!   but with the stage estimates it needs only (doubling, then bisecting, over layers and
//!   bounds), and a stage's estimate is kept for every candidate that shares its tensor, seq,
//!   expert, pipeline and FSDP sizes, policy, micro-batch and layers (the slots in flight add
//!   `(n − 1)` slots to it: [`super::memory::device_estimate_slots`]);
//! - expert axes are the divisors of a node's data ranks that divide the experts.
//!
//! **The step time** is compute plus communication, not overlapped (an upper bound):
//! - compute: the step's training FLOPs ([`crate::config::ModelConfig::train_flops_per_token`],
//!   × 4/3 under full recomputation) over the devices at `peak × mfu`, divided by `1 − bubble`;
//! - communication: the bytes each device sends per step on each axis over that axis's link
//!   (ICI when the axis lies within a node, DCN when it spans nodes), as ring collectives move
//!   them (an all-reduce `2 (n − 1)/n` of the buffer, a gather or reduce-scatter `(n − 1)/n`):
//!   tensor, the four bf16 sums of a layer's `[tokens, d_model]` per micro-batch (six with full
//!   recomputation), and the vocabulary split's two (the embedding's output, the head's input
//!   gradient) with the loss's row maxima and sums (`[3 · tokens]` f32); seq, the gathers of
//!   q, k and v (forward, backward, and the recomputation) and the reduce-scatter of their
//!   gradient; FSDP, the bf16 gathers of the device's parameters
//!   (twice per micro-batch) and the f32 reduce-scatter of their gradient, over fsdp × seq; data,
//!   the all-reduce of the device's gradient pieces once per step; pipeline, each micro-batch's
//!   activation and its gradient, once per virtual stage; expert, the all-to-alls of each
//!   mixture-of-experts layer's fixed-size parts of bf16 rows per micro-batch (`e · tokens ·
//!   top_k` rows dropless, fewer under a capacity factor; dispatch and return, forward and
//!   backward; six with full recomputation), `(e − 1)/e` of them leaving the device. An expert axis divides the experts' parameters: FSDP gathers and
//!   reduce-scatters `1/e` of them, and the data axis sums them over its `d/e` replicas.

use std::collections::HashMap;

use anyhow::{Result, bail};

use super::mesh::Axis;
use super::plan::ParallelPlan;
use crate::backend::BufKind;
use crate::config::{BatchSize, Config, PipelineSchedule, PipelineSplit, Remat};
use crate::model::memory::{Target, element_bytes};
use crate::model::{Layout, Stage};

/// The CUDA target of every estimate (the H100's 132 multiprocessors size a scratch buffer).
const CUDA: Target = Target::Cuda { sm_count: 132 };

/// The hardware the plan is for, and the assumptions of the step-time estimate.
#[derive(Debug, Clone, Copy)]
pub struct Hardware {
    /// Nodes.
    pub nodes: usize,
    /// Devices per node.
    pub devices_per_node: usize,
    /// Memory per device, bytes.
    pub memory: usize,
    /// Bytes of each device kept for the CUDA context and NCCL.
    pub reserve: usize,
    /// Peak dense bf16 TFLOP/s of a device.
    pub peak_tflops: f64,
    /// The share of the peak the model's FLOPs run at.
    pub mfu: f64,
    /// Bytes per second a device sends within a node.
    pub ici_bytes_per_s: f64,
    /// Bytes per second a device sends to other nodes.
    pub dcn_bytes_per_s: f64,
}

/// One candidate: the keys that reproduce it, its memory and its estimated step time.
#[derive(Debug, Clone)]
pub struct Row {
    /// `KEY=VALUE` settings that reproduce it on top of the recipe.
    pub sets: Vec<String>,
    /// Bytes of the fullest device (the CUDA estimate).
    pub memory_per_device_bytes: usize,
    /// Estimated seconds per optimizer step.
    pub step_time_estimate_s: f64,
    /// Share of the step the pipeline idles.
    pub bubble: f64,
    /// `data x fsdp x tensor x pipeline x seq`, for the table.
    pub mesh: String,
}

/// What the search found.
pub struct Plans {
    /// The candidates that fit, best (fastest) first.
    pub fits: Vec<Row>,
    /// The candidate that needs the least memory, when none fits.
    pub closest: Option<Row>,
    /// Meshes searched: the tensor, seq, pipeline and expert sizes with their data and FSDP
    /// splits, each under every recomputation policy and batch split.
    pub meshes: usize,
    /// Of those, the meshes skipped before any estimate because their parameters, gradients,
    /// moments and FSDP buffers alone exceed the memory ([`state_lower_bound`]): none of their
    /// candidates could fit. (When nothing fits, those whose bound is below the closest
    /// candidate's memory are estimated after all, so that `closest` is the true closest.)
    pub pruned: usize,
}

/// Searches the plans of `base` on `hw` for a global batch of `global_batch` sequences per step.
pub fn search(base: &Config, hw: &Hardware, global_batch: usize) -> Result<Plans> {
    let (g, n) = (hw.devices_per_node, hw.nodes);
    if g == 0 || n == 0 {
        bail!("--nodes {n} --devices-per-node {g}: a plan needs at least one node of one device");
    }
    if hw.memory <= hw.reserve {
        bail!(
            "--memory {:.1} GiB leaves nothing beside the {:.1} GiB kept for the CUDA context and NCCL",
            gib(hw.memory),
            gib(hw.reserve)
        );
    }
    let devices = g * n;
    let m = &base.model;
    let mut memo = Memo::default();
    let mut fits = Vec::new();
    let mut closest: Option<Row> = None;
    let (mut meshes, mut pruned) = (0, Vec::new());
    for t in divisors(g) {
        for s in divisors(g / t) {
            if s > 1 && !base.train.seq_len.is_multiple_of(2 * s) {
                continue;
            }
            for ici_fsdp in [true, false] {
                let rest = g / (t * s);
                if !ici_fsdp && rest == 1 {
                    continue;
                }
                for p in divisors(n).into_iter().filter(|&p| p <= m.n_layers && (p == 1 || !m.tie_embeddings)) {
                    for dcn_fsdp in [true, false] {
                        let dcn_rest = n / p;
                        if !dcn_fsdp && dcn_rest == 1 {
                            continue;
                        }
                        let (ici_f, ici_d) = if ici_fsdp { (rest, 1) } else { (1, rest) };
                        let (dcn_f, dcn_d) = if dcn_fsdp { (dcn_rest, 1) } else { (1, dcn_rest) };
                        let shards = ici_f * ici_d * dcn_f * dcn_d;
                        if !global_batch.is_multiple_of(shards) {
                            continue;
                        }
                        for e in expert_axes(m, ici_d) {
                            let mesh = Mesh { t, s, p, e, ici: (ici_d, ici_f), dcn: (dcn_d, dcn_f) };
                            meshes += 1;
                            let bound = state_lower_bound(base, &mesh, &mut memo);
                            if bound + hw.reserve > hw.memory {
                                pruned.push((bound, mesh));
                                continue;
                            }
                            let per_shard = global_batch / shards;
                            for remat in [Remat::Full, Remat::Minimal, Remat::None] {
                                candidates(
                                    base,
                                    hw,
                                    &mesh,
                                    remat,
                                    per_shard,
                                    devices,
                                    &mut memo,
                                    &mut fits,
                                    &mut closest,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    let skipped = pruned.len();
    if fits.is_empty() {
        // Branch and bound: a skipped mesh whose bound is below the closest candidate's memory
        // might need less than it, so it is estimated after all.
        pruned.sort_by_key(|(bound, _)| *bound);
        for (bound, mesh) in pruned {
            if closest.as_ref().is_some_and(|c| c.memory_per_device_bytes <= bound) {
                break;
            }
            let shards = mesh.ici.0 * mesh.ici.1 * mesh.dcn.0 * mesh.dcn.1;
            for remat in [Remat::Full, Remat::Minimal, Remat::None] {
                let per_shard = global_batch / shards;
                candidates(base, hw, &mesh, remat, per_shard, devices, &mut memo, &mut fits, &mut closest);
            }
        }
    }
    fits.sort_by(|a, b| a.step_time_estimate_s.total_cmp(&b.step_time_estimate_s));
    let closest = if fits.is_empty() { closest } else { None };
    Ok(Plans { fits, closest, meshes, pruned: skipped })
}

/// What the search computes once and reads many times: each (tensor, expert) size's whole
/// layout's unit sizes, and the memory split's stage estimates.
#[derive(Default)]
struct Memo {
    /// `(t, e)` → the elements of each layer of a device's tensor slice and expert share, and
    /// of the whole model.
    layers: HashMap<(usize, usize), (Vec<usize>, usize)>,
    /// A stage's CUDA bytes with one micro-batch in flight, and a further slot's
    /// ([`stage_bytes`]).
    stages: HashMap<StageKey, (usize, usize)>,
}

/// What a device's estimate for a stage reads beside the slots in flight: the mesh's sizes
/// (tensor, seq, expert, pipeline, the FSDP group), the policy, the micro-batch, and the
/// stage's layers and ends.
#[derive(Clone, PartialEq, Eq, Hash)]
struct StageKey {
    mesh: (usize, usize, usize, usize, usize),
    remat: u8,
    microbatch: usize,
    layers: std::ops::Range<usize>,
    first: bool,
    last: bool,
}

/// The CUDA bytes of a device of `plan`'s stage `s` (without virtual stages) if it held
/// `layers`, as [`ParallelPlan::estimate`] counts them: its estimate with one micro-batch in
/// flight and each further slot's bytes ([`super::memory::device_estimate_slots`]), memoised,
/// so that only the model of a new key is built.
fn stage_bytes(
    c: &Config,
    plan: &mut ParallelPlan,
    s: usize,
    layers: std::ops::Range<usize>,
    memo: &mut Memo,
) -> usize {
    let (p, mesh) = (plan.stages.len(), plan.mesh);
    let fsdp = mesh.size(Axis::Fsdp) * mesh.size(Axis::Seq);
    let key = StageKey {
        mesh: (mesh.size(Axis::Tensor), mesh.size(Axis::Seq), mesh.expert_size(), p, fsdp),
        remat: c.train.remat as u8,
        microbatch: plan.microbatch,
        layers: layers.clone(),
        first: s == 0,
        last: s + 1 == p,
    };
    let in_flight = match plan.schedules[s].chunk_in_flight[..] {
        [one] => one,
        _ => unreachable!("internal error: a stage estimate with virtual stages"),
    };
    let (one, slot) = *memo.stages.entry(key).or_insert_with(|| {
        let stage = Stage { layers, first: s == 0, last: s + 1 == p, later: Vec::new() };
        let real = std::mem::replace(&mut plan.stages[s], stage);
        let model = plan.stage_model(c, s);
        plan.stages[s] = real;
        let (e, slot) = super::memory::device_estimate_slots(c, &model, plan.microbatch, fsdp, CUDA);
        (e.total(), slot)
    });
    one + (in_flight - 1) * slot
}

/// A lower bound of the CUDA bytes of `mesh`'s fullest device, from its parameters, gradients
/// and AdamW moments alone (18 bytes an element) and, under FSDP over `F` = fsdp × seq devices,
/// the buffers it lends a gathered unit (bf16) and a unit's accumulating gradient (f32), each
/// at least the widest unit the device holds. The device holding the widest layer `W` needs
/// `18 W / F + 6 W`; the stages share the model's `N` elements, so one holds at least
/// `18 N / (P F)`, plus the narrowest layer's buffers. (Tensor and expert axes divide the
/// layers as the device's layout does; activations and scratch are left out.)
fn state_lower_bound(base: &Config, mesh: &Mesh, memo: &mut Memo) -> usize {
    let m = &base.model;
    let (layers, total) = memo.layers.entry((mesh.t, mesh.e)).or_insert_with(|| {
        let experts = m.moe.as_ref().map_or(0, |moe| moe.num_experts / mesh.e);
        let local = super::tensor::local_config(m, mesh.t);
        let layout = Layout::stage_with_experts(&local, &Stage::whole(m.n_layers), 0..experts);
        (layout.layers.iter().map(|l| l.range.len()).collect(), layout.len)
    });
    let bytes = |kind| element_bytes(kind, CUDA);
    let state = bytes(BufKind::Params) + bytes(BufKind::Grads) + 2 * bytes(BufKind::OptState);
    let fsdp = mesh.ici.1 * mesh.dcn.1 * mesh.s;
    let buffers = if fsdp > 1 { bytes(BufKind::Gathered) + bytes(BufKind::Grads) } else { 0 };
    let (widest, narrowest) = (layers.iter().copied().max().unwrap_or(0), layers.iter().copied().min().unwrap_or(0));
    let holding_widest = state * widest / fsdp + buffers * widest;
    let share = state * *total / (mesh.p * fsdp) + buffers * narrowest;
    holding_widest.max(share)
}

/// The expert axes a node's data axis of `data` ranks can carve for `m`: the divisors of both
/// it and the experts (only 1 for a dense model).
fn expert_axes(m: &crate::config::ModelConfig, data: usize) -> Vec<usize> {
    let experts = m.moe.as_ref().map_or(1, |moe| moe.num_experts);
    divisors(data).into_iter().filter(|e| experts.is_multiple_of(*e)).collect()
}

/// A mesh of the search: tensor, seq, pipeline and expert sizes, and (data, fsdp) within and
/// across nodes.
struct Mesh {
    t: usize,
    s: usize,
    p: usize,
    /// The expert axis, within a node's data ranks.
    e: usize,
    ici: (usize, usize),
    dcn: (usize, usize),
}

/// The candidates of one mesh and policy, each shard group reading `per_shard` sequences per
/// step: micro-batches of growing size and count until one does not fit.
#[allow(clippy::too_many_arguments)]
fn candidates(
    base: &Config,
    hw: &Hardware,
    mesh: &Mesh,
    remat: Remat,
    per_shard: usize,
    devices: usize,
    memo: &mut Memo,
    fits: &mut Vec<Row>,
    closest: &mut Option<Row>,
) {
    let p = mesh.p;
    let counts: Vec<usize> = if p == 1 { vec![1] } else { vec![(p / 2).max(1), p, 2 * p, 4 * p] };
    // Interleaved 1F1B only with stages, and only where the layers split evenly into P·V
    // virtual stages (the memory split does not apply to them).
    let virtuals: Vec<usize> =
        [1, 2, 4].into_iter().filter(|&v| v == 1 || (p > 1 && base.model.n_layers.is_multiple_of(p * v))).collect();
    for mb in [1, 2, 4, 8] {
        let mut any = false;
        for &v in &virtuals {
            for &count in &counts {
                let round = mb * count;
                if !per_shard.is_multiple_of(round) || (v > 1 && !count.is_multiple_of(p)) {
                    continue;
                }
                let split = Split { mb, count, accum: per_shard / round, virtual_stages: v };
                let Some(row) = evaluate(base, hw, mesh, remat, split, devices, memo) else {
                    continue;
                };
                if row.memory_per_device_bytes + hw.reserve > hw.memory {
                    if closest.as_ref().is_none_or(|c| row.memory_per_device_bytes < c.memory_per_device_bytes) {
                        *closest = Some(row);
                    }
                    // More micro-batches in flight only need more.
                    break;
                }
                any = true;
                fits.push(row);
            }
        }
        if !any {
            return;
        }
    }
}

/// How a shard group's sequences of a step are cut: `mb` sequences a micro-batch, `count`
/// micro-batches a pipeline round, `accum` rounds (`train.grad_accum`), over `virtual_stages`
/// per device.
#[derive(Clone, Copy)]
struct Split {
    mb: usize,
    count: usize,
    accum: usize,
    virtual_stages: usize,
}

/// The config of a candidate and the `--set`s that give it.
fn configure(base: &Config, mesh: &Mesh, remat: Remat, split: Split) -> (Config, Vec<String>) {
    let Split { mb, count, accum, virtual_stages: v } = split;
    let mut c = base.clone();
    let group = mesh.t * mesh.p * mesh.s;
    let batch = (mb * count) as f64 / group as f64;
    let m = &mut c.mesh;
    (m.ici_data, m.ici_fsdp, m.ici_tensor, m.ici_pipeline, m.ici_seq) =
        (mesh.ici.0 as i64, mesh.ici.1 as i64, mesh.t as i64, 1, mesh.s as i64);
    (m.dcn_data, m.dcn_fsdp, m.dcn_tensor, m.dcn_pipeline, m.dcn_seq) =
        (mesh.dcn.0 as i64, mesh.dcn.1 as i64, 1, mesh.p as i64, 1);
    (m.ici_expert, m.dcn_expert) = (mesh.e as i64, 1);
    let t = &mut c.train;
    (t.batch_size, t.grad_accum, t.pipeline_microbatches, t.remat) = (BatchSize(batch), accum, count, remat);
    t.pipeline_layers.clear();
    if mesh.p > 1 {
        // Stages: the memory split, or interleaved 1F1B's equal virtual stages.
        t.pipeline_virtual_stages = v;
        if v > 1 {
            (t.pipeline_schedule, t.pipeline_split) = (PipelineSchedule::Interleaved, PipelineSplit::Compute);
        } else {
            (t.pipeline_schedule, t.pipeline_split) = (PipelineSchedule::OneFOneB, PipelineSplit::Memory);
        }
    }
    let remat_name = match remat {
        Remat::None => "none",
        Remat::Minimal => "minimal",
        Remat::Full => "full",
    };
    let mut sets = vec![
        format!("mesh.ici_data={}", mesh.ici.0),
        format!("mesh.ici_fsdp={}", mesh.ici.1),
        format!("mesh.ici_tensor={}", mesh.t),
        "mesh.ici_pipeline=1".to_string(),
        format!("mesh.ici_seq={}", mesh.s),
        format!("mesh.dcn_data={}", mesh.dcn.0),
        format!("mesh.dcn_fsdp={}", mesh.dcn.1),
        "mesh.dcn_tensor=1".to_string(),
        format!("mesh.dcn_pipeline={}", mesh.p),
        "mesh.dcn_seq=1".to_string(),
        format!("train.batch_size={batch}"),
        format!("train.grad_accum={accum}"),
        format!("train.pipeline_microbatches={count}"),
        format!("train.remat=\"{remat_name}\""),
    ];
    if base.model.moe.is_some() {
        sets.extend([format!("mesh.ici_expert={}", mesh.e), "mesh.dcn_expert=1".to_string()]);
    }
    if mesh.p > 1 {
        let (schedule, split) = if v > 1 { ("interleaved", "compute") } else { ("1f1b", "memory") };
        sets.push(format!("train.pipeline_schedule=\"{schedule}\""));
        sets.push(format!("train.pipeline_virtual_stages={v}"));
        sets.push(format!("train.pipeline_split=\"{split}\""));
        sets.push("train.pipeline_layers=[]".to_string());
    }
    (c, sets)
}

/// A candidate's memory and step time; `None` when the engine refuses it.
fn evaluate(
    base: &Config,
    hw: &Hardware,
    mesh: &Mesh,
    remat: Remat,
    split: Split,
    devices: usize,
    memo: &mut Memo,
) -> Option<Row> {
    let (mut c, sets) = configure(base, mesh, remat, split);
    if mesh.p > 1 && split.virtual_stages == 1 {
        // The memory split ([`ParallelPlan::memory_split`]), computed here from memoised
        // stage estimates and given as the layers: the same stages, as the sets reproduce.
        c.train.pipeline_layers = memory_split(&c, hw, memo)?;
    }
    let mut plan = ParallelPlan::resolve(&c, hw.devices_per_node, hw.nodes).ok()?;
    let memory = if plan.virtual_stages == 1 {
        // The fullest stage's, as `plan.estimate` counts it, from the memoised stage estimates.
        let stages: Vec<_> = plan.stages.iter().map(|s| s.layers.clone()).collect();
        let bytes = stages.into_iter().enumerate().map(|(s, layers)| stage_bytes(&c, &mut plan, s, layers, memo));
        bytes.max().expect("at least one stage")
    } else {
        plan.estimate(&c, CUDA).total()
    };
    let Split { mb, count, accum, virtual_stages } = split;
    let bubble = plan.bubble_fraction();
    let m = &c.model;
    let seq_len = c.train.seq_len;
    let global_tokens = (plan.global_sequences() * accum * seq_len) as f64;
    let recompute = if remat == Remat::Full { 4.0 / 3.0 } else { 1.0 };
    let compute = m.train_flops_per_token(seq_len) * global_tokens * recompute
        / (devices as f64 * hw.peak_tflops * 1e12 * hw.mfu)
        / (1.0 - bubble);
    // Bytes each device sends per step, by axis; a link per axis.
    let (t, s, p) = (mesh.t as f64, mesh.s as f64, mesh.p as f64);
    let f = (mesh.ici.1 * mesh.dcn.1) as f64;
    let d = (mesh.ici.0 * mesh.dcn.0) as f64;
    let micro = (accum * count) as f64;
    let layers = m.n_layers as f64 / p;
    let local_tokens = (mb * seq_len) as f64 / s;
    let ring = |n: f64| if n > 1.0 { (n - 1.0) / n } else { 0.0 };
    let tensor_sums = if remat == Remat::Full { 6.0 } else { 4.0 };
    let vocab = 2.0 * local_tokens * m.d_model as f64 * 2.0 + 3.0 * local_tokens * 4.0;
    let tensor = micro * 2.0 * ring(t) * (layers * tensor_sums * local_tokens * m.d_model as f64 * 2.0 + vocab);
    let qkv = (m.q_dim() + 2 * m.kv_dim()) as f64 / t;
    let seq_moves = if remat == Remat::Full { 4.0 } else { 3.0 };
    let seq = micro * layers * seq_moves * ring(s) * s * local_tokens * qkv * 2.0;
    // The expert axis divides the experts' parameters; the rest are the device's whole.
    let e = mesh.e as f64;
    let experts = m.expert_params() as f64;
    let (dense, experts) = ((m.param_count().total as f64 - experts) / (t * p), experts / (t * p * e));
    // FSDP shards over fsdp × seq: two bf16 gathers and an f32 reduce-scatter a micro-batch.
    let fsdp = micro * ring(f * s) * (dense + experts) * (2.0 * 2.0 + 4.0);
    let data = 2.0 * (ring(d) * dense + ring(d / e) * experts) / (f * s) * 4.0;
    let exchanges = super::experts::all_to_alls_per_layer(remat) as f64;
    // Each all-to-all moves the device's e fixed-size parts, every row its members could route
    // one another (`MoeConfig::most_received`: e · N · k dropless, less under a capacity factor).
    let rows = m.moe.as_ref().map_or(0, |moe| moe.most_received(local_tokens.ceil() as usize, mesh.e)) as f64;
    // Only the layers with experts exchange tokens (`moe.dense_layers` have none).
    let moe_layers = m.moe.as_ref().map_or(0, |moe| moe.moe_layers(m.n_layers)) as f64 / p;
    let expert = micro * moe_layers * exchanges * ring(e) * rows * m.d_model as f64 * 2.0;
    let pipeline =
        if mesh.p > 1 { virtual_stages as f64 * micro * 2.0 * local_tokens * m.d_model as f64 * 2.0 } else { 0.0 };
    let link = |dcn: bool| if dcn { hw.dcn_bytes_per_s } else { hw.ici_bytes_per_s };
    let comm = tensor / link(false)
        + seq / link(false)
        + fsdp / link(mesh.dcn.1 > 1)
        + data / link(mesh.dcn.0 > 1)
        + expert / link(false)
        + pipeline / link(true);
    Some(Row {
        sets,
        memory_per_device_bytes: memory,
        step_time_estimate_s: compute + comm,
        bubble,
        mesh: {
            let data = if mesh.e > 1 { format!("{d}(EP{})", mesh.e) } else { d.to_string() };
            match virtual_stages {
                1 => format!("{data} x {} x {} x {} x {}", f, mesh.t, mesh.p, mesh.s),
                v => format!("{data} x {} x {} x {}(V{v}) x {}", f, mesh.t, mesh.p, mesh.s),
            }
        },
    })
}

/// [`ParallelPlan::memory_split`] of `c` (a 1F1B pipeline), the same split found with fewer
/// estimates: a stage's bytes grow with its layers, so the most layers it takes under a bound
/// are found by doubling then bisecting, and the least bound that is enough by doubling then
/// bisecting over the bytes, each stage estimate memoised across candidates (it depends on
/// the mesh's sizes, the policy, the micro-batch and the slots in flight, not on the rest of
/// the mesh). `None` when the engine refuses the plan.
fn memory_split(c: &Config, hw: &Hardware, memo: &mut Memo) -> Option<Vec<usize>> {
    let n = c.model.n_layers;
    let p = (c.mesh.dcn_pipeline * c.mesh.ici_pipeline) as usize;
    let most = n + 1 - p;
    // A plan of the mesh with any layers: its stage models and slots are what the split reads.
    let mut probe = c.clone();
    probe.train.pipeline_layers = std::iter::repeat_n(1, p - 1).chain([most]).collect();
    let plan = ParallelPlan::resolve(&probe, hw.devices_per_node, hw.nodes).ok()?;
    let mut stages = StageBytes { c, plan, memo, most };
    // The least bound that is enough: at least each stage's one layer, raised by a doubling
    // step (from a layer's bytes, so that no stage is asked about many more layers than it
    // takes) until enough, then bisected. `enough` changes only at the stages' totals, so the
    // least enough integer is the least enough total, the bound `memory_split` finds among them.
    let one = (0..p).map(|s| stages.bytes(s, 1)).max().expect("at least one stage");
    let layer = (0..p).map(|s| stages.bytes(s, 2.min(most)).saturating_sub(stages.bytes(s, 1))).max();
    let (mut lo, mut hi, mut step) = (one - 1, one, layer.unwrap_or(1).max(1));
    while !stages.enough(hi) {
        (lo, hi, step) = (hi, hi.saturating_add(step), step.saturating_mul(2));
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if stages.enough(mid) { hi = mid } else { lo = mid }
    }
    let mut sizes = stages.fits(hi);
    // Give back the layers beyond n, from the stages holding the most, as `memory_split` does.
    let mut extra = sizes.iter().sum::<usize>() - n;
    while extra > 0 {
        let s = (0..p).rev().max_by_key(|&s| sizes[s]).expect("at least one stage");
        sizes[s] -= 1;
        extra -= 1;
    }
    Some(sizes)
}

/// The stage estimates of [`memory_split`]: a device of stage `s` holding `k` alike layers
/// (`0..k`, as [`ParallelPlan::memory_split`] takes them), memoised.
struct StageBytes<'a> {
    c: &'a Config,
    plan: ParallelPlan,
    memo: &'a mut Memo,
    most: usize,
}

impl StageBytes<'_> {
    fn bytes(&mut self, s: usize, k: usize) -> usize {
        stage_bytes(self.c, &mut self.plan, s, 0..k, self.memo)
    }

    /// The most layers (0 to `most`) stage `s` takes under `bound`: doubling, then bisecting.
    fn take(&mut self, s: usize, bound: usize) -> usize {
        if self.bytes(s, 1) > bound {
            return 0;
        }
        let most = self.most;
        // bytes(lo) is within the bound; bytes(hi) is not, or hi is `most`.
        let (mut lo, mut hi) = (1, 2.min(most));
        while hi < most && self.bytes(s, hi) <= bound {
            (lo, hi) = (hi, (2 * hi).min(most));
        }
        if self.bytes(s, hi) <= bound {
            return hi;
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.bytes(s, mid) <= bound { lo = mid } else { hi = mid }
        }
        lo
    }

    fn fits(&mut self, bound: usize) -> Vec<usize> {
        (0..self.plan.stages.len()).map(|s| self.take(s, bound)).collect()
    }

    fn enough(&mut self, bound: usize) -> bool {
        let k = self.fits(bound);
        k.iter().all(|&k| k >= 1) && k.iter().sum::<usize>() >= self.c.model.n_layers
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|k| n.is_multiple_of(*k)).collect()
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::recipe::{Override, resolve};

    fn h100(nodes: usize, memory_gib: usize) -> Hardware {
        Hardware {
            nodes,
            devices_per_node: 8,
            memory: memory_gib << 30,
            reserve: 1 << 30,
            peak_tflops: 989.0,
            mfu: 0.4,
            ici_bytes_per_s: 450e9,
            dcn_bytes_per_s: 50e9,
        }
    }

    /// llama3.1-8b at 131,072 tokens on one node of 8 H100s fits with a seq axis, the fastest
    /// plan has one, and every plan that fits splits the sequence or (vocabulary parallelism)
    /// the 128k vocabulary's logits over a tensor axis: data and FSDP alone do not fit.
    #[test]
    fn a_long_sequence_fits_one_node_only_with_a_seq_axis() {
        let c = resolve("llama3.1-8b", &Override::from_list("train.seq_len=131072", "test")).unwrap().config;
        let plans = search(&c, &h100(1, 80), 8).unwrap();
        assert!(!plans.fits.is_empty(), "nothing fits; closest {:?}", plans.closest);
        let unsplit = ["mesh.ici_seq=1", "mesh.ici_tensor=1"].map(String::from);
        for row in &plans.fits {
            assert!(!unsplit.iter().all(|s| row.sets.contains(s)), "{:?} fits with data and FSDP alone", row.sets);
        }
        assert!(!plans.fits[0].sets.contains(&unsplit[0]), "the fastest plan has no seq axis: {:?}", plans.fits[0]);
        let best = &plans.fits[0];
        assert!(best.memory_per_device_bytes + (1 << 30) <= 80 << 30);
    }

    /// With stages, the search weighs interleaved 1F1B: a row with two virtual stages has the
    /// smaller bubble (P − 1)/(V·M + P − 1) of its one-stage twin, and its `sets` reproduce it.
    #[test]
    fn stages_are_also_searched_interleaved() {
        let c = resolve("llama3.1-70b", &Override::from_list("train.seq_len=8192", "test")).unwrap().config;
        let plans = search(&c, &h100(4, 80), 32).unwrap();
        let pipeline_keys = ["train.pipeline_schedule", "train.pipeline_virtual_stages", "train.pipeline_split"];
        let others = |row: &Row| -> Vec<String> {
            row.sets.iter().filter(|s| !pipeline_keys.iter().any(|k| s.starts_with(k))).cloned().collect()
        };
        let set = |row: &Row, key: &str| -> String {
            row.sets.iter().find_map(|s| s.strip_prefix(&format!("{key}="))).unwrap().to_string()
        };
        let two = plans
            .fits
            .iter()
            .find(|r| r.sets.contains(&"train.pipeline_virtual_stages=2".to_string()))
            .expect("no interleaved plan fits");
        assert!(two.sets.contains(&"train.pipeline_schedule=\"interleaved\"".to_string()), "{:?}", two.sets);
        let one = plans
            .fits
            .iter()
            .find(|r| r.sets.contains(&"train.pipeline_virtual_stages=1".to_string()) && others(r) == others(two))
            .expect("the interleaved plan's one-stage twin does not fit");
        let (p, m) = (
            set(two, "mesh.dcn_pipeline").parse::<f64>().unwrap(),
            set(two, "train.pipeline_microbatches").parse::<f64>().unwrap(),
        );
        assert!((two.bubble - (p - 1.0) / (2.0 * m + p - 1.0)).abs() < 1e-12, "bubble {}", two.bubble);
        assert!(two.bubble < one.bubble, "{} against {}", two.bubble, one.bubble);
        // Its sets give the same plan.
        let sets = two.sets.join(" ");
        let again = resolve("llama3.1-70b", &Override::from_list(&format!("train.seq_len=8192 {sets}"), "test"))
            .unwrap()
            .config;
        let plan = ParallelPlan::resolve(&again, 8, 4).unwrap();
        assert_eq!(plan.virtual_stages, 2);
        assert_eq!(plan.estimate(&again, Target::Cuda { sm_count: 132 }).total(), two.memory_per_device_bytes);
    }

    /// GPT-OSS's sizes against H100s of 80 GiB. Training keeps 18 bytes an element (bf16 and
    /// f32 parameters, f32 gradients and AdamW moments; the model card's single 80 GB GPU is
    /// MXFP4 inference): gpt-oss-20b (20.9B) fits no single device but fits one node of 8,
    /// its first plan within the memory with the reserve; gpt-oss-120b (116.8B) does not fit
    /// one node, its state alone 245 GiB of each of the 8, the search's closest candidate
    /// above that bound. Four nodes are the fewest that fit it (three miss by 4 GiB): the first
    /// plan of `engine recipes plan gpt-oss-120b --nodes 4 --devices-per-node 8 --memory 80`
    /// (a 16 s search on 2 cores, not repeated here), EP 2 x tensor 4 x pipeline 4 of 16
    /// micro-batches under minimal recomputation, needs 75.8 GiB of its fullest device by the
    /// engine's estimate: with the reserve, within the 80 GiB.
    #[test]
    fn gpt_oss_20b_fits_one_node_and_120b_four() {
        let small = resolve("gpt-oss-20b", &[]).unwrap().config;
        let alone = search(&small, &Hardware { devices_per_node: 1, ..h100(1, 80) }, 1).unwrap();
        assert!(alone.fits.is_empty(), "gpt-oss-20b fits one device: {:?}", alone.fits[0]);
        let node = search(&small, &h100(1, 80), 8).unwrap();
        let first = node.fits.first().unwrap_or_else(|| panic!("gpt-oss-20b: closest {:?}", node.closest));
        assert!(first.memory_per_device_bytes + (1 << 30) <= 80 << 30, "{first:?}");
        let (memory, sets) = (gib(first.memory_per_device_bytes), first.sets.join(" "));
        crate::say!("gpt-oss-20b on 1 x 8 H100s: first plan {sets} ({memory:.1} GiB)");

        let c = resolve("gpt-oss-120b", &[]).unwrap().config;
        let state = 18 * Layout::new(&c.model).len;
        let one = search(&c, &h100(1, 80), 8).unwrap();
        assert!(one.fits.is_empty(), "gpt-oss-120b fits one node of 8: {:?}", one.fits[0]);
        let closest = one.closest.expect("a closest candidate");
        assert!(closest.memory_per_device_bytes >= state / 8, "{closest:?} under {:.1} GiB", gib(state / 8));
        let first = "mesh.ici_data=2 mesh.ici_fsdp=1 mesh.ici_tensor=4 mesh.ici_pipeline=1 mesh.ici_seq=1 \
                     mesh.dcn_data=1 mesh.dcn_fsdp=1 mesh.dcn_tensor=1 mesh.dcn_pipeline=4 mesh.dcn_seq=1 \
                     mesh.ici_expert=2 mesh.dcn_expert=1 train.batch_size=1 train.grad_accum=1 \
                     train.pipeline_microbatches=16 train.remat=\"minimal\" train.pipeline_schedule=\"1f1b\" \
                     train.pipeline_virtual_stages=1 train.pipeline_split=\"memory\"";
        let c = resolve("gpt-oss-120b", &Override::from_list(first, "test")).unwrap().config;
        let memory = ParallelPlan::resolve(&c, 8, 4).unwrap().estimate(&c, CUDA).total();
        crate::say!("gpt-oss-120b on 4 x 8 H100s: {first} ({:.1} GiB)", gib(memory));
        assert!(memory + (1 << 30) <= 80 << 30, "{:.1} GiB", gib(memory));
    }

    /// Gemma 3 27B (the text model: 27.0 B parameters, 18 bytes each of training state, 453
    /// GiB) trains on one node of 8 H100s of 80 GiB in its first plan, at seq 4096.
    #[test]
    fn gemma3_27b_fits_one_node() {
        let c = resolve("gemma3-27b", &[]).unwrap().config;
        let node = search(&c, &h100(1, 80), 8).unwrap();
        let first = node.fits.first().unwrap_or_else(|| panic!("gemma3-27b: closest {:?}", node.closest));
        assert!(first.memory_per_device_bytes + (1 << 30) <= 80 << 30, "{first:?}");
        let (memory, sets) = (gib(first.memory_per_device_bytes), first.sets.join(" "));
        crate::say!("gemma3-27b on 1 x 8 H100s: first plan {sets} ({memory:.1} GiB)");
    }

    /// The planner's memory split is the engine's ([`ParallelPlan::memory_split`]), dense
    /// layers among experts' included, and the state bound never exceeds a candidate's estimate.
    #[test]
    fn the_memoised_memory_split_is_the_engines() {
        let sets = "model.n_layers=9 model.moe.dense_layers=[0,1] train.seq_len=64";
        let base = resolve("tiny-deepseek-v3", &Override::from_list(sets, "test")).unwrap().config;
        let hw = h100(4, 80);
        let mut memo = Memo::default();
        let mut checked = 0;
        for (t, p, e) in [(1, 2, 1), (2, 4, 2), (1, 4, 4), (2, 2, 1)] {
            let mesh = Mesh { t, s: 1, p, e, ici: (8 / t, 1), dcn: (4 / p, 1) };
            for remat in [Remat::Full, Remat::None] {
                for (mb, count) in [(1, p), (2, 2 * p), (1, 4 * p)] {
                    let split = Split { mb, count, accum: 1, virtual_stages: 1 };
                    let (c, _) = configure(&base, &mesh, remat, split);
                    let engine = ParallelPlan::resolve(&c, 8, 4).unwrap();
                    let sizes: Vec<usize> = engine.stages.iter().map(|s| s.layers.len()).collect();
                    assert_eq!(memory_split(&c, &hw, &mut memo).unwrap(), sizes, "t {t} p {p} e {e} mb {mb} M {count}");
                    let row = evaluate(&base, &hw, &mesh, remat, split, 32, &mut memo).unwrap();
                    assert_eq!(row.memory_per_device_bytes, engine.estimate(&c, CUDA).total());
                    assert!(state_lower_bound(&base, &mesh, &mut memo) <= row.memory_per_device_bytes);
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 24);
    }
}
