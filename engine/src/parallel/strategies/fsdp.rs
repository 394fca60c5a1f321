//! FSDP / ZeRO-3 (see the parent module's documentation): a device's pieces of every unit, the
//! buffers it lends the passes for the time of a use (its loans), gathering parameters and
//! reduce-scattering gradients, and the sizes of all of it for the memory plan.

use std::ops::Range;

use crate::backend::{Backend, BufKind, Segment, View};
use crate::model::{Layout, Pass, Window};
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
    /// Buffers lent for gathered parameters.
    pub gathered: usize,
    /// Buffers lent for the gradients being accumulated.
    pub accumulating: usize,
}

/// The sizes of the buffers [`Fsdp`] allocates for `layout` over `size` devices.
pub fn fsdp_sizes(layout: &Layout, size: usize, options: FsdpOptions) -> FsdpSizes {
    let (units, shard) = fsdp_pieces(layout, size);
    let lending = Lending::new(&units, size, layout.tied, options);
    FsdpSizes {
        shard,
        gathered: lending.params.iter().map(|s| s.1).sum(),
        accumulating: lending.grads.iter().map(|s| s.1).sum(),
    }
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
struct Lending {
    /// Per buffer: its class and length.
    params: Vec<(usize, usize)>,
    grads: Vec<(usize, usize)>,
    /// Per unit: its class for parameters and for gradients.
    param_class: Vec<usize>,
    grad_class: Vec<usize>,
}

impl Lending {
    fn new(units: &[UnitPiece], size: usize, tied: bool, options: FsdpOptions) -> Lending {
        let n = units.len();
        let (embed, head) = (0, n - 1);
        let padded = |u: usize| units[u].1 * size;
        let widest = |class: &[usize], c: usize| (0..n).filter(|&u| class[u] == c).map(padded).max().unwrap_or(0);
        // Buffers of each class for an assignment of classes.
        let buffers = |class: &[usize], counts: &[usize]| -> Vec<(usize, usize)> {
            counts.iter().enumerate().flat_map(|(c, &k)| std::iter::repeat_n((c, widest(class, c)), k)).collect()
        };
        let total = |b: &[(usize, usize)]| b.iter().map(|x| x.1).sum::<usize>();
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
        let grads = buffers(&grad_class, &vec![1; 1 + usize::from(tied)]);
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
    bufs: Vec<View>,
    class: Vec<usize>,
    /// The unit each buffer is lent to.
    borrower: Vec<Option<usize>>,
    /// The class of each unit.
    unit_class: Vec<usize>,
}

impl Loans {
    fn new<B: Backend>(be: &mut B, kind: BufKind, sizes: &[(usize, usize)], unit_class: Vec<usize>) -> Loans {
        Loans {
            bufs: sizes.iter().map(|&(_, len)| be.alloc(kind, len)).collect(),
            class: sizes.iter().map(|s| s.0).collect(),
            borrower: vec![None; sizes.len()],
            unit_class,
        }
    }

    /// The buffer lent to unit `u`, if any.
    fn find(&self, u: usize) -> Option<View> {
        self.borrower.iter().position(|&b| b == Some(u)).map(|i| self.bufs[i])
    }

    /// Lends unit `u` a free buffer of its class.
    fn take(&mut self, u: usize) -> View {
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
    pub(super) fn new<B: Backend>(be: &mut B, layout: &Layout, size: usize, me: usize, options: FsdpOptions) -> Fsdp {
        let (units, len) = fsdp_pieces(layout, size);
        let (params, grads) = (be.alloc(BufKind::Params, len), be.alloc(BufKind::Grads, len));
        let lending = Lending::new(&units, size, layout.tied, options);
        let gathered = Loans::new(be, BufKind::Gathered, &lending.params, lending.param_class);
        let accumulating = Loans::new(be, BufKind::Grads, &lending.grads, lending.grad_class);
        let mut f =
            Fsdp { units, params, grads, gathered, accumulating, prefetched: None, options, segments: Vec::new(), me };
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
        (range.start + self.me * piece).min(range.end)..(range.start + (self.me + 1) * piece).min(range.end)
    }

    /// Gathers unit `u`'s parameters into a lent buffer (started only, with `ahead`).
    fn gather<B: Backend>(
        &mut self,
        comm: &mut dyn Collectives<B>,
        be: &mut B,
        u: usize,
        group: &[usize],
        ahead: bool,
    ) -> View {
        let (_, piece, offset) = self.units[u];
        let (mine, buf) = (self.params.at(offset, piece), self.gathered.take(u));
        let all = buf.at(0, piece * group.len());
        if ahead {
            comm.all_gather_start(be, mine, all, group);
        } else {
            comm.all_gather(be, mine, all, group);
        }
        buf
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
        let buf = match self.gathered.find(u) {
            Some(buf) => buf,
            None => self.gather(comm, be, u, group, false),
        };
        let next = self.next_unit(u, pass).filter(|&n| self.options.prefetch && self.gathered.find(n).is_none());
        if let Some(next) = next {
            self.settle(comm, be);
            self.gather(comm, be, next, group, true);
            self.prefetched = Some(next);
        }
        Window::from(buf, self.units[u].0.start)
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
            Some(buf) => buf,
            None => {
                let buf = self.accumulating.take(u);
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
        let buf = self.accumulating.find(u).expect("gradient buffer lent");
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

    /// Waits for the gather started ahead, if any.
    fn settle<B: Backend>(&mut self, comm: &mut dyn Collectives<B>, be: &mut B) {
        if self.prefetched.take().is_some() {
            comm.wait(be);
        }
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
            let f = Fsdp::new(&mut be, &l, 3, me, OPTIONS);
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

    /// What the memory plan counts is what a device allocates, for every arrangement.
    #[test]
    fn the_sizes_are_what_a_device_allocates() {
        for (layers, tied) in [(1, false), (3, false), (3, true)] {
            let l = layout(layers, tied);
            for (reshard_after_forward, prefetch) in [(true, true), (true, false), (false, true)] {
                let options = FsdpOptions { reshard_after_forward, prefetch };
                let f = Fsdp::new(&mut Cpu::new(), &l, 2, 0, options);
                let lent = |loans: &Loans| loans.bufs.iter().map(|b| b.len).sum::<usize>();
                let want = fsdp_sizes(&l, 2, options);
                assert_eq!(
                    (f.params.len, lent(&f.gathered), lent(&f.accumulating)),
                    (want.shard, want.gathered, want.accumulating)
                );
            }
        }
    }

    /// A tied model gathers its embedding for the head while the layers come and go; a layer
    /// and the next one prefetched fit at once, and a released buffer is lent again.
    #[test]
    fn loans_follow_the_classes() {
        let l = layout(3, true);
        let mut f = Fsdp::new(&mut Cpu::new(), &l, 2, 0, OPTIONS);
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
