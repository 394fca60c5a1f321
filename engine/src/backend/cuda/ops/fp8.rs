//! FP8 casts and the delayed recipe's update (`fp8.cu`): the host side of
//! [`crate::backend::Backend::fp8_quantize`], [`crate::backend::Backend::fp8_quantize_both`],
//! [`crate::backend::Backend::fp8_delayed_update`] and the weights' casts an AdamW step writes,
//! [`crate::backend::Backend::adamw_fp8`].
//! The products themselves are cuBLASLt's (`matmul.rs`).

use super::{Module, c_int};
use crate::backend::cuda::{Arg, Cuda, DType, Scratch};
use crate::backend::fp8::{Fp8Format, Scaling, State, WeightCast};
use crate::backend::{AdamWStep, BufKind, Segment, View};

/// The kernels of `fp8.cu`.
pub(crate) const MODULE: Module = Module {
    name: "fp8",
    source: include_str!("fp8.cu"),
    kernels: &[
        "fp8_amax_partials",
        "fp8_amax_finish",
        "fp8_cast",
        "fp8_cast_transposed",
        "fp8_transpose",
        "fp8_delayed_update",
        "adamw_fp8",
        "rmsnorm_fp8",
        "rmsnorm_fp8_v8",
        "swiglu_fp8",
    ],
};

/// `Backend::fp8_quantize` and `Backend::fp8_quantize_both` (`plain`: the untransposed cast
/// too, in the same pass). Tensorwise scaling takes the amax over fixed blocks into the state
/// first (it sets the scale the cast uses: two launches); the delayed recipe records the amax in
/// the cast itself (its scale is the last update's); a tensor cast again takes none. Then the
/// cast, transposed through shared memory when asked: one launch under the delayed recipe, three
/// under tensorwise scaling; the scale never leaves the device. [`Cuda::fp8_unfused`] (the
/// measurements' "before") takes the amax in its own pass under both recipes and casts each
/// layout in its own launch, as the engine did before the casts were fused.
pub(crate) fn quantize(
    gpu: &mut Cuda,
    (q, plain): (View, Option<View>),
    x: View,
    state: State,
    scaling: Scaling,
    transpose: Option<usize>,
) {
    assert_eq!(q.len, x.len, "internal error: fp8_quantize: q and x differ in length");
    gpu.expect(x, DType::Bf16, "fp8_quantize", "x");
    gpu.expect(q, DType::Fp8, "fp8_quantize", "q");
    gpu.expect(state.view, DType::F32, "fp8_quantize", "state");
    if let (Some(p), true) = (plain, gpu.fp8_unfused) {
        quantize(gpu, (p, None), x, state, scaling, None);
        return quantize(gpu, (q, None), x, state, Scaling::Again, transpose);
    }
    let (qp, xp, sp) = (gpu.out(q, "fp8_quantize"), gpu.ptr(x), gpu.out(state.view, "fp8_quantize"));
    let pp = plain.map_or(0, |p| {
        assert_eq!(p.len, x.len, "internal error: fp8_quantize: both layouts' lengths");
        gpu.expect(p, DType::Fp8, "fp8_quantize", "plain");
        gpu.out(p, "fp8_quantize")
    });
    let n = x.len as u64;
    let record = scaling == Scaling::Delayed && !gpu.fp8_unfused;
    if scaling == Scaling::Current || (scaling == Scaling::Delayed && !record) {
        amax_pass(gpu, (xp, n), sp, scaling == Scaling::Current);
    }
    let (e5m2, record) = (Arg::I((state.format == Fp8Format::E5M2) as i32), Arg::I(record as i32));
    match transpose {
        None => {
            assert!(plain.is_none(), "internal error: fp8_quantize: both layouts without a transpose");
            gpu.launch_1d("fp8_cast", n, &[Arg::P(qp), Arg::P(xp), Arg::U(n), Arg::P(sp), e5m2, record])
        }
        Some(cols) => {
            let rows = x.len / cols;
            assert_eq!(rows * cols, x.len, "internal error: fp8_quantize: {} elements are not rows of {cols}", x.len);
            let grid = (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1);
            assert!(grid.1 < 65536, "internal error: fp8_quantize: {rows} rows are more than a grid takes");
            let (r, c) = (Arg::I(c_int(rows, "rows")), Arg::I(c_int(cols, "cols")));
            let args = [Arg::P(qp), Arg::P(pp), Arg::P(xp), r, c, Arg::P(sp), e5m2, record];
            gpu.launch("fp8_cast_transposed", grid, 256, 0, &args);
        }
    }
}

/// `Backend::fp8_amax`: the tensorwise cast's amax pass (block partials, then their maximum),
/// recorded as the delayed recipe records it.
pub(crate) fn amax(gpu: &mut Cuda, state: State, x: View) {
    gpu.expect(x, DType::Bf16, "fp8_amax", "x");
    gpu.expect(state.view, DType::F32, "fp8_amax", "state");
    let (xp, sp) = (gpu.ptr(x), gpu.out(state.view, "fp8_amax"));
    amax_pass(gpu, (xp, x.len as u64), sp, false);
}

/// The amax of the `n` bf16 elements at `xp` into the state at `sp`: block partials, then their
/// maximum, which sets the scale (`current`, tensorwise) or is recorded.
fn amax_pass(gpu: &mut Cuda, (xp, n): (u64, u64), sp: u64, current: bool) {
    let most = super::elementwise::sum_blocks(gpu.dev.info().sm_count as usize);
    let parts = gpu.scratch(Scratch::SumPartials, most * 8);
    let blocks = n.div_ceil(256).clamp(1, most as u64) as u32;
    gpu.launch("fp8_amax_partials", (blocks, 1, 1), 256, 0, &[Arg::P(xp), Arg::U(n), Arg::P(parts)]);
    let args = [Arg::P(parts), Arg::I(blocks as i32), Arg::P(sp), Arg::I(current as i32)];
    gpu.launch("fp8_amax_finish", (1, 1, 1), 256, 0, &args);
}

/// `Backend::fp8_transpose`: `fp8.cu`'s tiles, one launch.
pub(crate) fn transpose(gpu: &mut Cuda, q: View, x: View, cols: usize) {
    assert_eq!(q.len, x.len, "internal error: fp8_transpose: q and x differ in length");
    gpu.expect(x, DType::Fp8, "fp8_transpose", "x");
    gpu.expect(q, DType::Fp8, "fp8_transpose", "q");
    assert!(!q.overlaps(x), "internal error: fp8_transpose in place");
    let rows = x.len / cols;
    assert_eq!(rows * cols, x.len, "internal error: fp8_transpose: {} elements are not rows of {cols}", x.len);
    let grid = (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1);
    assert!(grid.1 < 65536, "internal error: fp8_transpose: {rows} rows are more than a grid takes");
    let (qp, xp) = (gpu.out(q, "fp8_transpose"), gpu.ptr(x));
    let args = [Arg::P(qp), Arg::P(xp), Arg::I(c_int(rows, "rows")), Arg::I(c_int(cols, "cols"))];
    gpu.launch("fp8_transpose", grid, 256, 0, &args);
}

/// `Backend::rmsnorm_fp8`: a block of `rmsnorm_forward`'s threads (and vector width) per 32
/// rows; under [`Cuda::fp8_unfused`] the norm and then the cast, as the trait composes them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm(
    gpu: &mut Cuda,
    (q, qt, state): (View, View, State),
    out: View,
    rstd: View,
    (x, w): (View, View),
    offset: f32,
    d: usize,
    eps: f32,
) {
    if gpu.fp8_unfused {
        super::rmsnorm::forward(gpu, out, rstd, x, w, offset, d, eps);
        return quantize(gpu, (qt, Some(q)), out, state, Scaling::Delayed, Some(d));
    }
    for (v, name) in [(x, "x"), (w, "w")] {
        gpu.expect(v, DType::Bf16, "rmsnorm_fp8", name);
    }
    for (v, name) in [(q, "q"), (qt, "qt")] {
        gpu.expect(v, DType::Fp8, "rmsnorm_fp8", name);
        assert_eq!(v.len, x.len, "internal error: rmsnorm_fp8: {name}'s length");
    }
    assert_eq!(state.format, Fp8Format::E4M3, "internal error: rmsnorm_fp8 casts to E4M3");
    let rows = x.len / d;
    assert_eq!(rstd.len, rows, "internal error: rmsnorm_fp8: rstd length");
    let (qp, qtp, rp) = (gpu.out(q, "rmsnorm_fp8"), gpu.out(qt, "rmsnorm_fp8"), gpu.out(rstd, "rmsnorm_fp8"));
    let (xp, wp, sp) = (gpu.ptr(x), gpu.ptr(w), gpu.out(state.view, "rmsnorm_fp8"));
    // The unfused kernel's choice of width and threads: its sums, bit for bit.
    let v8 = d.is_multiple_of(8) && super::aligned16(&[gpu.ptr(out), xp, wp]);
    let name = if v8 { "rmsnorm_fp8_v8" } else { "rmsnorm_fp8" };
    let threads = super::row_threads(if v8 { d / 8 } else { d });
    let args = [
        Arg::P(qp),
        Arg::P(qtp),
        Arg::P(rp),
        Arg::P(xp),
        Arg::P(wp),
        Arg::I(c_int(rows, "rows")),
        Arg::I(c_int(d, "d")),
        Arg::F(eps),
        Arg::F(offset),
        Arg::P(sp),
    ];
    gpu.launch(name, (rows.div_ceil(32) as u32, 1, 1), threads, 0, &args);
}

/// `Backend::swiglu_fp8`: `cast_tile`'s grid of 32 × 32 tiles over `[rows, f]`; under
/// [`Cuda::fp8_unfused`] SwiGLU and then the cast, as the trait composes them.
pub(crate) fn swiglu(gpu: &mut Cuda, (q, qt, state): (View, View, State), h: View, gu: View, f: usize) {
    if gpu.fp8_unfused {
        super::swiglu::forward(gpu, h, gu, f);
        return quantize(gpu, (qt, Some(q)), h, state, Scaling::Delayed, Some(f));
    }
    gpu.expect(gu, DType::Bf16, "swiglu_fp8", "gu");
    for (v, name) in [(q, "q"), (qt, "qt")] {
        gpu.expect(v, DType::Fp8, "swiglu_fp8", name);
        assert_eq!(2 * v.len, gu.len, "internal error: swiglu_fp8: {name}'s length");
    }
    assert_eq!(state.format, Fp8Format::E4M3, "internal error: swiglu_fp8 casts to E4M3");
    let rows = q.len / f;
    let (qp, qtp, gp, sp) =
        (gpu.out(q, "swiglu_fp8"), gpu.out(qt, "swiglu_fp8"), gpu.ptr(gu), gpu.out(state.view, "swiglu_fp8"));
    let grid = (f.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1);
    assert!(grid.1 < 65536, "internal error: swiglu_fp8: {rows} rows are more than a grid takes");
    let (r, c) = (Arg::I(c_int(rows, "rows")), Arg::I(c_int(f, "f")));
    gpu.launch("swiglu_fp8", grid, 256, 0, &[Arg::P(qp), Arg::P(qtp), Arg::P(gp), r, c, Arg::P(sp)]);
}

/// `Backend::fp8_delayed_update`: one thread an operand.
pub(crate) fn delayed_update(gpu: &mut Cuda, states: View, stride: usize, margin: u32) {
    gpu.expect(states, DType::F32, "fp8_delayed_update", "states");
    let operands = states.len / stride;
    let sp = gpu.out(states, "fp8_delayed_update");
    let args =
        [Arg::P(sp), Arg::I(c_int(operands, "operands")), Arg::I(c_int(stride, "stride")), Arg::I(margin as i32)];
    gpu.launch("fp8_delayed_update", ((operands as u32).div_ceil(256).max(1), 1, 1), 256, 0, &args);
}

/// `Backend::adamw_fp8`: the flat update (`adamw.cu`) over the segments less the weights in
/// `casts`, then one `adamw_fp8` launch a weight, which updates it and writes its casts from
/// the new bf16 copy in the same pass. [`Cuda::fp8_unfused`] (the measurements' "before"):
/// the flat update over everything, then a cast of each weight as the passes made it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    gpu: &mut Cuda,
    params: View,
    grads: View,
    (m, v): (View, View),
    norm_squared: View,
    segments: &[Segment],
    step: AdamWStep,
    casts: &[WeightCast],
) {
    if gpu.fp8_unfused {
        super::adamw::step(gpu, params, grads, m, v, norm_squared, segments, step);
        return casts.iter().for_each(|c| c.cast(gpu, params));
    }
    let (rest, decays) = segments_without(segments, casts);
    super::adamw::step(gpu, params, grads, m, v, norm_squared, &rest, step);
    for (c, decays) in casts.iter().zip(decays) {
        let at = |x: View| x.at(c.offset, c.rows * c.cols);
        assert!(
            gpu.buffer(params).kind == BufKind::Params,
            "internal error: adamw_fp8 on a view that is not parameters"
        );
        gpu.expect(c.q, DType::Fp8, "adamw_fp8", "q");
        gpu.expect(c.qt, DType::Fp8, "adamw_fp8", "qt");
        assert!(c.q.len == c.rows * c.cols && c.qt.len == c.q.len, "internal error: adamw_fp8: the casts' lengths");
        let (p, p16) = (gpu.exact(at(params)).0, gpu.ptr(at(params)));
        let (g, mp, vp) = (gpu.out(at(grads), "adamw_fp8"), gpu.out(at(m), "adamw_fp8"), gpu.out(at(v), "adamw_fp8"));
        let (q, qt, state) =
            (gpu.out(c.q, "adamw_fp8"), gpu.out(c.qt, "adamw_fp8"), gpu.out(c.state.view, "adamw_fp8"));
        let mut args = vec![
            Arg::P(p),
            Arg::P(p16),
            Arg::P(g),
            Arg::P(mp),
            Arg::P(vp),
            Arg::P(gpu.ptr(norm_squared)),
            Arg::I(c_int(c.rows, "rows")),
            Arg::I(c_int(c.cols, "cols")),
            Arg::I(decays as i32),
            Arg::P(q),
            Arg::P(qt),
            Arg::P(state),
            Arg::I((c.state.format == Fp8Format::E5M2) as i32),
        ];
        args.extend(super::adamw::step_args(step));
        let grid = (c.cols.div_ceil(32) as u32, c.rows.div_ceil(32) as u32, 1);
        assert!(grid.1 < 65536, "internal error: adamw_fp8: {} rows are more than a grid takes", c.rows);
        gpu.launch("adamw_fp8", grid, 256, 0, &args);
    }
}

/// `segments` with the weights of `casts` cut out (what the flat update still takes), and
/// whether each weight decays: that of the segments covering it (a packed weight, q/k/v, spans
/// its tensors'), which must cover it whole and alike.
fn segments_without(segments: &[Segment], casts: &[WeightCast]) -> (Vec<Segment>, Vec<bool>) {
    let mut holes: Vec<(usize, usize)> = casts.iter().map(|c| (c.offset, c.offset + c.rows * c.cols)).collect();
    holes.sort_unstable();
    let decays = casts
        .iter()
        .map(|c| {
            let end = c.offset + c.rows * c.cols;
            let over: Vec<&Segment> =
                segments.iter().filter(|s| s.offset < end && s.offset + s.len > c.offset).collect();
            let covered: usize = over.iter().map(|s| (s.offset + s.len).min(end) - s.offset.max(c.offset)).sum();
            let decay = over.first().is_some_and(|s| s.decay);
            assert!(
                covered == end - c.offset && over.iter().all(|s| s.decay == decay),
                "internal error: adamw_fp8: weight {}..{end} not covered whole and alike by the update's segments",
                c.offset
            );
            decay
        })
        .collect();
    let mut rest = Vec::new();
    for s in segments {
        let mut at = s.offset;
        let end = s.offset + s.len;
        for &(a, b) in holes.iter().filter(|(a, b)| *a < end && *b > s.offset) {
            if a > at {
                rest.push(Segment { offset: at, len: a - at, decay: s.decay });
            }
            at = at.max(b);
        }
        if at < end {
            rest.push(Segment { offset: at, len: end - at, decay: s.decay });
        }
    }
    (rest, decays)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weights_are_cut_out_of_the_flat_updates_segments() {
        let seg = |offset, len, decay| Segment { offset, len, decay };
        let none = View { buf: crate::backend::BufId(0), offset: 0, len: 0 };
        let state = State { view: none, format: Fp8Format::E4M3 };
        let cast = |offset, rows, cols| WeightCast { offset, rows, cols, q: none, qt: none, state };
        // A weight in the middle of a segment, one filling a segment, one at a segment's end.
        let segments = [seg(0, 100, true), seg(100, 20, false), seg(120, 30, true)];
        let casts = [cast(10, 4, 5), cast(100, 4, 5), cast(140, 2, 5)];
        let (rest, decays) = segments_without(&segments, &casts);
        assert_eq!(rest, vec![seg(0, 10, true), seg(30, 70, true), seg(120, 20, true)]);
        assert_eq!(decays, vec![true, false, true]);
        // A packed weight over three tensors' segments (q, k, v).
        let packed = [seg(0, 8, true), seg(8, 4, true), seg(12, 4, true), seg(16, 4, false)];
        assert_eq!(segments_without(&packed, &[cast(0, 4, 4)]), (vec![seg(16, 4, false)], vec![true]));
        assert_eq!(segments_without(&segments, &[]).0, segments.to_vec());
    }
}
