//! The CPU backend: the f32 reference.
//!
//! Kernels are plain functions over slices, one file per op with its forward and backward side
//! by side. Parallel loops split work into chunks whose boundaries do not depend on the number of
//! threads, and every reduction adds its chunk partials in a fixed order, so results are bitwise
//! identical whatever the scheduling. Matrix products go through the `gemm` crate, whose threads
//! split the output (never the contracted dimension), which keeps them deterministic too.
//!
//! Ops get their operands as slices from `Memory::io_many`: `&mut` slices of the views they
//! write and `&` slices of those they read, in the same buffers, after checking that no written
//! view overlaps another view. It is the one place the backend builds slices from raw pointers;
//! its soundness (base pointers taken once, before any slice) is what Miri checks, on nightly:
//! `cargo +nightly miri test -p engine --lib backend::cpu::tests::io_many` runs the tests below
//! that reach it directly (the op tests reach it too, but run gemm's SIMD paths and rayon, which
//! are slow or unsupported under Miri).

mod adamw;
mod attention;
mod embedding;
mod gelu;
mod glu;
mod layernorm;
mod loss;
mod matmul;
pub(crate) use matmul::{Parallelism, sgemm};
mod mla;
mod moe;
mod muon;
mod norm;
mod qknorm;
mod reduce;
mod rope;
mod router;
mod sinks;
mod softcap;
mod swiglu;

#[cfg(test)]
mod gradcheck;

use super::{
    AdamWStep, AttnShape, Backend, BufId, BufKind, ExpertWeights, Glu, IdxView, MatMul, MlaShape, MoeDispatch,
    MuonMomentum, Parts, Segment, SeqSplit, View, fp8,
};

/// Rows handled by one task in row-parallel kernels with cross-row reductions; fixed so that
/// partial sums do not depend on the thread count.
const ROW_CHUNK: usize = 16;

/// The CPU backend. Buffers live in host memory; ops run on the global rayon pool.
#[derive(Default)]
pub struct Cpu {
    mem: Memory<f32>,
    idx: Memory<u32>,
    /// Reusable space for per-chunk partial results of reductions (grows once, on first use).
    scratch: Vec<f64>,
    /// Reusable space for the transposes of some matrix products (grows once, on first use).
    gemm: matmul::Scratch,
    /// Where the attention forward passes record each head's largest logit, if asked
    /// ([`Backend::attention_logit_max`]).
    logit_max: Option<View>,
}

/// Where a view lies: (buffer, offset, length).
trait Region: Copy + std::fmt::Debug {
    fn span(self) -> (usize, usize, usize);
}

impl Region for View {
    fn span(self) -> (usize, usize, usize) {
        (self.buf.0 as usize, self.offset, self.len)
    }
}

impl Region for IdxView {
    fn span(self) -> (usize, usize, usize) {
        (self.buf.0 as usize, self.offset, self.len)
    }
}

/// Host buffers of one element type.
struct Memory<T>(Vec<Box<[T]>>);

impl<T> Default for Memory<T> {
    fn default() -> Self {
        Memory(Vec::new())
    }
}

impl<T> Memory<T> {
    /// Bytes of every buffer together.
    fn bytes(&self) -> usize {
        self.0.iter().map(|b| std::mem::size_of_val(&**b)).sum()
    }

    fn push(&mut self, buf: Box<[T]>) -> BufId {
        self.0.push(buf);
        BufId(self.0.len() as u32 - 1)
    }

    fn get(&self, v: impl Region) -> &[T] {
        let (buf, offset, len) = v.span();
        &self.0[buf][offset..offset + len]
    }

    /// One writable view and several read-only ones (see [`Memory::io_many`]).
    fn io<R: Region, const N: usize>(&mut self, out: R, inputs: [R; N]) -> (&mut [T], [&[T]; N]) {
        let ([out], inputs) = self.io_many([out], inputs);
        (out, inputs)
    }

    /// Several writable views and several read-only ones. No writable view may overlap any other
    /// view: this check is what makes handing out the slices sound.
    fn io_many<R: Region, const M: usize, const N: usize>(
        &mut self,
        outs: [R; M],
        inputs: [R; N],
    ) -> ([&mut [T]; M], [&[T]; N]) {
        for v in outs.iter().chain(inputs.iter()) {
            let (buf, offset, len) = v.span();
            assert!(offset + len <= self.0[buf].len(), "view {v:?} out of bounds");
        }
        let overlap =
            |a: (usize, usize, usize), b: (usize, usize, usize)| a.0 == b.0 && a.1 < b.1 + b.2 && b.1 < a.1 + a.2;
        for (i, o) in outs.iter().enumerate() {
            for other in outs.iter().skip(i + 1).chain(inputs.iter()) {
                assert!(!overlap(o.span(), other.span()), "op output {o:?} overlaps {other:?}");
            }
        }
        // Every buffer's base pointer, each taken once and all before the first slice: taking a
        // buffer's pointer again (`as_mut_ptr` reborrows the whole buffer) would invalidate the
        // slices already made from it, and so would `as_ptr` on a buffer with a slice out.
        let bases: Vec<*mut T> = self.0.iter_mut().map(|b| b.as_mut_ptr()).collect();
        let outs = outs.map(|v| {
            let (buf, offset, len) = v.span();
            // SAFETY: `offset + len` lies within buffer `buf` (checked above), and no other view
            // handed out here shares an element with this one (checked above); all slices come
            // from the same base pointers, and `&mut self` keeps every other access out while
            // they live.
            unsafe { std::slice::from_raw_parts_mut(bases[buf].add(offset), len) }
        });
        let inputs = inputs.map(|v| {
            let (buf, offset, len) = v.span();
            // SAFETY: as above; read-only views may overlap each other, never a writable one.
            unsafe { std::slice::from_raw_parts(bases[buf].add(offset).cast_const(), len) }
        });
        (outs, inputs)
    }
}

/// Grows the scratch to `n` entries and returns them.
fn scratch(scratch: &mut Vec<f64>, n: usize) -> &mut [f64] {
    if scratch.len() < n {
        scratch.resize(n, 0.0);
    }
    &mut scratch[..n]
}

/// A norm's weight as it multiplies: `offset + w`, rounded to f32 as transformers' Gemma
/// computes `1.0 + weight.float()`; `w` itself when the offset is 0.
fn offset_weight(w: &[f32], offset: f32) -> std::borrow::Cow<'_, [f32]> {
    if offset == 0.0 { w.into() } else { w.iter().map(|w| offset + w).collect::<Vec<_>>().into() }
}

impl Cpu {
    /// `(expert, first row, rows)` of each expert the dispatch sent rows to, from its offsets.
    fn expert_rows(&self, dispatch: MoeDispatch) -> Vec<(usize, usize, usize)> {
        let offsets = self.idx.get(dispatch.offsets);
        (0..dispatch.experts)
            .map(|e| (e, offsets[e] as usize, (offsets[e + 1] - offsets[e]) as usize))
            .filter(|&(_, _, rows)| rows > 0)
            .collect()
    }

    /// Every expert's `out = a · W_e(ᵀ) · factor` on its rows (the grouped products; `factor`
    /// the FP8 operands' inverse scales, 1 otherwise).
    fn expert_products(
        &mut self,
        out: View,
        a: View,
        weights: ExpertWeights,
        dispatch: MoeDispatch,
        shape: MatMul,
        factor: f32,
    ) {
        for (e, first, rows) in self.expert_rows(dispatch) {
            let shape = MatMul { m: rows, ..shape };
            let (out, [a, w]) =
                self.mem.io(out.rows(first, rows, shape.n), [a.rows(first, rows, shape.k), weights.expert(e)]);
            matmul::matmul_scaled(out, a, w, shape, factor, &mut self.gemm);
        }
    }

    /// Every expert's `dW_e += dyᵀ · x · factor` on its rows; `(inp, out)` its weight's widths.
    fn expert_products_dw(
        &mut self,
        dweights: ExpertWeights,
        dy: View,
        x: View,
        dispatch: MoeDispatch,
        (inp, out): (usize, usize),
        factor: f32,
    ) {
        for (e, first, rows) in self.expert_rows(dispatch) {
            let (dw, [dy, x]) = self.mem.io(dweights.expert(e), [dy.rows(first, rows, out), x.rows(first, rows, inp)]);
            matmul::matmul_scaled(dw, dy, x, MatMul::linear_dw(rows, inp, out), factor, &mut self.gemm);
        }
    }

    /// The product of both FP8 operands' inverse scales (what an FP8 product's epilogue
    /// multiplies by).
    fn inverse_scales(&self, scales: [fp8::State; 2]) -> f32 {
        self.mem.get(scales[0].inv_scale())[0] * self.mem.get(scales[1].inv_scale())[0]
    }

    /// A CPU backend on the global rayon pool.
    pub fn new() -> Cpu {
        Cpu::default()
    }
}

impl Backend for Cpu {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    /// Nothing is freed: what the buffers and the scratch hold now is the high-water mark.
    fn peak_memory_bytes(&self) -> usize {
        self.mem.bytes() + self.idx.bytes() + self.scratch.capacity() * 8 + self.gemm.bytes()
    }

    fn alloc(&mut self, _kind: BufKind, len: usize) -> View {
        // vec! of zeros maps pages lazily; touching them now, from all threads, keeps the page
        // faults out of the first step.
        let mut buf = vec![0.0f32; len].into_boxed_slice();
        reduce::fill(&mut buf, 0.0);
        View { buf: self.mem.push(buf), offset: 0, len }
    }

    fn alloc_idx(&mut self, len: usize) -> IdxView {
        IdxView { buf: self.idx.push(vec![0; len].into_boxed_slice()), offset: 0, len }
    }

    fn upload(&mut self, dst: View, src: &[f32]) {
        self.mem.io(dst, []).0.copy_from_slice(src);
    }

    fn upload_idx(&mut self, dst: IdxView, src: &[u32]) {
        self.idx.io(dst, []).0.copy_from_slice(src);
    }

    fn download(&mut self, src: View, dst: &mut [f32]) {
        dst.copy_from_slice(self.mem.get(src));
    }

    fn download_idx(&mut self, src: IdxView, dst: &mut [u32]) {
        dst.copy_from_slice(self.idx.get(src));
    }

    fn fill(&mut self, dst: View, value: f32) {
        reduce::fill(self.mem.io(dst, []).0, value);
    }

    fn copy(&mut self, dst: View, src: View) {
        let (out, [src]) = self.mem.io(dst, [src]);
        reduce::copy(out, src);
    }

    fn add(&mut self, dst: View, src: View) {
        let (out, [src]) = self.mem.io(dst, [src]);
        reduce::add(out, src);
    }

    fn scale(&mut self, dst: View, s: f32) {
        reduce::scale(self.mem.io(dst, []).0, s);
    }

    fn sum(&mut self, out: View, x: View) {
        let partials = scratch(&mut self.scratch, reduce::partial_count(x.len));
        let total = reduce::sum(self.mem.get(x), partials, |v| v as f64);
        self.mem.io(out.at(0, 1), []).0[0] = total as f32;
    }

    fn sum_squares(&mut self, out: View, x: View) {
        let partials = scratch(&mut self.scratch, reduce::partial_count(x.len));
        let total = reduce::sum(self.mem.get(x), partials, |v| (v as f64) * (v as f64));
        self.mem.io(out.at(0, 1), []).0[0] = total as f32;
    }

    fn matmul(&mut self, out: View, a: View, b: View, shape: MatMul) {
        let (out, [a, b]) = self.mem.io(out, [a, b]);
        matmul::matmul(out, a, b, shape, &mut self.gemm);
    }

    fn supports_fp8(&self) -> bool {
        true
    }

    fn fp8_quantize(&mut self, q: View, x: View, state: fp8::State, scaling: fp8::Scaling, transpose: Option<usize>) {
        let ([q, s], [x]) = self.mem.io_many([q, state.view], [x]);
        fp8::quantize(q, x, s, state.format, scaling, transpose);
    }

    fn fp8_amax(&mut self, state: fp8::State, x: View) {
        let (s, [x]) = self.mem.io(state.view, [x]);
        fp8::record_amax(s, x);
    }

    fn fp8_transpose(&mut self, q: View, x: View, cols: usize) {
        assert_eq!(q.len, x.len, "internal error: fp8_transpose: q and x differ in length");
        let (q, [x]) = self.mem.io(q, [x]);
        matmul::transpose(x, q, x.len() / cols, cols);
    }

    /// The operands hold FP8 values in f32: every product of two is exact, and the sums are
    /// f32's, fast accumulation or not. The inverse scales multiply the product, as cuBLASLt's
    /// scale pointers do.
    fn matmul_fp8(&mut self, out: View, a: View, b: View, shape: MatMul, scales: [fp8::State; 2], _fast: bool) {
        assert!(!shape.a_t && shape.b_t, "internal error: an FP8 product in another layout than a · bᵀ");
        let factor = self.inverse_scales(scales);
        let (out, [a, b]) = self.mem.io(out, [a, b]);
        matmul::matmul_scaled(out, a, b, shape, factor, &mut self.gemm);
    }

    fn fp8_delayed_update(&mut self, states: View, stride: usize, margin: u32) {
        let (s, []) = self.mem.io(states, []);
        fp8::delayed_update(s, stride, margin);
    }

    fn embedding_forward(&mut self, out: View, table: View, tokens: IdxView, d: usize) {
        let (out, [table]) = self.mem.io(out, [table]);
        embedding::forward(out, table, self.idx.get(tokens), d);
    }

    fn embedding_backward(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize) {
        let (dtable, [dout]) = self.mem.io(dtable, [dout]);
        embedding::backward(dtable, dout, self.idx.get(tokens), d);
    }

    fn embedding_forward_slice(&mut self, out: View, table: View, tokens: IdxView, d: usize, first: usize) {
        let (out, [table]) = self.mem.io(out, [table]);
        embedding::forward_slice(out, table, self.idx.get(tokens), d, first);
    }

    fn embedding_backward_slice(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize, first: usize) {
        let (dtable, [dout]) = self.mem.io(dtable, [dout]);
        embedding::backward_slice(dtable, dout, self.idx.get(tokens), d, first);
    }

    fn rmsnorm_forward(&mut self, out: View, rstd: View, x: View, w: View, offset: f32, d: usize, eps: f32) {
        let ([out, rstd], [x, w]) = self.mem.io_many([out, rstd], [x, w]);
        norm::forward(out, rstd, x, w, offset, d, eps);
    }

    fn rmsnorm_backward(
        &mut self,
        dx: View,
        dw: View,
        dout: View,
        x: View,
        w: View,
        offset: f32,
        rstd: View,
        d: usize,
    ) {
        let partials = scratch(&mut self.scratch, (x.len / d).div_ceil(ROW_CHUNK) * d);
        let ([dx, dw], [dout, x, w, rstd]) = self.mem.io_many([dx, dw], [dout, x, w, rstd]);
        norm::backward(dx, dw, dout, x, (w, offset), rstd, d, partials);
    }

    fn layernorm_forward(&mut self, out: View, mean: View, rstd: View, x: View, w: View, b: View, d: usize, eps: f32) {
        let ([out, mean, rstd], [x, w, b]) = self.mem.io_many([out, mean, rstd], [x, w, b]);
        layernorm::forward(out, mean, rstd, x, w, b, d, eps);
    }

    fn layernorm_backward(
        &mut self,
        dx: View,
        dw: View,
        db: View,
        dout: View,
        x: View,
        w: View,
        mean: View,
        rstd: View,
        d: usize,
    ) {
        let partials = scratch(&mut self.scratch, (x.len / d).div_ceil(ROW_CHUNK) * 2 * d);
        let ([dx, dw, db], [dout, x, w, mean, rstd]) = self.mem.io_many([dx, dw, db], [dout, x, w, mean, rstd]);
        layernorm::backward(dx, dw, db, dout, x, w, mean, rstd, d, partials);
    }

    fn qk_norm_forward(&mut self, out: View, rstd: View, qkv: View, w: View, offset: f32, shape: AttnShape, eps: f32) {
        let ([out, rstd], [qkv, w]) = self.mem.io_many([out, rstd], [qkv, w]);
        qknorm::forward(out, rstd, qkv, (w, offset), shape, eps);
    }

    fn qk_norm_backward(
        &mut self,
        dqkv: View,
        dw: View,
        qkv: View,
        w: View,
        offset: f32,
        rstd: View,
        shape: AttnShape,
    ) {
        let rows = qkv.len / shape.qkv_width();
        let partials = scratch(&mut self.scratch, rows.div_ceil(ROW_CHUNK) * 2 * shape.head_dim);
        let ([dqkv, dw], [qkv, w, rstd]) = self.mem.io_many([dqkv, dw], [qkv, w, rstd]);
        qknorm::backward(dqkv, dw, qkv, (w, offset), rstd, shape, partials);
    }

    fn rope(&mut self, qkv: View, rope: View, shape: AttnShape, inverse: bool) {
        let (qkv, [rope]) = self.mem.io(qkv, [rope]);
        rope::apply(qkv, rope, shape, inverse);
    }

    fn mla_qkv_forward(&mut self, qkv: View, q: View, kv: View, kpe: View, table: View, shape: MlaShape, q_scale: f32) {
        let (qkv, [q, kv, kpe, table]) = self.mem.io(qkv, [q, kv, kpe, table]);
        mla::qkv_forward(qkv, q, kv, kpe, table, shape, q_scale);
    }

    fn mla_qkv_backward(
        &mut self,
        dq: View,
        dkv: View,
        dkpe: View,
        dqkv: View,
        table: View,
        shape: MlaShape,
        q_scale: f32,
    ) {
        let ([dq, dkv, dkpe], [dqkv, table]) = self.mem.io_many([dq, dkv, dkpe], [dqkv, table]);
        mla::qkv_backward(dq, dkv, dkpe, dqkv, table, shape, q_scale);
    }

    fn heads_narrow(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize) {
        assert!(to <= from, "internal error: heads_narrow from {from} to {to} columns");
        let (out, [x]) = self.mem.io(out, [x]);
        mla::heads_resize(out, x, rows, heads, from, to);
    }

    fn heads_widen(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize) {
        assert!(to >= from, "internal error: heads_widen from {from} to {to} columns");
        let (out, [x]) = self.mem.io(out, [x]);
        mla::heads_resize(out, x, rows, heads, from, to);
    }

    fn attention_forward(&mut self, out: View, lse: View, qkv: View, shape: AttnShape) {
        self.attention_forward_split(out, lse, qkv, shape, SeqSplit::WHOLE, None)
    }

    fn attention_logit_max(&mut self, into: Option<View>) {
        self.logit_max = into;
    }

    fn attention_backward(&mut self, dqkv: View, dout: View, qkv: View, out: View, lse: View, shape: AttnShape) {
        let (dqkv, [dout, qkv, out, lse]) = self.mem.io(dqkv, [dout, qkv, out, lse]);
        attention::backward(dqkv, dout, qkv, out, lse, shape);
    }

    fn seq_chunk_multiple(&self) -> Option<usize> {
        Some(1)
    }

    fn attention_forward_split(
        &mut self,
        out: View,
        lse: View,
        qkv_all: View,
        shape: AttnShape,
        split: SeqSplit,
        bounds: Option<IdxView>,
    ) {
        let starts = bounds.map(|b| &self.idx.get(b)[..shape.rows() * split.ranks]);
        match self.logit_max {
            Some(m) => {
                let ([out, lse, m], [qkv]) = self.mem.io_many([out, lse, m], [qkv_all]);
                attention::forward_masked(out, lse, qkv, shape, split, starts, Some(m));
            }
            None => {
                let ([out, lse], [qkv]) = self.mem.io_many([out, lse], [qkv_all]);
                attention::forward_masked(out, lse, qkv, shape, split, starts, None);
            }
        }
    }

    fn attention_backward_split(
        &mut self,
        dqkv_all: View,
        dout: View,
        qkv_all: View,
        out: View,
        lse: View,
        shape: AttnShape,
        split: SeqSplit,
        bounds: Option<IdxView>,
    ) {
        let (dqkv, [dout, qkv, out, lse]) = self.mem.io(dqkv_all, [dout, qkv_all, out, lse]);
        let starts = bounds.map(|b| &self.idx.get(b)[..shape.rows() * split.ranks]);
        attention::backward_masked(dqkv, dout, qkv, out, lse, shape, split, starts);
    }

    fn document_bounds(&mut self, bounds: IdxView, positions: Option<IdxView>, tokens: IdxView, seq: usize, eos: u32) {
        match positions {
            Some(positions) => {
                let ([bounds, positions], [tokens]) = self.idx.io_many([bounds, positions], [tokens]);
                attention::document_bounds(bounds, Some(positions), tokens, seq, eos);
            }
            None => {
                let (bounds, [tokens]) = self.idx.io(bounds, [tokens]);
                attention::document_bounds(bounds, None, tokens, seq, eos);
            }
        }
    }

    fn document_bounds_split(
        &mut self,
        bounds: IdxView,
        positions: Option<IdxView>,
        tokens: IdxView,
        seq: usize,
        split: SeqSplit,
        eos: u32,
    ) {
        match positions {
            Some(positions) => {
                let ([bounds, positions], [tokens]) = self.idx.io_many([bounds, positions], [tokens]);
                attention::document_bounds_split(bounds, Some(positions), tokens, seq, split, eos);
            }
            None => {
                let (bounds, [tokens]) = self.idx.io(bounds, [tokens]);
                attention::document_bounds_split(bounds, None, tokens, seq, split, eos);
            }
        }
    }

    fn attention_forward_docs(&mut self, out: View, lse: View, qkv: View, shape: AttnShape, bounds: IdxView) {
        self.attention_forward_split(out, lse, qkv, shape, SeqSplit::WHOLE, Some(bounds))
    }

    fn attention_backward_docs(
        &mut self,
        dqkv: View,
        dout: View,
        qkv: View,
        out: View,
        lse: View,
        shape: AttnShape,
        bounds: IdxView,
    ) {
        let (dqkv, [dout, qkv, out, lse]) = self.mem.io(dqkv, [dout, qkv, out, lse]);
        let starts = &self.idx.get(bounds)[..shape.rows()];
        attention::backward_masked(dqkv, dout, qkv, out, lse, shape, SeqSplit::WHOLE, Some(starts));
    }

    fn attention_sinks_forward(&mut self, out: View, lse: View, sinks: View, heads: usize, head_dim: usize) {
        let ([out, lse], [sinks]) = self.mem.io_many([out, lse], [sinks]);
        sinks::forward(out, lse, sinks, heads, head_dim);
    }

    fn attention_sinks_backward(
        &mut self,
        dsinks: View,
        dout: View,
        out: View,
        lse: View,
        sinks: View,
        heads: usize,
        head_dim: usize,
    ) {
        let (dsinks, [dout, out, lse, sinks]) = self.mem.io(dsinks, [dout, out, lse, sinks]);
        sinks::backward(dsinks, dout, out, lse, sinks, heads, head_dim);
    }

    fn swiglu_forward(&mut self, h: View, gu: View, f: usize) {
        let (h, [gu]) = self.mem.io(h, [gu]);
        swiglu::forward(h, gu, f);
    }

    fn swiglu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize) {
        let (dgu, [dh, gu]) = self.mem.io(dgu, [dh, gu]);
        swiglu::backward(dgu, dh, gu, f);
    }

    fn glu_forward(&mut self, h: View, gu: View, f: usize, kind: Glu) {
        let (h, [gu]) = self.mem.io(h, [gu]);
        glu::forward(h, gu, f, kind);
    }

    fn glu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize, kind: Glu) {
        let (dgu, [dh, gu]) = self.mem.io(dgu, [dh, gu]);
        glu::backward(dgu, dh, gu, f, kind);
    }

    fn softcap_forward(&mut self, x: View, cap: f32) {
        softcap::forward(self.mem.io(x, []).0, cap);
    }

    fn softcap_backward(&mut self, dx: View, x: View, cap: f32) {
        let (dx, [x]) = self.mem.io(dx, [x]);
        softcap::backward(dx, x, cap);
    }

    fn gelu_forward(&mut self, h: View, u: View, tanh: bool) {
        let (h, [u]) = self.mem.io(h, [u]);
        gelu::forward(h, u, tanh);
    }

    fn gelu_backward(&mut self, du: View, dh: View, u: View, tanh: bool) {
        let (du, [dh, u]) = self.mem.io(du, [dh, u]);
        gelu::backward(du, dh, u, tanh);
    }

    fn cross_entropy(&mut self, losses: View, logits: View, targets: IdxView, v: usize, grad_scale: Option<f32>) {
        let ([losses, logits], []) = self.mem.io_many([losses, logits], []);
        loss::cross_entropy(losses, logits, self.idx.get(targets), v, grad_scale);
    }

    fn cross_entropy_max(&mut self, max: View, logits: View, v: usize) {
        let (max, [logits]) = self.mem.io(max, [logits]);
        loss::row_max(max, logits, v);
    }

    fn cross_entropy_partials(
        &mut self,
        sums: View,
        logits: View,
        max: View,
        targets: IdxView,
        v: usize,
        first: usize,
    ) {
        let (sums, [logits, max]) = self.mem.io(sums, [logits, max]);
        loss::partials(sums, logits, max, self.idx.get(targets), v, first);
    }

    fn cross_entropy_finish(
        &mut self,
        losses: View,
        logits: View,
        max: View,
        sums: View,
        targets: IdxView,
        v: usize,
        first: usize,
        grad_scale: Option<f32>,
    ) {
        let ([losses, logits], [max, sums]) = self.mem.io_many([losses, logits], [max, sums]);
        loss::finish(losses, logits, max, sums, self.idx.get(targets), v, first, grad_scale);
    }

    fn moe_route(&mut self, probs: View, router_logits: View, dispatch: MoeDispatch) {
        let bias = dispatch.routing.bias.map(|b| self.mem.get(b).to_vec());
        let ([probs, weight, stats], [logits]) =
            self.mem.io_many([probs, dispatch.weight, dispatch.stats], [router_logits]);
        let ([expert, slot_row, row_slot, offsets], []) =
            self.idx.io_many([dispatch.expert, dispatch.slot_row, dispatch.row_slot, dispatch.offsets], []);
        let tables = moe::Tables { expert, slot_row, row_slot, offsets };
        router::route(probs, weight, stats, tables, logits, bias.as_deref(), dispatch);
    }

    fn moe_gather(&mut self, xe: View, x: View, dispatch: MoeDispatch, d: usize) {
        let (xe, [x]) = self.mem.io(xe, [x]);
        moe::gather(xe, x, self.idx.get(dispatch.row_slot), dispatch.top_k, d);
    }

    fn moe_gather_backward(&mut self, dx: View, dxe: View, dispatch: MoeDispatch, d: usize) {
        let (dx, [dxe]) = self.mem.io(dx, [dxe]);
        moe::gather_backward(dx, dxe, self.idx.get(dispatch.slot_row), dispatch.top_k, d);
    }

    fn moe_expert_matmul(&mut self, out: View, a: View, weights: ExpertWeights, dispatch: MoeDispatch, shape: MatMul) {
        self.expert_products(out, a, weights, dispatch, shape, 1.0);
    }

    fn moe_expert_matmul_dw(
        &mut self,
        dweights: ExpertWeights,
        dy: View,
        x: View,
        dispatch: MoeDispatch,
        inp: usize,
        out: usize,
    ) {
        self.expert_products_dw(dweights, dy, x, dispatch, (inp, out), 1.0);
    }

    fn moe_expert_matmul_fp8(
        &mut self,
        out: View,
        a: View,
        weights: ExpertWeights,
        dispatch: MoeDispatch,
        shape: MatMul,
        scales: [fp8::State; 2],
    ) {
        let factor = self.inverse_scales(scales);
        self.expert_products(out, a, weights, dispatch, shape, factor);
    }

    fn moe_expert_matmul_dw_fp8(
        &mut self,
        dweights: ExpertWeights,
        dy: View,
        x: View,
        dispatch: MoeDispatch,
        dims: (usize, usize),
        scales: [fp8::State; 2],
    ) {
        let factor = self.inverse_scales(scales);
        self.expert_products_dw(dweights, dy, x, dispatch, dims, factor);
    }

    fn moe_expert_bias(&mut self, out: View, bias: ExpertWeights, dispatch: MoeDispatch, width: usize) {
        assert_eq!(
            bias.first.len, width,
            "internal error: moe_expert_bias: an expert's bias holds {} ≠ {width}",
            bias.first.len
        );
        for (e, first, rows) in self.expert_rows(dispatch) {
            let (out, [b]) = self.mem.io(out.rows(first, rows, width), [bias.expert(e)]);
            moe::expert_bias(out, b);
        }
    }

    fn moe_expert_bias_backward(&mut self, dbias: ExpertWeights, dout: View, dispatch: MoeDispatch, width: usize) {
        assert_eq!(
            dbias.first.len, width,
            "internal error: moe_expert_bias_backward: an expert's bias holds {} ≠ {width}",
            dbias.first.len
        );
        for (e, first, rows) in self.expert_rows(dispatch) {
            let (db, [dout]) = self.mem.io(dbias.expert(e), [dout.rows(first, rows, width)]);
            moe::expert_bias_backward(db, dout);
        }
    }

    fn moe_combine(&mut self, out: View, ye: View, dispatch: MoeDispatch, d: usize) {
        let (out, [ye, weight]) = self.mem.io(out, [ye, dispatch.weight]);
        moe::combine(out, ye, weight, self.idx.get(dispatch.slot_row), dispatch.top_k, d);
    }

    fn moe_combine_backward(
        &mut self,
        dye: View,
        dweight: View,
        dout: View,
        ye: View,
        dispatch: MoeDispatch,
        d: usize,
    ) {
        let ([dye, dweight], [dout, ye, weight]) = self.mem.io_many([dye, dweight], [dout, ye, dispatch.weight]);
        let (slot_row, row_slot) = (self.idx.get(dispatch.slot_row), self.idx.get(dispatch.row_slot));
        moe::combine_backward(dye, dweight, dout, ye, weight, slot_row, row_slot, dispatch.top_k, d);
    }

    fn moe_route_backward(
        &mut self,
        drouter: View,
        dweight: View,
        probs: View,
        dispatch: MoeDispatch,
        counts: View,
        aux_scale: f32,
    ) {
        let (drouter, [dweight, probs, weight, counts]) =
            self.mem.io(drouter, [dweight, probs, dispatch.weight, counts]);
        router::route_backward(
            drouter,
            dweight,
            probs,
            weight,
            counts,
            self.idx.get(dispatch.expert),
            dispatch,
            aux_scale,
        );
    }

    fn moe_pack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize) {
        let (packed, [grouped]) = self.mem.io(dst, [src]);
        for (rows, part) in moe::parts(self.idx.get(offsets), parts, width) {
            let (kept, zeros) = packed[part].split_at_mut(rows.len());
            kept.copy_from_slice(&grouped[rows]);
            zeros.fill(0.0);
        }
    }

    fn moe_unpack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize) {
        let (grouped, [packed]) = self.mem.io(dst, [src]);
        for (rows, part) in moe::parts(self.idx.get(offsets), parts, width) {
            grouped[rows.clone()].copy_from_slice(&packed[part.start..part.start + rows.len()]);
        }
    }

    fn moe_counts(&mut self, counts: View, offsets: IdxView) {
        let (counts, []) = self.mem.io(counts, []);
        counts.iter_mut().zip(self.idx.get(offsets).windows(2)).for_each(|(c, o)| *c = (o[1] - o[0]) as f32);
    }

    fn moe_runs(&mut self, runs: IdxView, counts: View, parts: Parts) {
        let (runs, []) = self.idx.io(runs, []);
        moe::runs(runs, self.mem.get(counts), parts);
    }

    fn moe_load_excess(&mut self, dst: View, counts: View) {
        let (dst, [counts]) = self.mem.io(dst, [counts]);
        router::load_excess(dst, counts);
    }

    fn moe_bias_step(&mut self, bias: View, excess: View, rate: f32) {
        let ([bias, excess], []) = self.mem.io_many([bias, excess], []);
        router::bias_step(bias, excess, rate);
    }

    fn muon_momentum(&mut self, grads: View, buf: View, norm_squared: View, step: MuonMomentum) {
        let clip = super::clip_scale(self.mem.get(norm_squared)[0], step.max_grad_norm);
        let ([grads, buf], []) = self.mem.io_many([grads, buf], []);
        muon::momentum(grads, buf, step, clip);
    }

    fn divide_by_norm(&mut self, x: View, sum_squares: View, eps: f32) {
        let s = self.mem.get(sum_squares)[0];
        muon::divide_by_norm(self.mem.io(x, []).0, s, eps);
    }

    fn adamw(
        &mut self,
        params: View,
        grads: View,
        m: View,
        v: View,
        norm_squared: View,
        segments: &[Segment],
        step: AdamWStep,
    ) {
        let scale = step.clip_scale(self.mem.get(norm_squared)[0]);
        let ([params, grads, m, v], []) = self.mem.io_many([params, grads, m, v], []);
        adamw::step(params, grads, m, v, segments, step, scale);
    }
}

/// The machine's f32 GEMM rate in TFLOP/s on the current thread pool: the best of a few
/// 1024 × 1024 × 1024 products (about 0.1 s). The CPU's "peak" for MFU unless the user sets one.
pub fn measure_peak_tflops() -> f64 {
    let n = 1024;
    let a: Vec<f32> = (0..n * n).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut out = vec![0f32; n * n];
    let shape = MatMul { m: n, n, k: n, a_t: false, b_t: false, accumulate: false };
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        let start = std::time::Instant::now();
        matmul::matmul(&mut out, &a, &a, shape, &mut matmul::Scratch::default());
        best = best.min(start.elapsed().as_secs_f64());
    }
    shape.flops() / best / 1e12
}

/// The processor's model name, from `/proc/cpuinfo` where there is one.
pub fn model_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_many_hands_out_disjoint_views_of_one_buffer() {
        let mut mem = Memory::<f32>::default();
        let buf = mem.push((0..8).map(|i| i as f32).collect());
        let other = mem.push(vec![10.0; 4].into());
        let v = |offset, len| View { buf, offset, len };
        let z = View { buf: other, offset: 1, len: 1 };
        // Two outputs and two overlapping inputs of one buffer, read and written in turn.
        let ([a, b], [x, y, z]) = mem.io_many([v(0, 2), v(6, 2)], [v(2, 3), v(4, 2), z]);
        a.copy_from_slice(&[x[0], y[1]]);
        b[0] = x[2] + y[0];
        b[1] = a[0] + a[1] + z[0];
        assert_eq!(mem.get(v(0, 8)), &[2.0, 5.0, 2.0, 3.0, 4.0, 5.0, 8.0, 17.0]);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn io_many_refuses_an_output_that_overlaps_an_input() {
        let mut mem = Memory::<f32>::default();
        let buf = mem.push(vec![0.0; 8].into());
        mem.io_many([View { buf, offset: 0, len: 3 }], [View { buf, offset: 2, len: 2 }]);
    }
}
