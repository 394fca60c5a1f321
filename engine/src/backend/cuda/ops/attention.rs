//! Flash attention on the tensor cores, forward and backward (`attention.cu`): causal,
//! grouped-query, optional sliding window, optional document masking (`bounds`), optionally for
//! one rank's chunks of sequences split over the sequence axis (`split`); one kernel per padded
//! head width.

use super::{Module, aligned16, c_int, row_threads};
use crate::backend::cuda::{Arg, Cuda, DType, Scratch};
use crate::backend::{AttnShape, IdxView, SeqSplit, View};

/// The kernels of `attention.cu`.
pub(crate) const MODULE: Module = Module {
    name: "attention",
    source: include_str!("attention.cu"),
    kernels: &[
        "attention_forward_hd16",
        "attention_forward_hd32",
        "attention_forward_hd64",
        "attention_forward_hd128",
        "attention_forward_hd192",
        "attention_forward_hd256",
        "attention_forward_split_hd16",
        "attention_forward_split_hd32",
        "attention_forward_split_hd64",
        "attention_forward_split_hd128",
        "attention_forward_split_hd192",
        "attention_forward_split_hd256",
        "attention_backward_dot",
        "attention_backward_hd16",
        "attention_backward_hd32",
        "attention_backward_hd64",
        "attention_backward_hd128",
        "attention_backward_hd192",
        "attention_backward_hd256",
        "attention_backward_split_hd16",
        "attention_backward_split_hd32",
        "attention_backward_split_hd64",
        "attention_backward_split_hd128",
        "attention_backward_split_hd192",
        "attention_backward_split_hd256",
        "attention_backward_dq",
        "attention_document_bounds",
        "attention_document_positions",
    ],
};

/// Threads per block of the forward kernels: `ATTN_THREADS` in `attention.cu`, for which its
/// tile copies are written.
const THREADS: u32 = 128;

/// Widest attention head the flash-attention kernels handle (Gemma 3's; DeepSeek-V3's latent
/// attention packs heads of 192).
pub(crate) const MAX_HEAD_DIM: usize = 256;

/// The padded head widths (`HD`) there are kernels for.
const PADDED: [usize; 6] = [16, 32, 64, 128, 192, 256];

/// The padded head width (`HD`) of the attention kernel for a head of `dh`, a multiple of 8 up
/// to [`MAX_HEAD_DIM`]: 136 to 192 take the 192 kernels, 200 to 256 the 256 ones.
fn padded_hd(dh: usize) -> usize {
    assert!(dh.is_multiple_of(8) && dh <= MAX_HEAD_DIM, "head_dim {dh} has no attention kernel");
    PADDED.into_iter().find(|&hd| dh <= hd).expect("dh <= MAX_HEAD_DIM")
}

/// Keys per tile of the attention forward kernel (`BC` in `attention_forward_impl`): 64, 32 past
/// 128 (see "Wide heads" in attention.cu). Its query tiles are 64 rows at every width.
fn forward_bc(hd: usize) -> usize {
    if hd > 128 { 32 } else { 64 }
}

/// Dynamic shared memory of the attention forward kernel for padded width `hd`: the query
/// tile (64 rows of `hd + 8`) and two buffers each of keys and values (`forward_bc` rows).
fn forward_smem(hd: usize) -> usize {
    (64 + 4 * forward_bc(hd)) * (hd + 8) * 2
}

/// Query rows per inner tile of the attention backward kernel (`BR`): 64, 32 at 128 and 192,
/// 16 at 256, which keep the accumulators within registers.
fn backward_br(hd: usize) -> usize {
    if hd <= 64 {
        64
    } else if hd <= 192 {
        32
    } else {
        16
    }
}

/// Keys per block of the attention backward kernel (`BC`), 16 per warp of 32 threads: 128 at
/// 64 to 192, 64 for the narrow heads and at 256 (whose 128-key blocks would need 175,488 bytes
/// of shared memory, past sm_80's 166,912).
fn backward_bc(hd: usize) -> usize {
    if (64..=192).contains(&hd) { 128 } else { 64 }
}

/// The tiles the kernels use for a head of `dh` (padded as [`padded_hd`] does): the forward
/// pass's keys per tile, and the backward pass's queries per tile and keys per block. The
/// checks in `parity` count which tiles take the unmasked path from them.
pub(crate) fn tiles(dh: usize) -> (usize, usize, usize) {
    let hd = padded_hd(dh);
    (forward_bc(hd), backward_br(hd), backward_bc(hd))
}

/// Threads per block of the attention backward kernel: a warp per 16 keys.
fn backward_threads(hd: usize) -> u32 {
    (backward_bc(hd) / 16 * 32) as u32
}

/// Dynamic shared memory of the attention backward kernel: keys and values (BC rows of
/// `hd + 8`), two buffers each of a query tile and its output gradient (BR rows), dSᵀ
/// (BC × (BR + 8)), and two buffers each of the tile's log-sum-exp, D (f32) and document
/// starts (i32).
fn backward_smem(hd: usize) -> usize {
    let (br, bc) = (backward_br(hd), backward_bc(hd));
    (2 * bc * (hd + 8) + 4 * br * (hd + 8) + bc * (br + 8)) * 2 + 6 * br * 4
}

/// Threads per block of `attention_document_bounds` (`BOUNDS_THREADS`).
const BOUNDS_THREADS: u32 = 256;

/// `Backend::document_bounds`: a block per sequence.
pub(crate) fn document_bounds(
    gpu: &mut Cuda,
    bounds: IdxView,
    positions: Option<IdxView>,
    tokens: IdxView,
    seq: usize,
    eos: u32,
) {
    let n = tokens.len;
    assert!(seq > 0 && n.is_multiple_of(seq), "internal error: document_bounds: tokens length");
    assert_eq!(bounds.len, 2 * n, "internal error: document_bounds: bounds length");
    let pos = positions.map_or(0, |p| {
        assert_eq!(p.len, n, "internal error: document_bounds: positions length");
        gpu.iptr(p)
    });
    let (starts, ends) = (gpu.iptr(bounds.at(0, n)), gpu.iptr(bounds.at(n, n)));
    let args = [
        Arg::P(starts),
        Arg::P(ends),
        Arg::P(pos),
        Arg::P(gpu.iptr(tokens)),
        Arg::I(c_int(seq, "seq")),
        Arg::I(c_int(eos as usize, "eos")),
    ];
    gpu.launch("attention_document_bounds", ((n / seq) as u32, 1, 1), BOUNDS_THREADS, 0, &args);
}

/// `Backend::document_bounds_split`: the whole sequences' bounds (`tokens` holds every rank's
/// rows, in order), then, with `positions`, this rank's rows' positions within their documents
/// from them, a thread a row.
pub(crate) fn document_bounds_split(
    gpu: &mut Cuda,
    bounds: IdxView,
    positions: Option<IdxView>,
    tokens: IdxView,
    seq: usize,
    split: SeqSplit,
    eos: u32,
) {
    let whole = seq * split.ranks;
    document_bounds(gpu, bounds, None, tokens, whole, eos);
    if let Some(p) = positions {
        let rows = tokens.len / split.ranks;
        assert_eq!(p.len, rows, "internal error: document_bounds_split: positions length");
        let args = [
            Arg::P(gpu.iptr(p)),
            Arg::P(gpu.iptr(bounds.at(0, tokens.len))),
            Arg::I(c_int(whole, "seq")),
            Arg::I(c_int(seq, "seq")),
            Arg::I(split.rank as i32),
            Arg::I(split.ranks as i32),
            Arg::U(rows as u64),
        ];
        gpu.launch("attention_document_positions", ((rows as u64).div_ceil(256) as u32, 1, 1), 256, 0, &args);
    }
}

/// The kernels' tile copies address a row with a 32-bit offset from a 64-bit base
/// (`load_tile_async`): unsplit, from the sequence's first row, so a sequence of qkv rows must
/// hold fewer than 2^31 elements; on a sequence axis from the tile's, which a tile of 128 rows
/// must. The grids put the batch in y and the tiles of a whole sequence (`positions`) in z,
/// each at most 65535. On a sequence axis a tile must not straddle two chunks: the chunk (half
/// the rows a rank holds) must be a multiple of every tile, 128 rows.
fn check_shape(s: AttnShape, split: SeqSplit) {
    let positions = s.seq * split.ranks;
    let rows_from_base = if split.ranks == 1 { s.seq } else { CHUNK_MULTIPLE };
    assert!(
        rows_from_base * s.qkv_width() < 1 << 31 && positions < 1 << 31,
        "attention: a sequence of {positions} rows of {} elements is past the kernels' 32-bit offsets",
        s.qkv_width()
    );
    assert!(
        s.batch <= 65535 && positions.div_ceil(64) <= 65535,
        "attention: batch {} or sequence {positions} is past the grid's limits",
        s.batch
    );
    assert!(
        split.ranks == 1 || (s.seq / 2).is_multiple_of(CHUNK_MULTIPLE) && s.seq.is_multiple_of(2),
        "attention: chunks of {} rows on the sequence axis; the CUDA kernels need a multiple of {CHUNK_MULTIPLE} (train.seq_len a multiple of {})",
        s.seq / 2,
        2 * CHUNK_MULTIPLE * split.ranks
    );
}

/// What a chunk of the sequence axis must be a multiple of on CUDA: the widest tile (the
/// backward pass's 128 keys), so that no tile straddles two chunks.
pub(crate) const CHUNK_MULTIPLE: usize = 128;

/// The kernels' sequence arguments: the positions of a whole sequence, the rows of one on this
/// rank, the rank and the ranks (`SeqRows` in attention.cu).
fn seq_args(s: AttnShape, split: SeqSplit) -> [Arg; 4] {
    [
        Arg::I(c_int(s.seq * split.ranks, "seq")),
        Arg::I(c_int(s.seq, "seq")),
        Arg::I(split.rank as i32),
        Arg::I(split.ranks as i32),
    ]
}

/// `Backend::attention_forward` (`attention_forward_docs` with `bounds`,
/// `attention_forward_split` with `split`: `qkv` is then every rank's rows, rank-major): a block
/// per 64 queries of a head, the kernel of the padded head width.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    gpu: &mut Cuda,
    out: View,
    lse: View,
    qkv: View,
    s: AttnShape,
    split: SeqSplit,
    bounds: Option<IdxView>,
) {
    gpu.expect(out, DType::Bf16, "attention_forward", "out");
    gpu.expect(qkv, DType::Bf16, "attention_forward", "qkv");
    gpu.expect(lse, DType::F32, "attention_forward", "lse");
    assert_eq!(qkv.len, split.ranks * s.rows() * s.qkv_width(), "internal error: attention_forward: qkv length");
    assert_eq!(out.len, s.rows() * s.q_width(), "internal error: attention_forward: out length");
    assert_eq!(lse.len, s.rows() * s.n_heads, "internal error: attention_forward: lse length");
    check_shape(s, split);
    let hd = padded_hd(s.head_dim);
    let name = match (hd, split.ranks > 1) {
        (16, false) => "attention_forward_hd16",
        (32, false) => "attention_forward_hd32",
        (64, false) => "attention_forward_hd64",
        (128, false) => "attention_forward_hd128",
        (192, false) => "attention_forward_hd192",
        (_, false) => "attention_forward_hd256",
        (16, true) => "attention_forward_split_hd16",
        (32, true) => "attention_forward_split_hd32",
        (64, true) => "attention_forward_split_hd64",
        (128, true) => "attention_forward_split_hd128",
        (192, true) => "attention_forward_split_hd192",
        (_, true) => "attention_forward_split_hd256",
    };
    let (o, l, q) = (gpu.out(out, "attention"), gpu.out(lse, "attention"), gpu.ptr(qkv));
    assert!(aligned16(&[o, q]), "internal error: attention rows must start 16-byte aligned");
    let logit_max = gpu.logit_max.map_or(0, |m| {
        gpu.expect(m, DType::F32, "attention_forward", "logit_max");
        assert_eq!(m.len, s.n_heads, "internal error: attention_forward: logit_max length");
        gpu.out(m, "attention")
    });
    let [seq, local, rank, ranks] = seq_args(s, split);
    let args = [
        Arg::P(o),
        Arg::P(l),
        Arg::P(logit_max),
        Arg::P(q),
        Arg::P(doc_ptrs(gpu, bounds, s, split).0),
        seq,
        local,
        rank,
        ranks,
        Arg::I(s.n_heads as i32),
        Arg::I(s.n_kv_heads as i32),
        Arg::I(s.head_dim as i32),
        Arg::I(c_int(s.window, "window")),
        Arg::F(s.softmax_scale()),
    ];
    // (head, batch, query tile): the longest tiles of every head and sequence first.
    let grid = (s.n_heads as u32, s.batch as u32, s.seq.div_ceil(64) as u32);
    gpu.launch(name, grid, THREADS, forward_smem(hd), &args);
}

/// The kernels' `starts` and `ends` arguments: the halves of the document bounds (of the whole
/// sequences, by position), or null without masking.
fn doc_ptrs(gpu: &Cuda, bounds: Option<IdxView>, s: AttnShape, split: SeqSplit) -> (u64, u64) {
    let n = s.rows() * split.ranks;
    bounds.map_or((0, 0), |v| {
        assert_eq!(v.len, 2 * n, "internal error: attention: document bounds length");
        (gpu.iptr(v.at(0, n)), gpu.iptr(v.at(n, n)))
    })
}

/// `Backend::attention_backward` (`attention_backward_docs` with `bounds`,
/// `attention_backward_split` with `split`): D = rowsum(dout · out) first, then a block per 128
/// keys (64 for heads up to 32 wide and past 192) of a key/value head accumulating dQ in the
/// f32 scratch, and last dQ converted into `dqkv`. On a sequence axis the keys are every
/// rank's, and `dqkv` (every rank's rows) is zeroed first: the other ranks' rows get only key
/// and value gradients.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    gpu: &mut Cuda,
    dqkv: View,
    dout: View,
    qkv: View,
    out: View,
    lse: View,
    s: AttnShape,
    split: SeqSplit,
    bounds: Option<IdxView>,
) {
    for (v, name) in [(dqkv, "dqkv"), (dout, "dout"), (qkv, "qkv"), (out, "out")] {
        gpu.expect(v, DType::Bf16, "attention_backward", name);
    }
    gpu.expect(lse, DType::F32, "attention_backward", "lse");
    assert_eq!(dqkv.len, split.ranks * s.rows() * s.qkv_width(), "internal error: attention_backward: dqkv length");
    let (rows, heads, dh) = (s.rows(), s.n_heads, s.head_dim);
    let big_d = gpu.scratch(Scratch::AttnD, rows * heads * 4);
    let dq = gpu.scratch(Scratch::AttnDq, rows * heads * dh * 4);
    let (dqkv_p, g, q, o, l) = (gpu.out(dqkv, "attention"), gpu.ptr(dout), gpu.ptr(qkv), gpu.ptr(out), gpu.ptr(lse));
    assert!(aligned16(&[dqkv_p, g, q, o]), "internal error: attention rows must start 16-byte aligned");
    let args = [Arg::P(big_d), Arg::P(g), Arg::P(o), Arg::U(rows as u64), Arg::I(heads as i32), Arg::I(dh as i32)];
    gpu.launch("attention_backward_dot", (((rows * heads) as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
    gpu.zero_u32(dq, rows * heads * dh);
    check_shape(s, split);
    if split.ranks > 1 {
        gpu.zero_u32(dqkv_p, dqkv.len / 2); // bf16 pairs: the widths are multiples of 8
    }
    let hd = padded_hd(dh);
    let name = match (hd, split.ranks > 1) {
        (16, false) => "attention_backward_hd16",
        (32, false) => "attention_backward_hd32",
        (64, false) => "attention_backward_hd64",
        (128, false) => "attention_backward_hd128",
        (192, false) => "attention_backward_hd192",
        (_, false) => "attention_backward_hd256",
        (16, true) => "attention_backward_split_hd16",
        (32, true) => "attention_backward_split_hd32",
        (64, true) => "attention_backward_split_hd64",
        (128, true) => "attention_backward_split_hd128",
        (192, true) => "attention_backward_split_hd192",
        (_, true) => "attention_backward_split_hd256",
    };
    let scale = s.softmax_scale();
    let [seq, local, rank, ranks] = seq_args(s, split);
    let (starts, ends) = doc_ptrs(gpu, bounds, s, split);
    let args = [
        Arg::P(dqkv_p),
        Arg::P(dq),
        Arg::P(g),
        Arg::P(q),
        Arg::P(l),
        Arg::P(big_d),
        Arg::P(starts),
        Arg::P(ends),
        seq,
        local,
        rank,
        ranks,
        Arg::I(heads as i32),
        Arg::I(s.n_kv_heads as i32),
        Arg::I(dh as i32),
        Arg::I(c_int(s.window, "window")),
        Arg::F(scale),
    ];
    // (key/value head, batch, key tile): the longest tiles of every head and sequence first.
    let positions = s.seq * split.ranks;
    let grid = (s.n_kv_heads as u32, s.batch as u32, positions.div_ceil(backward_bc(hd)) as u32);
    gpu.launch(name, grid, backward_threads(hd), backward_smem(hd), &args);
    // This rank's rows of dqkv: a block of `rows`, rank-major.
    let own = dqkv_p + (split.rank * rows * s.qkv_width() * 2) as u64;
    let args = [
        Arg::P(own),
        Arg::P(dq),
        Arg::U(rows as u64),
        Arg::I(c_int(s.q_width(), "q width")),
        Arg::U(s.qkv_width() as u64),
        Arg::F(scale),
    ];
    // A block per row, 8 columns a thread: the head width is a multiple of 8 (`padded_hd`), the
    // rows of dqkv are 16-byte aligned (checked above) and so is the scratch.
    assert!(aligned16(&[dq]), "internal error: attention dQ scratch must be 16-byte aligned");
    let grid = rows.min(32 * gpu.dev.info().sm_count.max(1) as usize).max(1) as u32;
    gpu.launch("attention_backward_dq", (grid, 1, 1), row_threads(s.q_width() / 8), 0, &args);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_tiles_fit_the_shared_memory_of_sm80_and_sm90() {
        // Per-block opt-in limits: 163 KB on sm_80, 227 KB on sm_90; the forward kernel's
        // 256 bytes of static shared memory (its rows' document starts) count as well.
        for hd in PADDED {
            assert!(forward_smem(hd) + 256 <= 163 * 1024, "forward hd{hd}");
            assert!(backward_smem(hd) <= 163 * 1024, "backward hd{hd}");
            // A backward block is a warp per 16 keys; the dQ product splits its (BR / 16) ×
            // (hd / 8) tiles evenly over the warps, two at a time (`NT_PER_WARP` in attention.cu).
            let (br, bc) = (backward_br(hd), backward_bc(hd));
            let per_warp = (hd / 8) * (br / 16) / (bc / 16);
            assert!(per_warp.is_multiple_of(2) && per_warp * (bc / 16) == (hd / 8) * (br / 16), "dQ tiles hd{hd}");
            // Tiles never straddle two chunks of a sequence axis.
            for tile in [64, forward_bc(hd), br, bc] {
                assert!(CHUNK_MULTIPLE.is_multiple_of(tile), "hd{hd}: tile {tile}");
            }
        }
        assert_eq!(padded_hd(8), 16);
        assert_eq!(padded_hd(64), 64);
        assert_eq!(padded_hd(72), 128);
        assert_eq!(padded_hd(136), 192);
        assert_eq!(padded_hd(192), 192);
        assert_eq!(padded_hd(200), 256);
        assert_eq!(padded_hd(256), 256);
        assert_eq!(forward_smem(128), 87_040);
        // The wide heads' tiles (attention.cu, "Wide heads"): the forward pass's 32-key tiles,
        // the backward pass's 128 × 32 at 192 (just within sm_80) and 64 × 16 at 256.
        assert_eq!([forward_smem(192), forward_smem(256)], [76_800, 101_376]);
        assert_eq!([backward_smem(128), backward_smem(192), backward_smem(256)], [115_456, 164_608, 104_832]);
        assert_eq!(tiles(256), (32, 16, 64));
    }

    #[test]
    #[should_panic(expected = "head_dim 264 has no attention kernel")]
    fn heads_past_256_have_no_kernel() {
        padded_hd(264);
    }
}
