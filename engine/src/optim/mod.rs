//! The optimizers (`[optim]`): AdamW on every tensor, or Muon on the hidden matrices with
//! AdamW on the rest ([`crate::model::Tensor::is_hidden_matrix`], docs/recipes.md).
//!
//! Both run over the device's optimizer buffers ([`Parallel::optimizer_buffers`]: its FSDP
//! pieces, or its tensor-parallel slice) and two moment buffers laid out like them. AdamW keeps
//! its moments `m` and `v` there; Muon keeps its momentum buffer in `m` (its matrices' part of
//! `v` stays zero). A checkpoint saves both buffers whole, so it reshards as before; the
//! optimizer's name is in the saved configuration, and a resumed run must keep it
//! (`--reset-optimizer` starts both buffers afresh instead).

pub mod muon;
pub mod qk_clip;
pub mod schedule;

use crate::backend::fp8::WeightCast;
use crate::backend::{AdamWStep, Backend, Segment, View};
use crate::config::{OptimConfig, OptimName};
use crate::parallel::strategies::Parallel;

/// A device's optimizer: which segments of its buffers each update takes.
pub struct Optimizer {
    /// The segments AdamW updates (every one without Muon).
    adamw: Vec<Segment>,
    /// Muon's part, if `optim.name = "muon"`.
    muon: Option<muon::Muon>,
}

/// The learning rates of one step: AdamW's, and Muon's (before its shape adjustment).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// `optim.lr`'s schedule.
    pub adamw: f64,
    /// `optim.muon.lr`'s (`optim.lr`'s when 0).
    pub muon: f64,
}

impl Optimizer {
    /// The optimizer of `o` for the device `par`, with the scratch Muon needs allocated on `be`.
    pub fn new<B: Backend>(be: &mut B, par: &Parallel<B>, o: &OptimConfig) -> anyhow::Result<Optimizer> {
        Ok(match o.name {
            OptimName::Adamw => Optimizer { adamw: par.optimizer_buffers().2.to_vec(), muon: None },
            OptimName::Muon => {
                let (matrices, adamw) = par.segments_by_matrix();
                Optimizer { adamw, muon: Some(muon::Muon::new(be, par, matrices, o)?) }
            }
        })
    }

    /// Applies one step to `par`'s optimizer buffers with the gradients they hold (zeroing
    /// them), the squared global gradient norm in `norm_sq[0]` for clipping. `t` is the
    /// 1-based step. Where AdamW updates the weights of `casts`, it writes their FP8 casts in
    /// the same pass ([`Backend::adamw_fp8`]); returns whether it did (Muon's matrices are not
    /// AdamW's: their casts are left as they were).
    #[allow(clippy::too_many_arguments)]
    pub fn step<B: Backend>(
        &mut self,
        be: &mut B,
        par: &mut Parallel<B>,
        (m, v): (View, View),
        norm_sq: View,
        o: &OptimConfig,
        rates: Rates,
        t: u64,
        casts: &[WeightCast],
    ) -> bool {
        if let Some(muon) = &mut self.muon {
            muon.step(be, par, m, norm_sq, o, rates.muon);
        }
        let (params, grads, _) = par.optimizer_buffers();
        let step = AdamWStep {
            lr: rates.adamw as f32,
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            weight_decay: o.weight_decay as f32,
            t,
            max_grad_norm: o.grad_clip as f32,
        };
        if self.muon.is_some() || casts.is_empty() {
            be.adamw(params, grads, m, v, norm_sq, &self.adamw, step);
            return false;
        }
        be.adamw_fp8(params, grads, (m, v), norm_sq, &self.adamw, step, casts);
        true
    }
}

/// The learning rates of step `step` (0-based) of a run of `total_steps`: the schedule of
/// `optim.lr`, and of `optim.muon.lr` (or `optim.lr`).
pub fn rates(o: &OptimConfig, total_steps: usize, step: usize) -> Rates {
    let adamw = schedule::learning_rate(o, total_steps, step);
    let muon = match o.muon.lr {
        0.0 => adamw,
        lr => schedule::learning_rate(&OptimConfig { lr, ..o.clone() }, total_steps, step),
    };
    Rates { adamw, muon }
}

#[cfg(test)]
mod tests;
