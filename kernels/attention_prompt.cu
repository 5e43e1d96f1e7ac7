// Causal attention of a prompt's query rows on tensor cores, with FlashAttention's online softmax:
// the prompt pass's counterpart of attention.cu, whose split-key blocks read every visible key
// and value once per (query row, head), where here one block reads them once per 64 rows.
//
//   out[r][h][:] = sum_j softmax_j(scale * q[r][h]·k[j][kh]) v[j][kh],   visible j of row r
//
// q f32 [rows][heads][QK], k f32 [keys][kv_heads][QK], v f32 [keys][kv_heads][VD], out f32
// [rows][heads][VD]; head h reads kv head h / (heads / kv_heads). Row r sits at position
// start + r and sees keys lo .. start + r, lo = max(0, start + r + 1 - window) with a window,
// else 0 (attention.cu's att_keys).
//
// Numerics: q, k, v and the softmax weights are rounded to f16 as mma.sync operands, products
// summed in f32 (the hardware's order within a 16-input step); the scores scaled in f32, their
// running maximum and sums in f32. So the bits are not attention.cu's, and this kernel runs only
// for prompt passes (src/backend/cuda/ops/attention.rs), in every placement alike.
//
// Work split: a block is 4 warps over ATTP_ROWS = 64 query rows of one head (grid: row tiles x
// heads), each warp 16 rows, its q fragments in registers. Key tiles of ATTP_KEYS = 64 go through
// shared memory as f16 (keys and values row by row, 16-byte chunks swizzled within groups of
// eight, so an ldmatrix phase's eight rows hit eight bank groups); per tile a warp computes its
// 16 x 64 scores (mma, keys as the column operand), masks and rescales its running state, and
// adds P V with P's f16 fragments taken from the score accumulators and V's by ldmatrix.trans.
// Instantiated for (QK, VD) = (64, 64), (128, 128) and (192, 128); the host runs attention.cu
// for other shapes.

#include <cuda_fp16.h>

#include "common.cuh"

#include "mma.cuh"

#if !defined(ATTP_ROWS) || !defined(ATTP_KEYS) || !defined(ATTP_THREADS)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif
static_assert(ATTP_ROWS == 64 && ATTP_KEYS == 64 && ATTP_THREADS == 128,
              "the warp layout below is written for 64 x 64 tiles and 4 warps");

// The 16-byte chunk index of (row, chunk) in a shared tile of D halves a row.
template <int D>
__device__ __forceinline__ int attp_chunk(int row, int chunk) {
    return row * (D / 8) + ((chunk & ~7) | ((chunk ^ row) & 7));
}

// Rows 0 .. ATTP_KEYS - 1 of a shared tile <- keys j0 + row of head kh of `src` (D floats a head,
// `stride` floats a key) as f16; keys past `last` as zeros.
template <int D>
__device__ __forceinline__ void attp_stage(__half* tile, const float* src, size_t stride, int kh, int j0,
                                           int last) {
    for (int u = threadIdx.x; u < ATTP_KEYS * (D / 8); u += ATTP_THREADS) {
        const int key = u / (D / 8), c = u % (D / 8);
        uint4 val = make_uint4(0, 0, 0, 0);
        if (j0 + key <= last) {
            const float4* p = reinterpret_cast<const float4*>(src + (size_t)(j0 + key) * stride + (size_t)kh * D + c * 8);
            const float4 a = p[0], b = p[1];
            val = make_uint4(mma_pack(a.x, a.y), mma_pack(a.z, a.w), mma_pack(b.x, b.y), mma_pack(b.z, b.w));
        }
        *reinterpret_cast<uint4*>(tile + attp_chunk<D>(key, c) * 8) = val;
    }
}

template <int QK, int VD>
__device__ __forceinline__ void attention_prompt(const float* q, const float* k, const float* v,
                                                 float* __restrict__ out, int rows, int heads, int kv_heads,
                                                 float scale, int start, int window) {
    __shared__ __align__(128) __half sk[ATTP_KEYS * QK];
    __shared__ __align__(128) __half sv[ATTP_KEYS * VD];
    SPX_PROLOGUE();
    const int h = blockIdx.y, kh = h / (heads / kv_heads);
    const int m0 = blockIdx.x * ATTP_ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // This thread's two query rows (fragment rows g and g + 8 of its warp's 16).
    const int rr[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};

    constexpr int QS = QK / 16, VT = VD / 8;
    unsigned qa[QS][4];
    const size_t q_stride = (size_t)heads * QK;
#pragma unroll
    for (int kk = 0; kk < QS; ++kk) {
#pragma unroll
        for (int f = 0; f < 4; ++f) {
            const int r = rr[f & 1], c = 16 * kk + 2 * t + 8 * (f >> 1);
            const float* p = q + (size_t)r * q_stride + (size_t)h * QK + c;
            qa[kk][f] = r < rows ? mma_pack(p[0], p[1]) : 0u;
        }
    }
    const float neg_inf = -__int_as_float(0x7f800000);
    float run_max[2] = {neg_inf, neg_inf}, run_sum[2] = {0.0f, 0.0f};
    float o[VT][4];
#pragma unroll
    for (int i = 0; i < VT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][e] = 0.0f;

    // The keys any row of the block may see.
    const int last = start + min(m0 + ATTP_ROWS, rows) - 1;
    const int first = window > 0 ? max(0, start + m0 + 1 - window) : 0;
    const size_t k_stride = (size_t)kv_heads * QK, v_stride = (size_t)kv_heads * VD;
    for (int j0 = first; j0 <= last; j0 += ATTP_KEYS) {
        __syncthreads();  // every warp is done with the previous tile
        attp_stage<QK>(sk, k, k_stride, kh, j0, last);
        attp_stage<VD>(sv, v, v_stride, kh, j0, last);
        __syncthreads();

        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[i][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < QS; ++kk) {
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                // Matrices: keys 0-7 of inputs 0-7 and 8-15, then keys 8-15 of both.
                unsigned b[4];
                const int key = np * 16 + (lane & 7) + ((lane >> 4) << 3);
                mma_ldmatrix4(b, sk + attp_chunk<QK>(key, kk * 2 + ((lane >> 3) & 1)) * 8);
                mma_16816(s[2 * np], qa[kk], b[0], b[1]);
                mma_16816(s[2 * np + 1], qa[kk], b[2], b[3]);
            }
        }
        // Scale and mask; the tile's maximum per row over the quad of lanes that hold it.
        float tile_max[2] = {neg_inf, neg_inf};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = rr[e >> 1], j = j0 + nt * 8 + 2 * t + (e & 1);
                const int pos = start + r;
                const bool seen = r < rows && j <= pos && (window <= 0 || j > pos - window);
                s[nt][e] = seen ? s[nt][e] * scale : neg_inf;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nt][e]);
            }
        float base[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
            tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
            const float m = fmaxf(run_max[i], tile_max[i]);
            // A row that has seen no key yet keeps everything at zero.
            base[i] = m == neg_inf ? 0.0f : m;
            const float alpha = expf(run_max[i] - base[i]);
            run_max[i] = m;
            run_sum[i] *= alpha;
#pragma unroll
            for (int vt = 0; vt < VT; ++vt) {
                o[vt][2 * i] *= alpha;
                o[vt][2 * i + 1] *= alpha;
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = expf(s[nt][e] - base[e >> 1]);
                run_sum[e >> 1] += s[nt][e];
            }
        // O += P V, 16 keys a step: P's A fragment is score tiles 2 kk2 and 2 kk2 + 1.
#pragma unroll
        for (int kk2 = 0; kk2 < 4; ++kk2) {
            const unsigned pa[4] = {mma_pack(s[2 * kk2][0], s[2 * kk2][1]), mma_pack(s[2 * kk2][2], s[2 * kk2][3]),
                                    mma_pack(s[2 * kk2 + 1][0], s[2 * kk2 + 1][1]),
                                    mma_pack(s[2 * kk2 + 1][2], s[2 * kk2 + 1][3])};
#pragma unroll
            for (int dp = 0; dp < VT / 2; ++dp) {
                // Matrices (transposed): keys 0-7 / 8-15 of channels 0-7, then of channels 8-15.
                unsigned b[4];
                const int key = kk2 * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
                mma_ldmatrix4_trans(b, sv + attp_chunk<VD>(key, dp * 2 + (lane >> 4)) * 8);
                mma_16816(o[2 * dp], pa, b[0], b[1]);
                mma_16816(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        run_sum[i] += __shfl_xor_sync(0xffffffffu, run_sum[i], 1);
        run_sum[i] += __shfl_xor_sync(0xffffffffu, run_sum[i], 2);
    }
    const size_t o_stride = (size_t)heads * VD;
#pragma unroll
    for (int vt = 0; vt < VT; ++vt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = rr[e >> 1];
            if (r < rows) out[(size_t)r * o_stride + (size_t)h * VD + vt * 8 + 2 * t + (e & 1)] = o[vt][e] / run_sum[e >> 1];
        }
}

extern "C" __global__ void __launch_bounds__(ATTP_THREADS)
    attention_prompt_64_64(const float* q, const float* k, const float* v, float* __restrict__ out, int rows,
                           int heads, int kv_heads, float scale, int start, int window) {
    attention_prompt<64, 64>(q, k, v, out, rows, heads, kv_heads, scale, start, window);
}

extern "C" __global__ void __launch_bounds__(ATTP_THREADS)
    attention_prompt_128_128(const float* q, const float* k, const float* v, float* __restrict__ out, int rows,
                             int heads, int kv_heads, float scale, int start, int window) {
    attention_prompt<128, 128>(q, k, v, out, rows, heads, kv_heads, scale, start, window);
}

extern "C" __global__ void __launch_bounds__(ATTP_THREADS)
    attention_prompt_192_128(const float* q, const float* k, const float* v, float* __restrict__ out, int rows,
                             int heads, int kv_heads, float scale, int start, int window) {
    attention_prompt<192, 128>(q, k, v, out, rows, heads, kv_heads, scale, start, window);
}
