// The tiled FP8 quantize kernel QuantizeTiledKernel (pipeline below) over the tiles of
// quantize_tiled_tile.cuh and the hooks of quantize_tiled_policies.cuh; its launchers and the
// `Groups` / `Place` contract: quantize_tiled.cuh. Private to the including translation unit
// (an anonymous namespace, as when this code lived in quantize_tiled.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/cp_async.cuh"
#include "common/element.h"
#include "common/fast_div.h"
#include "common/reduce.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize_tiled_policies.cuh"
#include "quantize/quantize_tiled_tile.cuh"

namespace lowbit {
namespace {

// ---------------------------------------------------------------- tiled kernel
// One kRows x 128 tile per loop step (kRows = 64 or 128), 4 * kRows threads, and ONE
// __syncthreads per tile. Step i, after that barrier:
//   prefetch  tile i + kStages - 1 into the input stage tile i - 1 used (cp.async);
//   transpose tile i - 1's codes (left in shared memory by step i - 1) to colwise, and
//             add up its dbias row-group sums into one workspace row;
//   encode    tile i: amax, rowwise codes (16-byte stores), codes into the other codes
//             buffer, and (dbias) column sums of row groups into the other partial buffer.
// Every buffer written in step i is read in step i + 1 and rewritten in step i + 2, so
// the barrier of each step separates all of its writers from its readers. Shared memory
// (dynamic): kStages input stages, 2 code buffers, 2 dbias partial buffers.

// kVectorIO: x is 16-byte aligned and cols % kVec == 0, so every in-range input chunk is
// one 16-byte copy. Stores pick their width from the address at run time (StoreCodes16/8).
template <typename Tag, typename Fmt, bool kVectorIO, int kRows, int kStages, typename Groups, typename Place>
__global__ void __launch_bounds__(TileShape<typename Tag::Storage, kRows, kStages>::kThreads,
                                  TileShape<typename Tag::Storage, kRows, kStages>::kMinBlocks)
    QuantizeTiledKernel(const typename Tag::Storage* __restrict__ x, int64_t rows, int64_t cols,
                        const float* __restrict__ scale_ptr, uint8_t* __restrict__ rowwise,
                        uint8_t* __restrict__ colwise, uint32_t* __restrict__ amax,
                        float* __restrict__ partials, uint32_t band, Groups groups, const Place place) {
  using T = typename Tag::Storage;
  using Shape = TileShape<T, kRows, kStages>;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* const input = smem;                          // kStages x kInputBytes
  uint8_t* const codes = smem + Shape::kCodesOffset;    // 2 x kCodesBytes
  float* const col_partial = reinterpret_cast<float*>(smem + Shape::kPartialOffset);  // 2 x groups x 128

  // OneTensor: one scale for every row. Grouped: the group table goes into the shared
  // memory after the tiles (groups.Load); the loop's first barrier publishes it.
  float scale = 0.0f;
  bool scale_ok = false;
  typename Groups::Cursor cursor{};
  if constexpr (Groups::kGrouped) {
    groups.Load(smem + Shape::kSmemBytes);
  } else {
    scale = __ldg(scale_ptr);
    scale_ok = ScaleKeepsFinite(scale);
  }
  // Tile indices fit 32 bits (2^32 tiles would be 2^45 elements); 32-bit division is cheap.
  const uint32_t tiles_c = uint32_t((cols + kTileCols - 1) / kTileCols);
  const uint32_t tiles_r = uint32_t((rows + kRows - 1) / kRows);
  const uint32_t tiles = tiles_r * tiles_c;
  band = min(band, tiles_r);  // then band * tiles_c <= tiles
  const FastDivU32 by_cols(tiles_c);
  auto tile_at = [&](uint32_t t) { return TileAt<kRows>(t, tiles_r, tiles_c, by_cols, band, rows, cols); };
  auto load = [&](uint32_t t, int stage) {
    const TileOrigin o = tile_at(t);
    LoadTile<T, kRows, kStages, kVectorIO>(x + o.r0 * cols + o.c0, cols, o.rows_left, o.cols_left,
                                           input + stage * Shape::kInputBytes);
  };

  // Prologue: tiles 0 .. kStages - 2 of this block, one commit group each (empty past the end).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const uint64_t t = uint64_t(blockIdx.x) + uint64_t(s) * gridDim.x;
    if (t < tiles) load(uint32_t(t), s);
    CopyAsyncCommit();
  }

  uint32_t best = 0;
  TileOrigin prev;
  bool have_prev = false;
  int stage = 0, buf = 0;
  for (uint32_t tile = blockIdx.x;; tile += gridDim.x) {
    const bool have = tile < tiles;  // the same in every thread of the block
    if (!have && !have_prev) break;
    CopyAsyncWait<kStages - 2>();  // this thread's copies of `tile`
    __syncthreads();               // everyone's copies of `tile`; step i - 1 is done
    if (have) {
      const uint64_t ahead = uint64_t(tile) + uint64_t(kStages - 1) * gridDim.x;
      if (ahead < tiles) load(uint32_t(ahead), (stage + kStages - 1) % kStages);
    }
    CopyAsyncCommit();

    if (have_prev) {
      const int prev_buf = buf ^ 1;
      // 1. colwise of tile i - 1: thread -> 8 rows x 4 columns; the 8 lanes of a column
      //    write 64 contiguous bytes of its colwise row, 8 each.
      if (colwise != nullptr) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        const int chunk = warp % 8;                                  // 16 columns per warp
        const int row8 = (warp / 8) * 64 + (lane % 8) * kTransposeRows;
        const int col4 = chunk * 16 + (lane / 8) * kTransposeCols;
        const uint8_t* src = codes + prev_buf * Shape::kCodesBytes + row8 * kTileCols +
                             CodesSlot(row8, chunk) * 16 + (lane / 8) * 4;
        uint32_t w[kTransposeRows];
#pragma unroll
        for (int k = 0; k < kTransposeRows; ++k) w[k] = *reinterpret_cast<const uint32_t*>(src + k * kTileCols);
        uint32_t lo[4], hi[4];  // column j: rows row8..+3 in lo[j], row8+4..+7 in hi[j]
        Transpose4x4Bytes(w[0], w[1], w[2], w[3], lo);
        Transpose4x4Bytes(w[4], w[5], w[6], w[7], hi);
        // The tile's colwise rows (one per column), from byte r0 on; where the tile is whole
        // and they are 8-byte aligned, plain 8-byte stores (the same for every thread).
        const TileRows cw = place.ColsOf(colwise, prev.c0, prev.r0, rows);
        const bool whole = prev.rows_left == kRows &&
                           ((reinterpret_cast<uintptr_t>(cw.base) | uintptr_t(cw.pitch)) & 7) == 0;
        if (row8 < prev.rows_left) {
#pragma unroll
          for (int j = 0; j < kTransposeCols; ++j) {  // colwise row c0 + col4 + j, from row r0 + row8
            if (col4 + j < prev.cols_left) {
              uint8_t* dst = cw.base + (col4 + j) * cw.pitch + row8;
              if (whole) {
                *reinterpret_cast<uint2*>(dst) = make_uint2(lo[j], hi[j]);
              } else {
                StoreCodes8(dst, lo[j], hi[j], prev.rows_left - row8);
              }
            }
          }
        }
      }
      // 2. dbias of tile i - 1: the row groups' column sums, added in group order.
      if (partials != nullptr && threadIdx.x < kTileCols) {
        const float* part = col_partial + prev_buf * Shape::kDbiasGroups * kTileCols;
        float s = 0.0f;
#pragma unroll
        for (int g = 0; g < Shape::kDbiasGroups; ++g) s += part[g * kTileCols + threadIdx.x];
        if (int(threadIdx.x) < prev.cols_left) partials[prev.r0 / kRows * cols + prev.c0 + threadIdx.x] = s;
      }
    }
    if (!have) break;

    const TileOrigin cur = tile_at(tile);
    const uint8_t* in = input + stage * Shape::kInputBytes;
    uint8_t* tile_codes = codes + buf * Shape::kCodesBytes;

    // 3. Encode tile i: thread -> 16 consecutive values of rows t / 8 and t / 8 + kRows / 2;
    //    amax, rowwise codes (16-byte stores), codes into shared memory for step i + 1.
    const int enc_chunk = threadIdx.x % kEncodeThreadsPerRow;
    // The tile's rowwise rows; plain 16-byte stores where the tile is whole and they are aligned.
    const TileRows rw = rowwise != nullptr ? place.RowsOf(rowwise, cur.r0, cur.c0, cols) : TileRows{nullptr, 0, 0};
    const bool rw_whole = cur.cols_left == kTileCols &&
                          ((reinterpret_cast<uintptr_t>(rw.base) | uintptr_t(rw.pitch)) & 15) == 0;
#pragma unroll 1
    for (int p = 0; p < 2; ++p) {
      const int local_row = p * Shape::kEncodeRowsPerPass + threadIdx.x / kEncodeThreadsPerRow;
      float v[kEncodeCols];
#pragma unroll
      for (int i = 0; i < Shape::kChunksPerEncode; ++i) {
        const int chunk = enc_chunk * Shape::kChunksPerEncode + i;
        const uint4 packed = *reinterpret_cast<const uint4*>(in + local_row * Shape::kRowBytes + InputSlot(chunk) * 16);
        T vals[Shape::kVec];
        memcpy(vals, &packed, sizeof(packed));
#pragma unroll
        for (int e = 0; e < Shape::kVec; ++e) v[i * Shape::kVec + e] = LoadAsFloat(Tag{}, vals[e]);
      }
      uint32_t chunk_max = 0;
#pragma unroll
      for (int j = 0; j < kEncodeCols; ++j) chunk_max = max(chunk_max, AbsBitsOf(v[j]));
      float row_scale = scale;
      bool row_ok = scale_ok;
      int row_group = 0;  // grouped: the row's group, -1 for a padding row (zero codes)
      if constexpr (Groups::kGrouped) {
        row_group = groups.GroupOf(smem + Shape::kSmemBytes, cursor, cur.r0 + local_row);
        row_scale = groups.ScaleOf(smem + Shape::kSmemBytes, row_group);
        row_ok = ScaleKeepsFinite(row_scale);
        groups.AddAmax(smem + Shape::kSmemBytes, row_group, chunk_max);  // all lanes of the warp
      } else {
        best = max(best, chunk_max);
      }
      uint32_t words[kEncodeCols / 4];
      if (kHasCvtFp8x2 && row_ok && chunk_max <= 0x7F800000u) {
        EncodeChunk(Fmt{}, v, row_scale, true, words);
      } else {
        EncodeStepFromShared<Tag>(Fmt{}, in + local_row * Shape::kRowBytes, enc_chunk, row_scale, words);
      }
      if constexpr (Groups::kGrouped) {
        if (row_group < 0) words[0] = words[1] = words[2] = words[3] = 0;
      }
      if (rowwise != nullptr && local_row < cur.rows_left) {
        // Two store sites: folding them into one (the address chosen first) cost the kernels
        // 2-2.5% more instructions at the same times (Nsight Compute, H200, 2026-11-28).
        if (local_row < rw.limit) {
          uint8_t* dst = rw.base + local_row * rw.pitch + enc_chunk * kEncodeCols;
          if (rw_whole) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
          } else {
            StoreCodes16(dst, words, cur.cols_left - enc_chunk * kEncodeCols);
          }
        } else {  // past a placement's row segment: the first row of its own RowsOf
          StoreCodes16(place.RowsOf(rowwise, cur.r0 + local_row, cur.c0, cols).base + enc_chunk * kEncodeCols, words,
                       cur.cols_left - enc_chunk * kEncodeCols);
        }
      }
      if (colwise != nullptr) {
        *reinterpret_cast<uint4*>(tile_codes + local_row * kTileCols + CodesSlot(local_row, enc_chunk) * 16) =
            make_uint4(words[0], words[1], words[2], words[3]);
      }
    }

    // 4. dbias of tile i: thread -> one 4-byte word column over a group of rows, summed in
    //    row order into this step's partial buffer (added up in step i + 1).
    if (partials != nullptr) {
      constexpr int kE = Shape::kElemsPerWord;
      const int word = threadIdx.x % Shape::kDbiasWordsPerRow, group = threadIdx.x / Shape::kDbiasWordsPerRow;
      const uint8_t* at = in + group * Shape::kDbiasRowsPerGroup * Shape::kRowBytes + InputSlot(word / 4) * 16 +
                          (word % 4) * 4;
      float sum[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) sum[e] = 0.0f;
#pragma unroll 8
      for (int k = 0; k < Shape::kDbiasRowsPerGroup; ++k) {
        const uint32_t bits = *reinterpret_cast<const uint32_t*>(at + k * Shape::kRowBytes);
        T vals[kE];
        memcpy(vals, &bits, sizeof(bits));
#pragma unroll
        for (int e = 0; e < kE; ++e) sum[e] += LoadAsFloat(Tag{}, vals[e]);
      }
      // Flat index group * 128 + word * kE = threadIdx.x * kE.
      float* dst = col_partial + buf * Shape::kDbiasGroups * kTileCols + threadIdx.x * kE;
      if constexpr (kE == 2) {
        *reinterpret_cast<float2*>(dst) = make_float2(sum[0], sum[1]);
      } else {
        dst[0] = sum[0];
      }
    }
    prev = cur;
    have_prev = true;
    stage = (stage + 1) % kStages;
    buf ^= 1;
  }
  if constexpr (Groups::kGrouped) {
    groups.Flush(smem + Shape::kSmemBytes);
  } else {
    best = BlockMaxU32(best);
    if (threadIdx.x == 0 && best != 0) atomicMax(amax, best);
  }
}

}  // namespace
}  // namespace lowbit
