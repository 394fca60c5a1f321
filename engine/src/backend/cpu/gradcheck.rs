//! Finite-difference checks of every op's backward pass, through the [`Backend`] interface.
//!
//! Each check takes the scalar `L = Σ c ⊙ op(inputs)` for a fixed random `c`, runs the op's
//! backward with `dout = c`, and compares the gradient of every input with central differences
//! `(L(x + h) - L(x - h)) / 2h`, element by element, as a relative error in norm per input.

use super::Cpu;
use crate::backend::{AttnShape, Backend, BufKind, ExpertWeights, Glu, MatMul, MoeDispatch, Routing, Scoring, View};
use crate::rng;

const H: f32 = 1e-2;
// f32 forward passes leave errors near 2e-5 here; a 1% error in any sizeable part of a gradient
// exceeds this.
const TOLERANCE: f64 = 5e-4;

fn random(n: usize, stream: u64, scale: f64) -> Vec<f32> {
    (0..n).map(|i| (scale * (2.0 * rng::uniform(42, stream, i as u64) - 1.0)) as f32).collect()
}

fn upload(cpu: &mut Cpu, host: &[f32]) -> View {
    let v = cpu.alloc(BufKind::Activations, host.len());
    cpu.upload(v, host);
    v
}

fn download(cpu: &mut Cpu, v: View) -> Vec<f32> {
    let mut out = vec![0f32; v.len];
    cpu.download(v, &mut out);
    out
}

type Forward<'a> = &'a dyn Fn(&mut Cpu, &[View]) -> View;
type Backward<'a> = &'a dyn Fn(&mut Cpu, &[View], View) -> Vec<View>;

/// Checks the gradients `backward` gives for every input of `forward` (which returns its output
/// view; inputs are uploaded afresh for every evaluation, so in-place ops are fine).
fn check(name: &str, inputs: &[Vec<f32>], forward: Forward, backward: Backward) {
    let mut cpu = Cpu::new();
    let views: Vec<View> = inputs.iter().map(|x| upload(&mut cpu, x)).collect();
    let out = forward(&mut cpu, &views);
    let c = random(out.len, 99, 1.0);
    let dout = upload(&mut cpu, &c);
    for (v, x) in views.iter().zip(inputs) {
        cpu.upload(*v, x);
    }
    let grads: Vec<Vec<f32>> = backward(&mut cpu, &views, dout).into_iter().map(|g| download(&mut cpu, g)).collect();
    assert_eq!(grads.len(), inputs.len(), "{name}: one gradient per input");

    let objective = |host: &[Vec<f32>]| -> f64 {
        let mut cpu = Cpu::new();
        let views: Vec<View> = host.iter().map(|x| upload(&mut cpu, x)).collect();
        let out = forward(&mut cpu, &views);
        download(&mut cpu, out).iter().zip(&c).map(|(o, c)| *o as f64 * *c as f64).sum()
    };
    for (i, analytic) in grads.iter().enumerate() {
        let mut host = inputs.to_vec();
        let (mut err, mut norm) = (0f64, 0f64);
        for j in 0..host[i].len() {
            let x = host[i][j];
            host[i][j] = x + H;
            let plus = objective(&host);
            host[i][j] = x - H;
            let minus = objective(&host);
            host[i][j] = x;
            let numeric = (plus - minus) / (2.0 * H as f64);
            err += (numeric - analytic[j] as f64).powi(2);
            norm += numeric.powi(2);
        }
        let relative = err.sqrt() / norm.sqrt().max(1e-8);
        assert!(relative < TOLERANCE, "{name}: input {i} gradient off by {relative:.2e} (relative, in norm)");
    }
}

#[test]
fn matmul_in_all_layouts() {
    let (m, n, k) = (3, 4, 5);
    for (a_t, b_t) in [(false, false), (false, true), (true, false), (true, true)] {
        let shape = MatMul { m, n, k, a_t, b_t, accumulate: false };
        check(
            &format!("matmul a_t={a_t} b_t={b_t}"),
            &[random(m * k, 1, 1.0), random(k * n, 2, 1.0)],
            &|cpu, x| {
                let out = cpu.alloc(BufKind::Activations, m * n);
                cpu.matmul(out, x[0], x[1], shape);
                out
            },
            &|cpu, x, dout| {
                // dA = dout · op(B)ᵀ and dB = op(A)ᵀ · dout, in each operand's storage layout.
                let (da, db) = (cpu.alloc(BufKind::Activations, m * k), cpu.alloc(BufKind::Activations, k * n));
                if a_t {
                    cpu.matmul(da, x[1], dout, MatMul { m: k, n: m, k: n, a_t: b_t, b_t: true, accumulate: false });
                } else {
                    cpu.matmul(da, dout, x[1], MatMul { m, n: k, k: n, a_t: false, b_t: !b_t, accumulate: false });
                }
                if b_t {
                    cpu.matmul(db, dout, x[0], MatMul { m: n, n: k, k: m, a_t: true, b_t: a_t, accumulate: false });
                } else {
                    cpu.matmul(db, x[0], dout, MatMul { m: k, n, k: m, a_t: !a_t, b_t: false, accumulate: false });
                }
                vec![da, db]
            },
        );
    }
}

#[test]
fn linear_layer_helpers() {
    let (n, inp, out) = (4, 3, 5);
    check(
        "linear",
        &[random(n * inp, 1, 1.0), random(out * inp, 2, 1.0)],
        &|cpu, x| {
            let y = cpu.alloc(BufKind::Activations, n * out);
            cpu.matmul(y, x[0], x[1], MatMul::linear(n, inp, out));
            y
        },
        &|cpu, x, dy| {
            let (dx, dw) = (cpu.alloc(BufKind::Activations, n * inp), cpu.alloc(BufKind::Activations, out * inp));
            cpu.matmul(dx, dy, x[1], MatMul::linear_dx(n, inp, out));
            cpu.matmul(dw, dy, x[0], MatMul::linear_dw(n, inp, out));
            vec![dx, dw]
        },
    );
}

/// RMSNorm, with its weight as stored (offset 0) and as Gemma's offset from one.
#[test]
fn rmsnorm() {
    let (rows, d) = (5, 7);
    for offset in [0.0, 1.0] {
        check(
            &format!("rmsnorm offset {offset}"),
            &[random(rows * d, 1, 2.0), random(d, 2, 1.5)],
            &|cpu, x| {
                let (out, rstd) = (cpu.alloc(BufKind::Activations, rows * d), cpu.alloc(BufKind::Activations, rows));
                cpu.rmsnorm_forward(out, rstd, x[0], x[1], offset, d, 1e-5);
                out
            },
            &|cpu, x, dout| {
                let (out, rstd) = (cpu.alloc(BufKind::Activations, rows * d), cpu.alloc(BufKind::Activations, rows));
                cpu.rmsnorm_forward(out, rstd, x[0], x[1], offset, d, 1e-5);
                let (dx, dw) = (cpu.alloc(BufKind::Activations, rows * d), cpu.alloc(BufKind::Activations, d));
                cpu.rmsnorm_backward(dx, dw, dout, x[0], x[1], offset, rstd, d);
                vec![dx, dw]
            },
        );
    }
}

/// Logit soft-capping in place, differentiated at the uncapped values.
#[test]
fn softcap() {
    let n = 11;
    check(
        "softcap",
        &[random(n, 1, 4.0)],
        &|cpu, x| {
            let y = cpu.alloc(BufKind::Activations, n);
            cpu.copy(y, x[0]);
            cpu.softcap_forward(y, 2.5);
            y
        },
        &|cpu, x, dout| {
            cpu.softcap_backward(dout, x[0], 2.5);
            vec![dout]
        },
    );
}

/// QK-norm over the q and k heads of packed rows (2 query heads, 1 key/value head), with the
/// values passing through; the backward pass works in place of the output's gradient.
#[test]
fn qk_norm() {
    let shape = AttnShape { batch: 1, seq: 3, n_heads: 2, n_kv_heads: 1, head_dim: 4, window: 0, scale: None };
    let (rows, width, dh) = (3, shape.qkv_width(), shape.head_dim);
    for offset in [0.0, 1.0] {
        let forward = |cpu: &mut Cpu, x: &[View]| {
            let (out, rstd) =
                (cpu.alloc(BufKind::Activations, rows * width), cpu.alloc(BufKind::Activations, rows * 3));
            cpu.qk_norm_forward(out, rstd, x[0], x[1], offset, shape, 1e-6);
            (out, rstd)
        };
        check(
            &format!("qk_norm offset {offset}"),
            &[random(rows * width, 1, 2.0), random(2 * dh, 2, 1.5)],
            &|cpu, x| forward(cpu, x).0,
            &|cpu, x, dout| {
                let (_, rstd) = forward(cpu, x);
                let dw = cpu.alloc(BufKind::Activations, 2 * dh);
                cpu.qk_norm_backward(dout, dw, x[0], x[1], offset, rstd, shape);
                vec![dout, dw]
            },
        );
    }
}

#[test]
fn layernorm_with_weight_and_bias() {
    let (rows, d) = (5, 7);
    let stats = |cpu: &mut Cpu| (cpu.alloc(BufKind::Activations, rows), cpu.alloc(BufKind::Activations, rows));
    check(
        "layernorm",
        &[random(rows * d, 1, 2.0), random(d, 2, 1.5), random(d, 3, 1.0)],
        &|cpu, x| {
            let out = cpu.alloc(BufKind::Activations, rows * d);
            let (mean, rstd) = stats(cpu);
            cpu.layernorm_forward(out, mean, rstd, x[0], x[1], x[2], d, 1e-5);
            out
        },
        &|cpu, x, dout| {
            let out = cpu.alloc(BufKind::Activations, rows * d);
            let (mean, rstd) = stats(cpu);
            cpu.layernorm_forward(out, mean, rstd, x[0], x[1], x[2], d, 1e-5);
            let dx = cpu.alloc(BufKind::Activations, rows * d);
            let (dw, db) = (cpu.alloc(BufKind::Activations, d), cpu.alloc(BufKind::Activations, d));
            cpu.layernorm_backward(dx, dw, db, dout, x[0], x[1], mean, rstd, d);
            vec![dx, dw, db]
        },
    );
}

/// The input gradient adds to the residual stream's, and the weight and bias gradients to
/// theirs, as the model's backward pass relies on.
#[test]
fn layernorm_backward_accumulates() {
    let (rows, d) = (3, 5);
    let mut cpu = Cpu::new();
    let x = upload(&mut cpu, &random(rows * d, 1, 2.0));
    let (w, b) = (upload(&mut cpu, &random(d, 2, 1.0)), upload(&mut cpu, &random(d, 3, 1.0)));
    let dout = upload(&mut cpu, &random(rows * d, 4, 1.0));
    let (out, mean, rstd) = (
        cpu.alloc(BufKind::Activations, rows * d),
        cpu.alloc(BufKind::Activations, rows),
        cpu.alloc(BufKind::Activations, rows),
    );
    cpu.layernorm_forward(out, mean, rstd, x, w, b, d, 1e-5);
    let grads = |cpu: &mut Cpu, start: f32| {
        let views: Vec<View> = [rows * d, d, d].iter().map(|&n| upload(cpu, &vec![start; n])).collect();
        cpu.layernorm_backward(views[0], views[1], views[2], dout, x, w, mean, rstd, d);
        views.iter().map(|v| download(cpu, *v)).collect::<Vec<_>>()
    };
    let (zero, one) = (grads(&mut cpu, 0.0), grads(&mut cpu, 1.0));
    for (z, o) in zero.iter().zip(&one) {
        for (z, o) in z.iter().zip(o) {
            assert!((o - z - 1.0).abs() < 1e-5, "{o} is not {z} + 1");
        }
    }
}

#[test]
fn gelu_tanh_and_erf() {
    let n = 23;
    for tanh in [true, false] {
        check(
            &format!("gelu tanh={tanh}"),
            &[random(n, 1, 4.0)],
            &|cpu, x| {
                let h = cpu.alloc(BufKind::Activations, n);
                cpu.gelu_forward(h, x[0], tanh);
                h
            },
            &|cpu, x, dh| {
                let du = cpu.alloc(BufKind::Activations, n);
                cpu.gelu_backward(du, dh, x[0], tanh);
                vec![du]
            },
        );
    }
    // Both against PyTorch's `gelu(x, approximate='tanh')` and `gelu(x)` (in f64) at a few points.
    let mut cpu = Cpu::new();
    let xs = [-3.0f32, -0.5, 0.0, 0.7, 2.5];
    let u = upload(&mut cpu, &xs);
    let h = cpu.alloc(BufKind::Activations, xs.len());
    for (tanh, exact) in [
        (true, [-0.003_637_392, -0.154_286, 0.0, 0.530_570_13, 2.484_915_7]),
        (false, [-0.004_049_694, -0.154_268_77, 0.0, 0.530_625_44, 2.484_475_8]),
    ] {
        cpu.gelu_forward(h, u, tanh);
        for (got, want) in download(&mut cpu, h).iter().zip(exact) {
            assert!((got - want).abs() < 1e-6, "gelu tanh={tanh}: {got} vs {want}");
        }
    }
}

#[test]
fn embedding() {
    let (v, d, tokens) = (6, 4, [3u32, 0, 3, 5, 1]);
    check(
        "embedding",
        &[random(v * d, 1, 1.0)],
        &|cpu, x| {
            let (out, idx) = (cpu.alloc(BufKind::Activations, tokens.len() * d), cpu.alloc_idx(tokens.len()));
            cpu.upload_idx(idx, &tokens);
            cpu.embedding_forward(out, x[0], idx, d);
            out
        },
        &|cpu, _, dout| {
            let (dtable, idx) = (cpu.alloc(BufKind::Activations, v * d), cpu.alloc_idx(tokens.len()));
            cpu.upload_idx(idx, &tokens);
            cpu.embedding_backward(dtable, dout, idx, d);
            vec![dtable]
        },
    );
}

#[test]
fn swiglu() {
    let (rows, f) = (3, 5);
    check(
        "swiglu",
        &[random(rows * 2 * f, 1, 3.0)],
        &|cpu, x| {
            let h = cpu.alloc(BufKind::Activations, rows * f);
            cpu.swiglu_forward(h, x[0], f);
            h
        },
        &|cpu, x, dh| {
            let dgu = cpu.alloc(BufKind::Activations, rows * 2 * f);
            cpu.swiglu_backward(dgu, dh, x[0], f);
            vec![dgu]
        },
    );
}

#[test]
fn cross_entropy() {
    let (rows, v, targets) = (4, 9, [2u32, 8, 0, 2]);
    check(
        "cross_entropy",
        &[random(rows * v, 1, 3.0)],
        &|cpu, x| {
            let (losses, t) = (cpu.alloc(BufKind::Activations, rows), cpu.alloc_idx(rows));
            cpu.upload_idx(t, &targets);
            let logits = cpu.alloc(BufKind::Activations, rows * v);
            cpu.copy(logits, x[0]);
            cpu.cross_entropy(losses, logits, t, v, None);
            losses
        },
        &|cpu, x, dloss| {
            // The fused gradient is for a uniform weight per row; weight rows one at a time.
            let mut c = vec![0f32; rows];
            cpu.download(dloss, &mut c);
            let (losses, t, dlogits) =
                (cpu.alloc(BufKind::Activations, 1), cpu.alloc_idx(1), cpu.alloc(BufKind::Activations, rows * v));
            for (r, &target) in targets.iter().enumerate() {
                cpu.upload_idx(t, &[target]);
                let row = dlogits.at(r * v, v);
                cpu.copy(row, x[0].at(r * v, v));
                cpu.cross_entropy(losses, row, t, v, Some(c[r]));
            }
            vec![dlogits]
        },
    );
}

fn attention_shapes() -> Vec<AttnShape> {
    let s = |batch, n_heads, n_kv_heads, window| AttnShape {
        batch,
        seq: 6,
        n_heads,
        n_kv_heads,
        head_dim: 4,
        window,
        scale: None,
    };
    vec![s(2, 2, 2, 0), s(1, 4, 2, 0), s(1, 3, 1, 0), s(2, 2, 1, 3), s(1, 2, 2, 1)]
}

#[test]
fn attention_mha_gqa_mqa_and_windows() {
    for shape in attention_shapes() {
        let n = shape.rows();
        let forward = |cpu: &mut Cpu, qkv: View| {
            let (out, lse) = (
                cpu.alloc(BufKind::Activations, n * shape.q_width()),
                cpu.alloc(BufKind::Activations, n * shape.n_heads),
            );
            cpu.attention_forward(out, lse, qkv, shape);
            (out, lse)
        };
        check(
            &format!("attention {shape:?}"),
            &[random(n * shape.qkv_width(), 1, 1.5)],
            &|cpu, x| forward(cpu, x[0]).0,
            &|cpu, x, dout| {
                let (out, lse) = forward(cpu, x[0]);
                let dqkv = cpu.alloc(BufKind::Activations, n * shape.qkv_width());
                cpu.attention_backward(dqkv, dout, x[0], out, lse, shape);
                vec![dqkv]
            },
        );
    }
}

/// Document bounds of sequences of `shape` with an EOS (token 0) at position 2 of each.
fn eos_bounds(cpu: &mut Cpu, shape: AttnShape) -> crate::backend::IdxView {
    let n = shape.rows();
    let tokens = cpu.alloc_idx(n);
    cpu.upload_idx(tokens, &(0..n).map(|i| u32::from(i % shape.seq != 2)).collect::<Vec<_>>());
    let bounds = cpu.alloc_idx(2 * n);
    cpu.document_bounds(bounds, None, tokens, shape.seq, 0);
    bounds
}

/// Attention with learned sinks (GPT-OSS) as one function of (qkv, sinks): the attention
/// forward pass and the sinks' epilogue; backward, the epilogue's sink gradients and the
/// attention backward pass given the out and lse the epilogue left. Windows, grouped and
/// shared key/value heads, and document masking.
#[test]
fn attention_with_sinks_mha_gqa_windows_and_documents() {
    let docs = [(attention_shapes()[1], true), (attention_shapes()[3], true)];
    for (shape, masked) in attention_shapes().into_iter().map(|s| (s, false)).chain(docs) {
        let (n, heads, dh) = (shape.rows(), shape.n_heads, shape.head_dim);
        let forward = |cpu: &mut Cpu, x: &[View]| {
            let (out, lse) =
                (cpu.alloc(BufKind::Activations, n * shape.q_width()), cpu.alloc(BufKind::Scalars, n * heads));
            let bounds = masked.then(|| eos_bounds(cpu, shape));
            match bounds {
                Some(bounds) => cpu.attention_forward_docs(out, lse, x[0], shape, bounds),
                None => cpu.attention_forward(out, lse, x[0], shape),
            }
            cpu.attention_sinks_forward(out, lse, x[1], heads, dh);
            (out, lse, bounds)
        };
        check(
            &format!("attention with sinks {shape:?}, documents {masked}"),
            &[random(n * shape.qkv_width(), 1, 1.5), random(heads, 2, 2.0)],
            &|cpu, x| forward(cpu, x).0,
            &|cpu, x, dout| {
                let (out, lse, bounds) = forward(cpu, x);
                let (dqkv, dsinks) =
                    (cpu.alloc(BufKind::Activations, n * shape.qkv_width()), cpu.alloc(BufKind::Grads, heads));
                cpu.attention_sinks_backward(dsinks, dout, out, lse, x[1], heads, dh);
                match bounds {
                    Some(bounds) => cpu.attention_backward_docs(dqkv, dout, x[0], out, lse, shape, bounds),
                    None => cpu.attention_backward(dqkv, dout, x[0], out, lse, shape),
                }
                vec![dqkv, dsinks]
            },
        );
    }
}

#[test]
fn attention_matches_a_dense_softmax() {
    let shape = AttnShape { batch: 1, seq: 5, n_heads: 2, n_kv_heads: 1, head_dim: 4, window: 2, scale: None };
    let qkv = random(shape.rows() * shape.qkv_width(), 3, 1.0);
    let mut cpu = Cpu::new();
    let x = upload(&mut cpu, &qkv);
    let (out, lse) = (cpu.alloc(BufKind::Activations, 5 * 8), cpu.alloc(BufKind::Activations, 10));
    cpu.attention_forward(out, lse, x, shape);
    let out = download(&mut cpu, out);
    let w = shape.qkv_width();
    for i in 0..5 {
        for h in 0..2 {
            let q = &qkv[i * w + h * 4..][..4];
            let keys: Vec<usize> = (0..=i).filter(|&j| j + 2 > i).collect();
            let scores: Vec<f64> = keys
                .iter()
                .map(|&j| q.iter().zip(&qkv[j * w + 8..][..4]).map(|(a, b)| (a * b) as f64).sum::<f64>() / 2.0)
                .collect();
            let z: f64 = scores.iter().map(|s| s.exp()).sum();
            for c in 0..4 {
                let want: f64 = keys.iter().zip(&scores).map(|(&j, s)| s.exp() / z * qkv[j * w + 12 + c] as f64).sum();
                assert!((out[i * 8 + h * 4 + c] as f64 - want).abs() < 1e-6);
            }
        }
    }
}

#[test]
fn rope_and_its_inverse() {
    let shape = AttnShape { batch: 2, seq: 3, n_heads: 2, n_kv_heads: 1, head_dim: 4, window: 0, scale: None };
    let table = random(shape.seq * 2 * 2, 5, 1.0);
    // A real table holds (cos θ, sin θ); any (a, b) still gives a linear map whose transpose
    // the inverse must be, so normalise to keep it a rotation.
    let table: Vec<f32> = table
        .chunks(2)
        .flat_map(|p| {
            let r = (p[0] * p[0] + p[1] * p[1]).sqrt();
            [p[0] / r, p[1] / r]
        })
        .collect();
    let n = shape.rows() * shape.qkv_width();
    check(
        "rope",
        &[random(n, 1, 1.0)],
        &|cpu, x| {
            let t = upload(cpu, &table);
            cpu.rope(x[0], t, shape, false);
            x[0]
        },
        &|cpu, _, dout| {
            let t = upload(cpu, &table);
            let d = cpu.alloc(BufKind::Activations, n);
            cpu.copy(d, dout);
            cpu.rope(d, t, shape, true);
            vec![d]
        },
    );
}

/// MLA's assembly of packed qkv rows from q, kv and the shared rotary key, against its adjoint:
/// two sequences of 3, value heads narrower than qk, a query scale, de-interleaved or not, on a
/// YaRN table (cos and sin scaled by an attention factor other than 1).
#[test]
fn mla_qkv_assembly() {
    use crate::backend::MlaShape;
    use crate::model::rope::{Yarn, table_for, yarn_inv_freq};
    for interleave in [false, true] {
        let s = MlaShape { rows: 6, seq: 3, heads: 2, nope: 3, rope: 4, v: 2, interleave };
        let yarn = Yarn { factor: 4.0, original_max_seq_len: 2, ..Yarn::default() };
        let table = table_for(&yarn_inv_freq(s.rope, 10.0, &yarn), 1.1, &[0, 1, 2]);
        let q_scale = 0.7;
        check(
            &format!("mla_qkv interleave={interleave}"),
            &[
                random(s.rows * s.q_width(), 1, 1.0),
                random(s.rows * s.kv_width(), 2, 1.0),
                random(s.rows * s.rope, 3, 1.0),
            ],
            &|cpu, x| {
                let (t, qkv) = (upload(cpu, &table), cpu.alloc(BufKind::Activations, s.rows * s.qkv_width()));
                cpu.mla_qkv_forward(qkv, x[0], x[1], x[2], t, s, q_scale);
                qkv
            },
            &|cpu, x, dqkv| {
                let t = upload(cpu, &table);
                let grads: Vec<View> = x.iter().map(|v| cpu.alloc(BufKind::Activations, v.len)).collect();
                cpu.mla_qkv_backward(grads[0], grads[1], grads[2], dqkv, t, s, q_scale);
                grads
            },
        );
    }
}

/// Heads cut to fewer columns, and widened back with zeros: each the other's adjoint.
#[test]
fn heads_narrow_and_widen() {
    let (rows, heads, wide, narrow) = (3, 2, 5, 3);
    check(
        "heads_narrow",
        &[random(rows * heads * wide, 1, 1.0)],
        &|cpu, x| {
            let out = cpu.alloc(BufKind::Activations, rows * heads * narrow);
            cpu.heads_narrow(out, x[0], rows, heads, wide, narrow);
            out
        },
        &|cpu, _, dout| {
            let dx = cpu.alloc(BufKind::Activations, rows * heads * wide);
            cpu.heads_widen(dx, dout, rows, heads, narrow, wide);
            vec![dx]
        },
    );
    check(
        "heads_widen",
        &[random(rows * heads * narrow, 1, 1.0)],
        &|cpu, x| {
            let out = cpu.alloc(BufKind::Activations, rows * heads * wide);
            cpu.heads_widen(out, x[0], rows, heads, narrow, wide);
            out
        },
        &|cpu, _, dout| {
            let dx = cpu.alloc(BufKind::Activations, rows * heads * narrow);
            cpu.heads_narrow(dx, dout, rows, heads, wide, narrow);
            vec![dx]
        },
    );
}

/// Routing tables for `n` tokens over `e` experts, `k` each, each expert keeping `capacity`.
fn dispatch(cpu: &mut Cpu, n: usize, e: usize, k: usize, capacity: usize) -> MoeDispatch {
    let idx = cpu.alloc_idx(3 * n * k + e + 1);
    MoeDispatch {
        tokens: n,
        experts: e,
        top_k: k,
        routing: Routing::softmax(true),
        capacity,
        expert: idx.at(0, n * k),
        weight: cpu.alloc(BufKind::Activations, n * k),
        slot_row: idx.at(n * k, n * k),
        row_slot: idx.at(2 * n * k, n * k),
        offsets: idx.at(3 * n * k, e + 1),
        stats: cpu.alloc(BufKind::Activations, MoeDispatch::stats_len(e)),
    }
}

/// The whole mixture-of-experts MLP as the model composes it: router, route, gather, expert
/// SwiGLU, combine; inputs are the token rows, the router and the experts' weights.
#[test]
fn mixture_of_experts_block() {
    moe_block("moe", 6 * 2, true);
}

/// Qwen3-MoE's `norm_topk_prob = false`: each slot weighted by its softmax probability.
#[test]
fn mixture_of_experts_block_without_renormalisation() {
    moe_block("moe without renormalisation", 6 * 2, false);
}

/// The same with a capacity of 2 rows an expert (a factor of 2/3 for 6 tokens, top-2 of 4
/// experts): the dropped slots add nothing and get no gradient.
#[test]
fn mixture_of_experts_block_with_capacity() {
    moe_block("moe with capacity", 2, true);
}

fn moe_block(name: &str, capacity: usize, renormalize: bool) {
    let (n, d, f, e, k) = (6, 4, 3, 4, 2);
    let stride = 3 * f * d;
    let plan =
        |cpu: &mut Cpu| MoeDispatch { routing: Routing::softmax(renormalize), ..dispatch(cpu, n, e, k, capacity) };
    let alloc = |cpu: &mut Cpu, len| cpu.alloc(BufKind::Activations, len);
    type Acts = (MoeDispatch, View, View, View, View, View, View);
    let forward = |cpu: &mut Cpu, x: &[View]| -> Acts {
        let dispatch = plan(cpu);
        let (logits, probs, xe, gu, h, ye, out) = (
            alloc(cpu, n * e),
            alloc(cpu, n * e),
            alloc(cpu, n * k * d),
            alloc(cpu, n * k * 2 * f),
            alloc(cpu, n * k * f),
            alloc(cpu, n * k * d),
            alloc(cpu, n * d),
        );
        let gate_up = ExpertWeights { first: x[2].at(0, 2 * f * d), stride };
        let down = ExpertWeights { first: x[2].at(2 * f * d, d * f), stride };
        cpu.matmul(logits, x[0], x[1], MatMul::linear(n, d, e));
        cpu.moe_route(probs, logits, dispatch);
        cpu.moe_gather(xe, x[0], dispatch, d);
        cpu.moe_expert_matmul(gu, xe, gate_up, dispatch, MatMul::linear(0, d, 2 * f));
        cpu.swiglu_forward(h, gu, f);
        cpu.moe_expert_matmul(ye, h, down, dispatch, MatMul::linear(0, f, d));
        cpu.moe_combine(out, ye, dispatch, d);
        (dispatch, probs, xe, gu, h, ye, out)
    };
    let inputs = [random(n * d, 1, 1.0), random(e * d, 2, 1.0), random(e * stride, 3, 1.0)];
    let mut cpu = Cpu::new();
    let x: Vec<View> = inputs.iter().map(|x| upload(&mut cpu, x)).collect();
    let stats = forward(&mut cpu, &x).0.stats;
    let dropped = download(&mut cpu, stats)[2 * e];
    assert_eq!(dropped > 0.0, capacity * e < n * k, "{name}: {dropped} slots dropped");
    check(name, &inputs, &|cpu, x| forward(cpu, x).6, &|cpu, x, dout| {
        let (dispatch, probs, xe, gu, h, ye, _) = forward(cpu, x);
        let (dx, drouter_w, dexperts) = (alloc(cpu, n * d), alloc(cpu, e * d), alloc(cpu, e * stride));
        let (dye, dweight, dh, dgu, dxe, drouter, counts) = (
            alloc(cpu, n * k * d),
            alloc(cpu, n * k),
            alloc(cpu, n * k * f),
            alloc(cpu, n * k * 2 * f),
            alloc(cpu, n * k * d),
            alloc(cpu, n * e),
            alloc(cpu, e),
        );
        let gate_up = ExpertWeights { first: x[2].at(0, 2 * f * d), stride };
        let down = ExpertWeights { first: x[2].at(2 * f * d, d * f), stride };
        let dgate_up = ExpertWeights { first: dexperts.at(0, 2 * f * d), stride };
        let ddown = ExpertWeights { first: dexperts.at(2 * f * d, d * f), stride };
        cpu.moe_combine_backward(dye, dweight, dout, ye, dispatch, d);
        cpu.moe_expert_matmul(dh, dye, down, dispatch, MatMul::linear_dx(0, f, d));
        cpu.moe_expert_matmul_dw(ddown, dye, h, dispatch, f, d);
        cpu.swiglu_backward(dgu, dh, gu, f);
        cpu.moe_expert_matmul(dxe, dgu, gate_up, dispatch, MatMul::linear_dx(0, d, 2 * f));
        cpu.moe_expert_matmul_dw(dgate_up, dgu, xe, dispatch, d, 2 * f);
        cpu.moe_gather_backward(dx, dxe, dispatch, d);
        cpu.moe_route_backward(drouter, dweight, probs, dispatch, counts, 0.0);
        cpu.matmul(dx, drouter, x[1], MatMul::linear_dx(n, d, e).accumulating());
        cpu.matmul(drouter_w, drouter, x[0], MatMul::linear_dw(n, d, e));
        vec![dx, drouter_w, dexperts]
    });
}

/// The load-balancing term: `L = aux_scale · Σ_e counts[e] · Σ_t p[t, e]` with the counts held
/// fixed, as a function of the router logits.
#[test]
fn load_balancing_gradient() {
    load_balancing("load balancing", Routing::softmax(true));
}

/// The same through sigmoid scores (DeepSeek-V3's; the selection's groups and bias do not enter
/// the loss).
#[test]
fn load_balancing_gradient_through_sigmoid_scores() {
    load_balancing("load balancing, sigmoid", Routing { groups: 2, scale: 2.5, ..sigmoid_routing(None, true) });
}

fn load_balancing(name: &str, routing: Routing) {
    let (n, e, k) = (5, 4, 2);
    let counts = [3f32, 1.0, 4.0, 2.0];
    let plan = |cpu: &mut Cpu| MoeDispatch { routing, ..dispatch(cpu, n, e, k, n * k) };
    check(
        name,
        &[random(n * e, 1, 2.0)],
        &|cpu, x| {
            let (dispatch, probs) = (plan(cpu), cpu.alloc(BufKind::Activations, n * e));
            cpu.moe_route(probs, x[0], dispatch);
            // Σ_t p[t, e] for each e, then weighted by counts through a 1 x E product.
            let (sums, c, out) =
                (cpu.alloc(BufKind::Activations, e), upload(cpu, &counts), cpu.alloc(BufKind::Activations, 1));
            let ones = upload(cpu, &vec![1.0; n]);
            cpu.matmul(sums, ones, probs, MatMul { m: 1, n: e, k: n, a_t: false, b_t: false, accumulate: false });
            cpu.matmul(out, sums, c, MatMul { m: 1, n: 1, k: e, a_t: false, b_t: false, accumulate: false });
            out
        },
        &|cpu, x, dout| {
            let mut scale = [0f32];
            cpu.download(dout, &mut scale);
            let (dispatch, probs) = (plan(cpu), cpu.alloc(BufKind::Activations, n * e));
            cpu.moe_route(probs, x[0], dispatch);
            let (drouter, zeros, c) =
                (cpu.alloc(BufKind::Activations, n * e), cpu.alloc(BufKind::Activations, n * k), upload(cpu, &counts));
            cpu.moe_route_backward(drouter, zeros, probs, dispatch, c, scale[0]);
            vec![drouter]
        },
    );
}

/// DeepSeek-V3 routing for the checks below: sigmoid scores, 2 groups of 4 experts with 1 kept,
/// a scale of 2.5 and the selection bias `bias`.
fn sigmoid_routing(bias: Option<View>, renormalize: bool) -> Routing {
    Routing { scoring: Scoring::Sigmoid, renormalize, groups: 2, top_groups: 1, scale: 2.5, bias }
}

/// Router logits of 5 tokens over 8 experts, a shuffled grid 0.6 apart, and a selection bias
/// that moves the choice of tokens 0, 3 and 4: every selection margin (between groups, a chosen
/// and an unchosen expert, a group's second and third) is above 0.016 in `sigmoid + bias`, far
/// above the 2.5e-3 a finite-difference step moves a score.
const GRID_LOGITS: [[f32; 8]; 5] = [
    [-2.1, 0.9, 2.1, -0.9, -1.5, 1.5, 0.3, -0.3],
    [2.1, 0.9, 1.5, -0.9, -0.3, -2.1, 0.3, -1.5],
    [-0.9, -2.1, -1.5, 1.5, 0.3, 2.1, 0.9, -0.3],
    [1.5, -2.1, -0.9, 2.1, 0.3, -1.5, 0.9, -0.3],
    [-0.3, 1.5, 0.9, -0.9, -2.1, 0.3, 2.1, -1.5],
];
const GRID_BIAS: [f32; 8] = [0.3, -0.2, 0.1, 0.0, -0.3, 0.2, -0.1, 0.4];

/// The gradient of the weights of sigmoid routing with a group limit, a selection bias and a
/// scale, renormalised and not: only the chosen experts' scores carry it.
#[test]
fn moe_sigmoid_grouped_routing_gradient() {
    let (n, e, k) = (5, 8, 2);
    for renormalize in [true, false] {
        let plan = |cpu: &mut Cpu| {
            let bias = upload(cpu, &GRID_BIAS);
            MoeDispatch { routing: sigmoid_routing(Some(bias), renormalize), ..dispatch(cpu, n, e, k, n * k) }
        };
        check(
            &format!("sigmoid grouped routing, renormalize={renormalize}"),
            &[GRID_LOGITS.concat()],
            &|cpu, x| {
                let (d, probs) = (plan(cpu), cpu.alloc(BufKind::Activations, n * e));
                cpu.moe_route(probs, x[0], d);
                d.weight
            },
            &|cpu, x, dout| {
                let (d, probs) = (plan(cpu), cpu.alloc(BufKind::Activations, n * e));
                cpu.moe_route(probs, x[0], d);
                let (drouter, counts) = (cpu.alloc(BufKind::Activations, n * e), cpu.alloc(BufKind::Activations, e));
                cpu.moe_route_backward(drouter, dout, probs, d, counts, 0.0);
                vec![drouter]
            },
        );
    }
}

/// Routes one token's logits over 8 experts, top-2: its experts and weights.
fn route_one(logits: &[f32], routing: impl Fn(&mut Cpu) -> Routing) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let (e, k) = (8, 2);
    let mut cpu = Cpu::new();
    let z = upload(&mut cpu, logits);
    let d = MoeDispatch { routing: routing(&mut cpu), ..dispatch(&mut cpu, 1, e, k, k) };
    let probs = cpu.alloc(BufKind::Activations, e);
    cpu.moe_route(probs, z, d);
    let mut expert = vec![0u32; k];
    cpu.download_idx(d.expert, &mut expert);
    (expert, download(&mut cpu, d.weight), download(&mut cpu, probs))
}

/// The group limit keeps only the experts of the best groups, and the selection bias changes
/// which experts are chosen but not their weights (the unbiased sigmoid scores).
#[test]
fn moe_group_limit_and_bias_select_but_do_not_weigh() {
    let sigmoid = |z: f32| 1.0 / (1.0 + (-z).exp());
    // Group 0 holds the best expert (0), group 1 the best pair (4 and 5: a larger top-2 sum).
    let z = [3.0, -3.0, -3.0, -3.0, 1.0, 0.9, -3.0, -3.0];
    let plain = |groups| move |_: &mut Cpu| Routing { groups, bias: None, ..sigmoid_routing(None, false) };
    let (free, w_free, probs) = route_one(&z, plain(1));
    assert_eq!(free, [0, 4], "without a group limit");
    assert_eq!(w_free, [2.5 * sigmoid(3.0), 2.5 * sigmoid(1.0)]);
    assert_eq!(probs, z.map(sigmoid), "probs hold the sigmoid scores");
    let (limited, w_limited, _) = route_one(&z, plain(2));
    assert_eq!(limited, [4, 5], "group 0 dropped: expert 0 excluded");
    assert_eq!(w_limited, [2.5 * sigmoid(1.0), 2.5 * sigmoid(0.9)]);
    // A bias of 0.5 on expert 5 puts it first; its weight stays its unbiased score.
    let mut bias = [0f32; 8];
    bias[5] = 0.5;
    let biased = |cpu: &mut Cpu| Routing { groups: 1, ..sigmoid_routing(Some(upload(cpu, &bias)), true) };
    let (chosen, w, _) = route_one(&z, biased);
    assert_eq!(chosen, [5, 0], "the bias changes the selection");
    let (s5, s0) = (sigmoid(0.9), sigmoid(3.0));
    let total = s5 + s0 + 1e-20;
    assert_eq!(w, [s5 / total * 2.5, s0 / total * 2.5], "weights from the unbiased scores, renormalised, scaled");
    // Softmax routing is unchanged by the new fields' defaults.
    let (chosen, w, probs) = route_one(&z, |_: &mut Cpu| Routing::softmax(true));
    assert_eq!(chosen, [0, 4]);
    let total = probs[0] + probs[4];
    assert_eq!(w, [probs[0] / total, probs[4] / total]);
}

/// `dst[e] += counts[e] - mean(counts)`: added to what `dst` holds, not written over it.
#[test]
fn moe_load_excess_adds_the_gap_to_the_mean() {
    let mut cpu = Cpu::new();
    let dst = upload(&mut cpu, &[0.5, -1.0, 0.0, 2.0]);
    let counts = upload(&mut cpu, &[4.0, 2.0, 3.0, 3.0]); // mean 3
    cpu.moe_load_excess(dst, counts);
    assert_eq!(download(&mut cpu, dst), [1.5, -2.0, 0.0, 2.0]);
    // A second micro-batch accumulates.
    let counts = upload(&mut cpu, &[1.0, 5.0, 3.0, 7.0]); // mean 4
    cpu.moe_load_excess(dst, counts);
    assert_eq!(download(&mut cpu, dst), [-1.5, -1.0, -1.0, 5.0]);
}

/// `bias[i] -= rate · sign(excess[i])`, then `excess[i] = 0`: over-loaded experts down,
/// under-loaded up, an excess of 0 (sign 0) leaves the bias and stays 0; only the views given.
#[test]
fn moe_bias_step_follows_the_sign_of_the_excess_and_zeroes_it() {
    let mut cpu = Cpu::new();
    let bias = upload(&mut cpu, &[0.5, 0.5, -0.25, 0.0]);
    let excess = upload(&mut cpu, &[1.0, -1.0, 0.0, 0.0]);
    cpu.moe_bias_step(bias, excess, 0.125);
    assert_eq!(download(&mut cpu, bias), [0.375, 0.625, -0.25, 0.0]);
    assert_eq!(download(&mut cpu, excess), [0.0; 4]);
    // A sub-view (a shard) steps only its part.
    let bias = upload(&mut cpu, &[1.0, 1.0, 1.0, 1.0, 1.0]);
    let excess = upload(&mut cpu, &[3.0, -2.0, 5.0, -0.5, 7.0]);
    cpu.moe_bias_step(bias.at(1, 3), excess.at(1, 3), 0.5);
    assert_eq!(download(&mut cpu, bias), [1.0, 1.5, 0.5, 1.5, 1.0]);
    assert_eq!(download(&mut cpu, excess), [3.0, 0.0, 0.0, 0.0, 7.0]);
}

/// Rows `[gate | up]` of `f` random values in ±3 whose clamped inputs keep 0.1 off the kinks at
/// ±`limit` (finite differences of ±H do not cross them), with gates above the limit and ups
/// beyond both bounds.
fn glu_inputs(rows: usize, f: usize, limit: f32) -> Vec<f32> {
    let mut gu = random(rows * 2 * f, 1, 3.0);
    for x in gu.iter_mut() {
        if (x.abs() - limit).abs() < 0.1 {
            *x *= 1.2;
        }
    }
    // Row 0: a gate above the limit, an up above it and one below its negative.
    (gu[0], gu[f], gu[f + 1]) = (limit + 0.7, limit + 0.4, -limit - 0.9);
    gu
}

fn glu_check(name: &str, gu: Vec<f32>, rows: usize, f: usize, kind: Glu) {
    check(
        name,
        &[gu],
        &|cpu, x| {
            let h = cpu.alloc(BufKind::Activations, rows * f);
            cpu.glu_forward(h, x[0], f, kind);
            h
        },
        &|cpu, x, dh| {
            let dgu = cpu.alloc(BufKind::Activations, rows * 2 * f);
            cpu.glu_backward(dgu, dh, x[0], f, kind);
            vec![dgu]
        },
    );
}

/// GPT-OSS's clamped SwiGLU (limit 1.5 here, so that a third of the inputs are clipped).
#[test]
fn glu_clamped_swiglu() {
    let (rows, f, limit) = (4, 6, 1.5);
    let gu = glu_inputs(rows, f, limit);
    let gates = gu.chunks(f).step_by(2).flatten();
    let ups = gu.chunks(f).skip(1).step_by(2).flatten();
    let clipped = (gates.filter(|&&g| g > limit).count(), ups.filter(|&&u| u.abs() > limit).count());
    assert!(clipped.0 >= 2 && clipped.1 >= 4, "clipped gates and ups: {clipped:?}");
    glu_check("glu clamped swiglu", gu, rows, f, Glu::ClampedSwiglu { limit, alpha: 1.702 });
}

/// Gemma's GELU-tanh unit.
#[test]
fn glu_gelu_tanh() {
    let (rows, f) = (3, 5);
    glu_check("glu gelu-tanh", random(rows * 2 * f, 1, 3.0), rows, f, Glu::GeluTanh);
}

/// [`Glu::Swiglu`] is `swiglu_forward` and `swiglu_backward`, bit for bit.
#[test]
fn glu_swiglu_is_swiglu() {
    let (rows, f) = (3, 5);
    let mut cpu = Cpu::new();
    let (gu, dh) = (upload(&mut cpu, &random(rows * 2 * f, 1, 3.0)), upload(&mut cpu, &random(rows * f, 2, 1.0)));
    let alloc = |cpu: &mut Cpu, len| cpu.alloc(BufKind::Activations, len);
    let (h1, h2, d1, d2) = (
        alloc(&mut cpu, rows * f),
        alloc(&mut cpu, rows * f),
        alloc(&mut cpu, 2 * rows * f),
        alloc(&mut cpu, 2 * rows * f),
    );
    cpu.swiglu_forward(h1, gu, f);
    cpu.glu_forward(h2, gu, f, Glu::Swiglu);
    cpu.swiglu_backward(d1, dh, gu, f);
    cpu.glu_backward(d2, dh, gu, f, Glu::Swiglu);
    assert_eq!(download(&mut cpu, h1), download(&mut cpu, h2));
    assert_eq!(download(&mut cpu, d1), download(&mut cpu, d2));
}

/// Routing tables whose offsets are `offsets` (an expert's rows `offsets[e] .. offsets[e + 1]`
/// of `tokens` rows, top-1): the other tables are unused by the expert biases.
fn bias_dispatch(cpu: &mut Cpu, tokens: usize, offsets: &[u32]) -> MoeDispatch {
    let d = dispatch(cpu, tokens, offsets.len() - 1, 1, tokens);
    let table = cpu.alloc_idx(offsets.len());
    cpu.upload_idx(table, offsets);
    MoeDispatch { offsets: table, ..d }
}

/// Expert biases over uneven experts, one without rows, as the single device's dispatch and as a
/// second sender's on an expert axis (offsets from row 9 on); the biases lie in blocks of a
/// stride wider than them. Rows outside both dispatches are left alone, and so is the rest of
/// each block.
#[test]
fn moe_expert_bias_adds_and_sums_per_expert() {
    let (tokens, width, stride, experts) = (14, 3, 5, 3);
    // Rows per expert: 4, 0, 5, then 1, 2, 0; rows 12 and 13 belong to no expert.
    let (first, second): (&[u32], &[u32]) = (&[0, 4, 4, 9], &[9, 10, 12, 12]);
    let (x, b, g) =
        (random(tokens * width, 1, 1.0), random(experts * stride, 2, 1.0), random(experts * stride, 3, 1.0));
    let dy = random(tokens * width, 4, 1.0);
    let mut cpu = Cpu::new();
    let (out, blocks, dblocks, dout) =
        (upload(&mut cpu, &x), upload(&mut cpu, &b), upload(&mut cpu, &g), upload(&mut cpu, &dy));
    let bias = ExpertWeights { first: blocks.at(1, width), stride };
    let dbias = ExpertWeights { first: dblocks.at(1, width), stride };
    for offsets in [first, second] {
        let d = bias_dispatch(&mut cpu, tokens, offsets);
        cpu.moe_expert_bias(out, bias, d, width);
        cpu.moe_expert_bias_backward(dbias, dout, d, width);
    }
    let expert =
        |r: usize| [first, second].iter().find_map(|o| (0..experts).find(|&e| (o[e]..o[e + 1]).contains(&(r as u32))));
    let (got, db) = (download(&mut cpu, out), download(&mut cpu, dblocks));
    for r in 0..tokens {
        for j in 0..width {
            let want = x[r * width + j] + expert(r).map_or(0.0, |e| b[e * stride + 1 + j]);
            assert_eq!(got[r * width + j], want, "out[{r}, {j}]");
        }
    }
    for e in 0..experts {
        for j in 0..width {
            let sum: f64 = (0..tokens).filter(|&r| expert(r) == Some(e)).map(|r| dy[r * width + j] as f64).sum();
            let (at, want) = (e * stride + 1 + j, g[e * stride + 1 + j] + sum as f32);
            assert!((db[at] - want).abs() <= 1e-6, "dbias[{e}][{j}] = {}, want {want}", db[at]);
        }
        assert_eq!(db[e * stride], g[e * stride], "the rest of block {e}");
        assert_eq!(db[e * stride + 1 + width..(e + 1) * stride], g[e * stride + 1 + width..(e + 1) * stride]);
    }
    assert_eq!((expert(4), expert(9), expert(11), expert(12)), (Some(2), Some(0), Some(1), None));
}

/// The expert biases' gradients by finite differences, through the rows (`out = x + b_e`) and
/// the biases.
#[test]
fn moe_expert_bias_gradient() {
    let (tokens, width, stride) = (9, 4, 6);
    let offsets: &[u32] = &[0, 2, 2, 7, 8];
    check(
        "moe expert bias",
        &[random(tokens * width, 1, 1.0), random(4 * stride, 2, 1.0)],
        &|cpu, x| {
            let d = bias_dispatch(cpu, tokens, offsets);
            let out = cpu.alloc(BufKind::Activations, tokens * width);
            cpu.copy(out, x[0]);
            cpu.moe_expert_bias(out, ExpertWeights { first: x[1].at(2, width), stride }, d, width);
            out
        },
        &|cpu, _, dout| {
            let d = bias_dispatch(cpu, tokens, offsets);
            let (dx, db) =
                (cpu.alloc(BufKind::Activations, tokens * width), cpu.alloc(BufKind::Activations, 4 * stride));
            cpu.copy(dx, dout);
            cpu.moe_expert_bias_backward(ExpertWeights { first: db.at(2, width), stride }, dout, d, width);
            vec![dx, db]
        },
    );
}
