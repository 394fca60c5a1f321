//! The training loop: batches from the loader, forward, loss, backward, AdamW, metrics.
//!
//! One optimizer step accumulates `train.grad_accum` micro-batches of `train.batch_size`
//! sequences. The objective is the mean next-token cross-entropy over all the step's tokens,
//! plus `aux_loss_coef` times the load-balancing loss (averaged over micro-batches) for
//! mixture-of-experts models.

pub mod metrics;
pub mod schedule;
pub mod session;
pub mod tensorboard;

use std::time::Instant;

use anyhow::{Result, bail};

use crate::backend::{AdamWStep, Backend, BufKind, Segment, View};
use crate::checkpoint::Snapshot;
use crate::config::Config;
use crate::data::{self, Loader};
use crate::model::{GRAD_NORM_SQ, LOSS_ACCUM, LOSS_SUM, Model, Plan, init};
pub use metrics::StepMetrics;

/// A model being trained on a backend, with its optimizer state and data.
pub struct Trainer<B: Backend> {
    /// The device.
    pub backend: B,
    /// The model.
    pub model: Model,
    /// Device memory for the step.
    pub plan: Plan,
    /// The configuration being trained.
    pub config: Config,
    /// The data.
    pub loader: Loader,
    /// Optimizer steps completed.
    pub step: u64,
    /// First and second AdamW moments (flat, parameter layout).
    pub moments: (View, View),
    segments: Vec<Segment>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    flops_per_token: f64,
}

impl<B: Backend> Trainer<B> {
    /// Plans device memory, initialises the parameters from the seed and opens the data.
    pub fn new(mut backend: B, config: &Config) -> Result<Trainer<B>> {
        let t = &config.train;
        let source = data::open(&config.data, config.model.vocab_size, t.seed)?;
        let loader = Loader::new(source, t.seq_len, t.seed, 0, 1)?;
        let mut model = Model::new(&config.model);
        model.remat = t.remat;
        let plan = model.plan(&mut backend, t.batch_size, t.seq_len);
        init::upload_params(&mut backend, plan.params, &model, t.seed);
        let moments =
            (backend.alloc(BufKind::OptState, model.layout.len), backend.alloc(BufKind::OptState, model.layout.len));
        let segments =
            model.layout.tensors.iter().map(|t| Segment { offset: t.offset, len: t.len(), decay: t.decay }).collect();
        let n = t.batch_size * t.seq_len;
        Ok(Trainer {
            backend,
            flops_per_token: config.model.train_flops_per_token(t.seq_len),
            model,
            plan,
            config: config.clone(),
            loader,
            step: 0,
            moments,
            segments,
            tokens: vec![0; n],
            targets: vec![0; n],
        })
    }

    /// Tokens one optimizer step processes on this device.
    pub fn tokens_per_step(&self) -> usize {
        self.config.train.batch_size * self.config.train.seq_len * self.config.train.grad_accum
    }

    /// Training FLOPs of one optimizer step on this device.
    pub fn flops_per_step(&self) -> f64 {
        self.flops_per_token * self.tokens_per_step() as f64
    }

    /// Runs one optimizer step and reports it; `peak_tflops` is the device's peak for MFU.
    ///
    /// The host waits for the device once per step, to read the loss and gradient norm (and,
    /// for mixture-of-experts models, once per micro-batch for the load-balancing statistics).
    /// Each micro-batch's forward and backward pass is one [`Backend::begin_section`]: the same
    /// ops on the same buffers every time, which the CUDA backend records once as a graph.
    pub fn train_step(&mut self, peak_tflops: f64) -> StepMetrics {
        let start = Instant::now();
        let (c, p, be) = (&self.config, &self.plan, &mut self.backend);
        let accum = c.train.grad_accum;
        let tokens = (c.train.batch_size * c.train.seq_len) as f32;
        let weight = 1.0 / accum as f32;
        let aux_scale = self.model.aux_scale(p, weight);
        let mut aux_sum = 0f64;
        be.fill(p.scalars.at(LOSS_ACCUM, 1), 0.0);
        for _ in 0..accum {
            self.loader.next_batch(&mut self.tokens, &mut self.targets);
            be.upload_idx(p.tokens, &self.tokens);
            be.upload_idx(p.targets, &self.targets);
            let graphs = c.train.cuda_graphs;
            if !graphs || be.begin_section(SECTION_MICRO_BATCH) {
                self.model.forward(be, p, Some(weight / tokens));
                self.model.backward(be, p, aux_scale);
                be.add(p.scalars.at(LOSS_ACCUM, 1), p.scalars.at(LOSS_SUM, 1));
                if graphs {
                    be.end_section(SECTION_MICRO_BATCH);
                }
            }
            aux_sum += self.model.aux_loss(be, p);
        }

        let total_steps = c.train.steps;
        let lr = schedule::learning_rate(&c.optim, total_steps, self.step as usize);
        let norm_sq = p.scalars.at(GRAD_NORM_SQ, 1);
        be.sum_squares(norm_sq, p.grads);
        let o = &c.optim;
        let adamw = AdamWStep {
            lr: lr as f32,
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            weight_decay: o.weight_decay as f32,
            t: self.step + 1,
            max_grad_norm: o.grad_clip as f32,
        };
        let (m, v) = self.moments;
        be.adamw(p.params, p.grads, m, v, norm_sq, &self.segments, adamw);
        let mut scalars = [0f32; 4];
        be.download(p.scalars, &mut scalars);
        let (loss_sum, grad_norm) = (scalars[LOSS_ACCUM] as f64, (scalars[GRAD_NORM_SQ] as f64).sqrt());
        self.step += 1;

        let step_time_s = start.elapsed().as_secs_f64();
        let tflops = self.flops_per_step() / step_time_s / 1e12;
        StepMetrics {
            step: self.step,
            loss: loss_sum / (tokens as f64 * accum as f64),
            aux_loss: self.config.model.moe.as_ref().map(|_| aux_sum / accum as f64),
            lr,
            grad_norm,
            step_time_s,
            tokens_per_s: self.tokens_per_step() as f64 / step_time_s,
            tflops_per_device: tflops,
            mfu: if peak_tflops > 0.0 { tflops / peak_tflops } else { 0.0 },
            eval_loss: None,
            checkpoint_s: None,
        }
    }
}

/// The [`Backend::begin_section`] key of a micro-batch's forward and backward pass.
pub const SECTION_MICRO_BATCH: u32 = 0;

impl<B: Backend> Trainer<B> {
    /// Replaces the parameters (e.g. by imported ones), in layout order.
    pub fn load_params(&mut self, params: &[f32]) -> Result<()> {
        if params.len() != self.plan.params.len {
            bail!("{} parameters given, the model has {}", params.len(), self.plan.params.len);
        }
        self.backend.upload(self.plan.params, params);
        Ok(())
    }

    /// Copies the training state to the host, into `into`'s buffers (reused when their size
    /// fits, so that a save does not page in fresh memory).
    pub fn snapshot(&mut self, into: Snapshot) -> Snapshot {
        let n = self.plan.params.len;
        let (mut params, moments) = (into.params, into.moments);
        let (mut m, mut v) = moments.unwrap_or_default();
        for buf in [&mut params, &mut m, &mut v] {
            buf.resize(n, 0.0);
        }
        self.backend.download(self.plan.params, &mut params);
        self.backend.download(self.moments.0, &mut m);
        self.backend.download(self.moments.1, &mut v);
        Snapshot {
            step: self.step,
            position: self.loader.position(),
            data_tokens: self.loader.source_len() as u64,
            params,
            moments: Some((m, v)),
        }
    }

    /// Continues from a snapshot: parameters, moments, step and data position.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        let Some((m, v)) = &snap.moments else {
            bail!("the checkpoint has no optimizer state (an imported model?): it can start a run, not resume one");
        };
        if snap.data_tokens != self.loader.source_len() as u64 {
            bail!(
                "the training data holds {} tokens, {} when the checkpoint was saved: a run resumes on the same data",
                self.loader.source_len(),
                snap.data_tokens
            );
        }
        self.load_params(&snap.params)?;
        self.backend.upload(self.moments.0, m);
        self.backend.upload(self.moments.1, v);
        self.step = snap.step;
        self.loader.seek(snap.position);
        Ok(())
    }

    /// Mean next-token cross-entropy over the first `batches · batch_size` validation samples
    /// (the same samples at every evaluation), and the tokens it covers.
    pub fn eval_loss(&mut self, batches: usize) -> (f64, usize) {
        let (p, be) = (&self.plan, &mut self.backend);
        let batch = self.config.train.batch_size;
        let mut sum = 0f64;
        for i in 0..batches {
            self.loader.validation_batch(i * batch, &mut self.tokens, &mut self.targets);
            be.upload_idx(p.tokens, &self.tokens);
            be.upload_idx(p.targets, &self.targets);
            self.model.forward(be, p, None);
            sum += read_scalar(be, p.scalars.at(LOSS_SUM, 1));
        }
        let tokens = batches * self.tokens.len();
        (sum / tokens as f64, tokens)
    }
}

fn read_scalar<B: Backend>(be: &mut B, v: View) -> f64 {
    let mut x = [0f32];
    be.download(v, &mut x);
    x[0] as f64
}
