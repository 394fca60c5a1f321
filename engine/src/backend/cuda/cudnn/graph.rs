//! cuDNN's fused flash attention as plain values: the operation graphs of the forward and the
//! backward pass, written as cuDNN's runtime-fusion SDPA engines recognise them (the graphs
//! NVIDIA's cudnn-frontend builds for `sdpa` and `sdpa_backward`: causal mask, optional sliding
//! window, grouped-query heads, no dropout or bias), over the engine's own memory layout.
//!
//! Nothing here calls cuDNN: `super::plan` lowers a [`Graph`] to backend descriptors. Keeping
//! the graph as data lets the tests below check, without a GPU, what the GPU would otherwise be
//! the first to see: every tensor produced before it is read, products whose dimensions agree,
//! element-wise inputs that broadcast, strides that address the engine's packed rows.
//!
//! Layout (the engine's, `AttnShape`): a token row of `qkv` holds the query heads, then the key
//! heads, then the value heads, `head_dim` wide each; rows run sequence by sequence. cuDNN sees
//! every tensor as `[batch, heads, seq, head_dim]` with strides, so the same bytes serve without
//! a copy: Q has strides `[seq·W, D, W, 1]` for the row width W, and the transposed keys Kᵀ
//! `[batch, kv_heads, D, seq]` the same strides with the last two swapped. The statistics (the
//! softmax's log-sum-exp, natural log, which only these graphs read back) are kept
//! `[batch, heads, seq]`, packed.

use crate::backend::AttnShape;

/// Element types of the graphs' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DType {
    F32,
    Bf16,
    I32,
    Bool,
}

/// The tensors a call binds to device memory (or, for `Scalar`, passes by value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Role {
    /// Queries.
    Q,
    /// Keys, transposed: `[b, kv_heads, D, seq]`.
    Kt,
    /// Values.
    V,
    /// Values, transposed (the backward pass's dO·Vᵀ).
    Vt,
    /// The attention output.
    O,
    /// The softmax statistics: log-sum-exp per (sequence, head, query), f32.
    Stats,
    /// The output's gradient.
    DO,
    /// The gradients written into `dqkv`.
    DQ,
    DK,
    DV,
    /// dQ accumulated in f32 before its conversion (cuDNN's non-deterministic, faster path; the
    /// caller zeroes it before each backward pass).
    DQAccum,
    /// A constant passed by value.
    Scalar(f32),
}

/// What a tensor is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    /// Memory the caller binds (or a by-value scalar).
    Bound(Role),
    /// An intermediate cuDNN keeps to itself.
    Virtual,
}

/// A tensor of a graph.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tensor {
    /// cuDNN's unique id (1-based).
    pub uid: i64,
    pub dtype: DType,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
    pub kind: Kind,
    /// cuDNN's F16x16 reordering (the f32 dQ accumulator).
    pub reorder_f16x16: bool,
}

/// Element-wise operations used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pw {
    Add,
    Sub,
    Mul,
    Div,
    Exp,
    Log,
    CmpGe,
    CmpGt,
    GenIndex,
    BinarySelect,
    Identity,
}

/// Reductions used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Red {
    Add,
    Max,
}

/// One operation; tensors are indices into [`Graph::tensors`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Op {
    /// `c = a · b` over the last two dimensions, batched (and broadcast) over the first two.
    Matmul { a: usize, b: usize, c: usize },
    /// `y = mode(x, b, t)`, math in `math`; `axis` for GEN_INDEX. BINARY_SELECT picks x where
    /// the mask t holds, else b.
    Pointwise { mode: Pw, math: DType, axis: Option<i64>, x: usize, b: Option<usize>, t: Option<usize>, y: usize },
    /// `y` = x reduced over the dimensions where y is smaller.
    Reduction { op: Red, x: usize, y: usize },
    /// The same elements seen through other dimensions and strides (a transpose).
    Reshape { x: usize, y: usize },
}

/// Which pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Pass {
    Forward,
    Backward,
}

/// An operation graph in the order cuDNN is given it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Graph {
    pub tensors: Vec<Tensor>,
    pub ops: Vec<Op>,
}

/// The most negative f32: the value masked scores take (cudnn-frontend's `lowest()`).
const MASKED: f32 = f32::MIN;
/// The forward pass's sliding-window mask value, as cudnn-frontend writes it.
const MASKED_WINDOW_FORWARD: f32 = -1024.0 * 1024.0 * 1024.0;

struct Builder {
    g: Graph,
}

impl Builder {
    /// A graph whose first tensors are the queries and the transposed keys, which both passes read.
    fn with_queries_and_keys(v: &Views) -> (Builder, usize, usize) {
        let mut g = Builder { g: Graph { tensors: Vec::new(), ops: Vec::new() } };
        let (qd, qs) = v.in_qkv(v.hq);
        let q = g.bound(Role::Q, DType::Bf16, qd, qs);
        let (td, ts) = v.transposed();
        let kt = g.bound(Role::Kt, DType::Bf16, td, ts);
        (g, q, kt)
    }

    fn tensor(&mut self, dtype: DType, dims: [i64; 4], strides: [i64; 4], kind: Kind) -> usize {
        let uid = self.g.tensors.len() as i64 + 1;
        self.g.tensors.push(Tensor { uid, dtype, dims, strides, kind, reorder_f16x16: false });
        self.g.tensors.len() - 1
    }

    fn bound(&mut self, role: Role, dtype: DType, dims: [i64; 4], strides: [i64; 4]) -> usize {
        self.tensor(dtype, dims, strides, Kind::Bound(role))
    }

    fn scalar(&mut self, value: f32) -> usize {
        self.tensor(DType::F32, [1; 4], [1; 4], Kind::Bound(Role::Scalar(value)))
    }

    fn virt(&mut self, dtype: DType, dims: [i64; 4]) -> usize {
        self.tensor(dtype, dims, packed(dims), Kind::Virtual)
    }

    fn dims(&self, t: usize) -> [i64; 4] {
        self.g.tensors[t].dims
    }

    /// `y = mode(x [, b [, t]])` into a new virtual tensor of `x`'s dimensions (the mask's for
    /// a comparison of two index tensors, which have them too).
    fn pw(&mut self, mode: Pw, math: DType, out: DType, x: usize, b: Option<usize>, t: Option<usize>) -> usize {
        let y = self.virt(out, self.dims(x));
        self.g.ops.push(Op::Pointwise { mode, math, axis: None, x, b, t, y });
        y
    }

    fn gen_index(&mut self, x: usize, axis: i64, dtype: DType) -> usize {
        let y = self.virt(dtype, self.dims(x));
        self.g.ops.push(Op::Pointwise { mode: Pw::GenIndex, math: dtype, axis: Some(axis), x, b: None, t: None, y });
        y
    }

    fn matmul(&mut self, a: usize, b: usize, c: usize) {
        self.g.ops.push(Op::Matmul { a, b, c });
    }

    fn reduce(&mut self, op: Red, x: usize, y: usize) {
        self.g.ops.push(Op::Reduction { op, x, y });
    }

    /// The causal mask: scores of keys after the query become `MASKED`.
    fn causal(&mut self, s: usize) -> usize {
        let row = self.gen_index(s, 2, DType::I32);
        let col = self.gen_index(s, 3, DType::I32);
        let keep = self.pw(Pw::CmpGe, DType::Bool, DType::Bool, row, Some(col), None);
        let masked = self.scalar(MASKED);
        self.pw(Pw::BinarySelect, DType::F32, DType::F32, s, Some(masked), Some(keep))
    }

    /// The sliding window's mask: query i sees key j when j + W > i (AttnShape's window);
    /// others become `masked`. Written as cudnn-frontend writes it, in f32 indices.
    fn window(&mut self, s: usize, window: usize, masked: f32) -> usize {
        let row = self.gen_index(s, 2, DType::F32);
        let col = self.gen_index(s, 3, DType::F32);
        let w = self.scalar(window as f32);
        let shifted = self.virt(DType::F32, self.dims(col));
        self.g.ops.push(Op::Pointwise {
            mode: Pw::Add,
            math: DType::F32,
            axis: Some(3),
            x: col,
            b: Some(w),
            t: None,
            y: shifted,
        });
        let keep = self.pw(Pw::CmpGt, DType::Bool, DType::Bool, shifted, Some(row), None);
        let masked = self.scalar(masked);
        self.pw(Pw::BinarySelect, DType::F32, DType::F32, s, Some(masked), Some(keep))
    }
}

/// Packed strides of `dims`, the last dimension fastest.
fn packed(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// Dimensions and strides of the engine's buffers as cuDNN sees them.
struct Views {
    b: i64,
    hq: i64,
    hk: i64,
    s: i64,
    d: i64,
    /// Elements of a qkv row.
    w: i64,
}

impl Views {
    fn new(s: AttnShape) -> Views {
        let i = |x: usize| x as i64;
        Views {
            b: i(s.batch),
            hq: i(s.n_heads),
            hk: i(s.n_kv_heads),
            s: i(s.seq),
            d: i(s.head_dim),
            w: i(s.qkv_width()),
        }
    }

    /// Q (or dQ, `heads` query heads) or K, V (or their gradients): `[b, heads, s, d]` in qkv rows.
    fn in_qkv(&self, heads: i64) -> ([i64; 4], [i64; 4]) {
        ([self.b, heads, self.s, self.d], [self.s * self.w, self.d, self.w, 1])
    }

    /// Kᵀ or Vᵀ: `[b, kv_heads, d, s]` in qkv rows.
    fn transposed(&self) -> ([i64; 4], [i64; 4]) {
        ([self.b, self.hk, self.d, self.s], [self.s * self.w, self.d, 1, self.w])
    }

    /// O or dO: `[b, heads, s, d]` in rows of all query heads.
    fn out(&self) -> ([i64; 4], [i64; 4]) {
        let wq = self.hq * self.d;
        ([self.b, self.hq, self.s, self.d], [self.s * wq, self.d, wq, 1])
    }

    fn stats(&self) -> [i64; 4] {
        [self.b, self.hq, self.s, 1]
    }

    fn scores(&self) -> [i64; 4] {
        [self.b, self.hq, self.s, self.s]
    }
}

/// The graph of `pass` for attention of shape `s`.
pub(crate) fn graph(pass: Pass, s: AttnShape) -> Graph {
    match pass {
        Pass::Forward => forward(s),
        Pass::Backward => backward(s),
    }
}

/// O = softmax(mask(Q·Kᵀ·scale))·V, and the statistics log Σ exp of each row of scores.
fn forward(shape: AttnShape) -> Graph {
    let v = Views::new(shape);
    let (mut g, q, kt) = Builder::with_queries_and_keys(&v);
    let (vd, vs) = v.in_qkv(v.hk);
    let val = g.bound(Role::V, DType::Bf16, vd, vs);
    let (od, os) = v.out();
    let o = g.bound(Role::O, DType::Bf16, od, os);
    let stats = g.bound(Role::Stats, DType::F32, v.stats(), packed(v.stats()));

    let s = g.virt(DType::F32, v.scores());
    g.matmul(q, kt, s);
    let scale = g.scalar(shape.softmax_scale());
    let s = g.pw(Pw::Mul, DType::F32, DType::F32, s, Some(scale), None);
    let mut s = g.causal(s);
    if shape.window > 0 {
        s = g.window(s, shape.window, MASKED_WINDOW_FORWARD);
    }

    // Softmax with statistics: m = max, e = exp(s − m), z = Σ e, stats = m + log z, p = e / z.
    let m = g.virt(DType::F32, v.stats());
    g.reduce(Red::Max, s, m);
    let centred = g.pw(Pw::Sub, DType::F32, DType::F32, s, Some(m), None);
    let e = g.pw(Pw::Exp, DType::F32, DType::F32, centred, None, None);
    let z = g.virt(DType::F32, v.stats());
    g.reduce(Red::Add, e, z);
    let log_z = g.pw(Pw::Log, DType::F32, DType::F32, z, None, None);
    g.g.ops.push(Op::Pointwise {
        mode: Pw::Add,
        math: DType::F32,
        axis: None,
        x: m,
        b: Some(log_z),
        t: None,
        y: stats,
    });
    // P enters the second product in the inputs' type, as the fused engine wants it.
    let p = g.pw(Pw::Div, DType::F32, DType::Bf16, e, Some(z), None);
    g.matmul(p, val, o);
    g.g
}

/// dQ, dK, dV from dO, recomputing P = exp(mask(Q·Kᵀ·scale) − stats):
/// dV = Pᵀ·dO, dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O))·scale, dK = dSᵀ·Q, dQ = dS·K; with grouped
/// query heads dK and dV are summed over each group.
fn backward(shape: AttnShape) -> Graph {
    let v = Views::new(shape);
    let (mut g, q, kt) = Builder::with_queries_and_keys(&v);
    let (qd, qs) = v.in_qkv(v.hq);
    let (td, ts) = v.transposed();
    let vt = g.bound(Role::Vt, DType::Bf16, td, ts);
    let (od, os) = v.out();
    let o = g.bound(Role::O, DType::Bf16, od, os);
    let d_o = g.bound(Role::DO, DType::Bf16, od, os);
    let stats = g.bound(Role::Stats, DType::F32, v.stats(), packed(v.stats()));
    let dq = g.bound(Role::DQ, DType::Bf16, qd, qs);
    let (kd, ks) = v.in_qkv(v.hk);
    let dk = g.bound(Role::DK, DType::Bf16, kd, ks);
    let dv = g.bound(Role::DV, DType::Bf16, kd, ks);
    let dq_accum = g.bound(Role::DQAccum, DType::F32, qd, packed(qd));
    g.g.tensors[dq_accum].reorder_f16x16 = true;
    let one = g.scalar(1.0);
    let scale = g.scalar(shape.softmax_scale());

    // rowsum(dO ∘ O), the softmax's own term of dS.
    let prod = g.pw(Pw::Mul, DType::F32, DType::F32, d_o, Some(o), None);
    let sum = g.virt(DType::F32, v.stats());
    g.reduce(Red::Add, prod, sum);
    let softmax_sum = g.pw(Pw::Mul, DType::F32, DType::F32, sum, Some(one), None);

    // P again, from the statistics.
    let s = g.virt(DType::F32, v.scores());
    g.matmul(q, kt, s);
    let s = g.pw(Pw::Mul, DType::F32, DType::F32, s, Some(scale), None);
    let s = g.causal(s);
    let mut s = g.pw(Pw::Sub, DType::F32, DType::F32, s, Some(stats), None);
    if shape.window > 0 {
        // The window's mask after the statistics, where cudnn-frontend puts it.
        s = g.window(s, shape.window, MASKED);
    }
    let p = g.pw(Pw::Exp, DType::F32, DType::F32, s, None, None);

    // dV = Pᵀ·dO.
    let pt = transposed_scores(&mut g, p, &v);
    group_product(&mut g, pt, d_o, dv, &v);

    // dS = P ∘ (dO·Vᵀ − softmax_sum) · scale.
    let dp = g.virt(DType::F32, v.scores());
    g.matmul(d_o, vt, dp);
    let dp = g.pw(Pw::Mul, DType::F32, DType::F32, dp, Some(one), None);
    let dp = g.pw(Pw::Sub, DType::F32, DType::F32, dp, Some(softmax_sum), None);
    let dp = g.pw(Pw::Mul, DType::F32, DType::F32, dp, Some(p), None);
    let ds = g.pw(Pw::Mul, DType::F32, DType::F32, dp, Some(scale), None);

    // dK = dSᵀ·Q.
    let dst = transposed_scores(&mut g, ds, &v);
    group_product(&mut g, dst, q, dk, &v);

    // dQ = dS·K, accumulated in f32, then converted.
    let (kd, ks) = v.in_qkv(v.hk);
    let k = g.virt(DType::Bf16, kd);
    g.g.tensors[k].strides = ks;
    g.g.ops.push(Op::Reshape { x: kt, y: k });
    g.matmul(ds, k, dq_accum);
    g.g.ops.push(Op::Pointwise {
        mode: Pw::Identity,
        math: DType::F32,
        axis: None,
        x: dq_accum,
        b: None,
        t: None,
        y: dq,
    });
    g.g
}

/// `[b, h, s_q, s_kv]` scores seen as `[b, h, s_kv, s_q]`, in the inputs' type.
fn transposed_scores(g: &mut Builder, x: usize, v: &Views) -> usize {
    let y = g.virt(DType::Bf16, v.scores());
    g.g.tensors[y].strides = [v.hq * v.s * v.s, v.s * v.s, 1, v.s];
    g.g.ops.push(Op::Reshape { x, y });
    y
}

/// `out = a · b`, summed over each group of query heads when there are fewer key/value heads.
fn group_product(g: &mut Builder, a: usize, b: usize, out: usize, v: &Views) {
    if v.hq == v.hk {
        g.matmul(a, b, out);
    } else {
        let per_head = g.virt(DType::Bf16, [v.b, v.hq, v.s, v.d]);
        g.matmul(a, b, per_head);
        g.reduce(Red::Add, per_head, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(heads: usize, kv: usize, window: usize) -> AttnShape {
        AttnShape { batch: 2, seq: 48, n_heads: heads, n_kv_heads: kv, head_dim: 16, window, scale: None }
    }

    fn shapes() -> Vec<AttnShape> {
        vec![shape(4, 4, 0), shape(4, 2, 0), shape(8, 1, 0), shape(4, 2, 10)]
    }

    fn inputs(op: &Op) -> Vec<usize> {
        match *op {
            Op::Matmul { a, b, .. } => vec![a, b],
            Op::Pointwise { x, b, t, .. } => [Some(x), b, t].into_iter().flatten().collect(),
            Op::Reduction { x, .. } | Op::Reshape { x, .. } => vec![x],
        }
    }

    fn output(op: &Op) -> usize {
        match *op {
            Op::Matmul { c, .. } => c,
            Op::Pointwise { y, .. } | Op::Reduction { y, .. } | Op::Reshape { y, .. } => y,
        }
    }

    /// Whether a bound tensor is written by `pass` (else it is read).
    fn is_output(role: Role, pass: Pass) -> bool {
        match pass {
            Pass::Forward => matches!(role, Role::O | Role::Stats),
            Pass::Backward => matches!(role, Role::DQ | Role::DK | Role::DV | Role::DQAccum),
        }
    }

    #[test]
    fn every_tensor_is_written_once_before_it_is_read() {
        for s in shapes() {
            for pass in [Pass::Forward, Pass::Backward] {
                let g = graph(pass, s);
                let mut written = vec![false; g.tensors.len()];
                for (i, t) in g.tensors.iter().enumerate() {
                    // Inputs (and scalars) exist from the start.
                    if let Kind::Bound(r) = t.kind {
                        written[i] = !is_output(r, pass);
                    }
                }
                for op in &g.ops {
                    for i in inputs(op) {
                        assert!(written[i], "{pass:?} {s:?}: {op:?} reads tensor {} before it is written", i + 1);
                    }
                    let y = output(op);
                    assert!(!written[y], "{pass:?}: tensor {} written twice", y + 1);
                    written[y] = true;
                }
                assert!(written.iter().all(|&w| w), "{pass:?}: a tensor is never written");
                let read: std::collections::HashSet<usize> = g.ops.iter().flat_map(inputs).collect();
                for (i, t) in g.tensors.iter().enumerate() {
                    let result = matches!(t.kind, Kind::Bound(r) if is_output(r, pass) && r != Role::DQAccum);
                    assert!(read.contains(&i) || result, "{pass:?}: tensor {} is never read", i + 1);
                }
                let uids: std::collections::HashSet<i64> = g.tensors.iter().map(|t| t.uid).collect();
                assert_eq!(uids.len(), g.tensors.len(), "unique ids");
            }
        }
    }

    #[test]
    fn products_agree_and_element_wise_inputs_broadcast() {
        for s in shapes() {
            for pass in [Pass::Forward, Pass::Backward] {
                let g = graph(pass, s);
                let dims = |i: usize| g.tensors[i].dims;
                for op in &g.ops {
                    match *op {
                        Op::Matmul { a, b, c } => {
                            let (a, b, c) = (dims(a), dims(b), dims(c));
                            assert_eq!((a[2], a[3], b[3]), (c[2], b[2], c[3]), "{pass:?}: {op:?}");
                            for k in 0..2 {
                                // Batch dimensions: equal, or the smaller broadcast over groups.
                                let m = a[k].max(b[k]);
                                assert_eq!(c[k], m, "{pass:?}: {op:?}");
                                assert!(m % a[k] == 0 && m % b[k] == 0, "{pass:?}: {op:?}");
                            }
                        }
                        Op::Pointwise { x, b, t, y, .. } => {
                            for i in [Some(x), b, t].into_iter().flatten() {
                                for k in 0..4 {
                                    assert!(dims(i)[k] == dims(y)[k] || dims(i)[k] == 1, "{pass:?}: {op:?}");
                                }
                            }
                        }
                        Op::Reduction { x, y, .. } => {
                            for k in 0..4 {
                                assert!(dims(x)[k] % dims(y)[k] == 0, "{pass:?}: {op:?}");
                            }
                        }
                        Op::Reshape { x, y } => {
                            let n = |d: [i64; 4]| d.iter().product::<i64>();
                            assert_eq!(n(dims(x)), n(dims(y)), "{pass:?}: {op:?}");
                        }
                    }
                }
            }
        }
    }

    /// The element (b, h, s, d) of each bound tensor, through its strides, is where the
    /// engine keeps it.
    #[test]
    fn strides_address_the_engines_rows() {
        let s = shape(4, 2, 0);
        let (w, wq, d) = (s.qkv_width() as i64, s.q_width() as i64, s.head_dim as i64);
        let at = |t: &Tensor, i: [i64; 4]| (0..4).map(|k| t.strides[k] * i[k]).sum::<i64>();
        for pass in [Pass::Forward, Pass::Backward] {
            for t in &graph(pass, s).tensors {
                let Kind::Bound(role) = t.kind else { continue };
                let (b, h, q, c) = (1, 1, 7, 3);
                let row = b * s.seq as i64 + q;
                let want = match role {
                    Role::Q | Role::DQ | Role::V | Role::DK | Role::DV => row * w + h * d + c,
                    // Kᵀ and Vᵀ, dimensions [b, h, d, s]: the key (b, h, q) at column c.
                    Role::Kt | Role::Vt => row * w + h * d + c,
                    Role::O | Role::DO => row * wq + h * d + c,
                    _ => continue,
                };
                let index = if matches!(role, Role::Kt | Role::Vt) { [b, h, c, q] } else { [b, h, q, c] };
                assert_eq!(at(t, index), want, "{pass:?} {role:?}");
            }
        }
    }

    #[test]
    fn grouped_heads_sum_the_key_and_value_gradients_over_each_group() {
        let reductions =
            |s: AttnShape| graph(Pass::Backward, s).ops.iter().filter(|o| matches!(o, Op::Reduction { .. })).count();
        // rowsum(dO ∘ O), plus dK and dV summed over the groups.
        assert_eq!(reductions(shape(4, 4, 0)), 1);
        assert_eq!(reductions(shape(4, 2, 0)), 3);
        let windowed = graph(Pass::Forward, shape(4, 2, 10)).ops.len();
        assert_eq!(windowed, graph(Pass::Forward, shape(4, 2, 0)).ops.len() + 5, "the window's five operations");
    }
}
