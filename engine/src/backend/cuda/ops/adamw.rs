//! AdamW fused with gradient clipping, the zeroing of the gradients and the refresh of the
//! parameters' bf16 copy (`adamw.cu`).

use super::{Module, aligned16};
use crate::backend::cuda::{Arg, Cuda, DType, Scratch, bytes_of};
use crate::backend::{AdamWStep, BufKind, Segment, View};

/// The kernels of `adamw.cu`.
pub(crate) const MODULE: Module = Module { name: "adamw", source: include_str!("adamw.cu"), kernels: &["adamw"] };

/// `Backend::adamw`: one fused pass over the flat buffers, 4 elements a thread; the table of
/// decay runs is uploaded again only when the segments change.
pub(crate) fn step(
    gpu: &mut Cuda,
    params: View,
    grads: View,
    m: View,
    v: View,
    norm_squared: View,
    segments: &[Segment],
    step: AdamWStep,
) {
    assert!(gpu.buffer(params).kind == BufKind::Params, "internal error: adamw on a view that is not parameters");
    for (x, name) in [(grads, "grads"), (m, "m"), (v, "v"), (norm_squared, "norm_squared")] {
        gpu.expect(x, DType::F32, "adamw", name);
    }
    let n = params.len;
    assert!(grads.len == n && m.len == n && v.len == n, "internal error: adamw lengths");
    let (p, p16) = (gpu.exact(params).0, gpu.ptr(params));
    let (g, mp, vp, ns) = (gpu.out(grads, "adamw"), gpu.out(m, "adamw"), gpu.out(v, "adamw"), gpu.ptr(norm_squared));
    assert!(aligned16(&[p, g, mp, vp]) && p16 % 8 == 0, "internal error: adamw views must start 16-byte aligned");
    let runs = adam_runs(segments);
    if runs != gpu.adam_runs {
        let table = gpu.scratch(Scratch::AdamRuns, runs.len().max(3) * 8);
        gpu.dev.upload(table, bytes_of(&runs));
        gpu.adam_runs = runs;
    }
    let table = gpu.scratch[Scratch::AdamRuns as usize].0;
    let mut args = vec![
        Arg::P(p),
        Arg::P(p16),
        Arg::P(g),
        Arg::P(mp),
        Arg::P(vp),
        Arg::P(ns),
        Arg::P(table),
        Arg::I((gpu.adam_runs.len() / 3) as i32),
        Arg::U(n as u64),
    ];
    args.extend(step_args(step));
    gpu.launch_1d("adamw", (n as u64).div_ceil(4), &args);
}

/// The scalar arguments that end both AdamW kernels (`adamw.cu`'s and `fp8.cu`'s `adamw_fp8`):
/// lr, β1, β2, eps, weight decay, the bias-corrected step size, √(bias correction 2), the
/// clipping norm.
pub(super) fn step_args(step: AdamWStep) -> [Arg; 8] {
    let bc1 = 1.0 - (step.beta1 as f64).powi(step.t as i32);
    let bc2 = 1.0 - (step.beta2 as f64).powi(step.t as i32);
    [
        Arg::F(step.lr),
        Arg::F(step.beta1),
        Arg::F(step.beta2),
        Arg::F(step.eps),
        Arg::F(step.weight_decay),
        Arg::F((step.lr as f64 / bc1) as f32),
        Arg::F(bc2.sqrt() as f32),
        Arg::F(step.max_grad_norm),
    ]
}

/// The AdamW kernel's table: `segments` sorted and merged into runs of equal decay, as
/// `(start, end, decay)` triples.
fn adam_runs(segments: &[Segment]) -> Vec<u64> {
    let mut sorted: Vec<&Segment> = segments.iter().filter(|s| s.len > 0).collect();
    sorted.sort_by_key(|s| s.offset);
    let mut runs: Vec<u64> = Vec::new();
    for s in sorted {
        let (start, end, decay) = (s.offset as u64, (s.offset + s.len) as u64, s.decay as u64);
        let n = runs.len();
        if n >= 3 && runs[n - 2] == start && runs[n - 1] == decay {
            runs[n - 2] = end;
        } else {
            assert!(n < 3 || runs[n - 2] <= start, "internal error: overlapping AdamW segments");
            runs.extend([start, end, decay]);
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adam_runs_merge_adjacent_segments_of_equal_decay() {
        let seg = |offset, len, decay| Segment { offset, len, decay };
        let runs =
            adam_runs(&[seg(10, 5, true), seg(0, 10, true), seg(15, 2, false), seg(20, 3, false), seg(17, 3, false)]);
        assert_eq!(runs, vec![0, 15, 1, 15, 23, 0]);
        assert_eq!(adam_runs(&[seg(0, 4, true), seg(6, 2, true)]), vec![0, 4, 1, 6, 8, 1]);
        assert!(adam_runs(&[]).is_empty());
    }
}
