//! One device's part in a parallel run: the three strategies as the passes and the optimizer
//! see them.
//!
//! - **Data parallelism.** Each device of the batch group (data × fsdp ranks with the same
//!   tensor coordinate) trains on its own samples; once the last micro-batch of a step has
//!   finished a unit's gradient, the unit is summed over the group at once (one bucket per
//!   layer, started while the backward pass goes on to the layers below, and waited for before
//!   the optimizer: [`Collectives::all_reduce_sum_start`]).
//! - **FSDP / ZeRO-3.** Each unit of the flat buffers (embedding, each layer, head) is cut into
//!   `F` equal pieces, one per device of the fsdp group; a device keeps only its pieces of the
//!   parameters, gradients and both AdamW moments: no device holds the whole model. A unit's
//!   parameters are all-gathered into a buffer lent for the time of their use ([`Loans`]): the
//!   forward pass releases each layer's as soon as it is done (unless
//!   `mesh.fsdp_reshard_after_forward` is off, FSDP2's option, which keeps them until the
//!   backward pass is done with them), the backward pass gathers them again. The next unit's
//!   gather is started one unit ahead ([`Collectives::all_gather_start`]) so that it runs while
//!   the current unit computes. A unit's gradient accumulates in a lent buffer and is
//!   reduce-scattered into the pieces as soon as the backward pass is done with it (every
//!   micro-batch; summed over the data axis on top, HSDP, once per step); the optimizer
//!   updates the pieces only.
//! - **Tensor parallelism.** See [`crate::parallel::tensor`]: the model is the local slice and the
//!   passes add partial sums over the tensor group ([`Exchange`]).
//! - **Pipeline parallelism.** See [`crate::parallel::pipeline`]: the device holds one stage's
//!   units; the trainer sends activations and gradients to the neighbouring stages
//!   ([`Parallel::send_recv`]), the loss comes from the last stage and the squared gradient norm
//!   adds up over the stages ([`Parallel::sum_over_pipeline`]).
//!
//! - **Sequence parallelism.** The devices of a seq group read the same samples, each keeping
//!   two chunks of every sequence ([`crate::backend::SeqSplit`]); attention gathers every rank's
//!   q, k and v rows over the group and reduce-scatters their gradients
//!   ([`Exchange::seq_gather`]). Everything else is per token. The parameters are sharded over
//!   the seq axis as over the fsdp axis (FSDP runs over fsdp × seq, as torchtitan shards over
//!   its `dp_shard × cp` mesh and MaxText over `fsdp × sequence`), so a seq axis divides the
//!   state as FSDP does.
//!
//! Gradients are scaled so that the objective is the mean over the global batch, as on one
//! device: the sums over the batch group (data × fsdp × seq) add up its devices' per-device
//! means, each weighted `1 / (data · fsdp · seq)` by the trainer.

use std::ops::Range;

use super::comm::Collectives;
use super::mesh::{Axis, Coords, Mesh};
use super::tensor::{Run, TensorSlice};
use crate::backend::{Backend, BufKind, Segment, View};
use crate::checkpoint::sharded::Chunk;
use crate::model::{Exchange, Layout, Pass, Unit, Window};

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
    /// The devices that hold the same parameters (or pieces) and sum their gradients.
    data: Vec<usize>,
    /// The devices that share the model's pieces under FSDP: fsdp × seq.
    fsdp_group: Vec<usize>,
    /// The devices whose gradients and losses add up: data × fsdp × seq.
    batch: Vec<usize>,
    /// The devices that read distinct samples: data × fsdp (the data loader's ranks).
    samples: Vec<usize>,
    /// The devices that split each sequence (this device alone without a seq axis).
    seq: Vec<usize>,
    /// The pipeline's devices, stage by stage (this device alone without stages).
    pipeline: Vec<usize>,
    /// Time spent in point-to-point exchanges with the neighbouring stages (waiting for them,
    /// on virtual devices), since the counter was last read.
    pub p2p_time: std::time::Duration,
    /// The full (tensor-local) parameter and gradient buffers the passes use; empty under FSDP,
    /// where the passes borrow each unit's buffers from [`Fsdp`].
    params: View,
    grads: View,
    /// The optimizer's segments of the full buffers: one per tensor.
    segments: Vec<Segment>,
    fsdp: Option<Fsdp>,
    /// Whether this backward pass sums the gradients (the step's last micro-batch).
    pub sync: bool,
    /// `[2]` partial squared norms.
    scratch: View,
}

/// A device's pieces under FSDP, and the buffers it lends the passes.
struct Fsdp {
    /// Per unit (in [`Layout::units`] order): its range of the full buffers, the piece length
    /// and where this device's piece starts in the shard buffers.
    units: Vec<UnitPiece>,
    params: View,
    grads: View,
    /// Gathered parameters of the units in use.
    gathered: Loans,
    /// Gradients of the units the backward pass is writing.
    accumulating: Loans,
    /// The unit whose gather was started ahead of its use and not yet waited for.
    prefetched: Option<usize>,
    options: FsdpOptions,
    segments: Vec<Segment>,
    /// This device's position in the fsdp group.
    me: usize,
}

impl<B: Backend> Parallel<B> {
    /// Joins the mesh as `rank`, over the model buffers `params` and `grads` of the tensor-local
    /// `layout` (empty under FSDP: see [`Model::plan_with`](crate::model::Model::plan_with));
    /// allocates the pieces and the lent buffers (FSDP). The parameters start at zero: see
    /// [`Parallel::upload_params`].
    pub fn new(
        be: &mut B,
        comm: Box<dyn Collectives<B> + Send>,
        mesh: Mesh,
        slice: TensorSlice,
        (params, grads): (View, View),
        fsdp_options: FsdpOptions,
    ) -> Parallel<B> {
        let rank = comm.rank();
        let coords = mesh.coords(rank);
        let (tensor, data, fsdp_group) = (
            mesh.group(rank, Axis::Tensor),
            mesh.group(rank, Axis::Data),
            mesh.group_over(rank, &[Axis::Fsdp, Axis::Seq]),
        );
        let batch = mesh.group_over(rank, &[Axis::Data, Axis::Fsdp, Axis::Seq]);
        let samples = mesh.group_over(rank, &[Axis::Data, Axis::Fsdp]);
        let seq = mesh.group(rank, Axis::Seq);
        let pipeline = mesh.group(rank, Axis::Pipeline);
        let mut comm = comm;
        let world: Vec<usize> = (0..mesh.devices()).collect();
        // Named for the messages of a collective that fails; the first name of a group wins.
        comm.name_groups(
            [
                (&world, "world"),
                (&data, "data"),
                (&fsdp_group, "fsdp"),
                (&tensor, "tensor"),
                (&pipeline, "pipeline"),
                (&seq, "seq"),
                (&samples, "data x fsdp"),
                (&batch, "data x fsdp x seq"),
            ]
            .into_iter()
            .map(|(g, name)| (g.clone(), name.to_owned()))
            .collect(),
        );
        let layout = &slice.local;
        let me = fsdp_group.iter().position(|&r| r == rank).expect("member");
        let fsdp = (fsdp_group.len() > 1).then(|| Fsdp::new(be, layout, fsdp_group.len(), me, fsdp_options));
        let segments =
            layout.tensors.iter().map(|t| Segment { offset: t.offset, len: t.len(), decay: t.decay }).collect();
        // Two scalars for the tensor axis's sums, and the limbs of `gather_from_world`.
        let scratch = be.alloc(BufKind::Scalars, 2.max(3 * mesh.devices()));
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
            samples,
            seq,
            pipeline,
            p2p_time: std::time::Duration::ZERO,
            params,
            grads,
            segments,
            fsdp,
            sync: true,
            scratch,
        }
    }

    /// Whether this device's mesh shards the model (FSDP): the passes then need no flat buffers.
    pub fn shards_model(mesh: &Mesh) -> bool {
        mesh.size(Axis::Fsdp) * mesh.size(Axis::Seq) > 1
    }

    /// Writes this device's part of the parameters: `whole(g, out)` fills `out` with all of
    /// global tensor `g`'s values (the single-device layout's), one tensor at a time; the device
    /// keeps its tensor slice of each, or under FSDP its pieces of the slice.
    pub fn upload_params(&mut self, be: &mut B, whole: impl FnMut(usize, &mut Vec<f32>)) {
        let local = &self.slice.local.tensors;
        let (full, fsdp) = (self.params, &self.fsdp);
        self.slice.for_each_local(whole, |i, values| {
            let t = &local[i];
            match fsdp {
                None => be.upload(full.at(t.offset, t.len()), values),
                Some(f) => {
                    for (at, part) in f.parts_of(t.offset..t.offset + t.len()) {
                        be.upload(f.params.at(at, part.len()), &values[part.start - t.offset..part.end - t.offset]);
                    }
                }
            }
        });
        self.after_step(be);
    }

    /// Devices that read distinct samples, and this device's index among them (its data
    /// loader's rank).
    pub fn batch_rank(&self) -> (usize, usize) {
        (self.samples.iter().position(|&r| r == self.rank).expect("member"), self.samples.len())
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
        // Every stage holds its own layers: their squares add up.
        self.sum_over_pipeline(be, out);
    }

    /// `buf = Σ buf` over the stages of this device's pipeline (the loss, which only the last
    /// stage computes; the squared gradient norm).
    pub fn sum_over_pipeline(&mut self, be: &mut B, buf: View) {
        if self.pipeline.len() > 1 {
            self.comm.all_reduce_sum(be, buf, &self.pipeline);
        }
    }

    /// Stages in this device's pipeline.
    pub fn stages(&self) -> usize {
        self.pipeline.len()
    }

    /// The rank of the stage `offset` places from this device's (−1: the one before, +1: the
    /// one after) in its pipeline.
    pub fn neighbour(&self, offset: isize) -> usize {
        let at = self.coords.pipeline as isize + offset;
        assert!((0..self.pipeline.len() as isize).contains(&at), "internal error: no stage {at}");
        self.pipeline[at as usize]
    }

    /// Sends and receives activations or their gradients between neighbouring stages, as one
    /// group ([`Collectives::send_recv`]); the time it takes is counted in `p2p_time`.
    pub fn send_recv(&mut self, be: &mut B, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        if sends.is_empty() && recvs.is_empty() {
            return;
        }
        let start = std::time::Instant::now();
        self.comm.send_recv(be, sends, recvs);
        self.p2p_time += start.elapsed();
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

    /// After the optimizer (or new parameters): under FSDP, the gathered parameters are stale
    /// and given back; the next pass gathers again.
    pub fn after_step(&mut self, be: &mut B) {
        if let Some(f) = &mut self.fsdp {
            f.give_back(&mut *self.comm, be);
        }
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
                    let mine = f.mine(range, *piece);
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

    /// Tells the communicator the optimizer step in progress (for a failed collective's message).
    pub fn set_step(&mut self, step: u64) {
        self.comm.set_step(step);
    }

    /// Bytes this device has sent to others, where the communicator counts them.
    pub fn bytes_sent(&self) -> Option<u64> {
        self.comm.bytes_sent()
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
    /// travels as three 16-bit limbs in its own place of a buffer summed over the mesh, sums
    /// that f32 holds exactly). Every device calls it at the same point.
    pub fn gather_from_world(&mut self, be: &mut B, value: u64) -> Vec<u64> {
        assert!(value < 1 << 48, "gather_from_world: {value} does not fit 48 bits");
        let world = self.mesh.devices();
        // Allocated once with the scratch: this runs at every step boundary.
        let buf = self.scratch.at(0, 3 * world);
        let mut limbs = vec![0f32; 3 * world];
        for (i, limb) in limbs[3 * self.rank..3 * self.rank + 3].iter_mut().enumerate() {
            *limb = ((value >> (16 * i)) & 0xffff) as f32;
        }
        be.upload(buf, &limbs);
        let group: Vec<usize> = (0..world).collect();
        self.comm.all_reduce_sum(be, buf, &group);
        be.download(buf, &mut limbs);
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

    fn seq_gather(&mut self, be: &mut B, local: View, all: View) {
        self.comm.all_gather(be, local, all, &self.seq);
    }

    fn seq_scatter_sum(&mut self, be: &mut B, all: View, local: View) {
        self.comm.reduce_scatter_sum(be, all, local, &self.seq);
    }

    fn pass_begins(&mut self, be: &mut B, pass: Pass) {
        // A forward pass starts from the pieces: whatever an earlier pass left gathered (an
        // evaluation's head) is given back.
        if let (Some(f), Pass::Forward) = (&mut self.fsdp, pass) {
            f.give_back(&mut *self.comm, be);
        }
    }

    fn params_needed(&mut self, be: &mut B, unit: Unit, pass: Pass) -> Option<Window> {
        let u = self.unit_index(unit);
        let (f, comm) = (self.fsdp.as_mut()?, &mut *self.comm);
        if f.prefetched == Some(u) {
            f.settle(comm, be);
        }
        let buf = match f.gathered.find(u) {
            Some(buf) => buf,
            None => f.gather(comm, be, u, &self.fsdp_group, false),
        };
        // The next layer's gather runs while this one computes.
        let next = f.next_unit(u, pass).filter(|&n| f.options.prefetch && f.gathered.find(n).is_none());
        if let Some(next) = next {
            f.settle(comm, be);
            f.gather(comm, be, next, &self.fsdp_group, true);
            f.prefetched = Some(next);
        }
        Some(Window::from(buf, f.units[u].0.start))
    }

    fn params_done(&mut self, _be: &mut B, unit: Unit, pass: Pass) {
        let u = self.unit_index(unit);
        if let Some(f) = &mut self.fsdp
            && (pass == Pass::Backward || f.options.reshard_after_forward)
        {
            f.gathered.release(u);
        }
    }

    fn grads_needed(&mut self, be: &mut B, unit: Unit) -> Option<Window> {
        let u = self.unit_index(unit);
        let f = self.fsdp.as_mut()?;
        let buf = match f.accumulating.find(u) {
            Some(buf) => buf,
            None => {
                let buf = f.accumulating.take(u);
                be.fill(buf, 0.0);
                buf
            }
        };
        Some(Window::from(buf, f.units[u].0.start))
    }

    fn grads_ready(&mut self, be: &mut B, unit: Unit) {
        let u = self.unit_index(unit);
        match &mut self.fsdp {
            None => {
                let range = self.slice.local.unit_range(unit);
                if self.sync && self.batch.len() > 1 && !range.is_empty() {
                    self.comm.all_reduce_sum_start(be, self.grads.at(range.start, range.len()), &self.batch);
                }
            }
            Some(f) => {
                // Every micro-batch's gradient goes to the pieces at once (so that no device
                // ever holds a whole gradient), reduce-scattered in place (this device's part
                // of the lent buffer receives its sum); the data axis sums the pieces once per
                // step.
                let (_, piece, offset) = f.units[u];
                let buf = f.accumulating.find(u).expect("gradient buffer lent");
                let (all, sum) = (buf.at(0, piece * self.fsdp_group.len()), buf.at(f.me * piece, piece));
                self.comm.reduce_scatter_sum(be, all, sum, &self.fsdp_group);
                let mine = f.grads.at(offset, piece);
                be.add(mine, sum);
                f.accumulating.release(u);
                if self.sync && self.data.len() > 1 {
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
/// plan counts ([`crate::parallel::memory`]) and [`Parallel::new`] allocates.
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
    fn new<B: Backend>(be: &mut B, layout: &Layout, size: usize, me: usize, options: FsdpOptions) -> Fsdp {
        let (units, len) = fsdp_pieces(layout, size);
        let (params, grads) = (be.alloc(BufKind::Params, len), be.alloc(BufKind::Grads, len));
        let lending = Lending::new(&units, size, layout.tied, options);
        let gathered = Loans::new(be, BufKind::Params, &lending.params, lending.param_class);
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
    fn parts_of(&self, range: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
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
    fn mine(&self, range: &Range<usize>, piece: usize) -> Range<usize> {
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

    /// Gives back every gathered unit (waiting for a gather started ahead first).
    fn give_back<B: Backend>(&mut self, comm: &mut dyn Collectives<B>, be: &mut B) {
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
    fn full_offset(&self, x: usize) -> usize {
        let (range, piece, offset) =
            self.units.iter().find(|(_, piece, offset)| x < offset + piece).expect("shard element in a unit");
        range.start + self.me * piece + (x - offset)
    }
}
