// Shared by every kernel module (prepended to each source before NVRTC compiles it).
//
// No CUDA headers are included: NVRTC's own distribution (the PyPI wheel, and a bare driver
// install) ships none of cuda_bf16.h, mma.h or cuda_pipeline.h, so the bf16 type, its
// conversions and the tensor-core and async-copy instructions are written here as inline PTX.
// Everything targets sm_80 and newer (cvt.rn.bf16, cp.async, ldmatrix, mma.m16n8k16.bf16).
//
// The tests also compile these sources for the CPU (ENGINE_EMULATION, see emu/): there the
// inline-PTX helpers are declared here and defined by the emulator after PTX's definitions.
//
// Conventions: element counts and offsets are 64-bit (`u64`); buffers are row-major; bf16 holds
// activations and the compute copy of parameters; f32 holds master weights, gradients, optimizer
// state and statistics; every reduction accumulates in f32 or f64.

typedef unsigned long long u64;
typedef unsigned int u32;

// bf16 storage: the upper 16 bits of an IEEE f32.
struct alignas(2) bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float bf2f(bf16 v) { return __uint_as_float(((u32)v.bits) << 16); }

#ifndef ENGINE_EMULATION
// A shared-memory address as the PTX instructions take it.
typedef u32 smem_t;
// Dynamic shared memory of a kernel (its size is given at launch).
#define DYNAMIC_SMEM(type, name) extern __shared__ type name[]

// Round to nearest even (NaN stays NaN), as the tensor cores and PyTorch round.
__device__ __forceinline__ bf16 f2bf(float f) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
    return r;
}

// Two floats as a bf16x2 register: `lo` in the low half (the lower address in memory).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#else  // smem_t comes from the emulator's prelude
#define DYNAMIC_SMEM(type, name) type* name = (type*)emu_dynamic_smem()
inline bf16 f2bf(float f);
inline u32 pack_bf16(float lo, float hi);
inline void mma_bf16(float* c, const u32* a, u32 b0, u32 b1);
template <int A_E5M2>
inline void mma_fp8(float* c, const u32* a, u32 b0, u32 b1);
inline smem_t smem_addr(const void* p);
inline void ldmatrix_x4(u32* r, smem_t addr);
inline void ldmatrix_x4_trans(u32* r, smem_t addr);
inline void cp_async16(smem_t dst, const void* src, int bytes);
inline void cp_async_commit();
template <int N>
inline void cp_async_wait();
inline void red_add(float* p, float v);
inline void red_add2(float* p, float a, float b);
#endif
__device__ __forceinline__ float lo_f(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_f(u32 v) { return __uint_as_float(v & 0xffff0000u); }

// Loads and stores that convert through f32, so one template serves both element types.
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16* p) { return bf2f(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf16* p, float v) { *p = f2bf(v); }

// 2^x for a softmax: one MUFU.EX2. exp2f adds a range reduction so that results below 2^-126
// come out as denormals; a probability that small adds nothing, so it is flushed to zero (as
// the emulator does). 2^-inf is 0.
#ifndef ENGINE_EMULATION
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#else
inline float fast_exp2(float x) {
    float y = exp2f(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}
#endif

#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ u64 global_thread() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 global_stride() { return (u64)gridDim.x * blockDim.x; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// *p = max(*p, v) for any floats but NaN, atomically: non-negative floats order as their bits
// read as signed integers, negative ones inversely as unsigned, and a non-negative value's bits
// are below every negative one's as unsigned (so a negative v never replaces a non-negative *p).
__device__ __forceinline__ void atomic_max_f32(float* p, float v) {
    if (v >= 0.f)
        atomicMax((int*)p, __float_as_int(v));
    else
        atomicMin((unsigned*)p, __float_as_uint(v));
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `scratch` holds 32 floats of shared memory; the call ends with a barrier, so it may be reused.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum_f64(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < warps ? scratch[lane] : 0.0;
    t = warp_sum_f64(t);
    __syncthreads();
    return t;
}

// ---- Tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate) ------------------------------
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4·group + tig:
//   A 16×16 (row-major): a0 = (group, 2tig..+1), a1 = (group+8, 2tig..), a2 = (group, 2tig+8..),
//                        a3 = (group+8, 2tig+8..)
//   B 16×8 (k × n):      b0 = (k = 2tig..+1, n = group), b1 = (k = 2tig+8..+1, n = group)
//   C 16×8 (f32):        c0,c1 = (group, 2tig..+1), c2,c3 = (group+8, 2tig..+1)
// The C fragments of two adjacent n-tiles are, once packed to bf16, exactly the A fragment of
// one 16×16 tile: how softmax probabilities feed the next product without shared memory.

#ifndef ENGINE_EMULATION
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// FP8 (mma.sync m16n8k32, sm_89 and newer): A E4M3 or E5M2 (`A_E5M2`, the gradients), B E4M3,
// f32 accumulate. Each register holds 4 FP8 values where m16n8k16's holds 2 bf16, in the same
// places byte for byte (a0 = row group, bytes 4tig..+3 of k 0..15; a2 the same of k 16..31; b
// likewise along k), so the same ldmatrix of the same shared tiles feeds both. Earlier devices
// never run it (the FP8 products are refused there).
template <int A_E5M2>
__device__ __forceinline__ void mma_fp8(float* c, const u32* a, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 890
    if (A_E5M2)
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

__device__ __forceinline__ smem_t smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Four 8×8 b16 matrices from shared memory; lane l gives the row address of matrix l / 8, row
// l % 8. Without .trans lane i receives row i / 4, columns 2(i % 4)..+1 of each matrix.
__device__ __forceinline__ void ldmatrix_x4(u32* r, smem_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// The same, transposed: lane i receives column i / 4, rows 2(i % 4)..+1.
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, smem_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 16-byte asynchronous copy global -> shared; `bytes` < 16 zero-fills the rest (0: all zeros,
// and the source is not read).
__device__ __forceinline__ void cp_async16(smem_t dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Fire-and-forget f32 add to global memory.
__device__ __forceinline__ void red_add(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

// p[0] += a, p[1] += b (p 8-byte aligned): one vector reduction on sm_90, two before it.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    red_add(p, a);
    red_add(p + 1, b);
#endif
}
#endif

// ---- Vector access: V = 8 moves 16 bytes (8 bf16) at once, V = 4 8 bytes, V = 1 one element ---
// Callers choose V = 8 (4) only when the row width is a multiple of 8 (4) and the rows are
// 16-byte (8-byte) aligned (the host checks both).

template <int V>
__device__ __forceinline__ void loadv(const bf16* p, float* f) {
    if constexpr (V == 8) {
        uint4 u = *(const uint4*)p;
        f[0] = lo_f(u.x), f[1] = hi_f(u.x), f[2] = lo_f(u.y), f[3] = hi_f(u.y);
        f[4] = lo_f(u.z), f[5] = hi_f(u.z), f[6] = lo_f(u.w), f[7] = hi_f(u.w);
    } else if constexpr (V == 4) {
        uint2 u = *(const uint2*)p;
        f[0] = lo_f(u.x), f[1] = hi_f(u.x), f[2] = lo_f(u.y), f[3] = hi_f(u.y);
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) f[k] = bf2f(p[k]);
    }
}

template <int V>
__device__ __forceinline__ void storev(bf16* p, const float* f) {
    if constexpr (V == 8) {
        uint4 u;
        u.x = pack_bf16(f[0], f[1]), u.y = pack_bf16(f[2], f[3]);
        u.z = pack_bf16(f[4], f[5]), u.w = pack_bf16(f[6], f[7]);
        *(uint4*)p = u;
    } else if constexpr (V == 4) {
        uint2 u;
        u.x = pack_bf16(f[0], f[1]), u.y = pack_bf16(f[2], f[3]);
        *(uint2*)p = u;
    } else {
#pragma unroll
        for (int k = 0; k < V; k++) p[k] = f2bf(f[k]);
    }
}

// One element of an AdamW step (PyTorch's formulation; adamw.cu documents it): `clip` scales
// the gradient, `decay` is 1 - lr · wd (1 where the tensor takes no decay). Shared by the flat
// update (adamw.cu) and the update that writes a weight's FP8 casts (fp8.cu), so both compute
// the same bits.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float grad, float clip, float beta1,
                                              float beta2, float eps, float decay, float step_size, float bc2_sqrt) {
    grad *= clip;
    m = beta1 * m + (1.f - beta1) * grad;
    v = beta2 * v + (1.f - beta2) * grad * grad;
    float denom = sqrtf(v) / bc2_sqrt + eps;
    p = p * decay - step_size * m / denom;
}

// RMSNorm's rstd of the row `xr` (width d) with the whole block: 1 / sqrt(mean(x²) + eps), each
// thread summing its V-wide chunks in order, then block_sum. rmsnorm.cu's forward kernel and
// fp8.cu's fused RMSNorm cast share it, so that both give the same bits.
template <int V>
__device__ __forceinline__ float rms_rstd(const bf16* xr, int d, float eps, float* scratch) {
    float ss = 0.f;
    for (int j = threadIdx.x * V; j < d; j += blockDim.x * V) {
        float f[V];
        loadv<V>(xr + j, f);
#pragma unroll
        for (int k = 0; k < V; k++) ss += f[k] * f[k];
    }
    ss = block_sum(ss, scratch);
    return 1.f / sqrtf(ss / (float)d + eps);
}

// SwiGLU's element, silu(g) · u = g · σ(g) · u: swiglu.cu's forward kernel and fp8.cu's fused
// cast of its output share it, so that both give the same bits.
__device__ __forceinline__ float swiglu_element(float g, float u) { return g * (1.f / (1.f + __expf(-g))) * u; }
