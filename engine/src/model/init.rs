//! Seeded initialisation, as Hugging Face initialises Llama and GPT-2: weight matrices (and
//! GPT's position table) from `N(0, init_std²)`, norm weights at one (Gemma's, stored as
//! offsets from one, at zero), biases at zero. Tensor `i` of the layout draws from its own
//! counter-based stream, so the values depend neither on threads nor on other tensors.

use rayon::prelude::*;

use super::{Model, Tensor};
use crate::backend::{Backend, View};
use crate::rng;

/// Elements generated per task (even, so normal pairs never straddle tasks).
const CHUNK: usize = 1 << 16;

/// Writes the initial value of tensor number `stream` of the single-device layout into `out`
/// (a tensor-parallel device takes its slice of it: `parallel::tensor::TensorSlice`).
pub fn tensor(t: &Tensor, stream: usize, seed: u64, std: f32, out: &mut [f32]) {
    if t.shape.len() == 1 {
        // Biases (and DeepSeek-V3's selection bias, `e_score_correction_bias`) start at zero.
        out.fill(if t.name.ends_with("bias") || t.offset_from_one { 0.0 } else { 1.0 });
        return;
    }
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(chunk, c)| {
        let first_pair = (chunk * CHUNK / 2) as u64;
        for (i, pair) in c.chunks_mut(2).enumerate() {
            let (a, b) = rng::normal_pair(seed, stream as u64, first_pair + i as u64);
            pair[0] = a * std;
            if let Some(second) = pair.get_mut(1) {
                *second = b * std;
            }
        }
    });
}

/// The initial parameters of `model` for `seed`, as a host buffer in layout order.
pub fn params(model: &Model, seed: u64) -> Vec<f32> {
    let mut out = vec![0f32; model.layout.len];
    for (stream, t) in model.layout.tensors.iter().enumerate() {
        tensor(t, stream, seed, model.config.init_std as f32, &mut out[t.offset..t.offset + t.len()]);
    }
    out
}

/// Initialises the flat parameter buffer `params` on a backend, one tensor at a time (the host
/// holds at most the largest tensor).
pub fn upload_params<B: Backend>(be: &mut B, params: View, model: &Model, seed: u64) {
    let mut host = Vec::new();
    for (stream, t) in model.layout.tensors.iter().enumerate() {
        host.resize(t.len(), 0.0);
        tensor(t, stream, seed, model.config.init_std as f32, &mut host);
        be.upload(params.at(t.offset, t.len()), &host);
    }
}
