//! The CUDA backend — its host code and the kernel sources NVRTC compiles — against the f32 CPU
//! reference, with the kernels running on the CPU emulator (engine::backend::cuda::emulator):
//! every op against its CPU twin, whole-model loss and gradients, graph replay, recomputation,
//! the memory estimate and a few training steps, on shapes shrunk for the emulator; then
//! document masking (the kernels' document bounds).
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`). Without one the test prints a SKIPPED line and
//! passes, unless `ENGINE_REQUIRE_EMULATOR=1` (CI sets it) makes that a failure.
//! `ENGINE_CHECK_FILTER=text` runs only the checks whose names contain the text (ignoring case).

use engine::backend::cpu::Cpu;
use engine::backend::cuda::{Cuda, emulator};
use engine::backend::{AttnNeeds, AttnShape, Backend, BufKind, SeqSplit};
use engine::config::{AttentionImpl, Family, ModelConfig};
use engine::model::{Alone, Documents, Model, init};
use engine::parity::{self, Scale};

#[test]
fn cuda_backend_matches_the_cpu_reference_on_the_emulator_or_reports_skipped() {
    if !emulator::compiler_available() {
        if std::env::var("ENGINE_REQUIRE_EMULATOR").is_ok_and(|v| v == "1") {
            panic!("ENGINE_REQUIRE_EMULATOR=1 but no C++ compiler was found (install g++ or set CXX)");
        }
        eprintln!("SKIPPED: CUDA emulator checks: no C++ compiler (install g++ or set CXX)");
        return;
    }
    let filter = std::env::var("ENGINE_CHECK_FILTER").unwrap_or_default();
    let scale = Scale { emulated: true, train_steps: 20 };
    let outcomes = parity::run(scale, &mut Cuda::emulated, &filter, &mut |o| {
        eprintln!("{} {:<70} {:6.1} s  {}", if o.passed { "ok  " } else { "FAIL" }, o.name, o.seconds, o.detail)
    });
    let failed: Vec<&str> = outcomes.iter().filter(|o| !o.passed).map(|o| o.name.as_str()).collect();
    assert!(failed.is_empty(), "failed on the emulator: {failed:?}");
    let documents = "document masking".contains(filter.as_str());
    assert!(!outcomes.is_empty() || documents, "no check matches ENGINE_CHECK_FILTER={filter}");
    if documents {
        let start = std::time::Instant::now();
        document_bounds_match_the_cpu();
        masked_attention_matches_the_cpu();
        a_packed_document_has_its_logits_alone();
        cudnn_is_not_chosen_under_document_masking();
        eprintln!("ok   {:<70} {:6.1} s", "document masking", start.elapsed().as_secs_f64());
    }
}

/// `(‖a − b‖ / ‖b‖, max |a − b|)`.
fn errors(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut diff, mut norm, mut max) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = (x - y) as f64;
        (diff, norm, max) = (diff + d * d, norm + (y as f64).powi(2), max.max(d.abs()));
    }
    ((diff / norm.max(1e-30)).sqrt(), max)
}

/// Document bounds and positions of `tokens` (sequences of `seq`) on `be`.
fn bounds<B: Backend>(be: &mut B, tokens: &[u32], seq: usize, eos: u32) -> [Vec<u32>; 2] {
    let (t, s, p) = (be.alloc_idx(tokens.len()), be.alloc_idx(2 * tokens.len()), be.alloc_idx(tokens.len()));
    be.upload_idx(t, tokens);
    be.document_bounds(s, Some(p), t, seq, eos);
    let mut out = [vec![0; 2 * tokens.len()], vec![0; tokens.len()]];
    be.download_idx(s, &mut out[0]);
    be.download_idx(p, &mut out[1]);
    out
}

/// The scans over a block's threads: sequences longer than its 256 threads, EOS at a stretch's
/// edges, two in a row, at a sequence's end, and none in a whole sequence.
fn document_bounds_match_the_cpu() {
    let (seq, batch, eos) = (600, 3, 7u32);
    let mut tokens: Vec<u32> = (0..seq * batch).map(|i| (i as u32).wrapping_mul(2654435761) >> 28).collect();
    tokens.iter_mut().filter(|t| **t == eos).for_each(|t| *t = 1);
    for p in [2, 3, 4, 5, 299, 300, 599, 1 + seq, 2 * seq - 2] {
        tokens[p] = eos; // the third sequence holds none
    }
    let want = bounds(&mut Cpu::new(), &tokens, seq, eos);
    let n = tokens.len();
    assert_eq!((want[0][seq - 1], want[0][n + 6]), (301, 300), "the CPU reference");
    assert_eq!(bounds(&mut Cuda::emulated().unwrap(), &tokens, seq, eos), want, "document bounds on the emulator");
    // On a sequence axis of 3 (chunks of 100): the whole sequences' bounds, and rank 1's rows'
    // positions (chunks 1 and 4), which the EOS at 2..5 and 299 in other ranks' chunks set.
    let split = SeqSplit { rank: 1, ranks: 3 };
    let on = |be: &mut dyn Backend| {
        let (t, s, p) = (be.alloc_idx(tokens.len()), be.alloc_idx(2 * tokens.len()), be.alloc_idx(tokens.len() / 3));
        be.upload_idx(t, &tokens);
        be.document_bounds_split(s, Some(p), t, seq / 3, split, eos);
        let mut out = [vec![0; 2 * tokens.len()], vec![0; tokens.len() / 3]];
        be.download_idx(s, &mut out[0]);
        be.download_idx(p, &mut out[1]);
        out
    };
    let want = on(&mut Cpu::new());
    assert_eq!(
        want[0],
        bounds(&mut Cpu::new(), &tokens, seq, eos)[0],
        "the CPU's split bounds are the whole sequences'"
    );
    assert_eq!(want[1][0], 100 - 6, "position 100 is 94 past the EOS at 5");
    assert_eq!(on(&mut Cuda::emulated().unwrap()), want, "split document bounds on the emulator");
}

/// Masked attention forward and backward against the CPU at a shape of several tiles each way,
/// documents beginning mid-tile, so that the forward pass skips whole key tiles, the backward
/// pass stops before the last query tiles, and tiles are masked element by element; unmasked,
/// the outputs differ.
fn masked_attention_matches_the_cpu() {
    let s = AttnShape { batch: 2, seq: 200, n_heads: 2, n_kv_heads: 1, head_dim: 16, window: 0, scale: None };
    let eos = 1u32;
    let mut tokens = vec![0u32; s.rows()];
    for p in [40, 70, 150, s.seq + 130] {
        tokens[p] = eos;
    }
    let val = |k: usize, salt: usize| (((k * 7919 + salt) % 1000) as f32 / 500.0) - 1.0;
    let qkv: Vec<f32> = (0..s.rows() * s.qkv_width()).map(|k| val(k, 0)).collect();
    let dout: Vec<f32> = (0..s.rows() * s.q_width()).map(|k| val(k, 17)).collect();
    fn run<B: Backend>(be: &mut B, s: AttnShape, x: (&[f32], &[f32], &[u32]), masked: bool) -> [Vec<f32>; 3] {
        let (qkv_h, dout_h, tokens_h) = x;
        let (qkv, dout) = (be.alloc(BufKind::Activations, qkv_h.len()), be.alloc(BufKind::Activations, dout_h.len()));
        let (out, dqkv) = (be.alloc(BufKind::Activations, dout_h.len()), be.alloc(BufKind::Activations, qkv_h.len()));
        let lse = be.alloc(BufKind::Scalars, s.rows() * s.n_heads);
        let (tokens, bounds) = (be.alloc_idx(s.rows()), be.alloc_idx(2 * s.rows()));
        be.upload(qkv, qkv_h);
        be.upload(dout, dout_h);
        be.upload_idx(tokens, tokens_h);
        be.document_bounds(bounds, None, tokens, s.seq, 1);
        if masked {
            be.attention_forward_docs(out, lse, qkv, s, bounds);
            be.attention_backward_docs(dqkv, dout, qkv, out, lse, s, bounds);
        } else {
            be.attention_forward(out, lse, qkv, s);
            be.attention_backward(dqkv, dout, qkv, out, lse, s);
        }
        let mut r = [vec![0.0; out.len], vec![0.0; lse.len], vec![0.0; dqkv.len]];
        be.download(out, &mut r[0]);
        be.download(lse, &mut r[1]);
        be.download(dqkv, &mut r[2]);
        r
    }
    let x = (&qkv[..], &dout[..], &tokens[..]);
    let want = run(&mut Cpu::new(), s, x, true);
    let got = run(&mut Cuda::emulated().unwrap(), s, x, true);
    for (name, g, w, tol) in
        [("out", &got[0], &want[0], 2e-2), ("lse", &got[1], &want[1], 1e-3), ("dqkv", &got[2], &want[2], 3e-2)]
    {
        let (rel, max) = errors(g, w);
        assert!(rel <= tol, "masked attention {name} on the emulator: relative L2 error {rel:.2e} (max {max:.2e})");
    }
    let unmasked = run(&mut Cpu::new(), s, x, false);
    assert!(errors(&unmasked[0], &want[0]).0 > 0.1, "the mask changed nothing");
}

/// A GPT model (learned positions restarted at each document) on the emulator: the logits of a
/// document packed behind another equal those it has alone, within 1e-4, and are the CPU's
/// within bf16's precision.
fn a_packed_document_has_its_logits_alone() {
    let config = ModelConfig {
        family: Family::Gpt,
        vocab_size: 40,
        d_model: 32,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 16,
        mlp_dim: 64,
        max_seq_len: 64,
        norm_eps: 1e-5,
        ..ModelConfig::default()
    };
    const EOS: u32 = 39;
    let (first, second) = ([5, 7, 11, 2, EOS], [3, 8, 13, 21, 34, 1, 9]);
    let (seq, v) = (12, config.vocab_size);
    // Row 0: both documents; row 1: the second alone (what follows it cannot reach it).
    let tokens: Vec<u32> = [&first[..], &second[..], &second[..], &first[..]].concat();
    fn logits<B: Backend>(be: &mut B, config: &ModelConfig, tokens: &[u32], seq: usize) -> Vec<f32> {
        let mut model = Model::new(config);
        model.documents = Some(Documents { eos: 39, reset_positions: true });
        let plan = model.plan(be, tokens.len() / seq, seq);
        be.upload(plan.params, &init::params(&model, 3));
        be.upload_idx(plan.tokens, tokens);
        be.upload_idx(plan.targets, tokens);
        model.forward(be, &plan, None, &mut Alone);
        let mut out = vec![0.0; plan.logits.len];
        be.download(plan.logits, &mut out);
        out
    }
    let gpu = logits(&mut Cuda::emulated().unwrap(), &config, &tokens, seq);
    let packed = &gpu[first.len() * v..seq * v];
    let alone = &gpu[seq * v..(seq + second.len()) * v];
    let (_, max) = errors(packed, alone);
    assert!(max <= 1e-4, "the packed document's logits on the emulator differ from its own by {max:.2e}");
    let (rel, _) = errors(&gpu, &logits(&mut Cpu::new(), &config, &tokens, seq));
    assert!(rel <= 3e-2, "masked logits on the emulator against the CPU: relative L2 error {rel:.2e}");
}

/// cuDNN's attention takes no document mask: "auto" keeps the native kernels and says why,
/// "cudnn" is refused in one line.
fn cudnn_is_not_chosen_under_document_masking() {
    let s = AttnShape { batch: 1, seq: 64, n_heads: 2, n_kv_heads: 1, head_dim: 16, window: 0, scale: None };
    let mut gpu = Cuda::emulated().unwrap();
    let documents = AttnNeeds { documents: true, ..AttnNeeds::default() };
    let err = gpu.select_attention(AttentionImpl::Cudnn, s, documents).unwrap_err().to_string();
    assert!(
        err.starts_with("train.attention = \"cudnn\": data.document_mask = true needs the native kernels"),
        "{err}"
    );
    assert!(!err.contains('\n'), "{err}");
    gpu.select_attention(AttentionImpl::Auto, s, documents).unwrap();
    let described = gpu.describe();
    assert!(described.contains("attention: native kernels (cuDNN not used: data.document_mask"), "{described}");
}
