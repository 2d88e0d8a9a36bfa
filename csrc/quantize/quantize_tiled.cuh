// The tiled FP8 per-tensor cast-transpose kernel of quantize_fp8.cu, shared with the grouped
// quantizer (quantize_grouped.cu): one resident wave of blocks loops over tiles of 64, 128
// or 256 rows x 128 columns, staged through shared memory with cp.async; each tile is
// encoded (amax, rowwise codes) and, one step later, transposed (colwise codes) and summed
// (dbias). Layouts, numerics and the tile variants: quantize.h; the kernel's pipeline and
// shared-memory swizzles are described where they are defined below.
//
// `Groups` is how rows get their scale and where their amax goes:
//   OneTensor  one scale (scale_ptr) for all rows, one amax (quantize_fp8.cu);
//   GroupTable (quantize_grouped.cu) a per-group table kept in SmemBytes() bytes of shared
//              memory after the tiles: Load (before the loop), GroupOf / ScaleOf / AddAmax
//              per encoded row, Flush (after the loop).
// With OneTensor every `if constexpr (Groups::kGrouped)` branch drops out, so the per-tensor
// kernels are the code they were before the grouping hooks existed.
//
// `Place` is where the copies' rows go: DensePlace the layouts of quantize.h (every caller
// but one), SlicedPlace an Fp8CopyPlacement (lowbit_dense_backward_fp8).
//
// Private to those two .cu files: everything is in an anonymous namespace, as it was when
// it lived in quantize_fp8.cu (each file instantiates its own kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/cp_async.cuh"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/fast_div.h"
#include "common/reduce.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize.h"

namespace lowbit {
namespace {

// The per-tensor `Groups`: no table, no per-row state.
struct OneTensor {
  static constexpr bool kGrouped = false;
  struct Cursor {};
  int SmemBytes() const { return 0; }
};

// Where one tile's rows of a copy go: tile row i (0-based) at base + i * pitch while i < limit;
// a row at or past limit (a tile that crosses a placement's row segment) is the first row of
// its own RowsOf.
// Computed once per tile, so that a row's address is one multiply-add: the per-row (and
// per-column) divisions this replaced cost the placed dy quantize of the seed Dense a fifth of
// its instructions (~200 of ~960 per warp and tile, Nsight Compute on an H200, 2026-11-28).
struct TileRows {
  uint8_t* base;
  int64_t pitch;
  int64_t limit;
};

// Rowwise row r and colwise row c of the dense layouts (rows x cols and cols x rows).
struct DensePlace {
  // Rowwise rows of the tile at (r0, c0), from its column c0 on.
  __device__ __forceinline__ TileRows RowsOf(uint8_t* rowwise, int64_t r0, int64_t c0, int64_t cols) const {
    return {rowwise + r0 * cols + c0, cols, INT64_MAX};
  }
  // Colwise rows c0 .. c0 + 127 (the tile's columns), from their byte r0 on.
  __device__ __forceinline__ TileRows ColsOf(uint8_t* colwise, int64_t c0, int64_t r0, int64_t rows) const {
    return {colwise + c0 * rows + r0, rows, INT64_MAX};
  }
};

// The rows where an Fp8CopyPlacement puts them (quantize.h; 32-bit index arithmetic, the
// divisions by the segment and slice heights as FastDivU32, built on the host). The
// launcher checks that slice_rows is a multiple of the tile width, so a tile's 128 colwise
// rows lie in one slice.
struct SlicedPlace {
  Fp8CopyPlacement p;
  FastDivU32 segment_of, slice_of;  // by p.row_segment_rows, by p.slice_rows

  explicit SlicedPlace(const Fp8CopyPlacement& placement)
      : p(placement), segment_of(uint32_t(placement.row_segment_rows)), slice_of(uint32_t(placement.slice_rows)) {}

  __device__ __forceinline__ TileRows RowsOf(uint8_t* rowwise, int64_t r0, int64_t c0, int64_t) const {
    const uint32_t seg = segment_of.Div(uint32_t(r0));
    const int64_t first = r0 - int64_t(seg) * p.row_segment_rows;  // r0's row inside its segment
    return {rowwise + first * p.row_pitch + int64_t(seg) * p.row_segment_stride + c0, p.row_pitch,
            p.row_segment_rows - first};
  }
  __device__ __forceinline__ TileRows ColsOf(uint8_t*, int64_t c0, int64_t r0, int64_t) const {
    const uint32_t slice = slice_of.Div(uint32_t(c0));
    const int64_t pitch = p.slice_pitch[slice];
    return {p.slice_base[slice] + (c0 - int64_t(slice) * p.slice_rows) * pitch + r0, pitch, INT64_MAX};
  }
};

constexpr const char* kTileVariantEnv = kQuantizeTileVariantEnv;
constexpr int kTileCols = int(kQuantizeTileCols);

// Hardware FP8 conversion (CvtPair, sm_89+) and the vector helpers: quantize/fp8_cvt.cuh.
constexpr bool kHasCvtFp8x2 = LOWBIT_HAS_CVT_FP8X2;

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

// The tiled kernel's tuning knobs (quantize.h, LOWBIT_QUANTIZE_TILE_VARIANT).
struct TileVariant {
  int rows = 256;   // tile height: 64, 128 or 256 (the default; 4 threads per tile row)
  int stages = 2;   // input stages: 2 or 3
  int band = 0;     // 0: row-major tile order; else bands of `band` tile rows
};

Status ParseTileVariant(const char* op, TileVariant* v) {
  const char* env = std::getenv(kTileVariantEnv);
  if (env == nullptr || *env == '\0') return Status::Ok();
  int rows = 0, stages = 0, band = 0, used = 0;
  const int n = std::sscanf(env, "r%ds%d%n", &rows, &stages, &used);
  bool ok = n == 2 && ((rows == 64 && (stages == 2 || stages == 3)) || ((rows == 128 || rows == 256) && stages == 2));
  if (ok && env[used] == 'b') {
    int more = 0;
    ok = std::sscanf(env + used, "b%d%n", &band, &more) == 1 && band >= 1 && band <= 4096;
    used += more;
  }
  ok = ok && env[used] == '\0';
  if (!ok) {
    return Status::InvalidArgument(std::string(op) + ": " + kTileVariantEnv + "=\"" + env +
                                   "\": expected r64s2, r64s3, r128s2 or r256s2, optionally followed by b<1..4096>");
  }
  v->rows = rows;
  v->stages = stages;
  v->band = band;
  return Status::Ok();
}

template <typename Tag, typename Fmt, bool kVectorIO, int kRows, int kStages, typename Groups, typename Place>
Status LaunchTiled(const char* op, const QuantizeFp8Args& a, float* partials, const Groups& groups,
                   const Place& place, const TileVariant& v, GpuStream stream, int* tile_rows) {
  *tile_rows = kRows;
  using T = typename Tag::Storage;
  using Shape = TileShape<T, kRows, kStages>;
  auto kernel = QuantizeTiledKernel<Tag, Fmt, kVectorIO, kRows, kStages, Groups, Place>;
  const int smem_bytes = Shape::kSmemBytes + groups.SmemBytes();
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                         smem_bytes),
                                    op, "cudaFuncSetAttribute"));
  // One resident wave: every block loops over tiles, so blocks beyond what fits would
  // only start late. The occupancy query is host-side arithmetic (no device sync).
  int per_sm = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Shape::kThreads,
                                                                                  smem_bytes),
                                    op, "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
  const int64_t tiles = (a.rows + kRows - 1) / kRows * ((a.cols + kTileCols - 1) / kTileCols);
  const int blocks = GridStrideBlocks(tiles * Shape::kThreads, Shape::kThreads, per_sm > 0 ? per_sm : 1);
  kernel<<<blocks, Shape::kThreads, smem_bytes, stream>>>(
      static_cast<const T*>(a.x), a.rows, a.cols, a.scale, a.rowwise, a.colwise,
      reinterpret_cast<uint32_t*>(a.amax), partials, uint32_t(v.band), groups, place);
  return LaunchStatus(op);
}

// Picks the instantiation for the variant. f32 x always takes 64-row tiles and two stages
// (its 32 KB stages would leave one block per SM otherwise); where this device grants a
// block less shared memory than the variant needs (r256s2: 208 KB), 256 rows fall back to
// 128 and anything else to r64s2.
template <typename Tag, typename Fmt, bool kVectorIO, typename Groups, typename Place = DensePlace>
Status LaunchTiledVariant(const char* op, const QuantizeFp8Args& a, float* partials, const Groups& groups,
                          const TileVariant& v, GpuStream stream, int* tile_rows, const Place& place = Place{}) {
  using T = typename Tag::Storage;
  if constexpr (sizeof(T) == 4) {
    return LaunchTiled<Tag, Fmt, kVectorIO, 64, 2>(op, a, partials, groups, place, v, stream, tile_rows);
  } else {
    int device = 0, optin = 0;
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), op, "cudaGetDevice"));
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                                      op, "cudaDeviceGetAttribute"));
    if (v.rows == 256 && TileShape<T, 256, 2>::kSmemBytes + groups.SmemBytes() <= optin) {
      return LaunchTiled<Tag, Fmt, kVectorIO, 256, 2>(op, a, partials, groups, place, v, stream, tile_rows);
    }
    if (v.rows >= 128 && TileShape<T, 128, 2>::kSmemBytes + groups.SmemBytes() <= optin) {
      return LaunchTiled<Tag, Fmt, kVectorIO, 128, 2>(op, a, partials, groups, place, v, stream, tile_rows);
    }
    if (v.rows == 64 && v.stages == 3 && TileShape<T, 64, 3>::kSmemBytes + groups.SmemBytes() <= optin) {
      return LaunchTiled<Tag, Fmt, kVectorIO, 64, 3>(op, a, partials, groups, place, v, stream, tile_rows);
    }
    return LaunchTiled<Tag, Fmt, kVectorIO, 64, 2>(op, a, partials, groups, place, v, stream, tile_rows);
  }
}
}  // namespace
}  // namespace lowbit
