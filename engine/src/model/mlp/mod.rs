//! A layer's MLP, from `ln2` (the normed residual stream after attention) to the layer's
//! output. Its kind is chosen once, when the model is laid out
//! ([`MlpOffsets`](super::layout::MlpOffsets)), and each kind is a file:
//!
//! - `dense.rs`: SwiGLU (Llama and its kin), GPT's GELU MLP;
//! - `moe.rs`: a mixture of routed experts (Mixtral, Qwen3-MoE), the routing statistics and
//!   the load-balancing loss; `../experts.rs` runs its experts on an expert axis.

mod dense;
mod moe;

use super::layout::MlpOffsets;
use super::plan::MlpActs;
use super::{Exchange, Model, Plan, Window};
use crate::backend::{Backend, View};
pub(super) use moe::expert_weights;

impl Model {
    /// Layer `i`'s MLP, forward: with `out`, the layer's output `out = xmid + mlp(ln2)` (under
    /// sandwich norms, `mlp(ln2)` alone, into its own buffer, which the layer norms and adds);
    /// without, only the activations the backward pass reads (recomputation).
    pub(super) fn mlp_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        out: Option<View>,
        ex: &mut dyn Exchange<B>,
    ) {
        match (&p.layers[i].mlp, &self.layout.layers[i].mlp) {
            (MlpActs::Dense { gu, h }, MlpOffsets::Dense { gate_up, down }) => {
                self.dense_forward(be, p, i, w, (*gu, *h), (*gate_up, *down), out, ex)
            }
            (acts @ MlpActs::Moe { .. }, o @ MlpOffsets::Moe { .. }) => self.moe_forward(be, p, i, w, acts, o, out, ex),
            _ => unreachable!("internal error: activations planned for another MLP kind"),
        }
    }

    /// Layer `i`'s MLP, backward: from `dout` (the gradient of its output: of the layer's, or
    /// under sandwich norms of the output before its norm) to `p.dln` (that of `ln2`, summed
    /// over the tensor group), the weight gradients added into `g`. `counts` holds the whole
    /// model's routing counts (the load-balancing loss's).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        dout: View,
        (counts, aux_scale): (View, f32),
        ex: &mut dyn Exchange<B>,
    ) {
        match (&p.layers[i].mlp, &self.layout.layers[i].mlp) {
            (MlpActs::Dense { gu, h }, MlpOffsets::Dense { gate_up, down }) => {
                self.dense_backward(be, p, i, (w, g), dout, (*gu, *h), (*gate_up, *down), ex)
            }
            (acts @ MlpActs::Moe { .. }, o @ MlpOffsets::Moe { .. }) => {
                self.moe_backward(be, p, i, (w, g), dout, acts, o, (counts, aux_scale), ex)
            }
            _ => unreachable!("internal error: activations planned for another MLP kind"),
        }
    }
}
