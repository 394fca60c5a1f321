//! Mixture-of-experts routing, dispatch tables, gather and combine, the experts' biases, and
//! their gradients (`moe.cu`), all on the device. The experts' own products are in [`super::gemm`].

use super::{Module, aligned16, c_int, row_threads};
use crate::backend::cuda::{Arg, Cuda, DType};
use crate::backend::{BufKind, ExpertWeights, IdxView, MoeDispatch, Parts, Scoring, View};

/// The kernels of `moe.cu`.
pub(crate) const MODULE: Module = Module {
    name: "moe",
    source: include_str!("moe.cu"),
    kernels: &[
        "moe_route",
        "moe_dispatch",
        "moe_stats",
        "moe_gather",
        "moe_gather_backward",
        "moe_combine",
        "moe_combine_backward_rows",
        "moe_combine_backward_weights",
        "moe_route_backward",
        "moe_load_excess",
        "moe_bias_step",
        "moe_expert_bias",
        "moe_expert_bias_backward",
        "moe_parts",
        "moe_counts",
        "moe_runs",
    ],
};

/// Largest number of experts the routing kernels handle (8 per lane of a warp).
pub(crate) const MAX_EXPERTS: usize = 256;

/// `Backend::moe_route`: scores, selection (bias, group limit) and top-k weights (a warp per
/// token), the dispatch tables with the experts' capacity, the routed counts and the dropped
/// slots (one block), and the probability sums (a block per expert).
pub(crate) fn route(gpu: &mut Cuda, probs: View, router_logits: View, d: MoeDispatch) {
    for (v, name) in [(probs, "probs"), (router_logits, "router_logits"), (d.weight, "weight"), (d.stats, "stats")] {
        gpu.expect(v, DType::F32, "moe_route", name);
    }
    assert!(d.experts <= MAX_EXPERTS, "internal error: {} experts", d.experts);
    let (n, e, k, r) = (d.tokens, d.experts, d.top_k, d.routing);
    r.validate(e, k);
    // The selection bias is read exact, in f32 as transformers keeps it: a parameter's f32
    // master (its bf16 copy would round the balancing step's small moves away).
    let bias = r.bias.map_or(0, |b| {
        let (at, dtype) = gpu.exact(b);
        assert!(
            dtype == DType::F32,
            "internal error: cuda moe_route: the selection bias must be read in f32, got {dtype:?} ({:?}): FSDP's bf16 gathers do not carry it",
            gpu.buffer(b).kind
        );
        at
    });
    let (p, z, w, ex) =
        (gpu.out(probs, "moe_route"), gpu.ptr(router_logits), gpu.out(d.weight, "moe_route"), gpu.iptr(d.expert));
    let (ei, ki) = (e as i32, k as i32);
    let args = [
        Arg::P(p),
        Arg::P(w),
        Arg::P(ex),
        Arg::P(z),
        Arg::P(bias),
        Arg::U(n as u64),
        Arg::I(ei),
        Arg::I(ki),
        Arg::I((r.scoring == Scoring::Sigmoid) as i32),
        Arg::I(r.renormalize as i32),
        Arg::I(r.groups as i32),
        Arg::I(r.top_groups as i32),
        Arg::F(r.scale),
    ];
    gpu.launch("moe_route", ((n as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
    assert_eq!(d.stats.len, MoeDispatch::stats_len(e), "internal error: moe_route: stats length");
    let (sr, rs, off) = (gpu.iptr(d.slot_row), gpu.iptr(d.row_slot), gpu.iptr(d.offsets));
    let st = gpu.out(d.stats, "moe_route");
    let capacity = i32::try_from(d.capacity).expect("internal error: moe_route: capacity beyond i32");
    let args = [
        Arg::P(sr),
        Arg::P(rs),
        Arg::P(off),
        Arg::P(st),
        Arg::P(ex),
        Arg::U((n * k) as u64),
        Arg::I(ei),
        Arg::I(capacity),
    ];
    gpu.launch("moe_dispatch", (1, 1, 1), 1024, 34 * e * 4, &args);
    let args = [Arg::P(st), Arg::P(p), Arg::U(n as u64), Arg::I(ei)];
    gpu.launch("moe_stats", (e as u32, 1, 1), 256, 0, &args);
}

/// `Backend::moe_gather`: a block per slot copies its token's row into expert order.
pub(crate) fn gather(gpu: &mut Cuda, xe: View, x: View, d: MoeDispatch, width: usize) {
    gpu.expect(xe, DType::Bf16, "moe_gather", "xe");
    gpu.expect(x, DType::Bf16, "moe_gather", "x");
    let (o, xp, rs) = (gpu.out(xe, "moe_gather"), gpu.ptr(x), gpu.iptr(d.row_slot));
    let args = [Arg::P(o), Arg::P(xp), Arg::P(rs), Arg::I(d.top_k as i32), Arg::I(c_int(width, "d"))];
    gpu.launch("moe_gather", ((d.tokens * d.top_k) as u32, 1, 1), row_threads(width), 0, &args);
}

/// `Backend::moe_gather_backward`: a block per token sums the gradients of its k slots.
pub(crate) fn gather_backward(gpu: &mut Cuda, dx: View, dxe: View, d: MoeDispatch, width: usize) {
    gpu.expect(dx, DType::Bf16, "moe_gather_backward", "dx");
    gpu.expect(dxe, DType::Bf16, "moe_gather_backward", "dxe");
    let (o, g, sr) = (gpu.out(dx, "moe_gather_backward"), gpu.ptr(dxe), gpu.iptr(d.slot_row));
    let args = [Arg::P(o), Arg::P(g), Arg::P(sr), Arg::I(d.top_k as i32), Arg::I(c_int(width, "d"))];
    gpu.launch("moe_gather_backward", (d.tokens as u32, 1, 1), row_threads(width), 0, &args);
}

/// `Backend::moe_combine`: a block per token sums its experts' rows, weighted.
pub(crate) fn combine(gpu: &mut Cuda, out: View, ye: View, d: MoeDispatch, width: usize) {
    gpu.expect(out, DType::Bf16, "moe_combine", "out");
    gpu.expect(ye, DType::Bf16, "moe_combine", "ye");
    let (o, y, w, sr) = (gpu.out(out, "moe_combine"), gpu.ptr(ye), gpu.ptr(d.weight), gpu.iptr(d.slot_row));
    let args = [Arg::P(o), Arg::P(y), Arg::P(w), Arg::P(sr), Arg::I(d.top_k as i32), Arg::I(c_int(width, "d"))];
    gpu.launch("moe_combine", (d.tokens as u32, 1, 1), row_threads(width), 0, &args);
}

/// `Backend::moe_combine_backward`: the rows' gradients (a block per slot), then the routing
/// weights' gradients (a warp per slot).
pub(crate) fn combine_backward(
    gpu: &mut Cuda,
    dye: View,
    dweight: View,
    dout: View,
    ye: View,
    d: MoeDispatch,
    width: usize,
) {
    gpu.expect(dye, DType::Bf16, "moe_combine_backward", "dye");
    gpu.expect(dweight, DType::F32, "moe_combine_backward", "dweight");
    gpu.expect(dout, DType::Bf16, "moe_combine_backward", "dout");
    gpu.expect(ye, DType::Bf16, "moe_combine_backward", "ye");
    let slots = d.tokens * d.top_k;
    let (dy, dw) = (gpu.out(dye, "moe_combine_backward"), gpu.out(dweight, "moe_combine_backward"));
    let (g, y, w, sr, rs) = (gpu.ptr(dout), gpu.ptr(ye), gpu.ptr(d.weight), gpu.iptr(d.slot_row), gpu.iptr(d.row_slot));
    let (k, wi) = (d.top_k as i32, c_int(width, "d"));
    let args = [Arg::P(dy), Arg::P(g), Arg::P(w), Arg::P(rs), Arg::I(k), Arg::I(wi)];
    gpu.launch("moe_combine_backward_rows", (slots as u32, 1, 1), row_threads(width), 0, &args);
    let args = [Arg::P(dw), Arg::P(g), Arg::P(y), Arg::P(sr), Arg::U(slots as u64), Arg::I(k), Arg::I(wi)];
    gpu.launch("moe_combine_backward_weights", ((slots as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
}

/// `Backend::moe_route_backward`: the router logits' gradient from the weights' gradient (through
/// the scale, the renormalisation and the softmax or sigmoid) and the load-balancing loss, a
/// warp per token.
pub(crate) fn route_backward(
    gpu: &mut Cuda,
    drouter: View,
    dweight: View,
    probs: View,
    d: MoeDispatch,
    counts: View,
    aux_scale: f32,
) {
    gpu.expect(drouter, DType::Bf16, "moe_route_backward", "drouter");
    for (v, name) in [(dweight, "dweight"), (probs, "probs"), (counts, "counts"), (d.weight, "weight")] {
        gpu.expect(v, DType::F32, "moe_route_backward", name);
    }
    let (dr, dw, p, w, c, ex) = (
        gpu.out(drouter, "moe_route_backward"),
        gpu.ptr(dweight),
        gpu.ptr(probs),
        gpu.ptr(d.weight),
        gpu.ptr(counts),
        gpu.iptr(d.expert),
    );
    let args = [
        Arg::P(dr),
        Arg::P(dw),
        Arg::P(p),
        Arg::P(w),
        Arg::P(c),
        Arg::P(ex),
        Arg::U(d.tokens as u64),
        Arg::I(d.experts as i32),
        Arg::I(d.top_k as i32),
        Arg::F(aux_scale),
        Arg::I((d.routing.scoring == Scoring::Sigmoid) as i32),
        Arg::I(d.routing.renormalize as i32),
        Arg::F(d.routing.scale),
    ];
    gpu.launch("moe_route_backward", ((d.tokens as u64 * 32).div_ceil(256) as u32, 1, 1), 256, 0, &args);
}

/// `Backend::moe_load_excess`: one block (the mean summed in order by one thread).
pub(crate) fn load_excess(gpu: &mut Cuda, dst: View, counts: View) {
    gpu.expect(dst, DType::F32, "moe_load_excess", "dst");
    gpu.expect(counts, DType::F32, "moe_load_excess", "counts");
    assert_eq!(dst.len, counts.len, "internal error: moe_load_excess: dst and counts lengths");
    let (d, c) = (gpu.out(dst, "moe_load_excess"), gpu.ptr(counts));
    let args = [Arg::P(d), Arg::P(c), Arg::I(c_int(dst.len, "experts"))];
    gpu.launch("moe_load_excess", (1, 1, 1), 256, 0, &args);
}

/// `Backend::moe_bias_step`: elementwise. A bias in parameters steps its f32 master and refreshes
/// its bf16 copy, as AdamW does; any other bias is f32.
pub(crate) fn bias_step(gpu: &mut Cuda, bias: View, excess: View, rate: f32) {
    gpu.expect(excess, DType::F32, "moe_bias_step", "excess");
    assert_eq!(bias.len, excess.len, "internal error: moe_bias_step: bias and excess lengths");
    let (b, b16) = if gpu.buffer(bias).kind == BufKind::Params {
        (gpu.exact(bias).0, gpu.ptr(bias))
    } else {
        gpu.expect(bias, DType::F32, "moe_bias_step", "bias");
        (gpu.out(bias, "moe_bias_step"), 0)
    };
    let x = gpu.out(excess, "moe_bias_step");
    let args = [Arg::P(b), Arg::P(b16), Arg::P(x), Arg::U(bias.len as u64), Arg::F(rate)];
    gpu.launch_1d("moe_bias_step", bias.len as u64, &args);
}

/// `Backend::moe_expert_bias`: a block per dispatched row (the kept rows, at most
/// [`MoeDispatch::rows_bound`] from `offsets[0]`, as the grouped products find them), its
/// expert by a binary search of the offsets; 8 columns a thread when the widths and addresses
/// allow. The bias is read as the products read their weights: a parameter's bf16 copy.
pub(crate) fn expert_bias(gpu: &mut Cuda, out: View, bias: ExpertWeights, d: MoeDispatch, width: usize) {
    gpu.expect(out, DType::Bf16, "moe_expert_bias", "out");
    gpu.expect(bias.first, DType::Bf16, "moe_expert_bias", "bias");
    assert_eq!(
        bias.first.len, width,
        "internal error: moe_expert_bias: an expert's bias holds {} ≠ {width}",
        bias.first.len
    );
    let rows = d.rows_bound();
    assert!(out.len >= rows * width, "internal error: moe_expert_bias: out holds {} < {rows}·{width}", out.len);
    gpu.ptr(bias.expert(d.experts - 1)); // the last expert's bias lies in the buffer
    let (o, b, off) = (gpu.out(out, "moe_expert_bias"), gpu.ptr(bias.first), gpu.iptr(d.offsets));
    let vec = width.is_multiple_of(8) && bias.stride.is_multiple_of(8) && aligned16(&[o, b]);
    let args = [
        Arg::P(o),
        Arg::P(b),
        Arg::U(bias.stride as u64),
        Arg::P(off),
        Arg::I(c_int(d.experts, "experts")),
        Arg::I(c_int(width, "width")),
        Arg::I(vec as i32),
    ];
    let threads = row_threads(if vec { width / 8 } else { width });
    gpu.launch("moe_expert_bias", (rows as u32, 1, 1), threads, 0, &args);
}

/// `Backend::moe_expert_bias_backward`: a block per 64 columns of an expert sums its rows in a
/// fixed order into the f32 gradients (as `moe_expert_matmul_dw` writes the weights').
pub(crate) fn expert_bias_backward(gpu: &mut Cuda, dbias: ExpertWeights, dout: View, d: MoeDispatch, width: usize) {
    gpu.expect(dbias.first, DType::F32, "moe_expert_bias_backward", "dbias");
    gpu.expect(dout, DType::Bf16, "moe_expert_bias_backward", "dout");
    assert_eq!(
        dbias.first.len, width,
        "internal error: moe_expert_bias_backward: an expert's bias holds {} ≠ {width}",
        dbias.first.len
    );
    let rows = d.rows_bound();
    assert!(
        dout.len >= rows * width,
        "internal error: moe_expert_bias_backward: dout holds {} < {rows}·{width}",
        dout.len
    );
    gpu.ptr(dbias.expert(d.experts - 1));
    let (db, g, off) = (gpu.out(dbias.first, "moe_expert_bias_backward"), gpu.ptr(dout), gpu.iptr(d.offsets));
    let args = [Arg::P(db), Arg::P(g), Arg::U(dbias.stride as u64), Arg::P(off), Arg::I(c_int(width, "width"))];
    gpu.launch("moe_expert_bias_backward", (width.div_ceil(64) as u32, d.experts as u32, 1), 256, 0, &args);
}

/// `Backend::moe_pack` and `Backend::moe_unpack`: a block per row of each part.
pub(crate) fn parts(
    gpu: &mut Cuda,
    grouped: View,
    packed: View,
    offsets: IdxView,
    p: Parts,
    width: usize,
    unpack: bool,
) {
    let op = if unpack { "moe_unpack" } else { "moe_pack" };
    gpu.expect(grouped, DType::Bf16, op, "grouped rows");
    gpu.expect(packed, DType::Bf16, op, "parts");
    assert!(packed.len >= p.members * p.rows * width, "internal error: {op}: parts of {} elements", packed.len);
    assert!(offsets.len > p.members * p.local, "internal error: {op}: {} offsets", offsets.len);
    let (g, k) = if unpack { (gpu.out(grouped, op), gpu.ptr(packed)) } else { (gpu.ptr(grouped), gpu.out(packed, op)) };
    let args = [
        Arg::P(g),
        Arg::P(k),
        Arg::P(gpu.iptr(offsets)),
        Arg::I(c_int(p.local, "local experts")),
        Arg::U(p.rows as u64),
        Arg::I(c_int(width, "d")),
        Arg::I(unpack as i32),
    ];
    let grid = (u32::try_from(p.rows.max(1)).expect("internal error: parts of 2^32 rows"), p.members as u32, 1);
    gpu.launch("moe_parts", grid, row_threads(width), 0, &args);
}

/// `Backend::moe_counts`: a thread per expert.
pub(crate) fn counts(gpu: &mut Cuda, counts: View, offsets: IdxView) {
    gpu.expect(counts, DType::F32, "moe_counts", "counts");
    assert!(offsets.len > counts.len, "internal error: moe_counts: {} offsets for {} experts", offsets.len, counts.len);
    let args = [Arg::P(gpu.out(counts, "moe_counts")), Arg::P(gpu.iptr(offsets)), Arg::I(c_int(counts.len, "experts"))];
    gpu.launch_1d("moe_counts", counts.len as u64, &args);
}

/// `Backend::moe_runs`: a thread per sender.
pub(crate) fn runs(gpu: &mut Cuda, runs: IdxView, counts: View, p: Parts) {
    gpu.expect(counts, DType::F32, "moe_runs", "counts");
    assert!(counts.len >= p.members * p.local, "internal error: moe_runs: {} counts", counts.len);
    assert!(runs.len >= p.members * (p.local + 1), "internal error: moe_runs: {} offsets", runs.len);
    let args = [
        Arg::P(gpu.iptr(runs)),
        Arg::P(gpu.ptr(counts)),
        Arg::I(c_int(p.members, "members")),
        Arg::I(c_int(p.local, "local experts")),
        Arg::U(p.rows as u64),
    ];
    gpu.launch_1d("moe_runs", p.members as u64, &args);
}
