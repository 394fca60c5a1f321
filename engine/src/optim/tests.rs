//! The optimizers against PyTorch: the engine's Muon and AdamW steps equal `torch.optim.Muon`'s
//! and `torch.optim.AdamW`'s (f32, the CPU) from the same weights and gradients, for every kind
//! of tensor of a mixture of experts (router, experts, norms, embedding, head) and of the GPT
//! family (its packed `c_attn`, biases, LayerNorms, learned positions, tied embedding), over
//! three steps (clipping active in the first two), with both learning-rate adjustments.
//!
//! tests/fixtures/muon/make.py computes the reference from spec.json, which this test writes
//! from the engine's layouts and holds to the committed one. With ENGINE_TEST_TORCH_PYTHON
//! (Python with torch ≥ 2.9), the reference is made again and checked the same way.

use std::path::{Path, PathBuf};

use super::Optimizer;
use crate::backend::cpu::Cpu;
use crate::backend::{Backend, BufKind};
use crate::config::recipe::{Override, resolve};
use crate::config::{AdjustLr, Config};
use crate::parallel::comm::Solo;
use crate::parallel::mesh::Mesh;
use crate::parallel::strategies::{FsdpOptions, Parallel};
use crate::parallel::tensor::TensorSlice;

const SEED: u64 = 0;
const GRAD_SCALES: [f64; 3] = [0.08, 0.03, 0.004];
/// The initial weights' scale: small beside the steps (about 1e-3), so that the parameters'
/// f32 rounding (a unit in the last place of the weight) stays far below a step's, and the
/// step itself is compared to 1e-6.
const PARAM_SCALE: f64 = 0.01;
const MODELS: [(&str, &str, &str); 2] = [
    (
        "mixtral",
        "tiny-mixtral",
        "model.vocab_size=32 model.d_model=16 model.n_layers=1 model.n_heads=2 model.n_kv_heads=1 model.head_dim=8 model.mlp_dim=24 model.moe.num_experts=2",
    ),
    (
        "gpt",
        "tiny-gpt",
        "model.vocab_size=32 model.d_model=16 model.n_layers=1 model.n_heads=2 model.n_kv_heads=2 model.head_dim=8 model.mlp_dim=32 model.max_seq_len=8 train.seq_len=8",
    ),
];

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/muon")
}

fn config(recipe: &str, overrides: &str, adjust: AdjustLr) -> Config {
    let hyper = "optim.name=muon optim.lr=3e-3 optim.schedule=constant optim.warmup_steps=0 optim.grad_clip=1.0 optim.weight_decay=0.1 optim.muon.lr=0.02";
    let mut c = resolve(recipe, &Override::from_list(&format!("{overrides} {hyper}"), "test")).unwrap().config;
    c.optim.muon.adjust_lr_fn = adjust;
    c
}

/// The fixture's specification: every model's tensors as the engine lays them out, and the
/// hyper-parameters.
fn spec() -> String {
    let c = config(MODELS[0].1, MODELS[0].2, AdjustLr::Original);
    let (o, m) = (&c.optim, &c.optim.muon);
    let mut models = serde_json::Map::new();
    for (name, recipe, overrides) in MODELS {
        let layout = crate::model::Layout::new(&config(recipe, overrides, AdjustLr::Original).model);
        let tensors = layout
            .tensors
            .iter()
            .map(|t| serde_json::json!({"name": t.name, "shape": t.shape, "decay": t.decay}))
            .collect();
        models.insert(name.to_owned(), serde_json::Value::Array(tensors));
    }
    let spec = serde_json::json!({
        "seed": SEED,
        "grad_scales": GRAD_SCALES,
        "param_scale": PARAM_SCALE,
        "hyper": {
            "lr": o.lr, "beta1": o.beta1, "beta2": o.beta2, "eps": o.eps, "weight_decay": o.weight_decay,
            "grad_clip": o.grad_clip, "muon_lr": m.lr, "momentum": m.momentum, "nesterov": m.nesterov,
            "ns_steps": m.ns_steps, "muon_eps": m.eps, "muon_weight_decay": m.weight_decay,
        },
        "models": models,
    });
    serde_json::to_string_pretty(&spec).unwrap() + "\n"
}

/// The largest relative errors, each norm-wise per tensor (`‖a − b‖₂ / ‖b‖₂`), over every
/// tensor, step and adjustment: of the engine's parameters against torch's; of the engine's
/// step (the parameters' change) against the f64 run's; of torch's f32 step against it.
fn compare(reference: &Path) -> [f64; 3] {
    let file = crate::tensors::Mapped::open(reference).unwrap();
    let st = file.tensors();
    let read = |name: &str, len: usize| {
        let mut out = vec![0f32; len];
        crate::tensors::read_f32(name, &st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")), &mut out).unwrap();
        out
    };
    let mut worst = [0f64; 3];
    for (model, recipe, overrides) in MODELS {
        for (adjust, key) in [(AdjustLr::Original, "original"), (AdjustLr::MatchRmsAdamw, "match_rms_adamw")] {
            let c = config(recipe, overrides, adjust);
            let mut be = Cpu::new();
            let slice = TensorSlice::new(&c.model, 0, 1);
            let layout = slice.local.clone();
            let n = layout.len;
            let (params, grads) = (be.alloc(BufKind::Params, n), be.alloc(BufKind::Grads, n));
            let mut par = Parallel::new(
                &mut be,
                Box::new(Solo),
                Mesh::single(),
                slice,
                (params, grads),
                (FsdpOptions::of(&c.mesh), &[]),
            );
            let moments = (be.alloc(BufKind::OptState, n), be.alloc(BufKind::OptState, n));
            let norm = be.alloc(BufKind::Scalars, 1);
            let mut opt = Optimizer::new(&mut be, &par, &c.optim).unwrap();
            let flat = |prefix: &str| {
                let mut v = vec![0f32; n];
                for t in &layout.tensors {
                    v[t.offset..t.offset + t.len()].copy_from_slice(&read(&format!("{prefix}.{}", t.name), t.len()));
                }
                v
            };
            let mut before = flat(&format!("{model}.p0"));
            let (mut torch_before, mut exact_before) = (before.clone(), before.clone());
            be.upload(params, &before);
            for step in 1..=3u64 {
                be.upload(grads, &flat(&format!("{model}.g{step}")));
                par.grad_norm_squared(&mut be, norm);
                let rates = super::rates(&c.optim, 10, step as usize - 1);
                opt.step(&mut be, &mut par, moments, norm, &c.optim, rates, step, &[]);
                let mut got = vec![0f32; n];
                be.download(params, &mut got);
                let want = flat(&format!("{key}.{model}.step{step}"));
                let exact = flat(&format!("f64.{key}.{model}.step{step}"));
                for t in &layout.tensors {
                    let r = t.offset..t.offset + t.len();
                    // Norm-wise (L2) relative errors: of the parameters against torch's, and of
                    // each f32 run's step against the f64 one's.
                    let rel = |a: &[f32], b: &[f32]| {
                        let (d, n) = a.iter().zip(b).fold((0f64, 0f64), |(d, n), (&a, &b)| {
                            (d + (a as f64 - b as f64).powi(2), n + (b as f64).powi(2))
                        });
                        if n > 0.0 { (d / n).sqrt() } else { 0.0 }
                    };
                    let step_of = |after: &[f32], before: &[f32]| -> Vec<f32> {
                        after[r.clone()].iter().zip(&before[r.clone()]).map(|(a, b)| a - b).collect()
                    };
                    let ep = rel(&got[r.clone()], &want[r.clone()]);
                    assert!(ep < 1e-6, "{key} {model} step {step} {}: parameters {ep:.2e} from torch's", t.name);
                    let exact_step = step_of(&exact, &exact_before);
                    let (engine, torch) =
                        (rel(&step_of(&got, &before), &exact_step), rel(&step_of(&want, &torch_before), &exact_step));
                    worst = [worst[0].max(ep), worst[1].max(engine), worst[2].max(torch)];
                }
                (before, torch_before, exact_before) = (got, want, exact);
            }
            let mut g = vec![0f32; n];
            be.download(grads, &mut g);
            assert!(g.iter().all(|&x| x == 0.0), "the gradients are zeroed");
        }
    }
    worst
}

#[test]
fn the_fixture_spec_is_the_engines_layout() {
    let committed = std::fs::read_to_string(fixture_dir().join("spec.json")).unwrap_or_default();
    if std::env::var("ENGINE_WRITE_FIXTURES").is_ok_and(|v| v == "1") {
        std::fs::write(fixture_dir().join("spec.json"), spec()).unwrap();
        return;
    }
    assert_eq!(committed, spec(), "tests/fixtures/muon/spec.json: rerun with ENGINE_WRITE_FIXTURES=1 and make.py");
}

#[test]
fn muon_and_adamw_equal_pytorchs() {
    check(compare(&fixture_dir().join("reference.safetensors")), "");
}

/// The engine's steps are as close to the exact (f64) ones as torch's own f32 steps are, or
/// within 1e-6 of them.
fn check([param, engine, torch]: [f64; 3], what: &str) {
    eprintln!(
        "largest relative errors{what}: parameters against torch {param:.2e}; steps against f64: the engine's {engine:.2e}, torch's f32 {torch:.2e}"
    );
    assert!(
        engine <= (2.0 * torch).max(1e-6),
        "the engine's steps: {engine:.2e} from the f64 run's, torch's f32 {torch:.2e}"
    );
}

/// The reference made again from PyTorch (ENGINE_TEST_TORCH_PYTHON; skipped without).
#[test]
fn muon_and_adamw_equal_pytorchs_made_now() {
    let Ok(python) = std::env::var("ENGINE_TEST_TORCH_PYTHON") else {
        eprintln!("skipped: ENGINE_TEST_TORCH_PYTHON unset");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, self::spec()).unwrap();
    let out = dir.path().join("reference.safetensors");
    let status =
        std::process::Command::new(python).arg(fixture_dir().join("make.py")).args([&spec, &out]).status().unwrap();
    assert!(status.success(), "make.py failed");
    check(compare(&out), " (made now)");
}
