// Small utility kernels: buffer fill, half-precision axpy and a position-weighted byte checksum.
// The runtime uses them to prepare buffers; `doctor` uses them to prove that kernels compile,
// load and compute the right numbers on this machine, and that copied bytes arrived intact.

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
extern "C" __global__ void axpy_f16(__half* __restrict__ y, const __half* __restrict__ x, float a,
                                    unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        y[i] = __float2half(fmaf(a, __half2float(x[i]), __half2float(y[i])));
    }
}

// *out += sum over i of data[i] * ((i % 251) + 1), modulo 2^64.
// Weighting by position makes swapped or shifted bytes change the sum, unlike a plain byte sum.
// The caller zeroes *out first; the host reference computes the same sum.
extern "C" __global__ void byte_checksum(const unsigned char* __restrict__ data, unsigned long long n,
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
