// CUDA MXFP8 quantize (rowwise and/or colwise copy in x's layout, one pass) and dequantize.
// Numerics and layouts: quantize_mxfp8.h.
//
// Quantize: block_tiles.cuh's Mxfp8TileKernel over x itself (PlainSource): 64 x 128 tiles,
//   rowwise block maxima by lane shuffles, colwise ones through shared memory (see there);
//   with dbias, per-tile column sums into the workspace, then dbias_finalize.cuh (order:
//   block_dbias.h).
// DequantizeMxfp8Kernel: grid-stride over 8-code groups within a row.
// Encoding: fp8_cvt.cuh (hardware cvt unless a NaN value or a NaN factor is involved).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/block_codec.h"
#include "quantize/block_tiles.cuh"
#include "quantize/dbias_finalize.cuh"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_mxfp8";
constexpr const char* kDequantizeOp = "lowbit_dequantize_mxfp8";
constexpr int kThreads = 256;

template <typename Tag, typename Fmt, bool kColwise>
__global__ void __launch_bounds__(kThreads)
    DequantizeMxfp8Kernel(const uint8_t* __restrict__ data, int64_t rows, int64_t cols,
                          const uint8_t* __restrict__ scale, typename Tag::Storage* __restrict__ out) {
  const int64_t groups_per_row = (cols + 7) / 8;
  const int64_t groups = rows * groups_per_row;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = g / groups_per_row, c = g % groups_per_row * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (c + j >= cols) break;
      const float s = E8m0ToFloat(scale[Mxfp8ScaleOffset(r, c + j, rows, cols, kColwise)]);
      out[r * cols + c + j] = StoreFromFloat(Tag{}, DecodeScaled(Fmt{}, data[r * cols + c + j], s));
    }
  }
}

}  // namespace

Status QuantizeMxfp8Cuda(const QuantizeMxfp8Args& a, void* workspace, GpuStream stream) {
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    using Tag = decltype(tag);
    bool x_empty = false;
    LOWBIT_RETURN_IF_ERROR(dbias_finalize::PrepareDbias<Tag>(kQuantizeOp, a, workspace, stream, &x_empty));
    if (x_empty) return Status::Ok();  // every output is empty but dbias, zeroed: the sums of no rows
    auto* partials = static_cast<float*>(workspace);
    return DispatchFp8(a.out_dtype, kQuantizeOp, "out", [&](auto fmt) {
      const block_tiles::PlainSource<Tag> src{static_cast<const typename Tag::Storage*>(a.x)};
      using Src = decltype(src);
      using Fmt = decltype(fmt);
      const bool vec = src.VectorOk(a.cols);
      const Status launched =
          a.dbias != nullptr
              ? block_tiles::LaunchMxfp8Tiles<Src, Fmt, true>(src, vec, a, kQuantizeOp, stream, partials)
              : block_tiles::LaunchMxfp8Tiles<Src, Fmt>(src, vec, a, kQuantizeOp, stream);
      LOWBIT_RETURN_IF_ERROR(launched);
      if (a.dbias == nullptr) return Status::Ok();
      return dbias_finalize::LaunchDbiasFinalize<Tag>(partials, CeilDivI64(a.rows, kMxfp8DbiasTileRows), a.cols,
                                                      a.dbias, a.dbias_dtype, kQuantizeOp, stream);
    });
  });
}

Status DequantizeMxfp8Cuda(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols, bool colwise,
                           const uint8_t* scale, void* out, DType out_dtype, GpuStream stream) {
  return DispatchHighPrecision(out_dtype, kDequantizeOp, "out", [&](auto tag) {
    return DispatchFp8(data_dtype, kDequantizeOp, "data", [&](auto fmt) {
      using Tag = decltype(tag);
      using Fmt = decltype(fmt);
      if (rows == 0 || cols == 0) return Status::Ok();
      auto* dst = static_cast<typename Tag::Storage*>(out);
      const int blocks = GridStrideBlocks(rows * ((cols + 7) / 8), kThreads, 8);
      if (colwise) {
        DequantizeMxfp8Kernel<Tag, Fmt, true><<<blocks, kThreads, 0, stream>>>(data, rows, cols, scale, dst);
      } else {
        DequantizeMxfp8Kernel<Tag, Fmt, false><<<blocks, kThreads, 0, stream>>>(data, rows, cols, scale, dst);
      }
      return LaunchStatus(kDequantizeOp);
    });
  });
}

}  // namespace lowbit
