//! Dense matrix products through cuBLASLt: bf16 (or f32) operands, f32 accumulation, output in
//! bf16 or f32, with `beta = 1` when accumulating (the residual adds of the forward pass and the
//! gradient accumulation of the backward pass ride in the product's epilogue instead of costing
//! a pass of their own).
//!
//! cuBLASLt is column-major. A row-major `out[m, n] = op(a)[m, k] · op(b)[k, n]` is the
//! column-major `outᵀ[n, m] = op(b)ᵀ · op(a)ᵀ`, so the library's A is our `b` and its B our `a`,
//! each transposed when ours is not stored the way the product reads it.
//!
//! Descriptors and the algorithm are built once per shape (dimensions, transposes, types and the
//! operands' alignment) and cached. The algorithm: the heuristic is asked for up to
//! [`CANDIDATES`] of them, and when it offers more than one, each is run once untimed (lazy
//! module loading, clocks) and once between two CUDA events, on the product that asked, and the
//! fastest is kept; that happens the first time a shape is seen, which is the first (eager) run
//! of a step, never inside a graph capture (a shape first seen there takes the heuristic's first
//! choice untimed). Timing must not change what the product computes: see [`trial`].
//! `ENGINE_BLAS_LOG=1` prints one line per shape with the times.

use std::collections::HashMap;
use std::ffi::c_void;

use anyhow::{Context, Result, anyhow};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self as ltsys, cublasComputeType_t, cublasLtMatmulAlgo_t, cublasLtMatmulDescAttributes_t as DescAttr,
    cublasLtMatmulPreferenceAttributes_t as PrefAttr, cudaDataType,
};
use cudarc::driver::result as driver;
use cudarc::driver::sys::{self as dsys, CUdeviceptr, CUstream};

use super::DType;
use crate::backend::MatMul;
use crate::backend::fp8::Fp8Format;

/// Workspace cuBLASLt may use per product (what NVIDIA recommends for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Algorithms asked of the heuristic per shape, timed when there is more than one.
pub const CANDIDATES: usize = 8;

/// Largest output that an accumulating in-place product may copy for its trials (see [`trial`]).
pub const TRIAL_SCRATCH_MAX: usize = 256 << 20;

/// Where the candidates of a new plan run when they are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trial {
    /// On the product's own buffers: every trial writes D from A, B and C alone, so the run
    /// that follows writes what it would have written without them.
    InPlace,
    /// On a scratch output of this many bytes (C = D, accumulating: a trial in place would add
    /// the product into D once more each time).
    Scratch(usize),
    /// Not timed: the heuristic's first candidate, for the reason given.
    Untimed(&'static str),
}

/// How the candidates of a new plan for `g` are timed: not at all with a single candidate or
/// inside a graph capture (the capture would record the trials and the host cannot wait for
/// them); in place when D does not feed the product (`beta = 0`, or C a buffer of its own);
/// on scratch when the product accumulates into D (`C = D`, `beta ≠ 0`) and D is at most
/// [`TRIAL_SCRATCH_MAX`] bytes; otherwise not.
pub fn trial(g: &Gemm, candidates: usize, capturing: bool) -> Trial {
    if candidates <= 1 {
        Trial::Untimed("the heuristic offers one algorithm")
    } else if capturing {
        Trial::Untimed("first seen inside a graph capture")
    } else if g.beta == 0.0 || g.c != g.d {
        Trial::InPlace
    } else {
        let bytes = g.ldc * g.n * g.output.size();
        if bytes <= TRIAL_SCRATCH_MAX { Trial::Scratch(bytes) } else { Trial::Untimed("output too large to copy") }
    }
}

/// The candidate to keep from the trials' times in milliseconds (`None`: the candidate failed
/// to run): the fastest, the earlier in the heuristic's order on a tie; `None` when every one
/// failed.
pub fn fastest(times: &[Option<f32>]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, t) in times.iter().enumerate() {
        if let Some(t) = *t
            && t.is_finite()
            && best.is_none_or(|(_, b)| t < b)
        {
            best = Some((i, t));
        }
    }
    best.map(|(i, _)| i)
}

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
    /// For an FP8 product (`inputs` [`DType::Fp8`]): the operands' formats and scales.
    pub fp8: Option<Fp8Gemm>,
}

/// What an FP8 product adds to [`Gemm`]: `D = (a_scale · b_scale) · op(A) · op(B) + beta · C`,
/// the scales read from device memory when the product runs (cuBLASLt's scale pointers).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Gemm {
    /// A's format.
    pub a: Fp8Format,
    /// B's format.
    pub b: Fp8Format,
    /// Address of the f32 A is multiplied by (its inverse scale).
    pub a_scale: CUdeviceptr,
    /// Address of B's.
    pub b_scale: CUdeviceptr,
    /// cuBLASLt's fast accumulation (fewer promotions of the tensor cores' partial sums to
    /// f32): the forward products only.
    pub fast_accum: bool,
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
            fp8: None,
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
    /// An FP8 product's formats and fast accumulation (its scale pointers are set at each run).
    fp8: Option<(Fp8Format, Fp8Format, bool)>,
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
    /// Set while the stream is being captured into a graph: no trials then.
    pub capturing: bool,
    log: bool,
}

fn data_type(t: DType) -> cudaDataType {
    match t {
        DType::Bf16 => cudaDataType::CUDA_R_16BF,
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::Fp8 => unreachable!("internal error: an FP8 operand's type is its format's"),
    }
}

fn fp8_type(f: Fp8Format) -> cudaDataType {
    match f {
        Fp8Format::E4M3 => cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => cudaDataType::CUDA_R_8F_E5M2,
    }
}

/// `m×n×k`, the transposes and the types of a product, for the log.
fn describe(g: &Gemm) -> String {
    let t = |x: bool| if x { "T" } else { "N" };
    format!("{}x{}x{} {}{} {:?}->{:?} beta {}", g.m, g.n, g.k, t(g.transa), t(g.transb), g.inputs, g.output, g.beta)
}

/// Sets an FP8 product's A and B scale pointers on its descriptor.
fn set_scale_pointers(desc: ltsys::cublasLtMatmulDesc_t, f: &Fp8Gemm) -> Result<(), lt::CublasError> {
    let pointers = [
        (DescAttr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, f.a_scale),
        (DescAttr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, f.b_scale),
    ];
    for (attr, ptr) in pointers {
        // SAFETY: the attribute takes a device pointer, 8 bytes, read from a live local.
        unsafe { lt::set_matmul_desc_attribute(desc, attr, (&ptr as *const u64).cast(), 8) }?;
    }
    Ok(())
}

/// Largest power of two (up to 256) dividing a device address: what the heuristic may assume.
fn alignment(ptr: CUdeviceptr) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

impl Blas {
    /// A handle using `workspace` (at least [`WORKSPACE_BYTES`] of device memory).
    pub fn new(workspace: CUdeviceptr) -> Result<Blas> {
        let handle = lt::create_handle().map_err(|e| anyhow!("cuBLASLt does not start: {e}"))?;
        let log = std::env::var("ENGINE_BLAS_LOG").is_ok_and(|v| v == "1");
        Ok(Blas { handle, workspace, plans: HashMap::new(), capturing: false, log })
    }

    /// Runs one product on `stream`.
    pub fn gemm(&mut self, stream: CUstream, g: &Gemm) -> Result<()> {
        let key = Key {
            m: g.m,
            n: g.n,
            k: g.k,
            transa: g.transa,
            transb: g.transb,
            inputs: g.inputs,
            output: g.output,
            align: [alignment(g.a), alignment(g.b), alignment(g.c).min(alignment(g.d))],
            fp8: g.fp8.map(|f| (f.a, f.b, f.fast_accum)),
        };
        if !self.plans.contains_key(&key) {
            let (desc, layouts, algos) =
                self.plan(key, g).map_err(|e| anyhow!("cuBLASLt has no algorithm for {g:?} ({e})"))?;
            let mut plan = Plan { desc, layouts, algo: algos[0] };
            let how = trial(g, algos.len(), self.capturing);
            let chosen = self.choose(stream, g, &plan, &algos, how)?;
            plan.algo = algos[chosen];
            self.plans.insert(key, plan);
        }
        let plan = &self.plans[&key];
        // SAFETY: the plan's descriptors live in `self`; pointers are device addresses of the
        // sizes the layouts describe (the backend checks the views' lengths).
        unsafe { self.run(stream, g, plan, &plan.algo) }.with_context(|| format!("cuBLASLt matmul {g:?}"))
    }

    /// Issues `g` with `algo` on `stream`.
    ///
    /// # Safety
    /// `plan` was built for `g`'s key and `g`'s addresses hold what its layouts describe.
    unsafe fn run(&self, stream: CUstream, g: &Gemm, plan: &Plan, algo: &cublasLtMatmulAlgo_t) -> Result<()> {
        let alpha = 1f32;
        let [la, lb, lc] = plan.layouts;
        if let Some(f) = g.fp8 {
            // The scales' addresses differ from product to product of one shape (each layer's
            // operands have their own): set on the shared descriptor before each run.
            set_scale_pointers(plan.desc, &f)?;
        }
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
                algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as ltsys::cudaStream_t,
            )
        }
        .map_err(anyhow::Error::from)
    }

    /// The index in `algos` to keep for `g`: the fastest of one timed run each (after one
    /// untimed run each), or the heuristic's first when `how` says not to time. The host waits
    /// for the trials; a candidate that fails to run is left out.
    fn choose(
        &self,
        stream: CUstream,
        g: &Gemm,
        plan: &Plan,
        algos: &[cublasLtMatmulAlgo_t],
        how: Trial,
    ) -> Result<usize> {
        let target = match how {
            Trial::Untimed(why) => {
                if self.log {
                    crate::say!("cuBLASLt {}: the heuristic's first of {} ({why})", describe(g), algos.len());
                }
                return Ok(0);
            }
            Trial::InPlace => *g,
            Trial::Scratch(bytes) => {
                // SAFETY: plain allocation; freed below once the trials are done.
                let Ok(buf) = (unsafe { driver::malloc_sync(bytes) }) else {
                    if self.log {
                        crate::say!("cuBLASLt {}: the heuristic's first (no memory for trials)", describe(g));
                    }
                    return Ok(0);
                };
                // SAFETY: `buf` holds `bytes`, a multiple of 4; zeroed on the stream the trials use.
                let _ = unsafe { dsys::cuMemsetD32Async(buf, 0, bytes / 4, stream) }.result();
                Gemm { c: buf, d: buf, ..*g }
            }
        };
        let times = self.time(stream, &target, plan, algos);
        if let Trial::Scratch(_) = how {
            // SAFETY: allocated above; `time` waited for the trials (or the stream is idle).
            let _ = unsafe { driver::stream::synchronize(stream) };
            let _ = unsafe { driver::free_sync(target.d) };
        }
        let chosen = fastest(&times).ok_or_else(|| anyhow!("cuBLASLt: no candidate algorithm runs {g:?}"))?;
        if self.log {
            let ms: Vec<String> =
                times.iter().map(|t| t.map_or("failed".to_string(), |t| format!("{:.3}", t))).collect();
            crate::say!("cuBLASLt {}: candidate {chosen} of {} (ms: {})", describe(g), algos.len(), ms.join(" "));
        }
        Ok(chosen)
    }

    /// Milliseconds of one run of `g` with each of `algos` (after an untimed run of each),
    /// `None` for one that failed to run.
    fn time(&self, stream: CUstream, g: &Gemm, plan: &Plan, algos: &[cublasLtMatmulAlgo_t]) -> Vec<Option<f32>> {
        let flags = dsys::CUevent_flags::CU_EVENT_DEFAULT;
        let (Ok(start), Ok(end)) = (driver::event::create(flags), driver::event::create(flags)) else {
            return algos.iter().enumerate().map(|(i, _)| (i == 0).then_some(0.0)).collect();
        };
        let times = algos
            .iter()
            .map(|algo| {
                // SAFETY: as in `gemm`; the events belong to this context and are waited for.
                unsafe {
                    self.run(stream, g, plan, algo).ok()?;
                    driver::event::record(start, stream).ok()?;
                    self.run(stream, g, plan, algo).ok()?;
                    driver::event::record(end, stream).ok()?;
                    driver::event::synchronize(end).ok()?;
                    driver::event::elapsed(start, end).ok()
                }
            })
            .collect();
        // SAFETY: created above, waited for.
        unsafe {
            let _ = driver::event::destroy(start);
            let _ = driver::event::destroy(end);
        }
        times
    }

    /// The descriptors and layouts of `g` and up to [`CANDIDATES`] algorithms, the heuristic's
    /// best first.
    fn plan(
        &self,
        key: Key,
        g: &Gemm,
    ) -> Result<
        (ltsys::cublasLtMatmulDesc_t, [ltsys::cublasLtMatrixLayout_t; 3], Vec<cublasLtMatmulAlgo_t>),
        lt::CublasError,
    > {
        let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
        let ((ta_, tb_), cd) = match g.fp8 {
            Some(f) => ((fp8_type(f.a), fp8_type(f.b)), data_type(g.output)),
            None => ((data_type(g.inputs), data_type(g.inputs)), data_type(g.output)),
        };
        // Layouts describe the matrices as stored (before the transpose).
        let la = if g.transa {
            lt::create_matrix_layout(ta_, k, m, g.lda as i64)?
        } else {
            lt::create_matrix_layout(ta_, m, k, g.lda as i64)?
        };
        let lb = if g.transb {
            lt::create_matrix_layout(tb_, n, k, g.ldb as i64)?
        } else {
            lt::create_matrix_layout(tb_, k, n, g.ldb as i64)?
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
            if let Some(f) = g.fp8 {
                let fast = f.fast_accum as i8;
                let attr = DescAttr::CUBLASLT_MATMUL_DESC_FAST_ACCUM;
                lt::set_matmul_desc_attribute(desc, attr, (&fast as *const i8).cast(), 1)?;
                // The heuristic is asked with the scales set (to any device address: they are
                // read when the product runs).
                set_scale_pointers(desc, &f)?;
            }
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
            let mut found: [ltsys::cublasLtMatmulHeuristicResult_t; CANDIDATES] = std::mem::zeroed();
            let mut count = 0i32;
            let status = ltsys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                desc,
                la,
                lb,
                lc,
                lc,
                pref,
                CANDIDATES as i32,
                found.as_mut_ptr(),
                &mut count,
            );
            let _ = lt::destroy_matmul_pref(pref);
            status.result()?;
            let usable = found[..count.clamp(0, CANDIDATES as i32) as usize]
                .iter()
                .filter(|r| r.state == ltsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|r| r.algo);
            usable.collect::<Vec<_>>()
        };
        if algo.is_empty() {
            return Err(lt::CublasError(ltsys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED));
        }
        Ok((desc, [la, lb, lc], algo))
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

    fn product(beta: f32, c: CUdeviceptr, d: CUdeviceptr, output: DType) -> Gemm {
        let (a, b) = (0x1000, 0x2000);
        let (m, n, k) = (64, 32, 16);
        let (inputs, transa, transb) = (DType::Bf16, false, false);
        Gemm { m, n, k, transa, transb, a, lda: m, b, ldb: k, c, d, ldc: m, inputs, output, beta, fp8: None }
    }

    #[test]
    fn trials_never_change_what_the_product_computes() {
        let (buf, other) = (0x10_0000, 0x20_0000);
        // Overwriting D, or D = A·B + C with C elsewhere: every trial writes the same D.
        assert_eq!(trial(&product(0.0, buf, buf, DType::Bf16), 8, false), Trial::InPlace);
        assert_eq!(trial(&product(1.0, other, buf, DType::Bf16), 8, false), Trial::InPlace);
        // Accumulating into D: on a scratch copy of D's size (ldc · n elements).
        assert_eq!(trial(&product(1.0, buf, buf, DType::F32), 8, false), Trial::Scratch(64 * 32 * 4));
        let mut huge = product(1.0, buf, buf, DType::F32);
        (huge.m, huge.ldc, huge.n) = (128256, 128256, 2048);
        assert!(matches!(trial(&huge, 8, false), Trial::Untimed(_)), "1 GB of f32 gradient is not copied");
        // One candidate, or a capture in progress: nothing to time, or no timing allowed.
        assert!(matches!(trial(&product(0.0, buf, buf, DType::Bf16), 1, false), Trial::Untimed(_)));
        assert!(matches!(trial(&product(0.0, buf, buf, DType::Bf16), 8, true), Trial::Untimed(_)));
    }

    #[test]
    fn the_fastest_candidate_that_ran_is_kept() {
        assert_eq!(fastest(&[Some(1.0), Some(0.5), Some(0.7)]), Some(1));
        // Ties go to the heuristic's earlier choice.
        assert_eq!(fastest(&[Some(0.5), Some(0.5)]), Some(0));
        // A candidate that failed (or timed as NaN) is never chosen.
        assert_eq!(fastest(&[None, Some(2.0), Some(f32::NAN)]), Some(1));
        assert_eq!(fastest(&[None, None]), None);
        assert_eq!(fastest(&[]), None);
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0042), 2);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
    }
}
