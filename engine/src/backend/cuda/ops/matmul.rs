//! Dense matrix products: no kernel of ours, cuBLASLt through [`Gemm`] (see `blas.rs`), with
//! the residual add of `matmul_add` in the product's epilogue.

use crate::backend::cuda::blas::Gemm;
use crate::backend::cuda::{Cuda, DType};
use crate::backend::{MatMul, View};

/// `Backend::matmul`: one cuBLASLt product (with `k = 0` only the zeroing it implies).
pub(crate) fn matmul(gpu: &mut Cuda, out: View, a: View, b: View, s: MatMul) {
    assert_eq!(a.len, s.m * s.k, "internal error: matmul: a is not {}x{}", s.m, s.k);
    assert_eq!(b.len, s.k * s.n, "internal error: matmul: b is not {}x{}", s.k, s.n);
    assert_eq!(out.len, s.m * s.n, "internal error: matmul: out is not {}x{}", s.m, s.n);
    let inputs = gpu.dtype(a);
    gpu.expect(b, inputs, "matmul", "b (the same type as a)");
    let (o, ot) = (gpu.out(out, "matmul"), gpu.dtype(out));
    assert!(inputs == DType::Bf16 || ot == DType::F32, "internal error: matmul of f32 operands into bf16");
    if s.k == 0 {
        if !s.accumulate {
            super::elementwise::fill(gpu, out, 0.0);
        }
        return;
    }
    let (ap, bp) = (gpu.ptr(a), gpu.ptr(b));
    gpu.dev.gemm(&Gemm::row_major(s, o, ap, bp, inputs, ot));
}

/// `Backend::matmul_add`: one cuBLASLt product with `c` as the epilogue's addend.
pub(crate) fn matmul_add(gpu: &mut Cuda, out: View, a: View, b: View, c: View, s: MatMul) {
    assert_eq!(c.len, out.len, "internal error: matmul_add: c and out differ in length");
    assert_eq!(gpu.dtype(c), gpu.dtype(out), "internal error: matmul_add: c and out differ in type");
    assert!(!c.overlaps(out) || c == out, "internal error: matmul_add: c overlaps out");
    assert_eq!(a.len, s.m * s.k, "internal error: matmul_add: a is not {}x{}", s.m, s.k);
    assert_eq!(b.len, s.k * s.n, "internal error: matmul_add: b is not {}x{}", s.k, s.n);
    let inputs = gpu.dtype(a);
    gpu.expect(b, inputs, "matmul_add", "b (the same type as a)");
    let (o, cp) = (gpu.out(out, "matmul_add"), gpu.ptr(c));
    let (ap, bp) = (gpu.ptr(a), gpu.ptr(b));
    let mut g = Gemm::row_major(s.accumulating(), o, ap, bp, inputs, gpu.dtype(out));
    g.c = cp;
    gpu.dev.gemm(&g);
}
