//! AdamW with decoupled weight decay, in PyTorch's formulation, fused with gradient scaling
//! (clipping) and zeroing.
//!
//! g = grad_scale · grad
//! p ← p · (1 - lr · wd)                       (decaying segments only)
//! m ← β1 m + (1 - β1) g,  v ← β2 v + (1 - β2) g²
//! p ← p - (lr / (1 - β1ᵗ)) · m / (sqrt(v) / sqrt(1 - β2ᵗ) + ε)
//! grad ← 0

use crate::backend::{AdamWStep, Segment};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// Updates every segment of the flat buffers.
pub fn step(
    p: &mut [f32],
    g: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    segments: &[Segment],
    s: AdamWStep,
) {
    let bc1 = 1.0 - (s.beta1 as f64).powi(s.t as i32);
    let bc2 = 1.0 - (s.beta2 as f64).powi(s.t as i32);
    let step_size = (s.lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    for seg in segments {
        let range = seg.offset..seg.offset + seg.len;
        let decay = if seg.decay {
            1.0 - s.lr * s.weight_decay
        } else {
            1.0
        };
        p[range.clone()]
            .par_chunks_mut(CHUNK)
            .zip(g[range.clone()].par_chunks_mut(CHUNK))
            .zip(m[range.clone()].par_chunks_mut(CHUNK))
            .zip(v[range].par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                for i in 0..p.len() {
                    let grad = g[i] * s.grad_scale;
                    m[i] = s.beta1 * m[i] + (1.0 - s.beta1) * grad;
                    v[i] = s.beta2 * v[i] + (1.0 - s.beta2) * grad * grad;
                    let denom = v[i].sqrt() / bc2_sqrt + s.eps;
                    p[i] = p[i] * decay - step_size * m[i] / denom;
                    g[i] = 0.0;
                }
            });
    }
}
