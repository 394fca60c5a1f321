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

/// Vocabulary parallelism: `table` holds the rows of tokens `first..first + rows`; another
/// slice's token gets a zero row.
pub fn forward_slice(out: &mut [f32], table: &[f32], tokens: &[u32], d: usize, first: usize) {
    assert_eq!(out.len(), tokens.len() * d);
    let rows = first..first + table.len() / d;
    out.par_chunks_mut(d).zip(tokens.par_iter()).for_each(|(row, &t)| {
        let t = t as usize;
        if rows.contains(&t) {
            row.copy_from_slice(&table[(t - first) * d..(t - first + 1) * d]);
        } else {
            row.fill(0.0);
        }
    });
}

/// [`backward`] into a slice of the table: only the slice's tokens add.
pub fn backward_slice(dtable: &mut [f32], dout: &[f32], tokens: &[u32], d: usize, first: usize) {
    assert_eq!(dout.len(), tokens.len() * d);
    let rows = first..first + dtable.len() / d;
    for (row, &t) in dout.chunks_exact(d).zip(tokens) {
        let t = t as usize;
        if rows.contains(&t) {
            dtable[(t - first) * d..(t - first + 1) * d].iter_mut().zip(row).for_each(|(g, x)| *g += x);
        }
    }
}
