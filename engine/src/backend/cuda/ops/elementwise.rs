//! Fills, converting copies, adds and deterministic sums (`elementwise.cu`), and the refresh
//! of a parameter view's bf16 compute copy after its f32 master changed.

use super::Module;
use crate::backend::cuda::{Arg, Cuda, DType, Scratch};
use crate::backend::{BufKind, View};

/// The kernels of `elementwise.cu`.
pub(crate) const MODULE: Module = Module {
    name: "elementwise",
    source: include_str!("elementwise.cu"),
    kernels: &[
        "fill_f32",
        "fill_bf16",
        "copy_bf16_f32",
        "copy_f32_bf16",
        "add_f32_f32",
        "add_f32_bf16",
        "add_bf16_f32",
        "add_bf16_bf16",
        "scale_f32",
        "scale_bf16",
        "softcap_forward_f32",
        "softcap_forward_bf16",
        "softcap_backward_f32",
        "softcap_backward_bf16",
        "sum_partials_f32",
        "sum_partials_bf16",
        "sumsq_partials_f32",
        "sumsq_partials_bf16",
        "sum_partials_f32_v4",
        "sumsq_partials_f32_v4",
        "sum_finish",
    ],
};

/// Most blocks of the first pass of a sum: eight per multiprocessor (the grid depends on the
/// element count and the device only, so a sum is deterministic on a given device).
pub(crate) fn sum_blocks(sm_count: usize) -> usize {
    (8 * sm_count).clamp(8, 1024)
}

/// After a write into a parameter view's f32 master: refresh its bf16 copy (nothing for other
/// kinds, whose one copy the write changed).
pub(crate) fn refresh_compute_copy(gpu: &mut Cuda, v: View) {
    if gpu.buffer(v).kind == BufKind::Params && v.len > 0 {
        let (master, _) = gpu.exact(v);
        let compute = gpu.ptr(v);
        gpu.launch_1d("copy_bf16_f32", v.len as u64, &[Arg::P(compute), Arg::P(master), Arg::U(v.len as u64)]);
    }
}

/// `Backend::fill`: a grid-stride launch of the kernel of the view's type.
pub(crate) fn fill(gpu: &mut Cuda, dst: View, value: f32) {
    let (ptr, t) = gpu.exact(dst);
    let name = if t == DType::F32 { "fill_f32" } else { "fill_bf16" };
    gpu.launch_1d(name, dst.len as u64, &[Arg::P(ptr), Arg::U(dst.len as u64), Arg::F(value)]);
    refresh_compute_copy(gpu, dst);
}

/// `Backend::copy`: a device copy between views of one type, a converting kernel between two.
pub(crate) fn copy(gpu: &mut Cuda, dst: View, src: View) {
    assert_eq!(dst.len, src.len, "internal error: copy length");
    assert!(!dst.overlaps(src), "internal error: copy onto itself");
    let ((dp, dt), (sp, st)) = (gpu.exact(dst), gpu.exact(src));
    match (dt, st) {
        _ if dt == st => gpu.copy_bytes(dp, sp, dst.len * dt.size()),
        (DType::Bf16, _) => {
            gpu.launch_1d("copy_bf16_f32", dst.len as u64, &[Arg::P(dp), Arg::P(sp), Arg::U(dst.len as u64)])
        }
        (DType::F32, _) => {
            gpu.launch_1d("copy_f32_bf16", dst.len as u64, &[Arg::P(dp), Arg::P(sp), Arg::U(dst.len as u64)])
        }
        (DType::Fp8, _) => unreachable!("internal error: copy into FP8 (fp8_quantize casts)"),
    }
    refresh_compute_copy(gpu, dst);
}

/// `Backend::add`: one kernel per pair of types, summed in f32 and rounded once.
pub(crate) fn add(gpu: &mut Cuda, dst: View, src: View) {
    assert_eq!(dst.len, src.len, "internal error: add length");
    let ((dp, dt), (sp, st)) = (gpu.exact(dst), gpu.exact(src));
    let name = match (dt, st) {
        (DType::F32, DType::F32) => "add_f32_f32",
        (DType::F32, DType::Bf16) => "add_f32_bf16",
        (DType::Bf16, DType::F32) => "add_bf16_f32",
        (DType::Bf16, DType::Bf16) => "add_bf16_bf16",
        _ => unreachable!("internal error: add of FP8 values"),
    };
    gpu.launch_1d(name, dst.len as u64, &[Arg::P(dp), Arg::P(sp), Arg::U(dst.len as u64)]);
    refresh_compute_copy(gpu, dst);
}

/// `Backend::scale`: `x *= s` in f32, rounded to the view's type.
pub(crate) fn scale(gpu: &mut Cuda, x: View, s: f32) {
    let (ptr, t) = gpu.exact(x);
    let name = if t == DType::F32 { "scale_f32" } else { "scale_bf16" };
    gpu.launch_1d(name, x.len as u64, &[Arg::P(ptr), Arg::U(x.len as u64), Arg::F(s)]);
    refresh_compute_copy(gpu, x);
}

/// `Backend::softcap_forward`: `x = cap · tanh(x / cap)` in place, in f32.
pub(crate) fn softcap_forward(gpu: &mut Cuda, x: View, cap: f32) {
    let (ptr, t) = gpu.exact(x);
    let name = if t == DType::F32 { "softcap_forward_f32" } else { "softcap_forward_bf16" };
    gpu.launch_1d(name, x.len as u64, &[Arg::P(ptr), Arg::U(x.len as u64), Arg::F(cap)]);
}

/// `Backend::softcap_backward`: `dx *= 1 − tanh²(x / cap)` in place; `x` of `dx`'s type.
pub(crate) fn softcap_backward(gpu: &mut Cuda, dx: View, x: View, cap: f32) {
    assert_eq!(dx.len, x.len, "internal error: softcap_backward length");
    let ((dp, dt), (xp, xt)) = (gpu.exact(dx), gpu.exact(x));
    assert_eq!(dt, xt, "internal error: softcap_backward: the gradient and the logits differ in type");
    let name = if dt == DType::F32 { "softcap_backward_f32" } else { "softcap_backward_bf16" };
    gpu.launch_1d(name, dx.len as u64, &[Arg::P(dp), Arg::P(xp), Arg::U(dx.len as u64), Arg::F(cap)]);
}

/// `out[0] = Σ x` or `Σ x²` (`squares`), in f64 over fixed blocks, then one block adding the
/// partials in order.
pub(crate) fn sum(gpu: &mut Cuda, out: View, x: View, squares: bool) {
    gpu.expect(out, DType::F32, "sum", "out");
    let out_ptr = gpu.out(out.at(0, 1), "sum");
    let (xp, t) = gpu.exact(x);
    let most = sum_blocks(gpu.dev.info().sm_count as usize);
    let parts = gpu.scratch(Scratch::SumPartials, most * 8);
    // f32 from a 16-byte aligned start: 4 elements a load (and a thread per 4 elements).
    let v4 = t == DType::F32 && xp % 16 == 0;
    let per_thread = if v4 { 4 } else { 1 };
    let blocks = (x.len as u64).div_ceil(256 * per_thread).clamp(1, most as u64) as u32;
    let name = match (t, squares, v4) {
        (DType::F32, false, true) => "sum_partials_f32_v4",
        (DType::F32, true, true) => "sumsq_partials_f32_v4",
        (DType::F32, false, false) => "sum_partials_f32",
        (DType::Bf16, false, _) => "sum_partials_bf16",
        (DType::F32, true, false) => "sumsq_partials_f32",
        (DType::Bf16, true, _) => "sumsq_partials_bf16",
        (DType::Fp8, ..) => unreachable!("internal error: sum of FP8 values"),
    };
    gpu.launch(name, (blocks, 1, 1), 256, 0, &[Arg::P(xp), Arg::U(x.len as u64), Arg::P(parts)]);
    gpu.launch("sum_finish", (1, 1, 1), 256, 0, &[Arg::P(parts), Arg::I(blocks as i32), Arg::P(out_ptr)]);
}
