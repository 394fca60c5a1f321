//! The CUDA C sources of the backend's kernels, compiled at run time by NVRTC.
//!
//! Each module is one `.cu` file under `kernels/`, compiled with `common.cuh` prepended (NVRTC
//! is given no include path: everything a kernel needs is in the two texts). Every entry point
//! is `extern "C"` and listed here, so that the backend loads them by name and the compile check
//! can prove that each one exists for every architecture.

/// Shared definitions prepended to every module.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// One compilation unit.
#[derive(Debug)]
pub struct Module {
    /// File stem under `kernels/`.
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

/// Every kernel module.
pub const MODULES: &[Module] = &[
    Module {
        name: "elementwise",
        source: include_str!("kernels/elementwise.cu"),
        kernels: &[
            "fill_f32",
            "fill_bf16",
            "copy_bf16_f32",
            "copy_f32_bf16",
            "add_f32_f32",
            "add_f32_bf16",
            "add_bf16_f32",
            "add_bf16_bf16",
            "sum_partials_f32",
            "sum_partials_bf16",
            "sumsq_partials_f32",
            "sumsq_partials_bf16",
            "sum_finish",
        ],
    },
    Module {
        name: "embedding",
        source: include_str!("kernels/embedding.cu"),
        kernels: &["embedding_forward", "embedding_forward_v8", "embedding_backward"],
    },
    Module {
        name: "rmsnorm",
        source: include_str!("kernels/rmsnorm.cu"),
        kernels: &[
            "rmsnorm_forward",
            "rmsnorm_forward_v8",
            "rmsnorm_backward",
            "rmsnorm_backward_v8",
            "rmsnorm_dw_finish",
        ],
    },
    Module { name: "rope", source: include_str!("kernels/rope.cu"), kernels: &["rope"] },
    Module {
        name: "swiglu",
        source: include_str!("kernels/swiglu.cu"),
        kernels: &["swiglu_forward", "swiglu_forward_v8", "swiglu_backward", "swiglu_backward_v8"],
    },
    Module {
        name: "cross_entropy",
        source: include_str!("kernels/cross_entropy.cu"),
        kernels: &["cross_entropy", "cross_entropy_v8"],
    },
    Module { name: "adamw", source: include_str!("kernels/adamw.cu"), kernels: &["adamw"] },
    Module {
        name: "moe",
        source: include_str!("kernels/moe.cu"),
        kernels: &[
            "moe_route",
            "moe_dispatch",
            "moe_stats",
            "moe_gather",
            "moe_gather_backward",
            "moe_combine",
            "moe_combine_backward_rows",
            "moe_combine_backward_weights",
            "moe_route_backward",
        ],
    },
    Module {
        name: "gemm",
        source: include_str!("kernels/gemm.cu"),
        kernels: &["moe_gemm_forward", "moe_gemm_dx", "moe_gemm_dw"],
    },
    Module {
        name: "attention",
        source: include_str!("kernels/attention.cu"),
        kernels: &[
            "attention_forward_hd16",
            "attention_forward_hd32",
            "attention_forward_hd64",
            "attention_forward_hd128",
            "attention_backward_dot",
            "attention_backward_hd16",
            "attention_backward_hd32",
            "attention_backward_hd64",
            "attention_backward_hd128",
            "attention_backward_dq",
        ],
    },
];

/// Largest number of experts the routing kernels handle (8 per lane of a warp).
pub const MAX_EXPERTS: usize = 256;

/// Widest attention head the flash-attention kernels handle.
pub const MAX_HEAD_DIM: usize = 128;

/// The padded head width (`HD`) of the attention kernel for a head of `dh`, a multiple of 8 up
/// to [`MAX_HEAD_DIM`].
pub fn attention_hd(dh: usize) -> usize {
    assert!(dh.is_multiple_of(8) && dh <= MAX_HEAD_DIM, "head_dim {dh} has no attention kernel");
    [16, 32, 64, 128].into_iter().find(|&hd| dh <= hd).expect("dh <= 128")
}

/// Dynamic shared memory of the attention forward kernel for padded width `hd`: the query
/// tile and two buffers each of keys and values, 64 rows of `hd + 8`.
pub fn attention_forward_smem(hd: usize) -> usize {
    5 * 64 * (hd + 8) * 2
}

/// Query rows per inner tile of the attention backward kernel.
pub fn attention_backward_br(hd: usize) -> usize {
    if hd >= 128 { 32 } else { 64 }
}

/// Dynamic shared memory of the attention backward kernel: keys and values, two buffers each of
/// a query tile and its output gradient (rows of `hd + 8`), dSᵀ (64 × (BR + 8)), and two
/// buffers each of the tile's log-sum-exp and D (f32).
pub fn attention_backward_smem(hd: usize) -> usize {
    let br = attention_backward_br(hd);
    (2 * 64 * (hd + 8) + 4 * br * (hd + 8) + 64 * (br + 8)) * 2 + 4 * br * 4
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
                // Directly, or through an instantiating macro such as `ATTENTION_FORWARD(64)`.
                let by_macro = k
                    .rsplit_once("_hd")
                    .is_some_and(|(stem, hd)| m.source.contains(&format!("{}({hd}", stem.to_uppercase())));
                assert!(m.source.contains(&format!(" {k}(")) || by_macro, "{}: {k} is not defined", m.name);
            }
            for line in m.source.lines().filter(|l| l.contains("extern \"C\" __global__") && !l.contains("##")) {
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

    #[test]
    fn attention_tiles_fit_the_shared_memory_of_sm80_and_sm90() {
        // Per-block opt-in limits: 163 KB on sm_80, 227 KB on sm_90.
        for hd in [16, 32, 64, 128] {
            assert!(attention_forward_smem(hd) <= 163 * 1024, "forward hd{hd}");
            assert!(attention_backward_smem(hd) <= 163 * 1024, "backward hd{hd}");
        }
        assert_eq!(attention_hd(8), 16);
        assert_eq!(attention_hd(64), 64);
        assert_eq!(attention_hd(72), 128);
        assert_eq!(attention_forward_smem(128), 87_040);
    }
}
