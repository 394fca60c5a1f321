//! Muon (`optim.name = "muon"`): momentum orthogonalised by Newton–Schulz iterations, on the
//! hidden matrices, in `torch.optim.Muon`'s formulation (docs/recipes.md, `[optim.muon]`).
//!
//! For each matrix, `g` its clipped gradient and `B` its momentum buffer:
//!
//! ```text
//! B ← lerp(B, g, 1 − μ);   U ← lerp(g, B, μ) (Nesterov) or B        Backend::muon_momentum
//! X ← U / max(‖U‖_F, eps), [r, c] with r ≤ c (else transposed)       Backend::divide_by_norm
//! repeat ns_steps:  A ← X Xᵀ;  X ← a X + (b A + c A²) X              matmul, scale, add
//! p ← p (1 − lr · wd) − lr · adjust(rows, cols) · X
//! ```
//!
//! A tall matrix (more rows than columns) is not transposed: `A ← Xᵀ X` and `X ← a X + X Bᵀ`
//! are the same products on the stored matrix. The iterations run in the activations' type
//! (f32 on the CPU reference, bf16 on a GPU, as the reference implementations do), on whole
//! matrices that the devices holding their pieces assemble first
//! ([`crate::parallel::strategies::Parallel::assemble`]).

use anyhow::{Result, bail};

use crate::backend::{Backend, BufKind, MatMul, MuonMomentum, Segment, View};
use crate::config::{AdjustLr, MuonDistribution, OptimConfig};
use crate::parallel::strategies::{HeldMatrix, MatrixScratch, Parallel};

/// A device's Muon: its matrices, how they travel, and the scratch of the iterations.
pub struct Muon {
    matrices: Vec<HeldMatrix>,
    /// Muon's segments of the optimizer buffers, with their matrix's `[rows, cols]`.
    segments: Vec<(Segment, [usize; 2])>,
    /// Batches of matrices (indices into `matrices`) assembled together, with their group.
    batches: Vec<(Vec<usize>, Vec<usize>)>,
    distribution: MuonDistribution,
    /// The assembly buffer and its slot length.
    buf: View,
    slot: usize,
    /// `A` and `b A + c A²` (`r × r`), the product (`r × c`), and the norm's scalar.
    gram: View,
    update: View,
    product: View,
    norm: View,
}

impl Muon {
    /// Muon over `segments` of `par`'s optimizer buffers, its scratch allocated on `be`.
    pub fn new<B: Backend>(
        be: &mut B,
        par: &Parallel<B>,
        segments: Vec<(Segment, [usize; 2])>,
        o: &OptimConfig,
    ) -> Result<Muon> {
        let matrices = par.hidden_matrices();
        if matrices.is_empty() {
            bail!(
                "optim.name = \"muon\": this model (or this device's pipeline stage) has no hidden matrix for Muon to update; use optim.name = \"adamw\""
            );
        }
        let mut batches = Vec::new();
        for split in [false, true] {
            let group = par.assembly_group(split);
            let of: Vec<usize> = (0..matrices.len()).filter(|&i| matrices[i].split == split).collect();
            for batch in of.chunks(group.len()) {
                batches.push((batch.to_vec(), group.clone()));
            }
        }
        let shapes = matrices.iter().map(|m| [m.rows, m.cols]);
        let sizes = MatrixScratch::of(shapes, batches.iter().map(|(_, g)| g.len()).max().unwrap_or(1));
        Ok(Muon {
            buf: be.alloc(BufKind::Activations, sizes.assembly),
            slot: sizes.slot,
            gram: be.alloc(BufKind::Activations, sizes.gram),
            update: be.alloc(BufKind::Activations, sizes.gram),
            product: be.alloc(BufKind::Activations, sizes.slot),
            norm: be.alloc(BufKind::Scalars, 1),
            matrices,
            segments,
            batches,
            distribution: o.muon.distribution,
        })
    }

    /// One step over `par`'s optimizer buffers, its momentum buffer `momentum` laid out like
    /// them, at learning rate `lr` (before each matrix's adjustment). Zeroes the gradients of
    /// Muon's segments.
    pub fn step<B: Backend>(
        &mut self,
        be: &mut B,
        par: &mut Parallel<B>,
        momentum: View,
        norm_sq: View,
        o: &OptimConfig,
        lr: f64,
    ) {
        let m = &o.muon;
        let (params, grads, _) = par.optimizer_buffers();
        let mo = MuonMomentum { momentum: m.momentum as f32, nesterov: m.nesterov, max_grad_norm: o.grad_clip as f32 };
        for (s, _) in &self.segments {
            be.muon_momentum(grads.at(s.offset, s.len), momentum.at(s.offset, s.len), norm_sq, mo);
        }
        let how = self.distribution;
        let coefficients = m.ns_coefficients.map(|c| c as f32);
        for (batch, group) in &self.batches {
            let held: Vec<&HeldMatrix> = batch.iter().map(|&i| &self.matrices[i]).collect();
            let slots = par.assemble(be, grads, &held, (self.buf, self.slot), group, how);
            for (j, x) in slots {
                let scratch = [self.gram, self.update, self.product, self.norm];
                newton_schulz(be, x, [held[j].rows, held[j].cols], scratch, coefficients, m.ns_steps, m.eps as f32);
            }
            par.scatter_back(be, grads, &held, (self.buf, self.slot), group, how);
        }
        let decay = (1.0 - lr * m.weight_decay) as f32;
        for &(s, [rows, cols]) in &self.segments {
            let (p, g) = (params.at(s.offset, s.len), grads.at(s.offset, s.len));
            be.scale(p, decay);
            be.scale(g, -adjusted_lr(lr, rows, cols, m.adjust_lr_fn) as f32);
            be.add(p, g);
            be.fill(g, 0.0);
        }
    }
}

/// `lr` scaled for a `[rows, cols]` (`[out, in]`) matrix, as `torch.optim.Muon`'s
/// `_adjust_lr`.
pub fn adjusted_lr(lr: f64, rows: usize, cols: usize, how: AdjustLr) -> f64 {
    let (a, b) = (rows as f64, cols as f64);
    match how {
        AdjustLr::Original => lr * (a / b).max(1.0).sqrt(),
        AdjustLr::MatchRmsAdamw => lr * 0.2 * a.max(b).sqrt(),
    }
}

/// Orthogonalises the `[rows, cols]` matrix `x` in place: `steps` quintic Newton–Schulz
/// iterations after dividing it by its Frobenius norm (floored at `eps`). `scratch` is `A`'s,
/// `b A + c A²`'s and the product's buffers (at least `r²`, `r²` and `r · c` elements for
/// `r ≤ c` the sides) and a scalar.
pub fn newton_schulz<B: Backend>(
    be: &mut B,
    x: View,
    [rows, cols]: [usize; 2],
    [gram, update, product, norm]: [View; 4],
    [a, b, c]: [f32; 3],
    steps: usize,
    eps: f32,
) {
    let (r, long, tall) = if rows > cols { (cols, rows, true) } else { (rows, cols, false) };
    let (gram, update, product) = (gram.at(0, r * r), update.at(0, r * r), product.at(0, r * long));
    be.sum_squares(norm, x);
    be.divide_by_norm(x, norm, eps);
    let plain = |m, n, k| MatMul { m, n, k, a_t: false, b_t: false, accumulate: false };
    // Each sum is accumulated in the product (one rounding, as torch's addmm), its addend
    // scaled first.
    let scaled = |be: &mut B, dst: View, src: View, s: f32| {
        be.copy(dst, src);
        be.scale(dst, s);
    };
    let c_gram = product.at(0, r * r);
    for _ in 0..steps {
        // A = X Xᵀ (wide), Xᵀ X (tall): r × r.
        let square =
            if tall { MatMul { a_t: true, ..plain(r, r, long) } } else { MatMul { b_t: true, ..plain(r, r, long) } };
        be.matmul(gram, x, x, square);
        // B = b A + (c A) A.
        scaled(be, update, gram, b);
        scaled(be, c_gram, gram, c);
        be.matmul(update, c_gram, gram, MatMul { accumulate: true, ..plain(r, r, r) });
        // X ← a X + B X (wide), a X + X Bᵀ (tall).
        scaled(be, product, x, a);
        if tall {
            be.matmul(product, x, update, MatMul { b_t: true, accumulate: true, ..plain(long, r, r) });
        } else {
            be.matmul(product, update, x, MatMul { accumulate: true, ..plain(r, long, r) });
        }
        be.copy(x, product);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;

    /// The iteration drives every singular value of a matrix towards the band the quintic
    /// settles in (about 0.7 to 1.2), wide or tall alike, and a tall matrix's result is the
    /// transpose of its transpose's.
    #[test]
    fn newton_schulz_orthogonalises_wide_and_tall_alike() {
        let mut be = Cpu::new();
        let (rows, cols) = (6, 10);
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1).collect();
        let transposed: Vec<f32> = (0..rows * cols).map(|i| values[(i % rows) * cols + i / rows]).collect();
        let scratch = [100, 100, 60, 1].map(|n| be.alloc(BufKind::Activations, n));
        let run = |be: &mut Cpu, v: &[f32], shape: [usize; 2]| {
            let x = be.alloc(BufKind::Activations, v.len());
            be.upload(x, v);
            newton_schulz(be, x, shape, scratch, [3.4445, -4.7750, 2.0315], 5, 1e-7);
            let mut out = vec![0f32; v.len()];
            be.download(x, &mut out);
            out
        };
        let wide = run(&mut be, &values, [rows, cols]);
        let tall = run(&mut be, &transposed, [cols, rows]);
        for i in 0..rows * cols {
            assert!((tall[(i % cols) * rows + i / cols] - wide[i]).abs() < 1e-5, "element {i}");
        }
        // X Xᵀ's diagonal: each row's squared norm, the singular values' band.
        for r in 0..rows {
            let n: f32 = wide[r * cols..(r + 1) * cols].iter().map(|v| v * v).sum();
            assert!((0.4..1.5).contains(&n), "row {r}: {n}");
        }
    }

    #[test]
    fn adjusted_lr_follows_pytorch() {
        assert_eq!(adjusted_lr(0.02, 64, 16, AdjustLr::Original), 0.04);
        assert_eq!(adjusted_lr(0.02, 16, 64, AdjustLr::Original), 0.02);
        assert!((adjusted_lr(1.0, 16, 64, AdjustLr::MatchRmsAdamw) - 1.6).abs() < 1e-12);
    }
}
