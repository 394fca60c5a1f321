//! Learned attention sinks (GPT-OSS), as an epilogue of attention.
//!
//! Each query head h has a learned logit `s_h`, appended as one more column to every query
//! row's (scaled, masked) scores; the softmax runs over keys and sink, and the sink's column,
//! which has no value, is dropped, so a row's probabilities sum to less than one. Attention
//! without the sink leaves `o = Σ_j p_j v_j` and `L = log Σ_j exp(s_j)` (natural log); the sink
//! only renormalises them, per token row r and head h:
//!
//! forward:  L' = logaddexp(L, s_h)
//!           o' = o · exp(L − L')              (= o · σ(L − s_h))
//!           lse ← L'
//! backward: dq, dk, dv: the ordinary attention backward given (o', L'), unchanged: with
//!           P'_j = exp(S_j − L'), D' = do · o', dS_j = P'_j (dP_j − D') is the sinked softmax's
//!           own (the sink column has no value, so its dP is zero)
//!           ds_h += − Σ_r exp(s_h − L'_r) · (do_{r,h} · o'_{r,h})
//!
//! `out` and `dout` are `[rows, heads · head_dim]`, `lse` `[rows, heads]`, `sinks` and
//! `dsinks` `[heads]`. Statistics in f64; each head's gradient sums its rows in order.

use rayon::prelude::*;

/// `log(exp(a) + exp(b))`, exact for `a = −∞` (then `b`).
fn logaddexp(a: f64, b: f64) -> f64 {
    let m = a.max(b);
    if m == f64::NEG_INFINITY { m } else { m + (-(a - b).abs()).exp().ln_1p() }
}

/// Applies the sinks to attention's `out` and `lse`, in place.
pub fn forward(out: &mut [f32], lse: &mut [f32], sinks: &[f32], heads: usize, head_dim: usize) {
    let width = heads * head_dim;
    assert_eq!(sinks.len(), heads, "internal error: attention sinks: one sink a head");
    assert_eq!(out.len(), lse.len() * head_dim, "internal error: attention sinks: out is [rows, heads · head_dim]");
    if width == 0 {
        return;
    }
    out.par_chunks_mut(width).zip(lse.par_chunks_mut(heads)).for_each(|(o, l)| {
        for (h, (o, l)) in o.chunks_exact_mut(head_dim).zip(l).enumerate() {
            let (before, after) = (*l as f64, logaddexp(*l as f64, sinks[h] as f64));
            let scale = (before - after).exp() as f32;
            for x in o {
                *x *= scale;
            }
            *l = after as f32;
        }
    });
}

/// Adds the sinks' gradient to `dsinks`, from the output's gradient `dout` and what
/// [`forward`] left: `out` (o') and `lse` (L').
pub fn backward(
    dsinks: &mut [f32],
    dout: &[f32],
    out: &[f32],
    lse: &[f32],
    sinks: &[f32],
    heads: usize,
    head_dim: usize,
) {
    let width = heads * head_dim;
    assert_eq!(sinks.len(), heads, "internal error: attention sinks: one sink a head");
    assert_eq!(dsinks.len(), heads, "internal error: attention sinks: one gradient a head");
    assert_eq!(out.len(), lse.len() * head_dim, "internal error: attention sinks: out is [rows, heads · head_dim]");
    assert_eq!(dout.len(), out.len(), "internal error: attention sinks: dout is out's shape");
    if width == 0 {
        return;
    }
    let rows = out.len() / width;
    dsinks.par_iter_mut().enumerate().for_each(|(h, ds)| {
        let s = sinks[h] as f64;
        let total: f64 = (0..rows)
            .map(|r| {
                let at = r * width + h * head_dim;
                let (g, o) = (&dout[at..at + head_dim], &out[at..at + head_dim]);
                let dot: f64 = g.iter().zip(o).map(|(&g, &o)| g as f64 * o as f64).sum();
                (s - lse[r * heads + h] as f64).exp() * dot
            })
            .sum();
        *ds -= total as f32;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The epilogue gives a softmax over the keys and the sink, the sink's column dropped.
    #[test]
    fn sinks_renormalise_a_dense_softmax() {
        let (scores, values) = ([0.3f64, -1.2, 2.0], [[1.0f64, -2.0], [0.5, 4.0], [-3.0, 1.0]]);
        let sink = 1.1f64;
        let l = scores.iter().map(|s| s.exp()).sum::<f64>().ln();
        let mut out: Vec<f32> =
            (0..2).map(|c| scores.iter().zip(&values).map(|(s, v)| (s - l).exp() * v[c]).sum::<f64>() as f32).collect();
        let mut lse = vec![l as f32];
        forward(&mut out, &mut lse, &[sink as f32], 1, 2);
        let z = scores.iter().map(|s| s.exp()).sum::<f64>() + sink.exp();
        assert!((lse[0] as f64 - z.ln()).abs() < 1e-6);
        for c in 0..2 {
            let want: f64 = scores.iter().zip(&values).map(|(s, v)| s.exp() / z * v[c]).sum();
            assert!((out[c] as f64 - want).abs() < 1e-6, "{c}: {} vs {want}", out[c]);
        }
        // A row that saw no key is the sink's alone: no output, L' = s.
        let (mut out, mut lse) = (vec![0.0f32; 2], vec![f32::NEG_INFINITY]);
        forward(&mut out, &mut lse, &[sink as f32], 1, 2);
        assert_eq!((out, lse), (vec![0.0, 0.0], vec![sink as f32]));
    }
}
