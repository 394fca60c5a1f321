//! Grouped-query attention: one packed projection to `H` query heads and `KV` key and value
//! heads of width `Dh` (query head h reads kv head `h / (H / KV)`), optionally QK-norm (Qwen3:
//! an RMSNorm over each q and k head, before RoPE), RoPE (not GPT, whose positions are learned),
//! the attention core, then `o_proj`; GPT adds biases.
//!
//! ```text
//! forward:  qkv = ln1 · Wqkvᵀ (+ b)      raw projections, or under QK-norm normed per head
//!           qkv = rope(qkv)               q and k rotated by position
//!           attn = attention(qkv)         causal softmax(q kᵀ / sqrt(Dh)) v
//!           xmid = x + attn · Woᵀ (+ b)   row-parallel under tensor parallelism
//! backward: the same steps reversed; RoPE's adjoint is the rotation by -θ.
//! ```

use super::super::fp8::Linear;
use super::super::layout::GqaOffsets;
use super::super::{Exchange, Model, Plan, Window};
use crate::backend::{Backend, MatMul};

impl Model {
    pub(super) fn gqa_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        o: &GqaOffsets,
        ex: &mut dyn Exchange<B>,
    ) {
        let (m, a, b) = (&self.config, &p.layers[i], self.layout.layers[i].bias.as_ref());
        let (n, d) = (p.batch * p.seq, m.d_model);
        let (q, qkv) = (m.q_dim(), m.q_dim() + 2 * m.kv_dim());
        let shape = self.attn_shape(p.batch, p.seq);
        let wqkv = w.at(o.qkv, qkv * d);
        // Under QK-norm the projections land in `raw`, and the norm writes `a.qkv`.
        let raw = a.qk.map_or(a.qkv, |(raw, _)| raw);
        self.linear_forward(be, p, (i, Linear::Qkv), raw, (a.ln1, wqkv), None, MatMul::linear(n, d, qkv));
        self.add_bias(be, p, w, raw, b.map(|b| b.qkv), qkv);
        if let (Some((raw, rstd)), Some(at)) = (a.qk, o.qk_norm) {
            be.qk_norm_forward(a.qkv, rstd, raw, w.at(at, 2 * m.head_dim), shape, m.norm_eps as f32);
        }
        if !m.is_gpt() {
            be.rope(a.qkv, p.rope, shape, false);
        }
        self.attend(be, p, (a.attn, a.lse), a.qkv, shape, ex);
        let wo = w.at(o.o, d * q);
        self.row_parallel(be, p, ex, (i, Linear::O), a.xmid, (a.attn, wo), a.x, MatMul::linear(n, q, d));
        self.add_bias(be, p, w, a.xmid, b.map(|b| b.o), d);
    }

    pub(super) fn gqa_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        o: &GqaOffsets,
        ex: &mut dyn Exchange<B>,
    ) {
        let (m, a, b) = (&self.config, &p.layers[i], self.layout.layers[i].bias.as_ref());
        let (n, d) = (p.batch * p.seq, m.d_model);
        let (q, qkv) = (m.q_dim(), m.q_dim() + 2 * m.kv_dim());
        let shape = self.attn_shape(p.batch, p.seq);
        self.bias_backward(be, p, g, p.dres, b.map(|b| b.o), d);
        let shapes = (MatMul::linear_dx(n, q, d), MatMul::linear_dw(n, q, d));
        let (dw, wo) = (g.at(o.o, d * q), w.at(o.o, d * q));
        self.linear_backward(be, p, (i, Linear::O), (p.dattn, dw), p.dres, (a.attn, wo), shapes);
        self.attend_backward(be, p, p.dqkv, p.dattn, (a.qkv, a.attn, a.lse), shape, ex);
        if !m.is_gpt() {
            be.rope(p.dqkv, p.rope, shape, true);
        }
        if let (Some((raw, rstd)), Some(at)) = (a.qk, o.qk_norm) {
            // Each device of a tensor group holds some of the heads: its weight gradients
            // are partial sums, added up over the group before they accumulate.
            let dw = p.dqk_norm;
            be.fill(dw, 0.0);
            be.qk_norm_backward(p.dqkv, dw, raw, w.at(at, dw.len), rstd, shape);
            ex.tensor_sum(be, dw);
            be.add(g.at(at, dw.len), dw);
        }
        self.bias_backward(be, p, g, p.dqkv, b.map(|b| b.qkv), qkv);
        let shapes = (MatMul::linear_dx(n, d, qkv), MatMul::linear_dw(n, d, qkv));
        let (dw, wqkv) = (g.at(o.qkv, qkv * d), w.at(o.qkv, qkv * d));
        self.linear_backward(be, p, (i, Linear::Qkv), (p.dln, dw), p.dqkv, (a.ln1, wqkv), shapes);
        ex.tensor_sum(be, p.dln);
    }
}
