// Learned attention sinks (GPT-OSS) as an epilogue of attention: each query head h has a sink
// logit s_h (a bf16 parameter), one more column of every query row's softmax whose probability
// is dropped. From attention's out o [rows, heads·dh] (bf16) and log-sum-exp L (f32, natural
// log of the scaled scores), per token row r and head h:
//
// forward:  L' = logaddexp(L, s_h),  o' = o · exp(L − L'),  L ← L'             (in place)
// backward: ds_h += − Σ_r exp(s_h − L'_r) · (do_{r,h} · o'_{r,h})
//           (dq, dk, dv: attention's own backward pass given o' and L')
//
// L's layout: `seq` = 0, [rows, heads] (the native kernels'); `seq` > 0, [batch, heads, seq]
// (cuDNN's statistics), row r = b·seq + t.
//
// The forward pass is a block per row, a warp per head vector. The sink gradient is
// deterministic, as RMSNorm's weight gradient: block (c, h) walks a fixed range of rows of head
// h, its warps taking the rows round-robin, and leaves its sum in partial[h, c] (the warps'
// sums added in warp order); `attention_sinks_finish` adds each head's partials in block order.

__device__ __forceinline__ u64 sinks_lse_index(u64 row, int h, int heads, int seq) {
    if (seq == 0) return row * heads + h;
    return ((row / seq) * heads + h) * seq + row % seq;
}

// In place: only lane 0 reads and writes the head's L (the warp gets it by a shuffle), so no
// lane reads it after the write.
template <int V>
__device__ void attention_sinks_forward_impl(bf16* out, float* lse, const bf16* sinks, int heads, int dh, int seq) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u64 row = blockIdx.x;
    for (int h = warp; h < heads; h += warps) {
        u64 li = sinks_lse_index(row, h, heads, seq);
        float l = warp_sum(lane == 0 ? lse[li] : 0.f);
        float s = bf2f(sinks[h]);
        float m = fmaxf(l, s);
        float after = m + log1pf(expf(-fabsf(l - s)));  // L = −∞ (no key): L' = s, o' = 0
        float scale = expf(l - after);
        bf16* o = out + (row * heads + h) * (u64)dh;
        for (int j = lane * V; j < dh; j += 32 * V) {
            float f[V];
            loadv<V>(o + j, f);
#pragma unroll
            for (int k = 0; k < V; k++) f[k] *= scale;
            storev<V>(o + j, f);
        }
        if (lane == 0) lse[li] = after;
    }
}
extern "C" __global__ void attention_sinks_forward(bf16* out, float* lse, const bf16* sinks, int heads, int dh,
                                                   int seq) {
    attention_sinks_forward_impl<1>(out, lse, sinks, heads, dh, seq);
}
extern "C" __global__ void attention_sinks_forward_v8(bf16* out, float* lse, const bf16* sinks, int heads, int dh,
                                                      int seq) {
    attention_sinks_forward_impl<8>(out, lse, sinks, heads, dh, seq);
}

// Grid (blocks, heads): block (c, h) sums rows [c·rows_per_block, (c + 1)·rows_per_block) of
// head h into partial[h · blocks + c] (without the minus sign).
template <int V>
__device__ void attention_sinks_backward_impl(float* partial, const bf16* dout, const bf16* out, const float* lse,
                                              const bf16* sinks, u64 rows, int heads, int dh, int seq,
                                              int rows_per_block) {
    __shared__ float warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int h = blockIdx.y;
    float s = bf2f(sinks[h]);
    u64 first = (u64)blockIdx.x * rows_per_block;
    u64 last = first + rows_per_block < rows ? first + rows_per_block : rows;
    float acc = 0.f;
    for (u64 r = first + warp; r < last; r += warps) {
        u64 off = (r * heads + h) * (u64)dh;
        float dot = 0.f;
        for (int j = lane * V; j < dh; j += 32 * V) {
            float g[V], o[V];
            loadv<V>(dout + off + j, g);
            loadv<V>(out + off + j, o);
#pragma unroll
            for (int k = 0; k < V; k++) dot += g[k] * o[k];
        }
        dot = warp_sum(dot);
        acc += expf(s - lse[sinks_lse_index(r, h, heads, seq)]) * dot;
    }
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int w = 0; w < warps; w++) t += warp_sums[w];
        partial[(u64)h * gridDim.x + blockIdx.x] = t;
    }
}
extern "C" __global__ void attention_sinks_backward(float* partial, const bf16* dout, const bf16* out,
                                                    const float* lse, const bf16* sinks, u64 rows, int heads, int dh,
                                                    int seq, int rows_per_block) {
    attention_sinks_backward_impl<1>(partial, dout, out, lse, sinks, rows, heads, dh, seq, rows_per_block);
}
extern "C" __global__ void attention_sinks_backward_v8(float* partial, const bf16* dout, const bf16* out,
                                                       const float* lse, const bf16* sinks, u64 rows, int heads,
                                                       int dh, int seq, int rows_per_block) {
    attention_sinks_backward_impl<8>(partial, dout, out, lse, sinks, rows, heads, dh, seq, rows_per_block);
}

// dsinks[h] −= Σ_c partial[h, c], c in block order.
extern "C" __global__ void attention_sinks_finish(float* dsinks, const float* partial, int blocks, int heads) {
    for (u64 h = global_thread(); h < (u64)heads; h += global_stride()) {
        float t = 0.f;
        for (int c = 0; c < blocks; c++) t += partial[h * blocks + c];
        dsinks[h] -= t;
    }
}
