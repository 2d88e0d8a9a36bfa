// CUDA MXFP8 quantize (rowwise and/or colwise copy in x's layout, one pass) and dequantize.
// Numerics and layouts: quantize_mxfp8.h.
//
// QuantizeMxfp8Kernel: a block (256 threads) loops over 64 x 128 tiles of x; each thread
//   issues its 16-byte loads (kPasses rows x one chunk) first, then
//   - rowwise: the 32-value block max over the 32 / kVec lanes that hold it (shuffles), the
//     E8M0 byte written by the group's first lane, codes stored straight back (kVec bytes);
//   - colwise: per-thread column maxima for each of the tile's two 32-row blocks, combined
//     through shared memory by one thread per (block, column), which writes the byte; codes
//     are encoded with the column's factor and stored in x's layout (no transpose).
//   Scale padding is zeroed by a memset first, only when there is any.
// DequantizeMxfp8Kernel: grid-stride over 8-code groups within a row.
// Encoding: fp8_cvt.cuh (hardware cvt unless a NaN value or a NaN factor is involved).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/block_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_mxfp8";
constexpr const char* kDequantizeOp = "lowbit_dequantize_mxfp8";
constexpr int kThreads = 256;
constexpr int kBlock = int(kMxfp8BlockLen);
constexpr int kTileRows = 2 * kBlock;
constexpr int kTileCols = 128;

template <typename Tag, typename Fmt, bool kVectorIO>
__global__ void __launch_bounds__(kThreads, 2)
    QuantizeMxfp8Kernel(const typename Tag::Storage* __restrict__ x, int64_t rows, int64_t cols,
                        uint8_t* __restrict__ rowwise, uint8_t* __restrict__ row_scale,
                        uint8_t* __restrict__ colwise, uint8_t* __restrict__ col_scale) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));  // elements per 16-byte chunk
  constexpr int kThreadsPerRow = kTileCols / kVec;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTileRows / kRowsPerPass;  // 4 or 8; the first half is block 0
  constexpr int kLanesPerBlock = kBlock / kVec;      // 4 or 8 lanes hold one rowwise block
  __shared__ uint32_t col_part[2][kRowsPerPass][kTileCols];
  __shared__ float col_factor[2][kTileCols];

  const int64_t tiles_c = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows * tiles_c;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  const int64_t row_ld = Mxfp8ScaleDims(rows, cols, false).dim1;
  const int64_t col_ld = Mxfp8ScaleDims(rows, cols, true).dim1;

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t r0 = tile / tiles_c * kTileRows;
    const int64_t c0 = tile % tiles_c * kTileCols;
    const int64_t c = c0 + chunk_col;

    T vals[kPasses][kVec];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int64_t r = r0 + p * kRowsPerPass + chunk_row;
      if constexpr (kVectorIO) {
        uint4 packed = make_uint4(0, 0, 0, 0);
        if (r < rows && c < cols) packed = __ldg(reinterpret_cast<const uint4*>(x + r * cols + c));
        memcpy(vals[p], &packed, sizeof(packed));
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) vals[p][j] = (r < rows && c + j < cols) ? x[r * cols + c + j] : T(0);
      }
    }

    uint32_t chunk_max[kPasses];
    uint32_t col_max[2][kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) col_max[0][j] = col_max[1][j] = 0;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      chunk_max[p] = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const uint32_t b = AbsBitsOf(LoadAsFloatFast(Tag{}, vals[p][j]));
        chunk_max[p] = max(chunk_max[p], b);
        col_max[p / (kPasses / 2)][j] = max(col_max[p / (kPasses / 2)][j], b);
      }
    }

    if (rowwise != nullptr) {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        const int64_t r = r0 + p * kRowsPerPass + chunk_row;
        const uint8_t e = Mxfp8ScaleByte(GroupMaxU32<kLanesPerBlock>(chunk_max[p]), Fmt::kMax);
        if (threadIdx.x % kLanesPerBlock == 0 && r < rows && c < cols) row_scale[r * row_ld + c / kBlock] = e;
        float v[kVec], f[kVec];
        const float factor = Mxfp8EncodeFactor(e);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          v[j] = LoadAsFloatFast(Tag{}, vals[p][j]);
          f[j] = factor;
        }
        uint32_t words[kVec / 4];
        EncodeChunkScaled(Fmt{}, v, f, chunk_max[p] <= 0x7F800000u && e != 0xFFu, words);
        if (r < rows) {
          if (kVectorIO && c < cols) {
            StoreCodes<kVec>(rowwise + r * cols + c, words);
          } else {
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              if (c + j < cols) rowwise[r * cols + c + j] = CodeOf(words, j);
            }
          }
        }
      }
    }
    if (colwise == nullptr) continue;  // uniform across the block

#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      col_part[0][chunk_row][chunk_col + j] = col_max[0][j];
      col_part[1][chunk_row][chunk_col + j] = col_max[1][j];
    }
    __syncthreads();
    {
      const int half = threadIdx.x / kTileCols, col = threadIdx.x % kTileCols;  // 256 = 2 x 128
      uint32_t m = 0;
#pragma unroll
      for (int g = 0; g < kRowsPerPass; ++g) m = max(m, col_part[half][g][col]);
      const uint8_t e = Mxfp8ScaleByte(m, Fmt::kMax);
      col_factor[half][col] = Mxfp8EncodeFactor(e);
      const int64_t block_row = r0 / kBlock + half;
      if (block_row * kBlock < rows && c0 + col < cols) col_scale[block_row * col_ld + c0 + col] = e;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int64_t r = r0 + p * kRowsPerPass + chunk_row;
      float v[kVec], f[kVec];
      bool factors_ok = true;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        v[j] = LoadAsFloatFast(Tag{}, vals[p][j]);
        f[j] = col_factor[p / (kPasses / 2)][chunk_col + j];
        factors_ok &= !IsNanBits(FloatBits(f[j]));
      }
      uint32_t words[kVec / 4];
      EncodeChunkScaled(Fmt{}, v, f, chunk_max[p] <= 0x7F800000u && factors_ok, words);
      if (r < rows) {
        if (kVectorIO && c < cols) {
          StoreCodes<kVec>(colwise + r * cols + c, words);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            if (c + j < cols) colwise[r * cols + c + j] = CodeOf(words, j);
          }
        }
      }
    }
    __syncthreads();  // col_part / col_factor are rewritten by the next tile
  }
}

template <typename Tag, typename Fmt>
Status LaunchQuantize(const QuantizeMxfp8Args& a, GpuStream stream) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  auto aligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  auto zero_padding = [&](uint8_t* scale, bool colwise) -> Status {
    if (scale == nullptr) return Status::Ok();
    const ScaleDims d = Mxfp8ScaleDims(a.rows, a.cols, colwise);
    const int64_t used0 = colwise ? CeilDivI64(a.rows, kBlock) : a.rows;
    const int64_t used1 = colwise ? a.cols : CeilDivI64(a.cols, kBlock);
    if (used0 == d.dim0 && used1 == d.dim1) return Status::Ok();
    return CudaStatus(cudaMemsetAsync(scale, 0, size_t(d.size()), stream), kQuantizeOp, "cudaMemsetAsync");
  };
  LOWBIT_RETURN_IF_ERROR(zero_padding(a.rowwise_scale, false));
  LOWBIT_RETURN_IF_ERROR(zero_padding(a.colwise_scale, true));

  const T* x = static_cast<const T*>(a.x);
  const int64_t tiles = CeilDivI64(a.rows, kTileRows) * CeilDivI64(a.cols, kTileCols);
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 4);
  const bool vec_io = aligned(x, 16) && a.cols % kVec == 0 && (a.rowwise == nullptr || aligned(a.rowwise, 16)) &&
                      (a.colwise == nullptr || aligned(a.colwise, 16));
  if (vec_io) {
    QuantizeMxfp8Kernel<Tag, Fmt, true><<<blocks, kThreads, 0, stream>>>(
        x, a.rows, a.cols, a.rowwise, a.rowwise_scale, a.colwise, a.colwise_scale);
  } else {
    QuantizeMxfp8Kernel<Tag, Fmt, false><<<blocks, kThreads, 0, stream>>>(
        x, a.rows, a.cols, a.rowwise, a.rowwise_scale, a.colwise, a.colwise_scale);
  }
  return LaunchStatus(kQuantizeOp);
}

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

Status QuantizeMxfp8Cuda(const QuantizeMxfp8Args& a, GpuStream stream) {
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    if (a.rows == 0 || a.cols == 0) return Status::Ok();  // every output is empty
    return DispatchFp8(a.out_dtype, kQuantizeOp, "out", [&](auto fmt) {
      return LaunchQuantize<decltype(tag), decltype(fmt)>(a, stream);
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
