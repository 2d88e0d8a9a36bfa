// The dbias steps around the tile pass of the quantizers that sum x's columns in it
// (per-tensor FP8: quantize_fp8.cu; block: quantize_block.cu, quantize_mxfp8.cu): the
// launchers' shared preamble (PrepareDbias: dbias dtype, empty x, workspace) and the
// finalize: one workspace row of fp32 column sums per tile row, summed here in a fixed
// order (block_dbias.h states it), so the result has the same bits on every run.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "common/gpu_stream.h"
#include "quantize/block_dbias.h"

namespace lowbit {
namespace dbias_finalize {

// blockDim (32, kDbiasFinalizeRows): warp y sums workspace rows y, y+8, ... of 32 columns;
// the 8 partial sums are then added in order y = 0..7; a NaN total becomes the canonical NaN.
template <typename Tag, typename OutT>
__global__ void DbiasFinalizeKernel(const float* __restrict__ partials, int64_t tile_rows, int64_t cols,
                                    OutT* __restrict__ dbias) {
  __shared__ float sums[kDbiasFinalizeRows][32];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < cols) {
    // Unrolled so that several loads are in flight; the additions stay in order.
#pragma unroll 8
    for (int64_t t = threadIdx.y; t < tile_rows; t += kDbiasFinalizeRows) s += partials[t * cols + c];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < kDbiasFinalizeRows; ++y) total += sums[y][threadIdx.x];
    total = DbiasCanonical(total);
    if constexpr (sizeof(OutT) == sizeof(float)) {
      dbias[c] = total;
    } else {
      dbias[c] = StoreFromFloat(Tag{}, total);
    }
  }
}

// Sums `tile_rows` x cols fp32 partials into dbias (cols values of f32 or Tag's dtype).
template <typename Tag>
Status LaunchDbiasFinalize(const float* partials, int64_t tile_rows, int64_t cols, void* dbias, DType dbias_dtype,
                           const char* op, GpuStream stream) {
  const dim3 block(32, kDbiasFinalizeRows);
  const int64_t blocks = (cols + 31) / 32;
  if (blocks > 0x7FFFFFFF) return Status::InvalidArgument(std::string(op) + ": x: too many columns");
  if (dbias_dtype == DType::kF32) {
    DbiasFinalizeKernel<Tag, float>
        <<<unsigned(blocks), block, 0, stream>>>(partials, tile_rows, cols, static_cast<float*>(dbias));
  } else {
    using T = typename Tag::Storage;
    DbiasFinalizeKernel<Tag, T><<<unsigned(blocks), block, 0, stream>>>(partials, tile_rows, cols, static_cast<T*>(dbias));
  }
  return LaunchStatus(op);
}

// Zeroes dbias (cols values): the column sums of zero rows (0 bits in every dtype).
template <typename Tag>
Status ZeroDbias(void* dbias, int64_t cols, DType dbias_dtype, const char* op, GpuStream stream) {
  if (dbias == nullptr || cols == 0) return Status::Ok();
  const size_t bytes = size_t(cols) * (dbias_dtype == DType::kF32 ? sizeof(float) : sizeof(typename Tag::Storage));
  return CudaStatus(cudaMemsetAsync(dbias, 0, bytes, stream), op, "cudaMemsetAsync");
}

// The quantize launchers' preamble, before any kernel. Args: the launcher's arguments
// (x_dtype, rows, cols, dbias, dbias_dtype; null dbias: not requested). A requested dbias
// must be f32 or x's dtype (CheckBlockDbiasDType's InvalidArgument). An empty x (rows or
// cols 0) leaves nothing to write but dbias: it is zeroed here and *x_empty set, so the
// launcher returns at once. Otherwise a requested dbias needs the workspace of tile sums
// (an Internal error without it: the FFI handlers always allocate it).
template <typename Tag, typename Args>
Status PrepareDbias(const char* op, const Args& a, const void* workspace, GpuStream stream, bool* x_empty) {
  *x_empty = a.rows == 0 || a.cols == 0;
  if (a.dbias != nullptr) LOWBIT_RETURN_IF_ERROR(CheckBlockDbiasDType(op, a.x_dtype, a.dbias_dtype));
  if (*x_empty) return ZeroDbias<Tag>(a.dbias, a.cols, a.dbias_dtype, op, stream);
  if (a.dbias != nullptr && workspace == nullptr) return Status::Internal(std::string(op) + ": dbias: no workspace");
  return Status::Ok();
}

}  // namespace dbias_finalize
}  // namespace lowbit
