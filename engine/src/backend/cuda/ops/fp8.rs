//! FP8 casts and the delayed recipe's update (`fp8.cu`): the host side of
//! [`crate::backend::Backend::fp8_quantize`], [`crate::backend::Backend::fp8_quantize_both`]
//! and [`crate::backend::Backend::fp8_delayed_update`].
//! The products themselves are cuBLASLt's (`matmul.rs`).

use super::{Module, c_int};
use crate::backend::View;
use crate::backend::cuda::{Arg, Cuda, DType, Scratch};
use crate::backend::fp8::{Fp8Format, Scaling, State};

/// The kernels of `fp8.cu`.
pub(crate) const MODULE: Module = Module {
    name: "fp8",
    source: include_str!("fp8.cu"),
    kernels: &["fp8_amax_partials", "fp8_amax_finish", "fp8_cast", "fp8_cast_transposed", "fp8_delayed_update"],
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
        let most = super::elementwise::sum_blocks(gpu.dev.info().sm_count as usize);
        let parts = gpu.scratch(Scratch::SumPartials, most * 8);
        let blocks = n.div_ceil(256).clamp(1, most as u64) as u32;
        gpu.launch("fp8_amax_partials", (blocks, 1, 1), 256, 0, &[Arg::P(xp), Arg::U(n), Arg::P(parts)]);
        let current = Arg::I((scaling == Scaling::Current) as i32);
        gpu.launch("fp8_amax_finish", (1, 1, 1), 256, 0, &[Arg::P(parts), Arg::I(blocks as i32), Arg::P(sp), current]);
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

/// `Backend::fp8_delayed_update`: one thread an operand.
pub(crate) fn delayed_update(gpu: &mut Cuda, states: View, stride: usize, margin: u32) {
    gpu.expect(states, DType::F32, "fp8_delayed_update", "states");
    let operands = states.len / stride;
    let sp = gpu.out(states, "fp8_delayed_update");
    let args =
        [Arg::P(sp), Arg::I(c_int(operands, "operands")), Arg::I(c_int(stride, "stride")), Arg::I(margin as i32)];
    gpu.launch("fp8_delayed_update", ((operands as u32).div_ceil(256).max(1), 1, 1), 256, 0, &args);
}
