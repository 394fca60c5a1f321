//! The transformer, written once against [`Backend`]: its parameter layout (`layout`), the
//! activation plan for a batch shape (`plan`), what the passes exchange with the other devices
//! of a parallel run (`exchange`), and, here, the forward and backward passes.
//!
//! A block is pre-norm: `x + attn(rmsnorm(x))`, then `+ mlp(rmsnorm(·))`; the MLP is SwiGLU or
//! a Mixtral mixture of experts. The output head reads the final RMSNorm.
//!
//! The GPT family (`model.family = "gpt"`, GPT-2 and Pax's GPT) differs in four places, each
//! taken in the same passes: the input is `wte[token] + wpe[position]` (learned positions, no
//! RoPE); the norms are LayerNorms with weight and bias; the MLP is `c_proj(gelu(c_fc(x)))` (no
//! gate); every projection has a bias. A bias is added as a rank-one product with a column of
//! ones, `y[N, O] += 1[N, 1] · b[O, 1]ᵀ`, and its gradient is the same product's weight
//! gradient, `db[O] += dyᵀ · 1` (the sum over rows), so both run through [`Backend::matmul`]
//! (deterministic on the CPU, an extra GEMM on a GPU).

mod attention;
mod exchange;
mod experts;
mod fp8;
pub mod init;
pub mod layout;
pub mod memory;
mod mlp;
mod norm;
mod plan;
pub mod rope;
#[cfg(test)]
mod tests;

use crate::backend::{AttnShape, Backend, MatMul, SeqSplit, View};
use crate::config::{ModelConfig, Remat};
pub use exchange::{Alone, CastWindow, Exchange, Pass, Unit, Weight, Window};
use fp8::Linear;
pub use fp8::{CastWeight, Fp8Buffers, Fp8Policy};
pub use layout::{
    AttnOffsets, ExpertNames, GqaOffsets, LayerBiases, LayerOffsets, Layout, MlpOffsets, PostNorms, Tensor,
};
use plan::MlpActs;
pub use plan::{ActivationSizes, GRAD_NORM_SQ, LOSS_ACCUM, LOSS_SUM, Plan};

/// What the routers of a forward pass did, over the whole model ([`Model::router_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RouterStats {
    /// The load-balancing loss.
    pub aux_loss: f64,
    /// Share of the (token, expert) assignments dropped by the experts' capacity.
    pub dropped: f64,
    /// The most loaded expert's routed tokens over the mean, of the counts summed over the
    /// layers (1: even).
    pub max_load: f64,
}

/// A model: its configuration and parameter layout.
#[derive(Debug, Clone)]
pub struct Model {
    /// The architecture this model's layout and passes are built for (on a tensor-parallel
    /// device, its local slice: heads, columns and experts divided by the group size).
    pub config: ModelConfig,
    /// Where each tensor lives in the flat buffers.
    pub layout: Layout,
    /// Which activations the backward pass recomputes (`train.remat`); set before planning.
    pub remat: Remat,
    /// Which linear layers run in FP8, and how they are scaled (`train.precision = "fp8"`);
    /// none: all in the backend's precision. Set before planning.
    pub fp8: Option<Fp8Policy>,
    /// Whether the FP8 forward passes keep each weight's transposed cast for the backward pass
    /// (written in the same pass as the forward's own), instead of the backward pass casting the
    /// weight again: where the device holds its whole model's weights (no FSDP, one pipeline
    /// stage), at one byte an FP8 weight. Set before planning.
    pub fp8_weight_cache: bool,
    /// Whether, besides, the optimizer writes each FP8 weight's casts in both layouts, with the
    /// amax, in its update's pass ([`crate::backend::Backend::adamw_fp8`]), so that neither pass
    /// casts a weight: under the delayed recipe, whose scale is known before the cast, at one
    /// byte more an FP8 weight. Its owner casts them before the first pass and after anything
    /// else changes the weights ([`Model::refresh_fp8_weight_casts`]). Set before planning.
    pub fp8_weight_copies: bool,
    /// Whether FSDP gathers the FP8 products' weights as their E4M3 casts, one byte an element
    /// (`parallel/strategies/fsdp.rs`; [`Model::fp8_cast_weights`]), which the passes then read
    /// instead of casting: on an fsdp × seq group. Set before planning.
    pub fp8_gathers: bool,
    /// Whether the FP8 forward passes keep, for the backward pass, the transposed casts of the
    /// inputs that only a weight gradient reads (q/k/v's, gate/up's and down's: the norms' and
    /// the gated unit's outputs), written in the same pass as the forward product's own, in
    /// place of the inputs themselves: one byte an element instead of two, and no cast of x in
    /// the backward pass (`fp8.rs`'s `Model::fp8_kept`). Without recomputation only
    /// (`remat = "none"`: what a policy refills, it does not keep at all). Set before planning.
    pub fp8_keep_inputs: bool,
    /// Whether the attention forward passes record each head's largest logit for QK-clip
    /// (`optim.qk_clip`: [`Plan::logit_max`]). Set before planning.
    pub logit_max: bool,
    /// Devices that share the global batch's tokens (data × fsdp × seq), over which the
    /// load-balancing loss averages: its routing statistics are summed over them
    /// ([`Exchange::batch_sum`]).
    pub batch_shards: usize,
    /// This device's chunks of each sequence under sequence parallelism (the whole sequence
    /// without): a plan's `seq` rows are those chunks, at their true positions (RoPE, learned
    /// positions), and attention reads every rank's keys and values ([`Exchange::seq_gather`]).
    pub seq: SeqSplit,
    /// Document masking of packed sequences (`data.document_mask`): attention stays within each
    /// document of a sequence; none attends across EOS.
    pub documents: Option<Documents>,
    /// Devices the experts are distributed over, whole (the expert axis, `experts.rs`): each
    /// runs its experts on the rows every member of its expert group routes to them. 1: every
    /// device runs every expert on its own rows.
    pub expert_ranks: usize,
    /// A test's fault on the expert axis: one row of each dispatch goes to the next expert,
    /// on another device.
    #[cfg(test)]
    pub(crate) fault_misroute: bool,
    /// A test's fault in the vocabulary-parallel loss: the row maxima are not reduced over the
    /// tensor group, so each device's partial sums are against another maximum.
    #[cfg(test)]
    pub(crate) fault_local_vocab_max: bool,
}

/// How packed sequences are cut into documents ([`Model::documents`]). A document ends with
/// its EOS token, which belongs to it (as in MaxText and torchtitan): the token after an EOS
/// starts the next document. The loss is untouched, as MaxText's packing keeps it: every
/// position predicts its next token, so an EOS position is trained to predict the next
/// document's first token (from its own document alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Documents {
    /// The token that ends a document.
    pub eos: u32,
    /// Whether positions restart at 0 at each document (`data.reset_positions`; the GPT
    /// family's learned positions).
    pub reset_positions: bool,
}

impl Documents {
    /// The run's document masking (`data.document_mask`, `data.reset_positions`), with the EOS
    /// id that its shards record (every dataset of a mixture must agree); none when off.
    pub fn of(data: &crate::config::DataConfig) -> anyhow::Result<Option<Documents>> {
        if !data.document_mask {
            return Ok(None);
        }
        let paths = std::iter::once(data.path.as_str()).chain(data.mixture.iter().map(|m| m.path.as_str()));
        let mut eos: Option<(u32, String)> = None;
        for path in paths.filter(|p| !p.is_empty()) {
            let first = crate::data::shard::list(std::path::Path::new(path))?;
            let Some(first) = first.first() else { continue };
            let id = crate::data::shard::Shard::open(first)?.header.eos;
            match &eos {
                Some((e, other)) if *e != id => anyhow::bail!(
                    "data.document_mask = true: the shards of {other} end documents with EOS id {e}, those of {path} with {id}; mask with one EOS"
                ),
                Some(_) => {}
                None => eos = Some((id, path.to_string())),
            }
        }
        let Some((eos, _)) = eos else {
            anyhow::bail!(
                "data.document_mask = true, but no shard names an EOS id (data.path and data.mixture hold none)"
            )
        };
        Ok(Some(Documents { eos, reset_positions: data.reset_positions }))
    }
}

/// The part of the model one pipeline stage holds: a contiguous run of layers, with the
/// embedding on the first stage and the final norm, output head and loss on the last. A model
/// without stages is the one stage that is both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// Its layers (indices in the whole model).
    pub layers: std::ops::Range<usize>,
    /// Whether it holds the embedding (and reads the tokens).
    pub first: bool,
    /// Whether it holds the final norm and the output head (and computes the loss).
    pub last: bool,
    /// On a device of an interleaved pipeline (`train.pipeline_virtual_stages`), the layers of
    /// its later virtual stages, each a run of its own laid out after `layers`; empty else.
    pub later: Vec<std::ops::Range<usize>>,
}

impl Stage {
    /// The whole model as one stage.
    pub fn whole(n_layers: usize) -> Stage {
        Stage { layers: 0..n_layers, first: true, last: true, later: Vec::new() }
    }

    /// The layers it holds, in buffer order (those of every virtual stage).
    pub fn layer_indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.clone().chain(self.later.iter().flat_map(Clone::clone))
    }

    /// How many layers it holds.
    pub fn layer_count(&self) -> usize {
        self.layers.len() + self.later.iter().map(ExactSizeIterator::len).sum::<usize>()
    }

    /// Its virtual stages, each a stage of its own: the embedding with the first (if it holds
    /// it), the head with the last (if it holds it). Without virtual stages, itself.
    pub fn chunks(&self) -> Vec<Stage> {
        let runs: Vec<_> = std::iter::once(self.layers.clone()).chain(self.later.iter().cloned()).collect();
        let n = runs.len();
        let chunk = |(c, layers)| Stage {
            layers,
            first: self.first && c == 0,
            last: self.last && c + 1 == n,
            later: Vec::new(),
        };
        runs.into_iter().enumerate().map(chunk).collect()
    }
}

impl Model {
    /// A model with the layout of `config`.
    pub fn new(config: &ModelConfig) -> Model {
        Model::for_stage(config, &Stage::whole(config.n_layers))
    }

    /// The part of the model of `config` that a pipeline stage holds and runs.
    pub fn for_stage(config: &ModelConfig, stage: &Stage) -> Model {
        Model {
            config: config.clone(),
            layout: Layout::stage(config, stage),
            remat: Remat::None,
            fp8: None,
            fp8_weight_cache: false,
            fp8_weight_copies: false,
            fp8_gathers: false,
            fp8_keep_inputs: false,
            logit_max: false,
            batch_shards: 1,
            seq: SeqSplit::WHOLE,
            documents: None,
            expert_ranks: 1,
            #[cfg(test)]
            fault_misroute: false,
            #[cfg(test)]
            fault_local_vocab_max: false,
        }
    }

    /// This model holding only `experts` of each mixture-of-experts layer: a device's own on an
    /// expert axis of [`Model::expert_ranks`] devices.
    pub fn hold_experts(&mut self, experts: std::ops::Range<usize>) {
        self.layout = Layout::stage_with_experts(&self.config, &self.layout.stage, experts);
    }

    /// The stage this model is (the whole model: the stage that is first and last).
    pub fn stage(&self) -> &Stage {
        &self.layout.stage
    }

    /// The attention shape of the stage's layer `i` (its window: sliding or full).
    pub(crate) fn attn_shape(&self, i: usize, batch: usize, seq: usize) -> AttnShape {
        let m = &self.config;
        let layer = self.layer_index(i);
        AttnShape {
            batch,
            seq,
            n_heads: m.n_heads,
            n_kv_heads: m.n_kv_heads,
            head_dim: m.head_dim,
            window: m.window(layer),
            scale: m.attn_scale(),
        }
    }

    /// The forward pass over the tokens in `plan.tokens`: logits, per-token losses against
    /// `plan.targets`, and their sum in `plan.scalars[LOSS_SUM]`. With `grad_scale`, the logits
    /// are replaced by the gradient of `grad_scale · Σ losses`, ready for [`Model::backward`].
    pub fn forward<B: Backend>(&self, be: &mut B, p: &Plan, grad_scale: Option<f32>, ex: &mut dyn Exchange<B>) {
        let (m, l) = (&self.config, &self.layout);
        let (n, d, v) = (p.batch * p.seq, m.d_model, m.vocab_size);
        let fwd = Pass::Forward;

        let stage = &l.stage;
        ex.pass_begins(be, fwd);
        if let Some(docs) = self.documents {
            // Every stage's attention reads the bounds; the first stage's embedding the positions.
            let positions = docs.reset_positions.then_some(p.positions);
            if self.seq.ranks > 1 {
                // From the whole sequences, which every device of the axis reads (the EOS of
                // the others' chunks bound its queries and positions); no exchange needed.
                be.document_bounds_split(p.bounds, positions, p.whole_tokens, p.seq, self.seq, docs.eos);
            } else {
                be.document_bounds(p.bounds, positions, p.tokens, p.seq, docs.eos);
            }
        }
        // A later stage's input (and the routing statistics so far) came from the stage before.
        if stage.first {
            let w = p.params_of(ex, be, Unit::Embed, fwd);
            let x0 = p.stage_input();
            let (vocab_rank, vocab_ranks) = ex.tensor_rank_for_vocab();
            if vocab_ranks > 1 {
                // Each device looks up the tokens of its slice of the vocabulary (zero rows for
                // the others'); the sum over the tensor group is the whole lookup.
                be.embedding_forward_slice(x0, w.at(l.embed, v * d), p.tokens, d, vocab_rank * v);
                ex.tensor_sum(be, x0);
            } else {
                be.embedding_forward(x0, w.at(l.embed, v * d), p.tokens, d);
            }
            if let Some(pos) = l.positions {
                // x0 = wte[token] + wpe[position]; `dln` is free until the backward pass.
                be.embedding_forward(p.dln, w.at(pos, m.max_seq_len * d), p.positions, d);
                be.add(x0, p.dln);
            }
            if let Some(s) = m.embed_scale() {
                be.scale(x0, s);
            }
            ex.params_done(be, Unit::Embed, fwd);
            if m.moe.is_some() {
                be.fill(p.stats, 0.0);
            }
        }
        for i in 0..p.layers.len() {
            let w = p.params_of(ex, be, Unit::Layer(i), fwd);
            let out = p.layers.get(i + 1).map_or(p.x_out, |next| next.x);
            self.layer_forward(be, p, i, w, Some(out), ex);
            ex.params_done(be, Unit::Layer(i), fwd);
        }
        if m.moe.is_some() {
            for a in &p.layers {
                if let MlpActs::Moe { dispatch, .. } = &a.mlp {
                    be.add(p.stats, dispatch.stats);
                }
            }
        }
        if stage.last {
            let (w, head) = self.head_params(be, p, ex, fwd);
            self.norm_forward(be, p.lnf, p.rstdf, p.x_out, w, l.norm);
            be.matmul(p.logits, p.lnf, head, MatMul::linear(n, d, v));
            if m.final_logit_softcap > 0.0 {
                be.copy(p.precap, p.logits);
                be.softcap_forward(p.logits, m.final_logit_softcap as f32);
            }
            self.cross_entropy_vocab(be, p, grad_scale, ex);
            be.sum(p.scalars.at(LOSS_SUM, 1), p.losses);
        }
    }

    /// The per-token losses of `p.logits` (and with `grad_scale`, their gradient in their place).
    /// Under vocabulary parallelism each device holds its slice's columns of the logits, and
    /// Megatron-LM's loss never gathers them: the row maxima reduced over the tensor group (max),
    /// then the sums of exponentials and the target logits (held by one device each; sum).
    fn cross_entropy_vocab<B: Backend>(&self, be: &mut B, p: &Plan, grad_scale: Option<f32>, ex: &mut dyn Exchange<B>) {
        let (n, v) = (p.batch * p.seq, self.config.vocab_size);
        let (vocab_rank, vocab_ranks) = ex.tensor_rank_for_vocab();
        if vocab_ranks == 1 {
            be.cross_entropy(p.losses, p.logits, p.targets, v, grad_scale);
            return;
        }
        let first = vocab_rank * v;
        let (max, sums) = (p.vocab_stats.at(0, n), p.vocab_stats.at(n, 2 * n));
        be.cross_entropy_max(max, p.logits, v);
        #[cfg(test)]
        let reduce_max = !self.fault_local_vocab_max;
        #[cfg(not(test))]
        let reduce_max = true;
        if reduce_max {
            ex.tensor_max_for_vocab(be, max);
        }
        be.cross_entropy_partials(sums, p.logits, max, p.targets, v, first);
        ex.tensor_sum(be, sums);
        be.cross_entropy_finish(p.losses, p.logits, max, sums, p.targets, v, first, grad_scale);
    }

    /// The head unit's parameters and the output matrix, which is the embedding's when tied.
    fn head_params<B: Backend>(&self, be: &mut B, p: &Plan, ex: &mut dyn Exchange<B>, pass: Pass) -> (Window, View) {
        let l = &self.layout;
        let w = p.params_of(ex, be, Unit::Head, pass);
        let matrix = if self.tied() { p.params_of(ex, be, Unit::Embed, pass) } else { w };
        (w, matrix.at(l.head, self.config.vocab_size * self.config.d_model))
    }

    /// Whether the output head is the embedding (which lives in the [`Unit::Embed`] unit).
    fn tied(&self) -> bool {
        self.layout.tied
    }

    /// Layer `i`'s forward pass from its input `p.layers[i].x`, with the layer's parameters in
    /// `w`: `xmid = x + attn(norm(x))`, then `out = xmid + mlp(norm(xmid))`. With `out`, the
    /// layer's output (the next residual stream) is written there; without, only the
    /// activations the backward pass reads are refilled (recomputation under `remat = full`).
    fn layer_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        out: Option<View>,
        ex: &mut dyn Exchange<B>,
    ) {
        let (a, o) = (&p.layers[i], &self.layout.layers[i]);
        self.norm_before(be, (p, i, Linear::Qkv), a.ln1, a.rstd1, a.x, w, o.ln1);
        self.attention_forward(be, p, i, w, ex);
        if let (Some(s), Some(post)) = (&a.post, &o.post) {
            // Sandwich norms: xmid = x + norm(attn_y).
            self.norm_forward(be, a.xmid, s.attn_rstd, s.attn_y, w, post.attn);
            be.add(a.xmid, a.x);
        }
        self.norm_before(be, (p, i, Linear::Up), a.ln2, a.rstd2, a.xmid, w, o.ln2);
        self.mlp_forward(be, p, i, w, out, ex);
        if let (Some(out), Some(s), Some(post)) = (out, &a.post, &o.post) {
            // out = xmid + norm(mlp_y).
            self.norm_forward(be, out, s.mlp_rstd, s.mlp_y, w, post.mlp);
            be.add(out, a.xmid);
        }
    }

    /// Where a branch of layer `i` (its attention or its MLP) writes its output, and the
    /// residual it adds: the residual stream after it (`to`) with the stream before it added;
    /// under sandwich norms (`own`: the branch's output before its norm) that output alone,
    /// which [`Model::layer_forward`] norms and adds to the stream.
    pub(super) fn branch_output(own: Option<View>, to: View, from: View) -> (View, Option<View>) {
        match own {
            Some(own) => (own, None),
            None => (to, Some(from)),
        }
    }

    /// The gradient a branch of layer `i` starts its backward pass from: the residual stream's
    /// (`p.dres`), or under sandwich norms that of its output before the norm (`x`, normed with
    /// the weight at `at` and `rstd`), into `p.dpost`.
    fn branch_gradient<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        (w, g): (Window, Window),
        post: Option<(View, usize, View)>,
    ) -> View {
        let Some((x, at, rstd)) = post else { return p.dres };
        be.fill(p.dpost, 0.0);
        self.norm_backward(be, p.dpost, g, p.dres, x, w, at, rstd);
        p.dpost
    }

    /// The index in the whole model of the stage's layer `i`.
    pub(super) fn layer_index(&self, i: usize) -> usize {
        self.layout.stage.layer_indices().nth(i).unwrap_or(0)
    }

    /// Refills the activations layer `i`'s backward pass reads that the recomputation policy
    /// did not keep. The last layer needs nothing: the shared buffers still hold its values.
    fn recompute<B: Backend>(&self, be: &mut B, p: &Plan, i: usize, w: Window, ex: &mut dyn Exchange<B>) {
        if i + 1 == p.layers.len() && !p.refill_last {
            return;
        }
        match self.remat {
            Remat::None => {}
            Remat::Minimal => {
                let (a, o) = (&p.layers[i], &self.layout.layers[i]);
                self.norm_forward(be, a.ln1, a.rstd1, a.x, w, o.ln1);
                self.norm_forward(be, a.ln2, a.rstd2, a.xmid, w, o.ln2);
                let (MlpActs::Dense { gu, h } | MlpActs::Moe { gu, h, .. }) = &a.mlp;
                let f = match a.mlp {
                    MlpActs::Dense { .. } => h.len / (p.batch * p.seq),
                    MlpActs::Moe { .. } => self.config.mlp_dim,
                };
                self.activation_forward(be, *h, *gu, f);
                if let MlpActs::Moe { shared: Some((sgu, sh)), .. } = &a.mlp {
                    be.swiglu_forward(*sh, *sgu, sh.len / (p.batch * p.seq));
                }
            }
            Remat::Full => self.layer_forward(be, p, i, w, None, ex),
        }
    }

    /// The backward pass, after a forward pass with `grad_scale`: accumulates the gradient of
    /// the objective into `plan.grads` (or where the exchange says). `aux_scale` comes from
    /// [`Model::aux_scale`].
    pub fn backward<B: Backend>(&self, be: &mut B, p: &Plan, aux_scale: f32, ex: &mut dyn Exchange<B>) {
        let (m, l) = (&self.config, &self.layout);
        let (n, d, v) = (p.batch * p.seq, m.d_model, m.vocab_size);
        let bwd = Pass::Backward;

        // Output head and final norm; `dres` then carries the residual stream's gradient down.
        // A tied head's gradient goes to the embedding, which is finished last.
        // On a stage before the last, `dres` holds the gradient of the stage's output, received
        // from the next stage, and the statistics the whole model's routing.
        let stage = &l.stage;
        ex.pass_begins(be, bwd);
        if stage.last {
            let (w, head) = self.head_params(be, p, ex, bwd);
            let g = p.grads_of(ex, be, Unit::Head);
            let dhead = if self.tied() { p.grads_of(ex, be, Unit::Embed) } else { g }.at(l.head, v * d);
            if m.final_logit_softcap > 0.0 {
                be.softcap_backward(p.logits, p.precap, m.final_logit_softcap as f32);
            }
            be.matmul(p.dln, p.logits, head, MatMul::linear_dx(n, d, v));
            // Under vocabulary parallelism, each device's columns give a partial sum.
            ex.tensor_sum(be, p.dln);
            be.matmul(dhead, p.logits, p.lnf, MatMul::linear_dw(n, d, v));
            be.fill(p.dres, 0.0);
            self.norm_backward(be, p.dres, g, p.dln, p.x_out, w, l.norm, p.rstdf);
            ex.params_done(be, Unit::Head, bwd);
            if self.tied() {
                ex.params_done(be, Unit::Embed, bwd);
            }
            ex.grads_ready(be, Unit::Head);
        }
        let counts = p.stats.at(0, m.moe.as_ref().map_or(0, |e| e.num_experts));

        for (i, (a, o)) in p.layers.iter().zip(&l.layers).enumerate().rev() {
            let w = p.params_of(ex, be, Unit::Layer(i), bwd);
            let g = p.grads_of(ex, be, Unit::Layer(i));
            self.recompute(be, p, i, w, ex);
            let post = a.post.as_ref().zip(o.post.as_ref());
            let dout = self.branch_gradient(be, p, (w, g), post.map(|(s, o)| (s.mlp_y, o.mlp, s.mlp_rstd)));
            self.mlp_backward(be, p, i, (w, g), dout, (counts, aux_scale), ex);
            self.norm_backward(be, p.dres, g, p.dln, a.xmid, w, o.ln2, a.rstd2);
            let dout = self.branch_gradient(be, p, (w, g), post.map(|(s, o)| (s.attn_y, o.attn, s.attn_rstd)));
            self.attention_backward(be, p, i, (w, g), dout, ex);
            self.norm_backward(be, p.dres, g, p.dln, a.x, w, o.ln1, a.rstd1);
            ex.params_done(be, Unit::Layer(i), bwd);
            ex.grads_ready(be, Unit::Layer(i));
        }
        // A later stage's input gradient stays in `dres`, for the stage before.
        if stage.first {
            let g = p.grads_of(ex, be, Unit::Embed);
            if let Some(s) = m.embed_scale() {
                be.scale(p.dres, s);
            }
            match ex.tensor_rank_for_vocab() {
                (_, 1) => be.embedding_backward(g.at(l.embed, v * d), p.dres, p.tokens, d),
                // Each device's slice takes its own tokens' rows (`dres` is the whole group's).
                (vocab_rank, _) => {
                    be.embedding_backward_slice(g.at(l.embed, v * d), p.dres, p.tokens, d, vocab_rank * v)
                }
            }
            if let Some(pos) = l.positions {
                be.embedding_backward(g.at(pos, m.max_seq_len * d), p.dres, p.positions, d);
            }
            ex.grads_ready(be, Unit::Embed);
        }
    }
}

impl Model {
    /// `out = a · bᵀ (+ residual)` for a product whose inner dimension is split over the tensor
    /// group: each device's product is a partial sum, the group adds them up, and one device
    /// adds the residual so that it counts once.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn row_parallel<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        ex: &mut dyn Exchange<B>,
        linear: (usize, Linear),
        out: View,
        (a, b): (View, Weight),
        residual: Option<View>,
        shape: MatMul,
    ) {
        let residual = residual.filter(|_| ex.adds_residual());
        self.linear_forward(be, p, linear, out, (a, b), residual, shape);
        ex.tensor_sum(be, out);
    }

    /// `out[N, O] += 1[N, 1] · b[O, 1]ᵀ`: adds the bias at `at` in `w` (width `width`) to every
    /// row, when the layer has one (the GPT family).
    pub(super) fn add_bias<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        w: Window,
        out: View,
        at: Option<usize>,
        width: usize,
    ) {
        if let Some(at) = at {
            let n = p.batch * p.seq;
            be.matmul(out, p.ones, w.at(at, width), MatMul::linear(n, 1, width).accumulating());
        }
    }

    /// `db[O] += dyᵀ · 1`: the gradient of [`Model::add_bias`]'s bias, the sum of its output's
    /// gradient over rows, added into `g` at `at`.
    pub(super) fn bias_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        g: Window,
        dy: View,
        at: Option<usize>,
        width: usize,
    ) {
        if let Some(at) = at {
            be.matmul(g.at(at, width), dy, p.ones, MatMul::linear_dw(p.batch * p.seq, 1, width));
        }
    }
}
