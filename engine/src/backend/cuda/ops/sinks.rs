//! Learned attention sinks (GPT-OSS): the forward epilogue in place on attention's output and
//! log-sum-exp, and the sinks' gradient summed over fixed blocks of rows (`sinks.cu`).

use super::{Module, aligned16, c_int, rmsnorm::backward_blocks};
use crate::backend::View;
use crate::backend::cuda::{Arg, Cuda, DType, Scratch};
use cudarc::driver::sys::CUdeviceptr;

/// The kernels of `sinks.cu`.
pub(crate) const MODULE: Module = Module {
    name: "sinks",
    source: include_str!("sinks.cu"),
    kernels: &[
        "attention_sinks_forward",
        "attention_sinks_forward_v8",
        "attention_sinks_backward",
        "attention_sinks_backward_v8",
        "attention_sinks_finish",
    ],
};

/// Threads of a backward block: a warp a row, at most eight.
const BACKWARD_THREADS: u32 = 256;

/// Where the log-sum-exp lies: `[rows, heads]` (the native kernels'), or cuDNN's statistics
/// `[batch, heads, seq]` of sequences of `seq` rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LseLayout {
    /// `lse[r · heads + h]`.
    RowsHeads,
    /// `lse[(b · heads + h) · seq + t]` for row `r = b · seq + t`.
    BatchHeadsSeq(usize),
}

impl LseLayout {
    fn seq_arg(self) -> i32 {
        match self {
            LseLayout::RowsHeads => 0,
            LseLayout::BatchHeadsSeq(seq) => {
                assert!(seq > 0, "internal error: attention sinks: a [batch, heads, seq] layout of no seq");
                c_int(seq, "seq")
            }
        }
    }
}

/// The blocks of rows a head's gradient is summed over on `sm_count` multiprocessors, and rows
/// a block: RMSNorm's [`backward_blocks`] for a `1/heads` share of the device (the grid has a
/// row of blocks a head), so that `blocks · heads` partials never exceed RMSNorm's blocks times
/// the head count (the memory estimate's [`Scratch::NormPartials`], which they share).
pub(crate) fn backward_grid(rows: usize, heads: usize, sm_count: usize) -> (usize, usize) {
    backward_blocks(rows, sm_count.div_ceil(heads.max(1)))
}

/// The token rows of `out` (none for an empty shape), after checking `lse`'s and `sinks`' lengths.
fn rows_of(out: View, lse: View, sinks: View, heads: usize, head_dim: usize, op: &str) -> Option<usize> {
    let width = heads * head_dim;
    if width == 0 {
        return None;
    }
    let rows = out.len / width;
    assert_eq!(out.len, rows * width, "internal error: {op}: out is [rows, heads · head_dim]");
    assert_eq!(lse.len, rows * heads, "internal error: {op}: lse is [rows, heads]");
    assert_eq!(sinks.len, heads, "internal error: {op}: one sink a head");
    (rows > 0).then_some(rows)
}

fn wide(head_dim: usize, ptrs: &[CUdeviceptr]) -> bool {
    head_dim.is_multiple_of(8) && aligned16(ptrs)
}

/// `Backend::attention_sinks_forward`: a block per row, a warp per head vector (the 8-wide
/// kernel when the head width and the addresses allow).
pub(crate) fn forward(
    gpu: &mut Cuda,
    out: View,
    lse: View,
    sinks: View,
    heads: usize,
    head_dim: usize,
    layout: LseLayout,
) {
    const OP: &str = "attention_sinks_forward";
    for (v, name) in [(out, "out"), (sinks, "sinks")] {
        gpu.expect(v, DType::Bf16, OP, name);
    }
    gpu.expect(lse, DType::F32, OP, "lse");
    let Some(rows) = rows_of(out, lse, sinks, heads, head_dim, OP) else { return };
    if let LseLayout::BatchHeadsSeq(seq) = layout {
        assert_eq!(rows % seq, 0, "internal error: {OP}: {rows} rows are not whole sequences of {seq}");
    }
    let (o, l, sp) = (gpu.out(out, OP), gpu.out(lse, OP), gpu.ptr(sinks));
    let name = if wide(head_dim, &[o]) { "attention_sinks_forward_v8" } else { "attention_sinks_forward" };
    let args = [
        Arg::P(o),
        Arg::P(l),
        Arg::P(sp),
        Arg::I(c_int(heads, "heads")),
        Arg::I(c_int(head_dim, "head_dim")),
        Arg::I(layout.seq_arg()),
    ];
    let threads = (32 * heads.clamp(1, 8)) as u32;
    gpu.launch(name, (c_int(rows, "rows") as u32, 1, 1), threads, 0, &args);
}

/// `Backend::attention_sinks_backward`: a grid of fixed blocks of rows by heads leaves each
/// block's sum in scratch; a second kernel adds each head's sums in block order to `dsinks`
/// (negated). No atomics: the same bits every run on the same device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    gpu: &mut Cuda,
    dsinks: View,
    dout: View,
    out: View,
    lse: View,
    sinks: View,
    heads: usize,
    head_dim: usize,
    layout: LseLayout,
) {
    const OP: &str = "attention_sinks_backward";
    for (v, name) in [(dout, "dout"), (out, "out"), (sinks, "sinks")] {
        gpu.expect(v, DType::Bf16, OP, name);
    }
    gpu.expect(lse, DType::F32, OP, "lse");
    gpu.expect(dsinks, DType::F32, OP, "dsinks");
    assert_eq!(dsinks.len, heads, "internal error: {OP}: one gradient a head");
    assert_eq!(dout.len, out.len, "internal error: {OP}: dout is out's shape");
    let Some(rows) = rows_of(out, lse, sinks, heads, head_dim, OP) else { return };
    if let LseLayout::BatchHeadsSeq(seq) = layout {
        assert_eq!(rows % seq, 0, "internal error: {OP}: {rows} rows are not whole sequences of {seq}");
    }
    let sm_count = gpu.dev.info().sm_count as usize;
    let (blocks, per_block) = backward_grid(rows, heads, sm_count);
    let partial = gpu.scratch(Scratch::NormPartials, blocks * heads * 4);
    let ds = gpu.out(dsinks, OP);
    let (g, o, l, sp) = (gpu.ptr(dout), gpu.ptr(out), gpu.ptr(lse), gpu.ptr(sinks));
    let name = if wide(head_dim, &[g, o]) { "attention_sinks_backward_v8" } else { "attention_sinks_backward" };
    let args = [
        Arg::P(partial),
        Arg::P(g),
        Arg::P(o),
        Arg::P(l),
        Arg::P(sp),
        Arg::U(rows as u64),
        Arg::I(c_int(heads, "heads")),
        Arg::I(c_int(head_dim, "head_dim")),
        Arg::I(layout.seq_arg()),
        Arg::I(c_int(per_block, "rows a block")),
    ];
    let grid = (c_int(blocks, "blocks") as u32, c_int(heads, "heads") as u32, 1);
    gpu.launch(name, grid, BACKWARD_THREADS, 0, &args);
    let args = [Arg::P(ds), Arg::P(partial), Arg::I(blocks as i32), Arg::I(heads as i32)];
    gpu.launch_1d("attention_sinks_finish", heads as u64, &args);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinks_partials_fit_the_norms_scratch() {
        for (rows, heads, sms) in [(1, 1, 132), (66, 4, 2), (4096, 64, 132), (32768, 8, 132), (100, 3, 1), (5, 2, 0)] {
            let (blocks, per) = backward_grid(rows, heads, sms);
            assert!(blocks * per >= rows && (blocks - 1) * per < rows, "{rows} rows: {blocks} x {per}");
            assert!(blocks <= backward_blocks(rows, sms).0, "{rows} rows, {heads} heads on {sms}");
        }
    }
}
