//! Cross-entropy fused with the softmax and, when asked, its gradient written over the logits
//! (`cross_entropy.cu`).

use super::{Module, aligned16, row_threads};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{IdxView, View};

/// The kernels of `cross_entropy.cu`.
pub(crate) const MODULE: Module = Module {
    name: "cross_entropy",
    source: include_str!("cross_entropy.cu"),
    kernels: &["cross_entropy", "cross_entropy_v8"],
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
