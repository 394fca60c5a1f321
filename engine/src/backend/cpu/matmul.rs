//! Matrix products through the `gemm` family of crates (gemm-f32's kernels, [`sgemm`]).
//!
//! `gemm` is fast when both operands are row-major (`a · b`, and with a transposed left operand)
//! but about three times slower on `x · Wᵀ` with few rows — the forward pass of every linear
//! layer, whose weight is stored `[out, in]` — measured on this project's CPUs (64 × 1024 ×
//! 22016: 85 ms direct, 30 ms as below). For those, [`matmul`] computes `(W · xᵀ)ᵀ` instead: it
//! transposes the small `x` and the small result, and multiplies row-major operands.

pub(crate) use gemm_common::Parallelism;
use rayon::prelude::*;

use crate::backend::MatMul;

/// Largest row count of `a` for which `a · bᵀ` goes through transposes; beyond it the direct
/// product wins (the transposes grow with the rows while the product's penalty shrinks).
const TRANSPOSE_ROWS: usize = 256;

/// Space for the transposed operands of `a · bᵀ`, reused across calls.
#[derive(Default)]
pub struct Scratch {
    a_t: Vec<f32>,
    out_t: Vec<f32>,
}

impl Scratch {
    /// Bytes the transposes hold.
    pub fn bytes(&self) -> usize {
        (self.a_t.capacity() + self.out_t.capacity()) * 4
    }
}

/// `out[m, n] (+)= op(a) · op(b)`, see [`MatMul`]. Threads split the output only, so the result
/// does not depend on their number.
pub fn matmul(out: &mut [f32], a: &[f32], b: &[f32], s: MatMul, scratch: &mut Scratch) {
    matmul_scaled(out, a, b, s, 1.0, scratch)
}

/// `out[m, n] (+)= op(a) · op(b) · scale`: [`matmul`] with the product multiplied by `scale`
/// before it is stored or added (the FP8 products' inverse scales).
pub fn matmul_scaled(out: &mut [f32], a: &[f32], b: &[f32], s: MatMul, scale: f32, scratch: &mut Scratch) {
    if !s.a_t && s.b_t && s.m <= TRANSPOSE_ROWS && s.m > 0 && s.n > 0 && s.k > 0 {
        // outᵀ[n, m] = b[n, k] · aᵀ[k, m], both row-major.
        scratch.a_t.resize(s.k * s.m, 0.0);
        scratch.out_t.resize(s.n * s.m, 0.0);
        transpose(a, &mut scratch.a_t, s.m, s.k);
        let product = MatMul { m: s.n, n: s.m, k: s.k, a_t: false, b_t: false, accumulate: false };
        gemm_raw(&mut scratch.out_t, b, &scratch.a_t, product, scale);
        if s.accumulate {
            add_transposed(out, &scratch.out_t, s.n, s.m);
        } else {
            transpose(&scratch.out_t, out, s.n, s.m);
        }
        return;
    }
    gemm_raw(out, a, b, s, scale)
}

/// Tile edge of the transposes: a tile of each side stays in L1.
const TILE: usize = 32;

/// `dst[c, r] = src[r, c]` for a `rows × cols` row-major `src`.
pub fn transpose(src: &[f32], dst: &mut [f32], rows: usize, cols: usize) {
    assert_eq!(src.len(), rows * cols);
    assert_eq!(dst.len(), rows * cols);
    // Each task owns TILE rows of dst (= TILE columns of src).
    dst.par_chunks_mut(TILE * rows).enumerate().for_each(|(block, d)| {
        let c0 = block * TILE;
        let nc = d.len() / rows;
        for r0 in (0..rows).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                let row = &src[r * cols + c0..][..nc];
                for (c, &x) in row.iter().enumerate() {
                    d[c * rows + r] = x;
                }
            }
        }
    });
}

/// `dst[c, r] += src[r, c]` for a `rows × cols` row-major `src`.
fn add_transposed(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    dst.par_chunks_mut(TILE * rows).enumerate().for_each(|(block, d)| {
        let c0 = block * TILE;
        let nc = d.len() / rows;
        for r0 in (0..rows).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                let row = &src[r * cols + c0..][..nc];
                for (c, &x) in row.iter().enumerate() {
                    d[c * rows + r] += x;
                }
            }
        }
    });
}

/// The product through `gemm` as given, multiplied by `scale`.
fn gemm_raw(out: &mut [f32], a: &[f32], b: &[f32], s: MatMul, scale: f32) {
    assert_eq!(out.len(), s.m * s.n, "matmul output");
    assert_eq!(a.len(), s.m * s.k, "matmul lhs");
    assert_eq!(b.len(), s.k * s.n, "matmul rhs");
    if s.m == 0 || s.n == 0 {
        return;
    }
    if s.k == 0 {
        if !s.accumulate {
            out.fill(0.0);
        }
        return;
    }
    // gemm takes (column stride, row stride) per operand.
    let (a_cs, a_rs) = if s.a_t { (s.m, 1) } else { (1, s.k) };
    let (b_cs, b_rs) = if s.b_t { (s.k, 1) } else { (1, s.n) };
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 && s.flops() > 2e6 { Parallelism::Rayon(threads) } else { Parallelism::None };
    // SAFETY: the slices hold exactly the elements the shapes and strides address (asserted).
    unsafe {
        sgemm(
            (s.m, s.n, s.k),
            out.as_mut_ptr(),
            (1, s.n as isize),
            s.accumulate,
            (a.as_ptr(), a_cs as isize, a_rs as isize),
            (b.as_ptr(), b_cs as isize, b_rs as isize),
            scale,
            parallelism,
        );
    }
}

/// `dst = lhs · rhs · scale`, plus `dst` when `accumulate`: f32, `m × k` times `k × n`, each
/// operand given by its first element and its (column, row) strides in elements, through
/// gemm-f32's kernels.
///
/// This is the orientation step of the `gemm` front crate's `gemm::gemm` (0.19), kept here so
/// that the f64 and complex kernels that crate also builds stay out of the tree: the
/// microkernels want a column-major destination, so a row-major one is computed as its
/// transpose, `dstᵀ = rhsᵀ · lhsᵀ`. Strides are never negative here (the front crate also flips
/// those).
///
/// # Safety
///
/// Each pointer addresses every element its shape and strides reach.
pub(crate) unsafe fn sgemm(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    (dst_cs, dst_rs): (isize, isize),
    accumulate: bool,
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
    scale: f32,
    parallelism: Parallelism,
) {
    debug_assert!([dst_cs, dst_rs, lhs.1, lhs.2, rhs.1, rhs.2].iter().all(|&s| s >= 0));
    let ((m, n), (dst_cs, dst_rs), lhs, rhs) = if dst_cs < dst_rs {
        ((n, m), (dst_rs, dst_cs), (rhs.0, rhs.2, rhs.1), (lhs.0, lhs.2, lhs.1))
    } else {
        ((m, n), (dst_cs, dst_rs), lhs, rhs)
    };
    // SAFETY: the caller's promise, for the same elements under either orientation.
    unsafe {
        gemm_f32::gemm::f32::get_gemm_fn()(
            m,
            n,
            k,
            dst,
            dst_cs,
            dst_rs,
            accumulate,
            lhs.0,
            lhs.1,
            lhs.2,
            rhs.0,
            rhs.1,
            rhs.2,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook triple loop, in f64.
    fn naive(a: &[f32], b: &[f32], s: MatMul) -> Vec<f32> {
        let mut out = vec![0f32; s.m * s.n];
        for i in 0..s.m {
            for j in 0..s.n {
                let mut acc = 0f64;
                for p in 0..s.k {
                    let x = if s.a_t { a[p * s.m + i] } else { a[i * s.k + p] };
                    let y = if s.b_t { b[j * s.k + p] } else { b[p * s.n + j] };
                    acc += x as f64 * y as f64;
                }
                out[i * s.n + j] = acc as f32;
            }
        }
        out
    }

    #[test]
    fn all_transposes_match_the_triple_loop() {
        // 70 rows: the transposed route; 300: the direct one. Odd sizes cross tile edges.
        for (m, n, k) in [(7, 5, 9), (70, 45, 33), (300, 37, 5)] {
            check(m, n, k);
        }
    }

    fn check(m: usize, n: usize, k: usize) {
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
            let s = MatMul { m, n, k, a_t, b_t, accumulate: false };
            let mut out = vec![1f32; m * n];
            matmul(&mut out, &a, &b, s, &mut Scratch::default());
            let want = naive(&a, &b, s);
            for (x, y) in out.iter().zip(&want) {
                assert!((x - y).abs() < 1e-5, "{a_t} {b_t}: {x} vs {y}");
            }
            let mut acc = want.clone();
            matmul(&mut acc, &a, &b, s.accumulating(), &mut Scratch::default());
            for (x, y) in acc.iter().zip(&want) {
                assert!((x - 2.0 * y).abs() < 1e-5);
            }
        }
    }
}
