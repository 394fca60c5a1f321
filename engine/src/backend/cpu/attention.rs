//! Causal, optionally windowed, grouped-query attention over packed qkv rows.
//!
//! For a query row i of head h (key/value head g = h / (H / KV)), over keys j that i may see
//! (`first_key(i) <= j <= i`):
//!
//! forward:  s_j = (q · k_j) · c (c = 1 / sqrt(Dh) unless the shape says),   p_j = exp(s_j - lse),  lse = log Σ_j exp(s_j),
//!           o = Σ_j p_j v_j
//! backward: D = do · o,  dp_j = do · v_j,  ds_j = p_j (dp_j - D),
//!           dq = Σ_j ds_j k_j / sqrt(Dh),  dk_j += ds_j q / sqrt(Dh),  dv_j += p_j do
//!
//! The forward keeps only `lse` per query; the backward recomputes the probabilities from it,
//! as flash attention does, in two passes so that each writes whole rows: queries (dq), then
//! keys (dk, dv), which sums over the queries that see each key.
//!
//! Under sequence parallelism ([`SeqSplit`]) the queries are one rank's rows (two chunks of
//! each sequence, at their true positions) and the keys every rank's rows as an all-gather
//! leaves them (rank-major): the same loops, with each position mapped to its row. One device is
//! the split of one rank ([`SeqSplit::WHOLE`]), whose rows are the positions in order.
//!
//! Under document masking (`starts`, see [`document_bounds`]) query i also needs
//! `j >= starts[i]`: the first key of its document. A document's rows are contiguous and
//! `starts` never decreases along a sequence, so the keys a query sees stay one range,
//! `max(first_key(i), starts[i]) ..= i`, and the queries that see key j stop at the first whose
//! document begins after j.

use std::ops::Range;

use crate::backend::{AttnShape, SeqSplit};
use rayon::prelude::*;

/// `a · b`, summed in 8 fixed lanes and then across them: a single running sum would be one
/// long dependency chain the compiler may not reorder (f32 addition is not associative), while
/// fixed lanes vectorise and still give the same bits whatever the thread count.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    let (a8, b8) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a8.remainder().iter().zip(b8.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Column offsets of query head `h`, and of the key and value heads it reads.
fn columns(s: &AttnShape, h: usize) -> (usize, usize, usize) {
    let g = h / (s.n_heads / s.n_kv_heads);
    (h * s.head_dim, (s.n_heads + g) * s.head_dim, (s.n_heads + s.n_kv_heads + g) * s.head_dim)
}

/// Where a split's rows are: `s.seq` rows of each sequence on each of `split.ranks` ranks, the
/// gathered buffer holding rank after rank.
#[derive(Clone, Copy)]
struct Rows {
    s: AttnShape,
    split: SeqSplit,
}

impl Rows {
    /// Tokens per whole sequence.
    fn len(&self) -> usize {
        self.s.seq * self.split.ranks
    }

    /// Gathered row of rank `rank`'s local row `i` of sequence `b`.
    fn row(&self, rank: usize, b: usize, i: usize) -> usize {
        (rank * self.s.batch + b) * self.s.seq + i
    }

    /// Gathered row of true position `j` of sequence `b`.
    fn key(&self, b: usize, j: usize) -> usize {
        let (rank, i) = self.split.owner(j, self.s.seq);
        self.row(rank, b, i)
    }

    /// Last query (inclusive, a true position) that sees key position `j`.
    fn last_query(&self, j: usize) -> usize {
        let end = self.len() - 1;
        if self.s.window == 0 { end } else { (j + self.s.window - 1).min(end) }
    }

    /// The first key (a true position) that a query at position `pos` of sequence `b` sees:
    /// the window's, or its document's start (`starts`, by sequence and true position) if later.
    fn first_key<'a>(&self, starts: Option<&'a [u32]>) -> impl Fn(usize, usize) -> usize + 'a {
        let (s, len) = (self.s, self.len());
        if let Some(st) = starts {
            assert_eq!(st.len(), s.batch * len, "internal error: attention: document starts length");
        }
        move |b, pos| s.first_key(pos).max(starts.map_or(0, |st| st[b * len + pos] as usize))
    }

    /// This rank's local rows whose true positions lie in `lo..=hi`, in increasing position: its
    /// early chunk's, then its late chunk's.
    fn local_between(&self, lo: usize, hi: usize) -> [Range<usize>; 2] {
        let l = self.s.seq;
        let part = |first_row: usize, rows: usize, base: usize| {
            let (a, b) = (lo.max(base), hi.min(base + rows - 1));
            if a > b { first_row..first_row } else { first_row + a - base..first_row + b - base + 1 }
        };
        if self.split.ranks == 1 {
            return [part(0, l, 0), l..l];
        }
        let c = l / 2;
        let late = 2 * self.split.ranks - 1 - self.split.rank;
        [part(0, c, self.split.rank * c), part(c, c, late * c)]
    }
}

/// `bounds[r]` (`r = b·T + i`): where row r's document begins in its sequence, one past the
/// last `eos` before position i (0 without one): the EOS belongs to the document it ends;
/// `bounds[N + r]`: where it ends, one past its EOS (T without one). With `positions`, each
/// row's position within its document too.
pub fn document_bounds(bounds: &mut [u32], mut positions: Option<&mut [u32]>, tokens: &[u32], seq: usize, eos: u32) {
    let n = tokens.len();
    assert_eq!(bounds.len(), 2 * n);
    let (starts, ends) = bounds.split_at_mut(n);
    for r in 0..n {
        let i = r % seq;
        starts[r] = match i {
            0 => 0,
            _ if tokens[r - 1] == eos => i as u32,
            _ => starts[r - 1],
        };
        if let Some(p) = positions.as_deref_mut() {
            p[r] = i as u32 - starts[r];
        }
    }
    for r in (0..n).rev() {
        let i = r % seq;
        ends[r] = match i {
            _ if tokens[r] == eos => i as u32 + 1,
            _ if i + 1 == seq => seq as u32,
            _ => ends[r + 1],
        };
    }
}

/// [`document_bounds`] on a sequence axis: `tokens` are the whole sequences (of
/// `seq · split.ranks` tokens), `bounds` theirs (by true position), and `positions` those of
/// `split.rank`'s `seq` rows of each sequence (its two chunks), measured from their documents'
/// starts, which an EOS in another rank's chunk may set.
pub fn document_bounds_split(
    bounds: &mut [u32],
    positions: Option<&mut [u32]>,
    tokens: &[u32],
    seq: usize,
    split: SeqSplit,
    eos: u32,
) {
    let len = seq * split.ranks;
    document_bounds(bounds, None, tokens, len, eos);
    if let Some(p) = positions {
        assert_eq!(p.len() * split.ranks, tokens.len(), "internal error: document positions length");
        for (r, p) in p.iter_mut().enumerate() {
            let (b, pos) = (r / seq, split.position(split.rank, r % seq, seq));
            *p = (pos - bounds[b * len + pos] as usize) as u32;
        }
    }
}

/// `out[N, H · Dh]` and `lse[N, H]`, with an online softmax per query, for `split.rank`'s
/// rows of sequences split over the sequence axis ([`SeqSplit::WHOLE`]: one device), against
/// the gathered rows of every rank (`qkv_all`, rank-major), and under document masking with
/// `starts` (`[batch · positions]`, by true position) as [`document_bounds`] gives them. With
/// `logit_max` (`[H]`), each head's largest scaled logit over these queries and the keys they
/// see is max-accumulated into it (QK-clip's measurement: the online softmax's final maximum).
pub fn forward_masked(
    out: &mut [f32],
    lse: &mut [f32],
    qkv_all: &[f32],
    s: AttnShape,
    split: SeqSplit,
    starts: Option<&[u32]>,
    logit_max: Option<&mut [f32]>,
) {
    let (w, dh) = (s.qkv_width(), s.head_dim);
    let scale = s.softmax_scale();
    let at = Rows { s, split };
    assert_eq!(qkv_all.len(), split.ranks * s.rows() * w);
    assert_eq!(lse.len(), s.rows() * s.n_heads);
    let first = at.first_key(starts);
    // Each row's maxima (a few bytes per row beside its `dh`-wide output), folded after.
    let mut row_max = vec![f32::NEG_INFINITY; lse.len()];
    let rows =
        out.par_chunks_mut(s.q_width()).zip(lse.par_chunks_mut(s.n_heads)).zip(row_max.par_chunks_mut(s.n_heads));
    rows.enumerate().for_each(|(local, ((o, l), m))| {
        let (b, i) = (local / s.seq, local % s.seq);
        let (row, pos) = (at.row(split.rank, b, i), split.position(split.rank, i, s.seq));
        for h in 0..s.n_heads {
            let (qc, kc, vc) = columns(&s, h);
            let q = &qkv_all[row * w + qc..][..dh];
            let acc = &mut o[h * dh..(h + 1) * dh];
            acc.fill(0.0);
            let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
            for j in first(b, pos)..=pos {
                let key_row = at.key(b, j) * w;
                let score = dot(q, &qkv_all[key_row + kc..][..dh]) * scale;
                if score > max {
                    let c = (max - score).exp();
                    sum *= c;
                    acc.iter_mut().for_each(|a| *a *= c);
                    max = score;
                }
                let p = (score - max).exp();
                sum += p;
                acc.iter_mut().zip(&qkv_all[key_row + vc..][..dh]).for_each(|(a, v)| *a += p * v);
            }
            acc.iter_mut().for_each(|a| *a /= sum);
            l[h] = max + sum.ln();
            m[h] = max;
        }
    });
    if let Some(into) = logit_max {
        assert_eq!(into.len(), s.n_heads, "internal error: attention: logit maxima length");
        for row in row_max.chunks(s.n_heads) {
            into.iter_mut().zip(row).for_each(|(m, r)| *m = m.max(*r));
        }
    }
}

/// Gradient with respect to the packed qkv rows (overwritten).
pub fn backward(dqkv: &mut [f32], dout: &[f32], qkv: &[f32], out: &[f32], lse: &[f32], s: AttnShape) {
    backward_masked(dqkv, dout, qkv, out, lse, s, SeqSplit::WHOLE, None)
}

/// [`backward`] under a split and document masking (`starts` as [`forward_masked`] reads
/// them): `dqkv_all` (laid out as `qkv_all`) receives the gradient of every rank's rows from
/// `split.rank`'s queries, which `dout`, `out` and `lse` are (the queries' gradient on this
/// rank's rows only; zero on the others').
#[allow(clippy::too_many_arguments)]
pub fn backward_masked(
    dqkv_all: &mut [f32],
    dout: &[f32],
    qkv_all: &[f32],
    out: &[f32],
    lse: &[f32],
    s: AttnShape,
    split: SeqSplit,
    starts: Option<&[u32]>,
) {
    let (w, dh, qw) = (s.qkv_width(), s.head_dim, s.q_width());
    let scale = s.softmax_scale();
    let at = Rows { s, split };
    let first = at.first_key(starts);
    assert_eq!(qkv_all.len(), split.ranks * s.rows() * w);
    assert_eq!(dqkv_all.len(), qkv_all.len());
    // Probability, its gradient and D for local query `qi` (this rank's row) of head h against
    // gathered key row `kj`.
    let terms = |qi: usize, kj: usize, h: usize| {
        let (qc, kc, vc) = columns(&s, h);
        let q_row = at.row(split.rank, 0, 0) + qi;
        let (q, k, v) =
            (&qkv_all[q_row * w + qc..][..dh], &qkv_all[kj * w + kc..][..dh], &qkv_all[kj * w + vc..][..dh]);
        let d_out = &dout[qi * qw + h * dh..][..dh];
        let p = (dot(q, k) * scale - lse[qi * s.n_heads + h]).exp();
        (p, dot(d_out, v), d_out)
    };
    // D = do · o for every query row and head, once (both passes read it for every key).
    let mut big_d = vec![0f32; s.rows() * s.n_heads];
    big_d.par_chunks_mut(s.n_heads).enumerate().for_each(|(qi, d)| {
        for (h, d) in d.iter_mut().enumerate() {
            *d = dot(&dout[qi * qw + h * dh..][..dh], &out[qi * qw + h * dh..][..dh]);
        }
    });
    let big_d = |qi: usize, h: usize| big_d[qi * s.n_heads + h];
    let per_rank = s.rows();

    // Pass 1, per query row: dq (zero on the other ranks' rows).
    dqkv_all.par_chunks_mut(w).enumerate().for_each(|(row, dr)| {
        let (rank, local) = (row / per_rank, row % per_rank);
        if rank != split.rank {
            dr[..qw].fill(0.0);
            return;
        }
        let (b, i) = (local / s.seq, local % s.seq);
        let pos = split.position(split.rank, i, s.seq);
        for h in 0..s.n_heads {
            let (qc, kc, _) = columns(&s, h);
            let dq = &mut dr[qc..qc + dh];
            dq.fill(0.0);
            let d = big_d(local, h);
            for j in first(b, pos)..=pos {
                let kj = at.key(b, j);
                let (p, dp, _) = terms(local, kj, h);
                let ds = p * (dp - d);
                dq.iter_mut().zip(&qkv_all[kj * w + kc..][..dh]).for_each(|(g, k)| *g += ds * k);
            }
            dq.iter_mut().for_each(|g| *g *= scale);
        }
    });

    // Pass 2, per key row: dk and dv, summed over the query heads of each group and this rank's
    // queries that see the key.
    let group = s.n_heads / s.n_kv_heads;
    dqkv_all.par_chunks_mut(w).enumerate().for_each(|(row, dr)| {
        let (rank, local) = (row / per_rank, row % per_rank);
        let (b, j) = (local / s.seq, split.position(rank, local % s.seq, s.seq));
        let queries = at.local_between(j, at.last_query(j));
        let (_, kv) = dr.split_at_mut(qw);
        let (dk_all, dv_all) = kv.split_at_mut(s.n_kv_heads * dh);
        for g in 0..s.n_kv_heads {
            let (dk, dv) = (&mut dk_all[g * dh..(g + 1) * dh], &mut dv_all[g * dh..(g + 1) * dh]);
            dk.fill(0.0);
            dv.fill(0.0);
            for h in g * group..(g + 1) * group {
                let qc = columns(&s, h).0;
                for i in queries.iter().flat_map(Clone::clone) {
                    if first(b, split.position(split.rank, i, s.seq)) > j {
                        continue; // a later document's query
                    }
                    let qi = b * s.seq + i;
                    let q_row = at.row(split.rank, b, i);
                    let (p, dp, d_out) = terms(qi, row, h);
                    let ds = p * (dp - big_d(qi, h));
                    dk.iter_mut().zip(&qkv_all[q_row * w + qc..][..dh]).for_each(|(g, q)| *g += ds * q);
                    dv.iter_mut().zip(d_out).for_each(|(g, o)| *g += p * o);
                }
            }
            dk.iter_mut().for_each(|g| *g *= scale);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eos_ends_its_document_and_positions_restart_after_it() {
        const E: u32 = 9;
        let tokens = [1, 2, E, 3, E, E, 4, /* next sequence */ E, 5, 6, 7, 8, E, 4];
        let (mut bounds, mut positions) = (vec![0; 28], vec![0; 14]);
        document_bounds(&mut bounds, Some(&mut positions), &tokens, 7, E);
        assert_eq!(bounds[..14], [0, 0, 0, 3, 3, 5, 6, 0, 1, 1, 1, 1, 1, 6]);
        assert_eq!(bounds[14..], [3, 3, 3, 5, 5, 6, 7, 1, 6, 6, 6, 6, 6, 7]);
        assert_eq!(positions, [0, 1, 2, 0, 1, 0, 0, 0, 0, 1, 2, 3, 4, 0]);
    }

    /// Two documents packed in one sequence under the mask give each document's outputs,
    /// statistics and gradients alone (the second one's at its own positions, as RoPE's
    /// relative scores and reset positions see it), with and without a window; unmasked, the
    /// second document's differ.
    #[test]
    fn a_masked_packed_sequence_is_its_documents_alone() {
        let (first, second) = (5, 7);
        let val = |k: usize| ((k * 7919 % 1000) as f32 / 500.0) - 1.0;
        for window in [0, 3] {
            let packed = AttnShape {
                batch: 1,
                seq: first + second,
                n_heads: 2,
                n_kv_heads: 1,
                head_dim: 4,
                window,
                scale: None,
            };
            let (w, qw, h) = (packed.qkv_width(), packed.q_width(), packed.n_heads);
            let qkv: Vec<f32> = (0..packed.rows() * w).map(val).collect();
            let dout: Vec<f32> = (0..packed.rows() * qw).map(|k| val(k + 17)).collect();
            let mut tokens = vec![1u32; packed.rows()];
            tokens[first - 1] = 0; // the first document's EOS
            let mut bounds = vec![0; 2 * packed.rows()];
            document_bounds(&mut bounds, None, &tokens, packed.seq, 0);
            let starts = &bounds[..packed.rows()];
            let run = |s: AttnShape, qkv: &[f32], dout: &[f32], starts: Option<&[u32]>| {
                let (mut out, mut lse) = (vec![0.0; s.rows() * qw], vec![0.0; s.rows() * h]);
                forward_masked(&mut out, &mut lse, qkv, s, SeqSplit::WHOLE, starts, None);
                let mut dqkv = vec![0.0; qkv.len()];
                backward_masked(&mut dqkv, dout, qkv, &out, &lse, s, SeqSplit::WHOLE, starts);
                (out, lse, dqkv)
            };
            let masked = run(packed, &qkv, &dout, Some(starts));
            let unmasked = run(packed, &qkv, &dout, None);
            for (doc, rows) in [(0, 0..first), (1, first..first + second)] {
                let alone = AttnShape { seq: rows.len(), ..packed };
                let of = |x: &[f32], width: usize| x[rows.start * width..rows.end * width].to_vec();
                let want = run(alone, &of(&qkv, w), &of(&dout, qw), None);
                let close = |a: &[f32], b: &[f32], what: &str| {
                    for (k, (x, y)) in a.iter().zip(b).enumerate() {
                        assert!(
                            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                            "window {window}, document {doc}, {what}[{k}]: {x} vs {y}"
                        );
                    }
                };
                close(&of(&masked.0, qw), &want.0, "out");
                close(&of(&masked.1, h), &want.1, "lse");
                close(&of(&masked.2, w), &want.2, "dqkv");
                if doc == 1 {
                    assert_ne!(
                        of(&unmasked.0, qw),
                        want.0,
                        "window {window}: unmasked, the second document sees the first"
                    );
                }
            }
        }
    }

    /// Two ranks' split attention, gathered, gives the single device's outputs, statistics,
    /// gradients (the dk/dv halves summed over the ranks) and QK-clip's maxima (each head's
    /// largest logit, against every pair it attends), with and without a window, and under
    /// document masking with bounds from the whole sequences' tokens (documents that cross the
    /// chunks, an EOS in another rank's chunk bounding this rank's queries and positions).
    #[test]
    fn a_split_over_two_ranks_matches_one_device() {
        const E: u32 = 0;
        // Sequences of 8 in chunks of 2: rank 0 holds positions 0-1 and 6-7, rank 1 2-5.
        let tokens = [1, 2, 3, E, 4, 5, 6, 7, /* next sequence */ 1, E, 2, 3, 4, E, 5, 6];
        for (window, masked) in [(0, false), (3, false), (0, true), (3, true)] {
            let s = AttnShape { batch: 2, seq: 8, n_heads: 2, n_kv_heads: 1, head_dim: 4, window, scale: None };
            let w = s.qkv_width();
            let val = |k: usize| ((k * 7919 % 1000) as f32 / 500.0) - 1.0;
            let qkv: Vec<f32> = (0..s.rows() * w).map(val).collect();
            let dout: Vec<f32> = (0..s.rows() * s.q_width()).map(|k| val(k + 17)).collect();
            let (mut bounds, mut positions) = (vec![0; 2 * s.rows()], vec![0; s.rows()]);
            document_bounds(&mut bounds, Some(&mut positions), &tokens, s.seq, E);
            let starts = masked.then_some(&bounds[..s.rows()]);
            let (mut out, mut lse) = (vec![0.0; s.rows() * s.q_width()], vec![0.0; s.rows() * s.n_heads]);
            let mut maxima = vec![f32::NEG_INFINITY; s.n_heads];
            forward_masked(&mut out, &mut lse, &qkv, s, SeqSplit::WHOLE, starts, Some(&mut maxima));
            // QK-clip's maxima: every head's largest scaled logit over the pairs it attends.
            for (h, &got) in maxima.iter().enumerate() {
                let (qc, kc, _) = columns(&s, h);
                let mut want = f32::NEG_INFINITY;
                for (b, i) in (0..s.batch).flat_map(|b| (0..s.seq).map(move |i| (b, i))) {
                    let start = starts.map_or(0, |st| st[b * s.seq + i] as usize);
                    for j in (0..=i).filter(|&j| j >= start && (window == 0 || j + window > i)) {
                        let (q, k) = ((b * s.seq + i) * w + qc, (b * s.seq + j) * w + kc);
                        want = want.max(dot(&qkv[q..q + 4], &qkv[k..k + 4]) * s.softmax_scale());
                    }
                }
                assert!((got - want).abs() <= 1e-6, "window {window}, masked {masked}, head {h}: {got} vs {want}");
            }
            let mut split_maxima = vec![f32::NEG_INFINITY; s.n_heads];
            let mut dqkv = vec![0.0; qkv.len()];
            backward_masked(&mut dqkv, &dout, &qkv, &out, &lse, s, SeqSplit::WHOLE, starts);
            // Rank r's rows of each sequence, at their true positions.
            let ranks = 2;
            let local = AttnShape { seq: s.seq / ranks, ..s };
            let rows_of = |r: usize| -> Vec<usize> {
                let split = SeqSplit { rank: r, ranks };
                (0..s.batch).flat_map(|b| split.positions(local.seq).into_iter().map(move |p| b * s.seq + p)).collect()
            };
            let pick = |x: &[f32], width: usize, rows: &[usize]| -> Vec<f32> {
                rows.iter().flat_map(|&r| x[r * width..(r + 1) * width].to_vec()).collect()
            };
            let all: Vec<f32> = (0..ranks).flat_map(|r| pick(&qkv, w, &rows_of(r))).collect();
            let mut dsum = vec![0f32; all.len()];
            for r in 0..ranks {
                let split = SeqSplit { rank: r, ranks };
                let rows = rows_of(r);
                let (mut b, mut p) = (vec![0; 2 * s.rows()], vec![0; local.rows()]);
                document_bounds_split(&mut b, Some(&mut p), &tokens, local.seq, split, E);
                assert_eq!(b, bounds, "rank {r}: the whole sequences' bounds");
                assert_eq!(p, rows.iter().map(|&i| positions[i]).collect::<Vec<_>>(), "rank {r}: positions");
                let starts = masked.then_some(&b[..s.rows()]);
                let (mut o, mut l) = (vec![0.0; local.rows() * s.q_width()], vec![0.0; local.rows() * s.n_heads]);
                forward_masked(&mut o, &mut l, &all, local, split, starts, Some(&mut split_maxima));
                let what = format!("window {window}, masked {masked}, rank {r}");
                assert_eq!(o, pick(&out, s.q_width(), &rows), "{what}: outputs");
                assert_eq!(l, pick(&lse, s.n_heads, &rows), "{what}: statistics");
                let mut d = vec![0.0; all.len()];
                backward_masked(&mut d, &pick(&dout, s.q_width(), &rows), &all, &o, &l, local, split, starts);
                dsum.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            }
            assert_eq!(split_maxima, maxima, "window {window}, masked {masked}: the ranks' maxima");
            let want: Vec<f32> = (0..ranks).flat_map(|r| pick(&dqkv, w, &rows_of(r))).collect();
            for (k, (a, b)) in dsum.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "window {window}, masked {masked}: element {k}: {a} vs {b}"
                );
            }
        }
    }
}
