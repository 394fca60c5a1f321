//! FP8 products of the decoder's linear layers (`train.precision = "fp8"`): which products run
//! in FP8, the scaling state of their operands, and the three products of a linear layer.
//!
//! A linear layer `y[N, O] = x[N, I] · W[O, I]ᵀ` has three products, each with its operands in
//! FP8 (Transformer Engine's and torchao's "hybrid" format):
//!
//! ```text
//! forward  y  = x_q(E4M3) · W_q(E4M3)ᵀ      fast accumulation on a GPU
//! dgrad    dx = dy_q(E5M2) · W_q(E4M3)
//! wgrad    dW += dy_q(E5M2)ᵀ · x_q(E4M3)
//! ```
//!
//! Each of x, W and dy has a scaling state ([`crate::backend::fp8::State`]) per layer and
//! product; a cast sets or uses it by the recipe (`train.fp8.recipe`). The backward pass casts
//! dy into both layouts at once (cuBLASLt's FP8 products take one layout, and dy's two products
//! read one each) and W a second time, transposed, with the scale its first cast left (no second
//! amax pass), unless the forward pass kept Wᵀ ([`Model::fp8_weight_cache`]) or the optimizer
//! wrote both ([`Model::fp8_weight_copies`]). x it casts again from the activation the forward
//! pass read, unless the forward pass kept xᵀ in place of that activation
//! ([`Model::fp8_keep_inputs`], [`KeptInput`]): within a step a cast of x gives the same values
//! every time (tensorwise: the same amax; delayed: the step's fixed scale), so either way the
//! gradients are the same bits. Under the delayed recipe the RMSNorm before q/k/v and gate/up,
//! and the SwiGLU before down, write their outputs' casts in their own pass
//! ([`Model::fp8_produced`]), the same bytes.
//!
//! Per product and operand, where each cast comes from:
//!
//! ```text
//!             forward x                      backward xᵀ          W, Wᵀ                  dy, dyᵀ
//! q/k/v, up   RMSNorm (delayed), else a      kept from forward    optimizer (delayed,    one cast, both
//!             cast of both layouts           (remat none)         whole model), else a   layouts
//! down        SwiGLU (delayed), else a cast  kept from forward    cast of both layouts
//! o           a cast                         cast again           in the forward pass
//! ```
//!
//! (Under recomputation nothing is kept: xᵀ is cast again, and the producers write bf16.)
//!
//! Latent attention (DeepSeek-V3) has five such layers instead of q/k/v: the queries' down and
//! up projections (or their one projection), the keys' and values' latent projection and its up
//! projection, and `o_proj`. The shared RoPE key's projection (64 wide in DeepSeek-V3, the
//! last rows of `kv_a_proj_with_mqa`) stays in the model's precision: no FP8 product pays at
//! that width.
//!
//! A mixture of experts' grouped products (gate/up and down of every expert) run in FP8 too
//! ([`ExpertMatmuls`]): the rows cast as one tensor (E4M3; their gradients E5M2), and the
//! layer's experts' weights, both projections of all the device's experts, cast as one tensor
//! too, once a pass (the backward pass's cast takes the forward pass's scale); the grouped
//! kernels read any layout, so no operand is cast transposed. Their states follow the dense
//! layers' in [`Fp8Buffers::states`] (so a model without experts keeps its states' length).
//! With a capacity factor the rows' cast covers the buffer's rows past the kept ones too (an
//! earlier pass's rows of the layer): its amax, and so its scale, is at most that conservative.
//!
//! The embedding, the output head, the router, attention's core, the norms and the biases stay
//! in the model's precision, as do products too small for FP8 to pay (`train.fp8.min_dim`), the
//! shared experts' and the dense layers' MLPs of a mixture-of-experts model.

use super::layout::{AttnOffsets, LayerOffsets, MlpOffsets, QueryOffsets};
use super::{Model, Plan, Weight};
use crate::backend::fp8::{Fp8Format, Scaling, State, WeightCast};
use crate::backend::{Backend, BufKind, ExpertWeights, MatMul, MoeDispatch, View};
use crate::config::{Fp8Config, Fp8Recipe, ModelConfig, Precision, TrainConfig};

/// The linear layers of a decoder block that may run in FP8.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Linear {
    /// The packed q, k and v projections.
    Qkv,
    /// Attention's output projection.
    O,
    /// The packed gate and up projections (GPT: `c_fc`).
    Up,
    /// The down projection (GPT: `c_proj`).
    Down,
    /// Latent attention's query down-projection (`q_a_proj`).
    QDown,
    /// Latent attention's query up-projection (`q_b_proj`), or its one query projection
    /// (`q_proj`) when the queries have no latent.
    QUp,
    /// Latent attention's key-value latent projection: the latent's rows of
    /// `kv_a_proj_with_mqa`.
    KvDown,
    /// Latent attention's key-value up-projection (`kv_b_proj`).
    KvUp,
}

impl Linear {
    const ALL: [Linear; 8] =
        [Linear::Qkv, Linear::O, Linear::Up, Linear::Down, Linear::QDown, Linear::QUp, Linear::KvDown, Linear::KvUp];

    /// How the start-up line names them.
    const NAMES: [&str; 8] = ["q/k/v", "o", "gate/up", "down", "q_a", "q_b", "kv_a", "kv_b"];

    /// Its (input, output) widths in a layer of `m` (a device's slice under tensor
    /// parallelism); `(0, 0)` for the layers of the other attention kind.
    fn widths(self, m: &ModelConfig) -> (usize, usize) {
        let up = if m.is_gpt() { m.mlp_dim } else { 2 * m.mlp_dim };
        let (d, h) = (m.d_model, m.n_heads);
        match (self, &m.mla) {
            (Linear::Qkv, None) => (d, m.q_dim() + 2 * m.kv_dim()),
            (Linear::O, None) => (m.q_dim(), d),
            (Linear::O, Some(a)) => (h * a.v_dim, d),
            (Linear::Up, _) => (d, up),
            (Linear::Down, _) => (m.mlp_dim, d),
            (Linear::QDown, Some(a)) if a.q_lora_rank > 0 => (d, a.q_lora_rank),
            (Linear::QUp, Some(a)) if a.q_lora_rank > 0 => (a.q_lora_rank, m.q_dim()),
            (Linear::QUp, Some(_)) => (d, m.q_dim()),
            (Linear::KvDown, Some(a)) => (d, a.kv_lora_rank),
            (Linear::KvUp, Some(a)) => (a.kv_lora_rank, h * (a.nope_dim + a.v_dim)),
            _ => (0, 0),
        }
    }
}

/// The operands of a linear layer's products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operand {
    X,
    W,
    Dy,
}

impl Operand {
    const ALL: [Operand; 3] = [Operand::X, Operand::W, Operand::Dy];

    fn format(self) -> Fp8Format {
        match self {
            Operand::X | Operand::W => Fp8Format::E4M3,
            Operand::Dy => Fp8Format::E5M2,
        }
    }
}

/// Which products of a model run in FP8, and how they are scaled: the run's `[train.fp8]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Policy {
    /// The recipe, history, margin and size threshold.
    pub config: Fp8Config,
}

impl Fp8Policy {
    /// The policy of a run: none unless `train.precision = "fp8"`.
    pub fn of(train: &TrainConfig) -> Option<Fp8Policy> {
        (train.precision == Precision::Fp8).then(|| Fp8Policy { config: train.fp8.clone() })
    }

    /// Whether `linear` of model `m` runs in FP8 for micro-batches of `n` tokens: both widths
    /// at least `min_dim`, and every dimension of its three products a multiple of 16
    /// (cuBLASLt's FP8 rule), experts excepted.
    fn covers(&self, m: &ModelConfig, linear: Linear, n: usize) -> bool {
        let (inp, out) = linear.widths(m);
        let moe = m.moe.is_some() && matches!(linear, Linear::Up | Linear::Down);
        !moe && inp.min(out) >= self.config.min_dim && [inp, out, n].iter().all(|k| k % 16 == 0 && *k > 0)
    }

    /// Whether the experts' grouped products of model `m` run in FP8: both widths at least
    /// `min_dim` and multiples of 16.
    fn covers_experts(&self, m: &ModelConfig) -> bool {
        let (d, f) = (m.d_model, m.mlp_dim);
        m.moe.is_some() && d.min(f) >= self.config.min_dim && d % 16 == 0 && f % 16 == 0
    }

    /// Elements of one operand's state.
    fn stride(&self) -> usize {
        State::len(if self.config.recipe == Fp8Recipe::Delayed { self.config.amax_history } else { 0 })
    }
}

/// The weights' kept casts ([`Fp8Buffers::cache`]): each covered linear layer of each layer at
/// its offset `at` in a layer's `stride` elements.
#[derive(Debug, Clone, Copy)]
struct WeightCache {
    /// The transposed casts, which the forward pass writes beside its own (one pass) and the
    /// backward pass reads.
    wt: View,
    /// The casts in the forward pass's layout, where the optimizer writes both
    /// ([`Model::fp8_weight_copies`]): then neither pass casts a weight.
    w: Option<View>,
    at: [usize; 8],
    stride: usize,
}

/// The experts' FP8 buffers ([`Fp8Buffers::experts`]): where their states start in
/// [`Fp8Buffers::states`] (two grouped products a layer, three operands each), and the casts of
/// the rows (`x`), of their gradients (`dy`) and of a layer's experts' weights (`w`).
#[derive(Debug, Clone, Copy)]
pub(in super::super) struct ExpertBuffers {
    first_state: usize,
    x: View,
    dy: View,
    w: View,
}

/// A weight FSDP gathers as its E4M3 cast ([`Model::fp8_cast_weights`]): its range of the
/// flat buffers, and the state whose scale casts it and which records its amax (none where only
/// the memory plan asks).
#[derive(Debug, Clone)]
pub struct CastWeight {
    /// Its range of the flat buffers.
    pub range: std::ops::Range<usize>,
    /// Its scaling state.
    pub state: Option<State>,
    /// The recipe's: [`Scaling::Delayed`] (each piece cast with the state's scale, its amax
    /// recorded) or [`Scaling::Current`] (the scale from the whole weight's amax, taken once
    /// the weights changed, before the pieces are cast).
    pub scaling: Scaling,
}

/// A linear layer's input kept cast for its weight gradient ([`Model::fp8_kept`]): `xᵀ`
/// (`[I, N]`, E4M3), which the forward pass writes beside its own cast and the backward pass's
/// `dW` product reads; under tensorwise scaling with the state whose scale cast it, this
/// micro-batch's own (another micro-batch's forward pass sets the layer's shared one before
/// this one's backward pass, in a pipeline's schedule). A layer's are in its activations.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeptInput {
    pub(super) xt: View,
    pub(super) state: Option<View>,
}

/// A device's FP8 buffers ([`Plan::fp8`]): the scaling state of every operand of every FP8
/// product of the whole model (indexed by the layer's place in the whole model, so that every
/// virtual stage and micro-batch slot shares one), and the casts' scratch.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Buffers {
    /// `[layers × 8 linear layers × 3 operands, stride]` states ([`State`]).
    pub states: View,
    /// Elements of one state.
    stride: usize,
    /// Which of [`Linear::ALL`] run in FP8 (the same in every layer).
    covered: [bool; 8],
    /// The cast input, weight and output gradient of the product running, and the output
    /// gradient transposed.
    x: View,
    w: View,
    dy: View,
    dyt: View,
    /// The weights' casts kept between the passes, where a device holds its whole model's
    /// weights ([`Model::fp8_weight_cache`]); none otherwise (each pass casts W).
    cache: Option<WeightCache>,
    /// The experts' states and casts, where their products run in FP8.
    experts: Option<ExpertBuffers>,
    /// How a first cast of a tensor scales: the recipe's.
    scaling: Scaling,
    /// The delayed recipe's `2^margin` headroom.
    margin: u32,
}

impl Fp8Buffers {
    /// The initial states of all operands, to upload at the start of a run (scale 1).
    pub fn initial_states(&self) -> Vec<f32> {
        let formats = Operand::ALL.map(Operand::format);
        let history = self.stride - State::len(0);
        let operands = self.states.len / self.stride;
        (0..operands).flat_map(|i| State::initial(formats[i % 3], history)).collect()
    }

    /// Elements of one operand's state: what [`Backend::fp8_delayed_update`] steps by.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The end of an optimizer step: the delayed recipe rolls every operand's amax into its
    /// history and sets the next step's scales (nothing under tensorwise scaling).
    pub fn step_done<B: Backend>(&self, be: &mut B) {
        if self.scaling == Scaling::Delayed {
            be.fp8_delayed_update(self.states, self.stride, self.margin);
        }
    }

    /// The weight's kept casts of `linear` in whole-model layer `layer` (`len` elements): the
    /// forward pass's layout (where the optimizer writes it) and the transposed one.
    fn cached(&self, layer: usize, linear: Linear, len: usize) -> Option<(Option<View>, View)> {
        self.cache.map(|c| {
            let at = layer * c.stride + c.at[linear as usize];
            (c.w.map(|w| w.at(at, len)), c.wt.at(at, len))
        })
    }

    /// Whether the optimizer writes the weights' casts ([`Model::fp8_weight_copies`]).
    fn optimizer_casts(&self) -> bool {
        self.cache.is_some_and(|c| c.w.is_some())
    }

    fn state(&self, layer: usize, linear: Linear, operand: Operand) -> State {
        self.operand_state((layer * Linear::ALL.len() + linear as usize) * 3, operand)
    }

    /// `operand`'s state of the product whose three states start at state `first`.
    fn operand_state(&self, first: usize, operand: Operand) -> State {
        let index = first + operand as usize;
        State { view: self.states.at(index * self.stride, self.stride), format: operand.format() }
    }
}

impl Model {
    /// Takes the FP8 buffers of a plan for `n` tokens from `take`, or shares `reuse`'s; none
    /// when the model has no FP8 policy or no product qualifies.
    pub(super) fn plan_fp8(
        &self,
        n: usize,
        take: &mut dyn FnMut(BufKind, usize) -> View,
        reuse: Option<&Plan>,
    ) -> Option<Fp8Buffers> {
        let policy = self.fp8.as_ref()?;
        let m = &self.config;
        let covered = Linear::ALL.map(|l| policy.covers(m, l, n));
        let experts = policy.covers_experts(m);
        if !covered.contains(&true) && !experts {
            return None;
        }
        if let Some(r) = reuse {
            return r.fp8;
        }
        let widths = Linear::ALL.iter().zip(covered).filter(|(_, c)| *c).map(|(l, _)| l.widths(m));
        let (mut x, mut w, mut dy) = (0, 0, 0);
        for (inp, out) in widths {
            (x, w, dy) = (x.max(n * inp), w.max(inp * out), dy.max(n * out));
        }
        let stride = policy.stride();
        let cache = self.fp8_weight_cache.then(|| {
            let mut at = [0; 8];
            let mut stride = 0;
            for (k, l) in Linear::ALL.iter().enumerate().filter(|&(k, _)| covered[k]) {
                let (inp, out) = l.widths(m);
                at[k] = stride;
                stride += (inp * out).next_multiple_of(16);
            }
            let wt = take(BufKind::Fp8, m.n_layers * stride);
            let w = self.fp8_weight_copies.then(|| take(BufKind::Fp8, m.n_layers * stride));
            WeightCache { wt, w, at, stride }
        });
        let dense_states = m.n_layers * Linear::ALL.len() * 3;
        let states = take(BufKind::Scalars, (dense_states + if experts { m.n_layers * 2 * 3 } else { 0 }) * stride);
        let experts = m.moe.as_ref().filter(|_| experts).map(|moe| {
            let (d, f) = (m.d_model, m.mlp_dim);
            // The casts span the buffers they cast (the products address rows in them): the
            // routed rows `xe` and their gradients (every slot), the received ones on an expert
            // axis, and the rows' MLP activations.
            let (slots, received) = (n * moe.top_k, moe.most_received(n, self.expert_ranks));
            let block = self.layout.layers.iter().filter_map(|o| o.experts()).map(|r| r.len()).max().unwrap_or(0);
            ExpertBuffers {
                first_state: dense_states,
                x: take(BufKind::Fp8, (slots * d).max(received * d.max(f))),
                dy: take(BufKind::Fp8, (slots * d).max(received * d.max(2 * f))),
                w: take(BufKind::Fp8, block),
            }
        });
        Some(Fp8Buffers {
            states,
            stride,
            covered,
            experts,
            x: take(BufKind::Fp8, x),
            w: take(BufKind::Fp8, w),
            dy: take(BufKind::Fp8, dy),
            dyt: take(BufKind::Fp8, dy),
            cache,
            scaling: match policy.config.recipe {
                Fp8Recipe::Tensorwise => Scaling::Current,
                Fp8Recipe::Delayed => Scaling::Delayed,
            },
            margin: policy.config.margin,
        })
    }

    /// Which linear layers' inputs the forward pass keeps cast for the backward pass, for
    /// micro-batches of `n` tokens ([`Model::fp8_keep_inputs`]): the FP8 products whose input
    /// nothing but their weight gradient reads, so that the layer keeps the cast instead of the
    /// input. q/k/v's (the first norm's output; latent attention's is read by its RoPE key's
    /// product too), gate/up's (the second norm's; a mixture of experts' router reads it, but
    /// its MLP is not covered) and down's (the gated unit's output; its backward pass reads
    /// gate/up's). Not `o`'s: attention's backward pass reads its output.
    pub(super) fn fp8_kept(&self, n: usize) -> [bool; 8] {
        let keep = self.fp8_keep_inputs && self.remat == crate::config::Remat::None;
        let Some(policy) = self.fp8.as_ref().filter(|_| keep) else { return [false; 8] };
        Linear::ALL.map(|l| matches!(l, Linear::Qkv | Linear::Up | Linear::Down) && policy.covers(&self.config, l, n))
    }

    /// Takes a layer's [`KeptInput`]s from `take` for micro-batches of `n` tokens (indexed by
    /// [`Linear`]; none where `kept`, [`Model::fp8_kept`]'s answer, says no).
    pub(super) fn plan_kept_inputs(
        &self,
        n: usize,
        kept: [bool; 8],
        take: &mut dyn FnMut(BufKind, usize) -> View,
    ) -> [Option<KeptInput>; 8] {
        let tensorwise = self.fp8.as_ref().is_some_and(|f| f.config.recipe == Fp8Recipe::Tensorwise);
        Linear::ALL.map(|l| {
            kept[l as usize].then(|| KeptInput {
                xt: take(BufKind::Fp8, n * l.widths(&self.config).0),
                state: tensorwise.then(|| take(BufKind::Scalars, State::len(0))),
            })
        })
    }

    /// What runs in FP8 under this model's policy with plan `p`, for the start-up line: the
    /// recipe and the linear layers, or that none qualified; none without the policy.
    pub fn describe_fp8(&self, p: &Plan) -> Option<String> {
        let policy = self.fp8.as_ref()?;
        let c = &policy.config;
        Some(match p.fp8 {
            Some(f) => {
                let mut on: Vec<&str> =
                    Linear::NAMES.iter().zip(f.covered).filter(|(_, c)| *c).map(|(n, _)| *n).collect();
                if f.experts.is_some() {
                    on.push("experts");
                }
                let recipe = match c.recipe {
                    Fp8Recipe::Tensorwise => "tensorwise".to_string(),
                    Fp8Recipe::Delayed => format!("delayed, history {}, margin {}", c.amax_history, c.margin),
                };
                format!("FP8 ({recipe}): {}", on.join(", "))
            }
            None => format!(
                "FP8 asked, but no linear layer qualifies (widths of at least train.fp8.min_dim = {}, multiples of 16, and {} tokens a micro-batch, a multiple of 16): all in bf16",
                c.min_dim,
                p.batch * p.seq
            ),
        })
    }

    /// The weights FSDP gathers as their E4M3 casts ([`Model::fp8_gathers`]), for micro-batches
    /// of `n` tokens: every covered linear layer's weight of every layer, in layout order, with
    /// its state in `p` where given (the memory plan asks without one); none otherwise.
    pub fn fp8_cast_weights(&self, n: usize, p: Option<&Plan>) -> Vec<CastWeight> {
        let Some(policy) = self.fp8.as_ref().filter(|_| self.fp8_gathers) else { return Vec::new() };
        let covered = Linear::ALL.map(|l| policy.covers(&self.config, l, n));
        let scaling = match policy.config.recipe {
            Fp8Recipe::Tensorwise => Scaling::Current,
            Fp8Recipe::Delayed => Scaling::Delayed,
        };
        let mut casts = Vec::new();
        for (i, layer) in self.layout.stage.layer_indices().enumerate() {
            let mut weights: Vec<CastWeight> = (Linear::ALL.iter().filter(|l| covered[**l as usize]))
                .map(|&linear| {
                    let (inp, out) = linear.widths(&self.config);
                    let offset = weight_offset(&self.layout.layers[i], linear);
                    let state = p.and_then(|p| p.fp8).map(|f| f.state(layer, linear, Operand::W));
                    CastWeight { range: offset..offset + inp * out, state, scaling }
                })
                .collect();
            weights.sort_by_key(|w| w.range.start);
            casts.extend(weights);
        }
        casts
    }

    /// The weights whose casts the optimizer writes ([`Model::fp8_weight_copies`]): every
    /// covered linear layer's weight of every layer, with its casts in `p` and its state; none
    /// otherwise.
    pub fn fp8_weight_casts(&self, p: &Plan) -> Vec<WeightCast> {
        let Some(f) = p.fp8.filter(Fp8Buffers::optimizer_casts) else { return Vec::new() };
        let mut casts = Vec::new();
        for (i, layer) in self.layout.stage.layer_indices().enumerate() {
            for &linear in Linear::ALL.iter().filter(|l| f.covered[**l as usize]) {
                let (inp, out) = linear.widths(&self.config);
                let Some((Some(q), qt)) = f.cached(layer, linear, inp * out) else { unreachable!() };
                let offset = weight_offset(&self.layout.layers[i], linear);
                let state = f.state(layer, linear, Operand::W);
                casts.push(WeightCast { offset, rows: out, cols: inp, q, qt, state });
            }
        }
        casts
    }

    /// Casts every weight of [`Model::fp8_weight_casts`] from the parameters as they are: before
    /// the first pass, and after anything but the fused AdamW step changed them (a checkpoint
    /// loaded, Muon, QK-clip). A pass would have cast the same bytes and recorded the same amax.
    pub fn refresh_fp8_weight_casts<B: Backend>(&self, be: &mut B, p: &Plan) {
        for c in self.fp8_weight_casts(p) {
            c.cast(be, p.params);
        }
    }

    /// The FP8 buffers of `p` if `linear` runs in FP8, with layer `i`'s place in the whole model.
    fn fp8_of(&self, p: &Plan, i: usize, linear: Linear) -> Option<(Fp8Buffers, usize)> {
        let f = p.fp8.filter(|f| f.covered[linear as usize])?;
        let layer = self.layout.stage.layer_indices().nth(i).expect("a layer of the stage");
        Some((f, layer))
    }

    /// `out = x · Wᵀ` (plus `residual`, when given) for `linear` of layer `i`, in FP8 where the
    /// policy says.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_forward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        (i, linear): (usize, Linear),
        out: View,
        (x, w): (View, Weight),
        residual: Option<View>,
        shape: MatMul,
    ) {
        let Some((f, layer)) = self.fp8_of(p, i, linear) else {
            let w = w.plain();
            return match residual {
                Some(c) => be.matmul_add(out, x, w, c, shape),
                None => be.matmul(out, x, w, shape),
            };
        };
        let kept = p.layers[i].fp8_inputs[linear as usize];
        let (sx, sw) = (kept_state(f, layer, linear, kept), f.state(layer, linear, Operand::W));
        let (xq, mut wq) = (f.x.at(0, x.len), f.w.at(0, w.elements()));
        match kept {
            // The kernel producing x wrote both layouts ([`Model::fp8_produced`]).
            Some(_) if self.fp8_produced(p, i, linear).is_some() => {}
            // xᵀ for the backward pass's dW in the same pass: the layer keeps it, not x.
            Some(k) => be.fp8_quantize_both(xq, k.xt, x, sx, f.scaling, shape.k),
            None => be.fp8_quantize(xq, x, sx, f.scaling, None),
        }
        match (w, f.cached(layer, linear, w.elements())) {
            // FSDP gathered the cast (its piece's amax recorded by each device).
            (Weight::Cast(q), _) => wq = q,
            // Both layouts as the last optimizer step wrote them: nothing to cast.
            (Weight::Plain(_), Some((Some(kept), _))) => wq = kept,
            // W `[O, I]` and Wᵀ `[I, O]` in one pass: the backward pass's dx product reads Wᵀ.
            (Weight::Plain(w), Some((None, wt))) => be.fp8_quantize_both(wq, wt, w, sw, f.scaling, shape.k),
            (Weight::Plain(w), None) => be.fp8_quantize(wq, w, sw, f.scaling, None),
        }
        match residual {
            Some(c) => be.matmul_fp8_add(out, xq, wq, c, shape, [sx, sw], true),
            None => be.matmul_fp8(out, xq, wq, shape, [sx, sw], true),
        }
    }

    /// Where the kernel producing `linear`'s input in layer `i` writes it cast, in its own pass:
    /// the RMSNorm before q/k/v and gate/up ([`Backend::rmsnorm_fp8`]), the SwiGLU before down
    /// ([`Backend::swiglu_fp8`]). The product's x cast, the kept transposed one, and x's state;
    /// under the delayed recipe (whose scale is known before the producer runs), where the layer
    /// keeps the input cast (then nothing reads the producer's bf16 output). None otherwise:
    /// tensorwise scaling (the scale needs the output's amax first), GPT's LayerNorm and GELU,
    /// Gemma's GeGLU.
    pub(super) fn fp8_produced(&self, p: &Plan, i: usize, linear: Linear) -> Option<(View, View, State)> {
        let kept = p.layers[i].fp8_inputs[linear as usize]?;
        let (f, layer) = self.fp8_of(p, i, linear)?;
        let producer = match linear {
            Linear::Qkv | Linear::Up => !self.config.is_gpt(),
            Linear::Down => !self.config.is_gpt() && self.dense_glu() == crate::backend::Glu::Swiglu,
            _ => false,
        };
        let fused = producer && f.scaling == Scaling::Delayed;
        fused.then(|| (f.x.at(0, kept.xt.len), kept.xt, kept_state(f, layer, linear, Some(kept))))
    }

    /// The backward pass of [`Model::linear_forward`]: `dx = dy · W` (added to `dx` when
    /// `shape_dx` accumulates) and `dW += dyᵀ · x`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_backward<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        (i, linear): (usize, Linear),
        (dx, dw): (View, View),
        dy: View,
        (x, w): (View, Weight),
        (shape_dx, shape_dw): (MatMul, MatMul),
    ) {
        let Some((f, layer)) = self.fp8_of(p, i, linear) else {
            be.matmul(dx, dy, w.plain(), shape_dx);
            be.matmul(dw, dy, x, shape_dw);
            return;
        };
        let [_, sw, sdy] = Operand::ALL.map(|o| f.state(layer, linear, o));
        let kept = p.layers[i].fp8_inputs[linear as usize];
        let sx = kept_state(f, layer, linear, kept);
        let (xq, wq, dyq, dyqt) = (f.x.at(0, x.len), f.w.at(0, w.elements()), f.dy.at(0, dy.len), f.dyt.at(0, dy.len));
        // FP8 products take one layout, `a · bᵀ`: dx = dy · (Wᵀ)ᵀ and dW = dyᵀ · (xᵀ)ᵀ, with
        // Wᵀ, dyᵀ and xᵀ cast transposed (`[O, I]`, `[N, O]` and `[N, I]` read by columns).
        let linear_form = |s: MatMul| MatMul { a_t: false, b_t: true, ..s };
        let (inp, out) = (shape_dx.n, shape_dx.k);
        // dy's second cast and W's in the backward pass take the scale their first set (W's in
        // this layer's forward pass: the weight has not changed since). x's, where the layer
        // did not keep it, does not: another micro-batch's forward pass may have cast its own x
        // with the same state since.
        be.fp8_quantize_both(dyq, dyqt, dy, sdy, f.scaling, out);
        // Wᵀ as this layer's forward pass cast it, or cast again (the weight has not changed
        // since: the same bytes), or FSDP's gathered cast transposed.
        let wt = match (w, f.cached(layer, linear, w.elements())) {
            (_, Some((_, wt))) => wt,
            (Weight::Cast(q), None) => {
                be.fp8_transpose(wq, q, inp);
                wq
            }
            (Weight::Plain(w), None) => {
                be.fp8_quantize(wq, w, sw, Scaling::Again, Some(inp));
                wq
            }
        };
        be.matmul_fp8(dx, dyq, wt, linear_form(shape_dx), [sdy, sw], false);
        let xt = kept.map(|k| k.xt).unwrap_or_else(|| {
            be.fp8_quantize(xq, x, sx, f.scaling, Some(inp));
            xq
        });
        be.matmul_fp8(dw, dyqt, xt, linear_form(shape_dw), [sdy, sx], false);
    }
}

/// The state x of `linear` in whole-model layer `layer` is cast with: the kept input's own
/// under tensorwise scaling, else the layer's.
fn kept_state(f: Fp8Buffers, layer: usize, linear: Linear, kept: Option<KeptInput>) -> State {
    match kept.and_then(|k| k.state) {
        Some(view) => State { view, format: Operand::X.format() },
        None => f.state(layer, linear, Operand::X),
    }
}

/// A layer's two grouped expert products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in super::super) enum Expert {
    /// Gate and up (`w13`, or GPT-OSS's `gate_up_proj`).
    Up,
    /// Down (`w2`).
    Down,
}

/// How a layer's grouped expert products run ([`Model::expert_matmuls`]): in the model's
/// precision, or in FP8 with the layer's experts' weights cast (`Fp8`). The passes call the
/// same methods either way: `input` and `grad` cast a product's rows and their gradients (the
/// views themselves in the model's precision), the products read what they returned.
// One a layer's pass, on the stack: boxing the FP8 variant would allocate per layer for nothing.
#[allow(clippy::large_enum_variant)]
pub(in super::super) enum ExpertMatmuls {
    Plain,
    Fp8 {
        buffers: ExpertBuffers,
        /// `[gate/up, down]` × `[x, W, dy]`; W's of gate/up scales the whole cast block.
        states: [[State; 3]; 2],
        scaling: Scaling,
        /// The layer's experts' weights as the window holds them (what `w` casts).
        block: View,
    },
}

impl ExpertMatmuls {
    /// The rows `x` of `which`'s products as they read them: under FP8 the first `cast`
    /// elements (the rows in use) cast to E4M3 (the state's scale as the recipe sets it, the
    /// amax recorded under the delayed one), in a view as long as `x`.
    pub(super) fn input<B: Backend>(&self, be: &mut B, which: Expert, x: View, cast: usize) -> View {
        self.cast(be, which, (x, cast), Operand::X)
    }

    /// The gradients `dy` of `which`'s outputs as its backward products read them: E5M2.
    pub(super) fn grad<B: Backend>(&self, be: &mut B, which: Expert, dy: View, cast: usize) -> View {
        self.cast(be, which, (dy, cast), Operand::Dy)
    }

    fn cast<B: Backend>(&self, be: &mut B, which: Expert, (x, cast): (View, usize), operand: Operand) -> View {
        let ExpertMatmuls::Fp8 { buffers, states, scaling, .. } = self else { return x };
        let q = if operand == Operand::X { buffers.x } else { buffers.dy }.at(0, x.len);
        be.fp8_quantize(q.at(0, cast), x.at(0, cast), states[which as usize][operand as usize], *scaling, None);
        q
    }

    /// The weights of `weights` (views in the block) as the products read them.
    fn weights(&self, weights: ExpertWeights) -> ExpertWeights {
        match self {
            ExpertMatmuls::Plain => weights,
            ExpertMatmuls::Fp8 { buffers, block, .. } => {
                assert!(weights.first.buf == block.buf && weights.first.offset >= block.offset);
                ExpertWeights { first: buffers.w.at(weights.first.offset - block.offset, weights.first.len), ..weights }
            }
        }
    }

    /// `out = a · W_eᵀ` (the forward pass, `a` from [`ExpertMatmuls::input`]) or `dy · W_e`
    /// (`dx`: `a` from [`ExpertMatmuls::grad`]) for every expert's rows of `dispatch`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul<B: Backend>(
        &self,
        be: &mut B,
        which: Expert,
        out: View,
        a: View,
        weights: ExpertWeights,
        dispatch: MoeDispatch,
        shape: MatMul,
    ) {
        match self {
            ExpertMatmuls::Plain => be.moe_expert_matmul(out, a, weights, dispatch, shape),
            ExpertMatmuls::Fp8 { states, .. } => {
                let sa = states[which as usize][if shape.b_t { Operand::X } else { Operand::Dy } as usize];
                let sw = states[Expert::Up as usize][Operand::W as usize];
                be.moe_expert_matmul_fp8(out, a, self.weights(weights), dispatch, shape, [sa, sw]);
            }
        }
    }

    /// `dW_e += dyᵀ · x` over every expert's rows (`dy` from [`ExpertMatmuls::grad`], `x` from
    /// [`ExpertMatmuls::input`]); `dims` = (inp, out).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_dw<B: Backend>(
        &self,
        be: &mut B,
        which: Expert,
        dweights: ExpertWeights,
        dy: View,
        x: View,
        dispatch: MoeDispatch,
        (inp, out): (usize, usize),
    ) {
        match self {
            ExpertMatmuls::Plain => be.moe_expert_matmul_dw(dweights, dy, x, dispatch, inp, out),
            ExpertMatmuls::Fp8 { states, .. } => {
                let [sx, _, sdy] = states[which as usize];
                be.moe_expert_matmul_dw_fp8(dweights, dy, x, dispatch, (inp, out), [sdy, sx]);
            }
        }
    }
}

impl Model {
    /// Layer `i`'s grouped expert products: in FP8 where the policy covers them, the layer's
    /// experts' weights `block` cast first (in the backward pass at the forward pass's scale:
    /// the weights have not changed since).
    pub(super) fn expert_matmuls<B: Backend>(
        &self,
        be: &mut B,
        p: &Plan,
        i: usize,
        block: View,
        backward: bool,
    ) -> ExpertMatmuls {
        let Some((f, buffers)) = p.fp8.and_then(|f| Some((f, f.experts?))) else { return ExpertMatmuls::Plain };
        let layer = self.layout.stage.layer_indices().nth(i).expect("a layer of the stage");
        let states =
            [0, 1].map(|which| Operand::ALL.map(|o| f.operand_state(buffers.first_state + (layer * 2 + which) * 3, o)));
        let w = states[Expert::Up as usize][Operand::W as usize];
        be.fp8_quantize(buffers.w.at(0, block.len), block, w, if backward { Scaling::Again } else { f.scaling }, None);
        ExpertMatmuls::Fp8 { buffers, states, scaling: f.scaling, block }
    }
}

/// Where `linear`'s weight starts in the parameters, in a layer laid out at `o`: the offsets the
/// attention and MLP kinds read it at (latent attention's kv_a: the latent's rows, the first).
fn weight_offset(o: &LayerOffsets, linear: Linear) -> usize {
    match (&o.attn, &o.mlp, linear) {
        (AttnOffsets::Gqa(a), _, Linear::Qkv) => a.qkv,
        (AttnOffsets::Gqa(a), _, Linear::O) => a.o,
        (AttnOffsets::Mla(a), _, Linear::O) => a.o,
        (AttnOffsets::Mla(a), _, Linear::QDown) => match a.q {
            QueryOffsets::Latent { down, .. } => down,
            QueryOffsets::Direct(_) => unreachable!("internal error: a query down-projection without a latent"),
        },
        (AttnOffsets::Mla(a), _, Linear::QUp) => match a.q {
            QueryOffsets::Latent { up, .. } => up,
            QueryOffsets::Direct(q) => q,
        },
        (AttnOffsets::Mla(a), _, Linear::KvDown) => a.kv_a,
        (AttnOffsets::Mla(a), _, Linear::KvUp) => a.kv_b,
        (_, MlpOffsets::Dense { gate_up, .. }, Linear::Up) => *gate_up,
        (_, MlpOffsets::Dense { down, .. }, Linear::Down) => *down,
        _ => unreachable!("internal error: {linear:?} has no weight in this layer"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::config::ModelConfig;
    use crate::model::{Alone, init};

    /// A layer whose every linear product qualifies at `min_dim = 16`: widths of 32 and 64.
    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 40,
            d_model: 32,
            n_layers: 2,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 16,
            mlp_dim: 48,
            max_seq_len: 32,
            init_std: 0.2,
            ..ModelConfig::default()
        }
    }

    fn policy(recipe: Fp8Recipe, min_dim: usize) -> Fp8Policy {
        Fp8Policy { config: Fp8Config { recipe, min_dim, amax_history: 4, ..Fp8Config::default() } }
    }

    /// Latent attention whose every projection but the RoPE key's (16 wide) qualifies at
    /// `min_dim = 16`, with or without a query latent.
    fn latent(q_lora_rank: usize) -> ModelConfig {
        use crate::config::{Family, MlaConfig};
        let mla =
            MlaConfig { q_lora_rank, kv_lora_rank: 16, nope_dim: 16, rope_dim: 16, v_dim: 16, ..MlaConfig::default() };
        ModelConfig { family: Family::DeepseekV3, n_kv_heads: 2, head_dim: 32, mla: Some(mla), ..config() }
    }

    /// A model of `m` (FP8 by `fp8`) on the CPU with its parameters and 16 tokens; returns the
    /// gradient of the mean loss after one forward and backward pass.
    fn run_model(m: &ModelConfig, fp8: Option<Fp8Policy>) -> (Model, Cpu, Plan, Vec<f32>) {
        run_cached(m, fp8, false)
    }

    /// [`run_model`], the weights' transposed casts kept from the forward pass (`cache`).
    fn run_cached(m: &ModelConfig, fp8: Option<Fp8Policy>, cache: bool) -> (Model, Cpu, Plan, Vec<f32>) {
        run_tokens(m, fp8, cache, 16)
    }

    /// [`run_cached`] on `n` tokens.
    fn run_tokens(m: &ModelConfig, fp8: Option<Fp8Policy>, cache: bool, n: usize) -> (Model, Cpu, Plan, Vec<f32>) {
        let mut model = Model::new(m);
        model.fp8 = fp8;
        model.fp8_weight_cache = cache;
        let mut cpu = Cpu::new();
        let plan = model.plan(&mut cpu, 1, n);
        cpu.upload(plan.params, &init::params(&model, 5));
        let tokens: Vec<u32> = (0..=n).map(|i| (i * 7 % 40) as u32).collect();
        cpu.upload_idx(plan.tokens, &tokens[..n]);
        cpu.upload_idx(plan.targets, &tokens[1..]);
        model.forward(&mut cpu, &plan, Some(1.0 / n as f32), &mut Alone);
        model.backward(&mut cpu, &plan, 0.0, &mut Alone);
        let mut grads = vec![0f32; plan.grads.len];
        cpu.download(plan.grads, &mut grads);
        (model, cpu, plan, grads)
    }

    fn run(fp8: Option<Fp8Policy>) -> (Model, Cpu, Plan, Vec<f32>) {
        run_model(&config(), fp8)
    }

    /// Every tensor's FP8 gradient (both recipes) against its f32 gradient, for model `m`.
    fn assert_gradients_follow(m: &ModelConfig) {
        assert_gradients_follow_on(m, 16, 0.9)
    }

    /// [`assert_gradients_follow`] on `n` tokens, each cosine above `least`.
    fn assert_gradients_follow_on(m: &ModelConfig, n: usize, least: f64) {
        let (_, _, _, exact) = run_tokens(m, None, false, n);
        for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Delayed] {
            let (model, _, _, fp8) = run_tokens(m, Some(policy(recipe, 16)), false, n);
            assert_ne!(exact, fp8, "{recipe:?}: the FP8 products were not used");
            for t in &model.layout.tensors {
                let r = t.offset..t.offset + t.len();
                let (e, f) = (&exact[r.clone()], &fp8[r]);
                let dot: f64 = e.iter().zip(f).map(|(&a, &b)| a as f64 * b as f64).sum();
                let norm = |v: &[f32]| v.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt();
                let (cosine, ratio) = (dot / (norm(e) * norm(f)), norm(f) / norm(e));
                // E5M2 gradients keep 2 mantissa bits: each element moves by up to 1/8, and the
                // noise adds up through the layers; a wrong scale would show in the ratio.
                assert!(
                    cosine > least && (0.8..1.25).contains(&ratio),
                    "{recipe:?}: {}: cosine {cosine:.4}, norm ratio {ratio:.3} against the f32 gradient",
                    t.name
                );
            }
        }
    }

    fn get(cpu: &mut Cpu, v: View) -> Vec<f32> {
        let mut out = vec![0f32; v.len];
        cpu.download(v, &mut out);
        out
    }

    /// `x` cast as tensorwise scaling casts it: (the FP8 values, 1 / scale).
    fn cast(x: &[f32], format: Fp8Format) -> (Vec<f64>, f64) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = format.max() / amax;
        (x.iter().map(|&v| format.round(v * scale) as f64).collect(), 1.0 / scale as f64)
    }

    #[test]
    fn a_forward_product_multiplies_the_rounded_operands() {
        let (model, mut cpu, plan, _) = run(Some(policy(Fp8Recipe::Tensorwise, 16)));
        let (a, o) = (&plan.layers[0], &model.layout.layers[0]);
        let (n, d, width) = (16, 32, 64);
        let ln1 = get(&mut cpu, a.ln1);
        let w = get(&mut cpu, plan.params.at(o.attn.gqa().qkv, width * d));
        // q before RoPE is what the product wrote: compare the v columns, which RoPE leaves.
        let qkv = get(&mut cpu, a.qkv);
        let ((xq, sx), (wq, sw)) = (cast(&ln1, Fp8Format::E4M3), cast(&w, Fp8Format::E4M3));
        let (mut worst, mut moved) = (0f64, 0f64);
        for r in 0..n {
            for c in 48..width {
                let exact: f64 = (0..d).map(|k| ln1[r * d + k] as f64 * w[c * d + k] as f64).sum();
                let fp8: f64 = (0..d).map(|k| xq[r * d + k] * wq[c * d + k]).sum::<f64>() * sx * sw;
                worst = worst.max((qkv[r * width + c] as f64 - fp8).abs());
                moved = moved.max((exact - fp8).abs());
            }
        }
        assert!(worst < 1e-5, "the product differs from the rounded operands' by {worst}");
        assert!(moved > 1e-3, "FP8 rounding should move the product (by {moved} at most)");
    }

    /// The weights' transposed casts kept from the forward pass give the backward pass the
    /// bytes it would cast itself: the same gradients, bit for bit, both recipes, for grouped-query
    /// and latent attention; the cache is one byte a covered weight in the FP8 buffers.
    #[test]
    fn the_kept_weight_casts_change_no_gradient() {
        for m in [config(), latent(16)] {
            for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Delayed] {
                let (_, _, plain, cast_again) = run_cached(&m, Some(policy(recipe, 16)), false);
                let (model, _, cached, kept) = run_cached(&m, Some(policy(recipe, 16)), true);
                assert_eq!(kept, cast_again, "{recipe:?}: the kept casts changed a gradient");
                let (Some(a), Some(b)) = (plain.fp8, cached.fp8) else { panic!("FP8 buffers") };
                let weights: usize = Linear::ALL
                    .iter()
                    .filter(|l| b.covered[**l as usize])
                    .map(|l| l.widths(&model.config))
                    .map(|(i, o)| (i * o).next_multiple_of(16))
                    .sum();
                assert!(
                    a.cache.is_none() && b.cache.is_some_and(|c| c.wt.len == m.n_layers * weights && c.w.is_none())
                );
            }
        }
    }

    #[test]
    fn fp8_gradients_point_where_the_f32_gradients_do() {
        assert_gradients_follow(&config());
    }

    /// Latent attention's projections run in FP8 (the RoPE key's aside), with a query latent
    /// or without, and their gradients follow the f32 ones.
    #[test]
    fn latent_attention_projections_run_in_fp8() {
        for (q_lora, want) in [(16, "o, gate/up, down, q_a, q_b, kv_a, kv_b"), (0, "o, gate/up, down, q_b, kv_a, kv_b")]
        {
            let m = latent(q_lora);
            let (model, _, plan, _) = run_model(&m, Some(policy(Fp8Recipe::Tensorwise, 16)));
            let line = model.describe_fp8(&plan).unwrap();
            assert_eq!(line, format!("FP8 (tensorwise): {want}"), "q_lora_rank {q_lora}");
            assert_gradients_follow(&m);
        }
    }

    /// Experts (4; once with a capacity that drops rows) run their grouped products in FP8 (with
    /// the attention's projections on 16 tokens; alone on 15, which no dense FP8 product
    /// takes), and with the experts' the only FP8 products every gradient follows the f32 one;
    /// the states of the two grouped products follow the dense layers'. (With the attention's
    /// too, at these widths the noise of four FP8 products a layer takes some cosines to 0.80:
    /// the training curves below and the emulator's checks hold that path.) Every token goes to every expert (top 4): with a top-2 choice
    /// the FP8 rounding flips some tokens' choices, and an expert's gradient then moves by the
    /// rows it gained or lost (cosines down to 0.70 measured at these sizes), which says nothing
    /// of the products.
    #[test]
    fn the_experts_grouped_products_run_in_fp8() {
        use crate::config::{Family, MoeConfig};
        for capacity_factor in [None, Some(0.5)] {
            let moe = MoeConfig { num_experts: 4, top_k: 4, capacity_factor, ..MoeConfig::default() };
            let m = ModelConfig { family: Family::Mixtral, moe: Some(moe), d_model: 64, mlp_dim: 64, ..config() };
            for (n, want) in [(16, "q/k/v, o, experts"), (15, "experts")] {
                let (model, _, plan, _) = run_tokens(&m, Some(policy(Fp8Recipe::Tensorwise, 16)), false, n);
                assert_eq!(model.describe_fp8(&plan).unwrap(), format!("FP8 (tensorwise): {want}"));
                let f = plan.fp8.unwrap();
                assert_eq!(f.states.len, m.n_layers * (8 + 2) * 3 * f.stride());
            }
            assert_gradients_follow_on(&m, 15, 0.9);
        }
    }

    #[test]
    fn small_products_stay_in_the_models_precision() {
        let (_, _, plan, grads) = run(Some(policy(Fp8Recipe::Tensorwise, 2048)));
        assert!(plan.fp8.is_none(), "no product reaches min_dim: no FP8 buffers");
        assert_eq!(grads, run(None).3, "the same products as without FP8");
        // Widths or tokens off cuBLASLt's multiple of 16 stay out too.
        let p = policy(Fp8Recipe::Tensorwise, 16);
        let m = config();
        assert!(p.covers(&m, Linear::Qkv, 32));
        assert!(!p.covers(&m, Linear::Qkv, 24));
        assert!(!p.covers(&ModelConfig { d_model: 40, ..m.clone() }, Linear::O, 32));
        let moe = ModelConfig { moe: Some(Default::default()), ..m };
        assert!(!p.covers(&moe, Linear::Up, 32) && p.covers(&moe, Linear::O, 32), "the experts' MLP is no dense one");
        assert!(p.covers_experts(&moe) && !p.covers_experts(&config()), "the experts' grouped products");
        assert!(!p.covers_experts(&ModelConfig { mlp_dim: 40, ..moe }), "experts 40 wide stay out");
    }

    #[test]
    fn delayed_scaling_moves_its_scales_at_the_step_and_not_before() {
        let (_, mut cpu, plan, _) = run(Some(policy(Fp8Recipe::Delayed, 16)));
        let f = plan.fp8.unwrap();
        let before = get(&mut cpu, f.states);
        let s = f.stride();
        assert!(before.chunks(s).all(|st| st[0] == 1.0), "within the first step every scale is 1");
        assert!(before.chunks(s).any(|st| st[2] > 0.0), "the casts recorded amaxes");
        f.step_done(&mut cpu);
        let after = get(&mut cpu, f.states);
        for (b, a) in before.chunks(s).zip(after.chunks(s)) {
            assert_eq!(a[4], b[2], "the amax entered the history");
            if b[2] > 0.0 {
                assert_eq!(a[0], a[3] / b[2], "scale = max / amax");
            }
        }
    }
}
