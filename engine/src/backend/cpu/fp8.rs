//! FP8 products on the CPU reference: operands rounded to E4M3/E5M2 with the same scales a GPU
//! uses ([`crate::backend::fp8`]), held as f32 values of the FP8 grid, multiplied in f32.
//!
//! `out (+)= (a_q · b_q) · (1/s_a) · (1/s_b)`: every product of two FP8 values is exact in f32
//! (4 significant bits each), so the product differs from a GPU's only by the order of the f32
//! sums, as the bf16 products do.

use super::matmul::{self, Scratch};
use crate::backend::MatMul;

/// `out (+)= op(a) · op(b) · factor`, `factor` being the product of the operands' inverse
/// scales; `tmp` holds the product when it accumulates.
pub fn matmul_scaled(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    shape: MatMul,
    factor: f32,
    tmp: &mut Vec<f32>,
    gemm: &mut Scratch,
) {
    if shape.accumulate {
        tmp.resize(out.len(), 0.0);
        matmul::matmul(tmp, a, b, MatMul { accumulate: false, ..shape }, gemm);
        for (o, &p) in out.iter_mut().zip(tmp.iter()) {
            *o += p * factor;
        }
    } else {
        matmul::matmul(out, a, b, shape, gemm);
        for o in out.iter_mut() {
            *o *= factor;
        }
    }
}
