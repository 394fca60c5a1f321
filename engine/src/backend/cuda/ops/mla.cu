// DeepSeek-V3's multi-head latent attention (MLA) around the ordinary attention kernels: the
// packed qkv rows assembled from MLA's pieces, their adjoint, and heads narrowed or widened.
// Per row at position t = row % seq and head h (widths nope, rope, v; qk = nope + rope; s the
// query scale):
//
// forward:  q_h = s · [q_nope_h | R_t(P(q_rope_h))]       q [rows, H·qk]
//           k_h =     [k_nope_h | R_t(P(kpe))]            kv [rows, H·(nope + v)], kpe [rows, rope]
//           v_h =     [v_h      | 0 … 0]                  qkv [rows, 3·H·qk]
// backward: dq_h  = s · [dq_nope_h | Pᵀ R_tᵀ dq_rope_h]
//           dkv_h = [dk_nope_h | dv_h[..v]]
//           dkpe  = Pᵀ R_tᵀ Σ_h dk_rope_h                  (heads summed in order 0..H, in f32)
//
// R_t rotates pairs (i, i + rope/2) by the table's pair i, "rotate half" as rope.cu (the same
// fused multiply-adds); its transpose rotates by −θ. P is the identity, or when `interleave` the
// de-interleaving x -> [x0, x2, …, x1, x3, …] (Hugging Face's rope_interleave): pair i of the
// rotation reads x[2i] and x[2i + 1].
//
// Launch (all three kernels): blocks over rows (a block strides over rows gridDim.x apart),
// threads over the columns of the row's outputs; every output element is computed by one thread
// from its own inputs, so the results do not depend on the launch shape. The rotary key is
// rotated again for each head (rope/2 pairs: cheaper than a barrier).

// Column j (< rope) of R(P(x)) over one rope part x; `cs` holds the position's (cos, sin) pairs.
__device__ __forceinline__ float mla_rotated(const bf16* x, const float* cs, int j, int half, int interleave) {
    int i = j < half ? j : j - half;
    int lo = interleave ? 2 * i : i, hi = interleave ? 2 * i + 1 : half + i;
    float a = bf2f(x[lo]), b = bf2f(x[hi]), c = cs[2 * i], s = cs[2 * i + 1];
    return j < half ? fmaf(a, c, -(b * s)) : fmaf(a, s, b * c);
}

// Column j (< rope) of Pᵀ Rᵀ g, from the rotated pair (ga, gb) = (g_i, g_{half+i}) it belongs to.
__device__ __forceinline__ void mla_pair_of(int j, int half, int interleave, int* i, bool* first) {
    if (interleave) {
        *i = j >> 1, *first = (j & 1) == 0;
    } else {
        *first = j < half, *i = j < half ? j : j - half;
    }
}
__device__ __forceinline__ float mla_back(float ga, float gb, float c, float s, bool first) {
    return first ? fmaf(ga, c, gb * s) : fmaf(gb, c, -(ga * s));
}

extern "C" __global__ void mla_qkv_forward(bf16* qkv, const bf16* q, const bf16* kv, const bf16* kpe,
                                           const float* table, u64 rows, int seq, int heads, int nope, int rope,
                                           int v, int interleave, float q_scale) {
    int qk = nope + rope, half = rope / 2, hq = heads * qk, width = 3 * hq, kvw = heads * (nope + v);
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* cs = table + (row % (u64)seq) * rope;
        const bf16 *qr = q + row * hq, *kvr = kv + row * kvw, *kr = kpe + row * rope;
        bf16* out = qkv + row * width;
        for (int col = threadIdx.x; col < width; col += blockDim.x) {
            int part = col / hq, rem = col - part * hq;
            int h = rem / qk, c = rem - h * qk;
            const bf16* kvh = kvr + h * (nope + v);
            float y;
            if (part == 0) {
                const bf16* qh = qr + h * qk;
                y = q_scale * (c < nope ? bf2f(qh[c]) : mla_rotated(qh + nope, cs, c - nope, half, interleave));
            } else if (part == 1) {
                y = c < nope ? bf2f(kvh[c]) : mla_rotated(kr, cs, c - nope, half, interleave);
            } else {
                y = c < v ? bf2f(kvh[nope + c]) : 0.f;
            }
            out[col] = f2bf(y);
        }
    }
}

// Columns of a row's outputs: dq (H·qk), then dkv (H·(nope + v)), then dkpe (rope).
extern "C" __global__ void mla_qkv_backward(bf16* dq, bf16* dkv, bf16* dkpe, const bf16* dqkv, const float* table,
                                            u64 rows, int seq, int heads, int nope, int rope, int v, int interleave,
                                            float q_scale) {
    int qk = nope + rope, half = rope / 2, hq = heads * qk, width = 3 * hq, kvw = heads * (nope + v);
    int all = hq + kvw + rope;
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* cs = table + (row % (u64)seq) * rope;
        const bf16 *gq = dqkv + row * width, *gk = gq + hq, *gv = gk + hq;
        for (int col = threadIdx.x; col < all; col += blockDim.x) {
            if (col < hq) {
                int h = col / qk, c = col - h * qk;
                const bf16* g = gq + h * qk;
                float y;
                if (c < nope) {
                    y = bf2f(g[c]);
                } else {
                    int i;
                    bool first;
                    mla_pair_of(c - nope, half, interleave, &i, &first);
                    y = mla_back(bf2f(g[nope + i]), bf2f(g[nope + half + i]), cs[2 * i], cs[2 * i + 1], first);
                }
                dq[row * hq + col] = f2bf(q_scale * y);
            } else if (col < hq + kvw) {
                int r = col - hq, h = r / (nope + v), c = r - h * (nope + v);
                dkv[row * kvw + r] = c < nope ? gk[h * qk + c] : gv[h * qk + c - nope];
            } else {
                int j = col - hq - kvw, i;
                bool first;
                mla_pair_of(j, half, interleave, &i, &first);
                float ga = 0.f, gb = 0.f;
                for (int h = 0; h < heads; h++) {
                    ga += bf2f(gk[h * qk + nope + i]);
                    gb += bf2f(gk[h * qk + nope + half + i]);
                }
                dkpe[row * rope + j] = f2bf(mla_back(ga, gb, cs[2 * i], cs[2 * i + 1], first));
            }
        }
    }
}

// out[r, h·to + c] = x[r, h·from + c] for c < from, 0 past it (to > from): heads narrowed
// (to ≤ from) or widened with zeros; the kept elements are copied exactly.
extern "C" __global__ void heads_resize(bf16* out, const bf16* x, u64 rows, int heads, int from, int to) {
    int width = heads * to;
    bf16 zero;
    zero.bits = 0;
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const bf16* xr = x + row * heads * from;
        bf16* o = out + row * width;
        for (int col = threadIdx.x; col < width; col += blockDim.x) {
            int h = col / to, c = col - h * to;
            o[col] = c < from ? xr[h * from + c] : zero;
        }
    }
}
