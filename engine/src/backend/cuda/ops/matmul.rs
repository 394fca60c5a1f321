//! Dense matrix products: no kernel of ours, cuBLASLt through [`Gemm`] (see `blas.rs`), with
//! the residual add of `matmul_add` in the product's epilogue.

use crate::backend::cuda::blas::{Fp8Gemm, Gemm};
use crate::backend::cuda::{Cuda, DType};
use crate::backend::fp8::State;
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
    gpu.gemm(&Gemm::row_major(s, o, ap, bp, inputs, ot));
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
    gpu.gemm(&g);
}

/// `Backend::matmul_fp8` (and, with `c`, `matmul_fp8_add`): one cuBLASLt FP8 product, `a · bᵀ`
/// (in cuBLASLt's column-major terms `TN`, the one layout its FP8 kernels take on Hopper), each
/// operand's inverse scale read by the epilogue through a scale pointer, `c` added there; bf16
/// or f32 output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_fp8(
    gpu: &mut Cuda,
    out: View,
    a: View,
    b: View,
    c: Option<View>,
    s: MatMul,
    scales: [State; 2],
    fast: bool,
) {
    assert!(!s.a_t && s.b_t, "internal error: matmul_fp8 takes a · bᵀ only");
    assert_eq!(a.len, s.m * s.k, "internal error: matmul_fp8: a is not {}x{}", s.m, s.k);
    assert_eq!(b.len, s.k * s.n, "internal error: matmul_fp8: b is not {}x{}", s.n, s.k);
    assert_eq!(out.len, s.m * s.n, "internal error: matmul_fp8: out is not {}x{}", s.m, s.n);
    gpu.expect(a, DType::Fp8, "matmul_fp8", "a");
    gpu.expect(b, DType::Fp8, "matmul_fp8", "b");
    let (o, ot) = (gpu.out(out, "matmul_fp8"), gpu.dtype(out));
    let (ap, bp) = (gpu.ptr(a), gpu.ptr(b));
    let [sa, sb] = scales.map(|st| gpu.ptr(st.inv_scale()));
    let s = if c.is_some() { s.accumulating() } else { s };
    let mut g = Gemm::row_major(s, o, ap, bp, DType::Fp8, ot);
    if let Some(c) = c {
        assert_eq!(c.len, out.len, "internal error: matmul_fp8_add: c and out differ in length");
        assert_eq!(gpu.dtype(c), ot, "internal error: matmul_fp8_add: c and out differ in type");
        assert!(!c.overlaps(out) || c == out, "internal error: matmul_fp8_add: c overlaps out");
        g.c = gpu.ptr(c);
    }
    // cuBLASLt's A is our b, its B our a.
    g.fp8 = Some(Fp8Gemm { a: scales[1].format, b: scales[0].format, a_scale: sb, b_scale: sa, fast_accum: fast });
    gpu.gemm(&g);
}
