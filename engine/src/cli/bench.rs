//! `engine bench`: step time, tokens/s, TFLOP/s and MFU of recipes, and the GEMM rate.
//!
//! A benchmark prints figures; it asserts nothing. Compare side by side on the same machine
//! (see `bench/` for the PyTorch peer).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use engine::backend::cpu;
use engine::backend::traced::Traced;
use engine::backend::{Backend, BufKind, MatMul, gib};
use engine::config::{Override, Resolved};
use engine::fsutil::write_atomic;
use engine::train::Trainer;
use engine::train::step_times::StepTimes;
use serde::Serialize;

use super::RecipeArgs;
use super::device::{self, DeviceArg, Opened};

/// The seed images' test configurations, measured when no recipe is named.
const DEFAULT_RECIPES: [&str; 3] = ["tiny-llama2", "tiny-mistral", "tiny-mixtral"];

#[derive(Args)]
pub struct BenchArgs {
    /// Recipe to measure (repeatable) [default: tiny-llama2, tiny-mistral, tiny-mixtral].
    #[arg(long = "recipe", value_name = "NAME|FILE")]
    recipes: Vec<String>,
    /// Override a recipe key in every measured recipe (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Measured steps per recipe.
    #[arg(long, default_value_t = 10, value_name = "N")]
    steps: usize,
    /// Steps run before measuring.
    #[arg(long, default_value_t = 2, value_name = "N")]
    warmup: usize,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// After measuring, time every op of one more step and print where the time goes.
    #[arg(long)]
    profile: bool,
    /// Measure each of N virtual CPU devices (threads) of the recipe's mesh instead: step time,
    /// the share of the pipeline's span spent outside forward and backward passes against the
    /// schedule's bubble, and peak memory.
    #[arg(long, value_name = "N")]
    devices: Option<usize>,
}

#[derive(Serialize)]
struct RecipeResult {
    recipe: String,
    device: String,
    tokens_per_step: usize,
    median_step_time_s: f64,
    tokens_per_s: f64,
    tflops_per_device: f64,
    mfu: f64,
    peak_tflops: f64,
}

#[derive(Serialize)]
struct Report {
    machine: String,
    threads: usize,
    recipes: Vec<RecipeResult>,
}

pub fn run(args: BenchArgs, device: DeviceArg) -> Result<()> {
    anyhow::ensure!(args.steps > 0, "--steps must be at least 1");
    let names: Vec<String> =
        if args.recipes.is_empty() { DEFAULT_RECIPES.map(String::from).to_vec() } else { args.recipes.clone() };
    let machine = cpu::model_name();
    let threads = rayon::current_num_threads();
    println!("machine: {machine}, {threads} threads");
    println!(
        "\n{:<16} {:>9} {:>12} {:>11} {:>10} {:>7}   GEMMs of the output head",
        "recipe", "tok/step", "step (med)", "tokens/s", "TFLOP/s", "MFU"
    );
    if let Some(devices) = args.devices {
        for name in &names {
            bench_devices(&args, name, devices)?;
        }
        return Ok(());
    }
    let mut results = Vec::new();
    for name in &names {
        let recipe = RecipeArgs { recipe: name.clone(), set: args.set.clone() };
        let total = args.warmup + args.steps;
        let steps = Override { text: format!("train.steps={total}"), origin: "engine bench".into() };
        let resolved = recipe.resolve(&[steps])?;
        let opened = device::open(device, Some(&resolved.config))?;
        let peak = device::peak(&opened, &resolved.config);
        results.push(match opened {
            Opened::Cpu(be) => bench_one(&args, &resolved, be, peak)?,
            Opened::Cuda(be) => bench_one(&args, &resolved, *be, peak)?,
        });
    }
    if let Some(path) = args.json {
        let report = Report { machine, threads, recipes: results };
        write_atomic(&path, serde_json::to_string_pretty(&report)?.as_bytes())?;
    }
    Ok(())
}

/// Measures one recipe on one backend and prints its line.
fn bench_one<B: Backend>(
    args: &BenchArgs,
    resolved: &Resolved,
    backend: B,
    peak: (f64, String),
) -> Result<RecipeResult> {
    let (peak, peak_source) = peak;
    let config = &resolved.config;
    let mut trainer = Trainer::new(Traced::new(backend), config)?;
    let mut times = Vec::with_capacity(args.steps);
    for i in 0..args.warmup + args.steps {
        let m = trainer.train_step(peak);
        if i >= args.warmup {
            times.push(m.step_time_s);
        }
    }
    let stats = StepTimes::of(&times, trainer.flops_per_step(), trainer.tokens_per_step() as f64, peak);
    let m = &config.model;
    let n = trainer.plan.batch * config.train.seq_len;
    let head = match head_gemm_tflops(&mut trainer.backend.inner, n, m.d_model, m.vocab_size) {
        Ok(tflops) => format!("{tflops:.3} TFLOP/s"),
        Err(why) => format!("not measured: {why}"),
    };
    println!(
        "{:<16} {:>9} {:>10.3} s {:>11.0} {:>10.3} {:>6.1}%   {head} ({n}x{}x{} fwd, dx, dw)",
        resolved.name,
        trainer.tokens_per_step(),
        stats.median_s,
        stats.tokens_per_s,
        stats.tflops_per_device,
        100.0 * stats.mfu,
        m.d_model,
        m.vocab_size
    );
    println!("    on {}, peak {peak:.1} TFLOP/s ({peak_source})", trainer.backend.describe());
    if args.profile {
        print_profile(&mut trainer, peak);
    }
    Ok(RecipeResult {
        recipe: resolved.name.clone(),
        device: trainer.backend.describe(),
        tokens_per_step: trainer.tokens_per_step(),
        median_step_time_s: stats.median_s,
        tokens_per_s: stats.tokens_per_s,
        tflops_per_device: stats.tflops_per_device,
        mfu: stats.mfu,
        peak_tflops: peak,
    })
}

/// One virtual device's figures over the measured steps.
#[derive(Serialize)]
struct DeviceResult {
    rank: usize,
    stage: usize,
    median_step_time_s: f64,
    /// Share of the pipeline's span (a step until every stage is done with its passes) this
    /// device spent outside its forward and backward passes.
    idle_share: f64,
    peak_memory_bytes: usize,
    /// The peak less the parameters, gradients and moments (exact sizes): the activations and
    /// the backend's scratch.
    activation_bytes: usize,
    /// Seconds a measured step spent in the collectives' recording wrapper's own work (the
    /// flight recorder, the straggler detector's timing); none without the wrapper.
    recorder_s_per_step: Option<f64>,
}

/// `engine bench --devices N`: each virtual device of the recipe's mesh.
fn bench_devices(args: &BenchArgs, name: &str, devices: usize) -> Result<()> {
    let recipe = RecipeArgs { recipe: name.to_string(), set: args.set.clone() };
    let total = args.warmup + args.steps;
    let steps = Override { text: format!("train.steps={total}"), origin: "engine bench".into() };
    let resolved = recipe.resolve(&[steps])?;
    let config = &resolved.config;
    let plan = engine::parallel::plan::ParallelPlan::resolve(config, devices, 1)?;
    let stages = plan.stages.len();
    let t = &config.train;
    let bubble = plan.bubble_fraction();
    let plans = plan.stage_estimates(config, engine::model::memory::Target::Cpu);
    // Each device computes on a pool of its own share of the cores: on the shared global pool,
    // a device alone in a bubble would borrow the idle devices' cores and shrink the bubble.
    let per_device = (rayon::current_num_threads() / devices).max(1);
    let results = engine::train::devices::run(config, devices, |rank, trainer| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(per_device).build()?;
        pool.install(|| measure_device(args, total, &plans, rank, trainer))
    })?;
    println!(
        "{} on {devices} virtual devices ({per_device} thread(s) each), {stages} stage(s), {} micro-batches, {}: bubble {} = {:.1} %",
        resolved.name,
        t.pipeline_microbatches,
        t.pipeline_schedule.name(),
        if plan.virtual_stages > 1 { "(P-1)/(V*M+P-1)" } else { "(P-1)/(M+P-1)" },
        100.0 * bubble
    );
    println!(
        "{:>5} {:>6} {:>12} {:>10} {:>14} {:>16} {:>18}",
        "rank", "stage", "step (med)", "idle", "peak memory", "activation part", "recorder a step"
    );
    for r in &results {
        let recorder = match r.recorder_s_per_step {
            Some(s) => format!("{:.1} us {:.2}%", s * 1e6, 100.0 * s / r.median_step_time_s),
            None => "off".to_owned(),
        };
        println!(
            "{:>5} {:>6} {:>10.3} s {:>9.1}% {:>10.2} MiB {:>12.2} MiB {:>18}",
            r.rank,
            r.stage,
            r.median_step_time_s,
            100.0 * r.idle_share,
            r.peak_memory_bytes as f64 / (1 << 20) as f64,
            r.activation_bytes as f64 / (1 << 20) as f64,
            recorder
        );
    }
    if let Some(path) = &args.json {
        let report = serde_json::json!({
            "recipe": resolved.name,
            "devices": devices,
            "stages": stages,
            "microbatches": t.pipeline_microbatches,
            "schedule": t.pipeline_schedule,
            "bubble_fraction": bubble,
            "per_device": results,
        });
        write_atomic(path, serde_json::to_string_pretty(&report)?.as_bytes())?;
    }
    Ok(())
}

/// Runs the warm-up and measured steps on one virtual device and returns its figures.
fn measure_device(
    args: &BenchArgs,
    total: usize,
    plans: &[engine::parallel::memory::StagePlan],
    rank: usize,
    trainer: &mut Trainer<Traced<cpu::Cpu>>,
) -> Result<DeviceResult> {
    let mut times = Vec::with_capacity(args.steps);
    let (mut busy, mut span) = (0.0, 0.0);
    let mut recorder_before = None;
    for i in 0..total {
        if i == args.warmup {
            recorder_before = trainer.parallel.collectives_overhead();
        }
        let m = trainer.train_step(0.0);
        if i >= args.warmup {
            times.push(m.step_time_s);
            busy += trainer.pass_times.0.as_secs_f64();
            span += trainer.pass_times.1.as_secs_f64();
        }
    }
    let stage = trainer.parallel.coords.pipeline;
    let peak = trainer.backend.peak_memory_bytes();
    let e = &plans[stage].estimate;
    Ok(DeviceResult {
        rank,
        stage,
        median_step_time_s: StepTimes::of(&times, 0.0, 0.0, 0.0).median_s,
        idle_share: 1.0 - busy / span,
        peak_memory_bytes: peak,
        activation_bytes: peak.saturating_sub(e.parameters + e.gradients + e.optimizer),
        recorder_s_per_step: (trainer.parallel.collectives_overhead().zip(recorder_before))
            .map(|(after, before)| (after - before).as_secs_f64() / args.steps.max(1) as f64),
    })
}

/// Times every op of one step and prints the ops by total time.
fn print_profile<B: Backend>(trainer: &mut Trainer<Traced<B>>, peak: f64) {
    trainer.backend.start();
    let start = Instant::now();
    trainer.train_step(peak);
    let total = start.elapsed().as_secs_f64() * 1e6;
    let mut per_op: std::collections::BTreeMap<&str, (f64, usize)> = Default::default();
    for s in trainer.backend.stop() {
        let e = per_op.entry(s.name).or_default();
        e.0 += s.duration_us;
        e.1 += 1;
    }
    let mut rows: Vec<_> = per_op.into_iter().collect();
    rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    for (name, (us, calls)) in rows {
        println!("    {name:<24} {:>9.2} ms {:>5.1}%  ({calls} calls)", us / 1e3, 100.0 * us / total);
    }
}

/// Rate of the three products of an output head `[n, d] x [v, d]ᵀ` (forward, input and weight
/// gradients) on the benchmarked backend, best of three rounds, in TFLOP/s. Its buffers come on
/// top of the model's, so on a device that the model nearly fills it is skipped, with the reason.
fn head_gemm_tflops<B: Backend>(be: &mut B, n: usize, d: usize, v: usize) -> Result<f64> {
    // At most 4 bytes an element, and 6 more for parameters (a GPU's f32 master and bf16 copy).
    let needed = 4 * (2 * n * d + n * v + v * d) + 6 * v * d;
    if let Some(free) = be.free_memory_bytes()
        && free < needed
    {
        bail!("its buffers need {:.2} GiB, {:.2} GiB are free beside the model", gib(needed), gib(free));
    }
    let (x, w, y) = (
        be.alloc(BufKind::Activations, n * d),
        be.alloc(BufKind::Params, v * d),
        be.alloc(BufKind::Activations, n * v),
    );
    let (dx, dw) = (be.alloc(BufKind::Activations, n * d), be.alloc(BufKind::Grads, v * d));
    let shapes = [MatMul::linear(n, d, v), MatMul::linear_dx(n, d, v), MatMul::linear_dw(n, d, v)];
    let flops: f64 = shapes.iter().map(MatMul::flops).sum();
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        be.synchronize();
        let start = Instant::now();
        be.matmul(y, x, w, shapes[0]);
        be.matmul(dx, y, w, shapes[1]);
        be.matmul(dw, y, x, shapes[2]);
        be.synchronize();
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(flops / best / 1e12)
}
