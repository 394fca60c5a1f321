//! QK-norm forward, and backward in place with the weight gradient summed over fixed blocks of
//! rows (`qknorm.cu`).

use super::{Module, aligned16, c_int, rmsnorm::backward_blocks};
use crate::backend::cuda::{Arg, Cuda, DType, Scratch};
use crate::backend::{AttnShape, View};
use cudarc::driver::sys::CUdeviceptr;

/// The kernels of `qknorm.cu`.
pub(crate) const MODULE: Module = Module {
    name: "qknorm",
    source: include_str!("qknorm.cu"),
    kernels: &["qk_norm_forward", "qk_norm_forward_v8", "qk_norm_backward", "qk_norm_backward_v8", "qk_norm_dw_finish"],
};

/// Warps of a block: one per head vector, at most eight.
const MAX_WARPS: usize = 8;

/// Threads of a block whose warps share `vectors` head vectors.
fn threads(vectors: usize) -> u32 {
    (32 * vectors.clamp(1, MAX_WARPS)) as u32
}

/// Whether the 8-wide kernels apply: heads (so rows and the weight halves) a multiple of 8
/// wide, and 16-byte aligned addresses.
fn wide(dh: usize, ptrs: &[CUdeviceptr]) -> bool {
    dh.is_multiple_of(8) && aligned16(ptrs)
}

/// Floats of the partial weight-gradient rows the backward pass of `rows` token rows leaves in
/// [`Scratch::NormPartials`] on `sm_count` multiprocessors: one `[dwq | dwk]` row of `2·head_dim`
/// per block of [`backward_blocks`] (the blocks RMSNorm's backward pass uses, so the memory
/// estimate sizes the shared scratch as the larger of the two rows).
pub(crate) fn partial_floats(rows: usize, head_dim: usize, sm_count: usize) -> usize {
    backward_blocks(rows, sm_count).0 * 2 * head_dim
}

/// The token rows of `qkv` (none for an empty shape), after checking that `other` (the output,
/// or the gradient) has its length, `rstd` one value a head of a row, and `w` `[wq | wk]`.
fn rows_of(qkv: View, other: View, rstd: View, w: View, s: AttnShape, op: &str) -> Option<usize> {
    let width = s.qkv_width();
    if width == 0 {
        return None;
    }
    let rows = qkv.len / width;
    assert_eq!(qkv.len, rows * width, "internal error: {op}: qkv length");
    assert_eq!(other.len, qkv.len, "internal error: {op}: output or gradient length");
    assert_eq!(rstd.len, rows * (s.n_heads + s.n_kv_heads), "internal error: {op}: rstd length");
    assert_eq!(w.len, 2 * s.head_dim, "internal error: {op}: the weights are [wq | wk]");
    Some(rows)
}

/// `Backend::qk_norm_forward`: a block per token row, a warp per head vector (the 8-wide kernel
/// when the head width and the addresses allow), the block copying the v part.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(gpu: &mut Cuda, out: View, rstd: View, qkv: View, w: View, offset: f32, s: AttnShape, eps: f32) {
    for (v, name) in [(out, "out"), (qkv, "qkv"), (w, "w")] {
        gpu.expect(v, DType::Bf16, "qk_norm_forward", name);
    }
    gpu.expect(rstd, DType::F32, "qk_norm_forward", "rstd");
    let (width, dh, heads) = (s.qkv_width(), s.head_dim, s.n_heads + s.n_kv_heads);
    let Some(rows) = rows_of(qkv, out, rstd, w, s, "qk_norm_forward") else { return };
    let (o, r, xp, wp) = (gpu.out(out, "qk_norm_forward"), gpu.out(rstd, "qk_norm_forward"), gpu.ptr(qkv), gpu.ptr(w));
    let name = if wide(dh, &[o, xp, wp]) { "qk_norm_forward_v8" } else { "qk_norm_forward" };
    let args = [
        Arg::P(o),
        Arg::P(r),
        Arg::P(xp),
        Arg::P(wp),
        Arg::I(heads as i32),
        Arg::I(s.n_heads as i32),
        Arg::I(c_int(dh, "head_dim")),
        Arg::I(c_int(width, "qkv width")),
        Arg::F(eps),
        Arg::F(offset),
    ];
    gpu.launch(name, (c_int(rows, "rows") as u32, 1, 1), threads(heads), 0, &args);
}

/// `Backend::qk_norm_backward`: fixed blocks of rows (RMSNorm's, [`backward_blocks`]) turn
/// `dqkv`'s q and k parts into the input's gradient in place, a warp per head vector, and leave
/// per-block weight gradients in scratch, which a second kernel sums in order into `dw`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    gpu: &mut Cuda,
    dqkv: View,
    dw: View,
    qkv: View,
    w: View,
    offset: f32,
    rstd: View,
    s: AttnShape,
) {
    for (v, name) in [(dqkv, "dqkv"), (qkv, "qkv"), (w, "w")] {
        gpu.expect(v, DType::Bf16, "qk_norm_backward", name);
    }
    gpu.expect(dw, DType::F32, "qk_norm_backward", "dw");
    gpu.expect(rstd, DType::F32, "qk_norm_backward", "rstd");
    let (width, dh, heads) = (s.qkv_width(), s.head_dim, s.n_heads + s.n_kv_heads);
    let Some(rows) = rows_of(qkv, dqkv, rstd, w, s, "qk_norm_backward") else { return };
    assert_eq!(dw.len, 2 * dh, "internal error: qk_norm_backward: the weight gradients are [dwq | dwk]");
    let sm_count = gpu.dev.info().sm_count as usize;
    let (blocks, per_block) = backward_blocks(rows, sm_count);
    let partial = gpu.scratch(Scratch::NormPartials, partial_floats(rows, dh, sm_count) * 4);
    let (gp, dwp) = (gpu.out(dqkv, "qk_norm_backward"), gpu.out(dw, "qk_norm_backward"));
    let (xp, wp, r) = (gpu.ptr(qkv), gpu.ptr(w), gpu.ptr(rstd));
    let name = if wide(dh, &[gp, xp, wp]) { "qk_norm_backward_v8" } else { "qk_norm_backward" };
    let threads = threads(heads * per_block);
    let d2 = c_int(2 * dh, "2 head_dim");
    let args = [
        Arg::P(gp),
        Arg::P(partial),
        Arg::P(xp),
        Arg::P(wp),
        Arg::P(r),
        Arg::U(rows as u64),
        Arg::I(heads as i32),
        Arg::I(s.n_heads as i32),
        Arg::I(c_int(dh, "head_dim")),
        Arg::I(c_int(width, "qkv width")),
        Arg::I(per_block as i32),
        Arg::F(offset),
    ];
    let smem = (threads as usize / 32) * 2 * dh * 4;
    gpu.launch(name, (blocks as u32, 1, 1), threads, smem, &args);
    let args = [Arg::P(dwp), Arg::P(partial), Arg::I(blocks as i32), Arg::I(d2)];
    gpu.launch_1d("qk_norm_dw_finish", 2 * dh as u64, &args);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_one_to_eight_warps() {
        assert_eq!([threads(0), threads(1), threads(6), threads(8), threads(240)], [32, 32, 192, 256, 256]);
    }
}
