// FP16-weight matrix products for f32 activations of few rows (decode, verification windows, short
// prompts): plain linear layers, the fused gate/up of a gated MLP, and the grouped routed-expert
// FFN (see src/backend/cuda/moe/experts.rs).
//
// One warp owns two output features (two weight rows; four in the one-item routed down kernels,
// whose rows are short): its lanes stream the rows in 16-byte pieces (8 halves), several pieces
// of each row in flight per lane, and each activation value loaded serves every feature. Each
// lane accumulates, for up to MR activation rows at once, in f32
// with one fixed order (its pieces in ascending order, 8 fused multiply-adds each); the 32 partial
// sums are then combined by a fixed shuffle tree. The arithmetic of one (row, feature) is the same
// whatever the number of rows in the launch, the row's place in its group of MR, or which of the
// warp's two slots the feature sits in (the backend's exactness contract), and each weight byte
// is read from DRAM about once per launch (the groups of a feature block run side by side).
// Groups of 1 or 2 rows run narrower code (fewer accumulators live), with the same per-row
// arithmetic. The routed-expert kernels keep eight
// partials per lane instead of one, so the host can compute the same bits (`lane_dot2_split`).

#include <cuda_fp16.h>

#include "common.cuh"

#include "routing.cuh"

#include "linear_rows.cuh"

#if !defined(DOWN_FEATURES_ONE) || !defined(EXPERTS_ONE_ARRIVED) || !defined(EXPERTS_ONE_GATE_UP_WORK)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif

// DOWN_FEATURES_ONE (the host's table): output features per warp of the one-item routed down
// kernels (moe_f16_down_1 and the routed rows of moe_f16_down_shared_1 and moe_f16_experts_1).
// Their pieces in flight per feature: six cover a lane's share of DeepSeek-V2-Lite's 1408-long
// rows in one pass.
#define DOWN_UNROLL_ONE 6
// Their register cap: three blocks an SM (<= 168 registers), as the several-row kernels.
#define DOWN_MIN_BLOCKS_ONE 3

// The routed experts' dot products keep eight partials per lane instead of one: partial e of lane
// l sums position e of the lane's 16-byte pieces (elements 8c + e, c = l, l + 32, ...), by fused
// multiply-adds in ascending c. Eight contiguous weights then feed eight different partials, so
// the host expert kernel (src/host_experts/lanes.rs) computes the same partials from plain vector
// loads, with no transposes, and gives the same bits. `split_sum` fixes the combine. Groups hold
// at most MR_SPLIT rows (64 accumulators for the two features). When k is not a multiple of 8,
// lane l sums elements l, l + 32, ... into its partial 0 (the others stay 0).
#define MR_SPLIT 4

template <int MT, int UNR = UNROLL>
__device__ __forceinline__ void lane_dot2_split(const __half* SPX_READONLY w0,
                                                const __half* SPX_READONLY w1, const float* const* xr,
                                                int mr, int k, int lane, float a0[MR_SPLIT][8],
                                                float a1[MR_SPLIT][8]) {
    if ((k & 7) == 0) {
        const int chunks = k >> 3;
        const uint4* v0 = reinterpret_cast<const uint4*>(w0);
        const uint4* v1 = reinterpret_cast<const uint4*>(w1);
        for (int c0 = lane; c0 < chunks; c0 += 32 * UNR) {
            uint4 p0[UNR], p1[UNR];
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                const int c = c0 + 32 * u;
                if (c < chunks) {
                    p0[u] = spx_ldg(v0 + c);
                    p1[u] = spx_ldg(v1 + c);
                }
            }
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                const int c = c0 + 32 * u;
                if (c < chunks) {
                    float f0[8], f1[8];
                    halves_to_floats(p0[u], f0);
                    halves_to_floats(p1[u], f1);
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        if (m < mr) {
                            const float4 xa = reinterpret_cast<const float4*>(xr[m] + 8 * c)[0];
                            const float4 xb = reinterpret_cast<const float4*>(xr[m] + 8 * c)[1];
                            const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                            for (int e = 0; e < 8; ++e) {
                                a0[m][e] = fmaf(f0[e], xv[e], a0[m][e]);
                                a1[m][e] = fmaf(f1[e], xv[e], a1[m][e]);
                            }
                        }
                    }
                }
            }
        }
    } else {
        for (int i = lane; i < k; i += 32) {
            const float f0 = __half2float(w0[i]), f1 = __half2float(w1[i]);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m < mr) {
                    const float xv = xr[m][i];
                    a0[m][0] = fmaf(f0, xv, a0[m][0]);
                    a1[m][0] = fmaf(f1, xv, a1[m][0]);
                }
            }
        }
    }
}

__device__ __forceinline__ void group_dot2_split(const __half* SPX_READONLY w0,
                                                 const __half* SPX_READONLY w1, const float* const* xr,
                                                 int mr, int k, int lane, float a0[MR_SPLIT][8],
                                                 float a1[MR_SPLIT][8]) {
#pragma unroll
    for (int m = 0; m < MR_SPLIT; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            a0[m][e] = 0.0f;
            a1[m][e] = 0.0f;
        }
    }
    if (mr == 1) {
        lane_dot2_split<1>(w0, w1, xr, mr, k, lane, a0, a1);
    } else if (mr == 2) {
        lane_dot2_split<2>(w0, w1, xr, mr, k, lane, a0, a1);
    } else {
        lane_dot2_split<MR_SPLIT>(w0, w1, xr, mr, k, lane, a0, a1);
    }
}

// lane_dot2_split of one row for NF features at once: a[f] += the lane partials of x . w[f],
// every feature's loads in flight together (the one-item down kernels). Each feature gets the
// arithmetic lane_dot2_split<1> gives it, so the bits are the same.
// EARLY: the caller has not waited for x; the lane issues its first pieces' loads, then calls
// `wait` (as lane_dot2's EARLY).
template <int NF, int UNR, bool EARLY = false, class Wait = GridWait>
__device__ __forceinline__ void lane_dotn_split(const __half* const* w, const float* x, int k,
                                                int lane, float a[NF][8], Wait wait = Wait()) {
    if ((k & 7) == 0) {
        const int chunks = k >> 3;
        for (int c0 = lane; c0 < chunks; c0 += 32 * UNR) {
            uint4 p[NF][UNR];
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                const int c = c0 + 32 * u;
                if (c < chunks) {
#pragma unroll
                    for (int f = 0; f < NF; ++f) p[f][u] = spx_ldg(reinterpret_cast<const uint4*>(w[f]) + c);
                }
            }
            if (EARLY && c0 == lane) wait();
#pragma unroll
            for (int u = 0; u < UNR; ++u) {
                const int c = c0 + 32 * u;
                if (c < chunks) {
                    const float4 xa = reinterpret_cast<const float4*>(x + 8 * c)[0];
                    const float4 xb = reinterpret_cast<const float4*>(x + 8 * c)[1];
                    const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                    for (int f = 0; f < NF; ++f) {
                        float wf[8];
                        halves_to_floats(p[f][u], wf);
#pragma unroll
                        for (int e = 0; e < 8; ++e) a[f][e] = fmaf(wf[e], xv[e], a[f][e]);
                    }
                }
            }
        }
        if (EARLY && lane >= chunks) wait();
    } else {
        if (EARLY) wait();
        for (int i = lane; i < k; i += 32) {
            const float xv = x[i];
#pragma unroll
            for (int f = 0; f < NF; ++f) a[f][0] = fmaf(__half2float(w[f][i]), xv, a[f][0]);
        }
    }
}

// One half of the values a lane sends to the lane `offset` away and adds the other half of that
// lane's: lanes with `offset` clear keep positions 0..n/2, the others n/2..n.
template <int N>
__device__ __forceinline__ void split_step(const float in[N], float out[N / 2], int lane, int offset) {
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
        const float send = upper ? in[j] : in[j + N / 2];
        const float keep = upper ? in[j + N / 2] : in[j];
        out[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
}

// The combine of a lane's eight partials over the warp, the same bits in every lane:
// S[e] = the butterfly (xor 16, 8, 4, 2, 1) of position e over the 32 lanes, then
// ((S0 + S1) + (S2 + S3)) + ((S4 + S5) + (S6 + S7)). Computed with 12 shuffles: three halving
// steps leave lane l with S[4 b4 + 2 b3 + b2] (b = bits of l) summed over bits 4..2, two more sum
// bits 1..0, and the last three add the positions in the tree's order.
__device__ __forceinline__ float split_sum(const float p[8], int lane) {
    float q[4], r[2], s;
    split_step<8>(p, q, lane, 16);
    split_step<4>(q, r, lane, 8);
    split_step<2>(r, &s, lane, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    s += __shfl_xor_sync(0xffffffffu, s, 16);
    return s;
}

// Work blocks of a linear product: feature blocks times row groups (ONE: feature blocks).
template <bool ONE>
__device__ __forceinline__ int linear_work(int rows, int n) {
    return (n + FEATURES * WARPS - 1) / (FEATURES * WARPS) * (ONE ? 1 : row_groups(rows));
}

// Asks L2 for the weight rows warp `threadIdx.x >> 5` reads in work block `work` of a linear
// product.
template <bool ONE>
__device__ __forceinline__ void linear_prefetch(const __half* SPX_READONLY w, int rows, int n, int k,
                                                int work) {
    const int block = work / (ONE ? 1 : row_groups(rows));
    const int col = FEATURES * (block * WARPS + (threadIdx.x >> 5));
    if (col < n) {
        spx_prefetch_l2(w + (size_t)col * k, (size_t)(col + 1 < n ? 2 : 1) * k * sizeof(__half), threadIdx.x & 31);
    }
}

// The matrix kernels below run their blocks' work in grid-stride loops: work block b for b =
// blockIdx.x, blockIdx.x + gridDim.x, ... For several rows the host launches at most as many
// blocks as fit on the device at once, so no block waits for a wave to drain, and each asks L2
// for its next work block's weights before computing the current one; for one row, a block per
// work block (src/backend/cuda/runtime/kernels.rs, `GridStride::grid`). Which block computes a feature
// changes no bit.

// y[rows, n] = x[rows, k] @ w[n, k]^T (+ bias[n]), over ceil(n / (FEATURES * WARPS)) feature
// blocks times row_groups(rows) work blocks; block: 32 * WARPS. linear_f16_1: the same for one
// row.
//
// linear2_f16: two products of the same input in one launch, each as linear_f16 computes it:
// work blocks below `blocks_a` row groups' worth compute ya = x @ wa^T (+ ba), the others
// yb = x @ wb^T (+ bb); blocks_a = ceil(na / (FEATURES * WARPS)), the feature blocks of ya.
// The one-row forms read their first weights before their wait (linear_block's EARLY).
#define LINEAR_KERNELS(SUFFIX, ONE)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) linear_f16##SUFFIX(                      \
        const float* x, int rows, int k, const __half* SPX_READONLY w, int n,                         \
        const __half* SPX_READONLY bias, float* __restrict__ y) {                                     \
        spx_launch_dependents();                                                                      \
        const int blocks = linear_work<ONE>(rows, n);                                                 \
        for (int b = blockIdx.x; b < blocks; b += gridDim.x) {                                        \
            if (b + (int)gridDim.x < blocks) linear_prefetch<ONE>(w, rows, n, k, b + gridDim.x);      \
            linear_block<ONE, ONE>(x, rows, k, w, n, bias, y, b);                                     \
        }                                                                                             \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) linear2_f16##SUFFIX(                     \
        const float* x, int rows, int k, const __half* SPX_READONLY wa, int na,                       \
        const __half* SPX_READONLY ba, float* __restrict__ ya, const __half* SPX_READONLY wb, int nb, \
        const __half* SPX_READONLY bb, float* __restrict__ yb, int blocks_a) {                        \
        spx_launch_dependents();                                                                      \
        const int work_a = blocks_a * (ONE ? 1 : row_groups(rows));                                   \
        const int blocks = work_a + linear_work<ONE>(rows, nb);                                       \
        for (int b = blockIdx.x; b < blocks; b += gridDim.x) {                                        \
            const int next = b + gridDim.x;                                                           \
            if (next < work_a) {                                                                      \
                linear_prefetch<ONE>(wa, rows, na, k, next);                                          \
            } else if (next < blocks) {                                                               \
                linear_prefetch<ONE>(wb, rows, nb, k, next - work_a);                                 \
            }                                                                                         \
            if (b < work_a) {                                                                         \
                linear_block<ONE, ONE>(x, rows, k, wa, na, ba, ya, b);                                \
            } else {                                                                                  \
                linear_block<ONE, ONE>(x, rows, k, wb, nb, bb, yb, b - work_a);                       \
            }                                                                                         \
        }                                                                                             \
    }

LINEAR_KERNELS(, false)
LINEAR_KERNELS(_1, true)

// The gate/up product of a gated MLP with the activation fused, feature j of every row:
// h[r][j] = silu(x[r] . w[j]) * (x[r] . w[inter + j]), w = [gate; up] of shape [2 * inter, k].
// The two dot products are the ones linear_f16 computes (same order), so h equals linear_f16
// followed by silu_mul bit for bit. One warp. ONE: one row, by the code group_dot2 runs
// for a group of one row (the same bits), without the registers of wider groups.
// Rows first .. last of x (ONE: the one row).
template <bool ONE = false>
__device__ __forceinline__ void gate_up_silu_feature(const float* x, int first, int last,
                                                     int k, const __half* SPX_READONLY w, int inter,
                                                     float* __restrict__ h, int j) {
    const int lane = threadIdx.x & 31;
    if (j >= inter) return;
    const __half* wg = w + (size_t)j * k;
    const __half* wu = w + (size_t)(inter + j) * k;
    if (ONE) {
        // The first pieces load before the wait (lane_dot2's EARLY): in a decode step this runs
        // in route_plan_shared_f16_1, after the router's small product.
        const float* xr[1] = {x};
        float a[1] = {0.0f}, b[1] = {0.0f};
        lane_dot2<1, UNROLL, true>(wg, wu, xr, 1, k, lane, a, b);
        const float ga = warp_sum(a[0]);
        const float ub = warp_sum(b[0]);
        if (lane == 0) h[j] = ga / (1.0f + expf(-ga)) * ub;
        return;
    }
    spx_grid_wait();
    for (int r0 = first; r0 < last; r0 += MR) {
        const int mr = min(MR, last - r0);
        const float* xr[MR];
        float a[MR], b[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m) xr[m] = x + (size_t)(r0 + min(m, mr - 1)) * k;
        group_dot2(wg, wu, xr, mr, k, lane, a, b);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            if (m < mr) {
                const float ga = warp_sum(a[m]);
                const float ub = warp_sum(b[m]);
                if (lane == 0) h[(size_t)(r0 + m) * inter + j] = ga / (1.0f + expf(-ga)) * ub;
            }
        }
    }
}

// The items of one routed expert group, MS at a time (MR_SPLIT, or 1 with more pieces in flight:
// an item's arithmetic is the same either way).
template <int MS>
__device__ __forceinline__ void split_items(const __half* SPX_READONLY w0, const __half* SPX_READONLY w1,
                                            const float* const* xr, int mr, int k, int lane, float a0[][8],
                                            float a1[][8]) {
    if (MS == 1) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            a0[0][e] = 0.0f;
            a1[0][e] = 0.0f;
        }
        lane_dot2_split<1, UNROLL_ONE>(w0, w1, xr, 1, k, lane, a0, a1);
    } else {
        group_dot2_split(w0, w1, xr, mr, k, lane, a0, a1);
    }
}

// Grouped gate/up: h[item][j] = silu(x[row] . gate[j]) * (x[row] . up[j]), work block (bx, by)
// of (ceil(inter / WARPS), groups): group by's features bx * WARPS + w.
template <int MS>
__device__ __forceinline__ void moe_gate_up_block(const float* x, int hidden, int inter,
                                                  const ExpertGroup* groups,
                                                  const unsigned* item_row, float* __restrict__ h,
                                                  int bx, int by) {
    const ExpertGroup g = groups[by];
    const int lane = threadIdx.x & 31;
    const int j = bx * WARPS + (threadIdx.x >> 5);
    if (j >= inter) return;
    const __half* wg = reinterpret_cast<const __half*>(g.gate_up) + (size_t)j * hidden;
    const __half* wu = reinterpret_cast<const __half*>(g.gate_up) + (size_t)(inter + j) * hidden;
    for (int i0 = 0; i0 < (int)g.count; i0 += MS) {
        const int mr = min(MS, (int)g.count - i0);
        const float* xr[MS];
        float a[MS][8], b[MS][8];
#pragma unroll
        for (int m = 0; m < MS; ++m) xr[m] = x + (size_t)item_row[g.first + i0 + min(m, mr - 1)] * hidden;
        split_items<MS>(wg, wu, xr, mr, hidden, lane, a, b);
#pragma unroll
        for (int m = 0; m < MS; ++m) {
            if (m < mr) {
                const float ga = split_sum(a[m], lane);
                const float ub = split_sum(b[m], lane);
                if (lane == 0) h[(size_t)(g.first + i0 + m) * inter + j] = __fmul_rn(spx_silu(ga), ub);
            }
        }
    }
}

// Grouped down: out[item][c] = weight[item] * (h[item] . down[c]); warp w of work block (bx, by)
// of (ceil(hidden / (FEATURES * WARPS)), groups) owns group by's features
// c = FEATURES * (bx * WARPS + w) and c + 1.
template <int MS>
__device__ __forceinline__ void moe_down_block(const float* h, int hidden, int inter,
                                               const ExpertGroup* groups,
                                               const float* item_weight, float* __restrict__ out,
                                               int bx, int by) {
    const ExpertGroup g = groups[by];
    const int lane = threadIdx.x & 31;
    const int c = FEATURES * (bx * WARPS + (threadIdx.x >> 5));
    if (c >= hidden) return;
    const bool second = c + 1 < hidden;
    const __half* w0 = reinterpret_cast<const __half*>(g.down) + (size_t)c * inter;
    const __half* w1 = second ? w0 + inter : w0;
    for (int i0 = 0; i0 < (int)g.count; i0 += MS) {
        const int mr = min(MS, (int)g.count - i0);
        const float* xr[MS];
        float a0[MS][8], a1[MS][8];
#pragma unroll
        for (int m = 0; m < MS; ++m) xr[m] = h + (size_t)(g.first + i0 + min(m, mr - 1)) * inter;
        split_items<MS>(w0, w1, xr, mr, inter, lane, a0, a1);
#pragma unroll
        for (int m = 0; m < MS; ++m) {
            if (m < mr) {
                const float s0 = split_sum(a0[m], lane);
                const float s1 = split_sum(a1[m], lane);
                if (lane == 0) {
                    const size_t item = g.first + i0 + m;
                    const float wt = item_weight[item];
                    out[item * hidden + c] = wt * s0;
                    if (second) out[item * hidden + c + 1] = wt * s1;
                }
            }
        }
    }
}

// moe_down_block for groups of one item at a time with DOWN_FEATURES_ONE features per warp:
// warp w of work block (bx, by) of (ceil(hidden / (DOWN_FEATURES_ONE * WARPS)), groups) owns
// group by's features c = DOWN_FEATURES_ONE * (bx * WARPS + w) onwards. More weight bytes in
// flight per warp than two features give (the down rows are only inter long); each output has
// moe_down_block's arithmetic.
// UNR: pieces in flight per feature (the arithmetic does not depend on it). EARLY: the first
// pieces load before `wait`, which must return once h is ready to read.
template <int UNR = DOWN_UNROLL_ONE, bool EARLY = false, class Wait = GridWait>
__device__ __forceinline__ void moe_down_block_1(const float* h, int hidden, int inter,
                                                 const ExpertGroup* groups,
                                                 const float* item_weight,
                                                 float* __restrict__ out, int bx, int by,
                                                 Wait wait = Wait()) {
    const ExpertGroup g = groups[by];
    const int lane = threadIdx.x & 31;
    const int c = DOWN_FEATURES_ONE * (bx * WARPS + (threadIdx.x >> 5));
    if (c >= hidden) return;
    const __half* w[DOWN_FEATURES_ONE];
#pragma unroll
    for (int f = 0; f < DOWN_FEATURES_ONE; ++f) {
        // Past the last feature the warp recomputes it and stores it once.
        w[f] = reinterpret_cast<const __half*>(g.down) + (size_t)min(c + f, hidden - 1) * inter;
    }
    for (int i = 0; i < (int)g.count; ++i) {
        const size_t item = g.first + i;
        float a[DOWN_FEATURES_ONE][8];
#pragma unroll
        for (int f = 0; f < DOWN_FEATURES_ONE; ++f) {
#pragma unroll
            for (int e = 0; e < 8; ++e) a[f][e] = 0.0f;
        }
        if (EARLY && i == 0) {
            lane_dotn_split<DOWN_FEATURES_ONE, UNR, true>(w, h + item * inter, inter, lane, a, wait);
        } else {
            lane_dotn_split<DOWN_FEATURES_ONE, UNR>(w, h + item * inter, inter, lane, a);
        }
        const float wt = item_weight[item];
#pragma unroll
        for (int f = 0; f < DOWN_FEATURES_ONE; ++f) {
            const float s = split_sum(a[f], lane);
            if (lane == 0 && c + f < hidden) out[item * hidden + c + f] = wt * s;
        }
    }
}

// Asks L2 for the gate and up rows of feature j (none past inter).
__device__ __forceinline__ void gate_up_prefetch(const __half* SPX_READONLY w, int k, int inter, int j) {
    if (j < inter) {
        const int lane = threadIdx.x & 31;
        spx_prefetch_l2(w + (size_t)j * k, (size_t)k * sizeof(__half), lane);
        spx_prefetch_l2(w + (size_t)(inter + j) * k, (size_t)k * sizeof(__half), lane);
    }
}

// Work blocks first, first + stride, ... below ceil(inter / WARPS) feature blocks times
// row_groups(rows) (ONE: feature blocks) of gate_up_silu_feature: warp w of work block v computes
// feature (v / groups) * WARPS + w over row group v % groups.
template <bool ONE = false>
__device__ __forceinline__ void gate_up_silu_blocks(const float* x, int rows, int k,
                                                    const __half* SPX_READONLY w, int inter,
                                                    float* __restrict__ h, int first, int stride) {
    const int warp = threadIdx.x >> 5;
    const int groups = ONE ? 1 : row_groups(rows);
    const int per = ONE ? rows : work_rows(rows);
    const int blocks = (inter + WARPS - 1) / WARPS * groups;
    for (int v = first; v < blocks; v += stride) {
        gate_up_prefetch(w, k, inter, (v + stride) / groups * WARPS + warp);
        const int r0 = ONE ? 0 : (v % groups) * per;
        gate_up_silu_feature<ONE>(x, r0, min(rows, r0 + per), k, w, inter, h, v / groups * WARPS + warp);
    }
}

// Block: 32 * WARPS; any grid.
extern "C" __global__ void __launch_bounds__(32 * WARPS) gate_up_silu_f16(
    const float* x, int rows, int k, const __half* SPX_READONLY w, int inter,
    float* __restrict__ h) {
    spx_launch_dependents();
    gate_up_silu_blocks(x, rows, k, w, inter, h, blockIdx.x, gridDim.x);
}

// An MoE layer's routing and work list (route_plan, kernels/routing.cu) and its ungated shared
// experts' gate/up (gate_up_silu_f16) in one launch, for few rows: block 0 routes and builds the
// list while the other blocks compute h_shared[rows, inter_shared] from x, which needs no
// routing, so the shared experts' weights stream while the routing's latency chain runs. Each
// part has its own kernel's arithmetic. route_plan_shared_f16_1: the same for one row, whose
// shared gate/up holds no registers for other rows (more blocks fit on a multiprocessor).
// Grid: at least 2 blocks of 32 * WARPS threads.
#define ROUTE_PLAN_SHARED_KERNEL(SUFFIX, ONE)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) route_plan_shared_f16##SUFFIX(                    \
        const float* logits, int experts, int top_k, int renormalize, float scale,                             \
        unsigned* __restrict__ ids, float* __restrict__ weights, int rows, const ExpertGroup* SPX_READONLY table, \
        int max_groups, ExpertGroup* __restrict__ groups, unsigned* __restrict__ item_row,                     \
        float* __restrict__ item_weight, unsigned* __restrict__ row_items, const float* x, int k,              \
        const __half* SPX_READONLY w_shared, int inter_shared, float* __restrict__ h_shared) {                 \
        spx_launch_dependents();                                                                               \
        if (blockIdx.x == 0) {                                                                                 \
            spx_grid_wait();                                                                                   \
            route_plan_block<WARPS>(logits, experts, top_k, renormalize, scale, ids, weights, rows, table,     \
                                    max_groups, groups, item_row, item_weight, row_items);                     \
        } else {                                                                                               \
            gate_up_silu_blocks<ONE>(x, rows, k, w_shared, inter_shared, h_shared, blockIdx.x - 1,             \
                                     gridDim.x - 1);                                                           \
        }                                                                                                      \
    }

ROUTE_PLAN_SHARED_KERNEL(, false)
ROUTE_PLAN_SHARED_KERNEL(_1, true)

// The grouped kernels run work blocks v = by * gx + bx (group by, then its features) in
// grid-stride loops (without the next block's prefetch: the host gives the one-item forms a
// block per work block, and the others' weights serve several items). The _1 kernels take
// groups' items one at a time (decode: every group holds one item). Block: 32 * WARPS; any grid.
// moe_f16_down_shared: moe_f16_down over the routed work blocks (gx per group), then the shared
// experts' down product y_shared[rows, hidden] = h_shared @ w_down^T as linear_f16 computes it
// (its work blocks; the _1 form one row at a time, the same bits). The one-item down kernels
// follow the macros.
#define MOE_F16_GATE_UP_KERNEL(SUFFIX, MS)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_f16_gate_up##SUFFIX(                   \
        const float* x, int hidden, int inter, const ExpertGroup* groups,                               \
        int num_groups, const unsigned* item_row, float* __restrict__ h) {                              \
        SPX_PROLOGUE();                                                                                 \
        const int gx = (inter + WARPS - 1) / WARPS, blocks = gx * num_groups;                           \
        for (int v = blockIdx.x; v < blocks; v += gridDim.x) {                                          \
            moe_gate_up_block<MS>(x, hidden, inter, groups, item_row, h, v % gx, v / gx);               \
        }                                                                                               \
    }

#define MOE_F16_DOWN_KERNELS(SUFFIX, MS)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_f16_down##SUFFIX(                      \
        const float* h, int hidden, int inter, const ExpertGroup* groups,                               \
        int num_groups, const float* item_weight, float* __restrict__ out) {                            \
        SPX_PROLOGUE();                                                                                 \
        const int gx = (hidden + FEATURES * WARPS - 1) / (FEATURES * WARPS), blocks = gx * num_groups;  \
        for (int v = blockIdx.x; v < blocks; v += gridDim.x) {                                          \
            moe_down_block<MS>(h, hidden, inter, groups, item_weight, out, v % gx, v / gx);             \
        }                                                                                               \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_f16_down_shared##SUFFIX(               \
        const float* h, int hidden, int inter, const ExpertGroup* groups,                               \
        int num_groups, const float* item_weight, float* __restrict__ out,                              \
        const float* h_shared, int rows, int inter_shared, const __half* SPX_READONLY w_down,           \
        float* __restrict__ y_shared) {                                                                 \
        spx_launch_dependents();                                                                        \
        const int gx = (hidden + FEATURES * WARPS - 1) / (FEATURES * WARPS);                            \
        const int routed = gx * num_groups, blocks = routed + linear_work<false>(rows, hidden);         \
        for (int v = blockIdx.x; v < blocks; v += gridDim.x) {                                          \
            if (v < routed) {                                                                           \
                spx_grid_wait();                                                                        \
                moe_down_block<MS>(h, hidden, inter, groups, item_weight, out, v % gx, v / gx);         \
            } else {                                                                                    \
                linear_block<false>(h_shared, rows, inter_shared, w_down, hidden, nullptr, y_shared,    \
                                    v - routed);                                                        \
            }                                                                                           \
        }                                                                                               \
    }

MOE_F16_GATE_UP_KERNEL(, MR_SPLIT)
MOE_F16_GATE_UP_KERNEL(_1, 1)
MOE_F16_DOWN_KERNELS(, MR_SPLIT)

// The one-item forms of the down kernels: routed work blocks of DOWN_FEATURES_ONE features a warp
// (moe_down_block_1), gx1 = ceil(hidden / (DOWN_FEATURES_ONE * WARPS)) per group. In
// moe_f16_down_shared_1 the shared experts' down product comes first, as gx = ceil(hidden /
// (FEATURES * WARPS)) work blocks of linear_block<true> (the first blocks dispatched): its
// weights need no routing, so they load their first pieces before the wait (linear_block's
// EARLY), during the routed gate/up's last blocks.
extern "C" __global__ void __launch_bounds__(32 * WARPS, DOWN_MIN_BLOCKS_ONE) moe_f16_down_1(
    const float* h, int hidden, int inter, const ExpertGroup* groups,
    int num_groups, const float* item_weight, float* __restrict__ out) {
    SPX_PROLOGUE();
    const int gx1 = (hidden + DOWN_FEATURES_ONE * WARPS - 1) / (DOWN_FEATURES_ONE * WARPS);
    const int blocks = gx1 * num_groups;
    for (int v = blockIdx.x; v < blocks; v += gridDim.x) {
        moe_down_block_1(h, hidden, inter, groups, item_weight, out, v % gx1, v / gx1);
    }
}
extern "C" __global__ void __launch_bounds__(32 * WARPS, DOWN_MIN_BLOCKS_ONE) moe_f16_down_shared_1(
    const float* h, int hidden, int inter, const ExpertGroup* groups,
    int num_groups, const float* item_weight, float* __restrict__ out,
    const float* h_shared, int rows, int inter_shared, const __half* SPX_READONLY w_down,
    float* __restrict__ y_shared) {
    spx_launch_dependents();
    const int gx1 = (hidden + DOWN_FEATURES_ONE * WARPS - 1) / (DOWN_FEATURES_ONE * WARPS);
    const int gx = (hidden + FEATURES * WARPS - 1) / (FEATURES * WARPS);
    const int blocks = gx + gx1 * num_groups;
    // The shared rows first, then the routed ones: two loops, so the two kinds of work never hold
    // registers at once.
    const int stride = gridDim.x;
    int v = blockIdx.x;
    for (; v < gx; v += stride) {
        linear_block<true, true>(h_shared, rows, inter_shared, w_down, hidden, nullptr, y_shared, v);
    }
    if (v >= blocks) return;
    spx_grid_wait();
    for (; v < blocks; v += stride) {
        moe_down_block_1(h, hidden, inter, groups, item_weight, out, (v - gx) % gx1, (v - gx) / gx1);
    }
}

// ---------------------------------------------------------------------------------------------
// moe_f16_experts_1: a one-row MoE layer's experts in one launch, which moe_f16_gate_up_1,
// moe_f16_down_shared_1 and moe_combine run in three: the shared experts' down product, every
// routed expert's gate/up and down, and the combine y = sum of the row's items' outputs (ascending
// item, as moe_combine) + the shared output. Each work block runs the code of the launch it comes
// from, so every output has that launch's bits.
//
// Why one launch: between dependent launches every multiprocessor drains the first launch's last
// blocks before the next one's start reading. Here a routed down block waits only for the gate/up
// blocks of its own expert, and the combine of 16 outputs runs in the last group's routed down
// block for them. The routing and the shared gate/up stay in the launch before
// (route_plan_shared_f16_1), whose blocks load their first weights before their wait.
//
// Grid: gs + (gx + gx1) num_groups blocks of 32 * WARPS threads (below). Inputs: x (one row of
// hidden), the groups (at most one item each, 1 <= num_groups <= MAX_TOP_K), item_row,
// item_weight, h_shared (the shared gate/up's output), w_down, row_items, the counter slot.
// Outputs: h and out (the items' activations and outputs), y_shared, y. Numerics: each output
// has the bits of the separate launch it stands for (moe_f16_gate_up_1, moe_f16_down_shared_1,
// moe_combine), whatever the order blocks run in.
//
// Order and progress. A block takes a ticket from a counter when it starts and runs that work
// block: tickets [0, gs) the shared down's (their first weights load before the wait for the
// routing launch, as in moe_f16_down_shared_1), then the routed gate/up's (gx per group, each
// two work blocks of moe_f16_gate_up_1), then the routed down's (gx1 per group, group by
// group). A routed down block waits for its group's gate/up blocks, and the last group's, which
// combine, then wait for the other blocks of their chunk (the other groups' and the shared
// down's): every block waited on has a lower ticket and waits only for blocks of lower tickets
// still, so every wait ends, however many blocks are resident.
//
// Counters: EXPERTS_ONE_ARRIVED + gx1 u32 a launch, zero when it starts; the block that counts
// the last combine's wait done sets them back to zero (the backend zeroes the buffer once and
// gives consecutive launches different slots: src/backend/cuda/runtime/launch_constants.rs,
// EXPERTS_ONE_SLOTS). By then every block has taken its ticket and made its last signal: every
// chunk's combine has waited for a routed down block of each group, which waited for all of its
// group's gate/up blocks, and for the chunk's shared down blocks. Words: the ticket, combines
// past their wait, gate/up blocks done per group (MAX_TOP_K), then arrivals per 16-output chunk
// of the combine. Signals are release reductions after a block barrier (no block waits for its
// signal's answer before ending); a wait acquires once its count is reached, and the combine
// reads past L1. A slot must not be taken again while its previous launch runs: see
// EXPERTS_ONE_SLOTS in src/backend/cuda/runtime/launch_constants.rs.

#define EXPERTS_ONE_TICKET 0
#define EXPERTS_ONE_COMBINED 1
#define EXPERTS_ONE_DONE 2
// EXPERTS_ONE_ARRIVED (the host's table): the first word of the arrivals per chunk.
static_assert(EXPERTS_ONE_ARRIVED == EXPERTS_ONE_DONE + MAX_TOP_K, "a done count per group");
// Pieces in flight per feature of the routed down blocks here: the launch holds every role at
// 128 registers (four blocks a multiprocessor, as moe_f16_gate_up_1), which moe_down_block_1's
// DOWN_UNROLL_ONE exceeds. The same arithmetic.
#define EXPERTS_ONE_DOWN_UNROLL 3
// EXPERTS_ONE_GATE_UP_WORK (the host's table): routed gate/up work blocks a block of the launch
// runs, one after the other, the second's weights asked of L2 before the first's loads.

// Counter operations at GPU scope. Waits poll with relaxed loads and acquire once, by a fence,
// after the count is reached: an acquire invalidates the multiprocessor's L1 (CCTL.IVALL), where
// the other blocks' warps keep the activation row they all read, so the poll itself is relaxed.
__device__ __forceinline__ unsigned spx_load_relaxed(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void spx_fence_acq_rel() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ void spx_add_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned spx_fetch_add_release(unsigned* p, unsigned v) {
    unsigned old;
    asm volatile("atom.release.gpu.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// A wait until a counter reaches `want`: a routed down warp's for its group's gate/up blocks, a
// combine's for the other blocks of its chunk.
struct CountWait {
    const unsigned* done;
    unsigned want;
    __device__ __forceinline__ void operator()() const {
        while (spx_load_relaxed(done) < want) __nanosleep(32);
        spx_fence_acq_rel();
    }
};

// Grid: gs + (gx + gx1) num_groups blocks of 32 * WARPS threads (gs = ceil(hidden / (FEATURES *
// WARPS)), gx = ceil(ceil(inter / WARPS) / EXPERTS_ONE_GATE_UP_WORK), gx1 = ceil(hidden /
// (DOWN_FEATURES_ONE * WARPS))); groups of at most one item; 1 <= num_groups <= MAX_TOP_K;
// `counters` as above.
extern "C" __global__ void __launch_bounds__(32 * WARPS, 4) moe_f16_experts_1(
    const float* x, int hidden, int inter, const ExpertGroup* groups, int num_groups,
    const unsigned* item_row, float* h, const float* item_weight, float* out,
    const float* h_shared, int inter_shared, const __half* SPX_READONLY w_down, float* y_shared,
    const unsigned* row_items, int top_k, float* __restrict__ y, unsigned* counters) {
    __shared__ unsigned ticket;
    spx_launch_dependents();
    if (threadIdx.x == 0) ticket = atomicAdd(counters + EXPERTS_ONE_TICKET, 1u);
    __syncthreads();
    const int v = (int)ticket;
    const int gs = (hidden + FEATURES * WARPS - 1) / (FEATURES * WARPS);
    const int gw = (inter + WARPS - 1) / WARPS;
    const int gx = (gw + EXPERTS_ONE_GATE_UP_WORK - 1) / EXPERTS_ONE_GATE_UP_WORK;
    const int gx1 = (hidden + DOWN_FEATURES_ONE * WARPS - 1) / (DOWN_FEATURES_ONE * WARPS);
    const int gate_up_end = gs + gx * num_groups;
    const int total = gate_up_end + gx1 * num_groups;
    if (v >= total) return;  // not with the grid above
    // The combine chunk (16 outputs: two shared down blocks, one routed down block per group)
    // this shared or routed down block computes outputs of.
    int chunk = 0;
    bool combines = false;
    if (v < gs) {
        linear_block<true, true>(h_shared, 1, inter_shared, w_down, hidden, nullptr, y_shared, v);
        chunk = v / 2;
    } else if (v < gate_up_end) {
        static_assert(EXPERTS_ONE_GATE_UP_WORK == 2, "the two work blocks below");
        spx_grid_wait();
        const int by = (v - gs) / gx, b0 = (v - gs) % gx * EXPERTS_ONE_GATE_UP_WORK;
        const bool second = b0 + 1 < gw;
        if (second) {
            gate_up_prefetch(reinterpret_cast<const __half*>(groups[by].gate_up), hidden, inter,
                             (b0 + 1) * WARPS + (int)(threadIdx.x >> 5));
        }
        moe_gate_up_block<1>(x, hidden, inter, groups, item_row, h, b0, by);
        if (second) moe_gate_up_block<1>(x, hidden, inter, groups, item_row, h, b0 + 1, by);
        __syncthreads();
        if (threadIdx.x == 0) spx_add_release(counters + EXPERTS_ONE_DONE + by, 1u);
        return;
    } else {
        spx_grid_wait();
        const int d = v - gate_up_end;
        const CountWait wait{counters + EXPERTS_ONE_DONE + d / gx1, (unsigned)gx};
        moe_down_block_1<EXPERTS_ONE_DOWN_UNROLL, true>(h, hidden, inter, groups, item_weight,
                                                        out, d % gx1, d / gx1, wait);
        chunk = d % gx1;
        combines = d / gx1 == num_groups - 1;
    }
    __syncthreads();
    if (!combines) {
        if (threadIdx.x == 0) {
            spx_add_release(counters + EXPERTS_ONE_ARRIVED + chunk, 1u);
        }
        return;
    }
    if (threadIdx.x == 0) {
        const CountWait arrived{counters + EXPERTS_ONE_ARRIVED + chunk,
                                (unsigned)(num_groups - 1 + min(2, gs - 2 * chunk))};
        arrived();
    }
    __syncthreads();
    if (threadIdx.x < 2 * FEATURES * WARPS) {
        const int c = 2 * FEATURES * WARPS * chunk + threadIdx.x;
        if (c < hidden) {
            float acc = 0.0f;
            for (int j = 0; j < top_k; ++j) acc += __ldcg(out + (size_t)row_items[j] * hidden + c);
            acc = acc + __ldcg(y_shared + c);
            y[c] = acc;
        }
    } else if (threadIdx.x == 32 &&
               spx_fetch_add_release(counters + EXPERTS_ONE_COMBINED, 1u) + 1u == (unsigned)gx1) {
        // Every block has taken its ticket and made its signals, and every combine has passed its
        // wait: back to zero for the next launch (beside this block's combine, which reads no
        // counter).
        spx_fence_acq_rel();
        const int words = EXPERTS_ONE_ARRIVED + gx1;
        for (int i = 0; i < words; ++i) counters[i] = 0u;
    }
}
