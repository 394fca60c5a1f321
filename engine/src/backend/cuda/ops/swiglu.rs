//! SwiGLU over rows `[gate | up]`, forward and backward (`swiglu.cu`).

use super::{Module, aligned16, c_int};
use crate::backend::View;
use crate::backend::cuda::{Arg, Cuda, DType};

/// The kernels of `swiglu.cu`.
pub(crate) const MODULE: Module = Module {
    name: "swiglu",
    source: include_str!("swiglu.cu"),
    kernels: &["swiglu_forward", "swiglu_forward_v8", "swiglu_backward", "swiglu_backward_v8"],
};

/// `Backend::swiglu_forward`: grid-stride, 8 elements a thread when `f` and the rows allow.
pub(crate) fn forward(gpu: &mut Cuda, h: View, gu: View, f: usize) {
    gpu.expect(h, DType::Bf16, "swiglu_forward", "h");
    gpu.expect(gu, DType::Bf16, "swiglu_forward", "gu");
    assert_eq!(gu.len, 2 * h.len, "internal error: swiglu_forward lengths");
    let (hp, g) = (gpu.out(h, "swiglu"), gpu.ptr(gu));
    let v8 = f.is_multiple_of(8) && aligned16(&[hp, g]);
    let (name, per) = if v8 { ("swiglu_forward_v8", 8) } else { ("swiglu_forward", 1) };
    let n = h.len / f;
    gpu.launch_1d(name, (h.len / per) as u64, &[Arg::P(hp), Arg::P(g), Arg::U(n as u64), Arg::I(c_int(f, "f"))]);
}

/// `Backend::swiglu_backward`: grid-stride, 8 elements a thread when `f` and the rows allow.
pub(crate) fn backward(gpu: &mut Cuda, dgu: View, dh: View, gu: View, f: usize) {
    for (v, name) in [(dgu, "dgu"), (dh, "dh"), (gu, "gu")] {
        gpu.expect(v, DType::Bf16, "swiglu_backward", name);
    }
    assert_eq!(dgu.len, gu.len, "internal error: swiglu_backward lengths");
    let (d, g, u) = (gpu.out(dgu, "swiglu"), gpu.ptr(dh), gpu.ptr(gu));
    let v8 = f.is_multiple_of(8) && aligned16(&[d, g, u]);
    let (name, per) = if v8 { ("swiglu_backward_v8", 8) } else { ("swiglu_backward", 1) };
    let n = dh.len / f;
    let args = [Arg::P(d), Arg::P(g), Arg::P(u), Arg::U(n as u64), Arg::I(c_int(f, "f"))];
    gpu.launch_1d(name, (dh.len / per) as u64, &args);
}
