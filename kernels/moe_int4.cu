// Grouped W4A16 MoE expert kernels for the INT4 draft: Marlin-tiled INT4 weights (group size
// 128, docs/MARLIN.md), activations rounded to f16, tensor-core products with f32 accumulation.
//
//   moe_int4_gate_up_<M>: h[item][j]   = silu(x[row]·gate[j]) * (x[row]·up[j]),   j < inter
//   moe_int4_down_<M>:    out[item][c] = weight[item] * (h[item]·down[c]),       c < hidden
//
// <M> (8, 16) is the most items one block handles at a time (one chunk); a larger group runs in
// several chunks. The host picks 8 when no group exceeds 8 items (fewer registers, more resident
// blocks), else 16. Both give the same bits for an item (see "Batch invariance").
//
// Work split. Block (x, y) owns 64 output columns (one Marlin 16x64 block column) of the expert
// of group y (gate_up: gate columns 64x..64x+63 and the matching up columns). Its 8 warps split K
// into 8 contiguous ranges of K/128 tile rows (16 input features each). Each warp streams its
// tile rows through a private ring of RING 512-byte cp.async slots in shared memory (lane i
// copies, and later reads back, only its own 16 bytes, so no barrier is needed inside a warp).
// PAIRED variants stream a tile row of gate and the same tile row of up side by side (RING / 2
// rows of each in flight), so gate_up is one pass over K; the others run gate, then up, in two
// passes of RING rows in flight. A one-row draft step's block has only 16 (gate/up) or 11
// (down) tile rows a warp: one pass and a ring that holds nearly all of them keep the weights'
// loads in flight together instead of two pipeline fills one after the other. Both orders give
// every output the same arithmetic.
//
// The product: mma.sync m16n8k16 (f16 inputs, f32 accumulators) with the weight as the A
// operand (16 output columns x 16 input features) and the activations as B (16 features x 8
// items). Marlin stores, for lane i = 4g + t (g = i/4, t = i%4), one word per 16x16 tile j of a
// tile row holding the codes of tile columns g and g+8 at tile rows 2t, 2t+1, 2t+8, 2t+9; nibble
// 4 (rr%2) + 2 (cc/8) + rr/8 holds (rr, cc). That is exactly the A fragment of lane i:
//
//   a0 = rows g,   k 2t, 2t+1   = nibbles 0 (low half), 4 (high half)   = w & 0x000F000F
//   a1 = rows g+8, k 2t, 2t+1   = nibbles 2, 6                          = (w >> 8) & 0x000F000F
//   a2 = rows g,   k 2t+8, 2t+9 = nibbles 1, 5                          = w & 0x00F000F0
//   a3 = rows g+8, k 2t+8, 2t+9 = nibbles 3, 7                          = (w >> 8) & 0x00F000F0
//
// OR-ing 0x6400 (f16 1024) into a half whose mantissa holds q (or 16 q) gives 1024 + q (or
// 1024 + 16 q) exactly; subtracting 1032 (or fma by 1/16 then -72) leaves q - 8 exactly, so the
// A operand is the integer code, exact in f16. B fragment of lane i: item g of the n8 tile,
// features 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1). C fragment: c0, c1 = output column g, items 2t,
// 2t+1; c2, c3 = column g+8, same items. A chunk of up to 8 items is one n8 tile (NT = 1), up to
// 16 two (NT = 2); missing items are zero columns of B.
//
// Staged activations (STAGED variants). Read straight from global memory, one warp-wide B load
// touches 8 item rows, about 8 L1 wavefronts, for each n8 tile and tile row; at 16 items that
// L1 traffic, not DRAM, bounds the kernel. So once per chunk each warp converts the activations
// of its own K range (whole-sector reads, the same f16 rounding) into its part of the block's
// dynamic shared memory, which only it reads (__syncwarp suffices; the two passes of a two-pass
// gate_up share one staging). Per tile row it holds 8 words per item slot, the item's 16 features as f16 in
// the order 0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15, so lane 4g + t finds b0, b1 of item
// slot 8 nt + g in the 8 bytes at 32 (8 nt + g) + 8 t = 256 nt + 8 lane: one 64-bit load per
// n8 tile, 256 contiguous bytes per warp, free of bank conflicts. Tile rows are 8 M + 8 words
// apart (8 mod 32 banks), which keeps the staging stores conflict-free too (see
// stage_activations). Slots past the chunk's items hold zeros. Size: 2 K (M + 1) bytes per block,
// 68 KB for the 16 variant at K = 2048, which is why it is dynamic (static is capped at 48 KB).
// It also takes the activation loads, their conversion and pointer upkeep out of the K loop.
//
// Numerics (W4A16 as Marlin defines it: FP16 compute, FP32 accumulation). Each activation (f32
// in memory: x for gate_up, h for down) is rounded once to f16, to nearest even
// (cvt.rn.f16x2.f32): relative error at most 2^-11 (absolute 2^-25 below 2^-14, where f16 is
// subnormal). Beyond that rounding only f32 arithmetic rounds: code products are exact and the
// mma accumulates in f32. The CPU reference (src/backend/cpu, `f16_input` of an INT4 weight)
// rounds its inputs the same way. Activations must lie within the f16 range: |x| in [65504,
// 65520) rounds to +-65504, larger becomes +-inf, and every output it feeds becomes +-inf or NaN
// (a zero code times inf is NaN), as on the CPU; NaN stays NaN. Per K group of 128 features a
// fresh f32 fragment collects the group's mma results; at the group's end (or the end of the
// warp's range) acc = fma(partial, scale, acc) per output element, scale being the f32 value of
// the stored f16 scale (exact). The eight warps' acc values are then added in warp order by one
// thread per output.
//
// Batch invariance (an item's bits do not depend on its group's size, its position in the group,
// or the launch): every arithmetic step above, the f16 rounding included, is per element in an
// order fixed by K alone; an item's B column, and so every mma it takes part in, is the same
// whatever else is in its n8 tile or chunk, and the padding items are zero. This relies on the
// tensor core computing each D element from its own A row, B column and C element only (true of
// NVIDIA's mma units; tests/cuda_moe_int4.rs checks it by comparing an item alone, in a 16-item
// chunk and reordered).
//
// Alignment: qweight and scales must be 16-byte aligned, x and h 8-byte aligned (device
// allocations are 256-byte aligned; the host checks x and h).

#include <cuda_fp16.h>

#include "common.cuh"

#include "linear_rows.cuh"

#if !defined(MOE_THREADS) || !defined(MOE_WARPS) || !defined(MOE_COLS) || !defined(MOE_RED_STRIDE)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

// From the host's table: MOE_WARPS and MOE_THREADS, the block; MOE_COLS, the output columns of a
// block (one Marlin block column); MOE_RED_STRIDE, the row stride of the reduction buffer (68
// words put the 32 lanes' writes in distinct banks).
// Words per tile row of a warp's staged activations (see "Staged activations"): 8 per item slot
// plus 8 of padding, so the stride is 8 (mod 32) banks.
#define MOE_XS_STRIDE(MAXI) (8 * (MAXI) + 8)

// One warp's space in the block's dynamic shared memory: its load ring (RING slots of 32 x 16
// bytes) during the K loop, then its partial sums (red: one [MAXI][MOE_RED_STRIDE] array per
// matrix of the pass). The two are never live together (the warp finishes reading the ring
// before it writes sums). src/backend/cuda/moe/int4.rs computes the same size.
__host__ __device__ constexpr unsigned moe_warp_space_bytes(int maxi, int ring, bool paired) {
    return 512u * ring > (paired ? 2u : 1u) * maxi * MOE_RED_STRIDE * 4u
               ? 512u * ring
               : (paired ? 2u : 1u) * maxi * MOE_RED_STRIDE * 4u;
}

// The block's static shared memory; the warp spaces, then the staged activations (STAGED), are
// its dynamic shared memory.
template <int MAXI>
struct MoeShared {
    float gate[MAXI][MOE_COLS];  // gate pre-activations (two-pass gate_up only)
    const float* rows[MAXI];     // activation row of each item of the chunk
};

__device__ __forceinline__ u32 shared_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared (`dst` a shared window address), past L1 (weights are read once
// per chunk). cp.async wants a .global address; the conversion from the generic one is free on
// current GPUs.
__device__ __forceinline__ void copy_async(u32 dst, const void* src) {
    asm volatile(
        "{ .reg .u64 g; cvta.to.global.u64 g, %1; cp.async.cg.shared.global [%0], [g], 16; }" ::"r"(
            dst),
        "l"(src)
        : "memory");
}

__device__ __forceinline__ void copy_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Loads from a shared window address (as shared_addr gives). The K loop addresses its ring and
// staged activations this way, with the slot and tile row stepped: from generic pointers the
// compiler rebuilds the shared window's base and the lane from the thread index in every
// iteration. Volatile, so they stay after the cp.async wait before them.
__device__ __forceinline__ uint4 load_shared_u4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}

__device__ __forceinline__ uint2 load_shared_u2(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}

__device__ __forceinline__ float half_to_float(u32 bits16) {
    float f;
    unsigned short h = (unsigned short)bits16;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f16x2 of (lo_elem, hi_elem): lo_elem in the low 16 bits, round to nearest even.
__device__ __forceinline__ u32 pack_half2(float lo_elem, float hi_elem) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_elem), "f"(lo_elem));
    return r;
}

// (w & mask) | 0x64006400 in one LOP3 (written as and + or, ptxas keeps two instructions, as
// each can hold only one 32-bit immediate).
template <u32 MASK>
__device__ __forceinline__ u32 mask_or_1024(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(MASK), "r"(0x64006400u));
    return r;
}

// q - 8 for the two low-nibble codes (bits 0..3 and 16..19) of w: (1024 + q) - 1032, exact.
__device__ __forceinline__ u32 codes_low(u32 w) {
    const u32 v = mask_or_1024<0x000F000Fu>(w);
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x64086408u));
    return r;
}

// q - 8 for the two codes at bits 4..7 and 20..23: (1024 + 16 q) / 16 - 72, exact.
__device__ __forceinline__ u32 codes_high(u32 w) {
    const u32 v = mask_or_1024<0x00F000F0u>(w);
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x2C002C00u), "r"(0xD480D480u));
    return r;
}

// d += A B for one m16n8k16 tile (A = 4 f16x2, B = 2 f16x2, d = 4 f32).
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc += part * scale for this lane's 8 columns (scales packed as f16 in `s`: word j holds tile
// j's columns g (low half) and g+8 (high half)); part is reset for the next group.
template <int NT>
__device__ __forceinline__ void flush_group(const uint4 s, float (&part)[NT][4][4],
                                            float (&acc)[NT][4][4]) {
    const u32 sw[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float s_lo = half_to_float(sw[j] & 0xFFFFu);
        const float s_hi = half_to_float(sw[j] >> 16);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[nt][j][e] = __fmaf_rn(part[nt][j][e], e < 2 ? s_lo : s_hi, acc[nt][j][e]);
                part[nt][j][e] = 0.0f;
            }
        }
    }
}

// Converts this warp's K range (tile rows tr_begin .. tr_begin + rows) of the chunk's first
// 8 NT activation rows to f16 B fragments in its staging buffer xs (item slots past `count` get
// zeros). Lane 4 r + t takes tile rows r, r + 8, ...: it reads the feature pairs 2t, 2t+1 and
// 2t+8, 2t+9 (two float2; the warp's 32 lanes read 8 whole 32-byte sectors each time) and
// writes them as the 8 bytes it will itself load in the K loop. Each 64-bit store covers, per
// half-warp, 4 tile rows (8 mod 32 banks apart) x 4 lanes x 2 words: all 32 banks once.
template <int NT, int MAXI>
__device__ __forceinline__ void stage_activations(u32* xs, const float* const* item_rows,
                                                  u32 count, u32 tr_begin, u32 rows) {
    const u32 lane = threadIdx.x & 31;
    const u32 r = lane >> 2;
    const u32 feature = 16u * (tr_begin + r) + 2u * (lane & 3u);
    uint2* d = reinterpret_cast<uint2*>(xs + r * MOE_XS_STRIDE(MAXI)) + (lane & 3u);
    if (count == 1) {
        // One item (a draft step): two tile rows' loads at a time, so that their round trips
        // overlap; the other item slots get zeros. The same words as the loop below.
        const float* x = item_rows[0];
        const u32 next = 4u * MOE_XS_STRIDE(MAXI);  // 8 tile rows on, in uint2
#pragma unroll 1
        for (u32 i = r, f = feature; i < rows; i += 16, f += 256, d += 2 * next) {
            const bool second = i + 8 < rows;
            const float2 a0 = *reinterpret_cast<const float2*>(x + f);
            const float2 a8 = *reinterpret_cast<const float2*>(x + f + 8);
            float2 b0 = make_float2(0.0f, 0.0f), b8 = b0;
            if (second) {
                b0 = *reinterpret_cast<const float2*>(x + f + 128);
                b8 = *reinterpret_cast<const float2*>(x + f + 136);
            }
            d[0] = make_uint2(pack_half2(a0.x, a0.y), pack_half2(a8.x, a8.y));
#pragma unroll
            for (int m = 1; m < 8 * NT; ++m) d[4 * m] = make_uint2(0u, 0u);
            if (second) {
                d[next] = make_uint2(pack_half2(b0.x, b0.y), pack_half2(b8.x, b8.y));
#pragma unroll
                for (int m = 1; m < 8 * NT; ++m) d[next + 4 * m] = make_uint2(0u, 0u);
            }
        }
        return;
    }
#pragma unroll 1
    for (u32 i = r, f = feature; i < rows; i += 8, f += 128, d += 4 * MOE_XS_STRIDE(MAXI)) {
        // All items' loads first, so their latencies overlap.
        float2 v0[8 * NT], v8[8 * NT];
#pragma unroll
        for (int m = 0; m < 8 * NT; ++m) {
            v0[m] = v8[m] = make_float2(0.0f, 0.0f);
            if ((u32)m < count) {
                const float* x = item_rows[m] + f;
                v0[m] = *reinterpret_cast<const float2*>(x);
                v8[m] = *reinterpret_cast<const float2*>(x + 8);
            }
        }
#pragma unroll
        for (int m = 0; m < 8 * NT; ++m) {
            d[4 * m] = make_uint2(pack_half2(v0[m].x, v0[m].y), pack_half2(v8[m].x, v8[m].y));
        }
    }
}

// The dynamic shared memory a block of these kernels is given: MOE_WARPS warp spaces of
// moe_warp_space_bytes bytes, then (STAGED) the staged activations.
extern __shared__ uint4 moe_dynamic[];

// Warp w's space (see moe_warp_space_bytes).
template <int MAXI, int RING, bool PAIRED>
__device__ __forceinline__ unsigned char* warp_space(u32 w) {
    return reinterpret_cast<unsigned char*>(moe_dynamic) +
           w * moe_warp_space_bytes(MAXI, RING, PAIRED);
}

// The staged activations, after the warp spaces.
template <int MAXI, int RING, bool PAIRED>
__device__ __forceinline__ u32* staged_space() {
    return reinterpret_cast<u32*>(warp_space<MAXI, RING, PAIRED>(MOE_WARPS));
}

// block_pass's `fill_rows` when the caller has set sh.rows.
struct RowsSet {
    template <class Shared>
    __device__ __forceinline__ void operator()(Shared&) const {}
};

// block_pass's `fill_rows` for a gate/up chunk: each item's activation row, from the routing's
// item list. A round trip to L2 that the block's weights need not wait for, so it runs once
// they are in flight. Every thread of the block calls it (a barrier); `active` is the same for
// all of them.
template <int MAXI>
struct ChunkRows {
    const float* x;
    const u32* item_row;
    u32 item0;
    u32 count;
    u32 hidden;
    bool active;
    __device__ __forceinline__ void operator()(MoeShared<MAXI>& sh) const {
        if (!active) return;
        if (threadIdx.x < count) {
            sh.rows[threadIdx.x] = x + (u64)item_row[item0 + threadIdx.x] * hidden;
        }
        __syncthreads();
    }
};

// This warp's sums over its K range for the 64 columns of block column b0 + p b_step of each of
// the P matrices of the pass (P = 2: gate and up, streamed side by side) and the chunk's `count`
// items (rows in sh.rows), written to red array p of its warp space (the caller synchronises
// before reading them). STAGES tile rows of each matrix are in flight (STAGES P ring slots). NT n8
// item tiles cover the chunk (count <= 8 NT). With STAGED the B fragments come from this warp's
// part of `staged`, which the pass first fills if `stage` (else it holds this chunk's
// activations from an earlier pass); without, straight from global memory. Each matrix's
// arithmetic is the same whatever P and STAGES are.
// `fill_rows` sets sh.rows once the weights are in flight (RowsSet: the caller has).
template <int NT, int MAXI, bool STAGED, int P, int STAGES, int RING, bool PAIRED,
          class Rows = RowsSet>
__device__ __forceinline__ void block_pass(const uint4* SPX_READONLY qweight,
                                           const uint4* SPX_READONLY scales, u32 n, u32 k,
                                           u32 b0, u32 b_step, u32 count, MoeShared<MAXI>& sh,
                                           u32* staged, bool stage, bool wait_after_ring = false,
                                           Rows fill_rows = Rows()) {
    static_assert(STAGES * P <= RING, "the ring holds STAGES tile rows of P matrices");
    const u32 lane = threadIdx.x & 31;
    const u32 warp = threadIdx.x >> 5;
    const u32 g = lane >> 2;
    const u32 t = lane & 3;
    const u32 rows = k / (16 * MOE_WARPS);  // tile rows per warp (= k / 128, whole)
    const u32 tr_begin = warp * rows;
    const u64 row_vecs = n / 2;    // uint4 per qweight tile row (2n words)
    const u64 scale_vecs = n / 8;  // uint4 per scale row (n halves)
    // Matrix p's pieces and scales are p_weights and p_scales uint4 further than matrix 0's.
    const u64 p_weights = 32u * (u64)b_step;
    const u64 p_scales = 8u * (u64)b_step;
    const uint4* wp = qweight + (u64)tr_begin * row_vecs + 32u * b0 + lane;
    const uint4* sp = scales + 8u * b0 + g;
    // Slot s of matrix p: ring[(P s + p) 32 + lane].
    const uint4* ring = reinterpret_cast<const uint4*>(warp_space<MAXI, RING, PAIRED>(warp));
    const u32 ring_lane = shared_addr(ring + lane);
    u32* xs = staged + warp * rows * MOE_XS_STRIDE(MAXI);

#pragma unroll
    for (u32 s = 0; s < STAGES; ++s) {
        if (s < rows) {
#pragma unroll
            for (int p = 0; p < P; ++p) {
                copy_async(ring_lane + (P * s + p) * 512u, wp + (u64)s * row_vecs + p * p_weights);
            }
        }
        copy_commit();
    }
    // The weights in flight, the caller's wait for the kernels before (see down_kernel).
    if (wait_after_ring) spx_grid_wait();
    fill_rows(sh);
    // The loop steps these pointers (the refill source; the next group's scales) rather than
    // recomputing them, which keeps its integer work small.
    const uint4* refill = wp + (u64)STAGES * row_vecs;
    const uint4* next_scales = sp + (u64)(tr_begin / 8 + 1) * scale_vecs;

    // Lane's B column: item 8 nt + g of the chunk (null past the chunk: zero operand).
    const float* xr[NT];
    if constexpr (STAGED) {
        if (stage) {
            stage_activations<NT, MAXI>(xs, sh.rows, count, tr_begin, rows);
            __syncwarp();
        }
    } else {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u32 m = 8u * nt + g;
            xr[nt] = m < count ? sh.rows[m] + 2u * t : nullptr;
        }
    }
    // Lane i's B fragment of tile row r, n8 tile nt: the 8 bytes at shared address xb + 4 r
    // stride + 256 nt (xb: this lane's 8 bytes of tile row 0).
    const u32 xb = shared_addr(xs) + 8u * lane;

    float acc[P][NT][4][4];
    float part[P][NT][4][4];
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[p][nt][j][e] = 0.0f;
                    part[p][nt][j][e] = 0.0f;
                }
            }
        }
    }
    uint4 s[P];
#pragma unroll
    for (int p = 0; p < P; ++p) s[p] = spx_ldg(next_scales - scale_vecs + p * p_scales);

    // This lane's 16 bytes of row i's slot (slot i % STAGES), and the end of its ring.
    u32 slot_lane = ring_lane;
    const u32 ring_end = ring_lane + STAGES * P * 512u;
    // Row i's tile row (tr_begin + i), stepped rather than recomputed from the warp index.
    u32 tr = tr_begin;
#pragma unroll 1
    for (u32 i = 0; i < rows; ++i, ++tr) {
        // Activations first: their loads overlap the wait for the weights.
        u32 bx[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if constexpr (STAGED) {
                const uint2 v = load_shared_u2(xb + i * (4u * MOE_XS_STRIDE(MAXI)) + 256u * nt);
                bx[nt][0] = v.x;
                bx[nt][1] = v.y;
            } else {
                float2 x0 = make_float2(0.0f, 0.0f), x8 = make_float2(0.0f, 0.0f);
                if (xr[nt] != nullptr) {
                    x0 = *reinterpret_cast<const float2*>(xr[nt] + 16u * tr);
                    x8 = *reinterpret_cast<const float2*>(xr[nt] + 16u * tr + 8u);
                }
                bx[nt][0] = pack_half2(x0.x, x0.y);
                bx[nt][1] = pack_half2(x8.x, x8.y);
            }
        }
        // A new quantization group starts every 8 tile rows; its scales are needed only when
        // the group ends, so the load has time to arrive.
        if ((tr & 7u) == 0u && i != 0) {
#pragma unroll
            for (int p = 0; p < P; ++p) s[p] = spx_ldg(next_scales + p * p_scales);
            next_scales += scale_vecs;
        }

        // Row i is complete once at most STAGES - 1 later rows are pending.
        copy_wait<STAGES - 1>();
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const uint4 w = load_shared_u4(slot_lane + p * 512u);
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 hi8 = words[j] >> 8;
                const u32 a[4] = {codes_low(words[j]), codes_low(hi8), codes_high(words[j]),
                                  codes_high(hi8)};
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    mma16816(part[p][nt][j], a, bx[nt][0], bx[nt][1]);
                }
            }
        }
        // Refill the slots just read (their values are consumed above, so the reads have
        // completed).
        if (i + STAGES < rows) {
#pragma unroll
            for (int p = 0; p < P; ++p) copy_async(slot_lane + p * 512u, refill + p * p_weights);
        }
        refill += row_vecs;
        copy_commit();
        // The next row's slot: rows go round the ring in order.
        slot_lane = slot_lane + P * 512u == ring_end ? ring_lane : slot_lane + P * 512u;
        if ((tr & 7u) == 7u || i + 1 == rows) {
#pragma unroll
            for (int p = 0; p < P; ++p) flush_group<NT>(s[p], part[p], acc[p]);
        }
    }
    copy_wait<0>();
    // The ring and red share memory: every lane must be done with the ring first.
    __syncwarp();

    float* red = reinterpret_cast<float*>(warp_space<MAXI, RING, PAIRED>(warp));
#pragma unroll
    for (int p = 0; p < P; ++p) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // c0, c1: column g, items 2t, 2t+1; c2, c3: column g+8.
                    const u32 m = 8 * nt + 2 * t + (e & 1);
                    red[(p * MAXI + m) * MOE_RED_STRIDE + 16 * j + g + 8 * (e >> 1)] =
                        acc[p][nt][j][e];
                }
            }
        }
    }
}

// Sum of the eight warps' partials of matrix p for item slot m, column c, in warp order.
template <int MAXI, int RING, bool PAIRED>
__device__ __forceinline__ float warps_total(u32 p, u32 m, u32 c) {
    const u32 at = (p * MAXI + m) * MOE_RED_STRIDE + c;
    float v = reinterpret_cast<const float*>(warp_space<MAXI, RING, PAIRED>(0))[at];
#pragma unroll
    for (int w = 1; w < MOE_WARPS; ++w) {
        v = __fadd_rn(v, reinterpret_cast<const float*>(warp_space<MAXI, RING, PAIRED>(w))[at]);
    }
    return v;
}

__device__ __forceinline__ float silu(float a) { return a / (1.0f + expf(-a)); }

template <int NT, int MAXI, bool STAGED, int RING, bool PAIRED>
__device__ __forceinline__ void gate_up_chunk(const ExpertGroup& g, u32 item0, u32 count,
                                              const float* x,
                                              const u32* item_row,
                                              float* __restrict__ h, u32 hidden, u32 inter,
                                              MoeShared<MAXI>& sh, u32 bx) {
    u32* staged = staged_space<MAXI, RING, PAIRED>();
    const uint4* qweight = reinterpret_cast<const uint4*>(g.gate_up);
    const uint4* scales = reinterpret_cast<const uint4*>(g.gate_up_scales);
    const u32 n = 2 * inter;
    // The up block column matching gate block column x is inter/64 columns further.
    const u32 up_step = inter / MOE_COLS;
    if constexpr (PAIRED) {
        const ChunkRows<MAXI> rows{x, item_row, item0, count, hidden, true};
        block_pass<NT, MAXI, STAGED, 2, RING / 2, RING, PAIRED>(qweight, scales, n, hidden,
                                                                bx, up_step, count, sh,
                                                                staged, true, false, rows);
        __syncthreads();
        for (u32 o = threadIdx.x; o < count * MOE_COLS; o += MOE_THREADS) {
            const u32 m = o / MOE_COLS, c = o % MOE_COLS;
            const float gate = warps_total<MAXI, RING, PAIRED>(0, m, c);
            const float up = warps_total<MAXI, RING, PAIRED>(1, m, c);
            h[(u64)(item0 + m) * inter + MOE_COLS * bx + c] = __fmul_rn(silu(gate), up);
        }
        // The warp spaces are rewritten by the next chunk, as are sh.rows and the staged
        // activations.
        __syncthreads();
        return;
    }
    // Pass 0: gate block x; pass 1: the up block, on the same staged x.
#pragma unroll 1
    for (u32 pass = 0; pass < 2; ++pass) {
        const u32 b = bx + pass * up_step;
        const ChunkRows<MAXI> rows{x, item_row, item0, count, hidden, pass == 0};
        block_pass<NT, MAXI, STAGED, 1, RING, RING, PAIRED>(qweight, scales, n, hidden, b, 0,
                                                            count, sh, staged, pass == 0, false,
                                                            rows);
        __syncthreads();
        for (u32 o = threadIdx.x; o < count * MOE_COLS; o += MOE_THREADS) {
            const u32 m = o / MOE_COLS, c = o % MOE_COLS;
            const float v = warps_total<MAXI, RING, PAIRED>(0, m, c);
            if (pass == 0) {
                sh.gate[m][c] = v;
            } else {
                h[(u64)(item0 + m) * inter + MOE_COLS * bx + c] =
                    __fmul_rn(silu(sh.gate[m][c]), v);
            }
        }
        // The warp spaces are rewritten by the next pass, sh.rows and the staged activations by
        // the next chunk.
        __syncthreads();
    }
}

// No lead_slot: a down launch's outputs go to `out` only.
#define NO_LEAD_SLOT 0xFFFFFFFFu

// `lead_slot` (a down launch in clusters, one item a block): where in the cluster's first block
// this block's 64 outputs also go (cluster_addr), NO_LEAD_SLOT for none. Before storing
// there the block waits for the cluster's blocks to have started (their arrival at the kernel's
// start).
template <int NT, int MAXI, bool STAGED, int RING, bool PAIRED>
__device__ __forceinline__ void down_chunk(const ExpertGroup& g, u32 item0, u32 count,
                                           const float* h,
                                           const float* item_weight,
                                           float* __restrict__ out, u32 hidden, u32 inter,
                                           MoeShared<MAXI>& sh, bool early,
                                           u32 lead_slot = NO_LEAD_SLOT) {
    if (threadIdx.x < count) sh.rows[threadIdx.x] = h + (u64)(item0 + threadIdx.x) * inter;
    __syncthreads();
    block_pass<NT, MAXI, STAGED, 1, RING, RING, PAIRED>(
        reinterpret_cast<const uint4*>(g.down), reinterpret_cast<const uint4*>(g.down_scales),
        hidden, inter, blockIdx.x, 0, count, sh, staged_space<MAXI, RING, PAIRED>(), true, early);
    __syncthreads();
    if (lead_slot != NO_LEAD_SLOT) spx_cluster_wait();
    for (u32 o = threadIdx.x; o < count * MOE_COLS; o += MOE_THREADS) {
        const u32 m = o / MOE_COLS, c = o % MOE_COLS;
        const u32 item = item0 + m;
        const float v = __fmul_rn(item_weight[item], warps_total<MAXI, RING, PAIRED>(0, m, c));
        out[(u64)item * hidden + MOE_COLS * blockIdx.x + c] = v;
        if (lead_slot != NO_LEAD_SLOT) cluster_store(lead_slot + 4u * c, v);
    }
    __syncthreads();
}

// Block column bx of group by (grid = (inter / 64, groups) or more), block = 256. Chunks of
// MAXI items; a chunk of at most 8 items takes the one-tile path (same bits, half the mma work).
template <int MAXI, bool STAGED, int RING, bool PAIRED>
__device__ __forceinline__ void gate_up_kernel(const ExpertGroup* groups,
                                               const float* x,
                                               const u32* item_row,
                                               float* __restrict__ h, u32 hidden, u32 inter,
                                               u32 bx, u32 by) {
    // Two tiles of gate and up accumulators at once would not fit the registers.
    static_assert(!(PAIRED && MAXI > 8), "a paired variant takes at most 8 items a chunk");
    __shared__ MoeShared<MAXI> sh;
    const ExpertGroup g = groups[by];
    for (u32 done = 0; done < g.count; done += MAXI) {
        const u32 n = min((u32)MAXI, g.count - done);
        if constexpr (MAXI > 8) {
            if (n > 8) {
                gate_up_chunk<2, MAXI, STAGED, RING, PAIRED>(g, g.first + done, n, x, item_row,
                                                             h, hidden, inter, sh, bx);
                continue;
            }
        }
        gate_up_chunk<1, MAXI, STAGED, RING, PAIRED>(g, g.first + done, n, x, item_row, h,
                                                     hidden, inter, sh, bx);
    }
}

// grid = (hidden / 64, groups), block = 256. The group is known before the wait (see
// group_before_wait), so the first chunk's weights are in flight before it: they stream while
// the gate/up launch drains, as the one-row dense products' first pieces do (linear_block's
// EARLY). A block whose group is empty reads nothing an earlier kernel writes but its group.
// `lead_slot`: as down_chunk's (the one-row combine; groups of one item). Returns the group's
// item count.
template <int MAXI, bool STAGED, int RING, bool PAIRED>
__device__ __forceinline__ u32 down_kernel(const ExpertGroup* groups,
                                           const float* h,
                                           const float* item_weight,
                                           float* __restrict__ out, u32 hidden, u32 inter,
                                           u32 lead_slot = NO_LEAD_SLOT) {
    __shared__ MoeShared<MAXI> sh;
    const ExpertGroup g = group_before_wait(groups, blockIdx.y);
    for (u32 done = 0; done < g.count; done += MAXI) {
        const u32 n = min((u32)MAXI, g.count - done);
        if constexpr (MAXI > 8) {
            if (n > 8) {
                down_chunk<2, MAXI, STAGED, RING, PAIRED>(g, g.first + done, n, h, item_weight,
                                                          out, hidden, inter, sh, done == 0);
                continue;
            }
        }
        down_chunk<1, MAXI, STAGED, RING, PAIRED>(g, g.first + done, n, h, item_weight, out,
                                                  hidden, inter, sh, done == 0, lead_slot);
    }
    return g.count;
}

// The shared experts' down product of one row, s_y = s_h @ s_down^T (s_down: [hidden][s_inter]
// f16), by the blocks of a gate_up launch beside its routed ones (gate_up_role): it
// needs no routing, and the one-row gate_up leaves SMs free (132 blocks of 2 an SM at
// DeepSeek-V2-Lite's shape). A block of 8 warps runs two of linear_f16_1's 4-warp work blocks
// (linear_block's features follow the warp index), so each output gets linear_f16_1's
// arithmetic and bits; its first weights load before the wait (EARLY), as linear_f16_1's.
// `block`: the shared down's block index, 0 onwards.
__device__ __forceinline__ void shared_down_block(u32 block, const float* s_h,
                                                  u32 s_inter, const __half* SPX_READONLY s_down,
                                                  float* __restrict__ s_y, u32 hidden) {
    linear_block<true, true>(s_h, 1, (int)s_inter, s_down, (int)hidden, nullptr, s_y,
                             (int)(2 * block));
}

// The role of a gate_up block: routed block `index` (block column index % gx of group
// index / gx) or shared down block `index`. In launch order the two kinds alternate while both
// last (even blocks routed), then the rest of the longer kind follows, so routed and shared
// blocks share the multiprocessors. Every block's work and bits do not depend on its place.
struct GateUpRole {
    bool shared;
    u32 index;
};

__device__ __forceinline__ GateUpRole gate_up_role(u32 num_groups) {
    const u32 gx = gridDim.x;
    const u32 l = blockIdx.y * gx + blockIdx.x;
    const u32 routed = num_groups * gx;
    const u32 shared = gx * gridDim.y - routed;
    const u32 pairs = min(routed, shared);
    if (l < 2 * pairs) return GateUpRole{(l & 1u) != 0u, l >> 1};
    return routed > shared ? GateUpRole{false, l - pairs} : GateUpRole{true, l - pairs};
}

// MOE_INT4_KERNELS(MAXI, MIN_BLOCKS, STAGED, RING, PAIRED): the gate_up and down kernels of one
// variant; the host's table gives MAXI, STAGED, RING and PAIRED of both variants
// (MOE_INT4_V0_*, MOE_INT4_V1_*); src/backend/cuda/moe/int4.rs sizes a launch's dynamic shared memory
// from them: MOE_WARPS moe_warp_space_bytes(MAXI, RING, PAIRED), plus 2 K (MAXI + 1) bytes of
// staged activations when STAGED. gate_up's grid has room for num_groups rows of routed blocks
// and, when s_down is given, rows of shared_down_block, in the order gate_up_role gives.
//
// The 8-item variant, which runs the draft's one-row steps: 16 ring slots (gate_up: 8 tile rows
// each of gate and up; down: 16 rows, more than the 11 a warp has at DeepSeek-V2-Lite's inter
// of 1408) and at most 128 registers (its gate and up accumulators take 64); 100 KB of shared
// memory a block, two blocks an SM, more than the 132 or 192 blocks of a one-row launch need.
// The 16-item variant: 8 slots and two passes; a cap of 2 blocks (128 registers) as its acc and
// partial fragments alone take 64 registers, and a cap of 3 (80) makes ptxas spill.
#define MOE_INT4_KERNELS(MAXI, MIN_BLOCKS, STAGED, RING, PAIRED)                                  \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MIN_BLOCKS)                         \
        moe_int4_gate_up_##MAXI(const ExpertGroup* groups,                                        \
                                const float* x, const u32* item_row,                              \
                                float* __restrict__ h, u32 hidden, u32 inter, u32 num_groups,     \
                                const float* s_h, u32 s_inter,                                    \
                                const __half* SPX_READONLY s_down, float* __restrict__ s_y) {     \
        const GateUpRole role = gate_up_role(num_groups);                                         \
        if (role.shared) {                                                                        \
            spx_launch_dependents();                                                              \
            shared_down_block(role.index, s_h, s_inter, s_down, s_y, hidden);                     \
            return;                                                                               \
        }                                                                                         \
        /* The down launch reads its groups before its wait: see group_before_wait. */            \
        spx_grid_wait();                                                                          \
        spx_launch_dependents();                                                                  \
        gate_up_kernel<MAXI, STAGED, RING, PAIRED>(groups, x, item_row, h, hidden, inter,         \
                                                   role.index % gridDim.x,                        \
                                                   role.index / gridDim.x);                       \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(MOE_THREADS, MIN_BLOCKS)                         \
        moe_int4_down_##MAXI(const ExpertGroup* groups, const float* h,                           \
                             const float* item_weight, float* __restrict__ out,                   \
                             u32 hidden, u32 inter) {                                             \
        spx_launch_dependents();                                                                  \
        down_kernel<MAXI, STAGED, RING, PAIRED>(groups, h, item_weight, out, hidden, inter);      \
    }

// The two variants, their shapes from the host's table (MOE_INT4_V0_*, MOE_INT4_V1_*). The
// indirection expands the table's names before MOE_INT4_KERNELS pastes MAXI into the kernel
// names (moe_int4_gate_up_8, moe_int4_down_16, ...).
#define MOE_INT4_KERNELS_OF(...) MOE_INT4_KERNELS(__VA_ARGS__)
MOE_INT4_KERNELS_OF(MOE_INT4_V0_ITEMS, 2, MOE_INT4_V0_STAGED, MOE_INT4_V0_RING, MOE_INT4_V0_PAIRED)
MOE_INT4_KERNELS_OF(MOE_INT4_V1_ITEMS, 2, MOE_INT4_V1_STAGED, MOE_INT4_V1_RING, MOE_INT4_V1_PAIRED)

// The one-row down launch of the 8-item variant with the layer's combine in it (the draft's
// steps): moe_combine's y = sum over the row's top_k items of out[item] (ascending item) + s_y
// (the shared experts' output, which the gate/up launch wrote; null without shared experts).
// Launched in thread block clusters of (1, top_k) blocks, the groups of one block column: every
// block stores its columns of out, and the same values into the first block's shared memory
// (distributed shared memory); after the cluster's barrier the first block adds them there, not
// through L2. Each block computes what moe_int4_down_8 computes, so out and y have the bits of
// that launch and moe_combine's. For a row whose groups are its items (group g holds item g, as
// the one-row plan makes them; top_k <= 8). Grid: (hidden / 64, top_k).
extern "C" __global__ void __launch_bounds__(MOE_THREADS, 2)
    moe_int4_down_combine_8(const ExpertGroup* groups, const float* h, const float* item_weight,
                            float* __restrict__ out, u32 hidden, u32 inter, u32 top_k,
                            const float* s_y, float* __restrict__ y) {
    // The first block of the cluster (rank 0: the cluster is one block column's top_k blocks)
    // keeps every block's 64 outputs here, so its sum reads shared memory, not L2.
    __shared__ float lead_out[8][MOE_COLS];
    spx_launch_dependents();
    spx_cluster_arrive_relaxed();
    const u32 slot = cluster_addr(&lead_out[blockIdx.y][0], 0);
    // A block with no item has not waited for the others' start (down_chunk): it does so here,
    // as every block waits once between its two arrivals.
    if (down_kernel<8, true, 16, true>(groups, h, item_weight, out, hidden, inter, slot) == 0) {
        spx_cluster_wait();
    }
    const bool lead = blockIdx.y == 0 && threadIdx.x < MOE_COLS;
    const u32 c = MOE_COLS * blockIdx.x + threadIdx.x;
    float shared_out = 0.0f;
    if (lead) {
        // (A block whose group is empty would not have waited; y may still be read by a kernel
        // before it.) The shared experts' output is read while the other blocks finish.
        spx_grid_wait();
        if (s_y != nullptr) shared_out = __ldcg(s_y + c);
    }
    spx_cluster_sync();
    if (!lead) return;
    float acc = 0.0f;
    for (u32 j = 0; j < top_k; ++j) acc += lead_out[j][threadIdx.x];
    if (s_y != nullptr) acc = acc + shared_out;
    y[c] = acc;
}
