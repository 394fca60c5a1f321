// Cross-entropy fused with the softmax, one block per row of bf16 logits.
//
// loss_n = lse(z_n) - z_n,target,   dz_nv = scale · (softmax(z_n)_v - [v = target])
//
// The row is read in vocabulary chunks (V elements per thread per step) with an online
// log-sum-exp in f32: a running maximum m and sum s = Σ exp(z - m), rescaled when m grows. No
// f32 copy of the logits exists; with a gradient, a second pass overwrites the bf16 logits with
// it in place. A target outside the vocabulary gives a NaN loss.

// Merges two (max, sum of exp(z - max)) pairs.
__device__ __forceinline__ void lse_merge(float& m, float& s, float om, float os) {
    float nm = fmaxf(m, om);
    if (nm == NEG_INF) return;  // both empty
    s = s * __expf(m - nm) + os * __expf(om - nm);
    m = nm;
}

template <int V>
__device__ void cross_entropy_impl(float* losses, bf16* logits, const u32* targets, u64 v, float scale, int grad) {
    __shared__ float sm[32], ss[32];
    u64 row = blockIdx.x;
    bf16* z = logits + row * v;
    u64 t = targets[row];
    float m = NEG_INF, s = 0.f;
    for (u64 j = (u64)threadIdx.x * V; j < v; j += (u64)blockDim.x * V) {
        float f[V];
        loadv<V>(z + j, f);
        float cm = f[0];
#pragma unroll
        for (int k = 1; k < V; k++) cm = fmaxf(cm, f[k]);
        if (cm > m) {
            s *= __expf(m - cm);
            m = cm;
        }
#pragma unroll
        for (int k = 0; k < V; k++) s += __expf(f[k] - m);
    }
    for (int o = 16; o > 0; o >>= 1) {
        float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
        lse_merge(m, s, om, os);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sm[warp] = m, ss[warp] = s;
    __syncthreads();
    if (warp == 0) {
        m = lane < (int)(blockDim.x >> 5) ? sm[lane] : NEG_INF;
        s = lane < (int)(blockDim.x >> 5) ? ss[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) {
            float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
            lse_merge(m, s, om, os);
        }
        if (lane == 0) sm[0] = m + __logf(s);
    }
    __syncthreads();
    float lse = sm[0];
    if (threadIdx.x == 0) losses[row] = t < v ? lse - bf2f(z[t]) : __int_as_float(0x7fc00000);
    if (!grad) return;
    __syncthreads();  // the target's logit is read above before it is overwritten below
    for (u64 j = (u64)threadIdx.x * V; j < v; j += (u64)blockDim.x * V) {
        float f[V];
        loadv<V>(z + j, f);
#pragma unroll
        for (int k = 0; k < V; k++) f[k] = scale * __expf(f[k] - lse) - (j + k == t ? scale : 0.f);
        storev<V>(z + j, f);
    }
}
extern "C" __global__ void cross_entropy(float* losses, bf16* logits, const u32* targets, u64 v, float scale, int grad) {
    cross_entropy_impl<1>(losses, logits, targets, v, scale, grad);
}
extern "C" __global__ void cross_entropy_v8(float* losses, bf16* logits, const u32* targets, u64 v, float scale,
                                            int grad) {
    cross_entropy_impl<8>(losses, logits, targets, v, scale, grad);
}

// Vocabulary-parallel cross-entropy (Megatron-LM's): this device holds columns first..first + v
// of every row, and the tensor group reduces between the three kernels (one block per row):
//
// cross_entropy_max:      m_n = max_v z_nv                              (then max over the group)
// cross_entropy_partials: s_n = Σ_v exp(z_nv - m_n), p_n = z_n,target-first where held, else 0
//                                                                       (then summed over the group)
// cross_entropy_finish:   loss_n = log s_n + m_n - p_n,
//                         dz_nv = scale · (exp(z_nv - m_n) / s_n - [first + v = target])

// Maximum over the block, as block_sum (every thread gets it; ends with a barrier).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : NEG_INF;
    t = warp_max(t);
    __syncthreads();
    return t;
}

extern "C" __global__ void cross_entropy_max(float* max, const bf16* logits, u64 v) {
    __shared__ float scratch[32];
    const bf16* z = logits + (u64)blockIdx.x * v;
    float m = NEG_INF;
    for (u64 j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, bf2f(z[j]));
    m = block_max(m, scratch);
    if (threadIdx.x == 0) max[blockIdx.x] = m;
}

extern "C" __global__ void cross_entropy_partials(float* sums, const bf16* logits, const float* max, const u32* targets,
                                                  u64 v, u64 first, u64 n) {
    __shared__ float scratch[32];
    u64 row = blockIdx.x;
    const bf16* z = logits + row * v;
    float m = max[row], s = 0.f;
    for (u64 j = threadIdx.x; j < v; j += blockDim.x) s += __expf(bf2f(z[j]) - m);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) {
        u64 t = targets[row];
        sums[row] = s;
        sums[n + row] = t >= first && t - first < v ? bf2f(z[t - first]) : 0.f;
    }
}

extern "C" __global__ void cross_entropy_finish(float* losses, bf16* logits, const float* max, const float* sums,
                                                const u32* targets, u64 v, u64 first, u64 n, float scale, int grad) {
    u64 row = blockIdx.x, t = targets[row];
    bf16* z = logits + row * v;
    float m = max[row], s = sums[row];
    if (threadIdx.x == 0) losses[row] = __logf(s) + m - sums[n + row];
    if (!grad) return;
    float k = scale / s;
    for (u64 j = threadIdx.x; j < v; j += blockDim.x) {
        float g = __expf(bf2f(z[j]) - m) * k;
        if (first + j == t) g -= scale;
        z[j] = f2bf(g);
    }
}
