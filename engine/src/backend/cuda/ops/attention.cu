// Flash attention, forward and backward, on the tensor cores: causal, grouped-query (query head
// h reads key/value head h / (H / KV)), optional sliding window W (query i sees keys j with
// i - W < j <= i), over packed qkv rows [q: H·dh | k: KV·dh | v: KV·dh].
//
// forward:  s_j = q·k_j / sqrt(dh),  lse = log Σ_j exp(s_j),  o = Σ_j exp(s_j - lse) v_j
// backward: D = do·o,  dp_j = do·v_j,  ds_j = p_j (dp_j - D),
//           dq = Σ_j ds_j k_j / sqrt(dh),  dk_j = Σ_i ds_ij q_i / sqrt(dh),  dv_j = Σ_i p_ij do_i
//
// HD is the head width padded to a multiple of 16 (16, 32, 64, 128, 192 or 256); the real
// width dh is a multiple of 8 and the padding is zero-filled by cp.async, so it adds nothing to
// any product. A warp owns 16 rows of the tile (queries forward, keys backward): forward blocks
// are 4 warps, backward blocks 8 (128 keys) at HD 64 to 192 and 4 (64 keys) otherwise.
// Shared rows are HD + 8 elements long, which keeps ldmatrix free of bank conflicts.
//
// Forward (FlashAttention-2): one block per 64 queries of one head; key/value tiles of BC keys
// (64, 32 past HD 128) are double-buffered with cp.async; an online softmax in base 2 keeps a
// running maximum and sum per row; the probabilities go from the score accumulators straight
// into the A operand of P·V. Only the log-sum-exp is saved, and, for QK-clip, each head's
// largest logit (the rows' final maxima, one atomic per warp).
//
// Backward: `attention_backward_dot` computes D; then one block per BC keys (128, or 64 for HD
// 16, 32 and 256) of one key/value head walks every query tile of every query head of its group
// that sees those keys, recomputes P from the saved log-sum-exp, and accumulates dK and dV in
// registers (written once, no atomics); dQ is accumulated in f32 with atomics and converted by
// `attention_backward_dq`. Past HD 128 the block walks its query tiles twice, dV the first time
// and dK and dQ the second (`attention_backward_impl` says why).
//
// Wide heads (HD 192 and 256: DeepSeek-V3's latent attention packs heads of 128 + 64, Gemma 3's
// are 256 wide). Per thread, a warp's 16 rows × HD of f32 accumulator are HD / 2 registers
// (each of the 32 lanes holds 4 of every 16 × 8 tile), so at HD 256 the forward pass's O alone is
// 128 of the 255 a thread may have, and the backward pass's dK and dV together 256:
//   forward  HD ≤ 128: Q's fragments (HD / 4 registers) stay in registers across key tiles,
//                      64-key tiles: 64 + 2·2·64 rows of HD + 8 in shared memory.
//            HD > 128: Q's fragments are read from shared memory again for every key tile (one
//                      ldmatrix per 16 columns, against two per 16 keys × 16 columns for K: the
//                      S = QKᵀ product reads 1.5 times the shared memory it did), and key tiles
//                      are 32 (S: 16 registers, not 32): 64 + 2·2·32 rows of HD + 8, 76,800 bytes
//                      at HD 192 (two blocks an SM on sm_80, two on sm_90) and 101,376 at 256
//                      (one on sm_80, two on sm_90). 64-key double-buffered tiles would take
//                      168,960 bytes at 256, past sm_80's 166,912 per block.
//   backward HD > 128: dK and dV do not fit together (192 or 256 registers of accumulators), so
//                      the block makes two passes over its query tiles: the first recomputes
//                      S and P and accumulates dV (P·dO) only, writes it and clears the
//                      accumulators; the second recomputes S, P, dP and dS and accumulates dK
//                      and dQ. One accumulator of HD / 2 registers, as dK and dV together were
//                      at HD 128; the price is S = KQᵀ computed twice and Q, dO and the
//                      log-sum-exp loaded twice: 6 tile products of 16 × BR × HD per key tile
//                      where one pass does 5 (+20 %), plus the second pass's loads (from L2).
//                      Tiles: HD 192, 128 keys (8 warps) × 32 queries, 164,608 bytes of shared
//                      memory (fits sm_80's 166,912); HD 256, 64 keys (4 warps) × 16 queries,
//                      104,832 bytes (128 keys need 175,488 even with 16 queries). 16 queries
//                      keep the dQ product's accumulators (HD/8 · BR/16 / warps tiles of 8
//                      columns, 4 registers each) at 32 registers.
//
// Document masking (packed sequences): with `starts` (else null), query i also needs
// j >= starts[i], the first position of its document, and key j is seen by queries before
// ends[j], one past its document's last position (`attention_document_bounds`). Documents are
// contiguous, so a forward block skips every key tile before its first query's start, and a
// backward block stops at its last key's end; the tiles between are masked element by element
// unless every query of the tile sees every key (keys at or past the tile's last start).

// Sequence axis (context parallelism): each of `ranks` devices holds two chunks of L positions
// of every sequence, chunk `rank` and chunk 2·ranks − 1 − rank (load-balanced under the causal
// mask); its queries are those rows, the keys every rank's rows, gathered rank-major. `seq` is
// then the positions of a whole sequence and `local` = 2L the rows a rank holds (`seq` unsplit).
// Masks and tiles work in positions; SeqRows maps a position to its row in qkv (every rank's)
// and in the per-query buffers (out, lse, dout, D, dQ: this rank's). The launcher checks that L
// is a multiple of every tile, so a tile lies inside one chunk and its rows are contiguous.
// SPLIT is a compile-time choice: the kernels without it (`attention_forward_hd64`, ...) fold
// every mapping to `b·seq + p` and keep no register for the split's numbers (with them as
// run-time values, the forward hd64 and backward hd128 kernels spilled on sm_90); those with it
// are the `_split_` entry points.
template <bool SPLIT>
struct SeqRows {
    int seq, local, rank, ranks, batch;

    // The row of position p within the `local` rows of the rank that holds it.
    __device__ __forceinline__ int chunk_row(int p) const {
        int L = local >> 1, c = p / L;
        return c < ranks ? p - c * L : L + p - c * L;
    }
    __device__ __forceinline__ u64 qkv_row(int b, int p) const {
        if (!SPLIT) return (u64)b * seq + p;
        int c = p / (local >> 1), holder = c < ranks ? c : 2 * ranks - 1 - c;
        return ((u64)holder * batch + b) * local + chunk_row(p);
    }
    // Position p must be one of this rank's.
    __device__ __forceinline__ u64 local_row(int b, int p) const {
        return !SPLIT ? (u64)b * seq + p : (u64)b * local + chunk_row(p);
    }
    // A tile starting at position p, as load_tile_async takes it (its rows' base, the first
    // row from there, the row where zero-filling starts): unsplit, the sequence's first row
    // and p, as the kernels had it before the split (32-bit offsets within the sequence).
    struct Tile {
        u64 row0;
        int r0, limit;
    };
    __device__ __forceinline__ Tile qkv_tile(int b, int p) const {
        if (!SPLIT) return {(u64)b * seq, p, seq};
        return {qkv_row(b, p), 0, seq - p};
    }
    __device__ __forceinline__ Tile local_tile(int b, int p) const {
        if (!SPLIT) return {(u64)b * seq, p, seq};
        return {local_row(b, p), 0, seq - p};
    }
    // The position of this rank's local row i.
    __device__ __forceinline__ int position(int i) const {
        int L = local >> 1;
        return !SPLIT ? i : i < L ? rank * L + i : (2 * ranks - 1 - rank) * L + i - L;
    }
    // This rank's query tiles of `br` local rows that hold a position in [lo, hi), as a range
    // [x, y) of tile indices: local rows run in position order (chunk `rank` before the late
    // one), so the tiles of a range of positions are contiguous.
    struct Range {
        int first, end;
    };
    __device__ __forceinline__ Range tiles(int lo, int hi, int br) const {
        if (!SPLIT) return {lo / br, (hi + br - 1) / br};
        int L = local >> 1, first = local, end = 0;
        for (int k = 0; k < 2; k++) {
            int c = k == 0 ? rank : 2 * ranks - 1 - rank, a = max(lo, c * L), z = min(hi, c * L + L);
            if (a < z) first = min(first, (k * L + a - c * L) / br), end = max(end, (k * L + z - c * L + br - 1) / br);
        }
        return first < end ? Range{first, end} : Range{0, 0};
    }
};

template <int HD>
struct Smem {
    static constexpr int LD = HD + 8;
};

// Threads per block of both passes: the launchers in attention.rs launch exactly this many and
// __launch_bounds__ says so. The tile copies below are written for this count.
#define ATTN_THREADS 128

// Copies rows [r0, r0 + ROWS) × [0, HD) of a head (columns col .. col + dh of rows of width
// `width`) into shared memory, zero-filling rows at or past `limit` and columns at or past dh.
// A tile is ROWS · HD/8 chunks of 16 bytes, chunk ch at row ch / (HD/8), column (ch % (HD/8))·8.
// Thread t copies chunks t, t + U, t + 2U, ... where U, the threads that copy, is the block's T
// threads rounded down to a multiple of HD/8 (T itself for the powers of two; at HD 192, 24
// chunks a row, 120 of 128 threads or 240 of 256, the rest idle): its column cc is the same in
// every trip and its row advances by U / (HD/8): the row, column and address are computed once,
// and a trip adds a constant to a 32-bit offset (11-15 SASS instructions per 16-byte copy,
// against 31-35 when the loop was bounded by blockDim.x and divided each chunk index). The loop
// is left rolled: unrolled, its hoisted addresses cost the forward pass 10-30 registers and hd64
// a block per SM.
template <int ROWS, int HD, int T = ATTN_THREADS>
__device__ __forceinline__ void load_tile_async(bf16* tile, const bf16* base, u64 row0, int r0, int limit, u64 width,
                                                int col, int dh) {
    constexpr int PER_ROW = HD / 8, CHUNKS = ROWS * PER_ROW, LD = HD + 8;
    constexpr int U = T / PER_ROW * PER_ROW, TRIPS = (CHUNKS + U - 1) / U, ROW_STEP = U / PER_ROW;
    static_assert(ROW_STEP > 0, "a row's chunks fit the block's threads");
    if (U < T && (int)threadIdx.x >= U) return;  // (no barrier below: an idle thread may leave)
    int r = threadIdx.x / PER_ROW, cc = (threadIdx.x % PER_ROW) * 8;
    int rows_left = dh > cc ? limit - r0 - r : 0;  // this thread's rows before `limit`; none past dh
    // Offsets from row0 fit 32 bits (the launcher checks: row0 is the sequence's first row
    // unsplit, the tile's on a sequence axis): only row0 is a 64-bit address.
    const bf16* seq_base = base + row0 * width + col + cc;
    int w = (int)width, off = (r0 + r) * w;
    bf16* dst = tile + r * LD + cc;
#pragma unroll 1
    for (int i = 0; i < TRIPS; i++) {
        if (CHUNKS % U == 0 || r + i * ROW_STEP < ROWS) {  // the last trip of a small tile
            bool ok = i * ROW_STEP < rows_left;
            cp_async16(smem_addr(dst + i * ROW_STEP * LD), ok ? seq_base + off : base, ok ? 16 : 0);
        }
        off += ROW_STEP * w;
    }
}

// BC: keys per tile (64; 32 past HD 128). QREG: Q's fragments kept in registers across the key
// tiles (up to HD 128), else read from shared memory for each (see "Wide heads" above).
template <int HD, class Rows>
__device__ void attention_forward_impl(bf16* out, float* lse, float* logit_max, const bf16* qkv, const u32* starts,
                                       Rows R, int heads, int kv_heads, int dh, int window, float scale) {
    constexpr int LD = HD + 8, BR = 64, BC = HD <= 128 ? 64 : 32;
    constexpr bool QREG = HD <= 128;
    DYNAMIC_SMEM(uint4, smem_raw);  // uint4: 16-byte aligned, as cp.async and ldmatrix need
    bf16* Qs = (bf16*)smem_raw;
    bf16* Ks = Qs + BR * LD;       // [2][BC][LD]
    bf16* Vs = Ks + 2 * BC * LD;   // [2][BC][LD]

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = lane >> 2, tig = lane & 3;
    // The grid is (head, batch, query tile), dealt out x fastest: every head and sequence of
    // the last query tile (the longest under a causal mask) goes first, then those of the tile
    // before it, so the short tiles fill the last wave. (A grid of (tile, head, batch) kept the
    // order only within a head; bench/kernel_stats.py --waves estimates the difference.)
    int seq = R.seq, q0 = R.position((gridDim.z - 1 - blockIdx.z) * BR);
    int h = blockIdx.x, b = blockIdx.y, g = h / (heads / kv_heads);
    u64 width = (u64)(heads + 2 * kv_heads) * dh, row0 = (u64)b * seq;  // row0: of the document bounds
    int qcol = h * dh, kcol = (heads + g) * dh, vcol = (heads + kv_heads + g) * dh;

    int kv_end = min(seq, q0 + BR);
    // Document masking: the tile's rows' document starts, in shared memory (registers are
    // spent); its first row's bounds the keys it reads, its last row's the tiles seen whole.
    __shared__ int start_s[BR];
    if (threadIdx.x < BR) start_s[threadIdx.x] = starts && q0 + threadIdx.x < seq ? (int)starts[row0 + q0 + threadIdx.x] : 0;
    int kv_first = max(window ? max(0, q0 - window + 1) : 0, starts ? (int)starts[row0 + q0] : 0);
    int t_first = kv_first / BC, t_count = (kv_end + BC - 1) / BC - t_first;

    auto qt = R.qkv_tile(b, q0), kt0 = R.qkv_tile(b, t_first * BC);
    load_tile_async<BR, HD>(Qs, qkv, qt.row0, qt.r0, qt.limit, width, qcol, dh);
    load_tile_async<BC, HD>(Ks, qkv, kt0.row0, kt0.r0, kt0.limit, width, kcol, dh);
    load_tile_async<BC, HD>(Vs, qkv, kt0.row0, kt0.r0, kt0.limit, width, vcol, dh);
    cp_async_commit();

    float scale2 = scale * LOG2E;
    u32 qf[QREG ? HD / 16 : 1][4];
    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    int row_a = q0 + warp * 16 + group;  // this thread's rows: row_a and row_a + 8

    for (int it = 0; it < t_count; it++) {
        int buf = it & 1, j0 = (t_first + it) * BC;
        if (it + 1 < t_count) {
            auto next = R.qkv_tile(b, j0 + BC);
            load_tile_async<BC, HD>(Ks + (buf ^ 1) * BC * LD, qkv, next.row0, next.r0, next.limit, width, kcol, dh);
            load_tile_async<BC, HD>(Vs + (buf ^ 1) * BC * LD, qkv, next.row0, next.r0, next.limit, width, vcol, dh);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (QREG && it == 0) {
#pragma unroll
            for (int kt = 0; kt < (QREG ? HD / 16 : 0); kt++)
                ldmatrix_x4(qf[kt], smem_addr(Qs + (warp * 16 + (lane % 16)) * LD + kt * 16 + (lane / 16) * 8));
        }
        const bf16* K = Ks + buf * BC * LD;
        const bf16* V = Vs + buf * BC * LD;

        // S = Q Kᵀ for this warp's 16 rows × BC keys.
        float s[BC / 8][4];
#pragma unroll
        for (int i = 0; i < BC / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kt = 0; kt < HD / 16; kt++) {
            u32* qa = qf[QREG ? kt : 0];
            if (!QREG) ldmatrix_x4(qa, smem_addr(Qs + (warp * 16 + (lane % 16)) * LD + kt * 16 + (lane / 16) * 8));
#pragma unroll
            for (int np = 0; np < BC / 16; np++) {
                u32 r[4];
                ldmatrix_x4(r, smem_addr(K + (np * 16 + (lane % 8) + (lane / 16) * 8) * LD + kt * 16 + ((lane / 8) % 2) * 8));
                mma_bf16(s[2 * np], qa, r[0], r[1]);
                mma_bf16(s[2 * np + 1], qa, r[2], r[3]);
            }
        }

        // Scale to base 2, mask where the tile is not entirely visible to the whole block.
        bool full = j0 + BC - 1 <= q0 && j0 + BC <= seq && (window == 0 || j0 > q0 + BR - 1 - window) &&
                    j0 >= start_s[kv_end - 1 - q0];
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = s[nt][e] * scale2;
                if (!full) {
                    int row = row_a + (e >> 1) * 8, key = j0 + nt * 8 + tig * 2 + (e & 1);
                    bool ok = key <= row && key < seq && (window == 0 || key > row - window) &&
                              key >= start_s[row - q0];
                    v = ok ? v : NEG_INF;
                }
                s[nt][e] = v;
            }

        // Online softmax: rows are shared by the 4 lanes of a quad.
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++) {
            mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        float base[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            base[r] = mx[r] == NEG_INF ? 0.f : mx[r];  // a row that has seen no key yet
            alpha[r] = fast_exp2(m[r] - base[r]);
            m[r] = mx[r];
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fast_exp2(s[nt][e] - base[e >> 1]);
                s[nt][e] = p;
                l[e >> 1] += p;
            }
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            o[dt][0] *= alpha[0], o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1], o[dt][3] *= alpha[1];
        }

        // O += P V: P's accumulators become A fragments; V (stored [key][d]) via ldmatrix.trans.
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            u32 pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                         pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < HD / 16; dp++) {
                u32 r[4];
                ldmatrix_x4_trans(r, smem_addr(V + (kk * 16 + (lane % 16)) * LD + dp * 16 + (lane / 16) * 8));
                mma_bf16(o[2 * dp], pa, r[0], r[1]);
                mma_bf16(o[2 * dp + 1], pa, r[2], r[3]);
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    u64 out_width = (u64)heads * dh;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = row_a + r * 8;
        if (row >= seq) continue;
        float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        u64 out_row = R.local_row(b, row);
        bf16* dst = out + out_row * out_width + qcol;
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            int col = dt * 8 + tig * 2;
            if (col < dh) *(u32*)(dst + col) = pack_bf16(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
        }
        if (tig == 0) lse[out_row * heads + h] = (m[r] + __log2f(l[r])) * LN2;
    }
    // QK-clip (`logit_max`, else null): the head's largest scaled logit, the rows' final running
    // maxima (base 2) over the warp, then one atomic per warp.
    if (logit_max) {
        float top = NEG_INF;
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (row_a + r * 8 < seq) top = fmaxf(top, m[r]);
        top = warp_max(top);
        if (lane == 0 && top != NEG_INF) atomic_max_f32(logit_max + h, top * LN2);
    }
}

// Forward blocks per SM that registers must allow: 4 up to hd64 (its 46 KB of shared memory
// allow 4 as well; without the bound ptxas takes 134 registers at hd64 and 3 fit), 1 from hd128
// on (87 KB of shared memory at hd128: 2 fit whatever the registers; 77 KB at hd192 and 101 KB at
// hd256: shared memory, not registers, holds them to 1 or 2, and their O accumulators need the
// registers).
// The split variants' position arithmetic costs hd64 a few registers more, which the bound of 4
// blocks would spill (20 bytes on sm_90): they take 3.
#define FORWARD_MIN_BLOCKS(HD, SPLIT) ((HD) <= 64 ? ((SPLIT) && (HD) == 64 ? 3 : 4) : 1)
#define ATTENTION_FORWARD(NAME, HD, SPLIT)                                                                           \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, FORWARD_MIN_BLOCKS(HD, SPLIT)) NAME(                   \
        bf16* out, float* lse, float* logit_max, const bf16* qkv, const u32* starts, int seq, int local, int rank,      \
        int ranks, int heads, int kv_heads, int dh, int window, float scale) {                                       \
        SeqRows<SPLIT> R{seq, local, rank, ranks, (int)gridDim.y};                                                   \
        attention_forward_impl<HD>(out, lse, logit_max, qkv, starts, R, heads, kv_heads, dh, window, scale);         \
    }
ATTENTION_FORWARD(attention_forward_hd16, 16, false)
ATTENTION_FORWARD(attention_forward_hd32, 32, false)
ATTENTION_FORWARD(attention_forward_hd64, 64, false)
ATTENTION_FORWARD(attention_forward_hd128, 128, false)
ATTENTION_FORWARD(attention_forward_hd192, 192, false)
ATTENTION_FORWARD(attention_forward_hd256, 256, false)
ATTENTION_FORWARD(attention_forward_split_hd16, 16, true)
ATTENTION_FORWARD(attention_forward_split_hd32, 32, true)
ATTENTION_FORWARD(attention_forward_split_hd64, 64, true)
ATTENTION_FORWARD(attention_forward_split_hd128, 128, true)
ATTENTION_FORWARD(attention_forward_split_hd192, 192, true)
ATTENTION_FORWARD(attention_forward_split_hd256, 256, true)

// D[row, h] = Σ_d dout[row, h, d] · out[row, h, d]   (one warp per (row, head))
extern "C" __global__ void attention_backward_dot(float* big_d, const bf16* dout, const bf16* out, u64 rows, int heads,
                                                  int dh) {
    u64 w = global_thread() / 32;
    int lane = threadIdx.x & 31;
    if (w >= rows * heads) return;
    const bf16 *a = dout + w * dh, *b = out + w * dh;  // rows of H·dh: (row, h) is at (row·H + h)·dh
    float acc = 0.f;
    for (int d = lane; d < dh; d += 32) acc += bf2f(a[d]) * bf2f(b[d]);
    acc = warp_sum(acc);
    if (lane == 0) big_d[w] = acc;
}

// Writes a warp's 16 key rows of an accumulator (dK or dV: `col` the head's first column in
// qkv's rows), times `mul`; columns past dh are padding and are not written.
template <int HD, class Rows>
__device__ __forceinline__ void store_key_rows(bf16* dqkv, const float (&a)[HD / 8][4], Rows R, int b, int key_a,
                                               u64 width, int col, int dh, float mul) {
    int tig = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int key = key_a + r * 8;
        if (key >= R.seq) continue;
        bf16* row = dqkv + R.qkv_row(b, key) * width + col;
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            int c = dt * 8 + tig * 2;
            if (c < dh) *(u32*)(row + c) = pack_bf16(a[dt][2 * r] * mul, a[dt][2 * r + 1] * mul);
        }
    }
}

// BR: queries per inner tile (64; 32 for HD 128 and 192 and 16 for HD 256, to stay within
// registers). BC: keys per block, 16 per warp: 128 (8 warps) for HD 64 to 192, 64 (4 warps) for
// the narrow heads and for HD 256 (whose 128-key tiles would not fit sm_80's shared memory). A
// block's query tiles (Q, dO, their log-sum-exp and D) are loaded once for all its warps and
// its dQ contribution is one set of atomics per query tile, so 128 keys a block halve both
// per key against 64; registers hold one 256-thread block per SM either way (8 warps, as two
// 128-thread blocks did).
// PASSES: 1 up to HD 128 (dK and dV accumulate together), 2 past it: dV over every query tile,
// then dK and dQ over every query tile again (see "Wide heads" above). A pass is
//   for each (query head, query tile) step:  Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ·scale·log2 e - lse)
//     pass accumulating dV:                  dV += Pᵀ dO
//     pass accumulating dK:                  dPᵀ = V dOᵀ, dSᵀ = Pᵀ ⊙ (dPᵀ - D), dK += dSᵀ Q,
//                                            dQ += dS K (through shared memory, f32 atomics)
template <int HD, int BR, int BC, class Rows>
__device__ void attention_backward_impl(bf16* dqkv, float* dq_acc, const bf16* dout, const bf16* qkv, const float* lse,
                                        const float* big_d, const u32* starts, const u32* ends, Rows R, int heads,
                                        int kv_heads, int dh, int window, float scale) {
    constexpr int LD = HD + 8, LDS = BR + 8, WARPS = BC / 16, T = WARPS * 32;
    constexpr int PASSES = HD <= 128 ? 1 : 2, DV = 0, DK = 2 - PASSES;  // acc[DV] and acc[DK]
    DYNAMIC_SMEM(uint4, smem_raw);
    bf16* Ks = (bf16*)smem_raw;     // [BC][LD]
    bf16* Vs = Ks + BC * LD;         // [BC][LD]
    bf16* Qs_buf = Vs + BC * LD;     // [2][BR][LD]: the tile in use and the next one
    bf16* dOs_buf = Qs_buf + 2 * BR * LD;  // [2][BR][LD]
    bf16* dSs = dOs_buf + 2 * BR * LD;     // [BC][LDS]: dSᵀ, keys × queries
    float* lse_buf = (float*)(dSs + BC * LDS);  // [2][BR]
    float* d_buf = lse_buf + 2 * BR;            // [2][BR]
    int* start_buf = (int*)(d_buf + 2 * BR);    // [2][BR]: the queries' document starts (0 unmasked)

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, group = lane >> 2, tig = lane & 3;
    // Grid (key/value head, batch, key tile), x fastest: the first key tiles, which the most
    // query tiles see under a causal mask, go first for every head and sequence.
    int seq = R.seq, k0 = blockIdx.z * BC, g = blockIdx.x, b = blockIdx.y, per_group = heads / kv_heads;
    // row0: of the document bounds (and unsplit, of everything).
    u64 width = (u64)(heads + 2 * kv_heads) * dh, row0 = (u64)b * seq, out_width = (u64)heads * dh;
    int kcol = (heads + g) * dh, vcol = (heads + kv_heads + g) * dh;
    float scale2 = scale * LOG2E;

    auto kt = R.qkv_tile(b, k0);
    load_tile_async<BC, HD, T>(Ks, qkv, kt.row0, kt.r0, kt.limit, width, kcol, dh);
    load_tile_async<BC, HD, T>(Vs, qkv, kt.row0, kt.r0, kt.limit, width, vcol, dh);
    cp_async_commit();

    // dV and dK: two accumulators with one pass, one (dV, then dK) with two.
    float acc_kv[3 - PASSES][HD / 8][4];
#pragma unroll
    for (int a = 0; a < 3 - PASSES; a++)
#pragma unroll
        for (int i = 0; i < HD / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc_kv[a][i][e] = 0.f;
    int key_a = k0 + warp * 16 + group;  // this thread's keys: key_a and key_a + 8

    int q_end = window ? min(seq, k0 + BC - 1 + window) : seq;  // queries that see some key here
    if (ends) q_end = min(q_end, (int)ends[row0 + min(k0 + BC, seq) - 1]);  // and in its documents
    auto qt_range = R.tiles(k0, q_end, BR);  // this rank's query tiles (all of them unsplit)
    int qt_first = qt_range.first, qt_end = qt_range.end;

    // The (query head, query tile) pairs this block visits, in order: step = head · q_tiles +
    // tile, walked with two counters (no divide); the next pair's Q, dO, log-sum-exp and D are
    // fetched while the current one is computed.
    int q_tiles = qt_end - qt_first, steps = per_group * q_tiles;
    static_assert(BR <= T, "one thread per query row of the tile");
    auto fetch = [&](int h, int q0, int buf) {
        auto qt = R.qkv_tile(b, q0), ot = R.local_tile(b, q0);
        load_tile_async<BR, HD, T>(Qs_buf + buf * BR * LD, qkv, qt.row0, qt.r0, qt.limit, width, h * dh, dh);
        load_tile_async<BR, HD, T>(dOs_buf + buf * BR * LD, dout, ot.row0, ot.r0, ot.limit, out_width, h * dh, dh);
        cp_async_commit();
        int i = threadIdx.x;
        if (i < BR) {
            bool ok = q0 + i < seq;
            u64 row = ok ? R.local_row(b, q0 + i) : 0;
            lse_buf[buf * BR + i] = ok ? lse[row * heads + h] * LOG2E : POS_INF;
            d_buf[buf * BR + i] = ok ? big_d[row * heads + h] : 0.f;
            start_buf[buf * BR + i] = ok && starts ? (int)starts[row0 + q0 + i] : 0;
        }
    };
#pragma unroll
    for (int pass = 0; pass < PASSES; pass++) {
        // What this pass accumulates (both with one pass).
        const bool do_dv = PASSES == 1 || pass == 0, do_dk = PASSES == 1 || pass == 1;
        if (pass > 0) {
            // dV is complete: written now, its registers then accumulate dK.
            store_key_rows<HD>(dqkv, acc_kv[DV], R, b, key_a, width, vcol, dh, 1.f);
#pragma unroll
            for (int i = 0; i < HD / 8; i++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc_kv[DK][i][e] = 0.f;
            if (steps == 0) break;
        }
        int h = g * per_group, qt = 0;  // the pair of this step
        fetch(h, R.position(qt_first * BR), 0);  // (a valid tile even when there are no steps)
        for (int step = 0; step < steps; step++) {
            int buf = step & 1, q0 = R.position((qt_first + qt) * BR);
            bool wrap = qt + 1 == q_tiles;
            int next_h = wrap ? h + 1 : h, next_qt = wrap ? 0 : qt + 1;
            // The other buffer was last read before the barrier that ended the previous step.
            if (step + 1 < steps) {
                fetch(next_h, R.position((qt_first + next_qt) * BR), buf ^ 1);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            const bf16 *Qs = Qs_buf + buf * BR * LD, *dOs = dOs_buf + buf * BR * LD;
            const float *lse_s = lse_buf + buf * BR, *d_s = d_buf + buf * BR;
            // Sᵀ = K Qᵀ: this warp's 16 keys × BR queries.
            float st[BR / 8][4];
#pragma unroll
            for (int i = 0; i < BR / 8; i++) st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.f;
#pragma unroll
            for (int kt = 0; kt < HD / 16; kt++) {
                u32 ka[4];
                ldmatrix_x4(ka, smem_addr(Ks + (warp * 16 + (lane % 16)) * LD + kt * 16 + (lane / 16) * 8));
#pragma unroll
                for (int np = 0; np < BR / 16; np++) {
                    u32 r[4];
                    ldmatrix_x4(r, smem_addr(Qs + (np * 16 + (lane % 8) + (lane / 16) * 8) * LD + kt * 16 + ((lane / 8) % 2) * 8));
                    mma_bf16(st[2 * np], ka, r[0], r[1]);
                    mma_bf16(st[2 * np + 1], ka, r[2], r[3]);
                }
            }
            // Pᵀ, zero where the query does not see the key. Most tiles of a long sequence are
            // seen whole by every query (all keys before all queries, inside the window): those
            // skip the mask, as the forward pass does.
            bool full = k0 + BC - 1 <= q0 && k0 + BC <= seq && q0 + BR <= seq &&
                        (window == 0 || k0 > q0 + BR - 1 - window) && k0 >= start_buf[buf * BR + BR - 1];
#pragma unroll
            for (int nt = 0; nt < BR / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int qi = nt * 8 + tig * 2 + (e & 1);
                    float p = fast_exp2(st[nt][e] * scale2 - lse_s[qi]);
                    if (!full) {
                        int key = key_a + (e >> 1) * 8, q = q0 + qi;
                        bool ok = key < seq && q < seq && key <= q && (window == 0 || key > q - window) &&
                                  key >= start_buf[buf * BR + qi];
                        p = ok ? p : 0.f;
                    }
                    st[nt][e] = p;
                }
            // dV += Pᵀ dO   (dO stored [query][d]: ldmatrix.trans gives its (k = query, n = d) fragments)
#pragma unroll
            for (int kk = 0; kk < (do_dv ? BR / 16 : 0); kk++) {
                u32 pa[4] = {pack_bf16(st[2 * kk][0], st[2 * kk][1]), pack_bf16(st[2 * kk][2], st[2 * kk][3]),
                             pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                             pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3])};
#pragma unroll
                for (int dp = 0; dp < HD / 16; dp++) {
                    u32 r[4];
                    ldmatrix_x4_trans(r, smem_addr(dOs + (kk * 16 + (lane % 16)) * LD + dp * 16 + (lane / 16) * 8));
                    mma_bf16(acc_kv[DV][2 * dp], pa, r[0], r[1]);
                    mma_bf16(acc_kv[DV][2 * dp + 1], pa, r[2], r[3]);
                }
            }
            if (do_dk) {
                // dPᵀ = V dOᵀ, then dSᵀ = Pᵀ ⊙ (dPᵀ - D) in place.
                float dpt[BR / 8][4];
#pragma unroll
                for (int i = 0; i < BR / 8; i++) dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.f;
#pragma unroll
                for (int kt = 0; kt < HD / 16; kt++) {
                    u32 va[4];
                    ldmatrix_x4(va, smem_addr(Vs + (warp * 16 + (lane % 16)) * LD + kt * 16 + (lane / 16) * 8));
#pragma unroll
                    for (int np = 0; np < BR / 16; np++) {
                        u32 r[4];
                        ldmatrix_x4(r, smem_addr(dOs + (np * 16 + (lane % 8) + (lane / 16) * 8) * LD + kt * 16 + ((lane / 8) % 2) * 8));
                        mma_bf16(dpt[2 * np], va, r[0], r[1]);
                        mma_bf16(dpt[2 * np + 1], va, r[2], r[3]);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < BR / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) dpt[nt][e] = st[nt][e] * (dpt[nt][e] - d_s[nt * 8 + tig * 2 + (e & 1)]);
                // dK += dSᵀ Q   (Q stored [query][d]: ldmatrix.trans)
#pragma unroll
                for (int kk = 0; kk < BR / 16; kk++) {
                    u32 da[4] = {pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]), pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]),
                                 pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                 pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
                    for (int dp = 0; dp < HD / 16; dp++) {
                        u32 r[4];
                        ldmatrix_x4_trans(r, smem_addr(Qs + (kk * 16 + (lane % 16)) * LD + dp * 16 + (lane / 16) * 8));
                        mma_bf16(acc_kv[DK][2 * dp], da, r[0], r[1]);
                        mma_bf16(acc_kv[DK][2 * dp + 1], da, r[2], r[3]);
                    }
                }
                // dSᵀ to shared memory for dQ, which needs it with queries as rows.
#pragma unroll
                for (int nt = 0; nt < BR / 8; nt++)
#pragma unroll
                    for (int r = 0; r < 2; r++)
                        *(u32*)(dSs + (warp * 16 + group + r * 8) * LDS + nt * 8 + tig * 2) =
                            pack_bf16(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
                __syncthreads();

                // dQ (BR × HD) += dS K: the output tiles are split over the warps; dS comes from its
                // transpose in shared memory (ldmatrix.trans), K (stored [key][d]) likewise.
                constexpr int MT = BR / 16, NT_PER_WARP = (HD / 8) * MT / WARPS;
                static_assert(NT_PER_WARP % 2 == 0 && NT_PER_WARP * WARPS == (HD / 8) * MT, "dQ tiles split evenly");
                int mi = warp % MT, nt0 = (warp / MT) * NT_PER_WARP;
                float acc[NT_PER_WARP][4];
#pragma unroll
                for (int i = 0; i < NT_PER_WARP; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < BC / 16; kk++) {
                    u32 a[4];
                    ldmatrix_x4_trans(a, smem_addr(dSs + (kk * 16 + (lane % 8) + (lane / 16) * 8) * LDS + mi * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
                    for (int np = 0; np < NT_PER_WARP / 2; np++) {
                        u32 r[4];
                        ldmatrix_x4_trans(r, smem_addr(Ks + (kk * 16 + (lane % 16)) * LD + (nt0 + 2 * np) * 8 + (lane / 16) * 8));
                        mma_bf16(acc[2 * np], a, r[0], r[1]);
                        mma_bf16(acc[2 * np + 1], a, r[2], r[3]);
                    }
                }
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    int q = q0 + mi * 16 + group + r * 8;
                    if (q >= seq) continue;
                    float* dst = dq_acc + R.local_row(b, q) * out_width + (u64)h * dh;
#pragma unroll
                    for (int i = 0; i < NT_PER_WARP; i++) {
                        int col = (nt0 + i) * 8 + tig * 2;
                        if (col < dh) red_add2(dst + col, acc[i][2 * r], acc[i][2 * r + 1]);
                    }
                }
            }  // do_dk
            __syncthreads();  // dSs and this step's buffers are refilled next
            h = next_h, qt = next_qt;
        }
    }  // pass

    // dK (scaled) and, with one pass, dV for this block's keys, written once.
    if (PASSES == 2) {
        store_key_rows<HD>(dqkv, acc_kv[DK], R, b, key_a, width, kcol, dh, scale);
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int key = key_a + r * 8;
        if (key >= seq) continue;
        bf16* row = dqkv + R.qkv_row(b, key) * width;
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt++) {
            int col = dt * 8 + tig * 2;
            if (col >= dh) continue;
            *(u32*)(row + kcol + col) = pack_bf16(acc_kv[DK][dt][2 * r] * scale, acc_kv[DK][dt][2 * r + 1] * scale);
            *(u32*)(row + vcol + col) = pack_bf16(acc_kv[DV][dt][2 * r], acc_kv[DV][dt][2 * r + 1]);
        }
    }
}

// BOUNDS: the unsplit kernels leave ptxas its register heuristics; the split ones say one block
// per SM suffices, which gives their position arithmetic the registers it needs (hd16 spilled
// 24 bytes on sm_90 at the 128 registers ptxas chose otherwise).
#define ATTENTION_BACKWARD(NAME, HD, BR, BC, SPLIT, BOUNDS)                                                         \
    extern "C" __global__ void BOUNDS NAME(                                                                         \
        bf16* dqkv, float* dq_acc, const bf16* dout, const bf16* qkv, const float* lse, const float* big_d,          \
        const u32* starts, const u32* ends, int seq, int local, int rank, int ranks, int heads, int kv_heads, int dh, \
        int window, float scale) {                                                                                   \
        SeqRows<SPLIT> R{seq, local, rank, ranks, (int)gridDim.y};                                                   \
        attention_backward_impl<HD, BR, BC>(dqkv, dq_acc, dout, qkv, lse, big_d, starts, ends, R, heads, kv_heads,   \
                                            dh, window, scale);                                                      \
    }
ATTENTION_BACKWARD(attention_backward_hd16, 16, 64, 64, false, __launch_bounds__(128))
ATTENTION_BACKWARD(attention_backward_hd32, 32, 64, 64, false, __launch_bounds__(128))
ATTENTION_BACKWARD(attention_backward_hd64, 64, 64, 128, false, __launch_bounds__(256))
ATTENTION_BACKWARD(attention_backward_hd128, 128, 32, 128, false, __launch_bounds__(256))
ATTENTION_BACKWARD(attention_backward_hd192, 192, 32, 128, false, __launch_bounds__(256))
ATTENTION_BACKWARD(attention_backward_hd256, 256, 16, 64, false, __launch_bounds__(128))
ATTENTION_BACKWARD(attention_backward_split_hd16, 16, 64, 64, true, __launch_bounds__(128, 1))
ATTENTION_BACKWARD(attention_backward_split_hd32, 32, 64, 64, true, __launch_bounds__(128, 1))
ATTENTION_BACKWARD(attention_backward_split_hd64, 64, 64, 128, true, __launch_bounds__(256, 1))
ATTENTION_BACKWARD(attention_backward_split_hd128, 128, 32, 128, true, __launch_bounds__(256, 1))
ATTENTION_BACKWARD(attention_backward_split_hd192, 192, 32, 128, true, __launch_bounds__(256, 1))
ATTENTION_BACKWARD(attention_backward_split_hd256, 256, 16, 64, true, __launch_bounds__(128, 1))

// dqkv[row, q columns] = scale · dq_acc[row]. A block per row (striding over the rows), its
// threads over the row's columns 8 at a time: no divide, two 16-byte loads and one 16-byte
// store per 8 columns. The launcher checks what this needs: q_width and width multiples of 8,
// dqkv and dq_acc 16-byte aligned. (Through uint4 pointers: a uint4 store to a cast bf16
// address compiles to four 4-byte stores here.)
extern "C" __global__ void attention_backward_dq(bf16* dqkv, const float* dq_acc, u64 rows, int q_width, u64 width,
                                                 float scale) {
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float4* src = (const float4*)(dq_acc + row * q_width);
        uint4* dst = (uint4*)(dqkv + row * width);
        for (int c = threadIdx.x; c < q_width / 8; c += blockDim.x) {
            float4 a = src[2 * c], b = src[2 * c + 1];
            dst[c] = make_uint4(pack_bf16(a.x * scale, a.y * scale), pack_bf16(a.z * scale, a.w * scale),
                                pack_bf16(b.x * scale, b.y * scale), pack_bf16(b.z * scale, b.w * scale));
        }
    }
}

// Document bounds of packed sequences (rows r = b·T + i): starts[r] = 1 + the last position
// j < i of sequence b whose token is `eos` (0 without one), so the EOS belongs to the document it
// ends; ends[r] = 1 + the first position j >= i holding `eos` (T without one); with `positions`
// (else null), positions[r] = i - starts[r]. A block per sequence: each thread finds the last
// and the first EOS of its stretch of T / blockDim.x tokens, scans over the threads (a prefix
// maximum and a suffix minimum) give the last EOS before each stretch and the first after it,
// and each thread writes its stretch.
#define BOUNDS_THREADS 256
extern "C" __global__ void __launch_bounds__(BOUNDS_THREADS) attention_document_bounds(u32* starts, u32* ends,
                                                                                      u32* positions, const u32* tokens,
                                                                                      int seq, int eos) {
    __shared__ int last[BOUNDS_THREADS], first[BOUNDS_THREADS];
    u64 row0 = (u64)blockIdx.x * seq;
    int t = threadIdx.x, per = (seq + BOUNDS_THREADS - 1) / BOUNDS_THREADS;
    int lo = min(seq, t * per), hi = min(seq, lo + per);
    int mine_last = -1, mine_first = seq;
    for (int i = hi - 1; i >= lo; i--)
        if ((int)tokens[row0 + i] == eos) mine_last = max(mine_last, i), mine_first = i;
    last[t] = mine_last, first[t] = mine_first;
    __syncthreads();
    for (int off = 1; off < BOUNDS_THREADS; off *= 2) {
        int before = t >= off ? last[t - off] : -1, after = t + off < BOUNDS_THREADS ? first[t + off] : seq;
        __syncthreads();
        last[t] = max(last[t], before), first[t] = min(first[t], after);
        __syncthreads();
    }
    int prev = t > 0 ? last[t - 1] : -1;  // the last EOS before this stretch
    for (int i = lo; i < hi; i++) {
        u32 start = (u32)(prev + 1);
        starts[row0 + i] = start;
        if (positions) positions[row0 + i] = (u32)i - start;
        if ((int)tokens[row0 + i] == eos) prev = i;
    }
    int next = t + 1 < BOUNDS_THREADS ? first[t + 1] : seq;  // the first EOS after it
    for (int i = hi - 1; i >= lo; i--) {
        if ((int)tokens[row0 + i] == eos) next = i;
        ends[row0 + i] = (u32)min(next + 1, seq);
    }
}

// On a sequence axis, the positions within their documents of one rank's rows (r = b·local + i)
// from the whole sequences' starts (`attention_document_bounds` over every rank's tokens):
// positions[r] = p - starts[b·seq + p], p the true position of local row i. A thread a row.
extern "C" __global__ void attention_document_positions(u32* positions, const u32* starts, int seq, int local,
                                                        int rank, int ranks, u64 rows) {
    u64 r = global_thread();
    if (r >= rows) return;
    SeqRows<true> R{seq, local, rank, ranks, 0};
    int b = (int)(r / local), p = R.position((int)(r % local));
    positions[r] = (u32)p - starts[(u64)b * seq + p];
}
