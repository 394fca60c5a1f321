//! Finding the CUDA libraries and devices at run time, and each device's peak rate.
//!
//! The engine links no CUDA library: cudarc opens `libcuda`, `libnvrtc` and `libcublasLt` by
//! name when first used, through the dynamic loader's search path. `ENGINE_CUDA_LIB_PATH` adds
//! directories (colon-separated) whose NVRTC and cuBLASLt libraries are loaded first, by full
//! path; the loader then resolves cudarc's by-name requests to them (a loaded library answers to
//! its soname). That is how tests use NVRTC from the PyPI wheel without a CUDA installation, and
//! how a user points the engine at a toolkit outside the search path.

use std::ffi::CString;
use std::sync::OnceLock;

use anyhow::{Result, anyhow, bail};
use cudarc::driver::{result, sys};

/// The environment variable listing extra library directories.
pub const LIB_PATH_VAR: &str = "ENGINE_CUDA_LIB_PATH";

/// Oldest driver API version the backend accepts: the API level it is built against (13.0).
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// Library files loaded from `ENGINE_CUDA_LIB_PATH`, in this order (NVRTC's builtins first, as
/// NVRTC opens them by name when it compiles).
const PRELOAD: [&str; 3] = ["libnvrtc-builtins.so", "libnvrtc.so", "libcublasLt.so"];

/// Loads the libraries found in `ENGINE_CUDA_LIB_PATH` (once per process) and returns the
/// files loaded and the problems met.
pub fn preload_libraries() -> &'static (Vec<String>, Vec<String>) {
    static LOADED: OnceLock<(Vec<String>, Vec<String>)> = OnceLock::new();
    LOADED.get_or_init(|| {
        let (mut loaded, mut problems) = (Vec::new(), Vec::new());
        let Ok(dirs) = std::env::var(LIB_PATH_VAR) else { return (loaded, problems) };
        // A directory named twice, or one library under several names (`libnvrtc.so`, `.so.13`,
        // `.so.13.0.88` are links to one file), is loaded once.
        let mut seen = std::collections::HashSet::new();
        for dir in dirs.split(':').filter(|d| !d.is_empty()) {
            if !seen.insert(std::fs::canonicalize(dir).unwrap_or_else(|_| dir.into())) {
                continue;
            }
            let Ok(entries) = std::fs::read_dir(dir) else {
                problems.push(format!("{LIB_PATH_VAR}: cannot read directory {dir}"));
                continue;
            };
            let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
            names.sort();
            for prefix in PRELOAD {
                // `libnvrtc.so.13`, not `libnvrtc.alt.so.13` (a variant built for other uses).
                for name in names.iter().filter(|n| n.starts_with(prefix)) {
                    let path = format!("{dir}/{name}");
                    if !seen.insert(std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone().into())) {
                        continue;
                    }
                    match dlopen_global(&path) {
                        Ok(()) => loaded.push(path),
                        Err(e) => problems.push(format!("{LIB_PATH_VAR}: cannot load {path}: {e}")),
                    }
                }
            }
        }
        (loaded, problems)
    })
}

/// Loads a shared library by path with its symbols global, keeping it for the process's life.
fn dlopen_global(path: &str) -> Result<()> {
    let c = CString::new(path).map_err(|_| anyhow!("path contains a NUL byte"))?;
    // SAFETY: dlopen with a valid C string; the handle is deliberately never closed.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null C string from dlerror.
            unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned()
        };
        bail!(msg);
    }
    Ok(())
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
    /// Memory in bytes.
    pub memory: usize,
    /// Streaming multiprocessors.
    pub sm_count: i32,
}

/// The devices the driver reports, or why there are none usable: no driver library, a driver
/// older than CUDA 13.0, no device.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    preload_libraries();
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        bail!(
            "no CUDA driver library (libcuda.so.1) was found; is the NVIDIA driver installed and, in a \
             container, is the GPU passed through (docker run --gpus=all)?"
        );
    }
    result::init().map_err(|e| anyhow!("the CUDA driver failed to start: {e}"))?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| anyhow!("cannot read the CUDA driver version: {e}"))?;
    if version < MIN_DRIVER_VERSION {
        bail!(
            "the NVIDIA driver supports CUDA {}.{}, older than the 13.0 the engine is built for; update the driver \
             (580 or newer)",
            version / 1000,
            version % 1000 / 10
        );
    }
    let count = result::device::get_count().map_err(|e| anyhow!("cannot count CUDA devices: {e}"))?;
    if count == 0 {
        bail!("the CUDA driver reports no device");
    }
    (0..count as usize).map(device_info).collect()
}

fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    let err = |e: result::DriverError| anyhow!("CUDA device {ordinal}: {e}");
    let dev = result::device::get(ordinal as i32).map_err(err)?;
    let attr = |a| unsafe { result::device::get_attribute(dev, a) }.map_err(err);
    use sys::CUdevice_attribute::*;
    Ok(DeviceInfo {
        ordinal,
        name: result::device::get_name(dev).map_err(err)?,
        capability: (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        // SAFETY: a valid device handle.
        memory: unsafe { result::device::total_mem(dev) }.map_err(err)?,
        sm_count: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
    })
}

/// Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' datasheets, matched
/// against the device name in order (the more specific names first). The SXM parts of H100 and
/// H200 share one chip and one rate.
pub const PEAK_BF16_TFLOPS: &[(&str, f64)] = &[
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("H20", 148.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
];

/// The dense bf16 peak of a device by name, when the table knows it.
pub fn peak_tflops(name: &str) -> Option<f64> {
    PEAK_BF16_TFLOPS.iter().find(|(key, _)| name.contains(key)).map(|&(_, peak)| peak)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_match_the_most_specific_name() {
        assert_eq!(peak_tflops("NVIDIA H200"), Some(989.0));
        assert_eq!(peak_tflops("NVIDIA H100 80GB HBM3"), Some(989.0));
        assert_eq!(peak_tflops("NVIDIA H100 PCIe"), Some(756.0));
        assert_eq!(peak_tflops("NVIDIA H200 NVL"), Some(835.0));
        assert_eq!(peak_tflops("NVIDIA GH200 480GB"), Some(989.0));
        assert_eq!(peak_tflops("NVIDIA A100-SXM4-80GB"), Some(312.0));
        assert_eq!(peak_tflops("NVIDIA L40S"), Some(362.0));
        assert_eq!(peak_tflops("NVIDIA L4"), Some(121.0));
        assert_eq!(peak_tflops("NVIDIA A10"), Some(125.0));
        assert_eq!(peak_tflops("NVIDIA B200"), Some(2250.0));
        assert_eq!(peak_tflops("Tesla V100-SXM2-16GB"), None);
    }

    #[test]
    fn a_missing_library_directory_is_reported_not_fatal() {
        // The preload runs once per process; only its reporting of problems is checked here,
        // through the same helper it uses.
        assert!(dlopen_global("/nonexistent/libnvrtc.so.13").is_err());
    }
}
