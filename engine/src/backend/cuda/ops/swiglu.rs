//! SwiGLU and the other gated linear units ([`Glu`]) over rows `[gate | up]`, forward and
//! backward (`swiglu.cu`).

use super::{Module, aligned16, c_int};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{Glu, View};

/// The kernels of `swiglu.cu`.
pub(crate) const MODULE: Module = Module {
    name: "swiglu",
    source: include_str!("swiglu.cu"),
    kernels: &[
        "swiglu_forward",
        "swiglu_forward_v8",
        "swiglu_backward",
        "swiglu_backward_v8",
        "glu_forward",
        "glu_forward_v8",
        "glu_backward",
        "glu_backward_v8",
    ],
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

/// The `glu_*` kernels' `kind`, `limit` and `alpha` of a unit other than SwiGLU (whose own
/// kernels run it).
fn glu_args(kind: Glu) -> Option<[Arg; 3]> {
    match kind {
        Glu::Swiglu => None,
        Glu::ClampedSwiglu { limit, alpha } => Some([Arg::I(1), Arg::F(limit), Arg::F(alpha)]),
        Glu::GeluTanh => Some([Arg::I(2), Arg::F(0.0), Arg::F(0.0)]),
    }
}

/// `Backend::glu_forward`: [`forward`] for SwiGLU, else as it, grid-stride, 8 elements a thread
/// when `f` and the rows allow.
pub(crate) fn glu_forward(gpu: &mut Cuda, h: View, gu: View, f: usize, kind: Glu) {
    let Some([k, limit, alpha]) = glu_args(kind) else { return forward(gpu, h, gu, f) };
    gpu.expect(h, DType::Bf16, "glu_forward", "h");
    gpu.expect(gu, DType::Bf16, "glu_forward", "gu");
    assert_eq!(gu.len, 2 * h.len, "internal error: glu_forward lengths");
    let (hp, g) = (gpu.out(h, "glu"), gpu.ptr(gu));
    let v8 = f.is_multiple_of(8) && aligned16(&[hp, g]);
    let (name, per) = if v8 { ("glu_forward_v8", 8) } else { ("glu_forward", 1) };
    let n = h.len / f;
    let args = [Arg::P(hp), Arg::P(g), Arg::U(n as u64), Arg::I(c_int(f, "f")), k, limit, alpha];
    gpu.launch_1d(name, (h.len / per) as u64, &args);
}

/// `Backend::glu_backward`: [`backward`] for SwiGLU, else as it, grid-stride, 8 elements a
/// thread when `f` and the rows allow.
pub(crate) fn glu_backward(gpu: &mut Cuda, dgu: View, dh: View, gu: View, f: usize, kind: Glu) {
    let Some([k, limit, alpha]) = glu_args(kind) else { return backward(gpu, dgu, dh, gu, f) };
    for (v, name) in [(dgu, "dgu"), (dh, "dh"), (gu, "gu")] {
        gpu.expect(v, DType::Bf16, "glu_backward", name);
    }
    assert_eq!(dgu.len, gu.len, "internal error: glu_backward lengths");
    assert_eq!(gu.len, 2 * dh.len, "internal error: glu_backward lengths");
    let (d, g, u) = (gpu.out(dgu, "glu"), gpu.ptr(dh), gpu.ptr(gu));
    let v8 = f.is_multiple_of(8) && aligned16(&[d, g, u]);
    let (name, per) = if v8 { ("glu_backward_v8", 8) } else { ("glu_backward", 1) };
    let n = dh.len / f;
    let args = [Arg::P(d), Arg::P(g), Arg::P(u), Arg::U(n as u64), Arg::I(c_int(f, "f")), k, limit, alpha];
    gpu.launch_1d(name, (dh.len / per) as u64, &args);
}
