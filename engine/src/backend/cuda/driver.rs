//! The real device: a GPU through the CUDA driver API, one stream, kernels compiled by NVRTC,
//! products through cuBLASLt, sections captured as CUDA graphs.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use cudarc::driver::sys::{self, CUdeviceptr, CUfunction};
use cudarc::driver::{CudaContext, CudaGraph, CudaStream, result};

use super::blas::{self, Blas, Gemm};
use super::cudnn::Cudnn;
use super::discovery::{self, DeviceInfo};
use super::ops::MODULES;
use super::{Device, DeviceFn, nvrtc};

/// A GPU. See the [module documentation](self).
pub struct Gpu {
    info: DeviceInfo,
    max_smem: usize,
    funcs: HashMap<&'static str, CUfunction>,
    smem_raised: HashMap<&'static str, usize>,
    graphs: Vec<CudaGraph>,
    blas: Blas,
    workspace: CUdeviceptr,
    modules: Vec<sys::CUmodule>,
    /// Opened when attention first asks for it; dropped before the stream and context.
    cudnn: Option<Cudnn>,
    raw: sys::CUstream,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Gpu {
    /// Opens device `ordinal`: checks the driver, the device and the libraries, compiles (or
    /// loads from the cache) every kernel module for the device's architecture.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let devices = discovery::probe()?;
        let info = devices
            .get(ordinal)
            .cloned()
            .ok_or_else(|| anyhow!("there is no CUDA device {ordinal} ({} found)", devices.len()))?;
        if info.capability.0 < 8 {
            bail!(
                "{} has compute capability {}.{}; the CUDA backend needs 8.0 or newer (bf16 tensor cores: A100, H100, \
                 H200, L4, L40S, B200 ...)",
                info.name,
                info.capability.0,
                info.capability.1
            );
        }
        nvrtc::version()?;
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            bail!(
                "cuBLASLt (libcublasLt.so.13) was not found on the library path nor in {0}; install the CUDA 13 \
                 toolkit's cuBLAS or point {0} at its lib directory",
                discovery::LIB_PATH_VAR
            );
        }
        // Flags by GPU generation: the driver reads them when the context is created.
        super::flags::apply(info.capability);
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow!("cannot open CUDA device {ordinal}: {e}"))?;
        // One stream and raw allocations: cudarc's per-slice event tracking has nothing to guard.
        // SAFETY: no cudarc slices are used here.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| anyhow!("cannot create a CUDA stream: {e}"))?;
        let raw = stream.cu_stream();
        let arch = (info.capability.0 * 10 + info.capability.1) as u32;
        let max_smem =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize;

        // Compile (or load) every module, in parallel: NVRTC programs are independent.
        use rayon::prelude::*;
        let cubins: Vec<Result<(Vec<u8>, bool)>> =
            MODULES.par_iter().map(|m| nvrtc::load_or_compile(m, arch)).collect();
        let (mut modules, mut funcs) = (Vec::new(), HashMap::new());
        for (m, cubin) in MODULES.iter().zip(cubins) {
            let (cubin, _) = cubin?;
            // SAFETY: a CUBIN produced by NVRTC for this device's architecture.
            let module = unsafe { result::module::load_data(cubin.as_ptr().cast()) }
                .map_err(|e| anyhow!("cannot load kernel module {}: {e}", m.name))?;
            modules.push(module);
            for &k in m.kernels {
                let name = CString::new(k).expect("kernel names hold no NUL byte");
                // SAFETY: a loaded module.
                let f = unsafe { result::module::get_function(module, name) }
                    .map_err(|e| anyhow!("kernel {k} missing from module {}: {e}", m.name))?;
                funcs.insert(k, f);
            }
        }
        // SAFETY: a plain device allocation.
        let workspace = unsafe { result::malloc_sync(blas::WORKSPACE_BYTES) }
            .map_err(|e| anyhow!("cannot allocate the cuBLASLt workspace: {e}"))?;
        let blas = Blas::new(workspace)?;
        Ok(Gpu {
            info,
            max_smem,
            funcs,
            smem_raised: HashMap::new(),
            graphs: Vec::new(),
            blas,
            workspace,
            modules,
            cudnn: None,
            raw,
            stream,
            ctx,
        })
    }
}

/// A CUDA call that failed while running: the GPU, its driver or a CUDA library, not the input
/// (an Xid, an ECC error, a launch that failed). The device's methods return nothing, so it
/// unwinds as a panic with this payload, which the `engine` binary's panic hook reports as one
/// line with exit code 1, not as a bug (docs/launch.md, "Exit codes").
#[derive(Debug)]
pub struct CudaFailure(pub String);

impl std::fmt::Display for CudaFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; the GPU, its driver or a CUDA library failed while running: see nvidia-smi and the kernel log (Xid errors), then continue with --resume=auto",
            self.0
        )
    }
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    std::panic::panic_any(CudaFailure(format!("CUDA error ({what}): {e}")))
}

impl Device for Gpu {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn max_shared_memory(&self) -> usize {
        self.max_smem
    }

    fn alloc(&mut self, bytes: usize) -> Result<CUdeviceptr> {
        // SAFETY: a plain allocation, zeroed before use.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        // Zeroed on the compute stream, never with the "synchronous" cuMemsetD8: that one runs on
        // the legacy default stream, which our non-blocking stream does not wait for, and returns
        // before it is done. Seen on an H100: a fresh buffer's zeroing landed after the uploads
        // and kernels that followed it, changing the first loss and the embedding gradient.
        // SAFETY: the allocation just made.
        unsafe { result::memset_d8_async(ptr, 0, bytes.max(1), self.raw) }?;
        Ok(ptr)
    }

    fn free(&mut self, ptr: CUdeviceptr) {
        // Work queued on the stream may still use the buffer. (Errors are ignored as the free's
        // own are: this also runs when the backend is dropped after a failure.)
        let _ = self.stream.synchronize();
        // SAFETY: a pointer this device allocated, freed once, with no work pending on it.
        let _ = unsafe { result::free_sync(ptr) };
    }

    fn upload(&mut self, dst: CUdeviceptr, src: &[u8]) {
        // SAFETY: `dst` holds `src.len()` bytes (checked by the backend); a pageable source is
        // staged by the driver before the call returns.
        unsafe { result::memcpy_htod_async(dst, src, self.raw) }.unwrap_or_else(|e| fail("upload", e));
    }

    fn download(&mut self, dst: &mut [u8], src: CUdeviceptr) {
        self.synchronize();
        // SAFETY: `src` holds `dst.len()` bytes; the stream is idle.
        unsafe { result::memcpy_dtoh_sync(dst, src) }.unwrap_or_else(|e| fail("download", e));
    }

    fn copy(&mut self, dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) {
        // SAFETY: both ranges lie in allocations (checked by the backend).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.raw) }.unwrap_or_else(|e| fail("copy", e));
    }

    fn zero_u32(&mut self, dst: CUdeviceptr, count: usize) {
        // SAFETY: `dst` holds `count` 4-byte words.
        unsafe { sys::cuMemsetD32Async(dst, 0, count, self.raw) }.result().unwrap_or_else(|e| fail("memset", e));
    }

    fn launch(&mut self, name: &'static str, grid: (u32, u32, u32), block: u32, smem: usize, args: &mut [u64]) {
        let f = *self.funcs.get(name).unwrap_or_else(|| panic!("internal error: no kernel {name}"));
        if smem > 48 * 1024 && self.smem_raised.get(name).copied().unwrap_or(0) < smem {
            // SAFETY: a loaded function; the backend keeps `smem` within the device's limit.
            unsafe {
                result::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
            }
            .unwrap_or_else(|e| panic!("internal error: cannot give {name} {smem} bytes of shared memory: {e}"));
            self.smem_raised.insert(name, smem);
        }
        let mut params: Vec<*mut c_void> = args.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        // SAFETY: the slots outlive the call (the driver copies them) and match the kernel's
        // parameters (little-endian: a 4-byte parameter reads the low half of its slot).
        unsafe { result::launch_kernel(f, grid, (block, 1, 1), smem as u32, self.raw, &mut params) }
            .unwrap_or_else(|e| panic!("internal error: CUDA kernel {name} failed to launch: {e}"));
    }

    fn gemm(&mut self, g: &Gemm) {
        self.blas.gemm(self.raw, g).unwrap_or_else(|e| panic!("internal error: {e:#}"));
    }

    fn synchronize(&mut self) {
        self.stream.synchronize().unwrap_or_else(|e| fail("the step", e));
    }

    fn begin_capture(&mut self) {
        self.blas.capturing = true;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap_or_else(|e| panic!("internal error: cannot start a CUDA graph capture: {e}"));
    }

    fn end_capture(&mut self) -> usize {
        self.blas.capturing = false;
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap_or_else(|e| {
                panic!("CUDA graph capture of the step failed ({e}); run with --set train.cuda_graphs=false")
            })
            .expect("a captured graph");
        self.graphs.push(graph);
        self.graphs.len() - 1
    }

    fn replay(&mut self, graph: usize) {
        self.graphs[graph].launch().unwrap_or_else(|e| panic!("internal error: CUDA graph launch failed: {e}"));
    }

    fn host_call(&mut self, f: DeviceFn) {
        f(self)
    }

    fn memory(&self) -> (usize, usize) {
        result::mem_get_info().unwrap_or((0, 0))
    }

    fn stream(&self) -> Option<sys::CUstream> {
        Some(self.raw)
    }

    fn cudnn(&mut self) -> Result<&mut Cudnn> {
        if self.cudnn.is_none() {
            self.cudnn = Some(Cudnn::new(self.raw)?);
        }
        Ok(self.cudnn.as_mut().expect("opened above"))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        self.graphs.clear();
        // SAFETY: allocated and loaded by this device, released once, the stream idle.
        unsafe {
            let _ = result::free_sync(self.workspace);
            for &m in &self.modules {
                let _ = result::module::unload(m);
            }
        }
    }
}
