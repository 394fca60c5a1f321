//! A backend wrapper that times every op, for the profiling window of a run: one step written as
//! a Chrome trace (`chrome://tracing`, Perfetto) of per-op durations.
//!
//! While recording, each op waits for the device to finish ([`Backend::synchronize`]), so the
//! durations are the ops' own; the profiled step is therefore slower than the others and is
//! left out of performance summaries.

use std::time::Instant;

use super::{
    AdamWStep, AttnNeeds, AttnShape, Backend, BufKind, ExpertWeights, Glu, HostFn, IdxView, MatMul, MlaShape,
    MoeDispatch, MuonMomentum, Parts, Segment, SeqSplit, View, fp8,
};

/// One timed op.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Span {
    /// The op (the backend method's name).
    pub name: &'static str,
    /// Start, in microseconds since recording began.
    pub start_us: f64,
    /// Duration in microseconds.
    pub duration_us: f64,
}

/// A backend whose ops can be timed.
pub struct Traced<B: Backend> {
    /// The backend doing the work.
    pub inner: B,
    recording: Option<Instant>,
    spans: Vec<Span>,
    /// A section began while recording: its ops run (and are timed) one by one, not replayed.
    section_bypassed: bool,
}

impl<B: Backend> Traced<B> {
    /// Wraps a backend; nothing is recorded until [`Traced::start`].
    pub fn new(inner: B) -> Traced<B> {
        Traced { inner, recording: None, spans: Vec::new(), section_bypassed: false }
    }

    /// Starts recording (clearing earlier spans).
    pub fn start(&mut self) {
        self.inner.synchronize();
        self.spans.clear();
        self.recording = Some(Instant::now());
    }

    /// Stops recording and returns the spans.
    pub fn stop(&mut self) -> Vec<Span> {
        self.recording = None;
        std::mem::take(&mut self.spans)
    }

    fn time(&mut self, name: &'static str, op: impl FnOnce(&mut B)) {
        let Some(origin) = self.recording else { return op(&mut self.inner) };
        let start = Instant::now();
        op(&mut self.inner);
        self.inner.synchronize();
        let end = Instant::now();
        self.spans.push(Span {
            name,
            start_us: (start - origin).as_secs_f64() * 1e6,
            duration_us: (end - start).as_secs_f64() * 1e6,
        });
    }
}

/// The Chrome trace-event JSON of a list of spans (complete events on one track), with a summary
/// per op name in the metadata.
pub fn chrome_trace(spans: &[Span], label: &str) -> serde_json::Value {
    let events: Vec<serde_json::Value> = spans
        .iter()
        .map(|s| serde_json::json!({"name": s.name, "ph": "X", "ts": s.start_us, "dur": s.duration_us, "pid": 0, "tid": 0}))
        .collect();
    let mut totals: std::collections::BTreeMap<&str, (f64, usize)> = Default::default();
    for s in spans {
        let t = totals.entry(s.name).or_default();
        t.0 += s.duration_us;
        t.1 += 1;
    }
    let summary: serde_json::Map<String, serde_json::Value> = totals
        .into_iter()
        .map(|(name, (us, calls))| (name.to_owned(), serde_json::json!({"total_us": us, "calls": calls})))
        .collect();
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"label": label, "per_op": summary}})
}

impl<B: Backend> Backend for Traced<B> {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn select_attention(
        &mut self,
        choice: crate::config::AttentionImpl,
        shape: AttnShape,
        needs: AttnNeeds,
    ) -> anyhow::Result<()> {
        self.inner.select_attention(choice, shape, needs)
    }
    fn peak_memory_bytes(&self) -> usize {
        self.inner.peak_memory_bytes()
    }
    fn free_memory_bytes(&self) -> Option<usize> {
        self.inner.free_memory_bytes()
    }
    fn synchronize(&mut self) {
        self.inner.synchronize()
    }
    fn begin_section(&mut self, key: u32) -> bool {
        self.section_bypassed = self.recording.is_some();
        self.section_bypassed || self.inner.begin_section(key)
    }
    fn end_section(&mut self, key: u32) {
        if !std::mem::take(&mut self.section_bypassed) {
            self.inner.end_section(key)
        }
    }
    fn alloc(&mut self, kind: BufKind, len: usize) -> View {
        self.inner.alloc(kind, len)
    }
    fn alloc_idx(&mut self, len: usize) -> IdxView {
        self.inner.alloc_idx(len)
    }
    fn upload(&mut self, dst: View, src: &[f32]) {
        self.time("upload", |b| b.upload(dst, src))
    }
    fn upload_idx(&mut self, dst: IdxView, src: &[u32]) {
        self.time("upload_idx", |b| b.upload_idx(dst, src))
    }
    fn download(&mut self, src: View, dst: &mut [f32]) {
        self.time("download", |b| b.download(src, dst))
    }
    fn download_message(&mut self, src: View, dst: &mut [f32]) {
        self.time("download", |b| b.download_message(src, dst))
    }
    fn upload_message(&mut self, dst: View, src: &[f32]) {
        self.time("upload", |b| b.upload_message(dst, src))
    }
    fn download_idx(&mut self, src: IdxView, dst: &mut [u32]) {
        self.time("download_idx", |b| b.download_idx(src, dst))
    }
    fn host_call(&mut self, reads: View, writes: View, f: HostFn) {
        self.time("host_call", |b| b.host_call(reads, writes, f))
    }
    fn fill(&mut self, dst: View, value: f32) {
        self.time("fill", |b| b.fill(dst, value))
    }
    fn copy(&mut self, dst: View, src: View) {
        self.time("copy", |b| b.copy(dst, src))
    }
    fn add(&mut self, dst: View, src: View) {
        self.time("add", |b| b.add(dst, src))
    }
    fn scale(&mut self, dst: View, s: f32) {
        self.time("scale", |b| b.scale(dst, s))
    }
    fn sum(&mut self, out: View, x: View) {
        self.time("sum", |b| b.sum(out, x))
    }
    fn sum_squares(&mut self, out: View, x: View) {
        self.time("sum_squares", |b| b.sum_squares(out, x))
    }
    fn matmul(&mut self, out: View, a: View, b: View, shape: MatMul) {
        let name = match (shape.a_t, shape.b_t) {
            (false, true) => "matmul_forward",
            (false, false) => "matmul_dx",
            (true, _) => "matmul_dw",
        };
        self.time(name, |be| be.matmul(out, a, b, shape))
    }
    fn supports_fp8(&self) -> bool {
        self.inner.supports_fp8()
    }
    fn fp8_quantize(&mut self, q: View, x: View, state: fp8::State, scaling: fp8::Scaling, transpose: Option<usize>) {
        self.time("fp8_quantize", |be| be.fp8_quantize(q, x, state, scaling, transpose))
    }
    fn fp8_quantize_both(&mut self, q: View, qt: View, x: View, state: fp8::State, scaling: fp8::Scaling, cols: usize) {
        self.time("fp8_quantize", |be| be.fp8_quantize_both(q, qt, x, state, scaling, cols))
    }
    fn fp8_amax(&mut self, state: fp8::State, x: View) {
        self.time("fp8_amax", |be| be.fp8_amax(state, x))
    }
    fn fp8_transpose(&mut self, q: View, x: View, cols: usize) {
        self.time("fp8_transpose", |be| be.fp8_transpose(q, x, cols))
    }
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_fp8(
        &mut self,
        cast: (View, View, fp8::State),
        out: View,
        rstd: View,
        xw: (View, View),
        offset: f32,
        d: usize,
        eps: f32,
    ) {
        self.time("rmsnorm_fp8", |be| be.rmsnorm_fp8(cast, out, rstd, xw, offset, d, eps))
    }
    fn swiglu_fp8(&mut self, cast: (View, View, fp8::State), h: View, gu: View, f: usize) {
        self.time("swiglu_fp8", |be| be.swiglu_fp8(cast, h, gu, f))
    }
    fn matmul_fp8(&mut self, out: View, a: View, b: View, shape: MatMul, scales: [fp8::State; 2], fast: bool) {
        self.time("matmul_fp8", |be| be.matmul_fp8(out, a, b, shape, scales, fast))
    }
    fn matmul_fp8_add(&mut self, out: View, a: View, b: View, c: View, s: MatMul, scales: [fp8::State; 2], fast: bool) {
        self.time("matmul_fp8", |be| be.matmul_fp8_add(out, a, b, c, s, scales, fast))
    }
    fn fp8_delayed_update(&mut self, states: View, stride: usize, margin: u32) {
        self.time("fp8_delayed_update", |be| be.fp8_delayed_update(states, stride, margin))
    }
    fn matmul_add(&mut self, out: View, a: View, b: View, c: View, shape: MatMul) {
        self.time("matmul_forward", |be| be.matmul_add(out, a, b, c, shape))
    }
    fn embedding_forward(&mut self, out: View, table: View, tokens: IdxView, d: usize) {
        self.time("embedding_forward", |b| b.embedding_forward(out, table, tokens, d))
    }
    fn embedding_backward(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize) {
        self.time("embedding_backward", |b| b.embedding_backward(dtable, dout, tokens, d))
    }
    fn embedding_forward_slice(&mut self, out: View, table: View, tokens: IdxView, d: usize, first: usize) {
        self.time("embedding_forward", |b| b.embedding_forward_slice(out, table, tokens, d, first))
    }
    fn embedding_backward_slice(&mut self, dtable: View, dout: View, tokens: IdxView, d: usize, first: usize) {
        self.time("embedding_backward", |b| b.embedding_backward_slice(dtable, dout, tokens, d, first))
    }
    fn rmsnorm_forward(&mut self, out: View, rstd: View, x: View, w: View, offset: f32, d: usize, eps: f32) {
        self.time("rmsnorm_forward", |b| b.rmsnorm_forward(out, rstd, x, w, offset, d, eps))
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
        self.time("rmsnorm_backward", |b| b.rmsnorm_backward(dx, dw, dout, x, w, offset, rstd, d))
    }
    fn qk_norm_forward(&mut self, out: View, rstd: View, qkv: View, w: View, offset: f32, shape: AttnShape, eps: f32) {
        self.time("qk_norm_forward", |b| b.qk_norm_forward(out, rstd, qkv, w, offset, shape, eps))
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
        self.time("qk_norm_backward", |b| b.qk_norm_backward(dqkv, dw, qkv, w, offset, rstd, shape))
    }
    fn rope(&mut self, qkv: View, rope: View, shape: AttnShape, inverse: bool) {
        self.time(if inverse { "rope_backward" } else { "rope_forward" }, |b| b.rope(qkv, rope, shape, inverse))
    }
    fn mla_qkv_forward(&mut self, qkv: View, q: View, kv: View, kpe: View, table: View, shape: MlaShape, q_scale: f32) {
        self.time("mla_qkv_forward", |b| b.mla_qkv_forward(qkv, q, kv, kpe, table, shape, q_scale))
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
        self.time("mla_qkv_backward", |b| b.mla_qkv_backward(dq, dkv, dkpe, dqkv, table, shape, q_scale))
    }
    fn heads_narrow(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize) {
        self.time("heads_narrow", |b| b.heads_narrow(out, x, rows, heads, from, to))
    }
    fn heads_widen(&mut self, out: View, x: View, rows: usize, heads: usize, from: usize, to: usize) {
        self.time("heads_widen", |b| b.heads_widen(out, x, rows, heads, from, to))
    }
    fn attention_forward(&mut self, out: View, lse: View, qkv: View, shape: AttnShape) {
        self.time("attention_forward", |b| b.attention_forward(out, lse, qkv, shape))
    }
    fn attention_backward(&mut self, dqkv: View, dout: View, qkv: View, out: View, lse: View, shape: AttnShape) {
        self.time("attention_backward", |b| b.attention_backward(dqkv, dout, qkv, out, lse, shape))
    }
    fn attention_logit_max(&mut self, into: Option<View>) {
        self.inner.attention_logit_max(into)
    }
    fn seq_chunk_multiple(&self) -> Option<usize> {
        self.inner.seq_chunk_multiple()
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
        self.time("attention_forward", |b| b.attention_forward_split(out, lse, qkv_all, shape, split, bounds))
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
        self.time("attention_backward", |b| {
            b.attention_backward_split(dqkv_all, dout, qkv_all, out, lse, shape, split, bounds)
        })
    }
    fn document_bounds(&mut self, bounds: IdxView, positions: Option<IdxView>, tokens: IdxView, seq: usize, eos: u32) {
        self.time("document_bounds", |b| b.document_bounds(bounds, positions, tokens, seq, eos))
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
        self.time("document_bounds", |b| b.document_bounds_split(bounds, positions, tokens, seq, split, eos))
    }
    fn attention_forward_docs(&mut self, out: View, lse: View, qkv: View, shape: AttnShape, bounds: IdxView) {
        self.time("attention_forward", |b| b.attention_forward_docs(out, lse, qkv, shape, bounds))
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
        self.time("attention_backward", |b| b.attention_backward_docs(dqkv, dout, qkv, out, lse, shape, bounds))
    }
    fn attention_sinks_forward(&mut self, out: View, lse: View, sinks: View, heads: usize, head_dim: usize) {
        self.time("attention_sinks_forward", |b| b.attention_sinks_forward(out, lse, sinks, heads, head_dim))
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
        self.time("attention_sinks_backward", |b| {
            b.attention_sinks_backward(dsinks, dout, out, lse, sinks, heads, head_dim)
        })
    }
    fn layernorm_forward(&mut self, out: View, mean: View, rstd: View, x: View, w: View, b: View, d: usize, eps: f32) {
        self.time("layernorm_forward", |be| be.layernorm_forward(out, mean, rstd, x, w, b, d, eps))
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
        self.time("layernorm_backward", |be| be.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, d))
    }
    fn softcap_forward(&mut self, x: View, cap: f32) {
        self.time("softcap_forward", |b| b.softcap_forward(x, cap))
    }
    fn softcap_backward(&mut self, dx: View, x: View, cap: f32) {
        self.time("softcap_backward", |b| b.softcap_backward(dx, x, cap))
    }
    fn gelu_forward(&mut self, h: View, u: View, tanh: bool) {
        self.time("gelu_forward", |b| b.gelu_forward(h, u, tanh))
    }
    fn gelu_backward(&mut self, du: View, dh: View, u: View, tanh: bool) {
        self.time("gelu_backward", |b| b.gelu_backward(du, dh, u, tanh))
    }
    fn swiglu_forward(&mut self, h: View, gu: View, f: usize) {
        self.time("swiglu_forward", |b| b.swiglu_forward(h, gu, f))
    }
    fn swiglu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize) {
        self.time("swiglu_backward", |b| b.swiglu_backward(dgu, dh, gu, f))
    }
    fn glu_forward(&mut self, h: View, gu: View, f: usize, kind: Glu) {
        self.time("glu_forward", |b| b.glu_forward(h, gu, f, kind))
    }
    fn glu_backward(&mut self, dgu: View, dh: View, gu: View, f: usize, kind: Glu) {
        self.time("glu_backward", |b| b.glu_backward(dgu, dh, gu, f, kind))
    }
    fn cross_entropy(&mut self, losses: View, logits: View, targets: IdxView, v: usize, grad_scale: Option<f32>) {
        self.time("cross_entropy", |b| b.cross_entropy(losses, logits, targets, v, grad_scale))
    }
    fn cross_entropy_max(&mut self, max: View, logits: View, v: usize) {
        self.time("cross_entropy", |b| b.cross_entropy_max(max, logits, v))
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
        self.time("cross_entropy", |b| b.cross_entropy_partials(sums, logits, max, targets, v, first))
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
        self.time("cross_entropy", |b| b.cross_entropy_finish(losses, logits, max, sums, targets, v, first, grad_scale))
    }
    fn moe_route(&mut self, probs: View, router_logits: View, dispatch: MoeDispatch) {
        self.time("moe_route", |b| b.moe_route(probs, router_logits, dispatch))
    }
    fn moe_gather(&mut self, xe: View, x: View, dispatch: MoeDispatch, d: usize) {
        self.time("moe_gather", |b| b.moe_gather(xe, x, dispatch, d))
    }
    fn moe_gather_backward(&mut self, dx: View, dxe: View, dispatch: MoeDispatch, d: usize) {
        self.time("moe_gather_backward", |b| b.moe_gather_backward(dx, dxe, dispatch, d))
    }
    fn moe_expert_matmul(&mut self, out: View, a: View, weights: ExpertWeights, dispatch: MoeDispatch, shape: MatMul) {
        self.time("moe_expert_matmul", |b| b.moe_expert_matmul(out, a, weights, dispatch, shape))
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
        self.time("moe_expert_matmul_dw", |b| b.moe_expert_matmul_dw(dweights, dy, x, dispatch, inp, out))
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
        self.time("moe_expert_matmul_fp8", |b| b.moe_expert_matmul_fp8(out, a, weights, dispatch, shape, scales))
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
        self.time("moe_expert_matmul_dw_fp8", |b| b.moe_expert_matmul_dw_fp8(dweights, dy, x, dispatch, dims, scales))
    }
    fn moe_expert_bias(&mut self, out: View, bias: ExpertWeights, dispatch: MoeDispatch, width: usize) {
        self.time("moe_expert_bias", |b| b.moe_expert_bias(out, bias, dispatch, width))
    }
    fn moe_expert_bias_backward(&mut self, dbias: ExpertWeights, dout: View, dispatch: MoeDispatch, width: usize) {
        self.time("moe_expert_bias_backward", |b| b.moe_expert_bias_backward(dbias, dout, dispatch, width))
    }
    fn moe_combine(&mut self, out: View, ye: View, dispatch: MoeDispatch, d: usize) {
        self.time("moe_combine", |b| b.moe_combine(out, ye, dispatch, d))
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
        self.time("moe_combine_backward", |b| b.moe_combine_backward(dye, dweight, dout, ye, dispatch, d))
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
        self.time("moe_route_backward", |b| b.moe_route_backward(drouter, dweight, probs, dispatch, counts, aux_scale))
    }
    fn moe_pack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize) {
        self.time("moe_pack", |b| b.moe_pack(dst, src, offsets, parts, width))
    }
    fn moe_unpack(&mut self, dst: View, src: View, offsets: IdxView, parts: Parts, width: usize) {
        self.time("moe_unpack", |b| b.moe_unpack(dst, src, offsets, parts, width))
    }
    fn moe_counts(&mut self, counts: View, offsets: IdxView) {
        self.time("moe_counts", |b| b.moe_counts(counts, offsets))
    }
    fn moe_runs(&mut self, runs: IdxView, counts: View, parts: Parts) {
        self.time("moe_runs", |b| b.moe_runs(runs, counts, parts))
    }
    fn moe_load_excess(&mut self, dst: View, counts: View) {
        self.time("moe_load_excess", |b| b.moe_load_excess(dst, counts))
    }
    fn moe_bias_step(&mut self, bias: View, excess: View, rate: f32) {
        self.time("moe_bias_step", |b| b.moe_bias_step(bias, excess, rate))
    }
    fn muon_momentum(&mut self, grads: View, buf: View, norm_squared: View, step: MuonMomentum) {
        self.time("muon_momentum", |b| b.muon_momentum(grads, buf, norm_squared, step))
    }
    fn divide_by_norm(&mut self, x: View, sum_squares: View, eps: f32) {
        self.time("divide_by_norm", |b| b.divide_by_norm(x, sum_squares, eps))
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
        self.time("adamw", |b| b.adamw(params, grads, m, v, norm_squared, segments, step))
    }

    fn adamw_fp8(
        &mut self,
        params: View,
        grads: View,
        moments: (View, View),
        norm_squared: View,
        segments: &[Segment],
        step: AdamWStep,
        casts: &[crate::backend::fp8::WeightCast],
    ) {
        self.time("adamw", |b| b.adamw_fp8(params, grads, moments, norm_squared, segments, step, casts))
    }
}
