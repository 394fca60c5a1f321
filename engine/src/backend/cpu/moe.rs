//! Mixture-of-experts dispatch and combine (the routers, softmax and DeepSeek-V3's sigmoid, are
//! in `router.rs`).
//!
//! route:    p = softmax(router_logits);  the top-k experts e_1..e_k of each token (ties to the
//!           lower index);  w_j = p_{e_j} / Σ_m p_{e_m}  (renormalised; else w_j = p_{e_j});
//!           DeepSeek-V3's sigmoid scores, selection bias, group limit and scale: `router.rs`
//! capacity: expert e keeps its first C slots in slot order (token t's slot j is t·k + j, so
//!           token order within the batch, as MaxText's cumsum of the expert mask and Megatron's
//!           `moe_token_drop_policy = "position"` keep them); kept_j ∈ {0, 1}
//! combine:  y_t = Σ_j kept_j · w_j · expert_{e_j}(x_t)
//! backward: dw_j = kept_j · dy_t · expert_{e_j}(x_t);  dx_t gets kept_j · dexpert_{e_j} only;
//!           for the chosen experts dp_{e_i} = (dw_i - Σ_j dw_j w_j) / Σ_m p_{e_m} (renormalised;
//!           else dp_{e_i} = dw_i);  plus the
//!           load-balancing term;  dlogits = p ⊙ (dp - p · dp)
//! biases:   y_r += b_e over the dispatched rows r of expert e (GPT-OSS's experts);
//!           db_e += Σ_{rows r of e} dy_r
//!
//! A dropped slot (kept_j = 0) adds nothing to its token's output (the residual carries the
//! token) and its expert gets no gradient from it; its weight still shares the renormalisation,
//! as in Megatron and MaxText, where the weights are computed before the drop.
//!
//! Dispatched rows are grouped by expert, each expert's kept rows in token order (a stable
//! counting sort), so every expert's tokens form one contiguous block for its matrix products;
//! the rows past the kept ones (`offsets[E] ..`) belong to no slot.

use std::ops::Range;

use crate::backend::{DROPPED, MoeDispatch, Parts};
use rayon::prelude::*;

/// The writable routing tables of one dispatch.
pub struct Tables<'a> {
    /// `[N · k]` expert of each slot.
    pub expert: &'a mut [u32],
    /// `[N · k]` dispatched row of each slot.
    pub slot_row: &'a mut [u32],
    /// `[N · k]` slot of each dispatched row.
    pub row_slot: &'a mut [u32],
    /// `[E + 1]` first dispatched row of each expert.
    pub offsets: &'a mut [u32],
}

/// The dispatch tables of the slots' experts (`t.expert`, filled by the router) and the
/// statistics `[counts | Σ p | dropped]` of the scores `probs`.
pub fn dispatch(stats: &mut [f32], t: Tables, probs: &[f32], d: MoeDispatch) {
    let e = d.experts;
    // Stable counting sort of the slots by expert, each expert's first `capacity` slots kept.
    let cap = d.capacity;
    let mut routed = vec![0u32; e];
    for &x in t.expert.iter() {
        routed[x as usize] += 1;
    }
    let offsets = t.offsets;
    offsets[0] = 0;
    for x in 0..e {
        offsets[x + 1] = offsets[x] + routed[x].min(cap as u32);
    }
    let mut rank = vec![0u32; e];
    let mut dropped = 0u32;
    t.row_slot.fill(DROPPED);
    for (slot, &x) in t.expert.iter().enumerate() {
        let r = &mut rank[x as usize];
        if (*r as usize) < cap {
            let row = offsets[x as usize] + *r;
            t.slot_row[slot] = row;
            t.row_slot[row as usize] = slot as u32;
        } else {
            t.slot_row[slot] = DROPPED;
            dropped += 1;
        }
        *r += 1;
    }

    let (counts, rest) = stats.split_at_mut(e);
    let (prob_sums, dropped_slots) = rest.split_at_mut(e);
    for x in 0..e {
        counts[x] = routed[x] as f32;
        prob_sums[x] = probs.chunks_exact(e).map(|p| p[x] as f64).sum::<f64>() as f32;
    }
    dropped_slots[0] = dropped as f32;
}

/// `xe[r] = x[row_slot[r] / k]`; zero for the rows no slot fills.
pub fn gather(xe: &mut [f32], x: &[f32], row_slot: &[u32], k: usize, d: usize) {
    xe.par_chunks_mut(d).zip(row_slot.par_iter()).for_each(|(row, &slot)| {
        if slot == DROPPED {
            row.fill(0.0);
        } else {
            let t = slot as usize / k;
            row.copy_from_slice(&x[t * d..(t + 1) * d]);
        }
    });
}

/// `dx[t] = Σ_j dxe[slot_row[t·k + j]]` over the kept slots.
pub fn gather_backward(dx: &mut [f32], dxe: &[f32], slot_row: &[u32], k: usize, d: usize) {
    dx.par_chunks_mut(d).zip(slot_row.par_chunks(k)).for_each(|(row, rows)| {
        row.fill(0.0);
        for &r in rows.iter().filter(|&&r| r != DROPPED) {
            row.iter_mut().zip(&dxe[r as usize * d..][..d]).for_each(|(a, b)| *a += b);
        }
    });
}

/// `out[t] = Σ_j weight[t·k + j] · ye[slot_row[t·k + j]]` over the kept slots.
pub fn combine(out: &mut [f32], ye: &[f32], weight: &[f32], slot_row: &[u32], k: usize, d: usize) {
    out.par_chunks_mut(d).zip(slot_row.par_chunks(k)).zip(weight.par_chunks(k)).for_each(|((row, rows), w)| {
        row.fill(0.0);
        for (&r, &w) in rows.iter().zip(w).filter(|(r, _)| **r != DROPPED) {
            row.iter_mut().zip(&ye[r as usize * d..][..d]).for_each(|(a, y)| *a += w * y);
        }
    });
}

/// `dye[r] = weight[s] · dout[s / k]` for the slot s of each row (zero for the rows no slot
/// fills), and `dweight[s] = dout[s / k] · ye[slot_row[s]]` (zero for a dropped slot).
pub fn combine_backward(
    dye: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    ye: &[f32],
    weight: &[f32],
    slot_row: &[u32],
    row_slot: &[u32],
    k: usize,
    d: usize,
) {
    dye.par_chunks_mut(d).zip(row_slot.par_iter()).for_each(|(row, &s)| {
        if s == DROPPED {
            row.fill(0.0);
            return;
        }
        let (s, t) = (s as usize, s as usize / k);
        row.iter_mut().zip(&dout[t * d..(t + 1) * d]).for_each(|(g, o)| *g = weight[s] * o);
    });
    dweight.par_iter_mut().zip(slot_row.par_iter()).enumerate().for_each(|(s, (dw, &r))| {
        let t = s / k;
        *dw = if r == DROPPED {
            0.0
        } else {
            dout[t * d..(t + 1) * d].iter().zip(&ye[r as usize * d..][..d]).map(|(a, b)| a * b).sum()
        };
    });
}

/// Columns of an expert's bias gradient summed by one task.
const BIAS_COLUMNS: usize = 64;

/// `out[r] += bias` for every row of one expert's block of rows (`bias.len()` wide): an expert
/// projection's bias (GPT-OSS's experts).
pub fn expert_bias(out: &mut [f32], bias: &[f32]) {
    out.par_chunks_mut(bias.len()).for_each(|row| row.iter_mut().zip(bias).for_each(|(o, b)| *o += b));
}

/// `dbias += Σ_r dout[r]` over one expert's block of rows: each column summed in f64 in row
/// order, then added once.
pub fn expert_bias_backward(dbias: &mut [f32], dout: &[f32]) {
    let width = dbias.len();
    dbias.par_chunks_mut(BIAS_COLUMNS).enumerate().for_each(|(c, db)| {
        let mut acc = [0f64; BIAS_COLUMNS];
        for row in dout.chunks_exact(width) {
            acc.iter_mut().zip(&row[c * BIAS_COLUMNS..][..db.len()]).for_each(|(a, x)| *a += *x as f64);
        }
        db.iter_mut().zip(acc).for_each(|(d, a)| *d += a as f32);
    });
}

/// `Backend::moe_pack` and `Backend::moe_unpack`: for each member `j`, the element ranges of
/// its rows among the grouped ones (`offsets[j·L] .. offsets[(j+1)·L]`) and of its part.
pub fn parts(offsets: &[u32], parts: Parts, width: usize) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
    (0..parts.members).map(move |j| {
        let (from, to) = (offsets[j * parts.local] as usize, offsets[(j + 1) * parts.local] as usize);
        assert!(to - from <= parts.rows, "internal error: {} rows for member {j}, parts of {}", to - from, parts.rows);
        (from * width..to * width, j * parts.rows * width..(j + 1) * parts.rows * width)
    })
}

/// `Backend::moe_runs`: each sender's `L + 1` offsets of its runs among the received parts.
pub fn runs(runs: &mut [u32], counts: &[f32], parts: Parts) {
    let l = parts.local;
    for s in 0..parts.members {
        let mut at = s * parts.rows;
        runs[s * (l + 1)] = at as u32;
        for i in 0..l {
            at += counts[s * l + i] as usize;
            runs[s * (l + 1) + i + 1] = at as u32;
        }
    }
}
