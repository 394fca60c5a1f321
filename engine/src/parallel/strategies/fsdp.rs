//! FSDP / ZeRO-3 (see the parent module's documentation): a device's pieces of every unit, the
//! buffers it lends the passes for the time of a use (its loans), gathering parameters and
//! reduce-scattering gradients, and the sizes of all of it for the memory plan.
//!
//! **FP8 gathers** (`train.precision = "fp8"`: torchao's float8 all-gather). A unit whose
//! weights run in FP8 products travels as their E4M3 casts where that moves fewer bytes: each
//! device casts its piece of each such weight with the weight's scale, the same on every device
//! so that no scale travels. Under the delayed recipe it is the last update's (the amaxes are
//! maxed over the batch group before each update), and each piece records its amax (the group's
//! maximum is the whole weight's). Under tensorwise scaling it is the whole weight's amax's,
//! taken once the weights changed ([`Fsdp::scale_weights`]: the pieces' amaxes, their maximum
//! over the group). The unit's casts are gathered at one byte an element into
//! an image of the unit, where the passes read each weight's cast in place of casting it
//! ([`crate::model::Weight::Cast`]). The rest of the unit (norms, biases, whatever runs in the
//! model's precision) is gathered in bf16 into a compact buffer: each device packs its pieces'
//! rest, the gather pads each part to the longest, one copy a device unpacks it.

use std::ops::Range;

use crate::backend::fp8::{Scaling, slot};
use crate::backend::{Backend, BufKind, Segment, View};
use crate::model::{CastWeight, CastWindow, Layout, Pass, Window};
use crate::parallel::comm::Collectives;

/// A device's pieces under FSDP, and the buffers it lends the passes.
pub(super) struct Fsdp {
    /// Per unit (in [`Layout::units`] order): its range of the full buffers, the piece length
    /// and where this device's piece starts in the shard buffers.
    pub(super) units: Vec<UnitPiece>,
    pub(super) params: View,
    pub(super) grads: View,
    /// Gathered parameters of the units in use.
    gathered: Loans,
    /// Gradients of the units the backward pass is writing.
    accumulating: Loans,
    /// The unit whose gather was started ahead of its use and not yet waited for.
    prefetched: Option<usize>,
    /// Per unit, how it travels in FP8, where it does.
    casts: Vec<Option<CastUnit>>,
    /// The rest parts of an FP8 unit's gather, each device's padded to the longest
    /// ([`CastUnit::rest_piece`]) before they are unpacked into the loan.
    rest_scratch: View,
    /// Whether the weights changed since their tensorwise scales were last taken
    /// ([`Fsdp::scale_weights`]).
    scales_stale: bool,
    options: FsdpOptions,
    pub(super) segments: Vec<Segment>,
    /// This device's position in the fsdp group.
    me: usize,
}

/// A unit under FSDP: its range of the full buffers, the piece length, and where a device's
/// piece starts in its shard buffers.
pub type UnitPiece = (Range<usize>, usize, usize);

/// Under FSDP over `size` devices: each unit of `layout` (its range, piece length and where the
/// piece starts in a device's shard) and the shard's length.
pub fn fsdp_pieces(layout: &Layout, size: usize) -> (Vec<UnitPiece>, usize) {
    let mut units = Vec::new();
    let mut len = 0;
    for unit in layout.units() {
        let range = layout.unit_range(unit);
        let piece = range.len().div_ceil(size);
        units.push((range, piece, len));
        len += piece;
    }
    (units, len)
}

/// Elements of the buffers one device allocates under FSDP over `size` devices: what the memory
/// plan counts ([`crate::parallel::memory`]) and [`super::Parallel::new`] allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpSizes {
    /// This device's pieces: parameters, gradients, and each AdamW moment.
    pub shard: usize,
    /// Buffers lent for gathered parameters (with the FP8 gathers' rest, compact and padded).
    pub gathered: usize,
    /// Buffers lent for the units gathered as FP8 casts ([`BufKind::Fp8`]).
    pub gathered_fp8: usize,
    /// Buffers lent for the gradients being accumulated.
    pub accumulating: usize,
}

/// The sizes of the buffers [`Fsdp`] allocates for `layout` over `size` devices, the weights of
/// `casts` gathered in FP8 where that moves fewer bytes.
pub fn fsdp_sizes(layout: &Layout, size: usize, options: FsdpOptions, casts: &[CastWeight]) -> FsdpSizes {
    let (units, shard) = fsdp_pieces(layout, size);
    let cast_units = cast_units(&units, size, casts);
    let lending = Lending::new(&units, &cast_units, size, layout.tied, options);
    let (bf16, fp8) = lending.params.iter().fold((0, 0), |(a, b), s| (a + s.1.0, b + s.1.1));
    FsdpSizes {
        shard,
        gathered: bf16 + rest_scratch_len(&cast_units, size),
        gathered_fp8: fp8,
        accumulating: lending.grads.iter().map(|s| s.1.0).sum(),
    }
}

/// A unit gathered as FP8 casts ([`Fsdp`]'s module documentation).
#[derive(Debug, Clone)]
struct CastUnit {
    /// Its FP8 weights, in layout order.
    weights: Vec<CastWeight>,
    /// The rest of the unit: full-buffer ranges in layout order, each with where it starts in
    /// the compact buffer (which holds them one after the other).
    rest: Vec<(Range<usize>, usize)>,
    /// Elements of the rest in each device's piece.
    rest_in: Vec<usize>,
}

impl CastUnit {
    /// Elements of the rest.
    fn rest_len(&self) -> usize {
        self.rest_in.iter().sum()
    }

    /// Elements each device sends of the rest: the largest part.
    fn rest_piece(&self) -> usize {
        self.rest_in.iter().copied().max().unwrap_or(0)
    }
}

/// Per unit, how it travels as FP8 casts: where some of `casts` lie in it, its rest is in at
/// most [`CastWindow::RUNS`] ranges, and the casts and the padded rest move fewer bytes than
/// the unit in bf16 (not a mixture of experts' layer, whose experts stay in the model's
/// precision); none otherwise.
fn cast_units(units: &[UnitPiece], size: usize, casts: &[CastWeight]) -> Vec<Option<CastUnit>> {
    units
        .iter()
        .map(|(unit, piece, _)| {
            let weights: Vec<CastWeight> =
                casts.iter().filter(|c| unit.start <= c.range.start && c.range.end <= unit.end).cloned().collect();
            if weights.is_empty() {
                return None;
            }
            let mut rest = Vec::new();
            let (mut at, mut compact) = (unit.start, 0);
            for w in weights.iter().map(|w| &w.range).chain(std::iter::once(&(unit.end..unit.end))) {
                assert!(w.start >= at, "internal error: FP8 weights overlap or are out of order");
                if w.start > at {
                    rest.push((at..w.start, compact));
                    compact += w.start - at;
                }
                at = w.end;
            }
            let rest_in: Vec<usize> = (0..size)
                .map(|j| {
                    let mine = piece_of(unit, *piece, j);
                    rest.iter().map(|(r, _)| r.end.min(mine.end).saturating_sub(r.start.max(mine.start))).sum()
                })
                .collect();
            let c = CastUnit { weights, rest, rest_in };
            let fewer_bytes = piece * size + 2 * c.rest_piece() * size < 2 * piece * size;
            (c.rest.len() <= CastWindow::RUNS && fewer_bytes).then_some(c)
        })
        .collect()
}

/// Where two ranges meet (empty where they do not).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end)
}

/// The full-buffer range of device `j`'s piece of a unit.
fn piece_of(range: &Range<usize>, piece: usize, j: usize) -> Range<usize> {
    (range.start + j * piece).min(range.end)..(range.start + (j + 1) * piece).min(range.end)
}

/// Elements of [`Fsdp::rest_scratch`]: the longest padded rest gather.
fn rest_scratch_len(casts: &[Option<CastUnit>], size: usize) -> usize {
    casts.iter().flatten().map(|c| c.rest_piece() * size).max().unwrap_or(0)
}

/// The lent buffers, by class: a unit borrows a free buffer of its class.
///
/// Parameters, resharded after the forward pass: the passes use one unit at a time, plus the
/// next layer while a layer computes (prefetch is between layers only: the embedding and head
/// are often the widest units, and a buffer for one of them beside a layer's would cost more
/// than their two unprefetched gathers), plus the embedding a tied head reads (and then the
/// head, only a norm, goes with the layers). An untied model takes the smaller of two
/// arrangements: one buffer for the embedding and head and one or two for the layers, or one
/// or two buffers that fit any unit. Kept after the forward pass: one buffer per unit.
///
/// Gradients: the backward pass finishes one unit before the next begins, except that a tied
/// head writes into the embedding's gradient, which is finished last: one buffer, or one for
/// the embedding and one for the rest.
///
/// A buffer is a pair: elements in the model's precision (the whole unit, or an FP8 unit's
/// compact rest) and FP8 elements (an FP8 unit's image; 0 for the others).
struct Lending {
    /// Per buffer: its class and lengths.
    params: Vec<(usize, (usize, usize))>,
    grads: Vec<(usize, (usize, usize))>,
    /// Per unit: its class for parameters and for gradients.
    param_class: Vec<usize>,
    grad_class: Vec<usize>,
}

impl Lending {
    fn new(units: &[UnitPiece], casts: &[Option<CastUnit>], size: usize, tied: bool, options: FsdpOptions) -> Lending {
        let n = units.len();
        let (embed, head) = (0, n - 1);
        let padded = |u: usize| units[u].1 * size;
        let need = |u: usize| match &casts[u] {
            Some(c) => (c.rest_len(), padded(u)),
            None => (padded(u), 0),
        };
        let widest = |class: &[usize], c: usize| {
            (0..n).filter(|&u| class[u] == c).map(need).fold((0, 0), |(a, b), (x, y)| (a.max(x), b.max(y)))
        };
        // Buffers of each class for an assignment of classes.
        let buffers = |class: &[usize], counts: &[usize]| -> Vec<(usize, (usize, usize))> {
            counts.iter().enumerate().flat_map(|(c, &k)| std::iter::repeat_n((c, widest(class, c)), k)).collect()
        };
        // In bytes on a GPU, where the arrangements differ.
        let total = |b: &[(usize, (usize, usize))]| b.iter().map(|x| 2 * x.1.0 + x.1.1).sum::<usize>();
        let layers = n - 2;
        let at_once = if options.prefetch && layers >= 2 { 2 } else { 1 };

        let (params, param_class) = if !options.reshard_after_forward {
            let class: Vec<usize> = (0..n).collect();
            (buffers(&class, &vec![1; n]), class)
        } else if tied {
            let class: Vec<usize> = (0..n).map(|u| usize::from(u != embed)).collect();
            (buffers(&class, &[1, at_once]), class)
        } else {
            let apart: Vec<usize> = (0..n).map(|u| usize::from(u != embed && u != head)).collect();
            let shared = vec![0; n];
            let (a, b) = (buffers(&apart, &[1, at_once]), buffers(&shared, &[at_once]));
            if total(&b) <= total(&a) { (b, shared) } else { (a, apart) }
        };
        let grad_class: Vec<usize> = (0..n).map(|u| usize::from(tied && u != embed)).collect();
        let whole = |class: &[usize], c: usize| (0..n).filter(|&u| class[u] == c).map(padded).max().unwrap_or(0);
        let grads = (0..1 + usize::from(tied)).map(|c| (c, (whole(&grad_class, c), 0))).collect();
        Lending { params, grads, param_class, grad_class }
    }
}

/// FSDP's options (`mesh.fsdp_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpOptions {
    /// Release a layer's gathered parameters after the forward pass (FSDP2's
    /// `reshard_after_forward`); else keep them until the backward pass is done with them.
    pub reshard_after_forward: bool,
    /// Start the next layer's gather before the current layer computes.
    pub prefetch: bool,
}

impl FsdpOptions {
    /// The options a configuration sets.
    pub fn of(mesh: &crate::config::MeshConfig) -> FsdpOptions {
        FsdpOptions { reshard_after_forward: mesh.fsdp_reshard_after_forward, prefetch: mesh.fsdp_prefetch }
    }
}

/// FSDP's loans: buffers lent to units for the time of a use, each of a class ([`Lending`]).
/// (A pipeline's "slots", [`crate::parallel::pipeline`], are another thing: the activations
/// of a micro-batch in flight.)
struct Loans {
    /// Each buffer, with its FP8 image where its class has one.
    bufs: Vec<(View, Option<View>)>,
    class: Vec<usize>,
    /// The unit each buffer is lent to.
    borrower: Vec<Option<usize>>,
    /// The class of each unit.
    unit_class: Vec<usize>,
}

impl Loans {
    fn new<B: Backend>(be: &mut B, kind: BufKind, sizes: &[(usize, (usize, usize))], unit_class: Vec<usize>) -> Loans {
        Loans {
            bufs: (sizes.iter())
                .map(|&(_, (len, fp8))| (be.alloc(kind, len), (fp8 > 0).then(|| be.alloc(BufKind::Fp8, fp8))))
                .collect(),
            class: sizes.iter().map(|s| s.0).collect(),
            borrower: vec![None; sizes.len()],
            unit_class,
        }
    }

    /// The buffer lent to unit `u`, if any.
    fn find(&self, u: usize) -> Option<(View, Option<View>)> {
        self.borrower.iter().position(|&b| b == Some(u)).map(|i| self.bufs[i])
    }

    /// Lends unit `u` a free buffer of its class.
    fn take(&mut self, u: usize) -> (View, Option<View>) {
        let class = self.unit_class[u];
        let i = (0..self.bufs.len())
            .find(|&i| self.class[i] == class && self.borrower[i].is_none())
            .unwrap_or_else(|| panic!("internal error: no free FSDP buffer of class {class} for unit {u}"));
        self.borrower[i] = Some(u);
        self.bufs[i]
    }

    /// Takes back the buffer lent to unit `u`.
    fn release(&mut self, u: usize) {
        self.borrower.iter_mut().filter(|b| **b == Some(u)).for_each(|b| *b = None);
    }

    fn release_all(&mut self) {
        self.borrower.fill(None);
    }
}

impl Fsdp {
    pub(super) fn new<B: Backend>(
        be: &mut B,
        layout: &Layout,
        (size, me): (usize, usize),
        options: FsdpOptions,
        casts: &[CastWeight],
    ) -> Fsdp {
        let (units, len) = fsdp_pieces(layout, size);
        let (params, grads) = (be.alloc(BufKind::Params, len), be.alloc(BufKind::Grads, len));
        let casts = cast_units(&units, size, casts);
        assert!(
            casts.iter().flatten().flat_map(|c| &c.weights).all(|w| w.state.is_some()),
            "internal error: an FP8 gather without its weight's state"
        );
        let lending = Lending::new(&units, &casts, size, layout.tied, options);
        let gathered = Loans::new(be, BufKind::Gathered, &lending.params, lending.param_class);
        let accumulating = Loans::new(be, BufKind::Grads, &lending.grads, lending.grad_class);
        let rest_scratch = be.alloc(BufKind::Gathered, rest_scratch_len(&casts, size));
        let mut f = Fsdp {
            units,
            params,
            grads,
            gathered,
            accumulating,
            prefetched: None,
            casts,
            rest_scratch,
            scales_stale: true,
            options,
            segments: Vec::new(),
            me,
        };
        // Each tensor's parts in this device's pieces, in shard order.
        f.segments = (layout.tensors.iter())
            .flat_map(|t| {
                let parts = f.parts_of(t.offset..t.offset + t.len());
                parts.map(|(offset, part)| Segment { offset, len: part.len(), decay: t.decay })
            })
            .collect();
        f
    }

    /// The parts of the full-buffer range `range` that lie in this device's pieces: where each
    /// starts in the shard, and its full-buffer range.
    pub(super) fn parts_of(&self, range: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.units.iter().filter_map(move |(unit, piece, offset)| {
            let mine = self.mine(unit, *piece);
            let part = range.start.max(mine.start)..range.end.min(mine.end);
            (!part.is_empty()).then(|| (offset + part.start - mine.start, part))
        })
    }

    /// The layer `pass` reads after unit `u`, if `u` is a layer: the forward pass goes up the
    /// layers, the backward pass down ([`Lending`] says why the embedding and head are not
    /// prefetched).
    fn next_unit(&self, u: usize, pass: Pass) -> Option<usize> {
        let last_layer = self.units.len() - 2;
        match pass {
            Pass::Forward => (1..last_layer).contains(&u).then_some(u + 1),
            Pass::Backward => (2..=last_layer).contains(&u).then(|| u - 1),
        }
    }

    /// The full-buffer range of this device's piece of a unit.
    pub(super) fn mine(&self, range: &Range<usize>, piece: usize) -> Range<usize> {
        piece_of(range, piece, self.me)
    }

    /// `part` (a full-buffer range inside this device's piece of unit `u`) in the shard.
    fn piece_part(&self, u: usize, part: &Range<usize>) -> View {
        let (unit, piece, offset) = &self.units[u];
        self.params.at(offset + part.start - self.mine(unit, *piece).start, part.len())
    }

    /// Gathers unit `u`'s parameters into a lent buffer (started only, with `ahead`; an FP8
    /// unit's rest is unpacked when it is waited for, [`Fsdp::settle`]).
    fn gather<B: Backend>(
        &mut self,
        comm: &mut dyn Collectives<B>,
        be: &mut B,
        u: usize,
        group: &[usize],
        ahead: bool,
    ) -> (View, Option<View>) {
        // One gather at a time uses the rest's scratch.
        self.settle(comm, be);
        if self.scales_stale && self.casts[u].is_some() {
            self.scale_weights(comm, be, group);
        }
        let (unit, piece, offset) = self.units[u].clone();
        let (buf, image) = self.gathered.take(u);
        let mut gathers = Vec::new();
        match (&self.casts[u], image) {
            (Some(c), Some(image)) => {
                let mine = self.mine(&unit, piece);
                // This device's piece of each weight, cast into its place in the image.
                for w in &c.weights {
                    let part = overlap(&w.range, &mine);
                    if part.is_empty() {
                        continue;
                    }
                    let (q, x) = (image.at(part.start - unit.start, part.len()), self.piece_part(u, &part));
                    // Tensorwise: the whole weight's scale ([`Fsdp::scale_weights`]).
                    let scaling = if w.scaling == Scaling::Current { Scaling::Again } else { w.scaling };
                    be.fp8_quantize(q, x, w.state.expect("a state"), scaling, None);
                }
                // The rest of the piece, packed into this device's part of the scratch.
                let rest = c.rest_piece();
                let mut at = self.me * rest;
                for part in c.rest.iter().map(|(r, _)| overlap(r, &mine)).filter(|p| !p.is_empty()) {
                    be.copy(self.rest_scratch.at(at, part.len()), self.piece_part(u, &part));
                    at += part.len();
                }
                gathers.push((image.at(self.me * piece, piece), image.at(0, piece * group.len())));
                if rest > 0 {
                    let scratch = self.rest_scratch;
                    gathers.push((scratch.at(self.me * rest, rest), scratch.at(0, rest * group.len())));
                }
            }
            (None, _) => gathers.push((self.params.at(offset, piece), buf.at(0, piece * group.len()))),
            (Some(_), None) => {
                unreachable!("internal error: an FSDP loan without the image its unit's FP8 gather needs")
            }
        }
        for (mine, all) in gathers {
            if ahead {
                comm.all_gather_start(be, mine, all, group);
            } else {
                comm.all_gather(be, mine, all, group);
            }
        }
        if ahead {
            self.prefetched = Some(u);
        } else {
            self.unpack(be, u);
        }
        (buf, image)
    }

    /// The tensorwise weights' scales from their whole amaxes, once the weights changed (as
    /// torchao precomputes its float8 all-gather's scales after the optimizer step): each
    /// device's pieces' amax, the group's maximum, the scale it gives
    /// ([`crate::backend::fp8::delayed_update`] of a state without history). The same scale a
    /// cast of the whole weight sets.
    fn scale_weights<B: Backend>(&mut self, comm: &mut dyn Collectives<B>, be: &mut B, group: &[usize]) {
        self.scales_stale = false;
        for (u, c) in self.casts.iter().enumerate() {
            let Some(c) = c else { continue };
            let mine = self.mine(&self.units[u].0, self.units[u].1);
            for w in c.weights.iter().filter(|w| w.scaling == Scaling::Current) {
                let (state, part) = (w.state.expect("a state"), overlap(&w.range, &mine));
                if !part.is_empty() {
                    be.fp8_amax(state, self.piece_part(u, &part));
                }
                comm.all_reduce_max(be, state.view.at(slot::AMAX, 1), group);
                be.fp8_delayed_update(state.view, state.view.len, 0);
            }
        }
    }

    /// The optimizer (or a checkpoint) changed the weights: their tensorwise scales are taken
    /// again before the next gather.
    pub(super) fn weights_changed(&mut self) {
        self.scales_stale = true;
    }

    /// Unpacks FP8 unit `u`'s gathered rest from the scratch into its loan: each device's part,
    /// one after the other (nothing for a unit gathered whole).
    fn unpack<B: Backend>(&mut self, be: &mut B, u: usize) {
        let (Some(c), Some((buf, _))) = (&self.casts[u], self.gathered.find(u)) else { return };
        let (rest, mut at) = (c.rest_piece(), 0);
        for (j, &len) in c.rest_in.iter().enumerate().filter(|(_, len)| **len > 0) {
            be.copy(buf.at(at, len), self.rest_scratch.at(j * rest, len));
            at += len;
        }
    }

    /// The window the passes read unit `u`'s parameters through, lent `(buf, image)`.
    fn window(&self, u: usize, (buf, image): (View, Option<View>)) -> Window {
        let start = self.units[u].0.start;
        match (&self.casts[u], image) {
            (Some(c), Some(image)) => {
                let mut runs = [(0, 0, 0); CastWindow::RUNS];
                for (k, (r, at)) in c.rest.iter().enumerate() {
                    runs[k] = (r.start, r.len(), *at);
                }
                Window::cast(buf, start, CastWindow { image, runs, count: c.rest.len() })
            }
            _ => Window::from(buf, start),
        }
    }

    /// Unit `u`'s parameters for `pass`, in a lent buffer: gathered over `group` unless this
    /// device still holds them; the next layer's gather is started to run while `u` computes.
    pub(super) fn params_needed<B: Backend>(
        &mut self,
        comm: &mut dyn Collectives<B>,
        be: &mut B,
        u: usize,
        pass: Pass,
        group: &[usize],
    ) -> Window {
        if self.prefetched == Some(u) {
            self.settle(comm, be);
        }
        let lent = match self.gathered.find(u) {
            Some(lent) => lent,
            None => self.gather(comm, be, u, group, false),
        };
        let next = self.next_unit(u, pass).filter(|&n| self.options.prefetch && self.gathered.find(n).is_none());
        if let Some(next) = next {
            self.gather(comm, be, next, group, true);
        }
        self.window(u, lent)
    }

    /// `pass` is done with unit `u`'s parameters: the backward pass gives them back, and the
    /// forward pass too unless they are kept for it (`reshard_after_forward` off).
    pub(super) fn params_done(&mut self, u: usize, pass: Pass) {
        if pass == Pass::Backward || self.options.reshard_after_forward {
            self.gathered.release(u);
        }
    }

    /// Unit `u`'s gradient, in a lent buffer zeroed when it is lent.
    pub(super) fn grads_needed<B: Backend>(&mut self, be: &mut B, u: usize) -> Window {
        let buf = match self.accumulating.find(u) {
            Some((buf, _)) => buf,
            None => {
                let buf = self.accumulating.take(u).0;
                be.fill(buf, 0.0);
                buf
            }
        };
        Window::from(buf, self.units[u].0.start)
    }

    /// Unit `u`'s gradient, reduce-scattered over `group` in place (so that no device ever holds
    /// a whole gradient for long: this device's part of the lent buffer receives its sum) and
    /// added to this device's piece, which it returns; the buffer is given back.
    pub(super) fn grads_ready<B: Backend>(
        &mut self,
        comm: &mut dyn Collectives<B>,
        be: &mut B,
        u: usize,
        group: &[usize],
    ) -> View {
        let (_, piece, offset) = self.units[u];
        let buf = self.accumulating.find(u).expect("gradient buffer lent").0;
        let (all, sum) = (buf.at(0, piece * group.len()), buf.at(self.me * piece, piece));
        comm.reduce_scatter_sum(be, all, sum, group);
        let mine = self.grads.at(offset, piece);
        be.add(mine, sum);
        self.accumulating.release(u);
        mine
    }

    /// Gives back every gathered unit (waiting for a gather started ahead first).
    pub(super) fn give_back<B: Backend>(&mut self, comm: &mut dyn Collectives<B>, be: &mut B) {
        self.settle(comm, be);
        self.gathered.release_all();
    }

    /// Waits for the gather started ahead, if any, and unpacks its rest.
    fn settle<B: Backend>(&mut self, comm: &mut dyn Collectives<B>, be: &mut B) {
        if let Some(u) = self.prefetched.take() {
            comm.wait(be);
            self.unpack(be, u);
        }
    }

    /// Units gathered as FP8 casts, and units in all.
    pub(super) fn cast_units(&self) -> (usize, usize) {
        (self.casts.iter().flatten().count(), self.units.len())
    }

    /// The full-buffer element of shard element `x`.
    pub(super) fn full_offset(&self, x: usize) -> usize {
        let (range, piece, offset) =
            self.units.iter().find(|(_, piece, offset)| x < offset + piece).expect("shard element in a unit");
        range.start + self.me * piece + (x - offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::fp8::{Fp8Format, State};
    use crate::config::recipe::resolve;

    /// tiny-gpt's layout (about 200,000 elements a layer) with `layers` layers.
    fn layout(layers: usize, tied: bool) -> Layout {
        let mut m = resolve("tiny-gpt", &[]).unwrap().config.model;
        (m.n_layers, m.tie_embeddings) = (layers, tied);
        Layout::new(&m)
    }

    const OPTIONS: FsdpOptions = FsdpOptions { reshard_after_forward: true, prefetch: true };

    /// Over 3 devices (pieces that do not divide the units evenly): every element of every
    /// tensor is in exactly one device's pieces, where `full_offset` finds it again.
    #[test]
    fn the_pieces_cover_every_element_once() {
        let l = layout(2, false);
        let mut be = Cpu::new();
        let mut owner = vec![usize::MAX; l.len];
        for me in 0..3 {
            let f = Fsdp::new(&mut be, &l, (3, me), OPTIONS, &[]);
            for t in &l.tensors {
                for (at, part) in f.parts_of(t.offset..t.offset + t.len()) {
                    for (k, x) in part.clone().enumerate() {
                        assert_eq!(owner[x], usize::MAX, "element {x} in two pieces");
                        owner[x] = me;
                        assert_eq!(f.full_offset(at + k), x);
                    }
                }
            }
            let held: usize = f.segments.iter().map(|s| s.len).sum();
            assert_eq!(held, owner.iter().filter(|&&o| o == me).count());
            assert!(f.params.len >= held && f.params.len == fsdp_pieces(&l, 3).1);
        }
        assert!(owner.iter().all(|&o| o < 3), "an element in no piece");
    }

    /// The layers' projection weights of `l` as FP8 gathers, each with a state from `be`.
    fn cast_weights(l: &Layout, be: &mut Cpu) -> Vec<CastWeight> {
        let projections = l.tensors.iter().filter(|t| t.name.starts_with("transformer.h.") && t.shape.len() == 2);
        let state = State { view: be.alloc(BufKind::Scalars, State::len(0)), format: Fp8Format::E4M3 };
        projections
            .map(|t| CastWeight { range: t.offset..t.offset + t.len(), state: Some(state), scaling: Scaling::Delayed })
            .collect()
    }

    /// What the memory plan counts is what a device allocates, for every arrangement, with
    /// and without FP8 gathers (which lend a layer a byte an element for its casts, and its
    /// norms' and biases' elements in the model's precision).
    #[test]
    fn the_sizes_are_what_a_device_allocates() {
        for (layers, tied) in [(1, false), (3, false), (3, true)] {
            let l = layout(layers, tied);
            for (reshard_after_forward, prefetch) in [(true, true), (true, false), (false, true)] {
                for fp8 in [false, true] {
                    let options = FsdpOptions { reshard_after_forward, prefetch };
                    let mut be = Cpu::new();
                    let casts = if fp8 { cast_weights(&l, &mut be) } else { Vec::new() };
                    let f = Fsdp::new(&mut be, &l, (3, 0), options, &casts);
                    let lent = |loans: &Loans, fp8: bool| {
                        loans.bufs.iter().map(|b| if fp8 { b.1.map_or(0, |v| v.len) } else { b.0.len }).sum::<usize>()
                    };
                    let want = fsdp_sizes(&l, 3, options, &casts);
                    let got = (lent(&f.gathered, false) + f.rest_scratch.len, lent(&f.gathered, true));
                    assert_eq!(
                        (f.params.len, got, lent(&f.accumulating, false)),
                        (want.shard, (want.gathered, want.gathered_fp8), want.accumulating)
                    );
                    assert_eq!(f.cast_units().0, if fp8 { layers } else { 0 });
                    let plain = fsdp_sizes(&l, 3, options, &[]);
                    if fp8 {
                        assert!(2 * want.gathered + want.gathered_fp8 < 2 * plain.gathered, "{want:?} vs {plain:?}");
                    }
                }
            }
        }
    }

    /// An FP8 unit's window: the rest's tensors in the compact buffer, one after the other,
    /// the weights as casts in the image at their places in the unit.
    #[test]
    fn a_cast_window_finds_each_tensor() {
        let l = layout(1, false);
        let mut be = Cpu::new();
        let casts = cast_weights(&l, &mut be);
        let f = Fsdp::new(&mut be, &l, (3, 0), OPTIONS, &casts);
        let u = 1;
        let (rest, image) = (f.casts[u].as_ref().unwrap().rest_len(), f.units[u].1 * 3);
        let (buf, image) = (be.alloc(BufKind::Gathered, rest), be.alloc(BufKind::Fp8, image));
        let w = f.window(u, (buf, Some(image)));
        let unit = &f.units[u].0;
        let mut compact = 0;
        for t in l.tensors.iter().filter(|t| unit.contains(&t.offset)) {
            match w.weight(t.offset, t.len()) {
                crate::model::Weight::Cast(v) => {
                    assert!(casts.iter().any(|c| c.range.start == t.offset), "{} gathered as a cast", t.name);
                    assert_eq!((v.buf, v.offset), (image.buf, image.offset + t.offset - unit.start), "{}", t.name);
                }
                crate::model::Weight::Plain(v) => {
                    assert_eq!((v.buf, v.offset, v.len), (buf.buf, compact, t.len()), "{}", t.name);
                    compact += t.len();
                }
            }
        }
        assert_eq!(compact, rest);
    }

    /// A tied model gathers its embedding for the head while the layers come and go; a layer
    /// and the next one prefetched fit at once, and a released buffer is lent again.
    #[test]
    fn loans_follow_the_classes() {
        let l = layout(3, true);
        let mut f = Fsdp::new(&mut Cpu::new(), &l, (2, 0), OPTIONS, &[]);
        let head = f.units.len() - 1;
        let g = &mut f.gathered;
        let embed = g.take(0);
        let (a, b) = (g.take(1), g.take(2));
        assert!(a != b && g.find(1) == Some(a) && g.find(2) == Some(b));
        g.release(1);
        assert_eq!(g.find(1), None);
        assert_eq!(g.take(head), a, "the head goes with the layers");
        assert_eq!(g.find(0), Some(embed));
        g.release_all();
        assert!((0..=head).all(|u| g.find(u).is_none()));
    }
}
