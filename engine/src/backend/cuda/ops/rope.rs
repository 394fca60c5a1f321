//! Rotary position embedding, in place on the q and k heads, and its inverse (`rope.cu`).

use super::{Module, aligned16, c_int, row_threads};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{AttnShape, View};

/// The kernels of `rope.cu`.
pub(crate) const MODULE: Module =
    Module { name: "rope", source: include_str!("rope.cu"), kernels: &["rope", "rope_v4"] };

/// `Backend::rope`: blocks over (position, sequence), each block's threads over the rotated
/// pairs of a row's q and k heads, 4 pairs a thread when `head_dim / 2` and the addresses allow.
pub(crate) fn apply(gpu: &mut Cuda, qkv: View, rope: View, s: AttnShape, inverse: bool) {
    gpu.expect(qkv, DType::Bf16, "rope", "qkv");
    gpu.expect(rope, DType::F32, "rope", "table");
    assert_eq!(qkv.len, s.rows() * s.qkv_width(), "internal error: rope: qkv length");
    assert!(rope.len >= s.seq * s.head_dim, "internal error: RoPE table shorter than the sequence");
    let (heads, half) = (s.n_heads + s.n_kv_heads, s.head_dim / 2);
    if half == 0 || s.rows() == 0 {
        return;
    }
    let (q, t) = (gpu.out(qkv, "rope"), gpu.ptr(rope));
    // 4 pairs: 8-byte accesses of q (head_dim and the width are then multiples of 8) and
    // 16-byte loads of the table.
    let v4 = half.is_multiple_of(4) && aligned16(&[q, t]);
    let (name, per) = if v4 { ("rope_v4", 4) } else { ("rope", 1) };
    let threads = row_threads(heads * (half / per));
    // As many threads in all as `launch_1d` starts at most; the kernel strides over the rest.
    let cap = (32 * 256 * gpu.dev.info().sm_count.max(1) as usize / threads as usize).max(1);
    let x = s.seq.min(cap);
    let y = s.batch.min(65535).min((cap / x).max(1));
    let args = [
        Arg::P(q),
        Arg::P(t),
        Arg::I(c_int(s.batch, "batch")),
        Arg::I(c_int(s.seq, "seq")),
        Arg::I(heads as i32),
        Arg::I(s.head_dim as i32),
        Arg::I(c_int(s.qkv_width(), "qkv width")),
        Arg::F(if inverse { -1.0 } else { 1.0 }),
    ];
    gpu.launch(name, (x as u32, y as u32, 1), threads, 0, &args);
}
