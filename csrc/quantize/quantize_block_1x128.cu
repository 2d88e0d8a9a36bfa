// The CUDA FP8 block quantizer's tile launch for 1x128 (activations and gradients) tiles
// (quantize_block_tiles.h), a translation unit of its own so that the build compiles the tile
// shapes in parallel.
#include "quantize/quantize_block_tiles.cuh"

namespace lowbit::fp8_block_cuda {

template <>
Status LaunchPlainTiles<false>(const QuantizeFp8BlockArgs& a, float* partials, const char* op, GpuStream stream) {
  return LaunchPlainTilesImpl<false>(a, partials, op, stream);
}

}  // namespace lowbit::fp8_block_cuda
