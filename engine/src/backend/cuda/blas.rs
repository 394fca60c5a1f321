//! Dense matrix products through cuBLASLt: bf16 (or f32) operands, f32 accumulation, output in
//! bf16 or f32, with `beta = 1` when accumulating (the residual adds of the forward pass and the
//! gradient accumulation of the backward pass ride in the product's epilogue instead of costing
//! a pass of their own).
//!
//! cuBLASLt is column-major. A row-major `out[m, n] = op(a)[m, k] · op(b)[k, n]` is the
//! column-major `outᵀ[n, m] = op(b)ᵀ · op(a)ᵀ`, so the library's A is our `b` and its B our `a`,
//! each transposed when ours is not stored the way the product reads it.
//!
//! Descriptors and the heuristic's algorithm are built once per shape (dimensions, transposes,
//! types and the operands' alignment) and cached.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self as ltsys, cublasComputeType_t, cublasLtMatmulAlgo_t, cublasLtMatmulDescAttributes_t as DescAttr,
    cublasLtMatmulPreferenceAttributes_t as PrefAttr, cudaDataType,
};
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::DType;
use crate::backend::MatMul;

/// Workspace cuBLASLt may use per product (what NVIDIA recommends for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// One product in cuBLASLt's (column-major, BLAS) terms: `C[m, n] = op(A)[m, k] · op(B)[k, n]
/// + beta · C`, element `(i, j)` of a matrix at `i + j · ld`; `op(A)` is `Aᵀ` when `transa`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// A is stored `k × m` and used transposed (else stored `m × k`).
    pub transa: bool,
    /// B is stored `n × k` and used transposed (else stored `k × n`).
    pub transb: bool,
    /// A's address and leading dimension.
    pub a: CUdeviceptr,
    /// Leading dimension of A.
    pub lda: usize,
    /// B's address.
    pub b: CUdeviceptr,
    /// Leading dimension of B.
    pub ldb: usize,
    /// C's address (read when `beta` is not 0).
    pub c: CUdeviceptr,
    /// The output D's address (C's layout; may be C).
    pub d: CUdeviceptr,
    /// Leading dimension of C and D.
    pub ldc: usize,
    /// Type of A and B.
    pub inputs: DType,
    /// Type of C.
    pub output: DType,
    /// 0 overwrites C, 1 accumulates into it.
    pub beta: f32,
}

impl Gemm {
    /// The row-major `out[m, n] (+)= op(a)[m, k] · op(b)[k, n]` of [`MatMul`] as the column-major
    /// `outᵀ = op(b)ᵀ · op(a)ᵀ`: cuBLASLt's A is our `b`, its B our `a`, each used transposed
    /// exactly when ours is.
    pub fn row_major(
        s: MatMul,
        out: CUdeviceptr,
        a: CUdeviceptr,
        b: CUdeviceptr,
        inputs: DType,
        output: DType,
    ) -> Gemm {
        Gemm {
            m: s.n,
            n: s.m,
            k: s.k,
            transa: s.b_t,
            transb: s.a_t,
            a: b,
            lda: if s.b_t { s.k } else { s.n },
            b: a,
            ldb: if s.a_t { s.m } else { s.k },
            c: out,
            d: out,
            ldc: s.n,
            inputs,
            output,
            beta: if s.accumulate { 1.0 } else { 0.0 },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    m: usize,
    n: usize,
    k: usize,
    transa: bool,
    transb: bool,
    inputs: DType,
    output: DType,
    align: [u32; 3],
}

struct Plan {
    desc: ltsys::cublasLtMatmulDesc_t,
    layouts: [ltsys::cublasLtMatrixLayout_t; 3],
    algo: cublasLtMatmulAlgo_t,
}

/// A cuBLASLt handle, its workspace and the cached plans.
pub struct Blas {
    handle: ltsys::cublasLtHandle_t,
    workspace: CUdeviceptr,
    plans: HashMap<Key, Plan>,
}

fn data_type(t: DType) -> cudaDataType {
    match t {
        DType::Bf16 => cudaDataType::CUDA_R_16BF,
        DType::F32 => cudaDataType::CUDA_R_32F,
    }
}

/// Largest power of two (up to 256) dividing a device address: what the heuristic may assume.
fn alignment(ptr: CUdeviceptr) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

impl Blas {
    /// A handle using `workspace` (at least [`WORKSPACE_BYTES`] of device memory).
    pub fn new(workspace: CUdeviceptr) -> Result<Blas, String> {
        let handle = lt::create_handle().map_err(|e| format!("cuBLASLt does not start: {e}"))?;
        Ok(Blas { handle, workspace, plans: HashMap::new() })
    }

    /// Runs one product on `stream`.
    pub fn gemm(&mut self, stream: CUstream, g: &Gemm) -> Result<(), String> {
        let key = Key {
            m: g.m,
            n: g.n,
            k: g.k,
            transa: g.transa,
            transb: g.transb,
            inputs: g.inputs,
            output: g.output,
            align: [alignment(g.a), alignment(g.b), alignment(g.c).min(alignment(g.d))],
        };
        if !self.plans.contains_key(&key) {
            let plan = self.plan(key, g).map_err(|e| format!("cuBLASLt has no algorithm for {g:?} ({e})"))?;
            self.plans.insert(key, plan);
        }
        let plan = &self.plans[&key];
        let alpha = 1f32;
        let [la, lb, lc] = plan.layouts;
        // SAFETY: the plan's descriptors live in `self`; pointers are device addresses of the
        // sizes the layouts describe (the backend checks the views' lengths).
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&g.beta as *const f32).cast(),
                g.a as *const c_void,
                la,
                g.b as *const c_void,
                lb,
                g.c as *const c_void,
                lc,
                g.d as *mut c_void,
                lc,
                &plan.algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as ltsys::cudaStream_t,
            )
        }
        .map_err(|e| format!("cuBLASLt matmul {g:?}: {e}"))
    }

    fn plan(&self, key: Key, g: &Gemm) -> Result<Plan, lt::CublasError> {
        let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
        let (ab, cd) = (data_type(g.inputs), data_type(g.output));
        // Layouts describe the matrices as stored (before the transpose).
        let la = if g.transa {
            lt::create_matrix_layout(ab, k, m, g.lda as i64)?
        } else {
            lt::create_matrix_layout(ab, m, k, g.lda as i64)?
        };
        let lb = if g.transb {
            lt::create_matrix_layout(ab, n, k, g.ldb as i64)?
        } else {
            lt::create_matrix_layout(ab, k, n, g.ldb as i64)?
        };
        let lc = lt::create_matrix_layout(cd, m, n, g.ldc as i64)?;
        let desc = lt::create_matmul_desc(cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType::CUDA_R_32F)?;
        // cublasOperation_t (declared by cuBLAS, not cuBLASLt's bindings): N = 0, T = 1.
        let (ta, tb) = (g.transa as i32, g.transb as i32);
        let pref = lt::create_matmul_pref()?;
        // SAFETY: attributes written from values of the sizes the attributes take.
        let algo = unsafe {
            lt::set_matmul_desc_attribute(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSA, (&ta as *const i32).cast(), 4)?;
            lt::set_matmul_desc_attribute(desc, DescAttr::CUBLASLT_MATMUL_DESC_TRANSB, (&tb as *const i32).cast(), 4)?;
            let ws = WORKSPACE_BYTES as u64;
            lt::set_matmul_pref_attribute(
                pref,
                PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                8,
            )?;
            let [a_align, b_align, c_align] = key.align;
            for (attr, value) in [
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a_align),
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b_align),
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c_align),
                (PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c_align),
            ] {
                lt::set_matmul_pref_attribute(pref, attr, (&value as *const u32).cast(), 4)?;
            }
            let found = lt::get_matmul_algo_heuristic(self.handle, desc, la, lb, lc, lc, pref);
            let _ = lt::destroy_matmul_pref(pref);
            found?.algo
        };
        Ok(Plan { desc, layouts: [la, lb, lc], algo })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created by this handle's plans and is destroyed once.
        unsafe {
            for plan in self.plans.values() {
                let _ = lt::destroy_matmul_desc(plan.desc);
                for l in plan.layouts {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0042), 2);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
    }
}
