//! The CUDA backend: bf16 training on NVIDIA GPUs (compute capability 8.0 and newer).
//!
//! Precision: activations and the compute copy of the parameters are bf16; the master weights,
//! gradients, AdamW moments and every statistic (norm and softmax statistics, losses, routing
//! weights) are f32; every product and reduction accumulates in f32 (or f64). A
//! [`BufKind::Params`] buffer is two allocations: the f32 master, which uploads, downloads and
//! the optimizer use, and its bf16 copy, which the ops read; AdamW refreshes the copy as it
//! updates the master. Parameters gathered for a use ([`BufKind::Gathered`], FSDP) are the bf16
//! copy alone: gathered from the pieces' copies, they never need a master.
//!
//! Work: dense products go through cuBLASLt (`blas.rs`); everything else is CUDA C compiled at
//! start by NVRTC for the device's architecture and cached on disk ([`nvrtc`]). Each op has one
//! file in [`ops`], its kernels beside their host code; this module keeps what all ops share. All
//! work is issued on one stream and nothing waits for the device except [`Backend::download`]
//! and [`Backend::synchronize`]. A section ([`Backend::begin_section`]) runs eagerly once, is
//! captured as a CUDA graph the second time, and is replayed from then on.
//!
//! Libraries are loaded at run time ([`discovery`]): the engine builds and runs without CUDA.

mod blas;
pub mod cudnn;
pub mod discovery;
mod driver;
pub use driver::CudaFailure;
pub mod emulator;
pub mod flags;
pub mod nvrtc;
pub mod ops;

use std::collections::HashMap;

use anyhow::{Result, anyhow, bail};
use cudarc::driver::sys::{self, CUdeviceptr};

use super::{
    AdamWStep, AttnNeeds, AttnShape, Backend, BufKind, ExpertWeights, Glu, HostFn, IdxView, MatMul, MlaShape,
    MoeDispatch, MuonMomentum, Parts, Segment, SeqSplit, View, fp8, gib,
};
use crate::config::{AttentionImpl, ModelConfig};
use blas::Gemm;
pub use discovery::DeviceInfo;

/// What the backend needs from a device: zeroed memory, copies, kernel launches, cuBLASLt
/// products, and capture and replay of work. [`driver::Gpu`] drives a GPU; the
/// [`emulator::Emulator`] runs the same kernel sources on the CPU, for tests without a GPU.
/// Work is issued in order; only `download` and `synchronize` wait for it.
trait Device {
    /// The device.
    fn info(&self) -> &DeviceInfo;
    /// Largest dynamic shared memory a block may have.
    fn max_shared_memory(&self) -> usize;
    /// Zero-filled device memory.
    fn alloc(&mut self, bytes: usize) -> Result<CUdeviceptr>;
    /// Frees what `alloc` returned (nothing may be pending on it).
    fn free(&mut self, ptr: CUdeviceptr);
    /// Host to device, in order with the work issued.
    fn upload(&mut self, dst: CUdeviceptr, src: &[u8]);
    /// Device to host, after all work issued.
    fn download(&mut self, dst: &mut [u8], src: CUdeviceptr);
    /// Device to device.
    fn copy(&mut self, dst: CUdeviceptr, src: CUdeviceptr, bytes: usize);
    /// Sets `count` 4-byte words to zero.
    fn zero_u32(&mut self, dst: CUdeviceptr, count: usize);
    /// Runs a kernel; `args` are its parameters, each in an 8-byte slot.
    fn launch(&mut self, kernel: &'static str, grid: (u32, u32, u32), block: u32, smem: usize, args: &mut [u64]);
    /// A product with cuBLASLt's semantics.
    fn gemm(&mut self, g: &Gemm);
    /// Waits for all work issued.
    fn synchronize(&mut self);
    /// Starts recording the work issued instead of doing it.
    fn begin_capture(&mut self);
    /// Stops recording; returns the recording's number.
    fn end_capture(&mut self) -> usize;
    /// Issues a recording's work again.
    fn replay(&mut self, graph: usize);
    /// Calls `f` on the device in order with the work issued: where work is recorded (the
    /// emulator's graphs) the call is recorded and made again at each replay; on a GPU it is
    /// made now, after the work issued (a host function cannot touch device memory in a CUDA
    /// graph, so a GPU section holds none: the backend checks).
    fn host_call(&mut self, f: DeviceFn);
    /// Whether [`Device::host_call`] is recorded with the work (may sit inside a section).
    fn records_host_calls(&self) -> bool {
        false
    }
    /// Free and total device memory in bytes.
    fn memory(&self) -> (usize, usize);
    /// The stream all work goes to, for a library that issues work itself (NCCL); none on
    /// the emulator.
    fn stream(&self) -> Option<sys::CUstream> {
        None
    }
    /// cuDNN on the device's stream, opened the first time it is asked for.
    fn cudnn(&mut self) -> Result<&mut cudnn::Cudnn> {
        bail!("cuDNN runs on a GPU, and this device is the emulator")
    }
}

/// A host function on the device ([`Device::host_call`]).
type DeviceFn = std::sync::Arc<dyn Fn(&mut dyn Device) + Send + Sync>;

/// Messages ([`Backend::download_message`]) from a view's bytes of type `t`: f32 and bf16 as
/// numbers, an FP8 byte as its code.
fn decode(t: DType, bytes: &[u8]) -> Vec<f32> {
    match t {
        DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect(),
        DType::Bf16 => {
            bytes.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_ne_bytes([b[0], b[1]])).to_f32()).collect()
        }
        DType::Fp8 => bytes.iter().map(|&b| f32::from(b)).collect(),
    }
}

/// The bytes of type `t` of messages: the inverse of [`decode`] (bf16 rounded to nearest even).
fn encode(t: DType, messages: &[f32]) -> Vec<u8> {
    match t {
        DType::F32 => bytes_of(messages).to_vec(),
        DType::Bf16 => messages.iter().flat_map(|&x| half::bf16::from_f32(x).to_bits().to_ne_bytes()).collect(),
        DType::Fp8 => messages.iter().map(|&x| x as u8).collect(),
    }
}

/// Which kernels run attention (`train.attention`, resolved by [`Backend::select_attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attention {
    /// The engine's own flash-attention kernels (`ops/attention.cu`).
    Native,
    /// cuDNN's fused flash attention ([`cudnn`]).
    Cudnn,
}

/// Bytes of plain numbers (f32, u16, u32, u64), for copies to and from the device.
fn bytes_of<T: Copy>(x: &[T]) -> &[u8] {
    // SAFETY: T is a plain number type here: every byte is initialised, any alignment is 1.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}
fn bytes_of_mut<T: Copy>(x: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is a valid f32, u16 or u32.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast(), std::mem::size_of_val(x)) }
}

/// Element type of a view as the ops see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE f32.
    F32,
    /// An FP8 format's byte ([`BufKind::Fp8`]); which format, the op that reads it says.
    Fp8,
}

impl DType {
    fn size(self) -> usize {
        match self {
            DType::Fp8 => 1,
            DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }
}

/// Bytes of one element of each buffer kind on the GPU (parameters: the f32 master plus its
/// bf16 copy; gathered parameters: the bf16 copy alone).
pub fn bytes_per_element(kind: BufKind) -> usize {
    match kind {
        BufKind::Params => 6,
        BufKind::Activations | BufKind::Gathered => 2,
        BufKind::Grads | BufKind::OptState | BufKind::Scalars => 4,
        BufKind::Fp8 => 1,
    }
}

/// Why a model cannot train on this backend, if it cannot.
pub fn check_model(m: &ModelConfig) -> Result<()> {
    if !m.head_dim.is_multiple_of(8) || m.head_dim > ops::attention::MAX_HEAD_DIM {
        bail!(
            "model.head_dim = {}: the CUDA attention kernels take a multiple of 8 up to {} (heads padded to 16, 32, 64, 128, 192 or 256); use --device cpu",
            m.head_dim,
            ops::attention::MAX_HEAD_DIM
        );
    }
    if let Some(moe) = &m.moe
        && moe.num_experts > ops::moe::MAX_EXPERTS
    {
        bail!(
            "model.moe.num_experts = {}: the CUDA routing kernels take at most {}; use --device cpu",
            moe.num_experts,
            ops::moe::MAX_EXPERTS
        );
    }
    Ok(())
}

/// What the CUDA backend cannot run of a whole run's configuration: its model
/// ([`check_model`]), and DeepSeek-V3's selection biases under FSDP, whose bf16 gathers would
/// round the balancing step's moves away (routing reads the bias in f32, from the parameters'
/// master, which FSDP keeps sharded).
pub fn check_run(c: &crate::config::Config) -> Result<()> {
    check_model(&c.model)?;
    let fsdp = c.mesh.ici_fsdp != 1 || c.mesh.dcn_fsdp != 1;
    if fsdp && c.model.moe.as_ref().is_some_and(|moe| moe.selection_bias) {
        bail!(
            "model.moe.selection_bias with an fsdp axis (mesh.ici_fsdp = {}, mesh.dcn_fsdp = {}): the CUDA backend gathers FSDP's parameters in bf16, which does not carry the f32 selection bias yet; use the data, tensor or expert axes, or --device cpu",
            c.mesh.ici_fsdp,
            c.mesh.dcn_fsdp
        );
    }
    Ok(())
}

/// Device memory the backend allocates for itself, beyond the views it hands out, for a model
/// at a batch shape: the cuBLASLt workspace, the reduction partials, the RMSNorm weight-gradient
/// partials (LayerNorm's weight and bias gradients: twice as many; QK-norm's `[dwq | dwk]`, which
/// share that scratch: `2·head_dim` a block; latent attention's norms, their ranks' width) and the attention backward pass's f32 dQ
/// accumulator and D.
pub fn scratch_bytes(m: &ModelConfig, batch: usize, seq: usize, sm_count: usize) -> usize {
    let rows = batch * seq;
    let (norm_blocks, _) = ops::rmsnorm::backward_blocks(rows, sm_count);
    let qk_norm_row = if m.qk_norm() { 2 * m.head_dim } else { 0 };
    // Latent attention's two RMSNorms are as wide as their ranks, which may exceed d_model.
    let latent_row = m.mla.as_ref().map_or(0, |a| a.q_lora_rank.max(a.kv_lora_rank));
    let norm_row = (m.d_model * if m.is_gpt() { 2 } else { 1 }).max(qk_norm_row).max(latent_row);
    // Attention sinks' gradient partials share it too: a head's per block, over no more blocks
    // (`ops::sinks::backward_grid`).
    let norm_row = norm_row.max(m.n_heads);
    blas::WORKSPACE_BYTES
        + ops::elementwise::sum_blocks(sm_count) * 8
        + norm_blocks * norm_row * 4
        + rows * m.n_heads * (m.head_dim + 1) * 4
}

/// One buffer: `ptr` holds the elements (f32, or bf16 for activations); `compute` the bf16 copy
/// of a parameter buffer (0 otherwise).
struct Buffer {
    kind: BufKind,
    len: usize,
    ptr: CUdeviceptr,
    compute: CUdeviceptr,
}

/// A kernel argument (every one is at most 8 bytes, passed from a u64 slot).
#[derive(Clone, Copy)]
enum Arg {
    P(CUdeviceptr),
    U(u64),
    I(i32),
    F(f32),
}

/// Where a section stands: run eagerly (how many times), being captured, or a graph.
enum Section {
    Eager(u32),
    Capturing,
    Graph(usize),
}

/// Scratch the backend owns, grown on first use (during the eager run of a section, never while
/// capturing).
#[derive(Clone, Copy)]
enum Scratch {
    SumPartials,
    NormPartials,
    AttnDq,
    AttnD,
    AdamRuns,
}
const SCRATCH_KINDS: usize = 5;

/// A kernel launch as [`Cuda::trace_launches`] records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The kernel.
    pub name: &'static str,
    /// Its grid.
    pub grid: (u32, u32, u32),
    /// Its arguments as the launch passes them: pointers, and integers and floats as their bits.
    pub args: Vec<u64>,
}

/// The CUDA backend on one device. See the [module documentation](self).
pub struct Cuda {
    bufs: Vec<Buffer>,
    idx: Vec<(CUdeviceptr, usize)>,
    scratch: [(CUdeviceptr, usize); SCRATCH_KINDS],
    adam_runs: Vec<u64>,
    sections: HashMap<u32, Section>,
    capturing: bool,
    attention: Attention,
    /// What [`Backend::select_attention`] chose and why, for [`Backend::describe`].
    attention_note: String,
    /// Where the native forward kernels record each head's largest logit, if asked
    /// ([`Backend::attention_logit_max`]).
    logit_max: Option<View>,
    /// The FP8 casts as they were before their fusion ([`ops::fp8::quantize`]): the
    /// measurements' "before" and the fused casts' byte-for-byte reference.
    fp8_unfused: bool,
    /// The launches made since [`Cuda::trace_launches`] started a trace, and whether they are
    /// only recorded, not run.
    trace: Option<(Vec<Launch>, bool)>,
    allocated: usize,
    /// The most `allocated` has been.
    peak: usize,
    dev: Box<dyn Device>,
}

impl Cuda {
    /// Opens GPU `ordinal`: checks the driver, the device and the libraries, and compiles (or
    /// loads from the cache) every kernel module for the device's architecture.
    pub fn new(ordinal: usize) -> Result<Cuda> {
        Ok(Cuda::on(Box::new(driver::Gpu::open(ordinal)?)))
    }

    /// Casts FP8 operands as before their fusion (`unfused`): an amax pass of its own under
    /// both recipes, each layout in its own launch ([`ops::fp8::quantize`]). For measurements
    /// and the fused casts' checks; the bytes are the same.
    pub fn set_fp8_unfused(&mut self, unfused: bool) {
        self.fp8_unfused = unfused;
    }

    /// Starts recording every kernel launch (its name, grid and arguments), or stops (`None`);
    /// with `Some(true)` the launches are recorded and not run (a dry run that counts what a
    /// sequence of ops would launch, at any shape). [`Cuda::take_launches`] returns them.
    pub fn trace_launches(&mut self, how: Option<bool>) {
        self.trace = how.map(|dry| (Vec::new(), dry));
    }

    /// The launches recorded since the trace started (or last taken).
    pub fn take_launches(&mut self) -> Vec<Launch> {
        self.trace.as_mut().map(|(t, _)| std::mem::take(t)).unwrap_or_default()
    }

    /// The backend on the CPU emulator: the same kernels and host code, no GPU (slow; tests).
    pub fn emulated() -> Result<Cuda> {
        Ok(Cuda::on(Box::new(emulator::Emulator::open()?)))
    }

    fn on(dev: Box<dyn Device>) -> Cuda {
        Cuda {
            bufs: Vec::new(),
            idx: Vec::new(),
            scratch: [(0, 0); SCRATCH_KINDS],
            adam_runs: Vec::new(),
            sections: HashMap::new(),
            capturing: false,
            attention: Attention::Native,
            attention_note: String::new(),
            logit_max: None,
            fp8_unfused: false,
            trace: None,
            allocated: blas::WORKSPACE_BYTES,
            peak: blas::WORKSPACE_BYTES,
            dev,
        }
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        self.dev.info()
    }

    /// Dense bf16 peak of the device in TFLOP/s, from [`discovery::PEAK_BF16_TFLOPS`].
    pub fn peak_tflops(&self) -> Option<f64> {
        discovery::peak_tflops(&self.dev.info().name)
    }

    /// Sections recorded as graphs (and replayed since).
    pub fn recorded_sections(&self) -> usize {
        self.sections.values().filter(|s| matches!(s, Section::Graph(_))).count()
    }

    /// Free and total device memory in bytes.
    pub fn device_memory(&self) -> (usize, usize) {
        self.dev.memory()
    }

    /// Bytes this backend has allocated, and bytes in use on the device (all processes and the
    /// CUDA context included).
    pub fn memory_in_use(&self) -> (usize, usize) {
        let (free, total) = self.dev.memory();
        (self.allocated, total - free)
    }

    // ---- memory ------------------------------------------------------------------------------

    fn device_alloc(&mut self, bytes: usize, what: &str) -> CUdeviceptr {
        assert!(!self.capturing, "internal error: device allocation ({what}) inside a captured section");
        let ptr = self.dev.alloc(bytes).unwrap_or_else(|e| {
            let (free, total) = self.dev.memory();
            panic!(
                "CUDA out of memory allocating {:.2} GiB for {what} ({:.2} GiB free of {:.2} GiB): lower \
                 train.batch_size or set train.remat (see `engine recipes show`) ({e})",
                gib(bytes),
                gib(free),
                gib(total)
            )
        });
        self.allocated += bytes;
        self.peak = self.peak.max(self.allocated);
        ptr
    }

    /// The stream the ops run on (none on the emulator), for work ordered with them from
    /// outside the backend (NCCL's communication stream waits for it and it for that stream).
    pub fn compute_stream(&self) -> Option<sys::CUstream> {
        self.dev.stream()
    }

    /// For a communication library that works in place on this backend's buffers (ordered with
    /// [`Cuda::compute_stream`]): the address of a view's exact values (f32, bf16 for
    /// activations, bytes for FP8 casts) and their size in bytes (4, 2 or 1). After writing
    /// into a view, call [`Cuda::written`].
    pub fn raw_view(&self, v: View) -> (CUdeviceptr, usize) {
        let (ptr, dtype) = self.exact(v);
        (ptr, dtype.size())
    }

    /// Address of what the ops read from `v`, and its elements' size in bytes (parameters:
    /// their bf16 copy): what a gather into bf16 sends ([`BufKind::Gathered`]).
    pub fn compute_view(&self, v: View) -> (CUdeviceptr, usize) {
        (self.ptr(v), self.dtype(v).size())
    }

    /// The FP8 values of a [`BufKind::Fp8`] view holding `format`, decoded (a check's
    /// read-back: the ops never need it).
    pub fn download_fp8(&mut self, src: View, format: fp8::Fp8Format) -> Vec<f32> {
        self.sync_check("download_fp8");
        let (ptr, t) = self.exact(src);
        assert_eq!(t, DType::Fp8, "internal error: download_fp8 of a {t:?} view");
        let mut bytes = vec![0u8; src.len];
        self.dev.download(&mut bytes, ptr);
        bytes.into_iter().map(|b| format.decode(b)).collect()
    }

    /// Tells the backend that `v` was written behind its back ([`Cuda::raw_view`]).
    pub fn written(&mut self, v: View) {
        ops::elementwise::refresh_compute_copy(self, v);
    }

    fn buffer(&self, v: View) -> &Buffer {
        let b = &self.bufs[v.buf.0 as usize];
        assert!(v.offset + v.len <= b.len, "internal error: view {v:?} outside its buffer of {}", b.len);
        b
    }

    /// Element type the ops read from a view (parameters: their bf16 copy).
    fn dtype(&self, v: View) -> DType {
        match self.buffer(v).kind {
            BufKind::Params | BufKind::Activations | BufKind::Gathered => DType::Bf16,
            BufKind::Fp8 => DType::Fp8,
            _ => DType::F32,
        }
    }

    /// Address the ops read from (parameters: the bf16 copy).
    fn ptr(&self, v: View) -> CUdeviceptr {
        let b = self.buffer(v);
        match b.kind {
            BufKind::Params => b.compute + 2 * v.offset as u64,
            BufKind::Activations | BufKind::Gathered => b.ptr + 2 * v.offset as u64,
            BufKind::Fp8 => b.ptr + v.offset as u64,
            _ => b.ptr + 4 * v.offset as u64,
        }
    }

    /// Address and type of a view's exact values (parameters: the f32 master).
    fn exact(&self, v: View) -> (CUdeviceptr, DType) {
        let b = self.buffer(v);
        match b.kind {
            BufKind::Activations | BufKind::Gathered => (b.ptr + 2 * v.offset as u64, DType::Bf16),
            BufKind::Fp8 => (b.ptr + v.offset as u64, DType::Fp8),
            _ => (b.ptr + 4 * v.offset as u64, DType::F32),
        }
    }

    /// A view the op writes: its address and type, for any kind but parameters.
    fn out(&self, v: View, op: &str) -> CUdeviceptr {
        let kind = self.buffer(v).kind;
        assert!(!matches!(kind, BufKind::Params | BufKind::Gathered), "internal error: {op} writes into parameters");
        self.ptr(v)
    }

    fn expect(&self, v: View, want: DType, op: &str, arg: &str) {
        let got = self.dtype(v);
        assert!(
            got == want,
            "internal error: cuda {op}: {arg} must be {want:?}, got {got:?} ({:?})",
            self.buffer(v).kind
        );
    }

    fn iptr(&self, v: IdxView) -> CUdeviceptr {
        let (ptr, len) = self.idx[v.buf.0 as usize];
        assert!(v.offset + v.len <= len, "internal error: index view {v:?} outside its buffer of {len}");
        ptr + 4 * v.offset as u64
    }

    fn scratch(&mut self, which: Scratch, bytes: usize) -> CUdeviceptr {
        let (ptr, size) = self.scratch[which as usize];
        if size >= bytes {
            return ptr;
        }
        if ptr != 0 {
            self.synchronize(); // pending work may still use the old buffer
            self.dev.free(ptr);
            self.allocated -= size;
            // Recorded sections point at the old buffer: record them again.
            self.sections.clear();
        }
        let ptr = self.device_alloc(bytes, "scratch");
        self.scratch[which as usize] = (ptr, bytes);
        ptr
    }

    // ---- launching ---------------------------------------------------------------------------

    fn launch(&mut self, name: &'static str, grid: (u32, u32, u32), block: u32, smem: usize, args: &[Arg]) {
        let limit = self.dev.max_shared_memory();
        assert!(smem <= limit, "internal error: {name} needs {smem} bytes of shared memory, the device has {limit}");
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::P(p) => p,
                Arg::U(u) => u,
                Arg::I(i) => i as u32 as u64,
                Arg::F(f) => f.to_bits() as u64,
            })
            .collect();
        if let Some((trace, dry)) = &mut self.trace {
            trace.push(Launch { name, grid, args: slots.clone() });
            if *dry {
                return;
            }
        }
        if grid.0 > 0 && grid.1 > 0 && grid.2 > 0 {
            self.dev.launch(name, grid, block, smem, &mut slots);
        }
    }

    /// Whether work is only traced, not run ([`Cuda::trace_launches`]).
    fn dry(&self) -> bool {
        matches!(self.trace, Some((_, true)))
    }

    /// A cuBLASLt product (not run in a dry run).
    fn gemm(&mut self, g: &Gemm) {
        if !self.dry() {
            self.dev.gemm(g);
        }
    }

    /// A device-to-device copy of `bytes` (not run in a dry run).
    fn copy_bytes(&mut self, dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) {
        if !self.dry() {
            self.dev.copy(dst, src, bytes);
        }
    }

    /// Zeroes `count` 32-bit words (not run in a dry run).
    fn zero_u32(&mut self, dst: CUdeviceptr, count: usize) {
        if !self.dry() {
            self.dev.zero_u32(dst, count);
        }
    }

    /// A grid-stride launch over `n` items, 256 threads a block.
    fn launch_1d(&mut self, name: &'static str, n: u64, args: &[Arg]) {
        let cap = 32 * self.dev.info().sm_count.max(1) as u64;
        self.launch(name, (n.div_ceil(256).clamp(1, cap) as u32, 1, 1), 256, 0, args);
    }

    /// Host transfers and waits have no place in a captured section: the graph would not redo
    /// them at replay.
    fn sync_check(&self, what: &str) {
        assert!(!self.capturing, "internal error: {what} inside a captured section");
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        self.capturing = false;
        self.dev.synchronize();
        let scratch: Vec<CUdeviceptr> = self.scratch.iter().filter(|s| s.1 > 0).map(|s| s.0).collect();
        let bufs = self.bufs.iter().flat_map(|b| [b.ptr, b.compute]).filter(|&p| p != 0);
        for p in bufs.chain(self.idx.iter().map(|i| i.0)).chain(scratch).collect::<Vec<_>>() {
            self.dev.free(p);
        }
    }
}

impl Backend for Cuda {
    fn describe(&self) -> String {
        let i = self.dev.info();
        let note = if self.attention_note.is_empty() { String::new() } else { format!("; {}", self.attention_note) };
        format!(
            "cuda:{} {} (sm_{}{}, {:.0} GiB{note})",
            i.ordinal,
            i.name,
            i.capability.0,
            i.capability.1,
            gib(i.memory)
        )
    }

    fn select_attention(&mut self, choice: AttentionImpl, shape: AttnShape, needs: AttnNeeds) -> Result<()> {
        let cudnn = |gpu: &mut Cuda| -> Result<String> {
            if needs.documents {
                bail!(cudnn::NO_DOCUMENT_MASK);
            }
            if needs.seq_split {
                bail!(cudnn::NO_SEQ_SPLIT);
            }
            if needs.sinks {
                bail!(cudnn::NO_SINKS);
            }
            if needs.logit_max {
                bail!(cudnn::NO_LOGIT_MAX);
            }
            // Head widths cuDNN's fused attention does not train on this device.
            let version = gpu.dev.cudnn()?.version();
            if let Some(why) = cudnn::head_dim_refusal(shape.head_dim, gpu.dev.info().capability, version) {
                bail!(why);
            }
            let checked = cudnn::self_check(gpu, shape)?;
            let c = gpu.dev.cudnn()?;
            c.prepare(shape)?;
            Ok(format!("cuDNN {} (checked against the CPU: {checked})", cudnn::dotted(c.version())))
        };
        (self.attention, self.attention_note) = match choice {
            AttentionImpl::Native => (Attention::Native, "attention: native kernels".into()),
            AttentionImpl::Cudnn => {
                let how = cudnn(self)
                    .map_err(|e| anyhow!("train.attention = \"cudnn\": {e:#}; set \"auto\" or \"native\""))?;
                (Attention::Cudnn, format!("attention: {how}"))
            }
            AttentionImpl::Auto => match cudnn(self) {
                Ok(how) => (Attention::Cudnn, format!("attention: {how}")),
                Err(why) => (Attention::Native, format!("attention: native kernels (cuDNN not used: {why:#})")),
            },
        };
        Ok(())
    }

    fn peak_memory_bytes(&self) -> usize {
        self.peak
    }

    fn free_memory_bytes(&self) -> Option<usize> {
        Some(self.dev.memory().0)
    }

    fn synchronize(&mut self) {
        self.sync_check("synchronize");
        self.dev.synchronize();
    }

    fn begin_section(&mut self, key: u32) -> bool {
        match self.sections.entry(key).or_insert(Section::Eager(0)) {
            Section::Graph(g) => {
                self.dev.replay(*g);
                false
            }
            // The first run is eager: it allocates scratch and plans the products.
            Section::Eager(0) => true,
            state @ Section::Eager(_) => {
                self.dev.begin_capture();
                *state = Section::Capturing;
                self.capturing = true;
                true
            }
            Section::Capturing => panic!("internal error: section {key} begun twice"),
        }
    }

    fn end_section(&mut self, key: u32) {
        // (A scratch buffer that grew during an eager run cleared the sections: count this run.)
        let state = self.sections.entry(key).or_insert(Section::Eager(0));
        match state {
            Section::Eager(n) => *n += 1,
            Section::Capturing => {
                self.capturing = false;
                let graph = self.dev.end_capture();
                // The capture recorded the work without doing it: do it now.
                self.dev.replay(graph);
                *state = Section::Graph(graph);
            }
            Section::Graph(_) => panic!("internal error: end of a replayed section"),
        }
    }

    fn alloc(&mut self, kind: BufKind, len: usize) -> View {
        let stored = if kind == BufKind::Params { 4 } else { bytes_per_element(kind) };
        let ptr = self.device_alloc(len * stored, &format!("{kind:?}"));
        let compute = if kind == BufKind::Params { self.device_alloc(len * 2, "parameters (bf16 copy)") } else { 0 };
        self.bufs.push(Buffer { kind, len, ptr, compute });
        View { buf: super::BufId(self.bufs.len() as u32 - 1), offset: 0, len }
    }

    fn alloc_idx(&mut self, len: usize) -> IdxView {
        let ptr = self.device_alloc(len * 4, "indices");
        self.idx.push((ptr, len));
        IdxView { buf: super::BufId(self.idx.len() as u32 - 1), offset: 0, len }
    }

    fn upload(&mut self, dst: View, src: &[f32]) {
        assert_eq!(dst.len, src.len(), "internal error: upload length");
        self.sync_check("upload");
        let (ptr, t) = self.exact(dst);
        match t {
            DType::F32 => self.dev.upload(ptr, bytes_of(src)),
            DType::Bf16 => self.dev.upload(ptr, &encode(t, src)),
            DType::Fp8 => panic!("internal error: FP8 buffers are written by fp8_quantize alone"),
        }
        ops::elementwise::refresh_compute_copy(self, dst);
    }

    fn upload_idx(&mut self, dst: IdxView, src: &[u32]) {
        assert_eq!(dst.len, src.len(), "internal error: upload length");
        self.sync_check("upload_idx");
        let ptr = self.iptr(dst);
        self.dev.upload(ptr, bytes_of(src));
    }

    fn download(&mut self, src: View, dst: &mut [f32]) {
        assert_eq!(src.len, dst.len(), "internal error: download length");
        self.sync_check("download");
        let (ptr, t) = self.exact(src);
        match t {
            DType::F32 => self.dev.download(bytes_of_mut(dst), ptr),
            DType::Bf16 => {
                let mut bytes = vec![0u8; 2 * dst.len()];
                self.dev.download(&mut bytes, ptr);
                dst.copy_from_slice(&decode(t, &bytes));
            }
            DType::Fp8 => {
                panic!("internal error: FP8 buffers are read back with Cuda::download_fp8, which knows their format")
            }
        }
    }

    fn download_message(&mut self, src: View, dst: &mut [f32]) {
        let (ptr, t) = self.exact(src);
        if t != DType::Fp8 {
            return self.download(src, dst);
        }
        assert_eq!(src.len, dst.len(), "internal error: download length");
        self.sync_check("download");
        let mut bytes = vec![0u8; src.len];
        self.dev.download(&mut bytes, ptr);
        dst.copy_from_slice(&decode(t, &bytes));
    }

    fn upload_message(&mut self, dst: View, src: &[f32]) {
        let (ptr, t) = self.exact(dst);
        if t != DType::Fp8 {
            return self.upload(dst, src);
        }
        assert_eq!(dst.len, src.len(), "internal error: upload length");
        self.sync_check("upload");
        self.dev.upload(ptr, &encode(t, src));
    }

    fn host_call(&mut self, reads: View, writes: View, f: HostFn) {
        if !self.dev.records_host_calls() {
            self.sync_check("a host call");
        }
        let ((src, t_in), (dst, t_out)) = (self.exact(reads), self.exact(writes));
        let (n_in, n_out) = (reads.len, writes.len);
        self.dev.host_call(std::sync::Arc::new(move |dev: &mut dyn Device| {
            let mut bytes = vec![0u8; n_in * t_in.size()];
            if n_in > 0 {
                dev.download(&mut bytes, src);
            }
            let mut output = vec![0f32; n_out];
            f(&decode(t_in, &bytes), &mut output);
            if n_out > 0 {
                dev.upload(dst, &encode(t_out, &output));
            }
        }));
        ops::elementwise::refresh_compute_copy(self, writes);
    }

    fn download_idx(&mut self, src: IdxView, dst: &mut [u32]) {
        assert_eq!(src.len, dst.len(), "internal error: download length");
        self.sync_check("download_idx");
        let ptr = self.iptr(src);
        self.dev.download(bytes_of_mut(dst), ptr);
    }

    fn fill(&mut self, dst: View, value: f32) {
        ops::elementwise::fill(self, dst, value)
    }

    fn copy(&mut self, dst: View, src: View) {
        ops::elementwise::copy(self, dst, src)
    }

    fn add(&mut self, dst: View, src: View) {
        ops::elementwise::add(self, dst, src)
    }

    fn scale(&mut self, dst: View, s: f32) {
        ops::elementwise::scale(self, dst, s)
    }

    fn sum(&mut self, out: View, x: View) {
        ops::elementwise::sum(self, out, x, false)
    }

    fn sum_squares(&mut self, out: View, x: View) {
        ops::elementwise::sum(self, out, x, true)
    }

    fn matmul(&mut self, out: View, a: View, b: View, s: MatMul) {
        ops::matmul::matmul(self, out, a, b, s)
    }

    /// cuBLASLt's FP8 products need compute capability 8.9 (Ada) or newer (Hopper: 9.0).
    fn supports_fp8(&self) -> bool {
        self.dev.info().capability >= (8, 9)
    }

    fn fp8_quantize(&mut self, q: View, x: View, state: fp8::State, scaling: fp8::Scaling, transpose: Option<usize>) {
        ops::fp8::quantize(self, (q, None), x, state, scaling, transpose)
    }

    fn fp8_quantize_both(&mut self, q: View, qt: View, x: View, state: fp8::State, scaling: fp8::Scaling, cols: usize) {
        ops::fp8::quantize(self, (qt, Some(q)), x, state, scaling, Some(cols))
    }

    fn fp8_amax(&mut self, state: fp8::State, x: View) {
        ops::fp8::amax(self, state, x)
    }

    fn fp8_transpose(&mut self, q: View, x: View, cols: usize) {
        ops::fp8::transpose(self, q, x, cols)
    }

    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_fp8(
        &mut self,
        cast: (View, View, fp8::State),
        out: View,
        rstd: View,
        xw: (View, View),
        offset: f32,
        d: usize,
        eps: f32,
    ) {
        ops::fp8::rmsnorm(self, cast, out, rstd, xw, offset, d, eps)
    }

    fn swiglu_fp8(&mut self, cast: (View, View, fp8::State), h: View, gu: View, f: usize) {
        ops::fp8::swiglu(self, cast, h, gu, f)
    }

    fn matmul_fp8(&mut self, out: View, a: View, b: View, s: MatMul, scales: [fp8::State; 2], fast: bool) {
        ops::matmul::matmul_fp8(self, out, a, b, None, s, scales, fast)
    }

    fn matmul_fp8_add(&mut self, out: View, a: View, b: View, c: View, s: MatMul, scales: [fp8::State; 2], fast: bool) {
        ops::matmul::matmul_fp8(self, out, a, b, Some(c), s, scales, fast)
    }

    fn fp8_delayed_update(&mut self, states: View, stride: usize, margin: u32) {
        ops::fp8::delayed_update(self, states, stride, margin)
    }

    fn matmul_add(&mut self, out: View, a: View, b: View, c: View, s: MatMul) {
        ops::matmul::matmul_add(self, out, a, b, c, s)
    }

    fn embedding_forward(&mut self, out: View, table: View, tokens: IdxView, d: usize) {
        ops::embedding::forward(self, out, table, tokens, d)
    }

    fn embedding_backward(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize) {
        ops::embedding::backward(self, dtable, dout, tokens, d)
    }

    fn embedding_forward_slice(&mut self, out: View, table: View, tokens: IdxView, d: usize, first: usize) {
        ops::embedding::forward_slice(self, out, table, tokens, d, first)
    }

    fn embedding_backward_slice(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize, first: usize) {
        ops::embedding::backward_slice(self, dtable, dout, tokens, d, first)
    }

    fn rmsnorm_forward(&mut self, out: View, rstd: View, x: View, w: View, offset: f32, d: usize, eps: f32) {
        ops::rmsnorm::forward(self, out, rstd, x, w, offset, d, eps)
    }

    fn rmsnorm_backward(
        &mut self,
        dx: View,
        dw: View,
        dout: View,
        x: View,
        w: View,
        offset: f32,
        rstd: View,
        d: usize,
    ) {
        ops::rmsnorm::backward(self, dx, dw, dout, x, w, offset, rstd, d)
    }

    fn qk_norm_forward(&mut self, out: View, rstd: View, qkv: View, w: View, offset: f32, s: AttnShape, eps: f32) {
        ops::qknorm::forward(self, out, rstd, qkv, w, offset, s, eps)
    }

    fn qk_norm_backward(&mut self, dqkv: View, dw: View, qkv: View, w: View, offset: f32, rstd: View, s: AttnShape) {
        ops::qknorm::backward(self, dqkv, dw, qkv, w, offset, rstd, s)
    }

    fn rope(&mut self, qkv: View, rope: View, s: AttnShape, inverse: bool) {
        ops::rope::apply(self, qkv, rope, s, inverse)
    }

    fn mla_qkv_forward(&mut self, qkv: View, q: View, kv: View, kpe: View, table: View, s: MlaShape, q_scale: f32) {
        ops::mla::qkv_forward(self, qkv, q, kv, kpe, table, s, q_scale)
    }

    fn mla_qkv_backward(
        &mut self,
        dq: View,
        dkv: View,
        dkpe: View,
        dqkv: View,
        table: View,
        s: MlaShape,
        q_scale: f32,
    ) {
        ops::mla::qkv_backward(self, dq, dkv, dkpe, dqkv, table, s, q_scale)
    }

    fn heads_narrow(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize) {
        assert!(to <= from, "internal error: heads_narrow from {from} to {to} columns");
        ops::mla::heads_resize(self, out, x, rows, heads, from, to)
    }

    fn heads_widen(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize) {
        assert!(to >= from, "internal error: heads_widen from {from} to {to} columns");
        ops::mla::heads_resize(self, out, x, rows, heads, from, to)
    }

    fn attention_forward(&mut self, out: View, lse: View, qkv: View, s: AttnShape) {
        match self.attention {
            Attention::Native => ops::attention::forward(self, out, lse, qkv, s, SeqSplit::WHOLE, None),
            Attention::Cudnn => cudnn::forward(self, out, lse, qkv, s),
        }
    }

    fn attention_logit_max(&mut self, into: Option<View>) {
        assert!(
            into.is_none() || self.attention == Attention::Native,
            "internal error: logit maxima from cuDNN's attention"
        );
        self.logit_max = into;
    }

    fn attention_backward(&mut self, dqkv: View, dout: View, qkv: View, out: View, lse: View, s: AttnShape) {
        match self.attention {
            Attention::Native => ops::attention::backward(self, dqkv, dout, qkv, out, lse, s, SeqSplit::WHOLE, None),
            Attention::Cudnn => cudnn::backward(self, dqkv, dout, qkv, out, lse, s),
        }
    }

    fn document_bounds(&mut self, bounds: IdxView, positions: Option<IdxView>, tokens: IdxView, seq: usize, eos: u32) {
        ops::attention::document_bounds(self, bounds, positions, tokens, seq, eos)
    }

    // Document masking runs on the native kernels only: `select_attention` refuses cuDNN for it.
    fn attention_forward_docs(&mut self, out: View, lse: View, qkv: View, s: AttnShape, bounds: IdxView) {
        assert!(self.attention == Attention::Native, "internal error: document masking on cuDNN's attention");
        ops::attention::forward(self, out, lse, qkv, s, SeqSplit::WHOLE, Some(bounds))
    }

    fn attention_backward_docs(
        &mut self,
        dqkv: View,
        dout: View,
        qkv: View,
        out: View,
        lse: View,
        s: AttnShape,
        bounds: IdxView,
    ) {
        assert!(self.attention == Attention::Native, "internal error: document masking on cuDNN's attention");
        ops::attention::backward(self, dqkv, dout, qkv, out, lse, s, SeqSplit::WHOLE, Some(bounds))
    }

    // The epilogue reads and writes the native kernels' log-sum-exp, `[rows, heads]`. cuDNN's
    // statistics are the same natural-log values laid out `[batch, heads, seq]`, which the
    // kernels take (`LseLayout::BatchHeadsSeq`) given the sequence length, which these calls do
    // not carry yet: sinks need the native kernels until they do.
    fn attention_sinks_forward(&mut self, out: View, lse: View, sinks: View, heads: usize, head_dim: usize) {
        assert!(self.attention == Attention::Native, "internal error: attention sinks on cuDNN's attention");
        ops::sinks::forward(self, out, lse, sinks, heads, head_dim, ops::sinks::LseLayout::RowsHeads)
    }

    fn attention_sinks_backward(
        &mut self,
        dsinks: View,
        dout: View,
        out: View,
        lse: View,
        sinks: View,
        heads: usize,
        head_dim: usize,
    ) {
        assert!(self.attention == Attention::Native, "internal error: attention sinks on cuDNN's attention");
        let layout = ops::sinks::LseLayout::RowsHeads;
        ops::sinks::backward(self, dsinks, dout, out, lse, sinks, heads, head_dim, layout)
    }

    fn seq_chunk_multiple(&self) -> Option<usize> {
        Some(ops::attention::CHUNK_MULTIPLE)
    }

    fn document_bounds_split(
        &mut self,
        bounds: IdxView,
        positions: Option<IdxView>,
        tokens: IdxView,
        seq: usize,
        split: SeqSplit,
        eos: u32,
    ) {
        ops::attention::document_bounds_split(self, bounds, positions, tokens, seq, split, eos)
    }

    // A sequence axis runs on the native kernels, whatever `train.attention` chose: they take
    // the chunk offsets (cuDNN's graphs would need a mask per chunk pair). Forward and backward
    // both, so the log-sum-exp's layout is the one the backward pass reads.
    fn attention_forward_split(
        &mut self,
        out: View,
        lse: View,
        qkv_all: View,
        s: AttnShape,
        split: SeqSplit,
        bounds: Option<IdxView>,
    ) {
        match (split.ranks, bounds) {
            (1, Some(bounds)) => self.attention_forward_docs(out, lse, qkv_all, s, bounds),
            (1, None) => self.attention_forward(out, lse, qkv_all, s),
            _ => ops::attention::forward(self, out, lse, qkv_all, s, split, bounds),
        }
    }

    fn attention_backward_split(
        &mut self,
        dqkv_all: View,
        dout: View,
        qkv_all: View,
        out: View,
        lse: View,
        s: AttnShape,
        split: SeqSplit,
        bounds: Option<IdxView>,
    ) {
        match (split.ranks, bounds) {
            (1, Some(bounds)) => self.attention_backward_docs(dqkv_all, dout, qkv_all, out, lse, s, bounds),
            (1, None) => self.attention_backward(dqkv_all, dout, qkv_all, out, lse, s),
            _ => ops::attention::backward(self, dqkv_all, dout, qkv_all, out, lse, s, split, bounds),
        }
    }

    fn layernorm_forward(&mut self, out: View, mean: View, rstd: View, x: View, w: View, b: View, d: usize, eps: f32) {
        ops::layernorm::forward(self, out, mean, rstd, x, w, b, d, eps)
    }

    fn layernorm_backward(
        &mut self,
        dx: View,
        dw: View,
        db: View,
        dout: View,
        x: View,
        w: View,
        mean: View,
        rstd: View,
        d: usize,
    ) {
        ops::layernorm::backward(self, dx, dw, db, dout, x, w, mean, rstd, d)
    }

    fn softcap_forward(&mut self, x: View, cap: f32) {
        ops::elementwise::softcap_forward(self, x, cap)
    }

    fn softcap_backward(&mut self, dx: View, x: View, cap: f32) {
        ops::elementwise::softcap_backward(self, dx, x, cap)
    }

    fn gelu_forward(&mut self, h: View, u: View, tanh: bool) {
        ops::gelu::forward(self, h, u, tanh)
    }

    fn gelu_backward(&mut self, du: View, dh: View, u: View, tanh: bool) {
        ops::gelu::backward(self, du, dh, u, tanh)
    }

    fn swiglu_forward(&mut self, h: View, gu: View, f: usize) {
        ops::swiglu::forward(self, h, gu, f)
    }

    fn swiglu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize) {
        ops::swiglu::backward(self, dgu, dh, gu, f)
    }

    fn glu_forward(&mut self, h: View, gu: View, f: usize, kind: Glu) {
        ops::swiglu::glu_forward(self, h, gu, f, kind)
    }

    fn glu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize, kind: Glu) {
        ops::swiglu::glu_backward(self, dgu, dh, gu, f, kind)
    }

    fn cross_entropy(&mut self, losses: View, logits: View, targets: IdxView, v: usize, grad_scale: Option<f32>) {
        ops::cross_entropy::cross_entropy(self, losses, logits, targets, v, grad_scale)
    }

    fn cross_entropy_max(&mut self, max: View, logits: View, v: usize) {
        ops::cross_entropy::max(self, max, logits, v)
    }

    fn cross_entropy_partials(
        &mut self,
        sums: View,
        logits: View,
        max: View,
        targets: IdxView,
        v: usize,
        first: usize,
    ) {
        ops::cross_entropy::partials(self, sums, logits, max, targets, v, first)
    }

    fn cross_entropy_finish(
        &mut self,
        losses: View,
        logits: View,
        max: View,
        sums: View,
        targets: IdxView,
        v: usize,
        first: usize,
        grad_scale: Option<f32>,
    ) {
        ops::cross_entropy::finish(self, losses, logits, max, sums, targets, v, first, grad_scale)
    }

    fn moe_route(&mut self, probs: View, router_logits: View, d: MoeDispatch) {
        ops::moe::route(self, probs, router_logits, d)
    }

    fn moe_gather(&mut self, xe: View, x: View, d: MoeDispatch, width: usize) {
        ops::moe::gather(self, xe, x, d, width)
    }

    fn moe_gather_backward(&mut self, dx: View, dxe: View, d: MoeDispatch, width: usize) {
        ops::moe::gather_backward(self, dx, dxe, d, width)
    }

    fn moe_expert_matmul(&mut self, out: View, a: View, weights: ExpertWeights, d: MoeDispatch, s: MatMul) {
        ops::gemm::expert_matmul(self, out, a, weights, d, s, None)
    }

    fn moe_expert_matmul_fp8(
        &mut self,
        out: View,
        a: View,
        weights: ExpertWeights,
        d: MoeDispatch,
        s: MatMul,
        scales: [fp8::State; 2],
    ) {
        ops::gemm::expert_matmul(self, out, a, weights, d, s, Some(scales))
    }

    fn moe_expert_matmul_dw_fp8(
        &mut self,
        dweights: ExpertWeights,
        dy: View,
        x: View,
        d: MoeDispatch,
        (inp, out): (usize, usize),
        scales: [fp8::State; 2],
    ) {
        ops::gemm::expert_matmul_dw(self, dweights, dy, x, d, inp, out, Some(scales))
    }

    fn moe_expert_matmul_dw(
        &mut self,
        dweights: ExpertWeights,
        dy: View,
        x: View,
        d: MoeDispatch,
        inp: usize,
        out: usize,
    ) {
        ops::gemm::expert_matmul_dw(self, dweights, dy, x, d, inp, out, None)
    }

    fn moe_expert_bias(&mut self, out: View, bias: ExpertWeights, d: MoeDispatch, width: usize) {
        ops::moe::expert_bias(self, out, bias, d, width)
    }

    fn moe_expert_bias_backward(&mut self, dbias: ExpertWeights, dout: View, d: MoeDispatch, width: usize) {
        ops::moe::expert_bias_backward(self, dbias, dout, d, width)
    }

    fn moe_combine(&mut self, out: View, ye: View, d: MoeDispatch, width: usize) {
        ops::moe::combine(self, out, ye, d, width)
    }

    fn moe_combine_backward(&mut self, dye: View, dweight: View, dout: View, ye: View, d: MoeDispatch, width: usize) {
        ops::moe::combine_backward(self, dye, dweight, dout, ye, d, width)
    }

    fn moe_route_backward(
        &mut self,
        drouter: View,
        dweight: View,
        probs: View,
        d: MoeDispatch,
        counts: View,
        aux_scale: f32,
    ) {
        ops::moe::route_backward(self, drouter, dweight, probs, d, counts, aux_scale)
    }

    fn moe_pack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize) {
        ops::moe::parts(self, src, dst, offsets, parts, width, false)
    }

    fn moe_unpack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize) {
        ops::moe::parts(self, dst, src, offsets, parts, width, true)
    }

    fn moe_counts(&mut self, counts: View, offsets: IdxView) {
        ops::moe::counts(self, counts, offsets)
    }

    fn moe_runs(&mut self, runs: IdxView, counts: View, parts: Parts) {
        ops::moe::runs(self, runs, counts, parts)
    }

    fn moe_load_excess(&mut self, dst: View, counts: View) {
        ops::moe::load_excess(self, dst, counts)
    }

    fn moe_bias_step(&mut self, bias: View, excess: View, rate: f32) {
        ops::moe::bias_step(self, bias, excess, rate)
    }

    fn adamw(
        &mut self,
        params: View,
        grads: View,
        m: View,
        v: View,
        norm_squared: View,
        segments: &[Segment],
        step: AdamWStep,
    ) {
        ops::adamw::step(self, params, grads, m, v, norm_squared, segments, step)
    }

    fn adamw_fp8(
        &mut self,
        params: View,
        grads: View,
        moments: (View, View),
        norm_squared: View,
        segments: &[Segment],
        step: AdamWStep,
        casts: &[crate::backend::fp8::WeightCast],
    ) {
        ops::fp8::adamw(self, params, grads, moments, norm_squared, segments, step, casts)
    }

    fn muon_momentum(&mut self, grads: View, buf: View, norm_squared: View, step: MuonMomentum) {
        ops::muon::momentum(self, grads, buf, norm_squared, step)
    }

    fn divide_by_norm(&mut self, x: View, sum_squares: View, eps: f32) {
        ops::muon::divide_by_norm(self, x, sum_squares, eps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_checks_name_the_key() {
        let m = ModelConfig { head_dim: 6, ..ModelConfig::default() };
        assert!(check_model(&m).unwrap_err().to_string().contains("model.head_dim = 6"));
        // Heads up to 256: DeepSeek-V3's latent attention packs 192, Gemma 3's are 256.
        for head_dim in [8, 128, 136, 192, 200, 256] {
            assert!(check_model(&ModelConfig { head_dim, ..ModelConfig::default() }).is_ok(), "{head_dim}");
        }
        let e = check_model(&ModelConfig { head_dim: 264, ..ModelConfig::default() }).unwrap_err().to_string();
        assert!(e.contains("model.head_dim = 264") && e.contains("up to 256"), "{e}");
        assert!(check_model(&ModelConfig { head_dim: 196, ..ModelConfig::default() }).is_err());
    }

    #[test]
    fn a_selection_bias_under_fsdp_is_refused_by_name() {
        let overrides = crate::config::Override::from_list("mesh.ici_data=1 mesh.ici_fsdp=2", "test");
        let c = crate::config::resolve("tiny-deepseek-v3", &overrides).unwrap().config;
        let e = check_run(&c).unwrap_err().to_string();
        assert!(e.contains("model.moe.selection_bias") && e.contains("mesh.ici_fsdp = 2"), "{e}");
        let c = crate::config::resolve("tiny-deepseek-v3", &[]).unwrap().config;
        assert!(check_run(&c).is_ok());
    }
}
