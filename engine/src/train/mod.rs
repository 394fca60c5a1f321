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

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, bail};

use crate::backend::{AdamWStep, Backend, BufKind, Segment, View};
use crate::checkpoint::sharded::{self, Chunk, Part};
use crate::checkpoint::{self, Checkpoint, Extras, Snapshot};
use crate::config::Config;
use crate::data::{self, Loader};
use crate::model::{Alone, Exchange, GRAD_NORM_SQ, LOSS_ACCUM, LOSS_SUM, Model, Plan, init};
use crate::parallel::comm::Collectives;
use crate::parallel::mesh::Mesh;
use crate::parallel::strategies::Parallel;
use crate::parallel::tensor::{TensorSlice, local_config};
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
    /// This device's part in a parallel run (none on a single device).
    pub parallel: Option<Parallel<B>>,
    segments: Vec<Segment>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    flops_per_token: f64,
}

impl<B: Backend> Trainer<B> {
    /// Plans device memory, initialises the parameters from the seed and opens the data.
    pub fn new(backend: B, config: &Config) -> Result<Trainer<B>> {
        Trainer::build(backend, config, None)
    }

    /// A trainer for one device of a parallel run on `mesh`, talking to the others through
    /// `comm` (whose rank says which device this is). The mesh has been checked against the
    /// model ([`Mesh::check_model`]). Every device starts from the single-device
    /// initialisation's values for its slice.
    pub fn new_parallel(
        backend: B,
        config: &Config,
        comm: Box<dyn Collectives<B> + Send>,
        mesh: Mesh,
    ) -> Result<Trainer<B>> {
        Trainer::build(backend, config, Some((comm, mesh)))
    }

    fn build(
        mut backend: B,
        config: &Config,
        parallel: Option<(Box<dyn Collectives<B> + Send>, Mesh)>,
    ) -> Result<Trainer<B>> {
        let t = &config.train;
        let source = data::open(&config.data, config.model.vocab_size, t.seed)?;
        let (tensor, shards) = parallel
            .as_ref()
            .map_or((1, 1), |(_, mesh)| (mesh.size(crate::parallel::mesh::Axis::Tensor), mesh.batch_shards()));
        let mut model = Model::new(&local_config(&config.model, tensor));
        model.remat = t.remat;
        model.batch_shards = shards;
        // The devices of a tensor group share their samples: `batch_size · tensor` each.
        let plan = model.plan(&mut backend, t.batch_size * tensor, t.seq_len);
        let (parallel, loader) = match parallel {
            None => {
                init::upload_params(&mut backend, plan.params, &model, t.seed);
                (None, Loader::new(source, t.seq_len, t.seed, 0, 1)?)
            }
            Some((comm, mesh)) => {
                let slice = TensorSlice::new(&config.model, mesh.coords(comm.rank()).tensor, tensor);
                slice.upload_init(&mut backend, plan.params, t.seed, config.model.init_std as f32);
                let par = Parallel::new(&mut backend, comm, mesh, slice, plan.params, plan.grads);
                let (rank, ranks) = par.batch_rank();
                (Some(par), Loader::new(source, t.seq_len, t.seed, rank, ranks)?)
            }
        };
        let moment_len = parallel.as_ref().map_or(model.layout.len, |p| p.moment_len());
        let moments = (backend.alloc(BufKind::OptState, moment_len), backend.alloc(BufKind::OptState, moment_len));
        let segments =
            model.layout.tensors.iter().map(|t| Segment { offset: t.offset, len: t.len(), decay: t.decay }).collect();
        let n = plan.batch * plan.seq;
        Ok(Trainer {
            backend,
            flops_per_token: config.model.train_flops_per_token(t.seq_len),
            model,
            plan,
            config: config.clone(),
            loader,
            step: 0,
            moments,
            parallel,
            segments,
            tokens: vec![0; n],
            targets: vec![0; n],
        })
    }

    /// Devices of the run.
    pub fn devices(&self) -> usize {
        self.parallel.as_ref().map_or(1, |p| p.mesh.devices())
    }

    /// Tokens one optimizer step processes, all devices together (the global batch is
    /// `train.batch_size` × devices sequences per micro-batch).
    pub fn tokens_per_step(&self) -> usize {
        let t = &self.config.train;
        t.batch_size * self.devices() * t.seq_len * t.grad_accum
    }

    /// Training FLOPs of one optimizer step per device.
    pub fn flops_per_step(&self) -> f64 {
        self.flops_per_token * self.tokens_per_step() as f64 / self.devices() as f64
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
        let tokens = (p.batch * p.seq) as f32;
        let shards = self.model.batch_shards;
        let weight = 1.0 / accum as f32;
        let aux_scale = self.model.aux_scale(p, weight);
        let mut aux_sum = 0f64;
        be.fill(p.scalars.at(LOSS_ACCUM, 1), 0.0);
        // Collectives inside a recorded section would need the communicator captured too.
        let graphs = c.train.cuda_graphs && self.parallel.is_none();
        for micro in 0..accum {
            self.loader.next_batch(&mut self.tokens, &mut self.targets);
            be.upload_idx(p.tokens, &self.tokens);
            be.upload_idx(p.targets, &self.targets);
            let ex: &mut dyn Exchange<B> = match &mut self.parallel {
                Some(par) => {
                    par.sync = micro + 1 == accum;
                    par
                }
                None => &mut Alone,
            };
            if !graphs || be.begin_section(SECTION_MICRO_BATCH) {
                self.model.forward(be, p, Some(weight / tokens / shards as f32), ex);
                self.model.backward(be, p, aux_scale, ex);
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
        match &mut self.parallel {
            None => {
                be.sum_squares(norm_sq, p.grads);
                be.adamw(p.params, p.grads, m, v, norm_sq, &self.segments, adamw);
            }
            Some(par) => {
                par.grad_norm_squared(be, norm_sq, &self.segments);
                let (params, grads, segments) = par.optimizer_buffers(&self.segments);
                let segments = segments.to_vec();
                be.adamw(params, grads, m, v, norm_sq, &segments, adamw);
                par.after_step(be);
                par.sum_over_batch(be, p.scalars.at(LOSS_ACCUM, 1));
            }
        }
        let mut scalars = [0f32; 4];
        be.download(p.scalars, &mut scalars);
        let (loss_sum, grad_norm) = (scalars[LOSS_ACCUM] as f64, (scalars[GRAD_NORM_SQ] as f64).sqrt());
        self.step += 1;

        let step_time_s = start.elapsed().as_secs_f64();
        let tflops = self.flops_per_step() / step_time_s / 1e12;
        StepMetrics {
            step: self.step,
            loss: loss_sum / (tokens as f64 * accum as f64 * shards as f64),
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
    /// Replaces the parameters (e.g. by imported ones), given in single-device layout order:
    /// each device of a parallel run takes its slice.
    pub fn load_params(&mut self, params: &[f32]) -> Result<()> {
        let (p, be) = (&self.plan, &mut self.backend);
        let Some(par) = &mut self.parallel else {
            if params.len() != p.params.len {
                bail!("{} parameters given, the model has {}", params.len(), p.params.len);
            }
            be.upload(p.params, params);
            return Ok(());
        };
        let slice = &par.slice;
        if params.len() != slice.global.len {
            bail!("{} parameters given, the model has {}", params.len(), slice.global.len);
        }
        slice.upload(be, p.params, |g, out| {
            let t = &slice.global.tensors[g];
            out.copy_from_slice(&params[t.offset..t.offset + t.len()]);
        });
        par.params_loaded(be, p.params);
        Ok(())
    }

    /// Continues from a checkpoint saved on any mesh (resharding as needed): parameters,
    /// moments, step and data position.
    pub fn resume_from(&mut self, ck: &Checkpoint) -> Result<()> {
        self.check_data(ck.state.data_tokens)?;
        let (p, be) = (&self.plan, &mut self.backend);
        let chunks = match &self.parallel {
            Some(par) => par.chunks(),
            None => vec![Chunk { global: 0, local: 0, len: p.params.len }],
        };
        let params = self.parallel.as_ref().map_or(p.params, |par| par.master_params());
        let mut host = vec![0f32; params.len];
        for (part, view) in [(Part::Params, params), (Part::ExpAvg, self.moments.0), (Part::ExpAvgSq, self.moments.1)] {
            ck.read_chunks(part, &chunks, &mut host)?;
            be.upload(view, &host);
        }
        if let Some(par) = &mut self.parallel {
            par.after_step(be);
        }
        self.step = ck.state.step;
        self.loader.seek(ck.state.data_position);
        Ok(())
    }

    fn check_data(&self, saved_tokens: u64) -> Result<()> {
        if saved_tokens != self.loader.source_len() as u64 {
            bail!(
                "the training data holds {} tokens, {} when the checkpoint was saved: a run resumes on the same data",
                self.loader.source_len(),
                saved_tokens
            );
        }
        Ok(())
    }

    /// Saves a sharded checkpoint of the current step under `parent` and prunes to
    /// `train.keep_last` (see [`crate::checkpoint::sharded`]). Every device of the run calls
    /// this at the same step; it returns once the checkpoint is complete on all of them.
    pub fn save_sharded(&mut self, parent: &Path, extras: &Extras) -> Result<PathBuf> {
        let (be, step) = (&mut self.backend, self.step);
        let Some(par) = &mut self.parallel else { bail!("save_sharded: not a parallel run") };
        let dir = parent.join(checkpoint::dir_name(step));
        let tmp = parent.join(format!(".tmp-{}-sharded", checkpoint::dir_name(step)));
        let (rank, devices) = (par.rank, par.mesh.devices());
        let mut write = || -> Result<()> {
            std::fs::create_dir_all(&tmp)?;
            if par.saves() {
                let params = par.master_params();
                let mut bufs = [vec![0f32; params.len], vec![0f32; params.len], vec![0f32; params.len]];
                for (buf, view) in bufs.iter_mut().zip([params, self.moments.0, self.moments.1]) {
                    be.download(view, buf);
                }
                sharded::write_part(&tmp, rank, devices, [&bufs[0], &bufs[1], &bufs[2]], &par.chunks())?;
            }
            Ok(())
        };
        let written = write();
        if par.any_failed(be, written.is_err()) {
            written?;
            bail!("checkpoint {}: another device could not write its part", dir.display());
        }
        let sealed = if rank == 0 {
            let head = (step, self.loader.position(), self.loader.source_len() as u64);
            sharded::commit(&tmp, &dir, &self.config, head, devices, extras)
                .and_then(|()| checkpoint::prune(parent, self.config.train.keep_last))
        } else {
            Ok(())
        };
        if par.any_failed(be, sealed.is_err()) {
            sealed.map_err(|e| e.context(format!("cannot write checkpoint {}", dir.display())))?;
            bail!("checkpoint {}: rank 0 could not complete it", dir.display());
        }
        Ok(dir)
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
        self.check_data(snap.data_tokens)?;
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
        // Each device of the batch group takes its own stretch of the validation samples.
        let (rank, shards) = self.parallel.as_ref().map_or((0, 1), |par| par.batch_rank());
        if let Some(par) = &mut self.parallel {
            par.gather_all(be);
        }
        let mut sum = 0f64;
        for i in 0..batches {
            self.loader.validation_batch((i * shards + rank) * p.batch, &mut self.tokens, &mut self.targets);
            be.upload_idx(p.tokens, &self.tokens);
            be.upload_idx(p.targets, &self.targets);
            match &mut self.parallel {
                Some(par) => {
                    self.model.forward(be, p, None, par);
                    par.sum_over_batch(be, p.scalars.at(LOSS_SUM, 1));
                }
                None => self.model.forward(be, p, None, &mut Alone),
            }
            sum += read_scalar(be, p.scalars.at(LOSS_SUM, 1));
        }
        let tokens = batches * self.tokens.len() * shards;
        (sum / tokens as f64, tokens)
    }
}

fn read_scalar<B: Backend>(be: &mut B, v: View) -> f64 {
    let mut x = [0f32];
    be.download(v, &mut x);
    x[0] as f64
}
