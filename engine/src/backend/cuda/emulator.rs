//! A CPU stand-in for a GPU, so that the CUDA backend — its host code and the very kernel
//! sources NVRTC compiles — runs where there is no GPU: in CI and on developers' machines.
//!
//! The kernel modules are compiled with the host's C++20 compiler (`$CXX`, else `c++`) against
//! `emu/prelude.h` and `emu/ops.h`, which define CUDA's built-ins and emulate the inline-PTX
//! helpers after the PTX ISA's definitions (the mma.sync and ldmatrix fragment layouts, cp.async
//! completing only at wait_group), and linked with `emu/runtime.cpp` into a shared library that
//! is cached like the kernels. Every CUDA thread of a block is an OS thread, so barriers and warp
//! exchanges really synchronise; blocks run one after another. "Device memory" is host memory;
//! products follow cuBLASLt's column-major definition through the `gemm` crate in f32 (bf16
//! operands exactly converted, the result rounded once). Graphs are recorded lists of work.
//!
//! What it cannot show: timing, occupancy, bank conflicts, register or shared-memory limits
//! (ptxas reports those: tests/nvrtc.rs), races that need real concurrency between blocks, and
//! the CUDA driver's and cuBLASLt's own behaviour.
//!
//! **Test hook.** `ENGINE_TEST_EMULATOR_FAULT=KERNEL@N` ([`FAULT_HOOK`]) breaks a kernel on
//! purpose: the `N`-th launch (1-based, counted per emulator) of the kernel named `KERNEL` is not
//! run, as if the kernel had returned without writing its results (`KERNEL` alone: no launch of it
//! runs). The tests use it to show that `test-all --emulate` fails, naming the step, when a
//! kernel is wrong. Only the emulator reads it (a GPU never does); a name that is no kernel is an
//! error, and every emulator that applies it says so on stderr.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_void};
use std::path::PathBuf;
use std::sync::Mutex;

use anyhow::{Result, anyhow, bail};
use cudarc::driver::sys::CUdeviceptr;
use sha2::{Digest, Sha256};

use super::blas::Gemm;
use super::discovery::DeviceInfo;
use super::ops::{COMMON, MODULES};
use super::{DType, Device, DeviceFn, nvrtc};
use crate::backend::cpu::{Parallelism, sgemm};
use crate::backend::fp8::Fp8Format;

const PRELUDE: &str = include_str!("emu/prelude.h");
const OPS: &str = include_str!("emu/ops.h");
const RUNTIME: &str = include_str!("emu/runtime.cpp");

type LaunchFn = unsafe extern "C" fn(*const c_char, u32, u32, u32, u32, u32, *mut *mut c_void, *mut c_char, i32) -> i32;

/// The emulator's runtime is one per process: launches take turns.
static LAUNCH: Mutex<()> = Mutex::new(());

/// The test hook's variable (see the [module documentation](self)).
pub const FAULT_HOOK: &str = "ENGINE_TEST_EMULATOR_FAULT";

/// A kernel broken on purpose by [`FAULT_HOOK`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The kernel's entry name.
    pub kernel: String,
    /// The launch (1-based) that is not run; `None`: none of them runs.
    pub launch: Option<usize>,
}

impl Fault {
    /// Parses `KERNEL` or `KERNEL@N`; `KERNEL` must be an entry point of a kernel module.
    pub fn parse(text: &str) -> Result<Fault> {
        let bad = |why: &str| anyhow!("{FAULT_HOOK}={text}: {why}");
        let (kernel, launch) = match text.split_once('@') {
            None => (text, None),
            Some((k, n)) => match n.parse::<usize>() {
                Ok(n) if n >= 1 => (k, Some(n)),
                _ => return Err(bad("the launch after @ must be a whole number from 1")),
            },
        };
        if !MODULES.iter().any(|m| m.kernels.contains(&kernel)) {
            return Err(bad(&format!("no kernel is named `{kernel}` (the kernels are listed in backend/cuda/ops/)")));
        }
        Ok(Fault { kernel: kernel.to_owned(), launch })
    }

    /// The fault [`FAULT_HOOK`] asks for, if it is set and not empty.
    pub fn from_env() -> Result<Option<Fault>> {
        match std::env::var(FAULT_HOOK) {
            Ok(v) if !v.is_empty() => Fault::parse(&v).map(Some),
            _ => Ok(None),
        }
    }

    /// In words, for the line the emulator prints.
    pub fn describe(&self) -> String {
        match self.launch {
            Some(n) => format!("launch {n} of kernel {} is not run", self.kernel),
            None => format!("kernel {} is never run", self.kernel),
        }
    }
}

/// Work recorded for a graph.
enum Work {
    Launch { name: &'static str, grid: (u32, u32, u32), block: u32, smem: usize, args: Vec<u64> },
    Copy { dst: CUdeviceptr, src: CUdeviceptr, bytes: usize },
    Zero { dst: CUdeviceptr, count: usize },
    Gemm(Gemm),
    Host(DeviceFn),
}

/// The emulated device. See the [module documentation](self).
pub struct Emulator {
    info: DeviceInfo,
    launch_fn: LaunchFn,
    allocations: HashMap<CUdeviceptr, Layout>,
    recording: Option<Vec<Work>>,
    graphs: Vec<Vec<Work>>,
    /// With `ENGINE_EMULATOR_PROFILE=1`: seconds and launches per kernel, printed at the end.
    profile: Option<HashMap<&'static str, (f64, usize)>>,
    /// The test hook's fault, and the launches of its kernel seen so far.
    fault: Option<(Fault, usize)>,
}

impl Emulator {
    /// Builds (or finds in the cache) the emulated kernels and loads them.
    pub fn open() -> Result<Emulator> {
        let fault = Fault::from_env()?;
        if let Some(f) = &fault {
            crate::say!("{FAULT_HOOK}: the emulator breaks a kernel on purpose: {}", f.describe());
        }
        let library = build()?;
        let path = CString::new(library.to_string_lossy().as_bytes())?;
        // SAFETY: loading a library this module built; it is never unloaded.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            bail!("cannot load the CUDA emulator {}", library.display());
        }
        // SAFETY: a symbol the runtime exports with this signature.
        let sym = unsafe { libc::dlsym(handle, c"emu_launch".as_ptr()) };
        if sym.is_null() {
            bail!("the CUDA emulator has no emu_launch");
        }
        // SAFETY: emu_launch's C signature is LaunchFn.
        let launch_fn: LaunchFn = unsafe { std::mem::transmute::<*mut c_void, LaunchFn>(sym) };
        let info = DeviceInfo {
            ordinal: 0,
            name: "CPU emulator of an sm_90 GPU".into(),
            capability: (9, 0),
            memory: 64 << 30,
            sm_count: 2,
        };
        let profile = std::env::var("ENGINE_EMULATOR_PROFILE").is_ok_and(|v| v == "1").then(HashMap::new);
        Ok(Emulator {
            info,
            launch_fn,
            allocations: HashMap::new(),
            recording: None,
            graphs: Vec::new(),
            profile,
            fault: fault.map(|f| (f, 0)),
        })
    }

    /// Whether the test hook's fault drops this launch of kernel `name` (counting it).
    fn dropped(&mut self, name: &str) -> bool {
        match &mut self.fault {
            Some((f, seen)) if f.kernel == name => {
                *seen += 1;
                f.launch.is_none_or(|n| n == *seen)
            }
            _ => false,
        }
    }

    fn run(&mut self, work: &Work) {
        match work {
            Work::Launch { name, .. } if self.dropped(name) => {}
            Work::Launch { name, grid, block, smem, args } => {
                let mut slots = args.clone();
                let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
                let cname = CString::new(*name).expect("kernel names hold no NUL byte");
                let mut err = [0 as c_char; 512];
                let _turn = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
                let start = std::time::Instant::now();
                // SAFETY: the runtime reads `params.len()` slots as the kernel's parameters.
                let rc = unsafe {
                    (self.launch_fn)(
                        cname.as_ptr(),
                        grid.0,
                        grid.1,
                        grid.2,
                        *block,
                        *smem as u32,
                        params.as_mut_ptr(),
                        err.as_mut_ptr(),
                        512,
                    )
                };
                if rc != 0 {
                    // SAFETY: the runtime wrote a NUL-terminated message.
                    let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
                    panic!("internal error: emulated kernel launch failed: {msg}");
                }
                if let Some(p) = &mut self.profile {
                    let e = p.entry(name).or_default();
                    e.0 += start.elapsed().as_secs_f64();
                    e.1 += 1;
                }
            }
            // SAFETY (three arms): the backend keeps copies within its allocations.
            Work::Copy { dst, src, bytes } => unsafe {
                std::ptr::copy(*src as *const u8, *dst as *mut u8, *bytes);
            },
            Work::Zero { dst, count } => unsafe { std::ptr::write_bytes(*dst as *mut u32, 0, *count) },
            Work::Gemm(g) => gemm(g),
            Work::Host(f) => f(self),
        }
    }

    fn issue(&mut self, work: Work) {
        match &mut self.recording {
            Some(list) => list.push(work),
            None => self.run(&work),
        }
    }
}

impl Device for Emulator {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn max_shared_memory(&self) -> usize {
        227 * 1024
    }

    fn alloc(&mut self, bytes: usize) -> Result<CUdeviceptr> {
        let layout = Layout::from_size_align(bytes.max(1), 256)?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            bail!("the emulator cannot allocate {bytes} bytes");
        }
        self.allocations.insert(ptr as CUdeviceptr, layout);
        Ok(ptr as CUdeviceptr)
    }

    fn free(&mut self, ptr: CUdeviceptr) {
        if let Some(layout) = self.allocations.remove(&ptr) {
            // SAFETY: allocated by `alloc` with this layout.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
        }
    }

    fn upload(&mut self, dst: CUdeviceptr, src: &[u8]) {
        assert!(self.recording.is_none(), "internal error: upload while recording");
        // SAFETY: the backend keeps `dst` within an allocation of at least `src.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) }
    }

    fn download(&mut self, dst: &mut [u8], src: CUdeviceptr) {
        assert!(self.recording.is_none(), "internal error: download while recording");
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) }
    }

    fn copy(&mut self, dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) {
        self.issue(Work::Copy { dst, src, bytes });
    }

    fn zero_u32(&mut self, dst: CUdeviceptr, count: usize) {
        self.issue(Work::Zero { dst, count });
    }

    fn launch(&mut self, name: &'static str, grid: (u32, u32, u32), block: u32, smem: usize, args: &mut [u64]) {
        self.issue(Work::Launch { name, grid, block, smem, args: args.to_vec() });
    }

    fn gemm(&mut self, g: &Gemm) {
        self.issue(Work::Gemm(*g));
    }

    fn synchronize(&mut self) {
        assert!(self.recording.is_none(), "internal error: synchronize while recording");
    }

    fn begin_capture(&mut self) {
        assert!(self.recording.is_none(), "internal error: nested capture");
        self.recording = Some(Vec::new());
    }

    fn end_capture(&mut self) -> usize {
        let list = self.recording.take().expect("internal error: end of a capture never begun");
        self.graphs.push(list);
        self.graphs.len() - 1
    }

    fn replay(&mut self, graph: usize) {
        let list = std::mem::take(&mut self.graphs[graph]);
        for w in &list {
            self.run(w);
        }
        self.graphs[graph] = list;
    }

    fn host_call(&mut self, f: DeviceFn) {
        self.issue(Work::Host(f));
    }

    fn records_host_calls(&self) -> bool {
        true
    }

    fn memory(&self) -> (usize, usize) {
        let used: usize = self.allocations.values().map(|l| l.size()).sum();
        (self.info.memory.saturating_sub(used), self.info.memory)
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        if let Some(p) = self.profile.take() {
            let mut rows: Vec<_> = p.into_iter().collect();
            rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
            for (name, (seconds, launches)) in rows {
                crate::say!("emulator: {name:<32} {seconds:8.2} s  {launches:6} launches");
            }
        }
        for (ptr, layout) in self.allocations.drain() {
            // SAFETY: allocated by `alloc` with this layout.
            unsafe { std::alloc::dealloc(ptr as *mut u8, layout) }
        }
    }
}

/// Elements a column-major `rows × cols` matrix with leading dimension `ld` spans.
fn span(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 { 0 } else { (cols - 1) * ld + rows }
}

/// Reads `n` elements of type `t` at `ptr` as f32.
fn read(ptr: CUdeviceptr, t: DType, n: usize) -> Vec<f32> {
    // SAFETY: the backend checked that the operands lie in their allocations.
    unsafe {
        match t {
            DType::Fp8 => unreachable!("internal error: FP8 operands are read with their format (read_fp8)"),
            DType::F32 => std::slice::from_raw_parts(ptr as *const f32, n).to_vec(),
            DType::Bf16 => std::slice::from_raw_parts(ptr as *const u16, n)
                .iter()
                .map(|&b| half::bf16::from_bits(b).to_f32())
                .collect(),
        }
    }
}

/// `n` FP8 bytes of `format` at `ptr`, decoded.
fn read_fp8(ptr: CUdeviceptr, format: Fp8Format, n: usize) -> Vec<f32> {
    // SAFETY: the backend checked that the operands lie in their allocations.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, n) }.iter().map(|&b| format.decode(b)).collect()
}

/// cuBLASLt's product, in f32: `D = op(A) · op(B) + beta · C`, column-major; for FP8 operands
/// `D = (a_scale · b_scale) · op(A) · op(B) + beta · C`, the scales read from memory as the
/// product runs (every product of two FP8 values is exact in f32: only the sums' order may
/// differ from a GPU's, fast accumulation or not).
fn gemm(g: &Gemm) {
    let (a_rows, a_cols) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
    let (a_len, b_len) = (span(a_rows, a_cols, g.lda), span(b_rows, b_cols, g.ldb));
    let (a, b, scale) = match g.fp8 {
        // SAFETY: the scales are f32 values in device (here host) memory.
        Some(f) => (read_fp8(g.a, f.a, a_len), read_fp8(g.b, f.b, b_len), unsafe {
            *(f.a_scale as *const f32) * *(f.b_scale as *const f32)
        }),
        None => (read(g.a, g.inputs, a_len), read(g.b, g.inputs, b_len), 1.0),
    };
    let c_len = span(g.m, g.n, g.ldc);
    let mut c = if g.beta != 0.0 { read(g.c, g.output, c_len) } else { vec![0f32; c_len] };
    // gemm takes (column stride, row stride) per operand.
    let (a_cs, a_rs) = if g.transa { (1, g.lda) } else { (g.lda, 1) };
    let (b_cs, b_rs) = if g.transb { (1, g.ldb) } else { (g.ldb, 1) };
    if g.m > 0 && g.n > 0 {
        // SAFETY: the buffers hold every element the shapes and strides address.
        unsafe {
            sgemm(
                (g.m, g.n, g.k),
                c.as_mut_ptr(),
                (g.ldc as isize, 1),
                g.beta != 0.0,
                (a.as_ptr(), a_cs as isize, a_rs as isize),
                (b.as_ptr(), b_cs as isize, b_rs as isize),
                scale,
                Parallelism::Rayon(rayon::current_num_threads()),
            )
        }
    }
    // Write back only the m × n elements (the rest of the span may belong to other data).
    for j in 0..g.n {
        for i in 0..g.m {
            let at = i + j * g.ldc;
            // SAFETY: inside C's span.
            unsafe {
                match g.output {
                    DType::F32 => *(g.d as *mut f32).add(at) = c[at],
                    DType::Bf16 => *(g.d as *mut u16).add(at) = half::bf16::from_f32(c[at]).to_bits(),
                    DType::Fp8 => unreachable!("internal error: a product into FP8"),
                }
            }
        }
    }
}

/// Builds the emulator library (or finds it built) and returns its path.
fn build() -> Result<PathBuf> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut units: Vec<(String, String)> = vec![("runtime".into(), RUNTIME.to_string())];
    for m in MODULES {
        let mut text =
            format!("#include \"prelude.h\"\n{COMMON}\n#include \"ops.h\"\n#line 1 \"{}.cu\"\n{}\n", m.name, m.source);
        for k in m.kernels {
            text += &format!("EMU_KERNEL({k})\n");
        }
        units.push((m.name.to_string(), text));
    }
    let mut hash = Sha256::new();
    hash.update(format!("{cxx}\n{PRELUDE}\n{OPS}\n"));
    for (name, text) in &units {
        hash.update(format!("{name}\n{text}\n"));
    }
    let hex = crate::digest::hex(&hash.finalize()[..8]);
    let base = nvrtc::cache_dir().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("emulator-{hex}"));
    let library = dir.join("libengine_cuda_emulator.so");
    if library.exists() {
        return Ok(library);
    }
    // Build in a private directory, then move the library into place (concurrent builders each
    // produce the same file).
    let work = base.join(format!("emulator-{hex}.build-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| anyhow!("cannot create {}: {e}", work.display()))?;
    let write = |name: &str, text: &str| {
        std::fs::write(work.join(name), text).map_err(|e| anyhow!("cannot write {}: {e}", work.join(name).display()))
    };
    write("prelude.h", PRELUDE)?;
    write("ops.h", OPS)?;
    for (name, text) in &units {
        write(&format!("{name}.cpp"), text)?;
    }
    let compile = |name: &str| -> Result<()> {
        let out = std::process::Command::new(&cxx)
            .args(["-std=c++20", "-O1", "-fPIC", "-pthread", "-w", "-c"])
            .arg(format!("{name}.cpp"))
            .args(["-o", &format!("{name}.o")])
            .current_dir(&work)
            .output()
            .map_err(|e| anyhow!("cannot run the C++ compiler `{cxx}` (set CXX): {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(anyhow!("{cxx} cannot compile the emulated {name}.cu:\n{}", String::from_utf8_lossy(&out.stderr)))
        }
    };
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let jobs: Vec<_> = units.iter().map(|(name, _)| s.spawn(move || compile(name))).collect();
        jobs.into_iter().map(|j| j.join().unwrap_or_else(|_| Err(anyhow!("compiler thread panicked")))).collect()
    });
    results.into_iter().collect::<Result<Vec<()>>>()?;
    let objects: Vec<String> = units.iter().map(|(n, _)| format!("{n}.o")).collect();
    let out = std::process::Command::new(&cxx)
        .args(["-shared", "-pthread", "-o", "libengine_cuda_emulator.so"])
        .args(&objects)
        .current_dir(&work)
        .output()
        .map_err(|e| anyhow!("cannot run `{cxx}`: {e}"))?;
    if !out.status.success() {
        bail!("{cxx} cannot link the CUDA emulator:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    std::fs::create_dir_all(&dir)?;
    std::fs::rename(work.join("libengine_cuda_emulator.so"), &library)?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(library)
}

/// Whether a C++ compiler for the emulator is at hand.
pub fn compiler_available() -> bool {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    std::process::Command::new(cxx).arg("--version").output().is_ok_and(|o| o.status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fault_hook_names_a_kernel_and_optionally_a_launch() {
        assert_eq!(Fault::parse("adamw@3").unwrap(), Fault { kernel: "adamw".into(), launch: Some(3) });
        assert_eq!(Fault::parse("rope").unwrap(), Fault { kernel: "rope".into(), launch: None });
        let e = Fault::parse("adamv@3").unwrap_err().to_string();
        assert!(e.starts_with("ENGINE_TEST_EMULATOR_FAULT=adamv@3: no kernel is named `adamv`"), "{e}");
        for bad in ["adamw@0", "adamw@x", "adamw@"] {
            assert!(Fault::parse(bad).unwrap_err().to_string().contains("whole number from 1"), "{bad}");
        }
    }
}
