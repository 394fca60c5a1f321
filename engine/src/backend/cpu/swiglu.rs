//! SwiGLU activation over rows `[gate (f) | up (f)]`.
//!
//! forward:  h = silu(g) · u,  silu(g) = g · σ(g)
//! backward: dg = dh · u · σ(g) · (1 + g · (1 - σ(g))),  du = dh · silu(g)

use rayon::prelude::*;

const ROWS: usize = 4;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `h[n, :] = silu(gate[n, :]) ⊙ up[n, :]`.
pub fn forward(h: &mut [f32], gu: &[f32], f: usize) {
    assert_eq!(gu.len(), 2 * h.len());
    h.par_chunks_mut(ROWS * f).zip(gu.par_chunks(ROWS * 2 * f)).for_each(|(h, gu)| {
        for (h, gu) in h.chunks_exact_mut(f).zip(gu.chunks_exact(2 * f)) {
            let (g, u) = gu.split_at(f);
            for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
                *h = g * sigmoid(g) * u;
            }
        }
    });
}

/// Gradient with respect to the packed `[gate | up]` rows.
pub fn backward(dgu: &mut [f32], dh: &[f32], gu: &[f32], f: usize) {
    assert_eq!(dgu.len(), gu.len());
    dgu.par_chunks_mut(ROWS * 2 * f).zip(dh.par_chunks(ROWS * f)).zip(gu.par_chunks(ROWS * 2 * f)).for_each(
        |((dgu, dh), gu)| {
            for ((dgu, dh), gu) in dgu.chunks_exact_mut(2 * f).zip(dh.chunks_exact(f)).zip(gu.chunks_exact(2 * f)) {
                let (dg, du) = dgu.split_at_mut(f);
                let (g, u) = gu.split_at(f);
                for j in 0..f {
                    let s = sigmoid(g[j]);
                    dg[j] = dh[j] * u[j] * s * (1.0 + g[j] * (1.0 - s));
                    du[j] = dh[j] * g[j] * s;
                }
            }
        },
    );
}
