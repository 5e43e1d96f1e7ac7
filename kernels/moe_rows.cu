// Grouped MoE expert kernels for quantized weights in the row layout (docs/FORMAT.md, "Expert
// encodings"; src/quant/rows.rs): 8- and 4-bit targets and 3- and 2-bit drafts. Over the groups
// of one work list (src/backend/cuda/moe/experts.rs):
//
//   moe_rows_gate_up_<B>: h[item][j]   = silu(x[row]·gate_j) * (x[row]·up_j),       j < inter
//   moe_rows_down_<B>:    out[item][c] = item_weight[item] * (h[item]·down_c),     c < hidden
//
// B (8, 4, 3, 2) is the code width. ExpertGroup: gate_up = the codes of the [2 inter][hidden B / 8]
// byte matrix (gate rows, then up rows), gate_up_scales = its [2 inter][hidden / 128] f16
// scales; down = the codes of [hidden][inter B / 8], down_scales = [hidden][inter / 128]. One
// output row's codes are contiguous: 8 bits, byte i is the code of input i; 4 bits, byte i
// holds input 2 i's code in its low nibble and input 2 i + 1's in its high one; 3 and 2 bits,
// each run of 32 inputs is B little-endian u32 words (bit planes: bit j of word p is bit p of
// the code of input 32 run + j). A code q stands for (q - 2^(B-1)) * scale, one scale per (output
// row, group of 128 inputs).
//
// NUMERICS CONTRACT. Every result's bits are fixed by the following, whatever the launch; a host
// implementation that follows it gives the same bits.
//   1. The activation operand (x for gate/up, h for down) is rounded to f16 (to nearest even)
//      and back to f32: xr_i = (float)(half)x_i.
//   2. One output row and one item: the row's inputs are split in chunks, 16 inputs at 8 bits,
//      one 32-input run at 4, 3 and 2 bits. Lane L of 32 takes chunks L, L + 32, L + 64, ... in
//      ascending order; acc = 0; for each chunk: p = 0; for each input i of the chunk, ascending,
//      p = fmaf((float)(q_i - 2^(B-1)), xr_i, p); then acc = fmaf(p, scale(row, group of the
//      chunk), acc), the f16 scale taken as f32. A lane with no chunk keeps acc = 0. (fmaf: one
//      rounding, as Rust's f32::mul_add.)
//   3. The row's dot product is the sum of the 32 lanes' acc by the xor butterfly of
//      common.cuh's warp_sum: for offset 16, 8, 4, 2, 1: acc = acc + (acc of lane ^ offset).
//   4. gate/up: h = silu(g) * u with common.cuh's spx_silu, the product rounded once
//      (__fmul_rn); down: out = item_weight * d, rounded once. All arithmetic is f32.
// Batch invariance: an item's steps above depend only on its own activation row, its expert and
// the shapes: never on its group's size, its place in the group or the launch. Items are taken
// at most ROWS_ITEMS at a time with separate accumulators; a chunk of fewer items, and the
// one-item code, run the same steps.
//
// How the codes become operands, in three instructions a code and item (take, subtract, fma).
// A float with exponent 23 (bits 0x4B000000) whose mantissa holds only q at bits s .. s+B-1 is
// exactly 2^23 + q 2^s; subtracting the constant 2^23 + 2^(B-1) 2^s leaves (q - 2^(B-1)) 2^s
// exactly. At 8 bits a byte permute puts each code at s = 0 under that exponent. At 4 bits a
// word's nibbles 0 to 4 are read in place (s = 4 m) and nibbles 5 to 7 from the word shifted
// down 12 bits (s = 4 m - 12), every field below bit 23. At 2 and 3 bits
// a few shifts and masks per run interleave the planes so that each code's bits are adjacent in
// one word, at a position s = plane_shift(i) <= 23 - B; each such word gets the exponent's top
// byte once, and one and with a constant per code keeps the field and the exponent. The staged
// activation is stored times 2^-s: exact, as a nonzero f16 value is at least 2^-24 in magnitude
// and s <= 20, so the product stays a normal f32. Each fma then multiplies (q - 2^(B-1)) 2^s by
// xr_i 2^-s, exactly the product the contract names, and fmaf rounds only that exact product plus
// p: the contract's bits (a zero code's operand is +0 either way; infinities and NaN propagate
// alike).
//
// Work split. A block is ROWS_WARPS warps over one group (blockIdx.y); each warp streams
// ROWS_WARP_PAIRS pairs of rows: gate/up, features j (gate row j and up row inter + j) for
// consecutive j; down, pairs of adjacent output rows. For each chunk of at most ROWS_ITEMS items
// the block stages the items' activation rows in dynamic shared memory (step 1, pre-scaled as
// above), in chunks of CHUNK floats padded to CHUNK + ROWS_PAD so that the float4 reads of a
// warp's 32 lanes hit distinct banks; then every warp streams its rows once for those items:
// 16-byte (8 and 4 bits), 3 x 4-byte (3 bits) or 8-byte (2 bits) loads, several chunks of both
// rows in flight per lane, each code decoded once for every item and each activation read once
// for both rows. The one-item code (the _1 kernels, and chunks of one item in the others) runs
// its pairs as one stream: the next chunks' loads, of this pair or the next, are in flight while
// the current ones compute, and the first ones are issued before the staging. Each warp asks L2
// for all its rows first; the down kernels do that before their wait for the gate/up launch (the
// group read as group_before_wait allows: the gate/up kernels let the next launch start only
// after their own wait), so the weights stream while the gate/up launch drains.
//
// Alignment: each expert's code matrix 16-byte aligned (8 and 4 bits: 16-byte loads; 2 bits:
// 8-byte; 3 bits: 4-byte), scales 2-byte, x and h 16-byte (float4 staging). hidden and inter are
// multiples of 128 (the host refuses other shapes).

#include <cuda_fp16.h>

#include "common.cuh"

#if !defined(ROWS_WARPS) || !defined(ROWS_ITEMS) || !defined(ROWS_PAD) || !defined(ROWS_WARP_PAIRS)
#error "build.rs defines the constants shared with the host (src/backend/cuda/runtime/kernel_defines.rs)"
#endif

// From the host's table: ROWS_WARPS, warps per block; ROWS_ITEMS, the most items a block takes
// at a time; ROWS_PAD, floats of padding after each staged chunk; ROWS_WARP_PAIRS, the pairs of
// rows a warp streams.
static_assert(ROWS_ITEMS == 8, "the item dispatch below covers 1, 2, 4 and 8 items");

typedef unsigned int u32;
typedef unsigned long long u64;

#define ROWS_THREADS (32 * ROWS_WARPS)
// Inputs per scale.
#define ROWS_GROUP 128
// The bits of the float 2^23.
#define ROWS_MAGIC 0x4B000000u

// Per width: inputs per chunk, u32 words of codes per chunk, and chunks of each row a lane loads
// at a time in the one-item code (two batches in registers, the one computing and the next, fit
// the one-item kernels' 64 registers).
template <int B>
struct Width;
template <>
struct Width<8> {
    static constexpr int CHUNK = 16, WORDS = 4, UNROLL_ONE = 1;
};
template <>
struct Width<4> {
    static constexpr int CHUNK = 32, WORDS = 4, UNROLL_ONE = 1;
};
template <>
struct Width<3> {
    static constexpr int CHUNK = 32, WORDS = 3, UNROLL_ONE = 1;
};
template <>
struct Width<2> {
    static constexpr int CHUNK = 32, WORDS = 2, UNROLL_ONE = 2;
};

// Floats of one item's staged row of k inputs (src/backend/cuda/moe/rows.rs computes the same).
template <int B>
__device__ __forceinline__ u32 staged_floats(u32 k) {
    return k / Width<B>::CHUNK * (Width<B>::CHUNK + ROWS_PAD);
}

// The bit position s of input i's code in the word Codes<B> takes it from (see "How the codes
// become operands").
template <int B>
__host__ __device__ constexpr int plane_shift(int i) {
    if (B == 8) return 0;
    if (B == 4) return i % 8 <= 4 ? 4 * (i % 8) : 4 * (i % 8) - 12;
    if (B == 2) return (i & ~1) <= 21 ? (i & ~1) : (i & ~1) - 22;
    return i - i % 3 <= 20 ? i - i % 3 : i - i % 3 - 21;
}

// Chunk c of a row's codes.
template <int B>
__device__ __forceinline__ void load_codes(const unsigned char* SPX_READONLY row, int c,
                                           u32 (&w)[Width<B>::WORDS]) {
    if constexpr (B == 8 || B == 4) {
        const uint4 v = spx_ldg(reinterpret_cast<const uint4*>(row) + c);
        w[0] = v.x;
        w[1] = v.y;
        w[2] = v.z;
        w[3] = v.w;
    } else if constexpr (B == 3) {
        const u32* p = reinterpret_cast<const u32*>(row) + 3 * c;
        w[0] = spx_ldg(p);
        w[1] = spx_ldg(p + 1);
        w[2] = spx_ldg(p + 2);
    } else {
        const uint2 v = spx_ldg(reinterpret_cast<const uint2*>(row) + c);
        w[0] = v.x;
        w[1] = v.y;
    }
}

// (q - 2^(bits-1)) 2^s for the code q at bits s .. s + bits - 1 of `word`, a word whose bits
// from 23 up are ROWS_MAGIC's (s + bits <= 23; the magic's bits are 24, 25, 27 and 30). With s
// and bits constant (unrolled loops): one and with a constant, one subtraction of a constant.
__device__ __forceinline__ float field_value(u32 word, int s, int bits) {
    const u32 f = word & ((((1u << bits) - 1u) << s) | ROWS_MAGIC);
    return __fsub_rn(__uint_as_float(f), (float)((1u << 23) + ((1u << (bits - 1)) << s)));
}

// `w` with its top byte replaced by the magic's (the fields below bit 23 unchanged). A byte
// permute rather than an or: the compiler would fold an or into each field's and, needing a
// second constant there.
__device__ __forceinline__ u32 with_magic(u32 w) { return __byte_perm(w, ROWS_MAGIC, 0x7210u); }

// One chunk's codes, ready to give input i's operand (i constant after unrolling).
template <int B>
struct Codes;

template <>
struct Codes<8> {
    u32 w[4];
    __device__ __forceinline__ explicit Codes(const u32 (&in)[4]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = in[k];
    }
    // Byte i % 4 of word i / 4 under the exponent of 2^23: 2^23 + q.
    __device__ __forceinline__ float value(int i) const {
        const u32 f = __byte_perm(w[i / 4], ROWS_MAGIC, 0x7540u | (u32)(i % 4));
        return __fsub_rn(__uint_as_float(f), 8388736.0f);  // 2^23 + 128
    }
};

// 4 bits: word i / 8 holds input i's code at nibble i % 8; `lo` is each word as loaded (nibbles
// 0 to 4 read in place), `hi` the word shifted down 12 bits (nibbles 5 to 7 at bits 8, 12, 16);
// each then carries the magic (with_magic).
template <>
struct Codes<4> {
    u32 lo[4], hi[4];
    __device__ __forceinline__ explicit Codes(const u32 (&w)[4]) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            hi[k] = with_magic(w[k] >> 12);
            lo[k] = with_magic(w[k]);
        }
    }
    __device__ __forceinline__ float value(int i) const {
        const u32 word = i % 8 <= 4 ? lo[i / 8] : hi[i / 8];
        return field_value(word, plane_shift<4>(i), 4);
    }
};

// 2 bits: `e` holds input i's code at bits i, i + 1 for even i (plane 0 at the even bits, plane 1
// shifted up to the odd ones), `o` at bits i - 1, i for odd i; `eh` and `oh` are both shifted
// down 22 bits for the inputs whose field lies past the mantissa. Each word then carries the
// magic (with_magic).
template <>
struct Codes<2> {
    u32 e, o, eh, oh;
    __device__ __forceinline__ explicit Codes(const u32 (&w)[2]) {
        e = (w[0] & 0x55555555u) | ((w[1] << 1) & 0xAAAAAAAAu);
        o = ((w[0] >> 1) & 0x55555555u) | (w[1] & 0xAAAAAAAAu);
        eh = with_magic(e >> 22);
        oh = with_magic(o >> 22);
        e = with_magic(e);
        o = with_magic(o);
    }
    __device__ __forceinline__ float value(int i) const {
        const bool low = (i & ~1) <= 21;
        const u32 word = (i & 1) ? (low ? o : oh) : (low ? e : eh);
        return field_value(word, plane_shift<2>(i), 2);
    }
};

// 3 bits: for inputs i = 3 t + r the word of class r holds the code at bits i - r .. i - r + 2:
// plane p's bit i moved to i - r + p, and the three classes' masks (bits = 0, 1, 2 mod 3) merge
// the planes. Fields past bit 20 are read from the words shifted down 21 bits (`ah`, `bh`, `ch`);
// the top bit of inputs 30 and 31 falls off the 32-bit word `a` and `b` are built in, so it is
// put back into `ah` and `bh` from plane 2. Each word then carries the magic (with_magic).
template <>
struct Codes<3> {
    u32 a, b, c, ah, bh, ch;
    __device__ __forceinline__ explicit Codes(const u32 (&w)[3]) {
        constexpr u32 M0 = 0x49249249u, M1 = 0x92492492u, M2 = 0x24924924u;
        a = (w[0] & M0) | ((w[1] << 1) & M1) | ((w[2] << 2) & M2);
        b = ((w[0] >> 1) & M0) | (w[1] & M1) | ((w[2] << 1) & M2);
        c = ((w[0] >> 2) & M0) | ((w[1] >> 1) & M1) | (w[2] & M2);
        ah = with_magic((a >> 21) | ((w[2] >> 19) & 0x800u));
        bh = with_magic((b >> 21) | ((w[2] >> 20) & 0x800u));
        ch = with_magic(c >> 21);
        a = with_magic(a);
        b = with_magic(b);
        c = with_magic(c);
    }
    __device__ __forceinline__ float value(int i) const {
        const int r = i % 3;
        const bool low = i - r <= 20;
        const u32 word = r == 0 ? (low ? a : ah) : (r == 1 ? (low ? b : bh) : (low ? c : ch));
        return field_value(word, plane_shift<3>(i), 3);
    }
};

__device__ __forceinline__ float component(const float4& v, int e) {
    return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}

// Contract step 2 for one chunk of two rows and MT items: p0[m], p1[m] = the chunk's partial of
// row 0 and row 1 for item m, whose staged chunk starts at xc[m].
template <int B, int MT>
__device__ __forceinline__ void chunk_pair(const Codes<B>& d0, const Codes<B>& d1,
                                           const float* const (&xc)[MT], float (&p0)[MT],
                                           float (&p1)[MT]) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        p0[m] = 0.0f;
        p1[m] = 0.0f;
    }
#pragma unroll
    for (int q = 0; q < Width<B>::CHUNK / 4; ++q) {
        float v0[4], v1[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v0[e] = d0.value(4 * q + e);
            v1[e] = d1.value(4 * q + e);
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const float4 xv = reinterpret_cast<const float4*>(xc[m])[q];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p0[m] = fmaf(v0[e], component(xv, e), p0[m]);
                p1[m] = fmaf(v1[e], component(xv, e), p1[m]);
            }
        }
    }
}

// A warp's pairs of rows: pair k is rows r0 + k step and r1 + k step, their scales s0 + k sstep
// and s1 + k sstep; `pairs` of them (fewer at the end of the matrix), each of `chunks` chunks.
struct PairRows {
    const unsigned char* r0;
    const unsigned char* r1;
    const __half* s0;
    const __half* s1;
    u64 step, sstep;
    int pairs, chunks;
};

// UNR chunks of both rows of a pair (codes and scales), loaded together.
template <int B, int UNR>
struct Batch {
    u32 w0[UNR][Width<B>::WORDS], w1[UNR][Width<B>::WORDS];
    float s0[UNR], s1[UNR];
};

// Chunks base + lane + 32 u (u < UNR, those below pr.chunks) of pair k.
template <int B, int UNR>
__device__ __forceinline__ void load_batch(Batch<B, UNR>& b, const PairRows& pr, int k, int base,
                                           int lane) {
    constexpr u32 PER_GROUP = ROWS_GROUP / Width<B>::CHUNK;
    const unsigned char* r0 = pr.r0 + k * pr.step;
    const unsigned char* r1 = pr.r1 + k * pr.step;
    const __half* s0 = pr.s0 + k * pr.sstep;
    const __half* s1 = pr.s1 + k * pr.sstep;
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
        const u32 c = (u32)(base + lane + 32 * u);
        if (c < (u32)pr.chunks) {
            load_codes<B>(r0, c, b.w0[u]);
            load_codes<B>(r1, c, b.w1[u]);
            b.s0[u] = __half2float(spx_ldg(s0 + c / PER_GROUP));
            b.s1[u] = __half2float(spx_ldg(s1 + c / PER_GROUP));
        }
    }
}

// Contract step 2 over a loaded batch for MT items (staged rows xm[m]): acc a0, a1 of the lanes'
// chunks in it, in ascending order.
template <int B, int UNR, int MT>
__device__ __forceinline__ void compute_batch(const Batch<B, UNR>& b, const float* const (&xm)[MT],
                                              int base, int chunks, int lane, float (&a0)[MT],
                                              float (&a1)[MT]) {
    constexpr int STRIDE = Width<B>::CHUNK + ROWS_PAD;
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
        const int c = base + lane + 32 * u;
        if (c < chunks) {
            const Codes<B> d0(b.w0[u]), d1(b.w1[u]);
            const float* xc[MT];
#pragma unroll
            for (int m = 0; m < MT; ++m) xc[m] = xm[m] + c * STRIDE;
            float p0[MT], p1[MT];
            chunk_pair<B, MT>(d0, d1, xc, p0, p1);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                a0[m] = fmaf(p0[m], b.s0[u], a0[m]);
                a1[m] = fmaf(p1[m], b.s1[u], a1[m]);
            }
        }
    }
}

// Step 4 for pair k and one item, given step 3's two sums: gate/up, h of feature j0 + k; down,
// out of rows c0 + 2 k and c0 + 2 k + 1.
struct GateUpStore {
    float* h;
    u32 inter, j0;
    __device__ __forceinline__ void operator()(u64 item, int k, float g, float u) const {
        h[item * inter + j0 + k] = __fmul_rn(spx_silu(g), u);
    }
};

struct DownStore {
    float* out;
    const float* item_weight;
    u32 hidden, c0;
    __device__ __forceinline__ void operator()(u64 item, int k, float d0, float d1) const {
        const float wt = item_weight[item];
        out[item * hidden + c0 + 2 * k] = __fmul_rn(wt, d0);
        out[item * hidden + c0 + 2 * k + 1] = __fmul_rn(wt, d1);
    }
};

// The one-item code: every pair of pr for `item`, staged at xs, as one stream of batches (pair
// by pair, each from chunk 0): the next batch's loads are issued before the current one
// computes. `cur` holds the first batch of pair 0, already issued.
template <int B, class Store>
__device__ __forceinline__ void one_item_pairs(const PairRows& pr,
                                               Batch<B, Width<B>::UNROLL_ONE>& cur,
                                               const float* xs, u64 item, int lane,
                                               const Store& store) {
    constexpr int UNR = Width<B>::UNROLL_ONE, SPAN = 32 * UNR;
    const float* xm[1] = {xs};
    float a0[1] = {0.0f}, a1[1] = {0.0f};
    int k = 0, base = 0;
    while (true) {
        int next_k = k, next_base = base + SPAN;
        if (next_base >= pr.chunks) {
            next_k = k + 1;
            next_base = 0;
        }
        const bool more = next_k < pr.pairs;
        Batch<B, UNR> next;
        if (more) load_batch<B, UNR>(next, pr, next_k, next_base, lane);
        compute_batch<B, UNR, 1>(cur, xm, base, pr.chunks, lane, a0, a1);
        if (next_k != k) {
            const float s0 = warp_sum(a0[0]);
            const float s1 = warp_sum(a1[0]);
            if (lane == 0) store(item, k, s0, s1);
            a0[0] = 0.0f;
            a1[0] = 0.0f;
        }
        if (!more) break;
        cur = next;
        k = next_k;
        base = next_base;
    }
}

// Every pair of pr for mr (2 to ROWS_ITEMS) items item0 ..., staged at xs, `xstride` floats
// apart: per pair, batches of one chunk of both rows for MT items (those past mr repeat item
// mr - 1; their results are dropped), then lane m stores item m's outputs.
template <int B, int MT, class Store>
__device__ __forceinline__ void items_pairs(const PairRows& pr, const float* xs, u32 xstride,
                                            int mr, u64 item0, int lane, const Store& store) {
    const float* xm[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) xm[m] = xs + (u32)min(m, mr - 1) * xstride;
    for (int k = 0; k < pr.pairs; ++k) {
        float a0[MT], a1[MT];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            a0[m] = 0.0f;
            a1[m] = 0.0f;
        }
        for (int base = 0; base < pr.chunks; base += 32) {
            Batch<B, 1> b;
            load_batch<B, 1>(b, pr, k, base, lane);
            compute_batch<B, 1, MT>(b, xm, base, pr.chunks, lane, a0, a1);
        }
        // Every lane sums every slot (the slots past mr too: no shuffle under a branch).
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const float s0 = warp_sum(a0[m]);
            const float s1 = warp_sum(a1[m]);
            if (m < mr && lane == m) store(item0 + m, k, s0, s1);
        }
    }
}

// Stages the activation rows of items item0 .. item0 + mr - 1 (row item_row[item] of src, or
// row item when item_row is null), k floats each, into xs: contract step 1, each value times
// 2^-plane_shift of its place in its chunk, in the padded chunk layout. The whole block calls it.
template <int B>
__device__ __forceinline__ void stage_rows(float* xs, const float* src, const u32* item_row,
                                           u32 item0, u32 mr, u32 k) {
    constexpr u32 CHUNK = Width<B>::CHUNK, STRIDE = CHUNK + ROWS_PAD;
    const u32 xstride = staged_floats<B>(k);
    for (u32 m = 0; m < mr; ++m) {
        const u32 row = item_row != nullptr ? item_row[item0 + m] : item0 + m;
        const float4* in = reinterpret_cast<const float4*>(src + (u64)row * k);
        float* dst = xs + m * xstride;
        for (u32 q = threadIdx.x; q < k / 4; q += ROWS_THREADS) {
            const float4 v = in[q];
            const float2 lo = __half22float2(__floats2half2_rn(v.x, v.y));
            const float2 hi = __half22float2(__floats2half2_rn(v.z, v.w));
            const u32 e = 4 * q, i = e % CHUNK;
            float r[4] = {lo.x, lo.y, hi.x, hi.y};
            if constexpr (B != 8) {
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    r[t] = __fmul_rn(r[t], __uint_as_float((u32)(127 - plane_shift<B>(i + t)) << 23));
                }
            }
            *reinterpret_cast<float4*>(dst + e / CHUNK * STRIDE + i) = make_float4(r[0], r[1], r[2], r[3]);
        }
    }
}

extern __shared__ float4 rows_stage_space[];

// The items of group g, `step` at a time (ONE: one at a time, which only the one-item code is
// compiled for): stages each chunk's activation rows (k inputs of src, rows item_row[item] or
// the items themselves), then streams the warp's pairs pr over them. The whole block calls it;
// `active`: whether this warp has pairs.
template <int B, bool ONE, class Store>
__device__ __forceinline__ void run_items(const ExpertGroup& g, const PairRows& pr, bool active,
                                          const float* src, const u32* item_row, u32 k, u32 step,
                                          const Store& store) {
    float* xs = reinterpret_cast<float*>(rows_stage_space);
    const int lane = threadIdx.x & 31;
    if (ONE) step = 1;
    for (u32 i0 = 0; i0 < g.count; i0 += step) {
        const u32 mr = min(step, g.count - i0);
        Batch<B, Width<B>::UNROLL_ONE> first;
        // The one-item stream's first loads fly during the staging.
        if (active && mr == 1) load_batch<B, Width<B>::UNROLL_ONE>(first, pr, 0, 0, lane);
        // The previous chunk's warps have finished reading the staged rows.
        if (i0 > 0) __syncthreads();
        stage_rows<B>(xs, src, item_row, g.first + i0, mr, k);
        __syncthreads();
        if (!active) continue;
        if (ONE || mr == 1) {
            one_item_pairs<B>(pr, first, xs, g.first + i0, lane, store);
        } else if constexpr (!ONE) {
            const u32 xstride = staged_floats<B>(k);
            if (mr == 2) {
                items_pairs<B, 2>(pr, xs, xstride, (int)mr, g.first + i0, lane, store);
            } else if (mr <= 4) {
                items_pairs<B, 4>(pr, xs, xstride, (int)mr, g.first + i0, lane, store);
            } else {
                items_pairs<B, 8>(pr, xs, xstride, (int)mr, g.first + i0, lane, store);
            }
        }
    }
}

// Asks L2 for `bytes` bytes from p (warp-wide).
__device__ __forceinline__ void prefetch(const unsigned char* SPX_READONLY p, u64 bytes, int lane) {
    spx_prefetch_l2(p, bytes, lane);
}

// Block (bx, by): features j0 = ROWS_WARP_PAIRS (bx ROWS_WARPS + warp) onwards of group by.
template <int B, bool ONE>
__device__ __forceinline__ void gate_up_block(const ExpertGroup& g, const float* x,
                                              const u32* item_row, float* __restrict__ h,
                                              u32 hidden, u32 inter, u32 chunk_items) {
    const int lane = threadIdx.x & 31;
    const u32 j0 = ROWS_WARP_PAIRS * (blockIdx.x * ROWS_WARPS + (threadIdx.x >> 5));
    const int pairs = j0 < inter ? (int)min((u32)ROWS_WARP_PAIRS, inter - j0) : 0;
    const u32 row_bytes = hidden * B / 8, scales = hidden / ROWS_GROUP;
    PairRows pr;
    pr.r0 = reinterpret_cast<const unsigned char*>(g.gate_up) + (u64)j0 * row_bytes;
    pr.r1 = pr.r0 + (u64)inter * row_bytes;
    pr.s0 = reinterpret_cast<const __half*>(g.gate_up_scales) + (u64)j0 * scales;
    pr.s1 = pr.s0 + (u64)inter * scales;
    pr.step = row_bytes;
    pr.sstep = scales;
    pr.pairs = pairs;
    pr.chunks = (int)(hidden / Width<B>::CHUNK);
    if (pairs > 0 && g.count > 0) {
        prefetch(pr.r0, (u64)pairs * row_bytes, lane);
        prefetch(pr.r1, (u64)pairs * row_bytes, lane);
    }
    run_items<B, ONE>(g, pr, pairs > 0, x, item_row, hidden, chunk_items, GateUpStore{h, inter, j0});
}

// Block (bx, by): output rows c0 = 2 ROWS_WARP_PAIRS (bx ROWS_WARPS + warp) onwards of group by.
// The group is read and the rows asked of L2 before the wait (see "Work split").
template <int B, bool ONE>
__device__ __forceinline__ void down_block(const ExpertGroup* groups, const float* h,
                                           const float* item_weight, float* __restrict__ out,
                                           u32 hidden, u32 inter, u32 chunk_items) {
    const ExpertGroup g = group_before_wait(groups, blockIdx.y);
    const int lane = threadIdx.x & 31;
    const u32 c0 = 2 * ROWS_WARP_PAIRS * (blockIdx.x * ROWS_WARPS + (threadIdx.x >> 5));
    // hidden is even: every pair is whole.
    const int pairs = c0 < hidden ? (int)min((u32)ROWS_WARP_PAIRS, (hidden - c0) / 2) : 0;
    const u32 row_bytes = inter * B / 8, scales = inter / ROWS_GROUP;
    PairRows pr;
    pr.r0 = reinterpret_cast<const unsigned char*>(g.down) + (u64)c0 * row_bytes;
    pr.r1 = pr.r0 + row_bytes;
    pr.s0 = reinterpret_cast<const __half*>(g.down_scales) + (u64)c0 * scales;
    pr.s1 = pr.s0 + scales;
    pr.step = 2 * (u64)row_bytes;
    pr.sstep = 2 * (u64)scales;
    pr.pairs = pairs;
    pr.chunks = (int)(inter / Width<B>::CHUNK);
    if (pairs > 0 && g.count > 0) prefetch(pr.r0, 2 * (u64)pairs * row_bytes, lane);
    spx_grid_wait();
    run_items<B, ONE>(g, pr, pairs > 0, h, nullptr, inter, chunk_items,
                      DownStore{out, item_weight, hidden, c0});
}

// gate/up waits before it lets the next launch start, which is what lets down read its group
// before its own wait.
template <int B, bool ONE>
__device__ __forceinline__ void gate_up_kernel(const ExpertGroup* groups, const float* x,
                                               const u32* item_row, float* __restrict__ h,
                                               u32 hidden, u32 inter, u32 chunk_items) {
    spx_grid_wait();
    spx_launch_dependents();
    gate_up_block<B, ONE>(groups[blockIdx.y], x, item_row, h, hidden, inter, chunk_items);
}

template <int B, bool ONE>
__device__ __forceinline__ void down_kernel(const ExpertGroup* groups, const float* h,
                                            const float* item_weight, float* __restrict__ out,
                                            u32 hidden, u32 inter, u32 chunk_items) {
    spx_launch_dependents();
    down_block<B, ONE>(groups, h, item_weight, out, hidden, inter, chunk_items);
}

// The kernels: moe_rows_{gate_up,down}_<B> take a group's items chunk_items (1 to ROWS_ITEMS)
// at a time; the _1 forms take them one at a time (decode, where every group holds one item),
// compiled for that alone: fewer registers, more blocks an SM, the same bits. Grid: gate/up
// (ceil(inter / (ROWS_WARP_PAIRS ROWS_WARPS)), groups), down (ceil(hidden / (2 ROWS_WARP_PAIRS
// ROWS_WARPS)), groups); block ROWS_THREADS; dynamic shared memory: chunk_items (the _1 forms:
// 1) staged rows of staged_floats(hidden) (gate/up) or staged_floats(inter) (down) floats.
// Blocks an SM: the general kernels' eight-item code needs up to 128 registers; the one-item
// kernels fit 64, four blocks an SM, so that a decode step's gate/up launch at DeepSeek-V2-Lite's
// widths (6 x 1408 features, 528 blocks) is one wave on 132 SMs.
#define ROWS_MIN_BLOCKS 2
#define ROWS_MIN_BLOCKS_ONE 4

extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_gate_up_8(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<8, false>(groups, x, item_row, h, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_gate_up_4(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<4, false>(groups, x, item_row, h, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_gate_up_3(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<3, false>(groups, x, item_row, h, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_gate_up_2(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<2, false>(groups, x, item_row, h, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_gate_up_8_1(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<8, true>(groups, x, item_row, h, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_gate_up_4_1(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<4, true>(groups, x, item_row, h, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_gate_up_3_1(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<3, true>(groups, x, item_row, h, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_gate_up_2_1(
    const ExpertGroup* groups, const float* x, const u32* item_row, float* __restrict__ h,
    u32 hidden, u32 inter, u32 chunk_items) {
    gate_up_kernel<2, true>(groups, x, item_row, h, hidden, inter, chunk_items);
}

extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_down_8(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<8, false>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_down_4(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<4, false>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_down_3(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<3, false>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS) moe_rows_down_2(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<2, false>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_down_8_1(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<8, true>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_down_4_1(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<4, true>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_down_3_1(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<3, true>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
extern "C" __global__ void __launch_bounds__(ROWS_THREADS, ROWS_MIN_BLOCKS_ONE) moe_rows_down_2_1(
    const ExpertGroup* groups, const float* h, const float* item_weight, float* __restrict__ out,
    u32 hidden, u32 inter, u32 chunk_items) {
    down_kernel<2, true>(groups, h, item_weight, out, hidden, inter, chunk_items);
}
