//! Cross-entropy fused with the softmax.
//!
//! loss_n   = log Σ_v exp(z_nv) - z_n,target
//! dz_nv    = scale · (softmax(z_n)_v - [v = target])
//!
//! Vocabulary-parallel (Megatron-LM's): a device of the tensor group holds columns
//! `first..first + v` of every row, and the group reduces between the three steps:
//!
//! m_n      = max_v z_nv                       (row_max, then the maximum over the group)
//! s_n      = Σ_v exp(z_nv - m_n)              (partials, then the sum over the group)
//! t_n      = z_n,target where held, else 0    (partials, then the sum over the group)
//! loss_n   = log s_n + m_n - t_n              (finish)
//! dz_nv    = scale · (exp(z_nv - m_n) / s_n - [first + v = target])

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

/// Each row's maximum over this device's columns.
pub fn row_max(max: &mut [f32], logits: &[f32], v: usize) {
    assert_eq!(logits.len(), max.len() * v);
    max.par_iter_mut().zip(logits.par_chunks(v)).for_each(|(m, z)| {
        *m = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    });
}

/// `sums[n]` = this device's Σ exp(z - max), `sums[N + n]` = the target's logit if this
/// device holds its column, else 0.
pub fn partials(sums: &mut [f32], logits: &[f32], max: &[f32], targets: &[u32], v: usize, first: usize) {
    let n = max.len();
    assert_eq!((sums.len(), logits.len(), targets.len()), (2 * n, n * v, n));
    let (exp_sums, picked) = sums.split_at_mut(n);
    exp_sums.par_iter_mut().zip(logits.par_chunks(v)).zip(max.par_iter()).for_each(|((s, z), &m)| {
        *s = super::reduce::lanes_sum(z, &|x| (x - m).exp() as f64) as f32;
    });
    picked.iter_mut().zip(logits.chunks_exact(v)).zip(targets).for_each(|((p, z), &t)| {
        let t = t as usize;
        *p = if (first..first + v).contains(&t) { z[t - first] } else { 0.0 };
    });
}

/// The losses from the group's maxima and sums; with `grad_scale`, the logits' gradient over
/// this device's columns.
#[allow(clippy::too_many_arguments)]
pub fn finish(
    losses: &mut [f32],
    logits: &mut [f32],
    max: &[f32],
    sums: &[f32],
    targets: &[u32],
    v: usize,
    first: usize,
    grad_scale: Option<f32>,
) {
    let n = losses.len();
    assert_eq!((logits.len(), max.len(), sums.len(), targets.len()), (n * v, n, 2 * n, n));
    let (exp_sums, picked) = sums.split_at(n);
    let rows = logits.par_chunks_mut(v).zip(losses.par_iter_mut()).zip(targets.par_iter());
    rows.enumerate().for_each(|(i, ((z, loss), &t))| {
        let (m, s) = (max[i], exp_sums[i] as f64);
        *loss = (m as f64 + s.ln() - picked[i] as f64) as f32;
        if let Some(scale) = grad_scale {
            let k = (scale as f64 / s) as f32;
            z.iter_mut().for_each(|x| *x = (*x - m).exp() * k);
            let t = t as usize;
            if (first..first + v).contains(&t) {
                z[t - first] -= scale;
            }
        }
    });
}
