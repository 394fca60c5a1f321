//! Tensor parallelism: which slice of each tensor a device of the tensor group holds.
//!
//! Megatron-LM's split. A device of a group of `T` keeps `1/T` of the query and key/value heads,
//! `1/T` of the MLP's columns (of every expert's, in a mixture of experts) and `1/T` of the
//! vocabulary, so it runs the same model with `n_heads / T`, `n_kv_heads / T`, `mlp_dim / T`
//! and `vocab_size / T`: its [`Layout`] is the layout of that *local* configuration. The
//! products into a slice (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, `w1`, `w3`;
//! GPT's `c_attn` and `c_fc` with their biases) take whole rows of the weight; the products out
//! of it (`o_proj`, `down_proj`, `w2`; GPT's two `c_proj`) take whole columns and give partial
//! sums that the group adds up ([`crate::model::Exchange`]), their biases replicated and added
//! once, after the sum. Vocabulary parallelism: the embedding's rows and the output head's
//! (its output columns) are split by token, device `r` holding tokens `r · V/T ..`; the
//! embedding's lookups and the loss are summed (and maximised) over the group
//! ([`crate::model::Model::forward`]). Everything else (positions, norms, router) is replicated.
//!
//! Latent attention (DeepSeek-V3) splits its heads the same way (`q_b_proj` or `q_proj` and
//! `kv_b_proj` by rows, `o_proj` by columns) and replicates the latents' projections and norms
//! (`model/attention/mla.rs`); dense layers among experts split their own width
//! (`moe.dense_mlp_dim / T`), shared experts theirs with the experts' columns.
//!
//! GPT's `c_attn` holds q, k and v one after the other in one tensor: a device's rows are its
//! heads' part of each, three runs.
//!
//! A [`TensorSlice`] maps each local tensor onto the single-device layout as a strided [`Run`],
//! which is all that initialisation, checkpoints and resharding need.

use crate::config::ModelConfig;
use crate::model::{Layout, Stage};

/// How a weight is split over the tensor group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every device holds all of it.
    Replicated,
    /// Device `r` holds rows `[r · rows / T, (r + 1) · rows / T)` (output features).
    Rows,
    /// Device `r` holds columns `[r · cols / T, (r + 1) · cols / T)` (input features).
    Cols,
}

/// How the tensor with this Hugging Face name is split.
pub fn split_of(name: &str) -> Split {
    const ROWS: [&str; 15] = [
        "self_attn.sinks",
        "q_proj",
        "q_b_proj",
        "kv_b_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        ".w1",
        ".w3",
        "attn.c_attn",
        "mlp.c_fc",
        "embed_tokens",
        "transformer.wte",
        "lm_head",
    ];
    const COLS: [&str; 4] = ["o_proj", "down_proj", ".w2", ".c_proj"];
    // Biases: those of column-parallel products split with their rows (`c_attn`, `c_fc`);
    // those of row-parallel ones (`c_proj`) are replicated, added once after the sum.
    let (base, bias) = match name.strip_suffix(".bias") {
        Some(base) => (base, true),
        None => (name.strip_suffix(".weight").unwrap_or(name), false),
    };
    if ROWS.iter().any(|s| base.ends_with(s)) {
        Split::Rows
    } else if !bias && COLS.iter().any(|s| base.ends_with(s)) {
        Split::Cols
    } else {
        Split::Replicated
    }
}

/// The configuration one device of a tensor group of `size` runs (see the module comment).
/// The caller has checked divisibility ([`crate::parallel::mesh::Mesh::check_model`]).
pub fn local_config(m: &ModelConfig, size: usize) -> ModelConfig {
    let moe =
        m.moe.as_ref().map(|moe| crate::config::MoeConfig { dense_mlp_dim: moe.dense_mlp_dim / size, ..moe.clone() });
    ModelConfig {
        n_heads: m.n_heads / size,
        n_kv_heads: m.n_kv_heads / size,
        mlp_dim: m.mlp_dim / size,
        vocab_size: m.vocab_size / size,
        moe,
        ..m.clone()
    }
}

/// `count` chunks of `len` elements: local elements `local + i·len ..` are global elements
/// `global + i·stride ..` of the single-device layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Run {
    /// First local element.
    pub local: usize,
    /// First global element.
    pub global: usize,
    /// Elements per chunk.
    pub len: usize,
    /// Number of chunks.
    pub count: usize,
    /// Distance between chunks in the global layout.
    pub stride: usize,
}

impl Run {
    /// Elements covered.
    pub fn elements(&self) -> usize {
        self.len * self.count
    }

    /// The `(local, global, len)` pieces of this run that fall in local elements `range`.
    pub fn pieces(&self, range: std::ops::Range<usize>) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.count).filter_map(move |i| {
            let start = self.local + i * self.len;
            let (lo, hi) = (start.max(range.start), (start + self.len).min(range.end));
            (lo < hi).then(|| (lo, self.global + i * self.stride + (lo - start), hi - lo))
        })
    }
}

/// One device's slice of the model: its local layout, the single-device one, and a [`Run`] per
/// local tensor, in layout order.
#[derive(Debug, Clone)]
pub struct TensorSlice {
    /// The layout of the local configuration.
    pub local: Layout,
    /// The single-device layout.
    pub global: Layout,
    /// Where each local tensor comes from.
    pub runs: Vec<Run>,
    /// Index in `global.tensors` of each local tensor (its initialisation stream).
    pub global_index: Vec<usize>,
    /// Devices in the tensor group.
    pub size: usize,
    /// Whether the device holds only some of the experts (an expert axis): their gradient
    /// norms add up over the expert group.
    pub divides_experts: bool,
}

impl TensorSlice {
    /// The slice device `rank` of a tensor group of `size` holds of `model`.
    pub fn new(model: &ModelConfig, rank: usize, size: usize) -> TensorSlice {
        let whole = Layout::new(model);
        TensorSlice::of_stage(model, &whole.stage, rank, size, whole.experts)
    }

    /// The slice device `rank` of a tensor group of `size` holds of a pipeline stage of
    /// `model` and of its `experts` (all, or a device's own on an expert axis): the stage's
    /// tensors, mapped onto the whole model's single-device layout.
    pub fn of_stage(
        model: &ModelConfig,
        stage: &Stage,
        rank: usize,
        size: usize,
        experts: std::ops::Range<usize>,
    ) -> TensorSlice {
        let global = Layout::new(model);
        let divides_experts = experts != global.experts;
        let local = Layout::stage_with_experts(&local_config(model, size), stage, experts);
        let mut runs = Vec::with_capacity(local.tensors.len());
        let mut global_index = Vec::with_capacity(local.tensors.len());
        for t in &local.tensors {
            let i = global.tensors.iter().position(|g| g.name == t.name).expect("same tensor names");
            let g = &global.tensors[i];
            let run = match split_of(&t.name) {
                _ if size == 1 => Run { local: t.offset, global: g.offset, len: t.len(), count: 1, stride: 0 },
                Split::Replicated => Run { local: t.offset, global: g.offset, len: t.len(), count: 1, stride: 0 },
                Split::Rows => {
                    // Each block's rows `r · rows / T ..`: the logical matrices a tensor stacks
                    // (one but for GPT's `c_attn`, q, k and v), each split on its own.
                    let blocks = t.matrices().len();
                    let (len, stride) = (t.len() / blocks, g.len() / blocks);
                    Run { local: t.offset, global: g.offset + rank * len, len, count: blocks, stride }
                }
                Split::Cols => {
                    let (rows, cols) = (t.shape[0], t.shape[1]);
                    Run { local: t.offset, global: g.offset + rank * cols, len: cols, count: rows, stride: g.shape[1] }
                }
            };
            runs.push(run);
            global_index.push(i);
        }
        TensorSlice { local, global, runs, global_index, size, divides_experts }
    }

    /// Whether the local tensor at `index` is split (its gradient norm adds up over the group).
    pub fn is_split(&self, index: usize) -> bool {
        self.size > 1 && split_of(&self.local.tensors[index].name) != Split::Replicated
    }

    /// Whether the local tensor at `index` is an expert's that other members of the expert
    /// group do not hold (its gradient norm adds up over the group).
    pub fn is_divided_expert(&self, index: usize) -> bool {
        self.divides_experts && self.local.tensors[index].name.contains(".experts.")
    }

    /// Every local tensor's values, one at a time: `whole(g, out)` fills `out` with all of
    /// global tensor `g`'s values, and `local(i, values)` receives this device's slice of them
    /// (the whole local tensor `i`). The host holds one global tensor at a time.
    pub fn for_each_local(&self, mut whole: impl FnMut(usize, &mut Vec<f32>), mut local: impl FnMut(usize, &[f32])) {
        let (mut values, mut mine) = (Vec::new(), Vec::new());
        for (i, t) in self.local.tensors.iter().enumerate() {
            let g = self.global_index[i];
            values.resize(self.global.tensors[g].len(), 0.0);
            whole(g, &mut values);
            mine.resize(t.len(), 0.0);
            self.extract(i, &values, &mut mine);
            local(i, &mine);
        }
    }

    /// Copies the local elements of a global tensor (`values`, the whole of global tensor
    /// `global_index[i]`) into `out` (the whole local tensor `i`).
    pub fn extract(&self, i: usize, values: &[f32], out: &mut [f32]) {
        let (run, base) = (self.runs[i], self.global.tensors[self.global_index[i]].offset);
        for c in 0..run.count {
            let from = run.global - base + c * run.stride;
            out[c * run.len..(c + 1) * run.len].copy_from_slice(&values[from..from + run.len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::recipe::{Override, resolve};

    /// The slices of a group cover every split tensor exactly once and every replicated one
    /// on each device.
    #[test]
    fn the_slices_of_a_group_tile_the_model() {
        for name in ["tiny-llama2", "tiny-mixtral", "tiny-gpt", "tiny-qwen3", "tiny-qwen3-moe"] {
            let m = resolve(name, &Override::from_list("model.vocab_size=64", "test")).unwrap().config.model;
            let global = Layout::new(&m);
            let mut hits = vec![0u8; global.len];
            for rank in 0..2 {
                let slice = TensorSlice::new(&m, rank, 2);
                assert_eq!(slice.runs.iter().map(Run::elements).sum::<usize>(), slice.local.len);
                for run in &slice.runs {
                    for (_, g, len) in run.pieces(run.local..run.local + run.elements()) {
                        hits[g..g + len].iter_mut().for_each(|h| *h += 1);
                    }
                }
            }
            for t in &global.tensors {
                let want = if split_of(&t.name) == Split::Replicated { 2 } else { 1 };
                assert!(hits[t.offset..t.offset + t.len()].iter().all(|&h| h == want), "{name}: {}", t.name);
            }
        }
    }

    #[test]
    fn names_map_to_megatron_splits() {
        assert_eq!(split_of("model.layers.0.self_attn.k_proj.weight"), Split::Rows);
        assert_eq!(split_of("model.layers.3.block_sparse_moe.experts.7.w3.weight"), Split::Rows);
        assert_eq!(split_of("model.layers.0.mlp.down_proj.weight"), Split::Cols);
        assert_eq!(split_of("model.layers.1.block_sparse_moe.experts.0.w2.weight"), Split::Cols);
        assert_eq!(split_of("model.layers.1.block_sparse_moe.gate.weight"), Split::Replicated);
        assert_eq!(split_of("lm_head.weight"), Split::Rows);
        assert_eq!(split_of("model.embed_tokens.weight"), Split::Rows);
        assert_eq!(split_of("model.norm.weight"), Split::Replicated);
        // GPT: the fused q, k, v and the MLP's first product are column-parallel with their
        // biases; the two `c_proj` are row-parallel, their biases replicated.
        assert_eq!(split_of("transformer.wte.weight"), Split::Rows);
        assert_eq!(split_of("transformer.wpe.weight"), Split::Replicated);
        assert_eq!(split_of("transformer.h.0.attn.c_attn.bias"), Split::Rows);
        assert_eq!(split_of("transformer.h.0.mlp.c_fc.weight"), Split::Rows);
        assert_eq!(split_of("transformer.h.0.mlp.c_fc.bias"), Split::Rows);
        assert_eq!(split_of("transformer.h.0.attn.c_proj.weight"), Split::Cols);
        assert_eq!(split_of("transformer.h.0.mlp.c_proj.bias"), Split::Replicated);
        assert_eq!(split_of("transformer.h.1.ln_2.bias"), Split::Replicated);
    }

    /// A device's part of GPT's fused `c_attn` is its heads' rows of q, of k and of v.
    #[test]
    fn gpt_fused_qkv_splits_each_of_q_k_and_v() {
        let m = resolve("tiny-gpt", &Override::from_list("model.vocab_size=64", "test")).unwrap().config.model;
        let slice = TensorSlice::new(&m, 1, 2);
        let i = slice.local.tensors.iter().position(|t| t.name == "transformer.h.0.attn.c_attn.weight").unwrap();
        let (run, g) = (slice.runs[i], &slice.global.tensors[slice.global_index[i]]);
        let q = m.q_dim() * m.d_model;
        assert_eq!((run.count, run.len, run.stride), (3, q / 2, q));
        assert_eq!(run.global, g.offset + q / 2);
    }
}
