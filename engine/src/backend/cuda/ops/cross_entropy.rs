//! Cross-entropy fused with the softmax and, when asked, its gradient written over the logits
//! (`cross_entropy.cu`).

use super::{Module, aligned16, row_threads};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{IdxView, View};

/// The kernels of `cross_entropy.cu`.
pub(crate) const MODULE: Module = Module {
    name: "cross_entropy",
    source: include_str!("cross_entropy.cu"),
    kernels: &[
        "cross_entropy",
        "cross_entropy_v8",
        "cross_entropy_max",
        "cross_entropy_partials",
        "cross_entropy_finish",
    ],
};

/// `Backend::cross_entropy`: a block per row, the 8-wide kernel when `v` and the logits allow.
pub(crate) fn cross_entropy(
    gpu: &mut Cuda,
    losses: View,
    logits: View,
    targets: IdxView,
    v: usize,
    grad_scale: Option<f32>,
) {
    gpu.expect(losses, DType::F32, "cross_entropy", "losses");
    gpu.expect(logits, DType::Bf16, "cross_entropy", "logits");
    assert_eq!(logits.len, losses.len * v, "internal error: cross_entropy: logits length");
    assert_eq!(targets.len, losses.len, "internal error: cross_entropy: targets length");
    let (l, z, t) = (gpu.out(losses, "cross_entropy"), gpu.out(logits, "cross_entropy"), gpu.iptr(targets));
    let v8 = v.is_multiple_of(8) && aligned16(&[z]);
    let name = if v8 { "cross_entropy_v8" } else { "cross_entropy" };
    let threads = row_threads(if v8 { v / 8 } else { v });
    let args = [
        Arg::P(l),
        Arg::P(z),
        Arg::P(t),
        Arg::U(v as u64),
        Arg::F(grad_scale.unwrap_or(0.0)),
        Arg::I(grad_scale.is_some() as i32),
    ];
    gpu.launch(name, (losses.len as u32, 1, 1), threads, 0, &args);
}

/// `Backend::cross_entropy_max`: a block per row.
pub(crate) fn max(gpu: &mut Cuda, max: View, logits: View, v: usize) {
    gpu.expect(max, DType::F32, "cross_entropy_max", "max");
    gpu.expect(logits, DType::Bf16, "cross_entropy_max", "logits");
    assert_eq!(logits.len, max.len * v, "internal error: cross_entropy_max: logits length");
    let args = [Arg::P(gpu.out(max, "cross_entropy_max")), Arg::P(gpu.ptr(logits)), Arg::U(v as u64)];
    gpu.launch("cross_entropy_max", (max.len as u32, 1, 1), row_threads(v), 0, &args);
}

/// `Backend::cross_entropy_partials`: a block per row.
pub(crate) fn partials(gpu: &mut Cuda, sums: View, logits: View, max: View, targets: IdxView, v: usize, first: usize) {
    gpu.expect(sums, DType::F32, "cross_entropy_partials", "sums");
    gpu.expect(max, DType::F32, "cross_entropy_partials", "max");
    gpu.expect(logits, DType::Bf16, "cross_entropy_partials", "logits");
    let n = max.len;
    assert_eq!(
        (sums.len, logits.len, targets.len),
        (2 * n, n * v, n),
        "internal error: cross_entropy_partials: lengths"
    );
    let args = [
        Arg::P(gpu.out(sums, "cross_entropy_partials")),
        Arg::P(gpu.ptr(logits)),
        Arg::P(gpu.ptr(max)),
        Arg::P(gpu.iptr(targets)),
        Arg::U(v as u64),
        Arg::U(first as u64),
        Arg::U(n as u64),
    ];
    gpu.launch("cross_entropy_partials", (n as u32, 1, 1), row_threads(v), 0, &args);
}

/// `Backend::cross_entropy_finish`: a block per row, the gradient in place of the logits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish(
    gpu: &mut Cuda,
    losses: View,
    logits: View,
    max: View,
    sums: View,
    targets: IdxView,
    v: usize,
    first: usize,
    grad_scale: Option<f32>,
) {
    gpu.expect(losses, DType::F32, "cross_entropy_finish", "losses");
    gpu.expect(logits, DType::Bf16, "cross_entropy_finish", "logits");
    gpu.expect(max, DType::F32, "cross_entropy_finish", "max");
    gpu.expect(sums, DType::F32, "cross_entropy_finish", "sums");
    let n = losses.len;
    assert_eq!(
        (logits.len, max.len, sums.len, targets.len),
        (n * v, n, 2 * n, n),
        "internal error: cross_entropy_finish: lengths"
    );
    let args = [
        Arg::P(gpu.out(losses, "cross_entropy_finish")),
        Arg::P(gpu.out(logits, "cross_entropy_finish")),
        Arg::P(gpu.ptr(max)),
        Arg::P(gpu.ptr(sums)),
        Arg::P(gpu.iptr(targets)),
        Arg::U(v as u64),
        Arg::U(first as u64),
        Arg::U(n as u64),
        Arg::F(grad_scale.unwrap_or(0.0)),
        Arg::I(grad_scale.is_some() as i32),
    ];
    gpu.launch("cross_entropy_finish", (n as u32, 1, 1), row_threads(v), 0, &args);
}
