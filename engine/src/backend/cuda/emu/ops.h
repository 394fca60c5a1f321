// The inline-PTX helpers of common.cuh, emulated after the PTX ISA's definitions (included after
// common.cuh, whose bf16 and u32 types they use).
#pragma once

// Warp-wide data exchange: every lane publishes up to 16 words, waits for the warp, then reads
// any lane's (the slots stay valid until this lane's next exchange).
uint64_t* emu_warp_publish(int words);  // this lane's slots; the caller fills them, then:
void emu_warp_sync();                   // barrier of the warp
const uint64_t* emu_warp_slots(int lane);
int emu_lane();

// cvt.rn.bf16.f32: round to nearest even; NaN stays a (quiet) NaN.
inline unsigned short emu_bf16_bits(float f) {
    unsigned u = std::bit_cast<unsigned>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
inline bf16 f2bf(float f) { return bf16{emu_bf16_bits(f)}; }
inline u32 pack_bf16(float lo, float hi) { return emu_bf16_bits(lo) | ((u32)emu_bf16_bits(hi) << 16); }

inline smem_t smem_addr(const void* p) { return p; }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (fragment layouts in common.cuh).
inline void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    uint64_t* mine = emu_warp_publish(6);
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b0, mine[5] = b1;
    emu_warp_sync();
    auto half = [](uint64_t word, int hi) { return __uint_as_float(hi ? (u32)word & 0xffff0000u : (u32)word << 16); };
    auto A = [&](int r, int k) {  // row r < 16, column k < 16
        int lane = (r % 8) * 4 + (k % 8) / 2, reg = r / 8 + 2 * (k / 8);
        return half(emu_warp_slots(lane)[reg], k % 2);
    };
    auto B = [&](int k, int n) {  // k < 16, n < 8
        int lane = n * 4 + (k % 8) / 2, reg = 4 + k / 8;
        return half(emu_warp_slots(lane)[reg], k % 2);
    };
    int lane = emu_lane(), group = lane >> 2, tig = lane & 3;
    for (int e = 0; e < 4; e++) {
        int r = group + (e >> 1) * 8, n = tig * 2 + (e & 1);
        float acc = c[e];
        for (int k = 0; k < 16; k++) acc += A(r, k) * B(k, n);
        c[e] = acc;
    }
}

// An FP8 byte's value: E4M3 (bias 7, no infinities, NaN 0x7f/0xff) or E5M2 (bias 15).
inline float emu_fp8(unsigned byte, bool e5m2) {
    int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7, ebits = e5m2 ? 5 : 4;
    int e = (byte >> mbits) & ((1 << ebits) - 1), m = byte & ((1 << mbits) - 1);
    float sign = byte & 0x80 ? -1.f : 1.f;
    if (e5m2 && e == 31) return m ? NAN : sign * INFINITY;
    if (!e5m2 && e == 15 && m == 7) return NAN;
    if (e == 0) return sign * std::ldexp((float)m, 1 - bias - mbits);
    return sign * std::ldexp(1.f + (float)m / (1 << mbits), e - bias);
}

// mma.sync.aligned.m16n8k32.row.col.f32.{e4m3,e5m2}.e4m3.f32 (fragment layouts in common.cuh:
// m16n8k16's, a byte a value).
template <int A_E5M2>
inline void mma_fp8(float* c, const u32* a, u32 b0, u32 b1) {
    uint64_t* mine = emu_warp_publish(6);
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b0, mine[5] = b1;
    emu_warp_sync();
    auto byte = [](uint64_t word, int k) { return (unsigned)(word >> (8 * (k % 4))) & 0xffu; };
    auto A = [&](int r, int k) {  // row r < 16, column k < 32
        int lane = (r % 8) * 4 + (k % 16) / 4, reg = r / 8 + 2 * (k / 16);
        return emu_fp8(byte(emu_warp_slots(lane)[reg], k), A_E5M2);
    };
    auto B = [&](int k, int n) {  // k < 32, n < 8
        int lane = n * 4 + (k % 16) / 4, reg = 4 + k / 16;
        return emu_fp8(byte(emu_warp_slots(lane)[reg], k), false);
    };
    int lane = emu_lane(), group = lane >> 2, tig = lane & 3;
    for (int e = 0; e < 4; e++) {
        int r = group + (e >> 1) * 8, n = tig * 2 + (e & 1);
        float acc = c[e];
        for (int k = 0; k < 32; k++) acc += A(r, k) * B(k, n);
        c[e] = acc;
    }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
inline void emu_ldmatrix(u32* r, smem_t addr, bool trans) {
    if ((uintptr_t)addr % 16 != 0) emu_fail("ldmatrix row address not 16-byte aligned");
    emu_warp_publish(1)[0] = (uint64_t)(uintptr_t)addr;
    emu_warp_sync();
    int lane = emu_lane();
    auto row = [](int l) { return (const unsigned short*)(uintptr_t)emu_warp_slots(l)[0]; };
    for (int q = 0; q < 4; q++) {
        if (!trans) {
            const unsigned short* p = row(q * 8 + lane / 4);
            r[q] = p[2 * (lane % 4)] | ((u32)p[2 * (lane % 4) + 1] << 16);
        } else {
            const unsigned short *p0 = row(q * 8 + 2 * (lane % 4)), *p1 = row(q * 8 + 2 * (lane % 4) + 1);
            r[q] = p0[lane / 4] | ((u32)p1[lane / 4] << 16);
        }
    }
}
inline void ldmatrix_x4(u32* r, smem_t addr) { emu_ldmatrix(r, addr, false); }
inline void ldmatrix_x4_trans(u32* r, smem_t addr) { emu_ldmatrix(r, addr, true); }

// cp.async: copies are queued and happen when a wait_group covers their group, so that reading
// shared memory before waiting shows up as wrong results, as it may on the hardware.
void emu_cp_async(smem_t dst, const void* src, int bytes);
void emu_cp_async_commit();
void emu_cp_async_wait(int pending_groups);
inline void cp_async16(smem_t dst, const void* src, int bytes) { emu_cp_async(dst, src, bytes); }
inline void cp_async_commit() { emu_cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
    emu_cp_async_wait(N);
}

inline void red_add(float* p, float v) { std::atomic_ref<float>(*p).fetch_add(v); }
inline void red_add2(float* p, float a, float b) {
    if ((uintptr_t)p % 8 != 0) emu_fail("red.v2 address not 8-byte aligned");
    red_add(p, a);
    red_add(p + 1, b);
}

// Registration of the kernels for emu_launch.
void emu_register(const char* name, EmuEntry entry);
template <typename... Ts, std::size_t... I>
void emu_call(void (*f)(Ts...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<Ts>*>(args[I])...);
}
template <typename... Ts>
void emu_invoke(void (*f)(Ts...), void** args) {
    emu_call(f, args, std::index_sequence_for<Ts...>{});
}
struct EmuRegistrar {
    EmuRegistrar(const char* name, EmuEntry entry) { emu_register(name, entry); }
};
#define EMU_KERNEL(name) static EmuRegistrar emu_reg_##name(#name, [](void** a) { emu_invoke(&name, a); });
