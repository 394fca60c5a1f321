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
//!   parameters are all-gathered into a buffer lent for the time of their use (`fsdp.rs`): the
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
//! Data parallelism, tensor and pipeline exchanges are here, in [`Parallel`], which every device
//! is; FSDP's pieces and loans are in `fsdp.rs`, which a device has only on an fsdp × seq group
//! of more than one.
//!
//! Gradients are scaled so that the objective is the mean over the global batch, as on one
//! device: the sums over the batch group (data × fsdp × seq) add up its devices' per-device
//! means, each weighted `1 / (data · fsdp · seq)` by the trainer.

mod fsdp;
mod matrices;

pub use fsdp::{FsdpOptions, FsdpSizes, UnitPiece, fsdp_pieces, fsdp_sizes};
pub use matrices::{Assembly, HeldMatrix, MatrixScratch};

use super::comm::Collectives;
use super::experts::ExpertExchange;
use super::mesh::{Axis, Coords, Mesh};
use super::tensor::{Run, TensorSlice};
use crate::backend::{Backend, BufKind, IdxView, Parts, Segment, View};
use crate::checkpoint::sharded::Chunk;
use crate::model::{CastWeight, Exchange, Pass, Unit, Window};
use fsdp::Fsdp;

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
    /// The expert group: the devices that hold every expert once between them (this device
    /// alone without an expert axis).
    expert_group: Vec<usize>,
    /// The data ranks that hold this device's experts, over which their gradients are summed
    /// (the data group without an expert axis).
    expert_replicas: Vec<usize>,
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
    /// The expert axis's token exchange ([`Parallel::join_experts`]); none without one.
    experts: Option<ExpertExchange>,
    /// The pieces of the optimizer's buffers that hold selection biases (DeepSeek-V3's
    /// buffers, moved by the balancing step, never by AdamW), each with where its load excess
    /// waits in `excess` between the gradients' norm and the step.
    balance: Vec<(Segment, usize)>,
    excess: View,
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
        (fsdp_options, casts): (FsdpOptions, &[CastWeight]),
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
        let (expert_group, expert_replicas) = (mesh.expert_group(rank), mesh.expert_replicas(rank));
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
                (&expert_group, "expert"),
                (&expert_replicas, "expert replicas"),
                (&samples, "data x fsdp"),
                (&batch, "data x fsdp x seq"),
            ]
            .into_iter()
            .map(|(g, name)| (g.clone(), name.to_owned()))
            .collect(),
        );
        let layout = &slice.local;
        let me = fsdp_group.iter().position(|&r| r == rank).expect("member");
        let fsdp = (fsdp_group.len() > 1).then(|| Fsdp::new(be, layout, (fsdp_group.len(), me), fsdp_options, casts));
        let segments =
            layout.tensors.iter().map(|t| Segment { offset: t.offset, len: t.len(), decay: t.decay }).collect();
        let mut balance = Vec::new();
        let mut excess_len = 0;
        for t in layout.tensors.iter().filter(|t| t.is_buffer()) {
            let range = t.offset..t.offset + t.len();
            let parts: Vec<(usize, usize)> = match &fsdp {
                Some(f) => f.parts_of(range).map(|(at, part)| (at, part.len())).collect(),
                None => vec![(range.start, range.len())],
            };
            for (offset, len) in parts {
                balance.push((Segment { offset, len, decay: false }, excess_len));
                excess_len += len;
            }
        }
        let excess = be.alloc(BufKind::Scalars, excess_len);
        // Two scalars for the tensor axis's sums, and the limbs of `gather_from_world`.
        let scratch = be.alloc(BufKind::Scalars, 2.max(6 * mesh.devices()));
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
            expert_group,
            expert_replicas,
            p2p_time: std::time::Duration::ZERO,
            params,
            grads,
            segments,
            fsdp,
            sync: true,
            scratch,
            experts: None,
            balance,
            excess,
        }
    }

    /// Takes the selection biases' load excess out of the gradients (after their sums, before
    /// their norm, which it must not count), into a buffer of its own until
    /// [`Parallel::balance_selection_biases`].
    pub fn take_load_excess(&mut self, be: &mut B) {
        self.comm.wait(be);
        let (_, grads, _) = self.optimizer_buffers();
        for &(seg, at) in &self.balance {
            let piece = grads.at(seg.offset, seg.len);
            be.copy(self.excess.at(at, seg.len), piece);
            be.fill(piece, 0.0);
        }
    }

    /// DeepSeek-V3's auxiliary-loss-free balancing step: each selection bias moves by
    /// `rate · sign(mean load − load)`, elementwise over this device's pieces (every replica
    /// summed the same loads, so every copy moves alike); `None` (a step not applied) drops
    /// the excess.
    pub fn balance_selection_biases(&mut self, be: &mut B, rate: Option<f32>) {
        let (params, _, _) = self.optimizer_buffers();
        for &(seg, at) in &self.balance {
            let excess = self.excess.at(at, seg.len);
            match rate {
                Some(rate) => be.moe_bias_step(params.at(seg.offset, seg.len), excess, rate),
                None => be.fill(excess, 0.0),
            }
        }
    }

    /// Joins this device's expert group for a model of `experts` experts, when the mesh has an
    /// expert axis: the expert layers then run this device's experts on the rows every member
    /// routes to them ([`crate::parallel::experts`]).
    ///
    /// The device holds its own experts only (its slice's layout): their gradients are summed
    /// over the data ranks that hold the same experts ([`Mesh::expert_replicas`]), the rest of
    /// each layer's over the batch group as without the axis, and their squared norms add up
    /// over the expert group.
    pub fn join_experts(&mut self, be: &mut B, experts: usize) {
        if self.mesh.expert_size() > 1 {
            self.experts = Some(ExpertExchange::new(be, self.expert_group.clone(), self.rank, experts));
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

    /// Under FSDP, the units it gathers as FP8 casts and the units in all.
    pub fn fp8_gathers(&self) -> Option<(usize, usize)> {
        self.fsdp.as_ref().map(|f| f.cast_units())
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
        let experts = self.slice.divides_experts;
        if self.tensor.len() == 1 && !experts {
            be.sum_squares(out, grads);
        } else {
            // Replicated tensors count once; the slices of split ones add up over the tensor
            // group, the experts of an expert axis over the expert group (and, split over the
            // tensor axis too, over the tensor group after that; those the tensor group
            // replicates, GPT-OSS's down biases, over the expert group alone).
            let (split, part) = (self.scratch.at(0, 1), self.scratch.at(1, 1));
            // The experts' split tensors' squares and their replicated ones', reduced together.
            let expert = self.scratch.at(2, 2);
            let (expert_split, expert_replicated) = (expert.at(0, 1), expert.at(1, 1));
            be.fill(out, 0.0);
            be.fill(split, 0.0);
            be.fill(expert, 0.0);
            for s in &segs {
                be.sum_squares(part, grads.at(s.offset, s.len));
                let i = self.segment_tensor(s);
                let into = match (self.slice.is_divided_expert(i), self.slice.is_split(i)) {
                    (true, true) => expert_split,
                    (true, false) => expert_replicated,
                    (false, true) => split,
                    (false, false) => out,
                };
                be.add(into, part);
            }
            if experts {
                self.comm.all_reduce_sum(be, expert, &self.expert_group);
                be.add(if self.tensor.len() > 1 { split } else { out }, expert_split);
                be.add(out, expert_replicated);
            }
            if self.tensor.len() > 1 {
                self.comm.all_reduce_sum(be, split, &self.tensor);
                be.add(out, split);
            }
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

    /// Whether this device's collectives may sit inside a recorded section
    /// ([`Collectives::captures_sections`]).
    pub fn captures_sections(&self) -> bool {
        self.comm.captures_sections()
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

    /// The local tensor an optimizer segment belongs to. Segments are whole tensors, or pieces
    /// of one under FSDP.
    fn segment_tensor(&self, s: &Segment) -> usize {
        let offset = match &self.fsdp {
            None => s.offset,
            Some(f) => f.full_offset(s.offset),
        };
        self.slice.local.tensors.partition_point(|t| t.offset + t.len() <= offset)
    }

    /// `buf = Σ buf` over the batch group (the step's loss, evaluation sums).
    pub fn sum_over_batch(&mut self, be: &mut B, buf: View) {
        if self.batch.len() > 1 {
            self.comm.all_reduce_sum(be, buf, &self.batch);
        }
    }

    /// `buf = max buf` over the batch group (FP8 amaxes, so that every replica scales alike).
    pub fn max_over_batch(&mut self, be: &mut B, buf: View) {
        if self.batch.len() > 1 {
            self.comm.all_reduce_max(be, buf, &self.batch);
        }
    }

    /// After the optimizer (or new parameters): under FSDP, the gathered parameters are stale
    /// and given back; the next pass gathers again.
    pub fn after_step(&mut self, be: &mut B) {
        if let Some(f) = &mut self.fsdp {
            f.give_back(&mut *self.comm, be);
            f.weights_changed();
        }
    }

    /// The range of the device's layout that a unit's experts take on an expert axis, where
    /// they are summed apart from the rest of the unit.
    fn experts_in(&self, unit: Unit) -> Option<std::ops::Range<usize>> {
        match unit {
            Unit::Layer(i) if self.slice.divides_experts => self.slice.local.layers[i].experts(),
            _ => None,
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
    /// each slice along the data axis (the others hold copies); on an expert axis, every member
    /// of the first expert group, each holding its own experts.
    pub fn saves(&self) -> bool {
        self.mesh.expert_replica(self.rank) == 0
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
        self.over_world(be, x, false)
    }

    /// `max x` over every device of the mesh. Every device calls it at the same point.
    pub fn max_over_world(&mut self, be: &mut B, x: f32) -> f32 {
        self.over_world(be, x, true)
    }

    /// `x` summed (or its maximum taken) over every device of the mesh, through the scratch.
    fn over_world(&mut self, be: &mut B, x: f32, max: bool) -> f32 {
        let v = self.scratch.at(0, 1);
        be.upload(v, &[x]);
        let world: Vec<usize> = (0..self.mesh.devices()).collect();
        if max {
            self.comm.all_reduce_max(be, v, &world);
        } else {
            self.comm.all_reduce_sum(be, v, &world);
        }
        let mut out = [0f32];
        be.download(v, &mut out);
        out[0]
    }

    /// Devices whose gradients and losses add up (data × fsdp × seq).
    pub fn batch_devices(&self) -> usize {
        self.batch.len()
    }

    /// `value` of every device of the mesh, in rank order, exactly (integers below 2^48: each
    /// travels as three 16-bit limbs in its own place of a buffer summed over the mesh, sums
    /// that f32 holds exactly). Every device calls it at the same point.
    pub fn gather_from_world(&mut self, be: &mut B, value: u64) -> Vec<u64> {
        self.gather_many_from_world(be, [value]).into_iter().map(|[v]| v).collect()
    }

    /// [`Parallel::gather_from_world`] of `N` (at most 2) values at once, in one collective.
    pub fn gather_many_from_world<const N: usize>(&mut self, be: &mut B, values: [u64; N]) -> Vec<[u64; N]> {
        assert!(N <= 2, "gather_many_from_world: at most 2 values (the scratch's size)");
        let world = self.mesh.devices();
        // Allocated once with the scratch: this runs at every step boundary.
        let (width, mut limbs) = (3 * N, vec![0f32; 3 * N * world]);
        let buf = self.scratch.at(0, width * world);
        for (v, &value) in values.iter().enumerate() {
            assert!(value < 1 << 48, "gather_from_world: {value} does not fit 48 bits");
            let at = width * self.rank + 3 * v;
            for (i, limb) in limbs[at..at + 3].iter_mut().enumerate() {
                *limb = ((value >> (16 * i)) & 0xffff) as f32;
            }
        }
        be.upload(buf, &limbs);
        let group: Vec<usize> = (0..world).collect();
        self.comm.all_reduce_sum(be, buf, &group);
        be.download(buf, &mut limbs);
        let value = |l: &[f32]| l.iter().rev().fold(0u64, |acc, &x| (acc << 16) | x as u64);
        limbs.chunks_exact(width).map(|rank| std::array::from_fn(|v| value(&rank[3 * v..3 * v + 3]))).collect()
    }

    /// Time this device has waited in collectives so far, where it is counted
    /// ([`Collectives::blocked`]).
    pub fn blocked(&self) -> Option<std::time::Duration> {
        self.comm.blocked()
    }

    /// Time the collectives' wrapper has spent on its own work so far, where there is one
    /// ([`Collectives::overhead`]).
    pub fn collectives_overhead(&self) -> Option<std::time::Duration> {
        self.comm.overhead()
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

    fn tensor_rank_for_vocab(&self) -> (usize, usize) {
        (self.coords.tensor, self.tensor.len())
    }

    fn tensor_max_for_vocab(&mut self, be: &mut B, buf: View) {
        if self.tensor.len() > 1 {
            self.comm.all_reduce_max(be, buf, &self.tensor);
        }
    }

    fn seq_gather(&mut self, be: &mut B, local: View, all: View) {
        self.comm.all_gather(be, local, all, &self.seq);
    }

    fn seq_scatter_sum(&mut self, be: &mut B, all: View, local: View) {
        self.comm.reduce_scatter_sum(be, all, local, &self.seq);
    }

    fn expert_rank(&self) -> (usize, usize) {
        match &self.experts {
            None => (0, 1),
            Some(e) => {
                let (local, members) = (e.local_experts(), self.mesh.expert_size());
                (local.start / local.len(), members)
            }
        }
    }

    fn expert_exchange(&mut self, be: &mut B, input: View, output: View) {
        let e = self.experts.as_mut().expect("internal error: an expert exchange without an expert axis");
        e.exchange(&mut *self.comm, be, input, output);
    }

    fn expert_runs(&mut self, be: &mut B, offsets: IdxView, parts: Parts, runs: IdxView) {
        let e = self.experts.as_mut().expect("internal error: an expert exchange without an expert axis");
        e.runs(&mut *self.comm, be, offsets, parts, runs);
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
        let f = self.fsdp.as_mut()?;
        Some(f.params_needed(&mut *self.comm, be, u, pass, &self.fsdp_group))
    }

    fn params_done(&mut self, _be: &mut B, unit: Unit, pass: Pass) {
        let u = self.unit_index(unit);
        if let Some(f) = &mut self.fsdp {
            f.params_done(u, pass);
        }
    }

    fn grads_needed(&mut self, be: &mut B, unit: Unit) -> Option<Window> {
        let u = self.unit_index(unit);
        Some(self.fsdp.as_mut()?.grads_needed(be, u))
    }

    fn grads_ready(&mut self, be: &mut B, unit: Unit) {
        let (u, experts) = (self.unit_index(unit), self.experts_in(unit));
        match &mut self.fsdp {
            None => {
                // Data parallelism: the unit's bucket is summed over the batch group once the
                // step's last micro-batch has finished it, while the backward pass goes on.
                let range = self.slice.local.unit_range(unit);
                if self.sync && self.batch.len() > 1 && !range.is_empty() {
                    let (buf, groups) = (self.grads.at(range.start, range.len()), (&self.batch, &self.expert_replicas));
                    sum_experts_apart(be, self.comm.as_mut(), (buf, range.start), experts, groups);
                }
            }
            Some(f) => {
                // Every micro-batch's gradient goes to the pieces at once; the data axis sums
                // the pieces once per step (HSDP).
                let mine = f.grads_ready(&mut *self.comm, be, u, &self.fsdp_group);
                if self.sync && self.data.len() > 1 {
                    let start = f.full_offset(mine.offset - f.grads.offset);
                    let groups = (&self.data, &self.expert_replicas);
                    sum_experts_apart(be, self.comm.as_mut(), (mine, start), experts, groups);
                }
            }
        }
    }
}

/// Starts summing a unit's gradients `buf` (elements `start..` of the device's layout) over
/// `all`, but those of `experts` (a layer's own experts on an expert axis, which end the
/// layer) over `replicas`, the devices that hold the same experts.
fn sum_experts_apart<B: Backend>(
    be: &mut B,
    comm: &mut (dyn Collectives<B> + Send),
    (buf, start): (View, usize),
    experts: Option<std::ops::Range<usize>>,
    (all, replicas): (&Vec<usize>, &Vec<usize>),
) {
    let split = experts.map_or(buf.len, |e| e.start.saturating_sub(start).min(buf.len));
    if split > 0 {
        comm.all_reduce_sum_start(be, buf.at(0, split), all);
    }
    if split < buf.len && replicas.len() > 1 {
        comm.all_reduce_sum_start(be, buf.at(split, buf.len - split), replicas);
    }
}
