//! Token embedding lookup and its scatter-add gradient (`embedding.cu`).

use super::{Module, aligned16, c_int, row_threads};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{IdxView, View};

/// The kernels of `embedding.cu`.
pub(crate) const MODULE: Module = Module {
    name: "embedding",
    source: include_str!("embedding.cu"),
    kernels: &[
        "embedding_forward",
        "embedding_forward_v8",
        "embedding_backward",
        "embedding_forward_slice",
        "embedding_backward_slice",
    ],
};

/// `Backend::embedding_forward`: a block per token, the 8-wide kernel when `d` and the rows allow.
pub(crate) fn forward(gpu: &mut Cuda, out: View, table: View, tokens: IdxView, d: usize) {
    gpu.expect(out, DType::Bf16, "embedding_forward", "out");
    gpu.expect(table, DType::Bf16, "embedding_forward", "table");
    assert_eq!(out.len, tokens.len * d, "internal error: embedding_forward: out length");
    let (o, t, tok) = (gpu.out(out, "embedding_forward"), gpu.ptr(table), gpu.iptr(tokens));
    let v8 = d.is_multiple_of(8) && aligned16(&[o, t]);
    let name = if v8 { "embedding_forward_v8" } else { "embedding_forward" };
    let threads = row_threads(if v8 { d / 8 } else { d });
    let args = [Arg::P(o), Arg::P(t), Arg::P(tok), Arg::I(c_int(d, "d")), Arg::U((table.len / d) as u64)];
    gpu.launch(name, (tokens.len as u32, 1, 1), threads, 0, &args);
}

/// `Backend::embedding_backward`: a block per token adding its row with f32 atomics.
pub(crate) fn backward(gpu: &mut Cuda, dtable: View, dout: View, tokens: IdxView, d: usize) {
    gpu.expect(dtable, DType::F32, "embedding_backward", "dtable");
    gpu.expect(dout, DType::Bf16, "embedding_backward", "dout");
    let (dt, g, tok) = (gpu.out(dtable, "embedding_backward"), gpu.ptr(dout), gpu.iptr(tokens));
    let args = [Arg::P(dt), Arg::P(g), Arg::P(tok), Arg::I(c_int(d, "d")), Arg::U((dtable.len / d) as u64)];
    gpu.launch("embedding_backward", (tokens.len as u32, 1, 1), row_threads(d), 0, &args);
}

/// `Backend::embedding_forward_slice`: a block per token; another slice's token gets zeros.
pub(crate) fn forward_slice(gpu: &mut Cuda, out: View, table: View, tokens: IdxView, d: usize, first: usize) {
    gpu.expect(out, DType::Bf16, "embedding_forward_slice", "out");
    gpu.expect(table, DType::Bf16, "embedding_forward_slice", "table");
    assert_eq!(out.len, tokens.len * d, "internal error: embedding_forward_slice: out length");
    let (o, t, tok) = (gpu.out(out, "embedding_forward_slice"), gpu.ptr(table), gpu.iptr(tokens));
    let rows = (table.len / d) as u64;
    let args = [Arg::P(o), Arg::P(t), Arg::P(tok), Arg::I(c_int(d, "d")), Arg::U(first as u64), Arg::U(rows)];
    gpu.launch("embedding_forward_slice", (tokens.len as u32, 1, 1), row_threads(d), 0, &args);
}

/// `Backend::embedding_backward_slice`: a block per token of the slice, adding with f32 atomics.
pub(crate) fn backward_slice(gpu: &mut Cuda, dtable: View, dout: View, tokens: IdxView, d: usize, first: usize) {
    gpu.expect(dtable, DType::F32, "embedding_backward_slice", "dtable");
    gpu.expect(dout, DType::Bf16, "embedding_backward_slice", "dout");
    let (dt, g, tok) = (gpu.out(dtable, "embedding_backward_slice"), gpu.ptr(dout), gpu.iptr(tokens));
    let rows = (dtable.len / d) as u64;
    let args = [Arg::P(dt), Arg::P(g), Arg::P(tok), Arg::I(c_int(d, "d")), Arg::U(first as u64), Arg::U(rows)];
    gpu.launch("embedding_backward_slice", (tokens.len as u32, 1, 1), row_threads(d), 0, &args);
}
