//! Gated linear units over rows `[gate (f) | up (f)]` ([`Glu`]): SwiGLU is `swiglu.rs`; here
//! GPT-OSS's clamped SwiGLU and Gemma's GELU-tanh unit. `x_g`, `x_u` are a row's inputs, `[·]`
//! the indicator through which a clamp passes its gradient (torch's `clamp`: where
//! `min ≤ x ≤ max`, equality included).
//!
//! clamped SwiGLU (limit L, slope α), in f32:
//!   forward:  g = min(x_g, L)                  backward: dx_g = dh · (u + 1) · s · (1 + α·g·(1 − s)) · [x_g ≤ L]
//!             u = clamp(x_u, −L, L)                      dx_u = dh · g · s · [−L ≤ x_u ≤ L]
//!             s = σ(α·g),  h = (u + 1) · g · s
//! GELU-tanh, computed in f64 and stored in f32 (as `gelu.rs`):
//!   forward:  h = gelu(x_g) · x_u              backward: dx_g = dh · x_u · gelu'(x_g)
//!             gelu(x) = ½x(1 + t)                        dx_u = dh · gelu(x_g)
//!             t = tanh(c(x + a·x³))                      gelu'(x) = ½(1 + t) + ½x(1 − t²) · c(1 + 3a·x²)

use super::{gelu, swiglu};
use crate::backend::Glu;
use rayon::prelude::*;

const ROWS: usize = 4;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `h` of one element.
fn value(kind: Glu, xg: f32, xu: f32) -> f32 {
    match kind {
        Glu::ClampedSwiglu { limit, alpha } => {
            let (g, u) = (xg.min(limit), xu.clamp(-limit, limit));
            (u + 1.0) * g * sigmoid(alpha * g)
        }
        Glu::GeluTanh => (gelu::value(xg as f64, true) * xu as f64) as f32,
        Glu::Swiglu => unreachable!("internal error: SwiGLU is swiglu.rs's"),
    }
}

/// `(dx_g, dx_u)` of one element, from its output's gradient `dh`.
fn gradient(kind: Glu, xg: f32, xu: f32, dh: f32) -> (f32, f32) {
    match kind {
        Glu::ClampedSwiglu { limit, alpha } => {
            let (g, u) = (xg.min(limit), xu.clamp(-limit, limit));
            let s = sigmoid(alpha * g);
            let dg = if xg <= limit { dh * (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s)) } else { 0.0 };
            let du = if (-limit..=limit).contains(&xu) { dh * g * s } else { 0.0 };
            (dg, du)
        }
        Glu::GeluTanh => {
            let (xg, xu, dh) = (xg as f64, xu as f64, dh as f64);
            ((dh * xu * gelu::derivative(xg, true)) as f32, (dh * gelu::value(xg, true)) as f32)
        }
        Glu::Swiglu => unreachable!("internal error: SwiGLU is swiglu.rs's"),
    }
}

/// `h[n, :] = act(gate[n, :]) ⊙ up[n, :]` of the unit `kind`.
pub fn forward(h: &mut [f32], gu: &[f32], f: usize, kind: Glu) {
    if kind == Glu::Swiglu {
        return swiglu::forward(h, gu, f);
    }
    assert_eq!(gu.len(), 2 * h.len());
    h.par_chunks_mut(ROWS * f).zip(gu.par_chunks(ROWS * 2 * f)).for_each(|(h, gu)| {
        for (h, gu) in h.chunks_exact_mut(f).zip(gu.chunks_exact(2 * f)) {
            let (g, u) = gu.split_at(f);
            for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
                *h = value(kind, g, u);
            }
        }
    });
}

/// Gradient with respect to the packed `[gate | up]` rows (`=`).
pub fn backward(dgu: &mut [f32], dh: &[f32], gu: &[f32], f: usize, kind: Glu) {
    if kind == Glu::Swiglu {
        return swiglu::backward(dgu, dh, gu, f);
    }
    assert_eq!(dgu.len(), gu.len());
    assert_eq!(gu.len(), 2 * dh.len());
    dgu.par_chunks_mut(ROWS * 2 * f).zip(dh.par_chunks(ROWS * f)).zip(gu.par_chunks(ROWS * 2 * f)).for_each(
        |((dgu, dh), gu)| {
            for ((dgu, dh), gu) in dgu.chunks_exact_mut(2 * f).zip(dh.chunks_exact(f)).zip(gu.chunks_exact(2 * f)) {
                let (dg, du) = dgu.split_at_mut(f);
                let (g, u) = gu.split_at(f);
                for j in 0..f {
                    (dg[j], du[j]) = gradient(kind, g[j], u[j], dh[j]);
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clamps pass the gradient at their bounds (torch's `clamp`) and stop it beyond them;
    /// values as GPT-OSS's `(up + 1) · g · σ(α·g)`.
    #[test]
    fn clamped_swiglu_at_and_beyond_the_limits() {
        let (limit, alpha) = (2.0f32, 1.702f32);
        let kind = Glu::ClampedSwiglu { limit, alpha };
        let beyond = f32::from_bits(limit.to_bits() + 1);
        // Rows [gate | up] of 4: gates at, beyond, below and far below the limit, ups at +L,
        // beyond +L, at −L and beyond −L.
        let gu = [limit, beyond, 0.5, -3.0, limit, beyond, -limit, -beyond];
        let (mut h, mut dgu) = ([0f32; 4], [0f32; 8]);
        forward(&mut h, &gu, 4, kind);
        backward(&mut dgu, &[1.0; 4], &gu, 4, kind);
        let s = |g: f32| sigmoid(alpha * g);
        let expect_h = [
            (limit + 1.0) * limit * s(limit),
            (limit + 1.0) * limit * s(limit),
            (1.0 - limit) * 0.5 * s(0.5),
            (1.0 - limit) * -3.0 * s(-3.0),
        ];
        assert_eq!(h, expect_h);
        let dg = |g: f32, u: f32| (u + 1.0) * s(g) * (1.0 + alpha * g * (1.0 - s(g)));
        assert_eq!(dgu[..4], [dg(limit, limit), 0.0, dg(0.5, -limit), dg(-3.0, -limit)], "gate gradients");
        assert_eq!(dgu[4..], [limit * s(limit), 0.0, 0.5 * s(0.5), 0.0], "up gradients");
        assert!(dgu[0] != 0.0 && dgu[4] != 0.0 && dgu[6] != 0.0, "at the bound the gradient passes");
    }

    /// GELU-tanh's unit is `gelu_tanh(gate) · up`: with `up = 1` its value and gate gradient are
    /// `gelu_forward`'s and `gelu_backward`'s.
    #[test]
    fn gelu_tanh_unit_with_unit_up_is_gelu() {
        let gates = [-3.0f32, -0.7, 0.0, 0.4, 2.5];
        let mut gu = gates.to_vec();
        gu.extend([1.0; 5]);
        let (mut h, mut dgu, mut plain, mut dplain) = ([0f32; 5], [0f32; 10], [0f32; 5], [0f32; 5]);
        forward(&mut h, &gu, 5, Glu::GeluTanh);
        backward(&mut dgu, &[1.0; 5], &gu, 5, Glu::GeluTanh);
        gelu::forward(&mut plain, &gates, true);
        gelu::backward(&mut dplain, &[1.0; 5], &gates, true);
        assert_eq!(h, plain);
        assert_eq!(dgu[..5], dplain);
        assert_eq!(dgu[5..], plain, "the up gradient is gelu(gate)");
    }
}
