//! The layers' normalisations, chosen by the family once: RMSNorm (every family but GPT), or
//! LayerNorm with weight and bias (GPT, whose bias follows its weight in the layout). Gemma 3
//! stores its RMSNorm weights as offsets from one: the norm multiplies by `1 + w`
//! ([`ModelConfig::norm_offset`](crate::config::ModelConfig::norm_offset)).
//!
//! ```text
//! RMSNorm:   y = w ⊙ x · rstd,              rstd = 1 / sqrt(mean(x²) + eps)
//! LayerNorm: y = w ⊙ (x − mean) · rstd + b,  rstd = 1 / sqrt(var(x) + eps)
//! ```
//! Their backward passes are the backend's ([`Backend::rmsnorm_backward`],
//! [`Backend::layernorm_backward`]).

use super::fp8::Linear;
use super::{Model, Plan, Window};
use crate::backend::{Backend, View};

impl Model {
    /// `out = norm(x)` with the norm whose weight is at `at` in `w` (and, for LayerNorm, its bias
    /// right after); `stats` is RMSNorm's `[N]` rstd or LayerNorm's `[2N]` mean then rstd.
    pub(super) fn norm_forward<B: Backend>(&self, be: &mut B, out: View, stats: View, x: View, w: Window, at: usize) {
        let (d, eps) = (self.config.d_model, self.config.norm_eps as f32);
        if self.config.is_gpt() {
            let n = stats.len / 2;
            be.layernorm_forward(out, stats.at(0, n), stats.at(n, n), x, w.at(at, d), w.at(at + d, d), d, eps);
        } else {
            be.rmsnorm_forward(out, stats, x, w.at(at, d), self.config.norm_offset(), d, eps);
        }
    }

    /// [`Model::norm_forward`] of layer `i`'s norm before `linear` (its input): cast for the
    /// FP8 product in the norm's own pass where [`Model::fp8_produced`] says (`out` is then
    /// scratch), else as `norm_forward` writes it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_before<B: Backend>(
        &self,
        be: &mut B,
        (p, i, linear): (&Plan, usize, Linear),
        out: View,
        stats: View,
        x: View,
        w: Window,
        at: usize,
    ) {
        match self.fp8_produced(p, i, linear) {
            Some(cast) => {
                let (d, eps) = (self.config.d_model, self.config.norm_eps as f32);
                be.rmsnorm_fp8(cast, out, stats, (x, w.at(at, d)), self.config.norm_offset(), d, eps);
            }
            None => self.norm_forward(be, out, stats, x, w, at),
        }
    }

    /// The backward pass of [`Model::norm_forward`]: the input gradient added to `dx`, the weight
    /// (and bias) gradients to `g` at `at`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_backward<B: Backend>(
        &self,
        be: &mut B,
        dx: View,
        g: Window,
        dout: View,
        x: View,
        w: Window,
        at: usize,
        stats: View,
    ) {
        let d = self.config.d_model;
        if self.config.is_gpt() {
            let n = stats.len / 2;
            let (mean, rstd) = (stats.at(0, n), stats.at(n, n));
            be.layernorm_backward(dx, g.at(at, d), g.at(at + d, d), dout, x, w.at(at, d), mean, rstd, d);
        } else {
            be.rmsnorm_backward(dx, g.at(at, d), dout, x, w.at(at, d), self.config.norm_offset(), stats, d);
        }
    }
}
