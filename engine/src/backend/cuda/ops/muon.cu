// Muon's elementwise parts (torch.optim.Muon's formulation): the momentum over the flat f32
// gradients of the matrices it updates, fused with clipping, and the normalisation of a matrix
// by its Frobenius norm before the Newton–Schulz iterations.
//
// momentum:   scale = min(1, max_norm / sqrt(norm_sq[0]))   (read on the device; 1 if max_norm = 0)
//             g = scale · grad
//             B ← lerp(B, g, 1 − μ)                          (= μ B + (1 − μ) g)
//             grad ← lerp(g, B, μ) if nesterov, else B       (the matrix to orthogonalise)
// normalise:  x ← x / max(sqrt(sum_sq[0]), eps)              (in f32, rounded to x's type)
//
// lerp(a, b, w) is torch.lerp's: a + w (b − a) for |w| < 0.5, else b − (b − a)(1 − w), exact at
// both ends. 1 − μ comes from the host, rounded to f32 once (as PyTorch passes a Python float).

__device__ __forceinline__ float torch_lerp(float a, float b, float w) {
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.f - w);
}

// g, buf: n f32 each; keep = μ, mix = 1 − μ.
extern "C" __global__ void muon_momentum(float* g, float* buf, const float* norm_sq, u64 n, float keep, float mix,
                                         int nesterov, float max_norm) {
    float norm = sqrtf(norm_sq[0]);
    float scale = (max_norm > 0.f && norm > max_norm) ? max_norm / norm : 1.f;
    for (u64 i = global_thread(); i < n; i += global_stride()) {
        float grad = g[i] * scale;
        float b = torch_lerp(buf[i], grad, mix);
        buf[i] = b;
        g[i] = nesterov ? torch_lerp(grad, b, keep) : b;
    }
}

// x: n values of T (f32, or bf16: Newton–Schulz's matrices on GPUs); sum_sq[0] = ‖x‖²_F.
template <typename T>
__device__ void divide_by_norm_impl(T* x, const float* sum_sq, u64 n, float eps) {
    float norm = fmaxf(sqrtf(sum_sq[0]), eps);
    for (u64 i = global_thread(); i < n; i += global_stride()) st(&x[i], ld(&x[i]) / norm);
}
extern "C" __global__ void divide_by_norm_f32(float* x, const float* s, u64 n, float eps) {
    divide_by_norm_impl(x, s, n, eps);
}
extern "C" __global__ void divide_by_norm_bf16(bf16* x, const float* s, u64 n, float eps) {
    divide_by_norm_impl(x, s, n, eps);
}
