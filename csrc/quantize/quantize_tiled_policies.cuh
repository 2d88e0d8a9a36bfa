// The per-tensor `Groups` (OneTensor) and the `Place`s (TileRows, DensePlace, SlicedPlace) of
// the tiled FP8 quantize kernel; quantize_tiled.cuh describes both hooks and includes this
// with the rest of the kernel. Private to the including translation unit (an anonymous
// namespace, as when this code lived in quantize_tiled.cuh).
#pragma once

#include <cstdint>

#include "common/fast_div.h"
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

}  // namespace
}  // namespace lowbit
