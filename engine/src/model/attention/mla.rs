//! Multi-head latent attention (DeepSeek-V2/V3), as transformers' `DeepseekV3Attention`
//! computes it. Queries go through a low-rank latent (or one projection), keys and values
//! through one shared latent; each head's key is its own `nope` part beside a RoPE key shared by
//! all heads; values are `v` wide. The pieces are assembled into the packed rows of the
//! attention core ([`Backend::mla_qkv_forward`]: `H` query, key and value heads of width
//! `qk = nope + rope`, values zero-padded), so the same core (its sequence and document
//! handling, the CUDA flash kernel and cuDNN) serves both kinds; its output is narrowed back to
//! the values' width before `o_proj`.
//!
//! ```text
//! forward:  q     = rmsnorm(ln1 · Wq_aᵀ) · Wq_bᵀ        [N, H·qk]   (or ln1 · Wqᵀ)
//!           c     = rmsnorm(ln1 · Wkv_a[:Rkv]ᵀ)         [N, Rkv]    the latent
//!           kpe   = ln1 · Wkv_a[Rkv:]ᵀ                  [N, rope]   one RoPE key for all heads
//!           kv    = c · Wkv_bᵀ                          [N, H·(nope + v)]
//!           qkv   = assemble(q, kv, kpe)                RoPE on q's and kpe's rope parts
//!           attn  = attention(qkv)                      softmax(q kᵀ / sqrt(qk) · s) v
//!           xmid  = x + narrow(attn) · Woᵀ
//! backward: each step's adjoint, in reverse; the latents' RMSNorms by the backend's
//!           backward; ln1's gradient gathers the three products that read it.
//! ```
//!
//! `s`, the softmax scale's extra factor, is YaRN's `m(factor, mscale_all_dim)²` when the
//! model's RoPE is YaRN with `mscale_all_dim` set (1 otherwise); it multiplies the queries.
//!
//! Under tensor parallelism the heads are split: `q_b_proj` (or `q_proj`) and `kv_b_proj` by
//! rows, `o_proj` by columns; the latents' projections and norms (`q_a_proj`,
//! `q_a_layernorm`, `kv_a_proj_with_mqa`, `kv_a_layernorm`) are replicated, since every head
//! reads the whole latent: the latents' gradients are summed over the group, and the
//! replicated projections' backward then runs on the sums alike on every device.
//!
//! Under `train.precision = "fp8"` the projections run as FP8 products where their widths
//! qualify ([`super::super::fp8`]), the RoPE key's excepted.

use super::super::fp8::Linear;
use super::super::layout::{MlaOffsets, QueryOffsets};
use super::super::{Exchange, Model, Plan, Weight, Window};
use crate::backend::{AttnShape, Backend, MatMul, MlaShape, View};
use crate::config::MlaConfig;

impl Model {
    fn mla_config(&self) -> &MlaConfig {
        self.config.mla.as_ref().expect("internal error: latent attention without [model.mla]")
    }

    /// The assembly's shape for a batch.
    fn mla_shape(&self, p: &Plan) -> MlaShape {
        let a = self.mla_config();
        MlaShape {
            rows: p.batch * p.seq,
            seq: p.seq,
            heads: self.config.n_heads,
            nope: a.nope_dim,
            rope: a.rope_dim,
            v: a.v_dim,
            interleave: a.interleave,
        }
    }

    /// The factor the queries are multiplied by: YaRN's `m(factor, mscale_all_dim)²` when set
    /// (transformers applies it to the softmax scale of any RoPE type but the default).
    fn mla_q_scale(&self) -> f32 {
        match &self.config.yarn {
            Some(y) if y.mscale_all_dim != 0.0 => {
                let m = super::super::rope::yarn_mscale(y.factor, y.mscale_all_dim);
                (m * m) as f32
            }
            _ => 1.0,
        }
    }

    pub(super) fn mla_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        o: &MlaOffsets,
        ex: &mut dyn Exchange<B>,
    ) {
        let (m, la, a) = (&self.config, &p.layers[i], self.mla_config());
        let acts = la.mla.as_ref().expect("internal error: latent attention without its activations");
        let (n, d, h) = (p.batch * p.seq, m.d_model, m.n_heads);
        let (qk, eps) = (m.head_dim, a.latent_norm_eps as f32);
        let (rkv, rope) = (a.kv_lora_rank, a.rope_dim);
        let fwd = |be: &mut B, linear, out, (x, w): (View, Weight), shape| {
            self.linear_forward(be, p, (i, linear), out, (x, w), None, shape)
        };
        match o.q {
            QueryOffsets::Latent { down, norm, up } => {
                let rq = a.q_lora_rank;
                fwd(be, Linear::QDown, acts.q_lat, (la.ln1, w.weight(down, rq * d)), MatMul::linear(n, d, rq));
                be.rmsnorm_forward(acts.q_lat_n, acts.q_rstd, acts.q_lat, w.at(norm, rq), 0.0, rq, eps);
                fwd(be, Linear::QUp, acts.q, (acts.q_lat_n, w.weight(up, h * qk * rq)), MatMul::linear(n, rq, h * qk));
            }
            QueryOffsets::Direct(q) => {
                fwd(be, Linear::QUp, acts.q, (la.ln1, w.weight(q, h * qk * d)), MatMul::linear(n, d, h * qk))
            }
        }
        fwd(be, Linear::KvDown, acts.kv_lat, (la.ln1, w.weight(o.kv_a, rkv * d)), MatMul::linear(n, d, rkv));
        be.matmul(acts.kpe, la.ln1, w.at(o.kv_a + rkv * d, rope * d), MatMul::linear(n, d, rope));
        be.rmsnorm_forward(acts.kv_lat_n, acts.kv_rstd, acts.kv_lat, w.at(o.kv_norm, rkv), 0.0, rkv, eps);
        let kv_width = h * (a.nope_dim + a.v_dim);
        let wkv_b = w.weight(o.kv_b, kv_width * rkv);
        fwd(be, Linear::KvUp, acts.kv, (acts.kv_lat_n, wkv_b), MatMul::linear(n, rkv, kv_width));
        let shape = self.mla_shape(p);
        be.mla_qkv_forward(la.qkv, acts.q, acts.kv, acts.kpe, p.rope, shape, self.mla_q_scale());
        self.attend(be, p, i, (la.attn, la.lse), la.qkv, self.attn_shape(i, p.batch, p.seq), ex);
        be.heads_narrow(acts.attn_v, la.attn, n, h, qk, a.v_dim);
        let (vw, wo) = (h * a.v_dim, w.weight(o.o, d * h * a.v_dim));
        let (out, residual) = Self::branch_output(la.post.as_ref().map(|s| s.attn_y), la.xmid, la.x);
        self.row_parallel(be, p, ex, (i, Linear::O), out, (acts.attn_v, wo), residual, MatMul::linear(n, vw, d));
    }

    pub(super) fn mla_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        (w, g): (Window, Window),
        dout: View,
        o: &MlaOffsets,
        ex: &mut dyn Exchange<B>,
    ) {
        let (m, la, a) = (&self.config, &p.layers[i], self.mla_config());
        let acts = la.mla.as_ref().expect("internal error: latent attention without its activations");
        let (n, d, h) = (p.batch * p.seq, m.d_model, m.n_heads);
        let (qk, rkv, rope, vw) = (m.head_dim, a.kv_lora_rank, a.rope_dim, h * a.v_dim);
        let kv_width = h * (a.nope_dim + a.v_dim);
        let [dq, dkv, dkpe, dq_lat, dkv_lat, dattn_v, dc, dq_lat_n] = p.dmla;
        // xmid = x + attn_v · Woᵀ
        let bwd = |be: &mut B, linear, (dx, dw): (View, View), dy, (x, w): (View, Weight), (inp, out), acc: bool| {
            let dx_shape = MatMul { accumulate: acc, ..MatMul::linear_dx(n, inp, out) };
            self.linear_backward(be, p, (i, linear), (dx, dw), dy, (x, w), (dx_shape, MatMul::linear_dw(n, inp, out)))
        };
        let (dwo, wo) = (g.at(o.o, d * vw), w.weight(o.o, d * vw));
        bwd(be, Linear::O, (dattn_v, dwo), dout, (acts.attn_v, wo), (vw, d), false);
        be.heads_widen(p.dattn, dattn_v, n, h, a.v_dim, qk);
        let shape: AttnShape = self.attn_shape(i, p.batch, p.seq);
        self.attend_backward(be, p, p.dqkv, p.dattn, (la.qkv, la.attn, la.lse), shape, ex);
        be.mla_qkv_backward(dq, dkv, dkpe, p.dqkv, p.rope, self.mla_shape(p), self.mla_q_scale());
        // Under tensor parallelism each device holds some heads: the gradients of what all
        // heads read (the latents, the RoPE key) are partial sums, added up over the group
        // before the replicated projections' backward, which then gives every device the
        // whole input gradient (no sum of `dln` after).
        ex.tensor_sum(be, dkpe);
        // kv = c · Wkv_bᵀ, c = rmsnorm(kv_lat)
        let (dwkv_b, wkv_b) = (g.at(o.kv_b, kv_width * rkv), w.weight(o.kv_b, kv_width * rkv));
        bwd(be, Linear::KvUp, (dc, dwkv_b), dkv, (acts.kv_lat_n, wkv_b), (rkv, kv_width), false);
        ex.tensor_sum(be, dc);
        be.fill(dkv_lat, 0.0);
        let norm = (g.at(o.kv_norm, rkv), w.at(o.kv_norm, rkv));
        be.rmsnorm_backward(dkv_lat, norm.0, dc, acts.kv_lat, norm.1, 0.0, acts.kv_rstd, rkv);
        // The queries' part of `dln` first: a partial sum over the heads without a latent.
        match o.q {
            QueryOffsets::Latent { down, norm, up } => {
                let rq = a.q_lora_rank;
                // q = rmsnorm(q_lat) · Wq_bᵀ
                let (wu, gu) = (w.weight(up, h * qk * rq), g.at(up, h * qk * rq));
                bwd(be, Linear::QUp, (dq_lat_n, gu), dq, (acts.q_lat_n, wu), (rq, h * qk), false);
                ex.tensor_sum(be, dq_lat_n);
                be.fill(dq_lat, 0.0);
                let (gn, wn) = (g.at(norm, rq), w.at(norm, rq));
                be.rmsnorm_backward(dq_lat, gn, dq_lat_n, acts.q_lat, wn, 0.0, acts.q_rstd, rq);
                let (wd, gd) = (w.weight(down, rq * d), g.at(down, rq * d));
                bwd(be, Linear::QDown, (p.dln, gd), dq_lat, (la.ln1, wd), (d, rq), false);
            }
            QueryOffsets::Direct(q) => {
                let (wq, gq) = (w.weight(q, h * qk * d), g.at(q, h * qk * d));
                bwd(be, Linear::QUp, (p.dln, gq), dq, (la.ln1, wq), (d, h * qk), false);
                ex.tensor_sum(be, p.dln);
            }
        }
        // kv_lat and kpe = ln1 · Wkv_aᵀ (its two row blocks), replicated.
        let (wkv_a, dwkv_a) = (w.weight(o.kv_a, rkv * d), g.at(o.kv_a, rkv * d));
        let (wpe, dwpe) = (w.at(o.kv_a + rkv * d, rope * d), g.at(o.kv_a + rkv * d, rope * d));
        bwd(be, Linear::KvDown, (p.dln, dwkv_a), dkv_lat, (la.ln1, wkv_a), (d, rkv), true);
        be.matmul(p.dln, dkpe, wpe, MatMul::linear_dx(n, d, rope).accumulating());
        be.matmul(dwpe, dkpe, la.ln1, MatMul::linear_dw(n, d, rope));
    }
}
