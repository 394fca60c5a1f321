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

/// Updates every segment of the flat buffers, gradients multiplied by `grad_scale` first.
pub fn step(
    p: &mut [f32],
    g: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    segments: &[Segment],
    s: AdamWStep,
    grad_scale: f32,
) {
    let bc1 = 1.0 - (s.beta1 as f64).powi(s.t as i32);
    let bc2 = 1.0 - (s.beta2 as f64).powi(s.t as i32);
    let step_size = (s.lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    for seg in segments {
        let range = seg.offset..seg.offset + seg.len;
        let decay = if seg.decay { 1.0 - s.lr * s.weight_decay } else { 1.0 };
        p[range.clone()]
            .par_chunks_mut(CHUNK)
            .zip(g[range.clone()].par_chunks_mut(CHUNK))
            .zip(m[range.clone()].par_chunks_mut(CHUNK))
            .zip(v[range].par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                for i in 0..p.len() {
                    let grad = g[i] * grad_scale;
                    m[i] = s.beta1 * m[i] + (1.0 - s.beta1) * grad;
                    v[i] = s.beta2 * v[i] + (1.0 - s.beta2) * grad * grad;
                    let denom = v[i].sqrt() / bc2_sqrt + s.eps;
                    p[i] = p[i] * decay - step_size * m[i] / denom;
                    g[i] = 0.0;
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's `torch.optim.AdamW` on one scalar, written out in f64.
    fn reference(p: f64, grads: &[f64], lr: f64, wd: f64) -> f64 {
        let (b1, b2, eps) = (0.9f64, 0.95f64, 1e-8f64);
        let (mut p, mut m, mut v) = (p, 0.0, 0.0);
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            p *= 1.0 - lr * wd;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let denom = v.sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            p -= lr / (1.0 - b1.powi(t)) * m / denom;
        }
        p
    }

    #[test]
    fn matches_pytorch_adamw_and_zeroes_gradients() {
        let grads = [0.3, -1.2, 0.05, 2.0];
        let segments = [Segment { offset: 0, len: 1, decay: true }, Segment { offset: 1, len: 1, decay: false }];
        let (mut p, mut m, mut v) = (vec![0.7f32, 0.7], vec![0f32; 2], vec![0f32; 2]);
        for (t, &g) in grads.iter().enumerate() {
            let mut gr = vec![g as f32 * 2.0; 2];
            let s = AdamWStep {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                t: t as u64 + 1,
                max_grad_norm: 0.0,
            };
            step(&mut p, &mut gr, &mut m, &mut v, &segments, s, 0.5);
            assert_eq!(gr, [0.0, 0.0]);
        }
        assert!((p[0] as f64 - reference(0.7, &grads, 0.01, 0.1)).abs() < 1e-6);
        assert!((p[1] as f64 - reference(0.7, &grads, 0.01, 0.0)).abs() < 1e-6);
    }
}
