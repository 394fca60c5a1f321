//! Grouped-query attention: one packed projection to `H` query heads and `KV` key and value
//! heads of width `Dh` (query head h reads kv head `h / (H / KV)`), optionally QK-norm (Qwen3:
//! an RMSNorm over each q and k head, before RoPE), RoPE (not GPT, whose positions are learned),
//! the attention core, then `o_proj`; GPT and GPT-OSS add biases, GPT-OSS a learned sink per
//! head.
//!
//! ```text
//! forward:  qkv = ln1 · Wqkvᵀ (+ b)      raw projections, or under QK-norm normed per head
//!           qkv = rope(qkv)               q and k rotated by position
//!           attn = attention(qkv)         causal softmax(q kᵀ / sqrt(Dh)) v, within the layer's
//!                                         window; with sinks, the softmax's denominator also
//!                                         holds exp(sink_h) ([`Backend::attention_sinks_forward`])
//!           xmid = x + attn · Woᵀ (+ b)   row-parallel under tensor parallelism
//! backward: the same steps reversed; RoPE's adjoint is the rotation by -θ.
//! ```

use super::super::fp8::Linear;
use super::super::layout::{GqaOffsets, LayerBiases};
use super::super::{Exchange, Model, Plan, Window};
use crate::backend::{Backend, MatMul, View};

impl Model {
    /// The RoPE table of the stage's layer `i`: the local one of a sliding layer in a model
    /// with a local base (Gemma 3), else the model's.
    fn rope_table(&self, p: &Plan, i: usize) -> View {
        if self.config.local_rope(self.layer_index(i)) { p.rope_local } else { p.rope }
    }

    /// The offsets of the q/k/v and o biases, if any: GPT's (in the layer's [`LayerBiases`]),
    /// GPT-OSS's (in `o`).
    fn attention_biases(gpt: Option<&LayerBiases>, o: &GqaOffsets) -> (Option<usize>, Option<usize>) {
        match (gpt, o.bias) {
            (Some(b), _) => (Some(b.qkv), Some(b.o)),
            (None, Some((qkv, o))) => (Some(qkv), Some(o)),
            (None, None) => (None, None),
        }
    }

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
        let shape = self.attn_shape(i, p.batch, p.seq);
        let wqkv = w.weight(o.qkv, qkv * d);
        let (qkv_bias, o_bias) = Self::attention_biases(b, o);
        // Under QK-norm the projections land in `raw`, and the norm writes `a.qkv`.
        let raw = a.qk.map_or(a.qkv, |(raw, _)| raw);
        self.linear_forward(be, p, (i, Linear::Qkv), raw, (a.ln1, wqkv), None, MatMul::linear(n, d, qkv));
        self.add_bias(be, p, w, raw, qkv_bias, qkv);
        if let (Some((raw, rstd)), Some(at)) = (a.qk, o.qk_norm) {
            let weight = w.at(at, 2 * m.head_dim);
            be.qk_norm_forward(a.qkv, rstd, raw, weight, m.norm_offset(), shape, m.norm_eps as f32);
        }
        if !m.is_gpt() {
            be.rope(a.qkv, self.rope_table(p, i), shape, false);
        }
        self.attend(be, p, i, (a.attn, a.lse), a.qkv, shape, ex);
        if let Some(at) = o.sinks {
            be.attention_sinks_forward(a.attn, a.lse, w.at(at, m.n_heads), m.n_heads, m.head_dim);
        }
        let wo = w.weight(o.o, d * q);
        let (out, residual) = Self::branch_output(a.post.as_ref().map(|s| s.attn_y), a.xmid, a.x);
        self.row_parallel(be, p, ex, (i, Linear::O), out, (a.attn, wo), residual, MatMul::linear(n, q, d));
        // After the group's sum: every device adds the bias to the whole sum.
        self.add_bias(be, p, w, out, o_bias, d);
    }

    pub(super) fn gqa_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        dout: View,
        o: &GqaOffsets,
        ex: &mut dyn Exchange<B>,
    ) {
        let (m, a, b) = (&self.config, &p.layers[i], self.layout.layers[i].bias.as_ref());
        let (n, d) = (p.batch * p.seq, m.d_model);
        let (q, qkv) = (m.q_dim(), m.q_dim() + 2 * m.kv_dim());
        let shape = self.attn_shape(i, p.batch, p.seq);
        let (qkv_bias, o_bias) = Self::attention_biases(b, o);
        self.bias_backward(be, p, g, dout, o_bias, d);
        let shapes = (MatMul::linear_dx(n, q, d), MatMul::linear_dw(n, q, d));
        let (dw, wo) = (g.at(o.o, d * q), w.weight(o.o, d * q));
        self.linear_backward(be, p, (i, Linear::O), (p.dattn, dw), dout, (a.attn, wo), shapes);
        if let Some(at) = o.sinks {
            let (dsinks, sinks) = (g.at(at, m.n_heads), w.at(at, m.n_heads));
            be.attention_sinks_backward(dsinks, p.dattn, a.attn, a.lse, sinks, m.n_heads, m.head_dim);
        }
        self.attend_backward(be, p, p.dqkv, p.dattn, (a.qkv, a.attn, a.lse), shape, ex);
        if !m.is_gpt() {
            be.rope(p.dqkv, self.rope_table(p, i), shape, true);
        }
        if let (Some((raw, rstd)), Some(at)) = (a.qk, o.qk_norm) {
            // Each device of a tensor group holds some of the heads: its weight gradients
            // are partial sums, added up over the group before they accumulate.
            let dw = p.dqk_norm;
            be.fill(dw, 0.0);
            be.qk_norm_backward(p.dqkv, dw, raw, w.at(at, dw.len), m.norm_offset(), rstd, shape);
            ex.tensor_sum(be, dw);
            be.add(g.at(at, dw.len), dw);
        }
        self.bias_backward(be, p, g, p.dqkv, qkv_bias, qkv);
        let shapes = (MatMul::linear_dx(n, d, qkv), MatMul::linear_dw(n, d, qkv));
        let (dw, wqkv) = (g.at(o.qkv, qkv * d), w.weight(o.qkv, qkv * d));
        self.linear_backward(be, p, (i, Linear::Qkv), (p.dln, dw), p.dqkv, (a.ln1, wqkv), shapes);
        ex.tensor_sum(be, p.dln);
    }
}
