//! Mixture-of-experts routers: Mixtral / Qwen3-MoE softmax top-k and DeepSeek-V3 sigmoid
//! scoring with a selection bias and a group limit (Hugging Face's `DeepseekV3TopkRouter`), their
//! gradient, and the auxiliary-loss-free balancing of the bias. All in f32, per token:
//!
//! forward                                          backward (g = dL/ds, then dL/dz)
//! s   = softmax(z)  |  sigmoid(z)                  dz = s ⊙ (g - s·g)  |  g ⊙ s ⊙ (1 - s)
//! sel = s + bias    (selection only)               (no gradient: bias, groups, choice)
//! groups > 1: score_g = top1 + top2 of sel in g,
//!     keep the top_groups best (ties: lower index)
//! e_j = top-k of sel over the kept groups' experts
//!     (ties: lower index)
//! u_j = s[e_j]                                     g[e] = aux_scale · counts[e]  (load balancing)
//! D   = Σ_j u_j  (+ 1e-20 for sigmoid)
//! w_j = scale · u_j / D   (renormalised)           g[e_i] += (scale · dw_i - Σ_j dw_j w_j) / D
//! w_j = scale · u_j       (else)                   g[e_i] += scale · dw_i
//!
//! The renormalised line uses w_j / scale = u_j / D, so the saved weights serve the backward pass.
//!
//! Auxiliary-loss-free balancing, in two parts so that a sharded optimizer can take the step:
//! load excess (per layer and micro-batch, over all E):  excess[e] += counts[e] - mean(counts)
//!     (the mean summed in f64 in index order; the difference rounded once to f32)
//! bias step (elementwise, over any part):               bias[i] -= rate · sign(excess[i]),
//!     sign(0) = 0, then excess[i] = 0

use super::moe::{self, Tables};
use crate::backend::{MoeDispatch, Routing, Scoring};
use rayon::prelude::*;

/// The renormalisation's guard for sigmoid scores (Hugging Face's `+ 1e-20`).
const SIGMOID_EPS: f32 = 1e-20;

/// Scores, choice, weights, dispatch tables and statistics (`[counts | Σ s | dropped]`).
pub fn route(
    probs: &mut [f32],
    weight: &mut [f32],
    stats: &mut [f32],
    t: Tables,
    logits: &[f32],
    bias: Option<&[f32]>,
    d: MoeDispatch,
) {
    let (e, k, r) = (d.experts, d.top_k, d.routing);
    r.validate(e, k);
    probs
        .par_chunks_mut(e)
        .zip(logits.par_chunks(e))
        .zip(t.expert.par_chunks_mut(k))
        .zip(weight.par_chunks_mut(k))
        .for_each_init(
            || (vec![0f32; e], vec![false; e]),
            |(sel, allowed), (((p, z), chosen), w)| {
                score(p, z, r.scoring);
                choose(chosen, sel, allowed, p, bias, &r);
                for (w, &x) in w.iter_mut().zip(chosen.iter()) {
                    *w = p[x as usize];
                }
                if r.renormalize {
                    let mut total: f32 = w.iter().sum();
                    if r.scoring == Scoring::Sigmoid {
                        total += SIGMOID_EPS;
                    }
                    w.iter_mut().for_each(|w| *w /= total);
                }
                w.iter_mut().for_each(|w| *w *= r.scale);
            },
        );
    moe::dispatch(stats, t, probs, d);
}

/// `p = softmax(z)` or `sigmoid(z)`.
fn score(p: &mut [f32], z: &[f32], scoring: Scoring) {
    match scoring {
        Scoring::Softmax => {
            let max = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            p.iter_mut().zip(z).for_each(|(p, &z)| *p = (z - max).exp());
            let sum: f32 = p.iter().sum();
            p.iter_mut().for_each(|p| *p /= sum);
        }
        Scoring::Sigmoid => p.iter_mut().zip(z).for_each(|(p, &z)| *p = 1.0 / (1.0 + (-z).exp())),
    }
}

/// The index of the largest `v[x]` with `ok(x)`, the lower index on ties; None if none is.
fn argmax(v: &[f32], ok: impl Fn(usize) -> bool) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (x, &vx) in v.iter().enumerate() {
        if ok(x) && best.is_none_or(|b| vx > v[b]) {
            best = Some(x);
        }
    }
    best
}

/// The k experts of one token (`chosen`, in order of choice) by `sel = p + bias` among the
/// experts of its kept groups. `sel` and `allowed` are scratch of E entries.
fn choose(chosen: &mut [u32], sel: &mut [f32], allowed: &mut [bool], p: &[f32], bias: Option<&[f32]>, r: &Routing) {
    let e = p.len();
    match bias {
        Some(b) => sel.iter_mut().zip(p).zip(b).for_each(|((s, &p), &b)| *s = p + b),
        None => sel.copy_from_slice(p),
    }
    if r.groups > 1 {
        let size = e / r.groups;
        // A group's score: the sum of its two largest `sel` (top1 + top2).
        let group_scores: Vec<f32> = sel
            .chunks_exact(size)
            .map(|g| {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in g {
                    if v > a {
                        (a, b) = (v, a);
                    } else if v > b {
                        b = v;
                    }
                }
                a + b
            })
            .collect();
        allowed.fill(false);
        let mut kept = vec![false; r.groups];
        for _ in 0..r.top_groups {
            let g = argmax(&group_scores, |g| !kept[g]).expect("internal error: moe routing: no group left");
            kept[g] = true;
            allowed[g * size..(g + 1) * size].fill(true);
        }
    } else {
        allowed.fill(true);
    }
    for j in 0..chosen.len() {
        let taken = &chosen[..j];
        let best = argmax(sel, |x| allowed[x] && !taken.contains(&(x as u32)))
            .expect("internal error: moe routing: fewer allowed experts than top_k");
        chosen[j] = best as u32;
    }
}

/// Gradient of the router logits (overwritten), from the gradient of the routing weights and
/// `aux_scale · counts[e]` on every score of expert e (the load-balancing loss).
#[allow(clippy::too_many_arguments)]
pub fn route_backward(
    drouter: &mut [f32],
    dweight: &[f32],
    probs: &[f32],
    weight: &[f32],
    counts: &[f32],
    expert: &[u32],
    d: MoeDispatch,
    aux_scale: f32,
) {
    let (e, k, r) = (d.experts, d.top_k, d.routing);
    drouter
        .par_chunks_mut(e)
        .zip(probs.par_chunks(e))
        .zip(expert.par_chunks(k))
        .zip(dweight.par_chunks(k).zip(weight.par_chunks(k)))
        .for_each(|(((dr, p), chosen), (dw, w))| {
            // dr first holds dL/ds, then becomes dL/dlogits in place.
            dr.iter_mut().zip(counts).for_each(|(g, &c)| *g = aux_scale * c);
            if r.renormalize {
                let mut chosen_sum: f32 = chosen.iter().map(|&x| p[x as usize]).sum();
                if r.scoring == Scoring::Sigmoid {
                    chosen_sum += SIGMOID_EPS;
                }
                let c: f32 = dw.iter().zip(w).map(|(a, b)| a * b).sum();
                for (&x, &g) in chosen.iter().zip(dw) {
                    dr[x as usize] += (r.scale * g - c) / chosen_sum;
                }
            } else {
                for (&x, &g) in chosen.iter().zip(dw) {
                    dr[x as usize] += r.scale * g;
                }
            }
            match r.scoring {
                Scoring::Softmax => {
                    let dot: f32 = dr.iter().zip(p).map(|(g, p)| g * p).sum();
                    dr.iter_mut().zip(p).for_each(|(g, &p)| *g = p * (*g - dot));
                }
                Scoring::Sigmoid => dr.iter_mut().zip(p).for_each(|(g, &p)| *g *= p * (1.0 - p)),
            }
        });
}

/// `dst[e] += counts[e] - mean(counts)`, the mean summed in f64 in index order and the
/// difference rounded once to f32.
pub fn load_excess(dst: &mut [f32], counts: &[f32]) {
    assert_eq!(dst.len(), counts.len(), "moe_load_excess: dst and counts lengths");
    let mean = counts.iter().map(|&c| c as f64).sum::<f64>() / counts.len() as f64;
    for (d, &c) in dst.iter_mut().zip(counts) {
        *d += (c as f64 - mean) as f32;
    }
}

/// `bias[i] -= rate · sign(excess[i])`, sign(0) = 0, then `excess[i] = 0`.
pub fn bias_step(bias: &mut [f32], excess: &mut [f32], rate: f32) {
    assert_eq!(bias.len(), excess.len(), "moe_bias_step: bias and excess lengths");
    for (b, x) in bias.iter_mut().zip(excess.iter_mut()) {
        let sign = if *x > 0.0 {
            1.0
        } else if *x < 0.0 {
            -1.0
        } else {
            0.0
        };
        *b -= rate * sign;
        *x = 0.0;
    }
}
