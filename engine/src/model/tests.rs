//! Whole-model checks: the backward pass against finite differences of the training objective
//! (mean cross-entropy + coefficient × load-balancing loss) for a small model of each family,
//! and determinism across thread counts.

use super::{Documents, LOSS_SUM, Model, Plan, init};
use crate::backend::Backend;
use crate::backend::cpu::Cpu;
use crate::config::{Family, ModelConfig, MoeConfig, Remat, RopeScaling};
use crate::rng;

fn small(family: Family) -> ModelConfig {
    ModelConfig {
        family,
        vocab_size: 37,
        d_model: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 6,
        mlp_dim: 24,
        max_seq_len: 64,
        init_std: 0.3,
        ..ModelConfig::default()
    }
}

/// A model with its parameters, and a batch of tokens uploaded.
struct Setup {
    model: Model,
    cpu: Cpu,
    plan: Plan,
    params: Vec<f32>,
}

fn setup(config: ModelConfig, batch: usize, seq: usize) -> Setup {
    setup_with(config, batch, seq, Remat::None, None)
}

/// With `documents`, positions 3 and 7 of every sequence hold its EOS.
fn setup_with(config: ModelConfig, batch: usize, seq: usize, remat: Remat, documents: Option<Documents>) -> Setup {
    let mut model = Model::new(&config);
    model.remat = remat;
    model.documents = documents;
    setup_model(model, batch, seq)
}

/// [`setup_with`] for a model with its options set.
fn setup_model(model: Model, batch: usize, seq: usize) -> Setup {
    let (config, documents) = (model.config.clone(), model.documents);
    let mut cpu = Cpu::new();
    let plan = model.plan(&mut cpu, batch, seq);
    let params = init::params(&model, 5);
    cpu.upload(plan.params, &params);
    let n = batch * seq;
    let mut stream: Vec<u32> =
        (0..=n).map(|i| (rng::bits(11, 0, i as u64) % config.vocab_size as u64) as u32).collect();
    if let Some(d) = documents {
        stream.iter_mut().enumerate().filter(|(i, _)| i % seq == 3 || i % seq == 7).for_each(|(_, t)| *t = d.eos);
    }
    cpu.upload_idx(plan.tokens, &stream[..n]);
    cpu.upload_idx(plan.targets, &stream[1..]);
    Setup { model, cpu, plan, params }
}

impl Setup {
    /// The objective at the current parameters, in f64 from the per-token losses.
    fn objective(&mut self) -> f64 {
        self.model.forward(&mut self.cpu, &self.plan, None, &mut crate::model::Alone);
        let mut losses = vec![0f32; self.plan.losses.len];
        self.cpu.download(self.plan.losses, &mut losses);
        let ce = losses.iter().map(|&l| l as f64).sum::<f64>() / losses.len() as f64;
        let coef = self.model.config.moe.as_ref().map_or(0.0, |m| m.aux_loss_coef);
        ce + coef * self.model.aux_loss(&mut self.cpu, &self.plan)
    }

    /// The analytic gradient of [`Setup::objective`].
    fn gradient(&mut self) -> Vec<f32> {
        let n = self.plan.losses.len as f32;
        self.cpu.fill(self.plan.grads, 0.0);
        self.model.forward(&mut self.cpu, &self.plan, Some(1.0 / n), &mut crate::model::Alone);
        let aux = self.model.aux_scale(&self.plan, 1.0);
        self.model.backward(&mut self.cpu, &self.plan, aux, &mut crate::model::Alone);
        let mut g = vec![0f32; self.plan.grads.len];
        self.cpu.download(self.plan.grads, &mut g);
        g
    }

    fn set_params(&mut self, p: &[f32]) {
        self.cpu.upload(self.plan.params, p);
    }
}

/// For every tensor, compares the directional derivative along a direction close to the
/// gradient with central differences of the objective.
fn check_model(name: &str, config: ModelConfig, batch: usize, seq: usize) {
    check_setup(name, setup(config, batch, seq));
}

fn check_setup(name: &str, s: Setup) {
    check_setup_with(name, s, 3e-3);
}

/// [`check_setup`] with central differences of step `h`.
fn check_setup_with(name: &str, mut s: Setup, h: f64) {
    let grad = s.gradient();
    let base = s.params.clone();
    let tensors = s.model.layout.tensors.clone();
    for (stream, t) in tensors.iter().enumerate() {
        let range = t.offset..t.offset + t.len();
        let g = &grad[range.clone()];
        let g_norm = g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        // Half along the gradient, half random: a wrong magnitude or direction both show. An
        // expert no token was routed to has no gradient: then the objective must not move.
        let noise: Vec<f64> = (0..t.len()).map(|i| 2.0 * rng::uniform(3, stream as u64, i as u64) - 1.0).collect();
        let noise_norm = noise.iter().map(|x| x * x).sum::<f64>().sqrt();
        let along = if g_norm > 0.0 { 1.0 / g_norm } else { 0.0 };
        let u: Vec<f64> = g.iter().zip(&noise).map(|(&g, &r)| g as f64 * along + r / noise_norm).collect();
        let analytic: f64 = g.iter().zip(&u).map(|(&g, &u)| g as f64 * u).sum();
        // `h`: small enough that curvature stays below the tolerance, large enough for f32 noise.
        let mut eval = |sign: f64| {
            let mut p = base.clone();
            for (x, d) in p[range.clone()].iter_mut().zip(&u) {
                *x += (sign * h * d) as f32;
            }
            s.set_params(&p);
            s.objective()
        };
        let numeric = (eval(1.0) - eval(-1.0)) / (2.0 * h);
        if t.is_buffer() {
            // DeepSeek-V3's selection bias is not trained by gradients: it has none, and
            // moving it moves the objective only where it changes a choice of experts.
            assert_eq!(g_norm, 0.0, "{name}: {}", t.name);
            continue;
        }
        if g_norm == 0.0 {
            assert!(
                t.name.contains("experts") && numeric.abs() < 1e-4,
                "{name}: {}: no gradient, yet {numeric:e}",
                t.name
            );
            continue;
        }
        let relative = (numeric - analytic).abs() / analytic.abs();
        assert!(
            relative < 2e-3,
            "{name}: {}: analytic {analytic:.6e} vs numeric {numeric:.6e} ({relative:.1e})",
            t.name
        );
    }
}

#[test]
fn llama_with_rope_scaling() {
    let config = ModelConfig {
        rope_scaling: Some(RopeScaling {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 2.0,
            original_max_seq_len: 8,
        }),
        rope_theta: 50.0,
        ..small(Family::Llama)
    };
    check_model("llama", config, 2, 7);
}

#[test]
fn mistral_with_a_window_shorter_than_the_sequence() {
    check_model("mistral", ModelConfig { sliding_window: 3, n_kv_heads: 1, ..small(Family::Mistral) }, 2, 8);
}

#[test]
fn mixtral_top2_of_4_with_the_auxiliary_loss() {
    let moe = MoeConfig { num_experts: 4, aux_loss_coef: 0.5, ..MoeConfig::default() };
    check_model("mixtral", ModelConfig { moe: Some(moe), ..small(Family::Mixtral) }, 2, 12);
}

/// QK-norm over 4 query and 2 key/value heads wider than `d_model / heads`, as Qwen3's.
#[test]
fn qwen3_with_qk_norm() {
    check_model("qwen3", ModelConfig { head_dim: 12, ..small(Family::Qwen3) }, 2, 7);
}

/// Gemma 3 in small: sandwich norms with `1 + w` weights, QK-norm, GeGLU, the embedding scaled
/// by √d, `query_pre_attn_scalar`, sliding layers on a local RoPE base among global ones on a
/// linearly scaled base, the final logits soft-capped, tied embeddings.
fn gemma3() -> ModelConfig {
    ModelConfig {
        head_dim: 12,
        n_layers: 3,
        sliding_window: 3,
        window_pattern: 3,
        rope_theta: 100.0,
        rope_local_theta: 10.0,
        rope_linear_factor: 2.0,
        query_pre_attn_scalar: 20.0,
        final_logit_softcap: 1.5,
        tie_embeddings: true,
        ..small(Family::Gemma3)
    }
}

#[test]
fn gemma3_sandwich_norms_local_and_global_layers_and_a_softcap() {
    check_model("gemma3", gemma3(), 2, 7);
}

/// Qwen3-MoE with `norm_topk_prob = false`: the weights are the softmax's probabilities.
#[test]
fn qwen3_moe_top2_of_4_without_renormalisation() {
    let moe = MoeConfig { num_experts: 4, aux_loss_coef: 0.5, renormalize: false, ..MoeConfig::default() };
    check_model("qwen3_moe", ModelConfig { moe: Some(moe), ..small(Family::Qwen3Moe) }, 2, 12);
}

/// DeepSeek-V3 in small: latent attention (with a query latent or without, interleaved RoPE or
/// not, YaRN with `mscale_all_dim`), a dense first layer, then sigmoid routing over 8 experts in
/// 4 groups (2 kept) with a nonzero selection bias, scaled weights and a shared expert.
fn deepseek(q_lora_rank: usize, interleave: bool, yarn: bool) -> ModelConfig {
    use crate::config::{MlaConfig, Scoring, Yarn};
    let moe = MoeConfig {
        num_experts: 8,
        top_k: 3,
        aux_loss_coef: 0.0,
        scoring: Scoring::Sigmoid,
        groups: 4,
        top_groups: 2,
        routed_scale: 2.5,
        selection_bias: true,
        shared_experts: 1,
        dense_layers: vec![0],
        dense_mlp_dim: 20,
        ..MoeConfig::default()
    };
    let mla = MlaConfig {
        q_lora_rank,
        kv_lora_rank: 8,
        nope_dim: 4,
        rope_dim: 2,
        v_dim: 4,
        interleave,
        ..MlaConfig::default()
    };
    ModelConfig {
        n_kv_heads: 4,
        mlp_dim: 8,
        moe: Some(moe),
        mla: Some(mla),
        yarn: yarn.then(|| Yarn { factor: 4.0, original_max_seq_len: 4, mscale_all_dim: 0.8, ..Yarn::default() }),
        ..small(Family::DeepseekV3)
    }
}

#[test]
fn deepseek_v3_latent_attention_and_grouped_sigmoid_routing() {
    for (q_lora, interleave, yarn) in [(12, true, true), (0, false, false)] {
        let name = format!("deepseek q_lora {q_lora}, interleave {interleave}, yarn {yarn}");
        let mut s = setup(deepseek(q_lora, interleave, yarn), 2, 7);
        // A selection bias that decides every choice, with margins wider than the sigmoid's
        // range: groups 0 and 2 are kept (their experts 0, 1 and 4 win the top 3), whatever
        // the scores. Finite differences need choices that do not flip; the weights still
        // come from the scores alone, which the check sees.
        let bias = [3.0, 3.0, -3.0, -3.0, 2.0, 0.0, -3.0, -3.0];
        for t in &s.model.layout.tensors {
            if t.name.ends_with("e_score_correction_bias") {
                s.params[t.offset..t.offset + t.len()].copy_from_slice(&bias);
            }
        }
        let params = s.params.clone();
        s.set_params(&params);
        // The query latent's RMSNorm over 12 small values curves the objective: 3e-3 steps
        // leave up to 1e-2 of curvature in the central difference, 5e-4 steps none.
        check_setup_with(&name, s, 5e-4);
    }
}

#[test]
fn tied_embeddings() {
    check_model("tied", ModelConfig { tie_embeddings: true, n_kv_heads: 4, ..small(Family::Llama) }, 1, 9);
}

fn gpt() -> ModelConfig {
    ModelConfig { n_kv_heads: 4, norm_eps: 1e-5, ..small(Family::Gpt) }
}

#[test]
fn gpt_untied_with_tanh_gelu() {
    check_model("gpt", gpt(), 2, 7);
}

#[test]
fn gpt_tied_with_erf_gelu() {
    use crate::config::Gelu;
    check_model("gpt tied", ModelConfig { tie_embeddings: true, gelu: Gelu::Erf, ..gpt() }, 1, 9);
}

/// Document masking: attention stops at each EOS, and the GPT family's positions restart there.
#[test]
fn document_masking_with_and_without_reset_positions() {
    for (name, config, reset) in [("gpt documents", gpt(), true), ("llama documents", small(Family::Llama), false)] {
        let documents = Some(Documents { eos: 5, reset_positions: reset });
        check_setup(name, setup_with(config, 2, 11, Remat::None, documents));
    }
}

/// One training step's gradients and loss, on a rayon pool of `threads` threads.
fn step_bits(config: &ModelConfig, threads: usize) -> (Vec<u32>, u32) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let mut s = setup(config.clone(), 2, 16);
        let g = s.gradient();
        let mut loss = [0f32; 1];
        s.cpu.download(s.plan.scalars.at(LOSS_SUM, 1), &mut loss);
        (g.iter().map(|x| x.to_bits()).collect(), loss[0].to_bits())
    })
}

#[test]
fn gradients_are_bitwise_identical_whatever_the_thread_count() {
    for config in [
        ModelConfig { d_model: 96, mlp_dim: 160, ..small(Family::Llama) },
        ModelConfig { moe: Some(MoeConfig::default()), d_model: 64, ..small(Family::Mixtral) },
        ModelConfig { d_model: 96, mlp_dim: 160, ..gpt() },
    ] {
        let one = step_bits(&config, 1);
        for threads in [2, 3, 5] {
            assert!(one == step_bits(&config, threads), "{:?} differs with {threads} threads", config.family);
        }
    }
}

/// Recomputation refills activations with the very ops that made them, so the gradients may not
/// change by a bit; and each policy keeps less than the one before.
#[test]
fn recomputation_changes_memory_but_not_a_bit_of_the_gradients() {
    let moe = MoeConfig { num_experts: 4, aux_loss_coef: 0.5, ..MoeConfig::default() };
    for config in [
        small(Family::Llama),
        ModelConfig { sliding_window: 3, ..small(Family::Mistral) },
        ModelConfig { moe: Some(moe), ..small(Family::Mixtral) },
        gpt(),
        small(Family::Qwen3),
        gemma3(),
    ] {
        let mut grads = Vec::new();
        let mut sizes = Vec::new();
        for remat in [Remat::None, Remat::Minimal, Remat::Full] {
            let mut s = setup_with(config.clone(), 2, 9, remat, None);
            sizes.push(s.model.activation_elements(2, 9));
            grads.push(s.gradient().iter().map(|g| g.to_bits()).collect::<Vec<_>>());
        }
        assert!(grads[1] == grads[0], "{:?}: minimal recomputation changed the gradients", config.family);
        assert!(grads[2] == grads[0], "{:?}: full recomputation changed the gradients", config.family);
        assert!(sizes[1].activations < sizes[0].activations, "{:?}: {sizes:?}", config.family);
        assert!(sizes[2].activations < sizes[1].activations, "{:?}: {sizes:?}", config.family);
        assert!(sizes[2].scalars < sizes[0].scalars, "{:?}: {sizes:?}", config.family);
    }
}

/// QK-clip's rescaling (`optim/qk_clip.rs`) does what it promises, for every kind of attention:
/// after it, the same batch gives each clipped head of the first layer exactly the threshold as
/// its largest logit and every other head its old one. Grouped-query (Llama), multi-head with
/// the packed projection's bias (GPT), grouped-query with biases and sinks (GPT-OSS), latent
/// with and without a query latent and YaRN's scale (DeepSeek-V3); the maxima recorded are
/// those of the forward pass (the first layer's input does not depend on the rescaling).
#[test]
fn qk_clip_brings_each_clipped_head_to_the_threshold() {
    use crate::optim::qk_clip::layer_scales;
    let oss = ModelConfig {
        family: Family::GptOss,
        n_kv_heads: 2,
        sliding_window: 4,
        window_pattern: 2,
        moe: Some(MoeConfig { num_experts: 4, top_k: 2, ..MoeConfig::default() }),
        ..small(Family::GptOss)
    };
    let kinds = [
        ("llama", small(Family::Llama)),
        ("gpt", gpt()),
        ("gpt-oss", oss),
        ("deepseek", deepseek(12, true, true)),
        ("deepseek without a query latent", deepseek(0, false, false)),
    ];
    for (name, config) in kinds {
        let mut model = Model::new(&config);
        model.logit_max = true;
        let mut s = setup_model(model, 2, 7);
        let maxima = |s: &mut Setup| {
            let m = s.plan.logit_max.expect("planned");
            s.cpu.fill(m, f32::NEG_INFINITY);
            s.model.forward(&mut s.cpu, &s.plan, None, &mut crate::model::Alone);
            let mut out = vec![0f32; m.len];
            s.cpu.download(m, &mut out);
            out
        };
        let h = config.n_heads;
        let before = maxima(&mut s)[..h].to_vec();
        let mut sorted = before.clone();
        sorted.sort_by(f32::total_cmp);
        let tau = (sorted[h / 2 - 1] + sorted[h / 2]) as f64 / 2.0;
        assert!(tau > 0.0 && sorted[0] < sorted[h - 1], "{name}: maxima {before:?}");
        let mut params = s.params.clone();
        for r in layer_scales(&config, 0, &before, tau, 0.3) {
            let t = s.model.layout.tensors.iter().find(|t| t.name == r.tensor).expect("tensor");
            let cols = t.shape.get(1).copied().unwrap_or(1);
            params[t.offset + r.rows.start * cols..t.offset + r.rows.end * cols]
                .iter_mut()
                .for_each(|p| *p *= r.factor);
        }
        s.set_params(&params);
        let after = maxima(&mut s);
        for (head, (&b, &a)) in before.iter().zip(&after).enumerate() {
            let want = (b as f64).min(tau);
            assert!(
                (a as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{name}, head {head}: {a} after, want {want} (before {b}, threshold {tau})"
            );
        }
    }
}
