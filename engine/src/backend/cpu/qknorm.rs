//! QK-norm (Qwen3, Gemma 3): RMSNorm of width `Dh` over each query head and each key head of
//! packed qkv rows `[q: H·Dh | k: KV·Dh | v: KV·Dh]`, before RoPE. Query heads share the weight
//! `wq`, key heads `wk` (`w = [wq | wk]`, 2·Dh); values pass through. Statistics in f64, values
//! in f32, as `norm.rs`.
//!
//! `w` is `offset + stored` in f32 (Gemma 3's `1 + w`), as `norm.rs`.
//!
//! forward:  per head vector x (width Dh), r = 1 / sqrt(mean_j(x_j²) + eps),  y_j = w_j · x_j · r
//! backward: dx_i = r · (dy_i w_i - x_i · r² · mean_j(dy_j w_j x_j))   (in place of dy)
//!           dw_j += Σ_heads dy_j · x_j · r   (q heads into dwq, k heads into dwk)

use super::ROW_CHUNK;
use crate::backend::AttnShape;
use rayon::prelude::*;

/// Normalises the q and k heads of every row of `x` into `out` (v copied); saves
/// `rstd[row · (H + KV) + head]`.
pub fn forward(out: &mut [f32], rstd: &mut [f32], x: &[f32], (w, offset): (&[f32], f32), shape: AttnShape, eps: f32) {
    let w: &[f32] = &super::offset_weight(w, offset);
    let (width, dh, heads) = (shape.qkv_width(), shape.head_dim, shape.n_heads + shape.n_kv_heads);
    assert_eq!(w.len(), 2 * dh, "internal error: qk_norm weights are [wq | wk]");
    out.par_chunks_mut(width).zip(rstd.par_chunks_mut(heads)).zip(x.par_chunks(width)).for_each(|((y, r), x)| {
        for (h, r) in r.iter_mut().enumerate() {
            let (x, y) = (&x[h * dh..(h + 1) * dh], &mut y[h * dh..(h + 1) * dh]);
            let w = if h < shape.n_heads { &w[..dh] } else { &w[dh..] };
            let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dh as f64;
            *r = (1.0 / (ms + eps as f64).sqrt()) as f32;
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                *y = w * (x * *r);
            }
        }
        y[heads * dh..].copy_from_slice(&x[heads * dh..]);
    });
}

/// Turns `dqkv`'s q and k parts (the output's gradient) into the input's, in place; v's is the
/// same on both sides. Adds the weight gradients to `dw` (`[dwq | dwk]`). `partials` holds one
/// `2·Dh` row per chunk of [`ROW_CHUNK`] rows, added in order at the end, so the sums do not
/// depend on the thread count.
pub fn backward(
    dqkv: &mut [f32],
    dw: &mut [f32],
    x: &[f32],
    (w, offset): (&[f32], f32),
    rstd: &[f32],
    shape: AttnShape,
    partials: &mut [f64],
) {
    let w: &[f32] = &super::offset_weight(w, offset);
    let (width, dh, heads) = (shape.qkv_width(), shape.head_dim, shape.n_heads + shape.n_kv_heads);
    let rows = rstd.len() / heads;
    assert_eq!(partials.len(), rows.div_ceil(ROW_CHUNK) * 2 * dh);
    dqkv.par_chunks_mut(ROW_CHUNK * width).zip(partials.par_chunks_mut(2 * dh)).enumerate().for_each(
        |(chunk, (dy, dw_part))| {
            dw_part.fill(0.0);
            for (i, dy) in dy.chunks_exact_mut(width).enumerate() {
                let row = chunk * ROW_CHUNK + i;
                for h in 0..heads {
                    let r = rstd[row * heads + h];
                    let x = &x[row * width + h * dh..row * width + (h + 1) * dh];
                    let dy = &mut dy[h * dh..(h + 1) * dh];
                    let part = if h < shape.n_heads { 0 } else { dh };
                    let (w, dw_part) = (&w[part..part + dh], &mut dw_part[part..part + dh]);
                    let dot: f64 = dy.iter().zip(w).zip(x).map(|((&g, &w), &x)| g as f64 * w as f64 * x as f64).sum();
                    let c = (dot / dh as f64) as f32 * r * r;
                    for j in 0..dh {
                        dw_part[j] += (dy[j] * x[j] * r) as f64;
                        dy[j] = r * (dy[j] * w[j] - x[j] * c);
                    }
                }
            }
        },
    );
    let chunks = rows.div_ceil(ROW_CHUNK);
    dw.par_iter_mut().enumerate().for_each(|(j, dw)| {
        let total: f64 = (0..chunks).map(|c| partials[c * 2 * dh + j]).sum();
        *dw += total as f32;
    });
}
