// Causal softmax attention of query rows over a KV cache (prefill, decode and verification
// windows alike), f32 throughout.
//
// One block of ATT_THREADS threads per (query row, head). Scores live in shared memory when the
// visible keys fit (ATT_SMEM_KEYS), else in a global scratch row (any context length works).
// Each warp scores ATT_KEYS_PER_WARP keys at a time (lanes split the channels, 16-byte loads
// where the shapes allow, a fixed shuffle tree per key); the softmax uses block reductions in a
// fixed order; the weighted sum of values is split over the warps by contiguous key ranges (each
// in ascending key order per channel) and the warps' partial sums are added in warp order.
// Every split depends only on the number of visible keys and the head shapes, so a (row, head)
// result depends only on its query and the keys it may see, never on the other rows of the
// call: a verification window gives the same bits as decoding its rows one at a time.

#include "common.cuh"

#define ATT_THREADS 256
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_SMEM_KEYS 4096
#define ATT_KEYS_PER_WARP 4
// Channels of the value sum per pass: 4 per lane.
#define ATT_VTILE 128

// q: [rows, heads * qk_dim]; k: [>= kv_len, kv_heads * qk_dim]; v: [>= kv_len, kv_heads * v_dim];
// out: [rows, heads * v_dim]; scratch: [rows * heads, score_stride] f32.
// Query row r sits at position start + r (start = start_at[0] when start_at is not null) and sees
// keys lo..=start + r, lo = 0 or the window's start; the caller guarantees that the visible key
// count start + r + 1 - lo is at most score_stride.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ out, float* __restrict__ scratch, int heads, int kv_heads, int qk_dim, int v_dim,
    float scale, int start, int window, int score_stride, const unsigned* __restrict__ start_at) {
    SPX_PROLOGUE();
    __shared__ float red[ATT_WARPS];
    __shared__ float smem_scores[ATT_SMEM_KEYS];
    __shared__ float part[ATT_WARPS][ATT_VTILE];
    const int r = blockIdx.x / heads, h = blockIdx.x % heads;
    const int kh = h / (heads / kv_heads);
    const int pos = (start_at ? (int)start_at[0] : start) + r;
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    const int n = pos + 1 - lo;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* qh = q + ((size_t)r * heads + h) * qk_dim;
    float* scores = n <= ATT_SMEM_KEYS ? smem_scores : scratch + (size_t)blockIdx.x * score_stride;
    const size_t k_stride = (size_t)kv_heads * qk_dim, v_stride = (size_t)kv_heads * v_dim;
    const float* kbase = k + (size_t)lo * k_stride + (size_t)kh * qk_dim;
    const float* vbase = v + (size_t)lo * v_stride + (size_t)kh * v_dim;

    // Scores: each warp takes ATT_KEYS_PER_WARP consecutive keys at a time.
    // Channels in fours when the widths allow (16-byte loads where aligned, the same arithmetic
    // otherwise), so the order depends on the shapes only.
    const bool qk_vec = (qk_dim & 3) == 0;
    const bool qk_aligned = ((reinterpret_cast<size_t>(q) | reinterpret_cast<size_t>(k)) & 15) == 0;
    for (int j0 = warp * ATT_KEYS_PER_WARP; j0 < n; j0 += ATT_THREADS / 32 * ATT_KEYS_PER_WARP) {
        float s[ATT_KEYS_PER_WARP];
#pragma unroll
        for (int u = 0; u < ATT_KEYS_PER_WARP; ++u) s[u] = 0.0f;
        if (qk_vec) {
            const int d4n = qk_dim >> 2;
            for (int d4 = lane; d4 < d4n; d4 += 32) {
                const float4 qv = load_float4(qh + 4 * d4, qk_aligned);
#pragma unroll
                for (int u = 0; u < ATT_KEYS_PER_WARP; ++u) {
                    if (j0 + u < n) {
                        const float4 kv = load_float4(kbase + (size_t)(j0 + u) * k_stride + 4 * d4, qk_aligned);
                        float t = s[u];
                        t = fmaf(qv.x, kv.x, t);
                        t = fmaf(qv.y, kv.y, t);
                        t = fmaf(qv.z, kv.z, t);
                        t = fmaf(qv.w, kv.w, t);
                        s[u] = t;
                    }
                }
            }
        } else {
            for (int d = lane; d < qk_dim; d += 32) {
                const float qd = qh[d];
#pragma unroll
                for (int u = 0; u < ATT_KEYS_PER_WARP; ++u) {
                    if (j0 + u < n) s[u] = fmaf(qd, kbase[(size_t)(j0 + u) * k_stride + d], s[u]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_KEYS_PER_WARP; ++u) {
            const float t = warp_sum(s[u]);
            if (lane == 0 && j0 + u < n) scores[j0 + u] = t * scale;
        }
    }
    __syncthreads();

    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n; j += ATT_THREADS) m = fmaxf(m, scores[j]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < ATT_WARPS; ++w) m = fmaxf(m, red[w]);
    __syncthreads();

    float total = 0.0f;
    for (int j = threadIdx.x; j < n; j += ATT_THREADS) {
        const float e = expf(scores[j] - m);
        scores[j] = e;
        total += e;
    }
    total = warp_sum(total);
    if (lane == 0) red[warp] = total;
    __syncthreads();
    total = red[0];
    for (int w = 1; w < ATT_WARPS; ++w) total += red[w];
    const float inv = 1.0f / total;

    // Values: warp w sums keys [w * per, min(n, (w + 1) * per)) in ascending order; lane l owns
    // channels d0 + 4l .. d0 + 4l + 3 of each tile of ATT_VTILE channels.
    const int per = (n + ATT_WARPS - 1) / ATT_WARPS;
    const int j_begin = min(n, warp * per), j_end = min(n, j_begin + per);
    const bool v_vec = (v_dim & 3) == 0;
    const bool v_aligned = (reinterpret_cast<size_t>(v) & 15) == 0;
    float* o = out + ((size_t)r * heads + h) * v_dim;
    for (int d0 = 0; d0 < v_dim; d0 += ATT_VTILE) {
        const int d = d0 + 4 * lane;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (d < v_dim) {
            if (v_vec) {
                const float* vd = vbase + d;
#pragma unroll 4
                for (int j = j_begin; j < j_end; ++j) {
                    const float p = scores[j] * inv;
                    const float4 x = load_float4(vd + (size_t)j * v_stride, v_aligned);
                    acc.x = fmaf(p, x.x, acc.x);
                    acc.y = fmaf(p, x.y, acc.y);
                    acc.z = fmaf(p, x.z, acc.z);
                    acc.w = fmaf(p, x.w, acc.w);
                }
            } else {
                const float* vd = vbase + d;
                for (int j = j_begin; j < j_end; ++j) {
                    const float p = scores[j] * inv;
                    const float* x = vd + (size_t)j * v_stride;
                    acc.x = fmaf(p, x[0], acc.x);
                    if (d + 1 < v_dim) acc.y = fmaf(p, x[1], acc.y);
                    if (d + 2 < v_dim) acc.z = fmaf(p, x[2], acc.z);
                    if (d + 3 < v_dim) acc.w = fmaf(p, x[3], acc.w);
                }
            }
        }
        part[warp][4 * lane] = acc.x;
        part[warp][4 * lane + 1] = acc.y;
        part[warp][4 * lane + 2] = acc.z;
        part[warp][4 * lane + 3] = acc.w;
        __syncthreads();
        if (threadIdx.x < ATT_VTILE && d0 + (int)threadIdx.x < v_dim) {
            float sum = part[0][threadIdx.x];
            for (int w = 1; w < ATT_WARPS; ++w) sum += part[w][threadIdx.x];
            o[d0 + threadIdx.x] = sum;
        }
        __syncthreads();
    }
}
