// Fills, converting copies and adds, and deterministic sums.
//
// fill:   x[i] = v
// copy:   d[i] = s[i]            (through f32 when the types differ; same-type copies are memcpys)
// add:    d[i] = d[i] + s[i]     (in f32, rounded once to d's type)
// scale:  x[i] = x[i] · c        (in f32)
// softcap: x[i] = c · tanh(x[i] / c); backward dx[i] = dx[i] · (1 − tanh²(x[i] / c)), x the
//         values before capping (Gemma's final-logit soft-capping), in f32
// sum:    out[0] = Σ f(x[i]), f(v) = v or v², in f64: fixed-size block partials, then one block
//         adds them in a fixed order, so the result does not depend on scheduling.

template <typename T>
__device__ void fill_impl(T* x, u64 n, float v) {
    for (u64 i = global_thread(); i < n; i += global_stride()) st(&x[i], v);
}
extern "C" __global__ void fill_f32(float* x, u64 n, float v) { fill_impl(x, n, v); }
extern "C" __global__ void fill_bf16(bf16* x, u64 n, float v) { fill_impl(x, n, v); }

template <typename D, typename S>
__device__ void copy_impl(D* d, const S* s, u64 n) {
    for (u64 i = global_thread(); i < n; i += global_stride()) st(&d[i], ld(&s[i]));
}
extern "C" __global__ void copy_bf16_f32(bf16* d, const float* s, u64 n) { copy_impl(d, s, n); }
extern "C" __global__ void copy_f32_bf16(float* d, const bf16* s, u64 n) { copy_impl(d, s, n); }

template <typename D, typename S>
__device__ void add_impl(D* d, const S* s, u64 n) {
    for (u64 i = global_thread(); i < n; i += global_stride()) st(&d[i], ld(&d[i]) + ld(&s[i]));
}
extern "C" __global__ void add_f32_f32(float* d, const float* s, u64 n) { add_impl(d, s, n); }
extern "C" __global__ void add_f32_bf16(float* d, const bf16* s, u64 n) { add_impl(d, s, n); }
extern "C" __global__ void add_bf16_f32(bf16* d, const float* s, u64 n) { add_impl(d, s, n); }
extern "C" __global__ void add_bf16_bf16(bf16* d, const bf16* s, u64 n) { add_impl(d, s, n); }

template <typename T>
__device__ void scale_impl(T* x, u64 n, float c) {
    for (u64 i = global_thread(); i < n; i += global_stride()) st(&x[i], ld(&x[i]) * c);
}
extern "C" __global__ void scale_f32(float* x, u64 n, float c) { scale_impl(x, n, c); }
extern "C" __global__ void scale_bf16(bf16* x, u64 n, float c) { scale_impl(x, n, c); }

template <typename T>
__device__ void softcap_forward_impl(T* x, u64 n, float c) {
    for (u64 i = global_thread(); i < n; i += global_stride()) st(&x[i], tanhf(ld(&x[i]) / c) * c);
}
extern "C" __global__ void softcap_forward_f32(float* x, u64 n, float c) { softcap_forward_impl(x, n, c); }
extern "C" __global__ void softcap_forward_bf16(bf16* x, u64 n, float c) { softcap_forward_impl(x, n, c); }

template <typename T>
__device__ void softcap_backward_impl(T* dx, const T* x, u64 n, float c) {
    for (u64 i = global_thread(); i < n; i += global_stride()) {
        float t = tanhf(ld(&x[i]) / c);
        st(&dx[i], ld(&dx[i]) * (1.f - t * t));
    }
}
extern "C" __global__ void softcap_backward_f32(float* dx, const float* x, u64 n, float c) {
    softcap_backward_impl(dx, x, n, c);
}
extern "C" __global__ void softcap_backward_bf16(bf16* dx, const bf16* x, u64 n, float c) {
    softcap_backward_impl(dx, x, n, c);
}

// One partial per block; the grid size is chosen by the host from n alone.
template <typename T, bool SQUARES>
__device__ void partials_impl(const T* x, u64 n, double* partials) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (u64 i = global_thread(); i < n; i += global_stride()) {
        double v = (double)ld(&x[i]);
        acc += SQUARES ? v * v : v;
    }
    acc = block_sum_f64(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}
extern "C" __global__ void sum_partials_f32(const float* x, u64 n, double* p) { partials_impl<float, false>(x, n, p); }
extern "C" __global__ void sum_partials_bf16(const bf16* x, u64 n, double* p) { partials_impl<bf16, false>(x, n, p); }
extern "C" __global__ void sumsq_partials_f32(const float* x, u64 n, double* p) { partials_impl<float, true>(x, n, p); }
extern "C" __global__ void sumsq_partials_bf16(const bf16* x, u64 n, double* p) { partials_impl<bf16, true>(x, n, p); }

// f32 sums with 16-byte loads (the gradient norm reads every gradient once a step: 4 bytes a
// parameter, which this pass should move at the memory's rate). x is 16-byte aligned (the
// launcher checks); thread t of the grid takes vectors t, t + stride, ... and the n % 4
// elements past the last vector go to the grid's first threads. The order depends on n and the
// grid only, as above.
template <bool SQUARES>
__device__ void partials_f32_v4_impl(const float* x, u64 n, double* partials) {
    __shared__ double scratch[32];
    double acc = 0.0;
    u64 n4 = n / 4;
    const float4* x4 = (const float4*)x;
    for (u64 i = global_thread(); i < n4; i += global_stride()) {
        float4 f = x4[i];
        double a = f.x, b = f.y, c = f.z, d = f.w;
        acc += SQUARES ? (a * a + b * b) + (c * c + d * d) : (a + b) + (c + d);
    }
    u64 tail = 4 * n4 + global_thread();
    if (tail < n) {
        double v = x[tail];
        acc += SQUARES ? v * v : v;
    }
    acc = block_sum_f64(acc, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}
extern "C" __global__ void sum_partials_f32_v4(const float* x, u64 n, double* p) { partials_f32_v4_impl<false>(x, n, p); }
extern "C" __global__ void sumsq_partials_f32_v4(const float* x, u64 n, double* p) { partials_f32_v4_impl<true>(x, n, p); }

// One block: out[0] = Σ partials[0..count) (f32 result of an f64 sum).
extern "C" __global__ void sum_finish(const double* partials, int count, float* out) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
    acc = block_sum_f64(acc, scratch);
    if (threadIdx.x == 0) out[0] = (float)acc;
}
