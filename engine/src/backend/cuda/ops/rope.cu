// Rotary position embedding in the "rotate half" layout (dimension i pairs with i + Dh/2), in
// place on the q and k heads of packed qkv rows. `table` is [seq, Dh/2] pairs (cos, sin) of
// t · inv_freq_i, computed on the host with Llama 3 frequency scaling when the model has it.
//
// forward:  (a, b) -> (a cos θ - b sin θ,  b cos θ + a sin θ)
// backward: the same with -θ (sign = -1): a rotation's transpose is its inverse.
//
// Launch: blocks over positions t (x) and sequences b (y), so that row b · seq + t comes with
// its position and needs no `row % seq`; a 1-D block over the (head, pair) slots of a row, in
// chunks of V consecutive pairs. A thread's (head, chunk) is the same for every row it visits,
// so its one divide (a 32-bit one, by the chunks per head) is done once, before the loops: the
// loops themselves only add. The (cos, sin) entries loaded for a position serve every sequence
// and every head that the thread rotates at that position.
//
// V = 4 (`rope_v4`) moves 4 pairs with 8-byte accesses of p[i..i+3] and p[half+i..] and two
// 16-byte loads of the table; the host chooses it only when Dh/2 is a multiple of 4 and qkv and
// the table are 16-byte aligned. V = 1 (`rope`) is the scalar fallback.
//
// The fused multiply-adds are written out: the one-pair kernel this one replaced compiled to
// fma(a, cos, -(b sin)) and fma(a, sin, b cos), and every variant rounds exactly as it did (left
// to itself, the compiler fuses the other product of the second sum in the 4-pair loop).

// (cos, sin · sign) of pairs i .. i + V of one position; `e` points at pair i's cos.
template <int V>
__device__ __forceinline__ void load_cos_sin(const float* e, float sign, float* c, float* s) {
    if constexpr (V == 4) {
        float4 u = *(const float4*)e, w = *(const float4*)(e + 4);
        c[0] = u.x, s[0] = sign * u.y, c[1] = u.z, s[1] = sign * u.w;
        c[2] = w.x, s[2] = sign * w.y, c[3] = w.z, s[3] = sign * w.w;
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) c[k] = e[2 * k], s[k] = sign * e[2 * k + 1];
    }
}

template <int V>
__device__ void rope_impl(bf16* qkv, const float* table, int batch, int seq, int heads, int head_dim, int width,
                          float sign) {
    int half = head_dim / 2, chunks = half / V;  // chunks of V pairs in one head
    int per_pass = max((int)blockDim.x / chunks, 1);  // heads the block covers at once
    int head0 = threadIdx.x / chunks;
    int i0 = (threadIdx.x - head0 * chunks) * V;
    if (head0 >= per_pass) return;  // past the last whole head the block covers
    for (int t = blockIdx.x; t < seq; t += gridDim.x) {
        // One trip unless a head has more chunks than the block has threads (then head0 = 0).
        for (int i = i0; i < half; i += blockDim.x * V) {
            float c[V], s[V];
            load_cos_sin<V>(table + ((u64)t * half + i) * 2, sign, c, s);
            for (int b = blockIdx.y; b < batch; b += gridDim.y) {
                bf16* row = qkv + ((u64)b * seq + t) * width + i;
                for (int h = head0; h < heads; h += per_pass) {
                    bf16* p = row + h * head_dim;
                    float a[V], bb[V], x[V], y[V];
                    loadv<V>(p, a);
                    loadv<V>(p + half, bb);
#pragma unroll
                    for (int k = 0; k < V; k++) {
                        x[k] = fmaf(a[k], c[k], -(bb[k] * s[k]));
                        y[k] = fmaf(a[k], s[k], bb[k] * c[k]);
                    }
                    storev<V>(p, x);
                    storev<V>(p + half, y);
                }
            }
        }
    }
}

extern "C" __global__ void rope(bf16* qkv, const float* table, int batch, int seq, int heads, int head_dim, int width,
                                float sign) {
    rope_impl<1>(qkv, table, batch, seq, heads, head_dim, width, sign);
}
extern "C" __global__ void rope_v4(bf16* qkv, const float* table, int batch, int seq, int heads, int head_dim,
                                   int width, float sign) {
    rope_impl<4>(qkv, table, batch, seq, heads, head_dim, width, sign);
}
