//! Whole models on the CUDA backend: loss and gradients against the f32 CPU model, graph replay,
//! recomputation, the memory estimate, training that lowers the loss, and NCCL on one GPU.

use super::{Open, Scale, Tol, compare, failure};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::Cuda;
use crate::backend::{Backend, BufKind, gib};
use crate::config::{Config, Remat, recipe};
use crate::model::memory::{self, Target};
use crate::model::{LOSS_SUM, Model, Plan, init};
use crate::rng;
use crate::train::Trainer;

/// A built-in tiny configuration, scaled down for the emulator.
fn tiny(name: &str, scale: Scale, extra: &[&str]) -> Config {
    let mut texts: Vec<&str> = Vec::new();
    if scale.emulated {
        texts.extend(["model.vocab_size=512", "train.seq_len=64"]);
        texts.extend(match name {
            "tiny-llama2" => &["model.d_model=256", "model.mlp_dim=512", "model.n_heads=2", "model.n_kv_heads=2"][..],
            "tiny-mistral" => &["model.d_model=256", "model.mlp_dim=128", "model.sliding_window=24"][..],
            "tiny-gpt" => &[][..], // seed-sized already: d_model 128, vocabulary 512, seq 64
            // Heads of 64 and the window of 16 kept; two layers, a sliding one then a global one
            // (each with its RoPE table), which attend differently within the 64 positions.
            "tiny-gemma3" => {
                &["model.d_model=128", "model.mlp_dim=96", "model.n_layers=2", "model.window_pattern=2"][..]
            }
            // Every token to all 8 experts: bf16 router logits choose differently from f32 ones
            // near ties, and one flipped choice moves the gradients past the tolerance (4.7e-2
            // on the embedding with top-2 of 4 groups). The grouped, biased selection has a check
            // of its own ("sigmoid grouped routing with a selection bias").
            "tiny-deepseek-v3" => &[
                "model.d_model=128",
                "model.mlp_dim=32",
                "model.moe.dense_mlp_dim=128",
                "model.moe.num_experts=8",
                "model.moe.top_k=8",
                "model.moe.groups=1",
                "model.moe.top_groups=1",
                "model.mla.q_lora_rank=32",
                "model.mla.kv_lora_rank=32",
            ][..],
            _ => &["model.d_model=128", "model.mlp_dim=96", "model.moe.num_experts=4"][..],
        });
    }
    texts.extend(extra);
    let overrides: Vec<recipe::Override> =
        texts.iter().map(|t| recipe::Override { text: t.to_string(), origin: "gpu-test".into() }).collect();
    recipe::resolve(name, &overrides).expect("the tiny recipes resolve").config
}

/// One forward and backward pass of `model` on a backend: (loss sum, gradients).
fn model_step<B: Backend>(be: &mut B, model: &Model, plan: &Plan, params: &[f32], tokens: &[u32]) -> (f32, Vec<f32>) {
    be.upload(plan.params, params);
    let n = plan.batch * plan.seq;
    be.upload_idx(plan.tokens, &tokens[..n]);
    be.upload_idx(plan.targets, &tokens[1..=n]);
    be.fill(plan.grads, 0.0);
    model.refresh_fp8_weight_casts(be, plan);
    model.forward(be, plan, Some(1.0 / n as f32), &mut crate::model::Alone);
    model.backward(be, plan, model.aux_scale(plan, 1.0), &mut crate::model::Alone);
    let (mut loss, mut grads) = ([0f32], vec![0f32; plan.grads.len]);
    be.download(plan.scalars.at(LOSS_SUM, 1), &mut loss);
    be.download(plan.grads, &mut grads);
    (loss[0], grads)
}

/// Loss and gradients of tiny configuration `name` (with `extra` overrides) against the f32 CPU model.
pub(super) fn parity(gpu: Cuda, name: &str, extra: &[&str], scale: Scale) -> Result<String, String> {
    let config = tiny(name, scale, extra);
    let mut model = Model::new(&config.model);
    model.fp8 = crate::model::Fp8Policy::of(&config.train);
    // One device holding its whole model, as a run on one GPU: the FP8 forward passes keep the
    // weights' transposed casts for the backward pass, and the inputs' in place of the inputs;
    // under the delayed recipe they read both weight layouts as the optimizer (here, their
    // first cast) wrote them.
    model.fp8_weight_cache = true;
    model.fp8_weight_copies = config.train.fp8.recipe == crate::config::Fp8Recipe::Delayed;
    model.fp8_keep_inputs = true;
    let (batch, seq) = (config.train.batch_size.per_group(1), config.train.seq_len);
    let params = init::params(&model, 7);
    let tokens: Vec<u32> =
        (0..=batch * seq).map(|i| (rng::bits(3, 3, i as u64) % config.model.vocab_size as u64) as u32).collect();
    let mut cpu = Cpu::new();
    let cpu_plan = model.plan(&mut cpu, batch, seq);
    let (cpu_loss, cpu_grads) = model_step(&mut cpu, &model, &cpu_plan, &params, &tokens);
    let mut gpu = gpu;
    let gpu_plan = model.plan(&mut gpu, batch, seq);
    let (gpu_loss, gpu_grads) = model_step(&mut gpu, &model, &gpu_plan, &params, &tokens);
    let n = (batch * seq) as f32;
    let (cl, gl) = (cpu_loss / n, gpu_loss / n);
    let mut notes = vec![format!("loss {cl:.4} (CPU) {gl:.4} (GPU)")];
    if config.model.final_logit_softcap > 0.0 {
        notes.push(softcap_reached(&mut cpu, &model, &cpu_plan, config.model.final_logit_softcap as f32)?);
    }
    let close = (gl - cl).abs() <= 0.005 * cl.abs();
    if !close {
        return Err(format!("loss {gl} on the GPU, {cl} on the CPU (tolerance 0.5 %)"));
    }
    // FP8 casts of bf16 operands (the GPU's) and of f32 ones (the CPU's) round a few elements
    // to neighbouring FP8 values (a quantum is 1/8 of an E4M3 value, 1/4 of an E5M2 one), and the
    // backward pass carries those differences through the layers: wider tolerances, still far
    // below what a wrong scale or transpose gives (a relative error of 1 or more).
    //
    // Gemma 3 is worse conditioned: QK-norm makes its attention logits of order one at
    // initialisation (the others' are near zero, their softmax near uniform), and its sandwich
    // norms scale the branches' small outputs (RMS 1e-2 and below) up to the residual stream's
    // size, so the same bf16 roundings weigh more. Rounding only its parameters to bf16 moves the
    // f32 CPU model's gradients by 1.0 to 1.3 % (0.3 to 0.5 % for the others); the emulator
    // measures 2.1 to 2.5 % on all of them and up to 3.3 % on the worst tensor, at its sizes and
    // at the recipe's full one. Twice that stays far below what a wrong constant gives: a norm
    // eps of 1e-5 for 1e-6, a softmax scale of 1/8 for 1/√48 or a window of 17 for 16 move the
    // gradients by 20 to 50 %.
    let gemma = config.model.family == crate::config::Family::Gemma3;
    let (tensor_tol, all_tol) = match (model.fp8, gemma) {
        (None, false) => (Tol { rel_l2: 0.03, max: 1.0 }, Tol { rel_l2: 0.02, max: 1.0 }),
        (None, true) => (Tol { rel_l2: 0.06, max: 1.0 }, Tol { rel_l2: 0.05, max: 1.0 }),
        (Some(_), _) => (Tol { rel_l2: 0.25, max: 1.0 }, Tol { rel_l2: 0.15, max: 1.0 }),
    };
    let mut worst = (0f64, String::new());
    for tensor in &model.layout.tensors {
        let r = tensor.offset..tensor.offset + tensor.len();
        let (c, g) = (&cpu_grads[r.clone()], &gpu_grads[r]);
        if c.iter().all(|&x| x == 0.0) {
            continue; // an expert no token reached
        }
        let text = compare(&tensor.name, c, g, tensor_tol)?;
        let rel: f64 = text.split_whitespace().last().and_then(|s| s.split('/').next()?.parse().ok()).unwrap_or(0.0);
        if rel > worst.0 {
            worst = (rel, text);
        }
    }
    notes.push(format!("worst gradient: {}", worst.1));
    notes.push(compare("all gradients", &cpu_grads, &gpu_grads, all_tol)?);
    Ok(notes.join(", "))
}

/// Soft-capping must matter: some logit of the CPU model (its parameters and tokens as
/// [`model_step`] left them) passes half the cap, so that its capped value `cap · tanh(x / cap)`
/// passes `cap · tanh(1/2)`.
fn softcap_reached(cpu: &mut Cpu, model: &Model, plan: &Plan, cap: f32) -> Result<String, String> {
    model.forward(cpu, plan, None, &mut crate::model::Alone);
    let mut logits = vec![0f32; plan.logits.len];
    cpu.download(plan.logits, &mut logits);
    let top = logits.iter().fold(0f32, |m, x| m.max(x.abs()));
    let uncapped = cap * (top / cap).atanh();
    let text = format!("largest |logit| {uncapped:.2} before the cap of {cap}, {top:.2} after");
    if top > cap * 0.5f32.tanh() { Ok(text) } else { Err(format!("{text}: under half the cap, which barely acts")) }
}

/// Losses of `steps` training steps of a tiny configuration, and the sections recorded.
fn train_losses(gpu: Cuda, config: &Config, steps: usize) -> Result<(Vec<f64>, usize), String> {
    let mut trainer = Trainer::new(gpu, config).map_err(failure)?;
    let losses = (0..steps).map(|_| trainer.train_step(0.0).loss).collect();
    Ok((losses, trainer.backend.recorded_sections()))
}

/// Steps replayed from a CUDA graph give the losses of eager steps.
pub(super) fn graphs(gpu: Cuda, open: &mut Open, recipe: &str, sets: &[&str], scale: Scale) -> Result<String, String> {
    let steps = 4;
    let (graphs, recorded) = train_losses(gpu, &tiny(recipe, scale, sets), steps)?;
    let eager_sets = [sets, &["train.cuda_graphs=false"]].concat();
    let (eager, none) = train_losses(open().map_err(failure)?, &tiny(recipe, scale, &eager_sets), steps)?;
    if recorded != 1 || none != 0 {
        return Err(format!("{recorded} graphs recorded with train.cuda_graphs, {none} without (want 1 and 0)"));
    }
    // Step 1 runs eagerly, step 2 is captured, 3 and 4 replay; atomics make the last bits differ
    // from run to run.
    for (i, (a, b)) in graphs.iter().zip(&eager).enumerate() {
        if (a - b).abs() > 2e-3 * b.abs() {
            return Err(format!("step {}: loss {a} with graphs, {b} without", i + 1));
        }
    }
    Ok(format!("losses {graphs:.4?} with graphs, {eager:.4?} without"))
}

/// FP8 training under the delayed recipe through the trainer, as a run on one GPU takes it: the
/// AdamW update writes the weights' casts (`adamw_fp8`) that the next step's passes read, the
/// first step's cast before it; the losses follow the FP8 CPU model's, and the GPU allocates
/// what the memory plan says (the casts in both layouts, a byte a weight each).
pub(super) fn fp8_training(gpu: Cuda, scale: Scale) -> Result<String, String> {
    use crate::parallel::plan::ParallelPlan;
    let sets = ["train.precision=fp8", "train.fp8.min_dim=16", "train.fp8.recipe=delayed", "optim.lr=3e-3"];
    let config = tiny("tiny-llama2", scale, &sets);
    let steps = 3;
    let target = Target::Cuda { sm_count: gpu.info().sm_count as usize };
    let estimate = ParallelPlan::resolve(&config, 1, 1).map_err(failure)?.estimate(&config, target).total();
    let mut trainer = Trainer::new(gpu, &config).map_err(failure)?;
    if !trainer.model.fp8_weight_copies {
        return Err("the trainer's model does not take its weights' casts from the optimizer".into());
    }
    let on_gpu: Vec<f64> = (0..steps).map(|_| trainer.train_step(0.0).loss).collect();
    let allocated = trainer.backend.memory_in_use().0;
    let mut cpu = Trainer::new(Cpu::new(), &config).map_err(failure)?;
    let on_cpu: Vec<f64> = (0..steps).map(|_| cpu.train_step(0.0).loss).collect();
    let detail = format!(
        "losses {on_gpu:.4?} on the GPU, {on_cpu:.4?} on the CPU; allocated {:.4} GiB, planned {:.4} GiB",
        gib(allocated),
        gib(estimate)
    );
    // FP8 roundings of bf16 and f32 operands differ by a quantum here and there (`parity`'s
    // note): the curves stay within 1 % of each other.
    if on_gpu.iter().zip(&on_cpu).any(|(a, b)| (a - b).abs() > 1e-2 * b.abs()) || on_cpu[steps - 1] >= on_cpu[0] {
        return Err(detail);
    }
    let off = (allocated as f64 - estimate as f64).abs() / estimate as f64;
    if off > 0.01 { Err(format!("{detail}: {:.2} % off", 100.0 * off)) } else { Ok(detail) }
}

/// Gradients with full recomputation match those without.
pub(super) fn remat(gpu: Cuda, open: &mut Open, scale: Scale) -> Result<String, String> {
    let grads = |gpu: Cuda, remat: Remat| {
        let config = tiny("tiny-llama2", scale, &["model.n_layers=2"]);
        let mut model = Model::new(&config.model);
        model.remat = remat;
        let (batch, seq) = (config.train.batch_size.per_group(1), config.train.seq_len);
        let params = init::params(&model, 7);
        let tokens: Vec<u32> = (0..=batch * seq).map(|i| (i * 7 % 200) as u32).collect();
        let mut gpu = gpu;
        let plan = model.plan(&mut gpu, batch, seq);
        model_step(&mut gpu, &model, &plan, &params, &tokens).1
    };
    let none = grads(gpu, Remat::None);
    let full = grads(open().map_err(failure)?, Remat::Full);
    compare("gradients", &none, &full, Tol { rel_l2: 1e-2, max: 5e-2 })
}

/// The memory estimate is within 1 % of what the backend allocates.
pub(super) fn memory_estimate(gpu: Cuda, scale: Scale) -> Result<String, String> {
    let config = tiny("tiny-mixtral", scale, &["train.batch_size=2", "train.remat=minimal"]);
    let mut model = Model::new(&config.model);
    model.remat = config.train.remat;
    let target = Target::Cuda { sm_count: gpu.info().sm_count as usize };
    let estimate = memory::estimate(&model, config.train.batch_size.per_group(1), config.train.seq_len, target).total();
    let mut trainer = Trainer::new(gpu, &config).map_err(failure)?;
    trainer.train_step(0.0);
    let (allocated, in_use) = trainer.backend.memory_in_use();
    let detail = format!(
        "estimate {:.4} GiB, allocated {:.4} GiB, device memory in use {:.3} GiB",
        gib(estimate),
        gib(allocated),
        gib(in_use)
    );
    let off = (allocated as f64 - estimate as f64).abs() / estimate as f64;
    if off > 0.01 { Err(format!("{detail}: {:.2} % off", 100.0 * off)) } else { Ok(detail) }
}

/// FSDP over two devices, whose lent buffers hold the gathered parameters in bf16 alone
/// ([`BufKind::Gathered`]): two emulated devices (threads meeting through the virtual
/// collectives) follow one device training the same global batch, and each allocates what the
/// mesh's memory plan says, the gathered units at 2 bytes an element.
pub(super) fn fsdp_bf16_gathers(gpu: Cuda, scale: Scale) -> Result<String, String> {
    two_devices(gpu, scale, "tiny-llama2", &[], &["mesh.ici_data=1", "mesh.ici_fsdp=2"], "FSDP 2")
}

/// FSDP over two devices in FP8 (the delayed recipe, whose amaxes the devices reduce before each
/// update, so both scale alike): every layer gathered as its weights' E4M3 casts (each device
/// casts its pieces; the bytes travel through the host as the virtual devices' messages), Wᵀ
/// transposed from them, the inputs kept cast for the weight gradients; the two follow one
/// device's FP8 training and allocate what the memory plan says. (Narrowed to d_model 128: the emulator's FP8 products
/// are its slowest.)
pub(super) fn fsdp_fp8(gpu: Cuda, scale: Scale) -> Result<String, String> {
    let fp8 = ["train.precision=fp8", "train.fp8.min_dim=16", "train.fp8.recipe=delayed"];
    let fp8 = [&fp8[..], &["model.d_model=128", "model.mlp_dim=128", "train.seq_len=32"]].concat();
    two_devices(gpu, scale, "tiny-llama2", &fp8, &["mesh.ici_data=1", "mesh.ici_fsdp=2"], "FSDP 2")
}

/// MuonClip (`optim.name = "muon"` with `optim.qk_clip`): steps on the GPU (Newton–Schulz in
/// bf16; each head's largest logit recorded by the attention kernels, every head's projections
/// rescaled on the f32 masters and their bf16 copies) follow the CPU's f32 ones, the maxima
/// agree, and the GPU allocates what the memory plan says, Muon's assembly buffer and scratch at
/// 2 bytes an element. The threshold is below every logit these weights give, so every head
/// clips at every step, and the second step's loss reads the first's rescaling. (Its FSDP
/// assembly is checked on the CPU's virtual devices, `train::devices`; two emulated devices took
/// 180 s more here.)
pub(super) fn muon(gpu: Cuda, scale: Scale) -> Result<String, String> {
    use crate::parallel::plan::ParallelPlan;
    let sets =
        ["model.d_model=128", "model.mlp_dim=128", "optim.name=muon", "optim.muon.lr=0.02", "optim.qk_clip=0.01"];
    let config = tiny("tiny-llama2", scale, &sets);
    let steps = 2;
    let target = Target::Cuda { sm_count: gpu.info().sm_count as usize };
    let estimate = ParallelPlan::resolve(&config, 1, 1).map_err(failure)?.estimate(&config, target).total();
    let mut trainer = Trainer::new(gpu, &config).map_err(failure)?;
    let on_gpu: Vec<_> = (0..steps).map(|_| trainer.train_step(0.0)).collect();
    let allocated = trainer.backend.memory_in_use().0;
    let mut cpu = Trainer::new(Cpu::new(), &config).map_err(failure)?;
    let on_cpu: Vec<_> = (0..steps).map(|_| cpu.train_step(0.0)).collect();
    let heads = config.model.n_layers * config.model.n_heads;
    for (i, (a, b)) in on_gpu.iter().zip(&on_cpu).enumerate() {
        if (a.loss - b.loss).abs() > 2e-3 * b.loss.abs() {
            return Err(format!("step {}: loss {} on the GPU, {} on the CPU", i + 1, a.loss, b.loss));
        }
        let (x, y) = (a.max_logit.unwrap_or(f64::NAN), b.max_logit.unwrap_or(f64::NAN));
        if (x - y).abs() > 2e-2 * y.abs() || a.clipped_heads != Some(heads) || b.clipped_heads != Some(heads) {
            return Err(format!(
                "step {}: largest logit {x} on the GPU, {y} on the CPU; heads clipped {:?} and {:?} of {heads}",
                i + 1,
                a.clipped_heads,
                b.clipped_heads
            ));
        }
    }
    let losses = |steps: &[crate::train::metrics::StepMetrics]| steps.iter().map(|m| m.loss).collect::<Vec<_>>();
    let (on_gpu, on_cpu) = (losses(&on_gpu), losses(&on_cpu));
    if on_cpu[1] >= on_cpu[0] {
        return Err(format!("the CPU's losses {on_cpu:.4?} do not fall"));
    }
    let detail = format!(
        "losses {on_gpu:.4?} on the GPU, {on_cpu:.4?} on the CPU, all {heads} heads clipped at each step; allocated {:.4} GiB, planned {:.4} GiB",
        gib(allocated),
        gib(estimate)
    );
    let off = (allocated as f64 - estimate as f64).abs() / estimate as f64;
    if off > 0.01 { Err(format!("{detail}: {:.2} % off", 100.0 * off)) } else { Ok(detail) }
}

/// The expert axis over two devices: each runs its experts' grouped products on the rows the
/// other routes to them (parts of fixed size, per-sender runs written on the device from the
/// exchanged counts), and the two follow one device training the same global batch, allocating
/// what the memory plan says; dropless or with a capacity factor, the second step is recorded
/// as a graph on each device (no count read back mid-step) and replayed.
pub(super) fn expert_axis(gpu: Cuda, scale: Scale, capacity: Option<&str>) -> Result<String, String> {
    let sets: Vec<&str> = capacity.into_iter().collect();
    two_devices(gpu, scale, "tiny-mixtral", &sets, &["mesh.ici_data=2", "mesh.ici_expert=2"], "EP 2")
}

/// Two emulated devices on `mesh` (threads meeting through the virtual collectives) follow one
/// device training the same global batch, and each allocates what the mesh's memory plan says.
/// Each records its second step's micro-batch as a graph, collectives included (the virtual
/// devices' host calls), and replays it.
fn two_devices(
    gpu: Cuda,
    scale: Scale,
    recipe: &str,
    common: &[&str],
    mesh: &[&str],
    what: &str,
) -> Result<String, String> {
    use crate::parallel::comm::Virtual;
    use crate::parallel::plan::ParallelPlan;
    // The second step reads the parameters AdamW updated (under FSDP, their gathers).
    let steps = 2;
    let config =
        |extra: &[&str]| tiny(recipe, scale, &[&["model.n_layers=2", "mesh.ici_data=1"], common, extra].concat());
    let (one, fsdp) = (config(&["train.batch_size=2"]), config(&[&["train.batch_size=1"], mesh].concat()));
    let (single, _) = train_losses(gpu, &one, steps)?;
    let plan = ParallelPlan::resolve(&fsdp, 2, 1).map_err(failure)?;
    // Under FP8 FSDP gathers every layer as its weights' casts.
    let fp8 = fsdp.train.precision == crate::config::Precision::Fp8;
    let want_casts = if fp8 { fsdp.model.n_layers } else { 0 };
    let device = |comm: Virtual| -> Result<(Vec<f64>, usize, usize), String> {
        let gpu = Cuda::emulated().map_err(failure)?;
        let estimate = plan.estimate(&fsdp, Target::Cuda { sm_count: gpu.info().sm_count as usize }).total();
        let mut t = Trainer::new_parallel(gpu, &fsdp, Box::new(comm), plan.clone()).map_err(failure)?;
        let casts = t.parallel.fp8_gathers().map_or(0, |g| g.0);
        if casts != want_casts {
            return Err(format!("{casts} units gathered as FP8 casts, {want_casts} expected"));
        }
        let losses = (0..steps).map(|_| t.train_step(0.0).loss).collect();
        if t.backend.recorded_sections() != 1 {
            return Err(format!("{} sections recorded as graphs, 1 expected", t.backend.recorded_sections()));
        }
        Ok((losses, t.backend.memory_in_use().0, estimate))
    };
    let runs: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = Virtual::devices(2).into_iter().map(|comm| s.spawn(|| device(comm))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    let mut detail = Vec::new();
    for (rank, run) in runs.into_iter().enumerate() {
        let (losses, allocated, estimate) = run?;
        for (step, (a, b)) in losses.iter().zip(&single).enumerate() {
            if (a - b).abs() > 2e-3 * b.abs() {
                return Err(format!("device {rank}, step {}: loss {a} under {what}, {b} on one device", step + 1));
            }
        }
        let off = (allocated as f64 - estimate as f64).abs() / estimate as f64;
        let memory = format!("device {rank}: allocated {:.4} GiB, planned {:.4} GiB", gib(allocated), gib(estimate));
        if off > 0.01 {
            return Err(format!("{memory}: {:.2} % off", 100.0 * off));
        }
        detail.push(format!("{memory}, losses {losses:.4?}"));
    }
    let casts = if want_casts > 0 { format!("; {want_casts} layers gathered as FP8 casts") } else { String::new() };
    Ok(format!("{}; one device: {single:.4?}{casts}; step 2 recorded as a graph on each device", detail.join("; ")))
}

/// A few training steps of tiny configuration `name` lower the loss.
pub(super) fn training(gpu: Cuda, name: &str, scale: Scale) -> Result<String, String> {
    let config = tiny(name, scale, &[&format!("train.steps={}", scale.train_steps)]);
    let (losses, _) = train_losses(gpu, &config, scale.train_steps)?;
    let tail = &losses[losses.len().saturating_sub(5)..];
    let last = tail.iter().sum::<f64>() / tail.len() as f64;
    let detail = format!("loss {:.3} -> {:.3} (mean of the last {})", losses[0], last, tail.len());
    if losses.iter().any(|l| !l.is_finite()) || last > 0.85 * losses[0] { Err(detail) } else { Ok(detail) }
}

/// NCCL on one GPU: every collective over a group of one leaves the data as it was, in f32 and
/// in bf16, on the backend's stream.
pub(super) fn nccl_alone(mut gpu: Cuda) -> Result<String, String> {
    use crate::parallel::comm::Collectives;
    use crate::parallel::nccl::{Nccl, unique_id};
    let id = unique_id().map_err(|e| e.to_string())?;
    let timeout = crate::parallel::job::collective_timeout().map_err(|e| e.to_string())?;
    let mut comm = Nccl::init(&id, 0, 1, timeout).map_err(|e| e.to_string())?;
    let n = 1000;
    // Small integers: exact in bf16 too.
    let x: Vec<f32> = (0..n).map(|i| (i % 200) as f32 - 100.0).collect();
    let mut failures = Vec::new();
    for kind in [BufKind::Grads, BufKind::Activations] {
        let (a, b, c) = (gpu.alloc(kind, n), gpu.alloc(kind, n), gpu.alloc(kind, n));
        gpu.upload(a, &x);
        Collectives::<Cuda>::all_reduce_sum(&mut comm, &mut gpu, a, &[0]);
        Collectives::<Cuda>::reduce_scatter_sum(&mut comm, &mut gpu, a, b, &[0]);
        Collectives::<Cuda>::all_gather(&mut comm, &mut gpu, b, c, &[0]);
        let mut got = vec![0f32; n];
        gpu.download(c, &mut got);
        if got != x {
            let bad = got.iter().zip(&x).position(|(g, w)| g != w).unwrap_or(0);
            failures.push(format!("{kind:?}: element {bad} is {} after the collectives, {} before", got[bad], x[bad]));
        }
    }
    // FSDP's gather into bf16 alone: a piece's bf16 copy, not its f32 master, travels.
    let y: Vec<f32> = (0..n).map(|i| i as f32 * 0.013 - 6.5).collect();
    let (piece, gathered) = (gpu.alloc(BufKind::Params, n), gpu.alloc(BufKind::Gathered, n));
    gpu.upload(piece, &y);
    Collectives::<Cuda>::all_gather(&mut comm, &mut gpu, piece, gathered, &[0]);
    let mut got = vec![0f32; n];
    gpu.download(gathered, &mut got);
    if let Some(bad) = got.iter().zip(&y).position(|(&g, &w)| g != half::bf16::from_f32(w).to_f32()) {
        failures
            .push(format!("parameters gathered into bf16: element {bad} is {}, {} rounded to bf16", got[bad], y[bad]));
    }
    if failures.is_empty() {
        Ok(format!("{n} elements unchanged in f32 and bf16; parameters gathered into bf16 rounded as their copy"))
    } else {
        Err(failures.join("; "))
    }
}

/// The FP8 overhead of a decoder layer at llama3.1-8b's shapes (one sequence of 8192 tokens):
/// every launch of an FP8 cast and amax kernel (all but the products, cuBLASLt's) in one layer's
/// forward and backward pass, as the launch trace records them in a dry run (nothing runs, so
/// the shapes are the real ones), and the bytes they move (a cast reads 2 bytes an element and
/// writes 1 a layout; an amax pass reads 2), fused against unfused, under `recipe`. "After"
/// keeps the inputs' transposed casts from the forward pass (no cast of x in the backward
/// pass); under the delayed recipe it counts the optimizer's update of the layer's weights too,
/// which writes their casts (a launch and 2 bytes a weight beyond the update itself), and no
/// pass casts W; it must take at most half the launches and half the bytes. (A check a recipe:
/// the emulator's buffers of a first plan stay until its backend goes.)
pub(super) fn fp8_overhead(mut gpu: Cuda, recipe: &str) -> Result<String, String> {
    let sets = ["model.n_layers=1", "model.vocab_size=256", "train.precision=fp8", "train.batch_size=1"];
    let recipe_set = format!("train.fp8.recipe={recipe}");
    let overrides = recipe::Override::from_list(&[&sets[..], &[recipe_set.as_str()]].concat().join(" "), "check");
    let config = recipe::resolve("llama3.1-8b", &overrides).map_err(failure)?.config;
    let mut model = Model::new(&config.model);
    model.fp8 = crate::model::Fp8Policy::of(&config.train);
    // One GPU holding the whole model: the forward pass keeps Wᵀ's cast (also "before", where it
    // costs what the backward pass's second cast did).
    model.fp8_weight_cache = true;
    gpu.trace_launches(Some(true));
    // (launches, bytes) of the casts and amax passes of one forward and backward pass, and
    // under the delayed recipe ("after") of the optimizer step that writes the weights' casts
    // (what its update writes besides: both layouts, and the amax).
    let mut per = |unfused: bool| -> (usize, f64) {
        let mut model = model.clone();
        model.fp8_weight_copies = !unfused && recipe == "delayed";
        model.fp8_keep_inputs = !unfused;
        let plan = model.plan(&mut gpu, 1, 8192);
        gpu.set_fp8_unfused(unfused);
        gpu.take_launches();
        model.forward(&mut gpu, &plan, Some(1.0), &mut crate::model::Alone);
        model.backward(&mut gpu, &plan, 0.0, &mut crate::model::Alone);
        let casts = model.fp8_weight_casts(&plan);
        if !casts.is_empty() {
            // A dry run: the moments' views need only name buffers.
            let all = [crate::backend::Segment { offset: 0, len: plan.params.len, decay: true }];
            let step = crate::backend::AdamWStep {
                lr: 1e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                t: 1,
                max_grad_norm: 1.0,
            };
            let (p, g, norm) = (plan.params, plan.grads, plan.scalars.at(0, 1));
            gpu.adamw_fp8(p, g, (g, g), norm, &all, step, &casts);
        }
        let bytes: Vec<u64> = gpu.take_launches().iter().filter_map(fp8_bytes).collect();
        (bytes.len(), bytes.iter().sum::<u64>() as f64)
    };
    let (before, after) = (per(true), per(false));
    gpu.set_fp8_unfused(false);
    gpu.trace_launches(None);
    let note = format!(
        "per decoder layer (q/k/v, o, gate/up, down), {recipe}: {} launches before, {} after ({:.0} % fewer); {:.2} GB moved before, {:.2} GB after ({:.0} % less)",
        before.0,
        after.0,
        100.0 * (1.0 - after.0 as f64 / before.0 as f64),
        before.1 / 1e9,
        after.1 / 1e9,
        100.0 * (1.0 - after.1 / before.1)
    );
    // Tensorwise scaling needs a tensor's amax before its cast: only dy's second layout goes.
    if recipe == "delayed" && (2 * after.0 > before.0 || 2.0 * after.1 > before.1) {
        return Err(format!("{note}: the fused casts keep more than half the launches or bytes"));
    }
    Ok(note)
}

/// The bytes an FP8 cast or amax launch moves, from its arguments (`fp8.cu`'s signatures); none
/// for any other kernel.
fn fp8_bytes(l: &crate::backend::cuda::Launch) -> Option<u64> {
    match l.name {
        "fp8_amax_partials" => Some(2 * l.args[1]),
        "fp8_amax_finish" => Some(4 * l.args[1] + 16),
        "fp8_cast" => Some(3 * l.args[2]),
        "fp8_cast_transposed" => {
            let n = l.args[3] * l.args[4];
            Some(n * if l.args[1] != 0 { 4 } else { 3 })
        }
        // Beyond the update the weight takes anyway: its casts, a byte an element each.
        "adamw_fp8" => Some(2 * l.args[6] * l.args[7]),
        _ => None,
    }
}
