// CPU emulation of the CUDA built-ins the kernels use, so that the kernel sources compile with a
// host C++20 compiler and run on the CPU (tests only; see emulator.rs). Every CUDA thread of a
// block is an OS thread; barriers, warp shuffles, ldmatrix and mma.sync exchange data between
// them as the hardware would (runtime.cpp, ops.h). Blocks run one after another.
#pragma once
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#define ENGINE_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
extern thread_local dim3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
template <class T>
inline float __int_as_float(T i) {
    return std::bit_cast<float>((uint32_t)i);
}
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline int __float_as_int(float f) { return std::bit_cast<int>(f); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline int __popc(unsigned v) { return std::popcount(v); }
using std::max;
using std::min;

// A shared-memory address (a plain pointer here; a 32-bit shared-window address in PTX).
typedef const void* smem_t;
// A kernel's launcher: the arguments arrive as an array of pointers to 8-byte slots, as
// cuLaunchKernel's do.
using EmuEntry = void (*)(void**);

void __syncthreads();
uint64_t emu_shfl_xor(uint64_t bits, int lane_mask);
unsigned __match_any_sync(unsigned mask, unsigned value);
void* emu_dynamic_smem();
[[noreturn]] void emu_fail(const char* what);

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    if (mask != 0xffffffffu) emu_fail("a warp shuffle with a partial mask");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = emu_shfl_xor(bits, lane_mask);
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
template <class T, class Better>
T emu_atomic_keep(T* p, T v, Better better) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (better(v, old) && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
inline int atomicMax(int* p, int v) { return emu_atomic_keep(p, v, [](int x, int y) { return x > y; }); }
inline unsigned atomicMax(unsigned* p, unsigned v) {
    return emu_atomic_keep(p, v, [](unsigned x, unsigned y) { return x > y; });
}
inline unsigned atomicMin(unsigned* p, unsigned v) {
    return emu_atomic_keep(p, v, [](unsigned x, unsigned y) { return x < y; });
}
