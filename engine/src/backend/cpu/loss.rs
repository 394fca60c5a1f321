//! Cross-entropy fused with the softmax.
//!
//! loss_n   = log Σ_v exp(z_nv) - z_n,target
//! dz_nv    = scale · (softmax(z_n)_v - [v = target])

use rayon::prelude::*;

/// Per-row losses; with `grad_scale`, the logits are overwritten by their scaled gradient.
pub fn cross_entropy(losses: &mut [f32], logits: &mut [f32], targets: &[u32], v: usize, grad_scale: Option<f32>) {
    assert_eq!(logits.len(), losses.len() * v);
    assert_eq!(targets.len(), losses.len());
    logits.par_chunks_mut(v).zip(losses.par_iter_mut()).zip(targets.par_iter()).for_each(|((z, loss), &t)| {
        let t = t as usize;
        assert!(t < v, "target token {t} outside the vocabulary of {v}");
        let max = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum = super::reduce::lanes_sum(z, &|x| ((x - max) as f64).exp());
        let lse = max as f64 + sum.ln();
        *loss = (lse - z[t] as f64) as f32;
        if let Some(scale) = grad_scale {
            for x in z.iter_mut() {
                *x = scale * ((*x as f64 - lse).exp() as f32);
            }
            z[t] -= scale;
        }
    });
}
