//! Seeded initialisation, as Hugging Face initialises Llama: weight matrices from
//! `N(0, init_std²)`, RMSNorm weights at one. Tensor `i` of the layout draws from its own
//! counter-based stream, so the values do not depend on threads or on other tensors' sizes.

use rayon::prelude::*;

use super::Model;
use crate::rng;

/// Elements generated per task (even, so normal pairs never straddle tasks).
const CHUNK: usize = 1 << 16;

/// The initial parameters of `model` for `seed`, as a host buffer in layout order.
pub fn params(model: &Model, seed: u64) -> Vec<f32> {
    let mut out = vec![0f32; model.layout.len];
    let std = model.config.init_std;
    for (stream, t) in model.layout.tensors.iter().enumerate() {
        let dst = &mut out[t.offset..t.offset + t.len()];
        if t.shape.len() == 1 {
            dst.fill(1.0);
            continue;
        }
        dst.par_chunks_mut(CHUNK)
            .enumerate()
            .for_each(|(chunk, c)| {
                let first_pair = (chunk * CHUNK / 2) as u64;
                for (i, pair) in c.chunks_mut(2).enumerate() {
                    let (a, b) = rng::normal_pair(seed, stream as u64, first_pair + i as u64);
                    pair[0] = (a * std) as f32;
                    if let Some(second) = pair.get_mut(1) {
                        *second = (b * std) as f32;
                    }
                }
            });
    }
    out
}
