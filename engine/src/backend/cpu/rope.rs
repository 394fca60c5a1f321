//! Rotary position embedding, in the "rotate half" layout of Hugging Face Llama: dimension i of
//! a head pairs with dimension i + Dh/2.
//!
//! forward:  (x_i, x_{i+h}) -> (x_i cos θ - x_{i+h} sin θ,  x_{i+h} cos θ + x_i sin θ),
//!           θ = t · inv_freq_i for the token's position t in its sequence
//! backward: the transpose of a rotation is the rotation by -θ.

use crate::backend::AttnShape;
use rayon::prelude::*;

/// Rotates the q and k heads of every packed qkv row in place; `table` holds `(cos, sin)` pairs
/// for each position and frequency, `[seq, Dh/2, 2]`.
pub fn apply(qkv: &mut [f32], table: &[f32], s: AttnShape, inverse: bool) {
    let (width, half) = (s.qkv_width(), s.head_dim / 2);
    assert_eq!(qkv.len(), s.rows() * width);
    assert!(table.len() >= s.seq * half * 2, "RoPE table shorter than the sequence");
    let sign = if inverse { -1.0 } else { 1.0 };
    qkv.par_chunks_mut(width).enumerate().for_each(|(row, r)| {
        let t = row % s.seq;
        let freqs = &table[t * half * 2..(t + 1) * half * 2];
        // q heads then k heads are contiguous: n_heads + n_kv_heads heads of head_dim.
        for head in r[..(s.n_heads + s.n_kv_heads) * s.head_dim].chunks_exact_mut(s.head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (cos, sin) = (freqs[2 * i], sign * freqs[2 * i + 1]);
                let (a, b) = (lo[i], hi[i]);
                lo[i] = a * cos - b * sin;
                hi[i] = b * cos + a * sin;
            }
        }
    });
}
