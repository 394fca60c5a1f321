//! Each op of the CUDA backend against its CPU twin: the same inputs on both, one call, the
//! outputs compared with the tolerance of their type.

use super::{BF16, EXACT, F32, Tol, compare, failure};
use crate::backend::cpu::Cpu;
use crate::backend::cuda::Cuda;
use crate::backend::{
    AdamWStep, AttnNeeds, AttnShape, Backend, BufKind, ExpertWeights, IdxView, MatMul, MoeDispatch, MuonMomentum,
    Parts, Routing, Scoring, Segment, SeqSplit, View, clip_scale,
};
use crate::config::AttentionImpl;
use crate::rng;
use BufKind::{Activations as ACT, Fp8 as FP8, Grads as GRAD, OptState as OPT, Params as PARAM, Scalars as F32S};

/// The same buffers on the CPU and the GPU, filled with the same values.
struct Twin {
    cpu: Cpu,
    gpu: Cuda,
    draws: u64,
    notes: Vec<String>,
}

impl Twin {
    fn new(gpu: Cuda) -> Twin {
        Twin { cpu: Cpu::new(), gpu, draws: 0, notes: Vec::new() }
    }

    fn alloc(&mut self, kind: BufKind, len: usize) -> View {
        let (a, b) = (self.cpu.alloc(kind, len), self.gpu.alloc(kind, len));
        assert_eq!(a, b, "the backends number buffers alike");
        a
    }

    fn idx(&mut self, data: &[u32]) -> IdxView {
        let (a, b) = (self.cpu.alloc_idx(data.len()), self.gpu.alloc_idx(data.len()));
        assert_eq!(a, b);
        self.cpu.upload_idx(a, data);
        self.gpu.upload_idx(a, data);
        a
    }

    /// Values `scale · N(0, 1)`, rounded to bf16 for kinds the GPU keeps in bf16.
    fn random(&mut self, kind: BufKind, len: usize, scale: f32) -> View {
        self.draws += 1;
        let data: Vec<f32> = (0..len).map(|i| scale * rng::normal_pair(99, self.draws, i as u64).0).collect();
        self.set(kind, &data)
    }

    fn set(&mut self, kind: BufKind, data: &[f32]) -> View {
        let v = self.alloc(kind, data.len());
        let rounded: Vec<f32> = if matches!(kind, BufKind::Activations | BufKind::Params | BufKind::Gathered) {
            data.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
        } else {
            data.to_vec()
        };
        self.cpu.upload(v, &rounded);
        self.gpu.upload(v, &rounded);
        v
    }

    fn both(&mut self, f: impl Fn(&mut dyn Backend)) {
        f(&mut self.cpu);
        f(&mut self.gpu);
    }

    fn check(&mut self, what: &str, v: View, tol: Tol) -> Result<(), String> {
        let (mut c, mut g) = (vec![0f32; v.len], vec![0f32; v.len]);
        self.cpu.download(v, &mut c);
        self.gpu.download(v, &mut g);
        self.notes.push(compare(what, &c, &g, tol)?);
        Ok(())
    }

    fn check_idx(&mut self, what: &str, v: IdxView) -> Result<(), String> {
        let (mut c, mut g) = (vec![0u32; v.len], vec![0u32; v.len]);
        self.cpu.download_idx(v, &mut c);
        self.gpu.download_idx(v, &mut g);
        match c.iter().zip(&g).position(|(a, b)| a != b) {
            None => {
                self.notes.push(format!("{what} exact"));
                Ok(())
            }
            Some(i) => Err(format!("{what}: entry {i} is {} on the GPU, {} on the CPU", g[i], c[i])),
        }
    }

    fn done(self) -> Result<String, String> {
        Ok(self.notes.join(", "))
    }
}

/// Fills, converting copies and adds between the types, and both sums.
pub(super) fn elementwise(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 3001;
    // Each op reads inputs no other op wrote: a bf16 result differs from the CPU's f32 one.
    let (a, b, c, d) = (t.random(ACT, n, 1.0), t.random(ACT, n, 1.0), t.random(ACT, n, 1.0), t.random(ACT, n, 1.0));
    let (f, g, out) = (t.random(F32S, n, 1.0), t.random(GRAD, n, 1.0), t.alloc(F32S, 5));
    let (copies, to_bf16) = (t.alloc(F32S, n), t.alloc(ACT, n));
    t.both(|be| {
        be.sum(out.at(0, 1), c);
        be.sum_squares(out.at(1, 1), g);
        be.sum(out.at(2, 1), f);
        be.sum_squares(out.at(3, 1), d);
        // From one element in: not 16-byte aligned, so the scalar f32 kernel (the aligned
        // sums above take the 4-wide one, with a tail of 3001 % 4 elements).
        be.sum_squares(out.at(4, 1), f.at(1, n - 1));
        be.copy(copies.at(0, 1000), c.at(0, 1000));
        be.copy(copies.at(1000, 1000), g.at(0, 1000));
        be.fill(copies.at(2000, 1001), 0.25);
        be.copy(to_bf16.at(0, 1000), d.at(0, 1000));
        be.copy(to_bf16.at(1000, 2001), f.at(0, 2001));
        be.add(a, b);
        be.add(g, c);
        be.add(d, f);
    });
    t.check("sums", out, F32)?;
    t.check("copies and fill into f32", copies, F32)?;
    t.check("copies into bf16", to_bf16, BF16)?;
    t.check("add bf16+bf16", a, BF16)?;
    t.check("add f32+bf16", g, F32)?;
    t.check("add bf16+f32", d, BF16)?;
    t.done()
}

/// `Backend::scale` (`x *= s`) on bf16 activations (the embedding's √d and its gradient), on f32
/// scalars and on an f32 gradient from its second element (not 16-byte aligned), `n` elements.
/// An f32 product is one rounding on both backends: exact.
pub(super) fn scale(gpu: Cuda, n: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (a, f, g) = (t.random(ACT, n, 1.0), t.random(F32S, n, 1.0), t.random(GRAD, n, 1.0));
    t.both(|be| {
        be.scale(a, 128f32.sqrt());
        be.scale(f, -0.37);
        be.scale(g.at(1, n - 2), 11.3);
    });
    t.check("bf16", a, BF16)?;
    t.check("f32", f, EXACT)?;
    t.check("f32 from element 1 (its ends unscaled)", g, EXACT)?;
    t.done()
}

/// Final-logit soft-capping (`y = cap · tanh(x / cap)`) and its gradient (`dx *= 1 − tanh²(x /
/// cap)` at the uncapped x), as the model runs them: the logits copied aside, capped in place,
/// the gradient taken in place at the copy. On the logits' kind (bf16 activations, as the plan
/// holds them) and on f32, over `n` values of scale 4·cap — a third of them past 4·cap (tanh
/// 0.9993), some past 10·cap (tanh 1 in f32) — and a few fixed ones: 0, ±cap, ±10⁴·cap.
pub(super) fn softcap(gpu: Cuda, n: usize, cap: f32) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let mut x: Vec<f32> = (0..n).map(|i| 4.0 * cap * rng::normal_pair(11, 0, i as u64).0).collect();
    x.extend([0.0, cap, -cap, 1e4 * cap, -1e4 * cap]);
    let n = x.len();
    let past = |k: f32| x.iter().filter(|v| v.abs() > k * cap).count();
    let (past4, past10) = (past(4.0), past(10.0));
    if past4 < n / 4 || past10 < 5 {
        return Err(format!("{past4} of {n} values past 4·cap, {past10} past 10·cap: too few saturate"));
    }
    for (name, kind, tol) in [("bf16", ACT, BF16), ("f32", F32S, F32)] {
        let (logits, dlogits) = (t.set(kind, &x), t.random(kind, n, 1.0));
        let precap = t.alloc(kind, n);
        t.both(|be| {
            be.copy(precap, logits);
            be.softcap_forward(logits, cap);
            be.softcap_backward(dlogits, precap, cap);
        });
        t.check(&format!("{name}: capped"), logits, tol)?;
        t.check(&format!("{name}: gradient"), dlogits, tol)?;
        // Capped values stay within the cap: tanh never passes 1 (bf16's rounding of cap · 1
        // is cap's, the largest value's).
        let mut g = vec![0f32; n];
        t.gpu.download(logits, &mut g);
        let top = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        if top > cap * (1.0 + 4e-3) {
            return Err(format!("{name}: a capped value is {top}, past the cap {cap}"));
        }
    }
    t.notes.push(format!("{past4} of {n} values past 4·cap, {past10} past 10·cap"));
    t.done()
}

/// Products as the linear layers use them: forward, with a residual added, dx, dW, into f32.
pub(super) fn matmul(gpu: Cuda, m: usize, n: usize, k: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (x, w) = (t.random(ACT, m * k, 1.0), t.random(PARAM, n * k, 0.05));
    let (y, res) = (t.alloc(ACT, m * n), t.random(ACT, m * n, 1.0));
    let dy = t.random(ACT, m * n, 1.0);
    let (dx, dw) = (t.alloc(ACT, m * k), t.random(GRAD, n * k, 0.1));
    let (logits, stream, sum) = (t.alloc(F32S, m * n), t.random(ACT, m * n, 1.0), t.alloc(ACT, m * n));
    t.both(|be| {
        be.matmul(y, x, w, MatMul::linear(m, k, n));
        be.matmul(res, x, w, MatMul::linear(m, k, n).accumulating());
        be.matmul_add(sum, x, w, stream, MatMul::linear(m, k, n));
        be.matmul(dx, dy, w, MatMul::linear_dx(m, k, n));
        be.matmul(dw, dy, x, MatMul::linear_dw(m, k, n));
        be.matmul(logits, x, w, MatMul::linear(m, k, n));
    });
    t.check("x·Wᵀ", y, BF16)?;
    t.check("residual + x·Wᵀ", res, BF16)?;
    t.check("residual + x·Wᵀ into another buffer", sum, BF16)?;
    t.check("dy·W", dx, BF16)?;
    t.check("dW += dyᵀ·x (f32)", dw, F32)?;
    t.check("x·Wᵀ into f32", logits, F32)?;
    t.done()
}

/// FP8 casts (tensorwise and delayed, E4M3 and E5M2, plain, transposed and both layouts in one
/// pass, the delayed recipe's amax taken as it casts), the delayed recipe's update and the FP8
/// products in their one layout, into bf16 and accumulated into f32.
/// The casts read bf16 inputs on both backends, so their bytes must be equal: the GPU's rounding
/// is the CPU reference's (the float8 crate's, CUDA's saturating round-to-nearest-even).
pub(super) fn fp8(gpu: Cuda, m: usize, n: usize, k: usize) -> Result<String, String> {
    use crate::backend::fp8::{Fp8Format, Scaling, State};
    let mut t = Twin::new(gpu);
    let (x, w, dy) = (t.random(ACT, m * k, 3.0), t.random(PARAM, n * k, 0.05), t.random(ACT, m * n, 1e-3));
    let history = 3;
    let state = |t: &mut Twin, format: Fp8Format| {
        let v = t.set(F32S, &State::initial(format, history));
        State { view: v, format }
    };
    let (sx, sw, sdy) =
        (state(&mut t, Fp8Format::E4M3), state(&mut t, Fp8Format::E4M3), state(&mut t, Fp8Format::E5M2));
    let (xq, wq, dyq, dyq_t) = (t.alloc(FP8, m * k), t.alloc(FP8, n * k), t.alloc(FP8, m * n), t.alloc(FP8, m * n));
    let (y, dw) = (t.alloc(ACT, m * n), t.random(GRAD, n * k, 0.1));
    let (residual, sum) = (t.random(ACT, m * n, 1.0), t.alloc(ACT, m * n));
    let delayed = state(&mut t, Fp8Format::E4M3);
    let xd = t.alloc(FP8, m * k);
    t.both(|be| {
        be.fp8_quantize(xq, x, sx, Scaling::Current, None);
        be.fp8_quantize(wq, w, sw, Scaling::Current, None);
        be.fp8_quantize(dyq, dy, sdy, Scaling::Current, None);
        // A second cast of dy takes the scale the first set (no amax pass).
        be.fp8_quantize(dyq_t, dy, sdy, Scaling::Again, Some(n));
        be.matmul_fp8(y, xq, wq, MatMul::linear(m, k, n), [sx, sw], true);
        be.matmul_fp8_add(sum, xq, wq, residual, MatMul::linear(m, k, n), [sx, sw], true);
        // dW[n, k] += dyᵀ · x as a · bᵀ: (dyᵀ)[n, m] · ((xᵀ)[k, m])ᵀ, xᵀ cast transposed.
        be.fp8_quantize(xd, x, sx, Scaling::Current, Some(k));
        be.matmul_fp8(dw, dyq_t, xd, MatMul { a_t: false, b_t: true, ..MatMul::linear_dw(m, k, n) }, [sdy, sx], false);
        // Delayed: the first step casts with scale 1 and records the amax; the update sets the
        // next scale from the history.
        be.fp8_quantize(xq, x, delayed, Scaling::Delayed, None);
        be.fp8_delayed_update(delayed.view, delayed.view.len, 1);
    });
    // FSDP's tensorwise weights: the amaxes of two pieces recorded without a cast, then a
    // state without history takes its scale from them: W's whole cast's scale.
    let pieces = t.set(F32S, &State::initial(Fp8Format::E4M3, 0));
    let pieces = State { view: pieces, format: Fp8Format::E4M3 };
    t.both(|be| {
        let half = w.len / 2;
        be.fp8_amax(pieces, w.at(0, half));
        be.fp8_amax(pieces, w.at(half, w.len - half));
        be.fp8_delayed_update(pieces.view, pieces.view.len, 0);
    });
    // The fused casts (the GPU's one pass for dy's two layouts, the delayed recipe's amax taken
    // as it casts), whose bytes must be the CPU's, which casts as the unfused path does: dy into
    // both layouts, tensorwise and delayed (E5M2), and x transposed, delayed (E4M3), each delayed
    // one cast twice, an update between, so that the second runs at the scale its amax set.
    let (sdy2, dyd, xtd) =
        (state(&mut t, Fp8Format::E5M2), state(&mut t, Fp8Format::E5M2), state(&mut t, Fp8Format::E4M3));
    let [both, both_t, both_d, both_dt] = [0; 4].map(|_| t.alloc(FP8, m * n));
    let xt_d = t.alloc(FP8, m * k);
    t.both(|be| {
        be.fp8_quantize_both(both, both_t, dy, sdy2, Scaling::Current, n);
        for _ in 0..2 {
            be.fp8_quantize_both(both_d, both_dt, dy, dyd, Scaling::Delayed, n);
            be.fp8_quantize(xt_d, x, xtd, Scaling::Delayed, Some(k));
            be.fp8_delayed_update(dyd.view, dyd.view.len, 0);
            be.fp8_delayed_update(xtd.view, xtd.view.len, 0);
        }
    });
    let mut notes = Vec::new();
    for (what, v, format) in [
        ("W (E4M3)", wq, Fp8Format::E4M3),
        ("dy (E5M2)", dyq, Fp8Format::E5M2),
        ("dy transposed (E5M2)", dyq_t, Fp8Format::E5M2),
        ("x transposed (E4M3)", xd, Fp8Format::E4M3),
        ("x at scale 1, delayed (E4M3)", xq, Fp8Format::E4M3),
        ("dy in both layouts in one pass, tensorwise: plain", both, Fp8Format::E5M2),
        ("and transposed", both_t, Fp8Format::E5M2),
        ("dy in both layouts, delayed, amax as it casts: plain", both_d, Fp8Format::E5M2),
        ("and transposed", both_dt, Fp8Format::E5M2),
        ("x transposed, delayed, amax as it casts (E4M3)", xt_d, Fp8Format::E4M3),
    ] {
        let mut c = vec![0f32; v.len];
        t.cpu.download(v, &mut c);
        let g = t.gpu.download_fp8(v, format);
        if let Some(i) = c.iter().zip(&g).position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan())) {
            return Err(format!("cast of {what}: element {i} is {} on the GPU, {} on the CPU", g[i], c[i]));
        }
        notes.push(format!("{what} exact"));
    }
    for (what, s) in [
        ("x", sx),
        ("W", sw),
        ("dy", sdy),
        ("delayed x after the update", delayed),
        ("dy cast into both layouts", sdy2),
        ("delayed dy cast into both layouts, after two updates", dyd),
        ("delayed x cast transposed, after two updates", xtd),
        ("W's pieces' amaxes, scaled without history", pieces),
    ] {
        t.check(&format!("{what}'s scaling state"), s.view, EXACT)?;
    }
    let (mut whole, mut from_pieces) = (vec![0f32; sw.view.len], vec![0f32; pieces.view.len]);
    t.cpu.download(sw.view, &mut whole);
    t.cpu.download(pieces.view, &mut from_pieces);
    if whole[..2] != from_pieces[..2] {
        return Err(format!("W's scale from its pieces' amaxes {:?}, from its whole cast {:?}", from_pieces, whole));
    }
    t.check("x·Wᵀ in FP8 (fast accumulation, bf16 out)", y, BF16)?;
    t.check("residual + x·Wᵀ in FP8, the residual in the epilogue", sum, BF16)?;
    t.check("dW += dyᵀ·x in FP8 (f32)", dw, F32)?;
    Ok(format!("{}, {}", notes.join(", "), t.done()?))
}

/// Embedding lookup and the scatter-add of its gradient, with repeated tokens.
pub(super) fn embedding(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (v, d, n) = (50, 64, 120);
    let table = t.random(PARAM, v * d, 1.0);
    let tokens: Vec<u32> = (0..n).map(|i| (rng::bits(5, 0, i) % 20) as u32).collect(); // repeats
    let tok = t.idx(&tokens);
    let (out, dout, dtable) =
        (t.alloc(ACT, n as usize * d), t.random(ACT, n as usize * d, 1.0), t.random(GRAD, v * d, 0.1));
    // Vocabulary parallelism: a slice of rows 10..30, which half the tokens (0..20) miss.
    let (out_slice, dtable_slice) = (t.alloc(ACT, n as usize * d), t.random(GRAD, 20 * d, 0.1));
    t.both(|be| {
        be.embedding_forward(out, table, tok, d);
        be.embedding_backward(dtable, dout, tok, d);
        be.embedding_forward_slice(out_slice, table.at(10 * d, 20 * d), tok, d, 10);
        be.embedding_backward_slice(dtable_slice, dout, tok, d, 10);
    });
    t.check("forward", out, BF16)?;
    t.check("backward (f32 atomics)", dtable, F32)?;
    t.check("vocabulary slice forward", out_slice, BF16)?;
    t.check("vocabulary slice backward", dtable_slice, F32)?;
    t.done()
}

/// RMSNorm forward and backward (the residual add into dx, the weight gradient) at width `d`,
/// multiplying by `offset + w` (Gemma's 1).
pub(super) fn rmsnorm(gpu: Cuda, d: usize, offset: f32) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let rows = 75;
    let (x, w) = (t.random(ACT, rows * d, 1.0), t.random(PARAM, d, 1.0));
    let (out, rstd) = (t.alloc(ACT, rows * d), t.alloc(F32S, rows));
    let (dout, dx, dw) = (t.random(ACT, rows * d, 1.0), t.random(ACT, rows * d, 1.0), t.random(GRAD, d, 1.0));
    t.both(|be| {
        be.rmsnorm_forward(out, rstd, x, w, offset, d, 1e-5);
        be.rmsnorm_backward(dx, dw, dout, x, w, offset, rstd, d);
    });
    t.check("y", out, BF16)?;
    t.check("rstd", rstd, F32)?;
    t.check("dx (added to the residual's)", dx, BF16)?;
    t.check("dw", dw, Tol { rel_l2: 1e-3, max: 1e-2 })?;
    t.done()
}

/// QK-norm forward and backward on packed qkv rows of shape `s`: q and k normalised (v copied),
/// rstd, the input's gradient in place of the output's (v's unchanged) and the weight gradients
/// added to `dw`; the weights are `offset + w` (Gemma 3's 1).
pub(super) fn qk_norm(gpu: Cuda, s: AttnShape, offset: f32) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (n, dh, heads) = (s.rows() * s.qkv_width(), s.head_dim, s.n_heads + s.n_kv_heads);
    let (qkv, w) = (t.random(ACT, n, 1.0), t.random(PARAM, 2 * dh, 1.0));
    let (out, rstd) = (t.alloc(ACT, n), t.alloc(F32S, s.rows() * heads));
    let (dqkv, dw) = (t.random(ACT, n, 1.0), t.random(GRAD, 2 * dh, 1.0));
    t.both(|be| {
        be.qk_norm_forward(out, rstd, qkv, w, offset, s, 1e-6);
        be.qk_norm_backward(dqkv, dw, qkv, w, offset, rstd, s);
    });
    t.check("y", out, BF16)?;
    t.check("rstd", rstd, F32)?;
    t.check("dqkv (in place)", dqkv, BF16)?;
    t.check("dw", dw, Tol { rel_l2: 1e-3, max: 1e-2 })?;
    // The v parts pass through exactly: y's is qkv's, dqkv's is left as it came.
    let (width, v0) = (s.qkv_width(), heads * dh);
    for (what, on_gpu, on_cpu) in [("y's v part", out, qkv), ("dqkv's v part", dqkv, dqkv)] {
        let (mut g, mut c) = (vec![0f32; n], vec![0f32; n]);
        t.gpu.download(on_gpu, &mut g);
        t.cpu.download(on_cpu, &mut c);
        if let Some(i) = (0..n).find(|&i| i % width >= v0 && g[i].to_bits() != c[i].to_bits()) {
            return Err(format!("{what}: element {i} is {} on the GPU, {} on the CPU", g[i], c[i]));
        }
        t.notes.push(format!("{what} exact"));
    }
    t.done()
}

/// LayerNorm forward and backward (the residual add into dx, the weight and bias gradients) at
/// width `d` over `rows` rows.
pub(super) fn layernorm(gpu: Cuda, rows: usize, d: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (x, w, b) = (t.random(ACT, rows * d, 1.0), t.random(PARAM, d, 1.0), t.random(PARAM, d, 1.0));
    let (out, mean, rstd) = (t.alloc(ACT, rows * d), t.alloc(F32S, rows), t.alloc(F32S, rows));
    let (dout, dx) = (t.random(ACT, rows * d, 1.0), t.random(ACT, rows * d, 1.0));
    let (dw, db) = (t.random(GRAD, d, 1.0), t.random(GRAD, d, 1.0));
    t.both(|be| {
        be.layernorm_forward(out, mean, rstd, x, w, b, d, 1e-5);
        be.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, d);
    });
    t.check("y", out, BF16)?;
    t.check("mean", mean, F32)?;
    t.check("rstd", rstd, F32)?;
    t.check("dx (added to the residual's)", dx, BF16)?;
    t.check("dw", dw, Tol { rel_l2: 1e-3, max: 1e-2 })?;
    t.check("db", db, Tol { rel_l2: 1e-3, max: 1e-2 })?;
    t.done()
}

/// GELU forward and backward, tanh approximation or exact, over `n` elements.
pub(super) fn gelu(gpu: Cuda, n: usize, tanh: bool) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (u, dh) = (t.random(ACT, n, 3.0), t.random(ACT, n, 1.0));
    let (h, du) = (t.alloc(ACT, n), t.alloc(ACT, n));
    t.both(|be| {
        be.gelu_forward(h, u, tanh);
        be.gelu_backward(du, dh, u, tanh);
    });
    t.check("h", h, BF16)?;
    t.check("du", du, BF16)?;
    t.done()
}

/// RoPE and its inverse on packed qkv rows.
pub(super) fn rope(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let s = AttnShape { batch: 2, seq: 33, n_heads: 4, n_kv_heads: 2, head_dim: 16, window: 0, scale: None };
    let config = crate::config::ModelConfig { head_dim: 16, rope_theta: 500.0, ..Default::default() };
    let table = crate::model::rope::table(&config, s.seq);
    let tab = t.set(F32S, &table);
    let (qkv, back) = (t.random(ACT, s.rows() * s.qkv_width(), 1.0), t.alloc(ACT, s.rows() * s.qkv_width()));
    t.both(|be| {
        be.rope(qkv, tab, s, false);
        be.copy(back, qkv);
        be.rope(back, tab, s, true);
    });
    t.check("rotated", qkv, BF16)?;
    t.check("rotated back", back, BF16)?;
    t.done()
}

/// (Key tile, query tile) pairs of one head that the attention kernels compute without the
/// causal/window mask, and all pairs they compute: `[forward unmasked, forward all, backward
/// unmasked, backward all]`. The conditions are the kernels' `full` tests (`attention.cu`): the
/// forward pass tiles 64 queries × FBC keys (64; 32 for heads wider than 128); the backward pass
/// BC keys × BR queries (`attention::tiles`: BC 128 for heads of 40 to 192 and 64 otherwise, BR
/// 64 up to 64, 32 up to 192 and 16 past it). A check that names this path fails when its shape
/// never takes it, so the shapes cannot drift into testing only the masked code.
pub(super) fn attention_tiles(s: AttnShape) -> [usize; 4] {
    let (seq, w) = (s.seq, s.window);
    let (fbc, br, bc) = crate::backend::cuda::ops::attention::tiles(s.head_dim);
    let mut n = [0; 4];
    for q0 in (0..seq).step_by(64) {
        let kv_first = if w > 0 { q0.saturating_sub(w - 1) } else { 0 };
        let kv_end = seq.min(q0 + 64);
        for j0 in (kv_first / fbc * fbc..kv_end).step_by(fbc) {
            let full = j0 + fbc - 1 <= q0 && j0 + fbc <= seq && (w == 0 || j0 + w > q0 + 63);
            n[0] += full as usize;
            n[1] += 1;
        }
    }
    for k0 in (0..seq).step_by(bc) {
        let q_end = if w > 0 { seq.min(k0 + bc - 1 + w) } else { seq };
        for q0 in (k0 / br * br..q_end).step_by(br) {
            let full = k0 + bc - 1 <= q0 && k0 + bc <= seq && q0 + br <= seq && (w == 0 || k0 + w > q0 + br - 1);
            n[2] += full as usize;
            n[3] += 1;
        }
    }
    n
}

/// Flash attention forward and backward against the CPU reference at shape `s`; with
/// `unmasked`, the shape must also give both passes tiles they compute without the mask. With
/// `native` false, on cuDNN's fused attention instead of the engine's kernels: its statistics
/// (natural log, laid out `[batch, heads, seq]`) are its own and left out of the comparison;
/// a head width cuDNN does not train on the device (`cudnn::head_dim_refusal`) is not run.
pub(super) fn attention(mut gpu: Cuda, s: AttnShape, unmasked: bool, native: bool) -> Result<String, String> {
    let tiles = attention_tiles(s);
    if unmasked && (tiles[0] == 0 || tiles[2] == 0) {
        return Err(format!("the shape gives no unmasked tile to both passes: {tiles:?}"));
    }
    if !native
        && let Ok(version) = crate::backend::cuda::cudnn::version()
        && let Some(why) = crate::backend::cuda::cudnn::head_dim_refusal(s.head_dim, gpu.info().capability, version)
    {
        return Ok(format!("not run: {why}"));
    }
    if !native {
        gpu.select_attention(AttentionImpl::Cudnn, s, AttnNeeds::default()).map_err(failure)?;
    }
    let mut t = Twin::new(gpu);
    if native {
        t.notes.push(format!("unmasked tiles forward {}/{}, backward {}/{}", tiles[0], tiles[1], tiles[2], tiles[3]));
    }
    let qkv = t.random(ACT, s.rows() * s.qkv_width(), 1.0);
    let (out, lse) = (t.alloc(ACT, s.rows() * s.q_width()), t.alloc(F32S, s.rows() * s.n_heads));
    let (dout, dqkv) = (t.random(ACT, s.rows() * s.q_width(), 1.0), t.alloc(ACT, s.rows() * s.qkv_width()));
    // QK-clip's maxima, recorded by the native kernels (cuDNN's have none).
    let maxima = native.then(|| t.alloc(F32S, s.n_heads));
    t.both(|be| {
        if let Some(m) = maxima {
            be.fill(m, f32::NEG_INFINITY);
            be.attention_logit_max(Some(m));
        }
        be.attention_forward(out, lse, qkv, s);
        be.attention_logit_max(None);
        be.attention_backward(dqkv, dout, qkv, out, lse, s);
    });
    t.check("out", out, BF16)?;
    if let Some(m) = maxima {
        t.check("lse", lse, F32)?;
        t.check("logit maxima", m, F32)?;
    }
    compare_qkv_gradients(&mut t, dqkv, s)?;
    scale_matters(&mut t, qkv, out, s, SeqSplit::WHOLE, None)?;
    t.done()
}

/// With a softmax scale of its own, the CPU's out at the default scale (`1 / sqrt(head_dim)`)
/// must differ from `out` by far more than the tolerance, so that a kernel that dropped the scale
/// fails the comparison. Allocates on the CPU alone: the twin's last allocation.
fn scale_matters(
    t: &mut Twin,
    qkv: View,
    out: View,
    s: AttnShape,
    split: SeqSplit,
    bounds: Option<IdxView>,
) -> Result<(), String> {
    let Some(scale) = s.scale else { return Ok(()) };
    let default = AttnShape { scale: None, ..s };
    let (other, lse) = (t.cpu.alloc(ACT, out.len), t.cpu.alloc(F32S, s.rows() * s.n_heads));
    t.cpu.attention_forward_split(other, lse, qkv, default, split, bounds);
    let (mut a, mut b) = (vec![0f32; out.len], vec![0f32; out.len]);
    t.cpu.download(out, &mut a);
    t.cpu.download(other, &mut b);
    match compare("out at the default scale", &a, &b, Tol { rel_l2: 0.1, max: 1.0 }) {
        Ok(text) => Err(format!("scale {scale}: {text}: the scale changes too little to be checked")),
        Err(text) => {
            let text = text.split(" (tolerance").next().unwrap_or_default();
            t.notes.push(format!("scale {scale}: {text} (default {:.3})", default.softmax_scale()));
            Ok(())
        }
    }
}

/// Attention for `split.rank`'s chunks of sequences split over a sequence axis of
/// `split.ranks` (`s.seq`: the rows of a sequence on one rank), against every rank's rows, with
/// document masking when `eos_every` is set (an EOS token every that many positions, offset so
/// that documents cross the chunks' edges): out, log-sum-exp and the gradient of every rank's
/// rows (dq zero on the others').
pub(super) fn attention_split(
    gpu: Cuda,
    s: AttnShape,
    split: SeqSplit,
    eos_every: Option<usize>,
) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let all = split.ranks * s.rows();
    let qkv = t.random(ACT, all * s.qkv_width(), 1.0);
    let (out, lse) = (t.alloc(ACT, s.rows() * s.q_width()), t.alloc(F32S, s.rows() * s.n_heads));
    let (dout, dqkv) = (t.random(ACT, s.rows() * s.q_width(), 1.0), t.alloc(ACT, all * s.qkv_width()));
    let bounds = eos_every.map(|every| {
        let tokens: Vec<u32> = (0..all).map(|i| if i % every == every / 3 { 1 } else { 2 + (i % 7) as u32 }).collect();
        let tokens = t.idx(&tokens);
        let bounds = t.idx(&vec![0; 2 * all]);
        t.both(|be| be.document_bounds(bounds, None, tokens, s.seq * split.ranks, 1));
        bounds
    });
    let maxima = t.alloc(F32S, s.n_heads);
    t.both(|be| {
        be.fill(maxima, f32::NEG_INFINITY);
        be.attention_logit_max(Some(maxima));
        be.attention_forward_split(out, lse, qkv, s, split, bounds);
        be.attention_logit_max(None);
        be.attention_backward_split(dqkv, dout, qkv, out, lse, s, split, bounds);
    });
    t.check("out", out, BF16)?;
    t.check("lse", lse, F32)?;
    t.check("logit maxima", maxima, F32)?;
    let g = compare_qkv_gradients(&mut t, dqkv, s)?;
    let (q, w) = (s.q_width(), s.qkv_width());
    // The other ranks' rows have no query gradient: exactly zero, not small.
    let stray = (0..all)
        .filter(|r| r / s.rows() != split.rank)
        .flat_map(|r| (0..q).map(move |c| r * w + c))
        .filter(|&i| g[i] != 0.0)
        .count();
    if stray > 0 {
        return Err(format!("{stray} query-gradient elements of other ranks' rows are not zero"));
    }
    scale_matters(&mut t, qkv, out, s, split, bounds)?;
    t.done()
}

/// Compares the packed gradient `dqkv` (rows of `s.qkv_width()`) on both backends, dq, dk and
/// dv apart (each has its own scale), and returns the GPU's.
fn compare_qkv_gradients(t: &mut Twin, dqkv: View, s: AttnShape) -> Result<Vec<f32>, String> {
    let (q, kv, w) = (s.q_width(), s.n_kv_heads * s.head_dim, s.qkv_width());
    let (mut c, mut g) = (vec![0f32; dqkv.len], vec![0f32; dqkv.len]);
    t.cpu.download(dqkv, &mut c);
    t.gpu.download(dqkv, &mut g);
    for (name, start, width) in [("dq", 0, q), ("dk", q, kv), ("dv", q + kv, kv)] {
        let idx: Vec<usize> = (0..dqkv.len / w).flat_map(|r| (0..width).map(move |c| r * w + start + c)).collect();
        let pick = |x: &[f32]| idx.iter().map(|&i| x[i]).collect::<Vec<f32>>();
        t.notes.push(compare(name, &pick(&c), &pick(&g), Tol { rel_l2: 2e-2, max: 8e-2 })?);
    }
    Ok(g)
}

/// SwiGLU forward and backward at width `f`.
pub(super) fn swiglu(gpu: Cuda, f: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 37;
    let (gu, dh) = (t.random(ACT, n * 2 * f, 2.0), t.random(ACT, n * f, 1.0));
    let (h, dgu) = (t.alloc(ACT, n * f), t.alloc(ACT, n * 2 * f));
    t.both(|be| {
        be.swiglu_forward(h, gu, f);
        be.swiglu_backward(dgu, dh, gu, f);
    });
    t.check("h", h, BF16)?;
    t.check("dgu", dgu, BF16)?;
    t.done()
}

/// The gated linear units other than SwiGLU, forward and backward, at a width of the 8-wide
/// kernels (64) and of the scalar ones (36): GPT-OSS's clamped SwiGLU (a limit of 2 on values of
/// scale 2: gates above it, ups above and below its bounds) and Gemma's GELU-tanh unit.
pub(super) fn glu(gpu: Cuda) -> Result<String, String> {
    use crate::backend::Glu;
    let mut t = Twin::new(gpu);
    let (n, limit) = (37, 2.0);
    let clamped = Glu::ClampedSwiglu { limit, alpha: 1.702 };
    for f in [64, 36] {
        let (gu, dh) = (t.random(ACT, n * 2 * f, 2.0), t.random(ACT, n * f, 1.0));
        let mut host = vec![0f32; gu.len];
        t.cpu.download(gu, &mut host);
        let gates = host.chunks(f).step_by(2).flatten().filter(|&&g| g > limit).count();
        let ups = |above: bool| {
            host.chunks(f).skip(1).step_by(2).flatten().filter(|&&u| if above { u > limit } else { u < -limit }).count()
        };
        let (above, below) = (ups(true), ups(false));
        if gates == 0 || above == 0 || below == 0 {
            return Err(format!("f={f}: {gates} gates above the limit, {above} ups above, {below} below: no clipping"));
        }
        for (name, kind) in [("clamped swiglu", clamped), ("gelu-tanh", Glu::GeluTanh)] {
            let (h, dgu) = (t.alloc(ACT, n * f), t.alloc(ACT, n * 2 * f));
            t.both(|be| {
                be.glu_forward(h, gu, f, kind);
                be.glu_backward(dgu, dh, gu, f, kind);
            });
            t.check(&format!("{name} f={f}: h"), h, BF16)?;
            t.check(&format!("{name} f={f}: dgu"), dgu, BF16)?;
        }
        t.notes.push(format!("f={f}: {gates} gates above the limit, ups {above} above and {below} below"));
    }
    t.done()
}

/// Cross-entropy losses and the gradient written over the logits, vocabulary `v`.
pub(super) fn cross_entropy(gpu: Cuda, v: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 45;
    let targets: Vec<u32> = (0..n).map(|i| (rng::bits(8, 1, i) % v as u64) as u32).collect();
    let tgt = t.idx(&targets);
    let (logits, grads) = (t.random(ACT, n as usize * v, 3.0), t.random(ACT, n as usize * v, 3.0));
    let (l1, l2) = (t.alloc(F32S, n as usize), t.alloc(F32S, n as usize));
    // Vocabulary-parallel steps on a slice holding columns v/2..3v/2: the targets from v/2 on.
    let slice = t.random(ACT, n as usize * v, 3.0);
    let (max, sums, l3) = (t.alloc(F32S, n as usize), t.alloc(F32S, 2 * n as usize), t.alloc(F32S, n as usize));
    t.both(|be| {
        be.cross_entropy(l1, logits, tgt, v, None);
        be.cross_entropy(l2, grads, tgt, v, Some(0.5));
        be.cross_entropy_max(max, slice, v);
        be.cross_entropy_partials(sums, slice, max, tgt, v, v / 2);
        be.cross_entropy_finish(l3, slice, max, sums, tgt, v, v / 2, Some(0.5));
    });
    t.check("losses", l1, F32)?;
    t.check("losses with gradient", l2, F32)?;
    t.check("gradient", grads, BF16)?;
    t.check("vocabulary slice: row maxima", max, F32)?;
    t.check("vocabulary slice: sums and target logits", sums, F32)?;
    t.check("vocabulary slice: losses", l3, F32)?;
    t.check("vocabulary slice: gradient", slice, BF16)?;
    t.done()
}

/// Random router logits for `n` tokens over `e` experts (top `k`), the buffer of their
/// probabilities and the dispatch tables a routing fills (softmax scores, renormalised or not;
/// `capacity` rows an expert, every slot without).
fn routing(
    t: &mut Twin,
    (n, e, k): (usize, usize, usize),
    capacity: Option<usize>,
    renormalize: bool,
) -> (View, View, MoeDispatch) {
    let rows = n * k;
    let router_logits = t.random(F32S, n * e, 1.5);
    let probs = t.alloc(F32S, n * e);
    let mut idx = |len: usize| t.idx(&vec![0; len]);
    let (expert, slot_row, row_slot, offsets) = (idx(rows), idx(rows), idx(rows), idx(e + 1));
    let dispatch = MoeDispatch {
        tokens: n,
        experts: e,
        top_k: k,
        routing: Routing::softmax(renormalize),
        capacity: capacity.unwrap_or(rows),
        expert,
        weight: t.alloc(F32S, rows),
        slot_row,
        row_slot,
        offsets,
        stats: t.alloc(F32S, MoeDispatch::stats_len(e)),
    };
    (router_logits, probs, dispatch)
}

/// The mixture-of-experts path: routing, dispatch tables, expert products, combine, backward;
/// dropless, or with each expert keeping `capacity` rows (the rest dropped).
pub(super) fn moe(gpu: Cuda, capacity: Option<usize>, renormalize: bool) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (n, e, k, d, f) = (90, 8, 2, 64, 48);
    let rows = n * k;
    let (router_logits, probs, dispatch) = routing(&mut t, (n, e, k), capacity, renormalize);
    let x = t.random(ACT, n * d, 1.0);
    let weights = t.random(PARAM, e * 3 * f * d, 0.1);
    let gate_up = ExpertWeights { first: weights.at(0, 2 * f * d), stride: 3 * f * d };
    let down = ExpertWeights { first: weights.at(2 * f * d, d * f), stride: 3 * f * d };
    let dweights = t.random(GRAD, e * 3 * f * d, 0.01);
    let dgate_up = ExpertWeights { first: dweights.at(0, 2 * f * d), ..gate_up };
    let ddown = ExpertWeights { first: dweights.at(2 * f * d, d * f), ..down };
    let (xe, gu, h, ye) =
        (t.alloc(ACT, rows * d), t.alloc(ACT, rows * 2 * f), t.alloc(ACT, rows * f), t.alloc(ACT, rows * d));
    let (out, dout) = (t.alloc(ACT, n * d), t.random(ACT, n * d, 1.0));
    let (dye, dweight, dh, dxe, dx) = (
        t.alloc(ACT, rows * d),
        t.alloc(F32S, rows),
        t.alloc(ACT, rows * f),
        t.alloc(ACT, rows * d),
        t.alloc(ACT, n * d),
    );
    let dgu = t.random(ACT, rows * 2 * f, 1.0);
    let (counts, drouter) = (t.random(F32S, e, 10.0), t.alloc(ACT, n * e));
    // The expert axis's parts: two members of e/2 experts, parts as large as every row.
    let parts = Parts { members: 2, local: e / 2, rows };
    let (packed, unpacked, routed) = (t.alloc(ACT, 2 * rows * d), t.alloc(ACT, rows * d), t.alloc(F32S, e));
    let runs = t.idx(&vec![0; 2 * (e / 2 + 1)]);
    t.both(|be| {
        be.moe_route(probs, router_logits, dispatch);
        be.moe_gather(xe, x, dispatch, d);
        be.moe_pack(packed, xe, dispatch.offsets, parts, d);
        be.moe_unpack(unpacked, packed, dispatch.offsets, parts, d);
        be.moe_counts(routed, dispatch.offsets);
        be.moe_runs(runs, routed, parts);
        be.moe_expert_matmul(gu, xe, gate_up, dispatch, MatMul::linear(0, d, 2 * f));
        be.swiglu_forward(h, gu, f);
        be.moe_expert_matmul(ye, h, down, dispatch, MatMul::linear(0, f, d));
        be.moe_combine(out, ye, dispatch, d);
        be.moe_combine_backward(dye, dweight, dout, ye, dispatch, d);
        be.moe_expert_matmul(dh, dye, down, dispatch, MatMul::linear_dx(0, f, d));
        be.moe_expert_matmul_dw(ddown, dye, h, dispatch, f, d);
        be.moe_expert_matmul(dxe, dgu, gate_up, dispatch, MatMul::linear_dx(0, d, 2 * f));
        be.moe_expert_matmul_dw(dgate_up, dgu, xe, dispatch, d, 2 * f);
        be.moe_gather_backward(dx, dxe, dispatch, d);
        be.moe_route_backward(drouter, dweight, probs, dispatch, counts, 0.01);
    });
    t.check("probs", probs, F32)?;
    t.check_idx("experts", dispatch.expert)?;
    t.check("weights", dispatch.weight, F32)?;
    for (name, v) in [("slot rows", dispatch.slot_row), ("row slots", dispatch.row_slot), ("offsets", dispatch.offsets)]
    {
        t.check_idx(name, v)?;
    }
    t.check("stats", dispatch.stats, F32)?;
    if capacity.is_some_and(|c| c * e < rows) {
        let mut stats = vec![0f32; dispatch.stats.len];
        t.cpu.download(dispatch.stats, &mut stats);
        if stats[2 * e] == 0.0 {
            return Err(format!("a capacity of {capacity:?} rows an expert dropped no slot"));
        }
    }
    t.check("gathered", xe, BF16)?;
    t.check("packed into parts", packed, EXACT)?;
    t.check("unpacked", unpacked, EXACT)?;
    t.check("routed counts", routed, EXACT)?;
    t.check_idx("runs of the parts", runs)?;
    t.check("gate and up (grouped GEMM)", gu, BF16)?;
    t.check("down (grouped GEMM)", ye, BF16)?;
    t.check("combined", out, BF16)?;
    t.check("dye", dye, BF16)?;
    // From here on the inputs themselves went through bf16 on the GPU (ye, dye, h): bf16 level.
    t.check("dweight", dweight, BF16)?;
    t.check("dh (grouped dx GEMM)", dh, BF16)?;
    t.check("dxe", dxe, BF16)?;
    t.check("dW (grouped dW GEMM)", dweights, BF16)?;
    t.check("dx", dx, BF16)?;
    t.check("drouter", drouter, BF16)?;
    t.done()
}

/// The experts' grouped products with FP8 operands (`moe_gemm_fp8_*`: E4M3 inputs and weights
/// forward, E5M2 gradients backward) at widths `d` and `f` (multiples of 16 take the vector
/// loads, others the scalar ones), the rows routed as a run routes them (a capacity of 12
/// dropping some). The operands are cast from the same bf16 values on both backends (their
/// bytes equal, as `fp8`'s check holds), so the products differ only in their sums' order and
/// the outputs' bf16 rounding.
pub(super) fn moe_fp8(gpu: Cuda, d: usize, f: usize, capacity: Option<usize>) -> Result<String, String> {
    use crate::backend::fp8::{Fp8Format, Scaling, State};
    let mut t = Twin::new(gpu);
    let (n, e, k) = (90, 8, 2);
    let rows = n * k;
    let (router_logits, probs, dispatch) = routing(&mut t, (n, e, k), capacity, true);
    let stride = 3 * f * d;
    let weights = t.random(PARAM, e * stride, 0.1);
    let (xe, h, dye, dgu) = (
        t.random(ACT, rows * d, 1.0),
        t.random(ACT, rows * f, 1.0),
        t.random(ACT, rows * d, 1e-3),
        t.random(ACT, rows * 2 * f, 1e-3),
    );
    let state = |t: &mut Twin, format: Fp8Format| State { view: t.set(F32S, &State::initial(format, 0)), format };
    let [sw, sx, sh] = [0; 3].map(|_| state(&mut t, Fp8Format::E4M3));
    let [sdy, sdgu] = [0; 2].map(|_| state(&mut t, Fp8Format::E5M2));
    let (wq, xq, hq, dyq, dguq) = (
        t.alloc(FP8, e * stride),
        t.alloc(FP8, rows * d),
        t.alloc(FP8, rows * f),
        t.alloc(FP8, rows * d),
        t.alloc(FP8, rows * 2 * f),
    );
    let gate_up = ExpertWeights { first: wq.at(0, 2 * f * d), stride };
    let down = ExpertWeights { first: wq.at(2 * f * d, d * f), stride };
    let dweights = t.random(GRAD, e * stride, 0.01);
    let dgate_up = ExpertWeights { first: dweights.at(0, 2 * f * d), stride };
    let ddown = ExpertWeights { first: dweights.at(2 * f * d, d * f), stride };
    let (gu, ye, dh, dxe) =
        (t.alloc(ACT, rows * 2 * f), t.alloc(ACT, rows * d), t.alloc(ACT, rows * f), t.alloc(ACT, rows * d));
    t.both(|be| {
        be.moe_route(probs, router_logits, dispatch);
        for (q, x, s) in [(wq, weights, sw), (xq, xe, sx), (hq, h, sh), (dyq, dye, sdy), (dguq, dgu, sdgu)] {
            be.fp8_quantize(q, x, s, Scaling::Current, None);
        }
        be.moe_expert_matmul_fp8(gu, xq, gate_up, dispatch, MatMul::linear(0, d, 2 * f), [sx, sw]);
        be.moe_expert_matmul_fp8(ye, hq, down, dispatch, MatMul::linear(0, f, d), [sh, sw]);
        be.moe_expert_matmul_fp8(dh, dyq, down, dispatch, MatMul::linear_dx(0, f, d), [sdy, sw]);
        be.moe_expert_matmul_dw_fp8(ddown, dyq, hq, dispatch, (f, d), [sdy, sh]);
        be.moe_expert_matmul_fp8(dxe, dguq, gate_up, dispatch, MatMul::linear_dx(0, d, 2 * f), [sdgu, sw]);
        be.moe_expert_matmul_dw_fp8(dgate_up, dguq, xq, dispatch, (d, 2 * f), [sdgu, sx]);
    });
    t.check_idx("offsets", dispatch.offsets)?;
    let mut offsets = vec![0u32; e + 1];
    t.cpu.download_idx(dispatch.offsets, &mut offsets);
    let kept = offsets[e] as usize;
    t.notes.push(format!("{kept} of {rows} rows kept"));
    // Rows past the kept ones are nobody's: compare the kept rows.
    t.check("gate and up, E4M3 · E4M3", gu.at(0, kept * 2 * f), BF16)?;
    t.check("down, E4M3 · E4M3", ye.at(0, kept * d), BF16)?;
    t.check("down's dx, E5M2 · E4M3", dh.at(0, kept * f), BF16)?;
    t.check("gate and up's dx, E5M2 · E4M3", dxe.at(0, kept * d), BF16)?;
    t.check("dW of both, E5M2ᵀ · E4M3 (f32, added to the gradients)", dweights, F32)?;
    t.done()
}

/// DeepSeek-V3 routing at its full width: 256 experts (8 a lane of the routing warp) in 8 groups
/// of which 4 are kept, top-8, sigmoid scores, a random selection bias, a scale of 2.5,
/// renormalised or not; the route and its backward with the load-balancing term.
pub(super) fn sigmoid_routing(gpu: Cuda, renormalize: bool) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (n, e, k) = (70, 256, 8);
    let rows = n * k;
    let router_logits = t.random(F32S, n * e, 1.5);
    let bias = t.random(F32S, e, 0.05);
    let probs = t.alloc(F32S, n * e);
    let mut idx = |len: usize| t.idx(&vec![0; len]);
    let (expert, slot_row, row_slot, offsets) = (idx(rows), idx(rows), idx(rows), idx(e + 1));
    let routing =
        Routing { scoring: Scoring::Sigmoid, renormalize, groups: 8, top_groups: 4, scale: 2.5, bias: Some(bias) };
    let dispatch = MoeDispatch {
        tokens: n,
        experts: e,
        top_k: k,
        routing,
        capacity: rows,
        expert,
        weight: t.alloc(F32S, rows),
        slot_row,
        row_slot,
        offsets,
        stats: t.alloc(F32S, MoeDispatch::stats_len(e)),
    };
    let (dweight, counts, drouter) = (t.random(F32S, rows, 1.0), t.random(F32S, e, 10.0), t.alloc(ACT, n * e));
    t.both(|be| {
        be.moe_route(probs, router_logits, dispatch);
        be.moe_route_backward(drouter, dweight, probs, dispatch, counts, 0.01);
    });
    t.check("sigmoid scores", probs, F32)?;
    t.check_idx("experts", dispatch.expert)?;
    t.check("weights", dispatch.weight, F32)?;
    for (name, v) in [("slot rows", dispatch.slot_row), ("row slots", dispatch.row_slot), ("offsets", dispatch.offsets)]
    {
        t.check_idx(name, v)?;
    }
    t.check("stats", dispatch.stats, F32)?;
    t.check("drouter", drouter, BF16)?;
    // The group limit must have bitten: some token's top-8 by score alone leaves its kept groups.
    let (mut z, mut b, mut chosen) = (vec![0f32; n * e], vec![0f32; e], vec![0u32; rows]);
    t.cpu.download(router_logits, &mut z);
    t.cpu.download(bias, &mut b);
    t.cpu.download_idx(dispatch.expert, &mut chosen);
    let limited = (0..n).any(|i| {
        let best = z[i * e..(i + 1) * e].iter().zip(&b).map(|(&z, &b)| 1.0 / (1.0 + (-z).exp()) + b);
        let mut order: Vec<(usize, f32)> = best.enumerate().collect();
        order.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
        order[..k].iter().any(|&(x, _)| !chosen[i * k..(i + 1) * k].contains(&(x as u32)))
    });
    if !limited {
        return Err("the group limit excluded no token's top-8 expert".into());
    }
    t.done()
}

/// The auxiliary-loss-free balancing over 256 experts: two micro-batches' load excess added to
/// the excess slots (counts above, below and at their mean), then the bias step, on a parameter
/// bias in two shards (its master stepped, its bf16 copy refreshed) and on an f32 bias whole.
pub(super) fn load_excess_and_bias_step(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let e = 256;
    let (bias, flat) = (t.random(PARAM, e, 0.1), t.random(F32S, e, 0.1));
    // Excess already held: random on odd experts, 0 on even ones.
    let held: Vec<f32> =
        (0..e).map(|x| if x % 2 == 1 { 3.0 * rng::normal_pair(7, 0, x as u64).0 } else { 0.0 }).collect();
    let (excess, excess_flat) = (t.set(GRAD, &held), t.set(F32S, &held));
    // Counts in pairs 10 ± (x / 2 mod 11) and 10 ± (x / 2 mod 5), around a mean of exactly 10:
    // experts 0, 110 and 220 stay at an excess of 0 (sign 0).
    let pairs = |m: usize| -> Vec<f32> {
        (0..e).map(|x| 10.0 + ((x / 2) % m) as f32 * if x % 2 == 0 { 1.0 } else { -1.0 }).collect()
    };
    let (c1, c2) = (t.set(F32S, &pairs(11)), t.set(F32S, &pairs(5)));
    let embedded = t.alloc(ACT, e);
    let first = t.idx(&[0]);
    t.both(|be| {
        for dst in [excess, excess_flat] {
            be.moe_load_excess(dst, c1);
            be.moe_load_excess(dst, c2);
        }
    });
    let exact = |t: &mut Twin, what: &str, v: View| -> Result<Vec<f32>, String> {
        let (mut c, mut g) = (vec![0f32; v.len], vec![0f32; v.len]);
        t.cpu.download(v, &mut c);
        t.gpu.download(v, &mut g);
        match (0..v.len).find(|&x| c[x].to_bits() != g[x].to_bits()) {
            Some(x) => Err(format!("{what}[{x}] is {} on the GPU, {} on the CPU", g[x], c[x])),
            None => Ok(c),
        }
    };
    let summed = exact(&mut t, "excess", excess)?;
    exact(&mut t, "f32 bias's excess", excess_flat)?;
    let at_zero = summed.iter().filter(|&&x| x == 0.0).count();
    if at_zero != 3 {
        return Err(format!("{at_zero} experts at an excess of 0, not 3"));
    }
    t.both(|be| {
        be.moe_bias_step(bias.at(0, 100), excess.at(0, 100), 1e-3);
        be.moe_bias_step(bias.at(100, e - 100), excess.at(100, e - 100), 1e-3);
        be.moe_bias_step(flat, excess_flat, 1e-3);
        be.embedding_forward(embedded, bias, first, e);
    });
    let stepped = exact(&mut t, "bias", bias)?;
    exact(&mut t, "f32 bias", flat)?;
    for (what, v) in [("excess after the step", excess), ("f32 bias's excess after the step", excess_flat)] {
        if exact(&mut t, what, v)?.iter().any(|&x| x != 0.0) {
            return Err(format!("{what} is not zero"));
        }
    }
    // The bias's bf16 copy, as the ops read it, is its stepped master rounded.
    let mut copy = vec![0f32; e];
    t.gpu.download(embedded, &mut copy);
    if let Some(x) = (0..e).find(|&x| copy[x].to_bits() != half::bf16::from_f32(stepped[x]).to_f32().to_bits()) {
        return Err(format!("bias[{x}]'s bf16 copy is {}, its master {}", copy[x], stepped[x]));
    }
    t.notes.push(format!("excess and biases exact ({at_zero} experts at an excess of 0), bf16 copy refreshed"));
    t.done()
}

/// GPT-OSS's expert biases over uneven experts with empty ones, forward into bf16 rows and
/// backward into f32 gradients (added to what they hold), through two dispatches: the single
/// device's (offsets from row 0) and a second sender's on an expert axis (from row 60); the rows
/// of neither stay as they were. The biases lie in blocks of a wider stride: at width 64 and
/// stride 72 the forward pass takes 8 columns a thread, at width 36 and stride 37 (from element
/// 1) one.
pub(super) fn expert_bias(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (tokens, experts) = (96, 5);
    // Rows per expert 7, 0, 13, 1, 39, then 0, 9, 3, 0, 18; rows 90 .. 96 in neither.
    let tables: [[u32; 6]; 2] = [[0, 7, 7, 20, 21, 60], [60, 60, 69, 72, 72, 90]];
    let dispatches: Vec<MoeDispatch> = tables
        .iter()
        .map(|offsets| MoeDispatch {
            tokens,
            experts,
            top_k: 1,
            routing: Routing::softmax(true),
            capacity: tokens,
            expert: t.idx(&[0; 96]),
            weight: t.alloc(F32S, tokens),
            slot_row: t.idx(&[0; 96]),
            row_slot: t.idx(&[0; 96]),
            offsets: t.idx(offsets),
            stats: t.alloc(F32S, MoeDispatch::stats_len(experts)),
        })
        .collect();
    for (width, stride, at) in [(64, 72, 0), (36, 37, 1)] {
        let (blocks, dblocks) = (t.random(PARAM, experts * stride, 1.0), t.random(GRAD, experts * stride, 0.1));
        let bias = ExpertWeights { first: blocks.at(at, width), stride };
        let dbias = ExpertWeights { first: dblocks.at(at, width), stride };
        let (out, dout) = (t.random(ACT, tokens * width, 1.0), t.random(ACT, tokens * width, 1.0));
        let mut before = vec![0f32; out.len];
        t.cpu.download(out, &mut before);
        t.both(|be| {
            for &d in &dispatches {
                be.moe_expert_bias(out, bias, d, width);
                be.moe_expert_bias_backward(dbias, dout, d, width);
            }
        });
        t.check(&format!("width {width}: rows plus biases"), out, BF16)?;
        t.check(&format!("width {width}: bias gradients"), dblocks, F32)?;
        let mut after = vec![0f32; out.len];
        t.gpu.download(out, &mut after);
        if let Some(i) = (90 * width..out.len).find(|&i| after[i].to_bits() != before[i].to_bits()) {
            return Err(format!("width {width}: element {i}, in a row of no expert, changed"));
        }
    }
    t.notes.push("rows of no expert untouched".into());
    t.done()
}

/// AdamW with gradient clipping and segments that decay and that do not.
pub(super) fn adamw(gpu: Cuda) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 4099;
    let (p, g) = (t.random(PARAM, n, 1.0), t.random(GRAD, n, 1.0));
    let (m, v, norm) = (t.random(OPT, n, 0.1), t.set(OPT, &vec![0.3; n]), t.alloc(F32S, 1));
    let segments = [
        Segment { offset: 0, len: 1000, decay: true },
        Segment { offset: 1000, len: 7, decay: false },
        Segment { offset: 1007, len: 3000, decay: true },
        Segment { offset: 4010, len: 89, decay: false },
    ];
    let step = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3, max_grad_norm: 1.0 };
    t.both(|be| {
        be.sum_squares(norm, g);
        be.adamw(p, g, m, v, norm, &segments, step);
    });
    t.check("parameters (f32 master)", p, F32)?;
    t.check("m", m, F32)?;
    t.check("v", v, F32)?;
    t.check("gradients zeroed", g, F32)?;
    t.done()
}

/// AdamW writing weights' FP8 casts in its own pass (the delayed recipe's optimizer-written
/// weights, `adamw_fp8`): three weights (32-tile edges, decaying or not, one filling its
/// segment) inside a flat update. On the GPU, fused against the unfused path (the flat update,
/// then each weight's cast from its updated bf16 copy, Cuda::set_fp8_unfused): parameters,
/// moments, zeroed gradients, both layouts' bytes and the amax recorded, all exact. The update
/// against the CPU reference's as `adamw`'s check (the CPU casts its f32 weights, the GPU its
/// bf16 copies: their bytes are not compared).
pub(super) fn adamw_fp8(gpu: Cuda) -> Result<String, String> {
    use crate::backend::fp8::{Fp8Format, State, WeightCast};
    let mut t = Twin::new(gpu);
    let n = 4099;
    let data = |draw: u64, scale: f32| -> Vec<f32> {
        (0..n).map(|i| scale * rng::normal_pair(98, draw, i as u64).0).collect::<Vec<f32>>()
    };
    let (p0, g0, m0) = (data(1, 0.05), data(2, 1.0), data(3, 0.1));
    let segments = [
        Segment { offset: 0, len: 1500, decay: true },
        Segment { offset: 1500, len: 20, decay: false },
        Segment { offset: 1520, len: 2112, decay: false },
        Segment { offset: 3640, len: 459, decay: true },
    ];
    let weights = [(37, 40, 32), (1520, 33, 64), (3650, 12, 36)];
    let step = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3, max_grad_norm: 1.0 };
    // Two sets of the same buffers: the fused path's and the unfused one's.
    let mut sets = Vec::new();
    for _ in 0..2 {
        let (p, g, m, v) = (t.set(PARAM, &p0), t.set(GRAD, &g0), t.set(OPT, &m0), t.set(OPT, &vec![0.3; n]));
        let norm = t.alloc(F32S, 1);
        let casts: Vec<WeightCast> = weights
            .iter()
            .map(|&(offset, rows, cols)| {
                // A scale the last update set (max / 0.15), and an amax recorded before.
                let state = t.set(F32S, &[448.0 / 0.15, 0.15 / 448.0, 0.02, 448.0, 0.15, 0.1, 0.0]);
                let (q, qt) = (t.alloc(FP8, rows * cols), t.alloc(FP8, rows * cols));
                WeightCast { offset, rows, cols, q, qt, state: State { view: state, format: Fp8Format::E4M3 } }
            })
            .collect();
        sets.push((p, g, (m, v), norm, casts));
    }
    for (k, (p, g, moments, norm, casts)) in sets.iter().enumerate() {
        t.gpu.set_fp8_unfused(k == 1);
        t.both(|be| {
            be.sum_squares(*norm, *g);
            be.adamw_fp8(*p, *g, *moments, *norm, &segments, step, casts);
        });
    }
    t.gpu.set_fp8_unfused(false);
    let ((p, g, (m, v), _, fused), (p_u, g_u, (m_u, v_u), _, unfused)) = (&sets[0], &sets[1]);
    let exact = fused_as_unfused;
    for (what, a, b) in [("parameters", *p, *p_u), ("gradients", *g, *g_u), ("m", *m, *m_u), ("v", *v, *v_u)] {
        exact(&mut t.gpu, what, a, b, false)?;
    }
    for (i, (a, b)) in fused.iter().zip(unfused).enumerate() {
        exact(&mut t.gpu, &format!("weight {i}'s scaling state"), a.state.view, b.state.view, false)?;
        exact(&mut t.gpu, &format!("weight {i}'s cast"), a.q, b.q, true)?;
        exact(&mut t.gpu, &format!("weight {i}'s transposed cast"), a.qt, b.qt, true)?;
    }
    t.notes.push(format!(
        "fused against unfused: parameters, moments, gradients, {} weights' casts in both layouts and amaxes exact",
        weights.len()
    ));
    t.check("parameters against the CPU (f32 master)", *p, F32)?;
    t.check("m against the CPU", *m, F32)?;
    t.check("v against the CPU", *v, F32)?;
    t.done()
}

/// Whether views `a` (the fused path's) and `b` (the unfused one's) hold the same bits on the
/// GPU; `fp8`: E4M3 bytes, else f32 or bf16 values.
fn fused_as_unfused(gpu: &mut Cuda, what: &str, a: View, b: View, fp8: bool) -> Result<(), String> {
    let read = |gpu: &mut Cuda, v: View| {
        if fp8 {
            return gpu.download_fp8(v, crate::backend::fp8::Fp8Format::E4M3);
        }
        let mut x = vec![0f32; v.len];
        gpu.download(v, &mut x);
        x
    };
    let (x, y) = (read(gpu, a), read(gpu, b));
    match x.iter().zip(&y).position(|(a, b)| a.to_bits() != b.to_bits()) {
        Some(i) => Err(format!("{what}: element {i} is {} fused, {} unfused", x[i], y[i])),
        None => Ok(()),
    }
}

/// RMSNorm and SwiGLU with their outputs cast to E4M3 in both layouts in their own pass
/// (`Backend::rmsnorm_fp8`, `Backend::swiglu_fp8`: the delayed recipe's q/k/v, gate/up and down
/// inputs): fused against the unfused path (the producer, then the cast of its bf16 output into
/// both layouts), the casts' bytes, rstd and the scaling state (the amax recorded) exact; rows
/// and widths off the 32-tiles, RMSNorm's 8-wide and scalar kernels, a weight offset (Gemma's)
/// or none. rstd against the CPU.
pub(super) fn fp8_producers(gpu: Cuda) -> Result<String, String> {
    use crate::backend::fp8::{Fp8Format, State};
    let mut t = Twin::new(gpu);
    // A scale the last update set (max / 3), and an amax recorded before.
    let fresh_state = |t: &mut Twin| State {
        view: t.set(F32S, &[448.0 / 3.0, 3.0 / 448.0, 0.5, 448.0, 3.0]),
        format: Fp8Format::E4M3,
    };
    for (rows, d, offset) in [(48, 40, 0.0), (70, 24, 1.0), (33, 20, 0.0)] {
        let (x, w) = (t.random(ACT, rows * d, 1.0), t.random(PARAM, d, 0.5));
        let mut sets = Vec::new();
        for unfused in [false, true] {
            let state = fresh_state(&mut t);
            let (q, qt, out, rstd) =
                (t.alloc(FP8, rows * d), t.alloc(FP8, rows * d), t.alloc(ACT, rows * d), t.alloc(F32S, rows));
            t.gpu.set_fp8_unfused(unfused);
            t.both(|be| be.rmsnorm_fp8((q, qt, state), out, rstd, (x, w), offset, d, 1e-5));
            sets.push((q, qt, rstd, state.view));
        }
        t.gpu.set_fp8_unfused(false);
        let ((q, qt, rstd, state), (q_u, qt_u, rstd_u, state_u)) = (sets[0], sets[1]);
        let at = format!("{rows} x {d}");
        fused_as_unfused(&mut t.gpu, &format!("{at}: the cast"), q, q_u, true)?;
        fused_as_unfused(&mut t.gpu, &format!("{at}: the transposed cast"), qt, qt_u, true)?;
        fused_as_unfused(&mut t.gpu, &format!("{at}: rstd"), rstd, rstd_u, false)?;
        fused_as_unfused(&mut t.gpu, &format!("{at}: the scaling state"), state, state_u, false)?;
        t.check(&format!("{at}: rstd against the CPU"), rstd, F32)?;
        // The plain cast transposed byte for byte (FSDP's gathered casts): the transposed cast.
        let back = t.alloc(FP8, rows * d);
        t.both(|be| be.fp8_transpose(back, q, d));
        fused_as_unfused(&mut t.gpu, &format!("{at}: the cast transposed"), back, qt, true)?;
        // SwiGLU over [gate | up] rows of width 2d.
        let gu = t.random(ACT, rows * 2 * d, 2.0);
        let mut sets = Vec::new();
        for unfused in [false, true] {
            let state = fresh_state(&mut t);
            let (q, qt, h) = (t.alloc(FP8, rows * d), t.alloc(FP8, rows * d), t.alloc(ACT, rows * d));
            t.gpu.set_fp8_unfused(unfused);
            t.both(|be| be.swiglu_fp8((q, qt, state), h, gu, d));
            sets.push((q, qt, state.view));
        }
        t.gpu.set_fp8_unfused(false);
        let ((q, qt, state), (q_u, qt_u, state_u)) = (sets[0], sets[1]);
        fused_as_unfused(&mut t.gpu, &format!("{at}: SwiGLU's cast"), q, q_u, true)?;
        fused_as_unfused(&mut t.gpu, &format!("{at}: SwiGLU's transposed cast"), qt, qt_u, true)?;
        fused_as_unfused(&mut t.gpu, &format!("{at}: SwiGLU's scaling state"), state, state_u, false)?;
    }
    t.notes.push(
        "fused against unfused: both layouts' bytes, rstd and amax exact, RMSNorm and SwiGLU; fp8_transpose of the cast is the transposed cast"
            .into(),
    );
    t.done()
}

/// Muon's momentum, `μ` = 0.95 (so both branches of `lerp`: `1 − μ` below ½, `μ` above): once
/// with gradients whose global norm (about 64) is clipped to 1, on a buffer of the clipped
/// gradients' scale, so that both terms count; once unclipped (`max_grad_norm` 0) on gradients
/// of norm 64 too. The buffer and the gradients' replacement (the matrix to orthogonalise).
pub(super) fn muon_momentum(gpu: Cuda, nesterov: bool) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let n = 4099;
    for (name, max_grad_norm, buf_scale) in [("clipped", 1.0, 1e-3), ("unclipped", 0.0, 0.05)] {
        let (g, buf, norm) = (t.random(GRAD, n, 1.0), t.random(OPT, n, buf_scale), t.alloc(F32S, 1));
        let step = MuonMomentum { momentum: 0.95, nesterov, max_grad_norm };
        t.both(|be| {
            be.sum_squares(norm, g);
            be.muon_momentum(g, buf, norm, step);
        });
        let mut norm_squared = [0f32];
        t.gpu.download(norm, &mut norm_squared);
        let clip = clip_scale(norm_squared[0], max_grad_norm);
        if (max_grad_norm > 0.0) != (clip < 0.1) {
            return Err(format!("{name}: clip scale {clip} at a norm of {}", norm_squared[0].sqrt()));
        }
        t.check(&format!("{name} (clip {clip:.1e}): buffer"), buf, F32)?;
        t.check(&format!("{name}: update"), g, F32)?;
    }
    t.done()
}

/// Newton–Schulz's normalisation `x ← x / max(‖x‖_F, eps)`, the squared norm from
/// `sum_squares`, over `n` values: on f32 values, on bf16 activations (the GPU's Newton–Schulz
/// matrices), on parameters (their f32 master), and on values so small that their norm is
/// under `eps` (the floor divides), f32 and bf16; an all-zero matrix stays zero (no NaN).
pub(super) fn divide_by_norm(gpu: Cuda, n: usize) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let cases = [
        ("f32", F32S, 1.0, 1e-7, F32),
        ("bf16", ACT, 1.0, 1e-7, BF16),
        ("parameters", PARAM, 1.0, 1e-7, F32),
        ("f32 under eps", GRAD, 1e-6, 1e-3, F32),
        ("bf16 under eps", ACT, 1e-6, 1e-3, BF16),
        ("zeros", ACT, 0.0, 1e-7, BF16),
    ];
    for (name, kind, scale, eps, tol) in cases {
        let (x, sum_squares) = (t.random(kind, n, scale), t.alloc(F32S, 1));
        t.both(|be| {
            be.sum_squares(sum_squares, x);
            be.divide_by_norm(x, sum_squares, eps);
        });
        let mut s = [0f32];
        t.gpu.download(sum_squares, &mut s);
        if (s[0].sqrt() < eps) != (scale < 1.0) {
            return Err(format!("{name}: norm {} against eps {eps}", s[0].sqrt()));
        }
        t.check(&format!("{name} (norm {:.1e})", s[0].sqrt()), x, tol)?;
    }
    t.done()
}

/// MLA's packed qkv rows assembled from q, kv and the shared rotary key (on a YaRN table),
/// and the adjoint: dq, dkv and dkpe (the heads' sum) from a random dqkv; the v padding exactly
/// zero.
pub(super) fn mla_qkv(gpu: Cuda, s: crate::backend::MlaShape, q_scale: f32) -> Result<String, String> {
    use crate::model::rope::{Yarn, table_for, yarn_attention_factor, yarn_inv_freq};
    let mut t = Twin::new(gpu);
    let yarn = Yarn { factor: 8.0, original_max_seq_len: 4, mscale: 1.0, mscale_all_dim: 0.5, ..Yarn::default() };
    let inv = yarn_inv_freq(s.rope, 1000.0, &yarn);
    let table = table_for(&inv, yarn_attention_factor(&yarn) as f32, &(0..s.seq).collect::<Vec<_>>());
    let tab = t.set(F32S, &table);
    let (q, kv, kpe) = (
        t.random(ACT, s.rows * s.q_width(), 1.0),
        t.random(ACT, s.rows * s.kv_width(), 1.0),
        t.random(ACT, s.rows * s.rope, 1.0),
    );
    let (qkv, dqkv) = (t.alloc(ACT, s.rows * s.qkv_width()), t.random(ACT, s.rows * s.qkv_width(), 1.0));
    let (dq, dkv, dkpe) =
        (t.alloc(ACT, s.rows * s.q_width()), t.alloc(ACT, s.rows * s.kv_width()), t.alloc(ACT, s.rows * s.rope));
    t.both(|be| {
        be.mla_qkv_forward(qkv, q, kv, kpe, tab, s, q_scale);
        be.mla_qkv_backward(dq, dkv, dkpe, dqkv, tab, s, q_scale);
    });
    t.check("qkv", qkv, BF16)?;
    t.check("dq", dq, BF16)?;
    t.check("dkv (copied)", dkv, EXACT)?;
    t.check("dkpe (summed over heads)", dkpe, BF16)?;
    let (mut g, width, qk) = (vec![0f32; qkv.len], s.qkv_width(), s.qk());
    t.gpu.download(qkv, &mut g);
    let v0 = 2 * s.heads * qk;
    if let Some(i) = (0..qkv.len).find(|&i| i % width >= v0 && (i % width - v0) % qk >= s.v && g[i].to_bits() != 0) {
        return Err(format!("the v padding: element {i} is {} on the GPU", g[i]));
    }
    t.notes.push("v padding exactly zero".into());
    t.done()
}

/// Heads narrowed (the attention's output to o_proj's width) and widened back with zeros: exact
/// copies.
pub(super) fn heads_narrow_widen(
    gpu: Cuda,
    rows: usize,
    heads: usize,
    wide: usize,
    narrow: usize,
) -> Result<String, String> {
    let mut t = Twin::new(gpu);
    let (x, back) = (t.random(ACT, rows * heads * wide, 1.0), t.random(ACT, rows * heads * narrow, 1.0));
    let (out, widened) = (t.alloc(ACT, rows * heads * narrow), t.alloc(ACT, rows * heads * wide));
    t.both(|be| {
        be.heads_narrow(out, x, rows, heads, wide, narrow);
        be.heads_widen(widened, back, rows, heads, narrow, wide);
    });
    t.check("narrowed", out, EXACT)?;
    t.check("widened", widened, EXACT)?;
    t.done()
}

/// Attention sinks' epilogue on `batch` sequences of `seq` rows of `heads` heads `dh` wide:
/// attention-like out and log-sum-exp (around 2, as tens of keys give, one of them −∞: a row
/// that saw no key) turned in place into the sinked ones, and the sinks' gradient added to a
/// nonzero `dsinks` from them. The sink gradient's tolerance is bf16's: the GPU's sum reads the
/// out it rounded to bf16, the CPU's its f32 one. Then, on the GPU alone, the same from cuDNN's
/// `[batch, heads, seq]` statistics layout must give the same bits.
pub(super) fn attention_sinks(gpu: Cuda, batch: usize, seq: usize, heads: usize, dh: usize) -> Result<String, String> {
    use crate::backend::cuda::ops::sinks::{self, LseLayout};
    let mut t = Twin::new(gpu);
    let (rows, width) = (batch * seq, heads * dh);
    let normal = |stream: u64, i: usize| rng::normal_pair(5, stream, i as u64).0;
    let lse_host: Vec<f32> =
        (0..rows * heads).map(|i| if i == 5 { f32::NEG_INFINITY } else { 2.0 + normal(1, i) }).collect();
    let sinks_host: Vec<f32> = (0..heads).map(|h| 2.0 + 1.5 * normal(2, h)).collect();
    let out = t.random(ACT, rows * width, 1.0);
    let lse = t.set(F32S, &lse_host);
    let sink = t.set(PARAM, &sinks_host);
    let (dout, dsinks) = (t.random(ACT, rows * width, 1.0), t.random(GRAD, heads, 1.0));
    // cuDNN's layout: copies of out and dsinks, lse permuted (row b·seq + s, head h at
    // (b·heads + h)·seq + s).
    let (out2, lse2, dsinks2) = (t.alloc(ACT, rows * width), t.alloc(F32S, rows * heads), t.alloc(GRAD, heads));
    let cudnn_at = |i: usize| {
        let (r, h) = (i / heads, i % heads);
        ((r / seq) * heads + h) * seq + r % seq
    };
    let mut permuted = vec![0f32; rows * heads];
    for (i, &l) in lse_host.iter().enumerate() {
        permuted[cudnn_at(i)] = l;
    }
    t.gpu.copy(out2, out);
    t.gpu.copy(dsinks2, dsinks);
    t.gpu.upload(lse2, &permuted);
    t.both(|be| {
        be.attention_sinks_forward(out, lse, sink, heads, dh);
        be.attention_sinks_backward(dsinks, dout, out, lse, sink, heads, dh);
    });
    t.check("out", out, BF16)?;
    t.check("lse", lse, F32)?;
    t.check("dsinks (accumulated)", dsinks, BF16)?;
    let layout = LseLayout::BatchHeadsSeq(seq);
    sinks::forward(&mut t.gpu, out2, lse2, sink, heads, dh, layout);
    sinks::backward(&mut t.gpu, dsinks2, dout, out2, lse2, sink, heads, dh, layout);
    let mut get = |v: View| {
        let mut x = vec![0f32; v.len];
        t.gpu.download(v, &mut x);
        x
    };
    let (l, l2) = (get(lse), get(lse2));
    let l2: Vec<f32> = (0..l.len()).map(|i| l2[cudnn_at(i)]).collect();
    for (what, a, b) in [("out", get(out), get(out2)), ("lse", l, l2), ("dsinks", get(dsinks), get(dsinks2))] {
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            return Err(format!("cuDNN's lse layout: {what}[{i}] is {}, {} in the native layout", b[i], a[i]));
        }
    }
    t.notes.push("cuDNN's lse layout: the same bits".into());
    t.done()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_tiles_counts_the_tiles_the_kernels_leave_unmasked() {
        let shape = |seq, head_dim, window| AttnShape {
            batch: 1,
            seq,
            n_heads: 1,
            n_kv_heads: 1,
            head_dim,
            window,
            scale: None,
        };
        // Head width 32 (64-key backward blocks), causal, two tiles: only (keys 0..64, queries
        // 64..128) is seen whole, in both passes.
        assert_eq!(attention_tiles(shape(128, 32, 0)), [1, 3, 1, 3]);
        // A ragged last query tile: the forward pass computes its rows past the end and drops
        // them (no mask needed), the backward pass masks them (they would enter dK and dV).
        assert_eq!(attention_tiles(shape(127, 32, 0)), [1, 3, 0, 3]);
        // Head width 64: 128-key backward blocks; keys 0..128 are whole for queries 128..256.
        assert_eq!(attention_tiles(shape(128, 64, 0)), [1, 3, 0, 2]);
        assert_eq!(attention_tiles(shape(256, 64, 0)), [6, 10, 2, 6]);
        // Head width 128: 32-query backward tiles, four of them whole under keys 0..128.
        assert_eq!(attention_tiles(shape(256, 128, 0)), [6, 10, 4, 12]);
        // Head width 192 (and 136, padded to it): 32-key forward tiles, two of them whole for
        // queries 64..128 and four for 128..160; backward, keys 0..128 for queries 128..160.
        assert_eq!(attention_tiles(shape(160, 192, 0)), [6, 11, 1, 6]);
        assert_eq!(attention_tiles(shape(160, 136, 0)), attention_tiles(shape(160, 192, 0)));
        // Head width 256: 64-key blocks of 16-query tiles backward, whole from queries 64 on.
        assert_eq!(attention_tiles(shape(96, 256, 0)), [2, 5, 2, 8]);
        // A window of 64 cuts every tile diagonally: nothing is whole.
        assert_eq!(attention_tiles(shape(256, 64, 64)), [0, 7, 0, 5]);
        // A window of 160 leaves the tile just below the diagonal whole (keys j0..j0+64 for
        // queries j0+64..j0+128: every query sees them when j0 + 160 > j0 + 127), three times.
        assert_eq!(attention_tiles(shape(256, 64, 160))[0], 3);
    }
}
