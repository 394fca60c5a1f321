//! DeepSeek-V3's MLA around the attention kernels: the packed qkv rows assembled from MLA's
//! pieces and their adjoint, and heads narrowed or widened (`mla.cu`).

use super::{Module, c_int, row_threads};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{MlaShape, View};

/// The kernels of `mla.cu`.
pub(crate) const MODULE: Module = Module {
    name: "mla",
    source: include_str!("mla.cu"),
    kernels: &["mla_qkv_forward", "mla_qkv_backward", "heads_resize"],
};

/// Blocks for `rows` rows of `threads` threads: one a row, at most as many threads in all as
/// `launch_1d` starts (the kernels stride over the rest).
fn blocks(gpu: &Cuda, rows: usize, threads: u32) -> u32 {
    let cap = (32 * 256 * gpu.dev.info().sm_count.max(1) as usize / threads as usize).max(1);
    rows.min(cap) as u32
}

/// Checks the shape and the views' lengths of either pass; `op` names it.
fn check(s: MlaShape, table: View, op: &str) {
    assert!(s.rope > 0 && s.rope.is_multiple_of(2), "internal error: {op}: MLA's rotary width {} is not even", s.rope);
    assert!(s.heads > 0 && s.nope + s.v > 0, "internal error: {op}: MLA shape {s:?} has empty heads");
    assert!(s.v <= s.qk(), "internal error: {op}: value heads ({}) wider than qk ({})", s.v, s.qk());
    assert!(s.rows == 0 || s.seq > 0, "internal error: {op}: rows without a sequence length");
    assert!(table.len >= s.seq.min(s.rows) * s.rope, "internal error: {op}: RoPE table shorter than the sequence");
    c_int(s.qkv_width(), "MLA qkv width");
    c_int(s.q_width() + s.kv_width() + s.rope, "MLA gradient row width");
}

/// The shape's integer arguments after the row count: seq, heads, nope, rope, v, interleave.
fn shape_args(s: MlaShape) -> [Arg; 6] {
    [
        Arg::I(c_int(s.seq, "seq")),
        Arg::I(s.heads as i32),
        Arg::I(s.nope as i32),
        Arg::I(s.rope as i32),
        Arg::I(s.v as i32),
        Arg::I(s.interleave as i32),
    ]
}

/// `Backend::mla_qkv_forward`: a block per row, its threads over the row's packed columns.
pub(crate) fn qkv_forward(
    gpu: &mut Cuda,
    qkv: View,
    q: View,
    kv: View,
    kpe: View,
    table: View,
    s: MlaShape,
    q_scale: f32,
) {
    const OP: &str = "mla_qkv_forward";
    for (v, name) in [(qkv, "qkv"), (q, "q"), (kv, "kv"), (kpe, "kpe")] {
        gpu.expect(v, DType::Bf16, OP, name);
    }
    gpu.expect(table, DType::F32, OP, "table");
    check(s, table, OP);
    assert_eq!(qkv.len, s.rows * s.qkv_width(), "internal error: {OP}: qkv length");
    assert_eq!(q.len, s.rows * s.q_width(), "internal error: {OP}: q length");
    assert_eq!(kv.len, s.rows * s.kv_width(), "internal error: {OP}: kv length");
    assert_eq!(kpe.len, s.rows * s.rope, "internal error: {OP}: kpe length");
    if s.rows == 0 {
        return;
    }
    let threads = row_threads(s.qkv_width());
    let grid = blocks(gpu, s.rows, threads);
    let ptrs = [gpu.out(qkv, OP), gpu.ptr(q), gpu.ptr(kv), gpu.ptr(kpe), gpu.ptr(table)];
    let mut args: Vec<Arg> = ptrs.into_iter().map(Arg::P).collect();
    args.push(Arg::U(s.rows as u64));
    args.extend(shape_args(s));
    args.push(Arg::F(q_scale));
    gpu.launch("mla_qkv_forward", (grid, 1, 1), threads, 0, &args);
}

/// `Backend::mla_qkv_backward`: a block per row, its threads over the columns of the row's three
/// gradients (dq, dkv, dkpe); a dkpe column sums its heads in order.
pub(crate) fn qkv_backward(
    gpu: &mut Cuda,
    dq: View,
    dkv: View,
    dkpe: View,
    dqkv: View,
    table: View,
    s: MlaShape,
    q_scale: f32,
) {
    const OP: &str = "mla_qkv_backward";
    for (v, name) in [(dq, "dq"), (dkv, "dkv"), (dkpe, "dkpe"), (dqkv, "dqkv")] {
        gpu.expect(v, DType::Bf16, OP, name);
    }
    gpu.expect(table, DType::F32, OP, "table");
    check(s, table, OP);
    assert_eq!(dqkv.len, s.rows * s.qkv_width(), "internal error: {OP}: dqkv length");
    assert_eq!(dq.len, s.rows * s.q_width(), "internal error: {OP}: dq length");
    assert_eq!(dkv.len, s.rows * s.kv_width(), "internal error: {OP}: dkv length");
    assert_eq!(dkpe.len, s.rows * s.rope, "internal error: {OP}: dkpe length");
    if s.rows == 0 {
        return;
    }
    let threads = row_threads(s.q_width() + s.kv_width() + s.rope);
    let grid = blocks(gpu, s.rows, threads);
    let ptrs = [gpu.out(dq, OP), gpu.out(dkv, OP), gpu.out(dkpe, OP), gpu.ptr(dqkv), gpu.ptr(table)];
    let mut args: Vec<Arg> = ptrs.into_iter().map(Arg::P).collect();
    args.push(Arg::U(s.rows as u64));
    args.extend(shape_args(s));
    args.push(Arg::F(q_scale));
    gpu.launch("mla_qkv_backward", (grid, 1, 1), threads, 0, &args);
}

/// `Backend::heads_narrow` and `Backend::heads_widen`: `out[rows, heads·to]` from `x[rows,
/// heads·from]`, each head's first `min(from, to)` columns copied and the rest zeroed.
pub(crate) fn heads_resize(gpu: &mut Cuda, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize) {
    let op = if to <= from { "heads_narrow" } else { "heads_widen" };
    gpu.expect(out, DType::Bf16, op, "out");
    gpu.expect(x, DType::Bf16, op, "x");
    assert_eq!(x.len, rows * heads * from, "internal error: {op}: input length");
    assert_eq!(out.len, rows * heads * to, "internal error: {op}: output length");
    if out.len == 0 {
        return;
    }
    let threads = row_threads(heads * to);
    let grid = blocks(gpu, rows, threads);
    let args = [
        Arg::P(gpu.out(out, op)),
        Arg::P(gpu.ptr(x)),
        Arg::U(rows as u64),
        Arg::I(c_int(heads, "heads")),
        Arg::I(c_int(from, "head width")),
        Arg::I(c_int(to, "head width")),
    ];
    c_int(heads * to.max(from), "row width");
    gpu.launch("heads_resize", (grid, 1, 1), threads, 0, &args);
}
