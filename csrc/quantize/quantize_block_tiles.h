// The CUDA FP8 block quantizer's tile launches over x itself (block_tiles.cuh's
// Fp8BlockTileKernel with PlainSource), one translation unit per tile shape
// (quantize_block_1x128.cu, quantize_block_128x128.cu) so that the build compiles the two in
// parallel; quantize_block.cu prepares dbias, calls the tile shape's launch and finalizes.
#pragma once

#include "common/gpu_stream.h"
#include "common/status.h"
#include "quantize/quantize_block.h"

namespace lowbit::fp8_block_cuda {

// Launches a's tile kernel for 1x128 (kTile2d false) or 128x128 tiles, every dtype and code
// format; with dbias (a.dbias set) its per-tile-row column sums go to `partials`. a is
// checked and x non-empty.
template <bool kTile2d>
Status LaunchPlainTiles(const QuantizeFp8BlockArgs& a, float* partials, const char* op, GpuStream stream);
template <>
Status LaunchPlainTiles<false>(const QuantizeFp8BlockArgs& a, float* partials, const char* op, GpuStream stream);
template <>
Status LaunchPlainTiles<true>(const QuantizeFp8BlockArgs& a, float* partials, const char* op, GpuStream stream);

}  // namespace lowbit::fp8_block_cuda
