//! Checks of the CUDA backend against the f32 CPU reference: every op against its CPU twin, the
//! loss and gradients of whole models, graph replay, recomputation, the memory estimate, and
//! training that lowers the loss. `engine gpu-test` runs them on a GPU; the test suite runs
//! them on the [emulator](crate::backend::cuda::emulator) (smaller shapes, fewer steps).
//!
//! This module drives the checks and compares results; `ops.rs` holds the checks of single ops,
//! `models.rs` those of whole models and training. It sits above the backends, the model and the
//! trainer, all of which it uses.
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
//!   configurations. Gemma 3, worse conditioned (`models::parity` says why), within 6 % and 5 %
//!   (the emulator: up to 3.3 % and 2.5 %).

mod models;
mod ops;

use std::time::Instant;

use crate::backend::cuda::Cuda;
use crate::backend::{AttnShape, SeqSplit};
use models::{expert_axis, fsdp_bf16_gathers, graphs, memory_estimate, nccl_alone, parity, remat, training};
use ops::{
    adamw, adamw_fp8, attention, attention_split, cross_entropy, elementwise, embedding, fp8, gelu, layernorm,
    load_excess_and_bias_step, matmul, moe, moe_fp8, qk_norm, rmsnorm, rope, sigmoid_routing, swiglu,
};

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
pub type Open<'a> = dyn FnMut() -> anyhow::Result<Cuda> + 'a;

/// Runs every check whose name contains `filter` (ignoring case: `FP8` takes the casts' `fp8`
/// checks, `muon` the MuonClip step's), reporting each as it ends.
pub fn run(scale: Scale, open: &mut Open, filter: &str, report: &mut dyn FnMut(&Outcome)) -> Vec<Outcome> {
    let checks = checks(scale);
    let filter = filter.to_lowercase();
    let mut out = Vec::new();
    for (name, check) in checks {
        if !name.to_lowercase().contains(&filter) {
            continue;
        }
        let start = Instant::now();
        let result = match open() {
            Ok(gpu) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(gpu, &mut *open))),
            Err(e) => Ok(Err(failure(e))),
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

/// An error as a check's failure: the error and its causes on one line.
fn failure(e: anyhow::Error) -> String {
    format!("{e:#}")
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .or_else(|| p.downcast_ref::<crate::backend::cuda::CudaFailure>().map(|f| f.to_string()))
        .unwrap_or_default()
}

/// The attention checks' shapes: (batch, seq, heads, kv heads, head width, window, must have
/// unmasked tiles). The last shapes of each list give both passes whole tiles that skip the
/// mask, at head widths 64 and 128 (the backward pass's 128-key blocks, and its 32-query tiles
/// at 128), and grids of several blocks along every axis (query or key tiles, heads, batch), so
/// that the order the blocks are dealt out in touches every index of the grid. The wide heads
/// (192: DeepSeek-V3's packed latent heads; 256: Gemma 3's), whose forward pass takes 32-key
/// tiles and whose backward pass makes two passes, are checked at their padded widths and below
/// them (136 and 200: zero-filled columns), on at least two key blocks of the backward pass, with
/// whole tiles in both passes.
type AttnCase = (usize, usize, usize, usize, usize, usize, bool);
fn attention_shapes(emulated: bool) -> &'static [AttnCase] {
    if emulated {
        &[
            (1, 70, 4, 2, 64, 0, false),
            (1, 40, 2, 1, 128, 0, false),
            (2, 50, 2, 2, 8, 0, false),
            (1, 90, 2, 1, 32, 24, false),
            (1, 200, 2, 1, 64, 0, true),
            (1, 150, 2, 2, 128, 100, false),
            (2, 192, 4, 2, 64, 0, true),
            (2, 160, 2, 1, 128, 0, true),
            (1, 320, 2, 1, 64, 200, true),
            (1, 160, 2, 1, 192, 0, true),
            (1, 100, 2, 2, 136, 40, false),
            (1, 96, 2, 1, 256, 0, true),
            (1, 80, 2, 1, 200, 30, false),
        ]
    } else {
        &[
            (2, 200, 8, 2, 64, 0, true),
            (1, 300, 4, 1, 128, 0, true),
            (2, 130, 4, 4, 8, 0, false),
            (1, 257, 4, 2, 16, 0, true),
            (1, 400, 4, 2, 32, 100, false),
            (2, 512, 8, 8, 128, 200, true),
            (3, 1024, 8, 2, 64, 0, true),
            (2, 1000, 4, 2, 128, 300, true),
            (2, 333, 8, 2, 192, 0, true),
            (1, 700, 4, 1, 256, 250, true),
            (2, 260, 4, 4, 136, 0, true),
            (1, 515, 4, 2, 200, 0, true),
        ]
    }
}

/// Attention at a softmax scale of its own (Gemma 3's `query_pre_attn_scalar`), well off
/// `1 / sqrt(head_dim)`: a shape as in [`attention_shapes`] (with both passes' unmasked tiles, the
/// scale entering the masked and the unmasked paths) and the scale.
fn scaled_attention_shapes(emulated: bool) -> &'static [(AttnCase, f32)] {
    if emulated { &[((1, 192, 2, 1, 64, 0, true), 0.3)] } else { &[((2, 512, 8, 2, 128, 200, true), 0.2)] }
}

/// The sequence axis's attention checks: (batch, rows of a sequence on a rank, heads, kv
/// heads, head width, window, rank, ranks, an EOS every so many positions). On the emulator the
/// wide heads' split kernels are checked in a window (their cost grows with the keys each query
/// sees).
type SplitCase = (usize, usize, usize, usize, usize, usize, usize, usize, Option<usize>);
fn split_attention_shapes(emulated: bool) -> &'static [SplitCase] {
    if emulated {
        &[
            (1, 256, 2, 1, 64, 0, 1, 2, Some(150)),
            (1, 256, 2, 2, 16, 0, 0, 2, None),
            (1, 256, 1, 1, 192, 40, 1, 2, Some(100)),
            (1, 256, 2, 1, 256, 30, 0, 2, None),
        ]
    } else {
        &[
            (2, 512, 8, 2, 64, 0, 0, 2, None),
            (1, 256, 4, 1, 128, 0, 2, 4, Some(300)),
            (2, 256, 4, 2, 32, 200, 1, 2, None),
            (1, 1024, 4, 2, 64, 0, 3, 4, Some(700)),
            (1, 256, 4, 2, 192, 0, 1, 2, Some(300)),
            (2, 512, 4, 1, 256, 100, 2, 4, None),
        ]
    }
}

/// The sequence axis at a softmax scale of its own, in a sliding window that reaches into
/// another rank's chunk.
fn scaled_split_attention_shapes(emulated: bool) -> &'static [(SplitCase, f32)] {
    if emulated { &[((1, 256, 2, 1, 64, 40, 1, 2, None), 0.3)] } else { &[((2, 512, 4, 2, 128, 300, 1, 2, None), 0.2)] }
}

/// A check's name's mention of a softmax scale of its own.
fn scale_text(scale: Option<f32>) -> String {
    scale.map(|c| format!(" scale={c}")).unwrap_or_default()
}

type Check = Box<dyn Fn(Cuda, &mut Open) -> Result<String, String>>;

fn checks(scale: Scale) -> Vec<(String, Check)> {
    let mut v: Vec<(String, Check)> = Vec::new();
    let mut add = |name: &str, f: Check| v.push((name.to_string(), f));
    add("elementwise: fill, copy, add, sums", Box::new(|g, _| elementwise(g)));
    for (m, n, k) in [(64, 96, 80), (37, 45, 33)] {
        add(&format!("matmul {m}x{n}x{k}: forward, dx, dW, residual"), Box::new(move |g, _| matmul(g, m, n, k)));
    }
    // FP8: sizes of multiples of 16 (cuBLASLt's rule), one with a partial 32 × 32 transpose tile.
    for (m, n, k) in [(64, 96, 80), (48, 32, 112)] {
        add(
            &format!("fp8 {m}x{n}x{k}: casts, delayed update, forward and dW products"),
            Box::new(move |g, _| fp8(g, m, n, k)),
        );
    }
    add("embedding forward and backward", Box::new(|g, _| embedding(g)));
    // d 256: the 8-wide kernel with one warp a block; d 100: the scalar one with four warps;
    // d 1024: the 8-wide one with four warps, whose backward pass walks its rows in chunks of
    // four (75 rows: 10 a block on the emulator's 2 SMs, so full and partial chunks). Offset
    // 1: Gemma's `1 + w`.
    for (d, offset) in [(256, 0.0), (100, 1.0), (1024, 1.0)] {
        add(
            &format!("rmsnorm d={d} offset={offset} forward and backward"),
            Box::new(move |g, _| rmsnorm(g, d, offset)),
        );
    }
    // QK-norm (B, S, H, KV, dh): heads of 128 and 64 on the 8-wide kernels, 20 on the scalar
    // ones; 24 heads a row, more than a block's 8 warps; odd row counts, so that the backward
    // pass's blocks hold unequal numbers of rows (on the emulator's 2 SMs, 33 rows are blocks of
    // 5 and one of 3) and its warps unequal numbers of head vectors.
    let qk_norm_shapes: &[(usize, usize, usize, usize, usize)] = if scale.emulated {
        &[(1, 7, 4, 2, 128), (3, 11, 4, 2, 64), (1, 5, 16, 8, 64), (1, 9, 2, 1, 20)]
    } else {
        &[(2, 333, 4, 2, 128), (3, 257, 4, 2, 64), (2, 129, 16, 8, 128), (1, 75, 2, 1, 20)]
    };
    // The last two with Gemma 3's `1 + w` (8-wide and scalar kernels).
    for (k, &(b, s, h, kv, dh)) in qk_norm_shapes.iter().enumerate() {
        let shape = AttnShape { batch: b, seq: s, n_heads: h, n_kv_heads: kv, head_dim: dh, window: 0, scale: None };
        let offset = if k >= 2 { 1.0 } else { 0.0 };
        add(
            &format!("qk-norm B={b} S={s} H={h} KV={kv} dh={dh} offset={offset}: forward and backward"),
            Box::new(move |g, _| qk_norm(g, shape, offset)),
        );
    }
    // Fewer rows on the emulator, where a row of the backward pass is slow (35 s at 75 x 256).
    let rows = if scale.emulated { 20 } else { 75 };
    for d in [256, 100] {
        add(&format!("layernorm {rows}x{d} forward and backward"), Box::new(move |g, _| layernorm(g, rows, d)));
    }
    add("scale: bf16 and f32, in place", Box::new(|g, _| ops::scale(g, 3001)));
    // Gemma's final-logit soft-capping at 30 (Gemma 2's), on values far past it.
    add("softcap cap=30 forward and backward (bf16 logits and f32)", Box::new(|g, _| ops::softcap(g, 3001, 30.0)));
    for (n, tanh) in [(4096, true), (1001, false)] {
        add(&format!("gelu n={n} tanh={tanh} forward and backward"), Box::new(move |g, _| gelu(g, n, tanh)));
    }
    add("rope forward and inverse", Box::new(|g, _| rope(g)));
    // MLA (rows, seq, heads, nope, rope, v, interleave, q scale): interleaved rotary pairs with
    // a query scale, and plain ones with v narrower than nope; rows of two sequences.
    type MlaCase = (usize, usize, usize, usize, usize, usize, bool, f32);
    let mla_shapes: &[MlaCase] = if scale.emulated {
        &[(10, 5, 3, 8, 4, 6, true, 1.3), (7, 7, 2, 16, 8, 12, false, 1.0)]
    } else {
        &[(2 * 257, 257, 16, 128, 64, 128, true, 1.7), (2 * 100, 100, 4, 32, 16, 24, false, 1.0)]
    };
    for &(rows, seq, heads, nope, rope, v, interleave, q_scale) in mla_shapes {
        let shape = crate::backend::MlaShape { rows, seq, heads, nope, rope, v, interleave };
        let pairs = if interleave { "interleaved" } else { "halves" };
        add(
            &format!("mla qkv assembly N={rows} S={seq} H={heads} nope={nope} rope={rope} v={v} {pairs}"),
            Box::new(move |g, _| ops::mla_qkv(g, shape, q_scale)),
        );
    }
    add("mla heads narrow and widen", Box::new(|g, _| ops::heads_narrow_widen(g, 9, 3, 12, 7)));
    // The default softmax scale's shapes, then those of a scale of their own.
    let attention_cases: Vec<(AttnCase, Option<f32>)> = attention_shapes(scale.emulated)
        .iter()
        .map(|&c| (c, None))
        .chain(scaled_attention_shapes(scale.emulated).iter().map(|&(c, sc)| (c, Some(sc))))
        .collect();
    for &((b, s, h, kv, dh, w, unmasked), sc) in &attention_cases {
        let shape = AttnShape { batch: b, seq: s, n_heads: h, n_kv_heads: kv, head_dim: dh, window: w, scale: sc };
        add(
            &format!("attention B={b} S={s} H={h} KV={kv} dh={dh} window={w}{}: forward and backward", scale_text(sc)),
            Box::new(move |g, _| attention(g, shape, unmasked, true)),
        );
    }
    // cuDNN's fused attention at the same shapes (a GPU only: the emulator has no cuDNN).
    for &((b, s, h, kv, dh, w, _), sc) in attention_cases.iter().filter(|_| !scale.emulated) {
        let shape = AttnShape { batch: b, seq: s, n_heads: h, n_kv_heads: kv, head_dim: dh, window: w, scale: sc };
        add(
            &format!(
                "attention on cuDNN B={b} S={s} H={h} KV={kv} dh={dh} window={w}{}: forward and backward",
                scale_text(sc)
            ),
            Box::new(move |g, _| attention(g, shape, false, false)),
        );
    }
    // The sequence axis: one rank's two chunks against every rank's keys (chunks of 128 rows,
    // the kernels' widest tile), unmasked, in a sliding window and under document masking.
    let split_cases = split_attention_shapes(scale.emulated)
        .iter()
        .map(|&c| (c, None))
        .chain(scaled_split_attention_shapes(scale.emulated).iter().map(|&(c, sc)| (c, Some(sc))));
    for ((b, s, h, kv, dh, w, rank, ranks, docs), sc) in split_cases {
        let shape = AttnShape { batch: b, seq: s, n_heads: h, n_kv_heads: kv, head_dim: dh, window: w, scale: sc };
        let split = SeqSplit { rank, ranks };
        let masked = if docs.is_some() { ", documents" } else { "" };
        add(
            &format!(
                "attention on a sequence axis, rank {rank} of {ranks}: B={b} S={s} H={h} KV={kv} dh={dh} window={w}{}{masked}",
                scale_text(sc)
            ),
            Box::new(move |g, _| attention_split(g, shape, split, docs)),
        );
    }
    // Attention sinks (GPT-OSS): heads of 16 on the 8-wide kernels, 12 on the scalar ones; odd
    // row counts, so that the sink gradient's blocks of rows are unequal (on the emulator's 2
    // SMs, 66 rows are blocks of 17 and one of 15).
    for (b, s, h, dh) in [(2, 33, 4, 16), (1, 21, 3, 12)] {
        add(
            &format!("attention sinks B={b} S={s} H={h} dh={dh}: forward epilogue and sink gradients against the CPU"),
            Box::new(move |g, _| ops::attention_sinks(g, b, s, h, dh)),
        );
    }
    for f in [128, 100] {
        add(&format!("swiglu f={f} forward and backward"), Box::new(move |g, _| swiglu(g, f)));
    }
    add("glu kinds: clamped swiglu and gelu-tanh, forward and backward, against the CPU", Box::new(|g, _| ops::glu(g)));
    for v in [1000, 37] {
        add(&format!("cross-entropy V={v}"), Box::new(move |g, _| cross_entropy(g, v)));
    }
    add("mixture of experts: route, dispatch, experts, combine, backward", Box::new(|g, _| moe(g, None, true)));
    // 90 tokens, top-2 of 8 experts: 180 slots, 12 rows an expert (a capacity factor of 0.53).
    add("mixture of experts with a capacity: dropped slots", Box::new(|g, _| moe(g, Some(12), true)));
    // Qwen3-MoE's norm_topk_prob = false: the weights are the softmax's probabilities.
    add("mixture of experts without renormalisation", Box::new(|g, _| moe(g, None, false)));
    for (d, f, capacity) in [(64, 48, None), (40, 24, Some(12))] {
        add(
            &format!("fp8 experts d {d}, f {f}, capacity {capacity:?}: the grouped FP8 products"),
            Box::new(move |g, _| moe_fp8(g, d, f, capacity)),
        );
    }
    // DeepSeek-V3's router: sigmoid scores, 8 groups of 32 experts (4 kept), top-8, a bias.
    for renormalize in [true, false] {
        add(
            &format!("sigmoid grouped routing with a selection bias, renormalize={renormalize}"),
            Box::new(move |g, _| sigmoid_routing(g, renormalize)),
        );
    }
    add(
        "expert load excess and bias step (auxiliary-loss-free balancing)",
        Box::new(|g, _| load_excess_and_bias_step(g)),
    );
    add("expert biases: forward and backward against the CPU", Box::new(|g, _| ops::expert_bias(g)));
    add("adamw with clipping and decay segments", Box::new(|g, _| adamw(g)));
    add("fp8 weight casts written by the adamw update: fused against unfused", Box::new(|g, _| adamw_fp8(g)));
    add(
        "fp8 producers (rmsnorm, swiglu) writing both casts in their pass: fused against unfused; fp8_transpose",
        Box::new(|g, _| ops::fp8_producers(g)),
    );
    for nesterov in [true, false] {
        add(
            &format!("muon momentum nesterov={nesterov}, clipped and unclipped"),
            Box::new(move |g, _| ops::muon_momentum(g, nesterov)),
        );
    }
    add("muon divide_by_norm: f32, bf16, parameters, under eps, zeros", Box::new(|g, _| ops::divide_by_norm(g, 3001)));
    if !scale.emulated {
        add(
            "nccl, world size 1: all-reduce, reduce-scatter, all-gather (f32, bf16, parameters into bf16)",
            Box::new(|g, _| nccl_alone(g)),
        );
    }
    for name in [
        "tiny-llama2",
        "tiny-mistral",
        "tiny-mixtral",
        "tiny-gpt",
        "tiny-qwen3-moe",
        "tiny-deepseek-v3",
        "tiny-gpt-oss",
        "tiny-gemma3",
    ] {
        add(
            &format!("{name}: loss and gradients against the f32 CPU model"),
            Box::new(move |g, _| parity(g, name, &[], scale)),
        );
    }
    // Gemma's final-logit soft-capping, at a cap the tiny model's logits reach: at
    // initialisation they spread about ±1 (the check fails when none passes half the cap).
    add(
        "tiny-gemma3 with final_logit_softcap 1: loss and gradients against the f32 CPU model",
        Box::new(move |g, _| parity(g, "tiny-gemma3", &["model.final_logit_softcap=1.0"], scale)),
    );
    // FP8 products for every linear layer (min_dim 16), against the CPU reference's FP8.
    for recipe in ["tensorwise", "delayed"] {
        let sets = ["train.precision=fp8", "train.fp8.min_dim=16"];
        add(
            &format!("tiny-llama2 in FP8 ({recipe}): loss and gradients against the FP8 CPU model"),
            Box::new(move |g, _| {
                let recipe = format!("train.fp8.recipe={recipe}");
                parity(g, "tiny-llama2", &[sets[0], sets[1], &recipe], scale)
            }),
        );
    }
    add(
        "tiny-llama2 in FP8 (delayed), 3 trainer steps: weights' casts written by the update, against the CPU",
        Box::new(move |g, _| models::fp8_training(g, scale)),
    );
    for recipe in ["tensorwise", "delayed"] {
        add(
            &format!(
                "FP8 overhead of a llama3.1-8b layer at 8192 tokens ({recipe}; launch trace, dry run): fused against unfused"
            ),
            Box::new(move |g, _| models::fp8_overhead(g, recipe)),
        );
    }
    // The experts' grouped products in FP8 beside the attention's projections. (Tensorwise: the
    // delayed recipe's first step casts at scale 1, where most of these gradients fall among
    // E5M2's subnormals, and the router's gradient, a difference of the experts' outputs, then
    // differs by 26 % between bf16 and f32 inputs; its later steps are the CPU's devices tests'.)
    add(
        "tiny-mixtral in FP8 (tensorwise), the experts too: loss and gradients against the FP8 CPU model",
        Box::new(move |g, _| parity(g, "tiny-mixtral", &["train.precision=fp8", "train.fp8.min_dim=16"], scale)),
    );
    // The GPT family in FP8: LayerNorm's and GELU's outputs kept cast for the weight gradients,
    // the biases added after the products.
    add(
        "tiny-gpt in FP8 (tensorwise): loss and gradients against the FP8 CPU model",
        Box::new(move |g, _| parity(g, "tiny-gpt", &["train.precision=fp8", "train.fp8.min_dim=16"], scale)),
    );
    // Latent attention's projections in FP8: q_a, q_b, the latent's kv_a rows, kv_b and o.
    add(
        "tiny-deepseek-v3 in FP8 (tensorwise): loss and gradients against the FP8 CPU model",
        Box::new(move |g, _| parity(g, "tiny-deepseek-v3", &["train.precision=fp8", "train.fp8.min_dim=16"], scale)),
    );
    // Odd sizes: scalar fallbacks of the vector kernels, planned views padded for alignment.
    let odd = &["model.d_model=100", "model.mlp_dim=60", "train.seq_len=61", "train.batch_size=2"];
    add(
        "tiny-mistral with odd sizes (d_model 100, seq 61): loss and gradients",
        Box::new(move |g, _| parity(g, "tiny-mistral", odd, scale)),
    );
    let one_head = &["model.d_model=2048", "model.mlp_dim=896", "model.head_dim=16", "model.sliding_window=0"];
    add(
        "tiny-mistral with one head of 16 at d_model 2048: loss and gradients",
        Box::new(move |g, _| parity(g, "tiny-mistral", one_head, scale)),
    );
    add(
        "tiny-llama2: CUDA graph replay matches eager steps",
        Box::new(move |g, open| graphs(g, open, "tiny-llama2", &[], scale)),
    );
    // A capacity factor below 1 drops slots on every layer: the whole step, dropped slots
    // included, against the CPU, then captured as a graph (the shapes are static).
    let capped = &["model.moe.capacity_factor=0.75"];
    add(
        "tiny-mixtral with capacity_factor 0.75: loss and gradients against the f32 CPU model",
        Box::new(move |g, _| parity(g, "tiny-mixtral", capped, scale)),
    );
    // Eight training steps of tiny Mixtral take minutes on the emulator (492 s on a loaded
    // 2-core machine): a GPU's check only.
    if !scale.emulated {
        add(
            "tiny-mixtral with capacity_factor 0.75: CUDA graph replay matches eager steps",
            Box::new(move |g, open| graphs(g, open, "tiny-mixtral", capped, scale)),
        );
    }
    add("tiny-llama2: gradients under remat=full match remat=none", Box::new(move |g, open| remat(g, open, scale)));
    add("memory estimate matches what the backend allocates", Box::new(move |g, _| memory_estimate(g, scale)));
    // Two devices on the emulator, each a thread with its own backend (on a GPU, FSDP runs one
    // process per device, over NCCL: `nccl_alone` checks its bf16 gather).
    if scale.emulated {
        add(
            "tiny-llama2 under FSDP 2: bf16 gathers follow one device, memory as planned",
            Box::new(move |g, _| fsdp_bf16_gathers(g, scale)),
        );
        add(
            "tiny-llama2 in FP8 (delayed) under FSDP 2, gathering the casts: follows one device, memory as planned",
            Box::new(move |g, _| models::fsdp_fp8(g, scale)),
        );
        add(
            "tiny-mixtral under EP 2, dropless: the experts on received parts follow one device, as planned, as a graph",
            Box::new(move |g, _| expert_axis(g, scale, None)),
        );
        add(
            "tiny-mixtral under EP 2, capacity_factor 0.75: the same, slots dropped",
            Box::new(move |g, _| expert_axis(g, scale, Some("model.moe.capacity_factor=0.75"))),
        );
    }
    add(
        "tiny-llama2 with MuonClip: bf16 Newton-Schulz and QK-clip follow the CPU, memory as planned",
        Box::new(move |g, _| models::muon(g, scale)),
    );
    // tiny-gpt trains on a GPU only: its 20 steps took 397 s on the emulator (its loss and
    // gradients are checked above there too).
    let trained: &[&str] = if scale.emulated {
        &["tiny-llama2", "tiny-mistral", "tiny-mixtral"]
    } else {
        &[
            "tiny-llama2",
            "tiny-mistral",
            "tiny-mixtral",
            "tiny-gpt",
            "tiny-qwen3",
            "tiny-qwen3-moe",
            "tiny-deepseek-v3",
            "tiny-gpt-oss",
            "tiny-gemma3",
        ]
    };
    for &name in trained {
        add(
            &format!("{name}: {} training steps lower the loss", scale.train_steps),
            Box::new(move |g, _| training(g, name, scale)),
        );
    }
    v
}

/// Tolerances: relative L2 error of a whole tensor, and largest error over the largest magnitude.
#[derive(Clone, Copy)]
struct Tol {
    rel_l2: f64,
    max: f64,
}

/// Outputs stored in bf16.
const BF16: Tol = Tol { rel_l2: 1e-2, max: 5e-2 };
/// Outputs kept in f32 from the same bf16 inputs.
const F32: Tol = Tol { rel_l2: 1e-4, max: 1e-3 };
/// Outputs moved or counted, never rounded: the same bits.
const EXACT: Tol = Tol { rel_l2: 0.0, max: 0.0 };

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_shapes_that_name_the_unmasked_path_take_it() {
        for emulated in [true, false] {
            let scaled = scaled_attention_shapes(emulated).iter().map(|&(c, sc)| (c, Some(sc)));
            for ((batch, seq, n_heads, n_kv_heads, head_dim, window, unmasked), scale) in
                attention_shapes(emulated).iter().map(|&c| (c, None)).chain(scaled)
            {
                let s = AttnShape { batch, seq, n_heads, n_kv_heads, head_dim, window, scale };
                let t = ops::attention_tiles(s);
                assert!(!unmasked || (t[0] > 0 && t[2] > 0), "{s:?} (emulated {emulated}): {t:?}");
            }
        }
    }
}
