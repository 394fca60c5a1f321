// SwiGLU over rows [gate (f) | up (f)].
//
// forward:  h = silu(g) · u,  silu(g) = g · σ(g)
// backward: dg = dh · u · σ(g) · (1 + g · (1 - σ(g))),  du = dh · silu(g)

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

template <int V>
__device__ void swiglu_forward_impl(bf16* h, const bf16* gu, u64 n, int f) {
    u64 chunks = n * (u64)(f / V);
    for (u64 c = global_thread(); c < chunks; c += global_stride()) {
        u64 row = c / (f / V);
        int j = (int)(c - row * (f / V)) * V;
        float g[V], u[V], o[V];
        loadv<V>(gu + row * 2 * f + j, g);
        loadv<V>(gu + row * 2 * f + f + j, u);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = g[k] * sigmoid(g[k]) * u[k];
        storev<V>(h + row * f + j, o);
    }
}
extern "C" __global__ void swiglu_forward(bf16* h, const bf16* gu, u64 n, int f) { swiglu_forward_impl<1>(h, gu, n, f); }
extern "C" __global__ void swiglu_forward_v8(bf16* h, const bf16* gu, u64 n, int f) {
    swiglu_forward_impl<8>(h, gu, n, f);
}

template <int V>
__device__ void swiglu_backward_impl(bf16* dgu, const bf16* dh, const bf16* gu, u64 n, int f) {
    u64 chunks = n * (u64)(f / V);
    for (u64 c = global_thread(); c < chunks; c += global_stride()) {
        u64 row = c / (f / V);
        int j = (int)(c - row * (f / V)) * V;
        float g[V], u[V], d[V], dg[V], du[V];
        loadv<V>(gu + row * 2 * f + j, g);
        loadv<V>(gu + row * 2 * f + f + j, u);
        loadv<V>(dh + row * f + j, d);
#pragma unroll
        for (int k = 0; k < V; k++) {
            float s = sigmoid(g[k]);
            dg[k] = d[k] * u[k] * s * (1.f + g[k] * (1.f - s));
            du[k] = d[k] * g[k] * s;
        }
        storev<V>(dgu + row * 2 * f + j, dg);
        storev<V>(dgu + row * 2 * f + f + j, du);
    }
}
extern "C" __global__ void swiglu_backward(bf16* dgu, const bf16* dh, const bf16* gu, u64 n, int f) {
    swiglu_backward_impl<1>(dgu, dh, gu, n, f);
}
extern "C" __global__ void swiglu_backward_v8(bf16* dgu, const bf16* dh, const bf16* gu, u64 n, int f) {
    swiglu_backward_impl<8>(dgu, dh, gu, n, f);
}
