//! What every step reports: a human-readable line and a JSON object in `metrics.jsonl`.
//!
//! Throughput follows the FLOP convention of [`crate::config::count`]; MFU is TFLOP/s per
//! device over the device's peak (on CPU, a measured f32 GEMM rate unless `train.peak_tflops`
//! is set).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

/// Metrics of one optimizer step.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StepMetrics {
    /// 1-based step number.
    pub step: u64,
    /// Whether the update was applied: false when the loss or the gradient norm was not finite
    /// (the step diverged and the model was left as it was).
    #[serde(skip)]
    pub applied: bool,
    /// Mean next-token cross-entropy over the step's tokens.
    pub loss: f64,
    /// Load-balancing loss, averaged over micro-batches (mixture-of-experts models only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
    /// Share of the step's (token, expert) assignments that the experts' capacity dropped, over
    /// all layers and micro-batches (mixture-of-experts models with `model.moe.capacity_factor`
    /// only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped_fraction: Option<f64>,
    /// The experts' balance: the most loaded expert's tokens over the mean, of the tokens
    /// routed to each expert summed over the layers, averaged over micro-batches (1: even;
    /// mixture-of-experts models only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_load: Option<f64>,
    /// The step's largest attention logit, over every layer and head (`optim.qk_clip` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_logit: Option<f64>,
    /// The heads whose q and k projections QK-clip rescaled after the step (`optim.qk_clip`
    /// only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clipped_heads: Option<usize>,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall time of the step.
    pub step_time_s: f64,
    /// Of the step time, the time spent waiting for batches (for the goodput timeline).
    #[serde(skip)]
    pub data_s: f64,
    /// Tokens processed per second (all micro-batches of this device).
    pub tokens_per_s: f64,
    /// Achieved TFLOP/s of this device.
    pub tflops_per_device: f64,
    /// Model FLOP utilisation: `tflops_per_device` over the device's peak.
    pub mfu: f64,
    /// Mean cross-entropy on the validation split, on steps that evaluate (`train.eval_every`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// With a mixture of datasets (`data.mixture`): the tokens trained on from each source so
    /// far, all devices together, by source name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_by_source: Option<std::collections::BTreeMap<String, u64>>,
    /// Seconds the step loop spent on a checkpoint after this step: copying the state to the
    /// host, and waiting for the previous save if it was still writing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_s: Option<f64>,
    /// Seconds the step loop spent on the local tier ([`super::local_saver`]) at this step's
    /// boundary, when a local save was due or in flight: copying the state to the host, waiting
    /// for the previous save, agreeing whether every rank's part is sealed, and exchanging the
    /// copies with the peers. A checkpoint stall in goodput.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_checkpoint_s: Option<f64>,
    /// Seconds this rank's thread took to write, seal and pack its part of a local save, in
    /// the background (not on the step loop); given at the boundary where every rank's part was
    /// found sealed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_checkpoint_write_s: Option<f64>,
    /// On runs of more than one device: the rank whose step took longest (the straggler the
    /// others waited for), and its step time. Every rank's time is gathered at each step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slowest_rank: Option<usize>,
    /// That rank's step time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slowest_step_time_s: Option<f64>,
    /// A rank named a straggler at this step ([`super::stragglers`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub straggler: Option<super::stragglers::Straggler>,
}

impl StepMetrics {
    /// The one-line summary printed for every step.
    pub fn line(&self, total_steps: usize) -> String {
        let width = total_steps.to_string().len();
        let aux = self.aux_loss.map(|a| format!(" | aux {a:.4}")).unwrap_or_default();
        let dropped = self.dropped_fraction.map(|f| format!(" | dropped {:.2}%", 100.0 * f)).unwrap_or_default();
        let load = self.expert_load.map(|l| format!(" | load max/mean {l:.2}")).unwrap_or_default();
        let eval = self.eval_loss.map(|e| format!(" | eval loss {e:.4}")).unwrap_or_default();
        let logits = match (self.max_logit, self.clipped_heads) {
            (Some(m), Some(0)) => format!(" | max logit {m:.2}"),
            (Some(m), Some(1)) => format!(" | max logit {m:.2} (1 head clipped)"),
            (Some(m), Some(h)) => format!(" | max logit {m:.2} ({h} heads clipped)"),
            _ => String::new(),
        };
        let slowest = match (self.slowest_rank, self.slowest_step_time_s) {
            (Some(rank), Some(s)) => format!(" | slowest rank {rank} {s:.3} s"),
            _ => String::new(),
        };
        format!(
            "step {:>width$}/{total_steps} | loss {:.4}{aux}{dropped}{load}{eval}{logits} | lr {:.2e} | grad norm {:.3} | {:.3} s{slowest} | {:.0} tok/s | {:.3} TFLOP/s | MFU {:.1}%",
            self.step,
            self.loss,
            self.lr,
            self.grad_norm,
            self.step_time_s,
            self.tokens_per_s,
            self.tflops_per_device,
            100.0 * self.mfu,
        )
    }
}

/// Appends one JSON object per step to `metrics.jsonl`, flushed at every step so that a killed
/// run keeps every completed step.
pub struct JsonlWriter {
    out: BufWriter<File>,
}

impl JsonlWriter {
    /// Opens (appending) `path`.
    pub fn append(path: &Path) -> Result<JsonlWriter> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {} for writing", path.display()))?;
        Ok(JsonlWriter { out: BufWriter::new(file) })
    }

    /// Writes one record.
    pub fn write(&mut self, record: &impl Serialize) -> Result<()> {
        serde_json::to_writer(&mut self.out, record)?;
        self.out.write_all(b"\n")?;
        self.out.flush().context("cannot write metrics")
    }
}
