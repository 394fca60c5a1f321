//! A layer's attention, from `ln1` (the normed residual stream) to `xmid` (the residual stream
//! after attention). Its kind is chosen once, when the model is laid out
//! ([`AttnOffsets`](super::layout::AttnOffsets)), and each kind is a file:
//!
//! - `gqa.rs`: grouped-query attention (Llama, Mistral, Mixtral, GPT, Qwen3 with QK-norm);
//! - `mla.rs`: multi-head latent attention (DeepSeek-V3).
//!
//! All kinds end in the same scaled-dot-product core ([`Model::attend`]), which handles what
//! does not depend on the kind: sequence parallelism (every rank's keys and values) and
//! document masking.

mod gqa;
mod mla;

use super::layout::AttnOffsets;
use super::{Exchange, Model, Plan, Window};
use crate::backend::{AttnShape, Backend, View};

impl Model {
    /// The sliding windows of sequences of `seq` tokens, for the start-up line: which layers
    /// attend through one, or that the window spans the whole sequence (full attention); none
    /// without windows.
    pub fn describe_windows(&self, seq: usize) -> Option<String> {
        let m = &self.config;
        let sliding: Vec<usize> = (0..m.n_layers).filter(|&i| m.window(i) > 0).collect();
        if sliding.is_empty() {
            return None;
        }
        let w = m.sliding_window;
        if w >= seq {
            return Some(format!(
                "model.sliding_window = {w} is at least the {seq} tokens of a sequence: every layer attends to its whole sequence"
            ));
        }
        let layers = if sliding.len() == m.n_layers {
            "every layer".to_string()
        } else if m.window_pattern > 0 {
            format!("{} of {} layers (one in {} full)", sliding.len(), m.n_layers, m.window_pattern)
        } else {
            format!("{} of {} layers (model.layer_types)", sliding.len(), m.n_layers)
        };
        let bases = if m.rope_local_theta > 0.0 {
            let scaled =
                if m.rope_linear_factor != 1.0 { format!(" / {}", m.rope_linear_factor) } else { String::new() };
            format!(" (RoPE base {} on them, {}{scaled} on the full ones)", m.rope_local_theta, m.rope_theta)
        } else {
            String::new()
        };
        Some(format!("sliding window {w} on {layers}{bases}"))
    }

    /// Layer `i`'s attention, forward: `xmid = x + attn(ln1)` (under sandwich norms, the
    /// output `attn(ln1)` alone, which the layer norms and adds).
    pub(super) fn attention_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        ex: &mut dyn Exchange<B>,
    ) {
        match &self.layout.layers[i].attn {
            AttnOffsets::Gqa(o) => self.gqa_forward(be, p, i, w, o, ex),
            AttnOffsets::Mla(o) => self.mla_forward(be, p, i, w, o, ex),
        }
    }

    /// Layer `i`'s attention, backward: from `dout` (the gradient of its output: of `xmid`, or
    /// under sandwich norms of the output before its norm) to `p.dln` (that of `ln1`, summed
    /// over the tensor group), the weight gradients added into `g`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        dout: View,
        ex: &mut dyn Exchange<B>,
    ) {
        match &self.layout.layers[i].attn {
            AttnOffsets::Gqa(o) => self.gqa_backward(be, p, i, (w, g), dout, o, ex),
            AttnOffsets::Mla(o) => self.mla_backward(be, p, i, (w, g), dout, o, ex),
        }
    }

    /// Causal attention over the packed rows `qkv` of layer `i` into `attn` (and `lse`): on a
    /// sequence axis over every rank's keys and values, under document masking within each
    /// document. Under QK-clip it also records each head's largest logit ([`Plan::logit_max`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (attn, lse): (View, View),
        qkv: View,
        shape: AttnShape,
        ex: &mut dyn Exchange<B>,
    ) {
        let heads = shape.n_heads;
        let record = p.logit_max.map(|m| m.at(self.layer_index(i) * heads, heads));
        if record.is_some() {
            be.attention_logit_max(record);
        }
        self.attend_only(be, p, (attn, lse), qkv, shape, ex);
        if record.is_some() {
            be.attention_logit_max(None);
        }
    }

    fn attend_only<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        (attn, lse): (View, View),
        qkv: View,
        shape: AttnShape,
        ex: &mut dyn Exchange<B>,
    ) {
        if self.seq.ranks > 1 {
            ex.seq_gather(be, qkv, p.qkv_all);
            let bounds = self.documents.map(|_| p.bounds);
            be.attention_forward_split(attn, lse, p.qkv_all, shape, self.seq, bounds);
        } else if self.documents.is_some() {
            be.attention_forward_docs(attn, lse, qkv, shape, p.bounds);
        } else {
            be.attention_forward(attn, lse, qkv, shape);
        }
    }

    /// The backward pass of [`Model::attend`]: `dqkv` (`=`) from `dattn`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        dqkv: View,
        dattn: View,
        (qkv, attn, lse): (View, View, View),
        shape: AttnShape,
        ex: &mut dyn Exchange<B>,
    ) {
        if self.seq.ranks > 1 {
            // The keys and values of every rank again (the forward pass's are another layer's
            // by now), and the gradients of every rank's summed back to their owners.
            ex.seq_gather(be, qkv, p.qkv_all);
            let bounds = self.documents.map(|_| p.bounds);
            be.attention_backward_split(p.dqkv_all, dattn, p.qkv_all, attn, lse, shape, self.seq, bounds);
            ex.seq_scatter_sum(be, p.dqkv_all, dqkv);
        } else if self.documents.is_some() {
            be.attention_backward_docs(dqkv, dattn, qkv, attn, lse, shape, p.bounds);
        } else {
            be.attention_backward(dqkv, dattn, qkv, attn, lse, shape);
        }
    }
}
