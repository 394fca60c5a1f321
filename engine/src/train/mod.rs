//! The training loop: batches from the loader, forward, loss, backward, the optimizer, metrics.
//!
//! One optimizer step accumulates `train.grad_accum` micro-batches of `train.batch_size`
//! sequences, each cut into `train.pipeline_microbatches` pipeline micro-batches that the
//! stages run in the order of the schedule ([`crate::parallel::pipeline`]; one device is the
//! pipeline of one stage). The objective is the mean next-token cross-entropy over all the
//! step's tokens, plus `aux_loss_coef` times the load-balancing loss (averaged over
//! micro-batches) for mixture-of-experts models.

pub mod checkpointer;
pub mod devices;
pub mod goodput;
pub mod local_saver;
pub mod local_tier;
pub mod logger;
pub mod metrics;
pub mod run_dir;
pub mod session;
pub mod signals;
pub mod step_times;
pub mod stragglers;
pub mod tensorboard;

use std::time::Instant;

use anyhow::{Result, bail};

use crate::backend::fp8::WeightCast;
use crate::backend::{AttnNeeds, Backend, BufKind, IdxView, View};
use crate::checkpoint::Checkpoint;
use crate::checkpoint::Progress;
use crate::checkpoint::sharded::{DeviceState, Part};
use crate::config::Config;
use crate::data::{self, Loader};
use crate::model::{GRAD_NORM_SQ, LOSS_ACCUM, LOSS_SUM, Model, Plan, init};
use crate::optim::{self, Optimizer};
use crate::parallel::comm::{Collectives, Solo};
use crate::parallel::mesh::Axis;
use crate::parallel::pipeline::{self, Action, ChunkExchange};
use crate::parallel::plan::{ParallelPlan, Schedule};
use crate::parallel::strategies::{FsdpOptions, Parallel};
use crate::parallel::tensor::TensorSlice;
pub use metrics::StepMetrics;

/// A model being trained on a backend, with its optimizer state and data.
///
/// Every trainer is one device of a mesh: a run on one device is a mesh of one, whose
/// collectives ([`Solo`]) leave the data where it is, so there is one training path.
pub struct Trainer<B: Backend> {
    /// The device the passes run on.
    pub backend: B,
    /// The model this device holds: the whole model, or its tensor-parallel slice.
    pub model: Model,
    /// Device memory of a micro-batch's forward and backward pass (the first activation slot).
    pub plan: Plan,
    /// The run's parallel plan: its mesh, stages, schedules and batch.
    pub parallel_plan: ParallelPlan,
    /// This stage's virtual stages (interleaved 1F1B; else the stage itself), each with the
    /// other activation slots of its micro-batches in flight, sharing `plan`'s parameters and
    /// gradients.
    chunks: Vec<Chunk>,
    /// This stage's passes in one step, the virtual stage and activation slot of each, and
    /// when their inputs and outputs go to and from the neighbouring stages.
    schedule: Schedule,
    /// The pipeline offsets of the devices before and after this one, wrapping round under
    /// interleaved 1F1B (the last device's virtual stage sends to the first device's next).
    around: (isize, isize),
    /// The tokens and targets of each micro-batch, from its first virtual stage's forward pass
    /// (which reads the batch) until its last's (which computes the loss; every virtual stage
    /// reads the tokens, for document masking's bounds); interleaved 1F1B only.
    stashed: Vec<[Vec<u32>; 2]>,
    /// The last step's time in forward and backward passes, and from its start until every
    /// stage had finished its schedule (the squared gradient norm summed over the stages):
    /// the pipeline's busy time and its span, whose difference is the idle time.
    pub pass_times: (std::time::Duration, std::time::Duration),
    /// A fault injected to show that the pipeline tests can fail.
    #[cfg(test)]
    pub(crate) fault: Option<Fault>,
    /// The configuration being trained.
    pub config: Config,
    /// This device's stream of training and validation samples.
    pub loader: Loader,
    /// Optimizer steps completed.
    pub step: u64,
    /// The optimizer's two state buffers, laid out like its parameters
    /// ([`Parallel::optimizer_buffers`]): AdamW's first and second moments; under Muon, its
    /// matrices' momentum in the first ([`crate::optim`]).
    pub moments: (View, View),
    /// Which update each part of the optimizer's buffers takes.
    optimizer: Optimizer,
    /// This device's place in the run: its mesh coordinates, collectives and shards.
    pub parallel: Parallel<B>,
    /// The loader's sequences, whole; on a seq axis each device uploads its chunks of them.
    tokens: Vec<u32>,
    targets: Vec<u32>,
    /// The chunks of `tokens` this device keeps, on a seq axis.
    local: Vec<u32>,
    /// The positions in its sequence of each row of a plan's sequence: the two chunks this
    /// device keeps on a seq axis (empty without one: every row).
    chunk_positions: Vec<usize>,
    flops_per_token: f64,
    /// The FP8 weights whose casts the optimizer writes ([`Model::fp8_weight_copies`]), and
    /// whether the weights changed since they were last written (the passes must not read them
    /// before [`Trainer::refresh_weight_casts`]).
    weight_casts: Vec<WeightCast>,
    casts_stale: bool,
}

impl<B: Backend> Trainer<B> {
    /// A trainer on one device: plans device memory, initialises the parameters from the seed
    /// and opens the data.
    pub fn new(backend: B, config: &Config) -> Result<Trainer<B>> {
        Trainer::new_parallel(backend, config, Box::new(Solo), ParallelPlan::single(config)?)
    }

    /// A trainer for one device of a run on `plan`'s mesh, talking to the others through `comm`
    /// (whose rank says which device this is). The plan is `config`'s, checked
    /// ([`ParallelPlan::new`]). Every device starts from the single-device initialisation's
    /// values for its slice.
    pub fn new_parallel(
        mut backend: B,
        config: &Config,
        comm: Box<dyn Collectives<B> + Send>,
        parallel_plan: ParallelPlan,
    ) -> Result<Trainer<B>> {
        let t = &config.train;
        let data = data::open_data(&config.data, config.model.vocab_size, t.seed)?;
        let mesh = parallel_plan.mesh;
        let tensor = mesh.size(Axis::Tensor);
        let coords = mesh.coords(comm.rank());
        let stage = parallel_plan.stages[coords.pipeline].clone();
        let mut model = parallel_plan.device_model(config, comm.rank());
        // On a seq axis each device keeps two chunks of every sequence.
        model.seq.rank = coords.seq;
        model.documents = crate::model::Documents::of(&config.data)?;
        if model.seq.ranks > 1 {
            let chunk = config.train.seq_len / (2 * model.seq.ranks);
            match backend.seq_chunk_multiple() {
                None => bail!(
                    "mesh.ici_seq x mesh.dcn_seq = {}: {}'s attention kernels do not take the sequence axis's chunks; set both to 1",
                    model.seq.ranks,
                    backend.describe()
                ),
                Some(k) if !chunk.is_multiple_of(k) => bail!(
                    "train.seq_len = {} over mesh.ici_seq x mesh.dcn_seq = {} gives chunks of {chunk} tokens (two a device); {}'s attention kernels need a multiple of {k}: make train.seq_len a multiple of {}",
                    config.train.seq_len,
                    model.seq.ranks,
                    backend.describe(),
                    2 * k * model.seq.ranks
                ),
                Some(_) => {}
            }
        }
        let seq_len = parallel_plan.local_seq_len(config);
        // The devices of a tensor group and of a pipeline share their samples, cut into the
        // pipeline's micro-batches.
        let batch = parallel_plan.microbatch;
        // The attention kernels, chosen (and checked) before any buffer is planned.
        let needs = AttnNeeds {
            documents: model.documents.is_some(),
            seq_split: model.seq.ranks > 1,
            sinks: model.config.family == crate::config::Family::GptOss,
            logit_max: model.logit_max,
        };
        backend.select_attention(t.attention, model.attn_shape(0, batch, seq_len), needs)?;
        if model.fp8.is_some() && !backend.supports_fp8() {
            bail!(
                "train.precision = \"fp8\": {} has no FP8 products (GPUs need compute capability 8.9 or newer: Ada, Hopper, Blackwell); set train.precision = \"bf16\"",
                backend.describe()
            );
        }
        let schedule = parallel_plan.schedules[coords.pipeline].clone();
        // Under FSDP no device holds the whole model: the passes borrow each unit's buffers.
        let flat = !Parallel::<B>::shards_model(&mesh);
        let (plan, chunks) = plan_chunks(&model, &mut backend, (batch, seq_len), flat, &schedule.chunk_in_flight);
        let (d, stages) = (coords.pipeline, mesh.size(Axis::Pipeline) as isize);
        let around = (if d > 0 { -1 } else { stages - 1 }, if (d as isize) + 1 < stages { 1 } else { 1 - stages });
        let stashed = vec![Default::default(); if chunks.len() > 1 { t.pipeline_microbatches } else { 0 }];
        let held = model.layout.experts.clone();
        let slice = TensorSlice::of_stage(&config.model, &stage, coords.tensor, tensor, held);
        let global = slice.global.clone();
        let fsdp = FsdpOptions::of(&config.mesh);
        let casts = model.fp8_cast_weights(plan.batch * plan.seq, Some(&plan));
        let mut parallel = Parallel::new(&mut backend, comm, mesh, slice, (plan.params, plan.grads), (fsdp, &casts));
        if let Some(moe) = &config.model.moe {
            parallel.join_experts(&mut backend, moe.num_experts);
        }
        let std = config.model.init_std as f32;
        parallel.upload_params(&mut backend, |g, out| init::tensor(&global.tensors[g], g, t.seed, std, out));
        let (rank, ranks) = parallel.batch_rank();
        let loader = Loader::open(data, t.seq_len, t.seed, rank, ranks)?;
        let moment_len = parallel.moment_len();
        let moments = (backend.alloc(BufKind::OptState, moment_len), backend.alloc(BufKind::OptState, moment_len));
        let optimizer = Optimizer::new(&mut backend, &parallel, &config.optim)?;
        let weight_casts = model.fp8_weight_casts(&plan);
        assert!(
            weight_casts.is_empty() || parallel.optimizer_buffers().0 == plan.params,
            "internal error: FP8 weight casts written by an optimizer that does not update the passes' parameters"
        );
        let n = plan.batch * t.seq_len;
        let chunk_positions = if model.seq.ranks > 1 { model.seq.positions(seq_len) } else { Vec::new() };
        Ok(Trainer {
            backend,
            flops_per_token: config.model.train_flops_per_token(t.seq_len),
            model,
            plan,
            chunks,
            schedule,
            around,
            stashed,
            parallel_plan,
            pass_times: Default::default(),
            #[cfg(test)]
            fault: None,
            config: config.clone(),
            loader,
            step: 0,
            moments,
            optimizer,
            parallel,
            tokens: vec![0; n],
            targets: vec![0; n],
            local: Vec::new(),
            chunk_positions,
            weight_casts,
            casts_stale: true,
        })
    }

    /// Devices of the run.
    pub fn devices(&self) -> usize {
        self.parallel.mesh.devices()
    }

    /// Tokens one optimizer step processes, all devices together (the global batch is
    /// `train.batch_size` × devices sequences per micro-batch).
    pub fn tokens_per_step(&self) -> usize {
        let t = &self.config.train;
        self.parallel_plan.global_sequences() * t.seq_len * t.grad_accum
    }

    /// The share of a step each device of the pipeline is idle, by the schedule (0 on one
    /// stage).
    pub fn bubble_fraction(&self) -> f64 {
        self.parallel_plan.bubble_fraction()
    }

    /// Training FLOPs of one optimizer step per device.
    pub fn flops_per_step(&self) -> f64 {
        self.flops_per_token * self.tokens_per_step() as f64 / self.devices() as f64
    }

    /// Runs one optimizer step and reports it; `peak_tflops` is the device's peak for MFU.
    ///
    /// A step whose loss or gradient norm is not finite is not applied (the parameters, moments
    /// and step count stay as they were, the gradients are cleared) and is reported with
    /// [`StepMetrics::applied`] false: the run stops there rather than train on from a diverged
    /// model or save one.
    ///
    /// The host waits for the device once per step, to read the loss and gradient norm (and,
    /// for mixture-of-experts models, once per micro-batch for the load-balancing statistics).
    ///
    /// Each `grad_accum` round runs this stage's schedule over the pipeline's micro-batches
    /// ([`crate::parallel::pipeline::actions`]): a forward pass receives its input from the
    /// stage before (unless first) and sends its output on (unless last); a backward pass
    /// receives its output's gradient (unless last) and sends its input's back (unless first).
    /// On one device, or on devices whose collectives can be recorded with their work and no
    /// pipeline, each micro-batch's forward and backward pass is one [`Backend::begin_section`]:
    /// the same ops on the same buffers every time, which the CUDA backend records once as a
    /// graph.
    pub fn train_step(&mut self, peak_tflops: f64) -> StepMetrics {
        let start = Instant::now();
        self.refresh_weight_casts();
        self.parallel.set_step(self.step + 1);
        if let Some(delay) = stragglers::test_delay(self.parallel.rank) {
            std::thread::sleep(delay);
        }
        let c = &self.config;
        let (accum, microbatches) = (c.train.grad_accum, c.train.pipeline_microbatches);
        let (tokens, shards) = ((self.plan.batch * self.plan.seq) as f32, self.model.batch_shards);
        let weight = 1.0 / (accum * microbatches) as f32;
        let aux_scale = self.model.aux_scale(&self.plan, weight);
        // The load-balancing loss and the dropped share, summed over the micro-batches.
        let (mut aux_sum, mut dropped_sum, mut load_sum) = (0f64, 0f64, 0f64);
        self.backend.fill(self.plan.scalars.at(LOSS_ACCUM, 1), 0.0);
        if let Some(maxima) = self.plan.logit_max {
            self.backend.fill(maxima, f32::NEG_INFINITY);
        }
        // Collectives inside a recorded section are recorded with it where the communicator
        // allows (the virtual devices': host calls in the stream); a pipeline's handoffs lie
        // between passes, so its stages record none.
        let graphs = c.train.cuda_graphs
            && (self.parallel.mesh.devices() == 1
                || (self.parallel.captures_sections() && self.parallel.stages() == 1));
        let seq_len = c.train.seq_len;
        let grad_scale = weight / tokens / shards as f32;
        let mut busy = std::time::Duration::ZERO;
        let mut data_wait = std::time::Duration::ZERO;
        for round in 0..accum {
            let mut next_handoff = 0;
            let mut i = 0;
            while i < self.schedule.actions.len() {
                while self.schedule.handoffs.get(next_handoff).is_some_and(|h| h.before == Some(i)) {
                    self.hand_off(next_handoff);
                    next_handoff += 1;
                }
                let (action, v) = (self.schedule.actions[i], self.schedule.chunk_of[i]);
                let (Action::Forward(mb) | Action::Backward(mb)) = action;
                let k = self.schedule.slot_of[v][mb];
                let p = slot(&self.plan, &self.chunks, v, k);
                let chunk = &self.chunks[v];
                let stage = chunk.model.stage();
                let (be, par) = (&mut self.backend, &mut self.parallel);
                match action {
                    Action::Forward(_) => {
                        // The first virtual stage reads the batch; every one takes its tokens (the
                        // embedding, document masking), the last its targets.
                        let rows = (&self.chunk_positions[..], seq_len);
                        let last_chunk = v + 1 == self.chunks.len();
                        if v == 0 {
                            let waited = Instant::now();
                            self.loader.next_batch(&mut self.tokens, &mut self.targets);
                            data_wait += waited.elapsed();
                            if !last_chunk {
                                self.stashed[mb][0].clone_from(&self.tokens);
                                self.stashed[mb][1].clone_from(&self.targets);
                            }
                        }
                        let [tokens, targets] = match v {
                            0 => [&self.tokens, &self.targets],
                            _ => [&self.stashed[mb][0], &self.stashed[mb][1]],
                        };
                        #[cfg(test)]
                        let tokens = &local_documents_only(self.fault, tokens, rows, self.model.documents);
                        upload_tokens(be, p, tokens, rows, &mut self.local);
                        if last_chunk {
                            upload_chunks(be, p.targets, targets, rows, &mut self.local);
                        }
                        // One device: the micro-batch's forward and backward pass as one
                        // recorded section (no handoffs: a single stage).
                        let fused = graphs && self.schedule.actions.get(i + 1) == Some(&Action::Backward(mb));
                        if fused {
                            debug_assert!(
                                self.schedule.handoffs.is_empty(),
                                "internal error: handoffs of a fused pass"
                            );
                            par.sync = round + 1 == accum && mb + 1 == microbatches;
                            // The micro-batch that ends the step reduces its gradients over the
                            // devices: other work, another section.
                            let section = SECTION_MICRO_BATCH + u32::from(par.sync);
                            let passes = Instant::now();
                            if be.begin_section(section) {
                                chunk.model.forward(be, p, Some(grad_scale), &mut chunk.exchange(par));
                                chunk.model.backward(be, p, aux_scale, &mut chunk.exchange(par));
                                be.add(self.plan.scalars.at(LOSS_ACCUM, 1), p.scalars.at(LOSS_SUM, 1));
                                be.end_section(section);
                            }
                            busy += passes.elapsed();
                            let router = self.model.router_stats(be, p);
                            (aux_sum, dropped_sum) = (aux_sum + router.aux_loss, dropped_sum + router.dropped);
                            load_sum += router.max_load;
                            i += 2;
                            continue;
                        }
                        let passes = Instant::now();
                        chunk.model.forward(be, p, Some(grad_scale), &mut chunk.exchange(par));
                        busy += passes.elapsed();
                        if stage.last {
                            be.add(self.plan.scalars.at(LOSS_ACCUM, 1), p.scalars.at(LOSS_SUM, 1));
                            let router = self.model.router_stats(be, p);
                            (aux_sum, dropped_sum) = (aux_sum + router.aux_loss, dropped_sum + router.dropped);
                            load_sum += router.max_load;
                        }
                    }
                    Action::Backward(_) => {
                        #[cfg(test)]
                        if self.fault == Some(Fault::DropGradient) && mb == 1 && !stage.last {
                            be.fill(p.residual_grad(), 0.0);
                        }
                        par.sync = round + 1 == accum && mb + 1 == microbatches;
                        let passes = Instant::now();
                        chunk.model.backward(be, p, aux_scale, &mut chunk.exchange(par));
                        busy += passes.elapsed();
                    }
                }
                i += 1;
            }
            for h in next_handoff..self.schedule.handoffs.len() {
                self.hand_off(h);
            }
        }

        let (p, be, par) = (&self.plan, &mut self.backend, &mut self.parallel);
        let c = &self.config;
        let total_steps = c.train.steps;
        let rates = optim::rates(&c.optim, total_steps, self.step as usize);
        let norm_sq = p.scalars.at(GRAD_NORM_SQ, 1);
        let balancing = c.model.moe.as_ref().map(|moe| moe.bias_update_rate as f32).filter(|&r| r > 0.0);
        if balancing.is_some() {
            par.take_load_excess(be);
        }
        par.grad_norm_squared(be, norm_sq);
        self.pass_times = (busy, start.elapsed());
        par.sum_over_batch(be, p.scalars.at(LOSS_ACCUM, 1));
        // The last stage computed the loss (and the load-balancing loss); the others hold 0.
        par.sum_over_pipeline(be, p.scalars.at(LOSS_ACCUM, 1));
        if c.model.moe.is_some() && par.stages() > 1 {
            let spare = p.scalars.at(3, 1);
            for sum in [&mut aux_sum, &mut dropped_sum, &mut load_sum] {
                be.upload(spare, &[*sum as f32]);
                par.sum_over_pipeline(be, spare);
                *sum = read_scalar(be, spare);
            }
        }
        // The loss and the norm are the same on every device now: all of them decide alike.
        let mut scalars = [0f32; 4];
        be.download(p.scalars, &mut scalars);
        let (loss_sum, grad_norm) = (scalars[LOSS_ACCUM] as f64, (scalars[GRAD_NORM_SQ] as f64).sqrt());
        let diverged = !loss_sum.is_finite() || !grad_norm.is_finite();
        let mut clipped = None;
        if diverged {
            // Never applied: the parameters and moments stay those of the last finite step.
            be.fill(par.optimizer_buffers().1, 0.0);
            par.balance_selection_biases(be, None);
        } else {
            if let Some(f) = p.fp8 {
                // Every replica records the same amaxes, then scales alike (Transformer
                // Engine's amax reduction). Before the update: the weights' casts it writes take
                // the next step's scales.
                par.max_over_batch(be, f.states);
                f.step_done(be);
            }
            // QK-clip rescales q/k rows after the update: their casts are taken afterwards.
            let casts = if c.optim.qk_clip > 0.0 { &[][..] } else { &self.weight_casts[..] };
            let wrote = self.optimizer.step(be, par, self.moments, norm_sq, &c.optim, rates, self.step + 1, casts);
            self.casts_stale = !self.weight_casts.is_empty() && !wrote;
            clipped = p.logit_max.map(|maxima| optim::qk_clip::apply(be, par, maxima, &c.model, &c.optim));
            par.balance_selection_biases(be, balancing);
            self.step += 1;
        }
        par.after_step(be);

        let step_time_s = start.elapsed().as_secs_f64();
        let tflops = self.flops_per_step() / step_time_s / 1e12;
        StepMetrics {
            step: self.step + diverged as u64,
            applied: !diverged,
            loss: loss_sum / (tokens as f64 * (accum * microbatches * shards) as f64),
            aux_loss: (self.config.model.moe.as_ref())
                .filter(|moe| moe.has_aux_loss())
                .map(|_| aux_sum / (accum * microbatches) as f64),
            dropped_fraction: (self.config.model.moe.as_ref())
                .and_then(|moe| moe.capacity_factor)
                .map(|_| dropped_sum / (accum * microbatches) as f64),
            expert_load: self.config.model.moe.as_ref().map(|_| load_sum / (accum * microbatches) as f64),
            max_logit: clipped.map(|c| c.max_logit),
            clipped_heads: clipped.map(|c| c.heads),
            lr: rates.adamw,
            grad_norm,
            step_time_s,
            data_s: data_wait.as_secs_f64(),
            tokens_per_s: self.tokens_per_step() as f64 / step_time_s,
            tflops_per_device: tflops,
            mfu: if peak_tflops > 0.0 { tflops / peak_tflops } else { 0.0 },
            eval_loss: None,
            tokens_by_source: self.loader.tokens_by_source(),
            checkpoint_s: None,
            slowest_rank: None,
            slowest_step_time_s: None,
            local_checkpoint_s: None,
            local_checkpoint_write_s: None,
            straggler: None,
        }
    }

    /// Makes handoff `h` of this stage's schedule ([`pipeline::handoffs`]): one group of
    /// sends and receives with the neighbouring stages. A forward pass receives its input from
    /// the stage before and sends its output on; a backward pass receives its output's gradient
    /// from the stage after and sends its input's back; the routing statistics of a mixture of
    /// experts travel with both.
    fn hand_off(&mut self, h: usize) {
        let moe = self.config.model.moe.is_some();
        let (prev, next) = (self.parallel.neighbour(self.around.0), self.parallel.neighbour(self.around.1));
        let s = &self.schedule;
        let mut sends = Vec::new();
        for &i in &s.handoffs[h].sends {
            let p = self.pass_plan(i);
            let (out, to) = match s.actions[i] {
                Action::Forward(_) => (p.stage_output(), next),
                Action::Backward(_) => (p.residual_grad(), prev),
            };
            #[cfg(test)]
            let out = match (s.actions[i], s.chunk_of[i]) {
                (Action::Forward(1), v)
                    if self.fault == Some(Fault::StaleActivation) && s.slot_of[v][0] != s.slot_of[v][1] =>
                {
                    slot(&self.plan, &self.chunks, v, s.slot_of[v][0]).stage_output()
                }
                _ => out,
            };
            sends.push((out, to));
            if moe {
                sends.push((p.moe_stats(), to));
            }
        }
        let mut recvs = Vec::new();
        for &i in &s.handoffs[h].recvs {
            let p = self.pass_plan(i);
            let (into, from) = match s.actions[i] {
                Action::Forward(_) => (p.stage_input(), prev),
                Action::Backward(_) => (p.residual_grad(), next),
            };
            recvs.push((into, from));
            if moe {
                recvs.push((p.moe_stats(), from));
            }
        }
        self.parallel.send_recv(&mut self.backend, &sends, &recvs);
    }

    /// The activation slot pass `i` of the schedule runs in.
    fn pass_plan(&self, i: usize) -> &Plan {
        let s = &self.schedule;
        let (Action::Forward(mb) | Action::Backward(mb)) = s.actions[i];
        slot(&self.plan, &self.chunks, s.chunk_of[i], s.slot_of[s.chunk_of[i]][mb])
    }
}

/// The [`Backend::begin_section`] key of a micro-batch's forward and backward pass (that of the
/// step's last micro-batch, whose gradients are reduced over the devices, is the next key).
pub const SECTION_MICRO_BATCH: u32 = 0;

/// Faults a test injects into the pipeline to show that the parity tests catch them.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// A stage before the last drops micro-batch 1's gradient from the next stage.
    DropGradient,
    /// The first stage sends micro-batch 0's activation again in place of micro-batch 1's.
    StaleActivation,
    /// A seq axis's devices give their late chunk a wrong offset ([`Trainer::wrong_chunk_offset`]).
    ChunkOffset,
    /// Document masking on a seq axis: each device finds the EOS of its own chunks only.
    LocalDocuments,
}

/// Under [`Fault::LocalDocuments`], the whole sequences as a device that knew only its own
/// chunks (`rows`) would bound documents: every EOS of the others' chunks turned into another
/// token. `tokens` unchanged otherwise.
#[cfg(test)]
fn local_documents_only(
    fault: Option<Fault>,
    tokens: &[u32],
    (positions, seq_len): (&[usize], usize),
    documents: Option<crate::model::Documents>,
) -> Vec<u32> {
    let mut out = tokens.to_vec();
    if let (Some(Fault::LocalDocuments), Some(docs)) = (fault, documents) {
        for (i, t) in out.iter_mut().enumerate() {
            if *t == docs.eos && !positions.contains(&(i % seq_len)) {
                *t = docs.eos.wrapping_add(1);
            }
        }
    }
    out
}

#[cfg(test)]
impl<B: Backend> Trainer<B> {
    /// A fault on a seq axis: every device takes its late chunk to start right after its early
    /// one (a wrong chunk offset), for its tokens and RoPE, while attention's mask and gathers
    /// keep the true layout.
    pub(crate) fn wrong_chunk_offset(&mut self) {
        let (seq, local) = (self.model.seq, self.plan.seq);
        let wrong: Vec<usize> = (0..local).map(|i| seq.rank * local / 2 + i).collect();
        for p in std::iter::once(&self.plan).chain(self.chunks.iter().flat_map(|c| &c.slots)) {
            self.model.set_positions(&mut self.backend, p, &wrong);
        }
        self.chunk_positions = wrong;
    }
}

/// Uploads a pass's tokens: this device's rows ([`upload_chunks`]) and, for document masking on
/// a seq axis, the whole sequences too ([`Plan::whole_tokens`]). Every device of the axis reads
/// the whole sequences already (it keeps two chunks of each), so it finds the EOS of the
/// others' chunks there, without an exchange.
fn upload_tokens<B: Backend>(be: &mut B, p: &Plan, whole: &[u32], rows: (&[usize], usize), scratch: &mut Vec<u32>) {
    upload_chunks(be, p.tokens, whole, rows, scratch);
    if p.whole_tokens.len > 0 {
        be.upload_idx(p.whole_tokens, whole);
    }
}

/// Uploads to `to` the rows of the whole sequences (of `seq_len` tokens) in `whole` that this
/// device keeps: on a seq axis, those at `positions` in each (its two chunks), else all of them.
/// `scratch` holds the chunks.
fn upload_chunks<B: Backend>(
    be: &mut B,
    to: IdxView,
    whole: &[u32],
    (positions, seq_len): (&[usize], usize),
    scratch: &mut Vec<u32>,
) {
    if positions.is_empty() {
        return be.upload_idx(to, whole);
    }
    scratch.clear();
    for sequence in whole.chunks_exact(seq_len) {
        scratch.extend(positions.iter().map(|&p| sequence[p]));
    }
    be.upload_idx(to, scratch);
}

impl<B: Backend> Trainer<B> {
    /// Casts the FP8 weights the passes read ([`Trainer::weight_casts`]) from the parameters
    /// as they are, if they changed since the optimizer last wrote the casts: before the first
    /// pass, after a checkpoint or parameters loaded, after a step the fused AdamW update did
    /// not make (Muon, QK-clip).
    fn refresh_weight_casts(&mut self) {
        if std::mem::take(&mut self.casts_stale) {
            for c in &self.weight_casts {
                c.cast(&mut self.backend, self.plan.params);
            }
        }
    }

    /// Replaces the parameters (e.g. by imported ones), given in single-device layout order:
    /// each device takes its slice.
    pub fn load_params(&mut self, params: &[f32]) -> Result<()> {
        self.casts_stale = true;
        let (be, par) = (&mut self.backend, &mut self.parallel);
        let global = par.slice.global.clone();
        if params.len() != global.len {
            bail!("{} parameters given, the model has {}", params.len(), global.len);
        }
        par.upload_params(be, |g, out| {
            let t = &global.tensors[g];
            out.copy_from_slice(&params[t.offset..t.offset + t.len()]);
        });
        Ok(())
    }

    /// Continues from a checkpoint saved on any mesh (resharding as needed): parameters,
    /// moments, step and data position.
    pub fn resume_from(&mut self, ck: &Checkpoint) -> Result<()> {
        if ck.state.data_tokens != self.loader.source_len() as u64 {
            bail!(
                "the training data holds {} tokens, {} when the checkpoint was saved: a run resumes on the same data",
                self.loader.source_len(),
                ck.state.data_tokens
            );
        }
        self.loader
            .seek(&ck.state.data_position)
            .map_err(|e| anyhow::anyhow!("checkpoint {}: {e}", ck.dir.display()))?;
        self.casts_stale = true;
        let (be, par) = (&mut self.backend, &mut self.parallel);
        let chunks = par.chunks();
        let params = par.master_params();
        let mut host = vec![0f32; params.len];
        for (part, view) in [(Part::Params, params), (Part::ExpAvg, self.moments.0), (Part::ExpAvgSq, self.moments.1)] {
            ck.read_chunks(part, &chunks, &mut host)?;
            be.upload(view, &host);
        }
        par.after_step(be);
        self.step = ck.state.step;
        self.resume_fp8_scaling(ck)
    }

    /// Starts the optimizer's state afresh (`--reset-optimizer`): both buffers zero, as a new
    /// optimizer's; says so on the first device.
    pub fn reset_optimizer(&mut self) {
        for m in [self.moments.0, self.moments.1] {
            self.backend.fill(m, 0.0);
        }
        if self.parallel.rank == 0 {
            crate::say!(
                "--reset-optimizer: the optimizer ({}) starts from zero state at step {}",
                match self.config.optim.name {
                    crate::config::OptimName::Adamw => "adamw",
                    crate::config::OptimName::Muon => "muon",
                },
                self.step
            );
        }
    }

    /// Restores the delayed FP8 recipe's scales and amax histories from `ck`, where it saved
    /// them for this device: on the same mesh, from this device's shard or that of a replica
    /// holding the same layers and tensor slice. Elsewhere (another mesh, a bf16 or tensorwise
    /// checkpoint, another history length) the histories start afresh, which one line says.
    fn resume_fp8_scaling(&mut self, ck: &Checkpoint) -> Result<()> {
        let Some(f) = self.plan.fp8 else { return Ok(()) };
        let (now, then) = (&self.config, &ck.config);
        if now.train.fp8.recipe != crate::config::Fp8Recipe::Delayed {
            return Ok(());
        }
        let mesh = &self.parallel.mesh;
        let me = mesh.coords(self.parallel.rank);
        let same_run = then.train.precision == now.train.precision
            && then.train.fp8.recipe == now.train.fp8.recipe
            && then.train.fp8.amax_history == now.train.fp8.amax_history
            && then.mesh == now.mesh
            && ck.state.shards == Some(mesh.devices());
        if same_run {
            let holders = (0..mesh.devices()).filter(|&r| {
                let c = mesh.coords(r);
                (c.pipeline, c.tensor) == (me.pipeline, me.tensor)
            });
            for r in holders {
                if let Some(states) = ck.fp8_scaling(r)?.filter(|s| s.len() == f.states.len) {
                    self.backend.upload(f.states, &states);
                    return Ok(());
                }
            }
        }
        if self.parallel.rank == 0 {
            crate::say!(
                "resuming from {}: the delayed FP8 recipe's amax histories start afresh (the checkpoint saved none for this precision, recipe, history length and mesh)",
                ck.dir.display()
            );
        }
        Ok(())
    }

    /// Copies this device's part of the training state to the host, into `into`'s buffers
    /// (reused when their size fits, so that a save does not page in fresh memory): the
    /// parameters the optimizer updates and both moments, with where they are in the
    /// single-device layout. Devices that hold a copy of another's state (data-parallel
    /// replicas) return nothing ([`Parallel::saves`]).
    pub fn device_state(&mut self, into: DeviceState) -> DeviceState {
        let mut state = into;
        if !self.parallel.saves() {
            state.chunks.clear();
            state.bufs.iter_mut().for_each(Vec::clear);
            return state;
        }
        self.part_state(state)
    }

    /// [`Trainer::device_state`] of every device, replicas included: the local tier keeps each
    /// rank's own part, so that each restores from its own copy without asking another.
    pub fn part_state(&mut self, into: DeviceState) -> DeviceState {
        let mut state = into;
        let views = [self.parallel.master_params(), self.moments.0, self.moments.1];
        for (buf, view) in state.bufs.iter_mut().zip(views) {
            buf.resize(view.len, 0.0);
            self.backend.download(view, buf);
        }
        state.chunks = self.parallel.chunks();
        state.fp8.clear();
        if let Some(f) = self.plan.fp8 {
            state.fp8.resize(f.states.len, 0.0);
            self.backend.download(f.states, &mut state.fp8);
        }
        state
    }

    /// What a checkpoint of the current step records besides the device state: the step, where
    /// the loader continues, and the training data's length.
    pub fn progress(&self) -> Progress {
        let data_tokens = self.loader.source_len() as u64;
        Progress { step: self.step, position: self.loader.position(), data_tokens, run: None }
    }

    /// Mean next-token cross-entropy over the first `batches · batch_size` validation samples
    /// (the same samples at every evaluation), and the tokens it covers.
    pub fn eval_loss(&mut self, batches: usize) -> (f64, usize) {
        match self.eval_loss_unless_stopped(batches, None) {
            Ok(done) => done,
            Err(_) => unreachable!("an evaluation without a stop request runs to its end"),
        }
    }

    /// [`Trainer::eval_loss`], abandoned between two batches when `stop` asks the run to stop:
    /// every device of the run stops before the same batch ([`EvalStops`]), within about a
    /// second of the request, and none sums the partial loss. Returns the batches evaluated.
    fn eval_loss_unless_stopped(
        &mut self,
        batches: usize,
        stop: Option<&signals::StopRequest>,
    ) -> std::result::Result<(f64, usize), usize> {
        self.refresh_weight_casts();
        let (be, par) = (&mut self.backend, &mut self.parallel);
        let microbatches = self.config.train.pipeline_microbatches;
        let moe = self.config.model.moe.is_some();
        // Each device of the batch group takes its own stretch of the validation samples, which
        // the pipeline reads in micro-batches, passing each through the stages.
        let (rank, shards) = par.batch_rank();
        let loss = self.plan.scalars.at(LOSS_ACCUM, 1);
        be.fill(loss, 0.0);
        let mut stops = stop.map(EvalStops::new);
        for i in 0..batches {
            if stops.as_mut().is_some_and(|s| s.stop_before(i, be, par)) {
                return Err(i);
            }
            for j in 0..microbatches {
                let first = ((i * shards + rank) * microbatches + j) * self.plan.batch;
                self.loader.validation_batch(first, &mut self.tokens, &mut self.targets);
                let rows = (&self.chunk_positions[..], self.config.train.seq_len);
                // Through this device's virtual stages in order (the stage itself without).
                for (v, chunk) in self.chunks.iter().enumerate() {
                    let (p, stage) = (slot(&self.plan, &self.chunks, v, 0), chunk.model.stage());
                    upload_tokens(be, p, &self.tokens, rows, &mut self.local);
                    if v + 1 == self.chunks.len() {
                        upload_chunks(be, p.targets, &self.targets, rows, &mut self.local);
                    }
                    if !stage.first {
                        let prev = par.neighbour(self.around.0);
                        let stats: &[(View, usize)] = if moe { &[(p.moe_stats(), prev)] } else { &[] };
                        par.send_recv(be, &[], &[&[(p.stage_input(), prev)], stats].concat());
                    }
                    chunk.model.forward(be, p, None, &mut chunk.exchange(par));
                    if stage.last {
                        be.add(loss, p.scalars.at(LOSS_SUM, 1));
                    } else {
                        let next = par.neighbour(self.around.1);
                        let stats: &[(View, usize)] = if moe { &[(p.moe_stats(), next)] } else { &[] };
                        par.send_recv(be, &[&[(p.stage_output(), next)], stats].concat(), &[]);
                    }
                }
            }
        }
        par.sum_over_batch(be, loss);
        par.sum_over_pipeline(be, loss);
        let sum = read_scalar(be, loss);
        let tokens = batches * microbatches * self.tokens.len() * shards;
        Ok((sum / tokens as f64, tokens))
    }

    /// Refuses a `train.eval_steps` whose evaluation reads more validation samples than the
    /// validation split holds: past them the loader comes round to the same samples again, and
    /// a stray value (billions) evaluated for hours. One line with the arithmetic, before the
    /// first step.
    fn check_eval_steps(&self) -> Result<()> {
        let t = &self.config.train;
        let p = &self.parallel_plan;
        let (steps, shards, micro, batch) = (t.eval_steps, p.batch_shards, p.microbatches, p.microbatch);
        let per_step = (shards * micro * batch) as u128;
        let reads = steps as u128 * per_step;
        let (distinct, what) = self.loader.distinct_validation_samples();
        if reads <= distinct as u128 {
            return Ok(());
        }
        let fits = match distinct as u128 / per_step {
            0 => format!(
                "the split holds fewer than one evaluation batch of {per_step}: lower train.batch_size or set data.validation_path to a larger validation set"
            ),
            n => format!("set train.eval_steps to at most {n}"),
        };
        bail!(
            "train.eval_steps = {steps} reads {steps} x {shards} batch shard(s) x {micro} pipeline micro-batch(es) x {batch} sequence(s) = {reads} validation samples per evaluation, more than the {distinct} distinct samples of {what} (of train.seq_len + 1 = {} tokens each): past them it would read the same samples again; {fits}",
            t.seq_len + 1
        )
    }
}

/// Seconds of evaluation between two exchanges of the devices' stop flags, about
/// ([`EvalStops`]).
const EVAL_STOP_EVERY_S: f64 = 0.25;

/// How an evaluation learns of a stop request between its batches. On one device it looks
/// before every batch (an atomic load). On several, every device must stop before the same
/// batch, else the others wait for it in their next collective: before the first batch and then
/// every few batches they exchange their "asked to stop" flags, with the time the batches
/// before the last exchange took on each, from which every device computes the same spacing of
/// the exchanges: about [`EVAL_STOP_EVERY_S`] of the slowest device's batches, starting at one
/// batch and at most doubling each time. The exchange's collective waits for the device's
/// work, so the times are the batches' own, not their launches'.
struct EvalStops<'a> {
    stop: &'a signals::StopRequest,
    /// The batch before which the devices next exchange their flags.
    next: usize,
    /// Batches from the last exchange to `next`.
    span: usize,
    /// Batches between the two exchanges before the last, and the microseconds they took on
    /// this device: what it sends at the next exchange.
    measured: (usize, u64),
    /// When the last exchange ended (the evaluation's start before the first).
    since: Instant,
}

impl<'a> EvalStops<'a> {
    fn new(stop: &'a signals::StopRequest) -> EvalStops<'a> {
        EvalStops { stop, next: 0, span: 0, measured: (0, 0), since: Instant::now() }
    }

    /// Whether the devices stop before batch `i` (every device calls it before each batch).
    fn stop_before<B: Backend>(&mut self, i: usize, be: &mut B, par: &mut Parallel<B>) -> bool {
        let asked = self.stop.requested().is_some();
        if par.mesh.devices() == 1 {
            return asked;
        }
        if i != self.next {
            return false;
        }
        let (span, micros) = self.measured;
        let all = par.gather_from_world(be, (micros.min((1 << 46) - 1) << 1) | asked as u64);
        let now = Instant::now();
        self.measured = (self.span, (now - self.since).as_micros() as u64);
        self.since = now;
        if all.iter().any(|v| v & 1 == 1) {
            return true;
        }
        let slowest = all.iter().map(|v| v >> 1).max().unwrap_or(0);
        let next = match (span, slowest) {
            (0, _) | (_, 0) => 1,
            _ => ((span as f64 * EVAL_STOP_EVERY_S * 1e6 / slowest as f64) as usize).clamp(1, 2 * self.span.max(1)),
        };
        (self.next, self.span) = (i + next, next);
        false
    }
}

fn read_scalar<B: Backend>(be: &mut B, v: View) -> f64 {
    let mut x = [0f32];
    be.download(v, &mut x);
    x[0] as f64
}

/// One virtual stage of a device under interleaved 1F1B (without, the device's stage itself):
/// its model, where its units start among the device's layers and in its flat buffers, and
/// its activation slots.
struct Chunk {
    model: Model,
    first_layer: usize,
    offset: usize,
    /// Its slots; the first virtual stage's first is the trainer's `plan`, not here.
    slots: Vec<Plan>,
}

impl Chunk {
    /// The device's exchange, as this virtual stage's passes address it.
    fn exchange<'a, B: Backend>(&self, par: &'a mut Parallel<B>) -> ChunkExchange<'a, B> {
        ChunkExchange { inner: par, first_layer: self.first_layer, offset: self.offset }
    }
}

/// Slot `k` of virtual stage `v`: `plan` for the first of the first.
fn slot<'a>(plan: &'a Plan, chunks: &'a [Chunk], v: usize, k: usize) -> &'a Plan {
    if v == 0 && k == 0 { plan } else { &chunks[v].slots[k - usize::from(v == 0)] }
}

/// The device's first plan (with the flat parameter and gradient buffers if `flat`) and its
/// virtual stages with `in_flight[v]` slots each, for micro-batches of `batch` sequences of
/// `seq` tokens. Every slot shares the first plan's backward scratch and recomputed
/// activations; a virtual stage's slots address the part of the flat buffers its units are in.
fn plan_chunks<B: Backend>(
    model: &Model,
    be: &mut B,
    (batch, seq): (usize, usize),
    flat: bool,
    in_flight: &[usize],
) -> (Plan, Vec<Chunk>) {
    let models = if in_flight.len() == 1 { vec![model.clone()] } else { pipeline::chunk_models(model) };
    let at = pipeline::chunk_offsets(&models);
    let mut plan = if models.len() == 1 {
        model.plan_with(be, batch, seq, flat)
    } else {
        // The flat buffers are the whole device's, the activations the first virtual stage's.
        let mut plan = models[0].plan_slot(be, batch, seq, false, None);
        let len = if flat { model.layout.len } else { 0 };
        (plan.params, plan.grads) = (be.alloc(BufKind::Params, len), be.alloc(BufKind::Grads, len));
        plan
    };
    plan.refill_last = in_flight.iter().sum::<usize>() > 1;
    let chunks = models
        .into_iter()
        .zip(at)
        .zip(in_flight)
        .enumerate()
        .map(|(v, ((model, (offset, first_layer)), &n))| {
            let slots = (usize::from(v == 0)..n)
                .map(|_| {
                    let mut p = model.plan_slot(be, batch, seq, false, Some(&plan));
                    if flat {
                        let len = model.layout.len;
                        (p.params, p.grads) = (plan.params.at(offset, len), plan.grads.at(offset, len));
                    }
                    p
                })
                .collect();
            Chunk { model, first_layer, offset, slots }
        })
        .collect();
    (plan, chunks)
}
