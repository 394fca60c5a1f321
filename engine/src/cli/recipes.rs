//! `engine recipes list|show|plan`.

use anyhow::Result;
use clap::Subcommand;
use engine::config::{Config, Remat, recipe};
use engine::model::memory::{Estimate, Target};
use engine::parallel::mesh::Axis;
use engine::parallel::plan::ParallelPlan;

use super::RecipeArgs;

#[derive(Subcommand)]
pub enum RecipesCommand {
    /// List the built-in recipes with their sizes.
    List,
    /// Show a recipe resolved (defaults, `extends`, overrides), its parameter count and
    /// training FLOPs per token.
    Show {
        /// Recipe name or TOML file.
        #[arg(value_name = "NAME|FILE")]
        recipe: String,
        /// Override a key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Devices per node for the memory plan, filling a mesh.ici_* size of -1 [default: the
        /// product of the recipe's ici sizes, a -1 counting as 1].
        #[arg(long, value_name = "N")]
        devices: Option<usize>,
        /// Nodes for the memory plan, filling a mesh.dcn_* size of -1 [default: the product of
        /// the recipe's dcn sizes, a -1 counting as 1].
        #[arg(long, value_name = "N")]
        nodes: Option<usize>,
        /// Print one JSON object (sizes, FLOPs, mesh, memory per device) instead of the text.
        #[arg(long)]
        json: bool,
    },
    /// Search the meshes (data, FSDP, tensor, pipeline, seq), recomputation policies and batch
    /// splits under which a recipe fits the memory of each device, fastest first by an
    /// estimated step time (FLOPs at an assumed MFU, plus each axis's communication at assumed
    /// bandwidths). Each row gives the `--set`s that reproduce it.
    Plan {
        /// Recipe name or TOML file.
        #[arg(value_name = "NAME|FILE")]
        recipe: String,
        /// Override a key (repeatable), before the search sets the mesh and batch keys.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Nodes.
        #[arg(long, value_name = "N")]
        nodes: usize,
        /// Devices per node.
        #[arg(long, value_name = "G")]
        devices_per_node: usize,
        /// Memory per device, GiB.
        #[arg(long, value_name = "GIB")]
        memory: f64,
        /// Sequences per optimizer step [default: the recipe's train.batch_size x devices x
        /// train.grad_accum].
        #[arg(long, value_name = "SEQUENCES")]
        global_batch: Option<usize>,
        /// Assumed model FLOPs utilisation.
        #[arg(long, value_name = "FRACTION", default_value_t = 0.4)]
        mfu: f64,
        /// Peak dense bf16 TFLOP/s of a device (an H100 SXM's).
        #[arg(long, value_name = "TFLOPS", default_value_t = 989.0)]
        peak_tflops: f64,
        /// Bandwidth a device sends at within a node, GB/s (NVLink 4, one direction).
        #[arg(long, value_name = "GB_PER_S", default_value_t = 450.0)]
        ici_gbps: f64,
        /// Bandwidth a device sends at to other nodes, GB/s (a 400 Gb/s NIC per GPU).
        #[arg(long, value_name = "GB_PER_S", default_value_t = 50.0)]
        dcn_gbps: f64,
        /// GiB of each device kept for the CUDA context and NCCL.
        #[arg(long, value_name = "GIB", default_value_t = 1.0)]
        reserve: f64,
        /// Rows printed (the text; --json lists all).
        #[arg(long, value_name = "N", default_value_t = 10)]
        top: usize,
        /// Print a JSON list, best first, of objects with sets, memory_per_device_bytes and
        /// step_time_estimate_s.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: RecipesCommand) -> Result<()> {
    match cmd {
        RecipesCommand::List => {
            println!("{:<30} {:>16}  description", "recipe", "parameters");
            for (name, _) in recipe::builtin() {
                let r = engine::config::resolve(name, &[])?;
                let count = r.config.model.param_count();
                println!("{name:<30} {:>16}  {}", group(count.total), r.config.description);
            }
            Ok(())
        }
        RecipesCommand::Show { recipe, set, devices, nodes, json } => {
            if devices == Some(0) {
                anyhow::bail!("--devices 0: a plan needs at least one device per node");
            }
            if nodes == Some(0) {
                anyhow::bail!("--nodes 0: a plan needs at least one node");
            }
            let r = RecipeArgs { recipe, set }.resolve(&[])?;
            let plan = plan_of(&r.config, devices, nodes)?;
            let c = &r.config.train;
            let tokens = plan.global_sequences() as u128 * c.seq_len as u128 * c.grad_accum as u128;
            if tokens > u64::MAX as u128 {
                anyhow::bail!(
                    "{} sequences x train.seq_len = {} x train.grad_accum = {} is {tokens} tokens per step, more than this engine counts (at most 2^64 - 1)",
                    plan.global_sequences(),
                    c.seq_len,
                    c.grad_accum
                );
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&show_json(&r.name, &r.config, &plan))?);
            } else {
                print!("{}", show(&r.name, &r.config, &plan));
            }
            Ok(())
        }
        RecipesCommand::Plan {
            recipe,
            set,
            nodes,
            devices_per_node,
            memory,
            global_batch,
            mfu,
            peak_tflops,
            ici_gbps,
            dcn_gbps,
            reserve,
            top,
            json,
        } => {
            let positive = [
                ("--memory", memory),
                ("--mfu", mfu),
                ("--peak-tflops", peak_tflops),
                ("--ici-gbps", ici_gbps),
                ("--dcn-gbps", dcn_gbps),
            ];
            for (flag, value) in positive {
                if !(value.is_finite() && value > 0.0) {
                    anyhow::bail!("{flag} {value}: a plan needs a positive number");
                }
            }
            if nodes == 0 || devices_per_node == 0 {
                anyhow::bail!(
                    "--nodes {nodes} --devices-per-node {devices_per_node}: a plan needs at least one node of one device"
                );
            }
            if mfu > 1.0 {
                anyhow::bail!("--mfu {mfu}: a share of the peak is at most 1");
            }
            if !(reserve.is_finite() && reserve >= 0.0) {
                anyhow::bail!("--reserve {reserve}: a plan needs a number of GiB, 0 or more");
            }
            let devices = max_devices(devices_per_node as u128, nodes as u128)?;
            let r = RecipeArgs { recipe, set }.resolve(&[])?;
            let c = &r.config;
            let global = match global_batch {
                Some(0) => anyhow::bail!("--global-batch 0: a step needs at least one sequence"),
                Some(g) => g,
                None => {
                    let g = c.train.batch_size.0 * (devices * c.train.grad_accum) as f64;
                    if g < 1.0 || g.fract() != 0.0 {
                        anyhow::bail!(
                            "train.batch_size = {} x {devices} devices x train.grad_accum = {} is {g} sequences, not a whole number: give --global-batch",
                            c.train.batch_size,
                            c.train.grad_accum
                        );
                    }
                    g as usize
                }
            };
            let gib = |x: f64| (x * (1u64 << 30) as f64) as usize;
            let hw = engine::parallel::planner::Hardware {
                nodes,
                devices_per_node,
                memory: gib(memory),
                reserve: gib(reserve),
                peak_tflops,
                mfu,
                ici_bytes_per_s: ici_gbps * 1e9,
                dcn_bytes_per_s: dcn_gbps * 1e9,
            };
            let plans = engine::parallel::planner::search(c, &hw, global)?;
            if plans.fits.is_empty() {
                let Some(close) = plans.closest else {
                    anyhow::bail!(
                        "recipe `{}`: no mesh of {nodes} x {devices_per_node} devices takes a global batch of {global} sequences (the engine refuses every split)",
                        r.name
                    );
                };
                let over = close.memory_per_device_bytes + hw.reserve - hw.memory;
                anyhow::bail!(
                    "recipe `{}`: nothing fits {memory} GiB per device on {nodes} x {devices_per_node} devices; the closest needs {:.1} GiB ({:.1} GiB over, with {reserve} GiB kept for CUDA and NCCL): --set {}",
                    r.name,
                    engine::backend::gib(close.memory_per_device_bytes),
                    engine::backend::gib(over),
                    close.sets.join(" --set ")
                );
            }
            if json {
                let rows: Vec<serde_json::Value> = plans
                    .fits
                    .iter()
                    .map(|row| {
                        serde_json::json!({
                            "sets": row.sets,
                            "memory_per_device_bytes": row.memory_per_device_bytes,
                            "step_time_estimate_s": row.step_time_estimate_s,
                            "bubble_fraction": row.bubble,
                            "mesh": row.mesh,
                        })
                    })
                    .collect();
                if plans.pruned > 0 {
                    eprintln!(
                        "# {} of {} meshes skipped unestimated: their parameters, gradients, moments and FSDP buffers alone exceed {memory} GiB less {reserve} GiB",
                        plans.pruned, plans.meshes
                    );
                }
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!(
                    "# recipe {}: {} plans fit {memory} GiB per device on {nodes} x {devices_per_node} devices, global batch {global} x {}; \
                     step time at MFU {mfu} of {peak_tflops} TFLOP/s, ICI {ici_gbps} GB/s, DCN {dcn_gbps} GB/s (the {} fastest)",
                    r.name,
                    plans.fits.len(),
                    c.train.seq_len,
                    top.min(plans.fits.len())
                );
                println!(
                    "{:>4} {:>10} {:>11} {:>8}  mesh (data x fsdp x tensor x pipeline x seq), --set",
                    "rank", "step (s)", "memory", "bubble"
                );
                if plans.pruned > 0 {
                    println!(
                        "# {} of {} meshes skipped unestimated: their parameters, gradients, moments and FSDP buffers alone exceed {memory} GiB less {reserve} GiB",
                        plans.pruned, plans.meshes
                    );
                }
                for (i, row) in plans.fits.iter().take(top).enumerate() {
                    println!(
                        "{:>4} {:>10.3} {:>7.1} GiB {:>7.1}%  {}: --set {}",
                        i + 1,
                        row.step_time_estimate_s,
                        engine::backend::gib(row.memory_per_device_bytes),
                        100.0 * row.bubble,
                        row.mesh,
                        row.sets.join(" --set ")
                    );
                }
            }
            Ok(())
        }
    }
}

/// The parallel plan the memory plan is for: the recipe's mesh over `devices` per node and
/// `nodes` (by default, what the explicit sizes multiply to).
fn plan_of(c: &Config, devices: Option<usize>, nodes: Option<usize>) -> Result<ParallelPlan> {
    let m = &c.mesh;
    // In u128, saturating: absurd sizes must not wrap (to 0 devices) before they are refused.
    let product = |sizes: [i64; 5]| sizes.iter().fold(1u128, |a, &s| a.saturating_mul(s.max(1) as u128));
    let devices = devices
        .map_or_else(|| product([m.ici_data, m.ici_fsdp, m.ici_tensor, m.ici_pipeline, m.ici_seq]), |d| d as u128);
    let nodes =
        nodes.map_or_else(|| product([m.dcn_data, m.dcn_fsdp, m.dcn_tensor, m.dcn_pipeline, m.dcn_seq]), |n| n as u128);
    max_devices(devices, nodes)?;
    ParallelPlan::resolve(c, devices as usize, nodes as usize)
}

/// The most devices a plan is for, all nodes together: 2^20, beyond any cluster built, and few
/// enough that nothing counted from them overflows or takes long to search.
const MAX_DEVICES: u128 = 1 << 20;

/// `devices_per_node × nodes`, refused beyond [`MAX_DEVICES`] with the arithmetic.
fn max_devices(devices_per_node: u128, nodes: u128) -> Result<usize> {
    let total = devices_per_node.saturating_mul(nodes);
    if total > MAX_DEVICES {
        anyhow::bail!(
            "{devices_per_node} devices per node x {nodes} nodes = {total} devices, more than this engine plans for (at most {MAX_DEVICES})"
        );
    }
    Ok(total as usize)
}

/// One device's memory plan under `plan`, for CUDA (the H100's 132 multiprocessors size a
/// scratch buffer) and the CPU.
fn plans(c: &Config, plan: &ParallelPlan) -> (Estimate, Estimate) {
    (plan.estimate(c, Target::Cuda { sm_count: 132 }), plan.estimate(c, Target::Cpu))
}

/// `engine recipes show --json`.
fn show_json(name: &str, c: &Config, plan: &ParallelPlan) -> serde_json::Value {
    let count = c.model.param_count();
    let part = |e: &Estimate| {
        serde_json::json!({
            "total_bytes": e.total(),
            "parameters_bytes": e.parameters,
            "gradients_bytes": e.gradients,
            "optimizer_bytes": e.optimizer,
            "activations_bytes": e.activations,
            "scratch_bytes": e.scratch,
            "communication_bytes": e.communication,
        })
    };
    let (gpu, cpu) = plans(c, plan);
    let mesh = &plan.mesh;
    let size = |a| mesh.size(a);
    let stages = plan.stage_estimates(c, Target::Cuda { sm_count: 132 });
    let stages: Vec<serde_json::Value> = stages
        .iter()
        .map(|s| {
            let runs = std::iter::once(&s.layers).chain(&s.later).zip(&s.chunk_in_flight);
            let virtual_stages: Vec<serde_json::Value> = runs
                .map(|(l, n)| serde_json::json!({ "layers": [l.start, l.end], "in_flight_microbatches": n }))
                .collect();
            serde_json::json!({
                "layers": [s.layers.start, s.layers.end],
                "in_flight_microbatches": s.in_flight,
                "virtual_stages": virtual_stages,
                "cuda": part(&s.estimate),
            })
        })
        .collect();
    serde_json::json!({
        "recipe": name,
        "parameters": count.total,
        "active_parameters": count.active,
        "flops_per_token": c.model.train_flops_per_token(c.train.seq_len),
        "tokens_per_step": tokens_per_step(c, plan),
        "mesh": {
            "devices": mesh.devices(),
            "data": size(Axis::Data),
            "fsdp": size(Axis::Fsdp),
            "tensor": size(Axis::Tensor),
            "pipeline": size(Axis::Pipeline),
            "seq": size(Axis::Seq),
            "expert": mesh.expert_size(),
            "ici": mesh.ici,
            "dcn": mesh.dcn,
        },
        "memory_per_device": { "cuda": part(&gpu), "cpu": part(&cpu) },
        "pipeline": {
            "microbatches": c.train.pipeline_microbatches,
            "schedule": c.train.pipeline_schedule,
            "virtual_stages": plan.virtual_stages,
            "split": split_name(c),
            "bubble_fraction": plan.bubble_fraction(),
            "stages": stages,
        },
        "expert_axis": ExpertPlan::of(c, plan).map(|e| e.json()),
    })
}

/// How the layers were split into stages: `train.pipeline_layers`, or `train.pipeline_split`.
fn split_name(c: &Config) -> &'static str {
    match (c.train.pipeline_layers.is_empty(), c.train.pipeline_split) {
        (false, _) => "explicit",
        (true, engine::config::PipelineSplit::Compute) => "compute",
        (true, engine::config::PipelineSplit::Memory) => "memory",
    }
}

/// Tokens of one optimizer step, all devices together: `batch_size × devices` sequences per
/// micro-batch.
fn tokens_per_step(c: &Config, plan: &ParallelPlan) -> usize {
    plan.global_sequences() * c.train.seq_len * c.train.grad_accum
}

/// The text of `engine recipes show`.
fn show(name: &str, c: &Config, plan: &ParallelPlan) -> String {
    let m = &c.model;
    let count = m.param_count();
    let seq = c.train.seq_len;
    let flops = m.train_flops_per_token(seq);
    let mut out = format!("# recipe {name}: {}\n", c.description);
    out += &toml::to_string(c).expect("a config serialises");
    out += "\n# size\n";
    out += &format!("parameters         {:>20}  ({:.2} B)\n", group(count.total), count.total as f64 / 1e9);
    if m.moe.is_some() {
        out += &format!("active per token   {:>20}  ({:.2} B)\n", group(count.active), count.active as f64 / 1e9);
        // What OpenAI's GPT-OSS card counts as active.
        let lookups = count.active - count.embedding;
        out += &format!("  embedding aside  {:>20}  ({:.2} B)\n", group(lookups), lookups as f64 / 1e9);
    }
    out += &format!("embedding          {:>20}\n", group(count.embedding));
    out += &format!(
        "training FLOPs/token at seq_len {seq}: {:.4e}  (6 x {} matmul parameters + attention {:.4e})\n",
        flops,
        group(((flops - attention_flops(c)) / 6.0).round() as u64),
        attention_flops(c)
    );
    out += &format!(
        "tokens per step    {:>20}  (batch {} x {} devices x seq {} x grad_accum {})\n",
        group(tokens_per_step(c, plan) as u64),
        c.train.batch_size,
        plan.mesh.devices(),
        seq,
        c.train.grad_accum
    );
    out += &memory_table(c, plan);
    out += "\nFLOP convention: a multiply-add is 2 FLOPs and training costs 3 forward passes, so a token costs\n\
            6 x (weights it multiplies with: projections, routed experts, output head; not the input lookup)\n\
            + 12 x layers x heads x head_dim x K, K = mean keys a query attends to. Causal halving is applied:\n\
            K = (seq_len + 1) / 2 under the causal mask, min(i + 1, window) per query with a sliding window.\n";
    if c.model.is_gpt() {
        out += "GPT: parameters include the position table (max_seq_len x d_model, with the embedding), the\n\
                projections' biases and the LayerNorms' weights and biases; FLOPs count neither the position\n\
                lookup nor the bias additions.\n";
    }
    out
}

/// Estimated memory per device of `plan`'s mesh for the recipe's batch shape, on CUDA (bf16
/// activations, f32 master weights) and CPU (f32), and under each recomputation policy.
fn memory_table(c: &Config, plan: &ParallelPlan) -> String {
    let mesh = &plan.mesh;
    let [d, f, t, p, s] = [Axis::Data, Axis::Fsdp, Axis::Tensor, Axis::Pipeline, Axis::Seq].map(|a| mesh.size(a));
    let micro = plan.microbatches;
    let (batch, seq) = (plan.microbatch, plan.local_seq_len(c));
    let seq_axis = if s > 1 { format!(" x seq {s}") } else { String::new() };
    let e = mesh.expert_size();
    let expert = if e > 1 { format!(" (expert {e})") } else { String::new() };
    let chunks = if s > 1 { format!(" (two chunks of {} per sequence)", c.train.seq_len) } else { String::new() };
    let gib = |b: usize| format!("{:.2} GiB", engine::backend::gib(b));
    let (gpu, cpu) = plans(c, plan);
    let mut out = format!(
        "\n# memory per device on {} devices (data {d}{expert} x fsdp {f} x tensor {t} x pipeline {p}{seq_axis}), micro-batch {batch} x {seq}{chunks}, remat = {} \
         (estimate; CUDA adds its context, ~0.5 GiB{})\n",
        mesh.devices(),
        remat_name(c.train.remat),
        if p > 1 { "; the costliest stage's device" } else { "" }
    );
    out += &format!("{:<28} {:>14} {:>14}\n", "", "cuda (bf16)", "cpu (f32)");
    for (name, g, p) in [
        ("parameters", gpu.parameters, cpu.parameters),
        ("gradients", gpu.gradients, cpu.gradients),
        ("AdamW moments", gpu.optimizer, cpu.optimizer),
        ("activations", gpu.activations, cpu.activations),
        ("backend scratch", gpu.scratch, cpu.scratch),
        ("communication buffers", gpu.communication, cpu.communication),
        ("total", gpu.total(), cpu.total()),
    ] {
        out += &format!("{name:<28} {:>14} {:>14}\n", gib(g), gib(p));
    }
    if p > 1 {
        let schedule = c.train.pipeline_schedule.name();
        let (v, formula) = match plan.virtual_stages {
            1 => (String::new(), "(P-1)/(M+P-1)"),
            v => (format!(" x {v} virtual stages"), "(P-1)/(V*M+P-1)"),
        };
        out += &format!(
            "\n# pipeline: {p} stages{v} ({} split), {micro} micro-batches, {schedule}: bubble {formula} = {:.1} % of each device's step\n",
            split_name(c),
            100.0 * plan.bubble_fraction()
        );
        out += &format!(
            "{:<8} {:>10} {:>10} {:>16} {:>14} {:>14}\n",
            "stage", "layers", "in flight", "params+grads+opt", "activations", "total (cuda)"
        );
        let stages = plan.stage_estimates(c, Target::Cuda { sm_count: 132 });
        for (i, s) in stages.iter().enumerate() {
            let e = &s.estimate;
            // A device's virtual stages' layers and micro-batches in flight, each its own.
            let runs = std::iter::once(&s.layers).chain(&s.later);
            let layers: Vec<String> = runs.map(|l| format!("{}..{}", l.start, l.end)).collect();
            let in_flight: Vec<String> = s.chunk_in_flight.iter().map(usize::to_string).collect();
            out += &format!(
                "{i:<8} {:>10} {:>10} {:>16} {:>14} {:>14}\n",
                layers.join(","),
                in_flight.join("+"),
                gib(e.parameters + e.gradients + e.optimizer),
                gib(e.activations),
                gib(e.total())
            );
        }
    }
    let mut with = c.clone();
    for remat in [Remat::None, Remat::Minimal, Remat::Full] {
        with.train.remat = remat;
        // Another policy is another plan: a memory split moves with the activations' size.
        let other;
        let plan = if remat == c.train.remat {
            plan
        } else {
            other = ParallelPlan::new(&with, plan.mesh).expect("the recomputation policy changes no check");
            &other
        };
        let g = plan.estimate(&with, Target::Cuda { sm_count: 132 });
        out += &format!("{:<28} {:>14}\n", format!("total with remat = {}", remat_name(remat)), gib(g.total()));
    }
    if let Some(experts) = ExpertPlan::of(c, plan) {
        out += &experts.text(c.model.moe.as_ref().is_some_and(|m| m.capacity_factor.is_none()));
    }
    out
}

/// The expert axis's part of a device's plan.
struct ExpertPlan {
    /// Devices the experts are divided over.
    devices: usize,
    /// Experts a device holds in each layer.
    per_device: usize,
    /// The parameters of a device's experts (the first stage's, with stages).
    parameters: usize,
    /// The most rows a layer receives: every member's `N · k` (dropless), or `E · C` under a
    /// capacity factor when fewer.
    received_rows: usize,
    /// `N · k`: the rows a device dispatches a layer and micro-batch.
    rows: usize,
    /// All-to-alls a layer and micro-batch: dispatch and return, forward and backward (and the
    /// forward again under full recomputation).
    exchanges: usize,
    /// Bytes a device sends a step by them, bf16 rows, when routing is balanced ((e − 1)/e of
    /// the rows leave the device).
    sent_bytes: f64,
}

impl ExpertPlan {
    /// The plan's expert axis, if it has one.
    fn of(c: &Config, plan: &ParallelPlan) -> Option<ExpertPlan> {
        let (moe, e) = (c.model.moe.as_ref()?, plan.mesh.expert_size());
        if e == 1 {
            return None;
        }
        let layout = plan.stage_model(c, 0).layout;
        let parameters = layout.layers.iter().filter_map(|l| l.experts()).map(|r| r.len()).sum();
        let tokens = plan.microbatch * plan.local_seq_len(c);
        let rows = tokens * moe.top_k;
        let exchanges = engine::parallel::experts::all_to_alls_per_layer(c.train.remat);
        let passes = plan.microbatches * c.train.grad_accum * (c.model.n_layers / plan.mesh.size(Axis::Pipeline));
        Some(ExpertPlan {
            devices: e,
            per_device: moe.num_experts / e,
            parameters,
            received_rows: moe.most_received(tokens, e),
            rows,
            exchanges,
            sent_bytes: (passes * exchanges * rows * c.model.d_model * 2) as f64 * (e - 1) as f64 / e as f64,
        })
    }

    fn text(&self, dropless: bool) -> String {
        let gib = |b: f64| format!("{:.2} GiB", b / (1u64 << 30) as f64);
        let bound = if dropless { "dropless: every member's N x k" } else { "E x C, the capacity factor's bound" };
        format!(
            "\n# expert axis: {} experts a device, over {} devices\n\
             {:<28} {:>14}  ({} parameters, f32)\n\
             {:<28} {:>14}  rows a layer ({bound}; N x k = {})\n\
             {:<28} {:>14}  a step ({} all-to-alls of N x k rows of d_model a layer and micro-batch, bf16; (e-1)/e leave the device when routing is balanced)\n",
            self.per_device,
            self.devices,
            "expert parameters",
            gib(self.parameters as f64 * 4.0),
            self.parameters,
            "received at most",
            self.received_rows,
            self.rows,
            "all-to-all sent",
            gib(self.sent_bytes),
            self.exchanges,
        )
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "devices": self.devices,
            "experts_per_device": self.per_device,
            "expert_parameters": self.parameters,
            "received_rows_max": self.received_rows,
            "rows_dispatched": self.rows,
            "all_to_alls_per_layer": self.exchanges,
            "all_to_all_bytes_sent_per_step": self.sent_bytes,
        })
    }
}

fn remat_name(r: Remat) -> &'static str {
    match r {
        Remat::None => "none",
        Remat::Minimal => "minimal",
        Remat::Full => "full",
    }
}

fn attention_flops(c: &Config) -> f64 {
    let m = &c.model;
    12.0 * (m.n_layers * m.n_heads * m.head_dim) as f64 * m.mean_keys_attended(c.train.seq_len)
}

pub use engine::config::count::group;
