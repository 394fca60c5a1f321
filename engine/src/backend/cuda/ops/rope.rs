//! Rotary position embedding, in place on the q and k heads, and its inverse (`rope.cu`).

use super::{Module, c_int};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{AttnShape, View};

/// The kernels of `rope.cu`.
pub(crate) const MODULE: Module = Module { name: "rope", source: include_str!("rope.cu"), kernels: &["rope"] };

/// `Backend::rope`: a grid-stride launch over the rotated pairs of the q and k heads, in place.
pub(crate) fn apply(gpu: &mut Cuda, qkv: View, rope: View, s: AttnShape, inverse: bool) {
    gpu.expect(qkv, DType::Bf16, "rope", "qkv");
    gpu.expect(rope, DType::F32, "rope", "table");
    assert_eq!(qkv.len, s.rows() * s.qkv_width(), "internal error: rope: qkv length");
    assert!(rope.len >= s.seq * s.head_dim, "internal error: RoPE table shorter than the sequence");
    let heads = s.n_heads + s.n_kv_heads;
    let (q, t) = (gpu.out(qkv, "rope"), gpu.ptr(rope));
    let args = [
        Arg::P(q),
        Arg::P(t),
        Arg::U(s.rows() as u64),
        Arg::I(c_int(s.seq, "seq")),
        Arg::I(heads as i32),
        Arg::I(s.head_dim as i32),
        Arg::I(c_int(s.qkv_width(), "qkv width")),
        Arg::F(if inverse { -1.0 } else { 1.0 }),
    ];
    gpu.launch_1d("rope", (s.rows() * heads * s.head_dim / 2) as u64, &args);
}
