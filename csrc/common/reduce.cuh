// Block-wide reductions for CUDA kernels (blockDim.x a multiple of 32, at most 1024).
#pragma once

#include <cstdint>

namespace lowbit {

__device__ __forceinline__ uint32_t WarpMaxU32(uint32_t v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// Every thread of the block must call this; the result is valid in every thread.
__device__ __forceinline__ uint32_t BlockMaxU32(uint32_t v) {
  __shared__ uint32_t warp_max[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = WarpMaxU32(v);
  __syncthreads();  // warp_max may still be read by a previous call
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = lane < warps ? warp_max[lane] : 0u;
  return WarpMaxU32(v);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

}  // namespace lowbit
