// The FP8 block (1x128, 128x128) tile kernel Fp8BlockTileKernel and its launchers, over the
// shared tile helpers of block_tiles_common.cuh; part of block_tiles.cuh (the umbrella header,
// which describes the row tilings and tile sources the kernel is templated on).
//
// Fp8BlockTileKernel: a block (256 threads) loops over 128 x 128 tiles of x. Each thread
//   issues all its chunk loads of the tile first (kPasses rows x one 16-byte chunk; in the
//   staged form, block_tiles.cuh, they were issued during the previous tile), then:
//   - amaxes (bf16 x: on the 16-bit halves, two per instruction): 1x128 rowwise: the tile
//     row's max over the lanes that hold it (shuffles), lane q of those computing the scale
//     of pass q's row (one division per lane) and shuffling it to the others; 1x128
//     colwise: per-thread column maxima, combined through shared memory; 128x128: one
//     block-wide max;
//   - rowwise codes: encoded with their row's scale and stored straight to global memory;
//   - colwise codes (encoded with their column's scale, from the same fp32 values as the
//     rowwise ones; for 128x128 the rowwise codes, the scale being the same) go to shared
//     memory, from which each thread gathers 4 columns x 8 rows, byte-transposes them and
//     writes 8-byte stores of the cols x rows copy (grouped tiles, which start at any row,
//     take 8-row windows aligned to x's rows instead).
//   Scales are written by the threads that own them; padding entries are zeroed by a memset
//   first, only when there are any.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/block_tiles_common.cuh"
#include "quantize/quantize_block.h"

namespace lowbit {
namespace block_tiles {

// Resident blocks an SM Fp8BlockTileKernel is compiled for (its launch bounds). The staged
// 1x128 dbias form fits the plain form's registers (its column totals share the colwise
// exchange's barrier); the unstaged dbias form would spill there and takes 2.
template <typename Src, bool kTile2d, bool kDbias, bool kStaged>
constexpr int Fp8TileMinBlocks() {
  return kTile2d ? Src::kMinBlocks2d : (kDbias && !kStaged) ? 2 : Src::kMinBlocks;
}

// kVectorIO: the source's chunks are whole 16-byte loads (Src::Load) and rowwise is aligned:
// every in-range chunk is one kVec-byte store. colwise_vec: rows % 8 == 0, colwise 8-byte
// aligned: full 8-row transposed chunks (at rows % 8 == 0) are 8-byte stores.
// kStaged (plain walk, vector IO, a Stageable source): each thread's chunks of the block's
// next tile are copied into dynamic shared memory (StagedTileBytes) by cp.async while this
// tile is encoded and stored, instead of being loaded when the tile starts.
template <typename Src, typename Fmt, bool kTile2d, bool kVectorIO, bool kDbias, bool kStaged, typename Rows>
__global__ void __launch_bounds__(kThreads, (Fp8TileMinBlocks<Src, kTile2d, kDbias, kStaged>()))
    Fp8BlockTileKernel(const Src src, const Rows row_tiles, int64_t rows, int64_t cols,
                           bool pow2, uint8_t* __restrict__ rowwise, float* __restrict__ row_scale_inv,
                           uint8_t* __restrict__ colwise, float* __restrict__ col_scale_inv,
                           bool colwise_vec, float* __restrict__ dbias_partials) {
  constexpr int kVec = Src::kVec;                      // elements per chunk (16 input bytes)
  constexpr int kThreadsPerRow = kTile / kVec;         // 16 (16-bit x) or 32 (f32)
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTile / kRowsPerPass;        // 8 or 16
  __shared__ __align__(16) uint8_t codes[kTile][kCodeStride];
  __shared__ uint32_t col_part[kRowsPerPass][kTile];
  __shared__ float col_scale[kTile];
  __shared__ __align__(16) float lane_sums[kDbias ? kRowsPerPass : 1][kTile];  // dbias

  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t tiles = row_tiles.TileRows(kTile) * tiles_c;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  const ScaleDims row_dims = Fp8BlockScaleDims(rows, cols, kTile2d);
  const ScaleDims col_dims = Fp8BlockScaleDims(cols, rows, kTile2d);
  typename Rows::Cursor cursor;
  static_assert(!kStaged || (kVectorIO && !Rows::kGrouped && Stageable<Src>::value), "staged: plain vector walk");
  extern __shared__ __align__(16) uint8_t staged_bytes[];  // kStaged: the next tile's chunks
  uint4* const staged = reinterpret_cast<uint4*>(staged_bytes);
  if constexpr (kStaged) {
    if (blockIdx.x < tiles) {
      StageTile<kTile, kTile, kPasses, kRowsPerPass>(src, row_tiles, blockIdx.x, tiles_c, 1, chunk_row, chunk_col,
                                                     cols, staged);
    }
  }

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t tile_r = tile / tiles_c;
    const RowTile rt = row_tiles.Tile(tile_r, kTile, 1, cursor);
    if (rt.skip) continue;  // uniform across the block
    const int64_t r0 = rt.r0, r_lim = rt.r_lim;
    const int64_t c0 = tile % tiles_c * kTile;
    const int64_t c = c0 + chunk_col;

    // 1. All loads first, 2. the amaxes.
    typename Src::Chunk vals[kPasses];
    LoadTileChunks<kStaged, kVectorIO, kPasses, kRowsPerPass>(src, r0, c, r_lim, cols, chunk_row, staged, vals);
    uint32_t chunk_max[kPasses];
    uint32_t col_max[1][kVec];
    ChunkAndColumnMaxima<1, kPasses, kVec, Src>(vals, chunk_max, col_max);
    // Every staged value is in registers now (the maxima used them all): the next tile's
    // copies may overwrite the slots.
    if constexpr (kStaged) {
      if (tile + gridDim.x < tiles) {
        StageTile<kTile, kTile, kPasses, kRowsPerPass>(src, row_tiles, tile + gridDim.x, tiles_c, 1, chunk_row,
                                                       chunk_col, cols, staged);
      }
    }

    // dbias (the plain walk: tile row tile_r). 1x128 with a colwise copy: the lane sums go to
    // shared memory now and the column totals are added after the colwise exchange's barrier,
    // which then serves both; otherwise TileColumnSums with its own barrier.
    if constexpr (kDbias) {
      if (!kTile2d && colwise != nullptr) {
        StoreLaneSums<Src, kPasses, kRowsPerPass, kTile>(vals, chunk_row, chunk_col, lane_sums);
      } else {
        TileColumnSums<Src, kPasses, kRowsPerPass, kTile>(vals, chunk_row, chunk_col, c0, cols, tile_r, lane_sums,
                                                          dbias_partials);
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
      if (threadIdx.x == 0 && !rt.tail) {
        const float inv = ScaleDivRn(1.0f, s);
        if (rowwise != nullptr) row_scale_inv[rt.scale_row * row_dims.dim1 + c0 / kTile] = inv;
        if (colwise != nullptr) col_scale_inv[(c0 / kTile) * row_tiles.col2d_ld + rt.scale_col2d] = inv;
      }
    } else {
      // The kThreadsPerRow lanes of a tile row share its scale (RowBlockValues); lane q also
      // writes pass q's scale_inv.
      const float my_scale = RowBlockValues<kThreadsPerRow>(
          chunk_max, [&](uint32_t m) { return Fp8BlockScale(m, Fmt::kMax, pow2); }, row_scale);
      const int q = threadIdx.x % kThreadsPerRow;
      if (q < kPasses) {
        const int64_t r = r0 + q * kRowsPerPass + chunk_row;
        if (rowwise != nullptr && r < r_lim) {
          row_scale_inv[(c0 / kTile) * row_dims.dim1 + r] = ScaleDivRn(1.0f, my_scale);
        }
      }
      if (colwise != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) col_part[chunk_row][chunk_col + j] = col_max[0][j];
        __syncthreads();
        if (threadIdx.x < kTile) {
          if constexpr (kDbias) FinishColumnSum<kRowsPerPass, kTile>(c0, cols, tile_r, lane_sums, dbias_partials);
          uint32_t m = 0;
#pragma unroll
          for (int g = 0; g < kRowsPerPass; ++g) m = max(m, col_part[g][threadIdx.x]);
          const float s = Fp8BlockScale(m, Fmt::kMax, pow2);
          col_scale[threadIdx.x] = s;
          // Colwise copy Q = x^T: element (c, r) has its 1x128 scale at [r / 128][c] (grouped:
          // at the tile's scale row).
          if (c0 + threadIdx.x < cols && !rt.tail) {
            col_scale_inv[rt.scale_row * col_dims.dim1 + c0 + threadIdx.x] = ScaleDivRn(1.0f, s);
          }
        }
        __syncthreads();
      }
    }

    // 3. Codes. 128x128: the rowwise codes, which are also the colwise ones (via shared
    // memory). 1x128: per chunk, each value converted once and encoded twice, with its row's
    // scale (stored straight out) and with its column's (to shared memory).
    if constexpr (kTile2d) {
      if (rowwise != nullptr || colwise != nullptr) {
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
          const int local_row = p * kRowsPerPass + chunk_row;
          const int64_t r = r0 + local_row;
          float v[kVec], s[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            v[j] = Src::Value(vals[p], j);
            s[j] = row_scale[p];
          }
          uint32_t words[kVec / 4];
          EncodeChunkScaled(Fmt{}, v, s, chunk_max[p] <= 0x7F800000u, words);
          if (Rows::kGrouped && rt.tail) ZeroWords(words);  // both copies group-bound
          if (rowwise != nullptr && r < r_lim) StoreRowCodes<kVectorIO, kVec>(rowwise + r * cols, c, cols, words);
          if (colwise != nullptr) {
#pragma unroll
            for (int j = 0; j < kVec; j += 4) *reinterpret_cast<uint32_t*>(&codes[local_row][chunk_col + j]) = words[j / 4];
          }
        }
      }
    } else {
      float cs[kVec];
      if (colwise != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) cs[j] = col_scale[chunk_col + j];
      }
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        const int local_row = p * kRowsPerPass + chunk_row;
        const int64_t r = r0 + local_row;
        const bool no_nan = chunk_max[p] <= 0x7F800000u;
        float v[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = Src::Value(vals[p], j);
        if (rowwise != nullptr) {
          float s[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) s[j] = row_scale[p];
          uint32_t words[kVec / 4];
          EncodeChunkScaled(Fmt{}, v, s, no_nan, words);
          if (r < r_lim) StoreRowCodes<kVectorIO, kVec>(rowwise + r * cols, c, cols, words);
        }
        if (colwise != nullptr) {
          uint32_t words[kVec / 4];
          EncodeChunkScaled(Fmt{}, v, cs, no_nan, words);
          if (Rows::kGrouped && rt.tail) ZeroWords(words);
#pragma unroll
          for (int j = 0; j < kVec; j += 4) *reinterpret_cast<uint32_t*>(&codes[local_row][chunk_col + j]) = words[j / 4];
        }
      }
    }
    if (colwise == nullptr) {  // uniform across the block
      if constexpr (kDbias) __syncthreads();  // lane_sums is rewritten by the next tile
      continue;
    }
    __syncthreads();

    // 5. Transposed write: item -> 4 tile columns x 8 tile rows, 8 lanes cover 64 bytes.
    if constexpr (!Rows::kGrouped) {
#pragma unroll
      for (int item = threadIdx.x; item < kColItems; item += kThreads) {
        const int row8 = (item % (kTile / 8)) * 8;
        const int col4 = (item / (kTile / 8)) * 4;
        uint32_t w[8], lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = *reinterpret_cast<const uint32_t*>(&codes[row8 + k][col4]);
        TransposeBytes8x4(w, lo, hi);
        const int64_t r = r0 + row8;  // first of my 8 input rows = colwise column
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t oc = c0 + col4 + j;  // colwise row
          if (oc >= cols) break;
          uint8_t* dst = colwise + oc * rows + r;
          if (colwise_vec && r + 8 <= r_lim) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(lo[j], hi[j]);
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              if (r + k < r_lim) dst[k] = uint8_t((k < 4 ? lo[j] : hi[j]) >> (8 * (k % 4)));
            }
          }
        }
      }
    } else {
      // Grouped: r0 (a group start + 128k) need not be a multiple of 8. The 8-row windows
      // are aligned to x's rows instead, so that whole windows stay 8-byte stores: with
      // shift = r0 % 8 != 0 there are 17, the first starting at tile row -shift; rows
      // outside [r0, min(r0 + 128, r_lim)) are neither read nor stored.
      const int shift = int(r0 & 7);
      const int windows = kTile / 8 + (shift != 0 ? 1 : 0);
      const int rows_here = int(min(int64_t(kTile), r_lim - r0));
      for (int item = threadIdx.x; item < windows * (kTile / 4); item += kThreads) {
        const int lr0 = (item % windows) * 8 - shift;  // tile row of the window's first row
        const int col4 = (item / windows) * 4;
        uint32_t w[8], lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int lr = lr0 + k;
          w[k] = lr >= 0 && lr < rows_here ? *reinterpret_cast<const uint32_t*>(&codes[lr][col4]) : 0u;
        }
        TransposeBytes8x4(w, lo, hi);
        const bool whole = colwise_vec && lr0 >= 0 && lr0 + 8 <= rows_here;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t oc = c0 + col4 + j;  // colwise row
          if (oc >= cols) break;
          uint8_t* dst = colwise + oc * rows + (r0 + lr0);
          if (whole) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(lo[j], hi[j]);
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              if (lr0 + k >= 0 && lr0 + k < rows_here) dst[k] = uint8_t((k < 4 ? lo[j] : hi[j]) >> (8 * (k % 4)));
            }
          }
        }
      }
    }
    __syncthreads();  // codes and col_scale are rewritten by the next tile
  }
}

// Zeroes an FP8 block scale_inv of a stored r x c copy where it has padding entries.
inline Status ZeroFp8BlockScalePadding(float* scale_inv, int64_t r, int64_t c, bool tile_2d, const char* op,
                                       GpuStream stream) {
  if (scale_inv == nullptr) return Status::Ok();
  const int64_t used = tile_2d ? CeilDivI64(c, kFp8BlockLen) : r;
  const ScaleDims d = Fp8BlockScaleDims(r, c, tile_2d);
  if (used == d.dim1) return Status::Ok();
  return CudaStatus(cudaMemsetAsync(scale_inv, 0, size_t(d.size()) * sizeof(float), stream), op, "cudaMemsetAsync");
}

// Launches Fp8BlockTileKernel over a's outputs with the row tiling `row_tiles` (a.x and
// a.x_dtype are not used: the source is the input; a.rows is x's row count, the colwise
// copy's leading dim). src_vector_ok: the source's chunks are whole 16-byte loads.
// Scale padding is the caller's.
template <typename Src, typename Fmt, bool kTile2d, bool kDbias = false, typename Rows>
Status LaunchFp8BlockTileKernel(const Src& src, bool src_vector_ok, const Rows& row_tiles,
                                const QuantizeFp8BlockArgs& a, const char* op, GpuStream stream,
                                float* dbias_partials = nullptr) {
  static_assert(!(kDbias && Rows::kGrouped), "dbias: the plain walk only");
  if (kDbias != (dbias_partials != nullptr)) return Status::Internal(std::string(op) + ": dbias: workspace mismatch");
  const int64_t tiles = row_tiles.TileRows(kTile) * CeilDivI64(a.cols, kTile);
  const bool vec_io = src_vector_ok && (a.rowwise == nullptr || Aligned(a.rowwise, 16));
  const bool colwise_vec = a.colwise != nullptr && Aligned(a.colwise, 8) && a.rows % 8 == 0;
  if constexpr (Stageable<Src>::value && !Rows::kGrouped) {
    bool staged = false;
    const bool default_on = !(kTile2d && sizeof(typename Src::T) == 2);
    LOWBIT_RETURN_IF_ERROR(BlockTileStaging(op, default_on, &staged));
    if (vec_io && staged) {
      bool launched = false;
      LOWBIT_RETURN_IF_ERROR(LaunchStagedIfFits(Fp8BlockTileKernel<Src, Fmt, kTile2d, true, kDbias, true, Rows>,
                                                StagedTileBytes<Src, kTile, kTile>(), tiles, op, stream, &launched,
                                                src, row_tiles, a.rows, a.cols, a.pow2_scales, a.rowwise,
                                                a.rowwise_scale_inv, a.colwise, a.colwise_scale_inv, colwise_vec,
                                                dbias_partials));
      if (launched) return Status::Ok();
    }
  }
  // Unstaged: twice the resident blocks, so that blocks loading overlap blocks encoding.
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 2 * Fp8TileMinBlocks<Src, kTile2d, kDbias, false>());
  if (vec_io) {
    Fp8BlockTileKernel<Src, Fmt, kTile2d, true, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.pow2_scales, a.rowwise, a.rowwise_scale_inv, a.colwise,
        a.colwise_scale_inv, colwise_vec, dbias_partials);
  } else {
    Fp8BlockTileKernel<Src, Fmt, kTile2d, false, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.pow2_scales, a.rowwise, a.rowwise_scale_inv, a.colwise,
        a.colwise_scale_inv, colwise_vec, dbias_partials);
  }
  return LaunchStatus(op);
}

// Launches Fp8BlockTileKernel over a's outputs (the plain walk), zeroing scale padding first;
// with dbias_partials (ceil(rows / 128) x cols fp32), the tile column sums of block_dbias.h.
template <typename Src, typename Fmt, bool kTile2d, bool kDbias = false>
Status LaunchFp8BlockTiles(const Src& src, bool src_vector_ok, const QuantizeFp8BlockArgs& a, const char* op,
                           GpuStream stream, float* dbias_partials = nullptr) {
  LOWBIT_RETURN_IF_ERROR(ZeroFp8BlockScalePadding(a.rowwise_scale_inv, a.rows, a.cols, kTile2d, op, stream));
  LOWBIT_RETURN_IF_ERROR(ZeroFp8BlockScalePadding(a.colwise_scale_inv, a.cols, a.rows, kTile2d, op, stream));
  UniformRowTiles row_tiles;
  row_tiles.rows = a.rows;
  row_tiles.col2d_ld = Fp8BlockScaleDims(a.cols, a.rows, true).dim1;
  return LaunchFp8BlockTileKernel<Src, Fmt, kTile2d, kDbias>(src, src_vector_ok, row_tiles, a, op, stream,
                                                             dbias_partials);
}

}  // namespace block_tiles
}  // namespace lowbit
