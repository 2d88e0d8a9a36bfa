// CUDA scale swizzle (scale_swizzle.h). One thread per 4-byte output word: word w of tile t
// holds input row 128 * (t / (C/4)) + (w % 4) * 32 + w / 4, columns 4 * (t % (C/4)) .. +3,
// a 4-byte aligned word of the input (C % 4 == 0). Writes are coalesced; each read is one
// 32-bit load. The largest seed-shape scale array is 8 MiB: a few microseconds.
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "gemm/scale_swizzle.h"

namespace lowbit {
namespace {

constexpr int kThreads = 256;

__global__ void ScaleSwizzleKernel(const uint32_t* __restrict__ in, uint32_t* __restrict__ out,
                                   int64_t rows, int64_t cols, int64_t valid_rows,
                                   int64_t valid_cols) {
  const int64_t words = rows * cols / 4;
  const int64_t col_tiles = cols / kSwizzleTileCols;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t w = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; w < words; w += stride) {
    const int64_t tile = w / (kSwizzleTileBytes / 4), within = w % (kSwizzleTileBytes / 4);
    const int64_t r = (tile / col_tiles) * kSwizzleTileRows + (within % 4) * 32 + within / 4;
    const int64_t c = (tile % col_tiles) * kSwizzleTileCols;
    uint32_t v = 0;
    if (r < valid_rows) {
      v = __ldg(in + (r * cols + c) / 4);
      // Zero the bytes (little-endian: byte i is column c + i) at columns >= valid_cols.
      const int64_t keep = valid_cols - c;
      if (keep <= 0) {
        v = 0;
      } else if (keep < 4) {
        v &= (uint32_t(1) << (8 * keep)) - 1;
      }
    }
    out[w] = v;
  }
}

}  // namespace

Status ScaleSwizzleCuda(const ScaleSwizzleArgs& args, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckScaleSwizzleArgs(args, "lowbit_gemm_swizzle_scales"));
  if (reinterpret_cast<uintptr_t>(args.in) % 4 != 0 || reinterpret_cast<uintptr_t>(args.out) % 4 != 0) {
    return Status::InvalidArgument("lowbit_gemm_swizzle_scales: scale: expected 4-byte aligned "
                                   "buffers");
  }
  const int64_t words = args.rows * args.cols / 4;
  if (words == 0) return Status::Ok();
  ScaleSwizzleKernel<<<GridStrideBlocks(words, kThreads), kThreads, 0, stream>>>(
      reinterpret_cast<const uint32_t*>(args.in), reinterpret_cast<uint32_t*>(args.out), args.rows,
      args.cols, args.valid_rows, args.valid_cols);
  return LaunchStatus("lowbit_gemm_swizzle_scales");
}

}  // namespace lowbit
