// Tensor-core building blocks (sm_80 and newer) of the prompt pass's kernels (gemm_f16.cu,
// attention_prompt.cu): asynchronous 16-byte copies to shared memory, ldmatrix and mma.sync
// m16n8k16 with f16 operands and f32 accumulators. Spliced into each including file by build.rs,
// like common.cuh, which the file includes first (with cuda_fp16.h).
//
// Fragments, per lane l of a warp (g = l / 4, t = l % 4), as PTX defines them for m16n8k16:
//   A (16 x 16, row): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..)
//   B (16 x 8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t + 8.., n g)
//   C (16 x 8):       c0, c1 = (g, 2t..2t+1), c2, c3 = (g + 8, 2t..2t+1)
// ldmatrix.x4 gives lane l, of matrix i (whose 8 row addresses lanes 8i .. 8i + 7 supply),
// elements (row g, columns 2t, 2t + 1); with .trans, (rows 2t, 2t + 1, column g).

#ifndef SPECTER_KERNELS_MMA_CUH
#define SPECTER_KERNELS_MMA_CUH

// 16 bytes global -> shared, asynchronously; `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void mma_cp16(__half* smem, const __half* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mma_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void mma_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mma_ldmatrix4(unsigned r[4], const __half* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// d += a (16 x 16, row) * b (16 x 8, col), f16 operands, f32 accumulators.
__device__ __forceinline__ void mma_16816(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix.x4 with .trans: each matrix transposed (a B fragment from a row-major [k][n] tile).
__device__ __forceinline__ void mma_ldmatrix4_trans(unsigned r[4], const __half* smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// Two floats as the f16 pair of an operand register (lo in the low half), each rounded to
// nearest even.
__device__ __forceinline__ unsigned mma_pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

#endif
