// FP16-weight matrix products for f32 activations of few rows (decode, verification windows, short
// prompts): plain linear layers and the grouped routed-expert FFN (see src/backend/cuda/experts.rs).
//
// One warp owns one output feature: its lanes stream the weight row in 16-byte pieces (8 halves),
// each lane accumulating, for up to 8 activation rows at once, in f32 with one fixed order; the 32
// partial sums are then combined by a fixed shuffle tree. A row's result therefore never depends
// on how many rows share the launch (the backend's exactness contract), and each weight byte is
// read once per group of 8 rows.

#include <cuda_fp16.h>

#define WARPS 8
#define MR 8
#define UNROLL 4

struct ExpertGroup {
    unsigned long long gate_up;
    unsigned long long gate_up_scales;
    unsigned long long down;
    unsigned long long down_scales;
    unsigned first;
    unsigned count;
};

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// acc[m] (lane-partial) += x[m] . w over k inputs, for m < mr. `xr[m]` points at row m of x.
// Vector path when k is a multiple of 8 (16-byte aligned rows), scalar otherwise.
__device__ __forceinline__ void lane_dot(const __half* __restrict__ w, const float* const* xr, int mr, int k,
                                         int lane, float acc[MR]) {
    if ((k & 7) == 0) {
        const int chunks = k >> 3;
        const uint4* w4 = reinterpret_cast<const uint4*>(w);
        for (int c0 = lane; c0 < chunks; c0 += 32 * UNROLL) {
            uint4 wv[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = c0 + 32 * u;
                if (c < chunks) wv[u] = __ldg(w4 + c);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = c0 + 32 * u;
                if (c < chunks) {
                    const __half2* h2 = reinterpret_cast<const __half2*>(&wv[u]);
                    float wf[8];
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        const float2 f = __half22float2(h2[p]);
                        wf[2 * p] = f.x;
                        wf[2 * p + 1] = f.y;
                    }
#pragma unroll
                    for (int m = 0; m < MR; ++m) {
                        if (m < mr) {
                            const float4* xp = reinterpret_cast<const float4*>(xr[m] + 8 * c);
                            const float4 a = xp[0], b = xp[1];
                            float s = acc[m];
                            s = fmaf(wf[0], a.x, s);
                            s = fmaf(wf[1], a.y, s);
                            s = fmaf(wf[2], a.z, s);
                            s = fmaf(wf[3], a.w, s);
                            s = fmaf(wf[4], b.x, s);
                            s = fmaf(wf[5], b.y, s);
                            s = fmaf(wf[6], b.z, s);
                            s = fmaf(wf[7], b.w, s);
                            acc[m] = s;
                        }
                    }
                }
            }
        }
    } else {
        for (int i = lane; i < k; i += 32) {
            const float wf = __half2float(w[i]);
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                if (m < mr) acc[m] = fmaf(wf, xr[m][i], acc[m]);
            }
        }
    }
}

// y[rows, n] = x[rows, k] @ w[n, k]^T (+ bias[n]). Grid: ceil(n / WARPS); block: 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS) linear_f16(
    const float* __restrict__ x, int rows, int k, const __half* __restrict__ w, int n,
    const __half* __restrict__ bias, float* __restrict__ y) {
    const int lane = threadIdx.x & 31;
    const int col = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (col >= n) return;
    const __half* wr = w + (size_t)col * k;
    const float b = bias ? __half2float(bias[col]) : 0.0f;
    for (int r0 = 0; r0 < rows; r0 += MR) {
        const int mr = min(MR, rows - r0);
        const float* xr[MR];
        float acc[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            xr[m] = x + (size_t)(r0 + min(m, mr - 1)) * k;
            acc[m] = 0.0f;
        }
        lane_dot(wr, xr, mr, k, lane, acc);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            const float s = warp_sum(acc[m]);
            if (lane == 0 && m < mr) y[(size_t)(r0 + m) * n + col] = bias ? s + b : s;
        }
    }
}

// Grouped gate/up: h[item][j] = silu(x[row] . gate[j]) * (x[row] . up[j]).
// Grid: (ceil(inter / WARPS), groups); block: 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_f16_gate_up(
    const float* __restrict__ x, int hidden, int inter, const ExpertGroup* __restrict__ groups,
    const unsigned* __restrict__ item_row, float* __restrict__ h) {
    const ExpertGroup g = groups[blockIdx.y];
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (j >= inter) return;
    const __half* wg = reinterpret_cast<const __half*>(g.gate_up) + (size_t)j * hidden;
    const __half* wu = reinterpret_cast<const __half*>(g.gate_up) + (size_t)(inter + j) * hidden;
    for (int i0 = 0; i0 < (int)g.count; i0 += MR) {
        const int mr = min(MR, (int)g.count - i0);
        const float* xr[MR];
        float a[MR], b[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            xr[m] = x + (size_t)item_row[g.first + i0 + min(m, mr - 1)] * hidden;
            a[m] = 0.0f;
            b[m] = 0.0f;
        }
        lane_dot(wg, xr, mr, hidden, lane, a);
        lane_dot(wu, xr, mr, hidden, lane, b);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            const float ga = warp_sum(a[m]);
            const float ub = warp_sum(b[m]);
            if (lane == 0 && m < mr) {
                h[(size_t)(g.first + i0 + m) * inter + j] = ga / (1.0f + expf(-ga)) * ub;
            }
        }
    }
}

// Grouped down: out[item][c] = weight[item] * (h[item] . down[c]).
// Grid: (ceil(hidden / WARPS), groups); block: 32 * WARPS.
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe_f16_down(
    const float* __restrict__ h, int hidden, int inter, const ExpertGroup* __restrict__ groups,
    const float* __restrict__ item_weight, float* __restrict__ out) {
    const ExpertGroup g = groups[blockIdx.y];
    const int lane = threadIdx.x & 31;
    const int c = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (c >= hidden) return;
    const __half* wd = reinterpret_cast<const __half*>(g.down) + (size_t)c * inter;
    for (int i0 = 0; i0 < (int)g.count; i0 += MR) {
        const int mr = min(MR, (int)g.count - i0);
        const float* xr[MR];
        float acc[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            xr[m] = h + (size_t)(g.first + i0 + min(m, mr - 1)) * inter;
            acc[m] = 0.0f;
        }
        lane_dot(wd, xr, mr, inter, lane, acc);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            const float s = warp_sum(acc[m]);
            if (lane == 0 && m < mr) {
                const size_t item = g.first + i0 + m;
                out[item * hidden + c] = item_weight[item] * s;
            }
        }
    }
}
