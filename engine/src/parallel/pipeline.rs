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
//! - **Interleaved 1F1B** (Megatron-LM's, `V` virtual stages per device): the model is cut
//!   into `P·V` virtual stages and device `d` holds `d, d + P, d + 2P, …` ([`interleave`]), so
//!   that a micro-batch visits every device `V` times. Each device runs its virtual stages'
//!   passes in groups of `P` micro-batches (forward: virtual stages in order; backward: in
//!   reverse), `2(P − d − 1) + (V − 1)·P` forward passes ahead, then one forward and one
//!   backward, then the rest of the backward passes; `M` must be a multiple of `P`.
//!
//! GPipe and 1F1B leave every device idle for the same share of a step, the bubble
//! `(P − 1) / (M + P − 1)`, when the stages cost the same; the interleaved schedule's passes
//! are `V` times shorter, and its bubble is `(P − 1) / (V·M + P − 1)` ([`bubble_fraction`]).

use crate::backend::{Backend, IdxView, Parts, View};
use crate::config::{ModelConfig, PipelineSchedule};
use crate::model::{Exchange, Model, Pass, Stage, Unit, Window};
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
            let stage =
                Stage { layers: start..start + k, first: s == 0, last: s + 1 == sizes.len(), later: Vec::new() };
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

/// Device `d` of a pipeline of `devices` with the `virtual_stages` (in model order, a multiple
/// of `devices` of them): the stage holding `d, d + P, d + 2P, …` (Megatron-LM's layout), whose
/// later virtual stages' layers are its [`Stage::later`].
pub fn interleave(virtual_stages: &[Stage], devices: usize) -> Vec<Stage> {
    assert!(
        virtual_stages.len().is_multiple_of(devices),
        "internal error: {} virtual stages on {devices} devices",
        virtual_stages.len()
    );
    (0..devices)
        .map(|d| {
            let mine: Vec<&Stage> = virtual_stages.iter().skip(d).step_by(devices).collect();
            Stage {
                layers: mine[0].layers.clone(),
                first: mine[0].first,
                last: mine[mine.len() - 1].last,
                later: mine[1..].iter().map(|s| s.layers.clone()).collect(),
            }
        })
        .collect()
}

/// The passes stage `stage` of `stages` runs in one step of `microbatches` micro-batches, in
/// order, each with the virtual stage it runs on (0 but under the interleaved schedule, over
/// `virtual_stages`). Forward passes come in micro-batch order on each virtual stage, and so do
/// backward passes.
pub fn actions(
    schedule: PipelineSchedule,
    stages: usize,
    stage: usize,
    microbatches: usize,
    virtual_stages: usize,
) -> Vec<(usize, Action)> {
    let m = microbatches;
    let plain = |a: Vec<Action>| a.into_iter().map(|a| (0, a)).collect();
    match schedule {
        PipelineSchedule::GPipe => plain((0..m).map(Action::Forward).chain((0..m).map(Action::Backward)).collect()),
        PipelineSchedule::OneFOneB => {
            let warmup = (stages - stage - 1).min(m);
            let mut out: Vec<Action> = (0..warmup).map(Action::Forward).collect();
            for i in 0..m - warmup {
                out.push(Action::Forward(warmup + i));
                out.push(Action::Backward(i));
            }
            out.extend((m - warmup..m).map(Action::Backward));
            plain(out)
        }
        PipelineSchedule::Interleaved => {
            let (p, v) = (stages, virtual_stages);
            assert!(m.is_multiple_of(p), "internal error: {m} micro-batches on {p} stages");
            // The k-th forward (backward) pass of the device: groups of P micro-batches, each
            // group through the virtual stages in order (in reverse for the backward passes).
            let pass = |k: usize, forward: bool| {
                let (group, within) = (k / (p * v), k % (p * v));
                let chunk = if forward { within / p } else { v - 1 - within / p };
                let mb = group * p + within % p;
                (chunk, if forward { Action::Forward(mb) } else { Action::Backward(mb) })
            };
            let total = m * v;
            let warmup = if m == p { total } else { (2 * (p - stage - 1) + (v - 1) * p).min(total) };
            let mut out: Vec<(usize, Action)> = (0..warmup).map(|k| pass(k, true)).collect();
            for k in 0..total - warmup {
                out.push(pass(warmup + k, true));
                out.push(pass(k, false));
            }
            out.extend((total - warmup..total).map(|k| pass(k, false)));
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

/// One exchange between neighbouring stages: a [`crate::parallel::comm::Collectives::send_recv`]
/// group made before pass `before` of a stage's schedule (after its last pass when `None`),
/// sending the output of each pass of `sends` (a forward pass's activation on, a backward
/// pass's input gradient back) and receiving the input of each pass of `recvs` (indices into
/// the schedule's passes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The pass it precedes; `None`: after the last.
    pub before: Option<usize>,
    /// The passes whose outputs it sends.
    pub sends: Vec<usize>,
    /// The passes whose inputs it receives.
    pub recvs: Vec<usize>,
}

/// The handoffs of stage `stage` of `stages` running `actions`, pass `i` on its virtual stage
/// `chunk_of[i]` of `virtual_stages`.
///
/// A pass's outputs go out with the next handoff, in one group with that handoff's receives,
/// so that two neighbours sending to each other at once (1F1B's steady state) do not wait on
/// each other: before each pass, the sends of the one before and this pass's receives
/// (Megatron-LM's `send_forward_recv_backward` and `send_backward_recv_forward`). That order
/// deadlocks the interleaved schedule where every send waits for its receive (NCCL): there, a
/// forward pass followed by a backward pass, with forward passes still to come, also receives
/// the backward pass's input, and the backward pass's sends wait for the next handoff
/// (Megatron-LM's interleaved steady state, `send_forward_backward_recv_forward_backward`).
/// `handoffs_never_wait_on_each_other` checks every schedule against that rule of sends.
pub fn handoffs(
    actions: &[Action],
    chunk_of: &[usize],
    stage: usize,
    stages: usize,
    virtual_stages: usize,
) -> Vec<Handoff> {
    let last = stages * virtual_stages - 1;
    let place = |i: usize| chunk_of[i] * stages + stage;
    let forward = |i: usize| matches!(actions[i], Action::Forward(_));
    let receives = |i: usize| if forward(i) { place(i) > 0 } else { place(i) < last };
    let sends = |i: usize| if forward(i) { place(i) < last } else { place(i) > 0 };
    // A receive ahead only where forward passes come after the backward pass.
    let last_forward = (0..actions.len()).rev().find(|&i| forward(i));
    let ahead = |i: usize| {
        virtual_stages > 1
            && last_forward.is_some_and(|f| f > i + 1)
            && forward(i)
            && !forward(i + 1)
            && receives(i + 1)
    };
    let mut out = Vec::new();
    let (mut pending, mut received) = (Vec::new(), vec![false; actions.len()]);
    for i in 0..actions.len() {
        if !received[i] {
            let mut recvs: Vec<usize> = receives(i).then_some(i).into_iter().collect();
            if ahead(i) {
                recvs.push(i + 1);
                received[i + 1] = true;
            }
            if !pending.is_empty() || !recvs.is_empty() {
                out.push(Handoff { before: Some(i), sends: std::mem::take(&mut pending), recvs });
            }
        }
        if sends(i) {
            pending.push(i);
        }
    }
    if !pending.is_empty() {
        out.push(Handoff { before: None, sends: pending, recvs: Vec::new() });
    }
    out
}

/// The share of a step each device of a pipeline of `stages` equal stages spends idle with
/// `microbatches` micro-batches: `(P − 1) / (V·M + P − 1)` over `virtual_stages` per device
/// (`V = 1`: GPipe and 1F1B).
pub fn bubble_fraction(stages: usize, microbatches: usize, virtual_stages: usize) -> f64 {
    (stages - 1) as f64 / (virtual_stages * microbatches + stages - 1) as f64
}

/// The models of a device's virtual stages ([`Stage::chunks`]), with its policies: each lays
/// its units out as the device's layout does from the virtual stage's first unit on
/// ([`chunk_offsets`]).
pub fn chunk_models(device: &Model) -> Vec<Model> {
    let experts = &device.layout.experts;
    let layout = |stage: &Stage| crate::model::Layout::stage_with_experts(&device.config, stage, experts.clone());
    let chunk = |stage: Stage| Model { layout: layout(&stage), ..device.clone() };
    device.stage().chunks().into_iter().map(chunk).collect()
}

/// Where each of `chunks` (a device's virtual stages' models) starts in the device's flat
/// buffers, and its first layer among the device's.
pub fn chunk_offsets(chunks: &[Model]) -> Vec<(usize, usize)> {
    let (mut offset, mut layer) = (0, 0);
    chunks
        .iter()
        .map(|c| {
            let at = (offset, layer);
            offset += c.layout.len;
            layer += c.layout.layers.len();
            at
        })
        .collect()
}

/// What a virtual stage's passes exchange: its device's exchange, with the virtual stage's
/// layer `i` the device's `first_layer + i`, and the device's buffers addressed from `offset`
/// (where the virtual stage's units start in the device's layout).
pub struct ChunkExchange<'a, B: Backend> {
    /// The device's exchange.
    pub inner: &'a mut dyn Exchange<B>,
    /// The virtual stage's first layer among the device's.
    pub first_layer: usize,
    /// Where its units start in the device's flat buffers.
    pub offset: usize,
}

impl<B: Backend> ChunkExchange<'_, B> {
    fn unit(&self, unit: Unit) -> Unit {
        match unit {
            Unit::Layer(i) => Unit::Layer(self.first_layer + i),
            u => u,
        }
    }
}

impl<B: Backend> Exchange<B> for ChunkExchange<'_, B> {
    fn adds_residual(&self) -> bool {
        self.inner.adds_residual()
    }
    fn tensor_sum(&mut self, be: &mut B, buf: View) {
        self.inner.tensor_sum(be, buf)
    }
    fn batch_sum(&mut self, be: &mut B, buf: View) {
        self.inner.batch_sum(be, buf)
    }
    fn tensor_rank_for_vocab(&self) -> (usize, usize) {
        self.inner.tensor_rank_for_vocab()
    }
    fn tensor_max_for_vocab(&mut self, be: &mut B, buf: View) {
        self.inner.tensor_max_for_vocab(be, buf)
    }
    fn pass_begins(&mut self, be: &mut B, pass: Pass) {
        self.inner.pass_begins(be, pass)
    }
    fn params_needed(&mut self, be: &mut B, unit: Unit, pass: Pass) -> Option<Window> {
        let unit = self.unit(unit);
        self.inner.params_needed(be, unit, pass).map(|w| w.rebased(self.offset))
    }
    fn params_done(&mut self, be: &mut B, unit: Unit, pass: Pass) {
        let unit = self.unit(unit);
        self.inner.params_done(be, unit, pass)
    }
    fn grads_needed(&mut self, be: &mut B, unit: Unit) -> Option<Window> {
        let unit = self.unit(unit);
        self.inner.grads_needed(be, unit).map(|w| w.rebased(self.offset))
    }
    fn grads_ready(&mut self, be: &mut B, unit: Unit) {
        let unit = self.unit(unit);
        self.inner.grads_ready(be, unit)
    }
    fn seq_gather(&mut self, be: &mut B, local: View, all: View) {
        self.inner.seq_gather(be, local, all)
    }
    fn seq_scatter_sum(&mut self, be: &mut B, all: View, local: View) {
        self.inner.seq_scatter_sum(be, all, local)
    }
    fn expert_rank(&self) -> (usize, usize) {
        self.inner.expert_rank()
    }
    fn expert_exchange(&mut self, be: &mut B, input: View, output: View) {
        self.inner.expert_exchange(be, input, output)
    }
    fn expert_runs(&mut self, be: &mut B, offsets: IdxView, parts: Parts, runs: IdxView) {
        self.inner.expert_runs(be, offsets, parts, runs)
    }
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

    /// Every schedule's handoffs complete where each send waits for its receive (NCCL). Each
    /// stage makes its handoffs in order; one completes once each of its sends and receives
    /// has its match (the k-th message from a device to a neighbour is the k-th that neighbour
    /// receives from it) in the neighbour's handoff under way or done. Each message is also the
    /// one its receiver expects (the same micro-batch, from the virtual stage before for a
    /// forward pass, after for a backward pass), a pass receives before it runs, and it sends
    /// after. Without the interleaved schedule's receive ahead, P = 2, V = 2, M = 4 deadlocks.
    #[test]
    fn handoffs_never_wait_on_each_other() {
        use PipelineSchedule::{GPipe, Interleaved, OneFOneB};
        for (schedule, v) in [(GPipe, 1), (OneFOneB, 1), (Interleaved, 2), (Interleaved, 3), (Interleaved, 4)] {
            for p in [2, 3, 4, 8] {
                for m in (1..=3 * p).filter(|m| v == 1 || m % p == 0) {
                    if let Err(e) = run_handoffs(schedule, p, m, v) {
                        panic!("{schedule:?}, P = {p}, V = {v}, M = {m}: {e}");
                    }
                }
            }
        }
    }

    /// What a message carries: a forward pass's activation (else a gradient), its micro-batch,
    /// its sender's virtual stage.
    type Carried = (bool, usize, usize);
    /// One message of a handoff: sent (else received), the neighbour, what it carries.
    type Message = (bool, usize, Carried);

    fn run_handoffs(schedule: PipelineSchedule, p: usize, m: usize, v: usize) -> anyhow::Result<()> {
        // Per stage, its handoffs as lists of messages.
        use std::collections::HashMap;
        let mut stages: Vec<Vec<Vec<Message>>> = Vec::new();
        for s in 0..p {
            let (chunk_of, acts): (Vec<usize>, Vec<Action>) = actions(schedule, p, s, m, v).into_iter().unzip();
            let place = |i: usize| chunk_of[i] * p + s;
            let (next, prev) = ((s + 1) % p, (s + p - 1) % p);
            let mut groups = Vec::new();
            for h in handoffs(&acts, &chunk_of, s, p, v) {
                let at = h.before.unwrap_or(acts.len());
                let mut group = Vec::new();
                for &i in &h.sends {
                    assert!(i < at, "pass {i} sends before it runs");
                    group.push(match acts[i] {
                        Action::Forward(mb) => (true, next, (true, mb, place(i))),
                        Action::Backward(mb) => (true, prev, (false, mb, place(i))),
                    });
                }
                for &i in &h.recvs {
                    assert!(i >= at, "pass {i} receives after it runs");
                    group.push(match acts[i] {
                        Action::Forward(mb) => (false, prev, (true, mb, place(i) - 1)),
                        Action::Backward(mb) => (false, next, (false, mb, place(i) + 1)),
                    });
                }
                groups.push(group);
            }
            stages.push(groups);
        }
        // Each message numbered among the stage's to (from) that neighbour: the k-th send from
        // s to q is the k-th receive of q from s.
        type Numbered = (bool, usize, usize, Carried);
        let numbered: Vec<Vec<Vec<Numbered>>> = (stages.iter())
            .map(|groups| {
                let mut count = HashMap::new();
                let mut number = |&(send, peer, what): &Message| {
                    let k = count.entry((send, peer)).or_insert(0);
                    *k += 1;
                    (send, peer, *k, what)
                };
                groups.iter().map(|g| g.iter().map(&mut number).collect()).collect()
            })
            .collect();
        // Per stage, by (sent?, neighbour, number): the handoff a message is in, what it carries.
        type Index = HashMap<(bool, usize, usize), (usize, Carried)>;
        let at: Vec<Index> = (numbered.iter())
            .map(|groups| {
                let each = groups.iter().enumerate().flat_map(|(g, group)| group.iter().map(move |m| (g, m)));
                each.map(|(g, &(send, peer, k, what))| ((send, peer, k), (g, what))).collect()
            })
            .collect();
        for (s, groups) in numbered.iter().enumerate() {
            for &(send, peer, k, what) in groups.iter().flatten() {
                match at[peer].get(&(!send, s, k)) {
                    None => anyhow::bail!("stage {s}'s message {what:?} has no match on stage {peer}"),
                    Some(&(_, other)) if send && other != what => {
                        anyhow::bail!("stage {peer} receives {what:?} where it expects {other:?}");
                    }
                    Some(_) => {}
                }
            }
        }
        let mut done = vec![0; p];
        while (0..p).any(|s| done[s] < numbered[s].len()) {
            let mut moved = false;
            for s in 0..p {
                let Some(group) = numbered[s].get(done[s]) else { continue };
                if group.iter().all(|&(send, peer, k, _)| at[peer][&(!send, s, k)].0 <= done[peer]) {
                    done[s] += 1;
                    moved = true;
                }
            }
            if !moved {
                anyhow::bail!("the stages wait on each other after handoffs {done:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn one_f_one_b_bounds_the_micro_batches_in_flight() {
        let (p, m) = (4, 8);
        for s in 0..p {
            for schedule in [PipelineSchedule::OneFOneB, PipelineSchedule::GPipe] {
                let a: Vec<Action> = actions(schedule, p, s, m, 1).into_iter().map(|(_, a)| a).collect();
                assert_eq!(a.len(), 2 * m);
                let (_, n) = slots(&a, m);
                let want = if schedule == PipelineSchedule::GPipe { m } else { p - s };
                assert_eq!(n, want, "{schedule:?} stage {s}");
            }
        }
        use Action::{Backward as B, Forward as F};
        let plain = |s| actions(PipelineSchedule::OneFOneB, 2, s, 3, 1).into_iter().map(|(_, a)| a).collect::<Vec<_>>();
        assert_eq!(plain(0), vec![F(0), F(1), B(0), F(2), B(1), B(2)]);
        assert_eq!(plain(1), vec![F(0), B(0), F(1), B(1), F(2), B(2)]);
        assert!((bubble_fraction(4, 8, 1) - 3.0 / 11.0).abs() < 1e-12);
        assert!((bubble_fraction(4, 8, 2) - 3.0 / 19.0).abs() < 1e-12);
        assert_eq!(bubble_fraction(1, 4, 1), 0.0);
    }

    /// Megatron-LM's interleaved order on 2 devices, 2 virtual stages, 4 micro-batches, and the
    /// layout of the virtual stages on the devices.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a device's one later virtual stage
    fn interleaved_order_and_layout_are_megatrons() {
        use Action::{Backward as B, Forward as F};
        let a = actions(PipelineSchedule::Interleaved, 2, 0, 4, 2);
        #[rustfmt::skip]
        let want = vec![
            (0, F(0)), (0, F(1)), (1, F(0)), (1, F(1)),
            (0, F(2)), (1, B(0)), (0, F(3)), (1, B(1)), (1, F(2)), (0, B(0)), (1, F(3)), (0, B(1)),
            (1, B(2)), (1, B(3)), (0, B(2)), (0, B(3)),
        ];
        assert_eq!(a, want);
        let m = model("model.n_layers=8 model.vocab_size=64");
        let virtual_stages = from_sizes(&[2; 4]);
        let devices = interleave(&virtual_stages, 2);
        assert_eq!((devices[0].layers.clone(), devices[0].later.clone()), (0..2, vec![4..6]));
        assert_eq!((devices[1].layers.clone(), devices[1].later.clone()), (2..4, vec![6..8]));
        assert!(devices[0].first && !devices[0].last && !devices[1].first && devices[1].last);
        // The virtual stages' layouts are the device's, cut where each starts.
        let device = Model::for_stage(&m, &devices[1]);
        let chunks = chunk_models(&device);
        assert_eq!(chunk_offsets(&chunks), vec![(0, 0), (chunks[0].layout.len, 2)]);
        let names = |l: &crate::model::Layout| l.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&device.layout), [names(&chunks[0].layout), names(&chunks[1].layout)].concat());
        assert_eq!(device.layout.len, chunks[0].layout.len + chunks[1].layout.len);
        assert!(!chunks[0].stage().last && chunks[1].stage().last);
    }

    /// The activations each device keeps (the virtual stages' slots together) against
    /// Megatron-LM's count, `2(P − d − 1) + (V − 1)·P + 1` virtual-stage micro-batches at once
    /// on device `d`. The trainer keeps each virtual stage's own slots (the most micro-batches
    /// in flight on it), which add up to more than that where the virtual stages' peaks fall
    /// at different times (12 against 9 on device 1 of P 4, V 2, M 8).
    #[test]
    fn interleaved_slots_against_megatrons_count() {
        for (p, v, m) in [(2, 2, 4), (4, 2, 8), (4, 2, 16), (2, 4, 8)] {
            for d in 0..p {
                let a = actions(PipelineSchedule::Interleaved, p, d, m, v);
                let mut at_once: usize = 0;
                let mut most = 0;
                for (_, x) in &a {
                    if let Action::Forward(_) = x {
                        at_once += 1
                    } else {
                        at_once -= 1
                    }
                    most = most.max(at_once);
                }
                assert_eq!(most, (2 * (p - d - 1) + (v - 1) * p + 1).min(m * v), "P {p} V {v} M {m} device {d}");
                let kept: usize = (0..v)
                    .map(|c| {
                        let mine: Vec<Action> = a.iter().filter(|(k, _)| *k == c).map(|&(_, x)| x).collect();
                        slots(&mine, m).1
                    })
                    .sum();
                if (p, v, m, d) == (4, 2, 8, 1) {
                    assert_eq!((kept, most), (12, 9));
                }
                assert!(kept >= most, "P {p} V {v} M {m} device {d}: {kept} slots, {most} at once");
            }
        }
    }
}
