// CUDA FP8 block quantize (1x128 or 128x128 tiles, rowwise and/or transposed colwise copy in
// one pass) and dequantize. Numerics and layouts: quantize_block.h.
//
// Quantize: block_tiles.cuh's Fp8BlockTileKernel over x itself (PlainSource): 128 x 128 tiles,
//   all loads first, per-tile-row / per-column / per-tile amaxes, rowwise codes stored
//   straight out, colwise codes byte-transposed through shared memory (see there). The tile
//   launches live in quantize_block_1x128.cu / _128x128.cu (quantize_block_tiles.h); here the
//   dbias preparation and finalize around them.
// DequantizeFp8BlockKernel: grid-stride over 8-code groups of one stored copy.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/block_codec.h"
#include "quantize/quantize_block_tiles.h"
#include "quantize/dbias_finalize.cuh"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize_block.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_fp8_block";
constexpr const char* kDequantizeOp = "lowbit_dequantize_fp8_block";
constexpr int kThreads = 256;

template <typename Tag, typename Fmt, bool kTile2d>
__global__ void __launch_bounds__(kThreads)
    DequantizeFp8BlockKernel(const uint8_t* __restrict__ data, int64_t rows, int64_t cols,
                             const float* __restrict__ scale_inv, typename Tag::Storage* __restrict__ out) {
  // Groups of 8 codes within one row (so one 1x128 or 128x128 tile: 128 % 8 == 0).
  const int64_t groups_per_row = (cols + 7) / 8;
  const int64_t groups = rows * groups_per_row;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = g / groups_per_row, c = g % groups_per_row * 8;
    const float s = scale_inv[Fp8BlockScaleOffset(r, c, rows, cols, kTile2d)];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (c + j < cols) out[r * cols + c + j] = StoreFromFloat(Tag{}, DecodeScaled(Fmt{}, data[r * cols + c + j], s));
    }
  }
}

}  // namespace

Status QuantizeFp8BlockCuda(const QuantizeFp8BlockArgs& a, void* workspace, GpuStream stream) {
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    using Tag = decltype(tag);
    bool x_empty = false;
    LOWBIT_RETURN_IF_ERROR(dbias_finalize::PrepareDbias<Tag>(kQuantizeOp, a, workspace, stream, &x_empty));
    if (x_empty) return Status::Ok();  // every output is empty but dbias, zeroed: the sums of no rows
    auto* partials = static_cast<float*>(workspace);
    LOWBIT_RETURN_IF_ERROR(a.tile_2d ? fp8_block_cuda::LaunchPlainTiles<true>(a, partials, kQuantizeOp, stream)
                                     : fp8_block_cuda::LaunchPlainTiles<false>(a, partials, kQuantizeOp, stream));
    if (a.dbias == nullptr) return Status::Ok();
    return dbias_finalize::LaunchDbiasFinalize<Tag>(partials, CeilDivI64(a.rows, kFp8BlockDbiasTileRows), a.cols,
                                                    a.dbias, a.dbias_dtype, kQuantizeOp, stream);
  });
}

Status DequantizeFp8BlockCuda(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols, bool tile_2d,
                              const float* scale_inv, void* out, DType out_dtype, GpuStream stream) {
  return DispatchHighPrecision(out_dtype, kDequantizeOp, "out", [&](auto tag) {
    return DispatchFp8(data_dtype, kDequantizeOp, "data", [&](auto fmt) {
      using Tag = decltype(tag);
      using Fmt = decltype(fmt);
      if (rows == 0 || cols == 0) return Status::Ok();
      auto* dst = static_cast<typename Tag::Storage*>(out);
      const int blocks = GridStrideBlocks(rows * ((cols + 7) / 8), kThreads, 8);
      if (tile_2d) {
        DequantizeFp8BlockKernel<Tag, Fmt, true><<<blocks, kThreads, 0, stream>>>(data, rows, cols, scale_inv, dst);
      } else {
        DequantizeFp8BlockKernel<Tag, Fmt, false><<<blocks, kThreads, 0, stream>>>(data, rows, cols, scale_inv, dst);
      }
      return LaunchStatus(kDequantizeOp);
    });
  });
}

}  // namespace lowbit
