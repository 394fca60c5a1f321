// Rotary position embedding in the "rotate half" layout (dimension i pairs with i + Dh/2), in
// place on the q and k heads of packed qkv rows. `table` is [seq, Dh/2] pairs (cos, sin) of
// t · inv_freq_i, computed on the host with Llama 3 frequency scaling when the model has it.
//
// forward:  (a, b) -> (a cos θ - b sin θ,  b cos θ + a sin θ)
// backward: the same with -θ (sign = -1): a rotation's transpose is its inverse.

extern "C" __global__ void rope(bf16* qkv, const float* table, u64 rows, int seq, int heads, int head_dim, int width,
                                float sign) {
    int half = head_dim / 2;
    u64 per_row = (u64)heads * half;
    for (u64 idx = global_thread(); idx < rows * per_row; idx += global_stride()) {
        u64 row = idx / per_row;
        int rem = (int)(idx - row * per_row);
        int head = rem / half, i = rem - head * half;
        int t = (int)(row % seq);
        float c = table[((u64)t * half + i) * 2], s = sign * table[((u64)t * half + i) * 2 + 1];
        bf16* p = qkv + row * width + (u64)head * head_dim + i;
        float a = bf2f(p[0]), b = bf2f(p[half]);
        p[0] = f2bf(a * c - b * s);
        p[half] = f2bf(b * c + a * s);
    }
}
