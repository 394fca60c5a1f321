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
        let target = z[t];
        let max = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        // One f32 exp per logit, kept for the gradient; the sum in f64.
        let sum = match grad_scale {
            Some(_) => {
                z.iter_mut().for_each(|x| *x = (*x - max).exp());
                super::reduce::lanes_sum(z, &|e| e as f64)
            }
            None => super::reduce::lanes_sum(z, &|x| (x - max).exp() as f64),
        };
        *loss = (max as f64 + sum.ln() - target as f64) as f32;
        if let Some(scale) = grad_scale {
            let k = (scale as f64 / sum) as f32;
            z.iter_mut().for_each(|e| *e *= k);
            z[t] -= scale;
        }
    });
}
