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
//!   mixture-of-experts layer's `[tokens · top_k, d_model]` bf16 rows per micro-batch (dispatch
//!   and return, forward and backward; six with full recomputation), `(e − 1)/e` of them
//!   leaving the device. An expert axis divides the experts' parameters: FSDP gathers and
//!   reduce-scatters `1/e` of them, and the data axis sums them over its `d/e` replicas.

use anyhow::{Result, bail};

use super::plan::ParallelPlan;
use crate::config::{BatchSize, Config, PipelineSchedule, PipelineSplit, Remat};
use crate::model::memory::Target;

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
    let mut fits = Vec::new();
    let mut closest: Option<Row> = None;
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
                            for remat in [Remat::Full, Remat::Minimal, Remat::None] {
                                let per_shard = global_batch / shards;
                                candidates(base, hw, &mesh, remat, per_shard, devices, &mut fits, &mut closest);
                            }
                        }
                    }
                }
            }
        }
    }
    fits.sort_by(|a, b| a.step_time_estimate_s.total_cmp(&b.step_time_estimate_s));
    let closest = if fits.is_empty() { closest } else { None };
    Ok(Plans { fits, closest })
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
                let Some(row) = evaluate(base, hw, mesh, remat, split, devices) else {
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
fn evaluate(base: &Config, hw: &Hardware, mesh: &Mesh, remat: Remat, split: Split, devices: usize) -> Option<Row> {
    let (c, sets) = configure(base, mesh, remat, split);
    let plan = ParallelPlan::resolve(&c, hw.devices_per_node, hw.nodes).ok()?;
    let memory = plan.estimate(&c, Target::Cuda { sm_count: 132 }).total();
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
    let top_k = m.moe.as_ref().map_or(0, |moe| moe.top_k) as f64;
    let expert = micro * layers * exchanges * ring(e) * local_tokens * top_k * m.d_model as f64 * 2.0;
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
}
