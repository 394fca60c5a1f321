//! What the passes exchange with the other devices of a parallel run ([`Exchange`]), and the
//! vocabulary of that conversation: the [`Unit`]s of the flat buffers, the [`Pass`] that reads
//! them, and the [`Window`] a unit's parameters or gradients are lent in. Kept apart from the
//! passes so that a parallel strategy (`parallel::strategies`) reads the contract it implements
//! without the model's math around it.

use crate::backend::{Backend, IdxView, Parts, View};

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
    /// sequence axis. Called only when the model's [`SeqSplit`](crate::backend::SeqSplit) has
    /// more than one rank.
    fn seq_gather(&mut self, be: &mut B, local: View, all: View) {
        be.copy(all, local);
    }
    /// `local = Σ_seq group all[this rank's part]`: a reduce-scatter over the sequence axis.
    fn seq_scatter_sum(&mut self, be: &mut B, all: View, local: View) {
        be.copy(local, all);
    }
    /// The expert axis: this device's position in its expert group and the group's size `n`.
    /// Member `j` holds the experts `[j·E/n, (j+1)·E/n)` and runs them on the rows every
    /// member routes to them ([`Exchange::expert_dispatch`]); a device alone holds them all.
    fn expert_rank(&self) -> (usize, usize) {
        (0, 1)
    }
    /// The expert group's all-to-all in equal parts: `input`'s part `j` (of [`Parts`], packed
    /// by [`Backend::moe_pack`]) goes to member `j`, and `output`'s part `s` receives what member
    /// `s` sent this one: the dispatch of packed rows and, backwards, their return. Called only
    /// when [`Exchange::expert_rank`] says more than one member.
    fn expert_exchange(&mut self, be: &mut B, input: View, output: View) {
        be.copy(output, input);
    }
    /// Writes into `runs` each sender's `L + 1` offsets of the rows it sent this member's
    /// experts among the received parts ([`Backend::moe_runs`]), from `offsets` (this member's
    /// rows of each of the model's experts, [`MoeDispatch::offsets`](crate::backend::MoeDispatch)):
    /// the rows' counts travel between the devices, never through the host.
    fn expert_runs(&mut self, be: &mut B, offsets: IdxView, parts: Parts, runs: IdxView) {
        let _ = (be, offsets, parts, runs);
        unreachable!("internal error: an expert exchange without an expert axis")
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
/// buffer), addressed with the layout's offsets; or, for a unit FSDP gathered as FP8 casts, the
/// casts' image of the unit and a compact buffer of the rest ([`CastWindow`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    buf: View,
    /// The layout offset of `buf`'s first element (of the unit, with `cast`).
    start: usize,
    cast: Option<CastWindow>,
}

/// A unit gathered as FP8 casts (`parallel/strategies/fsdp.rs`): `image` holds the unit's FP8
/// weights' E4M3 casts at their places in the unit (what lies between is not read), and the
/// window's buffer the rest, one range after the other: `runs[..count]` are
/// `(layout offset, length, place in the buffer)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CastWindow {
    /// The casts' image.
    pub image: View,
    /// The rest's ranges.
    pub runs: [(usize, usize, usize); CastWindow::RUNS],
    /// How many of `runs` there are.
    pub count: usize,
}

impl CastWindow {
    /// The most ranges of a unit's rest a window maps (a layer's norms and biases take at most
    /// six in every family); a unit with more is gathered whole.
    pub const RUNS: usize = 8;
}

/// A linear layer's weight as a window holds it ([`Window::weight`]): in the model's precision,
/// or its E4M3 cast as FSDP gathered it (the products read it, the transposed one for `dx`
/// through [`crate::backend::Backend::fp8_transpose`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weight {
    /// In the model's precision.
    Plain(View),
    /// Its E4M3 cast, `[O, I]` as the weight.
    Cast(View),
}

impl Weight {
    /// Its elements.
    pub fn elements(self) -> usize {
        match self {
            Weight::Plain(w) | Weight::Cast(w) => w.len,
        }
    }

    /// The weight in the model's precision, for a product that does not run in FP8.
    pub fn plain(self) -> View {
        match self {
            Weight::Plain(w) => w,
            Weight::Cast(_) => unreachable!("internal error: a weight gathered in FP8 for a product in bf16"),
        }
    }
}

impl Window {
    /// The whole flat buffer.
    pub fn whole(buf: View) -> Window {
        Window { buf, start: 0, cast: None }
    }

    /// A buffer holding the layout's elements from `start` on (a unit's).
    pub fn from(buf: View, start: usize) -> Window {
        Window { buf, start, cast: None }
    }

    /// A unit gathered as FP8 casts, from layout offset `start`: its rest in `buf`.
    pub fn cast(buf: View, start: usize, cast: CastWindow) -> Window {
        Window { buf, start, cast: Some(cast) }
    }

    /// The same buffer addressed with offsets `by` lower: those of a layout that is a part of
    /// this one starting at `by` (a virtual stage's, inside its device's).
    pub fn rebased(self, by: usize) -> Window {
        let cast = self.cast.map(|mut c| {
            c.runs[..c.count].iter_mut().for_each(|r| r.0 -= by);
            c
        });
        Window { buf: self.buf, start: self.start - by, cast }
    }

    /// The tensor at layout offset `offset`, `len` elements, in the model's precision.
    pub fn at(self, offset: usize, len: usize) -> View {
        let Some(c) = self.cast else { return self.buf.at(offset - self.start, len) };
        match c.runs[..c.count].iter().find(|r| r.0 <= offset && offset + len <= r.0 + r.1) {
            Some(&(first, _, at)) => self.buf.at(at + offset - first, len),
            None => panic!("internal error: layout elements {offset}..{} were gathered as FP8 casts", offset + len),
        }
    }

    /// The weight at layout offset `offset`, `len` elements: its FP8 cast where the unit was
    /// gathered as casts and it is one of them, else [`Window::at`]'s.
    pub fn weight(self, offset: usize, len: usize) -> Weight {
        match self.cast {
            Some(c) if !c.runs[..c.count].iter().any(|r| r.0 <= offset && offset < r.0 + r.1) => {
                Weight::Cast(c.image.at(offset - self.start, len))
            }
            _ => Weight::Plain(self.at(offset, len)),
        }
    }
}

/// The [`Exchange`] of a single device: nothing to exchange.
pub struct Alone;

impl<B: Backend> Exchange<B> for Alone {}
