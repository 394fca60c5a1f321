//! A mixture-of-experts layer's experts on an expert axis (`mesh.ici_expert`, issue 35): the
//! experts are distributed whole over the `n` devices of an expert group, and each device runs
//! its `L = E / n` experts on the rows every member routes to them, as Megatron-Core's
//! all-to-all token dispatcher and MaxText's expert axis do. Routing and combining are the
//! single device's, on each device's own tokens; only the experts' products move.
//!
//! ```text
//! forward:   xe = gather(ln2)              rows grouped by expert, all E experts
//!            xr = exchange(pack(xe))       parts of P rows to the experts' devices: [sender][local expert, zeros]
//!            yr = w2_l · swiglu(w13_l · xr)   each run of rows by its expert l
//!            ye = unpack(exchange(yr))     back in place, ready for the combine
//! backward:  dyr = exchange(pack(dye))     the returned rows' gradients go out as the rows went
//!            dxr = ∂(w2_l · swiglu(w13_l · xr)) / ∂xr · dyr,  dW_l += …   (received rows only)
//!            dxe = unpack(exchange(dxr))   the dispatched rows' gradients come back
//! ```
//!
//! The received parts lie sender by sender, each sender's rows by local expert, then zeros
//! ([`crate::parallel::experts`]); a table of `L + 1` offsets per sender (into the whole received
//! buffer), written on the device from the exchanged counts ([`Exchange::expert_runs`]), lets
//! the grouped expert products of the single device ([`Backend::moe_expert_matmul`]) run on
//! each sender's rows unchanged. The elementwise ops and the FP8 casts cover the whole received
//! buffer, its padding included (as the single device's cover the rows past the kept ones under
//! a capacity factor): the host never learns how many rows came. Moving rows is a permutation,
//! whose adjoint is its inverse, so the backward pass takes the reverse paths.
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
use crate::backend::{Backend, IdxView, MatMul, MoeDispatch, Parts};

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
        let received = xr.len / d;
        let parts = parts(dispatch, ex.expert_rank().1, received);
        be.moe_gather(*xe, a.ln2, *dispatch, d);
        #[cfg(test)]
        if self.fault_misroute {
            misroute(be, dispatch, parts);
        }
        be.moe_pack(p.parts, *xe, dispatch.offsets, parts, d);
        ex.expert_exchange(be, p.parts, *xr);
        ex.expert_runs(be, dispatch.offsets, parts, *local_offsets);
        let (gate_up, down) = expert_weights(w, experts.0, experts.1, d, f);
        let biases = self.expert_biases(w, experts.0, experts.1);
        let senders = senders(*dispatch, *local_offsets, parts.members);
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
        ex.expert_exchange(be, p.yr.at(0, received * d), p.parts);
        be.moe_unpack(*ye, p.parts, dispatch.offsets, parts, d);
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
        let received = xr.len / d;
        let parts = parts(dispatch, ex.expert_rank().1, received);
        be.moe_pack(p.parts, p.dye, dispatch.offsets, parts, d);
        ex.expert_exchange(be, p.parts, p.yr.at(0, received * d));
        let (gate_up, down) = expert_weights(w, experts.0, experts.1, d, f);
        let (dgate_up, ddown) = expert_weights(g, experts.0, experts.1, d, f);
        let dbiases = self.expert_biases(g, experts.0, experts.1);
        let senders = senders(*dispatch, *local_offsets, parts.members);
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
        ex.expert_exchange(be, p.yr.at(0, received * d), p.parts);
        be.moe_unpack(p.dxe, p.parts, dispatch.offsets, parts, d);
    }
}

/// The exchange's parts for a dispatch over `members` devices receiving `received` rows at most
/// (the plan's bound, `members` parts of equal size).
fn parts(dispatch: &MoeDispatch, members: usize, received: usize) -> Parts {
    Parts { members, local: dispatch.experts / members, rows: received / members }
}

/// The test hook: the last row of member 0's last expert goes to member 1's first expert
/// instead (the boundary between their runs moves down a row).
#[cfg(test)]
fn misroute<B: Backend>(be: &mut B, dispatch: &MoeDispatch, parts: Parts) {
    let mut offsets = vec![0u32; dispatch.experts + 1];
    be.download_idx(dispatch.offsets, &mut offsets);
    let boundary = parts.local;
    if offsets[boundary] > offsets[boundary - 1] {
        offsets[boundary] -= 1;
    }
    be.upload_idx(dispatch.offsets, &offsets);
}

/// One dispatch per sender for the grouped expert products: its rows of each local expert,
/// addressed in the whole received buffer (`n · P` rows, which the products' views span).
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
