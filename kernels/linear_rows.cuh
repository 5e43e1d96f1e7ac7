// The dense one-warp-two-features products of kernels/gemv_f16.cu that other kernel files run
// too: lane_dot2 (a lane's partials of two weight rows against up to MR activation rows) and
// linear_block (one work block of y = x @ w^T). Spliced into each including file by build.rs,
// like common.cuh, which the file includes first (with <cuda_fp16.h>). kernels/moe_int4.cu runs
// linear_block for the shared experts' down product inside the INT4 gate/up launch, with the
// arithmetic linear_f16_1 gives it.

#ifndef SPECTER_KERNELS_LINEAR_ROWS_CUH
#define SPECTER_KERNELS_LINEAR_ROWS_CUH

#if !defined(WARPS) || !defined(FEATURES) || !defined(WORK_ROWS)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif

// From the host's table: WARPS, warps per block; FEATURES, output features per warp of
// linear_f16 and moe_f16_down (the rows w0 and w1 below); WORK_ROWS, the most rows one warp of
// the several-row dense kernels (linear_f16, linear2_f16, gate_up_silu_f16 and the shared
// experts' products) takes: a work block is (a block of features, a group of at most WORK_ROWS
// rows; see work_rows), so a verification window's rows run in parallel warps that read the same
// weights (DRAM once, L2 after) instead of one after another in each warp.
#define MR WORK_ROWS
// 16-byte pieces of each weight row in flight per lane. (Narrower groups could take more, but
// registers are allocated for the widest group's code: 4 keeps every kernel at <= 168 registers,
// three 128-thread blocks per SM.)
#define UNROLL 4
// The one-row kernels (*_1, decode) hold no accumulators for other rows: their registers go to
// twice the pieces in flight, the same arithmetic in the same order.
#define UNROLL_ONE 8

__device__ __forceinline__ void halves_to_floats(const uint4& v, float f[8]) {
    const __half2* h2 = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const float2 t = __half22float2(h2[p]);
        f[2 * p] = t.x;
        f[2 * p + 1] = t.y;
    }
}

__device__ __forceinline__ float dot8(const float w[8], const float* xp, float s) {
    const float4 a = reinterpret_cast<const float4*>(xp)[0];
    const float4 b = reinterpret_cast<const float4*>(xp)[1];
    s = fmaf(w[0], a.x, s);
    s = fmaf(w[1], a.y, s);
    s = fmaf(w[2], a.z, s);
    s = fmaf(w[3], a.w, s);
    s = fmaf(w[4], b.x, s);
    s = fmaf(w[5], b.y, s);
    s = fmaf(w[6], b.z, s);
    s = fmaf(w[7], b.w, s);
    return s;
}

// What lane_dot2's EARLY waits for by default: the previous kernels' completion.
struct GridWait {
    __device__ __forceinline__ void operator()() const { spx_grid_wait(); }
};

// a0[m] += x[m] . w0 and a1[m] += x[m] . w1 (lane partials) over k inputs, for m < min(MT, mr).
// `xr[m]` points at row m of x. Vector path when k is a multiple of 8 (16-byte aligned rows),
// scalar otherwise; both give each (row, feature) the same order whatever MT is. EARLY: the
// caller has not waited for the previous kernels (spx_grid_wait); the lane issues its first
// pieces' loads, then calls `wait`, then reads x. Where to use it: see linear_block. A `wait`
// that also fills x (mla_kv_append_1, kernels/ops.cu) may use the whole warp: with k a multiple
// of 8 and at least 256, every lane calls it at the same point.
template <int MT, int UNR = UNROLL, bool EARLY = false, class Wait = GridWait>
__device__ __forceinline__ void lane_dot2(const __half* SPX_READONLY w0, const __half* SPX_READONLY w1,
                                          const float* const* xr, int mr, int k, int lane, float a0[MR],
                                          float a1[MR], Wait wait = Wait()) {
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
            if (EARLY && c0 == lane) wait();
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
                            const float* xp = xr[m] + 8 * c;
                            a0[m] = dot8(f0, xp, a0[m]);
                            a1[m] = dot8(f1, xp, a1[m]);
                        }
                    }
                }
            }
        }
        // A lane with no pieces still waits: its caller writes the outputs after this returns.
        if (EARLY && lane >= chunks) wait();
    } else {
        if (EARLY) wait();
        for (int i = lane; i < k; i += 32) {
            const float f0 = __half2float(w0[i]), f1 = __half2float(w1[i]);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m < mr) {
                    const float xv = xr[m][i];
                    a0[m] = fmaf(f0, xv, a0[m]);
                    a1[m] = fmaf(f1, xv, a1[m]);
                }
            }
        }
    }
}

// One group of mr <= MR rows: narrowest instantiation that holds them.
__device__ __forceinline__ void group_dot2(const __half* SPX_READONLY w0, const __half* SPX_READONLY w1,
                                           const float* const* xr, int mr, int k, int lane, float a0[MR],
                                           float a1[MR]) {
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        a0[m] = 0.0f;
        a1[m] = 0.0f;
    }
    if (mr == 1) {
        lane_dot2<1>(w0, w1, xr, mr, k, lane, a0, a1);
    } else if (mr == 2) {
        lane_dot2<2>(w0, w1, xr, mr, k, lane, a0, a1);
    } else {
        lane_dot2<MR>(w0, w1, xr, mr, k, lane, a0, a1);
    }
}

// Rows a work block of the several-row dense kernels takes: all of them up to 2, pairs up to 4,
// then WORK_ROWS. Parallelism only: a (row, feature)'s arithmetic does not depend on its group.
// The host sizes grids by the same rule (src/backend/cuda/runtime/kernels.rs, `work_rows`).
__device__ __forceinline__ int work_rows(int rows) {
    return rows <= 2 ? max(rows, 1) : (rows <= 4 ? 2 : WORK_ROWS);
}

__device__ __forceinline__ int row_groups(int rows) {
    const int g = work_rows(rows);
    return (rows + g - 1) / g;
}

// Work block `work` of y[rows, n] = x[rows, k] @ w[n, k]^T (+ bias[n]): feature block
// b = work / row_groups(rows), whose warp w owns features FEATURES * (b * WARPS + w) and the next,
// over row group work % row_groups(rows). ONE: every row, one at a time (lane_dot2<1>, as
// group_dot2 runs a group of one), with more pieces in flight; its work blocks are feature blocks.
// ONE and EARLY: the warp's first pieces of weights are loaded before it waits for the previous
// kernels (lane_dot2's EARLY; the same bits). For the one-row dense products, which follow glue
// kernels (norms, attention, MLA's latent step) that launch them only after their own wait
// (SPX_PROLOGUE_LATE): the reads then overlap the glue kernel, which reads little from DRAM,
// and not an earlier product's stream. Also for the shared experts' down rows of
// moe_f16_down_shared_1, whose blocks start as the routed gate/up's last ones drain.
template <bool ONE, bool EARLY = false>
__device__ __forceinline__ void linear_block(const float* x, int rows, int k,
                                             const __half* SPX_READONLY w, int n,
                                             const __half* SPX_READONLY bias, float* __restrict__ y,
                                             int work) {
    const int lane = threadIdx.x & 31;
    const int groups = ONE ? 1 : row_groups(rows);
    const int block = work / groups;
    const int col = FEATURES * (block * WARPS + (threadIdx.x >> 5));
    if (col >= n) return;
    const bool second = col + 1 < n;
    const __half* w0 = w + (size_t)col * k;
    // Without a second feature the warp computes the first twice and stores it once.
    const __half* w1 = second ? w0 + k : w0;
    if (!(ONE && EARLY)) spx_grid_wait();
    const float b0 = bias ? __half2float(bias[col]) : 0.0f;
    const float b1 = bias && second ? __half2float(bias[col + 1]) : 0.0f;
    constexpr int M = ONE ? 1 : MR;
    const int per = ONE ? 1 : work_rows(rows);
    const int first = ONE ? 0 : (work % groups) * per;
    const int last = ONE ? rows : min(rows, first + per);
    for (int r0 = first; r0 < last; r0 += M) {
        const int mr = min(M, last - r0);
        const float* xr[M];
        float a0[M], a1[M];
#pragma unroll
        for (int m = 0; m < M; ++m) xr[m] = x + (size_t)(r0 + min(m, mr - 1)) * k;
        if (ONE) {
            a0[0] = 0.0f;
            a1[0] = 0.0f;
            lane_dot2<1, UNROLL_ONE, EARLY>(w0, w1, xr, 1, k, lane, a0, a1);
        } else {
            group_dot2(w0, w1, xr, mr, k, lane, a0, a1);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m < mr) {
                const float s0 = warp_sum(a0[m]);
                const float s1 = warp_sum(a1[m]);
                if (lane == 0) {
                    float* yr = y + (size_t)(r0 + m) * n + col;
                    yr[0] = bias ? s0 + b0 : s0;
                    if (second) yr[1] = bias ? s1 + b1 : s1;
                }
            }
        }
    }
}


#endif  // SPECTER_KERNELS_LINEAR_ROWS_CUH
