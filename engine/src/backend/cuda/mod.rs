//! The CUDA backend: bf16 training on NVIDIA GPUs (compute capability 8.0 and newer).
//!
//! Precision: activations and the compute copy of the parameters are bf16; the master weights,
//! gradients, AdamW moments and every statistic (norm and softmax statistics, losses, routing
//! weights) are f32; every product and reduction accumulates in f32 (or f64). A
//! [`BufKind::Params`] buffer is two allocations: the f32 master, which uploads, downloads and
//! the optimizer use, and its bf16 copy, which the ops read; AdamW refreshes the copy as it
//! updates the master.
//!
//! Work: dense products go through cuBLASLt ([`blas`]); everything else is CUDA C compiled at
//! start by NVRTC for the device's architecture and cached on disk ([`kernels`], [`nvrtc`]). All
//! work is issued on one stream and nothing waits for the device except [`Backend::download`]
//! and [`Backend::synchronize`]. A section ([`Backend::begin_section`]) runs eagerly once, is
//! captured as a CUDA graph the second time, and is replayed from then on.
//!
//! Libraries are loaded at run time ([`device`]): the engine builds and runs without CUDA.

mod blas;
pub mod device;
mod driver;
pub mod emulator;
pub mod kernels;
pub mod nvrtc;

use std::collections::HashMap;

use cudarc::driver::sys::{self, CUdeviceptr};

use super::{AdamWStep, AttnShape, Backend, BufKind, ExpertWeights, IdxView, MatMul, MoeDispatch, Segment, View, gib};
use crate::config::ModelConfig;
use blas::Gemm;
pub use device::DeviceInfo;

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
    fn alloc(&mut self, bytes: usize) -> Result<CUdeviceptr, String>;
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
    /// Free and total device memory in bytes.
    fn memory(&self) -> (usize, usize);
    /// The stream all work goes to, for a library that issues work itself (NCCL); none on
    /// the emulator.
    fn stream(&self) -> Option<sys::CUstream> {
        None
    }
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
}

impl DType {
    fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }
}

/// Bytes of one element of each buffer kind on the GPU (parameters: the f32 master plus its
/// bf16 copy).
pub fn bytes_per_element(kind: BufKind) -> usize {
    match kind {
        BufKind::Params => 6,
        BufKind::Activations => 2,
        BufKind::Grads | BufKind::OptState | BufKind::Scalars => 4,
    }
}

/// Why a model cannot train on this backend, if it cannot.
pub fn check_model(m: &ModelConfig) -> Result<(), String> {
    if !m.head_dim.is_multiple_of(8) || m.head_dim > kernels::MAX_HEAD_DIM {
        return Err(format!(
            "model.head_dim = {}: the CUDA attention kernels take a multiple of 8 up to {}; use --device cpu",
            m.head_dim,
            kernels::MAX_HEAD_DIM
        ));
    }
    if let Some(moe) = &m.moe
        && moe.num_experts > kernels::MAX_EXPERTS
    {
        return Err(format!(
            "model.moe.num_experts = {}: the CUDA routing kernels take at most {}; use --device cpu",
            moe.num_experts,
            kernels::MAX_EXPERTS
        ));
    }
    Ok(())
}

/// Device memory the backend allocates for itself, beyond the views it hands out, for a model
/// at a batch shape: the cuBLASLt workspace, the reduction partials, the RMSNorm weight-gradient
/// partials and the attention backward pass's f32 dQ accumulator and D.
pub fn scratch_bytes(m: &ModelConfig, batch: usize, seq: usize, sm_count: usize) -> usize {
    let rows = batch * seq;
    let (norm_blocks, _) = norm_backward_blocks(rows, sm_count);
    blas::WORKSPACE_BYTES
        + sum_blocks(sm_count) * 8
        + norm_blocks * m.d_model * 4
        + rows * m.n_heads * (m.head_dim + 1) * 4
}

/// Most blocks of the first pass of a sum: eight per multiprocessor (the grid depends on the
/// element count and the device only, so a sum is deterministic on a given device).
fn sum_blocks(sm_count: usize) -> usize {
    (8 * sm_count).clamp(8, 1024)
}

/// Blocks and rows per block of the RMSNorm backward pass (two blocks per multiprocessor).
fn norm_backward_blocks(rows: usize, sm_count: usize) -> (usize, usize) {
    let target = (2 * sm_count).clamp(1, rows.max(1));
    let per_block = rows.div_ceil(target).max(1);
    (rows.div_ceil(per_block).max(1), per_block)
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

/// The CUDA backend on one device. See the [module documentation](self).
pub struct Cuda {
    bufs: Vec<Buffer>,
    idx: Vec<(CUdeviceptr, usize)>,
    scratch: [(CUdeviceptr, usize); SCRATCH_KINDS],
    adam_runs: Vec<u64>,
    sections: HashMap<u32, Section>,
    capturing: bool,
    allocated: usize,
    dev: Box<dyn Device>,
}

impl Cuda {
    /// Opens GPU `ordinal`: checks the driver, the device and the libraries, and compiles (or
    /// loads from the cache) every kernel module for the device's architecture.
    pub fn new(ordinal: usize) -> Result<Cuda, String> {
        Ok(Cuda::on(Box::new(driver::Gpu::open(ordinal)?)))
    }

    /// The backend on the CPU emulator: the same kernels and host code, no GPU (slow; tests).
    pub fn emulated() -> Result<Cuda, String> {
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
            allocated: blas::WORKSPACE_BYTES,
            dev,
        }
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        self.dev.info()
    }

    /// Dense bf16 peak of the device in TFLOP/s, from [`device::PEAK_BF16_TFLOPS`].
    pub fn peak_tflops(&self) -> Option<f64> {
        device::peak_tflops(&self.dev.info().name)
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
        ptr
    }

    /// For a communication library that works in place on this backend's stream: the address
    /// of a view's exact values (f32, or bf16 for activations), whether they are bf16, and the
    /// stream (none on the emulator). After writing into a view, call [`Cuda::written`].
    pub fn raw_view(&self, v: View) -> (CUdeviceptr, bool, Option<sys::CUstream>) {
        let (ptr, dtype) = self.exact(v);
        (ptr, dtype == DType::Bf16, self.dev.stream())
    }

    /// Tells the backend that `v` was written behind its back ([`Cuda::raw_view`]).
    pub fn written(&mut self, v: View) {
        self.refresh_compute_copy(v);
    }

    fn buffer(&self, v: View) -> &Buffer {
        let b = &self.bufs[v.buf.0 as usize];
        assert!(v.offset + v.len <= b.len, "internal error: view {v:?} outside its buffer of {}", b.len);
        b
    }

    /// Element type the ops read from a view (parameters: their bf16 copy).
    fn dtype(&self, v: View) -> DType {
        match self.buffer(v).kind {
            BufKind::Params | BufKind::Activations => DType::Bf16,
            _ => DType::F32,
        }
    }

    /// Address the ops read from (parameters: the bf16 copy).
    fn ptr(&self, v: View) -> CUdeviceptr {
        let b = self.buffer(v);
        match b.kind {
            BufKind::Params => b.compute + 2 * v.offset as u64,
            BufKind::Activations => b.ptr + 2 * v.offset as u64,
            _ => b.ptr + 4 * v.offset as u64,
        }
    }

    /// Address and type of a view's exact values (parameters: the f32 master).
    fn exact(&self, v: View) -> (CUdeviceptr, DType) {
        let b = self.buffer(v);
        match b.kind {
            BufKind::Activations => (b.ptr + 2 * v.offset as u64, DType::Bf16),
            _ => (b.ptr + 4 * v.offset as u64, DType::F32),
        }
    }

    /// A view the op writes: its address and type, for any kind but parameters.
    fn out(&self, v: View, op: &str) -> CUdeviceptr {
        assert!(self.buffer(v).kind != BufKind::Params, "internal error: {op} writes into the parameters");
        self.ptr(v)
    }

    /// After a write into a parameter view's master: refresh its bf16 copy.
    fn refresh_compute_copy(&mut self, v: View) {
        if self.buffer(v).kind == BufKind::Params && v.len > 0 {
            let (master, _) = self.exact(v);
            let compute = self.ptr(v);
            self.launch_1d("copy_bf16_f32", v.len as u64, &[Arg::P(compute), Arg::P(master), Arg::U(v.len as u64)]);
        }
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
        if grid.0 > 0 && grid.1 > 0 && grid.2 > 0 {
            self.dev.launch(name, grid, block, smem, &mut slots);
        }
    }

    /// A grid-stride launch over `n` items, 256 threads a block.
    fn launch_1d(&mut self, name: &'static str, n: u64, args: &[Arg]) {
        let cap = 32 * self.dev.info().sm_count.max(1) as u64;
        self.launch(name, (n.div_ceil(256).clamp(1, cap) as u32, 1, 1), 256, 0, args);
    }

    /// Threads for a block that walks a row of `items` in strides: a multiple of 32, 32 to 256.
    fn row_threads(items: usize) -> u32 {
        (items.div_ceil(32) * 32).clamp(32, 256) as u32
    }

    fn aligned16(ptrs: &[CUdeviceptr]) -> bool {
        ptrs.iter().all(|p| p % 16 == 0)
    }

    fn i32(x: usize, what: &str) -> i32 {
        i32::try_from(x).unwrap_or_else(|_| panic!("internal error: {what} = {x} does not fit the kernels' int"))
    }

    fn sum_impl(&mut self, out: View, x: View, squares: bool) {
        self.expect(out, DType::F32, "sum", "out");
        let out_ptr = self.out(out.at(0, 1), "sum");
        let (xp, t) = self.exact(x);
        let most = sum_blocks(self.dev.info().sm_count as usize);
        let parts = self.scratch(Scratch::SumPartials, most * 8);
        let blocks = (x.len as u64).div_ceil(256).clamp(1, most as u64) as u32;
        let name = match (t, squares) {
            (DType::F32, false) => "sum_partials_f32",
            (DType::Bf16, false) => "sum_partials_bf16",
            (DType::F32, true) => "sumsq_partials_f32",
            (DType::Bf16, true) => "sumsq_partials_bf16",
        };
        self.launch(name, (blocks, 1, 1), 256, 0, &[Arg::P(xp), Arg::U(x.len as u64), Arg::P(parts)]);
        self.launch("sum_finish", (1, 1, 1), 256, 0, &[Arg::P(parts), Arg::I(blocks as i32), Arg::P(out_ptr)]);
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
        format!("cuda:{} {} (sm_{}{}, {:.0} GiB)", i.ordinal, i.name, i.capability.0, i.capability.1, gib(i.memory))
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
        let ptr = self.device_alloc(len * if kind == BufKind::Activations { 2 } else { 4 }, &format!("{kind:?}"));
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
            DType::Bf16 => {
                let host: Vec<u16> = src.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                self.dev.upload(ptr, bytes_of(&host))
            }
        }
        self.refresh_compute_copy(dst);
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
                let mut host = vec![0u16; dst.len()];
                self.dev.download(bytes_of_mut(&mut host), ptr);
                for (d, h) in dst.iter_mut().zip(&host) {
                    *d = half::bf16::from_bits(*h).to_f32();
                }
            }
        }
    }

    fn download_idx(&mut self, src: IdxView, dst: &mut [u32]) {
        assert_eq!(src.len, dst.len(), "internal error: download length");
        self.sync_check("download_idx");
        let ptr = self.iptr(src);
        self.dev.download(bytes_of_mut(dst), ptr);
    }

    fn fill(&mut self, dst: View, value: f32) {
        let (ptr, t) = self.exact(dst);
        let name = if t == DType::F32 { "fill_f32" } else { "fill_bf16" };
        self.launch_1d(name, dst.len as u64, &[Arg::P(ptr), Arg::U(dst.len as u64), Arg::F(value)]);
        self.refresh_compute_copy(dst);
    }

    fn copy(&mut self, dst: View, src: View) {
        assert_eq!(dst.len, src.len, "internal error: copy length");
        assert!(!dst.overlaps(src), "internal error: copy onto itself");
        let ((dp, dt), (sp, st)) = (self.exact(dst), self.exact(src));
        match (dt, st) {
            _ if dt == st => self.dev.copy(dp, sp, dst.len * dt.size()),
            (DType::Bf16, _) => {
                self.launch_1d("copy_bf16_f32", dst.len as u64, &[Arg::P(dp), Arg::P(sp), Arg::U(dst.len as u64)])
            }
            (DType::F32, _) => {
                self.launch_1d("copy_f32_bf16", dst.len as u64, &[Arg::P(dp), Arg::P(sp), Arg::U(dst.len as u64)])
            }
        }
        self.refresh_compute_copy(dst);
    }

    fn add(&mut self, dst: View, src: View) {
        assert_eq!(dst.len, src.len, "internal error: add length");
        let ((dp, dt), (sp, st)) = (self.exact(dst), self.exact(src));
        let name = match (dt, st) {
            (DType::F32, DType::F32) => "add_f32_f32",
            (DType::F32, DType::Bf16) => "add_f32_bf16",
            (DType::Bf16, DType::F32) => "add_bf16_f32",
            (DType::Bf16, DType::Bf16) => "add_bf16_bf16",
        };
        self.launch_1d(name, dst.len as u64, &[Arg::P(dp), Arg::P(sp), Arg::U(dst.len as u64)]);
        self.refresh_compute_copy(dst);
    }

    fn sum(&mut self, out: View, x: View) {
        self.sum_impl(out, x, false);
    }

    fn sum_squares(&mut self, out: View, x: View) {
        self.sum_impl(out, x, true);
    }

    fn matmul(&mut self, out: View, a: View, b: View, s: MatMul) {
        assert_eq!(a.len, s.m * s.k, "internal error: matmul: a is not {}x{}", s.m, s.k);
        assert_eq!(b.len, s.k * s.n, "internal error: matmul: b is not {}x{}", s.k, s.n);
        assert_eq!(out.len, s.m * s.n, "internal error: matmul: out is not {}x{}", s.m, s.n);
        let inputs = self.dtype(a);
        self.expect(b, inputs, "matmul", "b (the same type as a)");
        let (o, ot) = (self.out(out, "matmul"), self.dtype(out));
        assert!(inputs == DType::Bf16 || ot == DType::F32, "internal error: matmul of f32 operands into bf16");
        if s.k == 0 {
            if !s.accumulate {
                self.fill(out, 0.0);
            }
            return;
        }
        let (ap, bp) = (self.ptr(a), self.ptr(b));
        self.dev.gemm(&Gemm::row_major(s, o, ap, bp, inputs, ot));
    }

    fn matmul_add(&mut self, out: View, a: View, b: View, c: View, s: MatMul) {
        assert_eq!(c.len, out.len, "internal error: matmul_add: c and out differ in length");
        assert_eq!(self.dtype(c), self.dtype(out), "internal error: matmul_add: c and out differ in type");
        assert!(!c.overlaps(out) || c == out, "internal error: matmul_add: c overlaps out");
        assert_eq!(a.len, s.m * s.k, "internal error: matmul_add: a is not {}x{}", s.m, s.k);
        assert_eq!(b.len, s.k * s.n, "internal error: matmul_add: b is not {}x{}", s.k, s.n);
        let inputs = self.dtype(a);
        self.expect(b, inputs, "matmul_add", "b (the same type as a)");
        let (o, cp) = (self.out(out, "matmul_add"), self.ptr(c));
        let (ap, bp) = (self.ptr(a), self.ptr(b));
        let mut g = Gemm::row_major(s.accumulating(), o, ap, bp, inputs, self.dtype(out));
        g.c = cp;
        self.dev.gemm(&g);
    }

    fn embedding_forward(&mut self, out: View, table: View, tokens: IdxView, d: usize) {
        self.expect(out, DType::Bf16, "embedding_forward", "out");
        self.expect(table, DType::Bf16, "embedding_forward", "table");
        assert_eq!(out.len, tokens.len * d, "internal error: embedding_forward: out length");
        let (o, t, tok) = (self.out(out, "embedding_forward"), self.ptr(table), self.iptr(tokens));
        let v8 = d.is_multiple_of(8) && Self::aligned16(&[o, t]);
        let name = if v8 { "embedding_forward_v8" } else { "embedding_forward" };
        let threads = Self::row_threads(if v8 { d / 8 } else { d });
        let args = [Arg::P(o), Arg::P(t), Arg::P(tok), Arg::I(Self::i32(d, "d")), Arg::U((table.len / d) as u64)];
        self.launch(name, (tokens.len as u32, 1, 1), threads, 0, &args);
    }

    fn embedding_backward(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize) {
        self.expect(dtable, DType::F32, "embedding_backward", "dtable");
        self.expect(dout, DType::Bf16, "embedding_backward", "dout");
        let (dt, g, tok) = (self.out(dtable, "embedding_backward"), self.ptr(dout), self.iptr(tokens));
        let args = [Arg::P(dt), Arg::P(g), Arg::P(tok), Arg::I(Self::i32(d, "d")), Arg::U((dtable.len / d) as u64)];
        self.launch("embedding_backward", (tokens.len as u32, 1, 1), Self::row_threads(d), 0, &args);
    }

    fn rmsnorm_forward(&mut self, out: View, rstd: View, x: View, w: View, d: usize, eps: f32) {
        for (v, name) in [(out, "out"), (x, "x"), (w, "w")] {
            self.expect(v, DType::Bf16, "rmsnorm_forward", name);
        }
        self.expect(rstd, DType::F32, "rmsnorm_forward", "rstd");
        let rows = x.len / d;
        assert_eq!(rstd.len, rows, "internal error: rmsnorm_forward: rstd length");
        let (o, r, xp, wp) = (self.out(out, "rmsnorm"), self.out(rstd, "rmsnorm"), self.ptr(x), self.ptr(w));
        let v8 = d.is_multiple_of(8) && Self::aligned16(&[o, xp, wp]);
        let name = if v8 { "rmsnorm_forward_v8" } else { "rmsnorm_forward" };
        let threads = Self::row_threads(if v8 { d / 8 } else { d });
        let args = [Arg::P(o), Arg::P(r), Arg::P(xp), Arg::P(wp), Arg::I(Self::i32(d, "d")), Arg::F(eps)];
        self.launch(name, (rows as u32, 1, 1), threads, 0, &args);
    }

    fn rmsnorm_backward(&mut self, dx: View, dw: View, dout: View, x: View, w: View, rstd: View, d: usize) {
        for (v, name) in [(dx, "dx"), (dout, "dout"), (x, "x"), (w, "w")] {
            self.expect(v, DType::Bf16, "rmsnorm_backward", name);
        }
        self.expect(dw, DType::F32, "rmsnorm_backward", "dw");
        self.expect(rstd, DType::F32, "rmsnorm_backward", "rstd");
        let rows = x.len / d;
        let (blocks, per_block) = norm_backward_blocks(rows, self.dev.info().sm_count as usize);
        let partial = self.scratch(Scratch::NormPartials, blocks * d * 4);
        let (dxp, dwp) = (self.out(dx, "rmsnorm_backward"), self.out(dw, "rmsnorm_backward"));
        let (g, xp, wp, r) = (self.ptr(dout), self.ptr(x), self.ptr(w), self.ptr(rstd));
        let v8 = d.is_multiple_of(8) && Self::aligned16(&[dxp, g, xp, wp]);
        let name = if v8 { "rmsnorm_backward_v8" } else { "rmsnorm_backward" };
        let threads = Self::row_threads(if v8 { d / 8 } else { d });
        let di = Self::i32(d, "d");
        let args = [
            Arg::P(dxp),
            Arg::P(partial),
            Arg::P(g),
            Arg::P(xp),
            Arg::P(wp),
            Arg::P(r),
            Arg::U(rows as u64),
            Arg::I(di),
            Arg::I(per_block as i32),
        ];
        self.launch(name, (blocks as u32, 1, 1), threads, d * 4, &args);
        let args = [Arg::P(dwp), Arg::P(partial), Arg::I(blocks as i32), Arg::I(di)];
        self.launch_1d("rmsnorm_dw_finish", d as u64, &args);
    }

    fn rope(&mut self, qkv: View, rope: View, s: AttnShape, inverse: bool) {
        self.expect(qkv, DType::Bf16, "rope", "qkv");
        self.expect(rope, DType::F32, "rope", "table");
        assert_eq!(qkv.len, s.rows() * s.qkv_width(), "internal error: rope: qkv length");
        assert!(rope.len >= s.seq * s.head_dim, "internal error: RoPE table shorter than the sequence");
        let heads = s.n_heads + s.n_kv_heads;
        let (q, t) = (self.out(qkv, "rope"), self.ptr(rope));
        let args = [
            Arg::P(q),
            Arg::P(t),
            Arg::U(s.rows() as u64),
            Arg::I(Self::i32(s.seq, "seq")),
            Arg::I(heads as i32),
            Arg::I(s.head_dim as i32),
            Arg::I(Self::i32(s.qkv_width(), "qkv width")),
            Arg::F(if inverse { -1.0 } else { 1.0 }),
        ];
        self.launch_1d("rope", (s.rows() * heads * s.head_dim / 2) as u64, &args);
    }

    fn attention_forward(&mut self, out: View, lse: View, qkv: View, s: AttnShape) {
        self.expect(out, DType::Bf16, "attention_forward", "out");
        self.expect(qkv, DType::Bf16, "attention_forward", "qkv");
        self.expect(lse, DType::F32, "attention_forward", "lse");
        assert_eq!(qkv.len, s.rows() * s.qkv_width(), "internal error: attention_forward: qkv length");
        assert_eq!(out.len, s.rows() * s.q_width(), "internal error: attention_forward: out length");
        assert_eq!(lse.len, s.rows() * s.n_heads, "internal error: attention_forward: lse length");
        let hd = kernels::attention_hd(s.head_dim);
        let name = match hd {
            16 => "attention_forward_hd16",
            32 => "attention_forward_hd32",
            64 => "attention_forward_hd64",
            _ => "attention_forward_hd128",
        };
        let (o, l, q) = (self.out(out, "attention"), self.out(lse, "attention"), self.ptr(qkv));
        assert!(Self::aligned16(&[o, q]), "internal error: attention rows must start 16-byte aligned");
        let args = [
            Arg::P(o),
            Arg::P(l),
            Arg::P(q),
            Arg::I(Self::i32(s.seq, "seq")),
            Arg::I(s.n_heads as i32),
            Arg::I(s.n_kv_heads as i32),
            Arg::I(s.head_dim as i32),
            Arg::I(Self::i32(s.window, "window")),
            Arg::F(1.0 / (s.head_dim as f32).sqrt()),
        ];
        let grid = (s.seq.div_ceil(64) as u32, s.n_heads as u32, s.batch as u32);
        self.launch(name, grid, 128, kernels::attention_forward_smem(hd), &args);
    }

    fn attention_backward(&mut self, dqkv: View, dout: View, qkv: View, out: View, lse: View, s: AttnShape) {
        for (v, name) in [(dqkv, "dqkv"), (dout, "dout"), (qkv, "qkv"), (out, "out")] {
            self.expect(v, DType::Bf16, "attention_backward", name);
        }
        self.expect(lse, DType::F32, "attention_backward", "lse");
        assert_eq!(dqkv.len, s.rows() * s.qkv_width(), "internal error: attention_backward: dqkv length");
        let (rows, heads, dh) = (s.rows(), s.n_heads, s.head_dim);
        let big_d = self.scratch(Scratch::AttnD, rows * heads * 4);
        let dq = self.scratch(Scratch::AttnDq, rows * heads * dh * 4);
        let (dqkv_p, g, q, o, l) =
            (self.out(dqkv, "attention"), self.ptr(dout), self.ptr(qkv), self.ptr(out), self.ptr(lse));
        assert!(Self::aligned16(&[dqkv_p, g, q, o]), "internal error: attention rows must start 16-byte aligned");
        let args = [Arg::P(big_d), Arg::P(g), Arg::P(o), Arg::U(rows as u64), Arg::I(heads as i32), Arg::I(dh as i32)];
        self.launch("attention_backward_dot", (((rows * heads) as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
        self.dev.zero_u32(dq, rows * heads * dh);
        let hd = kernels::attention_hd(dh);
        let name = match hd {
            16 => "attention_backward_hd16",
            32 => "attention_backward_hd32",
            64 => "attention_backward_hd64",
            _ => "attention_backward_hd128",
        };
        let scale = 1.0 / (dh as f32).sqrt();
        let args = [
            Arg::P(dqkv_p),
            Arg::P(dq),
            Arg::P(g),
            Arg::P(q),
            Arg::P(l),
            Arg::P(big_d),
            Arg::I(Self::i32(s.seq, "seq")),
            Arg::I(heads as i32),
            Arg::I(s.n_kv_heads as i32),
            Arg::I(dh as i32),
            Arg::I(Self::i32(s.window, "window")),
            Arg::F(scale),
        ];
        let grid = (s.seq.div_ceil(64) as u32, s.n_kv_heads as u32, s.batch as u32);
        self.launch(name, grid, 128, kernels::attention_backward_smem(hd), &args);
        let args = [
            Arg::P(dqkv_p),
            Arg::P(dq),
            Arg::U(rows as u64),
            Arg::I(Self::i32(s.q_width(), "q width")),
            Arg::U(s.qkv_width() as u64),
            Arg::F(scale),
        ];
        self.launch_1d("attention_backward_dq", (rows * s.q_width()) as u64, &args);
    }

    fn swiglu_forward(&mut self, h: View, gu: View, f: usize) {
        self.expect(h, DType::Bf16, "swiglu_forward", "h");
        self.expect(gu, DType::Bf16, "swiglu_forward", "gu");
        assert_eq!(gu.len, 2 * h.len, "internal error: swiglu_forward lengths");
        let (hp, g) = (self.out(h, "swiglu"), self.ptr(gu));
        let v8 = f.is_multiple_of(8) && Self::aligned16(&[hp, g]);
        let (name, per) = if v8 { ("swiglu_forward_v8", 8) } else { ("swiglu_forward", 1) };
        let n = h.len / f;
        self.launch_1d(
            name,
            (h.len / per) as u64,
            &[Arg::P(hp), Arg::P(g), Arg::U(n as u64), Arg::I(Self::i32(f, "f"))],
        );
    }

    fn swiglu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize) {
        for (v, name) in [(dgu, "dgu"), (dh, "dh"), (gu, "gu")] {
            self.expect(v, DType::Bf16, "swiglu_backward", name);
        }
        assert_eq!(dgu.len, gu.len, "internal error: swiglu_backward lengths");
        let (d, g, u) = (self.out(dgu, "swiglu"), self.ptr(dh), self.ptr(gu));
        let v8 = f.is_multiple_of(8) && Self::aligned16(&[d, g, u]);
        let (name, per) = if v8 { ("swiglu_backward_v8", 8) } else { ("swiglu_backward", 1) };
        let n = dh.len / f;
        let args = [Arg::P(d), Arg::P(g), Arg::P(u), Arg::U(n as u64), Arg::I(Self::i32(f, "f"))];
        self.launch_1d(name, (dh.len / per) as u64, &args);
    }

    fn cross_entropy(&mut self, losses: View, logits: View, targets: IdxView, v: usize, grad_scale: Option<f32>) {
        self.expect(losses, DType::F32, "cross_entropy", "losses");
        self.expect(logits, DType::Bf16, "cross_entropy", "logits");
        assert_eq!(logits.len, losses.len * v, "internal error: cross_entropy: logits length");
        assert_eq!(targets.len, losses.len, "internal error: cross_entropy: targets length");
        let (l, z, t) = (self.out(losses, "cross_entropy"), self.out(logits, "cross_entropy"), self.iptr(targets));
        let v8 = v.is_multiple_of(8) && Self::aligned16(&[z]);
        let name = if v8 { "cross_entropy_v8" } else { "cross_entropy" };
        let threads = Self::row_threads(if v8 { v / 8 } else { v });
        let args = [
            Arg::P(l),
            Arg::P(z),
            Arg::P(t),
            Arg::U(v as u64),
            Arg::F(grad_scale.unwrap_or(0.0)),
            Arg::I(grad_scale.is_some() as i32),
        ];
        self.launch(name, (losses.len as u32, 1, 1), threads, 0, &args);
    }

    fn moe_route(&mut self, probs: View, router_logits: View, d: MoeDispatch) {
        for (v, name) in [(probs, "probs"), (router_logits, "router_logits"), (d.weight, "weight"), (d.stats, "stats")]
        {
            self.expect(v, DType::F32, "moe_route", name);
        }
        assert!(d.experts <= kernels::MAX_EXPERTS, "internal error: {} experts", d.experts);
        let (n, e, k) = (d.tokens, d.experts, d.top_k);
        let (p, z, w, ex) = (
            self.out(probs, "moe_route"),
            self.ptr(router_logits),
            self.out(d.weight, "moe_route"),
            self.iptr(d.expert),
        );
        let (ei, ki) = (e as i32, k as i32);
        let args = [Arg::P(p), Arg::P(w), Arg::P(ex), Arg::P(z), Arg::U(n as u64), Arg::I(ei), Arg::I(ki)];
        self.launch("moe_route", ((n as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
        let (sr, rs, off) = (self.iptr(d.slot_row), self.iptr(d.row_slot), self.iptr(d.offsets));
        let args = [Arg::P(sr), Arg::P(rs), Arg::P(off), Arg::P(ex), Arg::U((n * k) as u64), Arg::I(ei)];
        self.launch("moe_dispatch", (1, 1, 1), 1024, 34 * e * 4, &args);
        let st = self.out(d.stats, "moe_route");
        let args = [Arg::P(st), Arg::P(off), Arg::P(p), Arg::U(n as u64), Arg::I(ei)];
        self.launch("moe_stats", (e as u32, 1, 1), 256, 0, &args);
    }

    fn moe_gather(&mut self, xe: View, x: View, d: MoeDispatch, width: usize) {
        self.expect(xe, DType::Bf16, "moe_gather", "xe");
        self.expect(x, DType::Bf16, "moe_gather", "x");
        let (o, xp, rs) = (self.out(xe, "moe_gather"), self.ptr(x), self.iptr(d.row_slot));
        let args = [Arg::P(o), Arg::P(xp), Arg::P(rs), Arg::I(d.top_k as i32), Arg::I(Self::i32(width, "d"))];
        self.launch("moe_gather", ((d.tokens * d.top_k) as u32, 1, 1), Self::row_threads(width), 0, &args);
    }

    fn moe_gather_backward(&mut self, dx: View, dxe: View, d: MoeDispatch, width: usize) {
        self.expect(dx, DType::Bf16, "moe_gather_backward", "dx");
        self.expect(dxe, DType::Bf16, "moe_gather_backward", "dxe");
        let (o, g, sr) = (self.out(dx, "moe_gather_backward"), self.ptr(dxe), self.iptr(d.slot_row));
        let args = [Arg::P(o), Arg::P(g), Arg::P(sr), Arg::I(d.top_k as i32), Arg::I(Self::i32(width, "d"))];
        self.launch("moe_gather_backward", (d.tokens as u32, 1, 1), Self::row_threads(width), 0, &args);
    }

    fn moe_expert_matmul(&mut self, out: View, a: View, weights: ExpertWeights, d: MoeDispatch, s: MatMul) {
        self.expect(out, DType::Bf16, "moe_expert_matmul", "out");
        self.expect(a, DType::Bf16, "moe_expert_matmul", "a");
        self.expect(weights.first, DType::Bf16, "moe_expert_matmul", "weights");
        assert!(!s.a_t, "internal error: moe_expert_matmul with a transposed");
        let rows = d.tokens * d.top_k;
        assert_eq!(a.len, rows * s.k, "internal error: moe_expert_matmul: a length");
        assert_eq!(out.len, rows * s.n, "internal error: moe_expert_matmul: out length");
        self.ptr(weights.expert(d.experts - 1)); // the last expert's weight lies in the buffer
        let (o, ap, wp, off) =
            (self.out(out, "moe_expert_matmul"), self.ptr(a), self.ptr(weights.first), self.iptr(d.offsets));
        let vec = s.k.is_multiple_of(8)
            && s.n.is_multiple_of(8)
            && weights.stride.is_multiple_of(8)
            && Self::aligned16(&[o, ap, wp]);
        let name = if s.b_t { "moe_gemm_forward" } else { "moe_gemm_dx" };
        let args = [
            Arg::P(o),
            Arg::P(ap),
            Arg::P(wp),
            Arg::U(weights.stride as u64),
            Arg::P(off),
            Arg::I(d.experts as i32),
            Arg::I(Self::i32(s.n, "n")),
            Arg::I(Self::i32(s.k, "k")),
            Arg::I(s.accumulate as i32),
            Arg::I(vec as i32),
        ];
        // Row tiles of all experts together: at most rows / 128 plus one partial tile each.
        let grid = (s.n.div_ceil(128) as u32, (rows.div_ceil(128) + d.experts) as u32, 1);
        self.launch(name, grid, 256, 0, &args);
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
        self.expect(dweights.first, DType::F32, "moe_expert_matmul_dw", "dweights");
        self.expect(dy, DType::Bf16, "moe_expert_matmul_dw", "dy");
        self.expect(x, DType::Bf16, "moe_expert_matmul_dw", "x");
        self.ptr(dweights.expert(d.experts - 1));
        let (dw, g, xp, off) =
            (self.out(dweights.first, "moe_expert_matmul_dw"), self.ptr(dy), self.ptr(x), self.iptr(d.offsets));
        let vec = inp.is_multiple_of(8) && out.is_multiple_of(8) && Self::aligned16(&[g, xp]);
        let args = [
            Arg::P(dw),
            Arg::P(g),
            Arg::P(xp),
            Arg::U(dweights.stride as u64),
            Arg::P(off),
            Arg::I(d.experts as i32),
            Arg::I(Self::i32(out, "out")),
            Arg::I(Self::i32(inp, "inp")),
            Arg::I(vec as i32),
        ];
        let grid = (inp.div_ceil(128) as u32, out.div_ceil(128) as u32, d.experts as u32);
        self.launch("moe_gemm_dw", grid, 256, 0, &args);
    }

    fn moe_combine(&mut self, out: View, ye: View, d: MoeDispatch, width: usize) {
        self.expect(out, DType::Bf16, "moe_combine", "out");
        self.expect(ye, DType::Bf16, "moe_combine", "ye");
        let (o, y, w, sr) = (self.out(out, "moe_combine"), self.ptr(ye), self.ptr(d.weight), self.iptr(d.slot_row));
        let args = [Arg::P(o), Arg::P(y), Arg::P(w), Arg::P(sr), Arg::I(d.top_k as i32), Arg::I(Self::i32(width, "d"))];
        self.launch("moe_combine", (d.tokens as u32, 1, 1), Self::row_threads(width), 0, &args);
    }

    fn moe_combine_backward(&mut self, dye: View, dweight: View, dout: View, ye: View, d: MoeDispatch, width: usize) {
        self.expect(dye, DType::Bf16, "moe_combine_backward", "dye");
        self.expect(dweight, DType::F32, "moe_combine_backward", "dweight");
        self.expect(dout, DType::Bf16, "moe_combine_backward", "dout");
        self.expect(ye, DType::Bf16, "moe_combine_backward", "ye");
        let slots = d.tokens * d.top_k;
        let (dy, dw) = (self.out(dye, "moe_combine_backward"), self.out(dweight, "moe_combine_backward"));
        let (g, y, w, sr, rs) =
            (self.ptr(dout), self.ptr(ye), self.ptr(d.weight), self.iptr(d.slot_row), self.iptr(d.row_slot));
        let (k, wi) = (d.top_k as i32, Self::i32(width, "d"));
        let args = [Arg::P(dy), Arg::P(g), Arg::P(w), Arg::P(rs), Arg::I(k), Arg::I(wi)];
        self.launch("moe_combine_backward_rows", (slots as u32, 1, 1), Self::row_threads(width), 0, &args);
        let args = [Arg::P(dw), Arg::P(g), Arg::P(y), Arg::P(sr), Arg::U(slots as u64), Arg::I(k), Arg::I(wi)];
        self.launch("moe_combine_backward_weights", ((slots as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
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
        self.expect(drouter, DType::Bf16, "moe_route_backward", "drouter");
        for (v, name) in [(dweight, "dweight"), (probs, "probs"), (counts, "counts"), (d.weight, "weight")] {
            self.expect(v, DType::F32, "moe_route_backward", name);
        }
        let (dr, dw, p, w, c, ex) = (
            self.out(drouter, "moe_route_backward"),
            self.ptr(dweight),
            self.ptr(probs),
            self.ptr(d.weight),
            self.ptr(counts),
            self.iptr(d.expert),
        );
        let args = [
            Arg::P(dr),
            Arg::P(dw),
            Arg::P(p),
            Arg::P(w),
            Arg::P(c),
            Arg::P(ex),
            Arg::U(d.tokens as u64),
            Arg::I(d.experts as i32),
            Arg::I(d.top_k as i32),
            Arg::F(aux_scale),
        ];
        self.launch("moe_route_backward", ((d.tokens as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
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
        assert!(self.buffer(params).kind == BufKind::Params, "internal error: adamw on a view that is not parameters");
        for (x, name) in [(grads, "grads"), (m, "m"), (v, "v"), (norm_squared, "norm_squared")] {
            self.expect(x, DType::F32, "adamw", name);
        }
        let n = params.len;
        assert!(grads.len == n && m.len == n && v.len == n, "internal error: adamw lengths");
        let (p, p16) = (self.exact(params).0, self.ptr(params));
        let (g, mp, vp, ns) =
            (self.out(grads, "adamw"), self.out(m, "adamw"), self.out(v, "adamw"), self.ptr(norm_squared));
        assert!(
            Self::aligned16(&[p, g, mp, vp]) && p16 % 8 == 0,
            "internal error: adamw views must start 16-byte aligned"
        );
        let runs = adam_runs(segments);
        if runs != self.adam_runs {
            let table = self.scratch(Scratch::AdamRuns, runs.len().max(3) * 8);
            self.dev.upload(table, bytes_of(&runs));
            self.adam_runs = runs;
        }
        let table = self.scratch[Scratch::AdamRuns as usize].0;
        let bc1 = 1.0 - (step.beta1 as f64).powi(step.t as i32);
        let bc2 = 1.0 - (step.beta2 as f64).powi(step.t as i32);
        let args = [
            Arg::P(p),
            Arg::P(p16),
            Arg::P(g),
            Arg::P(mp),
            Arg::P(vp),
            Arg::P(ns),
            Arg::P(table),
            Arg::I((self.adam_runs.len() / 3) as i32),
            Arg::U(n as u64),
            Arg::F(step.lr),
            Arg::F(step.beta1),
            Arg::F(step.beta2),
            Arg::F(step.eps),
            Arg::F(step.weight_decay),
            Arg::F((step.lr as f64 / bc1) as f32),
            Arg::F(bc2.sqrt() as f32),
            Arg::F(step.max_grad_norm),
        ];
        self.launch_1d("adamw", (n as u64).div_ceil(4), &args);
    }
}

/// The AdamW kernel's table: `segments` sorted and merged into runs of equal decay, as
/// `(start, end, decay)` triples.
fn adam_runs(segments: &[Segment]) -> Vec<u64> {
    let mut sorted: Vec<&Segment> = segments.iter().filter(|s| s.len > 0).collect();
    sorted.sort_by_key(|s| s.offset);
    let mut runs: Vec<u64> = Vec::new();
    for s in sorted {
        let (start, end, decay) = (s.offset as u64, (s.offset + s.len) as u64, s.decay as u64);
        let n = runs.len();
        if n >= 3 && runs[n - 2] == start && runs[n - 1] == decay {
            runs[n - 2] = end;
        } else {
            assert!(n < 3 || runs[n - 2] <= start, "internal error: overlapping AdamW segments");
            runs.extend([start, end, decay]);
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adam_runs_merge_adjacent_segments_of_equal_decay() {
        let seg = |offset, len, decay| Segment { offset, len, decay };
        let runs =
            adam_runs(&[seg(10, 5, true), seg(0, 10, true), seg(15, 2, false), seg(20, 3, false), seg(17, 3, false)]);
        assert_eq!(runs, vec![0, 15, 1, 15, 23, 0]);
        assert_eq!(adam_runs(&[seg(0, 4, true), seg(6, 2, true)]), vec![0, 4, 1, 6, 8, 1]);
        assert!(adam_runs(&[]).is_empty());
    }

    #[test]
    fn norm_backward_blocks_cover_every_row_once() {
        for (rows, sms) in [(1, 132), (7, 132), (4096, 132), (32768, 132), (100, 1), (5, 0)] {
            let (blocks, per) = norm_backward_blocks(rows, sms);
            assert!(blocks * per >= rows && (blocks - 1) * per < rows, "{rows} rows on {sms}: {blocks} x {per}");
        }
    }

    #[test]
    fn model_checks_name_the_key() {
        let m = ModelConfig { head_dim: 6, ..ModelConfig::default() };
        assert!(check_model(&m).unwrap_err().contains("model.head_dim = 6"));
        let m = ModelConfig { head_dim: 256, ..ModelConfig::default() };
        assert!(check_model(&m).is_err());
        assert!(check_model(&ModelConfig { head_dim: 128, ..ModelConfig::default() }).is_ok());
    }
}
