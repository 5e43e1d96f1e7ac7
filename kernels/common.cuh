// Definitions shared by several kernel files: the grouped-expert work item and the fixed-order
// reductions. A kernel file includes it with `#include "common.cuh"`; build.rs splices this text
// in at that line before embedding the source (NVRTC sees one self-contained file, and the
// source's hash, which keys the PTX cache, covers this header too), and nvcc finds it beside the
// including file.

#ifndef SPECTER_KERNELS_COMMON_CUH
#define SPECTER_KERNELS_COMMON_CUH

// One routed expert's group of work items. Mirrors `ExpertGroup` in src/backend/cuda/experts.rs
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

#endif  // SPECTER_KERNELS_COMMON_CUH
