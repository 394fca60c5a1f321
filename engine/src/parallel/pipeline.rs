//! Pipeline parallelism: the layers split into stages, and the order in which each stage runs
//! its micro-batches' forward and backward passes.
//!
//! A stage is a contiguous run of layers ([`Stage`]); the first also holds the embedding, the
//! last the final norm, the output head and the loss. [`split`] balances the stages by cost
//! ([`super::plan::ParallelPlan`] holds the stages of a run, however they were split).
//! Each step's batch is cut into `M` micro-batches; a stage receives each micro-batch's input
//! from the stage before, runs its layers and sends the output on, and in the backward pass
//! receives its output's gradient from the next stage and sends its input's gradient back
//! ([`crate::parallel::comm::Collectives::send_recv`]). [`actions`] is the order:
//!
//! - **GPipe**: every forward pass, then every backward pass; all `M` micro-batches are in
//!   flight at once (their activations kept).
//! - **1F1B** (PipeDream-Flush, Megatron-LM's default): stage `s` of `P` runs `P − s − 1`
//!   forward passes ahead, then alternates one forward and one backward pass, then finishes the
//!   backward passes: at most `P − s` micro-batches in flight on it.
//!
//! Both leave every device idle for the same share of a step, the bubble
//! `(P − 1) / (M + P − 1)` ([`bubble_fraction`]), when the stages cost the same.

use crate::config::{ModelConfig, PipelineSchedule};
use crate::model::Stage;

/// One pass of one micro-batch on a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The forward pass of micro-batch `m`.
    Forward(usize),
    /// The backward pass of micro-batch `m`.
    Backward(usize),
}

/// The relative cost of a layer and of the head, per token: the weights a token multiplies by
/// (for a mixture of experts, the router and `top_k` experts; for a GPT, its two MLP matrices).
fn costs(m: &ModelConfig) -> (u64, u64) {
    (m.layer_matmul_params_active(), m.d_model as u64 * m.vocab_size as u64)
}

/// Contiguous stages of `sizes[s]` layers each.
pub(crate) fn from_sizes(sizes: &[usize]) -> Vec<Stage> {
    let mut start = 0;
    sizes
        .iter()
        .enumerate()
        .map(|(s, &k)| {
            let stage = Stage { layers: start..start + k, first: s == 0, last: s + 1 == sizes.len() };
            start += k;
            stage
        })
        .collect()
}

/// Splits the layers of `m` into `stages` contiguous stages, each of at least one layer, that
/// minimise the costliest stage's cost (layers, plus the head on the last; the embedding is a
/// lookup). The caller has checked `stages <= n_layers` ([`super::mesh::Mesh::check_model`]).
pub fn split(m: &ModelConfig, stages: usize) -> Vec<Stage> {
    let n = m.n_layers;
    assert!((1..=n).contains(&stages), "internal error: {stages} stages of {n} layers");
    let (layer, head) = costs(m);
    let cost = |i: usize| layer + if i + 1 == n { head } else { 0 };
    // The stages' sizes for the least bound on a stage's cost that a greedy packing meets.
    let pack = |bound: u64| -> Option<Vec<usize>> {
        let mut sizes = Vec::with_capacity(stages);
        let (mut i, mut load, mut size) = (0, 0, 0);
        while i < n {
            let stages_after = stages - sizes.len() - 1;
            let must_close = n - i == stages_after && size > 0;
            if size > 0 && (load + cost(i) > bound || must_close) {
                sizes.push(size);
                (load, size) = (0, 0);
                if sizes.len() == stages {
                    return None;
                }
                continue;
            }
            if cost(i) > bound {
                return None;
            }
            load += cost(i);
            size += 1;
            i += 1;
        }
        sizes.push(size);
        (sizes.len() == stages).then_some(sizes)
    };
    let (mut lo, mut hi) = ((0..n).map(cost).max().unwrap_or(0), (0..n).map(cost).sum::<u64>());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pack(mid).is_some() { hi = mid } else { lo = mid + 1 }
    }
    from_sizes(&pack(lo).expect("the total cost bounds every stage"))
}

/// The passes stage `stage` of `stages` runs in one step of `microbatches` micro-batches, in
/// order. Forward passes come in micro-batch order, and so do backward passes.
pub fn actions(schedule: PipelineSchedule, stages: usize, stage: usize, microbatches: usize) -> Vec<Action> {
    let m = microbatches;
    match schedule {
        PipelineSchedule::GPipe => (0..m).map(Action::Forward).chain((0..m).map(Action::Backward)).collect(),
        PipelineSchedule::OneFOneB => {
            let warmup = (stages - stage - 1).min(m);
            let mut out: Vec<Action> = (0..warmup).map(Action::Forward).collect();
            for i in 0..m - warmup {
                out.push(Action::Forward(warmup + i));
                out.push(Action::Backward(i));
            }
            out.extend((m - warmup..m).map(Action::Backward));
            out
        }
    }
}

/// The activation slot each micro-batch of `actions` uses (a free one at its forward pass,
/// given back after its backward pass), and how many slots the stage needs: the most
/// micro-batches in flight at once.
pub fn slots(actions: &[Action], microbatches: usize) -> (Vec<usize>, usize) {
    let mut slot = vec![0; microbatches];
    let mut free: Vec<bool> = Vec::new();
    for a in actions {
        match *a {
            Action::Forward(m) => {
                let k = free.iter().position(|&f| f).unwrap_or_else(|| {
                    free.push(true);
                    free.len() - 1
                });
                free[k] = false;
                slot[m] = k;
            }
            Action::Backward(m) => free[slot[m]] = true,
        }
    }
    (slot, free.len())
}

/// The share of a step each device of a pipeline of `stages` equal stages spends idle under
/// GPipe or 1F1B with `microbatches` micro-batches: `(P − 1) / (M + P − 1)`.
pub fn bubble_fraction(stages: usize, microbatches: usize) -> f64 {
    (stages - 1) as f64 / (microbatches + stages - 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::recipe::{Override, resolve};

    fn model(sets: &str) -> ModelConfig {
        resolve("tiny-llama2", &Override::from_list(sets, "test")).unwrap().config.model
    }

    #[test]
    fn stages_are_contiguous_cover_every_layer_and_balance_the_head() {
        // A small vocabulary: the head costs less than a layer, so 5 layers go 3 + 2.
        let m = model("model.n_layers=5 model.vocab_size=64");
        let s = split(&m, 2);
        assert_eq!(s.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(), vec![0..3, 3..5]);
        assert!(s[0].first && !s[0].last && !s[1].first && s[1].last);
        // A head as costly as several layers leaves the last stage fewer layers.
        let wide = model("model.n_layers=6 model.vocab_size=65536");
        let s = split(&wide, 2);
        assert!(s[1].layers.len() < s[0].layers.len(), "{s:?}");
        // One layer per stage at most stages.
        let s = split(&m, 5);
        assert!(s.iter().enumerate().all(|(i, s)| s.layers == (i..i + 1)));
        assert_eq!(split(&m, 1), vec![Stage::whole(5)]);
    }

    #[test]
    fn one_f_one_b_bounds_the_micro_batches_in_flight() {
        let (p, m) = (4, 8);
        for s in 0..p {
            for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::GPipe] {
                let a = actions(schedule, p, s, m);
                assert_eq!(a.len(), 2 * m);
                let (_, n) = slots(&a, m);
                let want = if schedule == PipelineSchedule::GPipe { m } else { p - s };
                assert_eq!(n, want, "{schedule:?} stage {s}");
            }
        }
        use Action::{Backward as B, Forward as F};
        assert_eq!(actions(PipelineSchedule::OneFOneB, 2, 0, 3), vec![F(0), F(1), B(0), F(2), B(1), B(2)]);
        assert_eq!(actions(PipelineSchedule::OneFOneB, 2, 1, 3), vec![F(0), B(0), F(1), B(1), F(2), B(2)]);
        assert!((bubble_fraction(4, 8) - 3.0 / 11.0).abs() < 1e-12);
        assert_eq!(bubble_fraction(1, 4), 0.0);
    }
}
