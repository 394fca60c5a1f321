//! The activation plan: every buffer a step uses on the device for one batch shape ([`Plan`]),
//! carved out before the first step and measured by the same code ([`ActivationSizes`]) for the
//! memory estimate and the parallel planner. Kept apart from the passes, which only read it:
//! the plan decides where things live, the passes what they compute.

use super::fp8::{KeptInput, Linear};
use super::{Exchange, Model, Pass, Unit, Window, rope};
use crate::backend::{Backend, BufId, BufKind, IdxView, MoeDispatch, View};
use crate::config::Remat;

/// Activations of one layer kept for the backward pass. Under recomputation some of these views
/// are shared by all layers and refilled before each layer's backward pass.
pub(super) struct LayerActs {
    /// `[N, D]` input of the layer (the residual stream).
    pub(super) x: View,
    pub(super) ln1: View,
    /// `[N]` RMSNorm's rstd; `[2N]` LayerNorm's mean then rstd (the GPT family), as `rstd2`.
    pub(super) rstd1: View,
    /// `[N, (H + 2 KV) · Dh]` q, k (after RoPE) and v.
    pub(super) qkv: View,
    /// Under QK-norm: `[N, (H + 2 KV) · Dh]` the projections' q, k and v before the norm, and
    /// `[N, H + KV]` the norm's rstd of each head; none without.
    pub(super) qk: Option<(View, View)>,
    /// `[N, H · Dh]` attention output, before `o_proj`.
    pub(super) attn: View,
    /// `[N, H]` log-sum-exp of the attention scores.
    pub(super) lse: View,
    /// `[N, D]` residual stream after attention.
    pub(super) xmid: View,
    pub(super) ln2: View,
    pub(super) rstd2: View,
    pub(super) mlp: MlpActs,
    /// Latent attention's own activations; none under grouped-query attention.
    pub(super) mla: Option<MlaActs>,
    /// Under sandwich norms (Gemma 3), the attention's and the MLP's outputs before their
    /// norms; none without.
    pub(super) post: Option<PostActs>,
    /// Under FP8, the inputs kept cast for the weight gradients, by [`Linear`]; where one is,
    /// the input itself (`ln1`, `ln2` or the MLP's `h`) is shared by all layers.
    pub(super) fp8_inputs: [Option<KeptInput>; 8],
}

/// A layer's sandwich-norm activations (Gemma 3): the attention's output `[N, D]` (after
/// `o_proj`) and its norm's rstd `[N]`, then the MLP's and its norm's. The MLP's are kept
/// under every recomputation policy (the recomputed forward pass stops before the MLP's last
/// product).
pub(super) struct PostActs {
    pub(super) attn_y: View,
    pub(super) attn_rstd: View,
    pub(super) mlp_y: View,
    pub(super) mlp_rstd: View,
}

/// A latent attention layer's activations (`attention/mla.rs`), `R` the ranks: the queries'
/// latent before and after its norm `[N, Rq]` and the norm's rstd `[N]` (without a query
/// latent, empty), the queries `[N, H · qk]`, the key-value latent before and after its norm
/// `[N, Rkv]` and rstd `[N]`, the shared RoPE key `[N, rope]`, each head's keys and values
/// `[N, H · (nope + v)]`, and the attention output narrowed to the values `[N, H · v]`.
pub(super) struct MlaActs {
    pub(super) q_lat: View,
    pub(super) q_lat_n: View,
    pub(super) q_rstd: View,
    pub(super) q: View,
    pub(super) kv_lat: View,
    pub(super) kv_lat_n: View,
    pub(super) kv_rstd: View,
    pub(super) kpe: View,
    pub(super) kv: View,
    pub(super) attn_v: View,
}

#[allow(clippy::large_enum_variant)] // one per layer, built once
pub(super) enum MlpActs {
    Dense {
        /// `[N, 2F]` gate and up projections (GPT: `[N, F]`, `c_fc`'s output).
        gu: View,
        /// `[N, F]` SwiGLU (GPT: GELU) output.
        h: View,
    },
    Moe {
        /// `[N, E]` router logits.
        logits: View,
        /// `[N, E]` router probabilities.
        probs: View,
        dispatch: MoeDispatch,
        /// `[N · k, D]` inputs gathered in dispatch order.
        xe: View,
        /// `[R, 2F]`, `[R, F]` the experts' activations; `[N · k, D]` their outputs, in
        /// dispatch order. `R` is `N · k`, or on an expert axis of `n` devices the most rows
        /// this device's experts can receive, `n · N · k` (dropless: every member's every row).
        gu: View,
        h: View,
        ye: View,
        /// On an expert axis: `[R, D]` the rows received for this device's experts, and the
        /// `n · (L + 1)` offsets of each sender's rows of each of its `L` experts among them
        /// (`experts.rs`); empty without.
        xr: View,
        local_offsets: IdxView,
        /// The shared experts' `[N, 2S]` gate and up projections and `[N, S]` SwiGLU output;
        /// none without shared experts.
        shared: Option<(View, View)>,
    },
}

/// Everything a step uses on the device for one batch shape, planned before the first step:
/// the flat parameter and gradient buffers, the inputs, the activations and the scratch of the
/// backward pass. Nothing is allocated afterwards.
pub struct Plan {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The flat parameter buffer.
    pub params: View,
    /// The flat gradient buffer (same layout).
    pub grads: View,
    /// `[N]` input tokens.
    pub tokens: IdxView,
    /// `[N]` next-token targets.
    pub targets: IdxView,
    /// `[N]` position of each token in its sequence (the GPT family's learned positions); in
    /// its document under
    /// [`Documents::reset_positions`](super::Documents::reset_positions).
    pub(super) positions: IdxView,
    /// `[2N]` where each token's document begins in its sequence, then where it ends (document
    /// masking, [`Backend::document_bounds`]; empty without), from the tokens at every forward
    /// pass; on a seq axis, `[2 · ranks · N]`: the whole sequences', by true position.
    pub(super) bounds: IdxView,
    /// `[ranks · N]` the whole sequences' tokens, for document masking on a seq axis (empty
    /// otherwise): each device finds the EOS of every chunk in them.
    pub whole_tokens: IdxView,
    /// `[ranks · N, (H + 2 KV) · Dh]` every seq rank's q, k and v rows, gathered for attention
    /// (empty without a sequence axis); shared by the layers and the slots.
    pub(super) qkv_all: View,
    /// The gradient of `qkv_all`, before it is summed over the sequence axis.
    pub(super) dqkv_all: View,
    /// `[N]` ones: the column a bias is added with (the GPT family, GPT-OSS).
    pub(super) ones: View,
    /// `[N]` per-token cross-entropy.
    pub losses: View,
    /// `[3N]` on the last stage, the vocabulary-parallel loss's row maxima, then its sums of
    /// exponentials and the target logits (each reduced over the tensor group).
    pub(super) vocab_stats: View,
    /// `[N, V]` logits; after a training forward pass, their gradient.
    pub logits: View,
    /// `[N, V]` the logits before soft-capping (`model.final_logit_softcap`), which the
    /// backward pass differentiates at; empty without.
    pub(super) precap: View,
    /// `[4]`: sum of the losses ([`LOSS_SUM`]); the squared gradient norm ([`GRAD_NORM_SQ`]);
    /// the step's accumulated loss sum ([`LOSS_ACCUM`]); spare.
    pub scalars: View,
    pub(super) rope: View,
    /// The sliding layers' RoPE table when they have their own base (Gemma 3's local layers);
    /// empty otherwise.
    pub(super) rope_local: View,
    pub(super) layers: Vec<LayerActs>,
    pub(super) x_out: View,
    pub(super) lnf: View,
    pub(super) rstdf: View,
    /// `[2E]` routing statistics summed over the model's layers (MoE): tokens routed to each
    /// expert, then each expert's router probabilities. A pipeline stage adds its layers' to
    /// those of the stages before it, and its backward pass reads the whole model's.
    pub(super) stats: View,
    /// `[N, D]` the MoE layer's combined output before the residual add.
    pub(super) moe_out: View,
    // Backward scratch, shared by the layers.
    pub(super) dres: View,
    pub(super) dln: View,
    /// `[N, D]` under sandwich norms: the gradient of the attention's or the MLP's output
    /// before its norm; empty without.
    pub(super) dpost: View,
    pub(super) dqkv: View,
    pub(super) dattn: View,
    pub(super) dgu: View,
    pub(super) dh: View,
    pub(super) dye: View,
    pub(super) dxe: View,
    /// `[R, D]` on an expert axis: the experts' outputs before they go back, and in the
    /// backward pass the gradients received and sent back (`experts.rs`); empty without.
    pub(super) yr: View,
    /// `[R, D]` on an expert axis: the rows packed into parts before they leave and unpacked
    /// when they come back (`experts.rs`); empty without.
    pub(super) parts: View,
    pub(super) dweight: View,
    pub(super) drouter: View,
    /// `[2 · Dh]` under QK-norm: a layer's q and k norm weight gradients of this micro-batch
    /// alone, summed over the tensor group (each device holds some heads) before they add up.
    pub(super) dqk_norm: View,
    /// Latent attention's backward scratch (`attention/mla.rs`): the gradients of the
    /// queries, the keys and values, the RoPE key, the two latents, the narrowed attention
    /// output, and the two normed latents; empty without.
    pub(super) dmla: [View; 8],
    /// Whether the backward pass refills the last layer's shared activations too: when
    /// several micro-batches in flight share them ([`Model::plan_slot`]), another's forward
    /// pass may have overwritten them.
    pub refill_last: bool,
    /// The FP8 products' scaling states and cast scratch (`train.precision = "fp8"`), shared by
    /// every slot; none without FP8 products.
    pub fp8: Option<super::Fp8Buffers>,
    /// QK-clip's measurement (`optim.qk_clip`, [`Model::logit_max`]): each head's largest
    /// attention logit this step, `[layers of the whole model × this device's heads]`, by the
    /// layer's place in the whole model (so that every virtual stage and slot shares it); the
    /// trainer fills it with −∞ before each step. None without QK-clip.
    pub logit_max: Option<View>,
    /// The buffers shared by all layers, by name.
    shared: std::collections::HashMap<&'static str, View>,
}

/// Index of `Plan::scalars` holding the sum of the per-token losses.
pub const LOSS_SUM: usize = 0;
/// Index of `Plan::scalars` holding the squared gradient norm.
pub const GRAD_NORM_SQ: usize = 1;
/// Index of `Plan::scalars` where a step adds up its micro-batches' loss sums on the device, so
/// that the host reads the losses once per step.
pub const LOSS_ACCUM: usize = 2;

/// Every planned activation starts at a multiple of this many elements (128 bytes in bf16), so
/// that kernels may move rows 16 bytes at a time whatever the batch shape.
const ALIGN: usize = 64;

/// Elements of the buffers [`Model::plan`] allocates for one batch shape, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationSizes {
    /// [`BufKind::Activations`] elements (bf16 on a GPU).
    pub activations: usize,
    /// [`BufKind::Scalars`] elements (always f32), the RoPE table aside.
    pub scalars: usize,
    /// [`BufKind::Fp8`] elements (one byte on a GPU): the casts of FP8 products.
    pub fp8: usize,
    /// `u32` index entries (tokens, targets, routing tables).
    pub indices: usize,
}

impl Model {
    /// Allocates the flat buffers, the inputs and the activations for micro-batches of `batch`
    /// sequences of `seq` tokens. Parameters start at zero; see [`init`](super::init) and
    /// [`Backend::upload`].
    ///
    /// Activations come from two buffers: [`BufKind::Activations`] for what the matrix products
    /// read and write (bf16 on a GPU), [`BufKind::Scalars`] for the small statistics kept in f32
    /// everywhere (norm and softmax statistics, losses, routing weights and probabilities).
    pub fn plan<B: Backend>(&self, be: &mut B, batch: usize, seq: usize) -> Plan {
        self.plan_with(be, batch, seq, true)
    }

    /// [`Model::plan`], with the flat parameter and gradient buffers only if `flat`: under FSDP
    /// the exchange lends each unit its buffers ([`Exchange::params_needed`]), and the plan's
    /// are empty.
    pub fn plan_with<B: Backend>(&self, be: &mut B, batch: usize, seq: usize, flat: bool) -> Plan {
        self.plan_slot(be, batch, seq, flat, None)
    }

    /// [`Model::plan_with`] for another micro-batch in flight on a pipeline stage, beside
    /// `first` (`reuse`): it takes its own inputs and the activations its backward pass reads,
    /// and shares `first`'s parameters' buffers, backward scratch and the buffers the
    /// recomputation policy refills (all of its plans then refill the last layer's too:
    /// [`Plan::refill_last`]).
    pub fn plan_slot<B: Backend>(
        &self,
        be: &mut B,
        batch: usize,
        seq: usize,
        flat: bool,
        reuse: Option<&Plan>,
    ) -> Plan {
        let len = if flat { self.layout.len } else { 0 };
        let (params, grads) = (be.alloc(BufKind::Params, len), be.alloc(BufKind::Grads, len));
        let n = batch * seq;
        let idx = be.alloc_idx(2 * n + self.extra_idx_len(n));
        let sizes = self.measure(batch, seq, reuse.is_some());
        let bufs = [BufKind::Activations, BufKind::Scalars, BufKind::Fp8]
            .map(|kind| be.alloc(kind, [sizes.activations, sizes.scalars, sizes.fp8][kind_index(kind)]));
        let mut next = [0usize; 3];
        let mut plan = self.plan_activations(
            batch,
            seq,
            idx,
            &mut |kind, len| {
                let i = kind_index(kind);
                let v = bufs[i].at(next[i], len);
                next[i] += len.next_multiple_of(ALIGN);
                v
            },
            reuse,
        );
        plan.params = params;
        plan.grads = grads;
        if let (Some(f), None) = (plan.fp8, reuse) {
            be.upload(f.states, &f.initial_states());
        }
        for state in plan.layers.iter().flat_map(|a| a.fp8_inputs.iter().flatten().filter_map(|k| k.state)) {
            be.upload(state, &crate::backend::fp8::State::initial(crate::backend::fp8::Fp8Format::E4M3, 0));
        }
        if plan.ones.len > 0 {
            be.upload(plan.ones, &vec![1.0; n]);
        }
        if !self.config.is_gpt() {
            plan.rope = be.alloc(BufKind::Scalars, seq * self.config.rope_dim());
            if self.config.rope_local_theta > 0.0 {
                plan.rope_local = be.alloc(BufKind::Scalars, seq * self.config.rope_dim());
            }
        }
        self.set_positions(be, &plan, &self.seq.positions(seq));
        plan
    }

    /// Gives the plan's rows of each sequence these true positions (RoPE's angles, or the GPT
    /// family's learned positions): the plan's own chunks, or (a test's fault) others.
    pub(crate) fn set_positions<B: Backend>(&self, be: &mut B, plan: &Plan, positions: &[usize]) {
        assert_eq!(positions.len(), plan.seq);
        if self.config.is_gpt() {
            let n = plan.batch * plan.seq;
            let all: Vec<u32> = (0..n).map(|i| positions[i % plan.seq] as u32).collect();
            be.upload_idx(plan.positions, &all);
        } else {
            be.upload(plan.rope, &rope::table_at(&self.config, positions));
            if let Some(local) = rope::local_table_at(&self.config, positions) {
                be.upload(plan.rope_local, &local);
            }
        }
    }

    /// Elements [`Model::plan`] takes for activations, statistics and indices at this batch
    /// shape (under this model's recomputation policy).
    pub fn activation_elements(&self, batch: usize, seq: usize) -> ActivationSizes {
        self.measure(batch, seq, false)
    }

    /// Elements [`Model::plan_slot`] takes for each further micro-batch in flight.
    pub fn slot_activation_elements(&self, batch: usize, seq: usize) -> ActivationSizes {
        self.measure(batch, seq, true)
    }

    /// Elements of a first plan, or of a further slot (`slot`).
    fn measure(&self, batch: usize, seq: usize, slot: bool) -> ActivationSizes {
        let n = batch * seq;
        let idx_len = 2 * n + self.extra_idx_len(n);
        let idx = IdxView { buf: BufId(u32::MAX), offset: 0, len: idx_len };
        let dummy = |_: BufKind, len: usize| View { buf: BufId(u32::MAX), offset: 0, len };
        let first = slot.then(|| self.plan_activations(batch, seq, idx, &mut dummy.clone(), None));
        let mut totals = [0usize; 3];
        let mut count = |kind, len: usize| {
            totals[kind_index(kind)] += len.next_multiple_of(ALIGN);
            dummy(kind, len)
        };
        self.plan_activations(batch, seq, idx, &mut count, first.as_ref());
        let [activations, scalars, fp8] = totals;
        ActivationSizes { activations, scalars, fp8, indices: idx_len }
    }

    /// Index entries beyond tokens and targets: the routing tables of the stage's MoE layers,
    /// the positions of the GPT family.
    fn extra_idx_len(&self, n: usize) -> usize {
        let positions = if self.config.is_gpt() { n } else { 0 };
        let (bounds, whole) = self.document_idx_len(n);
        positions
            + bounds
            + whole
            + match &self.config.moe {
                None => 0,
                Some(moe) => {
                    self.layout.layers.len()
                        * (3 * n * moe.top_k + moe.num_experts + 1 + self.local_offsets_len(moe.num_experts))
                }
            }
    }

    /// Index entries of a layer's tables of received rows on an expert axis: `L + 1` offsets
    /// for each of the `n` senders (none without the axis).
    fn local_offsets_len(&self, experts: usize) -> usize {
        let n = self.expert_ranks;
        if n > 1 { n * (experts / n + 1) } else { 0 }
    }

    /// Index entries of document masking for `n` rows: the bounds, and the whole sequences'
    /// tokens on a seq axis.
    fn document_idx_len(&self, n: usize) -> (usize, usize) {
        match (self.documents, self.seq.ranks) {
            (None, _) => (0, 0),
            (Some(_), 1) => (2 * n, 0),
            (Some(_), ranks) => (2 * ranks * n, ranks * n),
        }
    }

    /// Carves every activation out of `take` (kind, length), in a fixed order (run once to
    /// measure, once to place). Activations the recomputation policy refills in the backward
    /// pass are taken once and shared by all layers.
    fn plan_activations(
        &self,
        batch: usize,
        seq: usize,
        idx: IdxView,
        take: &mut dyn FnMut(BufKind, usize) -> View,
        reuse: Option<&Plan>,
    ) -> Plan {
        use BufKind::{Activations as A, Scalars as S};
        let m = &self.config;
        let (n, d, f, v) = (batch * seq, m.d_model, m.mlp_dim, m.vocab_size);
        let (q, qkv) = (m.q_dim(), m.q_dim() + 2 * m.kv_dim());
        let (experts, k) = m.moe.as_ref().map_or((0, 1), |moe| (moe.num_experts, moe.top_k));
        // Widths of the dense layers' MLP and of the shared experts'.
        let dense_f = m.dense_mlp_dim();
        let shared_f = m.moe.as_ref().map_or(0, |moe| moe.shared_experts * f);
        let mut next_idx = 2 * n;
        let mut take_idx = |len: usize| {
            let v = idx.at(next_idx, len);
            next_idx += len;
            v
        };
        // The GPT family: positions, LayerNorm's two statistics per row, `c_fc`'s F columns.
        let gpt = m.is_gpt();
        let positions = take_idx(if gpt { n } else { 0 });
        let (bounds_len, whole_len) = self.document_idx_len(n);
        let bounds = take_idx(bounds_len);
        let whole_tokens = take_idx(whole_len);
        let (stats, up) = if gpt { (2, dense_f) } else { (1, 2 * dense_f) };
        // Which activations one buffer serves for all layers: the cheap ones under `minimal`,
        // all but the layer input (and the routing tables) under `full`.
        let (full, minimal) = (self.remat == Remat::Full, self.remat != Remat::None);
        // A further slot shares the first's refilled buffers and backward scratch.
        let mut shared: std::collections::HashMap<&'static str, View> =
            reuse.map(|r| r.shared.clone()).unwrap_or_default();
        let mut act = |name: &'static str, kind: BufKind, len: usize, share: bool| -> View {
            if share { *shared.entry(name).or_insert_with(|| take(kind, len)) } else { take(kind, len) }
        };
        let rows = n * k;
        // On an expert axis, the most rows this device's experts can receive.
        let ep = self.expert_ranks > 1;
        let capacity = m.moe.as_ref().map_or(rows, |moe| moe.capacity(n));
        let received = m.moe.as_ref().map_or(rows, |moe| moe.most_received(n, self.expert_ranks));
        let ep_only = |len: usize| if ep { len } else { 0 };
        let local_offsets_len = self.local_offsets_len(experts);
        let stage_layers: Vec<usize> = self.layout.stage.layer_indices().collect();
        // Inputs kept in FP8 need no bf16 copy of their own.
        let kept = self.fp8_kept(n);
        let [kept_ln1, kept_ln2, kept_h] = [Linear::Qkv, Linear::Up, Linear::Down].map(|l| kept[l as usize]);
        let layers = stage_layers
            .iter()
            .map(|&layer| {
                let x = act("x", A, n * d, false);
                let ln1 = act("ln1", A, n * d, minimal || kept_ln1);
                let rstd1 = act("rstd1", S, stats * n, full);
                let qkv_v = act("qkv", A, n * qkv, full);
                let qk = m.qk_norm().then(|| {
                    (act("qkv_raw", A, n * qkv, full), act("qk_rstd", S, n * (m.n_heads + m.n_kv_heads), full))
                });
                let attn = act("attn", A, n * q, full);
                let lse = act("lse", S, n * m.n_heads, full);
                let xmid = act("xmid", A, n * d, full);
                let ln2 = act("ln2", A, n * d, minimal || kept_ln2);
                let rstd2 = act("rstd2", S, stats * n, full);
                let mla = m.mla.as_ref().map(|a| {
                    let q_rank = a.q_lora_rank;
                    MlaActs {
                        q_lat: act("mla_q_lat", A, n * q_rank, full),
                        q_lat_n: act("mla_q_lat_n", A, n * q_rank, full),
                        q_rstd: act("mla_q_rstd", S, if q_rank > 0 { n } else { 0 }, full),
                        q: act("mla_q", A, n * q, full),
                        kv_lat: act("mla_kv_lat", A, n * a.kv_lora_rank, full),
                        kv_lat_n: act("mla_kv_lat_n", A, n * a.kv_lora_rank, full),
                        kv_rstd: act("mla_kv_rstd", S, n, full),
                        kpe: act("mla_kpe", A, n * a.rope_dim, full),
                        kv: act("mla_kv", A, n * m.n_heads * (a.nope_dim + a.v_dim), full),
                        attn_v: act("mla_attn_v", A, n * m.n_heads * a.v_dim, full),
                    }
                });
                let mlp = match &m.moe {
                    Some(moe) if moe.is_dense(layer) => {
                        MlpActs::Dense { gu: act("gu", A, n * up, full), h: act("h", A, n * dense_f, minimal) }
                    }
                    None => MlpActs::Dense { gu: act("gu", A, n * up, full), h: act("h", A, n * f, minimal || kept_h) },
                    Some(moe) => {
                        let dispatch = MoeDispatch {
                            tokens: n,
                            experts,
                            top_k: k,
                            routing: routing(moe),
                            capacity,
                            expert: take_idx(rows),
                            weight: act("weight", S, rows, false),
                            slot_row: take_idx(rows),
                            row_slot: take_idx(rows),
                            offsets: take_idx(experts + 1),
                            stats: act("stats", S, MoeDispatch::stats_len(experts), false),
                        };
                        MlpActs::Moe {
                            logits: act("router_logits", S, n * experts, full),
                            probs: act("probs", S, n * experts, full),
                            dispatch,
                            // On an expert axis the backward pass reads the received rows instead.
                            xe: act("xe", A, rows * d, full || ep),
                            gu: act("moe_gu", A, received * 2 * f, full),
                            h: act("moe_h", A, received * f, minimal),
                            ye: act("ye", A, rows * d, full),
                            xr: act("xr", A, ep_only(received * d), full),
                            local_offsets: take_idx(local_offsets_len),
                            shared: (shared_f > 0).then(|| {
                                (act("shared_gu", A, n * 2 * shared_f, full), act("shared_h", A, n * shared_f, minimal))
                            }),
                        }
                    }
                };
                let post = m.sandwich_norms().then(|| PostActs {
                    attn_y: act("attn_y", A, n * d, full),
                    attn_rstd: act("attn_post_rstd", S, n, full),
                    mlp_y: act("mlp_y", A, n * d, false),
                    mlp_rstd: act("mlp_post_rstd", S, n, false),
                });
                let fp8_inputs = self.plan_kept_inputs(n, kept, &mut |kind, len| act("fp8_input", kind, len, false));
                LayerActs { x, ln1, rstd1, qkv: qkv_v, qk, attn, lse, xmid, ln2, rstd2, mlp, mla, post, fp8_inputs }
            })
            .collect();
        let moe = m.moe.is_some();
        let moe_only = |len: usize| if moe { len } else { 0 };
        // The head's activations live on the last stage only.
        let last = self.layout.stage.last;
        let last_only = |len: usize| if last { len } else { 0 };
        let mut scratch = |kind: BufKind, len: usize, of: fn(&Plan) -> View| match reuse {
            Some(r) => of(r),
            None => take(kind, len),
        };
        let moe_out = scratch(A, moe_only(n * d), |r| r.moe_out);
        let dln = scratch(A, n * d, |r| r.dln);
        let dpost = scratch(A, if m.sandwich_norms() { n * d } else { 0 }, |r| r.dpost);
        let dqkv = scratch(A, n * qkv, |r| r.dqkv);
        let dattn = scratch(A, n * q, |r| r.dattn);
        // The widest of the routed experts' rows, the dense layers' and the shared experts'.
        let routed = if moe { received } else { 0 };
        let mlp_width = (routed * f).max(n * dense_f).max(n * shared_f);
        let dgu = scratch(A, 2 * mlp_width, |r| r.dgu);
        let dh = scratch(A, mlp_width, |r| r.dh);
        let dye = scratch(A, moe_only(rows * d), |r| r.dye);
        let dxe = scratch(A, moe_only(rows * d), |r| r.dxe);
        let yr = scratch(A, moe_only(ep_only(received * d)), |r| r.yr);
        let parts = scratch(A, moe_only(ep_only(received * d)), |r| r.parts);
        let dweight = scratch(S, moe_only(rows), |r| r.dweight);
        let drouter = scratch(A, moe_only(n * experts), |r| r.drouter);
        let dqk_norm = scratch(S, if m.qk_norm() { 2 * m.head_dim } else { 0 }, |r| r.dqk_norm);
        let mla_len = |of: fn(&crate::config::MlaConfig) -> usize| m.mla.as_ref().map_or(0, |a| n * of(a));
        let heads = m.n_heads;
        let dmla = [
            scratch(A, if m.mla.is_some() { n * q } else { 0 }, |r| r.dmla[0]),
            scratch(A, m.mla.as_ref().map_or(0, |a| n * heads * (a.nope_dim + a.v_dim)), |r| r.dmla[1]),
            scratch(A, mla_len(|a| a.rope_dim), |r| r.dmla[2]),
            scratch(A, mla_len(|a| a.q_lora_rank), |r| r.dmla[3]),
            scratch(A, mla_len(|a| a.kv_lora_rank), |r| r.dmla[4]),
            scratch(A, m.mla.as_ref().map_or(0, |a| n * heads * a.v_dim), |r| r.dmla[5]),
            scratch(A, mla_len(|a| a.kv_lora_rank), |r| r.dmla[6]),
            scratch(A, mla_len(|a| a.q_lora_rank), |r| r.dmla[7]),
        ];
        let gathered = if self.seq.ranks > 1 { self.seq.ranks * n * qkv } else { 0 };
        let qkv_all = scratch(A, gathered, |r| r.qkv_all);
        let dqkv_all = scratch(A, gathered, |r| r.dqkv_all);
        Plan {
            batch,
            seq,
            params: take(A, 0),
            grads: take(A, 0),
            tokens: idx.at(0, n),
            targets: idx.at(n, n),
            positions,
            bounds,
            whole_tokens,
            qkv_all,
            dqkv_all,
            ones: take(A, if gpt || m.family == crate::config::Family::GptOss { n } else { 0 }),
            x_out: take(A, n * d),
            lnf: take(A, last_only(n * d)),
            rstdf: take(S, last_only(stats * n)),
            logits: take(A, last_only(n * v)),
            precap: take(A, if m.final_logit_softcap > 0.0 { last_only(n * v) } else { 0 }),
            losses: take(S, last_only(n)),
            vocab_stats: take(S, last_only(3 * n)),
            scalars: take(S, 4),
            rope: take(S, 0),
            rope_local: take(S, 0),
            layers,
            stats: take(S, moe_only(MoeDispatch::stats_len(experts))),
            moe_out,
            // Each slot's own: it carries the gradient between stages.
            dres: take(A, n * d),
            dln,
            dpost,
            dqkv,
            dattn,
            dgu,
            dh,
            dye,
            dxe,
            yr,
            parts,
            dweight,
            drouter,
            dqk_norm,
            dmla,
            refill_last: reuse.is_some(),
            fp8: self.plan_fp8(n, take, reuse),
            logit_max: self.logit_max.then(|| match reuse {
                Some(first) => first.logit_max.expect("internal error: a slot without the first's logit maxima"),
                None => take(BufKind::Scalars, self.config.n_layers * self.config.n_heads),
            }),
            shared,
        }
    }
}

/// Which of a plan's three buffers holds a kind of activation: the activations (what the other
/// kinds are not), the f32 statistics, the FP8 casts.
fn kind_index(kind: BufKind) -> usize {
    match kind {
        BufKind::Scalars => 1,
        BufKind::Fp8 => 2,
        _ => 0,
    }
}

impl Plan {
    /// `[N, D]` the stage's input: the embedding's output, or on a later stage the activation
    /// the stage before sends.
    pub fn stage_input(&self) -> View {
        self.layers.first().map_or(self.x_out, |a| a.x)
    }

    /// `[N, D]` the stage's output, the last layer's, which a stage before the last sends on.
    pub fn stage_output(&self) -> View {
        self.x_out
    }

    /// `[N, D]` the residual stream's gradient: after a backward pass, the gradient of the
    /// stage's input (sent to the stage before); before a stage's backward pass (but the
    /// last's), the gradient of its output (received from the next).
    pub fn residual_grad(&self) -> View {
        self.dres
    }

    /// `[2E]` the routing statistics summed over the layers so far (MoE; empty otherwise),
    /// which travel with the activations and their gradients between stages.
    pub fn moe_stats(&self) -> View {
        self.stats
    }

    /// Where `unit`'s parameters are for `pass`: where the exchange put them, else the flat
    /// buffer.
    pub(super) fn params_of<B: Backend>(&self, ex: &mut dyn Exchange<B>, be: &mut B, unit: Unit, pass: Pass) -> Window {
        ex.params_needed(be, unit, pass).unwrap_or(Window::whole(self.params))
    }

    /// Where `unit`'s gradient accumulates.
    pub(super) fn grads_of<B: Backend>(&self, ex: &mut dyn Exchange<B>, be: &mut B, unit: Unit) -> Window {
        ex.grads_needed(be, unit).unwrap_or(Window::whole(self.grads))
    }
}

/// The routing rule of `moe`'s routers, without the selection bias (a parameter the forward
/// pass reads from the layer's weights).
fn routing(moe: &crate::config::MoeConfig) -> crate::backend::Routing {
    crate::backend::Routing {
        scoring: moe.scoring,
        renormalize: moe.renormalize,
        groups: moe.groups,
        top_groups: moe.top_groups,
        scale: moe.routed_scale as f32,
        bias: None,
    }
}
