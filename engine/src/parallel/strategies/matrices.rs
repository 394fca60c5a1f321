//! Whole matrices from the pieces the devices hold, for Muon's Newton–Schulz iterations, which
//! need each matrix whole while FSDP and tensor parallelism shard it.
//!
//! A device knows where each element of its optimizer buffers is in the single-device layout
//! ([`Parallel::chunks`]). A hidden matrix's elements are held once between the devices of its
//! *assembly group*: fsdp × seq (the FSDP pieces) for a matrix the tensor axis replicates,
//! fsdp × seq × tensor for one it splits. Every member of the group holds the same matrices in
//! the same order (the same stage, tensor-local layout and experts), so batches of `G` matrices
//! (`G` the group's size) travel together:
//!
//! - **owner** (round-robin): each member writes its pieces of the batch's matrices into a
//!   zeroed buffer of `G` slots, one per matrix; a reduce-scatter sums the slots, member `i`
//!   receiving matrix `i` whole (the other members' zeros add nothing: the sum is exact); it
//!   orthogonalises that one; an all-gather brings every slot back, and each member takes its
//!   pieces of every update. The iterations' work is divided over the group.
//! - **everywhere**: the same buffer, summed by an all-reduce; every member orthogonalises every
//!   matrix of the batch.
//!
//! The pipeline and expert axes need neither: a device holds its stage's and its experts'
//! matrices (or their FSDP pieces) itself. A group of one copies its matrices into the slot and
//! back, since the iterations run in the activations' type (bf16 on a GPU).

use super::Parallel;
use crate::backend::{Backend, View};
use crate::checkpoint::sharded::Chunk;

/// A hidden matrix a device holds all or pieces of, in the optimizer's buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldMatrix {
    /// Its tensor's name, and which block of a packed tensor (0 for the others).
    pub name: String,
    /// The logical matrix's rows (`out`).
    pub rows: usize,
    /// Its columns (`in`).
    pub cols: usize,
    /// Where this device's elements are: `(local, at, len)`, local elements `local ..` of the
    /// optimizer's buffers being elements `at ..` of the matrix, row-major.
    pub pieces: Vec<(usize, usize, usize)>,
    /// Whether the tensor axis splits it (assembled over fsdp × seq × tensor; else fsdp × seq).
    pub split: bool,
}

impl HeldMatrix {
    /// Elements of the whole matrix.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a batch of matrices is assembled: [`crate::config::MuonDistribution`].
pub use crate::config::MuonDistribution as Assembly;

impl<B: Backend> Parallel<B> {
    /// The hidden matrices ([`crate::model::Tensor::is_hidden_matrix`]) this device holds all
    /// or pieces of, in layout order, packed tensors cut into their logical matrices.
    pub fn hidden_matrices(&self) -> Vec<HeldMatrix> {
        let mut chunks = self.chunks();
        chunks.sort_by_key(|c| c.global);
        let mut out = Vec::new();
        for (i, t) in self.slice.local.tensors.iter().enumerate() {
            if !t.is_hidden_matrix() {
                continue;
            }
            let g = &self.slice.global.tensors[self.slice.global_index[i]];
            let cols = g.shape[1];
            for (block, (row, rows)) in g.matrices().into_iter().enumerate() {
                let start = g.offset + row * cols;
                let end = start + rows * cols;
                let pieces =
                    overlapping(&chunks, start..end).map(|(local, global, len)| (local, global - start, len)).collect();
                let split = self.slice.is_split(i);
                out.push(HeldMatrix { name: format!("{}#{block}", g.name), rows, cols, pieces, split });
            }
        }
        out
    }

    /// The devices that hold a matrix's pieces between them (this device among them): the
    /// assembly group of a matrix the tensor axis splits (`split`) or replicates.
    pub fn assembly_group(&self, split: bool) -> Vec<usize> {
        let axes: &[super::Axis] = if split {
            &[super::Axis::Fsdp, super::Axis::Seq, super::Axis::Tensor]
        } else {
            &[super::Axis::Fsdp, super::Axis::Seq]
        };
        self.mesh.group_over(self.rank, axes)
    }

    /// Assembles `batch` (at most `group.len()` matrices of one assembly group) from the
    /// members' pieces of `src` (the optimizer-buffer-shaped matrices to orthogonalise) into
    /// `buf` (`group.len()` slots of `slot` elements), and returns the slots this device
    /// orthogonalises: `(index in batch, view of the whole matrix)`.
    pub fn assemble(
        &mut self,
        be: &mut B,
        src: View,
        batch: &[&HeldMatrix],
        (buf, slot): (View, usize),
        group: &[usize],
        how: Assembly,
    ) -> Vec<(usize, View)> {
        let g = group.len();
        assert!(batch.len() <= g && buf.len >= g * slot, "internal error: a batch of matrices larger than its buffer");
        if g > 1 {
            be.fill(buf.at(0, g * slot), 0.0);
        }
        for (j, m) in batch.iter().enumerate() {
            for &(local, at, len) in &m.pieces {
                be.copy(buf.at(j * slot + at, len), src.at(local, len));
            }
        }
        let me = group.iter().position(|&r| r == self.rank).expect("member of its assembly group");
        match how {
            _ if g == 1 => batch.iter().enumerate().map(|(j, m)| (j, buf.at(j * slot, m.len()))).collect(),
            Assembly::Owner => {
                let mine = buf.at(g * slot, slot);
                self.comm.reduce_scatter_sum(be, buf.at(0, g * slot), mine, group);
                batch.get(me).map(|m| (me, mine.at(0, m.len()))).into_iter().collect()
            }
            Assembly::Everywhere => {
                self.comm.all_reduce_sum(be, buf.at(0, g * slot), group);
                batch.iter().enumerate().map(|(j, m)| (j, buf.at(j * slot, m.len()))).collect()
            }
        }
    }

    /// The inverse of [`Parallel::assemble`], once the slots it returned hold their updates:
    /// brings every slot back (owner: an all-gather) and copies this device's pieces of each
    /// matrix of `batch` into `dst`.
    pub fn scatter_back(
        &mut self,
        be: &mut B,
        dst: View,
        batch: &[&HeldMatrix],
        (buf, slot): (View, usize),
        group: &[usize],
        how: Assembly,
    ) {
        let g = group.len();
        if g > 1 && how == Assembly::Owner {
            self.comm.all_gather(be, buf.at(g * slot, slot), buf.at(0, g * slot), group);
        }
        for (j, m) in batch.iter().enumerate() {
            for &(local, at, len) in &m.pieces {
                be.copy(dst.at(local, len), buf.at(j * slot + at, len));
            }
        }
    }
}

impl<B: Backend> Parallel<B> {
    /// Multiplies, for each `(name, rows, factor)` of `scales`, rows `rows` of the tensor named
    /// `name` (in the single-device layout) by `factor` wherever this device holds them in its
    /// optimizer buffers' parameters (its FSDP pieces, its tensor-parallel slice), the compute
    /// copy with them: QK-clip's rescaling ([`crate::optim::qk_clip`]). A tensor this device's
    /// stage does not hold is skipped.
    pub fn scale_rows<'a>(&self, be: &mut B, scales: impl IntoIterator<Item = (&'a str, std::ops::Range<usize>, f32)>) {
        let mut chunks = self.chunks();
        chunks.sort_by_key(|c| c.global);
        let params = self.optimizer_buffers().0;
        for (name, rows, factor) in scales {
            let Some(t) = self.slice.global.tensors.iter().find(|t| t.name == name) else { continue };
            let cols = t.shape.get(1).copied().unwrap_or(1);
            assert!(rows.end <= t.shape[0], "internal error: rows {rows:?} of {name} {:?}", t.shape);
            for (local, _, len) in overlapping(&chunks, t.offset + rows.start * cols..t.offset + rows.end * cols) {
                be.scale(params.at(local, len), factor);
            }
        }
    }
}

/// The `(local, global, len)` parts of `chunks` (sorted by `global`) inside global elements
/// `range`.
fn overlapping(chunks: &[Chunk], range: std::ops::Range<usize>) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let first = chunks.partition_point(|c| c.global + c.len <= range.start);
    chunks[first..].iter().take_while(move |c| c.global < range.end).map(move |c| {
        let (lo, hi) = (c.global.max(range.start), (c.global + c.len).min(range.end));
        (c.local + (lo - c.global), lo, hi - lo)
    })
}

impl<B: Backend> Parallel<B> {
    /// The optimizer's segments ([`Parallel::optimizer_buffers`]) of hidden matrices (Muon's),
    /// each with its logical matrix's `[rows, cols]` (a packed tensor's blocks are alike), and
    /// the others (AdamW's).
    pub fn segments_by_matrix(&self) -> (Vec<(crate::backend::Segment, [usize; 2])>, Vec<crate::backend::Segment>) {
        let (_, _, segments) = self.optimizer_buffers();
        let (mut muon, mut adamw) = (Vec::new(), Vec::new());
        for s in segments {
            let i = self.segment_tensor(s);
            if self.slice.local.tensors[i].is_hidden_matrix() {
                let g = &self.slice.global.tensors[self.slice.global_index[i]];
                let (_, rows) = g.matrices()[0];
                muon.push((*s, [rows, g.shape[1]]));
            } else {
                adamw.push(*s);
            }
        }
        (muon, adamw)
    }
}

/// Elements of Muon's scratch on a device holding `matrices`, assembled in groups of at most
/// `group` devices: what Muon ([`crate::optim::muon`]) allocates and the memory plan counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixScratch {
    /// The largest matrix: a slot of the assembly buffer, and the product's scratch.
    pub slot: usize,
    /// The assembly buffer: `group` slots, and the owner's one more.
    pub assembly: usize,
    /// `A` (and `b A + c A²`): the square of the largest shorter side.
    pub gram: usize,
}

impl MatrixScratch {
    /// The sizes for matrices of `shapes` (`[rows, cols]`, whole) over groups of at most
    /// `group` devices.
    pub fn of(shapes: impl Iterator<Item = [usize; 2]> + Clone, group: usize) -> MatrixScratch {
        let slot = shapes.clone().map(|[r, c]| r * c).max().unwrap_or(0);
        let side = shapes.map(|[r, c]| r.min(c)).max().unwrap_or(0);
        let extra = usize::from(group > 1);
        MatrixScratch { slot, assembly: (group + extra) * slot, gram: side * side }
    }

    /// The sizes on a device holding `model` (its tensor-parallel slice of a pipeline stage,
    /// with its experts) of `config`'s run, whose matrices are sharded over `fsdp` devices
    /// (fsdp × seq): the whole matrices it holds pieces of, assembled over fsdp devices, or
    /// fsdp × tensor for those the tensor axis splits. What the memory plan counts.
    pub fn of_model(config: &crate::config::Config, model: &crate::model::Model, fsdp: usize) -> MatrixScratch {
        let whole = crate::model::Layout::new(&config.model);
        let held: std::collections::HashSet<&str> = model.layout.tensors.iter().map(|t| t.name.as_str()).collect();
        // The tensor group's size: its devices' local configurations hold 1/T of the heads.
        let tensor = config.model.n_heads / model.config.n_heads.max(1);
        let mut group = fsdp;
        let mut shapes = Vec::new();
        for t in whole.tensors.iter().filter(|t| t.is_hidden_matrix() && held.contains(t.name.as_str())) {
            if tensor > 1 && super::super::tensor::split_of(&t.name) != super::super::tensor::Split::Replicated {
                group = group.max(fsdp * tensor);
            }
            shapes.extend(t.matrices().into_iter().map(|(_, rows)| [rows, t.shape[1]]));
        }
        MatrixScratch::of(shapes.into_iter(), group)
    }

    /// All of it, in elements.
    pub fn total(&self) -> usize {
        self.assembly + 2 * self.gram + self.slot
    }
}
