// AdamW over the flat f32 buffers (PyTorch's formulation), fused with clipping, zeroing of the
// gradients and the refresh of the bf16 compute copy of the parameters.
//
//   scale = min(1, max_norm / sqrt(norm_sq[0]))     (read on the device: no host round trip)
//   g = scale · grad
//   m ← β1 m + (1 - β1) g,  v ← β2 v + (1 - β2) g²
//   p ← p · (1 - lr · wd) - step_size · m / (sqrt(v) / bc2_sqrt + eps)    (decay on matrices only)
//   grad ← 0,  p16 ← bf16(p)
//
// `runs` lists the ranges to update, sorted and disjoint, as (start, end, decay) triples of u64
// (adjacent tensors with the same decay merged). Each thread takes 4 consecutive elements with
// 16-byte loads; its run is found by binary search once per 4 elements. Weights whose FP8 casts
// the step writes too are left out of the runs: fp8.cu's adamw_fp8 updates them.

__device__ __forceinline__ int find_run(const u64* runs, int count, u64 i) {
    int lo = 0, hi = count;  // first run whose end is > i
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (runs[3 * mid + 1] <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

extern "C" __global__ void adamw(float* p, bf16* p16, float* g, float* m, float* v, const float* norm_sq, const u64* runs,
                                 int run_count, u64 n, float lr, float beta1, float beta2, float eps, float wd,
                                 float step_size, float bc2_sqrt, float max_norm) {
    float norm = sqrtf(norm_sq[0]);
    float scale = (max_norm > 0.f && norm > max_norm) ? max_norm / norm : 1.f;
    float decay = 1.f - lr * wd;
    for (u64 base = 4 * global_thread(); base < n; base += 4 * global_stride()) {
        int r = find_run(runs, run_count, base);
        bool full = base + 4 <= n;
        float pv[4], gv[4], mv[4], vv[4];
        if (full) {
            float4 a = *(const float4*)(p + base), b = *(const float4*)(g + base);
            float4 c = *(const float4*)(m + base), d = *(const float4*)(v + base);
            pv[0] = a.x, pv[1] = a.y, pv[2] = a.z, pv[3] = a.w;
            gv[0] = b.x, gv[1] = b.y, gv[2] = b.z, gv[3] = b.w;
            mv[0] = c.x, mv[1] = c.y, mv[2] = c.z, mv[3] = c.w;
            vv[0] = d.x, vv[1] = d.y, vv[2] = d.z, vv[3] = d.w;
        } else {
            for (int e = 0; e < 4; e++) {
                u64 i = base + e < n ? base + e : n - 1;
                pv[e] = p[i], gv[e] = g[i], mv[e] = m[i], vv[e] = v[i];
            }
        }
        bool touched[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            u64 i = base + e;
            while (r < run_count && runs[3 * r + 1] <= i) r++;
            touched[e] = i < n && r < run_count && runs[3 * r] <= i;
            if (!touched[e]) continue;
            adamw_element(pv[e], mv[e], vv[e], gv[e], scale, beta1, beta2, eps, runs[3 * r + 2] ? decay : 1.f, step_size,
                          bc2_sqrt);
            gv[e] = 0.f;
        }
        if (full) {
            *(float4*)(p + base) = make_float4(pv[0], pv[1], pv[2], pv[3]);
            *(float4*)(g + base) = make_float4(gv[0], gv[1], gv[2], gv[3]);
            *(float4*)(m + base) = make_float4(mv[0], mv[1], mv[2], mv[3]);
            *(float4*)(v + base) = make_float4(vv[0], vv[1], vv[2], vv[3]);
            *(uint2*)(p16 + base) = make_uint2(pack_bf16(pv[0], pv[1]), pack_bf16(pv[2], pv[3]));
        } else {
            for (int e = 0; e < 4 && base + e < n; e++) {
                u64 i = base + e;
                p[i] = pv[e], g[i] = gv[e], m[i] = mv[e], v[i] = vv[e];
                p16[i] = f2bf(pv[e]);
            }
        }
    }
}
