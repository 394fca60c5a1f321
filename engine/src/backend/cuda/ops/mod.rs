//! The backend's ops, one file each, as in llm.c's `llmc/`: the CUDA C kernels (`<op>.cu`) and
//! beside them their host side (`<op>.rs`): the kernels' entry names ([`Module`]), the checks of
//! an op's views, its argument packing and launch shape. `impl Backend for Cuda` hands each op
//! to its file in one line; the device, memory and graph plumbing stays in the parent module.
//!
//! The kernels are compiled at run time by NVRTC. Each module is one `.cu` file compiled with
//! `common.cuh` prepended (NVRTC is given no include path: everything a kernel needs is in the
//! two texts). Every entry point is `extern "C"` and listed in its file's `MODULE`, so that the
//! backend loads them by name and the compile check can prove that each one exists for every
//! architecture. `matmul.rs` has no kernel: dense products go to cuBLASLt.

pub(crate) mod adamw;
pub(crate) mod attention;
pub(crate) mod cross_entropy;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod fp8;
pub(crate) mod gelu;
pub(crate) mod gemm;
pub(crate) mod layernorm;
pub(crate) mod matmul;
pub(crate) mod mla;
pub(crate) mod moe;
pub(crate) mod muon;
pub(crate) mod qknorm;
pub(crate) mod rmsnorm;
pub(crate) mod rope;
pub(crate) mod sinks;
pub(crate) mod swiglu;

use cudarc::driver::sys::CUdeviceptr;

/// Shared definitions prepended to every module.
pub const COMMON: &str = include_str!("common.cuh");

/// One compilation unit.
#[derive(Debug)]
pub struct Module {
    /// File stem of its `.cu` file.
    pub name: &'static str,
    /// The module's own source (without [`COMMON`]).
    pub source: &'static str,
    /// Its entry points.
    pub kernels: &'static [&'static str],
}

impl Module {
    /// The text NVRTC compiles.
    pub fn full_source(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", self.name, self.source)
    }
}

/// Every kernel module, in the order the backend loads them.
pub const MODULES: &[Module] = &[
    elementwise::MODULE,
    embedding::MODULE,
    rmsnorm::MODULE,
    qknorm::MODULE,
    rope::MODULE,
    mla::MODULE,
    swiglu::MODULE,
    layernorm::MODULE,
    gelu::MODULE,
    cross_entropy::MODULE,
    adamw::MODULE,
    muon::MODULE,
    moe::MODULE,
    gemm::MODULE,
    attention::MODULE,
    sinks::MODULE,
    fp8::MODULE,
];

/// Threads for a block that walks a row of `items` in strides: a multiple of 32, 32 to 256.
fn row_threads(items: usize) -> u32 {
    (items.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// Whether every address allows 16-byte vector loads (the `_v8` kernels move 8 bf16 at once).
fn aligned16(ptrs: &[CUdeviceptr]) -> bool {
    ptrs.iter().all(|p| p % 16 == 0)
}

/// A size as the kernels' `int`, or a panic naming it.
fn c_int(x: usize, what: &str) -> i32 {
    i32::try_from(x).unwrap_or_else(|_| panic!("internal error: {what} = {x} does not fit the kernels' int"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lists_name_exactly_the_kernels_the_sources_define() {
        let mut seen = std::collections::HashSet::new();
        for m in MODULES {
            for k in m.kernels {
                assert!(seen.insert(*k), "{k} listed twice");
                // Directly, or through an instantiating macro that takes the name
                // (`ATTENTION_FORWARD(attention_forward_hd64, 64, false)`).
                let by_macro = m.source.contains(&format!("({k}, "));
                assert!(m.source.contains(&format!(" {k}(")) || by_macro, "{}: {k} is not defined", m.name);
            }
            // Definitions outside macros (a macro's lines end in `\`).
            for line in m
                .source
                .lines()
                .filter(|l| l.contains("extern \"C\" __global__") && !l.contains("##") && !l.trim_end().ends_with('\\'))
            {
                let name = line.split('(').next().unwrap().split_whitespace().last().unwrap();
                let name = if name.starts_with("__launch_bounds__") {
                    line.split(") ").nth(1).unwrap().split('(').next().unwrap()
                } else {
                    name
                };
                assert!(m.kernels.contains(&name), "{}: {name} is not listed", m.name);
            }
        }
    }
}
