//! Token embedding lookup.
//!
//! forward:  out[n, :] = table[tokens[n], :]
//! backward: dtable[tokens[n], :] += dout[n, :]

use rayon::prelude::*;

/// Gathers one table row per token.
pub fn forward(out: &mut [f32], table: &[f32], tokens: &[u32], d: usize) {
    assert_eq!(out.len(), tokens.len() * d);
    out.par_chunks_mut(d).zip(tokens.par_iter()).for_each(|(row, &t)| {
        let t = t as usize;
        row.copy_from_slice(&table[t * d..(t + 1) * d]);
    });
}

/// Adds each token's output gradient to its table row. Tokens repeat, so rows are visited in
/// token order on one thread: cheap (N · D adds) and deterministic.
pub fn backward(dtable: &mut [f32], dout: &[f32], tokens: &[u32], d: usize) {
    assert_eq!(dout.len(), tokens.len() * d);
    for (row, &t) in dout.chunks_exact(d).zip(tokens) {
        let t = t as usize;
        dtable[t * d..(t + 1) * d].iter_mut().zip(row).for_each(|(g, x)| *g += x);
    }
}
