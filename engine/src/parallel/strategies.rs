//! One device's part in a parallel run: the three strategies as the passes and the optimizer
//! see them.
//!
//! - **Data parallelism.** Each device of the batch group (data × fsdp ranks with the same
//!   tensor coordinate) trains on its own samples; once the last micro-batch of a step has
//!   finished a unit's gradient, the unit is summed over the group at once (one bucket per
//!   layer, started while the backward pass goes on to the layers below, and waited for before
//!   the optimizer: [`Collectives::all_reduce_sum_start`]).
//! - **FSDP / ZeRO-3.** Each unit of the flat buffers (embedding, each layer, head) is cut into
//!   `F` equal pieces, one per device of the fsdp group; a device keeps its pieces of the
//!   parameters, gradients and both AdamW moments. A unit's parameters are all-gathered just
//!   before the forward pass first reads them; its gradient is reduce-scattered when the backward
//!   pass is done with it (and summed over the data axis on top); the optimizer updates the
//!   pieces only. The gathered parameters stay resident until the next step's gather
//!   overwrites them: the memory saving of freeing them between uses is not implemented.
//! - **Tensor parallelism.** See [`crate::parallel::tensor`]: the model is the local slice and the
//!   passes add partial sums over the tensor group ([`Exchange`]).
//!
//! Gradients are scaled so that the objective is the mean over the global batch, as on one
//! device: the sums over the batch group add up `batch_shards` per-device means, each weighted
//! `1 / batch_shards` by the trainer.

use std::ops::Range;

use super::comm::Collectives;
use super::mesh::{Axis, Coords, Mesh};
use super::tensor::{Run, TensorSlice};
use crate::backend::{Backend, BufKind, Segment, View};
use crate::checkpoint::sharded::Chunk;
use crate::model::{Exchange, Layout, Unit};

/// A device of a mesh, with its collectives and its shards.
pub struct Parallel<B: Backend> {
    comm: Box<dyn Collectives<B> + Send>,
    /// The mesh this device is a member of (one device: the mesh of one).
    pub mesh: Mesh,
    /// This device's global rank.
    pub rank: usize,
    /// Its coordinates.
    pub coords: Coords,
    /// Its slice of the model's tensors.
    pub slice: TensorSlice,
    tensor: Vec<usize>,
    data: Vec<usize>,
    fsdp_group: Vec<usize>,
    batch: Vec<usize>,
    /// The full (tensor-local) parameter and gradient buffers the passes use.
    params: View,
    grads: View,
    /// The optimizer's segments of the full buffers: one per tensor.
    segments: Vec<Segment>,
    fsdp: Option<Fsdp>,
    /// Whether this backward pass sums the gradients (the step's last micro-batch).
    pub sync: bool,
    /// Units whose parameters the current step has gathered.
    gathered: Vec<bool>,
    /// `[2]` partial squared norms.
    scratch: View,
}

/// A device's pieces under FSDP.
struct Fsdp {
    /// Per unit (in [`Layout::units`] order): its range of the full buffers, the piece length
    /// and where this device's piece starts in the shard buffers.
    units: Vec<UnitPiece>,
    params: View,
    grads: View,
    /// A padded unit, for the collectives (units are rarely a multiple of the group size).
    staging: View,
    segments: Vec<Segment>,
    /// This device's position in the fsdp group.
    me: usize,
}

impl<B: Backend> Parallel<B> {
    /// Joins the mesh as `rank`, over the model buffers `params` and `grads` of the tensor-local
    /// `layout`; allocates the shards (FSDP) and copies this device's pieces of `params`.
    pub fn new(
        be: &mut B,
        comm: Box<dyn Collectives<B> + Send>,
        mesh: Mesh,
        slice: TensorSlice,
        params: View,
        grads: View,
    ) -> Parallel<B> {
        let rank = comm.rank();
        let coords = mesh.coords(rank);
        let (tensor, data, fsdp_group) =
            (mesh.group(rank, Axis::Tensor), mesh.group(rank, Axis::Data), mesh.group(rank, Axis::Fsdp));
        let batch = batch_group(&mesh, rank);
        let layout = &slice.local;
        let fsdp = (fsdp_group.len() > 1).then(|| Fsdp::new(be, layout, fsdp_group.len(), coords.fsdp, params));
        let units = layout.units().len();
        let segments =
            layout.tensors.iter().map(|t| Segment { offset: t.offset, len: t.len(), decay: t.decay }).collect();
        let scratch = be.alloc(BufKind::Scalars, 2);
        Parallel {
            comm,
            mesh,
            rank,
            coords,
            slice,
            tensor,
            data,
            fsdp_group,
            batch,
            params,
            grads,
            segments,
            fsdp,
            sync: true,
            gathered: vec![false; units],
            scratch,
        }
    }

    /// Devices that read distinct samples, and this device's index among them (its data
    /// loader's rank).
    pub fn batch_rank(&self) -> (usize, usize) {
        (self.batch.iter().position(|&r| r == self.rank).expect("member"), self.batch.len())
    }

    /// The buffers the optimizer updates: this device's pieces under FSDP, else the full ones,
    /// with their segments (the parts of tensors, each with its weight decay).
    pub fn optimizer_buffers(&self) -> (View, View, &[Segment]) {
        match &self.fsdp {
            Some(f) => (f.params, f.grads, &f.segments),
            None => (self.params, self.grads, &self.segments),
        }
    }

    /// The parameters the optimizer updates and checkpoints hold: this device's pieces under
    /// FSDP, else the full buffer.
    pub fn master_params(&self) -> View {
        self.fsdp.as_ref().map_or(self.params, |f| f.params)
    }

    /// Writes the squared global gradient norm into `out`, over whatever [`optimizer_buffers`]
    /// holds: split tensors add up over the tensor group, every piece over the fsdp group.
    ///
    /// [`optimizer_buffers`]: Parallel::optimizer_buffers
    pub fn grad_norm_squared(&mut self, be: &mut B, out: View) {
        // The gradient buckets started during the backward pass.
        self.comm.wait(be);
        let (_, grads, segs) = self.optimizer_buffers();
        let segs = segs.to_vec();
        if self.tensor.len() == 1 {
            be.sum_squares(out, grads);
        } else {
            // Replicated tensors count once; the slices of split ones add up over the group.
            let (split, part) = (self.scratch.at(0, 1), self.scratch.at(1, 1));
            be.fill(out, 0.0);
            be.fill(split, 0.0);
            for s in &segs {
                be.sum_squares(part, grads.at(s.offset, s.len));
                be.add(if self.segment_is_split(s) { split } else { out }, part);
            }
            self.comm.all_reduce_sum(be, split, &self.tensor);
            be.add(out, split);
        }
        if self.fsdp_group.len() > 1 {
            self.comm.all_reduce_sum(be, out, &self.fsdp_group);
        }
    }

    /// Whether an optimizer segment belongs to a tensor split over the tensor axis. Segments
    /// are whole tensors, or pieces of one under FSDP.
    fn segment_is_split(&self, s: &Segment) -> bool {
        let offset = match &self.fsdp {
            None => s.offset,
            Some(f) => f.full_offset(s.offset),
        };
        let local = &self.slice.local.tensors;
        let i = local.partition_point(|t| t.offset + t.len() <= offset);
        self.slice.is_split(i)
    }

    /// `buf = Σ buf` over the batch group (the step's loss, evaluation sums).
    pub fn sum_over_batch(&mut self, be: &mut B, buf: View) {
        if self.batch.len() > 1 {
            self.comm.all_reduce_sum(be, buf, &self.batch);
        }
    }

    /// After the optimizer: the full parameters are stale under FSDP until gathered again;
    /// the full gradients (which the optimizer did not zero) start the next step at zero.
    pub fn after_step(&mut self, be: &mut B) {
        if self.fsdp.is_some() {
            be.fill(self.grads, 0.0);
            self.gathered.fill(false);
        }
    }

    /// Gathers every unit's parameters (before an evaluation or a snapshot).
    pub fn gather_all(&mut self, be: &mut B) {
        for unit in self.slice.local.units() {
            self.params_needed(be, unit);
        }
    }

    /// After new parameters were written into the full buffer `full` (an import): under FSDP,
    /// this device takes its pieces of them; the next pass gathers again.
    pub fn params_loaded(&mut self, be: &mut B, full: View) {
        if let Some(f) = &self.fsdp {
            f.take_pieces(be, full);
        }
        self.gathered.fill(false);
    }

    fn unit_index(&self, unit: Unit) -> usize {
        match unit {
            Unit::Embed => 0,
            Unit::Layer(i) => 1 + i,
            Unit::Head => 1 + self.slice.local.layers.len(),
        }
    }

    /// Where the elements of this device's optimizer buffers (parameters or pieces of them, and
    /// the moments alike) are in the single-device layout, for sharded checkpoints.
    pub fn chunks(&self) -> Vec<Chunk> {
        let runs = &self.slice.runs;
        let whole = |r: &Run| r.local..r.local + r.elements();
        let mut out = Vec::new();
        match &self.fsdp {
            None => {
                for r in runs {
                    out.extend(r.pieces(whole(r)).map(|(local, global, len)| Chunk { global, local, len }));
                }
            }
            Some(f) => {
                for (range, piece, offset) in &f.units {
                    let mine = range.start + f.me * piece..(range.start + (f.me + 1) * piece).min(range.end);
                    for r in runs.iter().filter(|r| whole(r).start < mine.end && whole(r).end > mine.start) {
                        out.extend(r.pieces(mine.clone()).map(|(local, global, len)| Chunk {
                            global,
                            local: offset + local - mine.start,
                            len,
                        }));
                    }
                }
            }
        }
        out
    }

    /// Whether this device saves its buffers in a sharded checkpoint: the first replica of
    /// each slice along the data axis (the others hold copies).
    pub fn saves(&self) -> bool {
        self.coords.data == 0
    }

    /// `Σ x` over every device of the mesh, for agreements between devices (whether a save is
    /// complete everywhere). Every device calls it at the same point.
    pub fn sum_over_world(&mut self, be: &mut B, x: f32) -> f32 {
        let flag = self.scratch.at(0, 1);
        be.upload(flag, &[x]);
        let world: Vec<usize> = (0..self.mesh.devices()).collect();
        self.comm.all_reduce_sum(be, flag, &world);
        let mut out = [0f32];
        be.download(flag, &mut out);
        out[0]
    }

    /// `value` of every device of the mesh, in rank order, exactly (integers below 2^48: each
    /// travels as three 16-bit limbs in its own slots of a buffer summed over the mesh, sums
    /// that f32 holds exactly). Every device calls it at the same point.
    pub fn gather_from_world(&mut self, be: &mut B, value: u64) -> Vec<u64> {
        assert!(value < 1 << 48, "gather_from_world: {value} does not fit 48 bits");
        let world = self.mesh.devices();
        let slots = be.alloc(BufKind::Scalars, 3 * world);
        let mut limbs = vec![0f32; 3 * world];
        for (i, limb) in limbs[3 * self.rank..3 * self.rank + 3].iter_mut().enumerate() {
            *limb = ((value >> (16 * i)) & 0xffff) as f32;
        }
        be.upload(slots, &limbs);
        let group: Vec<usize> = (0..world).collect();
        self.comm.all_reduce_sum(be, slots, &group);
        be.download(slots, &mut limbs);
        limbs.chunks_exact(3).map(|l| l.iter().rev().fold(0u64, |acc, &x| (acc << 16) | x as u64)).collect()
    }

    /// Moments are laid out like the optimizer's buffers: this device's pieces under FSDP.
    pub fn moment_len(&self) -> usize {
        self.fsdp.as_ref().map_or(self.slice.local.len, |f| f.params.len)
    }
}

impl<B: Backend> Exchange<B> for Parallel<B> {
    fn adds_residual(&self) -> bool {
        self.coords.tensor == 0
    }

    fn tensor_sum(&mut self, be: &mut B, buf: View) {
        if self.tensor.len() > 1 {
            self.comm.all_reduce_sum(be, buf, &self.tensor);
        }
    }

    fn batch_sum(&mut self, be: &mut B, buf: View) {
        self.sum_over_batch(be, buf);
    }

    fn params_needed(&mut self, be: &mut B, unit: Unit) {
        let u = self.unit_index(unit);
        let Some(f) = &self.fsdp else { return };
        if self.gathered[u] {
            return;
        }
        let (range, piece, offset) = f.units[u].clone();
        let staging = f.staging.at(0, piece * self.fsdp_group.len());
        self.comm.all_gather(be, f.params.at(offset, piece), staging, &self.fsdp_group);
        be.copy(self.params.at(range.start, range.len()), staging.at(0, range.len()));
        self.gathered[u] = true;
    }

    fn grads_ready(&mut self, be: &mut B, unit: Unit) {
        if !self.sync {
            return;
        }
        let u = self.unit_index(unit);
        match &self.fsdp {
            None => {
                let range = self.slice.local.unit_range(unit);
                if self.batch.len() > 1 && !range.is_empty() {
                    self.comm.all_reduce_sum_start(be, self.grads.at(range.start, range.len()), &self.batch);
                }
            }
            Some(f) => {
                let (range, piece, offset) = f.units[u].clone();
                let (staging, mine) = (f.staging.at(0, piece * self.fsdp_group.len()), f.grads.at(offset, piece));
                be.fill(staging, 0.0);
                be.copy(staging.at(0, range.len()), self.grads.at(range.start, range.len()));
                self.comm.reduce_scatter_sum(be, staging, mine, &self.fsdp_group);
                if self.data.len() > 1 {
                    self.comm.all_reduce_sum_start(be, mine, &self.data);
                }
            }
        }
    }
}

/// A unit under FSDP: its range of the full buffers, the piece length, and where a device's
/// piece starts in its shard buffers.
pub type UnitPiece = (Range<usize>, usize, usize);

/// Under FSDP over `size` devices: each unit of `layout` (its range, piece length and where the
/// piece starts in a device's shard), the shard's length, and the padded length of the widest
/// unit (the staging buffer of the collectives).
pub fn fsdp_pieces(layout: &Layout, size: usize) -> (Vec<UnitPiece>, usize, usize) {
    let mut units = Vec::new();
    let (mut len, mut widest) = (0, 0);
    for unit in layout.units() {
        let range = layout.unit_range(unit);
        let piece = range.len().div_ceil(size);
        units.push((range, piece, len));
        len += piece;
        widest = widest.max(piece * size);
    }
    (units, len, widest.max(1))
}

impl Fsdp {
    fn new<B: Backend>(be: &mut B, layout: &Layout, size: usize, me: usize, full: View) -> Fsdp {
        let (units, len, widest) = fsdp_pieces(layout, size);
        let (params, grads) = (be.alloc(BufKind::Params, len), be.alloc(BufKind::Grads, len));
        let staging = be.alloc(BufKind::Grads, widest);
        // Each tensor's part in each of this device's pieces, in shard coordinates.
        let mut segments = Vec::new();
        for (range, piece, offset) in &units {
            let mine = range.start + me * piece..(range.start + (me + 1) * piece).min(range.end);
            for t in &layout.tensors {
                let (lo, hi) = (t.offset.max(mine.start), (t.offset + t.len()).min(mine.end));
                if lo < hi {
                    segments.push(Segment { offset: offset + lo - mine.start, len: hi - lo, decay: t.decay });
                }
            }
        }
        let f = Fsdp { units, params, grads, staging, segments, me };
        f.take_pieces(be, full);
        f
    }

    /// Copies this device's pieces of the full parameter buffer `full` into its shard.
    fn take_pieces<B: Backend>(&self, be: &mut B, full: View) {
        for (range, piece, offset) in &self.units {
            let start = range.start + self.me * piece;
            let len = range.end.saturating_sub(start).min(*piece);
            if len > 0 {
                be.copy(self.params.at(*offset, len), full.at(start, len));
            }
        }
    }

    /// The full-buffer element of shard element `x`.
    fn full_offset(&self, x: usize) -> usize {
        let (range, piece, offset) =
            self.units.iter().find(|(_, piece, offset)| x < offset + piece).expect("shard element in a unit");
        range.start + self.me * piece + (x - offset)
    }
}

/// The devices with this rank's tensor coordinate: they read distinct samples.
fn batch_group(mesh: &Mesh, rank: usize) -> Vec<usize> {
    let tensor = mesh.coords(rank).tensor;
    (0..mesh.devices()).filter(|&r| mesh.coords(r).tensor == tensor).collect()
}
