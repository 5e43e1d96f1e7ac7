// Row-wise and element-wise ops of the forward pass, over f32 activations and f16 weights.
//
// Exactness contract (as the CPU reference): every output element depends only on its own row's
// inputs, through code that does not change with the number of rows, so a batch of rows gives
// bit-identical results to the same rows launched one at a time. Reductions inside a row use a
// fixed tree over a fixed number of threads.

#include <cuda_fp16.h>

#include "common.cuh"

#define ROW_THREADS 256

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
extern "C" __global__ void embedding(const __half* __restrict__ table, const unsigned* __restrict__ ids,
                                     int hidden, float* __restrict__ y) {
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

// RMSNorm over each group of `group` columns: one block per (row, group). Block: ROW_THREADS.
// Groups of a multiple of 4 columns go four columns per thread step (float4 accesses where the
// buffers are 16-byte aligned, the same arithmetic otherwise), the first
// RMS_CACHE * ROW_THREADS * 4 columns kept in registers between the two passes. The sum of squares
// runs in an order fixed by `group` alone.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const __half* __restrict__ w, float eps,
                                    int group, float* __restrict__ y) {
    __shared__ float shared[ROW_THREADS / 32 + 1];
    const size_t base = (size_t)blockIdx.x * group;
    const bool vec = (group & 3) == 0;
    const bool aligned = ((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(y)) & 15) == 0 &&
                         (reinterpret_cast<size_t>(w) & 7) == 0;
    float ss = 0.0f;
    if (vec) {
        const int n4 = group >> 2;
        const float* xb = x + base;
        float* yb = y + base;
        float4 cache[RMS_CACHE];
#pragma unroll
        for (int i = 0; i < RMS_CACHE; ++i) {
            const int c = threadIdx.x + i * ROW_THREADS;
            if (c < n4) {
                const float4 v = load_float4(xb + 4 * c, aligned);
                cache[i] = v;
                ss = fmaf(v.x, v.x, ss);
                ss = fmaf(v.y, v.y, ss);
                ss = fmaf(v.z, v.z, ss);
                ss = fmaf(v.w, v.w, ss);
            }
        }
        for (int c = threadIdx.x + RMS_CACHE * ROW_THREADS; c < n4; c += ROW_THREADS) {
            const float4 v = load_float4(xb + 4 * c, aligned);
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
        const float v = x[base + c];
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, shared);
    const float inv = 1.0f / sqrtf(ss / (float)group + eps);
    for (int c = threadIdx.x; c < group; c += ROW_THREADS) {
        y[base + c] = __half2float(w[c]) * (x[base + c] * inv);
    }
}

// LayerNorm of each row (width `cols`) with weight and bias. One block per row.
extern "C" __global__ void layer_norm(const float* __restrict__ x, const __half* __restrict__ w,
                                      const __half* __restrict__ b, float eps, int cols,
                                      float* __restrict__ y) {
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
extern "C" __global__ void copy_cols(const float* __restrict__ x, int x_cols, int col0, int width,
                                     unsigned long long total, float* __restrict__ y0, int w0,
                                     float* __restrict__ y1, int w1, float* __restrict__ y2, int w2,
                                     float* __restrict__ y3, int w3) {
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
extern "C" __global__ void copy_rows_at(const float* __restrict__ src, float* __restrict__ dst, int cols,
                                        const unsigned* __restrict__ row_at) {
    const size_t r = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) dst[((size_t)row_at[0] + r) * cols + c] = src[r * cols + c];
}

extern "C" __global__ void clamp_f32(float* __restrict__ x, float limit, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] = fminf(fmaxf(x[i], -limit), limit);
    }
}

// x += y.
extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// x[r] += sigmoid(gate[r]) * y[r].
extern "C" __global__ void add_sigmoid_gated(float* __restrict__ x, const float* __restrict__ y,
                                             const float* __restrict__ gate, int cols,
                                             unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float g = 1.0f / (1.0f + expf(-gate[i / cols]));
        x[i] += g * y[i];
    }
}

// Rotates each head's channels [offset, offset + rot_dim) of row r by the host-computed
// cos/sin (`[rows, rot_dim / 2]`, already scaled). interleaved: pairs (2i, 2i+1); else (i, i+half).
// Grid: rows; block: any.
extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, int cols, int heads, int head_stride,
                                int offset, int rot_dim, int interleaved) {
    const int half = rot_dim / 2;
    const size_t r = blockIdx.x;
    float* row = x + r * cols;
    const float* cs = cos_t + r * half;
    const float* sn = sin_t + r * half;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        const int h = t / half, i = t % half;
        float* seg = row + h * head_stride + offset;
        const float c = cs[i], s = sn[i];
        if (interleaved) {
            const float a = seg[2 * i], b = seg[2 * i + 1];
            seg[2 * i] = a * c - b * s;
            seg[2 * i + 1] = a * s + b * c;
        } else {
            const float a = seg[i], b = seg[i + half];
            seg[i] = a * c - b * s;
            seg[i + half] = b * c + a * s;
        }
    }
}

// MLA: keys [len, heads * (nope + rope)] (per head: nope channels of kv, then the shared k_pe) and
// values [len, heads * v_dim] from kv [len, heads * (nope + v_dim)] and k_pe [len, rope].
// Grid: (len, heads); block: any.
extern "C" __global__ void mla_expand_kv(const float* __restrict__ kv, const float* __restrict__ k_pe,
                                         int heads, int nope, int rope, int v_dim,
                                         float* __restrict__ keys, float* __restrict__ values) {
    const size_t r = blockIdx.x;
    const int h = blockIdx.y;
    const int kw = nope + rope, in_w = nope + v_dim;
    const float* src = kv + (r * heads + h) * in_w;
    float* kd = keys + (r * heads + h) * kw;
    float* vd = values + (r * heads + h) * v_dim;
    for (int c = threadIdx.x; c < kw; c += blockDim.x) kd[c] = c < nope ? src[c] : k_pe[r * rope + (c - nope)];
    for (int c = threadIdx.x; c < v_dim; c += blockDim.x) vd[c] = src[nope + c];
}

// h[r][i] = silu(gu[r][i]) * gu[r][inter + i] from a fused [rows, 2 * inter] activation.
extern "C" __global__ void silu_mul(const float* __restrict__ gu, int inter, unsigned long long n,
                                    float* __restrict__ h) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long r = i / inter, c = i % inter;
        const float g = gu[r * 2 * inter + c];
        h[i] = g / (1.0f + expf(-g)) * gu[r * 2 * inter + inter + c];
    }
}

// Index of each row's maximum, the first on ties (NaN never wins). One block per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int cols, unsigned* __restrict__ out) {
    __shared__ float best_v[ROW_THREADS];
    __shared__ int best_i[ROW_THREADS];
    const float* row = x + (size_t)blockIdx.x * cols;
    float bv = row[0];
    int bi = 0;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS) {
        const float v = row[c];
        if (v > bv || (v == bv && c < bi)) {
            bv = v;
            bi = c;
        }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int stride = ROW_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float v = best_v[threadIdx.x + stride];
            const int i = best_i[threadIdx.x + stride];
            if (v > best_v[threadIdx.x] || (v == best_v[threadIdx.x] && i < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = v;
                best_i[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (unsigned)best_i[0];
}

// The routed-expert combine: y[r] = sum over j < top_k of out[row_items[r * top_k + j]], items
// listed in ascending expert id, added in that order (as the CPU reference adds them).
// Grid: (rows, ceil(hidden / blockDim.x)); one thread per output element.
extern "C" __global__ void moe_combine(const float* __restrict__ out, const unsigned* __restrict__ row_items,
                                       int top_k, int hidden, float* __restrict__ y) {
    const size_t r = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float acc = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        acc += out[(size_t)row_items[r * top_k + j] * hidden + c];
    }
    y[r * hidden + c] = acc;
}
