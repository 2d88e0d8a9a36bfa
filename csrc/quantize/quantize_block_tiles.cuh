// The body of fp8_block_cuda::LaunchPlainTiles (quantize_block_tiles.h) for one tile shape,
// included by that shape's .cu.
#pragma once

#include "common/element.h"
#include "quantize/block_tiles.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/quantize_block_tiles.h"

namespace lowbit::fp8_block_cuda {

template <bool kTile2d>
Status LaunchPlainTilesImpl(const QuantizeFp8BlockArgs& a, float* partials, const char* op, GpuStream stream) {
  return DispatchHighPrecision(a.x_dtype, op, "x", [&](auto tag) {
    using Tag = decltype(tag);
    return DispatchFp8(a.out_dtype, op, "out", [&](auto fmt) {
      using Fmt = decltype(fmt);
      const block_tiles::PlainSource<Tag> src{static_cast<const typename Tag::Storage*>(a.x)};
      const bool vec = src.VectorOk(a.cols);
      using Src = decltype(src);
      if (a.dbias != nullptr) {
        return block_tiles::LaunchFp8BlockTiles<Src, Fmt, kTile2d, true>(src, vec, a, op, stream, partials);
      }
      return block_tiles::LaunchFp8BlockTiles<Src, Fmt, kTile2d>(src, vec, a, op, stream);
    });
  });
}

}  // namespace lowbit::fp8_block_cuda
