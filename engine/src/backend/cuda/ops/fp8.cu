// FP8 casts of the products' operands (train.precision = "fp8"), in the rounding of
// backend/fp8.rs: x · scale rounded to nearest, ties to even, saturating to the format's
// largest finite value, with subnormals. The scale and the amax live in the operand's state,
// [scale, 1 / scale, amax, max, history...] (f32, device memory): the product reads 1 / scale
// through cuBLASLt's scale pointers, so the host never sees a scale.
//
// Formats (OCP): E4M3 (bias 7, 3 mantissa bits, ±448, NaN 0x7f) and E5M2 (bias 15, 2 bits,
// ±57344, NaN 0x7e). The conversion is written out rather than taken from cuda_fp8.h (which
// NVRTC's include-free build and the emulator lack), and it is exact on every architecture.

#define FP8_SCALE 0
#define FP8_INV_SCALE 1
#define FP8_AMAX 2
#define FP8_MAX 3
#define FP8_HISTORY 4

// x rounded to the FP8 format with `mbits` mantissa bits and exponent `bias`, largest finite
// value `max`, as its byte.
__device__ __forceinline__ unsigned char fp8_encode(float x, int mbits, int bias, float max, unsigned char nan) {
    if (x != x) return nan;
    unsigned char sign = x < 0.f ? 0x80 : 0;
    float a = fabsf(x);
    // The quantum at a's binade (the subnormals' below the smallest normal), then rint: the
    // division and multiplication by powers of two are exact, rint rounds ties to even.
    int e;
    frexpf(a, &e);  // a = m · 2^e, m in [0.5, 1): a's binade is 2^(e - 1)
    int lowest = 1 - bias;
    int binade = a == 0.f ? lowest : (e - 1 < lowest ? lowest : e - 1);
    float quantum = ldexpf(1.f, binade - mbits);
    float r = rintf(a / quantum) * quantum;
    if (r > max) r = max;
    if (r == 0.f) return sign;
    frexpf(r, &e);
    int exponent = e - 1;  // after rounding, which may carry into the next binade
    unsigned char code;
    if (exponent < lowest) {
        code = (unsigned char)(r / ldexpf(1.f, lowest - mbits));  // a subnormal: exponent field 0
    } else {
        int mantissa = (int)((r / ldexpf(1.f, exponent) - 1.f) * (float)(1 << mbits));
        code = (unsigned char)(((exponent + bias) << mbits) | mantissa);
    }
    return sign | code;
}

__device__ __forceinline__ unsigned char to_fp8(float x, int e5m2) {
    return e5m2 ? fp8_encode(x, 2, 15, 57344.f, 0x7e) : fp8_encode(x, 3, 7, 448.f, 0x7f);
}

// The scale that maps `amax` onto `max`, divided by 2^margin; 0 when the amax gives none (zero,
// infinite or NaN), where the caller keeps the scale it has (backend/fp8.rs's scale_for).
__device__ __forceinline__ float scale_for(float amax, float max, int margin) {
    float scale = max / amax / ldexpf(1.f, margin);
    return amax > 0.f && amax <= 3.4e38f && scale <= 3.4e38f && scale > 0.f ? scale : 0.f;
}

// |x| as bits: for non-negative floats the unsigned order is the numeric one, and every NaN
// lies above +inf, so the maximum of the bits is the amax, NaN if any element is NaN.
__device__ __forceinline__ u32 abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

__device__ __forceinline__ u32 block_max_u32(u32 v, u32* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        u32 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    u32 t = lane < warps ? scratch[lane] : 0u;
    for (int o = 16; o > 0; o >>= 1) {
        u32 w = __shfl_xor_sync(0xffffffffu, t, o);
        t = w > t ? w : t;
    }
    __syncthreads();
    return t;
}

// One amax partial per block (as bits), over a grid-stride walk of the bf16 tensor.
extern "C" __global__ void fp8_amax_partials(const bf16* x, u64 n, u32* partials) {
    __shared__ u32 scratch[32];
    u32 m = 0;
    for (u64 i = global_thread(); i < n; i += global_stride()) {
        u32 b = abs_bits(bf2f(x[i]));
        m = b > m ? b : m;
    }
    m = block_max_u32(m, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// The amax of the partials, into the state: under tensorwise scaling it sets the scale
// (max / amax, 1 when the amax gives none: zero, infinite or NaN); under delayed scaling it is
// recorded (the largest of the step's casts, NaN sticking).
extern "C" __global__ void fp8_amax_finish(const u32* partials, int count, float* state, int tensorwise) {
    __shared__ u32 scratch[32];
    u32 m = 0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) m = partials[i] > m ? partials[i] : m;
    m = block_max_u32(m, scratch);
    if (threadIdx.x != 0) return;
    float amax = __uint_as_float(m);
    if (tensorwise) {
        float scale = scale_for(amax, state[FP8_MAX], 0);
        state[FP8_SCALE] = scale > 0.f ? scale : 1.f;
        state[FP8_INV_SCALE] = 1.f / state[FP8_SCALE];
    } else {
        u32 recorded = abs_bits(state[FP8_AMAX]);
        state[FP8_AMAX] = __uint_as_float(m > recorded ? m : recorded);
    }
}

// Under the delayed recipe the scale is known before the cast (the last update set it), so the
// cast takes the tensor's amax in the same pass (`record`): each block's maximum, then one atomic
// into the state's amax (the bits of non-negative floats order as unsigned integers, and a
// NaN's lie above +inf, so it sticks as fp8_amax_finish's record does). Every thread of the
// block calls it (it holds barriers).
__device__ __forceinline__ void record_amax(u32 m, float* state, u32* scratch) {
    m = block_max_u32(m, scratch);
    if (threadIdx.x == 0) atomicMax((u32*)(state + FP8_AMAX), m);
}

// q[i] = fp8(x[i] · scale), and with `record` the amax into the state.
extern "C" __global__ void fp8_cast(unsigned char* q, const bf16* x, u64 n, float* state, int e5m2, int record) {
    __shared__ u32 scratch[32];
    float scale = state[FP8_SCALE];
    u32 m = 0;
    for (u64 i = global_thread(); i < n; i += global_stride()) {
        float v = bf2f(x[i]);
        u32 b = abs_bits(v);
        m = b > m ? b : m;
        q[i] = to_fp8(v * scale, e5m2);
    }
    if (record) record_amax(m, state, scratch);
}

// The casts into both layouts, a 32 × 32 tile a block (256 threads: 8 warps, each warp a row of
// the tile at a time; a grid of (cols / 32, rows / 32) tiles): `value(at)` gives the element at
// `at` of the [rows, cols] tensor; its byte goes to `plain` [rows, cols] (unless null) and,
// through shared memory so that both the reads and the writes are along rows, to `q`
// [cols, rows]. With `record`, the block's amax into the state.
template <typename Value>
__device__ __forceinline__ void cast_tile(unsigned char* q, unsigned char* plain, int rows, int cols, float* state,
                                          int e5m2, int record, Value value) {
    __shared__ unsigned char tile[32][33];
    __shared__ u32 scratch[32];
    float scale = state[FP8_SCALE];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    u32 m = 0;
    for (int dy = warp; dy < 32; dy += warps) {
        int r = r0 + dy, c = c0 + lane;
        if (r < rows && c < cols) {
            u64 at = (u64)r * cols + c;
            float v = value(at);
            u32 b = abs_bits(v);
            m = b > m ? b : m;
            unsigned char byte = to_fp8(v * scale, e5m2);
            tile[dy][lane] = byte;
            if (plain) plain[at] = byte;
        }
    }
    __syncthreads();
    for (int dy = warp; dy < 32; dy += warps) {
        int c = c0 + dy, r = r0 + lane;
        if (r < rows && c < cols) q[(u64)c * rows + r] = tile[lane][dy];
    }
    if (record) record_amax(m, state, scratch);
}

// The transposed cast: x is [rows, cols], q [cols, rows] (cast_tile). With `plain` (else null)
// the same pass also writes the untransposed cast: one read of x for both layouts (the backward
// pass's dy). With `record`, the amax into the state.
extern "C" __global__ void fp8_cast_transposed(unsigned char* q, unsigned char* plain, const bf16* x, int rows, int cols,
                                               float* state, int e5m2, int record) {
    cast_tile(q, plain, rows, cols, state, e5m2, record, [&](u64 at) { return bf2f(x[at]); });
}

// q [cols, rows] = x [rows, cols] transposed, byte for byte: a cast that arrived in one layout
// (FSDP's FP8 gathers) in the other, its scale unchanged. cast_tile's tiles: a 32 × 32 tile a
// block, through shared memory so that both the reads and the writes are along rows.
extern "C" __global__ void fp8_transpose(unsigned char* q, const unsigned char* x, int rows, int cols) {
    __shared__ unsigned char tile[32][33];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int dy = warp; dy < 32; dy += warps) {
        int r = r0 + dy, c = c0 + lane;
        if (r < rows && c < cols) tile[dy][lane] = x[(u64)r * cols + c];
    }
    __syncthreads();
    for (int dy = warp; dy < 32; dy += warps) {
        int c = c0 + dy, r = r0 + lane;
        if (r < rows && c < cols) q[(u64)c * rows + r] = tile[lane][dy];
    }
}

// RMSNorm cast to E4M3 in both layouts under the delayed recipe (the state's scale, the amax
// recorded), in place of rmsnorm_forward's bf16 output and fp8_cast_transposed's pass over it:
// q [rows, d], qt [d, rows] and rstd [rows]. A block takes 32 rows: their rstd one row at a time
// with the whole block (rms_rstd: the unfused kernel's sums, with its V and its threads), then
// the rows' 32-column tiles through shared memory as cast_tile's, each element rounded to bf16
// first as the unfused output is. So the bytes, rstd and amax are the unfused path's; x is read
// twice (the second time from L2) and a byte an element written a layout: 4 bytes an element
// moved from DRAM against the unfused 8, one launch against two.
template <int V>
__device__ void rmsnorm_fp8_impl(unsigned char* q, unsigned char* qt, float* rstd, const bf16* x, const bf16* w, int rows,
                                 int d, float eps, float offset, float* state) {
    __shared__ float r_s[32], scratch[32];
    __shared__ unsigned char tile[32][33];
    __shared__ u32 amax_scratch[32];
    int r0 = blockIdx.x * 32;
    for (int dy = 0; dy < 32 && r0 + dy < rows; dy++) {
        u64 row = (u64)r0 + dy;
        float r = rms_rstd<V>(x + row * d, d, eps, scratch);
        if (threadIdx.x == 0) r_s[dy] = r, rstd[row] = r;
    }
    __syncthreads();
    float scale = state[FP8_SCALE];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u32 m = 0;
    for (int c0 = 0; c0 < d; c0 += 32) {
        for (int dy = warp; dy < 32; dy += warps) {
            int r = r0 + dy, c = c0 + lane;
            if (r < rows && c < d) {
                u64 at = (u64)r * d + c;
                float v = bf2f(f2bf((bf2f(w[c]) + offset) * (bf2f(x[at]) * r_s[dy])));
                u32 b = abs_bits(v);
                m = b > m ? b : m;
                unsigned char byte = to_fp8(v * scale, 0);
                tile[dy][lane] = byte;
                q[at] = byte;
            }
        }
        __syncthreads();
        for (int dy = warp; dy < 32; dy += warps) {
            int c = c0 + dy, r = r0 + lane;
            if (r < rows && c < d) qt[(u64)c * rows + r] = tile[lane][dy];
        }
        __syncthreads();
    }
    record_amax(m, state, amax_scratch);
}
extern "C" __global__ void rmsnorm_fp8(unsigned char* q, unsigned char* qt, float* rstd, const bf16* x, const bf16* w,
                                       int rows, int d, float eps, float offset, float* state) {
    rmsnorm_fp8_impl<1>(q, qt, rstd, x, w, rows, d, eps, offset, state);
}
extern "C" __global__ void rmsnorm_fp8_v8(unsigned char* q, unsigned char* qt, float* rstd, const bf16* x, const bf16* w,
                                          int rows, int d, float eps, float offset, float* state) {
    rmsnorm_fp8_impl<8>(q, qt, rstd, x, w, rows, d, eps, offset, state);
}

// SwiGLU over rows [gate (f) | up (f)] cast to E4M3 in both layouts under the delayed recipe,
// in place of swiglu_forward's bf16 output h and fp8_cast_transposed's pass over it: q [rows, f]
// and qt [f, rows] (cast_tile's tiles), each element rounded to bf16 first as h is, the amax
// recorded. The same bytes; gu read once, a byte an element written a layout.
extern "C" __global__ void swiglu_fp8(unsigned char* q, unsigned char* qt, const bf16* gu, int rows, int f, float* state) {
    cast_tile(qt, q, rows, f, state, 0, 1, [&](u64 at) {
        u64 row = at / f, c = at - row * f;
        const bf16* r = gu + row * 2 * f;
        return bf2f(f2bf(swiglu_element(bf2f(r[c]), bf2f(r[f + c]))));
    });
}

// AdamW over one weight W [rows, cols] (adamw_element: the flat update's arithmetic), writing
// besides the parameters, moments, zeroed gradients and bf16 copy the copy's FP8 casts in both
// layouts, q [rows, cols] and qt [cols, rows], with the state's scale (the delayed recipe's,
// set by the update before this step) and the amax recorded: what fp8_cast_transposed with
// `plain` and `record` would write from the updated bf16 copy, without reading it again. The
// forward and backward passes read the casts instead of casting the weight. Tiles as
// cast_tile's; the pointers are the weight's own (its offset in the flat buffers).
extern "C" __global__ void adamw_fp8(float* p, bf16* p16, float* g, float* m, float* v, const float* norm_sq, int rows,
                                     int cols, int decays, unsigned char* q, unsigned char* qt, float* state, int e5m2,
                                     float lr, float beta1, float beta2, float eps, float wd, float step_size,
                                     float bc2_sqrt, float max_norm) {
    float norm = sqrtf(norm_sq[0]);
    float clip = (max_norm > 0.f && norm > max_norm) ? max_norm / norm : 1.f;
    float decay = decays ? 1.f - lr * wd : 1.f;
    cast_tile(qt, q, rows, cols, state, e5m2, 1, [&](u64 at) {
        float pv = p[at], mv = m[at], vv = v[at];
        adamw_element(pv, mv, vv, g[at], clip, beta1, beta2, eps, decay, step_size, bc2_sqrt);
        p[at] = pv, m[at] = mv, v[at] = vv, g[at] = 0.f;
        bf16 b = f2bf(pv);
        p16[at] = b;
        return bf2f(b);
    });
}

// The delayed recipe's step, one thread an operand: the recorded amax enters the history
// (newest first), and the scale becomes max / max(history) / 2^margin where that is usable; a
// state without history takes it from the recorded amax (backend/fp8.rs's delayed_update).
extern "C" __global__ void fp8_delayed_update(float* states, int operands, int stride, int margin) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= operands) return;
    float* s = states + (u64)i * stride;
    int history = stride - FP8_HISTORY;
    float amax = s[FP8_AMAX];
    if (history > 0) {
        for (int h = history - 1; h > 0; h--) s[FP8_HISTORY + h] = s[FP8_HISTORY + h - 1];
        s[FP8_HISTORY] = s[FP8_AMAX];
    }
    s[FP8_AMAX] = 0.f;
    // Without history, the amax recorded (FSDP's tensorwise weights: the group's maximum).
    float newest = history == 0 && amax == amax && amax > 0.f ? amax : 0.f;
    for (int h = 0; h < history; h++) {
        float v = s[FP8_HISTORY + h];
        if (v == v && v > newest) newest = v;
    }
    float scale = scale_for(newest, s[FP8_MAX], margin);
    if (scale > 0.f) {
        s[FP8_SCALE] = scale;
        s[FP8_INV_SCALE] = 1.f / scale;
    }
}
