// Grouped W4A16 MoE expert kernels for the INT4 draft: Marlin-tiled INT4 weights (group size
// 128, docs/MARLIN.md), f32 activations, f32 arithmetic.
//
//   moe_int4_gate_up_<M>: h[item][j]   = silu(x[row]·gate[j]) * (x[row]·up[j]),   j < inter
//   moe_int4_down_<M>:    out[item][c] = weight[item] * (h[item]·down[c]),       c < hidden
//
// <M> (1, 2, 4, 8) is the most items one block holds in registers at a time; the host picks the
// smallest that covers the launch's largest group, so small batches get small register files and
// many resident blocks (the kernels are memory-bound there). Every variant gives the same bits.
//
// Work split. Block (x, y) owns 64 output columns (one Marlin 16x64 block column) of the expert
// of group y (gate_up: gate columns 64x..64x+63 and the matching up columns). Its 8 warps split K
// into 8 contiguous ranges of K/128 tile rows. Within a tile row, lane i loads the 16 bytes
// (4 words, tiles j = 0..3) that Marlin stores for it: the codes of the 8 columns i/4 + 8e
// (e = 0..7) at the 4 rows 2(i%4) + {0, 1, 8, 9}; those 8 columns' scales are the 8 consecutive
// f16 at 8(i/4) of the block's 64-scale run. Each 16-byte chunk is loaded once and applied to
// all the chunk's items.
//
// Arithmetic (identical for every item and every variant, which is the batch invariance):
//   - a code q is decoded exactly: OR-ing nibble position p (bits 4p..4p+3) into the f32 2^23
//     gives 2^23 + q 16^p, and subtracting 2^23 + 8 * 16^p leaves 16^p (q - 8) exactly; the
//     activation is pre-multiplied by 16^-p (exact), so each product is x (q - 8) exactly;
//   - per thread and quantization group: gp[e] += x (q - 8) as one fma per code, in a fixed
//     order (tile row, then tile j, then nibble); at the end of the group acc[e] =
//     fma(gp[e], scale[e], acc[e]);
//   - the four lanes that share columns are summed by an xor butterfly (bitwise symmetric), then
//     the eight warps' sums are added in warp order by one thread per output.
// Nothing depends on how many items the group or the launch holds.
//
// Alignment: qweight and scales must be 16-byte aligned (device allocations are 256-byte aligned).

typedef unsigned int u32;
typedef unsigned long long u64;

// Mirrors `ExpertGroup` in src/backend/cuda/experts.rs (#[repr(C)], 40 bytes).
struct ExpertGroup {
    u64 gate_up;         // qweight of K = hidden, N = 2 * inter (gate columns then up columns)
    u64 gate_up_scales;  // f16 [hidden / 128][2 * inter], Marlin-permuted
    u64 down;            // qweight of K = inter, N = hidden
    u64 down_scales;     // f16 [inter / 128][hidden]
    u32 first;           // this expert's items are first .. first + count
    u32 count;
};
static_assert(sizeof(ExpertGroup) == 40, "ExpertGroup must match the Rust struct");

#define MOE_THREADS 256
#define MOE_WARPS 8
#define MOE_MAX_ITEMS 8
#define MOE_COLS 64

// Shared memory of one block, reused by every chunk of items.
struct MoeShared {
    float red[MOE_WARPS][MOE_MAX_ITEMS][MOE_COLS];  // per-warp column sums
    float gate[MOE_MAX_ITEMS][MOE_COLS];            // gate pre-activations (gate_up only)
    const float* rows[MOE_MAX_ITEMS];               // activation row of each item of the chunk
};

// Weights are read once per item chunk: stream them past L1 so the activations stay there.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ float half_to_float(u32 bits16) {
    float f;
    unsigned short h = (unsigned short)bits16;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// 16^p (q - 8) for the code q in bits `mask` (nibble position p) of `bits`; exact (see top).
__device__ __forceinline__ float code_at(u32 bits, u32 mask, float magic) {
    return __fsub_rn(__uint_as_float((bits & mask) | 0x4B000000u), magic);
}

// The magic constants 2^23 + 8 * 16^p for p = 0..3.
#define MAGIC0 8388616.0f
#define MAGIC1 8388736.0f
#define MAGIC2 8390656.0f
#define MAGIC3 8421376.0f

// Adds one tile row's contribution to the group partials gp of the MI items.
// `w` is this lane's 16-byte chunk, `k0` the activation index of its first row (16 tr + 2 (i%4)).
template <int MI>
__device__ __forceinline__ void tile_row(const uint4 w, const MoeShared& sh, u32 k0,
                                         float (&gp)[MI][8]) {
    // Decode the 32 codes once for all items. d[j][t]: tile j, nibble t.
    float d[4][8];
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 lo = words[j];
        const u32 hi = words[j] >> 16;
        d[j][0] = code_at(lo, 0x000Fu, MAGIC0);
        d[j][1] = code_at(lo, 0x00F0u, MAGIC1);
        d[j][2] = code_at(lo, 0x0F00u, MAGIC2);
        d[j][3] = code_at(lo, 0xF000u, MAGIC3);
        d[j][4] = code_at(hi, 0x000Fu, MAGIC0);
        d[j][5] = code_at(hi, 0x00F0u, MAGIC1);
        d[j][6] = code_at(hi, 0x0F00u, MAGIC2);
        d[j][7] = code_at(hi, 0xF000u, MAGIC3);
    }
#pragma unroll
    for (int m = 0; m < MI; ++m) {
        const float* xr = sh.rows[m] + k0;
        const float2 x01 = __ldg(reinterpret_cast<const float2*>(xr));      // rows 2a, 2a+1
        const float2 x89 = __ldg(reinterpret_cast<const float2*>(xr + 8));  // rows 2a+8, 2a+9
        // Nibble t holds row 2a + 8 (t%2) + t/4 of column slot 2j + (t/2)%2, at position t%4
        // of its half word; scale the activation by 16^-(t%4) to cancel the position.
        const float x0 = x01.x, x1 = x01.y;
        const float x0s8 = __fmul_rn(x01.x, 0x1p-8f), x1s8 = __fmul_rn(x01.y, 0x1p-8f);
        const float x2s4 = __fmul_rn(x89.x, 0x1p-4f), x3s4 = __fmul_rn(x89.y, 0x1p-4f);
        const float x2s12 = __fmul_rn(x89.x, 0x1p-12f), x3s12 = __fmul_rn(x89.y, 0x1p-12f);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float a = gp[m][2 * j];
            a = __fmaf_rn(d[j][0], x0, a);
            a = __fmaf_rn(d[j][1], x2s4, a);
            a = __fmaf_rn(d[j][4], x1, a);
            a = __fmaf_rn(d[j][5], x3s4, a);
            gp[m][2 * j] = a;
            float b = gp[m][2 * j + 1];
            b = __fmaf_rn(d[j][2], x0s8, b);
            b = __fmaf_rn(d[j][3], x2s12, b);
            b = __fmaf_rn(d[j][6], x1s8, b);
            b = __fmaf_rn(d[j][7], x3s12, b);
            gp[m][2 * j + 1] = b;
        }
    }
}

// acc += gp * scale for the group whose 8 scales (this lane's columns) are packed in `s`.
template <int MI>
__device__ __forceinline__ void flush_group(const uint4 s, float (&gp)[MI][8],
                                            float (&acc)[MI][8]) {
    const u32 sw[4] = {s.x, s.y, s.z, s.w};
    float scale[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        scale[e] = half_to_float(e % 2 == 0 ? (sw[e / 2] & 0xFFFFu) : (sw[e / 2] >> 16));
    }
#pragma unroll
    for (int m = 0; m < MI; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            acc[m][e] = __fmaf_rn(gp[m][e], scale[e], acc[m][e]);
            gp[m][e] = 0.0f;
        }
    }
}

// This thread's partial sums over its warp's K range for the 8 columns lane/4 + 8e of column
// block `b`, for the MI items whose rows are in sh.rows; then the lane and warp reduction into
// sh.red (the caller synchronises before reading it).
template <int MI, int U>
__device__ __forceinline__ void block_pass(const uint4* __restrict__ qweight,
                                           const uint4* __restrict__ scales, u32 n, u32 k,
                                           u32 b, MoeShared& sh) {
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 quad = lane & 3;
    const u32 rows_per_warp = k / (16 * MOE_WARPS);  // = k / 128: whole, since k % 128 == 0
    const u32 tr_begin = warp * rows_per_warp;
    const u32 tr_end = tr_begin + rows_per_warp;
    const u64 row_vecs = n / 2;    // uint4 per qweight tile row (2n words)
    const u64 scale_vecs = n / 8;  // uint4 per scale row (n halves)
    const uint4* wp = qweight + (u64)tr_begin * row_vecs + 32u * b + lane;
    const uint4* sp = scales + 8u * b + (lane >> 2);

    float acc[MI][8];
    float gp[MI][8];
#pragma unroll
    for (int m = 0; m < MI; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            acc[m][e] = 0.0f;
            gp[m][e] = 0.0f;
        }
    }
    uint4 s = __ldg(sp + (u64)(tr_begin / 8) * scale_vecs);

    for (u32 tr0 = tr_begin; tr0 < tr_end; tr0 += U) {
        // U loads in flight before the first use.
        uint4 w[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            w[u] = make_uint4(0u, 0u, 0u, 0u);
            if (tr0 + u < tr_end) w[u] = load_stream(wp + (u64)(tr0 + u - tr_begin) * row_vecs);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 tr = tr0 + u;
            if (tr < tr_end) {
                // A new quantization group starts every 8 tile rows; its scales are needed only
                // when the group ends, so the load has time to arrive.
                if ((tr & 7u) == 0u && tr != tr_begin) s = __ldg(sp + (u64)(tr >> 3) * scale_vecs);
                tile_row<MI>(w[u], sh, 16u * tr + 2u * quad, gp);
                if ((tr & 7u) == 7u || tr + 1 == tr_end) flush_group<MI>(s, gp, acc);
            }
        }
    }

    // Lanes 4c..4c+3 hold the same columns over different rows: an xor butterfly leaves the
    // same bits in all four ((v0+v1)+(v2+v3) and its commuted forms).
#pragma unroll
    for (int m = 0; m < MI; ++m) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float v = acc[m][e];
            v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
            v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
            // Lane quad writes slots 2 quad, 2 quad + 1 (compile-time slot, run-time predicate).
            if ((u32)(e >> 1) == quad) sh.red[warp][m][(lane >> 2) + 8 * e] = v;
        }
    }
}

// Sum of the eight warps' partials for item slot m, column c, in warp order.
__device__ __forceinline__ float warp_sum(const MoeShared& sh, u32 m, u32 c) {
    float v = sh.red[0][m][c];
#pragma unroll
    for (int w = 1; w < MOE_WARPS; ++w) v = __fadd_rn(v, sh.red[w][m][c]);
    return v;
}

__device__ __forceinline__ float silu(float a) { return a / (1.0f + expf(-a)); }

// Prefetch depth: deeper when few items leave registers free.
template <int MI>
struct Depth {
    static constexpr int value = MI <= 2 ? 8 : 4;
};

template <int MI>
__device__ __forceinline__ void gate_up_chunk(const ExpertGroup& g, u32 item0,
                                              const float* __restrict__ x,
                                              const u32* __restrict__ item_row,
                                              float* __restrict__ h, u32 hidden, u32 inter,
                                              MoeShared& sh) {
    if (threadIdx.x < MI) sh.rows[threadIdx.x] = x + (u64)item_row[item0 + threadIdx.x] * hidden;
    __syncthreads();
    const uint4* qweight = reinterpret_cast<const uint4*>(g.gate_up);
    const uint4* scales = reinterpret_cast<const uint4*>(g.gate_up_scales);
    const u32 n = 2 * inter;
    // Pass 0: gate block x; pass 1: the up block inter/64 blocks further.
#pragma unroll 1
    for (u32 pass = 0; pass < 2; ++pass) {
        const u32 b = blockIdx.x + pass * (inter / MOE_COLS);
        block_pass<MI, Depth<MI>::value>(qweight, scales, n, hidden, b, sh);
        __syncthreads();
        for (u32 o = threadIdx.x; o < MI * MOE_COLS; o += MOE_THREADS) {
            const u32 m = o / MOE_COLS, c = o % MOE_COLS;
            const float v = warp_sum(sh, m, c);
            if (pass == 0) {
                sh.gate[m][c] = v;
            } else {
                h[(u64)(item0 + m) * inter + MOE_COLS * blockIdx.x + c] =
                    __fmul_rn(silu(sh.gate[m][c]), v);
            }
        }
        // sh.red is rewritten by the next pass, sh.rows by the next chunk.
        __syncthreads();
    }
}

template <int MI>
__device__ __forceinline__ void down_chunk(const ExpertGroup& g, u32 item0,
                                           const float* __restrict__ h,
                                           const float* __restrict__ item_weight,
                                           float* __restrict__ out, u32 hidden, u32 inter,
                                           MoeShared& sh) {
    if (threadIdx.x < MI) sh.rows[threadIdx.x] = h + (u64)(item0 + threadIdx.x) * inter;
    __syncthreads();
    block_pass<MI, Depth<MI>::value>(reinterpret_cast<const uint4*>(g.down),
                                     reinterpret_cast<const uint4*>(g.down_scales), hidden, inter,
                                     blockIdx.x, sh);
    __syncthreads();
    for (u32 o = threadIdx.x; o < MI * MOE_COLS; o += MOE_THREADS) {
        const u32 m = o / MOE_COLS, c = o % MOE_COLS;
        const u32 item = item0 + m;
        out[(u64)item * hidden + MOE_COLS * blockIdx.x + c] =
            __fmul_rn(item_weight[item], warp_sum(sh, m, c));
    }
    __syncthreads();
}

// Runs chunk<N> for a chunk of exactly `n` items (1 <= n <= MAXI): one instantiation per size,
// so no register slot is ever spent on a missing item.
template <int N, int MAXI>
__device__ __forceinline__ void gate_up_dispatch(u32 n, const ExpertGroup& g, u32 item0,
                                                 const float* x, const u32* item_row, float* h,
                                                 u32 hidden, u32 inter, MoeShared& sh) {
    if (n == N) {
        gate_up_chunk<N>(g, item0, x, item_row, h, hidden, inter, sh);
    } else if constexpr (N < MAXI) {
        gate_up_dispatch<N + 1, MAXI>(n, g, item0, x, item_row, h, hidden, inter, sh);
    }
}

template <int N, int MAXI>
__device__ __forceinline__ void down_dispatch(u32 n, const ExpertGroup& g, u32 item0,
                                              const float* h, const float* item_weight,
                                              float* out, u32 hidden, u32 inter, MoeShared& sh) {
    if (n == N) {
        down_chunk<N>(g, item0, h, item_weight, out, hidden, inter, sh);
    } else if constexpr (N < MAXI) {
        down_dispatch<N + 1, MAXI>(n, g, item0, h, item_weight, out, hidden, inter, sh);
    }
}

// grid = (inter / 64, groups), block = 256.
template <int MAXI>
__device__ __forceinline__ void gate_up_kernel(const ExpertGroup* __restrict__ groups,
                                               const float* __restrict__ x,
                                               const u32* __restrict__ item_row,
                                               float* __restrict__ h, u32 hidden, u32 inter) {
    __shared__ MoeShared sh;
    const ExpertGroup g = groups[blockIdx.y];
    for (u32 done = 0; done < g.count; done += MAXI) {
        const u32 n = min((u32)MAXI, g.count - done);
        gate_up_dispatch<1, MAXI>(n, g, g.first + done, x, item_row, h, hidden, inter, sh);
    }
}

// grid = (hidden / 64, groups), block = 256.
template <int MAXI>
__device__ __forceinline__ void down_kernel(const ExpertGroup* __restrict__ groups,
                                            const float* __restrict__ h,
                                            const float* __restrict__ item_weight,
                                            float* __restrict__ out, u32 hidden, u32 inter) {
    __shared__ MoeShared sh;
    const ExpertGroup g = groups[blockIdx.y];
    for (u32 done = 0; done < g.count; done += MAXI) {
        const u32 n = min((u32)MAXI, g.count - done);
        down_dispatch<1, MAXI>(n, g, g.first + done, h, item_weight, out, hidden, inter, sh);
    }
}

// Register caps: small variants keep several blocks resident per SM for latency hiding; the
// 8-item variant is arithmetic-bound and gets the whole register file of one block.
#define MOE_INT4_KERNELS(MAXI, MIN_BLOCKS)                                                         \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MIN_BLOCKS)                          \
        moe_int4_gate_up_##MAXI(const ExpertGroup* __restrict__ groups,                           \
                                const float* __restrict__ x, const u32* __restrict__ item_row,    \
                                float* __restrict__ h, u32 hidden, u32 inter) {                   \
        gate_up_kernel<MAXI>(groups, x, item_row, h, hidden, inter);                              \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MIN_BLOCKS)                          \
        moe_int4_down_##MAXI(const ExpertGroup* __restrict__ groups, const float* __restrict__ h, \
                             const float* __restrict__ item_weight, float* __restrict__ out,      \
                             u32 hidden, u32 inter) {                                             \
        down_kernel<MAXI>(groups, h, item_weight, out, hidden, inter);                            \
    }

MOE_INT4_KERNELS(1, 3)
MOE_INT4_KERNELS(2, 2)
MOE_INT4_KERNELS(4, 1)
MOE_INT4_KERNELS(8, 1)
