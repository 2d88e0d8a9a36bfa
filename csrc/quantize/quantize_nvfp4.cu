// CUDA NVFP4 quantize (numerics and layouts: quantize_nvfp4.h), three launches on one stream:
//  1. global amaxes (|x| bit patterns, atomicMax) into the global_scale_inv results, used as
//     scratch: without RHT both copies hold the same values, so one AmaxCuda (amax/amax.h)
//     over x as a single row serves both; with RHT the colwise amax is that of the
//     transformed values, so Nvfp4AmaxKernel walks 16-row groups down each column and takes
//     the plain and the transformed amax in the same pass.
//  2. Nvfp4TileKernel: one 64 x 64 tile of x per CTA, both copies from the tile
//     (quantize_nvfp4_tile.cuh's QuantizeTile, shared with the grouped quantizer). The scale
//     arrays are zeroed first (their padding must be 0); the data is written in full.
//  3. Nvfp4FinalizeKernel: global_scale_inv = 1 / S over the stored amaxes.
#include <cuda_runtime.h>

#include <string>

#include "amax/amax.h"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/quantize_nvfp4.h"
#include "quantize/quantize_nvfp4_tile.cuh"

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_nvfp4";
using nvfp4_tile::CopyOut;
using nvfp4_tile::kThreads;
using nvfp4_tile::kTile;
using nvfp4_tile::TileParams;

// ------------------------------------------------------------------ pass 1 (RHT only)

// grid.x strides over columns, grid.y over 16-row groups. plain_out (may be null) gets
// max |x|; rht_out max |T v| over full groups and |x| over the partial last group.
template <typename Tag>
__global__ void Nvfp4AmaxKernel(const typename Tag::Storage* __restrict__ x, int64_t rows,
                                int64_t cols, const uint32_t* sign_word, uint32_t* plain_out,
                                uint32_t* rht_out) {
  const uint32_t sign_bits = *sign_word & 0xFFFFu;
  const int64_t groups = (rows + 15) / 16;
  uint32_t plain = 0, transformed = 0;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
         c += int64_t(gridDim.x) * blockDim.x) {
      nvfp4_tile::Amax16<Tag>(x, rows, cols, g * 16, c, true, sign_bits, plain, transformed);
    }
  }
  plain = BlockMaxU32(plain);
  transformed = BlockMaxU32(transformed);
  if (threadIdx.x == 0) {
    if (plain_out != nullptr && plain != 0) atomicMax(plain_out, plain);
    if (transformed != 0) atomicMax(rht_out, transformed);
  }
}

// ------------------------------------------------------------------ pass 2

template <typename Tag>
__global__ void __launch_bounds__(kThreads) Nvfp4TileKernel(const typename Tag::Storage* __restrict__ x,
                                                           TileParams p, int64_t tiles_x) {
  // Consecutive CTAs take consecutive tiles of one 64-row band (x rows read in full lines).
  const int64_t r0 = int64_t(blockIdx.x) / tiles_x * kTile, c0 = int64_t(blockIdx.x) % tiles_x * kTile;
  nvfp4_tile::QuantizeTile<Tag>(x, p, r0, c0);
}

// ------------------------------------------------------------------ pass 3

// Reads both amaxes before writing (they may be the same word).
__global__ void Nvfp4FinalizeKernel(const uint32_t* row_amax, float* row_out, const uint32_t* col_amax,
                                    float* col_out) {
  const uint32_t ra = row_amax != nullptr ? *row_amax : 0u;
  const uint32_t ca = col_amax != nullptr ? *col_amax : 0u;
  if (row_out != nullptr) *row_out = ScaleDivRn(1.0f, Nvfp4GlobalScale(ra));
  if (col_out != nullptr) *col_out = ScaleDivRn(1.0f, Nvfp4GlobalScale(ca));
}

template <typename Tag>
Status Launch(const QuantizeNvfp4Args& a, GpuStream stream) {
  using T = typename Tag::Storage;
  const bool want_row = a.rowwise != nullptr, want_col = a.colwise != nullptr;
  const auto* x = static_cast<const T*>(a.x);
  float* row_gsi = a.rowwise_global_scale_inv;
  float* col_gsi = a.colwise_global_scale_inv;

  // Pass 1.
  uint32_t* row_amax = reinterpret_cast<uint32_t*>(row_gsi);
  uint32_t* col_amax = reinterpret_cast<uint32_t*>(col_gsi);
  if (!(want_col && a.rht)) {
    float* out = want_row ? row_gsi : col_gsi;
    LOWBIT_RETURN_IF_ERROR(AmaxCuda(a.x, a.x_dtype, 1, a.rows * a.cols, out, stream));
    row_amax = col_amax = reinterpret_cast<uint32_t*>(out);
  } else {
    for (float* out : {row_gsi, col_gsi}) {
      if (out == nullptr) continue;
      LOWBIT_RETURN_IF_ERROR(
          CudaStatus(cudaMemsetAsync(out, 0, sizeof(float), stream), kOp, "cudaMemsetAsync"));
    }
    const int threads = 256;
    const int64_t groups = CeilDivI64(a.rows, 16);
    const int grid_x = int(CeilDivI64(a.cols, threads) < 65535 ? CeilDivI64(a.cols, threads) : 65535);
    int grid_y = GridStrideBlocks(groups * CeilDivI64(a.cols, threads), 1, 8) / grid_x;
    grid_y = grid_y < 1 ? 1 : (grid_y > groups ? int(groups) : grid_y);
    grid_y = grid_y > 65535 ? 65535 : grid_y;
    Nvfp4AmaxKernel<Tag><<<dim3(grid_x, grid_y), threads, 0, stream>>>(
        x, a.rows, a.cols, a.rht_sign_bits_device, want_row ? row_amax : nullptr, col_amax);
    LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));
  }

  // Pass 2.
  TileParams p;
  p.rows = a.rows;
  p.cols = a.cols;
  p.random = a.random;
  p.tile_2d = a.tile_2d;
  p.rht = a.rht;
  p.rht_sign_bits = a.rht_sign_bits_device;
  if (want_row) {
    const ScaleDims d = Nvfp4ScaleDims(a.rows, a.cols);
    p.row = {a.rowwise, a.rowwise_scale, d.dim1, CeilDivI64(a.cols, 2), row_amax};
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.rowwise_scale, 0, size_t(d.size()), stream),
                                      kOp, "cudaMemsetAsync"));
  }
  if (want_col) {
    const ScaleDims d = Nvfp4ScaleDims(a.cols, a.rows);
    p.col = {a.colwise, a.colwise_scale, d.dim1, CeilDivI64(a.rows, 2), col_amax};
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.colwise_scale, 0, size_t(d.size()), stream),
                                      kOp, "cudaMemsetAsync"));
  }
  const int64_t tiles_y = CeilDivI64(a.rows, kTile), tiles_x = CeilDivI64(a.cols, kTile);
  if (tiles_y * tiles_x > 2147483647) {
    return Status::InvalidArgument(std::string(kOp) + ": x: " + std::to_string(a.rows) + " x " +
                                   std::to_string(a.cols) + " has more 64 x 64 tiles than a grid holds (2^31 - 1)");
  }
  Nvfp4TileKernel<Tag><<<unsigned(tiles_y * tiles_x), kThreads, 0, stream>>>(x, p, tiles_x);
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(kOp));

  // Pass 3.
  Nvfp4FinalizeKernel<<<1, 1, 0, stream>>>(want_row ? row_amax : nullptr, row_gsi,
                                           want_col ? col_amax : nullptr, col_gsi);
  return LaunchStatus(kOp);
}

}  // namespace

Status QuantizeNvfp4Cuda(const QuantizeNvfp4Args& a, GpuStream stream) {
  if (a.rows * a.cols == 0) {  // A = 0, so S = 1: only the requested global scales are written
    Nvfp4FinalizeKernel<<<1, 1, 0, stream>>>(nullptr, a.rowwise_global_scale_inv, nullptr,
                                             a.colwise_global_scale_inv);
    return LaunchStatus(kOp);
  }
  if (a.rowwise == nullptr && a.colwise == nullptr) {
    return Status::InvalidArgument(std::string(kOp) + ": rowwise: neither copy requested");
  }
  if (a.rht && a.colwise != nullptr && a.rht_sign_bits_device == nullptr) {
    return Status::InvalidArgument(std::string(kOp) + ": rht_sign_bits: the CUDA launcher reads "
                                   "the sign word from device memory (rht_sign_bits_device)");
  }
  return DispatchHighPrecision(a.x_dtype, kOp, "x",
                               [&](auto tag) { return Launch<decltype(tag)>(a, stream); });
}

}  // namespace lowbit
