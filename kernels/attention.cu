// Causal softmax attention of query rows over a KV cache (prefill, decode and verification
// windows alike), f32 throughout.
//
// One block per (query row, head). Scores go to a global scratch row (any context length fits),
// the softmax uses block reductions in a fixed order, and the weighted sum of values runs over
// keys in ascending order per output channel. A (row, head) result depends only on its query and
// the keys it may see, never on the other rows of the call: a verification window gives the same
// bits as decoding its rows one at a time.

#define ATT_THREADS 128

__device__ __forceinline__ float att_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float att_warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// q: [rows, heads * qk_dim]; k: [>= kv_len, kv_heads * qk_dim]; v: [>= kv_len, kv_heads * v_dim];
// out: [rows, heads * v_dim]; scratch: [rows * heads, score_stride] f32.
// Query row r sits at position start + r and sees keys lo..=start + r, lo = 0 or the window's start.
// With `start_at` non-null the start is read from start_at[0] (a recorded pass replayed at a new
// position); score_stride then bounds every row's key count, not equals it.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ scratch, int heads, int kv_heads, int qk_dim, int v_dim,
    float scale, int start, int window, int score_stride, const unsigned* __restrict__ start_at) {
    __shared__ float red[ATT_THREADS / 32];
    const int r = blockIdx.x / heads, h = blockIdx.x % heads;
    const int kh = h / (heads / kv_heads);
    const int pos = (start_at ? (int)start_at[0] : start) + r;
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int n = pos + 1 - lo;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* qh = q + ((size_t)r * heads + h) * qk_dim;
    float* scores = scratch + (size_t)blockIdx.x * score_stride;
    const size_t k_stride = (size_t)kv_heads * qk_dim, v_stride = (size_t)kv_heads * v_dim;

    // Scores: one warp per key, lanes split the channels, a fixed shuffle tree combines them.
    for (int j = warp; j < n; j += ATT_THREADS / 32) {
        const float* kj = k + (size_t)(lo + j) * k_stride + (size_t)kh * qk_dim;
        float s = 0.0f;
        for (int d = lane; d < qk_dim; d += 32) s = fmaf(qh[d], kj[d], s);
        s = att_warp_sum(s);
        if (lane == 0) scores[j] = s * scale;
    }
    __syncthreads();

    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n; j += ATT_THREADS) m = fmaxf(m, scores[j]);
    m = att_warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < ATT_THREADS / 32; ++w) m = fmaxf(m, red[w]);
    __syncthreads();

    float total = 0.0f;
    for (int j = threadIdx.x; j < n; j += ATT_THREADS) {
        const float e = expf(scores[j] - m);
        scores[j] = e;
        total += e;
    }
    total = att_warp_sum(total);
    if (lane == 0) red[warp] = total;
    __syncthreads();
    total = red[0];
    for (int w = 1; w < ATT_THREADS / 32; ++w) total += red[w];
    const float inv = 1.0f / total;

    float* o = out + ((size_t)r * heads + h) * v_dim;
    for (int d = threadIdx.x; d < v_dim; d += ATT_THREADS) {
        const float* vd = v + (size_t)lo * v_stride + (size_t)kh * v_dim + d;
        float acc = 0.0f;
        for (int j = 0; j < n; ++j) acc = fmaf(scores[j] * inv, vd[(size_t)j * v_stride], acc);
        o[d] = acc;
    }
}
