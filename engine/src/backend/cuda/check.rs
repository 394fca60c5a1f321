//! Checks of the CUDA backend against the f32 CPU reference: every op against its CPU twin, the
//! loss and gradients of whole models, graph replay, recomputation, the memory estimate, and
//! training that lowers the loss. `engine gpu-test` runs them on a GPU; the test suite runs
//! them on the [emulator](super::emulator) (smaller shapes, fewer steps).
//!
//! Inputs are drawn once, rounded to bf16 where the GPU keeps bf16, and given to both backends,
//! so an op's two results differ only by the GPU's arithmetic: f32 accumulation in another
//! order, bf16 rounding of what it stores in bf16. Tolerances (relative L2 error of a whole
//! tensor, and largest error over the largest magnitude):
//!
//! - outputs stored in bf16: 1e-2 and 5e-2 — one rounding is at most 2⁻⁹ ≈ 2e-3 of each
//!   element (RMS about 1e-3); ops that round intermediates (attention's probabilities and dS)
//!   add a few of those;
//! - outputs kept in f32 from the same bf16 inputs: 1e-4 and 1e-3 — only summation order differs;
//! - whole models against the f32 CPU model (GPU parameters rounded to bf16, activations stored
//!   in bf16 through every layer): loss within 0.5 % and every tensor's gradient within 3 %
//!   relative L2 of the reference (all of them together within 2 %). The emulator, whose bf16
//!   rounding is the GPU's, measures about 0.01 % on the loss and 0.5 to 1 % on the gradients:
//!   the margin of three covers the GPU's other summation orders and the full-size tiny
//!   configurations.

use std::time::Instant;

use super::Cuda;
use crate::backend::cpu::Cpu;
use crate::backend::{
    AdamWStep, AttnShape, Backend, BufKind, ExpertWeights, IdxView, MatMul, MoeDispatch, Segment, View, gib,
};
use crate::config::{Config, Remat, recipe};
use crate::model::memory::{self, Target};
use crate::model::{LOSS_SUM, Model, Plan, init};
use crate::rng;
use crate::train::Trainer;

/// One check's result.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// What was checked.
    pub name: String,
    /// Whether it passed.
    pub passed: bool,
    /// Measured errors or the failure.
    pub detail: String,
    /// Seconds it took.
    pub seconds: f64,
}

/// How big the checks are.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Shrink shapes for the emulator (which runs a GPU's thousands of threads on a few cores).
    pub emulated: bool,
    /// Training steps of each tiny configuration (the GPU check trains 200).
    pub train_steps: usize,
}

/// Opens a fresh backend for a check.
pub type Open<'a> = dyn FnMut() -> Result<Cuda, String> + 'a;

/// Runs every check whose name contains `filter`, reporting each as it ends.
pub fn run(scale: Scale, open: &mut Open, filter: &str, report: &mut dyn FnMut(&Outcome)) -> Vec<Outcome> {
    let checks = checks(scale);
    let mut out = Vec::new();
    for (name, check) in checks {
        if !name.contains(filter) {
            continue;
        }
        let start = Instant::now();
        let result = match open() {
            Ok(gpu) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(gpu, &mut *open))),
            Err(e) => Ok(Err(e)),
        };
        let (passed, detail) = match result {
            Ok(Ok(detail)) => (true, detail),
            Ok(Err(e)) => (false, e),
            Err(panic) => (false, format!("panicked: {}", panic_text(&panic))),
        };
        let o = Outcome { name: name.to_string(), passed, detail, seconds: start.elapsed().as_secs_f64() };
        report(&o);
        out.push(o);
    }
    out
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

type Check = Box<dyn Fn(Cuda, &mut Open) -> Result<String, String>>;

fn checks(scale: Scale) -> Vec<(String, Check)> {
    let mut v: Vec<(String, Check)> = Vec::new();
    let mut add = |name: &str, f: Check| v.push((name.to_string(), f));
    add("elementwise: fill, copy, add, sums", Box::new(|g, _| elementwise(g)));
    for (m, n, k) in [(64, 96, 80), (37, 45, 33)] {
        add(&format!("matmul {m}x{n}x{k}: forward, dx, dW, residual"), Box::new(move |g, _| matmul(g, m, n, k)));
    }
    add("embedding forward and backward", Box::new(|g, _| embedding(g)));
    for d in [256, 100] {
        add(&format!("rmsnorm d={d} forward and backward"), Box::new(move |g, _| rmsnorm(g, d)));
    }
    add("rope forward and inverse", Box::new(|g, _| rope(g)));
    let attention_shapes: &[(usize, usize, usize, usize, usize, usize)] = if scale.emulated {
        &[
            (1, 70, 4, 2, 64, 0),
            (1, 40, 2, 1, 128, 0),
            (2, 50, 2, 2, 8, 0),
            (1, 90, 2, 1, 32, 24),
            (1, 200, 2, 1, 64, 0),
            (1, 150, 2, 2, 128, 100),
        ]
    } else {
        &[
            (2, 200, 8, 2, 64, 0),
            (1, 300, 4, 1, 128, 0),
            (2, 130, 4, 4, 8, 0),
            (1, 257, 4, 2, 16, 0),
            (1, 400, 4, 2, 32, 100),
            (2, 512, 8, 8, 128, 128),
        ]
    };
    for &(b, s, h, kv, dh, w) in attention_shapes {
        let shape = AttnShape { batch: b, seq: s, n_heads: h, n_kv_heads: kv, head_dim: dh, window: w };
        add(
            &format!("attention B={b} S={s} H={h} KV={kv} dh={dh} window={w}: forward and backward"),
            Box::new(move |g, _| attention(g, shape)),
        );
    }
    for f in [128, 100] {
        add(&format!("swiglu f={f} forward and backward"), Box::new(move |g, _| swiglu(g, f)));
    }
    for v in [1000, 37] {
        add(&format!("cross-entropy V={v}"), Box::new(move |g, _| cross_entropy(g, v)));
    }
    add("mixture of experts: route, dispatch, experts, combine, backward", Box::new(|g, _| moe(g)));
    add("adamw with clipping and decay segments", Box::new(|g, _| adamw(g)));
    if !scale.emulated {
        add("nccl, world size 1: all-reduce, reduce-scatter, all-gather (f32, bf16)", Box::new(|g, _| nccl_alone(g)));
    }
    for name in ["tiny-llama2", "tiny-mistral", "tiny-mixtral"] {
        add(
            &format!("{name}: loss and gradients against the f32 CPU model"),
            Box::new(move |g, _| parity(g, name, &[], scale)),
        );
    }
    // Odd sizes: scalar fallbacks of the vector kernels, planned views padded for alignment.
    let odd = &["model.d_model=100", "model.mlp_dim=60", "train.seq_len=61", "train.batch_size=2"];
    add(
        "tiny-mistral with odd sizes (d_model 100, seq 61): loss and gradients",
        Box::new(move |g, _| parity(g, "tiny-mistral", odd, scale)),
    );
    add("tiny-llama2: CUDA graph replay matches eager steps", Box::new(move |g, open| graphs(g, open, scale)));
    add("tiny-llama2: gradients under remat=full match remat=none", Box::new(move |g, open| remat(g, open, scale)));
    add("memory estimate matches what the backend allocates", Box::new(move |g, _| memory_estimate(g, scale)));
    for name in ["tiny-llama2", "tiny-mistral", "tiny-mixtral"] {
        add(
            &format!("{name}: {} training steps lower the loss", scale.train_steps),
            Box::new(move |g, _| training(g, name, scale)),
        );
    }
    v
}

// ---- comparing ------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Tol {
    rel_l2: f64,
    max: f64,
}
const BF16: Tol = Tol { rel_l2: 1e-2, max: 5e-2 };
const F32: Tol = Tol { rel_l2: 1e-4, max: 1e-3 };

/// Relative L2 error and largest error over the largest magnitude; Err past the tolerance.
fn compare(what: &str, cpu: &[f32], gpu: &[f32], tol: Tol) -> Result<String, String> {
    assert_eq!(cpu.len(), gpu.len());
    if let Some(i) = gpu.iter().position(|x| !x.is_finite()) {
        return Err(format!("{what}: element {i} is {} on the GPU ({} on the CPU)", gpu[i], cpu[i]));
    }
    let (mut diff2, mut ref2, mut max_err, mut max_ref) = (0f64, 0f64, 0f64, 0f64);
    for (&c, &g) in cpu.iter().zip(gpu) {
        let d = (g as f64 - c as f64).abs();
        diff2 += d * d;
        ref2 += (c as f64).powi(2);
        max_err = max_err.max(d);
        max_ref = max_ref.max((c as f64).abs());
    }
    let rel = if ref2 > 0.0 { (diff2 / ref2).sqrt() } else { diff2.sqrt() };
    let max = if max_ref > 0.0 { max_err / max_ref } else { max_err };
    let text = format!("{what} {rel:.1e}/{max:.1e}");
    if rel <= tol.rel_l2 && max <= tol.max {
        Ok(text)
    } else {
        Err(format!("{text} (tolerance {:.0e}/{:.0e})", tol.rel_l2, tol.max))
    }
}

/// The same buffers on the CPU and the GPU, filled with the same values.
struct Twin {
    cpu: Cpu,
    gpu: Cuda,
    draws: u64,
    notes: Vec<String>,
}

impl Twin {
    fn new(gpu: Cuda) -> Twin {
        Twin { cpu: Cpu::new(), gpu, draws: 0, notes: Vec::new() }
    }

    fn alloc(&mut self, kind: BufKind, len: usize) -> View {
        let (a, b) = (self.cpu.alloc(kind, len), self.gpu.alloc(kind, len));
        assert_eq!(a, b, "the backends number buffers alike");
        a
    }

    fn idx(&mut self, data: &[u32]) -> IdxView {
        let (a, b) = (self.cpu.alloc_idx(data.len()), self.gpu.alloc_idx(data.len()));
        assert_eq!(a, b);
        self.cpu.upload_idx(a, data);
        self.gpu.upload_idx(a, data);
        a
    }

    /// Values `scale · N(0, 1)`, rounded to bf16 for kinds the GPU keeps in bf16.
    fn random(&mut self, kind: BufKind, len: usize, scale: f32) -> View {
        self.draws += 1;
        let data: Vec<f32> = (0..len).map(|i| scale * rng::normal_pair(99, self.draws, i as u64).0).collect();
        self.set(kind, &data)
    }

    fn set(&mut self, kind: BufKind, data: &[f32]) -> View {
        let v = self.alloc(kind, data.len());
        let rounded: Vec<f32> = if matches!(kind, BufKind::Activations | BufKind::Params) {
            data.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
        } else {
            data.to_vec()
        };
        self.cpu.upload(v, &rounded);
        self.gpu.upload(v, &rounded);
        v
    }

    fn both(&mut self, f: impl Fn(&mut dyn Backend)) {
        f(&mut self.cpu);
        f(&mut self.gpu);
    }

    fn check(&mut self, what: &str, v: View, tol: Tol) -> Result<(), String> {
        let (mut c, mut g) = (vec![0f32; v.len], vec![0f32; v.len]);
        self.cpu.download(v, &mut c);
        self.gpu.download(v, &mut g);
        self.notes.push(compare(what, &c, &g, tol)?);
        Ok(())
    }

    fn check_idx(&mut self, what: &str, v: IdxView) -> Result<(), String> {
        let (mut c, mut g) = (vec![0u32; v.len], vec![0u32; v.len]);
        self.cpu.download_idx(v, &mut c);
        self.gpu.download_idx(v, &mut g);
        match c.iter().zip(&g).position(|(a, b)| a != b) {
            None => {
                self.notes.push(format!("{what} exact"));
                Ok(())
            }
            Some(i) => Err(format!("{what}: entry {i} is {} on the GPU, {} on the CPU", g[i], c[i])),
        }
    }

    fn done(self) -> Result<String, String> {
        Ok(self.notes.join(", "))
    }
}

use BufKind::{Activations as ACT, Grads as GRAD, OptState as OPT, Params as PARAM, Scalars as F32S};

// ---- ops ------------------------------------------------------------------------------------

fn elementwise(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 3001;
    // Each op reads inputs no other op wrote: a bf16 result differs from the CPU's f32 one.
    let (a, b, c, d) = (t.random(ACT, n, 1.0), t.random(ACT, n, 1.0), t.random(ACT, n, 1.0), t.random(ACT, n, 1.0));
    let (f, g, out) = (t.random(F32S, n, 1.0), t.random(GRAD, n, 1.0), t.alloc(F32S, 4));
    let (copies, to_bf16) = (t.alloc(F32S, n), t.alloc(ACT, n));
    t.both(|be| {
        be.sum(out.at(0, 1), c);
        be.sum_squares(out.at(1, 1), g);
        be.sum(out.at(2, 1), f);
        be.sum_squares(out.at(3, 1), d);
        be.copy(copies.at(0, 1000), c.at(0, 1000));
        be.copy(copies.at(1000, 1000), g.at(0, 1000));
        be.fill(copies.at(2000, 1001), 0.25);
        be.copy(to_bf16.at(0, 1000), d.at(0, 1000));
        be.copy(to_bf16.at(1000, 2001), f.at(0, 2001));
        be.add(a, b);
        be.add(g, c);
        be.add(d, f);
    });
    t.check("sums", out, F32)?;
    t.check("copies and fill into f32", copies, F32)?;
    t.check("copies into bf16", to_bf16, BF16)?;
    t.check("add bf16+bf16", a, BF16)?;
    t.check("add f32+bf16", g, F32)?;
    t.check("add bf16+f32", d, BF16)?;
    t.done()
}

fn matmul(gpu: Cuda, m: usize, n: usize, k: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (x, w) = (t.random(ACT, m * k, 1.0), t.random(PARAM, n * k, 0.05));
    let (y, res) = (t.alloc(ACT, m * n), t.random(ACT, m * n, 1.0));
    let dy = t.random(ACT, m * n, 1.0);
    let (dx, dw) = (t.alloc(ACT, m * k), t.random(GRAD, n * k, 0.1));
    let (logits, stream, sum) = (t.alloc(F32S, m * n), t.random(ACT, m * n, 1.0), t.alloc(ACT, m * n));
    t.both(|be| {
        be.matmul(y, x, w, MatMul::linear(m, k, n));
        be.matmul(res, x, w, MatMul::linear(m, k, n).accumulating());
        be.matmul_add(sum, x, w, stream, MatMul::linear(m, k, n));
        be.matmul(dx, dy, w, MatMul::linear_dx(m, k, n));
        be.matmul(dw, dy, x, MatMul::linear_dw(m, k, n));
        be.matmul(logits, x, w, MatMul::linear(m, k, n));
    });
    t.check("x·Wᵀ", y, BF16)?;
    t.check("residual + x·Wᵀ", res, BF16)?;
    t.check("residual + x·Wᵀ into another buffer", sum, BF16)?;
    t.check("dy·W", dx, BF16)?;
    t.check("dW += dyᵀ·x (f32)", dw, F32)?;
    t.check("x·Wᵀ into f32", logits, F32)?;
    t.done()
}

fn embedding(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (v, d, n) = (50, 64, 120);
    let table = t.random(PARAM, v * d, 1.0);
    let tokens: Vec<u32> = (0..n).map(|i| (rng::bits(5, 0, i) % 20) as u32).collect(); // repeats
    let tok = t.idx(&tokens);
    let (out, dout, dtable) =
        (t.alloc(ACT, n as usize * d), t.random(ACT, n as usize * d, 1.0), t.random(GRAD, v * d, 0.1));
    t.both(|be| {
        be.embedding_forward(out, table, tok, d);
        be.embedding_backward(dtable, dout, tok, d);
    });
    t.check("forward", out, BF16)?;
    t.check("backward (f32 atomics)", dtable, F32)?;
    t.done()
}

fn rmsnorm(gpu: Cuda, d: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let rows = 75;
    let (x, w) = (t.random(ACT, rows * d, 1.0), t.random(PARAM, d, 1.0));
    let (out, rstd) = (t.alloc(ACT, rows * d), t.alloc(F32S, rows));
    let (dout, dx, dw) = (t.random(ACT, rows * d, 1.0), t.random(ACT, rows * d, 1.0), t.random(GRAD, d, 1.0));
    t.both(|be| {
        be.rmsnorm_forward(out, rstd, x, w, d, 1e-5);
        be.rmsnorm_backward(dx, dw, dout, x, w, rstd, d);
    });
    t.check("y", out, BF16)?;
    t.check("rstd", rstd, F32)?;
    t.check("dx (added to the residual's)", dx, BF16)?;
    t.check("dw", dw, Tol { rel_l2: 1e-3, max: 1e-2 })?;
    t.done()
}

fn rope(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let s = AttnShape { batch: 2, seq: 33, n_heads: 4, n_kv_heads: 2, head_dim: 16, window: 0 };
    let config = crate::config::ModelConfig { head_dim: 16, rope_theta: 500.0, ..Default::default() };
    let table = crate::model::rope::table(&config, s.seq);
    let tab = t.set(F32S, &table);
    let (qkv, back) = (t.random(ACT, s.rows() * s.qkv_width(), 1.0), t.alloc(ACT, s.rows() * s.qkv_width()));
    t.both(|be| {
        be.rope(qkv, tab, s, false);
        be.copy(back, qkv);
        be.rope(back, tab, s, true);
    });
    t.check("rotated", qkv, BF16)?;
    t.check("rotated back", back, BF16)?;
    t.done()
}

fn attention(gpu: Cuda, s: AttnShape) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let qkv = t.random(ACT, s.rows() * s.qkv_width(), 1.0);
    let (out, lse) = (t.alloc(ACT, s.rows() * s.q_width()), t.alloc(F32S, s.rows() * s.n_heads));
    let (dout, dqkv) = (t.random(ACT, s.rows() * s.q_width(), 1.0), t.alloc(ACT, s.rows() * s.qkv_width()));
    t.both(|be| {
        be.attention_forward(out, lse, qkv, s);
        be.attention_backward(dqkv, dout, qkv, out, lse, s);
    });
    t.check("out", out, BF16)?;
    t.check("lse", lse, F32)?;
    let (q, kv) = (s.q_width(), s.n_kv_heads * s.head_dim);
    // dq, dk, dv separately: each has its own scale.
    let cols = |start: usize, width: usize| -> Vec<usize> {
        (0..s.rows()).flat_map(|r| (0..width).map(move |c| r * s.qkv_width() + start + c)).collect()
    };
    let (mut c, mut g) = (vec![0f32; dqkv.len], vec![0f32; dqkv.len]);
    t.cpu.download(dqkv, &mut c);
    t.gpu.download(dqkv, &mut g);
    for (name, start, width) in [("dq", 0, q), ("dk", q, kv), ("dv", q + kv, kv)] {
        let idx = cols(start, width);
        let pick = |x: &[f32]| idx.iter().map(|&i| x[i]).collect::<Vec<f32>>();
        t.notes.push(compare(name, &pick(&c), &pick(&g), Tol { rel_l2: 2e-2, max: 8e-2 })?);
    }
    t.done()
}

fn swiglu(gpu: Cuda, f: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 37;
    let (gu, dh) = (t.random(ACT, n * 2 * f, 2.0), t.random(ACT, n * f, 1.0));
    let (h, dgu) = (t.alloc(ACT, n * f), t.alloc(ACT, n * 2 * f));
    t.both(|be| {
        be.swiglu_forward(h, gu, f);
        be.swiglu_backward(dgu, dh, gu, f);
    });
    t.check("h", h, BF16)?;
    t.check("dgu", dgu, BF16)?;
    t.done()
}

fn cross_entropy(gpu: Cuda, v: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 45;
    let targets: Vec<u32> = (0..n).map(|i| (rng::bits(8, 1, i) % v as u64) as u32).collect();
    let tgt = t.idx(&targets);
    let (logits, grads) = (t.random(ACT, n as usize * v, 3.0), t.random(ACT, n as usize * v, 3.0));
    let (l1, l2) = (t.alloc(F32S, n as usize), t.alloc(F32S, n as usize));
    t.both(|be| {
        be.cross_entropy(l1, logits, tgt, v, None);
        be.cross_entropy(l2, grads, tgt, v, Some(0.5));
    });
    t.check("losses", l1, F32)?;
    t.check("losses with gradient", l2, F32)?;
    t.check("gradient", grads, BF16)?;
    t.done()
}

fn moe(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (n, e, k, d, f) = (90, 8, 2, 64, 48);
    let rows = n * k;
    let router_logits = t.random(F32S, n * e, 1.5);
    let probs = t.alloc(F32S, n * e);
    let mut idx = |len: usize| t.idx(&vec![0; len]);
    let (expert, slot_row, row_slot, offsets) = (idx(rows), idx(rows), idx(rows), idx(e + 1));
    let dispatch = MoeDispatch {
        tokens: n,
        experts: e,
        top_k: k,
        expert,
        weight: t.alloc(F32S, rows),
        slot_row,
        row_slot,
        offsets,
        stats: t.alloc(F32S, 2 * e),
    };
    let x = t.random(ACT, n * d, 1.0);
    let weights = t.random(PARAM, e * 3 * f * d, 0.1);
    let gate_up = ExpertWeights { first: weights.at(0, 2 * f * d), stride: 3 * f * d };
    let down = ExpertWeights { first: weights.at(2 * f * d, d * f), stride: 3 * f * d };
    let dweights = t.random(GRAD, e * 3 * f * d, 0.01);
    let dgate_up = ExpertWeights { first: dweights.at(0, 2 * f * d), ..gate_up };
    let ddown = ExpertWeights { first: dweights.at(2 * f * d, d * f), ..down };
    let (xe, gu, h, ye) =
        (t.alloc(ACT, rows * d), t.alloc(ACT, rows * 2 * f), t.alloc(ACT, rows * f), t.alloc(ACT, rows * d));
    let (out, dout) = (t.alloc(ACT, n * d), t.random(ACT, n * d, 1.0));
    let (dye, dweight, dh, dxe, dx) = (
        t.alloc(ACT, rows * d),
        t.alloc(F32S, rows),
        t.alloc(ACT, rows * f),
        t.alloc(ACT, rows * d),
        t.alloc(ACT, n * d),
    );
    let dgu = t.random(ACT, rows * 2 * f, 1.0);
    let (counts, drouter) = (t.random(F32S, e, 10.0), t.alloc(ACT, n * e));
    t.both(|be| {
        be.moe_route(probs, router_logits, dispatch);
        be.moe_gather(xe, x, dispatch, d);
        be.moe_expert_matmul(gu, xe, gate_up, dispatch, MatMul::linear(0, d, 2 * f));
        be.swiglu_forward(h, gu, f);
        be.moe_expert_matmul(ye, h, down, dispatch, MatMul::linear(0, f, d));
        be.moe_combine(out, ye, dispatch, d);
        be.moe_combine_backward(dye, dweight, dout, ye, dispatch, d);
        be.moe_expert_matmul(dh, dye, down, dispatch, MatMul::linear_dx(0, f, d));
        be.moe_expert_matmul_dw(ddown, dye, h, dispatch, f, d);
        be.moe_expert_matmul(dxe, dgu, gate_up, dispatch, MatMul::linear_dx(0, d, 2 * f));
        be.moe_expert_matmul_dw(dgate_up, dgu, xe, dispatch, d, 2 * f);
        be.moe_gather_backward(dx, dxe, dispatch, d);
        be.moe_route_backward(drouter, dweight, probs, dispatch, counts, 0.01);
    });
    t.check("probs", probs, F32)?;
    t.check_idx("experts", dispatch.expert)?;
    t.check("weights", dispatch.weight, F32)?;
    for (name, v) in [("slot rows", dispatch.slot_row), ("row slots", dispatch.row_slot), ("offsets", dispatch.offsets)]
    {
        t.check_idx(name, v)?;
    }
    t.check("stats", dispatch.stats, F32)?;
    t.check("gathered", xe, BF16)?;
    t.check("gate and up (grouped GEMM)", gu, BF16)?;
    t.check("down (grouped GEMM)", ye, BF16)?;
    t.check("combined", out, BF16)?;
    t.check("dye", dye, BF16)?;
    // From here on the inputs themselves went through bf16 on the GPU (ye, dye, h): bf16 level.
    t.check("dweight", dweight, BF16)?;
    t.check("dh (grouped dx GEMM)", dh, BF16)?;
    t.check("dxe", dxe, BF16)?;
    t.check("dW (grouped dW GEMM)", dweights, BF16)?;
    t.check("dx", dx, BF16)?;
    t.check("drouter", drouter, BF16)?;
    t.done()
}

fn adamw(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 4099;
    let (p, g) = (t.random(PARAM, n, 1.0), t.random(GRAD, n, 1.0));
    let (m, v, norm) = (t.random(OPT, n, 0.1), t.set(OPT, &vec![0.3; n]), t.alloc(F32S, 1));
    let segments = [
        Segment { offset: 0, len: 1000, decay: true },
        Segment { offset: 1000, len: 7, decay: false },
        Segment { offset: 1007, len: 3000, decay: true },
        Segment { offset: 4010, len: 89, decay: false },
    ];
    let step = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3, max_grad_norm: 1.0 };
    t.both(|be| {
        be.sum_squares(norm, g);
        be.adamw(p, g, m, v, norm, &segments, step);
    });
    t.check("parameters (f32 master)", p, F32)?;
    t.check("m", m, F32)?;
    t.check("v", v, F32)?;
    t.check("gradients zeroed", g, F32)?;
    t.done()
}

// ---- models ---------------------------------------------------------------------------------

/// A built-in tiny configuration, scaled down for the emulator.
fn tiny(name: &str, scale: Scale, extra: &[&str]) -> Config {
    let mut texts: Vec<&str> = Vec::new();
    if scale.emulated {
        texts.extend(["model.vocab_size=512", "train.seq_len=64"]);
        texts.extend(match name {
            "tiny-llama2" => &["model.d_model=256", "model.mlp_dim=512", "model.n_heads=2", "model.n_kv_heads=2"][..],
            "tiny-mistral" => &["model.d_model=256", "model.mlp_dim=128", "model.sliding_window=24"][..],
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
    model.forward(be, plan, Some(1.0 / n as f32), &mut crate::model::Alone);
    model.backward(be, plan, model.aux_scale(plan, 1.0), &mut crate::model::Alone);
    let (mut loss, mut grads) = ([0f32], vec![0f32; plan.grads.len]);
    be.download(plan.scalars.at(LOSS_SUM, 1), &mut loss);
    be.download(plan.grads, &mut grads);
    (loss[0], grads)
}

fn parity(gpu: Cuda, name: &str, extra: &[&str], scale: Scale) -> Result<String, String> {
    let config = tiny(name, scale, extra);
    let model = Model::new(&config.model);
    let (batch, seq) = (config.train.batch_size, config.train.seq_len);
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
    let close = (gl - cl).abs() <= 0.005 * cl.abs();
    if !close {
        return Err(format!("loss {gl} on the GPU, {cl} on the CPU (tolerance 0.5 %)"));
    }
    let mut worst = (0f64, String::new());
    for tensor in &model.layout.tensors {
        let r = tensor.offset..tensor.offset + tensor.len();
        let (c, g) = (&cpu_grads[r.clone()], &gpu_grads[r]);
        if c.iter().all(|&x| x == 0.0) {
            continue; // an expert no token reached
        }
        let text = compare(&tensor.name, c, g, Tol { rel_l2: 0.03, max: 1.0 })?;
        let rel: f64 = text.split_whitespace().last().and_then(|s| s.split('/').next()?.parse().ok()).unwrap_or(0.0);
        if rel > worst.0 {
            worst = (rel, text);
        }
    }
    notes.push(format!("worst gradient: {}", worst.1));
    notes.push(compare("all gradients", &cpu_grads, &gpu_grads, Tol { rel_l2: 0.02, max: 1.0 })?);
    Ok(notes.join(", "))
}

/// Losses of `steps` training steps of a tiny configuration, and the sections recorded.
fn train_losses(gpu: Cuda, config: &Config, steps: usize) -> Result<(Vec<f64>, usize), String> {
    let mut trainer = Trainer::new(gpu, config).map_err(|e| format!("{e:#}"))?;
    let losses = (0..steps).map(|_| trainer.train_step(0.0).loss).collect();
    Ok((losses, trainer.backend.recorded_sections()))
}

fn graphs(gpu: Cuda, open: &mut Open, scale: Scale) -> Result<String, String> {
    let steps = 4;
    let (graphs, recorded) = train_losses(gpu, &tiny("tiny-llama2", scale, &[]), steps)?;
    let (eager, none) = train_losses(open()?, &tiny("tiny-llama2", scale, &["train.cuda_graphs=false"]), steps)?;
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

fn remat(gpu: Cuda, open: &mut Open, scale: Scale) -> Result<String, String> {
    let grads = |gpu: Cuda, remat: Remat| {
        let config = tiny("tiny-llama2", scale, &["model.n_layers=2"]);
        let mut model = Model::new(&config.model);
        model.remat = remat;
        let (batch, seq) = (config.train.batch_size, config.train.seq_len);
        let params = init::params(&model, 7);
        let tokens: Vec<u32> = (0..=batch * seq).map(|i| (i * 7 % 200) as u32).collect();
        let mut gpu = gpu;
        let plan = model.plan(&mut gpu, batch, seq);
        model_step(&mut gpu, &model, &plan, &params, &tokens).1
    };
    let none = grads(gpu, Remat::None);
    let full = grads(open()?, Remat::Full);
    compare("gradients", &none, &full, Tol { rel_l2: 1e-2, max: 5e-2 })
}

fn memory_estimate(gpu: Cuda, scale: Scale) -> Result<String, String> {
    let config = tiny("tiny-mixtral", scale, &["train.batch_size=2", "train.remat=minimal"]);
    let mut model = Model::new(&config.model);
    model.remat = config.train.remat;
    let target = Target::Cuda { sm_count: gpu.info().sm_count as usize };
    let estimate = memory::estimate(&model, config.train.batch_size, config.train.seq_len, target).total();
    let mut trainer = Trainer::new(gpu, &config).map_err(|e| format!("{e:#}"))?;
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

fn training(gpu: Cuda, name: &str, scale: Scale) -> Result<String, String> {
    let config = tiny(name, scale, &[&format!("train.steps={}", scale.train_steps)]);
    let (losses, _) = train_losses(gpu, &config, scale.train_steps)?;
    let tail = &losses[losses.len().saturating_sub(5)..];
    let last = tail.iter().sum::<f64>() / tail.len() as f64;
    let detail = format!("loss {:.3} -> {:.3} (mean of the last {})", losses[0], last, tail.len());
    if losses.iter().any(|l| !l.is_finite()) || last > 0.85 * losses[0] { Err(detail) } else { Ok(detail) }
}

/// NCCL on one GPU: every collective over a group of one leaves the data as it was, in f32 and
/// in bf16, on the backend's stream.
fn nccl_alone(mut gpu: Cuda) -> Result<String, String> {
    use crate::parallel::comm::Collectives;
    use crate::parallel::nccl::{Nccl, unique_id};
    let id = unique_id().map_err(|e| e.to_string())?;
    let mut comm = Nccl::init(&id, 0, 1).map_err(|e| e.to_string())?;
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
    if failures.is_empty() { Ok(format!("{n} elements unchanged in f32 and bf16")) } else { Err(failures.join("; ")) }
}
