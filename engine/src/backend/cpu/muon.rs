//! Muon's elementwise parts: the momentum (fused with clipping) and the Frobenius
//! normalisation before the Newton–Schulz iterations, in `torch.optim.Muon`'s formulation.
//!
//! g = clip · grad
//! B ← lerp(B, g, 1 − μ)                          (B + (1 − μ)(g − B))
//! grad ← lerp(g, B, μ) if nesterov, else B       (the matrix to orthogonalise)
//!
//! X ← X / max(‖X‖_F, eps)                        (‖X‖²_F given, summed in f64)

use crate::backend::{MuonMomentum, lerp};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// The momentum over `grads` and its buffer `buf`, gradients multiplied by `clip` first.
pub fn momentum(grads: &mut [f32], buf: &mut [f32], s: MuonMomentum, clip: f32) {
    // PyTorch passes `1 − μ` as a Python float, rounded to the tensors' f32 once.
    let (keep, mix) = (s.momentum, (1.0 - s.momentum as f64) as f32);
    grads.par_chunks_mut(CHUNK).zip(buf.par_chunks_mut(CHUNK)).for_each(|(g, b)| {
        for (g, b) in g.iter_mut().zip(b.iter_mut()) {
            let grad = *g * clip;
            *b = lerp(*b, grad, mix);
            *g = if s.nesterov { lerp(grad, *b, keep) } else { *b };
        }
    });
}

/// `x ← x / max(√sum_squares, eps)`.
pub fn divide_by_norm(x: &mut [f32], sum_squares: f32, eps: f32) {
    let norm = sum_squares.sqrt().max(eps);
    x.par_chunks_mut(CHUNK).for_each(|x| x.iter_mut().for_each(|v| *v /= norm));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `torch.optim.Muon`'s two momentum lines on one element, written out in f64.
    fn reference(buf: f64, grad: f64, mu: f64, nesterov: bool) -> (f64, f64) {
        let b = mu * buf + (1.0 - mu) * grad;
        (b, if nesterov { (1.0 - mu) * grad + mu * b } else { b })
    }

    #[test]
    fn momentum_matches_pytorch_with_clipping() {
        for nesterov in [true, false] {
            let s = MuonMomentum { momentum: 0.95, nesterov, max_grad_norm: 1.0 };
            let (mut g, mut b) = (vec![0.5f32, -2.0, 3.0], vec![0.1f32, 0.2, -0.3]);
            momentum(&mut g, &mut b, s, 0.5);
            for i in 0..3 {
                let (rb, rg) = reference([0.1, 0.2, -0.3][i], [0.25, -1.0, 1.5][i], 0.95, nesterov);
                assert!((b[i] as f64 - rb).abs() < 1e-6 && (g[i] as f64 - rg).abs() < 1e-6, "{nesterov} {i}");
            }
        }
    }

    #[test]
    fn divide_by_norm_floors_the_norm_at_eps() {
        let mut x = vec![3.0f32, 4.0];
        divide_by_norm(&mut x, 25.0, 1e-7);
        assert_eq!(x, vec![0.6, 0.8]);
        let mut zero = vec![0.0f32; 2];
        divide_by_norm(&mut zero, 0.0, 1e-7);
        assert_eq!(zero, vec![0.0, 0.0]);
    }
}
