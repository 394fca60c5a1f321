// The experts' matrix products, grouped: one launch covers every expert of a layer, with the
// row counts read on the device from the dispatch offsets (no host round trip, so the step can
// be captured in a CUDA graph). bf16 in, f32 accumulate on the tensor cores (mma.sync
// m16n8k16), 128×128 block tiles 64 bytes deep (32 bf16), 8 warps of 64×32, shared memory
// double-buffered through registers. FP8 in (train.precision = "fp8": E4M3 operands, E5M2
// gradients; mma.sync m16n8k32, sm_89 and newer) the same kernel takes 64 FP8 values a k-tile:
// its shared tiles, ldmatrix addresses and fragments are byte for byte the bf16 kernel's, an
// m16n8k32 FP8 fragment holding 4 bytes of a row where m16n8k16's holds 2 bf16; the epilogue
// multiplies by both operands' inverse scales (read from their states on the device).
//
// MODE 0 (forward):  out[r, n] = Σ_k a[r, k] · W_e[n, k]      r over expert e's rows (M varies)
// MODE 1 (dx):       out[r, n] = Σ_k a[r, k] · W_e[k, n]
// MODE 2 (dW):       dW_e[m, n] += Σ_r dy[r, m] · x[r, n]      r over expert e's rows (K varies)
//
// Shared tiles are stored k-contiguous ([m][k] and [n][k]) whatever the global layout, so the
// fragments always come from plain ldmatrix; operands stored the other way round are
// transposed while being written to shared memory.

typedef unsigned char u8;

#define BM 128
#define BN 128
#define ROW_BYTES 80  // a tile row: 64 bytes of k, +16 for conflict-free ldmatrix

// An element type's 16-byte chunk: V elements (8 bf16, 16 FP8 bytes), and the same bits as the
// 16-byte vector that moves them.
template <typename T>
struct Chunk {
    static constexpr int V = 16 / sizeof(T);
};
template <typename T>
union ChunkBits {
    uint4 v;
    T e[Chunk<T>::V];
};

// V consecutive elements of row `row` of a row-major matrix, from column `col`; zeros outside
// [0, rows) × [0, cols). `vec`: 16-byte loads are allowed (ld % V == 0, 16-byte-aligned base).
template <typename T>
__device__ __forceinline__ uint4 load_chunk(const T* base, u64 ld, u64 row, bool row_ok, u64 col, u64 cols, bool vec) {
    constexpr int V = Chunk<T>::V;
    if (row_ok && vec && col + V <= cols) return *(const uint4*)(base + row * ld + col);
    ChunkBits<T> c;
#pragma unroll
    for (int i = 0; i < V; i++) c.e[i] = (row_ok && col + i < cols) ? base[row * ld + col + i] : T{};
    return c.v;
}

// Writes a chunk either along k (one 16-byte store) or across V rows at one k (transposed).
// `tile` is a shared tile of ROW_BYTES-byte rows; `k` counts elements.
template <typename T>
__device__ __forceinline__ void store_chunk(u8* tile, int row, int k, uint4 v, bool along_k) {
    constexpr int V = Chunk<T>::V;
    if (along_k) {
        *(uint4*)(tile + row * ROW_BYTES + k * sizeof(T)) = v;
    } else {
        ChunkBits<T> c;
        c.v = v;
#pragma unroll
        for (int i = 0; i < V; i++) *(T*)(tile + (row + i) * ROW_BYTES + k * sizeof(T)) = c.e[i];
    }
}

// bf16 products for T = bf16; FP8 ones for T = u8, A in E5M2 where `a_e5m2` (B is E4M3), the
// result multiplied by `scale_a[0] · scale_b[0]` (the operands' inverse scales).
template <int MODE, typename TC, typename T>
__device__ void grouped_gemm(TC* c, const T* a, const T* b, u64 b_stride, u64 c_stride, const u32* offsets,
                             int experts, int m_dim, int n_dim, int k_dim, int accumulate, int vec,
                             const float* scale_a = nullptr, const float* scale_b = nullptr, int a_e5m2 = 0) {
    constexpr int V = Chunk<T>::V, BK = 64 / sizeof(T), ACROSS = BM / V;  // chunks a k-row of 128
    alignas(16) __shared__ u8 As[2][BM * ROW_BYTES];
    alignas(16) __shared__ u8 Bs[2][BN * ROW_BYTES];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
    int e, rows_m, kdim, m0;
    u64 first;
    if (MODE < 2) {
        int tile = blockIdx.y;
        e = -1;
        for (int x = 0; x < experts; x++) {
            int t = ((int)(offsets[x + 1] - offsets[x]) + BM - 1) / BM;
            if (tile < t) {
                e = x;
                break;
            }
            tile -= t;
        }
        if (e < 0) return;
        first = offsets[e];
        rows_m = (int)(offsets[e + 1] - first);
        m0 = tile * BM;
        kdim = k_dim;
    } else {
        e = blockIdx.z;
        first = offsets[e];
        kdim = (int)(offsets[e + 1] - first);
        if (kdim == 0) return;  // no rows: dW_e += 0
        rows_m = m_dim;
        m0 = blockIdx.y * BM;
    }
    int n0 = blockIdx.x * BN;
    const T* w = MODE < 2 ? b + (u64)e * b_stride : b;

    uint4 ra[2], rb[2];
    auto load_tiles = [&](int k0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int ch = tid + i * 256;
            if (MODE < 2) {  // A [rows][K]: V along k
                int row = ch / 4, kc = (ch % 4) * V;
                ra[i] = load_chunk(a, k_dim, first + m0 + row, m0 + row < rows_m, k0 + kc, kdim, vec);
            } else {  // A(m, k) = dy[first + k][m]: V along m
                int kr = ch / ACROSS, mc = (ch % ACROSS) * V;
                ra[i] = load_chunk(a, m_dim, first + k0 + kr, k0 + kr < kdim, m0 + mc, m_dim, vec);
            }
            if (MODE == 0) {  // B(k, n) = W[n][k]: V along k
                int n = ch / 4, kc = (ch % 4) * V;
                rb[i] = load_chunk(w, k_dim, n0 + n, n0 + n < n_dim, k0 + kc, kdim, vec);
            } else {  // B(k, n) = W[k][n] or x[first + k][n]: V along n
                int kr = ch / ACROSS, nc = (ch % ACROSS) * V;
                u64 row = MODE == 1 ? (u64)(k0 + kr) : first + k0 + kr;
                rb[i] = load_chunk(w, n_dim, row, k0 + kr < kdim, n0 + nc, n_dim, vec);
            }
        }
    };
    auto store_tiles = [&](int buf) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int ch = tid + i * 256;
            if (MODE < 2) store_chunk<T>(As[buf], ch / 4, (ch % 4) * V, ra[i], true);
            else store_chunk<T>(As[buf], (ch % ACROSS) * V, ch / ACROSS, ra[i], false);
            if (MODE == 0) store_chunk<T>(Bs[buf], ch / 4, (ch % 4) * V, rb[i], true);
            else store_chunk<T>(Bs[buf], (ch % ACROSS) * V, ch / ACROSS, rb[i], false);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;

    int ktiles = (kdim + BK - 1) / BK;
    load_tiles(0);
    store_tiles(0);
    __syncthreads();
    for (int kt = 0; kt < ktiles; kt++) {
        int buf = kt & 1;
        if (kt + 1 < ktiles) load_tiles((kt + 1) * BK);
        // Two products a k-tile, 32 bytes deep each (m16n8k16 bf16 or m16n8k32 FP8).
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            u32 af[4][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                ldmatrix_x4(af[mi], smem_addr(&As[buf][(wm * 64 + mi * 16 + (lane % 16)) * ROW_BYTES + ks * 32 +
                                                       (lane / 16) * 16]));
#pragma unroll
            for (int np = 0; np < 2; np++) {
                u32 r[4];
                ldmatrix_x4(r, smem_addr(&Bs[buf][(wn * 32 + np * 16 + (lane % 8) + (lane / 16) * 8) * ROW_BYTES +
                                                  ks * 32 + ((lane / 8) % 2) * 16]));
                bfr[2 * np][0] = r[0], bfr[2 * np][1] = r[1], bfr[2 * np + 1][0] = r[2], bfr[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nj = 0; nj < 4; nj++) {
                    if constexpr (sizeof(T) == 2) mma_bf16(acc[mi][nj], af[mi], bfr[nj][0], bfr[nj][1]);
                    else if (a_e5m2) mma_fp8<1>(acc[mi][nj], af[mi], bfr[nj][0], bfr[nj][1]);
                    else mma_fp8<0>(acc[mi][nj], af[mi], bfr[nj][0], bfr[nj][1]);
                }
        }
        if (kt + 1 < ktiles) store_tiles(buf ^ 1);
        __syncthreads();
    }

    float scale = scale_a ? scale_a[0] * scale_b[0] : 1.f;
    int group = lane >> 2, tig = lane & 3;
    TC* out = MODE < 2 ? c : c + (u64)e * c_stride;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int nj = 0; nj < 4; nj++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int row = m0 + wm * 64 + mi * 16 + group + h * 8;
                if (row >= rows_m) continue;
                u64 out_row = MODE < 2 ? first + row : (u64)row;
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    int col = n0 + wn * 32 + nj * 8 + tig * 2 + q;
                    if (col >= n_dim) continue;
                    TC* p = out + out_row * n_dim + col;
                    float v = acc[mi][nj][h * 2 + q] * scale;
                    st(p, accumulate ? ld(p) + v : v);
                }
            }
}

extern "C" __global__ void __launch_bounds__(256) moe_gemm_forward(bf16* c, const bf16* a, const bf16* w, u64 w_stride,
                                                                   const u32* offsets, int experts, int n, int k,
                                                                   int accumulate, int vec) {
    grouped_gemm<0, bf16>(c, a, w, w_stride, 0, offsets, experts, 0, n, k, accumulate, vec);
}
extern "C" __global__ void __launch_bounds__(256) moe_gemm_dx(bf16* c, const bf16* a, const bf16* w, u64 w_stride,
                                                              const u32* offsets, int experts, int n, int k,
                                                              int accumulate, int vec) {
    grouped_gemm<1, bf16>(c, a, w, w_stride, 0, offsets, experts, 0, n, k, accumulate, vec);
}
extern "C" __global__ void __launch_bounds__(256) moe_gemm_dw(float* dw, const bf16* dy, const bf16* x, u64 dw_stride,
                                                              const u32* offsets, int experts, int m, int n, int vec) {
    grouped_gemm<2, float>(dw, dy, x, 0, dw_stride, offsets, experts, m, n, 0, 1, vec);
}

// FP8 (u8 bytes; `sa`, `sb`: the operands' states, whose inverse scale is at index 1).
extern "C" __global__ void __launch_bounds__(256) moe_gemm_fp8_forward(bf16* c, const u8* a, const u8* w, u64 w_stride,
                                                                       const u32* offsets, int experts, int n, int k,
                                                                       int accumulate, int vec, const float* sa,
                                                                       const float* sb, int a_e5m2) {
    grouped_gemm<0, bf16>(c, a, w, w_stride, 0, offsets, experts, 0, n, k, accumulate, vec, sa + 1, sb + 1, a_e5m2);
}
extern "C" __global__ void __launch_bounds__(256) moe_gemm_fp8_dx(bf16* c, const u8* a, const u8* w, u64 w_stride,
                                                                  const u32* offsets, int experts, int n, int k,
                                                                  int accumulate, int vec, const float* sa,
                                                                  const float* sb, int a_e5m2) {
    grouped_gemm<1, bf16>(c, a, w, w_stride, 0, offsets, experts, 0, n, k, accumulate, vec, sa + 1, sb + 1, a_e5m2);
}
extern "C" __global__ void __launch_bounds__(256) moe_gemm_fp8_dw(float* dw, const u8* dy, const u8* x, u64 dw_stride,
                                                                  const u32* offsets, int experts, int m, int n,
                                                                  int vec, const float* sa, const float* sb,
                                                                  int a_e5m2) {
    grouped_gemm<2, float>(dw, dy, x, 0, dw_stride, offsets, experts, m, n, 0, 1, vec, sa + 1, sb + 1, a_e5m2);
}
