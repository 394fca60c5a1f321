//! QK-clip (`optim.qk_clip`; with Muon, Kimi K2's MuonClip): after each optimizer step, every
//! attention head whose largest logit `S_h` of the step went past the threshold `τ` has its
//! query and key projections rescaled so that the same inputs would give `τ`:
//!
//! ```text
//! η_h = min(1, τ / S_h)                  S_h = max over the step's queries i and the keys j
//!                                              they see of q_i · k_j · c (c: the softmax scale)
//! multi-head:    W_q,h ← η_h^α W_q,h         W_k,h ← η_h^(1−α) W_k,h
//! grouped-query: W_k,g ← κ_g W_k,g           κ_g = (min over g's query heads of η_h)^(1−α)
//!                W_q,h ← (η_h / κ_g) W_q,h   every head of the group keeps η_h exactly
//! latent (MLA):  q_nope,h ← η_h^α    k_nope,h ← η_h^(1−α)    q_rope,h ← η_h
//!                                    (the RoPE key, shared by every head, stays)
//! ```
//!
//! A key head shared by several query heads cannot take each one's `η^(1−α)`: it takes the
//! smallest, and each query head the rest of its own `η`, so that an unclipped head's logits
//! stay as they were (its queries may grow by `1 / κ_g`) and a clipped head's scale by `η_h`,
//! as with its own key head. Biases (GPT, GPT-OSS) scale with their rows, so the projections'
//! outputs scale exactly. The maxima come from the attention forward passes of the step's
//! micro-batches ([`crate::backend::Backend::attention_logit_max`]), the maximum over the batch
//! axes, read by the host once per step.

use std::ops::Range;

use crate::backend::{Backend, View};
use crate::config::{Family, ModelConfig, OptimConfig};
use crate::parallel::strategies::Parallel;

/// One rescaling: rows `rows` of the tensor named `tensor` (in the whole model's layout,
/// transformers' names) multiplied by `factor`.
#[derive(Debug, Clone, PartialEq)]
pub struct RowScale {
    /// The tensor's name.
    pub tensor: String,
    /// Its rows (`[out, in]`: output features; a bias's elements).
    pub rows: Range<usize>,
    /// What they are multiplied by.
    pub factor: f32,
}

/// The rescalings of whole-model layer `layer` of `m` (the whole model's configuration, not a
/// tensor-parallel slice) from its heads' largest logits `maxima` (`[n_heads]`, −∞ for a head
/// that saw none), for threshold `threshold` and share `alpha`: empty when no head passed it.
/// Each weight's rescaling comes with its bias's where the model has one.
pub fn layer_scales(m: &ModelConfig, layer: usize, maxima: &[f32], threshold: f64, alpha: f64) -> Vec<RowScale> {
    assert_eq!(maxima.len(), m.n_heads, "internal error: QK-clip: one maximum per head");
    let eta: Vec<f64> =
        maxima.iter().map(|&s| if (s as f64) > threshold { threshold / s as f64 } else { 1.0 }).collect();
    if eta.iter().all(|&e| e == 1.0) {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut push = |tensor: String, rows: Range<usize>, factor: f64| {
        if factor != 1.0 {
            out.push(RowScale { tensor, rows, factor: factor as f32 });
        }
    };
    let dh = m.head_dim;
    if let Some(a) = &m.mla {
        let p = format!("model.layers.{layer}.self_attn");
        let q = if a.q_lora_rank > 0 { "q_b_proj" } else { "q_proj" };
        for (h, &e) in eta.iter().enumerate() {
            let (qh, kvh) = (h * dh, h * (a.nope_dim + a.v_dim));
            push(format!("{p}.{q}.weight"), qh..qh + a.nope_dim, e.powf(alpha));
            push(format!("{p}.{q}.weight"), qh + a.nope_dim..qh + dh, e);
            push(format!("{p}.kv_b_proj.weight"), kvh..kvh + a.nope_dim, e.powf(1.0 - alpha));
        }
        return out;
    }
    let group = m.n_heads / m.n_kv_heads;
    // The q and k projections' rows of head h and key head g, and the tensors holding them.
    let (q_rows, k_rows) = (|h: usize| h * dh..(h + 1) * dh, |g: usize| m.q_dim() + g * dh..m.q_dim() + (g + 1) * dh);
    let tensors: Vec<(String, String)> = if m.is_gpt() {
        let p = format!("transformer.h.{layer}.attn.c_attn");
        vec![(format!("{p}.weight"), format!("{p}.weight")), (format!("{p}.bias"), format!("{p}.bias"))]
    } else {
        let p = format!("model.layers.{layer}.self_attn");
        let mut t = vec![(format!("{p}.q_proj.weight"), format!("{p}.k_proj.weight"))];
        if m.family == Family::GptOss {
            t.push((format!("{p}.q_proj.bias"), format!("{p}.k_proj.bias")));
        }
        t
    };
    // Separate q and k tensors count the k rows from their own start.
    let k_offset = if m.is_gpt() { 0 } else { m.q_dim() };
    for g in 0..m.n_kv_heads {
        let heads = g * group..(g + 1) * group;
        let kappa = eta[heads.clone()].iter().copied().fold(1.0, f64::min).powf(1.0 - alpha);
        for (q, k) in &tensors {
            let rows = k_rows(g);
            push(k.clone(), rows.start - k_offset..rows.end - k_offset, kappa);
            for h in heads.clone() {
                push(q.clone(), q_rows(h), eta[h] / kappa);
            }
        }
    }
    out
}

/// What QK-clip found and did after a step, all devices together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Clipped {
    /// The largest attention logit of the step, over every layer and head.
    pub max_logit: f64,
    /// The heads whose projections were rescaled.
    pub heads: usize,
}

/// QK-clip after an optimizer step on device `par`: `maxima` is the plan's
/// [`crate::model::Plan::logit_max`] (`[layers of the whole model × this device's heads]`) as
/// the step's forward passes left it, `global` the whole model's configuration. Takes the
/// maximum over the batch axes, reads it (one small read a step), rescales what this device
/// holds of the projections of every head past `optim.qk_clip`, and reports over the mesh.
pub fn apply<B: Backend>(
    be: &mut B,
    par: &mut Parallel<B>,
    maxima: View,
    global: &ModelConfig,
    o: &OptimConfig,
) -> Clipped {
    par.max_over_batch(be, maxima);
    let mut host = vec![0f32; maxima.len];
    be.download(maxima, &mut host);
    let local = maxima.len / global.n_layers;
    // A tensor group's devices hold consecutive heads (and whole key/value groups).
    let first = par.coords.tensor * local;
    let (mut top, mut clipped, mut scales) = (f32::NEG_INFINITY, 0usize, Vec::new());
    for (layer, mine) in host.chunks(local).enumerate() {
        if mine.iter().all(|s| *s == f32::NEG_INFINITY) {
            continue; // a layer of another stage
        }
        top = mine.iter().copied().fold(top, f32::max);
        clipped += mine.iter().filter(|&&s| s as f64 > o.qk_clip).count();
        let mut all = vec![f32::NEG_INFINITY; global.n_heads];
        all[first..first + local].copy_from_slice(mine);
        scales.extend(layer_scales(global, layer, &all, o.qk_clip, o.qk_clip_alpha));
    }
    // Most steps clip nothing: no need to map the device's pieces then.
    if !scales.is_empty() {
        par.scale_rows(be, scales.iter().map(|r| (r.tensor.as_str(), r.rows.clone(), r.factor)));
    }
    let max_logit = par.max_over_world(be, top) as f64;
    // Every device of a batch group counted the same heads.
    let heads = par.sum_over_world(be, clipped as f32).round() as usize / par.batch_devices();
    Clipped { max_logit, heads }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::recipe::resolve;

    fn model(recipe: &str) -> ModelConfig {
        resolve(recipe, &[]).expect("recipe").config.model
    }

    /// Multi-head attention: a clipped head's q and k rows take η^α and η^(1−α), the others
    /// nothing; GPT's packed c_attn and its bias alike.
    #[test]
    fn multi_head_rows_take_their_share() {
        let m = model("tiny-gpt");
        let (h, dh) = (m.n_heads, m.head_dim);
        let mut maxima = vec![1.0f32; h];
        maxima[1] = 40.0;
        let s = layer_scales(&m, 2, &maxima, 10.0, 0.5);
        let w = "transformer.h.2.attn.c_attn.weight";
        let eta = 0.25f64;
        assert!(s.contains(&RowScale { tensor: w.into(), rows: dh..2 * dh, factor: eta.sqrt() as f32 }));
        let k = h * dh + dh..h * dh + 2 * dh;
        assert!(s.contains(&RowScale { tensor: w.into(), rows: k, factor: eta.sqrt() as f32 }));
        assert_eq!(s.len(), 4, "q and k rows of the weight and the bias: {s:?}");
        assert!(layer_scales(&m, 0, &vec![10.0; h], 10.0, 0.5).is_empty(), "at the threshold: nothing");
    }

    /// Grouped-query attention: the shared key head takes the group's smallest η^(1−α), and
    /// every query head of the group the rest of its own η, so that each head's logits scale
    /// by exactly its η (1 for the unclipped ones).
    #[test]
    fn grouped_heads_each_keep_their_own_eta() {
        let m = model("llama3.2-1b");
        assert!(m.n_heads > m.n_kv_heads, "a grouped-query model");
        let group = m.n_heads / m.n_kv_heads;
        let mut maxima = vec![-3.0f32; m.n_heads];
        maxima[0] = 20.0; // η 0.5 in group 0
        maxima[1] = 12.5; // η 0.8 in group 0
        let (alpha, s) = (0.3, layer_scales(&m, 0, &maxima, 10.0, 0.3));
        let factor = |t: &str, row: usize| {
            s.iter()
                .filter(|r| r.tensor.ends_with(t) && r.rows.contains(&row))
                .map(|r| r.factor as f64)
                .product::<f64>()
        };
        let kappa = 0.5f64.powf(1.0 - alpha);
        assert!((factor("k_proj.weight", 0) - kappa).abs() < 1e-6);
        for (h, eta) in (0..group).map(|h| (h, [0.5, 0.8].get(h).copied().unwrap_or(1.0))) {
            let q = factor("q_proj.weight", h * m.head_dim);
            assert!((q * kappa - eta).abs() < 1e-6, "head {h}: logits scale by {} for η {eta}", q * kappa);
        }
        assert_eq!(factor("k_proj.weight", m.head_dim), 1.0, "other groups untouched");
        assert_eq!(factor("q_proj.weight", group * m.head_dim), 1.0);
    }

    /// Latent attention: the nope parts share η, the query's rope part takes all of it, the
    /// shared RoPE key nothing.
    #[test]
    fn latent_attention_follows_kimi_k2() {
        let m = model("tiny-deepseek-v3");
        let a = m.mla.clone().expect("latent attention");
        let mut maxima = vec![0.0f32; m.n_heads];
        maxima[1] = 200.0;
        let s = layer_scales(&m, 1, &maxima, 100.0, 0.5);
        let q = if a.q_lora_rank > 0 { "q_b_proj" } else { "q_proj" };
        let p = "model.layers.1.self_attn";
        let qh = m.head_dim;
        let root = 0.5f32.sqrt();
        assert_eq!(s.len(), 3, "{s:?}");
        assert!(s.contains(&RowScale { tensor: format!("{p}.{q}.weight"), rows: qh..qh + a.nope_dim, factor: root }));
        assert!(s.contains(&RowScale {
            tensor: format!("{p}.{q}.weight"),
            rows: qh + a.nope_dim..2 * qh,
            factor: 0.5
        }));
        let kv = a.nope_dim + a.v_dim;
        assert!(s.contains(&RowScale {
            tensor: format!("{p}.kv_b_proj.weight"),
            rows: kv..kv + a.nope_dim,
            factor: root
        }));
    }
}
