//! The transformer, written once against [`Backend`]: its parameter layout, the activation plan
//! for a batch shape, and the forward and backward passes.
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

pub mod init;
pub mod layout;
pub mod memory;
pub mod rope;
#[cfg(test)]
mod tests;

use crate::backend::{AttnShape, Backend, BufId, BufKind, ExpertWeights, IdxView, MatMul, MoeDispatch, SeqSplit, View};
use crate::config::{Gelu, ModelConfig, Remat};
pub use layout::{LayerBiases, LayerOffsets, Layout, MlpOffsets, Tensor};

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

/// A stretch of the flat buffers the passes read or finish as one piece: the unit of the
/// per-layer collectives (FSDP's gathers and reduce-scatters, data parallelism's buckets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Everything before the first layer: the token embedding.
    Embed,
    /// Layer `i`.
    Layer(usize),
    /// Everything after the last layer: the final norm and the output head (unless tied).
    Head,
}

/// What the passes exchange with the other devices of a parallel run, at the points where
/// the math needs it. A single device needs nothing: [`Alone`].
///
/// Tensor parallelism (Megatron-LM): each device of the tensor group holds a slice of the
/// heads and of the MLP columns (`parallel::tensor`), so the products that leave a
/// slice (`o_proj`, `down_proj`, the experts' `w2`) give partial sums, added up over the group
/// before the residual add; in the backward pass the same happens to the gradient that
/// reaches each RMSNorm from the sliced products.
///
/// FSDP (ZeRO-3): no device holds the whole model. Before a pass reads a unit's parameters it
/// asks where they are ([`Exchange::params_needed`]: the exchange gathers them into a buffer it
/// lends for the time of the use), says when it is done with them ([`Exchange::params_done`]),
/// and asks where to accumulate a unit's gradient ([`Exchange::grads_needed`]) before handing
/// it over ([`Exchange::grads_ready`]). `None` means the plan's flat buffers.
pub trait Exchange<B: Backend> {
    /// Whether this device adds the residual stream to the partial sums of the sliced products
    /// (exactly one device of a tensor group does, so that the sum counts it once).
    fn adds_residual(&self) -> bool {
        true
    }
    /// `buf = Σ_tensor group buf`, in place.
    fn tensor_sum(&mut self, _be: &mut B, _buf: View) {}
    /// `buf = Σ buf` over the devices that share the global batch (routing statistics).
    fn batch_sum(&mut self, _be: &mut B, _buf: View) {}
    /// This device's position in its tensor group and the group's size (vocabulary
    /// parallelism: with a vocab_size of `V` rows, it holds tokens `position · V ..`).
    fn tensor_rank_for_vocab(&self) -> (usize, usize) {
        (0, 1)
    }
    /// `buf = max_tensor group buf`, in place (the vocabulary-parallel loss's row maxima).
    fn tensor_max_for_vocab(&mut self, _be: &mut B, _buf: View) {}
    /// Called when a pass begins, before any other call of the pass.
    fn pass_begins(&mut self, _be: &mut B, _pass: Pass) {}
    /// Where the parameters of `unit` are, before `pass` first reads them.
    fn params_needed(&mut self, _be: &mut B, _unit: Unit, _pass: Pass) -> Option<Window> {
        None
    }
    /// Called once `pass` has read `unit`'s parameters for the last time. The forward pass does
    /// not call it for the head (and the embedding it may be tied to): the backward pass reads
    /// them next.
    fn params_done(&mut self, _be: &mut B, _unit: Unit, _pass: Pass) {}
    /// Where the gradient of `unit` accumulates, before the backward pass first writes it.
    fn grads_needed(&mut self, _be: &mut B, _unit: Unit) -> Option<Window> {
        None
    }
    /// Called once the backward pass has written its last gradient into `unit`.
    fn grads_ready(&mut self, _be: &mut B, _unit: Unit) {}
    /// `all = [local of every rank of the seq group]`, rank-major: an all-gather over the
    /// sequence axis. Called only when the model's [`SeqSplit`] has more than one rank.
    fn seq_gather(&mut self, be: &mut B, local: View, all: View) {
        be.copy(all, local);
    }
    /// `local = Σ_seq group all[this rank's part]`: a reduce-scatter over the sequence axis.
    fn seq_scatter_sum(&mut self, be: &mut B, all: View, local: View) {
        be.copy(local, all);
    }
}

/// Which pass reads the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The forward pass (training or evaluation).
    Forward,
    /// The backward pass (recomputation included).
    Backward,
}

/// Where a unit's parameters or gradients are: a buffer that holds the unit (or the whole flat
/// buffer), addressed with the layout's offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    buf: View,
    /// The layout offset of `buf`'s first element.
    start: usize,
}

impl Window {
    /// The whole flat buffer.
    pub fn whole(buf: View) -> Window {
        Window { buf, start: 0 }
    }

    /// A buffer holding the layout's elements from `start` on (a unit's).
    pub fn from(buf: View, start: usize) -> Window {
        Window { buf, start }
    }

    /// The same buffer addressed with offsets `by` lower: those of a layout that is a part of
    /// this one starting at `by` (a virtual stage's, inside its device's).
    pub fn rebased(self, by: usize) -> Window {
        Window { buf: self.buf, start: self.start - by }
    }

    /// The tensor at layout offset `offset`, `len` elements.
    pub fn at(self, offset: usize, len: usize) -> View {
        self.buf.at(offset - self.start, len)
    }
}

/// The [`Exchange`] of a single device: nothing to exchange.
pub struct Alone;

impl<B: Backend> Exchange<B> for Alone {}

/// Activations of one layer kept for the backward pass. Under recomputation some of these views
/// are shared by all layers and refilled before each layer's backward pass.
struct LayerActs {
    /// `[N, D]` input of the layer (the residual stream).
    x: View,
    ln1: View,
    /// `[N]` RMSNorm's rstd; `[2N]` LayerNorm's mean then rstd (the GPT family), as `rstd2`.
    rstd1: View,
    /// `[N, (H + 2 KV) · Dh]` q, k (after RoPE) and v.
    qkv: View,
    /// `[N, H · Dh]` attention output, before `o_proj`.
    attn: View,
    /// `[N, H]` log-sum-exp of the attention scores.
    lse: View,
    /// `[N, D]` residual stream after attention.
    xmid: View,
    ln2: View,
    rstd2: View,
    mlp: MlpActs,
}

#[allow(clippy::large_enum_variant)] // one per layer, built once
enum MlpActs {
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
        /// `[N · k, 2F]`, `[N · k, F]`, `[N · k, D]` the experts' activations and outputs.
        gu: View,
        h: View,
        ye: View,
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
    /// its document under [`Documents::reset_positions`].
    positions: IdxView,
    /// `[2N]` where each token's document begins in its sequence, then where it ends (document
    /// masking, [`Backend::document_bounds`]; empty without), from the tokens at every forward
    /// pass; on a seq axis, `[2 · ranks · N]`: the whole sequences', by true position.
    bounds: IdxView,
    /// `[ranks · N]` the whole sequences' tokens, for document masking on a seq axis (empty
    /// otherwise): each device finds the EOS of every chunk in them.
    pub whole_tokens: IdxView,
    /// `[ranks · N, (H + 2 KV) · Dh]` every seq rank's q, k and v rows, gathered for attention
    /// (empty without a sequence axis); shared by the layers and the slots.
    qkv_all: View,
    /// The gradient of `qkv_all`, before it is summed over the sequence axis.
    dqkv_all: View,
    /// `[N]` ones: the column a bias is added with (the GPT family).
    ones: View,
    /// `[N]` per-token cross-entropy.
    pub losses: View,
    /// `[3N]` on the last stage, the vocabulary-parallel loss's row maxima, then its sums of
    /// exponentials and the target logits (each reduced over the tensor group).
    vocab_stats: View,
    /// `[N, V]` logits; after a training forward pass, their gradient.
    pub logits: View,
    /// `[4]`: sum of the losses ([`LOSS_SUM`]); the squared gradient norm ([`GRAD_NORM_SQ`]);
    /// the step's accumulated loss sum ([`LOSS_ACCUM`]); spare.
    pub scalars: View,
    rope: View,
    layers: Vec<LayerActs>,
    x_out: View,
    lnf: View,
    rstdf: View,
    /// `[2E]` routing statistics summed over the model's layers (MoE): tokens routed to each
    /// expert, then each expert's router probabilities. A pipeline stage adds its layers' to
    /// those of the stages before it, and its backward pass reads the whole model's.
    stats: View,
    /// `[N, D]` the MoE layer's combined output before the residual add.
    moe_out: View,
    // Backward scratch, shared by the layers.
    dres: View,
    dln: View,
    dqkv: View,
    dattn: View,
    dgu: View,
    dh: View,
    dye: View,
    dxe: View,
    dweight: View,
    drouter: View,
    /// Whether the backward pass refills the last layer's shared activations too: when
    /// several micro-batches in flight share them ([`Model::plan_slot`]), another's forward
    /// pass may have overwritten them.
    pub refill_last: bool,
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
    /// `u32` index entries (tokens, targets, routing tables).
    pub indices: usize,
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
            batch_shards: 1,
            seq: SeqSplit::WHOLE,
            documents: None,
            #[cfg(test)]
            fault_local_vocab_max: false,
        }
    }

    /// The stage this model is (the whole model: the stage that is first and last).
    pub fn stage(&self) -> &Stage {
        &self.layout.stage
    }

    pub(crate) fn attn_shape(&self, batch: usize, seq: usize) -> AttnShape {
        let m = &self.config;
        AttnShape {
            batch,
            seq,
            n_heads: m.n_heads,
            n_kv_heads: m.n_kv_heads,
            head_dim: m.head_dim,
            window: m.sliding_window,
        }
    }

    /// Allocates the flat buffers, the inputs and the activations for micro-batches of `batch`
    /// sequences of `seq` tokens. Parameters start at zero; see [`init`] and [`Backend::upload`].
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
        let (acts, stats) =
            (be.alloc(BufKind::Activations, sizes.activations), be.alloc(BufKind::Scalars, sizes.scalars));
        let mut next = [0usize; 2];
        let mut plan = self.plan_activations(
            batch,
            seq,
            idx,
            &mut |kind, len| {
                let (buf, i) = if kind == BufKind::Scalars { (stats, 1) } else { (acts, 0) };
                let v = buf.at(next[i], len);
                next[i] += len.next_multiple_of(ALIGN);
                v
            },
            reuse,
        );
        plan.params = params;
        plan.grads = grads;
        if self.config.is_gpt() {
            be.upload(plan.ones, &vec![1.0; n]);
        } else {
            plan.rope = be.alloc(BufKind::Scalars, seq * self.config.head_dim);
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
        let mut sizes = ActivationSizes { activations: 0, scalars: 0, indices: idx_len };
        let mut count = |kind, len: usize| {
            let total = if kind == BufKind::Scalars { &mut sizes.scalars } else { &mut sizes.activations };
            *total += len.next_multiple_of(ALIGN);
            dummy(kind, len)
        };
        self.plan_activations(batch, seq, idx, &mut count, first.as_ref());
        sizes
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
                Some(moe) => self.layout.layers.len() * (3 * n * moe.top_k + moe.num_experts + 1),
            }
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
        let (stats, up) = if gpt { (2, f) } else { (1, 2 * f) };
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
        let layers = (0..self.layout.layers.len())
            .map(|_| {
                let x = act("x", A, n * d, false);
                let ln1 = act("ln1", A, n * d, minimal);
                let rstd1 = act("rstd1", S, stats * n, full);
                let qkv_v = act("qkv", A, n * qkv, full);
                let attn = act("attn", A, n * q, full);
                let lse = act("lse", S, n * m.n_heads, full);
                let xmid = act("xmid", A, n * d, full);
                let ln2 = act("ln2", A, n * d, minimal);
                let rstd2 = act("rstd2", S, stats * n, full);
                let mlp = match &m.moe {
                    None => MlpActs::Dense { gu: act("gu", A, n * up, full), h: act("h", A, n * f, minimal) },
                    Some(_) => {
                        let dispatch = MoeDispatch {
                            tokens: n,
                            experts,
                            top_k: k,
                            expert: take_idx(rows),
                            weight: act("weight", S, rows, false),
                            slot_row: take_idx(rows),
                            row_slot: take_idx(rows),
                            offsets: take_idx(experts + 1),
                            stats: act("stats", S, 2 * experts, false),
                        };
                        MlpActs::Moe {
                            logits: act("router_logits", S, n * experts, full),
                            probs: act("probs", S, n * experts, full),
                            dispatch,
                            xe: act("xe", A, rows * d, full),
                            gu: act("gu", A, rows * 2 * f, full),
                            h: act("h", A, rows * f, minimal),
                            ye: act("ye", A, rows * d, full),
                        }
                    }
                };
                LayerActs { x, ln1, rstd1, qkv: qkv_v, attn, lse, xmid, ln2, rstd2, mlp }
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
        let dqkv = scratch(A, n * qkv, |r| r.dqkv);
        let dattn = scratch(A, n * q, |r| r.dattn);
        let dgu = scratch(A, rows * 2 * f, |r| r.dgu);
        let dh = scratch(A, rows * f, |r| r.dh);
        let dye = scratch(A, moe_only(rows * d), |r| r.dye);
        let dxe = scratch(A, moe_only(rows * d), |r| r.dxe);
        let dweight = scratch(S, moe_only(rows), |r| r.dweight);
        let drouter = scratch(A, moe_only(n * experts), |r| r.drouter);
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
            ones: take(A, if gpt { n } else { 0 }),
            x_out: take(A, n * d),
            lnf: take(A, last_only(n * d)),
            rstdf: take(S, last_only(stats * n)),
            logits: take(A, last_only(n * v)),
            losses: take(S, last_only(n)),
            vocab_stats: take(S, last_only(3 * n)),
            scalars: take(S, 4),
            rope: take(S, 0),
            layers,
            stats: take(S, moe_only(2 * experts)),
            moe_out,
            // Each slot's own: it carries the gradient between stages.
            dres: take(A, n * d),
            dln,
            dqkv,
            dattn,
            dgu,
            dh,
            dye,
            dxe,
            dweight,
            drouter,
            refill_last: reuse.is_some(),
            shared,
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
                    be.add(p.stats, dispatch.stats.at(0, 2 * dispatch.experts));
                }
            }
        }
        if stage.last {
            let (w, head) = self.head_params(be, p, ex, fwd);
            self.norm_forward(be, p.lnf, p.rstdf, p.x_out, w, l.norm);
            be.matmul(p.logits, p.lnf, head, MatMul::linear(n, d, v));
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
    /// `w`. With `out`, the layer's output (the next residual stream) is written there; without,
    /// only the activations the backward pass reads are refilled (recomputation under
    /// `remat = full`).
    fn layer_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        w: Window,
        out: Option<View>,
        ex: &mut dyn Exchange<B>,
    ) {
        let (m, a, o) = (&self.config, &p.layers[i], &self.layout.layers[i]);
        let (n, d, f) = (p.batch * p.seq, m.d_model, m.mlp_dim);
        let (q, qkv) = (m.q_dim(), m.q_dim() + 2 * m.kv_dim());
        let shape = self.attn_shape(p.batch, p.seq);
        let bias = |be: &mut B, out: View, at: Option<usize>, width: usize| {
            if let Some(at) = at {
                be.matmul(out, p.ones, w.at(at, width), MatMul::linear(n, 1, width).accumulating());
            }
        };
        let b = o.bias.as_ref();
        self.norm_forward(be, a.ln1, a.rstd1, a.x, w, o.ln1);
        be.matmul(a.qkv, a.ln1, w.at(o.qkv, qkv * d), MatMul::linear(n, d, qkv));
        bias(be, a.qkv, b.map(|b| b.qkv), qkv);
        if !m.is_gpt() {
            be.rope(a.qkv, p.rope, shape, false);
        }
        if self.seq.ranks > 1 {
            ex.seq_gather(be, a.qkv, p.qkv_all);
            let bounds = self.documents.map(|_| p.bounds);
            be.attention_forward_split(a.attn, a.lse, p.qkv_all, shape, self.seq, bounds);
        } else if self.documents.is_some() {
            be.attention_forward_docs(a.attn, a.lse, a.qkv, shape, p.bounds);
        } else {
            be.attention_forward(a.attn, a.lse, a.qkv, shape);
        }
        row_parallel(be, ex, a.xmid, a.attn, w.at(o.o, d * q), a.x, MatMul::linear(n, q, d));
        bias(be, a.xmid, b.map(|b| b.o), d);
        self.norm_forward(be, a.ln2, a.rstd2, a.xmid, w, o.ln2);
        match (&a.mlp, &o.mlp) {
            (MlpActs::Dense { gu, h }, MlpOffsets::Dense { gate_up, down }) => {
                let up = gu.len / n;
                be.matmul(*gu, a.ln2, w.at(*gate_up, up * d), MatMul::linear(n, d, up));
                bias(be, *gu, b.map(|b| b.up), f);
                self.activation_forward(be, *h, *gu);
                if let Some(out) = out {
                    row_parallel(be, ex, out, *h, w.at(*down, d * f), a.xmid, MatMul::linear(n, f, d));
                    bias(be, out, b.map(|b| b.down), d);
                }
            }
            (MlpActs::Moe { logits, probs, dispatch, xe, gu, h, ye }, MlpOffsets::Moe { router, experts, stride }) => {
                let (gate_up, down) = expert_weights(w, *experts, *stride, d, f);
                be.matmul(*logits, a.ln2, w.at(*router, dispatch.experts * d), MatMul::linear(n, d, dispatch.experts));
                be.moe_route(*probs, *logits, *dispatch);
                ex.batch_sum(be, dispatch.stats);
                be.moe_gather(*xe, a.ln2, *dispatch, d);
                be.moe_expert_matmul(*gu, *xe, gate_up, *dispatch, MatMul::linear(0, d, 2 * f));
                be.swiglu_forward(*h, *gu, f);
                be.moe_expert_matmul(*ye, *h, down, *dispatch, MatMul::linear(0, f, d));
                if let Some(out) = out {
                    be.moe_combine(p.moe_out, *ye, *dispatch, d);
                    ex.tensor_sum(be, p.moe_out);
                    be.copy(out, a.xmid);
                    be.add(out, p.moe_out);
                }
            }
            _ => unreachable!("activations planned for another MLP kind"),
        }
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
                self.activation_forward(be, *h, *gu);
            }
            Remat::Full => self.layer_forward(be, p, i, w, None, ex),
        }
    }

    /// `out = norm(x)` with the norm whose weight is at `at` in `w` (and, for LayerNorm, its bias
    /// right after); `stats` is RMSNorm's `[N]` rstd or LayerNorm's `[2N]` mean then rstd.
    fn norm_forward<B: Backend>(&self, be: &mut B, out: View, stats: View, x: View, w: Window, at: usize) {
        let (d, eps) = (self.config.d_model, self.config.norm_eps as f32);
        if self.config.is_gpt() {
            let n = stats.len / 2;
            be.layernorm_forward(out, stats.at(0, n), stats.at(n, n), x, w.at(at, d), w.at(at + d, d), d, eps);
        } else {
            be.rmsnorm_forward(out, stats, x, w.at(at, d), d, eps);
        }
    }

    /// The backward pass of [`Model::norm_forward`]: the input gradient added to `dx`, the weight
    /// (and bias) gradients to `g` at `at`.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward<B: Backend>(
        &self,
        be: &mut B,
        dx: View,
        g: Window,
        dout: View,
        x: View,
        w: Window,
        at: usize,
        stats: View,
    ) {
        let d = self.config.d_model;
        if self.config.is_gpt() {
            let n = stats.len / 2;
            let (mean, rstd) = (stats.at(0, n), stats.at(n, n));
            be.layernorm_backward(dx, g.at(at, d), g.at(at + d, d), dout, x, w.at(at, d), mean, rstd, d);
        } else {
            be.rmsnorm_backward(dx, g.at(at, d), dout, x, w.at(at, d), stats, d);
        }
    }

    /// The MLP's activation: SwiGLU of `[gate | up]` rows, or (GPT) GELU of `c_fc`'s output.
    fn activation_forward<B: Backend>(&self, be: &mut B, h: View, gu: View) {
        if self.config.is_gpt() {
            be.gelu_forward(h, gu, self.config.gelu == Gelu::Tanh);
        } else {
            be.swiglu_forward(h, gu, self.config.mlp_dim);
        }
    }

    /// The load-balancing loss of the last forward pass (0 without experts), as Hugging Face
    /// computes it for Mixtral over all layers' router outputs together:
    /// `E · Σ_e (tokens routed to e / T) · (Σ router probability of e / T)`, `T = layers · N`.
    pub fn aux_loss<B: Backend>(&self, be: &mut B, p: &Plan) -> f64 {
        let Some(moe) = &self.config.moe else {
            return 0.0;
        };
        let e = moe.num_experts;
        // The statistics summed over the layers of this stage and every stage before it: on
        // the last stage, the whole model's.
        let mut stats = vec![0f32; 2 * e];
        be.download(p.stats, &mut stats);
        let (counts, prob_sums) = stats.split_at(e);
        let total = (self.config.n_layers * p.batch * p.seq * self.batch_shards) as f64;
        e as f64 * counts.iter().zip(prob_sums).map(|(&c, &s)| c as f64 * s as f64).sum::<f64>() / (total * total)
    }

    /// Multiplier that turns the load-balancing loss's gradient into the [`Backend`]'s
    /// `aux_scale`: `coef · E / T²` times the objective's weight of this micro-batch.
    pub fn aux_scale(&self, p: &Plan, weight: f32) -> f32 {
        let Some(moe) = &self.config.moe else {
            return 0.0;
        };
        let total = (self.config.n_layers * p.batch * p.seq * self.batch_shards) as f64;
        (moe.aux_loss_coef * moe.num_experts as f64 / (total * total)) as f32 * weight
    }

    /// The backward pass, after a forward pass with `grad_scale`: accumulates the gradient of
    /// the objective into `plan.grads` (or where the exchange says). `aux_scale` comes from
    /// [`Model::aux_scale`].
    pub fn backward<B: Backend>(&self, be: &mut B, p: &Plan, aux_scale: f32, ex: &mut dyn Exchange<B>) {
        let (m, l) = (&self.config, &self.layout);
        let (n, d, f, v) = (p.batch * p.seq, m.d_model, m.mlp_dim, m.vocab_size);
        let (q, qkv) = (m.q_dim(), m.q_dim() + 2 * m.kv_dim());
        let shape = self.attn_shape(p.batch, p.seq);
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
            // db[O] += dyᵀ · 1: a bias's gradient is the sum of its output's gradient over rows.
            let b = o.bias.as_ref();
            let bias_grad = |be: &mut B, dy: View, at: Option<usize>, width: usize| {
                if let Some(at) = at {
                    be.matmul(g.at(at, width), dy, p.ones, MatMul::linear_dw(n, 1, width));
                }
            };
            match (&a.mlp, &o.mlp) {
                (MlpActs::Dense { gu, h }, MlpOffsets::Dense { gate_up, down }) => {
                    let up = gu.len / n;
                    let (dgu, dh) = (p.dgu.at(0, n * up), p.dh.at(0, n * f));
                    bias_grad(be, p.dres, b.map(|b| b.down), d);
                    be.matmul(dh, p.dres, w.at(*down, d * f), MatMul::linear_dx(n, f, d));
                    be.matmul(g.at(*down, d * f), p.dres, *h, MatMul::linear_dw(n, f, d));
                    if m.is_gpt() {
                        be.gelu_backward(dgu, dh, *gu, m.gelu == Gelu::Tanh);
                    } else {
                        be.swiglu_backward(dgu, dh, *gu, f);
                    }
                    bias_grad(be, dgu, b.map(|b| b.up), f);
                    be.matmul(p.dln, dgu, w.at(*gate_up, up * d), MatMul::linear_dx(n, d, up));
                    be.matmul(g.at(*gate_up, up * d), dgu, a.ln2, MatMul::linear_dw(n, d, up));
                    ex.tensor_sum(be, p.dln);
                }
                (MlpActs::Moe { probs, dispatch, xe, gu, h, ye, .. }, MlpOffsets::Moe { router, experts, stride }) => {
                    let (gate_up, down) = expert_weights(w, *experts, *stride, d, f);
                    let (dgate_up, ddown) = expert_weights(g, *experts, *stride, d, f);
                    let e = dispatch.experts;
                    be.moe_combine_backward(p.dye, p.dweight, p.dres, *ye, *dispatch, d);
                    ex.tensor_sum(be, p.dweight);
                    be.moe_expert_matmul(p.dh, p.dye, down, *dispatch, MatMul::linear_dx(0, f, d));
                    be.moe_expert_matmul_dw(ddown, p.dye, *h, *dispatch, f, d);
                    be.swiglu_backward(p.dgu, p.dh, *gu, f);
                    be.moe_expert_matmul(p.dxe, p.dgu, gate_up, *dispatch, MatMul::linear_dx(0, d, 2 * f));
                    be.moe_expert_matmul_dw(dgate_up, p.dgu, *xe, *dispatch, d, 2 * f);
                    be.moe_gather_backward(p.dln, p.dxe, *dispatch, d);
                    ex.tensor_sum(be, p.dln);
                    be.moe_route_backward(p.drouter, p.dweight, *probs, *dispatch, counts, aux_scale);
                    be.matmul(p.dln, p.drouter, w.at(*router, e * d), MatMul::linear_dx(n, d, e).accumulating());
                    be.matmul(g.at(*router, e * d), p.drouter, a.ln2, MatMul::linear_dw(n, d, e));
                }
                _ => unreachable!("activations planned for another MLP kind"),
            }
            self.norm_backward(be, p.dres, g, p.dln, a.xmid, w, o.ln2, a.rstd2);
            bias_grad(be, p.dres, b.map(|b| b.o), d);
            be.matmul(p.dattn, p.dres, w.at(o.o, d * q), MatMul::linear_dx(n, q, d));
            be.matmul(g.at(o.o, d * q), p.dres, a.attn, MatMul::linear_dw(n, q, d));
            if self.seq.ranks > 1 {
                // The keys and values of every rank again (the forward pass's are another
                // layer's by now), and the gradients of every rank's summed back to their owners.
                ex.seq_gather(be, a.qkv, p.qkv_all);
                let bounds = self.documents.map(|_| p.bounds);
                be.attention_backward_split(p.dqkv_all, p.dattn, p.qkv_all, a.attn, a.lse, shape, self.seq, bounds);
                ex.seq_scatter_sum(be, p.dqkv_all, p.dqkv);
            } else if self.documents.is_some() {
                be.attention_backward_docs(p.dqkv, p.dattn, a.qkv, a.attn, a.lse, shape, p.bounds);
            } else {
                be.attention_backward(p.dqkv, p.dattn, a.qkv, a.attn, a.lse, shape);
            }
            if !m.is_gpt() {
                be.rope(p.dqkv, p.rope, shape, true);
            }
            bias_grad(be, p.dqkv, b.map(|b| b.qkv), qkv);
            be.matmul(p.dln, p.dqkv, w.at(o.qkv, qkv * d), MatMul::linear_dx(n, d, qkv));
            be.matmul(g.at(o.qkv, qkv * d), p.dqkv, a.ln1, MatMul::linear_dw(n, d, qkv));
            ex.tensor_sum(be, p.dln);
            self.norm_backward(be, p.dres, g, p.dln, a.x, w, o.ln1, a.rstd1);
            ex.params_done(be, Unit::Layer(i), bwd);
            ex.grads_ready(be, Unit::Layer(i));
        }
        // A later stage's input gradient stays in `dres`, for the stage before.
        if stage.first {
            let g = p.grads_of(ex, be, Unit::Embed);
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
    fn params_of<B: Backend>(&self, ex: &mut dyn Exchange<B>, be: &mut B, unit: Unit, pass: Pass) -> Window {
        ex.params_needed(be, unit, pass).unwrap_or(Window::whole(self.params))
    }

    /// Where `unit`'s gradient accumulates.
    fn grads_of<B: Backend>(&self, ex: &mut dyn Exchange<B>, be: &mut B, unit: Unit) -> Window {
        ex.grads_needed(be, unit).unwrap_or(Window::whole(self.grads))
    }
}

/// `out = a · bᵀ + residual` for a product whose inner dimension is split over the tensor
/// group: each device's product is a partial sum, the group adds them up, and one device adds
/// the residual so that it counts once.
fn row_parallel<B: Backend>(
    be: &mut B,
    ex: &mut dyn Exchange<B>,
    out: View,
    a: View,
    b: View,
    residual: View,
    shape: MatMul,
) {
    if ex.adds_residual() {
        be.matmul_add(out, a, b, residual, shape);
    } else {
        be.matmul(out, a, b, shape);
    }
    ex.tensor_sum(be, out);
}

/// The experts' `[w1; w3]` (gate and up) and `w2` (down) weights of a layer.
fn expert_weights(w: Window, experts: usize, stride: usize, d: usize, f: usize) -> (ExpertWeights, ExpertWeights) {
    (
        ExpertWeights { first: w.at(experts, 2 * f * d), stride },
        ExpertWeights { first: w.at(experts + 2 * f * d, d * f), stride },
    )
}
