//! The checks of `test-all`, one function each (registered in [`super::checks`]).

use std::fs;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};

use super::baselines::{self, Against, tolerance};
use super::{CURVE_RECIPES, Ctx, DeviceClass, Measure, Mode, Target, Verdict};
use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::backend::cuda::{Cuda, discovery};
use crate::checkpoint::{self, Checkpoint, Extras, Snapshot};
use crate::config::{self, Config, Override};
use crate::data::prepare::{PrepareOptions, prepare};
use crate::data::shard::Shards;
use crate::data::tokenizer::TextTokenizer;
use crate::data::{CORPUS, TokenSource};
use crate::eval::{self, Loaded};
use crate::hf;
use crate::model::{Model, init};
use crate::parity::{self, Scale};
use crate::tensors::Mapped;
use crate::train::Trainer;
use crate::train::checkpointer::Checkpointer;
use crate::train::devices;

/// A throughput below the baseline's divided by this fails. Wide on purpose: the baseline was
/// recorded on one machine and the check runs on others (other core counts and clocks, shared CI
/// runners, another GPU generation: factors of 2 to 3 are ordinary). A factor of 5 is what a real
/// regression looks like — a vector path lost (the x86-v4 or NEON GEMM kernels falling back to
/// scalar code is 8 to 16 times slower), a debug build, one thread where there were many.
pub const THROUGHPUT_FLOOR: f64 = 5.0;

/// A small model for the checks that exercise the machinery rather than a recipe's numbers:
/// `tiny-llama2` shrunk (the same shrink the image test uses under emulation).
const SMALL: [&str; 6] = [
    "model.d_model=128",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.head_dim=64",
    "model.mlp_dim=256",
    "model.vocab_size=512",
];

fn resolve(recipe: &str, sets: &[&str]) -> Result<Config> {
    let list: Vec<Override> =
        sets.iter().map(|s| Override { text: s.to_string(), origin: "test-all".into() }).collect();
    Ok(config::resolve(recipe, &list)?.config)
}

fn tempdir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new().prefix("engine-test-all-").tempdir().context("cannot create a temporary directory")
}

// ---- loss curves and throughput against the baselines ------------------------------------

/// Trains `recipe` and compares its loss, step by step, with the reference's curve; the detail
/// names the reference (`cpu baseline`, `cuda baseline`, `cpu baseline, bf16 tolerance`).
pub fn loss_curve(ctx: &mut Ctx, recipe: &str) -> Result<Verdict> {
    let reference = ctx.reference.ok_or_else(|| anyhow!("no baselines loaded"))?;
    if let Some(why) = super::curve_unsupported(recipe, ctx.target.class())? {
        return Ok(Verdict::skip(format!("{recipe} cannot run on the CUDA backend: {why}")));
    }
    let shrink = if ctx.target == Target::Emulator { baselines::emulator_shrink(recipe) } else { &[] };
    if !shrink.is_empty() {
        return shrunk_curve(ctx, recipe, shrink);
    }
    let moe = routes_experts(recipe)?;
    let (base, file, label, fallback) = match (reference.file.recipes.get(recipe), &reference.cpu_for_missing) {
        (Some(base), _) => (base, &reference.file, reference.label().to_string(), false),
        (None, Some(cpu)) => {
            (&cpu.recipes[recipe], cpu, format!("cpu baseline, bf16 tolerance (no CUDA baseline of {recipe})"), true)
        }
        (None, None) => bail!("baselines {}: no curve of {recipe}", reference.file.path.display()),
    };
    let curve = ctx.curve(recipe)?;
    let tolerance = |step| if fallback { baselines::bf16_tolerance(moe, step) } else { reference.tolerance(moe, step) };
    let (result, record) = baselines::compare(recipe, &curve, base, tolerance);
    Ok(match result {
        Ok(text) => Verdict::pass(format!("{label}: {text}")),
        Err(text) => Verdict::fail(format!("{text} [{label} {}]", file.path.display())),
    }
    .with_curve(record))
}

/// Whether `recipe` is a mixture of experts (its bf16 curve gets more room: `BF16_MOE_REL_TOL`).
fn routes_experts(recipe: &str) -> Result<bool> {
    Ok(resolve(recipe, &[])?.model.moe.is_some())
}

/// A curve the emulator runs shrunk ([`baselines::emulator_shrink`]) against the CPU curve of the
/// same configuration, trained now, within the bf16 tolerance.
fn shrunk_curve(ctx: &mut Ctx, recipe: &str, shrink: &[&str]) -> Result<Verdict> {
    let cpu = baselines::train_curve_with(recipe, ctx.mode, shrink, Target::Cpu, &mut *ctx.progress)?;
    let curve = ctx.curve(recipe)?;
    let base = baselines::RecipeBaseline {
        overrides: Vec::new(),
        loss: cpu.loss,
        tokens_per_s: cpu.tokens_per_s,
        run_spread: 0.0,
    };
    let label = format!("cpu curve of this run, bf16 tolerance; shrunk for the emulator: {}", shrink.join(" "));
    let moe = routes_experts(recipe)?;
    let (result, record) = baselines::compare(recipe, &curve, &base, |step| baselines::bf16_tolerance(moe, step));
    Ok(match result {
        Ok(text) => Verdict::pass(format!("{label}: {text}")),
        Err(text) => Verdict::fail(format!("{text} [{label}]")),
    }
    .with_curve(record))
}

/// Tokens per second of every curve against the baseline's: reported, failing only below
/// 1/[`THROUGHPUT_FLOOR`] of it. Skipped, with the reason, where the reference was recorded on
/// another device class (a CUDA run against the CPU curves) or the target's speed means nothing
/// (the emulator).
pub fn throughput(ctx: &mut Ctx) -> Result<Verdict> {
    let reference = ctx.reference.ok_or_else(|| anyhow!("no baselines loaded"))?;
    if reference.against == Against::CpuBf16 {
        let why = match ctx.target {
            Target::Emulator => "the CPU emulator's speed says nothing about a GPU's".to_string(),
            _ => format!(
                "{}: a GPU's throughput has no CPU baseline to compare with",
                reference.why_cpu.as_deref().unwrap_or("no CUDA baselines")
            ),
        };
        // What was measured anyway, for the record (curves trained by the loss checks).
        let seen: Vec<String> = CURVE_RECIPES
            .iter()
            .filter_map(|r| ctx.trained(r).map(|c| format!("{r} {:.0} tokens/s", c.tokens_per_s)))
            .collect();
        let seen = if seen.is_empty() { String::new() } else { format!("; measured {}", seen.join(", ")) };
        return Ok(Verdict::skip(format!("{why}{seen}")));
    }
    let file = &reference.file;
    let (mut parts, mut slow, mut measures) = (Vec::new(), Vec::new(), Vec::new());
    for recipe in CURVE_RECIPES {
        // A recipe the CUDA backend refuses, or one its CUDA baselines lack (compared with the
        // CPU curve: a CPU throughput says nothing about a GPU's).
        if super::curve_unsupported(recipe, ctx.target.class())?.is_some() || !file.recipes.contains_key(recipe) {
            continue;
        }
        let got = ctx.curve(recipe)?.tokens_per_s;
        let want = file.recipes[recipe].tokens_per_s;
        let ratio = got / want;
        let text = format!("{recipe} {got:.0} tokens/s ({ratio:.2}x the baseline's {want:.0})");
        let ok = ratio >= 1.0 / THROUGHPUT_FLOOR;
        if !ok {
            slow.push(text.clone());
        }
        parts.push(text);
        measures.push(Measure {
            name: recipe.to_owned(),
            value: got,
            unit: "tokens/s",
            baseline: Some(want),
            ok,
            note: format!("{ratio:.2}x the baseline; fails below 1/{THROUGHPUT_FLOOR}"),
        });
    }
    let verdict = if slow.is_empty() {
        Verdict::pass(format!("{}; fails below 1/{THROUGHPUT_FLOOR} of the baseline", parts.join(", ")))
    } else {
        Verdict::fail(format!(
            "{} below 1/{THROUGHPUT_FLOOR} of the baseline ({}; recorded on {})",
            slow.join(", "),
            file.path.display(),
            file.device
        ))
    };
    Ok(verdict.with_measures(measures))
}

// ---- virtual devices --------------------------------------------------------------------

/// Four virtual CPU devices (threads) on FSDP 2 × tensor 2 against one device training the same
/// global batch, saving a sharded checkpoint halfway that DP 2 × tensor 2 and pipeline 2 ×
/// tensor 2 (two stages of one layer, two micro-batches, 1F1B) resume: every curve must follow
/// the single device's within 1e-5 relative (exact up to the order of additions).
pub fn virtual_devices(ctx: &mut Ctx) -> Result<Verdict> {
    let steps = match ctx.mode {
        Mode::Quick => 6,
        Mode::Full => 20,
    };
    let half = steps as u64 / 2;
    let steps_set = format!("train.steps={steps}");
    let with_mesh = |mesh: [&str; 3]| -> Result<Config> {
        let mut sets = SMALL.to_vec();
        sets.extend([steps_set.as_str(), "optim.warmup_steps=2", "model.n_layers=2"]);
        sets.extend(mesh);
        resolve("tiny-llama2", &sets)
    };
    let fsdp_tp = with_mesh(["mesh.ici_data=1", "mesh.ici_fsdp=2", "mesh.ici_tensor=2"])?;
    let dp_tp = with_mesh(["mesh.ici_data=2", "mesh.ici_fsdp=1", "mesh.ici_tensor=2"])?;
    let mut pp_tp = with_mesh(["mesh.ici_data=1", "mesh.ici_fsdp=1", "mesh.ici_tensor=2"])?;
    (pp_tp.mesh.ici_pipeline, pp_tp.train.pipeline_microbatches) = (2, 2);
    let mut one = fsdp_tp.clone();
    one.train.batch_size *= 4;
    let mut single = Trainer::new(Cpu::new(), &one)?;
    let want: Vec<f64> = (0..steps).map(|_| single.train_step(0.0).loss).collect();

    let dir = tempdir()?;
    let parent = dir.path().join("checkpoints");
    let mesh_curve = &devices::train_and_save(&fsdp_tp, 4, half, &parent)?;
    let ck = Checkpoint::open(&parent.join(checkpoint::dir_name(half)))?;
    let resume_on = |mesh: &Config| -> Result<Vec<f64>> {
        Ok(devices::run(mesh, 4, |_, t| {
            t.resume_from(&ck)?;
            Ok((half..steps as u64).map(|_| t.train_step(0.0).loss).collect::<Vec<f64>>())
        })?
        .swap_remove(0))
    };
    let (resumed, pipelined) = (&resume_on(&dp_tp)?, &resume_on(&pp_tp)?);
    let check = |what: &str, got: &[f64], from: usize| -> Option<String> {
        got.iter().zip(&want[from..]).enumerate().find_map(|(i, (g, w))| {
            let rel = (g - w).abs() / w.abs();
            (rel.is_nan() || rel > 1e-5).then(|| {
                format!(
                    "{what} step {}: loss {g:.8}, one device {w:.8} (relative difference {rel:.1e}, allowed 1e-5)",
                    from + i + 1
                )
            })
        })
    };
    if let Some(problem) = check("FSDP 2 x TP 2", mesh_curve, 0)
        .or_else(|| check("resumed on DP 2 x TP 2", resumed, half as usize))
        .or_else(|| check("resumed on pipeline 2 x TP 2", pipelined, half as usize))
    {
        return Ok(Verdict::fail(problem));
    }
    Ok(Verdict::pass(format!(
        "{steps} steps on 4 virtual devices (FSDP 2 x TP 2), resumed from a sharded checkpoint on DP 2 x TP 2 and on pipeline 2 x TP 2: within 1e-5 of one device"
    )))
}

// ---- checkpoint save and resume ------------------------------------------------------------

/// A run of N steps straight through against one saved at N/2, verified, resumed through
/// [`checkpoint::resume_point`] on a fresh backend and run to N: the losses after the resume and
/// the final parameters and moments must be the same bit for bit on the CPU (within the curve
/// tolerance on a GPU, whose bf16 copies are recomputed from the restored f32 weights).
pub fn checkpoint_resume(ctx: &mut Ctx) -> Result<Verdict> {
    let steps = match ctx.mode {
        Mode::Quick => 6,
        Mode::Full => 20,
    };
    let mut sets = SMALL.to_vec();
    let steps_set = format!("train.steps={steps}");
    sets.push(&steps_set);
    let config = resolve("tiny-llama2", &sets)?;
    match ctx.target {
        Target::Cpu => resume_on(|| Ok(Cpu::new()), &config, steps, None),
        target => {
            if let Some(why) = super::cuda_unsuitable(&config.model) {
                bail!("the check's model cannot run on the CUDA backend: {why}");
            }
            resume_on(|| target.open_cuda(), &config, steps, Some(tolerance(DeviceClass::Cuda, 1)))
        }
    }
}

fn resume_on<B: Backend>(
    mut open: impl FnMut() -> Result<B>,
    config: &Config,
    steps: usize,
    tol: Option<f64>,
) -> Result<Verdict> {
    let half = steps / 2;
    let run = |t: &mut Trainer<B>, n: usize| -> Vec<f64> { (0..n).map(|_| t.train_step(0.0).loss).collect() };

    let mut straight = Trainer::new(open()?, config)?;
    let want = run(&mut straight, steps);
    let want_state = straight.device_state(Default::default());
    drop(straight);

    // The first half saves through the checkpoint manager of `engine train`, in the background.
    let dir = tempdir()?;
    let parent = dir.path().join("checkpoints");
    let mut first = Trainer::new(open()?, config)?;
    run(&mut first, half);
    let mut saver = Checkpointer::new(&parent, &mut first, Extras::default(), true);
    saver.after_step(&mut first, true)?;
    saver.finish(&mut first)?;
    drop(first);

    let ck = checkpoint::resume_point(&parent, None, config, 1)?;
    let mut resumed = Trainer::new(open()?, config)?;
    resumed.resume_from(&ck)?;
    let got = run(&mut resumed, steps - half);
    let got_state = resumed.device_state(Default::default());

    for (i, (&g, &w)) in got.iter().zip(&want[half..]).enumerate() {
        let step = half + 1 + i;
        let same = match tol {
            None => g.to_bits() == w.to_bits(),
            Some(t) => ((g - w) / w).abs() <= t,
        };
        if !same {
            bail!("step {step} after resuming from step {half}: loss {g:.8}, {w:.8} without the interruption");
        }
    }
    if tol.is_none() {
        let parts = ["parameters", "first moments", "second moments"];
        for ((what, g), w) in parts.iter().zip(&got_state.bufs).zip(&want_state.bufs) {
            if let Some(i) = g.iter().zip(w).position(|(a, b)| a.to_bits() != b.to_bits()) {
                bail!(
                    "after step {steps}: {what} differ from the uninterrupted run's at element {i}: {} vs {}",
                    g[i],
                    w[i]
                );
            }
        }
    }
    let how = if tol.is_none() {
        "losses, parameters and moments equal bit for bit"
    } else {
        "losses equal within the CUDA tolerance"
    };
    Ok(Verdict::pass(format!(
        "{steps} steps = {half} + checkpoint ({}) + {}: {how} (final loss {:.4})",
        ck.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        steps - half,
        got[got.len() - 1]
    )))
}

// ---- Hugging Face import and export ----------------------------------------------------------

/// transformers' tiny `MistralForCausalLM` (tests/fixtures/hf/generate.py): bf16 weights, a
/// sliding window, `rope_parameters` spelling; 50 KB.
const MISTRAL_CONFIG: &[u8] = include_bytes!("../../../tests/fixtures/hf/mistral/config.json");
const MISTRAL_WEIGHTS: &[u8] = include_bytes!("../../../tests/fixtures/hf/mistral/model.safetensors");
const MISTRAL_TOKENS: &[u8] = include_bytes!("../../../tests/fixtures/hf/mistral/tokens.json");
const MISTRAL_EXPECTED: &str = include_str!("../../../tests/fixtures/hf/mistral/expected.json");

/// Two round trips. transformers' tiny Mistral: import → export gives back every tensor byte for
/// byte in its dtype, and the loss the engine computes for its token batch is transformers' own
/// (relative 1e-5, as engine/tests/hf.rs). A Mixtral made by the engine, exported as f32 shards:
/// export → import → export gives the same files and the imported parameters are the originals.
pub fn hf_roundtrip(_ctx: &mut Ctx) -> Result<Verdict> {
    let dir = tempdir()?;
    let d = dir.path();
    let src = d.join("mistral");
    fs::create_dir(&src)?;
    fs::write(src.join("config.json"), MISTRAL_CONFIG)?;
    fs::write(src.join("model.safetensors"), MISTRAL_WEIGHTS)?;
    fs::write(d.join("tokens.json"), MISTRAL_TOKENS)?;
    let report = hf::import(&src, &d.join("mistral-ck"))?;
    let ck = Checkpoint::open(&d.join("mistral-ck"))?;
    let out = d.join("mistral-out");
    hf::export(&ck, &out, None, u64::MAX)?;
    let tensors = same_tensors(&src.join("model.safetensors"), &out.join("model.safetensors"))?;

    let loaded = Loaded::open(None, Some(&out))?;
    let batch = eval::read_tokens(&d.join("tokens.json"), 0)?;
    let (result, _) = eval::evaluate(&loaded, &batch, false, false)?;
    let expected: serde_json::Value = serde_json::from_str(MISTRAL_EXPECTED)?;
    let want = expected["loss"].as_f64().ok_or_else(|| anyhow!("the fixture's expected.json has no loss"))?;
    let rel = (result.loss - want).abs() / want;
    if rel > 1e-5 {
        bail!(
            "the exported Mistral's loss is {:.7}, transformers computed {want:.7} (relative {rel:.1e})",
            result.loss
        );
    }

    // An engine-made Mixtral in shards of at most 64 KB.
    let config = resolve(
        "tiny-mixtral",
        &[
            "model.d_model=32",
            "model.mlp_dim=48",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.head_dim=8",
            "model.vocab_size=96",
        ],
    )?;
    let model = Model::new(&config.model);
    let params = init::params(&model, 7);
    let snap = Snapshot { params: params.clone(), ..Snapshot::default() };
    let first = checkpoint::write(&d.join("mixtral"), &config, &model.layout, &snap, &Extras::default(), None)?;
    let shard = 64_000;
    let exported = hf::export(&Checkpoint::open(&first)?, &d.join("mixtral-hf"), None, shard)?;
    hf::import(&d.join("mixtral-hf"), &d.join("mixtral-ck2"))?;
    let second = Checkpoint::open(&d.join("mixtral-ck2"))?;
    if second.params(&model.layout)? != params {
        bail!("the Mixtral imported from its export has other parameters than the original");
    }
    hf::export(&second, &d.join("mixtral-hf2"), None, shard)?;
    for name in exported.files.iter().map(String::as_str).chain(["model.safetensors.index.json", "config.json"]) {
        let (a, b) = (d.join("mixtral-hf").join(name), d.join("mixtral-hf2").join(name));
        if fs::read(&a)? != fs::read(&b)? {
            bail!("Mixtral export → import → export: {name} differs");
        }
    }
    Ok(Verdict::pass(format!(
        "Mistral ({}, {tensors} tensors) byte-exact, loss {:.6} = transformers' {want:.6}; Mixtral f32 in {} shards byte-exact",
        report.dtype.torch_name(),
        result.loss,
        exported.files.len()
    )))
}

/// Every tensor of `a` is in `b` with the same dtype, shape and bytes, and `b` has no other.
fn same_tensors(a: &Path, b: &Path) -> Result<usize> {
    let (a, b) = (Mapped::open(a)?, Mapped::open(b)?);
    let (ta, tb) = (a.tensors(), b.tensors());
    let names = ta.names();
    if names.len() != tb.names().len() {
        bail!("{} holds {} tensors, {} holds {}", a.path.display(), names.len(), b.path.display(), tb.names().len());
    }
    for name in &names {
        let x = ta.tensor(name)?;
        let y = tb.tensor(name).map_err(|_| anyhow!("tensor {name} is missing after the round trip"))?;
        if x.dtype() != y.dtype() || x.shape() != y.shape() || x.data() != y.data() {
            bail!(
                "tensor {name} differs after the round trip ({:?} {:?} vs {:?} {:?})",
                x.dtype(),
                x.shape(),
                y.dtype(),
                y.shape()
            );
        }
    }
    Ok(names.len())
}

// ---- data preparation -------------------------------------------------------------------------

/// A byte-level BPE `tokenizer.json` trained on the embedded corpus
/// (tests/fixtures/tokenizers/generate.py), and the ids Hugging Face's Python `tokenizers` gives
/// its probe texts.
const TOKENIZER: &[u8] = include_bytes!("../../../tests/fixtures/tokenizers/bytelevel-bpe.json");
const TOKENIZER_EXPECTED: &str = include_str!("../../../tests/fixtures/tokenizers/expected.json");

/// Prepares the embedded corpus (a text file and a JSONL file of its paragraphs) with the bundled
/// tokenizer: the tokenizer gives the reference library's ids, the shards hold exactly every
/// document's tokens and its end-of-sequence token in input order, and a model trains on them.
pub fn data_prepare(ctx: &mut Ctx) -> Result<Verdict> {
    let dir = tempdir()?;
    let d = dir.path();
    let tokenizer_path = d.join("tokenizer.json");
    fs::write(&tokenizer_path, TOKENIZER)?;
    let tokenizer = TextTokenizer::open(&tokenizer_path)?;

    let expected: serde_json::Value = serde_json::from_str(TOKENIZER_EXPECTED)?;
    let probes = &expected["bytelevel-bpe.json"];
    let (texts, ids) = (probes["texts"].as_array(), probes["ids"].as_array());
    let (texts, ids) = texts.zip(ids).ok_or_else(|| anyhow!("the tokenizer fixture has no probes"))?;
    for (text, want) in texts.iter().zip(ids) {
        let text = text.as_str().unwrap_or_default();
        let want: Vec<u32> =
            want.as_array().into_iter().flatten().filter_map(|x| x.as_u64()).map(|x| x as u32).collect();
        let got = tokenizer.encode(text)?;
        if got != want {
            bail!("the tokenizer gives {got:?} for {text:?}, the reference library {want:?}");
        }
    }

    // Documents: the first half of the corpus as one text file, the paragraphs of the rest as
    // JSONL records; read in name order (a.txt, b.jsonl).
    let text = std::str::from_utf8(CORPUS).context("the embedded corpus is not UTF-8")?;
    let cut = text[..text.len() / 2].rfind("\n\n").map_or(text.len() / 2, |i| i + 2);
    let (head, tail) = text.split_at(cut);
    let paragraphs: Vec<&str> = tail.split("\n\n").filter(|p| !p.is_empty()).collect();
    let corpus = d.join("corpus");
    fs::create_dir(&corpus)?;
    fs::write(corpus.join("a.txt"), head)?;
    let jsonl: String = paragraphs.iter().map(|p| format!("{}\n", serde_json::json!({ "text": p }))).collect();
    fs::write(corpus.join("b.jsonl"), jsonl)?;

    let out = d.join("shards");
    let opts = PrepareOptions {
        tokenizer: tokenizer_path.clone(),
        inputs: vec![corpus],
        out: out.clone(),
        eos: None,
        separator: None,
        text_field: "text".into(),
        shard_tokens: 10_000,
        max_vocab: None,
        progress: false,
    };
    let report = prepare(&opts)?;
    let eos = tokenizer.eos_id()?;
    let mut want = Vec::new();
    for doc in std::iter::once(head).chain(paragraphs.iter().copied()) {
        want.extend(tokenizer.encode(doc)?);
        want.push(eos);
    }
    let shards = Shards::open(&out)?;
    let mut got = vec![0u32; shards.len()];
    shards.read(0, &mut got);
    if got.len() != want.len() {
        bail!("the shards hold {} tokens, the documents tokenize to {}", got.len(), want.len());
    }
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        bail!("shard token {i} is {}, the tokenizer gives {} there", got[i], want[i]);
    }
    if report.documents as usize != 1 + paragraphs.len() || report.shards.len() < 2 {
        bail!("prepare.json reports {} documents in {} shards", report.documents, report.shards.len());
    }

    // The shards feed training (on the CPU: this checks the data path, not the device).
    let path = format!("data.path={}", out.display());
    let steps = match ctx.mode {
        Mode::Quick => 3,
        Mode::Full => 10,
    };
    let steps_set = format!("train.steps={steps}");
    let mut sets = SMALL.to_vec();
    sets.extend(["data.source=shards", path.as_str(), steps_set.as_str(), "train.seq_len=32"]);
    let config = resolve("tiny-llama2", &sets)?;
    let mut trainer = Trainer::new(Cpu::new(), &config)?;
    let losses: Vec<f64> = (0..steps).map(|_| trainer.train_step(0.0).loss).collect();
    if losses.iter().any(|l| !l.is_finite()) {
        bail!("training on the prepared shards gave losses {losses:?}");
    }
    Ok(Verdict::pass(format!(
        "{} probe texts as the reference tokenizer; {} documents, {} tokens in {} shards, exact; {steps} steps on them, loss {:.3} -> {:.3}",
        texts.len(),
        report.documents,
        report.tokens,
        report.shards.len(),
        losses[0],
        losses[steps - 1]
    )))
}

// ---- CPU and GPU -----------------------------------------------------------------------------

/// The CUDA backend against the CPU reference, through the checks of `engine gpu-test`
/// ([`parity`]): in quick mode the whole-model parity checks (loss and gradients of every tiny
/// configuration), in full mode all of them. Skipped without a GPU, or when the run is on the CPU.
/// On the emulator they run as `gpu-test --emulate` runs them: shapes shrunk, 20 training steps.
pub fn gpu_parity(ctx: &mut Ctx) -> Result<Verdict> {
    let emulated = ctx.target == Target::Emulator;
    if !emulated {
        if let Err(e) = discovery::probe() {
            return Ok(Verdict::skip(format!("no CUDA GPU ({e})")));
        }
        if ctx.target == Target::Cpu {
            return Ok(Verdict::skip("a GPU is present but the run is on the CPU (--device cpu)"));
        }
    }
    let (filter, steps) = match (ctx.mode, emulated) {
        (Mode::Quick, _) => ("against the f32 CPU model", 20),
        (Mode::Full, false) => ("", 200),
        (Mode::Full, true) => ("", 20),
    };
    let scale = Scale { emulated, train_steps: steps };
    let mut open = || if emulated { Cuda::emulated() } else { Cuda::new(0) };
    let progress = &mut *ctx.progress;
    let outcomes = parity::run(scale, &mut open, filter, &mut |o| {
        progress(&format!("  {} {} ({:.1} s): {}", if o.passed { "ok  " } else { "FAIL" }, o.name, o.seconds, o.detail))
    });
    let failed: Vec<String> =
        outcomes.iter().filter(|o| !o.passed).map(|o| format!("{}: {}", o.name, o.detail)).collect();
    let measures = outcomes
        .iter()
        .map(|o| Measure {
            name: o.name.clone(),
            value: o.seconds,
            unit: "s",
            baseline: None,
            ok: o.passed,
            note: o.detail.clone(),
        })
        .collect();
    let verdict = if failed.is_empty() {
        Verdict::pass(format!("{} gpu-test checks passed", outcomes.len()))
    } else {
        Verdict::fail(format!("{} of {} gpu-test checks failed: {}", failed.len(), outcomes.len(), failed.join("; ")))
    };
    Ok(verdict.with_measures(measures))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testall::baselines::Reference;

    /// The committed CPU quick baselines as the reference of a CUDA run without CUDA baselines.
    fn cpu_reference_for_cuda(why: &str) -> Reference {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/baselines");
        let file = baselines::load(Path::new(dir), DeviceClass::Cpu, Mode::Quick).unwrap();
        Reference { file, against: Against::CpuBf16, why_cpu: Some(why.into()), cpu_for_missing: None }
    }

    #[test]
    fn throughput_is_skipped_with_the_reason_until_there_is_a_cuda_baseline() {
        let reference = cpu_reference_for_cuda("no CUDA baselines (x/cuda/quick.json not found)");
        let mut lines = Vec::new();
        let mut progress = |l: &str| lines.push(l.to_owned());
        // Skipped before training anything: no GPU is opened (there is none here).
        let mut ctx = Ctx::new(Mode::Quick, Target::Gpu, Some(&reference), &mut progress);
        let v = throughput(&mut ctx).unwrap();
        assert_eq!(v.status, super::super::Status::Skip);
        assert_eq!(
            v.detail,
            "no CUDA baselines (x/cuda/quick.json not found): a GPU's throughput has no CPU baseline to compare with"
        );
        let mut ctx = Ctx::new(Mode::Quick, Target::Emulator, Some(&reference), &mut progress);
        let v = throughput(&mut ctx).unwrap();
        assert_eq!(
            (v.status, v.detail.as_str()),
            (super::super::Status::Skip, "the CPU emulator's speed says nothing about a GPU's")
        );
        drop(ctx);
        assert!(lines.is_empty(), "{lines:?}");
    }
}
