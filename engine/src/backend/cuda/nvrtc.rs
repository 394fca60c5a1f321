//! Compiling the kernel modules with NVRTC, and the on-disk cache of the results.
//!
//! A module is compiled to a CUBIN for the device's exact architecture (`sm_XY`), so the driver
//! loads machine code and never JIT-compiles PTX. Results are cached in
//! `$ENGINE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/engine/kernels`, else
//! `~/.cache/engine/kernels`, under a name holding the module and architecture and a hash of
//! everything that determines the output: NVRTC's version, the options and the full source.
//! A cache that cannot be written only costs a compilation per run.

use std::ffi::CStr;
use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};
use cudarc::nvrtc::{result, sys};
use sha2::{Digest, Sha256};

use super::discovery::{LIB_PATH_VAR, preload_libraries};
use super::ops::Module;
use crate::fsutil::write_atomic;

/// Options every compilation gets besides the architecture: C++17, line information for
/// profilers (no effect on the code).
const OPTIONS: [&str; 2] = ["-std=c++17", "-lineinfo"];

/// The NVRTC version (major, minor), or why NVRTC cannot be used.
pub fn version() -> Result<(i32, i32)> {
    let (_, problems) = preload_libraries();
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        let extra = if problems.is_empty() { String::new() } else { format!(" ({})", problems.join("; ")) };
        bail!(
            "NVRTC (libnvrtc.so.13) was not found on the library path nor in {LIB_PATH_VAR}{extra}; install the CUDA 13 \
             toolkit's NVRTC or the nvidia-cuda-nvrtc wheel and point {LIB_PATH_VAR} at its lib directory"
        );
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("NVRTC does not answer: {e:?}"))?;
    Ok((major, minor))
}

/// A compiled module.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// Machine code for one architecture.
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas's resource report when `verbose`).
    pub log: String,
}

/// Compiles `module` for `sm_{arch}` (e.g. 90). `verbose` asks ptxas for its report of
/// registers, spills and shared memory per kernel.
pub fn compile(module: &Module, arch: u32, verbose: bool) -> Result<Compiled> {
    version()?;
    let source = std::ffi::CString::new(module.full_source()).expect("kernel sources hold no NUL byte");
    let name = std::ffi::CString::new(format!("{}.cu", module.name)).expect("module names hold no NUL byte");
    let mut options: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture=sm_{arch}"));
    if verbose {
        options.push("--ptxas-options=-v".into());
    }
    let prog = result::create_program(&source, Some(&name)).map_err(|e| anyhow!("NVRTC: {e:?}"))?;
    // SAFETY: `prog` is a live program until destroyed at the end of this function.
    unsafe {
        let compiled = result::compile_program(prog, &options);
        let log = result::get_program_log(prog).map(|raw| c_text(&raw)).unwrap_or_default();
        let out = match compiled {
            Err(e) => Err(anyhow!("NVRTC cannot compile {}.cu for sm_{arch} ({e:?}):\n{log}", module.name)),
            Ok(()) => cubin(prog).map(|cubin| Compiled { cubin, log }),
        };
        let _ = result::destroy_program(prog);
        out
    }
}

/// A NUL-terminated C buffer as text.
fn c_text(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
}

/// The CUBIN of a compiled program.
///
/// # Safety
/// `prog` must be a successfully compiled program.
unsafe fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: per the function's contract.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }.result().map_err(|e| anyhow!("NVRTC: {e:?}"))?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds `size` bytes.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) }.result().map_err(|e| anyhow!("NVRTC: {e:?}"))?;
    Ok(buf)
}

/// Where compiled kernels are cached, if anywhere.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("ENGINE_KERNEL_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("engine/kernels")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/engine/kernels")))
}

/// The cache file of a module for an architecture: a hash of NVRTC's version, the options and
/// the source.
pub fn cache_file(module: &Module, arch: u32, nvrtc: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(format!("nvrtc {}.{}\n{:?}\nsm_{arch}\n", nvrtc.0, nvrtc.1, OPTIONS));
    h.update(module.full_source());
    let digest = h.finalize();
    let hex = crate::digest::hex(&digest[..8]);
    format!("{}-sm_{arch}-{hex}.cubin", module.name)
}

/// The module's CUBIN for `sm_{arch}`, from the cache when it is there, else compiled (and
/// cached). Returns whether it was compiled.
pub fn load_or_compile(module: &Module, arch: u32) -> Result<(Vec<u8>, bool)> {
    let nvrtc = version()?;
    let path = cache_dir().map(|d| d.join(cache_file(module, arch, nvrtc)));
    if let Some(cubin) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok((cubin, false));
    }
    let compiled = compile(module, arch, false)?;
    if let Some(path) = &path {
        let written = path.parent().map_or(Ok(()), std::fs::create_dir_all).map_err(anyhow::Error::from);
        if let Err(e) = written.and_then(|()| write_atomic(path, &compiled.cubin)) {
            warn_once(&format!("warning: kernel cache not written ({e:#}); kernels are compiled at every start"));
        }
    }
    Ok((compiled.cubin, true))
}

fn warn_once(message: &str) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| crate::say!("{message}"));
}

/// One kernel's resources as ptxas reported them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelReport {
    /// Entry point.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes spilled to local memory (stores).
    pub spill_bytes: u32,
    /// Static shared memory in bytes.
    pub shared_bytes: u32,
}

/// Reads ptxas's verbose report (`--ptxas-options=-v`) into one entry per kernel.
pub fn parse_report(log: &str) -> Vec<KernelReport> {
    let mut out: Vec<KernelReport> = Vec::new();
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let i = line.find(unit)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelReport { name, registers: 0, spill_bytes: 0, shared_bytes: 0 });
        } else if let Some(k) = out.last_mut() {
            if line.contains("spill stores") {
                k.spill_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
            }
            if line.contains("Used") && line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap_or(0);
                k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::ops::MODULES;

    #[test]
    fn reads_the_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
                   ptxas info    : Compiling entry function 'attention_forward_hd64' for 'sm_90'\n\
                   ptxas info    : Function properties for attention_forward_hd64\n\
                   ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 122 registers, used 1 barriers, 1024 bytes smem\n\
                   ptxas info    : Compiling entry function 'rope' for 'sm_90'\n\
                   ptxas info    : Used 32 registers, used 0 barriers\n";
        let r = parse_report(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelReport { name: "attention_forward_hd64".into(), registers: 122, spill_bytes: 4, shared_bytes: 1024 }
        );
        assert_eq!(r[1], KernelReport { name: "rope".into(), registers: 32, spill_bytes: 0, shared_bytes: 0 });
    }

    #[test]
    fn cache_names_change_with_the_architecture_and_nvrtc() {
        let m = &MODULES[0];
        let a = cache_file(m, 90, (13, 0));
        assert!(a.starts_with("elementwise-sm_90-") && a.ends_with(".cubin"), "{a}");
        assert_ne!(a, cache_file(m, 80, (13, 0)));
        assert_ne!(a, cache_file(m, 90, (13, 1)));
        assert_ne!(a, cache_file(&MODULES[1], 90, (13, 0)));
    }
}
