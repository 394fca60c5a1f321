//! Muon's elementwise parts (`muon.cu`): the momentum fused with gradient clipping, and the
//! normalisation of a matrix by its Frobenius norm before Newton–Schulz, both reading their
//! norm on the device (no host round trip).

use super::Module;
use super::elementwise::refresh_compute_copy;
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{BufKind, MuonMomentum, View};

/// The kernels of `muon.cu`.
pub(crate) const MODULE: Module = Module {
    name: "muon",
    source: include_str!("muon.cu"),
    kernels: &["muon_momentum", "divide_by_norm_f32", "divide_by_norm_bf16"],
};

/// `Backend::muon_momentum`: one grid-stride pass over the f32 gradients and their buffer.
pub(crate) fn momentum(gpu: &mut Cuda, grads: View, buf: View, norm_squared: View, step: MuonMomentum) {
    for (x, name) in [(grads, "grads"), (buf, "buf"), (norm_squared, "norm_squared")] {
        gpu.expect(x, DType::F32, "muon_momentum", name);
    }
    assert_eq!(grads.len, buf.len, "internal error: muon_momentum lengths");
    assert!(
        !grads.overlaps(buf) && !grads.overlaps(norm_squared) && !buf.overlaps(norm_squared),
        "internal error: muon_momentum views overlap"
    );
    let (g, b) = (gpu.out(grads, "muon_momentum"), gpu.out(buf, "muon_momentum"));
    let ns = gpu.ptr(norm_squared.at(0, 1));
    // PyTorch passes `1 − μ` as a Python float, rounded to the tensors' f32 once (as the CPU).
    let mix = (1.0 - step.momentum as f64) as f32;
    let n = grads.len as u64;
    let args = [
        Arg::P(g),
        Arg::P(b),
        Arg::P(ns),
        Arg::U(n),
        Arg::F(step.momentum),
        Arg::F(mix),
        Arg::I(step.nesterov as i32),
        Arg::F(step.max_grad_norm),
    ];
    gpu.launch_1d("muon_momentum", n, &args);
}

/// `Backend::divide_by_norm`: `x /= max(√sum_squares[0], eps)` in f32, rounded to the view's
/// type (bf16 activations: Newton–Schulz's matrices; f32 otherwise; parameters: their f32
/// master, then their bf16 copy refreshed).
pub(crate) fn divide_by_norm(gpu: &mut Cuda, x: View, sum_squares: View, eps: f32) {
    gpu.expect(sum_squares, DType::F32, "divide_by_norm", "sum_squares");
    assert!(gpu.buffer(x).kind != BufKind::Gathered, "internal error: divide_by_norm writes into gathered parameters");
    assert!(!x.overlaps(sum_squares), "internal error: divide_by_norm: the norm lies in the view it divides");
    let (xp, t) = gpu.exact(x);
    let name = match t {
        DType::F32 => "divide_by_norm_f32",
        DType::Bf16 => "divide_by_norm_bf16",
        DType::Fp8 => unreachable!("internal error: divide_by_norm of FP8 values"),
    };
    let ss = gpu.ptr(sum_squares.at(0, 1));
    gpu.launch_1d(name, x.len as u64, &[Arg::P(xp), Arg::P(ss), Arg::U(x.len as u64), Arg::F(eps)]);
    refresh_compute_copy(gpu, x);
}
