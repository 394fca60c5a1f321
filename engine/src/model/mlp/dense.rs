//! The dense MLP: SwiGLU, `down(silu(gate(x)) ⊙ up(x))` with gate and up packed in one
//! product (Gemma 3's GeGLU: `gelu_tanh` for `silu`); GPT's `c_proj(gelu(c_fc(x)))` with biases. Under tensor parallelism the hidden
//! columns are split: `gate_up` is column-parallel, `down` row-parallel (summed over the group).
//!
//! ```text
//! forward:  gu = ln2 · Wupᵀ (+ b)        [N, 2F] (GPT: [N, F])
//!           h  = act(gu)                  SwiGLU or GELU
//!           out = xmid + h · Wdownᵀ (+ b)
//! backward: dh = dout · Wdown, dWdown += doutᵀ · h; dgu = act'(gu) · dh;
//!           dln2 = dgu · Wup, dWup += dguᵀ · ln2
//! ```

use super::super::fp8::Linear;
use super::super::{Exchange, Model, Plan, Window};
use crate::backend::{Backend, Glu, MatMul, View};
use crate::config::{Family, Gelu};

impl Model {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dense_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        (gu, h): (View, View),
        (gate_up, down): (usize, usize),
        out: Option<View>,
        ex: &mut dyn Exchange<B>,
    ) {
        let (a, b) = (&p.layers[i], self.layout.layers[i].bias.as_ref());
        let (n, d) = (p.batch * p.seq, self.config.d_model);
        let (up, f) = (gu.len / n, h.len / n);
        let (wup, wdown) = (w.weight(gate_up, up * d), w.weight(down, d * f));
        self.linear_forward(be, p, (i, Linear::Up), gu, (a.ln2, wup), None, MatMul::linear(n, d, up));
        self.add_bias(be, p, w, gu, b.map(|b| b.up), f);
        match self.fp8_produced(p, i, Linear::Down) {
            // Down's input cast in SwiGLU's pass: `h` is scratch.
            Some(cast) => be.swiglu_fp8(cast, h, gu, f),
            None => self.activation_forward(be, h, gu, f),
        }
        if let Some(out) = out {
            let shape = MatMul::linear(n, f, d);
            let (out, residual) = Self::branch_output(a.post.as_ref().map(|s| s.mlp_y), out, a.xmid);
            self.row_parallel(be, p, ex, (i, Linear::Down), out, (h, wdown), residual, shape);
            self.add_bias(be, p, w, out, b.map(|b| b.down), d);
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn dense_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        dout: View,
        (gu, h): (View, View),
        (gate_up, down): (usize, usize),
        ex: &mut dyn Exchange<B>,
    ) {
        let (m, a, b) = (&self.config, &p.layers[i], self.layout.layers[i].bias.as_ref());
        let (n, d) = (p.batch * p.seq, m.d_model);
        let (up, f) = (gu.len / n, h.len / n);
        let (dgu, dh) = (p.dgu.at(0, n * up), p.dh.at(0, n * f));
        self.bias_backward(be, p, g, dout, b.map(|b| b.down), d);
        let (ddown, wdown) = (g.at(down, d * f), w.weight(down, d * f));
        let shapes = (MatMul::linear_dx(n, f, d), MatMul::linear_dw(n, f, d));
        self.linear_backward(be, p, (i, Linear::Down), (dh, ddown), dout, (h, wdown), shapes);
        if m.is_gpt() {
            be.gelu_backward(dgu, dh, gu, m.gelu == Gelu::Tanh);
        } else {
            be.glu_backward(dgu, dh, gu, f, self.dense_glu());
        }
        self.bias_backward(be, p, g, dgu, b.map(|b| b.up), f);
        let (dup, wup) = (g.at(gate_up, up * d), w.weight(gate_up, up * d));
        let shapes = (MatMul::linear_dx(n, d, up), MatMul::linear_dw(n, d, up));
        self.linear_backward(be, p, (i, Linear::Up), (p.dln, dup), dgu, (a.ln2, wup), shapes);
        ex.tensor_sum(be, p.dln);
    }

    /// The MLP's activation: the gated unit of `[gate | up]` rows ([`Model::dense_glu`]) into
    /// `h`'s rows of width `f`, or (GPT) GELU of `c_fc`'s output.
    pub(in super::super) fn activation_forward<B: Backend>(&self, be: &mut B, h: View, gu: View, f: usize) {
        if self.config.is_gpt() {
            be.gelu_forward(h, gu, self.config.gelu == Gelu::Tanh);
        } else {
            be.glu_forward(h, gu, f, self.dense_glu());
        }
    }

    /// The gated unit of a dense MLP: Gemma's GELU-tanh (GeGLU), else SwiGLU.
    pub(in super::super) fn dense_glu(&self) -> Glu {
        if self.config.family == Family::Gemma3 { Glu::GeluTanh } else { Glu::Swiglu }
    }
}
