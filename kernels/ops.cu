// Row-wise and element-wise ops of the forward pass, over f32 activations and f16 weights.
//
// Exactness contract (as the CPU reference): every output element depends only on its own row's
// inputs, through code that does not change with the number of rows, so a batch of rows gives
// bit-identical results to the same rows launched one at a time. Reductions inside a row use a
// fixed tree over a fixed number of threads.

#include <cuda_fp16.h>

#include "common.cuh"

#include "linear_rows.cuh"

#if !defined(ROW_THREADS) || !defined(MLA_APPEND_MAX_RANK) || !defined(ADD_NORM_MAX_COLS) || !defined(ARGMAX_CHUNK)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif
// ROW_THREADS (the host's table): the threads of the row-wise kernels.

// Sum of `v` over the block's ROW_THREADS threads in a fixed order; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.0f;
    if (warp == 0) {
        total = lane < (ROW_THREADS / 32) ? shared[lane] : 0.0f;
        for (int offset = 4; offset > 0; offset >>= 1) {
            total += __shfl_xor_sync(0xffffffffu, total, offset);
        }
        if (lane == 0) shared[ROW_THREADS / 32] = total;
    }
    __syncthreads();
    return shared[ROW_THREADS / 32];
}

// y[r] = table[ids[r]] (f16 -> f32). Grid: rows; block: any.
extern "C" __global__ void embedding(const __half* SPX_READONLY table, const unsigned* ids,
                                     int hidden, float* __restrict__ y) {
    SPX_PROLOGUE_LATE();
    const size_t r = blockIdx.x;
    const __half* src = table + (size_t)ids[r] * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        y[r * hidden + c] = __half2float(src[c]);
    }
}

#define RMS_CACHE 4

// Four consecutive floats stored: one 16-byte access when aligned, else four scalar ones.
__device__ __forceinline__ void store4(float* p, float4 v, bool aligned) {
    if (aligned) {
        *reinterpret_cast<float4*>(p) = v;
    } else {
        p[0] = v.x;
        p[1] = v.y;
        p[2] = v.z;
        p[3] = v.w;
    }
}

// w[i] * (v[i] * inv) for four columns; w read as two half2 when 8-byte aligned.
__device__ __forceinline__ float4 norm4(float4 v, const __half* w, float inv, bool aligned) {
    float2 wa, wb;
    if (aligned) {
        wa = __half22float2(reinterpret_cast<const __half2*>(w)[0]);
        wb = __half22float2(reinterpret_cast<const __half2*>(w)[1]);
    } else {
        wa = make_float2(__half2float(w[0]), __half2float(w[1]));
        wb = make_float2(__half2float(w[2]), __half2float(w[3]));
    }
    return make_float4(wa.x * (v.x * inv), wa.y * (v.y * inv), wb.x * (v.z * inv), wb.y * (v.w * inv));
}

// RMSNorm of one group of `group` columns, xb -> yb. Groups of a multiple of 4 columns go four
// columns per thread step (float4 accesses where `aligned`, the same arithmetic otherwise), the
// first RMS_CACHE * ROW_THREADS * 4 columns kept in registers between the two passes. The sum of
// squares runs in an order fixed by `group` alone. With ADD, xb[c] is first replaced by
// xb[c] + ab[c] (stored back to xb, as add_f32 does), and the norm is that of the sums.
// xb carries no __restrict__: with ADD the second pass reads back what the first stored.
template <bool ADD>
__device__ __forceinline__ void rms_norm_group(float* xb, const float* ab, const __half* SPX_READONLY w,
                                               float eps, int group, float* __restrict__ yb, bool aligned,
                                               float* shared) {
    float ss = 0.0f;
    if ((group & 3) == 0) {
        const int n4 = group >> 2;
        float4 cache[RMS_CACHE];
#pragma unroll
        for (int i = 0; i < RMS_CACHE; ++i) {
            const int c = threadIdx.x + i * ROW_THREADS;
            if (c < n4) {
                float4 v = load_float4(xb + 4 * c, aligned);
                if (ADD) {
                    const float4 t = load_float4(ab + 4 * c, aligned);
                    v = make_float4(v.x + t.x, v.y + t.y, v.z + t.z, v.w + t.w);
                    store4(xb + 4 * c, v, aligned);
                }
                cache[i] = v;
                ss = fmaf(v.x, v.x, ss);
                ss = fmaf(v.y, v.y, ss);
                ss = fmaf(v.z, v.z, ss);
                ss = fmaf(v.w, v.w, ss);
            }
        }
        for (int c = threadIdx.x + RMS_CACHE * ROW_THREADS; c < n4; c += ROW_THREADS) {
            float4 v = load_float4(xb + 4 * c, aligned);
            if (ADD) {
                const float4 t = load_float4(ab + 4 * c, aligned);
                v = make_float4(v.x + t.x, v.y + t.y, v.z + t.z, v.w + t.w);
                store4(xb + 4 * c, v, aligned);
            }
            ss = fmaf(v.x, v.x, ss);
            ss = fmaf(v.y, v.y, ss);
            ss = fmaf(v.z, v.z, ss);
            ss = fmaf(v.w, v.w, ss);
        }
        ss = block_sum(ss, shared);
        const float inv = 1.0f / sqrtf(ss / (float)group + eps);
#pragma unroll
        for (int i = 0; i < RMS_CACHE; ++i) {
            const int c = threadIdx.x + i * ROW_THREADS;
            if (c < n4) {
                store4(yb + 4 * c, norm4(cache[i], w + 4 * c, inv, aligned), aligned);
            }
        }
        for (int c = threadIdx.x + RMS_CACHE * ROW_THREADS; c < n4; c += ROW_THREADS) {
            store4(yb + 4 * c, norm4(load_float4(xb + 4 * c, aligned), w + 4 * c, inv, aligned), aligned);
        }
        return;
    }
    for (int c = threadIdx.x; c < group; c += ROW_THREADS) {
        float v = xb[c];
        if (ADD) {
            v = v + ab[c];
            xb[c] = v;
        }
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, shared);
    const float inv = 1.0f / sqrtf(ss / (float)group + eps);
    for (int c = threadIdx.x; c < group; c += ROW_THREADS) {
        yb[c] = __half2float(w[c]) * (xb[c] * inv);
    }
}

// RMSNorm over each group of `group` columns: one block per (row, group). Block: ROW_THREADS.
extern "C" __global__ void rms_norm(const float* x, const __half* SPX_READONLY w, float eps,
                                    int group, float* __restrict__ y) {
    SPX_PROLOGUE_LATE();
    __shared__ float shared[ROW_THREADS / 32 + 1];
    const size_t base = (size_t)blockIdx.x * group;
    const bool aligned = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(y)) & 15) == 0 &&
                         (reinterpret_cast<size_t>(w) & 7) == 0;
    rms_norm_group<false>(const_cast<float*>(x) + base, nullptr, w, eps, group, y + base, aligned, shared);
}

// The residual add and the next norm of a decoder layer: x += a, then y = RMSNorm(x) over whole
// rows of `cols` columns; the same bits as add_f32 followed by rms_norm. One block per row.
extern "C" __global__ void add_rms_norm(float* x, const float* a, const __half* SPX_READONLY w, float eps,
                                        int cols, float* __restrict__ y) {
    SPX_PROLOGUE_LATE();
    __shared__ float shared[ROW_THREADS / 32 + 1];
    const size_t base = (size_t)blockIdx.x * cols;
    const bool aligned = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(a) |
                           reinterpret_cast<size_t>(y) | (size_t)cols * 4) & 15) == 0 &&
                         (reinterpret_cast<size_t>(w) & 7) == 0;
    rms_norm_group<true>(x + base, a + base, w, eps, cols, y + base, aligned, shared);
}

// LayerNorm of each row (width `cols`) with weight and bias. One block per row.
extern "C" __global__ void layer_norm(const float* x, const __half* SPX_READONLY w,
                                      const __half* SPX_READONLY b, float eps, int cols,
                                      float* __restrict__ y) {
    SPX_PROLOGUE_LATE();
    __shared__ float shared[ROW_THREADS / 32 + 1];
    const size_t base = (size_t)blockIdx.x * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) s += x[base + c];
    const float mean = block_sum(s, shared) / (float)cols;
    float var = 0.0f;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) {
        const float d = x[base + c] - mean;
        var = fmaf(d, d, var);
    }
    var = block_sum(var, shared);
    const float inv = 1.0f / sqrtf(var / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) {
        y[base + c] = (x[base + c] - mean) * inv * __half2float(w[c]) + __half2float(b[c]);
    }
}

// Splits columns [col0, col0 + width) of x ([rows, x_cols]) into up to four consecutive pieces:
// y0 ([rows, w0]) takes the first w0 of them, y1 the next w1, and so on (unused pieces: width 0),
// with w0 + w1 + w2 + w3 = width. One launch for a whole split_cols of up to four pieces.
extern "C" __global__ void copy_cols(const float* x, int x_cols, int col0, int width,
                                     unsigned long long total, float* __restrict__ y0, int w0,
                                     float* __restrict__ y1, int w1, float* __restrict__ y2, int w2,
                                     float* __restrict__ y3, int w3) {
    SPX_PROLOGUE_LATE();
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = i / width;
        int c = (int)(i % width);
        const float v = x[r * x_cols + col0 + c];
        if (c < w0) {
            y0[r * w0 + c] = v;
        } else if ((c -= w0) < w1) {
            y1[r * w1 + c] = v;
        } else if ((c -= w1) < w2) {
            y2[r * w2 + c] = v;
        } else {
            c -= w2;
            y3[r * w3 + c] = v;
        }
    }
}

// dst[row_at[0] + r] = src[r] for `rows` rows of `cols` columns: the KV-cache append of a recorded
// forward pass, whose position is read on the device at replay. Grid: (ceil(cols / 256), rows).
extern "C" __global__ void copy_rows_at(const float* src, float* __restrict__ dst, int cols,
                                        const unsigned* row_at) {
    SPX_PROLOGUE_LATE();
    const size_t r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) dst[((size_t)row_at[0] + r) * cols + c] = src[r * cols + c];
}

extern "C" __global__ void clamp_f32(float* __restrict__ x, float limit, unsigned long long n) {
    SPX_PROLOGUE_LATE();
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] = fminf(fmaxf(x[i], -limit), limit);
    }
}

// x += y.
extern "C" __global__ void add_f32(float* __restrict__ x, const float* y, unsigned long long n) {
    SPX_PROLOGUE_LATE();
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// x[r] += sigmoid(gate[r]) * y[r].
extern "C" __global__ void add_sigmoid_gated(float* __restrict__ x, const float* y,
                                             const float* gate, int cols,
                                             unsigned long long n) {
    SPX_PROLOGUE_LATE();
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float g = 1.0f / (1.0f + expf(-gate[i / cols]));
        x[i] += g * y[i];
    }
}

// One rotated pair: (a, b) = (seg[2i], seg[2i+1]) when interleaved, else (seg[i], seg[i+half]).
__device__ __forceinline__ float2 rope_pair(float a, float b, float c, float s, int interleaved) {
    if (interleaved) return make_float2(a * c - b * s, a * s + b * c);
    return make_float2(a * c - b * s, b * c + a * s);
}

// Pair i of rope_segment.
__device__ __forceinline__ void rope_pair_at(const float* in, float* out, const float* cs, const float* sn,
                                             int half, int interleaved, int i) {
    const float c = cs[i], s = sn[i];
    if (interleaved) {
        const float2 r = rope_pair(in[2 * i], in[2 * i + 1], c, s, 1);
        out[2 * i] = r.x;
        out[2 * i + 1] = r.y;
    } else {
        const float2 r = rope_pair(in[i], in[i + half], c, s, 0);
        out[i] = r.x;
        out[i + half] = r.y;
    }
}

// Rotates channels [offset, offset + rot_dim) of one head segment `in` into `out` (the same
// place for an in-place rotation) by the row's cos/sin (`half` each). Threads t, t + step, ...
__device__ __forceinline__ void rope_segment(const float* in, float* out, const float* cs, const float* sn,
                                             int half, int interleaved, int t, int step) {
    for (int i = t; i < half; i += step) rope_pair_at(in, out, cs, sn, half, interleaved, i);
}

// Rotates each head's channels [offset, offset + rot_dim) of row r by the host-computed
// cos/sin (`[rows, rot_dim / 2]`, already scaled). interleaved: pairs (2i, 2i+1); else (i, i+half).
// Grid: rows; block: any.
extern "C" __global__ void rope(float* __restrict__ x, const float* SPX_READONLY cos_t,
                                const float* SPX_READONLY sin_t, int cols, int heads, int head_stride,
                                int offset, int rot_dim, int interleaved) {
    SPX_PROLOGUE_LATE();
    const int half = rot_dim / 2;
    const size_t r = blockIdx.x;
    float* row = x + r * cols;
    const float* cs = cos_t + r * half;
    const float* sn = sin_t + r * half;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        const int h = t / half, i = t % half;
        float* seg = row + h * head_stride + offset;
        rope_pair_at(seg, seg, cs, sn, half, interleaved, i);
    }
}

// MLA's latent step, one block (ROW_THREADS) per row of c ([rows, cols], cols = rank + rope):
// latent[r] = RMSNorm(c[r][0, rank)) times w, and pe[r] = c[r][rank, rank + rope) rotated by the
// row's cos/sin; the same bits as split_cols, rms_norm and rope.
extern "C" __global__ void mla_latent(const float* c, int cols, int rank, const __half* SPX_READONLY w,
                                      float eps, const float* SPX_READONLY cos_t, const float* SPX_READONLY sin_t,
                                      int rope, int interleaved, float* __restrict__ latent, float* __restrict__ pe) {
    SPX_PROLOGUE_LATE();
    __shared__ float shared[ROW_THREADS / 32 + 1];
    const size_t r = blockIdx.x;
    const float* row = c + r * cols;
    const bool aligned = ((reinterpret_cast<size_t>(row) | reinterpret_cast<size_t>(latent) | (size_t)rank * 4) & 15) == 0 &&
                         (reinterpret_cast<size_t>(w) & 7) == 0;
    rms_norm_group<false>(const_cast<float*>(row), nullptr, w, eps, rank, latent + r * rank, aligned, shared);
    const int half = rope / 2;
    rope_segment(row + rank, pe + r * rope, cos_t + r * half, sin_t + r * half, half, interleaved, threadIdx.x,
                 blockDim.x);
}

// MLA after kv_b: from kv ([rows, heads * (nope + v_dim)]) and the rotated k_pe ([rows, rope]),
// writes row r's keys (per head: nope channels of kv, then k_pe) and values into the caches at
// position p = (start_at ? start_at[0] : start) + r, and rotates the query's rope channels of
// head h in place (q: [rows, heads * (nope + rope)], channels nope.. of each head); the same bits
// as mla_expand_kv, two write_rows and rope. Grid: (rows, heads); block: any.
extern "C" __global__ void mla_expand_append(const float* kv, const float* k_pe, int heads,
                                             int nope, int rope, int v_dim, float* __restrict__ keys,
                                             float* __restrict__ values, int start,
                                             const unsigned* start_at, float* __restrict__ q,
                                             const float* SPX_READONLY cos_t, const float* SPX_READONLY sin_t,
                                             int interleaved) {
    SPX_PROLOGUE_LATE();
    const size_t r = blockIdx.x;
    const int h = blockIdx.y;
    const size_t p = (size_t)(start_at ? (int)start_at[0] : start) + r;
    const int kw = nope + rope, in_w = nope + v_dim;
    const float* src = kv + (r * heads + h) * in_w;
    float* kd = keys + (p * heads + h) * kw;
    float* vd = values + (p * heads + h) * v_dim;
    for (int c = threadIdx.x; c < kw; c += blockDim.x) kd[c] = c < nope ? src[c] : k_pe[r * rope + (c - nope)];
    for (int c = threadIdx.x; c < v_dim; c += blockDim.x) vd[c] = src[nope + c];
    const int half = rope / 2;
    float* qh = q + (r * heads + h) * kw + nope;
    rope_segment(qh, qh, cos_t + r * half, sin_t + r * half, half, interleaved, threadIdx.x, blockDim.x);
}

// MLA_APPEND_MAX_RANK (the host's table): the most latent columns mla_kv_append_1 takes; each
// warp keeps its own normed copy in shared memory (8 KB a block at 512, DeepSeek-V2's rank).

// The wait of mla_kv_append_1's product: after the previous kernels, the warp writes the row's
// normed latent into its own shared copy, with rms_norm_group's arithmetic for ROW_THREADS
// threads. Thread t of rms_norm_group sums the squares of float4 piece t (rank <= 4 ROW_THREADS:
// one piece each at most); lane l holds pieces l + 32 j, all loaded at once with their weights,
// and the warps' sums combine by block_sum's tree. Each element is w * (v * inv).
struct LatentWait {
    const float* c;
    const __half* w;
    float eps;
    int rank;
    float* latent;
    __device__ __forceinline__ void operator()() const {
        static_assert(ROW_THREADS == 256, "the tree below is block_sum's for 8 warps");
        static_assert(MLA_APPEND_MAX_RANK <= 4 * ROW_THREADS, "one float4 piece a thread");
        constexpr int PIECES = MLA_APPEND_MAX_RANK / 128;  // float4 pieces a lane holds
        spx_grid_wait();
        const int lane = threadIdx.x & 31;
        const int n4 = rank >> 2;
        float4 v[PIECES];
        uint2 wv[PIECES];
#pragma unroll
        for (int j = 0; j < PIECES; ++j) {
            const int i = lane + 32 * j;
            if (i < n4) {
                v[j] = reinterpret_cast<const float4*>(c)[i];
                wv[j] = reinterpret_cast<const uint2*>(w)[i];
            }
        }
        float ws[ROW_THREADS / 32];
#pragma unroll
        for (int j = 0; j < ROW_THREADS / 32; ++j) {
            float ss = 0.0f;
            if (j < PIECES && lane + 32 * j < n4) {
                ss = fmaf(v[j].x, v[j].x, ss);
                ss = fmaf(v[j].y, v[j].y, ss);
                ss = fmaf(v[j].z, v[j].z, ss);
                ss = fmaf(v[j].w, v[j].w, ss);
            }
            ws[j] = j < PIECES ? warp_sum(ss) : 0.0f;
        }
        // block_sum: lanes 0..7 hold the warps' sums, then xor 4, 2, 1; lane 0's order.
        const float total = ((ws[0] + ws[4]) + (ws[2] + ws[6])) + ((ws[1] + ws[5]) + (ws[3] + ws[7]));
        const float inv = 1.0f / sqrtf(total / (float)rank + eps);
#pragma unroll
        for (int j = 0; j < PIECES; ++j) {
            const int i = lane + 32 * j;
            if (i < n4) {
                const __half2* h2 = reinterpret_cast<const __half2*>(&wv[j]);
                const float2 wa = __half22float2(h2[0]), wb = __half22float2(h2[1]);
                reinterpret_cast<float4*>(latent)[i] =
                    make_float4(wa.x * (v[j].x * inv), wa.y * (v[j].y * inv), wb.x * (v[j].z * inv),
                                wb.y * (v[j].w * inv));
            }
        }
        __syncwarp();
    }
};

// The key or value slot of kv_b's output feature j (head j / (nope + v_dim): its nope key
// channels, then its values), as mla_expand_append places it.
__device__ __forceinline__ float* mla_kv_slot(int j, int heads, int nope, int kw, int v_dim, size_t p,
                                              float* keys, float* values) {
    const int in_w = nope + v_dim, h = j / in_w, cc = j % in_w;
    return cc < nope ? keys + (p * heads + h) * kw + cc : values + (p * heads + h) * v_dim + (cc - nope);
}

// MLA from the compressed projection to the caches for one row (decode): the same bits as
// mla_latent, linear_f16_1 of kv_b and mla_expand_append, in one launch. Block 0 rotates the
// shared key part c[rank, rank + rope) into every head's key (channels nope..) and the query's
// rope channels in place. The other blocks are linear_f16_1's work blocks of kv = latent @
// w_kv^T: each warp loads its first pieces of weights, waits, norms the latent itself
// (LatentWait), and stores its features straight into their key or value slots at position
// p = (start_at ? start_at[0] : start). c: [1, rank + rope], 16-byte aligned; w_norm 8-byte aligned;
// rank a multiple of 8 from 256 to MLA_APPEND_MAX_RANK; w_kv: [heads * (nope + v_dim), rank].
// Grid: 1 + ceil(heads * (nope + v_dim) / (FEATURES * WARPS)); block: 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS) mla_kv_append_1(
    const float* c, int rank, const __half* SPX_READONLY w_norm, float eps,
    const __half* SPX_READONLY w_kv, int heads, int nope, int rope, int v_dim, float* __restrict__ keys,
    float* __restrict__ values, int start, const unsigned* start_at, float* __restrict__ q,
    const float* SPX_READONLY cos_t, const float* SPX_READONLY sin_t, int interleaved) {
    __shared__ __align__(16) float latent[WARPS][MLA_APPEND_MAX_RANK];
    spx_launch_dependents();
    const int kw = nope + rope, n = heads * (nope + v_dim);
    if (blockIdx.x == 0) {
        spx_grid_wait();
        const size_t p = (size_t)(start_at ? (int)start_at[0] : start);
        const int half = rope / 2;
        // Every head's pairs at once (thread t: head t / half, pair t % half), each rotated as
        // rope_segment rotates it.
        for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
            const int h = t / half, i = t % half;
            rope_pair_at(c + rank, keys + (p * heads + h) * kw + nope, cos_t, sin_t, half, interleaved, i);
            float* qh = q + (size_t)h * kw + nope;
            rope_pair_at(qh, qh, cos_t, sin_t, half, interleaved, i);
        }
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = FEATURES * ((blockIdx.x - 1) * WARPS + warp);
    if (col >= n) return;
    const bool second = col + 1 < n;
    const __half* w0 = w_kv + (size_t)col * rank;
    // Without a second feature the warp computes the first twice and stores it once.
    const __half* w1 = second ? w0 + rank : w0;
    float* x = latent[warp];
    const float* xr[1] = {x};
    float a0[1] = {0.0f}, a1[1] = {0.0f};
    lane_dot2<1, UNROLL_ONE, true>(w0, w1, xr, 1, rank, lane, a0, a1, LatentWait{c, w_norm, eps, rank, x});
    const float s0 = warp_sum(a0[0]);
    const float s1 = warp_sum(a1[0]);
    if (lane == 0) {
        const size_t p = (size_t)(start_at ? (int)start_at[0] : start);
        *mla_kv_slot(col, heads, nope, kw, v_dim, p, keys, values) = s0;
        if (second) *mla_kv_slot(col + 1, heads, nope, kw, v_dim, p, keys, values) = s1;
    }
}

// ADD_NORM_MAX_COLS (the host's table): the most columns add_norm_linear_1 takes; each block keeps
// the normed row in shared memory (16 KB at 4096), and rms_norm_group keeps a row of that width
// in registers (RMS_CACHE pieces a thread).
// Its register cap: four blocks an SM (<= 128 registers), as linear2_f16_1, whose grid it runs.
#define ADD_NORM_MIN_BLOCKS 4

// 16 bytes from global to shared memory without passing through registers (sm_80 and newer),
// read through L2: other kernels wrote them.
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

// Waits for the thread's cp_async16 copies.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// The wait of add_norm_linear_1's products: after the previous kernels, the block adds the
// residual and its update and norms the sum into its shared copy `xs`, with rms_norm_group's
// arithmetic for ROW_THREADS threads; `x_out` and `h_out`, where given (one block), get the sum
// and the normed row. Thread u of the block's 128 plays rms_norm_group's threads u and u + 128:
// thread T sums the squares of float4 pieces T + ROW_THREADS i in ascending i, so u sums pieces
// u + 128 h + ROW_THREADS i (h = 0, 1) apart, and the eight warp sums combine by block_sum's
// tree. Every thread of the block calls it once.
struct AddNormWait {
    const float* x;
    const float* a;
    const __half* w;
    float eps;
    int cols;
    float* xs;
    float* ds;
    float* sums;
    float* x_out;
    float* h_out;
    __device__ __forceinline__ void operator()() const {
        constexpr int THREADS = 32 * WARPS;
        static_assert(ROW_THREADS == 2 * THREADS, "two of rms_norm_group's threads a thread");
        static_assert(ROW_THREADS == 256, "the tree below is block_sum's for 8 warps");
        static_assert(ADD_NORM_MAX_COLS <= 4 * ROW_THREADS * RMS_CACHE, "rms_norm_group's cache");
        // The norm weights of the thread's first pieces (t + THREADS j), which no kernel writes:
        // read before the wait.
        const int t = threadIdx.x, lane = t & 31, warp = t >> 5, n4 = cols >> 2;
        constexpr int EARLY_W = 4;
        uint2 wv[EARLY_W];
#pragma unroll
        for (int j = 0; j < EARLY_W; ++j) {
            if (t + THREADS * j < n4) wv[j] = reinterpret_cast<const uint2*>(w)[t + THREADS * j];
        }
        spx_grid_wait();
        // The row and its update into shared memory in one round trip (no registers held);
        // thread t copies, and later reads, only its own pieces t + THREADS j.
        for (int p = t; p < n4; p += THREADS) {
            cp_async16(xs + 4 * p, x + 4 * p);
            cp_async16(ds + 4 * p, a + 4 * p);
        }
        cp_async_wait_all();
        float ss[2] = {0.0f, 0.0f};
        for (int i = 0; 4 * ROW_THREADS * i < cols; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int p = t + THREADS * h + ROW_THREADS * i;
                if (p < n4) {
                    const float4 v = reinterpret_cast<const float4*>(xs)[p];
                    const float4 d = reinterpret_cast<const float4*>(ds)[p];
                    const float4 s = make_float4(v.x + d.x, v.y + d.y, v.z + d.z, v.w + d.w);
                    reinterpret_cast<float4*>(xs)[p] = s;
                    ss[h] = fmaf(s.x, s.x, ss[h]);
                    ss[h] = fmaf(s.y, s.y, ss[h]);
                    ss[h] = fmaf(s.z, s.z, ss[h]);
                    ss[h] = fmaf(s.w, s.w, ss[h]);
                }
            }
        }
        const float low = warp_sum(ss[0]), high = warp_sum(ss[1]);
        if (lane == 0) {
            sums[warp] = low;
            sums[warp + WARPS] = high;
        }
        __syncthreads();
        // block_sum: lanes 0..7 hold the warps' sums, then xor 4, 2, 1; lane 0's order.
        const float total = ((sums[0] + sums[4]) + (sums[2] + sums[6])) + ((sums[1] + sums[5]) + (sums[3] + sums[7]));
        const float inv = 1.0f / sqrtf(total / (float)cols + eps);
        // Each thread normalises the pieces it stored (no other thread's): w * (v * inv), as
        // norm4 computes it.
        const auto normalise = [&](int p, uint2 wp) {
            const float4 sum = reinterpret_cast<const float4*>(xs)[p];
            const __half2* h2 = reinterpret_cast<const __half2*>(&wp);
            const float2 wa = __half22float2(h2[0]), wb = __half22float2(h2[1]);
            const float4 y = make_float4(wa.x * (sum.x * inv), wa.y * (sum.y * inv), wb.x * (sum.z * inv),
                                         wb.y * (sum.w * inv));
            reinterpret_cast<float4*>(xs)[p] = y;
            if (x_out) reinterpret_cast<float4*>(x_out)[p] = sum;
            if (h_out) reinterpret_cast<float4*>(h_out)[p] = y;
        };
#pragma unroll
        for (int j = 0; j < EARLY_W; ++j) {
            if (t + THREADS * j < n4) normalise(t + THREADS * j, wv[j]);
        }
        for (int p = t + THREADS * EARLY_W; p < n4; p += THREADS) {
            normalise(p, reinterpret_cast<const uint2*>(w)[p]);
        }
        __syncthreads();
    }
};

// The residual add, the RMSNorm after it and one or two products of the normed row, for one row
// (decode): the same bits as add_rms_norm followed by linear_f16_1 (nb = 0) or linear2_f16_1.
// Blocks below blocks_a are linear_f16_1's work blocks of ya = h @ wa^T, the others those of
// yb = h @ wb^T; each warp loads its first weights, waits, and the block computes h itself
// (AddNormWait) before the warps read it. The sum x + a goes to x_out and h to h_out (block 0):
// x is not written, as other blocks read it. x, a, x_out, h_out 16-byte aligned; w_norm 8-byte
// aligned; cols a multiple of 8 from 256 to ADD_NORM_MAX_COLS; wa: [na, cols], wb: [nb, cols].
// Grid: blocks_a + ceil(nb / (FEATURES * WARPS)), blocks_a = ceil(na / (FEATURES * WARPS));
// block: 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS, ADD_NORM_MIN_BLOCKS) add_norm_linear_1(
    const float* x, const float* a, const __half* SPX_READONLY w_norm, float eps,
    int cols, float* __restrict__ x_out, float* __restrict__ h_out, const __half* SPX_READONLY wa, int na,
    float* __restrict__ ya, const __half* SPX_READONLY wb, int nb, float* __restrict__ yb, int blocks_a) {
    __shared__ __align__(16) float xs[ADD_NORM_MAX_COLS];
    __shared__ __align__(16) float ds[ADD_NORM_MAX_COLS];
    __shared__ float sums[2 * WARPS];
    spx_launch_dependents();
    const bool in_a = (int)blockIdx.x < blocks_a;
    const int block = in_a ? (int)blockIdx.x : (int)blockIdx.x - blocks_a;
    const __half* w = in_a ? wa : wb;
    const int n = in_a ? na : nb;
    float* y = in_a ? ya : yb;
    const bool lead = blockIdx.x == 0;
    const AddNormWait wait{x, a, w_norm, eps, cols, xs, ds, sums, lead ? x_out : nullptr, lead ? h_out : nullptr};
    const int lane = threadIdx.x & 31;
    const int col = FEATURES * (block * WARPS + (threadIdx.x >> 5));
    if (col >= n) {
        wait();  // the block's barriers count every thread
        return;
    }
    const bool second = col + 1 < n;
    const __half* w0 = w + (size_t)col * cols;
    // Without a second feature the warp computes the first twice and stores it once.
    const __half* w1 = second ? w0 + cols : w0;
    const float* xr[1] = {xs};
    float a0[1] = {0.0f}, a1[1] = {0.0f};
    lane_dot2<1, UNROLL_ONE, true>(w0, w1, xr, 1, cols, lane, a0, a1, wait);
    const float s0 = warp_sum(a0[0]);
    const float s1 = warp_sum(a1[0]);
    if (lane == 0) {
        y[col] = s0;
        if (second) y[col + 1] = s1;
    }
}

// MLA: keys [len, heads * (nope + rope)] (per head: nope channels of kv, then the shared k_pe) and
// values [len, heads * v_dim] from kv [len, heads * (nope + v_dim)] and k_pe [len, rope].
// Grid: (len, heads); block: any.
extern "C" __global__ void mla_expand_kv(const float* kv, const float* k_pe,
                                         int heads, int nope, int rope, int v_dim,
                                         float* __restrict__ keys, float* __restrict__ values) {
    SPX_PROLOGUE_LATE();
    const size_t r = blockIdx.x;
    const int h = blockIdx.y;
    const int kw = nope + rope, in_w = nope + v_dim;
    const float* src = kv + (r * heads + h) * in_w;
    float* kd = keys + (r * heads + h) * kw;
    float* vd = values + (r * heads + h) * v_dim;
    for (int c = threadIdx.x; c < kw; c += blockDim.x) kd[c] = c < nope ? src[c] : k_pe[r * rope + (c - nope)];
    for (int c = threadIdx.x; c < v_dim; c += blockDim.x) vd[c] = src[nope + c];
}

// The greedy choice of each row: the first index of its largest value, where NaN never wins and
// -0 equals +0, and 0 when no value is above -inf (decode::argmax_scan on the host). A column's
// key orders (value, -index): the largest key is the choice, and a maximum over keys does not
// depend on the order blocks merge them in, so the result is the same for any grid. Block
// (chunk, row) of (ceil(cols / ARGMAX_CHUNK), rows) merges its chunk's largest key into
// keys[row] (atomicMax); the last block of the row (a ticket from counts[row]) writes out[row]
// and leaves keys[row] and counts[row] zero for the next launch. A decode row of a large
// vocabulary is read by many blocks at once instead of one.

__device__ __forceinline__ unsigned long long argmax_key(float v, int c) {
    if (!(v > __int_as_float(0xff800000))) return 0ull;  // NaN and -inf: never chosen (key 0: none)
    // -0 is +0 here, as in the scan's comparisons; then the bits are made to order as unsigned.
    unsigned b = __float_as_uint(v == 0.0f ? 0.0f : v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)b << 32) | (unsigned long long)(0xffffffffu - (unsigned)c);
}

__device__ __forceinline__ unsigned long long key_max(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

extern "C" __global__ void __launch_bounds__(ROW_THREADS) argmax_rows(
    const float* x, int cols, unsigned long long* __restrict__ keys,
    unsigned* __restrict__ counts, unsigned* __restrict__ out) {
    SPX_PROLOGUE_LATE();
    const int row = blockIdx.y;
    const float* r = x + (size_t)row * cols;
    const int begin = blockIdx.x * ARGMAX_CHUNK, end = min(cols, begin + ARGMAX_CHUNK);
    unsigned long long best = 0ull;
    if ((cols & 3) == 0) {
        // Rows and chunks start 16-byte aligned.
        const float4* r4 = reinterpret_cast<const float4*>(r);
        for (int c = begin + 4 * threadIdx.x; c < end; c += 4 * ROW_THREADS) {
            const float4 v = r4[c >> 2];
            best = key_max(best, argmax_key(v.x, c));
            best = key_max(best, argmax_key(v.y, c + 1));
            best = key_max(best, argmax_key(v.z, c + 2));
            best = key_max(best, argmax_key(v.w, c + 3));
        }
    } else {
        for (int c = begin + threadIdx.x; c < end; c += ROW_THREADS) best = key_max(best, argmax_key(r[c], c));
    }
    for (int offset = 16; offset > 0; offset >>= 1) best = key_max(best, __shfl_xor_sync(0xffffffffu, best, offset));
    __shared__ unsigned long long warp_best[ROW_THREADS / 32];
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ROW_THREADS / 32; ++w) best = key_max(best, warp_best[w]);
        atomicMax(&keys[row], best);
        // The merge is visible before the ticket that may let another block read it.
        __threadfence();
        if (atomicAdd(&counts[row], 1u) == gridDim.x - 1) {
            const unsigned long long k = atomicExch(&keys[row], 0ull);
            counts[row] = 0u;
            out[row] = k == 0ull ? 0u : 0xffffffffu - (unsigned)(k & 0xffffffffull);
        }
    }
}

// The routed-expert combine: y[r] = sum over j < top_k of out[row_items[r * top_k + j]], items
// listed in ascending expert id, added in that order (as the CPU reference adds them); then,
// when `plus` is given, y[r] += plus[r] (the shared experts' output, as add_f32 would add it).
// Grid: (rows, ceil(hidden / blockDim.x)); one thread per output element.
extern "C" __global__ void moe_combine(const float* out, const unsigned* row_items,
                                       int top_k, int hidden, float* __restrict__ y,
                                       const float* plus) {
    SPX_PROLOGUE_LATE();
    const size_t r = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float acc = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        acc += out[(size_t)row_items[r * top_k + j] * hidden + c];
    }
    if (plus) acc = acc + plus[r * hidden + c];
    y[r * hidden + c] = acc;
}
