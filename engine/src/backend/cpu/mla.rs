//! DeepSeek-V3's multi-head latent attention (MLA) around the ordinary attention op: the packed
//! qkv rows assembled from MLA's pieces, and the heads narrowed from the attention's width to the
//! values' (and widened back).
//!
//! Per row at position t = row % seq, per head h (widths nope, rope, v; qk = nope + rope):
//!
//! forward:  q_h = s · [q_nope_h | R_t(P(q_rope_h))]
//!           k_h =     [k_nope_h | R_t(P(kpe))]          (one rotary key for every head)
//!           v_h =     [v_h      | 0 … 0]                 (qk − v zeros)
//! backward: dq_h  = s · [dq_nope_h | Pᵀ R_tᵀ dq_rope_h]
//!           dkv_h = [dk_nope_h | dv_h[..v]]
//!           dkpe  = Pᵀ R_tᵀ Σ_h dk_rope_h               (heads summed in order 0..H, in f64)
//!
//! R_t rotates pairs (i, i + rope/2) by table pair i, "rotate half" as `rope.rs`:
//! (a, b) -> (a cos − b sin, b cos + a sin); its transpose rotates by −θ. P is the identity, or
//! with `interleave` the de-interleaving x -> [x0, x2, x4, …, x1, x3, x5, …] (Hugging Face's
//! `apply_rotary_pos_emb_interleave`): pair i of the rotation takes x[2i] and x[2i + 1].
//!
//! narrow:   out_h = x_h[..to]              (x heads `from` wide, to ≤ from)
//! widen:    out_h = [x_h | 0 … 0]          (to ≥ from): narrow's adjoint

use crate::backend::MlaShape;
use rayon::prelude::*;

/// Where pair `i` of the rotation reads its two inputs in a rope part (`P`).
fn pair(i: usize, half: usize, interleave: bool) -> (usize, usize) {
    if interleave { (2 * i, 2 * i + 1) } else { (i, half + i) }
}

/// `out = scale · R(P(x))` over one rope part; `cs` holds the position's (cos, sin) pairs.
fn rotate(out: &mut [f32], x: &[f32], cs: &[f32], interleave: bool, scale: f32) {
    let half = x.len() / 2;
    for i in 0..half {
        let (lo, hi) = pair(i, half, interleave);
        let (cos, sin, a, b) = (cs[2 * i], cs[2 * i + 1], x[lo], x[hi]);
        out[i] = scale * (a * cos - b * sin);
        out[half + i] = scale * (b * cos + a * sin);
    }
}

/// `dx = scale · Pᵀ Rᵀ g` over one rope part: the transpose of [`rotate`].
fn rotate_back(dx: &mut [f32], g: &[f32], cs: &[f32], interleave: bool, scale: f32) {
    let half = g.len() / 2;
    for i in 0..half {
        let (lo, hi) = pair(i, half, interleave);
        let (cos, sin, ga, gb) = (cs[2 * i], cs[2 * i + 1], g[i], g[half + i]);
        dx[lo] = scale * (ga * cos + gb * sin);
        dx[hi] = scale * (gb * cos - ga * sin);
    }
}

fn check(s: MlaShape, table: &[f32]) {
    assert!(s.rope > 0 && s.rope.is_multiple_of(2), "internal error: MLA's rotary width {} is not even", s.rope);
    assert!(s.v <= s.qk(), "internal error: MLA's value heads ({}) are wider than qk ({})", s.v, s.qk());
    assert!(s.heads > 0 && s.nope + s.v > 0, "internal error: MLA shape {s:?} has empty heads");
    assert!(s.rows == 0 || s.seq > 0, "internal error: MLA rows without a sequence length");
    assert!(table.len() >= s.seq.min(s.rows) * s.rope, "internal error: MLA's RoPE table is shorter than the sequence");
}

/// Assembles the packed qkv rows (see the module documentation).
pub fn qkv_forward(qkv: &mut [f32], q: &[f32], kv: &[f32], kpe: &[f32], table: &[f32], s: MlaShape, q_scale: f32) {
    check(s, table);
    let (qk, nope, rope, v, h) = (s.qk(), s.nope, s.rope, s.v, s.heads);
    let (qw, kvw) = (s.q_width(), s.kv_width());
    assert_eq!(qkv.len(), s.rows * s.qkv_width(), "internal error: mla_qkv_forward: qkv length");
    assert_eq!(q.len(), s.rows * qw, "internal error: mla_qkv_forward: q length");
    assert_eq!(kv.len(), s.rows * kvw, "internal error: mla_qkv_forward: kv length");
    assert_eq!(kpe.len(), s.rows * rope, "internal error: mla_qkv_forward: kpe length");
    if s.rows == 0 {
        return;
    }
    qkv.par_chunks_mut(s.qkv_width()).enumerate().for_each(|(row, out)| {
        let t = row % s.seq;
        let cs = &table[t * rope..(t + 1) * rope];
        let (q, kv, kpe) = (&q[row * qw..(row + 1) * qw], &kv[row * kvw..(row + 1) * kvw], &kpe[row * rope..][..rope]);
        let (oq, rest) = out.split_at_mut(h * qk);
        let (ok, ov) = rest.split_at_mut(h * qk);
        for (oq, q) in oq.chunks_exact_mut(qk).zip(q.chunks_exact(qk)) {
            for (o, &x) in oq[..nope].iter_mut().zip(&q[..nope]) {
                *o = q_scale * x;
            }
            rotate(&mut oq[nope..], &q[nope..], cs, s.interleave, q_scale);
        }
        // The rotary key once, into head 0, then copied into the other heads.
        rotate(&mut ok[nope..qk], kpe, cs, s.interleave, 1.0);
        let (k0, others) = ok.split_at_mut(qk);
        for k in others.chunks_exact_mut(qk) {
            k[nope..].copy_from_slice(&k0[nope..]);
        }
        for ((k, o), kv) in ok.chunks_exact_mut(qk).zip(ov.chunks_exact_mut(qk)).zip(kv.chunks_exact(nope + v)) {
            k[..nope].copy_from_slice(&kv[..nope]);
            o[..v].copy_from_slice(&kv[nope..]);
            o[v..].fill(0.0);
        }
    });
}

/// The adjoint of [`qkv_forward`] (see the module documentation); every output overwritten.
pub fn qkv_backward(
    dq: &mut [f32],
    dkv: &mut [f32],
    dkpe: &mut [f32],
    dqkv: &[f32],
    table: &[f32],
    s: MlaShape,
    q_scale: f32,
) {
    check(s, table);
    let (qk, nope, rope, v, h) = (s.qk(), s.nope, s.rope, s.v, s.heads);
    let (qw, kvw, width) = (s.q_width(), s.kv_width(), s.qkv_width());
    assert_eq!(dqkv.len(), s.rows * width, "internal error: mla_qkv_backward: dqkv length");
    assert_eq!(dq.len(), s.rows * qw, "internal error: mla_qkv_backward: dq length");
    assert_eq!(dkv.len(), s.rows * kvw, "internal error: mla_qkv_backward: dkv length");
    assert_eq!(dkpe.len(), s.rows * rope, "internal error: mla_qkv_backward: dkpe length");
    if s.rows == 0 {
        return;
    }
    dq.par_chunks_mut(qw).zip(dkv.par_chunks_mut(kvw)).zip(dkpe.par_chunks_mut(rope)).enumerate().for_each(
        |(row, ((dq, dkv), dkpe))| {
            let t = row % s.seq;
            let cs = &table[t * rope..(t + 1) * rope];
            let g = &dqkv[row * width..(row + 1) * width];
            let (gq, gk, gv) = (&g[..h * qk], &g[h * qk..2 * h * qk], &g[2 * h * qk..]);
            for hd in 0..h {
                let gq = &gq[hd * qk..(hd + 1) * qk];
                let dq = &mut dq[hd * qk..(hd + 1) * qk];
                for (d, &x) in dq[..nope].iter_mut().zip(&gq[..nope]) {
                    *d = q_scale * x;
                }
                rotate_back(&mut dq[nope..], &gq[nope..], cs, s.interleave, q_scale);
                let dkv = &mut dkv[hd * (nope + v)..(hd + 1) * (nope + v)];
                dkv[..nope].copy_from_slice(&gk[hd * qk..hd * qk + nope]);
                dkv[nope..].copy_from_slice(&gv[hd * qk..hd * qk + v]);
            }
            let mut sum = vec![0f64; rope];
            for hd in 0..h {
                for (acc, &x) in sum.iter_mut().zip(&gk[hd * qk + nope..(hd + 1) * qk]) {
                    *acc += x as f64;
                }
            }
            let sum: Vec<f32> = sum.into_iter().map(|x| x as f32).collect();
            rotate_back(dkpe, &sum, cs, s.interleave, 1.0);
        },
    );
}

/// `out[r, h·to + c] = x[r, h·from + c]` for `c < min(from, to)`, zero for `from ≤ c < to`: the
/// heads narrowed (`to ≤ from`) or widened with zeros (`to ≥ from`).
pub fn heads_resize(out: &mut [f32], x: &[f32], rows: usize, heads: usize, from: usize, to: usize) {
    assert_eq!(x.len(), rows * heads * from, "internal error: heads_narrow/widen: input length");
    assert_eq!(out.len(), rows * heads * to, "internal error: heads_narrow/widen: output length");
    if out.is_empty() || from == 0 {
        return out.fill(0.0);
    }
    let keep = from.min(to);
    out.par_chunks_mut(heads * to).zip(x.par_chunks(heads * from)).for_each(|(o, x)| {
        for h in 0..heads {
            let o = &mut o[h * to..(h + 1) * to];
            o[..keep].copy_from_slice(&x[h * from..h * from + keep]);
            o[keep..].fill(0.0);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rope::{Yarn, table_for, yarn_inv_freq};
    use crate::rng;

    fn random(n: usize, stream: u64) -> Vec<f32> {
        (0..n).map(|i| (2.0 * rng::uniform(7, stream, i as u64) - 1.0) as f32).collect()
    }

    fn assemble(q: &[f32], kv: &[f32], kpe: &[f32], table: &[f32], s: MlaShape, q_scale: f32) -> Vec<f32> {
        let mut qkv = vec![f32::NAN; s.rows * s.qkv_width()];
        qkv_forward(&mut qkv, q, kv, kpe, table, s, q_scale);
        qkv
    }

    /// The layout the attention op reads: q heads, k heads, v heads, each qk wide; the k heads
    /// share one rotary key; v padded with zeros. At position 0 (cos 1, sin 0) the rotation is
    /// the identity, so the rope parts show P alone.
    #[test]
    fn rows_are_packed_as_the_attention_reads_them() {
        let s = MlaShape { rows: 1, seq: 1, heads: 2, nope: 2, rope: 4, v: 3, interleave: true };
        let q: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let kv: Vec<f32> = (0..10).map(|i| 100.0 + i as f32).collect();
        let kpe = [50.0, 51.0, 52.0, 53.0];
        let table = [1.0, 0.0, 1.0, 0.0];
        let qkv = assemble(&q, &kv, &kpe, &table, s, 2.0);
        #[rustfmt::skip]
        let want = [
            0.0, 2.0, 4.0, 8.0, 6.0, 10.0,        12.0, 14.0, 16.0, 20.0, 18.0, 22.0,   // 2 · [q_nope | P(q_rope)]
            100.0, 101.0, 50.0, 52.0, 51.0, 53.0, 105.0, 106.0, 50.0, 52.0, 51.0, 53.0, // [k_nope | P(kpe)]
            102.0, 103.0, 104.0, 0.0, 0.0, 0.0,   107.0, 108.0, 109.0, 0.0, 0.0, 0.0,  // [v | 0]
        ];
        assert_eq!(qkv, want);
        let plain = assemble(&q, &kv, &kpe, &table, MlaShape { interleave: false, ..s }, 1.0);
        assert_eq!(&plain[..6], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(&plain[14..18], kpe);
    }

    /// With interleaved rotary dimensions, the assembled heads score exactly what DeepSeek's
    /// GPT-J-style rotation (pair (x[2i], x[2i+1]) rotated by θ_i, in place) scores: for a query
    /// at position t and a key at u, q_h · k_h = s · (q_nope · k_nope + rot_t(q_rope) · rot_u(kpe)).
    #[test]
    fn interleaved_scores_are_those_of_the_gpt_j_rotation() {
        let s = MlaShape { rows: 5, seq: 5, heads: 3, nope: 4, rope: 8, v: 4, interleave: true };
        let (qk, half, q_scale) = (s.qk(), s.rope / 2, 0.6f32);
        let yarn = Yarn { factor: 8.0, original_max_seq_len: 4, mscale_all_dim: 0.5, ..Yarn::default() };
        let inv = yarn_inv_freq(s.rope, 100.0, &yarn);
        let table = table_for(&inv, 1.2, &[0, 1, 2, 3, 4]);
        let (q, kv, kpe) =
            (random(s.rows * s.q_width(), 1), random(s.rows * s.kv_width(), 2), random(s.rows * s.rope, 3));
        let qkv = assemble(&q, &kv, &kpe, &table, s, q_scale);
        let gptj = |x: &[f32], t: usize| -> Vec<f64> {
            let mut y = vec![0f64; x.len()];
            for i in 0..half {
                let (c, sn) = (table[(t * half + i) * 2] as f64, table[(t * half + i) * 2 + 1] as f64);
                let (a, b) = (x[2 * i] as f64, x[2 * i + 1] as f64);
                y[2 * i] = a * c - b * sn;
                y[2 * i + 1] = b * c + a * sn;
            }
            y
        };
        let width = s.qkv_width();
        for t in 0..s.rows {
            for u in 0..=t {
                for h in 0..s.heads {
                    let qh = &qkv[t * width + h * qk..][..qk];
                    let kh = &qkv[u * width + s.heads * qk + h * qk..][..qk];
                    let got: f64 = qh.iter().zip(kh).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let (q0, k0) = (&q[t * s.q_width() + h * qk..][..qk], &kv[u * s.kv_width() + h * (s.nope + s.v)..]);
                    let nope: f64 = (0..s.nope).map(|j| q0[j] as f64 * k0[j] as f64).sum();
                    let (rq, rk) = (gptj(&q0[s.nope..], t), gptj(&kpe[u * s.rope..][..s.rope], u));
                    let rope: f64 = rq.iter().zip(&rk).map(|(a, b)| a * b).sum();
                    let want = q_scale as f64 * (nope + rope);
                    assert!((got - want).abs() < 1e-5, "t {t} u {u} head {h}: {got} vs {want}");
                }
            }
        }
    }

    /// The key gradient of the shared rotary key sums the heads': with every head's gradient
    /// equal, dkpe is H times one head's.
    #[test]
    fn dkpe_sums_the_heads() {
        let s = MlaShape { rows: 2, seq: 2, heads: 3, nope: 1, rope: 2, v: 1, interleave: false };
        let table = [1.0, 0.0, 0.6, 0.8];
        let mut dqkv = vec![0f32; s.rows * s.qkv_width()];
        for row in 0..2 {
            for h in 0..3 {
                dqkv[row * s.qkv_width() + s.heads * s.qk() + h * s.qk() + 1..][..2].copy_from_slice(&[1.0, 2.0]);
            }
        }
        let (mut dq, mut dkv, mut dkpe) = (vec![9.0; 18], vec![9.0; 12], vec![9.0; 4]);
        qkv_backward(&mut dq, &mut dkv, &mut dkpe, &dqkv, &table, s, 1.0);
        assert!(dq.iter().chain(&dkv).all(|&x| x == 0.0));
        // Row 1: Rᵀ (3, 6) at (cos, sin) = (0.6, 0.8): (3·0.6 + 6·0.8, 6·0.6 − 3·0.8).
        let want = [3.0, 6.0, 3.0 * 0.6 + 6.0 * 0.8, 6.0 * 0.6 - 3.0 * 0.8];
        assert!(dkpe.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{dkpe:?}");
    }
}
