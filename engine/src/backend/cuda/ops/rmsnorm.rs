//! RMSNorm forward, and backward with the residual add and the weight gradient summed over
//! fixed blocks of rows (`rmsnorm.cu`).

use super::{Module, aligned16, c_int, row_threads};
use crate::backend::View;
use crate::backend::cuda::{Arg, Cuda, DType, Scratch};

/// The kernels of `rmsnorm.cu`.
pub(crate) const MODULE: Module = Module {
    name: "rmsnorm",
    source: include_str!("rmsnorm.cu"),
    kernels: &["rmsnorm_forward", "rmsnorm_forward_v8", "rmsnorm_backward", "rmsnorm_backward_v8", "rmsnorm_dw_finish"],
};

/// Blocks and rows per block of the RMSNorm backward pass: four blocks per multiprocessor (of
/// the six its registers allow at 256 threads), each walking its rows eight at a time. More
/// blocks put more rows in flight but each adds a partial weight-gradient row that
/// `rmsnorm_dw_finish` reads back: at 16384 rows of 2048 on 132 SMs, 4.3 MB against the 335 MB
/// the rows themselves move.
pub(crate) fn backward_blocks(rows: usize, sm_count: usize) -> (usize, usize) {
    let target = (4 * sm_count).clamp(1, rows.max(1));
    let per_block = rows.div_ceil(target).max(1);
    (rows.div_ceil(per_block).max(1), per_block)
}

/// `Backend::rmsnorm_forward`: a block per row, the 8-wide kernel when `d` and the rows allow.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(gpu: &mut Cuda, out: View, rstd: View, x: View, w: View, offset: f32, d: usize, eps: f32) {
    for (v, name) in [(out, "out"), (x, "x"), (w, "w")] {
        gpu.expect(v, DType::Bf16, "rmsnorm_forward", name);
    }
    gpu.expect(rstd, DType::F32, "rmsnorm_forward", "rstd");
    let rows = x.len / d;
    assert_eq!(rstd.len, rows, "internal error: rmsnorm_forward: rstd length");
    let (o, r, xp, wp) = (gpu.out(out, "rmsnorm"), gpu.out(rstd, "rmsnorm"), gpu.ptr(x), gpu.ptr(w));
    let v8 = d.is_multiple_of(8) && aligned16(&[o, xp, wp]);
    let name = if v8 { "rmsnorm_forward_v8" } else { "rmsnorm_forward" };
    let threads = row_threads(if v8 { d / 8 } else { d });
    let args = [Arg::P(o), Arg::P(r), Arg::P(xp), Arg::P(wp), Arg::I(c_int(d, "d")), Arg::F(eps), Arg::F(offset)];
    gpu.launch(name, (rows as u32, 1, 1), threads, 0, &args);
}

/// `Backend::rmsnorm_backward`: fixed blocks of rows add into `dx` and leave per-block weight
/// gradients in scratch, which a second kernel sums in order into `dw`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    gpu: &mut Cuda,
    dx: View,
    dw: View,
    dout: View,
    x: View,
    w: View,
    offset: f32,
    rstd: View,
    d: usize,
) {
    for (v, name) in [(dx, "dx"), (dout, "dout"), (x, "x"), (w, "w")] {
        gpu.expect(v, DType::Bf16, "rmsnorm_backward", name);
    }
    gpu.expect(dw, DType::F32, "rmsnorm_backward", "dw");
    gpu.expect(rstd, DType::F32, "rmsnorm_backward", "rstd");
    let rows = x.len / d;
    let (blocks, per_block) = backward_blocks(rows, gpu.dev.info().sm_count as usize);
    let partial = gpu.scratch(Scratch::NormPartials, blocks * d * 4);
    let (dxp, dwp) = (gpu.out(dx, "rmsnorm_backward"), gpu.out(dw, "rmsnorm_backward"));
    let (g, xp, wp, r) = (gpu.ptr(dout), gpu.ptr(x), gpu.ptr(w), gpu.ptr(rstd));
    let v8 = d.is_multiple_of(8) && aligned16(&[dxp, g, xp, wp]);
    let name = if v8 { "rmsnorm_backward_v8" } else { "rmsnorm_backward" };
    let threads = row_threads(if v8 { d / 8 } else { d });
    let di = c_int(d, "d");
    let args = [
        Arg::P(dxp),
        Arg::P(partial),
        Arg::P(g),
        Arg::P(xp),
        Arg::P(wp),
        Arg::P(r),
        Arg::U(rows as u64),
        Arg::I(di),
        Arg::I(per_block as i32),
        Arg::F(offset),
    ];
    gpu.launch(name, (blocks as u32, 1, 1), threads, d * 4, &args);
    let args = [Arg::P(dwp), Arg::P(partial), Arg::I(blocks as i32), Arg::I(di)];
    gpu.launch_1d("rmsnorm_dw_finish", d as u64, &args);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_blocks_cover_every_row_once() {
        for (rows, sms) in [(1, 132), (7, 132), (4096, 132), (32768, 132), (100, 1), (5, 0)] {
            let (blocks, per) = backward_blocks(rows, sms);
            assert!(blocks * per >= rows && (blocks - 1) * per < rows, "{rows} rows on {sms}: {blocks} x {per}");
        }
    }
}
