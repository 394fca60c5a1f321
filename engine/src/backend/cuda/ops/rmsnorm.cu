// RMSNorm over rows of width d, statistics in f32.
//
// forward:  r = 1 / sqrt(mean_j(x_j²) + eps),  y_j = w_j · (x_j · r)         (one block per row)
// with w_j = offset + stored w_j in f32 (Gemma stores its norms as offsets from one; 0 else)
// backward: dx_i += r · (dy_i w_i - x_i · c),  c = r² · mean_j(dy_j w_j x_j)
//           dw_j += Σ_rows dy_j · x_j · r
//
// The `+=` into dx is the residual add of the backward pass: the residual stream's gradient
// arrives in dx and leaves with the norm's contribution added, in one pass. (Forward, the
// residual add is the epilogue of the GEMM that produces the stream: beta = 1 in cuBLASLt.)
// The weight gradient is deterministic: each block sums its rows into shared memory and writes
// one partial row; `rmsnorm_dw_finish` adds the partials in block order.

template <int V>
__device__ void rmsnorm_forward_impl(bf16* out, float* rstd, const bf16* x, const bf16* w, int d, float eps, float offset) {
    __shared__ float scratch[32];
    u64 row = blockIdx.x;
    const bf16* xr = x + row * d;
    bf16* yr = out + row * d;
    float r = rms_rstd<V>(xr, d, eps, scratch);
    if (threadIdx.x == 0) rstd[row] = r;
    for (int j = threadIdx.x * V; j < d; j += blockDim.x * V) {
        float f[V], g[V];
        loadv<V>(xr + j, f);
        loadv<V>(w + j, g);
#pragma unroll
        for (int k = 0; k < V; k++) f[k] = (g[k] + offset) * (f[k] * r);
        storev<V>(yr + j, f);
    }
}
extern "C" __global__ void rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* w, int d, float eps, float offset) {
    rmsnorm_forward_impl<1>(out, rstd, x, w, d, eps, offset);
}
extern "C" __global__ void rmsnorm_forward_v8(bf16* out, float* rstd, const bf16* x, const bf16* w, int d, float eps, float offset) {
    rmsnorm_forward_impl<8>(out, rstd, x, w, d, eps, offset);
}

// Dynamic shared memory: d floats (the block's weight-gradient row).
//
// A block walks its rows in chunks of one row per warp. First each warp reduces its own row's
// dot product Σ_j dy_j w_j x_j with shuffles (no barrier), and its lane 0 leaves r and c in
// shared memory; one barrier; then the whole block walks the chunk's rows one after the other,
// each thread on its own columns of dx and of the weight-gradient row. So a row costs 1/warps
// barriers (was two, inside `block_sum`), and a chunk's dot products are all in flight at once
// instead of one row at a time. r and c are double-buffered by chunk: a warp writes chunk k+2's
// into the buffer of chunk k only after the barrier of chunk k+1, which every thread reaches
// after it has finished reading chunk k. A thread zeroes, accumulates and writes out the same
// columns of dw_s, so those need no barrier either; each column is summed in row order, as
// before (deterministic).
template <int V>
__device__ void rmsnorm_backward_impl(bf16* dx, float* dw_partial, const bf16* dy, const bf16* x, const bf16* w,
                                      const float* rstd, u64 rows, int d, int rows_per_block, float offset) {
    DYNAMIC_SMEM(float, dw_s);
    __shared__ float r_s[2][32], c_s[2][32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = threadIdx.x * V; j < d; j += blockDim.x * V)
#pragma unroll
        for (int k = 0; k < V; k++) dw_s[j + k] = 0.f;
    u64 first = (u64)blockIdx.x * rows_per_block;
    u64 last = first + rows_per_block < rows ? first + rows_per_block : rows;
    int buf = 0;
    for (u64 row0 = first; row0 < last; row0 += warps, buf ^= 1) {
        u64 mine = row0 + warp;
        if (mine < last) {
            const bf16 *xr = x + mine * d, *dyr = dy + mine * d;
            float dot = 0.f;
            for (int j = lane * V; j < d; j += 32 * V) {
                float a[V], b[V], c[V];
                loadv<V>(dyr + j, a);
                loadv<V>(w + j, b);
                loadv<V>(xr + j, c);
#pragma unroll
                for (int k = 0; k < V; k++) dot += a[k] * (b[k] + offset) * c[k];
            }
            dot = warp_sum(dot);
            if (lane == 0) {
                float r = rstd[mine];
                r_s[buf][warp] = r;
                c_s[buf][warp] = dot / (float)d * r * r;
            }
        }
        __syncthreads();
        int n = last - row0 < (u64)warps ? (int)(last - row0) : warps;
        for (int i = 0; i < n; i++) {
            u64 row = row0 + i;
            const bf16 *xr = x + row * d, *dyr = dy + row * d;
            bf16* dxr = dx + row * d;
            float r = r_s[buf][i], c = c_s[buf][i];
            for (int j = threadIdx.x * V; j < d; j += blockDim.x * V) {
                float g[V], wv[V], xv[V], o[V];
                loadv<V>(dyr + j, g);
                loadv<V>(w + j, wv);
                loadv<V>(xr + j, xv);
                loadv<V>(dxr + j, o);
#pragma unroll
                for (int k = 0; k < V; k++) {
                    o[k] += r * (g[k] * (wv[k] + offset) - xv[k] * c);
                    dw_s[j + k] += g[k] * xv[k] * r;
                }
                storev<V>(dxr + j, o);
            }
        }
    }
    for (int j = threadIdx.x * V; j < d; j += blockDim.x * V)
#pragma unroll
        for (int k = 0; k < V; k++) dw_partial[(u64)blockIdx.x * d + j + k] = dw_s[j + k];
}
extern "C" __global__ void rmsnorm_backward(bf16* dx, float* dw_partial, const bf16* dy, const bf16* x, const bf16* w,
                                            const float* rstd, u64 rows, int d, int rows_per_block, float offset) {
    rmsnorm_backward_impl<1>(dx, dw_partial, dy, x, w, rstd, rows, d, rows_per_block, offset);
}
extern "C" __global__ void rmsnorm_backward_v8(bf16* dx, float* dw_partial, const bf16* dy, const bf16* x,
                                               const bf16* w, const float* rstd, u64 rows, int d, int rows_per_block, float offset) {
    rmsnorm_backward_impl<8>(dx, dw_partial, dy, x, w, rstd, rows, d, rows_per_block, offset);
}

// dw[j] += Σ_b partial[b, j], b in block order.
extern "C" __global__ void rmsnorm_dw_finish(float* dw, const float* partial, int blocks, int d) {
    for (u64 j = global_thread(); j < (u64)d; j += global_stride()) {
        float s = 0.f;
        for (int b = 0; b < blocks; b++) s += partial[(u64)b * d + j];
        dw[j] += s;
    }
}
