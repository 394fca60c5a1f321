// QK-norm (Qwen3): RMSNorm of width dh over each query head and each key head of packed qkv
// rows [q: H·dh | k: KV·dh | v: KV·dh] (width = (H + 2·KV)·dh), before RoPE. Query heads share
// the weight wq = w[0, dh), key heads wk = w[dh, 2·dh); values pass through. Statistics in f32.
//
// w_j is offset + stored w_j in f32 (Gemma 3 stores its norms as offsets from one; 0 else).
//
// forward:  per head vector x (width dh), r = 1 / sqrt(mean_j(x_j²) + eps),  y_j = w_j · (x_j · r)
// backward: dx_i = r · (dy_i w_i - x_i · c),  c = r² · mean_j(dy_j w_j x_j)     (in place of dy)
//           dw_j += Σ_heads dy_j · x_j · r   (q heads into dwq, k heads into dwk)
//
// One warp per head vector: its lanes reduce the vector's sum of squares (or dot product) with
// shuffles, no barrier. rstd is [row, H + KV], head-major within a row.
//
// The weight gradient is deterministic, as RMSNorm's: a block walks a fixed range of rows; its
// warps take the range's head vectors round-robin (vector i = row · (H + KV) + head, warp
// i mod warps) and each sums into its own [dwq | dwk] row of shared memory, a lane always on the
// same columns (no barrier, no atomics); at the end the block adds its warps' rows in warp order
// into one partial row, and `qk_norm_dw_finish` adds the partials in block order into dw.

// Copies V bf16 as they are (the v part of a row).
template <int V>
__device__ __forceinline__ void copyv(bf16* dst, const bf16* src) {
    if constexpr (V == 8) {
        *(uint4*)dst = *(const uint4*)src;
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) dst[k] = src[k];
    }
}

// One block per row; warp w normalises heads w, w + warps, ...; then the block copies v.
template <int V>
__device__ void qk_norm_forward_impl(bf16* out, float* rstd, const bf16* x, const bf16* w, int heads, int n_heads,
                                     int dh, int width, float eps, float offset) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u64 row = blockIdx.x;
    const bf16* xr = x + row * width;
    bf16* yr = out + row * width;
    for (int h = warp; h < heads; h += warps) {
        const bf16* xh = xr + (u64)h * dh;
        const bf16* wh = w + (h < n_heads ? 0 : dh);
        bf16* yh = yr + (u64)h * dh;
        float ss = 0.f;
        for (int j = lane * V; j < dh; j += 32 * V) {
            float f[V];
            loadv<V>(xh + j, f);
#pragma unroll
            for (int k = 0; k < V; k++) ss += f[k] * f[k];
        }
        ss = warp_sum(ss);
        float r = 1.f / sqrtf(ss / (float)dh + eps);
        if (lane == 0) rstd[row * heads + h] = r;
        for (int j = lane * V; j < dh; j += 32 * V) {
            float f[V], g[V];
            loadv<V>(xh + j, f);
            loadv<V>(wh + j, g);
#pragma unroll
            for (int k = 0; k < V; k++) f[k] = (g[k] + offset) * (f[k] * r);
            storev<V>(yh + j, f);
        }
    }
    for (int j = heads * dh + threadIdx.x * V; j < width; j += blockDim.x * V) copyv<V>(yr + j, xr + j);
}
extern "C" __global__ void qk_norm_forward(bf16* out, float* rstd, const bf16* x, const bf16* w, int heads,
                                           int n_heads, int dh, int width, float eps, float offset) {
    qk_norm_forward_impl<1>(out, rstd, x, w, heads, n_heads, dh, width, eps, offset);
}
extern "C" __global__ void qk_norm_forward_v8(bf16* out, float* rstd, const bf16* x, const bf16* w, int heads,
                                              int n_heads, int dh, int width, float eps, float offset) {
    qk_norm_forward_impl<8>(out, rstd, x, w, heads, n_heads, dh, width, eps, offset);
}

// Dynamic shared memory: warps · 2·dh floats (each warp's [dwq | dwk] row).
//
// In place: a warp reads its vector's dy for the dot product, then reads each lane's columns
// again and overwrites them with dx; no other warp touches the vector.
template <int V>
__device__ void qk_norm_backward_impl(bf16* dqkv, float* dw_partial, const bf16* x, const bf16* w, const float* rstd,
                                      u64 rows, int heads, int n_heads, int dh, int width, int rows_per_block, float offset) {
    DYNAMIC_SMEM(float, dw_s);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* mine = dw_s + (u64)warp * 2 * dh;
    // Zeroed by the lanes that accumulate into them (the same columns as below).
    for (int p = 0; p < 2 * dh; p += dh)
        for (int j = lane * V; j < dh; j += 32 * V)
#pragma unroll
            for (int k = 0; k < V; k++) mine[p + j + k] = 0.f;
    u64 first = (u64)blockIdx.x * rows_per_block;
    u64 last = first + rows_per_block < rows ? first + rows_per_block : rows;
    u64 vectors = first < last ? (last - first) * heads : 0;
    for (u64 i = warp; i < vectors; i += warps) {
        u64 row = first + i / heads;
        int h = (int)(i % heads);
        u64 off = row * width + (u64)h * dh;
        int part = h < n_heads ? 0 : dh;
        const bf16 *xh = x + off, *wh = w + part;
        bf16* g = dqkv + off;
        float r = rstd[row * heads + h];
        float dot = 0.f;
        for (int j = lane * V; j < dh; j += 32 * V) {
            float a[V], b[V], c[V];
            loadv<V>(g + j, a);
            loadv<V>(wh + j, b);
            loadv<V>(xh + j, c);
#pragma unroll
            for (int k = 0; k < V; k++) dot += a[k] * (b[k] + offset) * c[k];
        }
        dot = warp_sum(dot);
        float c = dot / (float)dh * r * r;
        for (int j = lane * V; j < dh; j += 32 * V) {
            float gv[V], wv[V], xv[V], o[V];
            loadv<V>(g + j, gv);
            loadv<V>(wh + j, wv);
            loadv<V>(xh + j, xv);
#pragma unroll
            for (int k = 0; k < V; k++) {
                mine[part + j + k] += gv[k] * xv[k] * r;
                o[k] = r * (gv[k] * (wv[k] + offset) - xv[k] * c);
            }
            storev<V>(g + j, o);
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < 2 * dh; j += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < warps; k++) s += dw_s[(u64)k * 2 * dh + j];
        dw_partial[(u64)blockIdx.x * 2 * dh + j] = s;
    }
}
extern "C" __global__ void qk_norm_backward(bf16* dqkv, float* dw_partial, const bf16* x, const bf16* w,
                                            const float* rstd, u64 rows, int heads, int n_heads, int dh, int width,
                                            int rows_per_block, float offset) {
    qk_norm_backward_impl<1>(dqkv, dw_partial, x, w, rstd, rows, heads, n_heads, dh, width, rows_per_block, offset);
}
extern "C" __global__ void qk_norm_backward_v8(bf16* dqkv, float* dw_partial, const bf16* x, const bf16* w,
                                               const float* rstd, u64 rows, int heads, int n_heads, int dh,
                                               int width, int rows_per_block, float offset) {
    qk_norm_backward_impl<8>(dqkv, dw_partial, x, w, rstd, rows, heads, n_heads, dh, width, rows_per_block, offset);
}

// dw[j] += Σ_b partial[b, j], b in block order (d = 2·dh).
extern "C" __global__ void qk_norm_dw_finish(float* dw, const float* partial, int blocks, int d) {
    for (u64 j = global_thread(); j < (u64)d; j += global_stride()) {
        float s = 0.f;
        for (int b = 0; b < blocks; b++) s += partial[(u64)b * d + j];
        dw[j] += s;
    }
}
