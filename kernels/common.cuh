// Definitions shared by several kernel files: the grouped-expert work item and the fixed-order
// reductions. A kernel file includes it with `#include "common.cuh"`; build.rs splices this text
// in at that line before embedding the source (NVRTC sees one self-contained file, and the
// source's hash, which keys the PTX cache, covers this header too), and nvcc finds it beside the
// including file.

#ifndef SPECTER_KERNELS_COMMON_CUH
#define SPECTER_KERNELS_COMMON_CUH

// Memory no kernel writes (weights, rope tables, the expert table; all uploaded before the
// launches that read them): its pointers are `const T* SPX_READONLY p` and its explicit loads
// `spx_ldg`, which the compiler turns into non-coherent loads (ld.global.nc). Nothing else may be
// read that way. A non-coherent load promises the memory does not change while the kernel runs,
// and under programmatic dependent launch (spx_grid_wait) a kernel runs while the one before it
// still writes: the compiler and ptxas may then move such a load of an activation above the
// wait (ptxas did, in a kernel taken back) and read stale values. Activations, caches and plans
// are read through plain pointers (coherent loads, which stay after the wait).
// tests/kernels_compile.rs compiles every kernel with SPX_AUDIT_NC defined, where both marks
// become plain, and fails on any non-coherent load left.
#ifndef SPX_AUDIT_NC
#define SPX_READONLY __restrict__
#define spx_ldg(p) __ldg(p)
#else
#define SPX_READONLY
#define spx_ldg(p) (*(p))
#endif

// One routed expert's group of work items. Mirrors `ExpertGroup` in src/backend/cuda/moe/experts.rs
// (#[repr(C)], 40 bytes).
struct ExpertGroup {
    unsigned long long gate_up;         // gate/up weight: f16 [2 * inter][hidden], or INT4 qweight
                                        // of K = hidden, N = 2 * inter (gate columns, then up)
    unsigned long long gate_up_scales;  // INT4 only: f16 [hidden / 128][2 * inter], Marlin-permuted
    unsigned long long down;            // down weight: f16 [hidden][inter], or INT4 qweight of
                                        // K = inter, N = hidden
    unsigned long long down_scales;     // INT4 only: f16 [inter / 128][hidden]
    unsigned first;                     // this expert's items are first .. first + count
    unsigned count;
};
static_assert(sizeof(ExpertGroup) == 40, "ExpertGroup must match the Rust struct");

// Group y of a work list, read before spx_grid_wait from L2 (ld.global.cg: past this SM's L1,
// which may hold an earlier layer's list at the same address). For the INT4 down kernels only
// (kernels/moe_int4.cu): the list's writer (the routing launch) has finished before they can
// launch, because the gate/up launch between them lets its dependents launch only after its
// routed blocks' own wait, and a kernel launches only once every block of the one before has
// let it (or finished).
__device__ __forceinline__ ExpertGroup group_before_wait(const ExpertGroup* groups, unsigned y) {
    const unsigned long long* p = reinterpret_cast<const unsigned long long*>(groups + y);
    ExpertGroup g;
    g.gate_up = __ldcg(p);
    g.gate_up_scales = __ldcg(p + 1);
    g.down = __ldcg(p + 2);
    g.down_scales = __ldcg(p + 3);
    const unsigned long long fc = __ldcg(p + 4);
    g.first = (unsigned)fc;
    g.count = (unsigned)(fc >> 32);
    return g;
}

// Sum of `v` over the 32 lanes of a warp by a fixed butterfly (xor 16, 8, 4, 2, 1): every lane
// gets the same bits, whatever the launch.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Maximum of `v` over the 32 lanes of a warp; every lane gets it.
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Four consecutive floats: one 16-byte load when aligned, else four scalar ones (same values).
__device__ __forceinline__ float4 load_float4(const float* p, bool aligned) {
    if (aligned) return *reinterpret_cast<const float4*>(p);
    return make_float4(p[0], p[1], p[2], p[3]);
}

// Programmatic dependent launch (sm_90 and newer). The backend may launch a kernel while the one
// before it on the stream is still running (src/backend/cuda/backend.rs, `launch`); such a kernel
// must not touch memory an earlier kernel writes or reads before `spx_grid_wait`, which returns
// once every earlier kernel has finished and its writes are visible. Only reads of weights, which
// no kernel writes, may come before it (and the INT4 down's work list: group_before_wait).
// `spx_launch_dependents` lets the next kernel start launching (its blocks then wait in their own
// `spx_grid_wait`). Without such a launch both are no-ops, so every kernel calls them.
__device__ __forceinline__ void spx_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void spx_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The start of a kernel: let the next one launch, then wait for the previous ones.
#define SPX_PROLOGUE()           \
    do {                         \
        spx_launch_dependents(); \
        spx_grid_wait();         \
    } while (0)

// The start of a glue kernel (norms, attention, MLA's cache steps, the MoE combine; kernels/ops.cu
// and attention.cu): wait, then let the next kernel launch. The one-row dense products that
// follow glue read their first weights before their own wait (gemv_f16.cu, linear_block's
// EARLY); launched this late, those reads overlap only the glue kernel, which reads little from
// DRAM, and not the stream of the product before it.
#define SPX_PROLOGUE_LATE()      \
    do {                         \
        spx_grid_wait();         \
        spx_launch_dependents(); \
    } while (0)

// Thread block clusters (sm_90 and newer; the host launches in clusters only there): the barrier
// of every thread of the cluster's blocks. Writes before it (to global or any block's shared
// memory) are visible to the cluster's reads after it. Every thread of every block of the
// cluster must reach it.
__device__ __forceinline__ void spx_cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// Distributed shared memory (thread block clusters, sm_90 and newer): the address of this block's
// shared `p` in the shared memory of cluster block `rank`, and a store to such an address
// (visible to that block after spx_cluster_sync, or after its own barrier's wait).
__device__ __forceinline__ unsigned cluster_addr(const void* p, unsigned rank) {
    unsigned out = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(rank));
#endif
    return out;
}

__device__ __forceinline__ void cluster_store(unsigned addr, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
#else
    __trap();
#endif
}

// The halves of spx_cluster_sync: every block of the cluster arrives (relaxed: it orders no
// memory), and later waits for the others' arrival. Between them a block may do anything; a
// block stores into another's shared memory only once that block has started, which the wait
// after its arrival guarantees.
__device__ __forceinline__ void spx_cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}

__device__ __forceinline__ void spx_cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// Asks L2 to fetch `bytes` bytes from `p` (the weights of a block's next work block), one
// 128-byte line per lane and step. Only after `spx_grid_wait`, when the kernel before has finished
// streaming its own weights.
__device__ __forceinline__ void spx_prefetch_l2(const void* p, size_t bytes, int lane) {
    const char* c = reinterpret_cast<const char*>(p);
    for (size_t off = (size_t)lane * 128; off < bytes; off += 32 * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
    }
}

#endif  // SPECTER_KERNELS_COMMON_CUH

// The routed experts' SiLU, silu(g) = g / (1 + e^-g), with an exp of our own: the host expert
// kernel (src/host_experts/activation.rs) computes the same operations in the same order, so an
// expert gives the same bits on either side. Each step is one IEEE operation, spelled with its
// round-to-nearest intrinsic so the compiler fuses nothing that is not written as an fma.
__device__ __forceinline__ float spx_exp(float x) {
    if (x != x) return x;
    if (x < -87.0f) return 0.0f;
    if (x > 88.0f) return __int_as_float(0x7f800000);
    const float n = __fsub_rn(fmaf(x, __int_as_float(0x3fb8aa3b), 12582912.0f), 12582912.0f);
    float r = fmaf(n, -__int_as_float(0x3f317200), x);
    r = fmaf(n, -__int_as_float(0x35bfbe8e), r);
    float p = __int_as_float(0x39500d01);
    p = fmaf(p, r, __int_as_float(0x3ab60b61));
    p = fmaf(p, r, __int_as_float(0x3c088889));
    p = fmaf(p, r, __int_as_float(0x3d2aaaab));
    p = fmaf(p, r, __int_as_float(0x3e2aaaab));
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    // n is an integer in [-126, 127]: 2^n is a normal float.
    const float scale = __int_as_float(((int)n + 127) << 23);
    return __fmul_rn(p, scale);
}

__device__ __forceinline__ float spx_silu(float g) {
    return __fdiv_rn(g, __fadd_rn(1.0f, spx_exp(-g)));
}
