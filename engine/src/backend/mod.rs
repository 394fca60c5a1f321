//! The backend interface: memory and the small set of ops a transformer step needs.
//!
//! The model (`model/`, above this module) is written once against [`Backend`]; a backend owns its memory
//! and hands out [`View`]s (buffer, offset, length) that the model arranges into a plan before
//! the first step. No op allocates tensors, and none returns data to the host: the model reads
//! back only the scalars it logs, with [`Backend::download`].
//!
//! Conventions shared by every op:
//! - matrices are row-major; `[N, D]` means N rows of D contiguous elements;
//! - `N = B · T` token rows, ordered batch-major (row `b · T + t`);
//! - gradients of parameters accumulate (`+=`), so micro-batches add up until the optimizer
//!   consumes and zeroes them; gradients of activations are overwritten unless an op says so;
//! - outputs never overlap inputs (backends may check), except where an op works in place.
//!
//! The CPU backend ([`cpu::Cpu`]) is the f32 reference: deterministic, bit for bit, whatever the
//! thread scheduling.

pub mod cpu;
pub mod cuda;
pub mod fp8;
pub mod traced;

/// Identifies one buffer of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufId(pub u32);

/// A contiguous range of elements of one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct View {
    /// The backend buffer the range lies in.
    pub buf: BufId,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl View {
    /// The sub-range `[offset, offset + len)` of this view.
    pub fn at(self, offset: usize, len: usize) -> View {
        assert!(offset + len <= self.len, "view [{offset}, {}) outside a view of {}", offset + len, self.len);
        View { buf: self.buf, offset: self.offset + offset, len }
    }

    /// Rows `[first, first + count)` of a row-major matrix with `width` columns.
    pub fn rows(self, first: usize, count: usize, width: usize) -> View {
        self.at(first * width, count * width)
    }

    /// Whether two views share an element.
    pub fn overlaps(self, other: View) -> bool {
        self.buf == other.buf && self.offset < other.offset + other.len && other.offset < self.offset + self.len
    }
}

/// A contiguous range of a buffer of `u32` indices (tokens, routing tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IdxView {
    /// The backend buffer the range lies in.
    pub buf: BufId,
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl IdxView {
    /// The sub-range `[offset, offset + len)` of this view.
    pub fn at(self, offset: usize, len: usize) -> IdxView {
        assert!(offset + len <= self.len, "index view [{offset}, {}) outside a view of {}", offset + len, self.len);
        IdxView { buf: self.buf, offset: self.offset + offset, len }
    }
}

/// What a buffer holds. A backend may keep kinds at different precisions: the CPU keeps all in
/// f32; a GPU backend keeps activations and the compute copy of parameters in bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufKind {
    /// The flat parameter buffer.
    Params,
    /// Parameters gathered for the time of a use (FSDP's lent buffers): the ops read them as
    /// they read [`BufKind::Params`], but nothing updates them, so a GPU backend keeps only the
    /// copy the ops read (bf16), and a gather moves and holds 2 bytes an element.
    Gathered,
    /// The flat gradient buffer (same layout as the parameters).
    Grads,
    /// Optimizer moments (same layout as the parameters).
    OptState,
    /// Activations and scratch planned for a batch shape.
    Activations,
    /// Small f32 values: losses, norms, statistics, RoPE tables.
    Scalars,
    /// FP8 operands of products (`train.precision = "fp8"`): one byte an element on a GPU, the
    /// FP8 values held in f32 on the CPU reference.
    Fp8,
}

/// Bytes in GiB (2³⁰ bytes), for messages about memory: a device's, a backend's allocations,
/// an estimate's.
pub fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `out[m, n] (+)= op(a)[m, k] · op(b)[k, n]`, where `op(x)` is `x` or its transpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatMul {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// `a` is stored `[k, m]` and used transposed (else stored `[m, k]`).
    pub a_t: bool,
    /// `b` is stored `[n, k]` and used transposed (else stored `[k, n]`).
    pub b_t: bool,
    /// Add to `out` instead of overwriting it.
    pub accumulate: bool,
}

impl MatMul {
    /// `y[N, O] = x[N, I] · W[O, I]ᵀ`: a linear layer with a weight stored `[out, in]`.
    pub fn linear(n: usize, inp: usize, out: usize) -> MatMul {
        MatMul { m: n, n: out, k: inp, a_t: false, b_t: true, accumulate: false }
    }

    /// `dx[N, I] = dy[N, O] · W[O, I]`: the input gradient of [`MatMul::linear`].
    pub fn linear_dx(n: usize, inp: usize, out: usize) -> MatMul {
        MatMul { m: n, n: inp, k: out, a_t: false, b_t: false, accumulate: false }
    }

    /// `dW[O, I] += dy[N, O]ᵀ · x[N, I]`: the weight gradient of [`MatMul::linear`].
    pub fn linear_dw(n: usize, inp: usize, out: usize) -> MatMul {
        MatMul { m: out, n: inp, k: n, a_t: true, b_t: false, accumulate: true }
    }

    /// The same product, accumulating into the output.
    pub fn accumulating(self) -> MatMul {
        MatMul { accumulate: true, ..self }
    }

    /// Floating-point operations of the product (2 per multiply-add).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// Shape of causal attention over a packed `qkv` buffer whose rows are
/// `[q: n_heads · head_dim | k: n_kv_heads · head_dim | v: n_kv_heads · head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (divides `n_heads`).
    pub n_kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Sliding window W (query i sees keys j with i - W < j <= i); 0 for none.
    pub window: usize,
    /// The softmax's scale of `q · kᵀ`; `None`: `1 / sqrt(head_dim)`. Gemma 3's
    /// `query_pre_attn_scalar` s makes it `1 / sqrt(s)`.
    pub scale: Option<f32>,
}

impl AttnShape {
    /// The scale of the attention logits, `q · kᵀ · scale`.
    pub fn softmax_scale(&self) -> f32 {
        self.scale.unwrap_or_else(|| 1.0 / (self.head_dim as f32).sqrt())
    }

    /// Width of a packed qkv row.
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
    }

    /// Width of the attention output row (all query heads).
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Token rows.
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }

    /// First key (inclusive) query `i` may attend to.
    pub fn first_key(&self, i: usize) -> usize {
        if self.window == 0 { 0 } else { (i + 1).saturating_sub(self.window) }
    }
}

/// Shape of DeepSeek-V3's multi-head latent attention (MLA) as the backend sees it, after the
/// up-projections: per token row, `q [H·(nope + rope)]` (each head `[q_nope | q_rope]`),
/// `kv [H·(nope + v)]` (each head `[k_nope | v]`) and one rotary key `kpe [rope]` shared by all
/// heads. [`Backend::mla_qkv_forward`] assembles them into packed qkv rows that the attention op
/// reads with `n_heads = n_kv_heads = heads` and `head_dim = qk()`, v zero-padded to `qk()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaShape {
    /// Token rows `N` (sequences · `seq`).
    pub rows: usize,
    /// Tokens per sequence: row `r` is at position `r % seq`.
    pub seq: usize,
    /// Attention heads `H` (this device's).
    pub heads: usize,
    /// Width of the part of a query and key head without position (`qk_nope_head_dim`).
    pub nope: usize,
    /// Width of the rotary part of a query and key head (`qk_rope_head_dim`, even).
    pub rope: usize,
    /// Width of a value head (`v_head_dim`, at most `qk()`).
    pub v: usize,
    /// The rotary dimensions come in interleaved pairs `(x0, x1), (x2, x3), …` (Hugging Face's
    /// `rope_interleave`): they are de-interleaved (`[x0, x2, …, x1, x3, …]`) before the
    /// "rotate half" rotation, and stay in that order in the assembled rows.
    pub interleave: bool,
}

impl MlaShape {
    /// Width of a query and key head: `nope + rope` (the attention's `head_dim`).
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }

    /// Width of an assembled packed qkv row: `3 · H · qk`.
    pub fn qkv_width(&self) -> usize {
        3 * self.heads * self.qk()
    }

    /// Width of a row of the queries `q`: `H · (nope + rope)`.
    pub fn q_width(&self) -> usize {
        self.heads * self.qk()
    }

    /// Width of a row of the keys without position and the values, `kv`: `H · (nope + v)`.
    pub fn kv_width(&self) -> usize {
        self.heads * (self.nope + self.v)
    }

    /// The attention over the assembled rows: `batch = rows / seq` sequences, `H` query and
    /// key/value heads of width `qk()`, no window.
    pub fn attention(&self) -> AttnShape {
        AttnShape {
            batch: self.rows / self.seq.max(1),
            seq: self.seq,
            n_heads: self.heads,
            n_kv_heads: self.heads,
            head_dim: self.qk(),
            window: 0,
            // The queries come pre-scaled (`mla_qkv_forward`'s `q_scale`).
            scale: None,
        }
    }
}

/// How a sequence is split over the sequence (context-parallel) axis: into `2 · ranks` chunks of
/// equal length, rank `r` holding chunk `r` (early) and chunk `2 · ranks − 1 − r` (late), so that
/// every rank does the same share of causal attention (Llama 3's load-balanced split). A rank's
/// `2C` rows of a sequence are its early chunk's `C` then its late chunk's `C`. One rank
/// ([`SeqSplit::WHOLE`]) holds the whole sequence in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSplit {
    /// This device's position on the axis.
    pub rank: usize,
    /// Devices on the axis.
    pub ranks: usize,
}

impl SeqSplit {
    /// The whole sequence on one device.
    pub const WHOLE: SeqSplit = SeqSplit { rank: 0, ranks: 1 };

    /// True position in its sequence of local row `i` (`< local`, the rows of a sequence on one
    /// rank) of `rank`.
    pub fn position(&self, rank: usize, i: usize, local: usize) -> usize {
        let c = local / 2;
        if self.ranks == 1 {
            i
        } else if i < c {
            rank * c + i
        } else {
            (2 * self.ranks - 1 - rank) * c + i - c
        }
    }

    /// The rank that holds true position `j` and the row it has it in (`local` rows per
    /// sequence on a rank).
    pub fn owner(&self, j: usize, local: usize) -> (usize, usize) {
        if self.ranks == 1 {
            return (0, j);
        }
        let c = local / 2;
        let chunk = j / c;
        if chunk < self.ranks { (chunk, j % c) } else { (2 * self.ranks - 1 - chunk, c + j % c) }
    }

    /// The true positions of this rank's local rows, in order.
    pub fn positions(&self, local: usize) -> Vec<usize> {
        (0..local).map(|i| self.position(self.rank, i, local)).collect()
    }
}

/// How a mixture-of-experts router scores its experts ([`Routing::scoring`]): the
/// configuration's own (`model.moe.scoring`).
pub use crate::config::Scoring;

/// The routing rule of a mixture-of-experts layer, Hugging Face's `DeepseekV3TopkRouter` in
/// general and Mixtral's softmax top-k as its special case ([`Routing::softmax`]), all in f32:
///
/// ```text
/// s   = scoring(logits)               probabilities, saved (softmax over the E, or sigmoid)
/// sel = s + bias                      for the selection only
/// groups > 1: group g (experts g·E/G .. (g+1)·E/G) scores the sum of its top-2 `sel`; the
///             `top_groups` best groups are kept (ties to the lower index), the others' experts
///             are excluded
/// the top-k `sel` among the allowed experts (ties to the lower index)
/// w_j = s[chosen_j]                   the unbiased scores
/// renormalize: w /= Σ w (Softmax), w /= Σ w + 1e-20 (Sigmoid)
/// w *= scale
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Routing {
    /// The scoring function of the router logits.
    pub scoring: Scoring,
    /// Whether the chosen experts' scores are renormalised to sum to one
    /// ([`crate::config::MoeConfig::renormalize`], `norm_topk_prob`); else a slot's weight is
    /// its score (times [`Routing::scale`]).
    pub renormalize: bool,
    /// Expert groups (`n_group`), dividing the experts evenly; 1: no group limit.
    pub groups: usize,
    /// Groups kept per token (`topk_group`), `1 ..= groups`; unused with one group.
    pub top_groups: usize,
    /// Multiplies the final weights (`routed_scaling_factor`); 1 for Mixtral.
    pub scale: f32,
    /// `[E]` f32 selection bias (`e_score_correction_bias`, updated by
    /// [`Backend::moe_load_excess`] and [`Backend::moe_bias_step`]); it changes which experts are chosen, never their weights.
    /// None: zero.
    pub bias: Option<View>,
}

impl Routing {
    /// Mixtral's (`renormalize`) or Qwen3-MoE's softmax top-k: one group, no bias, scale 1.
    pub fn softmax(renormalize: bool) -> Routing {
        Routing { scoring: Scoring::Softmax, renormalize, groups: 1, top_groups: 1, scale: 1.0, bias: None }
    }

    /// Panics unless the rule fits `experts` experts and `top_k` choices: the groups divide the
    /// experts, each group holds at least two (its score is a top-2 sum), and the kept groups
    /// hold at least `top_k` experts.
    pub fn validate(&self, experts: usize, top_k: usize) {
        let (g, kept) = (self.groups, self.top_groups);
        assert!(g >= 1 && experts.is_multiple_of(g), "moe routing: {g} groups do not divide {experts} experts");
        if g > 1 {
            assert!(experts / g >= 2, "moe routing: groups of {} expert (a group scores its top two)", experts / g);
            assert!((1..=g).contains(&kept), "moe routing: keeping {kept} of {g} groups");
            assert!(top_k <= kept * experts / g, "moe routing: top-{top_k} from {kept} groups of {}", experts / g);
        }
        if let Some(b) = self.bias {
            assert_eq!(b.len, experts, "moe routing: the bias must hold one value per expert");
        }
    }
}

/// Routing tables of one mixture-of-experts layer for `N` tokens, each sent to `k` experts.
/// Rows of the dispatched (expert-major) activations are grouped by expert.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeDispatch {
    /// Tokens.
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The routing rule: scoring, renormalisation, group limit, scale and selection bias.
    pub routing: Routing,
    /// Rows each expert keeps ([`crate::config::MoeConfig::capacity`]): an expert's slots
    /// beyond its first `capacity` in slot order are dropped. `N · k` is dropless.
    pub capacity: usize,
    /// `[N · k]`: the expert chosen in each of a token's k slots (slot `t · k + j`).
    pub expert: IdxView,
    /// `[N · k]`: the routing weight of each slot (renormalised and scaled per [`Routing`]).
    pub weight: View,
    /// `[N · k]`: the dispatched row of each slot, [`DROPPED`] for a dropped slot.
    pub slot_row: IdxView,
    /// `[N · k]`: the slot each dispatched row comes from (its token is `slot / k`);
    /// [`DROPPED`] for the rows past the kept ones (`offsets[E] ..`).
    pub row_slot: IdxView,
    /// `[E + 1]`: dispatched rows of expert e are `offsets[e] .. offsets[e + 1]`.
    pub offsets: IdxView,
    /// `[2 · E + 1]` ([`MoeDispatch::stats_len`]): tokens routed to each expert (over all
    /// slots, before any drop), then the sum over tokens of each expert's router probability
    /// (the inputs of the load-balancing loss), then the number of dropped slots.
    pub stats: View,
}

/// The dispatched row of a dropped slot, and the slot of a row no slot fills.
pub const DROPPED: u32 = u32::MAX;

impl MoeDispatch {
    /// Length of [`MoeDispatch::stats`] for `experts` experts.
    pub fn stats_len(experts: usize) -> usize {
        2 * experts + 1
    }

    /// Most dispatched rows the experts can keep: every slot, or `capacity` rows of each
    /// expert, which never exceed the tokens (a token picks an expert at most once).
    pub fn rows_bound(&self) -> usize {
        (self.tokens * self.top_k).min(self.experts * self.capacity.min(self.tokens))
    }
}

/// The fixed-size parts of the expert axis's token exchange ([`Backend::moe_pack`]): `members`
/// parts of `rows` rows each, part `j` holding the rows bound for (or back from) member `j`,
/// whose experts are `[j·local, (j+1)·local)`. Every exchange moves whole parts, so its shape
/// never depends on the routing: no count comes back to the host and a CUDA graph can hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parts {
    /// Members of the expert group.
    pub members: usize,
    /// Experts per member.
    pub local: usize,
    /// Rows per part: the most one member routes to another's experts.
    pub rows: usize,
}

/// A host function in the stream of work ([`Backend::host_call`]): reads the messages of one
/// view, writes those of another.
pub type HostFn = std::sync::Arc<dyn Fn(&[f32], &mut [f32]) + Send + Sync>;

/// The weights of all experts of a layer for one projection: expert e's weight is the view
/// `first` moved `e · stride` elements on (experts are stored back to back, each a block holding
/// all its projections).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertWeights {
    /// Expert 0's weight.
    pub first: View,
    /// Elements from one expert's block to the next.
    pub stride: usize,
}

impl ExpertWeights {
    /// Expert `e`'s weight.
    pub fn expert(&self, e: usize) -> View {
        View { offset: self.first.offset + e * self.stride, ..self.first }
    }
}

/// The kind of a gated linear unit ([`Backend::glu_forward`]) over rows `[gate (f) | up (f)]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Glu {
    /// `silu(gate) · up` (Llama): [`Backend::swiglu_forward`].
    Swiglu,
    /// GPT-OSS: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`, `h = (u + 1) · g ·
    /// sigmoid(alpha · g)`; a clipped input gets no gradient (torch's `clamp`: the gradient passes
    /// where `min ≤ x ≤ max`, equality included).
    ClampedSwiglu {
        /// The clamp's bound (`swiglu_limit`, 7 in GPT-OSS).
        limit: f32,
        /// The sigmoid's slope (1.702 in GPT-OSS).
        alpha: f32,
    },
    /// Gemma: `gelu_tanh(gate) · up`, GELU's tanh approximation (torch's `gelu(approximate="tanh")`).
    GeluTanh,
}

/// One AdamW update: hyper-parameters of this step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay (applied to decaying segments only).
    pub weight_decay: f32,
    /// 1-based step number, for bias correction.
    pub t: u64,
    /// Clip the global gradient norm to this; 0 disables clipping.
    pub max_grad_norm: f32,
}

impl AdamWStep {
    /// The factor gradients are multiplied by before the update, given their squared global
    /// norm: [`clip_scale`].
    pub fn clip_scale(&self, norm_squared: f32) -> f32 {
        clip_scale(norm_squared, self.max_grad_norm)
    }
}

/// The factor gradients are multiplied by before an optimizer's update, given their squared
/// global norm: `min(1, max_grad_norm / norm)` (1 when `max_grad_norm` is 0: no clipping).
pub fn clip_scale(norm_squared: f32, max_grad_norm: f32) -> f32 {
    let norm = norm_squared.sqrt();
    if max_grad_norm > 0.0 && norm > max_grad_norm { max_grad_norm / norm } else { 1.0 }
}

/// One Muon momentum update ([`Backend::muon_momentum`]): hyper-parameters of this step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MuonMomentum {
    /// `μ`: the buffer keeps `μ` of itself.
    pub momentum: f32,
    /// Nesterov momentum: the update is `lerp(g, B, μ)` rather than `B`.
    pub nesterov: bool,
    /// Clip the global gradient norm to this; 0 disables clipping.
    pub max_grad_norm: f32,
}

/// `torch.lerp(a, b, w)` in f32 as PyTorch computes it, which keeps the end exact:
/// `a + w (b − a)` for `|w| < 0.5`, else `b − (b − a)(1 − w)`.
pub fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 { a + w * (b - a) } else { b - (b - a) * (1.0 - w) }
}

/// A range of the flat parameter buffer and whether it decays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First element.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    /// Whether weight decay applies.
    pub decay: bool,
}

/// What a model's attention takes beyond the causal mask and the window, which not every
/// implementation has ([`Backend::select_attention`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnNeeds {
    /// Document masking ([`Backend::attention_forward_docs`]).
    pub documents: bool,
    /// A sequence axis's chunks ([`Backend::attention_forward_split`]).
    pub seq_split: bool,
    /// Learned sinks ([`Backend::attention_sinks_forward`]), which read the attention's
    /// log-sum-exp in the native kernels' layout.
    pub sinks: bool,
    /// Each head's largest logit (QK-clip: [`Backend::attention_logit_max`]).
    pub logit_max: bool,
}

/// A compute device and the ops of a training step.
pub trait Backend {
    /// Short device description for logs (e.g. `cpu (2 threads)`).
    fn describe(&self) -> String;
    /// Chooses the kernels that run attention (`train.attention`) for attention of `shape` (the
    /// model's heads on this device, a micro-batch's sequences), checking what it chooses;
    /// [`Backend::describe`] then says which. Kernels without what `needs` names (document
    /// masking, a sequence axis's chunks) are not chosen (`"auto"` says why) and not accepted
    /// when named. A backend with one implementation keeps it.
    fn select_attention(
        &mut self,
        _choice: crate::config::AttentionImpl,
        _shape: AttnShape,
        _needs: AttnNeeds,
    ) -> anyhow::Result<()> {
        Ok(())
    }
    /// Waits until every op issued so far has finished (a no-op where ops are synchronous).
    fn synchronize(&mut self) {}

    /// Begins a section of work that repeats identically — the same ops on the same views, with
    /// no host read-back inside — each time it runs (a micro-batch's forward and backward pass),
    /// so that a backend may record it once and replay it (a CUDA graph). Returns true when the
    /// caller is to issue the section's ops and then call [`Backend::end_section`]; false when
    /// the backend has replayed the recorded section itself (the caller issues nothing). Inputs
    /// the section reads (tokens) are uploaded before it begins.
    fn begin_section(&mut self, _key: u32) -> bool {
        true
    }
    /// Ends the section [`Backend::begin_section`] began.
    fn end_section(&mut self, _key: u32) {}

    /// The most bytes of memory this backend has held at once for its buffers and scratch (its
    /// high-water mark), not counting the runtime's own (a CUDA context, the program).
    fn peak_memory_bytes(&self) -> usize;

    /// Bytes the device has free now, where its memory is bounded apart from the host's (a GPU).
    fn free_memory_bytes(&self) -> Option<usize> {
        None
    }

    /// Allocates a zero-filled buffer of `len` elements and returns a view of all of it.
    fn alloc(&mut self, kind: BufKind, len: usize) -> View;
    /// Allocates a zero-filled index buffer.
    fn alloc_idx(&mut self, len: usize) -> IdxView;
    /// Copies host data into a view (`src.len() == dst.len`).
    fn upload(&mut self, dst: View, src: &[f32]);
    /// Copies host indices into an index view.
    fn upload_idx(&mut self, dst: IdxView, src: &[u32]);
    /// Copies a view to the host (`dst.len() == src.len`). Waits for pending work.
    fn download(&mut self, src: View, dst: &mut [f32]);
    /// Copies an index view to the host.
    fn download_idx(&mut self, src: IdxView, dst: &mut [u32]);
    /// A view's elements as the f32 messages of collectives that move data through the host
    /// (the virtual devices', TCP's): as [`Backend::download`], but an FP8 element as its byte
    /// where the backend stores bytes (0 to 255, exact), so that any buffer travels whole, a
    /// cast without its format. [`Backend::upload_message`] writes it back.
    fn download_message(&mut self, src: View, dst: &mut [f32]) {
        self.download(src, dst)
    }
    /// Writes what [`Backend::download_message`] read (from this device or a peer) into `dst`.
    fn upload_message(&mut self, dst: View, src: &[f32]) {
        self.upload(dst, src)
    }
    /// Calls `f` in order with the work issued, on the messages of `reads` (as
    /// [`Backend::download_message`] reads them), writing what it leaves in its second argument
    /// (`writes.len` messages) to `writes` (as [`Backend::upload_message`]): where work is
    /// recorded ([`Backend::begin_section`]) the call is recorded too and made again at each
    /// replay, so that collectives moving data through the host (the virtual devices') may sit
    /// inside a recorded section. Here, at once.
    fn host_call(&mut self, reads: View, writes: View, f: HostFn) {
        let mut input = vec![0f32; reads.len];
        self.download_message(reads, &mut input);
        let mut output = vec![0f32; writes.len];
        f(&input, &mut output);
        self.upload_message(writes, &output);
    }
    /// Sets every element of a view.
    fn fill(&mut self, dst: View, value: f32);
    /// `dst = src`.
    fn copy(&mut self, dst: View, src: View);
    /// `dst += src`.
    fn add(&mut self, dst: View, src: View);
    /// `dst *= s` element-wise.
    fn scale(&mut self, dst: View, s: f32);
    /// `out[0] = Σ x`.
    fn sum(&mut self, out: View, x: View);
    /// `out[0] = Σ x²`.
    fn sum_squares(&mut self, out: View, x: View);

    /// General matrix product, see [`MatMul`].
    fn matmul(&mut self, out: View, a: View, b: View, shape: MatMul);
    /// Whether this backend has the FP8 ops ([`Backend::fp8_quantize`], [`Backend::matmul_fp8`],
    /// [`Backend::fp8_delayed_update`]); a run asks before it plans FP8 products.
    fn supports_fp8(&self) -> bool {
        false
    }
    /// Casts `x` to the FP8 format of `state` into `q`, as [`fp8::quantize`] does, the scale
    /// chosen as `scaling` says (set from `x`'s amax, the state's with `x`'s amax recorded, or
    /// the state's as it is). `q` holds `fp8(x · scale)`,
    /// transposed with `transpose = Some(cols)` (`x` being `[len / cols, cols]`); `q` is a
    /// [`BufKind::Fp8`] buffer.
    fn fp8_quantize(
        &mut self,
        _q: View,
        _x: View,
        _state: fp8::State,
        _scaling: fp8::Scaling,
        _transpose: Option<usize>,
    ) {
        unreachable!("internal error: {} has no FP8 ops (Backend::supports_fp8)", self.describe())
    }
    /// `q` = `x` transposed, both FP8 casts of one scale (`x` `[len / cols, cols]`, `q`
    /// `[cols, len / cols]`): the other layout of a cast that arrived in one, FSDP's weights
    /// gathered in FP8 (the backward pass's `dx` product reads Wᵀ).
    fn fp8_transpose(&mut self, _q: View, _x: View, _cols: usize) {
        unreachable!("internal error: {} has no FP8 ops (Backend::supports_fp8)", self.describe())
    }
    /// [`Backend::fp8_quantize`] into both layouts: `q` as `x` (`[len / cols, cols]`) and `qt`
    /// transposed, with one scale (the first cast's, as `scaling` says; the second cast is
    /// [`fp8::Scaling::Again`]). What the backward pass casts dy into (its two products read
    /// one layout each); a GPU reads `x` once for both.
    fn fp8_quantize_both(&mut self, q: View, qt: View, x: View, state: fp8::State, scaling: fp8::Scaling, cols: usize) {
        self.fp8_quantize(q, x, state, scaling, None);
        self.fp8_quantize(qt, x, state, fp8::Scaling::Again, Some(cols));
    }
    /// [`Backend::rmsnorm_forward`] of `x` with its output cast to E4M3 in both layouts
    /// ([`Backend::fp8_quantize_both`], `q` `[N, d]` and `qt` `[d, N]`) under the delayed
    /// recipe (the state's scale, the amax recorded), for an FP8 product that reads it: the
    /// output in the model's precision `out` is scratch, which this composition writes and a
    /// GPU's fused kernel does not (it writes `q`, `qt` and `rstd` in one pass, the same bytes).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_fp8(
        &mut self,
        (q, qt, state): (View, View, fp8::State),
        out: View,
        rstd: View,
        (x, w): (View, View),
        offset: f32,
        d: usize,
        eps: f32,
    ) {
        self.rmsnorm_forward(out, rstd, x, w, offset, d, eps);
        self.fp8_quantize_both(q, qt, out, state, fp8::Scaling::Delayed, d);
    }
    /// [`Backend::swiglu_forward`] with its output cast to E4M3 in both layouts under the
    /// delayed recipe, as [`Backend::rmsnorm_fp8`] for RMSNorm: `h` is scratch, which this
    /// composition writes and a GPU's fused kernel does not.
    fn swiglu_fp8(&mut self, (q, qt, state): (View, View, fp8::State), h: View, gu: View, f: usize) {
        self.swiglu_forward(h, gu, f);
        self.fp8_quantize_both(q, qt, h, state, fp8::Scaling::Delayed, f);
    }
    /// An FP8 product in cuBLASLt's one FP8 layout, `out[m, n] (+)= a[m, k] · b[n, k]ᵀ` (`shape`
    /// has `b_t` and not `a_t`), of operands cast by [`Backend::fp8_quantize`], multiplied by
    /// both states' inverse scales and accumulated in f32; `fast_accum` lets a GPU accumulate
    /// in its faster, less precise way (the forward products only, as Transformer Engine does).
    fn matmul_fp8(
        &mut self,
        _out: View,
        _a: View,
        _b: View,
        _shape: MatMul,
        _scales: [fp8::State; 2],
        _fast_accum: bool,
    ) {
        unreachable!("internal error: {} has no FP8 ops (Backend::supports_fp8)", self.describe())
    }
    /// `out = c + a · bᵀ` in FP8 ([`Backend::matmul_fp8`]; `shape.accumulate` is ignored): the
    /// residual add in the product's epilogue, as [`Backend::matmul_add`] for bf16 products.
    fn matmul_fp8_add(
        &mut self,
        out: View,
        a: View,
        b: View,
        c: View,
        shape: MatMul,
        scales: [fp8::State; 2],
        fast: bool,
    ) {
        self.copy(out, c);
        self.matmul_fp8(out, a, b, shape.accumulating(), scales, fast);
    }
    /// Records `x`'s amax in `state` (the larger of it and the amax there, NaN sticking), as a
    /// delayed cast would, without casting: a weight's piece under FSDP, whose group then takes
    /// the maximum.
    fn fp8_amax(&mut self, _state: fp8::State, _x: View) {
        unreachable!("internal error: {} has no FP8 ops (Backend::supports_fp8)", self.describe())
    }
    /// Delayed scaling's step ([`fp8::delayed_update`]) over operand states of `stride` elements
    /// laid back to back in `states`.
    fn fp8_delayed_update(&mut self, _states: View, _stride: usize, _margin: u32) {
        unreachable!("internal error: {} has no FP8 ops (Backend::supports_fp8)", self.describe())
    }
    /// `out = c + op(a) · op(b)` (`shape.accumulate` is ignored): a residual add in the
    /// product's epilogue, where the backend can read `c` and write `out` in one pass.
    fn matmul_add(&mut self, out: View, a: View, b: View, c: View, shape: MatMul) {
        self.copy(out, c);
        self.matmul(out, a, b, shape.accumulating());
    }

    /// `out[n] = table[tokens[n]]`, rows of width `d`.
    fn embedding_forward(&mut self, out: View, table: View, tokens: IdxView, d: usize);
    /// `dtable[tokens[n]] += dout[n]`.
    fn embedding_backward(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize);
    /// [`Backend::embedding_forward`] from a slice of the table (vocabulary parallelism): `table`
    /// holds the rows of tokens `first..first + table.len / d`; another slice's token gets a
    /// zero row (the tensor group's sum adds its holder's).
    fn embedding_forward_slice(&mut self, out: View, table: View, tokens: IdxView, d: usize, first: usize);
    /// [`Backend::embedding_backward`] into a slice of the table: only the slice's tokens add.
    fn embedding_backward_slice(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize, first: usize);

    /// `out = x · rstd · (offset + w)` with `rstd = 1 / sqrt(mean(x²) + eps)` per row of width
    /// `d`, `offset + w` taken in f32 (Gemma stores its norms' weights as offsets from one:
    /// `offset` 1; 0 for the others); saves `rstd` for the backward pass.
    fn rmsnorm_forward(&mut self, out: View, rstd: View, x: View, w: View, offset: f32, d: usize, eps: f32);
    /// Adds the input gradient to `dx` (`+=`: the residual stream's gradient) and the weight
    /// gradient to `dw` (the same for any `offset`).
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(&mut self, dx: View, dw: View, dout: View, x: View, w: View, offset: f32, rstd: View, d: usize);

    /// LayerNorm with weight and bias (the GPT family): per row of width `d`,
    /// `out = (x - μ) · rstd · w + b` with `rstd = 1 / sqrt(mean((x - μ)²) + eps)`, statistics in
    /// f32 or wider whatever the activations' precision; saves `mean` and `rstd` (`[N]` each).
    fn layernorm_forward(&mut self, out: View, mean: View, rstd: View, x: View, w: View, b: View, d: usize, eps: f32);
    /// Adds the input gradient to `dx` (`+=`: the residual stream's gradient, as
    /// [`Backend::rmsnorm_backward`]) and the weight and bias gradients to `dw` and `db`.
    fn layernorm_backward(
        &mut self,
        dx: View,
        dw: View,
        db: View,
        dout: View,
        x: View,
        w: View,
        mean: View,
        rstd: View,
        d: usize,
    );

    /// QK-norm (Qwen3, Gemma 3): RMSNorm of width `head_dim` over each query head (weight
    /// `w[..Dh]`) and each key head (`w[Dh..]`) of packed qkv rows, before RoPE, multiplying by
    /// `offset + w` as [`Backend::rmsnorm_forward`]: `out`'s q and k parts are normalised, its v
    /// part copied from `qkv`; saves `rstd[N, H + KV]`.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_forward(&mut self, out: View, rstd: View, qkv: View, w: View, offset: f32, shape: AttnShape, eps: f32);
    /// The backward pass of [`Backend::qk_norm_forward`], in place: `dqkv`'s q and k parts (the
    /// gradient of `out`) become the gradient of its input `qkv` (v's passes through unchanged);
    /// the weight gradients add to `dw` (`[dwq | dwk]`).
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_backward(&mut self, dqkv: View, dw: View, qkv: View, w: View, offset: f32, rstd: View, shape: AttnShape);

    /// Rotates the q and k parts of packed qkv rows by RoPE, in place; `inverse` rotates back
    /// (the backward pass). `rope` is `[seq, head_dim / 2]` pairs `(cos, sin)` interleaved.
    fn rope(&mut self, qkv: View, rope: View, shape: AttnShape, inverse: bool);

    /// Assembles DeepSeek-V3's MLA pieces into packed qkv rows `qkv [N, 3·H·qk]` for
    /// [`Backend::attention_forward`] with [`MlaShape::attention`]: from `q [N, H·qk]`, `kv [N,
    /// H·(nope + v)]`, the shared rotary key `kpe [N, rope]` and `table [seq, rope/2, 2]` (cos,
    /// sin pairs, as [`Backend::rope`]'s), at position `t = row % seq`, for every head h:
    ///
    /// ```text
    /// q_h = q_scale · [ q_nope_h | R_t(P(q_rope_h)) ]
    /// k_h =           [ k_nope_h | R_t(P(kpe))      ]
    /// v_h =           [ v_h      | 0 … 0            ]   (qk − v zeros)
    /// ```
    ///
    /// R_t is the "rotate half" rotation (pairs i, i + rope/2 by table pair i); P is the
    /// identity, or with `shape.interleave` the de-interleaving `[x0, x2, …, x1, x3, …]`.
    /// `q_scale` multiplies the whole query (a softmax scale other than `1 / sqrt(qk)`).
    fn mla_qkv_forward(&mut self, qkv: View, q: View, kv: View, kpe: View, table: View, shape: MlaShape, q_scale: f32);
    /// The adjoint of [`Backend::mla_qkv_forward`], every output overwritten: from the packed
    /// rows' gradient `dqkv`, `dq = q_scale · [dq_nope | Pᵀ R_tᵀ dq_rope]`, `dkv = [dk_nope |
    /// dv]` (the first `v` columns of each value head's gradient; the padding's is dropped) and
    /// `dkpe = Σ_h Pᵀ R_tᵀ dk_rope_h`, the heads summed in a fixed order.
    fn mla_qkv_backward(
        &mut self,
        dq: View,
        dkv: View,
        dkpe: View,
        dqkv: View,
        table: View,
        shape: MlaShape,
        q_scale: f32,
    );
    /// `out [rows, heads·to]` holds the first `to` (≤ `from`) columns of each `from`-wide head of
    /// `x [rows, heads·from]` (MLA: the attention's output heads, `qk` wide, cut to o_proj's `v`).
    fn heads_narrow(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize);
    /// The adjoint of [`Backend::heads_narrow`]: `out [rows, heads·to]` (`to` ≥ `from`) holds each
    /// `from`-wide head of `x [rows, heads·from]` followed by `to − from` zeros.
    fn heads_widen(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize);

    /// Causal (optionally windowed) grouped-query attention over packed qkv rows:
    /// `out[N, H · Dh]`, and the log-sum-exp of each query's scores `lse[N, H]` for the
    /// backward pass. Scores are scaled by `1 / sqrt(Dh)`.
    fn attention_forward(&mut self, out: View, lse: View, qkv: View, shape: AttnShape);
    /// Gradient of [`Backend::attention_forward`] with respect to the packed qkv rows (`=`).
    fn attention_backward(&mut self, dqkv: View, dout: View, qkv: View, out: View, lse: View, shape: AttnShape);
    /// QK-clip's measurement (`optim.qk_clip`): until called again with `None`, every attention
    /// forward pass (plain, documents, split) also max-accumulates each query head's largest
    /// scaled, masked logit, `max over its queries i and the keys j they see of q_i · k_j · c`,
    /// into `into[h]` (`[heads]`, f32: a [`BufKind::Scalars`] view), as the online softmax's
    /// final running maximum gives it. The caller fills `into` with −∞ to start. A backend whose
    /// attention cannot say refuses [`AttnNeeds::logit_max`] in [`Backend::select_attention`].
    fn attention_logit_max(&mut self, into: Option<View>);

    /// What a chunk of a sequence split over the sequence axis (half of a rank's rows) must be
    /// a multiple of for [`Backend::attention_forward_split`], or `None` when this backend takes
    /// no more than one rank.
    fn seq_chunk_multiple(&self) -> Option<usize> {
        None
    }
    /// [`Backend::attention_forward`] for the local rows of a sequence split over the sequence
    /// axis ([`SeqSplit`]): `qkv_all` holds every rank's rows, rank-major (`[ranks, batch, seq,
    /// W]`, `shape.seq` being the rows of a sequence on one rank: two chunks), as an all-gather
    /// leaves them; the queries are `split.rank`'s rows, each at its true position, and see the
    /// keys of every rank up to that position (the causal mask over each pair of chunks). Under
    /// document masking, `bounds` are the whole sequences' ([`Backend::document_bounds_split`]).
    fn attention_forward_split(
        &mut self,
        out: View,
        lse: View,
        qkv_all: View,
        shape: AttnShape,
        split: SeqSplit,
        bounds: Option<IdxView>,
    ) {
        assert_eq!(split.ranks, 1, "this backend's attention does not take chunk offsets (sequence axis)");
        match bounds {
            Some(bounds) => self.attention_forward_docs(out, lse, qkv_all, shape, bounds),
            None => self.attention_forward(out, lse, qkv_all, shape),
        }
    }
    /// Gradient of [`Backend::attention_forward_split`] with respect to every rank's rows
    /// (`dqkv_all`, laid out as `qkv_all`, `=`): the queries' gradient on `split.rank`'s rows
    /// (zero on the others'), and the keys' and values' from this rank's queries on every
    /// rank's rows, to be summed over the axis (a reduce-scatter).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_split(
        &mut self,
        dqkv_all: View,
        dout: View,
        qkv_all: View,
        out: View,
        lse: View,
        shape: AttnShape,
        split: SeqSplit,
        bounds: Option<IdxView>,
    ) {
        assert_eq!(split.ranks, 1, "this backend's attention does not take chunk offsets (sequence axis)");
        match bounds {
            Some(bounds) => self.attention_backward_docs(dqkv_all, dout, qkv_all, out, lse, shape, bounds),
            None => self.attention_backward(dqkv_all, dout, qkv_all, out, lse, shape),
        }
    }

    /// Document masking of packed sequences (`data.document_mask`), from the `[N]` tokens of
    /// sequences of `seq`: `bounds[r]` (`r = b·T + i`) is the position in sequence b where row
    /// r's document begins, one past the last `eos` before position i (0 without one), so that
    /// the EOS ends the document it closes and belongs to it (as MaxText and torchtitan segment
    /// them); `bounds[N + r]` is where it ends, one past its EOS (T without one). With
    /// `positions`, also `positions[r] = i - bounds[r]`: positions restarted at each document
    /// (`data.reset_positions`).
    fn document_bounds(&mut self, bounds: IdxView, positions: Option<IdxView>, tokens: IdxView, seq: usize, eos: u32);
    /// [`Backend::document_bounds`] on a sequence axis: `tokens` are the whole sequences
    /// (`[batch · seq · split.ranks]`, in order), so that a rank sees the EOS in the other ranks'
    /// chunks; `bounds` (`[2 · batch · seq · split.ranks]`) are the whole sequences', by true
    /// position, and `positions` (`[batch · seq]`) `split.rank`'s rows' (`seq` rows of a
    /// sequence on one rank: its two chunks). The bounds are [`Backend::document_bounds`]' of
    /// the whole sequences; picking a rank's positions out of theirs takes a backend's own op.
    #[allow(clippy::too_many_arguments)]
    fn document_bounds_split(
        &mut self,
        bounds: IdxView,
        positions: Option<IdxView>,
        tokens: IdxView,
        seq: usize,
        split: SeqSplit,
        eos: u32,
    ) {
        if split.ranks == 1 {
            return self.document_bounds(bounds, positions, tokens, seq, eos);
        }
        assert!(
            positions.is_none(),
            "this backend does not restart positions at documents on a sequence axis (data.reset_positions)"
        );
        self.document_bounds(bounds, None, tokens, seq * split.ranks, eos)
    }
    /// [`Backend::attention_forward`] under document masking: query i sees key j only when
    /// `bounds[i] <= j` too, that is only its own document's keys (`bounds`, `[2N]`, from
    /// [`Backend::document_bounds`]).
    fn attention_forward_docs(&mut self, out: View, lse: View, qkv: View, shape: AttnShape, bounds: IdxView);
    /// Gradient of [`Backend::attention_forward_docs`] with respect to the packed qkv rows (`=`).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_docs(
        &mut self,
        dqkv: View,
        dout: View,
        qkv: View,
        out: View,
        lse: View,
        shape: AttnShape,
        bounds: IdxView,
    );

    /// Learned attention sinks (GPT-OSS) as an epilogue of any of the attention forward passes,
    /// in place on its `out` `[rows, heads · head_dim]` and `lse` `[rows, heads]` (rows =
    /// `out.len / (heads · head_dim)`); `sinks` `[heads]` (a parameter). Each head's sink logit
    /// `s_h` joins every query row's scaled, masked scores as one more column of the softmax,
    /// whose probability is dropped (it has no value), so that per row r and head h, from
    /// attention's `L = log Σ_j exp(s_j)` (natural log):
    ///
    /// ```text
    /// L'  = logaddexp(L, s_h)
    /// out ← out · exp(L − L')        (= out · sigmoid(L − s_h))
    /// lse ← L'
    /// ```
    ///
    /// The attention backward pass given the new `out` and `lse` is then exactly the gradient of
    /// the sinked attention for q, k and v (`P' = exp(S − L')`, `D' = rowsum(dO ∘ O')`,
    /// `dS = P' (dP − D')`); [`Backend::attention_sinks_backward`] adds the sinks' own.
    fn attention_sinks_forward(&mut self, out: View, lse: View, sinks: View, heads: usize, head_dim: usize);
    /// The sinks' gradient for [`Backend::attention_sinks_forward`], from the output's gradient
    /// `dout` and the `out` and `lse` it left (`O'`, `L'`); `dsinks` `[heads]` accumulates (`+=`):
    ///
    /// ```text
    /// dsinks[h] += − Σ_r exp(s_h − L'_r) · Σ_c dout[r, h, c] · out[r, h, c]
    /// ```
    #[allow(clippy::too_many_arguments)]
    fn attention_sinks_backward(
        &mut self,
        dsinks: View,
        dout: View,
        out: View,
        lse: View,
        sinks: View,
        heads: usize,
        head_dim: usize,
    );

    /// `h = silu(gate) ⊙ up` where rows of `gu` are `[gate (f) | up (f)]`.
    fn swiglu_forward(&mut self, h: View, gu: View, f: usize);
    /// Gradient of [`Backend::swiglu_forward`] with respect to `gu` (`=`).
    fn swiglu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize);
    /// `h = act(gate) ⊙ up` of the gated linear unit `kind` ([`Glu`]), rows of `gu` being
    /// `[gate (f) | up (f)]`; [`Glu::Swiglu`] is [`Backend::swiglu_forward`].
    fn glu_forward(&mut self, h: View, gu: View, f: usize, kind: Glu);
    /// Gradient of [`Backend::glu_forward`] with respect to `gu` (`=`); [`Glu::Swiglu`] is
    /// [`Backend::swiglu_backward`].
    fn glu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize, kind: Glu);

    /// `x = cap · tanh(x / cap)` element-wise, in place (Gemma's final-logit soft-capping).
    fn softcap_forward(&mut self, x: View, cap: f32);
    /// Gradient of [`Backend::softcap_forward`], in place: `dx = dx · (1 − tanh²(x / cap))`,
    /// `x` the values before capping.
    fn softcap_backward(&mut self, dx: View, x: View, cap: f32);

    /// `h = gelu(u)` element-wise (the GPT family's MLP): the tanh approximation when `tanh`,
    /// else the exact `u · Φ(u)`.
    fn gelu_forward(&mut self, h: View, u: View, tanh: bool);
    /// Gradient of [`Backend::gelu_forward`] with respect to `u` (`=`): `du = dh · gelu'(u)`.
    fn gelu_backward(&mut self, du: View, dh: View, u: View, tanh: bool);

    /// Per-row cross-entropy of `logits[N, V]` against `targets[N]` into `losses[N]`
    /// (`lse(row) - row[target]`). With `grad_scale = Some(s)`, overwrites the logits with the
    /// gradient `s · (softmax(row) - onehot(target))`.
    fn cross_entropy(&mut self, losses: View, logits: View, targets: IdxView, v: usize, grad_scale: Option<f32>);
    /// Vocabulary-parallel cross-entropy (Megatron-LM's), step 1 of 3, when this device holds
    /// the `v` logit columns of tokens `first..first + v`: `max[n] = max_v z[n, v]` over its
    /// columns. The caller takes the maximum over the tensor group.
    fn cross_entropy_max(&mut self, max: View, logits: View, v: usize);
    /// Step 2: `sums[n] = Σ_v exp(z[n, v] - max[n])` and `sums[N + n] = z[n, target - first]`
    /// if this device holds the target's column, else 0. The caller sums both over the group.
    fn cross_entropy_partials(&mut self, sums: View, logits: View, max: View, targets: IdxView, v: usize, first: usize);
    /// Step 3: `losses[n] = ln sums[n] + max[n] - sums[N + n]`; with `grad_scale`, the logits are
    /// overwritten by their gradient, `scale · (exp(z - max) / sums[n] - [first + v = target])`.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_finish(
        &mut self,
        losses: View,
        logits: View,
        max: View,
        sums: View,
        targets: IdxView,
        v: usize,
        first: usize,
        grad_scale: Option<f32>,
    );

    /// Routing of `router_logits[N, E]` by [`MoeDispatch::routing`]: `probs` = the scores
    /// (softmax or sigmoid, saved), the top-k experts of each token by biased score among its
    /// kept groups (ties to the lower index), their unbiased scores as weights (renormalised,
    /// scaled), the dispatch tables and the layer's load-balancing statistics. Each expert keeps
    /// its first `capacity` slots in slot order (token order, MaxText's); the rest are dropped.
    fn moe_route(&mut self, probs: View, router_logits: View, dispatch: MoeDispatch);
    /// `xe[r] = x[row_slot[r] / k]`: gathers token rows of width `d` into dispatched order
    /// (rows no slot fills are zeroed).
    fn moe_gather(&mut self, xe: View, x: View, dispatch: MoeDispatch, d: usize);
    /// `x[t] = Σ_j xe[slot_row[t·k + j]]` over the kept slots (`=`): the backward pass of
    /// [`Backend::moe_gather`].
    fn moe_gather_backward(&mut self, dx: View, dxe: View, dispatch: MoeDispatch, d: usize);
    /// For every expert e, `out_e = a_e · op(W_e)` over its dispatched rows
    /// `offsets[e] .. offsets[e + 1]` of `a` and `out`. `shape` is that of one expert's product;
    /// its `m` is ignored (each expert's row count is used).
    fn moe_expert_matmul(&mut self, out: View, a: View, weights: ExpertWeights, dispatch: MoeDispatch, shape: MatMul);
    /// For every expert e, `dW_e += dy_eᵀ · x_e` over its dispatched rows: the weight gradient of
    /// a [`MatMul::linear`] expert projection with `inp` inputs and `out` outputs.
    fn moe_expert_matmul_dw(
        &mut self,
        dweights: ExpertWeights,
        dy: View,
        x: View,
        dispatch: MoeDispatch,
        inp: usize,
        out: usize,
    );
    /// [`Backend::moe_expert_matmul`] with FP8 operands ([`BufKind::Fp8`]: `a` in the format
    /// of `scales[0]`, the weights E4M3 as `scales[1]` says), the products multiplied by both
    /// inverse scales: the experts' products under `train.precision = "fp8"`.
    fn moe_expert_matmul_fp8(
        &mut self,
        _out: View,
        _a: View,
        _weights: ExpertWeights,
        _dispatch: MoeDispatch,
        _shape: MatMul,
        _scales: [fp8::State; 2],
    ) {
        unreachable!("internal error: {} has no FP8 ops (Backend::supports_fp8)", self.describe())
    }
    /// [`Backend::moe_expert_matmul_dw`] with FP8 operands: `dy` as `scales[0]` (E5M2), `x` as
    /// `scales[1]` (E4M3); `dims` = (inp, out).
    fn moe_expert_matmul_dw_fp8(
        &mut self,
        _dweights: ExpertWeights,
        _dy: View,
        _x: View,
        _dispatch: MoeDispatch,
        _dims: (usize, usize),
        _scales: [fp8::State; 2],
    ) {
        unreachable!("internal error: {} has no FP8 ops (Backend::supports_fp8)", self.describe())
    }
    /// `out[r] += bias_e` over the `width` columns of every dispatched row r of each expert e
    /// (`offsets[e] .. offsets[e + 1]`, as [`Backend::moe_expert_matmul`] finds them): an expert
    /// projection's biases (GPT-OSS's), expert e's `[width]` bias being `bias.expert(e)`.
    fn moe_expert_bias(&mut self, out: View, bias: ExpertWeights, dispatch: MoeDispatch, width: usize);
    /// `dbias_e += Σ_{rows r of e} dout[r]` over the same rows (an expert without rows gets
    /// nothing): the bias gradient of [`Backend::moe_expert_bias`], summed in a fixed order (no
    /// atomics).
    fn moe_expert_bias_backward(&mut self, dbias: ExpertWeights, dout: View, dispatch: MoeDispatch, width: usize);
    /// `out[t] = Σ_j weight[t·k + j] · ye[slot_row[t·k + j]]` over the kept slots (`=`): a
    /// dropped slot adds nothing (the residual carries the token).
    fn moe_combine(&mut self, out: View, ye: View, dispatch: MoeDispatch, d: usize);
    /// Backward of [`Backend::moe_combine`]: `dye[slot_row[s]] = weight[s] · dout[t]` and
    /// `dweight[s] = dout[t] · ye[slot_row[s]]` (both `=`; zero for dropped slots and rows no
    /// slot fills).
    fn moe_combine_backward(&mut self, dye: View, dweight: View, dout: View, ye: View, dispatch: MoeDispatch, d: usize);
    /// Gradient of the router logits (`=`) from the gradient of the routing weights (through
    /// the scale, the renormalisation and the scoring function) and of the load-balancing loss:
    /// `aux_scale · counts[e]` is added to the gradient of every token's score of expert e
    /// (`counts` holds the tokens routed to each expert over the whole model, as the loss uses
    /// them). The selection (bias, groups) gets no gradient.
    fn moe_route_backward(
        &mut self,
        drouter: View,
        dweight: View,
        probs: View,
        dispatch: MoeDispatch,
        counts: View,
        aux_scale: f32,
    );
    /// Packs rows grouped by expert (`offsets`, `[E + 1]`, as [`MoeDispatch::offsets`]) into
    /// `parts`: part `j` of `dst` (`rows` rows of `width`) takes the rows of member `j`'s experts,
    /// `offsets[j·L] .. offsets[(j+1)·L]`, in order, and zeros after them.
    ///
    /// ```text
    /// src: [ e0 e0 e1 | e2 | e3 e3 e3 ]         offsets [0, 2, 3, 4, 7], L = 2, rows = 4
    /// dst: [ e0 e0 e1 0 | e2 e3 e3 e3 ]
    /// ```
    fn moe_pack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize);
    /// The inverse of [`Backend::moe_pack`] (its adjoint, rows being moved): the rows of part
    /// `j` of `src` go back to `offsets[j·L] ..` of `dst`; the parts' zeros go nowhere.
    fn moe_unpack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize);
    /// `counts[e] = offsets[e + 1] − offsets[e]` for the `counts.len()` experts: the rows of
    /// each expert, as numbers, for the exchange that tells each member what it receives.
    fn moe_counts(&mut self, counts: View, offsets: IdxView);
    /// The runs of the rows a member received in parts ([`Backend::moe_pack`] on every sender),
    /// from `counts` (`[members · L]`: what each sender sent each local expert), as the grouped
    /// expert products read them: sender `s`'s `L + 1` offsets, `runs[s·(L+1) + l] = s·rows +
    /// Σ_{i<l} counts[s·L + i]`.
    fn moe_runs(&mut self, runs: IdxView, counts: View, parts: Parts);
    /// Adds a layer's load excess to `dst` (`[E]`): `dst[e] += counts[e] − mean(counts)`, the mean
    /// over the E entries of `counts` (summed in f64 in index order on the CPU). Summed over
    /// micro-batches (and over replicas, which all see the same counts), its sign is that of the
    /// step's load excess: the model accumulates it into the selection bias's gradient slot.
    fn moe_load_excess(&mut self, dst: View, counts: View);
    /// The balancing step of (a part of) a selection bias: `bias[i] −= rate · sign(excess[i])`
    /// (sign(0) = 0), then `excess[i] = 0`, elementwise over the two equal-length views.
    fn moe_bias_step(&mut self, bias: View, excess: View, rate: f32);

    /// Muon's momentum over the gradients of its matrices and their buffer `buf` (equal
    /// lengths), elementwise: `g ← clip · g` with [`clip_scale`] of the squared global norm in
    /// `norm_squared[0]` (read on the device), `buf ← lerp(buf, g, 1 − μ)`, then
    /// `grads ← lerp(g, buf, μ)` (Nesterov) or `buf`: the matrices to orthogonalise, in place
    /// of the gradients (`torch.optim.Muon`'s first two lines).
    fn muon_momentum(&mut self, grads: View, buf: View, norm_squared: View, step: MuonMomentum);

    /// `x ← x / max(√sum_squares[0], eps)`, the norm read on the device: Newton–Schulz's
    /// normalisation of a matrix by its Frobenius norm (`sum_squares` from [`Backend::sum_squares`]).
    fn divide_by_norm(&mut self, x: View, sum_squares: View, eps: f32);

    /// AdamW over the flat buffers: gradients clipped first by [`AdamWStep::clip_scale`] of the
    /// squared global norm held in `norm_squared[0]` (read on the device: no host round trip),
    /// decoupled weight decay on decaying segments; zeroes the gradients afterwards, ready for
    /// the next step's accumulation.
    fn adamw(
        &mut self,
        params: View,
        grads: View,
        m: View,
        v: View,
        norm_squared: View,
        segments: &[Segment],
        step: AdamWStep,
    );

    /// [`Backend::adamw`], which also writes each of `casts` (weights inside `segments`) from
    /// its updated weight, as [`fp8::WeightCast::cast`] would after the step. The reference
    /// does just that; a GPU writes the casts in the update's own pass, reading the weight once
    /// (no cast launch, no second read of the weight).
    #[allow(clippy::too_many_arguments)]
    fn adamw_fp8(
        &mut self,
        params: View,
        grads: View,
        (m, v): (View, View),
        norm_squared: View,
        segments: &[Segment],
        step: AdamWStep,
        casts: &[fp8::WeightCast],
    ) {
        self.adamw(params, grads, m, v, norm_squared, segments, step);
        for c in casts {
            c.cast(self, params);
        }
    }
}
