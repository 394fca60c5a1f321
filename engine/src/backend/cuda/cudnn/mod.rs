//! cuDNN's fused flash attention (`train.attention = "cudnn"`), loaded at run time as cuBLASLt
//! is: cudarc opens `libcudnn.so` through the dynamic loader's search path when first used.
//!
//! Measured on an H200 (docs/PERF.md, 2026-11-26), cuDNN's Hopper kernels run causal attention
//! at 409/346 TFLOP/s forward/backward where the engine's `mma.sync` kernels reach 225/156: that
//! measurement is why the engine carries this path. It is a graph of cuDNN's backend API, not
//! code of ours: [`graph`] describes the operations as plain values, [`Cudnn::run`] lowers them
//! to descriptors once per shape (heuristics, then the first engine configuration whose
//! execution plan finalizes) and executes the plan on the backend's stream, inside the step's
//! CUDA graph like every other kernel.

pub(crate) mod graph;

use std::collections::HashMap;
use std::ffi::{CStr, c_void};

use anyhow::{Context, Result, anyhow, bail};
use cudarc::cudnn::sys;
use cudarc::driver::result;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::{Cuda, Scratch};
use crate::backend::cpu::Cpu;
use crate::backend::{AttnShape, Backend, BufKind, View};
use graph::{DType, Graph, Kind, Op, Pass, Pw, Red, Role};

/// Oldest cuDNN accepted: 9.2, the first whose fused attention takes the sliding window, and
/// any sequence length.
pub const MIN_VERSION: usize = 90200;

/// Device memory a call binds, by role (Kᵀ and Vᵀ are the same bytes as K and V).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Bindings {
    pub q: CUdeviceptr,
    pub k: CUdeviceptr,
    pub v: CUdeviceptr,
    pub o: CUdeviceptr,
    pub stats: CUdeviceptr,
    pub d_o: CUdeviceptr,
    pub dq: CUdeviceptr,
    pub dk: CUdeviceptr,
    pub dv: CUdeviceptr,
    /// f32 `[batch, heads, seq, head_dim]`, zeroed by the caller before a backward pass.
    pub dq_accum: CUdeviceptr,
}

impl Bindings {
    fn pointer(&self, role: Role) -> CUdeviceptr {
        match role {
            Role::Q => self.q,
            Role::Kt => self.k,
            Role::V | Role::Vt => self.v,
            Role::O => self.o,
            Role::Stats => self.stats,
            Role::DO => self.d_o,
            Role::DQ => self.dq,
            Role::DK => self.dk,
            Role::DV => self.dv,
            Role::DQAccum => self.dq_accum,
            Role::Scalar(_) => unreachable!("scalars are passed by value"),
        }
    }
}

/// The cuDNN version of the library found, e.g. 91400 for 9.14.0, or why there is none.
pub fn version() -> Result<usize> {
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        bail!("cuDNN (libcudnn.so.9) was not found on the library path");
    }
    // SAFETY: a plain query of the loaded library.
    let v = unsafe { sys::cudnnGetVersion() };
    if v < MIN_VERSION {
        bail!("cuDNN {} is older than {} (the oldest whose fused attention is used)", dotted(v), dotted(MIN_VERSION));
    }
    Ok(v)
}

/// 91400 as "9.14.0".
pub fn dotted(v: usize) -> String {
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// A shape, as the plans are keyed: batch, seq, heads, kv heads, head width, window, the
/// softmax scale's bits.
type Key = [usize; 7];

fn key(s: AttnShape) -> Key {
    [s.batch, s.seq, s.n_heads, s.n_kv_heads, s.head_dim, s.window, s.softmax_scale().to_bits() as usize]
}

/// A cuDNN handle on the backend's stream, its execution plans by shape, and one workspace.
pub struct Cudnn {
    handle: sys::cudnnHandle_t,
    version: usize,
    plans: HashMap<(Pass, Key), Plan>,
    workspace: (CUdeviceptr, usize),
}

impl Cudnn {
    /// Opens cuDNN on `stream` (of the current CUDA context).
    pub fn new(stream: CUstream) -> Result<Cudnn> {
        let version = version()?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: the library is present (checked above); the handle is destroyed in Drop.
        check(unsafe { sys::cudnnCreate(&mut handle) }, "cudnnCreate")?;
        // SAFETY: a handle just created; the stream outlives the backend that owns both.
        check(unsafe { sys::cudnnSetStream(handle, stream.cast()) }, "cudnnSetStream")?;
        Ok(Cudnn { handle, version, plans: HashMap::new(), workspace: (0, 0) })
    }

    /// The library's version, e.g. 91400.
    pub fn version(&self) -> usize {
        self.version
    }

    /// Builds the plans of both passes for shape `s`, unless built: the first time a shape is
    /// seen, outside any CUDA graph capture (the first step runs eagerly).
    pub(crate) fn prepare(&mut self, s: AttnShape) -> Result<()> {
        for pass in [Pass::Forward, Pass::Backward] {
            self.plan(pass, s)?;
        }
        Ok(())
    }

    fn plan(&mut self, pass: Pass, s: AttnShape) -> Result<()> {
        if !self.plans.contains_key(&(pass, key(s))) {
            let plan = Plan::build(self.handle, graph::graph(pass, s))
                .with_context(|| format!("cuDNN {} {pass:?} attention plan for {s:?}", dotted(self.version)))?;
            if plan.workspace > self.workspace.1 {
                if self.workspace.0 != 0 {
                    // SAFETY: nothing is pending on the old workspace: plans are built eagerly,
                    // and the stream is synchronised first.
                    result::ctx::synchronize()?;
                    unsafe { result::free_sync(self.workspace.0) }?;
                }
                // SAFETY: a plain device allocation.
                let ptr = unsafe { result::malloc_sync(plan.workspace) }
                    .map_err(|e| anyhow!("cannot allocate cuDNN's workspace of {} bytes: {e}", plan.workspace))?;
                self.workspace = (ptr, plan.workspace);
            }
            self.plans.insert((pass, key(s)), plan);
        }
        Ok(())
    }

    /// Runs `pass` of attention of shape `s` on `b` (building its plan if needed).
    pub(crate) fn run(&mut self, pass: Pass, s: AttnShape, b: &Bindings) -> Result<()> {
        self.plan(pass, s)?;
        self.plans[&(pass, key(s))].execute(self.handle, b, self.workspace.0)
    }
}

impl Drop for Cudnn {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: the handle and workspace were created by this value and are not used again.
        unsafe {
            if self.workspace.0 != 0 {
                let _ = result::free_sync(self.workspace.0);
            }
            sys::cudnnDestroy(self.handle);
        }
    }
}

/// A backend descriptor, destroyed with its owner.
struct Descriptor(sys::cudnnBackendDescriptor_t);

impl Descriptor {
    fn new(kind: sys::cudnnBackendDescriptorType_t) -> Result<Descriptor> {
        let mut d = std::ptr::null_mut();
        // SAFETY: creates a descriptor; ownership moves into the returned value.
        check(unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut d) }, &format!("create {kind:?}"))?;
        Ok(Descriptor(d))
    }

    fn set<T>(
        &self,
        name: sys::cudnnBackendAttributeName_t,
        ty: sys::cudnnBackendAttributeType_t,
        v: &[T],
    ) -> Result<()> {
        // SAFETY: `v` holds `v.len()` elements of the type `ty` names (the callers pair them).
        check(
            unsafe { sys::cudnnBackendSetAttribute(self.0, name, ty, v.len() as i64, v.as_ptr().cast()) },
            &format!("set {name:?}"),
        )
    }

    fn set_desc(&self, name: sys::cudnnBackendAttributeName_t, d: &Descriptor) -> Result<()> {
        self.set(name, sys::cudnnBackendAttributeType_t::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[d.0])
    }

    /// Reads up to `out.len()` elements of attribute `name` (with `out` empty, only asks how
    /// many there are); returns how many there are.
    fn get<V>(
        &self,
        name: sys::cudnnBackendAttributeName_t,
        ty: sys::cudnnBackendAttributeType_t,
        out: &mut [V],
        what: &str,
    ) -> Result<i64> {
        let mut n = 0i64;
        let ptr = if out.is_empty() { std::ptr::null_mut() } else { out.as_mut_ptr().cast() };
        // SAFETY: `out` has room for the `out.len()` elements of the type `ty` names (the callers
        // pair them); a null array with a count of 0 asks for the count alone.
        check(unsafe { sys::cudnnBackendGetAttribute(self.0, name, ty, out.len() as i64, &mut n, ptr) }, what)?;
        Ok(n)
    }

    fn finalize(&self, what: &str) -> Result<()> {
        // SAFETY: a descriptor whose attributes were set.
        check(unsafe { sys::cudnnBackendFinalize(self.0) }, &format!("finalize {what}"))
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once.
        unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

/// A status as a message: cuDNN's name for it and its last error's text.
fn check(status: sys::cudnnStatus_t, what: &str) -> Result<()> {
    if status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let mut text = vec![0 as std::ffi::c_char; 1024];
    // SAFETY: a buffer of the size given; cuDNN writes a NUL-terminated string.
    let last = unsafe {
        sys::cudnnGetLastErrorString(text.as_mut_ptr(), text.len());
        CStr::from_ptr(text.as_ptr()).to_string_lossy().into_owned()
    };
    let last = if last.is_empty() { String::new() } else { format!(": {last}") };
    bail!("{what}: {status:?}{last}")
}

use sys::cudnnBackendAttributeName_t as A;
use sys::cudnnBackendAttributeType_t as T;
use sys::cudnnBackendDescriptorType_t as D;

fn data_type(t: DType) -> sys::cudnnDataType_t {
    match t {
        DType::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::Bf16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
        DType::I32 => sys::cudnnDataType_t::CUDNN_DATA_INT32,
        DType::Bool => sys::cudnnDataType_t::CUDNN_DATA_BOOLEAN,
    }
}

fn pointwise_mode(m: Pw) -> sys::cudnnPointwiseMode_t {
    use sys::cudnnPointwiseMode_t as M;
    match m {
        Pw::Add => M::CUDNN_POINTWISE_ADD,
        Pw::Sub => M::CUDNN_POINTWISE_SUB,
        Pw::Mul => M::CUDNN_POINTWISE_MUL,
        Pw::Div => M::CUDNN_POINTWISE_DIV,
        Pw::Exp => M::CUDNN_POINTWISE_EXP,
        Pw::Log => M::CUDNN_POINTWISE_LOG,
        Pw::CmpGe => M::CUDNN_POINTWISE_CMP_GE,
        Pw::CmpGt => M::CUDNN_POINTWISE_CMP_GT,
        Pw::GenIndex => M::CUDNN_POINTWISE_GEN_INDEX,
        Pw::BinarySelect => M::CUDNN_POINTWISE_BINARY_SELECT,
        Pw::Identity => M::CUDNN_POINTWISE_IDENTITY,
    }
}

/// An execution plan and what its variant pack binds.
struct Plan {
    plan: Descriptor,
    workspace: usize,
    /// (uid, role) of every bound tensor.
    bound: Vec<(i64, Role)>,
    /// The by-value scalars, at stable addresses the variant pack points to.
    scalars: Box<[f32]>,
    /// The descriptors the plan was built from (kept alive with it).
    _graph: Vec<Descriptor>,
}

impl Plan {
    fn build(handle: sys::cudnnHandle_t, g: Graph) -> Result<Plan> {
        let mut keep = Vec::new();
        let mut tensors = Vec::new();
        for t in &g.tensors {
            let d = Descriptor::new(D::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
            d.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, T::CUDNN_TYPE_DATA_TYPE, &[data_type(t.dtype)])?;
            d.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, T::CUDNN_TYPE_INT64, &t.dims)?;
            d.set(A::CUDNN_ATTR_TENSOR_STRIDES, T::CUDNN_TYPE_INT64, &t.strides)?;
            d.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, T::CUDNN_TYPE_INT64, &[t.uid])?;
            d.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, T::CUDNN_TYPE_INT64, &[16i64])?;
            match t.kind {
                Kind::Virtual => d.set(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, T::CUDNN_TYPE_BOOLEAN, &[true])?,
                Kind::Bound(Role::Scalar(_)) => {
                    d.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, T::CUDNN_TYPE_BOOLEAN, &[true])?
                }
                Kind::Bound(_) => {}
            }
            if t.reorder_f16x16 {
                d.set(
                    A::CUDNN_ATTR_TENSOR_REORDERING_MODE,
                    T::CUDNN_TYPE_TENSOR_REORDERING_MODE,
                    &[sys::cudnnBackendTensorReordering_t::CUDNN_TENSOR_REORDERING_F16x16],
                )?;
            }
            d.finalize(&format!("tensor {}", t.uid))?;
            tensors.push(d);
        }
        let mut ops = Vec::new();
        for (i, op) in g.ops.iter().enumerate() {
            let what = format!("operation {} ({op:?})", i + 1);
            let o = match *op {
                Op::Matmul { a, b, c } => {
                    let m = Descriptor::new(D::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
                    m.set(A::CUDNN_ATTR_MATMUL_COMP_TYPE, T::CUDNN_TYPE_DATA_TYPE, &[data_type(DType::F32)])?;
                    m.finalize(&what)?;
                    let o = Descriptor::new(D::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &tensors[a])?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &tensors[b])?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &tensors[c])?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &m)?;
                    keep.push(m);
                    o
                }
                Op::Pointwise { mode, math, axis, x, b, t, y } => {
                    let p = Descriptor::new(D::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
                    p.set(A::CUDNN_ATTR_POINTWISE_MODE, T::CUDNN_TYPE_POINTWISE_MODE, &[pointwise_mode(mode)])?;
                    p.set(A::CUDNN_ATTR_POINTWISE_MATH_PREC, T::CUDNN_TYPE_DATA_TYPE, &[data_type(math)])?;
                    if let Some(axis) = axis {
                        p.set(A::CUDNN_ATTR_POINTWISE_AXIS, T::CUDNN_TYPE_INT64, &[axis])?;
                    }
                    p.finalize(&what)?;
                    let o = Descriptor::new(D::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &p)?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &tensors[x])?;
                    if let Some(b) = b {
                        o.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &tensors[b])?;
                    }
                    if let Some(t) = t {
                        o.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &tensors[t])?;
                    }
                    o.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &tensors[y])?;
                    keep.push(p);
                    o
                }
                Op::Reduction { op, x, y } => {
                    let r = Descriptor::new(D::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
                    let operator = match op {
                        Red::Add => sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
                        Red::Max => sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX,
                    };
                    r.set(A::CUDNN_ATTR_REDUCTION_OPERATOR, T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &[operator])?;
                    r.set(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, T::CUDNN_TYPE_DATA_TYPE, &[data_type(DType::F32)])?;
                    r.finalize(&what)?;
                    let o = Descriptor::new(D::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &tensors[x])?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &tensors[y])?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &r)?;
                    keep.push(r);
                    o
                }
                Op::Reshape { x, y } => {
                    let o = Descriptor::new(D::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &tensors[x])?;
                    o.set_desc(A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &tensors[y])?;
                    o
                }
            };
            o.finalize(&what)?;
            ops.push(o);
        }
        let graph = Descriptor::new(D::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, T::CUDNN_TYPE_HANDLE, &[handle])?;
        let raw: Vec<sys::cudnnBackendDescriptor_t> = ops.iter().map(|o| o.0).collect();
        graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)?;
        graph.finalize("the operation graph")?;
        let (plan, workspace) = choose_plan(handle, &graph)?;

        let mut scalars = Vec::new();
        let mut bound = Vec::new();
        for t in &g.tensors {
            if let Kind::Bound(role) = t.kind {
                if let Role::Scalar(v) = role {
                    scalars.push(v);
                }
                bound.push((t.uid, role));
            }
        }
        keep.extend(tensors);
        keep.extend(ops);
        keep.push(graph);
        Ok(Plan { plan, workspace, bound, scalars: scalars.into_boxed_slice(), _graph: keep })
    }

    fn execute(&self, handle: sys::cudnnHandle_t, b: &Bindings, workspace: CUdeviceptr) -> Result<()> {
        let mut uids = Vec::with_capacity(self.bound.len());
        let mut pointers: Vec<*mut c_void> = Vec::with_capacity(self.bound.len());
        let mut next_scalar = 0;
        for &(uid, role) in &self.bound {
            uids.push(uid);
            pointers.push(match role {
                Role::Scalar(_) => {
                    next_scalar += 1;
                    (&self.scalars[next_scalar - 1] as *const f32).cast_mut().cast()
                }
                _ => b.pointer(role) as *mut c_void,
            });
        }
        let pack = Descriptor::new(D::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, T::CUDNN_TYPE_INT64, &uids)?;
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, T::CUDNN_TYPE_VOID_PTR, &pointers)?;
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, T::CUDNN_TYPE_VOID_PTR, &[workspace as *mut c_void])?;
        pack.finalize("the variant pack")?;
        // SAFETY: a finalized plan and variant pack whose pointers are live device memory (and
        // host scalars owned by the plan) for the duration of the call.
        check(unsafe { sys::cudnnBackendExecute(handle, self.plan.0, pack.0) }, "cudnnBackendExecute")
    }
}

/// The first engine configuration, in the order of heuristics A and then the fallback list,
/// whose execution plan finalizes; with the workspace it needs.
fn choose_plan(handle: sys::cudnnHandle_t, graph: &Descriptor) -> Result<(Descriptor, usize)> {
    // What each refusal said, as text: repeats are dropped and the rest joined in one line.
    let mut tried: Vec<String> = Vec::new();
    for mode in [sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A, sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK]
    {
        let heur = Descriptor::new(D::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.set_desc(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph)?;
        heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, T::CUDNN_TYPE_HEUR_MODE, &[mode])?;
        if let Err(e) = heur.finalize(&format!("heuristics {mode:?}")) {
            tried.push(format!("{e:#}"));
            continue;
        }
        let results = (A::CUDNN_ATTR_ENGINEHEUR_RESULTS, T::CUDNN_TYPE_BACKEND_DESCRIPTOR);
        let count = match heur.get::<sys::cudnnBackendDescriptor_t>(results.0, results.1, &mut [], "count the results")
        {
            Ok(count) => count,
            Err(e) => {
                tried.push(format!("{e:#}"));
                continue;
            }
        };
        let configs: Vec<Descriptor> =
            (0..count).map(|_| Descriptor::new(D::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)).collect::<Result<_>>()?;
        // The created engine-configuration descriptors, for cuDNN to fill.
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
        let returned = heur.get(results.0, results.1, &mut raw, "read the heuristics' results")?;
        for config in configs.iter().take(returned as usize) {
            let plan = Descriptor::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
            plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, T::CUDNN_TYPE_HANDLE, &[handle])?;
            plan.set_desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config)?;
            match plan.finalize("an execution plan") {
                Ok(()) => {
                    let mut bytes = [0i64];
                    let size = A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE;
                    plan.get(size, T::CUDNN_TYPE_INT64, &mut bytes, "the plan's workspace size")?;
                    return Ok((plan, bytes[0].max(0) as usize));
                }
                Err(e) => tried.push(format!("{e:#}")),
            }
        }
        if returned == 0 {
            tried.push(format!("heuristics {mode:?} returned no engine"));
        }
    }
    tried.dedup();
    bail!("no engine takes the graph ({})", tried.join("; "))
}

/// The addresses of Q, K and V in packed qkv rows starting at `qkv` (bf16).
fn qkv_parts(qkv: CUdeviceptr, s: AttnShape) -> (CUdeviceptr, CUdeviceptr, CUdeviceptr) {
    let k = qkv + 2 * s.q_width() as u64;
    (qkv, k, k + 2 * (s.n_kv_heads * s.head_dim) as u64)
}

/// Opens cuDNN on the backend's device, or says why it cannot be.
fn open(gpu: &mut Cuda) -> Result<&mut Cudnn> {
    gpu.dev.cudnn()
}

/// Why cuDNN's attention is not used under document masking (`data.document_mask`): its graphs
/// here carry no padding or ragged mask, and a mask that lets attention cross documents is the
/// bug MaxText's cuDNN path had (#4476), so the native kernels, which take the documents'
/// starts, run instead.
pub(crate) const NO_DOCUMENT_MASK: &str =
    "data.document_mask = true needs the native kernels (this cuDNN graph takes no document mask)";

/// Why cuDNN's attention is not used on a sequence axis: a rank's queries are two chunks at
/// their true positions against every rank's keys, which the native kernels take.
pub(crate) const NO_SEQ_SPLIT: &str = "a sequence axis (mesh.ici_seq x mesh.dcn_seq > 1) needs the native kernels (this cuDNN graph takes no chunk offsets)";

pub(crate) const NO_SINKS: &str =
    "attention sinks (GPT-OSS) need the native kernels (they read the log-sum-exp in the native layout)";
pub(crate) const NO_LOGIT_MAX: &str =
    "QK-clip (optim.qk_clip) needs the native kernels (they record each head's largest logit; cuDNN's do not)";

/// cuDNN version from which Hopper's fused attention trains heads wider than 128 (its backward
/// pass up to 256; the forward pass took them from 9.1).
pub(crate) const WIDE_HEADS_VERSION: usize = 90500;

/// Why cuDNN's fused attention cannot train heads `head_dim` wide (both passes, equal q/k and
/// v widths) on a device of compute capability `cc` with cuDNN `version`, if it cannot; the
/// native kernels then run. cuDNN 9's SDPA support matrix: heads up to 128 on every
/// architecture from sm_80; up to 256 on Hopper (sm_90) only, whose backward pass takes them
/// from 9.5. Ampere and Ada run forward passes up to 256 but backward passes only up to 128, and
/// Blackwell's backward pass past 128 is the (192, 128) split of latent attention or, from
/// 9.23, 256 alone: a training step needs both passes, so past 128 only sm_90 qualifies here.
pub(crate) fn head_dim_refusal(head_dim: usize, cc: (i32, i32), version: usize) -> Option<String> {
    let hopper = cc.0 == 9;
    if head_dim <= 128 || hopper && head_dim <= 256 && version >= WIDE_HEADS_VERSION {
        return None;
    }
    Some(if hopper && head_dim <= 256 {
        format!(
            "model.head_dim = {head_dim} needs the native kernels with cuDNN {} (its fused attention trains heads wider than 128 from {} on)",
            dotted(version),
            dotted(WIDE_HEADS_VERSION)
        )
    } else {
        format!(
            "model.head_dim = {head_dim} needs the native kernels on sm_{}{} (cuDNN's fused attention trains heads up to 128 wide there, up to 256 on sm_90)",
            cc.0, cc.1
        )
    })
}

/// `Backend::attention_forward` on cuDNN: out and the statistics (`lse` holds them
/// `[batch, heads, seq]`, natural log, which only the backward pass below reads).
pub(crate) fn forward(gpu: &mut Cuda, out: View, lse: View, qkv: View, s: AttnShape) {
    let (o, stats, base) = (gpu.out(out, "attention"), gpu.out(lse, "attention"), gpu.ptr(qkv));
    let (q, k, v) = qkv_parts(base, s);
    let b = Bindings { q, k, v, o, stats, ..Bindings::default() };
    if let Err(e) = open(gpu).and_then(|c| c.run(Pass::Forward, s, &b)) {
        panic!("attention forward on cuDNN: {e:#}; run with --set train.attention=native")
    }
}

/// `Backend::attention_backward` on cuDNN: dQ accumulates in the f32 scratch the native kernels
/// use for it, zeroed first, and is converted into `dqkv` with dK and dV.
pub(crate) fn backward(gpu: &mut Cuda, dqkv: View, dout: View, qkv: View, out: View, lse: View, s: AttnShape) {
    let n = s.rows() * s.q_width();
    let dq_accum = gpu.scratch(Scratch::AttnDq, n * 4);
    gpu.zero_u32(dq_accum, n);
    let (grads, base) = (gpu.out(dqkv, "attention"), gpu.ptr(qkv));
    let (q, k, v) = qkv_parts(base, s);
    let (dq, dk, dv) = qkv_parts(grads, s);
    let (o, stats, d_o) = (gpu.ptr(out), gpu.ptr(lse), gpu.ptr(dout));
    let b = Bindings { q, k, v, o, stats, d_o, dq, dk, dv, dq_accum };
    if let Err(e) = open(gpu).and_then(|c| c.run(Pass::Backward, s, &b)) {
        panic!("attention backward on cuDNN: {e:#}; run with --set train.attention=native")
    }
}

/// cuDNN's attention against the f32 CPU reference on one small case of the model's heads
/// (both passes, its plans built for that shape): the check `train.attention = "auto"` makes
/// before it takes cuDNN, and `"cudnn"` before it runs. Returns the errors measured.
pub(crate) fn self_check(gpu: &mut Cuda, model: AttnShape) -> Result<String> {
    open(gpu)?;
    let s = AttnShape { batch: 1, seq: 192, ..model };
    let (n, nq) = (s.rows() * s.qkv_width(), s.rows() * s.q_width());
    let random = |len: usize, stream: u64| -> Vec<f32> {
        (0..len).map(|i| half::bf16::from_f32(crate::rng::normal_pair(7, stream, i as u64).0).to_f32()).collect()
    };
    let (qkv, dout) = (random(n, 1), random(nq, 2));

    // The reference.
    let mut cpu = Cpu::new();
    let views = [n, nq, s.rows() * s.n_heads, nq, n].map(|len| cpu.alloc(BufKind::Activations, len));
    let [c_qkv, c_out, c_lse, c_dout, c_dqkv] = views;
    cpu.upload(c_qkv, &qkv);
    cpu.upload(c_dout, &dout);
    cpu.attention_forward(c_out, c_lse, c_qkv, s);
    cpu.attention_backward(c_dqkv, c_dout, c_qkv, c_out, c_lse, s);
    let (mut want_out, mut want_dqkv) = (vec![0f32; nq], vec![0f32; n]);
    cpu.download(c_out, &mut want_out);
    cpu.download(c_dqkv, &mut want_dqkv);

    // cuDNN, on memory of its own (freed after, outside the backend's accounting).
    let sizes = [2 * n, 2 * nq, 4 * s.rows() * s.n_heads, 2 * nq, 2 * n, 4 * nq];
    let mut ptrs = Vec::new();
    for bytes in sizes {
        ptrs.push(gpu.dev.alloc(bytes)?);
    }
    let bf16_bytes = |x: &[f32]| -> Vec<u8> { x.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect() };
    gpu.dev.upload(ptrs[0], &bf16_bytes(&qkv));
    gpu.dev.upload(ptrs[3], &bf16_bytes(&dout));
    let (q, k, v) = qkv_parts(ptrs[0], s);
    let (dq, dk, dv) = qkv_parts(ptrs[4], s);
    let b = Bindings { q, k, v, o: ptrs[1], stats: ptrs[2], d_o: ptrs[3], dq, dk, dv, dq_accum: ptrs[5] };
    let ran = open(gpu).and_then(|c| {
        c.prepare(s)?;
        c.run(Pass::Forward, s, &b)?;
        c.run(Pass::Backward, s, &b)
    });
    let (mut got_out, mut got_dqkv) = (vec![0u8; 2 * nq], vec![0u8; 2 * n]);
    if ran.is_ok() {
        gpu.dev.download(&mut got_out, ptrs[1]);
        gpu.dev.download(&mut got_dqkv, ptrs[4]);
    }
    gpu.dev.synchronize();
    for p in ptrs {
        gpu.dev.free(p);
    }
    ran?;
    let floats = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
    };
    let (got_out, got_dqkv) = (floats(&got_out), floats(&got_dqkv));
    let mut notes = vec![check_close("out", &got_out, &want_out, 1e-2)?];
    let (qw, kw) = (s.q_width(), s.n_kv_heads * s.head_dim);
    for (name, start, width) in [("dq", 0, qw), ("dk", qw, kw), ("dv", qw + kw, kw)] {
        let pick = |x: &[f32]| -> Vec<f32> {
            x.chunks_exact(s.qkv_width()).flat_map(|row| row[start..start + width].to_vec()).collect()
        };
        notes.push(check_close(name, &pick(&got_dqkv), &pick(&want_dqkv), 2e-2)?);
    }
    Ok(notes.join(", "))
}

/// `name`'s relative L2 error against the reference, if within `tol`.
fn check_close(name: &str, got: &[f32], want: &[f32], tol: f64) -> Result<String> {
    let (mut err, mut norm) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        err += f64::from(g - w).powi(2);
        norm += f64::from(*w).powi(2);
    }
    let rel = (err / norm.max(f64::MIN_POSITIVE)).sqrt();
    if rel.is_nan() || rel > tol {
        bail!("{name} is {rel:.2e} off the CPU reference (relative L2; at most {tol:.0e} expected)");
    }
    Ok(format!("{name} {rel:.1e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_past_128_take_cudnn_on_hopper_only() {
        let (a100, h100, b200) = ((8, 0), (9, 0), (10, 0));
        for cc in [a100, h100, b200] {
            assert_eq!(head_dim_refusal(128, cc, MIN_VERSION), None);
        }
        assert_eq!(head_dim_refusal(192, h100, WIDE_HEADS_VERSION), None);
        assert_eq!(head_dim_refusal(256, h100, 91400), None);
        let old = head_dim_refusal(256, h100, 90400).unwrap();
        assert!(old.contains("model.head_dim = 256") && old.contains("9.5.0"), "{old}");
        for cc in [a100, b200] {
            let why = head_dim_refusal(192, cc, 91400).unwrap();
            assert!(why.contains("model.head_dim = 192") && why.contains("native kernels"), "{why}");
        }
        assert!(head_dim_refusal(192, a100, 91400).unwrap().contains("sm_80"));
    }
}
