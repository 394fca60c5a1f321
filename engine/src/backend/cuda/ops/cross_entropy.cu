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
