//! A mixture of routed experts (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS): a router picks each token's
//! top-k experts ([`Backend::moe_route`]: softmax or sigmoid scores, a selection bias, expert
//! groups), the token's row goes to each (gather), every expert runs its SwiGLU on its rows
//! (grouped products), and the outputs come back weighted (combine). Shared experts
//! (DeepSeek-V3) are one more SwiGLU every token goes through, unweighted. On an expert axis
//! the routed experts' products run on the devices that hold them (`../experts.rs`); the
//! shared ones are replicated.
//!
//! ```text
//! forward:  logits = ln2 · Wrouterᵀ (+ b);  (experts, weights) = route(logits, bias)
//!           xe = gather(ln2);  ye_e = w2_e · glu(w13_e · xe_e (+ b13_e)) (+ b2_e)
//!           out = xmid + Σ_j weight_j · ye[slot j]  (+ Ws2 · swiglu(Ws13 · ln2))
//! backward: dye, dweight = combine'; the experts' products backward; dln2 = gather'(dxe)
//!           dlogits = route'(dweight, load-balancing loss); dln2 += dlogits · Wrouter
//! ```
//!
//! GPT-OSS's router and experts have biases and its GLU is a clamped SwiGLU
//! ([`Glu::ClampedSwiglu`]).
//!
//! The routing statistics of every layer add up in `Plan::stats`, summed over the devices that
//! share the batch, for the load-balancing loss ([`Model::router_stats`]).

use super::super::fp8::Expert;
use super::super::layout::MlpOffsets;
use super::super::plan::MlpActs;
use super::super::{Exchange, Model, Plan, RouterStats, Window};
use crate::backend::{Backend, ExpertWeights, Glu, MatMul, MoeDispatch, Routing, View};
use crate::config::Family;

impl Model {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        acts: &MlpActs,
        o: &MlpOffsets,
        out: Option<View>,
        ex: &mut dyn Exchange<B>,
    ) {
        let MlpActs::Moe { logits, probs, dispatch, xe, gu, h, ye, shared, .. } = acts else {
            unreachable!("internal error: dense activations for a mixture of experts")
        };
        let &MlpOffsets::Moe { router, bias, shared: shared_w, experts, stride } = o else {
            unreachable!("internal error: a dense layout for a mixture of experts")
        };
        let (a, (n, d, f)) = (&p.layers[i], (p.batch * p.seq, self.config.d_model, self.config.mlp_dim));
        be.matmul(*logits, a.ln2, w.at(router, dispatch.experts * d), MatMul::linear(n, d, dispatch.experts));
        self.add_bias(be, p, w, *logits, self.router_bias(router, dispatch.experts), dispatch.experts);
        be.moe_route(*probs, *logits, with_bias(*dispatch, w, bias));
        ex.batch_sum(be, dispatch.stats);
        if self.expert_ranks > 1 {
            self.experts_forward(be, p, i, w, (experts, stride), ex);
        } else {
            let (gate_up, down) = expert_weights(w, experts, stride, d, f);
            let biases = self.expert_biases(w, experts, stride);
            let mm = self.expert_matmuls(be, p, i, self.experts_block(w, i), false);
            be.moe_gather(*xe, a.ln2, *dispatch, d);
            // The rows the experts can keep (all the slots, dropless).
            let kept = dispatch.rows_bound();
            let x = mm.input(be, Expert::Up, *xe, kept * d);
            mm.matmul(be, Expert::Up, *gu, x, gate_up, *dispatch, MatMul::linear(0, d, 2 * f));
            if let Some((gate_up, _)) = biases {
                be.moe_expert_bias(*gu, gate_up, *dispatch, 2 * f);
            }
            be.glu_forward(*h, *gu, f, self.expert_glu());
            let hq = mm.input(be, Expert::Down, *h, kept * f);
            mm.matmul(be, Expert::Down, *ye, hq, down, *dispatch, MatMul::linear(0, f, d));
            // Under tensor parallelism `ye` holds partial sums: one device adds the bias.
            if let Some((_, down)) = biases.filter(|_| ex.adds_residual()) {
                be.moe_expert_bias(*ye, down, *dispatch, d);
            }
        }
        if let (Some((sgu, sh)), Some((gate_up, _))) = (shared, shared_w) {
            let s = sh.len / n;
            be.matmul(*sgu, a.ln2, w.at(gate_up, 2 * s * d), MatMul::linear(n, d, 2 * s));
            be.swiglu_forward(*sh, *sgu, s);
        }
        if let Some(out) = out {
            be.moe_combine(p.moe_out, *ye, *dispatch, d);
            if let (Some((_, sh)), Some((_, down))) = (shared, shared_w) {
                let s = sh.len / n;
                be.matmul(p.moe_out, *sh, w.at(down, d * s), MatMul::linear(n, s, d).accumulating());
            }
            ex.tensor_sum(be, p.moe_out);
            let (out, residual) = Self::branch_output(a.post.as_ref().map(|s| s.mlp_y), out, a.xmid);
            match residual {
                Some(residual) => {
                    be.copy(out, residual);
                    be.add(out, p.moe_out);
                }
                None => be.copy(out, p.moe_out),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        dout: View,
        acts: &MlpActs,
        o: &MlpOffsets,
        (counts, aux_scale): (View, f32),
        ex: &mut dyn Exchange<B>,
    ) {
        let MlpActs::Moe { probs, dispatch, xe, gu, h, ye, shared, .. } = acts else {
            unreachable!("internal error: dense activations for a mixture of experts")
        };
        let &MlpOffsets::Moe { router, bias, shared: shared_w, experts, stride } = o else {
            unreachable!("internal error: a dense layout for a mixture of experts")
        };
        let (a, (n, d, f)) = (&p.layers[i], (p.batch * p.seq, self.config.d_model, self.config.mlp_dim));
        let e = dispatch.experts;
        be.moe_combine_backward(p.dye, p.dweight, dout, *ye, *dispatch, d);
        ex.tensor_sum(be, p.dweight);
        if self.expert_ranks > 1 {
            self.experts_backward(be, p, i, (w, g), (experts, stride), ex);
        } else {
            let (gate_up, down) = expert_weights(w, experts, stride, d, f);
            let (dgate_up, ddown) = expert_weights(g, experts, stride, d, f);
            let dbiases = self.expert_biases(g, experts, stride);
            // The scratch serves the widest MLP of the model: this one's rows are its first.
            let (dgu, dh) = (p.dgu.at(0, gu.len), p.dh.at(0, h.len));
            if let Some((_, ddown)) = dbiases {
                be.moe_expert_bias_backward(ddown, p.dye, *dispatch, d);
            }
            let mm = self.expert_matmuls(be, p, i, self.experts_block(w, i), true);
            let kept = dispatch.rows_bound();
            let dye = mm.grad(be, Expert::Down, p.dye.at(0, ye.len), kept * d);
            mm.matmul(be, Expert::Down, dh, dye, down, *dispatch, MatMul::linear_dx(0, f, d));
            let hq = mm.input(be, Expert::Down, *h, kept * f);
            mm.matmul_dw(be, Expert::Down, ddown, dye, hq, *dispatch, (f, d));
            be.glu_backward(dgu, dh, *gu, f, self.expert_glu());
            if let Some((dgate_up, _)) = dbiases {
                be.moe_expert_bias_backward(dgate_up, dgu, *dispatch, 2 * f);
            }
            let (dguq, x) = (mm.grad(be, Expert::Up, dgu, kept * 2 * f), mm.input(be, Expert::Up, *xe, kept * d));
            mm.matmul(be, Expert::Up, p.dxe, dguq, gate_up, *dispatch, MatMul::linear_dx(0, d, 2 * f));
            mm.matmul_dw(be, Expert::Up, dgate_up, dguq, x, *dispatch, (d, 2 * f));
        }
        be.moe_gather_backward(p.dln, p.dxe, *dispatch, d);
        if let (Some((sgu, sh)), Some((gate_up, down))) = (shared, shared_w) {
            // The shared experts: a dense SwiGLU on every token, split like one over the
            // tensor group (its input gradient joins the routed experts' partial sum).
            let s = sh.len / n;
            let (dsgu, dsh) = (p.dgu.at(0, n * 2 * s), p.dh.at(0, n * s));
            be.matmul(dsh, dout, w.at(down, d * s), MatMul::linear_dx(n, s, d));
            be.matmul(g.at(down, d * s), dout, *sh, MatMul::linear_dw(n, s, d));
            be.swiglu_backward(dsgu, dsh, *sgu, s);
            be.matmul(p.dln, dsgu, w.at(gate_up, 2 * s * d), MatMul::linear_dx(n, d, 2 * s).accumulating());
            be.matmul(g.at(gate_up, 2 * s * d), dsgu, a.ln2, MatMul::linear_dw(n, d, 2 * s));
        }
        ex.tensor_sum(be, p.dln);
        be.moe_route_backward(p.drouter, p.dweight, *probs, with_bias(*dispatch, w, bias), counts, aux_scale);
        if let Some(at) = bias.filter(|_| self.config.moe.as_ref().is_some_and(|m| m.bias_update_rate > 0.0)) {
            // Auxiliary-loss-free balancing: the selection bias's gradient slot gathers the
            // layer's load excess over the step's micro-batches (and replicas), whose sign the
            // balancing step reads ([`crate::parallel::Parallel::balance_selection_biases`]).
            be.moe_load_excess(g.at(at, e), dispatch.stats.at(0, e));
        }
        self.bias_backward(be, p, g, p.drouter, self.router_bias(router, e), e);
        be.matmul(p.dln, p.drouter, w.at(router, e * d), MatMul::linear_dx(n, d, e).accumulating());
        be.matmul(g.at(router, e * d), p.drouter, a.ln2, MatMul::linear_dw(n, d, e));
    }

    /// Layer `i`'s experts' weights in window `w`: every expert this device holds, each block
    /// with all its projections (and biases).
    pub(in super::super) fn experts_block(&self, w: Window, i: usize) -> View {
        let r = self.layout.layers[i].experts().expect("internal error: the experts of a dense layer");
        w.at(r.start, r.len())
    }

    /// The router's bias `[E]` (GPT-OSS: right after its weight at `router`), if any.
    fn router_bias(&self, router: usize, experts: usize) -> Option<usize> {
        (self.config.family == Family::GptOss).then(|| router + experts * self.config.d_model)
    }

    /// The experts' gated linear unit: GPT-OSS's clamped SwiGLU, or SwiGLU.
    pub(in super::super) fn expert_glu(&self) -> Glu {
        let m = &self.config;
        match m.family {
            Family::GptOss => Glu::ClampedSwiglu { limit: m.glu_limit as f32, alpha: m.glu_alpha as f32 },
            _ => Glu::Swiglu,
        }
    }

    /// The experts' gate-and-up biases `[2F]` and down biases `[D]` in each expert's block of
    /// `w` (GPT-OSS's, after the three matrices), if they have them.
    pub(in super::super) fn expert_biases(
        &self,
        w: Window,
        experts: usize,
        stride: usize,
    ) -> Option<(ExpertWeights, ExpertWeights)> {
        let (d, f) = (self.config.d_model, self.config.mlp_dim);
        (self.config.family == Family::GptOss).then(|| {
            let at = experts + 3 * f * d;
            (ExpertWeights { first: w.at(at, 2 * f), stride }, ExpertWeights { first: w.at(at + 2 * f, d), stride })
        })
    }

    /// The load-balancing loss of the last forward pass (0 without experts), as Hugging Face
    /// computes it for Mixtral over all layers' router outputs together:
    /// `E · Σ_e (tokens routed to e / T) · (Σ router probability of e / T)`, `T = layers · N`
    /// over the layers with experts (transformers collects the routers' outputs only);
    /// and the share of the `T · k` (token, expert) assignments dropped by the experts'
    /// capacity (0 when dropless).
    pub fn router_stats<B: Backend>(&self, be: &mut B, p: &Plan) -> RouterStats {
        let Some(moe) = &self.config.moe else {
            return RouterStats::default();
        };
        let e = moe.num_experts;
        // The statistics summed over the layers of this stage and every stage before it: on
        // the last stage, the whole model's.
        let mut stats = vec![0f32; MoeDispatch::stats_len(e)];
        be.download(p.stats, &mut stats);
        let (counts, rest) = stats.split_at(e);
        let (prob_sums, dropped) = rest.split_at(e);
        let total = (moe.moe_layers(self.config.n_layers) * p.batch * p.seq * self.batch_shards) as f64;
        let aux_loss =
            e as f64 * counts.iter().zip(prob_sums).map(|(&c, &s)| c as f64 * s as f64).sum::<f64>() / (total * total);
        let mean = counts.iter().map(|&c| c as f64).sum::<f64>() / e as f64;
        let max_load = counts.iter().fold(0f64, |m, &c| m.max(c as f64)) / mean.max(f64::MIN_POSITIVE);
        // DeepSeek-V3's sigmoid routing has no load-balancing loss.
        let aux_loss = if moe.has_aux_loss() { aux_loss } else { 0.0 };
        RouterStats { aux_loss, dropped: dropped[0] as f64 / (total * moe.top_k as f64), max_load }
    }

    /// The load-balancing loss of the last forward pass ([`Model::router_stats`]).
    pub fn aux_loss<B: Backend>(&self, be: &mut B, p: &Plan) -> f64 {
        self.router_stats(be, p).aux_loss
    }

    /// Multiplier that turns the load-balancing loss's gradient into the [`Backend`]'s
    /// `aux_scale`: `coef · E / T²` times the objective's weight of this micro-batch.
    pub fn aux_scale(&self, p: &Plan, weight: f32) -> f32 {
        let Some(moe) = &self.config.moe else {
            return 0.0;
        };
        let total = (moe.moe_layers(self.config.n_layers) * p.batch * p.seq * self.batch_shards) as f64;
        (moe.aux_loss_coef * moe.num_experts as f64 / (total * total)) as f32 * weight
    }
}

/// The experts' `[w1; w3]` (gate and up) and `w2` (down) weights of a layer.
pub(in super::super) fn expert_weights(
    w: Window,
    experts: usize,
    stride: usize,
    d: usize,
    f: usize,
) -> (ExpertWeights, ExpertWeights) {
    (
        ExpertWeights { first: w.at(experts, 2 * f * d), stride },
        ExpertWeights { first: w.at(experts + 2 * f * d, d * f), stride },
    )
}

/// `dispatch` with the layer's selection bias (a parameter, read from the layer's weights `w`
/// at `bias`), if it has one.
fn with_bias(dispatch: MoeDispatch, w: Window, bias: Option<usize>) -> MoeDispatch {
    let routing = Routing { bias: bias.map(|at| w.at(at, dispatch.experts)), ..dispatch.routing };
    MoeDispatch { routing, ..dispatch }
}
