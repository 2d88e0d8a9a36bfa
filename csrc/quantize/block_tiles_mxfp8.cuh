// The MXFP8 tile kernel Mxfp8TileKernel and its launchers, over the shared tile helpers of
// block_tiles_common.cuh; part of block_tiles.cuh (the umbrella header, which describes the
// row tilings and tile sources the kernel is templated on).
//
// Mxfp8TileKernel: a block (256 threads) loops over 64 x 128 tiles of x; each thread
//   issues its chunk loads (kPasses rows x one chunk) first (staged: during the previous
//   tile), then
//   - amaxes (bf16 x: on the 16-bit halves): per chunk, and per column for each of the
//     tile's two 32-row blocks;
//   - rowwise: the 32-value block max over the 32 / kVec lanes that hold it (shuffles),
//     lane q of those computing pass q's E8M0 byte (and writing it) and shuffling it to the
//     others;
//   - colwise: the per-thread column maxima combined through shared memory by one thread per
//     (block, column), which writes the byte;
//   - codes: each value converted to fp32 once and encoded with its row block's factor and
//     its column block's, both copies stored in x's layout (no transpose).
//   Scale padding is zeroed by a memset first, only when there is any.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cuda_check.h"
#include "common/element.h"
#include "quantize/block_tiles_common.cuh"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {
namespace block_tiles {

// Resident blocks an SM Mxfp8TileKernel is compiled for: the staged dbias form as the plain one
// (bf16: 63 registers, no spills, with its column totals after the colwise exchange's barrier;
// f16: 12 bytes), the unstaged dbias form 3 (80 registers).
template <typename Src, bool kDbias, bool kStaged>
constexpr int Mxfp8TileMinBlocks() {
  return kDbias && !kStaged && Src::kMinBlocksMxfp8 > 3 ? 3 : Src::kMinBlocksMxfp8;
}

// kVectorIO: the source's chunks are whole 16-byte loads (Src::Load) and rowwise / colwise
// are 16-byte aligned: every in-range chunk is one kVec-byte store.
// kStaged: as Fp8BlockTileKernel's.
template <typename Src, typename Fmt, bool kVectorIO, bool kDbias, bool kStaged, typename Rows>
__global__ void __launch_bounds__(kThreads, (Mxfp8TileMinBlocks<Src, kDbias, kStaged>()))
    Mxfp8TileKernel(const Src src, const Rows row_tiles, int64_t rows, int64_t cols,
                        uint8_t* __restrict__ rowwise, uint8_t* __restrict__ row_scale,
                        uint8_t* __restrict__ colwise, uint8_t* __restrict__ col_scale,
                        float* __restrict__ dbias_partials) {
  constexpr int kVec = Src::kVec;  // elements per chunk (16 input bytes)
  constexpr int kThreadsPerRow = kTileCols / kVec;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTileRows / kRowsPerPass;  // 4 or 8; the first half is block 0
  constexpr int kLanesPerBlock = kBlock / kVec;      // 4 or 8 lanes hold one rowwise block
  __shared__ uint32_t col_part[2][kRowsPerPass][kTileCols];
  __shared__ float col_factor[2][kTileCols];
  __shared__ __align__(16) float lane_sums[kDbias ? kRowsPerPass : 1][kTileCols];  // dbias

  const int64_t tiles_c = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = row_tiles.TileRows(kTileRows) * tiles_c;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  const int64_t row_ld = Mxfp8ScaleDims(rows, cols, false).dim1;
  const int64_t col_ld = Mxfp8ScaleDims(rows, cols, true).dim1;
  typename Rows::Cursor cursor;
  static_assert(!kStaged || (kVectorIO && !Rows::kGrouped && Stageable<Src>::value), "staged: plain vector walk");
  extern __shared__ __align__(16) uint8_t staged_bytes[];  // kStaged: the next tile's chunks
  uint4* const staged = reinterpret_cast<uint4*>(staged_bytes);
  if constexpr (kStaged) {
    if (blockIdx.x < tiles) {
      StageTile<kTileRows, kTileCols, kPasses, kRowsPerPass>(src, row_tiles, blockIdx.x, tiles_c, kTileRows / kBlock,
                                                             chunk_row, chunk_col, cols, staged);
    }
  }

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const RowTile rt = row_tiles.Tile(tile / tiles_c, kTileRows, kTileRows / kBlock, cursor);
    if (rt.skip) continue;  // uniform across the block
    const int64_t r0 = rt.r0, r_lim = rt.r_lim;
    const int64_t c0 = tile % tiles_c * kTileCols;
    const int64_t c = c0 + chunk_col;

    typename Src::Chunk vals[kPasses];
    LoadTileChunks<kStaged, kVectorIO, kPasses, kRowsPerPass>(src, r0, c, r_lim, cols, chunk_row, staged, vals);
    uint32_t chunk_max[kPasses];
    uint32_t col_max[2][kVec];  // the tile's two 32-row blocks
    ChunkAndColumnMaxima<2, kPasses, kVec, Src>(vals, chunk_max, col_max);
    if constexpr (kStaged) {  // as in Fp8BlockTileKernel: every staged value is in registers
      if (tile + gridDim.x < tiles) {
        StageTile<kTileRows, kTileCols, kPasses, kRowsPerPass>(src, row_tiles, tile + gridDim.x, tiles_c,
                                                               kTileRows / kBlock, chunk_row, chunk_col, cols, staged);
      }
    }

    // dbias (the plain walk: tile row r0 / kTileRows); with a colwise copy the column totals
    // are added after the colwise exchange's barrier, as in Fp8BlockTileKernel.
    const int64_t tile_r = r0 / kTileRows;
    if constexpr (kDbias) {
      if (colwise != nullptr) {
        StoreLaneSums<Src, kPasses, kRowsPerPass, kTileCols>(vals, chunk_row, chunk_col, lane_sums);
      } else {
        TileColumnSums<Src, kPasses, kRowsPerPass, kTileCols>(vals, chunk_row, chunk_col, c0, cols, tile_r,
                                                              lane_sums, dbias_partials);
      }
    }

    // Rowwise E8M0 bytes: the kLanesPerBlock lanes of a 32-value block share it
    // (RowBlockValues); lane q also writes pass q's.
    uint32_t row_e[kPasses];
    if (rowwise != nullptr) {
      const uint32_t my_e = RowBlockValues<kLanesPerBlock>(
          chunk_max, [](uint32_t m) { return uint32_t(Mxfp8ScaleByte(m, Fmt::kMax)); }, row_e);
      const int q = threadIdx.x % kLanesPerBlock;
      const int64_t c_block = c - q * kVec;  // the block's first column
      if (q < kPasses) {
        const int64_t r = r0 + q * kRowsPerPass + chunk_row;
        if (r < r_lim && c_block < cols) row_scale[r * row_ld + c_block / kBlock] = uint8_t(my_e);
      }
    }

    // Colwise E8M0 bytes and factors, through shared memory.
    if (colwise != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        col_part[0][chunk_row][chunk_col + j] = col_max[0][j];
        col_part[1][chunk_row][chunk_col + j] = col_max[1][j];
      }
      __syncthreads();
      if constexpr (kDbias) {
        if (threadIdx.x < kTileCols) FinishColumnSum<kRowsPerPass, kTileCols>(c0, cols, tile_r, lane_sums, dbias_partials);
      }
      {
        const int half = threadIdx.x / kTileCols, col = threadIdx.x % kTileCols;  // 256 = 2 x 128
        uint32_t m = 0;
#pragma unroll
        for (int g = 0; g < kRowsPerPass; ++g) m = max(m, col_part[half][g][col]);
        const uint8_t e = Mxfp8ScaleByte(m, Fmt::kMax);
        col_factor[half][col] = Mxfp8EncodeFactor(e);
        if (r0 + half * kBlock < r_lim && c0 + col < cols && !rt.tail) col_scale[(rt.scale_row + half) * col_ld + c0 + col] = e;
      }
      __syncthreads();
    }

    // Codes: each value converted once, encoded with its row block's factor and its column
    // block's, both copies stored in x's layout.
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int64_t r = r0 + p * kRowsPerPass + chunk_row;
      float v[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = Src::Value(vals[p], j);
      if (rowwise != nullptr) {
        float f[kVec];
        const float factor = Mxfp8EncodeFactor(row_e[p]);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f[j] = factor;
        uint32_t words[kVec / 4];
        EncodeChunkScaled(Fmt{}, v, f, chunk_max[p] <= 0x7F800000u && row_e[p] != 0xFFu, words);
        if (r < r_lim) StoreRowCodes<kVectorIO, kVec>(rowwise + r * cols, c, cols, words);
      }
      if (colwise != nullptr) {
        float f[kVec];
        bool factors_ok = true;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          f[j] = col_factor[p / (kPasses / 2)][chunk_col + j];
          factors_ok &= !IsNanBits(FloatBits(f[j]));
        }
        uint32_t words[kVec / 4];
        EncodeChunkScaled(Fmt{}, v, f, chunk_max[p] <= 0x7F800000u && factors_ok, words);
        if (Rows::kGrouped && rt.tail) ZeroWords(words);
        if (r < r_lim) StoreRowCodes<kVectorIO, kVec>(colwise + r * cols, c, cols, words);
      }
    }
    // col_part / col_factor (colwise) and lane_sums (dbias) are rewritten by the next tile;
    // colwise is uniform across the block.
    if (colwise != nullptr || kDbias) __syncthreads();
  }
}

// Zeroes an MXFP8 scale array of a rows x cols tensor where it has padding entries.
inline Status ZeroMxfp8ScalePadding(uint8_t* scale, int64_t rows, int64_t cols, bool colwise, const char* op,
                                    GpuStream stream) {
  if (scale == nullptr) return Status::Ok();
  const ScaleDims d = Mxfp8ScaleDims(rows, cols, colwise);
  const int64_t used0 = colwise ? CeilDivI64(rows, kBlock) : rows;
  const int64_t used1 = colwise ? cols : CeilDivI64(cols, kBlock);
  if (used0 == d.dim0 && used1 == d.dim1) return Status::Ok();
  return CudaStatus(cudaMemsetAsync(scale, 0, size_t(d.size()), stream), op, "cudaMemsetAsync");
}

// Launches Mxfp8TileKernel over a's outputs with the row tiling `row_tiles`, as
// LaunchFp8BlockTileKernel (block_tiles_fp8.cuh) does Fp8BlockTileKernel.
template <typename Src, typename Fmt, bool kDbias = false, typename Rows>
Status LaunchMxfp8TileKernel(const Src& src, bool src_vector_ok, const Rows& row_tiles, const QuantizeMxfp8Args& a,
                             const char* op, GpuStream stream, float* dbias_partials = nullptr) {
  static_assert(!(kDbias && Rows::kGrouped), "dbias: the plain walk only");
  if (kDbias != (dbias_partials != nullptr)) return Status::Internal(std::string(op) + ": dbias: workspace mismatch");
  const int64_t tiles = row_tiles.TileRows(kTileRows) * CeilDivI64(a.cols, kTileCols);
  const bool vec_io = src_vector_ok && (a.rowwise == nullptr || Aligned(a.rowwise, 16)) &&
                      (a.colwise == nullptr || Aligned(a.colwise, 16));
  if constexpr (Stageable<Src>::value && !Rows::kGrouped) {
    bool staged = false;
    const bool default_on = kDbias || sizeof(typename Src::T) != 2;
    LOWBIT_RETURN_IF_ERROR(BlockTileStaging(op, default_on, &staged));
    if (vec_io && staged) {
      bool launched = false;
      LOWBIT_RETURN_IF_ERROR(LaunchStagedIfFits(Mxfp8TileKernel<Src, Fmt, true, kDbias, true, Rows>,
                                                StagedTileBytes<Src, kTileRows, kTileCols>(), tiles, op, stream,
                                                &launched, src, row_tiles, a.rows, a.cols, a.rowwise,
                                                a.rowwise_scale, a.colwise, a.colwise_scale, dbias_partials));
      if (launched) return Status::Ok();
    }
  }
  // Unstaged: twice the resident blocks, as for the FP8 block kernel.
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 2 * Mxfp8TileMinBlocks<Src, kDbias, false>());
  if (vec_io) {
    Mxfp8TileKernel<Src, Fmt, true, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.rowwise, a.rowwise_scale, a.colwise, a.colwise_scale, dbias_partials);
  } else {
    Mxfp8TileKernel<Src, Fmt, false, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.rowwise, a.rowwise_scale, a.colwise, a.colwise_scale, dbias_partials);
  }
  return LaunchStatus(op);
}

// Launches Mxfp8TileKernel over a's outputs (the plain walk), zeroing scale padding first;
// with dbias_partials (ceil(rows / 64) x cols fp32), the tile column sums of block_dbias.h.
template <typename Src, typename Fmt, bool kDbias = false>
Status LaunchMxfp8Tiles(const Src& src, bool src_vector_ok, const QuantizeMxfp8Args& a, const char* op,
                        GpuStream stream, float* dbias_partials = nullptr) {
  LOWBIT_RETURN_IF_ERROR(ZeroMxfp8ScalePadding(a.rowwise_scale, a.rows, a.cols, false, op, stream));
  LOWBIT_RETURN_IF_ERROR(ZeroMxfp8ScalePadding(a.colwise_scale, a.rows, a.cols, true, op, stream));
  UniformRowTiles row_tiles;
  row_tiles.rows = a.rows;
  return LaunchMxfp8TileKernel<Src, Fmt, kDbias>(src, src_vector_ok, row_tiles, a, op, stream, dbias_partials);
}

}  // namespace block_tiles
}  // namespace lowbit
