// SwiGLU over rows [gate (f) | up (f)], and the other gated linear units (below).
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
        for (int k = 0; k < V; k++) o[k] = swiglu_element(g[k], u[k]);
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

// Gated linear units beyond SwiGLU over the same rows (glu_forward / glu_backward), `kind`
// GLU_CLAMPED (GPT-OSS) or GLU_GELU_TANH (Gemma); x_g, x_u a row's inputs, [·] the indicator
// through which a clamp passes its gradient (torch's clamp: where min ≤ x ≤ max, equality
// included):
//
// clamped (limit L, slope α):
//   forward:  g = min(x_g, L)              backward: dx_g = dh · (u + 1) · s · (1 + α·g·(1 - s)) · [x_g ≤ L]
//             u = clamp(x_u, -L, L)                  dx_u = dh · g · s · [-L ≤ x_u ≤ L]
//             s = σ(α·g),  h = (u + 1) · g · s
// gelu-tanh:
//   forward:  h = gelu(x_g) · x_u          backward: dx_g = dh · x_u · gelu'(x_g),  dx_u = dh · gelu(x_g)
//             gelu(x) = ½x(1 + t)                    gelu'(x) = ½(1 + t) + ½x(1 - t²) · c(1 + 3a·x²)
//             t = tanh(c(x + a·x³)),  c = √(2/π), a = 0.044715

#define GLU_CLAMPED 1
#define GLU_GELU_TANH 2
#define GLU_GELU_C 0.7978845608028654f
#define GLU_GELU_A 0.044715f

__device__ __forceinline__ float glu_value(float xg, float xu, int kind, float limit, float alpha) {
    if (kind == GLU_CLAMPED) {
        float g = fminf(xg, limit), u = fminf(fmaxf(xu, -limit), limit);
        return (u + 1.f) * g * sigmoid(alpha * g);
    }
    float t = tanhf(GLU_GELU_C * (xg + GLU_GELU_A * xg * xg * xg));
    return 0.5f * xg * (1.f + t) * xu;
}

__device__ __forceinline__ void glu_grad(float xg, float xu, float d, int kind, float limit, float alpha, float* dg,
                                         float* du) {
    if (kind == GLU_CLAMPED) {
        float g = fminf(xg, limit), u = fminf(fmaxf(xu, -limit), limit);
        float s = sigmoid(alpha * g);
        *dg = xg <= limit ? d * (u + 1.f) * s * (1.f + alpha * g * (1.f - s)) : 0.f;
        *du = (xu >= -limit && xu <= limit) ? d * g * s : 0.f;
        return;
    }
    float t = tanhf(GLU_GELU_C * (xg + GLU_GELU_A * xg * xg * xg));
    float grad = 0.5f * (1.f + t) + 0.5f * xg * (1.f - t * t) * GLU_GELU_C * (1.f + 3.f * GLU_GELU_A * xg * xg);
    *dg = d * xu * grad;
    *du = d * 0.5f * xg * (1.f + t);
}

template <int V>
__device__ void glu_forward_impl(bf16* h, const bf16* gu, u64 n, int f, int kind, float limit, float alpha) {
    u64 chunks = n * (u64)(f / V);
    for (u64 c = global_thread(); c < chunks; c += global_stride()) {
        u64 row = c / (f / V);
        int j = (int)(c - row * (f / V)) * V;
        float g[V], u[V], o[V];
        loadv<V>(gu + row * 2 * f + j, g);
        loadv<V>(gu + row * 2 * f + f + j, u);
#pragma unroll
        for (int k = 0; k < V; k++) o[k] = glu_value(g[k], u[k], kind, limit, alpha);
        storev<V>(h + row * f + j, o);
    }
}
extern "C" __global__ void glu_forward(bf16* h, const bf16* gu, u64 n, int f, int kind, float limit, float alpha) {
    glu_forward_impl<1>(h, gu, n, f, kind, limit, alpha);
}
extern "C" __global__ void glu_forward_v8(bf16* h, const bf16* gu, u64 n, int f, int kind, float limit, float alpha) {
    glu_forward_impl<8>(h, gu, n, f, kind, limit, alpha);
}

template <int V>
__device__ void glu_backward_impl(bf16* dgu, const bf16* dh, const bf16* gu, u64 n, int f, int kind, float limit,
                                  float alpha) {
    u64 chunks = n * (u64)(f / V);
    for (u64 c = global_thread(); c < chunks; c += global_stride()) {
        u64 row = c / (f / V);
        int j = (int)(c - row * (f / V)) * V;
        float g[V], u[V], d[V], dg[V], du[V];
        loadv<V>(gu + row * 2 * f + j, g);
        loadv<V>(gu + row * 2 * f + f + j, u);
        loadv<V>(dh + row * f + j, d);
#pragma unroll
        for (int k = 0; k < V; k++) glu_grad(g[k], u[k], d[k], kind, limit, alpha, &dg[k], &du[k]);
        storev<V>(dgu + row * 2 * f + j, dg);
        storev<V>(dgu + row * 2 * f + f + j, du);
    }
}
extern "C" __global__ void glu_backward(bf16* dgu, const bf16* dh, const bf16* gu, u64 n, int f, int kind, float limit,
                                        float alpha) {
    glu_backward_impl<1>(dgu, dh, gu, n, f, kind, limit, alpha);
}
extern "C" __global__ void glu_backward_v8(bf16* dgu, const bf16* dh, const bf16* gu, u64 n, int f, int kind,
                                           float limit, float alpha) {
    glu_backward_impl<8>(dgu, dh, gu, n, f, kind, limit, alpha);
}
