//! The experts' matrix products, grouped in one launch per layer (`gemm.cu`): row counts are
//! read on the device from the dispatch offsets, so the step needs no host round trip. bf16
//! operands, or FP8 ones with their scaling states (`train.precision = "fp8"`).

use super::{Module, aligned16, c_int};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::fp8::{Fp8Format, State};
use crate::backend::{ExpertWeights, MatMul, MoeDispatch, View};

/// The kernels of `gemm.cu`.
pub(crate) const MODULE: Module = Module {
    name: "gemm",
    source: include_str!("gemm.cu"),
    kernels: &[
        "moe_gemm_forward",
        "moe_gemm_dx",
        "moe_gemm_dw",
        "moe_gemm_fp8_forward",
        "moe_gemm_fp8_dx",
        "moe_gemm_fp8_dw",
    ],
};

/// The operands' element type and the arguments an FP8 launch adds: both states (the kernel
/// reads their inverse scales) and whether `a` is E5M2.
fn operands(gpu: &Cuda, fp8: Option<[State; 2]>) -> (DType, usize, Vec<Arg>) {
    match fp8 {
        None => (DType::Bf16, 8, Vec::new()),
        Some([sa, sb]) => {
            assert_eq!(sb.format, Fp8Format::E4M3, "internal error: an FP8 expert product's b in E5M2");
            let e5m2 = (sa.format == Fp8Format::E5M2) as i32;
            (DType::Fp8, 16, vec![Arg::P(gpu.ptr(sa.view)), Arg::P(gpu.ptr(sb.view)), Arg::I(e5m2)])
        }
    }
}

/// `Backend::moe_expert_matmul` (and `_fp8`, `fp8` the operands' states): the forward (`b_t`) or
/// input-gradient product of every expert in one launch over 128×128 tiles, vector loads when
/// the sizes and addresses allow.
pub(crate) fn expert_matmul(
    gpu: &mut Cuda,
    out: View,
    a: View,
    weights: ExpertWeights,
    d: MoeDispatch,
    s: MatMul,
    fp8: Option<[State; 2]>,
) {
    let (dtype, v, extra) = operands(gpu, fp8);
    gpu.expect(out, DType::Bf16, "moe_expert_matmul", "out");
    gpu.expect(a, dtype, "moe_expert_matmul", "a");
    gpu.expect(weights.first, dtype, "moe_expert_matmul", "weights");
    assert!(!s.a_t, "internal error: moe_expert_matmul with a transposed");
    // The kernel reads and writes only the kept rows, `offsets[E]`, which a capacity bounds
    // below the `tokens · k` slots: buffers sized by `rows_bound` suffice.
    let rows = d.rows_bound();
    assert!(a.len >= rows * s.k, "internal error: moe_expert_matmul: a holds {} < {rows}·{}", a.len, s.k);
    assert!(out.len >= rows * s.n, "internal error: moe_expert_matmul: out holds {} < {rows}·{}", out.len, s.n);
    gpu.ptr(weights.expert(d.experts - 1)); // the last expert's weight lies in the buffer
    let (o, ap, wp, off) = (gpu.out(out, "moe_expert_matmul"), gpu.ptr(a), gpu.ptr(weights.first), gpu.iptr(d.offsets));
    let vec =
        s.k.is_multiple_of(v) && s.n.is_multiple_of(v) && weights.stride.is_multiple_of(v) && aligned16(&[o, ap, wp]);
    let name = match (s.b_t, fp8.is_some()) {
        (true, false) => "moe_gemm_forward",
        (false, false) => "moe_gemm_dx",
        (true, true) => "moe_gemm_fp8_forward",
        (false, true) => "moe_gemm_fp8_dx",
    };
    let mut args = vec![
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
    args.extend(extra);
    // Row tiles of all experts together: at most the kept rows / 128 plus one partial tile each.
    let grid = (s.n.div_ceil(128) as u32, (d.rows_bound().div_ceil(128) + d.experts) as u32, 1);
    gpu.launch(name, grid, 256, 0, &args);
}

/// `Backend::moe_expert_matmul_dw` (and `_fp8`): each expert's weight gradient, one grid layer
/// per expert.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expert_matmul_dw(
    gpu: &mut Cuda,
    dweights: ExpertWeights,
    dy: View,
    x: View,
    d: MoeDispatch,
    inp: usize,
    out: usize,
    fp8: Option<[State; 2]>,
) {
    let (dtype, v, extra) = operands(gpu, fp8);
    gpu.expect(dweights.first, DType::F32, "moe_expert_matmul_dw", "dweights");
    gpu.expect(dy, dtype, "moe_expert_matmul_dw", "dy");
    gpu.expect(x, dtype, "moe_expert_matmul_dw", "x");
    gpu.ptr(dweights.expert(d.experts - 1));
    let (dw, g, xp, off) =
        (gpu.out(dweights.first, "moe_expert_matmul_dw"), gpu.ptr(dy), gpu.ptr(x), gpu.iptr(d.offsets));
    let vec = inp.is_multiple_of(v) && out.is_multiple_of(v) && aligned16(&[g, xp]);
    let mut args = vec![
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
    args.extend(extra);
    let grid = (inp.div_ceil(128) as u32, out.div_ceil(128) as u32, d.experts as u32);
    gpu.launch(if fp8.is_some() { "moe_gemm_fp8_dw" } else { "moe_gemm_dw" }, grid, 256, 0, &args);
}
