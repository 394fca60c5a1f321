//! The experts' matrix products, grouped in one launch per layer (`gemm.cu`): row counts are
//! read on the device from the dispatch offsets, so the step needs no host round trip.

use super::{Module, aligned16, c_int};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{ExpertWeights, MatMul, MoeDispatch, View};

/// The kernels of `gemm.cu`.
pub(crate) const MODULE: Module = Module {
    name: "gemm",
    source: include_str!("gemm.cu"),
    kernels: &["moe_gemm_forward", "moe_gemm_dx", "moe_gemm_dw"],
};

/// `Backend::moe_expert_matmul`: the forward (`b_t`) or input-gradient product of every expert
/// in one launch over 128×128 tiles, vector loads when the sizes and addresses allow.
pub(crate) fn expert_matmul(gpu: &mut Cuda, out: View, a: View, weights: ExpertWeights, d: MoeDispatch, s: MatMul) {
    gpu.expect(out, DType::Bf16, "moe_expert_matmul", "out");
    gpu.expect(a, DType::Bf16, "moe_expert_matmul", "a");
    gpu.expect(weights.first, DType::Bf16, "moe_expert_matmul", "weights");
    assert!(!s.a_t, "internal error: moe_expert_matmul with a transposed");
    // The kernel reads and writes only the kept rows, `offsets[E]`, which a capacity bounds
    // below the `tokens · k` slots: buffers sized by `rows_bound` suffice.
    let rows = d.rows_bound();
    assert!(a.len >= rows * s.k, "internal error: moe_expert_matmul: a holds {} < {rows}·{}", a.len, s.k);
    assert!(out.len >= rows * s.n, "internal error: moe_expert_matmul: out holds {} < {rows}·{}", out.len, s.n);
    gpu.ptr(weights.expert(d.experts - 1)); // the last expert's weight lies in the buffer
    let (o, ap, wp, off) = (gpu.out(out, "moe_expert_matmul"), gpu.ptr(a), gpu.ptr(weights.first), gpu.iptr(d.offsets));
    let vec =
        s.k.is_multiple_of(8) && s.n.is_multiple_of(8) && weights.stride.is_multiple_of(8) && aligned16(&[o, ap, wp]);
    let name = if s.b_t { "moe_gemm_forward" } else { "moe_gemm_dx" };
    let args = [
        Arg::P(o),
        Arg::P(ap),
        Arg::P(wp),
        Arg::U(weights.stride as u64),
        Arg::P(off),
        Arg::I(d.experts as i32),
        Arg::I(c_int(s.n, "n")),
        Arg::I(c_int(s.k, "k")),
        Arg::I(s.accumulate as i32),
        Arg::I(vec as i32),
    ];
    // Row tiles of all experts together: at most the kept rows / 128 plus one partial tile each.
    let grid = (s.n.div_ceil(128) as u32, (d.rows_bound().div_ceil(128) + d.experts) as u32, 1);
    gpu.launch(name, grid, 256, 0, &args);
}

/// `Backend::moe_expert_matmul_dw`: each expert's weight gradient, one grid layer per expert.
pub(crate) fn expert_matmul_dw(
    gpu: &mut Cuda,
    dweights: ExpertWeights,
    dy: View,
    x: View,
    d: MoeDispatch,
    inp: usize,
    out: usize,
) {
    gpu.expect(dweights.first, DType::F32, "moe_expert_matmul_dw", "dweights");
    gpu.expect(dy, DType::Bf16, "moe_expert_matmul_dw", "dy");
    gpu.expect(x, DType::Bf16, "moe_expert_matmul_dw", "x");
    gpu.ptr(dweights.expert(d.experts - 1));
    let (dw, g, xp, off) =
        (gpu.out(dweights.first, "moe_expert_matmul_dw"), gpu.ptr(dy), gpu.ptr(x), gpu.iptr(d.offsets));
    let vec = inp.is_multiple_of(8) && out.is_multiple_of(8) && aligned16(&[g, xp]);
    let args = [
        Arg::P(dw),
        Arg::P(g),
        Arg::P(xp),
        Arg::U(dweights.stride as u64),
        Arg::P(off),
        Arg::I(d.experts as i32),
        Arg::I(c_int(out, "out")),
        Arg::I(c_int(inp, "inp")),
        Arg::I(vec as i32),
    ];
    let grid = (inp.div_ceil(128) as u32, out.div_ceil(128) as u32, d.experts as u32);
    gpu.launch("moe_gemm_dw", grid, 256, 0, &args);
}
