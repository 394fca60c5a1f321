// Token embedding lookup.
//
// forward:  out[n, :] = table[tokens[n], :]          (one block per token)
// backward: dtable[tokens[n], :] += dout[n, :]       (f32 atomics: tokens repeat)
//
// A token id outside the vocabulary writes NaN rows (the loss then says so) instead of reading
// outside the table.

template <int V>
__device__ void embedding_forward_impl(bf16* out, const bf16* table, const u32* tokens, int d, u64 vocab) {
    u64 n = blockIdx.x, t = tokens[n];
    bf16* row = out + n * d;
    if (t >= vocab) {
        for (int j = threadIdx.x; j < d; j += blockDim.x) row[j] = f2bf(__int_as_float(0x7fc00000));
        return;
    }
    const bf16* src = table + t * d;
    for (int j = threadIdx.x * V; j < d; j += blockDim.x * V) {
        if constexpr (V == 8) {
            *(uint4*)(row + j) = *(const uint4*)(src + j);
        } else {
            row[j] = src[j];
        }
    }
}
extern "C" __global__ void embedding_forward(bf16* out, const bf16* table, const u32* tokens, int d, u64 vocab) {
    embedding_forward_impl<1>(out, table, tokens, d, vocab);
}
extern "C" __global__ void embedding_forward_v8(bf16* out, const bf16* table, const u32* tokens, int d, u64 vocab) {
    embedding_forward_impl<8>(out, table, tokens, d, vocab);
}

extern "C" __global__ void embedding_backward(float* dtable, const bf16* dout, const u32* tokens, int d, u64 vocab) {
    u64 n = blockIdx.x, t = tokens[n];
    if (t >= vocab) return;
    for (int j = threadIdx.x; j < d; j += blockDim.x) red_add(&dtable[t * d + j], bf2f(dout[n * d + j]));
}

// Vocabulary parallelism: the table holds the rows of tokens first..first + rows; another slice's
// token gets a zero row (the tensor group's sum adds its holder's) and adds no gradient.
//
// forward:  out[n, :] = table[tokens[n] - first, :], or 0
// backward: dtable[tokens[n] - first, :] += dout[n, :], where held
extern "C" __global__ void embedding_forward_slice(bf16* out, const bf16* table, const u32* tokens, int d, u64 first,
                                                   u64 rows) {
    u64 n = blockIdx.x, t = tokens[n];
    bf16* row = out + n * d;
    bool held = t >= first && t - first < rows;
    for (int j = threadIdx.x; j < d; j += blockDim.x) row[j] = held ? table[(t - first) * d + j] : f2bf(0.f);
}

extern "C" __global__ void embedding_backward_slice(float* dtable, const bf16* dout, const u32* tokens, int d, u64 first,
                                                    u64 rows) {
    u64 n = blockIdx.x, t = tokens[n];
    if (t < first || t - first >= rows) return;
    for (int j = threadIdx.x; j < d; j += blockDim.x) red_add(&dtable[(t - first) * d + j], bf2f(dout[n * d + j]));
}
