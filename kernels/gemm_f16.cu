// Dense FP16-weight products of many rows on tensor cores: the prompt's pass (prefill), where a
// launch has hundreds or thousands of activation rows and the gemv kernels of gemv_f16.cu, which
// read each weight once per group of at most eight rows, are far from the device's arithmetic
// rate.
//
//   to_f16_rows: a[i] = (half)x[i], rounded to nearest even, for n values.
//   gemm_f16:    y[r][c] = sum_i a[r][i] * w[c][i]  (+ bias[c]),   r < m, c < n
//   moe_gather_f16, moe_gemm_gate_up_f16, moe_gemm_down_f16: the routed experts (see below).
//
// a is f16 [m][k] (the activation, converted once by to_f16_rows), w f16 [n][k] (a linear
// layer's weight as stored: one output feature's inputs contiguous), bias f16 [n] or null, y f32
// [m][n]. k is a multiple of GEMM_BK (the host refuses other shapes); m and n are any.
//
// Numerics: products of f16 operands, accumulated in f32 by mma.sync m16n8k16 in steps of 16
// inputs, ascending. The hardware's order inside one step is not specified, so these bits are
// not the gemv kernels' (which keep activations in f32 and fix their order): a row's result may
// differ in the last bits from the same row's one-row step. The backend runs this kernel for
// prompt passes alone, in every placement alike, so the tokens depend on neither placement nor
// mode (target-only and speculative decoding share the prefill). Activations are rounded to f16
// once (|x| above 65504 becomes infinite, as in f16 prefill on other engines).
//
// Work split: a block computes a GEMM_BM x GEMM_BN tile of y with 8 warps in 2 (rows) x 4
// (columns), each warp 64 x 32: 4 x 4 mma tiles, 64 f32 accumulators a thread. The k loop moves
// GEMM_BK inputs at a time through GEMM_STAGES shared-memory stages filled by cp.async (rows
// past m or n read as zeros), so the next tiles' loads are in flight while the current one
// computes. Shared rows of 32 halves (four 16-byte chunks) are stored with chunk c of row r at
// c ^ ((r >> 1) & 3): the eight rows an ldmatrix phase reads then fall in eight distinct bank
// groups. Alignment: a and w 16-byte aligned (k a multiple of 8 keeps every row so).

#include <cuda_fp16.h>

#include "common.cuh"

#include "mma.cuh"

#if !defined(GEMM_BM) || !defined(GEMM_BN) || !defined(GEMM_BK) || !defined(GEMM_STAGES) || !defined(GEMM_THREADS)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif
// The warp layout and the loads below are written for this tile.
static_assert(GEMM_BM == 128 && GEMM_BN == 128 && GEMM_BK == 32 && GEMM_THREADS == 256,
              "gemm_f16 is written for 128 x 128 tiles, 32-input steps and 8 warps");
static_assert(GEMM_STAGES >= 2, "the k loop needs at least two stages");

// Halves of one stage's tile of a (GEMM_BM rows) and of w (GEMM_BN rows).
#define GEMM_TILE_A (GEMM_BM * GEMM_BK)
#define GEMM_TILE_B (GEMM_BN * GEMM_BK)

extern "C" __global__ void to_f16_rows(const float* x, __half* __restrict__ a, unsigned long long n) {
    SPX_PROLOGUE();
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        a[i] = __float2half_rn(x[i]);
    }
}

// The 16-byte chunk index of (row, chunk) in a stage's tile (see the header's swizzle).
__device__ __forceinline__ unsigned gemm_chunk(unsigned row, unsigned chunk) {
    return row * (GEMM_BK / 8) + (chunk ^ ((row >> 1) & 3));
}

// Each thread's share of a stage's loads: chunk (threadIdx.x & 3) of tile rows
// (threadIdx.x >> 2) and (threadIdx.x >> 2) + 64, of a and of w. The rows' addresses at input 0,
// or null for a row past the operand's end (filled with zeros); `any` is a valid address that a
// zero fill names as its source without reading it.
struct GemmRows {
    const __half* a[2];
    const __half* w[2];
    const __half* any;
};

// Stage <- inputs k0 .. k0 + GEMM_BK of the thread's rows.
__device__ __forceinline__ void gemm_load(__half* sa, __half* sb, const GemmRows& r, int k0) {
    const unsigned ch = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned row = (threadIdx.x >> 2) + 64 * i;
        const __half* a = r.a[i];
        const __half* w = r.w[i];
        mma_cp16(sa + gemm_chunk(row, ch) * 8, a ? a + k0 + ch * 8 : r.any, a != nullptr);
        mma_cp16(sb + gemm_chunk(row, ch) * 8, w ? w + k0 + ch * 8 : r.any, w != nullptr);
    }
}

// acc (this warp's 64 x 32 share of the tile) = the tile's rows of a times its rows of w over k
// inputs, in the header's order.
__device__ __forceinline__ void gemm_mainloop(float acc[4][4][4], const GemmRows& r, int k) {
    __shared__ __align__(128) __half sa[GEMM_STAGES][GEMM_TILE_A];
    __shared__ __align__(128) __half sb[GEMM_STAGES][GEMM_TILE_B];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    const int tiles = k / GEMM_BK;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; ++s) {
        if (s < tiles) gemm_load(sa[s], sb[s], r, s * GEMM_BK);
        mma_commit();
    }
    for (int t = 0; t < tiles; ++t) {
        // Tile t has landed; every warp is done with the stage the next load overwrites (the
        // one tile t - 1 used).
        mma_wait<GEMM_STAGES - 2>();
        __syncthreads();
        const int next = t + GEMM_STAGES - 1;
        if (next < tiles) gemm_load(sa[next % GEMM_STAGES], sb[next % GEMM_STAGES], r, next * GEMM_BK);
        mma_commit();
        const __half* ta = sa[t % GEMM_STAGES];
        const __half* tb = sb[t % GEMM_STAGES];
#pragma unroll
        for (int kk = 0; kk < GEMM_BK / 16; ++kk) {
            unsigned fa[4][4], fb[4][2];
#pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                // Matrices: rows 0-7 / 8-15 of inputs 0-7, then of inputs 8-15.
                const int row = wm + mt * 16 + (lane & 15);
                mma_ldmatrix4(fa[mt], ta + gemm_chunk(row, kk * 2 + (lane >> 4)) * 8);
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                // Matrices: features 0-7 of inputs 0-7 and 8-15, then features 8-15 of both.
                const int row = wn + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                unsigned q[4];
                mma_ldmatrix4(q, tb + gemm_chunk(row, kk * 2 + ((lane >> 3) & 1)) * 8);
                fb[np * 2][0] = q[0];
                fb[np * 2][1] = q[1];
                fb[np * 2 + 1][0] = q[2];
                fb[np * 2 + 1][1] = q[3];
            }
#pragma unroll
            for (int mt = 0; mt < 4; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_16816(acc[mt][nt], fa[mt], fb[nt][0], fb[nt][1]);
        }
    }
    mma_wait<0>();
}

// Accumulator e of this thread's tile (mt, nt) lies at tile row gemm_acc_row(mt, e) and column
// gemm_acc_col(nt, e).
__device__ __forceinline__ int gemm_acc_row(int mt, int e) {
    return ((threadIdx.x >> 5) >> 2) * 64 + mt * 16 + ((threadIdx.x & 31) >> 2) + 8 * (e >> 1);
}
__device__ __forceinline__ int gemm_acc_col(int nt, int e) {
    return ((threadIdx.x >> 5) & 3) * 32 + nt * 8 + 2 * (threadIdx.x & 3) + (e & 1);
}

// The thread's rows of a tile whose a rows are `a_rows` rows of k halves from `a` and whose w
// rows are `w_rows` rows of k halves from `w` (fewer than the tile's: zeros past them).
__device__ __forceinline__ GemmRows gemm_rows(const __half* a, int a_rows, const __half* w, int w_rows,
                                              int k) {
    GemmRows r;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = (threadIdx.x >> 2) + 64 * i;
        r.a[i] = row < a_rows ? a + (size_t)row * k : nullptr;
        r.w[i] = row < w_rows ? w + (size_t)row * k : nullptr;
    }
    r.any = w;
    return r;
}

// store(tile row, tile column, value) for each of the thread's accumulators.
template <class Store>
__device__ __forceinline__ void gemm_store(const float acc[4][4][4], Store store) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) store(gemm_acc_row(mt, e), gemm_acc_col(nt, e), acc[mt][nt][e]);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm_f16(
    const __half* a, const __half* SPX_READONLY w, const __half* SPX_READONLY bias, float* __restrict__ y,
    int m, int n, int k) {
    SPX_PROLOGUE();
    const int n0 = blockIdx.x * GEMM_BN, m0 = blockIdx.y * GEMM_BM;
    float acc[4][4][4];
    gemm_mainloop(acc, gemm_rows(a + (size_t)m0 * k, m - m0, w + (size_t)n0 * k, n - n0, k), k);
    gemm_store(acc, [&](int row, int c, float v) {
        row += m0;
        c += n0;
        if (row < m && c < n) y[(size_t)row * n + c] = v + (bias ? __half2float(bias[c]) : 0.0f);
    });
}

// The grouped routed experts of a prompt pass (src/backend/cuda/moe/experts.rs's work list), FP16
// weights, in three launches:
//   moe_gather_f16:       x16[item][i] = (half)x[item_row[item]][i]
//   moe_gemm_gate_up_f16: h16[item][j] = (half)(silu(x16[item]·gate_j) * (x16[item]·up_j))
//   moe_gemm_down_f16:    out[item][c] = item_weight[item] * (h16[item]·down_c)
// Grid: (column tiles, row tiles of the largest group, groups); a block past its group's count
// returns at once. A group's items are contiguous (first .. first + count), so its rows of x16
// and h16 are too. The gate/up tile holds 64 features: its even w rows are gate rows, its odd
// ones the matching up rows, so each thread's accumulator pairs (e, e + 1) are one feature's gate
// and up.

extern "C" __global__ void moe_gather_f16(const float* x, const unsigned* item_row, int items, int hidden,
                                          __half* __restrict__ x16) {
    SPX_PROLOGUE();
    const unsigned long long n = (unsigned long long)items * hidden;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned item = (unsigned)(i / hidden), c = (unsigned)(i % hidden);
        x16[i] = __float2half_rn(x[(size_t)item_row[item] * hidden + c]);
    }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_gate_up_f16(
    const __half* x16, int hidden, int inter, const ExpertGroup* groups, __half* __restrict__ h16) {
    SPX_PROLOGUE();
    const ExpertGroup g = groups[blockIdx.z];
    const int m0 = blockIdx.y * GEMM_BM, j0 = blockIdx.x * (GEMM_BN / 2);
    if (m0 >= (int)g.count) return;
    const int count = (int)g.count - m0;
    const __half* w = reinterpret_cast<const __half*>(g.gate_up);
    GemmRows r = gemm_rows(x16 + (size_t)(g.first + m0) * hidden, count, w, 0, hidden);
    // Tile row 2 f + u of w: feature j0 + f's gate row (u = 0) or up row (u = 1).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = (threadIdx.x >> 2) + 64 * i;
        const int j = j0 + (row >> 1);
        r.w[i] = j < inter ? w + (size_t)((row & 1) * inter + j) * hidden : nullptr;
    }
    float acc[4][4][4];
    gemm_mainloop(acc, r, hidden);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int row = gemm_acc_row(mt, e), j = j0 + (gemm_acc_col(nt, e) >> 1);
                if (row < count && j < inter) {
                    const float v = __fmul_rn(spx_silu(acc[mt][nt][e]), acc[mt][nt][e + 1]);
                    h16[(size_t)(g.first + m0 + row) * inter + j] = __float2half_rn(v);
                }
            }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS) moe_gemm_down_f16(
    const __half* h16, int hidden, int inter, const ExpertGroup* groups, const float* item_weight,
    float* __restrict__ out) {
    SPX_PROLOGUE();
    const ExpertGroup g = groups[blockIdx.z];
    const int m0 = blockIdx.y * GEMM_BM, n0 = blockIdx.x * GEMM_BN;
    if (m0 >= (int)g.count) return;
    const int count = (int)g.count - m0;
    const __half* w = reinterpret_cast<const __half*>(g.down);
    float acc[4][4][4];
    gemm_mainloop(acc, gemm_rows(h16 + (size_t)(g.first + m0) * inter, count, w + (size_t)n0 * inter, hidden - n0, inter),
                  inter);
    gemm_store(acc, [&](int row, int c, float v) {
        c += n0;
        if (row < count && c < hidden) {
            const unsigned item = g.first + m0 + row;
            out[(size_t)item * hidden + c] = __fmul_rn(item_weight[item], v);
        }
    });
}
