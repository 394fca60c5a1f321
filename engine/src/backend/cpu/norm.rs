//! RMSNorm (statistics in f64, values in f32).
//!
//! forward:  r = 1 / sqrt(mean_j(x_j²) + eps),  y_j = w_j · x_j · r
//! backward: dx_i += r · (dy_i w_i - x_i · r² · mean_j(dy_j w_j x_j))
//!           dw_j += Σ_rows dy_j · x_j · r
//!
//! `w` here is `offset + stored` in f32 (Gemma stores its norms as offsets from one); the
//! weight gradient is the stored tensor's as well.

use super::ROW_CHUNK;
use rayon::prelude::*;

/// Normalises each row of width `d`; saves `rstd[row] = r`.
pub fn forward(out: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], offset: f32, d: usize, eps: f32) {
    assert_eq!(w.len(), d);
    let w: &[f32] = &super::offset_weight(w, offset);
    out.par_chunks_mut(d).zip(rstd.par_iter_mut()).zip(x.par_chunks(d)).for_each(|((y, r), x)| {
        let ms = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        *r = (1.0 / (ms + eps as f64).sqrt()) as f32;
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
            *y = w * (x * *r);
        }
    });
}

/// Accumulates the input gradient into `dx` and the weight gradient into `dw`. `partials` holds
/// one weight-gradient row per chunk of [`ROW_CHUNK`] rows, added in order at the end.
pub fn backward(
    dx: &mut [f32],
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    (w, offset): (&[f32], f32),
    rstd: &[f32],
    d: usize,
    partials: &mut [f64],
) {
    let w: &[f32] = &super::offset_weight(w, offset);
    let rows = rstd.len();
    assert_eq!(partials.len(), rows.div_ceil(ROW_CHUNK) * d);
    dx.par_chunks_mut(ROW_CHUNK * d).zip(partials.par_chunks_mut(d)).enumerate().for_each(|(chunk, (dx, dw_part))| {
        dw_part.fill(0.0);
        let first = chunk * ROW_CHUNK;
        for (i, dx) in dx.chunks_exact_mut(d).enumerate() {
            let row = first + i;
            let (x, dy, r) = (&x[row * d..(row + 1) * d], &dy[row * d..(row + 1) * d], rstd[row]);
            let dot: f64 = dy.iter().zip(w).zip(x).map(|((&g, &w), &x)| g as f64 * w as f64 * x as f64).sum();
            let c = (dot / d as f64) as f32 * r * r;
            for j in 0..d {
                dx[j] += r * (dy[j] * w[j] - x[j] * c);
                dw_part[j] += (dy[j] * x[j] * r) as f64;
            }
        }
    });
    let chunks = rows.div_ceil(ROW_CHUNK);
    dw.par_iter_mut().enumerate().for_each(|(j, dw)| {
        let total: f64 = (0..chunks).map(|c| partials[c * d + j]).sum();
        *dw += total as f32;
    });
}
