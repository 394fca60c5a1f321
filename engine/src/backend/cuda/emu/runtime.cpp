// The emulator's runtime: a pool of OS threads that run the threads of one block at a time,
// block and warp barriers (an exited thread leaves them, as on the hardware), the data exchange
// behind warp shuffles, ldmatrix and mma, queued cp.async copies, dynamic shared memory, and the
// C entry point the Rust side calls (emu_launch).
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <semaphore>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "prelude.h"

thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

static std::string g_kernel;  // for messages

[[noreturn]] void emu_fail(const char* what) {
    std::fprintf(stderr, "CUDA emulator: kernel %s: %s\n", g_kernel.c_str(), what);
    std::fflush(stderr);
    std::abort();
}

// A reusable barrier whose count shrinks when a participant exits. Arrivals are counted under a
// mutex; waiters first spin (yielding) on the generation, which on a machine with far fewer cores
// than emulated threads is much cheaper than sleeping and waking each of them, then sleep on it
// (a futex), so that a long wait or a busy machine does not burn the cores.
struct Barrier {
    std::mutex m;
    int count = 0, waiting = 0;
    std::atomic<long> generation{0};
    void reset(int n) {
        std::lock_guard<std::mutex> l(m);
        count = n, waiting = 0;
    }
    void wait([[maybe_unused]] const char* what) {
        long g;
        {
            std::lock_guard<std::mutex> l(m);
            g = generation.load();
            if (++waiting == count) {
                release_locked();
                return;
            }
        }
        // A barrier that never completes is reported by the launch watchdog.
        for (int spins = 0; spins < 64 && generation.load() == g; spins++) std::this_thread::yield();
        while (generation.load() == g) generation.wait(g);  // returns on a change (or spuriously)
    }
    void leave() {
        std::lock_guard<std::mutex> l(m);
        count--;
        if (waiting > 0 && waiting == count) release_locked();
    }
    void release_locked() {
        waiting = 0;
        generation.fetch_add(1);
        generation.notify_all();
    }
};

// Warp exchanges alternate between two sets of slots: a lane that has passed the barrier of
// exchange i may write exchange i + 1's slots while slower lanes still read exchange i's, and
// exchange i + 2 reuses i's only after every lane has reached exchange i + 1's barrier. So one
// barrier per exchange suffices.
struct Warp {
    Barrier barrier;
    std::atomic<int> lanes{0};
    uint64_t slots[2][32][16];
};

struct CpAsync {
    void* dst;
    const void* src;
    int bytes;
};

static Barrier g_block_barrier;
static Warp g_warps[32];
static std::vector<unsigned char> g_smem;
static thread_local std::vector<CpAsync> t_uncommitted;
static thread_local unsigned t_exchange;  // parity of this lane's warp exchanges
static thread_local std::deque<std::vector<CpAsync>> t_groups;

static int lane_id() { return (int)(threadIdx.x & 31); }
static Warp& my_warp() { return g_warps[threadIdx.x >> 5]; }

void __syncthreads() { g_block_barrier.wait("__syncthreads timed out (a thread never arrives: divergent barrier?)"); }

uint64_t* emu_warp_publish(int) {
    Warp& w = my_warp();
    if (w.lanes != 32) emu_fail("a warp-wide operation in a warp with exited or missing lanes");
    t_exchange ^= 1;
    return w.slots[t_exchange][lane_id()];
}
void emu_warp_sync() { my_warp().barrier.wait("a warp-wide operation timed out (divergent lanes?)"); }
const uint64_t* emu_warp_slots(int lane) { return my_warp().slots[t_exchange][lane]; }
int emu_lane() { return lane_id(); }

uint64_t emu_shfl_xor(uint64_t bits, int lane_mask) {
    emu_warp_publish(1)[0] = bits;
    emu_warp_sync();
    return emu_warp_slots(lane_id() ^ lane_mask)[0];
}

unsigned __match_any_sync(unsigned mask, unsigned value) {
    if (mask != 0xffffffffu) emu_fail("__match_any_sync with a partial mask");
    emu_warp_publish(1)[0] = value;
    emu_warp_sync();
    unsigned same = 0;
    for (int l = 0; l < 32; l++)
        if ((unsigned)emu_warp_slots(l)[0] == value) same |= 1u << l;
    return same;
}

void* emu_dynamic_smem() { return g_smem.data(); }

void emu_cp_async(smem_t dst, const void* src, int bytes) {
    if ((uintptr_t)dst % 16 != 0 || (bytes > 0 && (uintptr_t)src % 16 != 0)) emu_fail("cp.async address not 16-byte aligned");
    t_uncommitted.push_back({(void*)dst, src, bytes});
}
void emu_cp_async_commit() {
    t_groups.push_back(std::move(t_uncommitted));
    t_uncommitted.clear();
}
void emu_cp_async_wait(int pending_groups) {
    while ((int)t_groups.size() > pending_groups) {
        for (const CpAsync& c : t_groups.front()) {
            std::memset(c.dst, 0, 16);
            if (c.bytes > 0) std::memcpy(c.dst, c.src, c.bytes);
        }
        t_groups.pop_front();
    }
}

static std::map<std::string, EmuEntry>& registry() {
    static std::map<std::string, EmuEntry> r;
    return r;
}
void emu_register(const char* name, EmuEntry entry) { registry()[name] = entry; }

// The pool: worker i runs thread i of each block. Only the block's threads are woken (each
// worker sleeps on its own semaphore); the launching thread waits for them to finish.
struct Pool {
    std::vector<std::unique_ptr<std::binary_semaphore>> go;
    std::atomic<int> finished{0};
    EmuEntry entry = nullptr;
    void** args = nullptr;
    dim3 block;

    void grow(int n) {
        while ((int)go.size() < n) {
            int id = (int)go.size();
            go.push_back(std::make_unique<std::binary_semaphore>(0));
            std::thread([this, id] { run(id); }).detach();
        }
    }

    void run(int id) {
        for (;;) {
            go[id]->acquire();
            threadIdx = dim3{(unsigned)id, 0, 0};
            blockIdx = block;
            t_uncommitted.clear();
            t_groups.clear();
            t_exchange = 0;
            entry(args);
            g_warps[id >> 5].lanes--;
            g_warps[id >> 5].barrier.leave();
            g_block_barrier.leave();
            finished.fetch_add(1);
        }
    }

    void run_block(EmuEntry e, void** a, dim3 b, int threads) {
        g_block_barrier.reset(threads);
        for (int w = 0; w < (threads + 31) / 32; w++) {
            int lanes = std::min(32, threads - 32 * w);
            g_warps[w].lanes = lanes;
            g_warps[w].barrier.reset(lanes);
        }
        entry = e, args = a, block = b;
        finished = 0;
        for (int i = 0; i < threads; i++) go[i]->release();
        while (finished.load() < threads) std::this_thread::yield();
    }
};

static Pool& pool() {
    static Pool* p = new Pool();  // never destroyed: its detached workers outlive main
    return *p;
}

// Fails a launch that runs longer than any of the checks' should: a thread that never reaches
// a barrier, or a kernel that never ends.
static std::atomic<long> g_launch_started_ms{0};
static void start_watchdog() {
    static std::once_flag once;
    std::call_once(once, [] {
        std::thread([] {
            for (;;) {
                std::this_thread::sleep_for(std::chrono::seconds(1));
                long started = g_launch_started_ms.load();
                long now = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
                if (started != 0 && now - started > 300000)
                    emu_fail("still running after 5 minutes: a barrier some thread never reaches, or an endless loop");
            }
        }).detach();
    });
}

// Runs kernel `name` over the grid, one block at a time. Returns 0, or 1 for an unknown kernel
// or configuration (with a message in `err`).
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned threads, unsigned smem,
                          void** args, char* err, int err_len) {
    auto it = registry().find(name);
    if (it == registry().end()) {
        std::snprintf(err, err_len, "no kernel %s", name);
        return 1;
    }
    if (threads == 0 || threads > 1024 || threads % 32 != 0) {
        std::snprintf(err, err_len, "kernel %s: %u threads a block", name, threads);
        return 1;
    }
    g_kernel = name;
    g_smem.assign(smem + 16, 0xcd);  // uninitialised shared memory is garbage, not zeros
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{threads, 1, 1};
    Pool& p = pool();
    p.grow((int)threads);
    start_watchdog();
    g_launch_started_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::steady_clock::now().time_since_epoch())
                              .count();
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) p.run_block(it->second, args, dim3{x, y, z}, (int)threads);
    g_launch_started_ms = 0;
    return 0;
}
