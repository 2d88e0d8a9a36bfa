// The tiles of the tiled FP8 quantize kernel (quantize_tiled_kernel.cuh, which describes its
// pipeline): constants, TileShape (threads and shared-memory layout), the shared-memory
// swizzles, code stores, the tile load, the codec encode step and the tile order (TileAt).
// Part of quantize_tiled.cuh; private to the including translation unit (an anonymous
// namespace, as when this code lived in quantize_tiled.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/cp_async.cuh"
#include "common/element.h"
#include "common/fast_div.h"
#include "quantize/fp8_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize.h"

namespace lowbit {
namespace {

constexpr const char* kTileVariantEnv = kQuantizeTileVariantEnv;
constexpr int kTileCols = int(kQuantizeTileCols);

// Hardware FP8 conversion (CvtPair, sm_89+) and the vector helpers: quantize/fp8_cvt.cuh.
constexpr bool kHasCvtFp8x2 = LOWBIT_HAS_CVT_FP8X2;

constexpr int kEncodeCols = 16;                                  // values per encode step: 16 codes
constexpr int kEncodeThreadsPerRow = kTileCols / kEncodeCols;    // 8
constexpr int kTransposeRows = 8;                                // colwise: 8 rows x 4 columns
constexpr int kTransposeCols = 4;                                //   per thread, 8-byte stores
constexpr int kMaxRegisters = 64;                                // per thread (launch bounds)

template <typename T, int kRows, int kStages>
struct TileShape {
  static constexpr int kThreads = 4 * kRows;                      // 256 or 512
  static constexpr int kVec = 16 / int(sizeof(T));                // elements per 16-byte chunk
  static constexpr int kRowBytes = kTileCols * int(sizeof(T));    // a multiple of 128: bank 0
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kLoadsPerThread = kRows * kChunksPerRow / kThreads;
  static constexpr int kChunksPerEncode = kEncodeCols / kVec;     // = sizeof(T)
  static constexpr int kEncodeRowsPerPass = kThreads / kEncodeThreadsPerRow;  // kRows / 2
  static constexpr int kElemsPerWord = 4 / int(sizeof(T));
  static constexpr int kDbiasWordsPerRow = kRowBytes / 4;        // 64 or 128
  static constexpr int kDbiasGroups = kThreads / kDbiasWordsPerRow;
  static constexpr int kDbiasRowsPerGroup = kRows / kDbiasGroups;  // 16 (16-bit x) or 32 (f32)
  static constexpr int kInputBytes = kRows * kRowBytes;
  static constexpr int kCodesBytes = kRows * kTileCols;
  static constexpr int kPartialBytes = kDbiasGroups * kTileCols * int(sizeof(float));
  static constexpr int kCodesOffset = kStages * kInputBytes;
  static constexpr int kPartialOffset = kCodesOffset + 2 * kCodesBytes;
  static constexpr int kSmemBytes = kPartialOffset + 2 * kPartialBytes;
  static constexpr int kMinBlocks = 65536 / (kThreads * kMaxRegisters);
  static_assert(kStages >= 2, "the one-barrier pipeline needs a stage being filled and one being read");
  static_assert(kRows * kTileCols == kThreads * kTransposeRows * kTransposeCols, "transpose: 32 codes per thread");
  static_assert(kRows % 64 == 0 && kEncodeRowsPerPass * 2 == kRows, "encode: two passes");
  static_assert(kDbiasGroups * kDbiasWordsPerRow == kThreads, "dbias: whole rows per group");
};

// Input chunk j of a row is kept at 16-byte slot j ^ ((j / 8) % 8). An encode step reads
// chunks k * n + i (lane k = 0..7 of a quarter warp, n = 2 or 4): without the swizzle
// those share 16-byte bank groups 2 or 4 ways; with it the 8 lanes hit 8 distinct groups.
// A run of 8 aligned chunks stays a permutation of itself, so the 16-byte copies into
// shared memory and the 4-byte dbias reads (32 consecutive words) are conflict-free too.
__device__ __forceinline__ int InputSlot(int chunk) { return chunk ^ ((chunk >> 3) & 7); }

// Codes chunk j (16 codes) of tile row r is kept at slot j ^ ((r / 8) % 8). A transpose
// load reads word w (0..3) of chunk j from rows 8 * b + k (b = 0..7, lane = 8 * w + b): the
// XOR gives the 8 row blocks 8 distinct slots, so the 32 lanes hit 32 banks. The encode's
// 16-byte writes (8 lanes: one row, chunks 0..7) stay a permutation of one row.
__device__ __forceinline__ int CodesSlot(int row, int chunk) { return chunk ^ ((row >> 3) & 7); }

// Stores 16 codes (`words`, little-endian) at dst, of which the first `valid` are in range:
// one 16-byte store where dst allows it, else 8-, 4- or 1-byte stores.
__device__ __forceinline__ void StoreCodes16(uint8_t* dst, const uint32_t (&words)[4], int valid) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(dst);
  if (valid >= 16) {
    if (at % 16 == 0) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
      return;
    }
    if (at % 8 == 0) {
      reinterpret_cast<uint2*>(dst)[0] = make_uint2(words[0], words[1]);
      reinterpret_cast<uint2*>(dst)[1] = make_uint2(words[2], words[3]);
      return;
    }
    if (at % 4 == 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) reinterpret_cast<uint32_t*>(dst)[k] = words[k];
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (j < valid) dst[j] = CodeOf(words, j);
  }
}

// The same for 8 codes: one 8-byte store where dst allows it, else 4- or 1-byte stores.
__device__ __forceinline__ void StoreCodes8(uint8_t* dst, uint32_t lo, uint32_t hi, int valid) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(dst);
  if (valid >= 8) {
    if (at % 8 == 0) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
      return;
    }
    if (at % 4 == 0) {
      reinterpret_cast<uint32_t*>(dst)[0] = lo;
      reinterpret_cast<uint32_t*>(dst)[1] = hi;
      return;
    }
  }
  const uint32_t words[2] = {lo, hi};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < valid) dst[j] = CodeOf(words, j);
  }
}

// Copies the tile starting at x_tile (row pitch `cols`; rows_left x cols_left of it lie
// inside x) into `dst`, zeros elsewhere. kVectorIO: 16-byte cp.async chunks; otherwise
// element loads (unaligned x or cols % kVec != 0), stored synchronously.
template <typename T, int kRows, int kStages, bool kVectorIO>
__device__ __forceinline__ void LoadTile(const T* __restrict__ x_tile, int64_t cols, int rows_left, int cols_left,
                                         uint8_t* dst) {
  using Shape = TileShape<T, kRows, kStages>;
  constexpr int kRowsPerLoad = Shape::kThreads / Shape::kChunksPerRow;
  // Consecutive threads copy consecutive chunks; every step moves kRowsPerLoad rows down,
  // so a thread keeps one column and one swizzled slot.
  const int chunk = threadIdx.x % Shape::kChunksPerRow, col = chunk * Shape::kVec;
  const int row0 = threadIdx.x / Shape::kChunksPerRow;
  const T* src = x_tile + row0 * cols + col;
  uint8_t* slot = dst + row0 * Shape::kRowBytes + InputSlot(chunk) * 16;
#pragma unroll
  for (int s = 0; s < Shape::kLoadsPerThread; ++s) {
    const int row = row0 + s * kRowsPerLoad;
    uint8_t* to = slot + s * kRowsPerLoad * Shape::kRowBytes;
    const T* from = src + s * kRowsPerLoad * cols;
    if constexpr (kVectorIO) {
      if (row < rows_left && col < cols_left) {
        CopyAsync16(to, from);
      } else {
        *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
      }
    } else {
      T vals[Shape::kVec];
#pragma unroll
      for (int e = 0; e < Shape::kVec; ++e) vals[e] = (row < rows_left && col + e < cols_left) ? from[e] : T(0);
      uint4 packed;
      memcpy(&packed, vals, sizeof(packed));
      *reinterpret_cast<uint4*>(to) = packed;
    }
  }
}

// The codec path of EncodeChunk for one encode step (16 values of a tile row held in
// shared memory at `row`, chunks enc_chunk * n ..): 4 values at a time, re-read from
// shared memory, so the 16 inline codecs do not keep 16 values live (the fast path's
// registers would otherwise spill). Rare: only chunks that may produce a NaN get here.
template <typename Tag, typename Fmt>
__device__ __forceinline__ void EncodeStepFromShared(Fmt fmt, const uint8_t* row, int enc_chunk, float scale,
                                                     uint32_t (&words)[kEncodeCols / 4]) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  constexpr int kChunksPerEncode = kEncodeCols / kVec;
#pragma unroll 1
  for (int g = 0; g < kEncodeCols / 4; ++g) {
    const int elem = 4 * g;  // first of the 4 values; they share one 16-byte chunk
    const int chunk = enc_chunk * kChunksPerEncode + elem / kVec;
    const uint8_t* at = row + InputSlot(chunk) * 16 + (elem % kVec) * int(sizeof(T));
    T vals[4];
    memcpy(vals, at, sizeof(vals));
    uint8_t q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = EncodeScaled(fmt, LoadAsFloat(Tag{}, vals[j]), scale);
    // Shift the words down so that after the loop words[g] holds group g (no indexing).
    words[0] = words[1];
    words[1] = words[2];
    words[2] = words[3];
    words[3] = PackCodes4(q[0], q[1], q[2], q[3]);
  }
}

// Where a tile lies: its first row and column, and how many of its rows and columns lie
// inside x.
struct TileOrigin {
  int64_t r0 = 0, c0 = 0;
  int rows_left = 0, cols_left = 0;
};

// Tile t's position. band == 0: row-major over tiles (consecutive tiles share tile rows).
// band > 0: bands of `band` tile rows, column-major inside a band, so the tiles in flight
// at one time cover `band` tile rows x (blocks / band) tile columns: longer contiguous
// colwise segments (band * kRows bytes per colwise row), shorter rowwise ones.
// by_cols: division by tiles_c (the default order's one division per tile, as a multiply).
template <int kRows>
__device__ __forceinline__ TileOrigin TileAt(uint32_t t, uint32_t tiles_r, uint32_t tiles_c, const FastDivU32& by_cols,
                                             uint32_t band, int64_t rows, int64_t cols) {
  uint32_t tr, tc;
  if (band == 0) {
    tr = by_cols.Div(t);
    tc = t - tr * tiles_c;
  } else {
    const uint32_t b = t / (band * tiles_c), local = t - b * band * tiles_c;
    const uint32_t height = min(band, tiles_r - b * band);
    tr = b * band + local % height;
    tc = local / height;
  }
  TileOrigin o;
  o.r0 = int64_t(tr) * kRows;
  o.c0 = int64_t(tc) * kTileCols;
  o.rows_left = int(min(rows - o.r0, int64_t(kRows)));
  o.cols_left = int(min(cols - o.c0, int64_t(kTileCols)));
  return o;
}

}  // namespace
}  // namespace lowbit
