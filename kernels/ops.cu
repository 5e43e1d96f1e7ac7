// Row-wise and element-wise ops of the forward pass, over f32 activations and f16 weights.
//
// Exactness contract (as the CPU reference): every output element depends only on its own row's
// inputs, through code that does not change with the number of rows, so a batch of rows gives
// bit-identical results to the same rows launched one at a time. Reductions inside a row use a
// fixed tree over a fixed number of threads.

#include <cuda_fp16.h>

#define ROW_THREADS 256

// Sum of `v` over the block's ROW_THREADS threads in a fixed order; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
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

// Four consecutive floats: one 16-byte access when aligned, else four scalar ones (same values).
__device__ __forceinline__ float4 load4(const float* p, bool aligned) {
    if (aligned) return *reinterpret_cast<const float4*>(p);
    return make_float4(p[0], p[1], p[2], p[3]);
}

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
                const float4 v = load4(xb + 4 * c, aligned);
                cache[i] = v;
                ss = fmaf(v.x, v.x, ss);
                ss = fmaf(v.y, v.y, ss);
                ss = fmaf(v.z, v.z, ss);
                ss = fmaf(v.w, v.w, ss);
            }
        }
        for (int c = threadIdx.x + RMS_CACHE * ROW_THREADS; c < n4; c += ROW_THREADS) {
            const float4 v = load4(xb + 4 * c, aligned);
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
            store4(yb + 4 * c, norm4(load4(xb + 4 * c, aligned), w + 4 * c, inv, aligned), aligned);
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

struct ExpertGroup {
    unsigned long long gate_up;
    unsigned long long gate_up_scales;
    unsigned long long down;
    unsigned long long down_scales;
    unsigned first;
    unsigned count;
};

#define MAX_TOP_K 16

// Router softmax and top-k of one row by one warp (largest probability first, ties to the lower
// id), then optional renormalisation over the chosen k and scaling; as the CPU reference's
// SoftmaxTopK. `chosen`/`chosen_p`: the warp's own MAX_TOP_K shared slots.
__device__ __forceinline__ void route_row(const float* __restrict__ row, int experts, int top_k, int renormalize,
                                          float scale, int* chosen, float* chosen_p, unsigned* __restrict__ ids,
                                          float* __restrict__ weights) {
    const int lane = threadIdx.x & 31;
    float m = -__int_as_float(0x7f800000);
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float total = 0.0f;
    for (int e = lane; e < experts; e += 32) total += expf(row[e] - m);
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    for (int j = 0; j < top_k; ++j) {
        float best = -1.0f;
        int best_e = experts;
        for (int e = lane; e < experts; e += 32) {
            bool taken = false;
            for (int t = 0; t < j; ++t) taken |= chosen[t] == e;
            if (taken) continue;
            const float p = expf(row[e] - m) / total;
            if (p > best || (p == best && e < best_e)) {
                best = p;
                best_e = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        if (lane == 0) {
            chosen[j] = best_e;
            chosen_p[j] = best;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float s = 0.0f;
        for (int j = 0; j < top_k; ++j) s += chosen_p[j];
        for (int j = 0; j < top_k; ++j) {
            float w = chosen_p[j];
            if (renormalize) w /= s;
            if (scale != 1.0f) w *= scale;
            ids[j] = (unsigned)chosen[j];
            weights[j] = w;
        }
    }
    __syncwarp();
}

// Router softmax and top-k on the device, one warp per row. ids/weights: [rows, top_k].
extern "C" __global__ void route_softmax_topk(const float* __restrict__ logits, int experts, int top_k,
                                              int renormalize, float scale, unsigned* __restrict__ ids,
                                              float* __restrict__ weights) {
    __shared__ int chosen[MAX_TOP_K];
    __shared__ float chosen_p[MAX_TOP_K];
    const size_t r = blockIdx.x;
    route_row(logits + r * experts, experts, top_k, renormalize, scale, chosen, chosen_p, ids + r * top_k,
              weights + r * top_k);
}

// PhiMoE's SparseMixer top-2 at inference, as the CPU reference: each pick is the arg-max (first
// index on ties) of the logits not yet picked, weighted by a softmax over the candidates that lie
// within the jitter threshold of it, evaluated at the pick. One warp per row; ids/weights [rows, 2].
extern "C" __global__ void route_sparse_mixer(const float* __restrict__ logits, int experts, float jitter_eps,
                                              unsigned* __restrict__ ids, float* __restrict__ weights) {
    const int lane = threadIdx.x;
    const float* row = logits + (size_t)blockIdx.x * experts;
    const float neg_inf = -__int_as_float(0x7f800000);
    int first = -1;
    for (int j = 0; j < 2; ++j) {
        float best = neg_inf;
        int best_e = experts;
        for (int e = lane; e < experts; e += 32) {
            if (e == first) continue;
            const float v = row[e];
            if (v > best || (v == best && e < best_e)) {
                best = v;
                best_e = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        const float threshold = row[best_e];
        float m = neg_inf;
        for (int e = lane; e < experts; e += 32) {
            const float s = row[e];
            const float c = e == first ? neg_inf : s;
            m = fmaxf(m, (threshold - s) / fmaxf(fabsf(s), threshold) > 2.0f * jitter_eps ? neg_inf : c);
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float total = 0.0f;
        for (int e = lane; e < experts; e += 32) {
            const float s = row[e];
            const float c = e == first ? neg_inf : s;
            const float kept = (threshold - s) / fmaxf(fabsf(s), threshold) > 2.0f * jitter_eps ? neg_inf : c;
            total += expf(kept - m);
        }
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
        if (lane == 0) {
            ids[(size_t)blockIdx.x * 2 + j] = (unsigned)best_e;
            weights[(size_t)blockIdx.x * 2 + j] = expf(threshold - m) / total;
        }
        first = best_e;
    }
}

// counts[ids[i]] += 1 for i < n: the draft's routing counted on the device for the prefetch plan.
// Integer adds, so their order does not matter. One block.
extern "C" __global__ void count_routes(const unsigned* __restrict__ ids, int n, unsigned* __restrict__ counts) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&counts[ids[i]], 1u);
}

#define PLAN_MAX_EXPERTS 1024

// The grouped-MoE work list from device routing (src/backend/cuda/experts.rs): items grouped by
// ascending expert id, each expert's in ascending (row, slot) order, exactly as the host builds it.
// `table[e]` holds expert e's weight pointers. Groups past the number of experts hit get count 0,
// so kernels launched over `max_groups` groups do nothing there. Run by one thread: the lists are
// short. `cursor`: PLAN_MAX_EXPERTS shared words.
// ids/weights carry no __restrict__: in route_plan they were written earlier in the same kernel,
// so they must not be read through the non-coherent read-only path.
__device__ void plan_list(const unsigned* ids, const float* weights, int rows, int top_k,
                          int experts, const ExpertGroup* __restrict__ table, int max_groups,
                          ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,
                          float* __restrict__ item_weight, unsigned* __restrict__ row_items, unsigned* cursor) {
    const int n = rows * top_k;
    for (int e = 0; e < experts; ++e) cursor[e] = 0;
    for (int i = 0; i < n; ++i) cursor[ids[i]] += 1;
    unsigned start = 0;
    int g = 0;
    for (int e = 0; e < experts; ++e) {
        const unsigned c = cursor[e];
        cursor[e] = start;
        if (c > 0) {
            ExpertGroup grp = table[e];
            grp.first = start;
            grp.count = c;
            groups[g++] = grp;
        }
        start += c;
    }
    for (; g < max_groups; ++g) {
        ExpertGroup grp = table[0];
        grp.first = 0;
        grp.count = 0;
        groups[g] = grp;
    }
    for (int i = 0; i < n; ++i) {
        const unsigned pos = cursor[ids[i]]++;
        item_row[pos] = (unsigned)(i / top_k);
        item_weight[pos] = weights[i];
        row_items[i] = pos;
    }
    // Each row's items in ascending expert id, which is ascending item position.
    for (int r = 0; r < rows; ++r) {
        unsigned* list = row_items + (size_t)r * top_k;
        for (int a = 1; a < top_k; ++a) {
            const unsigned v = list[a];
            int b = a - 1;
            while (b >= 0 && list[b] > v) {
                list[b + 1] = list[b];
                --b;
            }
            list[b + 1] = v;
        }
    }
}

// The work list after route_softmax_topk. Grid: 1; block: any (thread 0 works).
extern "C" __global__ void moe_plan(const unsigned* __restrict__ ids, const float* __restrict__ weights,
                                    int rows, int top_k, int experts, const ExpertGroup* __restrict__ table,
                                    int max_groups, ExpertGroup* __restrict__ groups,
                                    unsigned* __restrict__ item_row, float* __restrict__ item_weight,
                                    unsigned* __restrict__ row_items) {
    __shared__ unsigned cursor[PLAN_MAX_EXPERTS];
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    plan_list(ids, weights, rows, top_k, experts, table, max_groups, groups, item_row, item_weight, row_items,
              cursor);
}

#define ROUTE_PLAN_WARPS 8

// route_softmax_topk and moe_plan in one launch, for few rows (decode, verification windows):
// warp w routes rows w, w + ROUTE_PLAN_WARPS, ... (the same per-row code as route_softmax_topk),
// then, after the block barrier makes ids/weights visible, thread 0 builds the work list as
// moe_plan does. Grid: 1; block: 32 * ROUTE_PLAN_WARPS.
extern "C" __global__ void __launch_bounds__(32 * ROUTE_PLAN_WARPS) route_plan(
    const float* __restrict__ logits, int experts, int top_k, int renormalize, float scale,
    unsigned* __restrict__ ids, float* __restrict__ weights, int rows, const ExpertGroup* __restrict__ table,
    int max_groups, ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,
    float* __restrict__ item_weight, unsigned* __restrict__ row_items) {
    __shared__ int chosen[ROUTE_PLAN_WARPS][MAX_TOP_K];
    __shared__ float chosen_p[ROUTE_PLAN_WARPS][MAX_TOP_K];
    __shared__ unsigned cursor[PLAN_MAX_EXPERTS];
    const int warp = threadIdx.x >> 5;
    for (int r = warp; r < rows; r += ROUTE_PLAN_WARPS) {
        route_row(logits + (size_t)r * experts, experts, top_k, renormalize, scale, chosen[warp], chosen_p[warp],
                  ids + (size_t)r * top_k, weights + (size_t)r * top_k);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    plan_list(ids, weights, rows, top_k, experts, table, max_groups, groups, item_row, item_weight, row_items,
              cursor);
}
