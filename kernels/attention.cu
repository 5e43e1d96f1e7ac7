// Causal softmax attention of query rows over a KV cache (prefill, decode and verification
// windows alike), f32 throughout.
//
// `attention`: the visible keys of a (query row, head) are cut into at most ATT_SPLITS chunks
// of `att_chunk(n)` keys (n the visible key count), one block of ATT_THREADS threads each. A
// decode row of DeepSeek-V2-Lite's 16 heads at 144 keys is 80 blocks instead of 16, and each
// block's chain of dependent loads is one pass over the keys and one over the values instead of
// five and five. A block computes its chunk's scores (each warp ATT_KEYS_PER_WARP keys at a
// time, lanes splitting the channels, 16-byte loads where the shapes allow, a fixed shuffle tree
// per key), their maximum m, e_j = exp(s_j - m) and their sum l (block reductions in a fixed
// order), and the unnormalised value sum o = sum_j e_j v_j (warps over contiguous key ranges in
// ascending order, their partial sums added in warp order). It writes (m, l, o) to `part`.
//
// The combine (`att_combine`) takes a (row, head)'s chunks in order: M = max m_c,
// w_c = exp(m_c - M), L = sum_c w_c l_c, out = (sum_c w_c o_c) / L. Launched in clusters of
// `splits` blocks (a (row, head) a cluster; sm_90 and newer), each block stores its partials in
// the shared memory of the cluster's first block, and after one cluster barrier that block
// combines them: no round trip through L2, no fence, no ticket. Otherwise the partials go to
// `part`; with `counters` the last chunk block of a (row, head) to finish combines them (a ticket
// from an atomic count, which that block sets back to zero for the next launch), without them
// `attention_combine` does as a second launch. Every form computes every output the same way,
// so they give the same bits.
//
// Every split depends only on the number of visible keys and the head shapes, so a (row, head)
// result depends only on its query and the keys it may see, never on the other rows of the
// call: a verification window gives the same bits as decoding its rows one at a time. The grid
// does not depend on the key count either, only on the most keys a row of the launch may see
// (chunks past a row's last are empty blocks), so a recorded pass replays at any length.

#include "common.cuh"

#if !defined(ATT_THREADS) || !defined(ATT_KEYS_PER_WARP) || !defined(ATT_SPLITS) || !defined(ATT_COMBINE_THREADS) || !defined(ATT_CLUSTER_MAX_V)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif

#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_SMEM_KEYS 4096
// From the host's table: ATT_THREADS, the block; ATT_KEYS_PER_WARP, keys a warp scores per pass;
// ATT_SPLITS, the most chunks a (row, head)'s keys are cut into; ATT_COMBINE_THREADS, the
// threads of `attention_combine` (one channel each per pass); ATT_CLUSTER_MAX_V, the most value
// channels of a clustered launch (the first block of a cluster keeps every chunk's partials
// (m, l, o) in its shared memory).
// Channels of the value sum per pass: 4 per lane.
#define ATT_VTILE 128
// The fewest keys of a chunk: one pass of the score loop.
#define ATT_CHUNK_MIN (ATT_WARPS * ATT_KEYS_PER_WARP)
// Value rows each warp loads with the keys, before the scores need them (one round of loads
// instead of two for short chunks; the rest of its rows load after the scores).
#define ATT_V_EARLY 4

// Keys per chunk for n visible keys: n / ATT_SPLITS rounded up to whole score passes.
__device__ __forceinline__ int att_chunk(int n) {
    const int c = (n + ATT_SPLITS - 1) / ATT_SPLITS;
    return max(ATT_CHUNK_MIN, (c + ATT_CHUNK_MIN - 1) / ATT_CHUNK_MIN * ATT_CHUNK_MIN);
}

// The first visible key and the visible key count of query row r.
__device__ __forceinline__ int2 att_keys(int r, int start, int window, const unsigned* start_at) {
    const int pos = (start_at ? (int)start_at[0] : start) + r;
    const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
    return make_int2(lo, pos + 1 - lo);
}

// The combine of one (row, head): `part(c, i)` is value i of chunk c's partials (m, l, o...),
// `chunks` of them written; o its output row; thread t of `threads` writes channels t,
// t + threads, ... (each channel's arithmetic does not depend on which thread computes it, or
// where the partials are read from).
template <class Part>
__device__ __forceinline__ void att_combine(const Part& part, int chunks, int v_dim, float* __restrict__ o,
                                            int t, int threads) {
    float w[ATT_SPLITS];
    float big = -__int_as_float(0x7f800000);
#pragma unroll
    for (int c = 0; c < ATT_SPLITS; ++c) {
        if (c < chunks) big = fmaxf(big, part(c, 0));
    }
    float total = 0.0f;
#pragma unroll
    for (int c = 0; c < ATT_SPLITS; ++c) {
        w[c] = 0.0f;
        if (c < chunks) {
            w[c] = expf(part(c, 0) - big);
            total = fmaf(w[c], part(c, 1), total);
        }
    }
    const float inv = 1.0f / total;
    for (int d = t; d < v_dim; d += threads) {
        float acc = 0.0f;
#pragma unroll
        for (int c = 0; c < ATT_SPLITS; ++c) {
            if (c < chunks) acc = fmaf(w[c], part(c, 2 + d), acc);
        }
        o[d] = acc * inv;
    }
}

// A (row, head)'s partials in `part` (global memory), read past L1: other blocks wrote them.
struct GlobalParts {
    const float* p;
    int v_dim;
    __device__ __forceinline__ float operator()(int c, int i) const { return __ldcg(p + (size_t)c * (2 + v_dim) + i); }
};

// A (row, head)'s partials in the shared memory of its cluster's first block.
struct ClusterParts {
    const float (*p)[2 + ATT_CLUSTER_MAX_V];
    __device__ __forceinline__ float operator()(int c, int i) const { return p[c][i]; }
};

// Where a chunk block puts its partials: its row of `part`, or (cluster) its row in the first
// cluster block's shared memory.
struct PartSink {
    float* global;
    unsigned remote;
    __device__ __forceinline__ void put(int i, float v) const {
        if (global) {
            global[i] = v;
        } else {
            cluster_store(remote + 4u * (unsigned)i, v);
        }
    }
};

// The partials (m, l, o) of chunk c of pair rh = (row r, head h): the chunk's n keys from key
// c0 of the row's visible ones (first key `lo`), put to `sink`. Every thread of the block calls
// it (it synchronises the block).
__device__ __forceinline__ void att_chunk_partials(const float* q, const float* k, const float* v,
                                                   float* __restrict__ scratch, int heads, int kv_heads,
                                                   int qk_dim, int v_dim, float scale, int score_stride,
                                                   int rh, int lo, int c0, int n, float* smem_scores,
                                                   float* red, float (*vsum)[ATT_VTILE],
                                                   const PartSink& sink) {
    const int r = rh / heads, h = rh % heads;
    const int kh = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* qh = q + ((size_t)r * heads + h) * qk_dim;
    float* scores = n <= ATT_SMEM_KEYS ? smem_scores : scratch + (size_t)rh * score_stride + c0;
    const size_t k_stride = (size_t)kv_heads * qk_dim, v_stride = (size_t)kv_heads * v_dim;
    const float* kbase = k + (size_t)(lo + c0) * k_stride + (size_t)kh * qk_dim;
    const float* vbase = v + (size_t)(lo + c0) * v_stride + (size_t)kh * v_dim;

    // The value rows of the first tile this warp sums first (see the value sum below), loaded
    // now so that they arrive with the keys.
    const int per = (n + ATT_WARPS - 1) / ATT_WARPS;
    const int j_begin = min(n, warp * per), j_end = min(n, j_begin + per);
    const bool v_vec = (v_dim & 3) == 0;
    const bool v_aligned = (reinterpret_cast<size_t>(v) & 15) == 0;
    const int d_lane = 4 * lane;
    float4 v_early[ATT_V_EARLY];
    if (v_vec && d_lane < v_dim) {
#pragma unroll
        for (int u = 0; u < ATT_V_EARLY; ++u) {
            if (j_begin + u < j_end) v_early[u] = load_float4(vbase + (size_t)(j_begin + u) * v_stride + d_lane, v_aligned);
        }
    }

    // Scores: each warp takes ATT_KEYS_PER_WARP consecutive keys at a time.
    // Channels in fours when the widths allow (16-byte loads where aligned, the same arithmetic
    // otherwise), so the order depends on the shapes only. A lane's pieces (d4 = lane, lane + 32,
    // ...) are summed in ascending order; two of them load at once.
    const bool qk_vec = (qk_dim & 3) == 0;
    const bool qk_aligned = ((reinterpret_cast<size_t>(q) | reinterpret_cast<size_t>(k)) & 15) == 0;
    for (int j0 = warp * ATT_KEYS_PER_WARP; j0 < n; j0 += ATT_WARPS * ATT_KEYS_PER_WARP) {
        float s[ATT_KEYS_PER_WARP];
#pragma unroll
        for (int u = 0; u < ATT_KEYS_PER_WARP; ++u) s[u] = 0.0f;
        if (qk_vec) {
            const int d4n = qk_dim >> 2;
            for (int d4 = lane; d4 < d4n; d4 += 64) {
                const bool two = d4 + 32 < d4n;
                const float4 qa = load_float4(qh + 4 * d4, qk_aligned);
                float4 qb = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (two) qb = load_float4(qh + 4 * (d4 + 32), qk_aligned);
                float4 ka[ATT_KEYS_PER_WARP], kb[ATT_KEYS_PER_WARP];
#pragma unroll
                for (int u = 0; u < ATT_KEYS_PER_WARP; ++u) {
                    if (j0 + u < n) {
                        const float* kr = kbase + (size_t)(j0 + u) * k_stride;
                        ka[u] = load_float4(kr + 4 * d4, qk_aligned);
                        if (two) kb[u] = load_float4(kr + 4 * (d4 + 32), qk_aligned);
                    }
                }
#pragma unroll
                for (int u = 0; u < ATT_KEYS_PER_WARP; ++u) {
                    if (j0 + u < n) {
                        float t = s[u];
                        t = fmaf(qa.x, ka[u].x, t);
                        t = fmaf(qa.y, ka[u].y, t);
                        t = fmaf(qa.z, ka[u].z, t);
                        t = fmaf(qa.w, ka[u].w, t);
                        if (two) {
                            t = fmaf(qb.x, kb[u].x, t);
                            t = fmaf(qb.y, kb[u].y, t);
                            t = fmaf(qb.z, kb[u].z, t);
                            t = fmaf(qb.w, kb[u].w, t);
                        }
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

    // Values: warp w sums keys [w * per, min(n, (w + 1) * per)) of the chunk in ascending order;
    // lane l owns channels d0 + 4l .. d0 + 4l + 3 of each tile of ATT_VTILE channels.
    if (threadIdx.x == 0) {
        sink.put(0, m);
        sink.put(1, total);
    }
    for (int d0 = 0; d0 < v_dim; d0 += ATT_VTILE) {
        const int d = d0 + d_lane;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (d < v_dim) {
            if (v_vec) {
                const float* vd = vbase + d;
                int j = j_begin;
                if (d0 == 0) {
#pragma unroll
                    for (int u = 0; u < ATT_V_EARLY; ++u) {
                        if (j_begin + u < j_end) {
                            const float e = scores[j_begin + u];
                            const float4 x = v_early[u];
                            acc.x = fmaf(e, x.x, acc.x);
                            acc.y = fmaf(e, x.y, acc.y);
                            acc.z = fmaf(e, x.z, acc.z);
                            acc.w = fmaf(e, x.w, acc.w);
                        }
                    }
                    j = min(j_end, j_begin + ATT_V_EARLY);
                }
#pragma unroll 4
                for (; j < j_end; ++j) {
                    const float e = scores[j];
                    const float4 x = load_float4(vd + (size_t)j * v_stride, v_aligned);
                    acc.x = fmaf(e, x.x, acc.x);
                    acc.y = fmaf(e, x.y, acc.y);
                    acc.z = fmaf(e, x.z, acc.z);
                    acc.w = fmaf(e, x.w, acc.w);
                }
            } else {
                const float* vd = vbase + d;
                for (int j = j_begin; j < j_end; ++j) {
                    const float e = scores[j];
                    const float* x = vd + (size_t)j * v_stride;
                    acc.x = fmaf(e, x[0], acc.x);
                    if (d + 1 < v_dim) acc.y = fmaf(e, x[1], acc.y);
                    if (d + 2 < v_dim) acc.z = fmaf(e, x[2], acc.z);
                    if (d + 3 < v_dim) acc.w = fmaf(e, x[3], acc.w);
                }
            }
        }
        vsum[warp][4 * lane] = acc.x;
        vsum[warp][4 * lane + 1] = acc.y;
        vsum[warp][4 * lane + 2] = acc.z;
        vsum[warp][4 * lane + 3] = acc.w;
        __syncthreads();
        if (threadIdx.x < ATT_VTILE && d0 + (int)threadIdx.x < v_dim) {
            float sum = vsum[0][threadIdx.x];
            for (int w = 1; w < ATT_WARPS; ++w) sum += vsum[w][threadIdx.x];
            sink.put(2 + d0 + threadIdx.x, sum);
        }
        __syncthreads();
    }
}

// q: [rows, heads * qk_dim]; k: [>= kv_len, kv_heads * qk_dim]; v: [>= kv_len, kv_heads * v_dim];
// part: [rows * heads * ATT_SPLITS, 2 + v_dim] (m, l, o); scratch: [rows * heads, score_stride]
// f32, used only by chunks of more than ATT_SMEM_KEYS keys; counters: null, or [rows * heads]
// zeros, and then out: [rows, heads * v_dim] gets the combined result.
// Query row r sits at position start + r (start = start_at[0] when start_at is not null) and sees
// keys lo..=start + r, lo = 0 or the window's start; the caller guarantees that the visible key
// count start + r + 1 - lo is at most score_stride. Grid: rows * heads * splits blocks, splits
// (at most ATT_SPLITS) no fewer than the chunks of score_stride keys: block b takes chunk
// b % splits of pair b / splits. With `cluster` (sm_90 and newer, v_dim at most
// ATT_CLUSTER_MAX_V) the launch's clusters are `splits` blocks, a pair each, and out gets the
// combined result (part and counters unused).
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention(
    const float* q, const float* k, const float* v,
    float* __restrict__ part, float* __restrict__ scratch, int heads, int kv_heads, int qk_dim, int v_dim,
    float scale, int start, int window, int score_stride, const unsigned* start_at,
    unsigned* __restrict__ counters, float* __restrict__ out, int splits, int cluster) {
    SPX_PROLOGUE_LATE();
    __shared__ float red[ATT_WARPS];
    __shared__ unsigned ticket;
    __shared__ float smem_scores[ATT_SMEM_KEYS];
    __shared__ float vsum[ATT_WARPS][ATT_VTILE];
    // Cluster launches: every chunk's partials, in the first block of the cluster.
    __shared__ float cluster_parts[ATT_SPLITS][2 + ATT_CLUSTER_MAX_V];
    const int rh = blockIdx.x / splits, c = blockIdx.x % splits;
    const int r = rh / heads;
    const int2 keys = att_keys(r, start, window, start_at);
    const int chunk = att_chunk(keys.y);
    const int c0 = c * chunk;
    const int chunks = (keys.y + chunk - 1) / chunk;
    // Past the last chunk a block computes nothing; in a cluster it still keeps the barrier
    // (every block of a cluster arrives), else the combine reads no more chunks.
    if (c0 < keys.y) {
        const PartSink sink = cluster ? PartSink{nullptr, cluster_addr(&cluster_parts[c][0], 0)}
                                      : PartSink{part + ((size_t)rh * ATT_SPLITS + c) * (2 + v_dim), 0u};
        att_chunk_partials(q, k, v, scratch, heads, kv_heads, qk_dim, v_dim, scale, score_stride, rh, keys.x, c0,
                           min(keys.y - c0, chunk), smem_scores, red, vsum, sink);
    } else if (!cluster) {
        return;
    }
    if (cluster) {
        spx_cluster_sync();
        if (c == 0) {
            att_combine(ClusterParts{cluster_parts}, chunks, v_dim, out + (size_t)rh * v_dim, threadIdx.x,
                        ATT_THREADS);
        }
        return;
    }
    if (counters == nullptr) return;
    // Publish this chunk, then take a ticket: the block that takes the last one has seen every
    // chunk's partials published and combines them.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ticket = atomicAdd(counters + rh, 1u);
    __syncthreads();
    if (ticket != (unsigned)(chunks - 1)) return;
    __threadfence();
    if (threadIdx.x == 0) counters[rh] = 0;
    att_combine(GlobalParts{part + (size_t)rh * ATT_SPLITS * (2 + v_dim), v_dim}, chunks, v_dim,
                out + (size_t)rh * v_dim, threadIdx.x, ATT_THREADS);
}

// The combine as a launch of its own, after `attention` without counters. part: as `attention`
// wrote it; out: [rows, heads * v_dim]. Grid: rows * heads blocks of ATT_COMBINE_THREADS
// threads; the other arguments as `attention`'s.
extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS) attention_combine(
    const float* part, float* __restrict__ out, int heads, int v_dim, int start, int window,
    const unsigned* start_at) {
    SPX_PROLOGUE_LATE();
    const int rh = blockIdx.x, r = rh / heads;
    const int n = att_keys(r, start, window, start_at).y;
    const int chunk = att_chunk(n);
    att_combine(GlobalParts{part + (size_t)rh * ATT_SPLITS * (2 + v_dim), v_dim}, (n + chunk - 1) / chunk,
                v_dim, out + (size_t)rh * v_dim, threadIdx.x, ATT_COMBINE_THREADS);
}
