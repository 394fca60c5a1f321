//! A mixture-of-experts layer's experts on an expert axis (`mesh.ici_expert`, issue 35): the
//! experts are distributed whole over the `n` devices of an expert group, and each device runs
//! its `L = E / n` experts on the rows every member routes to them, as Megatron-Core's
//! all-to-all token dispatcher and MaxText's expert axis do. Routing and combining are the
//! single device's, on each device's own tokens; only the experts' products move.
//!
//! ```text
//! forward:   xe = gather(ln2)              rows grouped by expert, all E experts
//!            xr = dispatch(xe)             to the experts' devices: [sender][local expert]
//!            yr = w2_l · swiglu(w13_l · xr)   each run of rows by its expert l
//!            ye = return(yr)               back in place, ready for the combine
//! backward:  dyr = dispatch_again(dye)     the returned rows' gradients go out as the rows went
//!            dxr = ∂(w2_l · swiglu(w13_l · xr)) / ∂xr · dyr,  dW_l += …   (received rows only)
//!            dxe = return(dxr)             the dispatched rows' gradients come back
//! ```
//!
//! The received rows lie sender by sender, each sender's by local expert; a table of `L + 1`
//! offsets per sender (into the whole received buffer) lets the grouped expert products of the
//! single device ([`Backend::moe_expert_matmul`]) run on each sender's rows unchanged: no op of
//! its own. Moving rows is a permutation, whose adjoint is its inverse, so the backward pass
//! takes the reverse paths ([`Exchange::expert_dispatch_again`], [`Exchange::expert_return`]).
//!
//! A device's layout holds its own experts only ([`crate::model::Layout::experts`]): their
//! weights, gradients and moments are divided by the axis, the rest of the layer is not. Their
//! gradients are summed over the devices that hold the same experts (`parallel::strategies`).
//! The load-balancing loss sums the routing statistics over the batch group
//! ([`Exchange::batch_sum`]), so it does not depend on the layout.

use super::fp8::Expert;
use super::mlp::expert_weights;
use super::plan::MlpActs;
use super::{Exchange, Model, Plan, Window};
use crate::backend::{Backend, IdxView, MatMul, MoeDispatch};

impl Model {
    /// Layer `i`'s experts on the expert axis, forward: from `ln2` to `ye` (the experts'
    /// outputs in dispatch order, as the combine reads them). `experts` is the layer's
    /// `(offset, stride)` of this device's first expert's block in the layout.
    pub(super) fn experts_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        experts: (usize, usize),
        ex: &mut dyn Exchange<B>,
    ) {
        let (a, (d, f)) = (&p.layers[i], (self.config.d_model, self.config.mlp_dim));
        let MlpActs::Moe { dispatch, xe, gu, h, ye, xr, local_offsets, .. } = &a.mlp else {
            unreachable!("internal error: expert activations planned for a dense layer")
        };
        let member = ex.expert_rank();
        be.moe_gather(*xe, a.ln2, *dispatch, d);
        let counts = self.routed_counts(be, dispatch, member.1);
        let from = ex.expert_dispatch(be, dispatch.offsets, *xe, &counts, d, *xr);
        let received = upload_local_offsets(be, *local_offsets, &from);
        let (gate_up, down) = expert_weights(w, experts.0, experts.1, d, f);
        let biases = self.expert_biases(w, experts.0, experts.1);
        let senders = senders(*dispatch, *local_offsets, member.1);
        let mm = self.expert_matmuls(be, p, i, self.experts_block(w, i), false);
        let x = mm.input(be, Expert::Up, *xr, received * d);
        for s in &senders {
            mm.matmul(be, Expert::Up, *gu, x, gate_up, *s, MatMul::linear(0, d, 2 * f));
            if let Some((gate_up, _)) = biases {
                be.moe_expert_bias(*gu, gate_up, *s, 2 * f);
            }
        }
        be.glu_forward(h.at(0, received * f), gu.at(0, received * 2 * f), f, self.expert_glu());
        let hq = mm.input(be, Expert::Down, *h, received * f);
        for s in &senders {
            mm.matmul(be, Expert::Down, p.yr, hq, down, *s, MatMul::linear(0, f, d));
            // Under tensor parallelism the rows hold partial sums: one device adds the bias.
            if let Some((_, down)) = biases.filter(|_| ex.adds_residual()) {
                be.moe_expert_bias(p.yr, down, *s, d);
            }
        }
        ex.expert_return(be, dispatch.offsets, p.yr.at(0, received * d), d, *ye);
    }

    /// Layer `i`'s experts on the expert axis, backward: from `p.dye` (the gradient of `ye`) to
    /// `p.dxe` (that of `xe`), the local experts' weight gradients added into `g`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn experts_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        experts: (usize, usize),
        ex: &mut dyn Exchange<B>,
    ) {
        let (a, (d, f)) = (&p.layers[i], (self.config.d_model, self.config.mlp_dim));
        let MlpActs::Moe { dispatch, gu, h, xr, local_offsets, .. } = &a.mlp else {
            unreachable!("internal error: expert activations planned for a dense layer")
        };
        let member = ex.expert_rank();
        let received = ex.expert_dispatch_again(be, dispatch.offsets, p.dye, d, p.yr);
        let (gate_up, down) = expert_weights(w, experts.0, experts.1, d, f);
        let (dgate_up, ddown) = expert_weights(g, experts.0, experts.1, d, f);
        let dbiases = self.expert_biases(g, experts.0, experts.1);
        let senders = senders(*dispatch, *local_offsets, member.1);
        let mm = self.expert_matmuls(be, p, i, self.experts_block(w, i), true);
        let (dyr, hq) = (mm.grad(be, Expert::Down, p.yr, received * d), mm.input(be, Expert::Down, *h, received * f));
        for s in &senders {
            if let Some((_, ddown)) = dbiases {
                be.moe_expert_bias_backward(ddown, p.yr, *s, d);
            }
            mm.matmul(be, Expert::Down, p.dh.at(0, h.len), dyr, down, *s, MatMul::linear_dx(0, f, d));
            mm.matmul_dw(be, Expert::Down, ddown, dyr, hq, *s, (f, d));
        }
        let (dgu, dh) = (p.dgu.at(0, received * 2 * f), p.dh.at(0, received * f));
        be.glu_backward(dgu, dh, gu.at(0, received * 2 * f), f, self.expert_glu());
        let dgu = p.dgu.at(0, gu.len);
        let (dguq, x) = (mm.grad(be, Expert::Up, dgu, received * 2 * f), mm.input(be, Expert::Up, *xr, received * d));
        // `yr` is free again: it takes the received rows' input gradients.
        for s in &senders {
            if let Some((dgate_up, _)) = dbiases {
                be.moe_expert_bias_backward(dgate_up, dgu, *s, 2 * f);
            }
            mm.matmul(be, Expert::Up, p.yr, dguq, gate_up, *s, MatMul::linear_dx(0, d, 2 * f));
            mm.matmul_dw(be, Expert::Up, dgate_up, dguq, x, *s, (d, 2 * f));
        }
        ex.expert_return(be, dispatch.offsets, p.yr.at(0, received * d), d, p.dxe);
    }

    /// Rows the routing sent each expert of the model (from its dispatch offsets: a host
    /// round trip, which the all-to-all's counts need anyway), on an expert group of `members`.
    fn routed_counts<B: Backend>(&self, be: &mut B, dispatch: &MoeDispatch, members: usize) -> Vec<usize> {
        let mut offsets = vec![0u32; dispatch.experts + 1];
        be.download_idx(dispatch.offsets, &mut offsets);
        #[allow(unused_mut)]
        let mut counts: Vec<usize> = offsets.windows(2).map(|o| (o[1] - o[0]) as usize).collect();
        #[cfg(test)]
        if self.fault_misroute {
            // The last row of member 0's last expert goes to member 1's first expert instead.
            let last = dispatch.experts / members - 1;
            if counts[last] > 0 {
                counts[last] -= 1;
                counts[last + 1] += 1;
            }
        }
        let _ = members;
        counts
    }
}

/// Writes each sender's `L + 1` offsets of its rows of each local expert among the received
/// rows (`from[s][l]` rows each, sender by sender) into `tables`; returns the rows received.
fn upload_local_offsets<B: Backend>(be: &mut B, tables: IdxView, from: &[Vec<usize>]) -> usize {
    let mut offsets = Vec::with_capacity(tables.len);
    let mut at = 0;
    for rows in from {
        offsets.push(at as u32);
        for &r in rows {
            at += r;
            offsets.push(at as u32);
        }
    }
    be.upload_idx(tables, &offsets);
    at
}

/// One dispatch per sender for the grouped expert products: its rows of each local expert,
/// addressed in the whole received buffer (`n · N · k` rows, which the products' views span).
fn senders(dispatch: MoeDispatch, tables: IdxView, n: usize) -> Vec<MoeDispatch> {
    let local = dispatch.experts / n;
    (0..n)
        .map(|s| MoeDispatch {
            tokens: n * dispatch.tokens,
            experts: local,
            offsets: tables.at(s * (local + 1), local + 1),
            ..dispatch
        })
        .collect()
}
