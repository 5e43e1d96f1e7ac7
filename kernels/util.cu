// Small utility kernels: buffer fill, half-precision axpy, a position-weighted byte checksum and
// the link pacing pair. The runtime uses them to prepare buffers and to pace expert copies;
// `doctor` uses them to prove that kernels compile, load and compute the right numbers on this
// machine, and that copied bytes arrived intact.

#include <cuda_fp16.h>

// y[i] = value for every i < n.
extern "C" __global__ void fill_f16(__half* __restrict__ y, float value, unsigned long long n) {
    const __half v = __float2half(value);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        y[i] = v;
    }
}

// y[i] = a * x[i] + y[i], accumulated in f32 and rounded once to f16.
extern "C" __global__ void axpy_f16(__half* __restrict__ y, const __half* x, float a,
                                    unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        y[i] = __float2half(fmaf(a, __half2float(x[i]), __half2float(y[i])));
    }
}

// *out += sum over i of data[i] * ((i % 251) + 1), modulo 2^64.
// Weighting by position makes swapped or shifted bytes change the sum, unlike a plain byte sum.
// The caller zeroes *out first; the host reference computes the same sum.
extern "C" __global__ void byte_checksum(const unsigned char* data, unsigned long long n,
                                         unsigned long long* __restrict__ out) {
    unsigned long long acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        acc += (unsigned long long)data[i] * ((i % 251ull) + 1ull);
    }
    // Reduce within the warp before touching global memory: one atomic per warp.
    for (int offset = 16; offset > 0; offset >>= 1) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(out, acc);
    }
}

// Link pacing (`--link-gbps`): the expert copy stream runs link_pace_start before a batch of copies
// and link_pace_wait after it, so the batch takes at least `ns` nanoseconds from the start stamp,
// as on a link of that rate. One thread each; %globaltimer is the GPU's nanosecond clock, which
// both kernels read, so no host clock is involved.
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// Longest single sleep of link_pace_wait, ns: short enough that the batch ends within a few
// microseconds of its due time.
#define PACE_SLEEP_NS 2000

// *stamp = now.
extern "C" __global__ void link_pace_start(unsigned long long* __restrict__ stamp) {
    *stamp = global_ns();
}

// Returns once `ns` nanoseconds have passed since *stamp, sleeping in short steps rather than
// spinning flat out (it shares an SM with compute kernels).
extern "C" __global__ void link_pace_wait(const unsigned long long* stamp,
                                          unsigned long long ns) {
    const unsigned long long until = *stamp + ns;
    for (unsigned long long now = global_ns(); now < until; now = global_ns()) {
#if __CUDA_ARCH__ >= 700
        const unsigned long long left = until - now;
        __nanosleep(left < PACE_SLEEP_NS ? (unsigned)left : PACE_SLEEP_NS);
#endif
    }
}
