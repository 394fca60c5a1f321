// Mixtral mixture-of-experts routing, dispatch and combine, without host round trips: the
// dispatch tables are built on the device and the experts' products (gemm.cu) read the
// per-expert row counts from them.
//
// route:    p = softmax(router_logits); top-k experts (ties to the lower index);
//           w_j = p_{e_j} / Σ_m p_{e_m}, or w_j = p_{e_j} without renormalisation; or
//           DeepSeek-V3's sigmoid scores with a selection bias, a group limit and a scale
//           (see moe_route)                                                   (one warp per token)
// dispatch: a stable counting sort of the N·k slots by expert, each expert keeping its first
//           `capacity` slots in slot order (token order, as MaxText); rows of expert e are
//           offsets[e] .. offsets[e + 1]; a dropped slot's row is DROPPED, as is the slot of
//           every row past offsets[e]                                                (one block)
// stats:    [tokens routed to e | Σ_t p_te | dropped slots], the inputs of the load-balancing
//           loss and the dropped share
// combine:  y_t = Σ_j w_tj · ye[slot_row[t·k + j]] over the kept slots
// backward: dw_j = dy_t · ye_j (0 if dropped);  dye = w · dy;  router gradient through the
//           scale, the renormalisation (if any) and the softmax or sigmoid, plus
//           aux_scale · counts[e] on every probability of expert e.
// balance:  DeepSeek-V3's auxiliary-loss-free balancing in two parts, so that a sharded
//           optimizer can take the step on its part of the bias:
//           load excess  excess[e] += counts[e] - mean(counts)                    (one block)
//           bias step    bias[i] -= rate · sign(excess[i]), sign(0) = 0; excess[i] = 0
//                                                                              (elementwise)
//
// Experts per layer are at most MAX_EXPERTS (8 per lane of a warp).

#define DROPPED 0xffffffffu
#define MAX_PER_LANE 8

__device__ __forceinline__ float moe_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

#define NO_EXPERT 0x7fffffff

// The warp's arg-max of v over the slots whose bit is set in `open` (slot q of a lane holds entry
// lane + 32·q): the largest value, the lower index on ties (q ascending within a lane, then the
// butterfly); NO_EXPERT if no slot is open. Every lane gets the result.
__device__ __forceinline__ int warp_argmax(const float* v, u32 open, int lane, float* value) {
    float best = NEG_INF;
    int best_x = NO_EXPERT;
#pragma unroll
    for (int q = 0; q < MAX_PER_LANE; q++)
        if (((open >> q) & 1u) && (best_x == NO_EXPERT || v[q] > best)) best = v[q], best_x = lane + 32 * q;
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int ox = __shfl_xor_sync(0xffffffffu, best_x, o);
        if (ox != NO_EXPERT && (best_x == NO_EXPERT || ob > best || (ob == best && ox < best_x))) best = ob, best_x = ox;
    }
    *value = best;
    return best_x;
}

// Routing of one token per warp (DeepSeek-V3's DeepseekV3TopkRouter; softmax top-k its special
// case), all in f32:
//   s   = softmax(z) | sigmoid(z)                                      (saved as probs)
//   sel = s + bias                                                     (bias may be null: 0)
//   groups > 1: group g (experts g·E/G ..) scores top1 + top2 of its sel (a butterfly of top-2
//               pairs); the top_groups best groups are kept, ties to the lower index
//   e_j = top-k of sel over the kept experts, ties to the lower index
//   w_j = s[e_j] / (Σ_m s[e_m] (+ 1e-20 if sigmoid)) · scale, or s[e_j] · scale
extern "C" __global__ void moe_route(float* probs, float* weight, u32* expert, const float* logits, const float* bias,
                                     u64 n, int e, int k, int sigmoid, int renormalize, int groups, int top_groups,
                                     float scale) {
    u64 token = global_thread() / 32;
    int lane = threadIdx.x & 31;
    if (token >= n) return;  // whole warps
    float z[MAX_PER_LANE], sel[MAX_PER_LANE];
    u32 open = 0;
#pragma unroll
    for (int q = 0; q < MAX_PER_LANE; q++)
        if (lane + 32 * q < e) open |= 1u << q;
    if (sigmoid) {
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++) {
            int x = lane + 32 * q;
            z[q] = x < e ? moe_sigmoid(logits[token * e + x]) : 0.f;
        }
    } else {
        float mx = NEG_INF;
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++) {
            int x = lane + 32 * q;
            z[q] = x < e ? logits[token * e + x] : NEG_INF;
            mx = fmaxf(mx, z[q]);
        }
        mx = warp_max(mx);
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++) {
            int x = lane + 32 * q;
            z[q] = x < e ? __expf(z[q] - mx) : 0.f;
            s += z[q];
        }
        s = warp_sum(s);
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++) z[q] /= s;
    }
#pragma unroll
    for (int q = 0; q < MAX_PER_LANE; q++) {
        int x = lane + 32 * q;
        if (x < e) probs[token * e + x] = z[q];
        sel[q] = x < e ? z[q] + (bias ? bias[x] : 0.f) : NEG_INF;
    }
    if (groups > 1) {
        int size = e / groups;
        float group_score[MAX_PER_LANE];  // group g's in lane g % 32, slot g / 32
        for (int g = 0; g < groups; g++) {
            float a = NEG_INF, b = NEG_INF;  // this lane's top two of group g, a >= b
#pragma unroll
            for (int q = 0; q < MAX_PER_LANE; q++) {
                int x = lane + 32 * q;
                if (x < e && x / size == g) {
                    if (sel[q] > a) b = a, a = sel[q];
                    else if (sel[q] > b) b = sel[q];
                }
            }
            for (int o = 16; o > 0; o >>= 1) {  // the top two of both pairs
                float oa = __shfl_xor_sync(0xffffffffu, a, o), ob = __shfl_xor_sync(0xffffffffu, b, o);
                if (a >= oa) b = fmaxf(b, oa);
                else b = fmaxf(a, ob), a = oa;
            }
#pragma unroll
            for (int q = 0; q < MAX_PER_LANE; q++)
                if (lane + 32 * q == g) group_score[q] = a + b;
        }
        u32 group_open = 0, allowed = 0;
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++)
            if (lane + 32 * q < groups) group_open |= 1u << q;
        for (int j = 0; j < top_groups; j++) {
            float unused;
            int g = warp_argmax(group_score, group_open, lane, &unused);
            if ((g & 31) == lane) group_open &= ~(1u << (g >> 5));
#pragma unroll
            for (int q = 0; q < MAX_PER_LANE; q++) {
                int x = lane + 32 * q;
                if (x < e && x / size == g) allowed |= 1u << q;
            }
        }
        open = allowed;
    }
    // Top-k by repeated arg-max over the open experts; a chosen one is closed.
    float total = 0.f;
    for (int j = 0; j < k; j++) {
        float unused;
        int x = warp_argmax(sel, open, lane, &unused);
        float mine = NEG_INF;
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++)
            if (lane + 32 * q == x) mine = z[q], open &= ~(1u << q);
        float w = warp_max(mine);  // the unbiased score, from the lane that holds it
        if (lane == 0) {
            expert[token * k + j] = x;
            weight[token * k + j] = w;
        }
        total += w;
    }
    if (renormalize && sigmoid) total += 1e-20f;
    if (lane == 0)
        for (int j = 0; j < k; j++) {
            float w = weight[token * k + j];
            weight[token * k + j] = (renormalize ? w / total : w) * scale;
        }
}

// One block of 1024 threads. Dynamic shared memory: (2 + 32) · e u32. Writes the routed counts
// and the dropped slots into stats (moe_stats adds the probability sums).
extern "C" __global__ void moe_dispatch(u32* slot_row, u32* row_slot, u32* offsets, float* stats, const u32* expert,
                                        u64 slots, int e, int capacity) {
    DYNAMIC_SMEM(u32, sh);
    u32 *counts = sh, *cursor = sh + e, *warp_counts = sh + 2 * e;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int x = tid; x < e; x += blockDim.x) counts[x] = 0;
    __syncthreads();
    for (u64 s = tid; s < slots; s += blockDim.x) atomicAdd(&counts[expert[s]], 1u);
    __syncthreads();
    if (tid == 0) {
        u32 acc = 0, dropped = 0;
        for (int x = 0; x < e; x++) {
            u32 kept = min(counts[x], (u32)capacity);
            offsets[x] = acc;
            cursor[x] = 0;  // slots of expert x seen so far
            acc += kept;
            dropped += counts[x] - kept;
            stats[x] = (float)counts[x];
        }
        offsets[e] = acc;
        stats[2 * e] = (float)dropped;
    }
    __syncthreads();
    for (u64 r = offsets[e] + tid; r < slots; r += blockDim.x) row_slot[r] = DROPPED;
    for (u64 base = 0; base < slots; base += blockDim.x) {
        u64 s = base + tid;
        bool valid = s < slots;
        u32 x = valid ? expert[s] : 0xffffffffu;
        u32 same = __match_any_sync(0xffffffffu, x);
        u32 rank = __popc(same & ((1u << lane) - 1));
        for (int i = tid; i < 32 * e; i += blockDim.x) warp_counts[i] = 0;
        __syncthreads();
        if (valid && rank == 0) warp_counts[warp * e + x] = __popc(same);
        __syncthreads();
        if (tid < e) {  // exclusive prefix over the warps, from the expert's cursor
            u32 acc = cursor[tid];
            for (int w = 0; w < 32; w++) {
                u32 c = warp_counts[w * e + tid];
                warp_counts[w * e + tid] = acc;
                acc += c;
            }
            cursor[tid] = acc;
        }
        __syncthreads();
        if (valid) {
            u32 nth = warp_counts[warp * e + x] + rank;  // the slot's place among expert x's
            if (nth < (u32)capacity) {
                u32 row = offsets[x] + nth;
                slot_row[s] = row;
                row_slot[row] = (u32)s;
            } else {
                slot_row[s] = DROPPED;
            }
        }
        __syncthreads();
    }
}

// One block per expert: Σ_t p_te (the counts and drops are moe_dispatch's).
extern "C" __global__ void moe_stats(float* stats, const float* probs, u64 n, int e) {
    __shared__ double scratch[32];
    int x = blockIdx.x;
    double acc = 0.0;
    for (u64 t = threadIdx.x; t < n; t += blockDim.x) acc += probs[t * e + x];
    acc = block_sum_f64(acc, scratch);
    if (threadIdx.x == 0) stats[e + x] = (float)acc;
}

// xe[r] = x[row_slot[r] / k], zero for a row no slot fills   (one block per dispatched row)
extern "C" __global__ void moe_gather(bf16* xe, const bf16* x, const u32* row_slot, int k, int d) {
    u64 r = blockIdx.x;
    u32 s = row_slot[r];
    if (s == DROPPED) {
        for (int j = threadIdx.x; j < d; j += blockDim.x) xe[r * d + j] = f2bf(0.f);
        return;
    }
    u64 t = s / k;
    for (int j = threadIdx.x; j < d; j += blockDim.x) xe[r * d + j] = x[t * d + j];
}

// dx[t] = Σ_j dxe[slot_row[t·k + j]] over the kept slots   (one block per token)
extern "C" __global__ void moe_gather_backward(bf16* dx, const bf16* dxe, const u32* slot_row, int k, int d) {
    u64 t = blockIdx.x;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < k; s++) {
            u32 r = slot_row[t * k + s];
            if (r != DROPPED) acc += bf2f(dxe[(u64)r * d + j]);
        }
        dx[t * d + j] = f2bf(acc);
    }
}

// out[t] = Σ_j weight[t·k + j] · ye[slot_row[t·k + j]] over the kept slots   (one block per token)
extern "C" __global__ void moe_combine(bf16* out, const bf16* ye, const float* weight, const u32* slot_row, int k,
                                       int d) {
    u64 t = blockIdx.x;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < k; s++) {
            u32 r = slot_row[t * k + s];
            if (r != DROPPED) acc += weight[t * k + s] * bf2f(ye[(u64)r * d + j]);
        }
        out[t * d + j] = f2bf(acc);
    }
}

// dye[r] = weight[s] · dout[s / k] for the slot s of row r, zero for a row no slot fills
// (one block per dispatched row)
extern "C" __global__ void moe_combine_backward_rows(bf16* dye, const bf16* dout, const float* weight,
                                                     const u32* row_slot, int k, int d) {
    u64 r = blockIdx.x;
    u32 s = row_slot[r];
    if (s == DROPPED) {
        for (int j = threadIdx.x; j < d; j += blockDim.x) dye[r * d + j] = f2bf(0.f);
        return;
    }
    u64 t = s / k;
    float w = weight[s];
    for (int j = threadIdx.x; j < d; j += blockDim.x) dye[r * d + j] = f2bf(w * bf2f(dout[t * d + j]));
}

// dweight[s] = dout[s / k] · ye[slot_row[s]], zero for a dropped slot   (one warp per slot)
extern "C" __global__ void moe_combine_backward_weights(float* dweight, const bf16* dout, const bf16* ye,
                                                        const u32* slot_row, u64 slots, int k, int d) {
    u64 s = global_thread() / 32;
    int lane = threadIdx.x & 31;
    if (s >= slots) return;
    u64 t = s / k;
    u32 r = slot_row[s];
    if (r == DROPPED) {
        if (lane == 0) dweight[s] = 0.f;
        return;
    }
    float acc = 0.f;
    for (int j = lane; j < d; j += 32) acc += bf2f(dout[t * d + j]) * bf2f(ye[(u64)r * d + j]);
    acc = warp_sum(acc);
    if (lane == 0) dweight[s] = acc;
}

// Router logits' gradient (one warp per token), forward beside backward (g = dL/ds):
//   s = softmax(z)                          dz = s ⊙ (g - Σ_x g_x s_x)
//   s = sigmoid(z)                          dz = g ⊙ s ⊙ (1 - s)
//   D = Σ_i s_{e_i} (+ 1e-20 if sigmoid)    g_e = aux_scale · counts[e]  (load balancing)
//   w_j = scale · s_{e_j} / D               g_{e_j} += (scale · dw_j - Σ_i dw_i w_i) / D
//   w_j = scale · s_{e_j}                   g_{e_j} += scale · dw_j
// The selection (bias, groups) gets no gradient.
extern "C" __global__ void moe_route_backward(bf16* drouter, const float* dweight, const float* probs,
                                              const float* weight, const float* counts, const u32* expert, u64 n,
                                              int e, int k, float aux_scale, int sigmoid, int renormalize,
                                              float scale) {
    u64 token = global_thread() / 32;
    int lane = threadIdx.x & 31;
    if (token >= n) return;
    float g[MAX_PER_LANE], p[MAX_PER_LANE];
#pragma unroll
    for (int q = 0; q < MAX_PER_LANE; q++) {
        int x = lane + 32 * q;
        p[q] = x < e ? probs[token * e + x] : 0.f;
        g[q] = x < e ? aux_scale * counts[x] : 0.f;
    }
    float chosen_sum = 0.f, c = 0.f;
    for (int j = 0; j < k; j++) {
        chosen_sum += probs[token * e + expert[token * k + j]];
        c += dweight[token * k + j] * weight[token * k + j];
    }
    if (sigmoid) chosen_sum += 1e-20f;
    for (int j = 0; j < k; j++) {
        u32 x = expert[token * k + j];
        float dw = scale * dweight[token * k + j];
        float add = renormalize ? (dw - c) / chosen_sum : dw;
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++)
            if (lane + 32 * q == (int)x) g[q] += add;
    }
    if (sigmoid) {
#pragma unroll
        for (int q = 0; q < MAX_PER_LANE; q++) {
            int x = lane + 32 * q;
            if (x < e) drouter[token * e + x] = f2bf(g[q] * (p[q] * (1.f - p[q])));
        }
        return;
    }
    float dot = 0.f;
#pragma unroll
    for (int q = 0; q < MAX_PER_LANE; q++) dot += g[q] * p[q];
    dot = warp_sum(dot);
#pragma unroll
    for (int q = 0; q < MAX_PER_LANE; q++) {
        int x = lane + 32 * q;
        if (x < e) drouter[token * e + x] = f2bf(p[q] * (g[q] - dot));
    }
}

// A layer's load excess (one block): dst[x] += counts[x] - mean, the mean of the e counts summed in
// f64, in order, by one thread, and the difference rounded once to f32 (as the CPU does).
extern "C" __global__ void moe_load_excess(float* dst, const float* counts, int e) {
    __shared__ double mean[1];
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int x = 0; x < e; x++) s += (double)counts[x];
        mean[0] = s / e;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < e; x += blockDim.x) dst[x] += (float)((double)counts[x] - mean[0]);
}

// The balancing step, elementwise: bias[i] -= rate · sign(excess[i]) (sign(0) = 0), then
// excess[i] = 0. bias16, when not null, is the bias's bf16 compute copy (a parameter's), refreshed.
extern "C" __global__ void moe_bias_step(float* bias, bf16* bias16, float* excess, u64 n, float rate) {
    for (u64 i = global_thread(); i < n; i += global_stride()) {
        float x = excess[i];
        float sign = x > 0.f ? 1.f : (x < 0.f ? -1.f : 0.f);
        float b = bias[i] - rate * sign;
        bias[i] = b;
        if (bias16) bias16[i] = f2bf(b);
        excess[i] = 0.f;
    }
}

// Expert biases (GPT-OSS's experts), over the rows the grouped products use: expert e's rows are
// offsets[e] .. offsets[e + 1] (from offsets[0], which on an expert axis is a sender's first
// received row), expert e's bias lies at bias + e · stride.
//   forward:  out[r] += b_e                          (a block per row, e by a binary search)
//   backward: db_e += Σ_{r of e} dout[r]             (a block per 64 columns of an expert: warp w
//             sums rows offsets[e] + w, + 8, … in f32, the 8 warps' sums added in order; no atomics)

// The expert whose rows hold row r, offsets[0] <= r < offsets[experts]: the last e with
// offsets[e] <= r (an expert without rows is passed over, its successor starting where it does).
__device__ __forceinline__ int expert_of_row(const u32* offsets, int experts, u64 r) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if ((u64)offsets[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

extern "C" __global__ void moe_expert_bias(bf16* out, const bf16* bias, u64 stride, const u32* offsets, int experts,
                                           int width, int vec) {
    u64 r = (u64)offsets[0] + blockIdx.x;
    if (r >= offsets[experts]) return;
    const bf16* b = bias + (u64)expert_of_row(offsets, experts, r) * stride;
    bf16* o = out + r * width;
    if (vec) {
        for (int j = threadIdx.x * 8; j < width; j += blockDim.x * 8) {
            float x[8], y[8];
            loadv<8>(o + j, x);
            loadv<8>(b + j, y);
#pragma unroll
            for (int k = 0; k < 8; k++) x[k] += y[k];
            storev<8>(o + j, x);
        }
    } else {
        for (int j = threadIdx.x; j < width; j += blockDim.x) o[j] = f2bf(bf2f(o[j]) + bf2f(b[j]));
    }
}

#define BIAS_COLS 64
#define BIAS_WARPS 8

// 256 threads; grid (ceil(width / 64), experts).
extern "C" __global__ void moe_expert_bias_backward(float* dbias, const bf16* dout, u64 stride, const u32* offsets,
                                                    int width) {
    __shared__ float part[BIAS_WARPS][BIAS_COLS];
    int e = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 first = offsets[e], end = offsets[e + 1];
    if (first == end) return;  // no rows: db_e += 0 (the whole block leaves)
    int c0 = blockIdx.x * BIAS_COLS;
    float acc[2] = {0.f, 0.f};
    for (u64 r = first + warp; r < end; r += BIAS_WARPS) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int c = c0 + lane + 32 * h;
            if (c < width) acc[h] += bf2f(dout[r * width + c]);
        }
    }
    part[warp][lane] = acc[0];
    part[warp][lane + 32] = acc[1];
    __syncthreads();
    int c = c0 + threadIdx.x;
    if (threadIdx.x < BIAS_COLS && c < width) {
        float s = 0.f;
        for (int w = 0; w < BIAS_WARPS; w++) s += part[w][threadIdx.x];
        dbias[(u64)e * stride + c] += s;
    }
}

// The expert axis's fixed-size parts (one block per row of a part, blockIdx.y the part): part j of
// `packed` holds the rows offsets[j·local] .. offsets[(j+1)·local] of `grouped`, then zeros.
// pack (unpack = 0) writes the part, zeros included; unpack (1) writes the rows back, nothing else.
extern "C" __global__ void moe_parts(bf16* grouped, bf16* packed, const u32* offsets, int local, u64 rows, int d,
                                     int unpack) {
    u64 j = blockIdx.y, i = blockIdx.x;
    u32 from = offsets[j * local], count = offsets[(j + 1) * local] - from;
    bf16* part = packed + (j * rows + i) * d;
    if (i < count) {
        bf16* row = grouped + ((u64)from + i) * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            if (unpack) row[c] = part[c];
            else part[c] = row[c];
        }
    } else if (!unpack) {
        for (int c = threadIdx.x; c < d; c += blockDim.x) part[c] = f2bf(0.f);
    }
}

// counts[e] = offsets[e + 1] - offsets[e], as numbers (grid-stride)
extern "C" __global__ void moe_counts(float* counts, const u32* offsets, int e) {
    for (int x = blockIdx.x * blockDim.x + threadIdx.x; x < e; x += gridDim.x * blockDim.x)
        counts[x] = (float)(offsets[x + 1] - offsets[x]);
}

// The runs of the received parts (a thread per sender): runs[s·(L+1) + l] = s·rows + Σ_{i<l} counts[s·L + i].
extern "C" __global__ void moe_runs(u32* runs, const float* counts, int senders, int local, u64 rows) {
    for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < senders; s += gridDim.x * blockDim.x) {
        u64 at = (u64)s * rows;
        runs[s * (local + 1)] = (u32)at;
        for (int l = 0; l < local; l++) {
            at += (u64)counts[s * local + l];
            runs[s * (local + 1) + l + 1] = (u32)at;
        }
    }
}
