// CUDA FP8 block quantize (1x128 or 128x128 tiles, rowwise and/or transposed colwise copy in
// one pass) and dequantize. Numerics and layouts: quantize_block.h.
//
// QuantizeFp8BlockKernel: a block (256 threads) loops over 128 x 128 tiles of x. Each thread
//   issues all its 16-byte loads of the tile first (kPasses rows x one 16-byte chunk), then:
//   - amaxes: 1x128 rowwise: the tile row's max over the lanes that hold it (shuffles);
//     1x128 colwise: per-thread column maxima, combined through shared memory; 128x128: one
//     block-wide max;
//   - rowwise codes: encoded with their row's scale and stored straight to global memory;
//   - colwise codes (encoded with their column's scale; for 128x128 the rowwise codes, the
//     scale being the same) go to shared memory, from which each thread gathers 4 columns x
//     8 rows, byte-transposes them and writes 8-byte stores of the cols x rows copy.
//   Scales are written by the threads that own them; padding entries are zeroed by a memset
//   first, only when there are any.
// DequantizeFp8BlockKernel: grid-stride over 8-code groups of one stored copy.
// Encoding: fp8_cvt.cuh (hardware cvt where bit-identical, else the formats.h codec). Partial
// tiles and unaligned tensors take bounds-checked scalar paths: nothing outside the tensors
// is read or written.
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/block_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize_block.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_fp8_block";
constexpr const char* kDequantizeOp = "lowbit_dequantize_fp8_block";
constexpr int kThreads = 256;
constexpr int kTile = int(kFp8BlockLen);  // the kernel's tile is always 128 x 128
// Shared-memory row of codes: 4-byte aligned; +4 spreads a warp's 8-row reads over banks.
constexpr int kCodeStride = kTile + 4;
constexpr int kColItems = (kTile / 4) * (kTile / 8);  // 4-col x 8-row transpose items per tile
static_assert(kColItems % kThreads == 0, "whole transpose items per thread");

// kVectorIO: x 16-byte aligned, cols % kVec == 0 and rowwise aligned: every in-range chunk
// is one 16-byte load and one kVec-byte store. colwise_vec: rows % 8 == 0, colwise 8-byte
// aligned: full 8-row transposed chunks are 8-byte stores.
template <typename Tag, typename Fmt, bool kTile2d, bool kVectorIO>
__global__ void __launch_bounds__(kThreads, 2)
    QuantizeFp8BlockKernel(const typename Tag::Storage* __restrict__ x, int64_t rows, int64_t cols,
                           bool pow2, uint8_t* __restrict__ rowwise, float* __restrict__ row_scale_inv,
                           uint8_t* __restrict__ colwise, float* __restrict__ col_scale_inv,
                           bool colwise_vec) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));          // elements per 16-byte chunk
  constexpr int kThreadsPerRow = kTile / kVec;         // 16 (16-bit x) or 32 (f32)
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTile / kRowsPerPass;        // 8 or 16
  __shared__ __align__(16) uint8_t codes[kTile][kCodeStride];
  __shared__ uint32_t col_part[kRowsPerPass][kTile];
  __shared__ float col_scale[kTile];

  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t tiles = (rows + kTile - 1) / kTile * tiles_c;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  const ScaleDims row_dims = Fp8BlockScaleDims(rows, cols, kTile2d);
  const ScaleDims col_dims = Fp8BlockScaleDims(cols, rows, kTile2d);

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t r0 = tile / tiles_c * kTile;
    const int64_t c0 = tile % tiles_c * kTile;
    const int64_t c = c0 + chunk_col;

    // 1. All loads first (out of range -> 0, which changes no amax).
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

    // 2. amaxes (|x| bits): per chunk (also the chunk's "no NaN" test) and per column.
    uint32_t chunk_max[kPasses];
    uint32_t col_max[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) col_max[j] = 0;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      chunk_max[p] = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const uint32_t b = AbsBitsOf(LoadAsFloatFast(Tag{}, vals[p][j]));
        chunk_max[p] = max(chunk_max[p], b);
        col_max[j] = max(col_max[j], b);
      }
    }

    float row_scale[kPasses];  // the scale of each of my rows' tile (all equal for 128x128)
    if constexpr (kTile2d) {
      uint32_t m = 0;
#pragma unroll
      for (int p = 0; p < kPasses; ++p) m = max(m, chunk_max[p]);
      const float s = Fp8BlockScale(BlockMaxU32(m), Fmt::kMax, pow2);
#pragma unroll
      for (int p = 0; p < kPasses; ++p) row_scale[p] = s;
      if (threadIdx.x == 0) {
        const float inv = ScaleDivRn(1.0f, s);
        if (rowwise != nullptr) row_scale_inv[(r0 / kTile) * row_dims.dim1 + c0 / kTile] = inv;
        if (colwise != nullptr) col_scale_inv[(c0 / kTile) * col_dims.dim1 + r0 / kTile] = inv;
      }
    } else {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        row_scale[p] = Fp8BlockScale(GroupMaxU32<kThreadsPerRow>(chunk_max[p]), Fmt::kMax, pow2);
        const int64_t r = r0 + p * kRowsPerPass + chunk_row;
        if (rowwise != nullptr && threadIdx.x % kThreadsPerRow == 0 && r < rows) {
          row_scale_inv[(c0 / kTile) * row_dims.dim1 + r] = ScaleDivRn(1.0f, row_scale[p]);
        }
      }
      if (colwise != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) col_part[chunk_row][chunk_col + j] = col_max[j];
        __syncthreads();
        if (threadIdx.x < kTile) {
          uint32_t m = 0;
#pragma unroll
          for (int g = 0; g < kRowsPerPass; ++g) m = max(m, col_part[g][threadIdx.x]);
          const float s = Fp8BlockScale(m, Fmt::kMax, pow2);
          col_scale[threadIdx.x] = s;
          // Colwise copy Q = x^T: element (c, r) has its 1x128 scale at [r / 128][c].
          if (c0 + threadIdx.x < cols) col_scale_inv[(r0 / kTile) * col_dims.dim1 + c0 + threadIdx.x] = ScaleDivRn(1.0f, s);
        }
        __syncthreads();
      }
    }

    // 3. Rowwise codes (for 128x128 also the colwise ones, via shared memory).
    const bool codes_from_rowwise = kTile2d && colwise != nullptr;
    if (rowwise != nullptr || codes_from_rowwise) {
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        const int local_row = p * kRowsPerPass + chunk_row;
        const int64_t r = r0 + local_row;
        float v[kVec], s[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          v[j] = LoadAsFloatFast(Tag{}, vals[p][j]);
          s[j] = row_scale[p];
        }
        uint32_t words[kVec / 4];
        EncodeChunkScaled(Fmt{}, v, s, chunk_max[p] <= 0x7F800000u, words);
        if (rowwise != nullptr && r < rows) {
          if (kVectorIO && c < cols) {
            StoreCodes<kVec>(rowwise + r * cols + c, words);
          } else {
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              if (c + j < cols) rowwise[r * cols + c + j] = CodeOf(words, j);
            }
          }
        }
        if (codes_from_rowwise) {
#pragma unroll
          for (int j = 0; j < kVec; j += 4) *reinterpret_cast<uint32_t*>(&codes[local_row][chunk_col + j]) = words[j / 4];
        }
      }
    }
    if (colwise == nullptr) continue;  // uniform across the block

    // 4. 1x128 colwise codes: each value with its column's scale.
    if constexpr (!kTile2d) {
      float s[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) s[j] = col_scale[chunk_col + j];
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        float v[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = LoadAsFloatFast(Tag{}, vals[p][j]);
        uint32_t words[kVec / 4];
        EncodeChunkScaled(Fmt{}, v, s, chunk_max[p] <= 0x7F800000u, words);
        const int local_row = p * kRowsPerPass + chunk_row;
#pragma unroll
        for (int j = 0; j < kVec; j += 4) *reinterpret_cast<uint32_t*>(&codes[local_row][chunk_col + j]) = words[j / 4];
      }
    }
    __syncthreads();

    // 5. Transposed write: item -> 4 tile columns x 8 tile rows, 8 lanes cover 64 bytes.
#pragma unroll
    for (int item = threadIdx.x; item < kColItems; item += kThreads) {
      const int row8 = (item % (kTile / 8)) * 8;
      const int col4 = (item / (kTile / 8)) * 4;
      uint32_t w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = *reinterpret_cast<const uint32_t*>(&codes[row8 + k][col4]);
      // Byte transpose: lo[j] holds column j of rows 0..3, hi[j] of rows 4..7.
      uint32_t lo[4], hi[4];
      const uint32_t a_lo = __byte_perm(w[0], w[1], 0x5140), a_hi = __byte_perm(w[0], w[1], 0x7362);
      const uint32_t b_lo = __byte_perm(w[2], w[3], 0x5140), b_hi = __byte_perm(w[2], w[3], 0x7362);
      const uint32_t e_lo = __byte_perm(w[4], w[5], 0x5140), e_hi = __byte_perm(w[4], w[5], 0x7362);
      const uint32_t f_lo = __byte_perm(w[6], w[7], 0x5140), f_hi = __byte_perm(w[6], w[7], 0x7362);
      lo[0] = __byte_perm(a_lo, b_lo, 0x5410);
      lo[1] = __byte_perm(a_lo, b_lo, 0x7632);
      lo[2] = __byte_perm(a_hi, b_hi, 0x5410);
      lo[3] = __byte_perm(a_hi, b_hi, 0x7632);
      hi[0] = __byte_perm(e_lo, f_lo, 0x5410);
      hi[1] = __byte_perm(e_lo, f_lo, 0x7632);
      hi[2] = __byte_perm(e_hi, f_hi, 0x5410);
      hi[3] = __byte_perm(e_hi, f_hi, 0x7632);
      const int64_t r = r0 + row8;  // first of my 8 input rows = colwise column
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t oc = c0 + col4 + j;  // colwise row
        if (oc >= cols) break;
        uint8_t* dst = colwise + oc * rows + r;
        if (colwise_vec && r + 8 <= rows) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(lo[j], hi[j]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            if (r + k < rows) dst[k] = uint8_t((k < 4 ? lo[j] : hi[j]) >> (8 * (k % 4)));
          }
        }
      }
    }
    __syncthreads();  // codes and col_scale are rewritten by the next tile
  }
}

template <typename Tag, typename Fmt, bool kTile2d>
Status LaunchQuantize(const QuantizeFp8BlockArgs& a, GpuStream stream) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  auto aligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
  // Zero the scale padding (only where there is any).
  auto zero_padding = [&](float* scale_inv, int64_t r, int64_t c) -> Status {
    if (scale_inv == nullptr) return Status::Ok();
    const int64_t used = kTile2d ? CeilDivI64(c, kFp8BlockLen) : r;
    const ScaleDims d = Fp8BlockScaleDims(r, c, kTile2d);
    if (used == d.dim1) return Status::Ok();
    return CudaStatus(cudaMemsetAsync(scale_inv, 0, size_t(d.size()) * sizeof(float), stream), kQuantizeOp,
                      "cudaMemsetAsync");
  };
  LOWBIT_RETURN_IF_ERROR(zero_padding(a.rowwise_scale_inv, a.rows, a.cols));
  LOWBIT_RETURN_IF_ERROR(zero_padding(a.colwise_scale_inv, a.cols, a.rows));

  const T* x = static_cast<const T*>(a.x);
  const int64_t tiles = CeilDivI64(a.rows, kTile) * CeilDivI64(a.cols, kTile);
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 4);
  const bool vec_io = aligned(x, 16) && a.cols % kVec == 0 && (a.rowwise == nullptr || aligned(a.rowwise, 16));
  const bool colwise_vec = a.colwise != nullptr && aligned(a.colwise, 8) && a.rows % 8 == 0;
  if (vec_io) {
    QuantizeFp8BlockKernel<Tag, Fmt, kTile2d, true><<<blocks, kThreads, 0, stream>>>(
        x, a.rows, a.cols, a.pow2_scales, a.rowwise, a.rowwise_scale_inv, a.colwise, a.colwise_scale_inv, colwise_vec);
  } else {
    QuantizeFp8BlockKernel<Tag, Fmt, kTile2d, false><<<blocks, kThreads, 0, stream>>>(
        x, a.rows, a.cols, a.pow2_scales, a.rowwise, a.rowwise_scale_inv, a.colwise, a.colwise_scale_inv, colwise_vec);
  }
  return LaunchStatus(kQuantizeOp);
}

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

Status QuantizeFp8BlockCuda(const QuantizeFp8BlockArgs& a, GpuStream stream) {
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    if (a.rows == 0 || a.cols == 0) return Status::Ok();  // every output is empty
    return DispatchFp8(a.out_dtype, kQuantizeOp, "out", [&](auto fmt) {
      using Tag = decltype(tag);
      using Fmt = decltype(fmt);
      return a.tile_2d ? LaunchQuantize<Tag, Fmt, true>(a, stream) : LaunchQuantize<Tag, Fmt, false>(a, stream);
    });
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
