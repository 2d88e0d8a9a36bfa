// LOWBIT_HD: a function that the CPU reference and the CUDA kernels share (host and device,
// always inlined under nvcc; a plain inline function for the host compiler).
#pragma once

#if defined(__CUDACC__)
#define LOWBIT_HD __host__ __device__ __forceinline__
#else
#define LOWBIT_HD inline
#endif
