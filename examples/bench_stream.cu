// Weight-streaming designs for one-row matrix products, timed by examples/bench_stream.rs: how
// fast can a chain of dependent products read its weights, and what does each design lose at a
// kernel boundary? Each kernel computes y[n] = w[n, k] . x[k] (FP16 weights, f32 activations),
// after `griddepcontrol.wait` (the previous kernel wrote x), the way kernels/gemv_f16.cu does.
//
//   read_ldg     a warp owns two rows; its lanes load eight 16-byte pieces of each row at once
//                (linear_f16_1's shape), a block of four warps per eight rows
//   read_ldg_pf  the same, each warp asking L2 for its rows before the wait
//   read_bulk    persistent blocks (1 or 2 a multiprocessor): one producer lane copies stages of
//                eight rows into shared memory with `cp.async.bulk` (the copy engine of each
//                multiprocessor, no registers held) through a ring of `stages` buffers; the
//                weights of the first stages are requested before the wait; eight consumer
//                warps take a row each per stage
//
// The example prepends kernels/common.cuh (the backend's warp_sum). Only reads of the weights
// come before the wait. `late` = 0: a kernel lets the next one launch
// as it starts (so a chain's later kernels may all become resident, and read ahead, at once);
// 1: only after its own wait, so at most the next kernel is resident early.

#include <cuda_fp16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void launch_next() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ float dot8(const uint4& v, const float* __restrict__ xp, float s) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
    const float4 a = reinterpret_cast<const float4*>(xp)[0];
    const float4 b = reinterpret_cast<const float4*>(xp)[1];
    float2 t = __half22float2(h[0]);
    s = fmaf(t.x, a.x, s);
    s = fmaf(t.y, a.y, s);
    t = __half22float2(h[1]);
    s = fmaf(t.x, a.z, s);
    s = fmaf(t.y, a.w, s);
    t = __half22float2(h[2]);
    s = fmaf(t.x, b.x, s);
    s = fmaf(t.y, b.y, s);
    t = __half22float2(h[3]);
    s = fmaf(t.x, b.z, s);
    s = fmaf(t.y, b.w, s);
    return s;
}


template <bool PREFETCH>
__device__ __forceinline__ void ldg_rows(const __half* __restrict__ w, int k, int n,
                                         const float* __restrict__ x, float* __restrict__ y, int late) {
    if (!late) launch_next();
    const int lane = threadIdx.x & 31;
    const int col = 2 * (blockIdx.x * 4 + (threadIdx.x >> 5));
    if (col >= n) return;
    const uint4* v0 = reinterpret_cast<const uint4*>(w + (size_t)col * k);
    const uint4* v1 = reinterpret_cast<const uint4*>(w + (size_t)(col + 1) * k);
    if (PREFETCH) {
        const char* c = reinterpret_cast<const char*>(v0);
        for (int off = lane * 128; off < 4 * k; off += 32 * 128) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
        }
    }
    grid_wait();
    if (late) launch_next();
    const int chunks = k >> 3;
    float a0 = 0.0f, a1 = 0.0f;
    for (int c0 = lane; c0 < chunks; c0 += 256) {
        uint4 p0[8], p1[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int c = c0 + 32 * u;
            if (c < chunks) {
                p0[u] = __ldg(v0 + c);
                p1[u] = __ldg(v1 + c);
            }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int c = c0 + 32 * u;
            if (c < chunks) {
                a0 = dot8(p0[u], x + 8 * c, a0);
                a1 = dot8(p1[u], x + 8 * c, a1);
            }
        }
    }
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    if (lane == 0) {
        y[col] = a0;
        y[col + 1] = a1;
    }
}

extern "C" __global__ void __launch_bounds__(128) read_ldg(const __half* __restrict__ w, int k, int n,
                                                           const float* __restrict__ x,
                                                           float* __restrict__ y, int stages, int late) {
    ldg_rows<false>(w, k, n, x, y, late);
}

extern "C" __global__ void __launch_bounds__(128) read_ldg_pf(const __half* __restrict__ w, int k, int n,
                                                              const float* __restrict__ x,
                                                              float* __restrict__ y, int stages, int late) {
    ldg_rows<true>(w, k, n, x, y, late);
}

// Consumer warps of a bulk block, one weight row each per stage; the producer is one more warp.
#define BULK_WARPS 8
#define BULK_ROWS BULK_WARPS
#define BULK_MAX_STAGES 4

// The bulk copies and their barriers. `full[s]` completes when stage s's bytes have landed (one
// arrival, by the producer, with the byte count); `empty[s]` when every consumer warp has read
// it. Each completes once per use of its buffer, so a waiter passes parity (use / stages) & 1.

__device__ __forceinline__ unsigned stream_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void stream_bar_init(unsigned long long* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(stream_smem(bar)), "r"(count) : "memory");
#endif
}

// Makes the barriers' initialisation visible to the copy engine; a block barrier follows.
__device__ __forceinline__ void stream_bar_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void stream_bar_arrive(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(stream_smem(bar))
                 : "memory");
#endif
}

__device__ __forceinline__ void stream_bar_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(stream_smem(bar)), "r"(parity)
            : "memory");
    }
#endif
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared
// `dst`; `bar` completes once they have landed.
__device__ __forceinline__ void stream_copy(void* dst, const void* src, unsigned bytes,
                                            unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(
                     stream_smem(bar)),
                 "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            stream_smem(dst)),
        "l"(src), "r"(bytes), "r"(stream_smem(bar))
        : "memory");
#else
    __trap();
#endif
}

// Stage t of the matrix (rows 8t .. 8t + 7) goes to block t % gridDim.x; n % 8 == 0.
extern "C" __global__ void __launch_bounds__(32 * (BULK_WARPS + 1), 1)
    read_bulk(const __half* __restrict__ w, int k, int n, const float* __restrict__ x,
              float* __restrict__ y, int stages, int late) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) u64 full[BULK_MAX_STAGES], empty[BULK_MAX_STAGES];
    if (!late) launch_next();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 stage_bytes = (u32)BULK_ROWS * k * 2;
    const int total = n / BULK_ROWS;
    const int mine = (total - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            stream_bar_init(&full[s], 1);
            stream_bar_init(&empty[s], BULK_WARPS);
        }
        stream_bar_fence();
    }
    __syncthreads();
    if (warp == BULK_WARPS) {
        if (lane != 0) return;
        for (int i = 0; i < mine; ++i) {
            const int s = i % stages;
            if (i >= stages) stream_bar_wait(&empty[s], ((i / stages) - 1) & 1);
            const size_t row = (size_t)(blockIdx.x + i * gridDim.x) * BULK_ROWS;
            stream_copy(ring + (size_t)s * stage_bytes, w + row * k, stage_bytes, &full[s]);
        }
        return;
    }
    grid_wait();
    if (late) launch_next();
    const int chunks = k >> 3;
    for (int i = 0; i < mine; ++i) {
        const int s = i % stages;
        stream_bar_wait(&full[s], (i / stages) & 1);
        const uint4* r = reinterpret_cast<const uint4*>(ring + (size_t)s * stage_bytes) + (size_t)warp * chunks;
        float a = 0.0f;
        for (int c = lane; c < chunks; c += 32) a = dot8(r[c], x + 8 * c, a);
        __syncwarp();
        if (lane == 0) stream_bar_arrive(&empty[s]);
        a = warp_sum(a);
        if (lane == 0) y[(size_t)(blockIdx.x + i * gridDim.x) * BULK_ROWS + warp] = a;
    }
}
