// CUDA amax: one pass over x with 16-byte loads where the alignment allows, a block-wide
// max of |x| bit patterns, then one unsigned atomicMax per block and row (see amax.h).
#include <cuda_runtime.h>

#include <cstring>

#include "amax/amax.h"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"

namespace lowbit {
namespace {

constexpr int kThreads = 256;

template <typename Tag>
__device__ __forceinline__ uint32_t AbsBits(typename Tag::Storage v) {
  return FloatBits(LoadAsFloat(Tag{}, v)) & 0x7FFFFFFFu;
}

// grid.y walks rows, grid.x strides over the columns of a row. kVec elements per 16-byte
// load when kVec > 1 (row starts then must be 16-byte aligned).
template <typename Tag, int kVec>
__global__ void AmaxKernel(const typename Tag::Storage* __restrict__ x, int64_t rows,
                           int64_t cols, uint32_t* __restrict__ out) {
  using T = typename Tag::Storage;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = x + r * cols;
    uint32_t best = 0;
    int64_t done = 0;
    if constexpr (kVec > 1) {
      const int64_t nvec = cols / kVec;
      const uint4* vec = reinterpret_cast<const uint4*>(row);
      for (int64_t i = first; i < nvec; i += stride) {
        uint4 packed = __ldg(vec + i);
        T vals[kVec];
        memcpy(vals, &packed, sizeof(packed));
#pragma unroll
        for (int j = 0; j < kVec; ++j) best = max(best, AbsBits<Tag>(vals[j]));
      }
      done = nvec * kVec;
    }
    for (int64_t i = done + first; i < cols; i += stride) best = max(best, AbsBits<Tag>(row[i]));
    best = BlockMaxU32(best);
    if (threadIdx.x == 0 && best != 0) atomicMax(out + r, best);
  }
}

template <typename Tag>
Status Launch(const void* x, int64_t rows, int64_t cols, float* out, GpuStream stream) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       (rows == 1 || (cols * int64_t(sizeof(T))) % 16 == 0);
  const int64_t per_row_items = aligned ? (cols + kVec - 1) / kVec : cols;
  const int grid_y = int(rows < 65535 ? rows : 65535);
  int grid_x = GridStrideBlocks(per_row_items, kThreads);
  grid_x = grid_x / grid_y > 0 ? grid_x / grid_y : 1;
  const dim3 grid(grid_x, grid_y);
  auto* out_bits = reinterpret_cast<uint32_t*>(out);
  if (aligned) {
    AmaxKernel<Tag, kVec><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), rows, cols,
                                                         out_bits);
  } else {
    AmaxKernel<Tag, 1><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(x), rows, cols,
                                                      out_bits);
  }
  return LaunchStatus("lowbit_amax");
}

}  // namespace

Status AmaxCuda(const void* x, DType dtype, int64_t rows, int64_t cols, float* out,
                GpuStream stream) {
  if (rows == 0) return Status::Ok();
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(out, 0, rows * sizeof(float), stream),
                                    "lowbit_amax", "cudaMemsetAsync"));
  if (cols == 0) return Status::Ok();
  return DispatchHighPrecision(dtype, "lowbit_amax", "x", [&](auto tag) {
    return Launch<decltype(tag)>(x, rows, cols, out, stream);
  });
}

}  // namespace lowbit
