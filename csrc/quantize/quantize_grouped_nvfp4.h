// Grouped NVFP4 quantization (MoE): G tensors stacked along the rows of one high-precision
// matrix, each quantized as its own NVFP4 tensor (quantize_nvfp4.h): every copy is
// group-bound, with its own global scale S per group and copy.
//
// Groups: x is rows x cols, row-major, f32/f16/bf16; group_sizes holds G int32 values in
// units of rows_per_unit rows (entries of x's first dim). Group g covers rows [start_g, end_g)
// with exactly the clipping of quantize_grouped.h (negative sizes count as 0; groups past the
// end of x are cut there), n_g = end_g - start_g. Rows [end_{G-1}, rows) are the tail: code 0,
// no scales.
// Contract: group g's rowwise and colwise data, block scales and global_scale_inv equal, bit
// for bit, QuantizeNvfp4Ref of rows [start_g, end_g) alone with the same options: tile_2d
// tiles, RHT 16-groups and 1x16 colwise blocks start at the group's first row (a partial last
// 16-group of a group is left as is), stochastic rounding uses the random words of those rows
// (random is rows x cols, x's own coordinates), the same RHT sign bits. An empty group gets
// global_scale_inv 1 (A = 0 gives S = 1, as the ungrouped op of an empty tensor) and nothing else.
// Layout: every array holds the groups' ungrouped arrays back to back (group 0 first), then
// zeros up to its size; so group g's copy is the ungrouped op's, in place, with the ungrouped
// leading dims (a GEMM reads it by a pointer offset; a shared leading dim across groups, e.g.
// a (cols, ~rows/2) colwise matrix with groups as byte-column ranges, would have a row pitch
// set by the other groups, not the 16-byte multiple cuBLASLt's FP4 operands need):
//   rowwise: rows x ceil(cols/2) bytes, x's rows (nothing moves); group g = rows
//     [start_g, end_g); tail 0.
//   rowwise_scale (E4M3): GroupedNvfp4RowScaleDims x roundup(ceil(cols/16), 4); group g = rows
//     [P_g, P_g + roundup(n_g, 128)), P_g = sum_{h<g} roundup(n_h, 128).
//   colwise (flat bytes): GroupedNvfp4ColBytes; group g = the cols x ceil(n_g/2) matrix at
//     byte cols * B_g, B_g = sum_{h<g} ceil(n_h/2).
//   colwise_scale (E4M3, flat): GroupedNvfp4ColScaleBytes; group g = the roundup(cols, 128) x
//     roundup(ceil(n_g/16), 4) matrix at byte roundup(cols, 128) * Q_g,
//     Q_g = sum_{h<g} roundup(ceil(n_h/16), 4).
//   rowwise / colwise_global_scale_inv: f32 (G,).
// Alignment for a GEMM reading a group in place (gemm.h's kNvfp4 operands, 16-byte pointers):
// the scale slots always are (byte offsets P_g * roundup(ceil(cols/16), 4) and
// roundup(cols, 128) * Q_g with P_g a multiple of 128, Q_g of 4); the data slots are when
// start_g * ceil(cols/2) and cols * B_g are multiples of 16 (e.g. cols % 32 == 0, or group
// sizes that are multiples of 32 rows).
// Size bounds (hold for any sizes): with b a block length and K <= min(G, rows) the number of
// non-empty groups, sum_g ceil(n_g/b) = sum_g floor((n_g + b - 1)/b) <= floor((sum_g n_g +
// (b - 1) K)/b) <= floor((rows + (b - 1) M)/b), M = min(G, rows) (floor(a) + floor(c) <=
// floor(a + c); empty groups add 0). With b = 128, 2 and 64 (roundup(ceil(n/16), 4) =
// 4 ceil(n/64)) this gives the three sizes below; for G = 1 they are the ungrouped sizes.
// CUDA: quantize_nvfp4_tile.cuh's tile code on each group's rows (see quantize_grouped_nvfp4.cu).
#pragma once

#include <cstdint>
#include <string>

#include "quantize/quantize_grouped.h"
#include "quantize/quantize_nvfp4.h"

namespace lowbit {

LOWBIT_HD int64_t GroupedNvfp4Bound(int64_t rows, int64_t groups, int64_t block) {
  const int64_t m = groups < rows ? groups : rows;
  return (rows + (block - 1) * m) / block;  // >= sum_g ceil(n_g / block)
}
LOWBIT_HD ScaleDims GroupedNvfp4RowScaleDims(int64_t rows, int64_t cols, int64_t groups) {
  return {128 * GroupedNvfp4Bound(rows, groups, 128), RoundUpI64(CeilDivI64(cols, kNvfp4BlockLen), 4)};
}
LOWBIT_HD int64_t GroupedNvfp4ColBytes(int64_t rows, int64_t cols, int64_t groups) {
  return cols * GroupedNvfp4Bound(rows, groups, 2);
}
LOWBIT_HD int64_t GroupedNvfp4ColScaleBytes(int64_t rows, int64_t cols, int64_t groups) {
  return RoundUpI64(cols, 128) * 4 * GroupedNvfp4Bound(rows, groups, 64);
}

// The CUDA kernels' tile walk (host + device, so GoogleTest checks it): tile row t of the grid
// belongs to the group whose range of 64-row tiles holds it, given the inclusive prefix sums
// tile_end[g] of ceil(n_g / 64); returns that group and sets *first_row (relative to the
// group's start), or returns -1 past the last tile. The grid walks floor(rows / 64) + G tile
// rows (>= sum_g ceil(n_g / 64), the bound above with b = 64 and K <= G).
constexpr int64_t kGroupedNvfp4TileRows = 64;
LOWBIT_HD int GroupedNvfp4TileGroup(const int32_t* tile_end, int groups, int64_t tile_row, int64_t* first_row) {
  RowRange cursor;
  const int e = FindGroup(tile_end, groups, cursor, int(tile_row));
  if (e >= 0) *first_row = (tile_row - (e > 0 ? tile_end[e - 1] : 0)) * kGroupedNvfp4TileRows;
  return e;
}

struct QuantizeGroupedNvfp4Args {
  const void* x = nullptr;
  DType x_dtype = DType::kInvalid;       // f32, f16 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  const int32_t* group_sizes = nullptr;  // groups values
  int64_t groups = 0;                    // 1 .. kMaxQuantizeGroups
  int64_t rows_per_unit = 1;             // rows per unit of group_sizes (>= 1)
  bool tile_2d = false;                  // 16x16 tiles, else 1x16
  const uint32_t* random = nullptr;      // rows x cols words, or null for RNE
  bool rht = false;                      // RHT on the colwise copy
  uint32_t rht_sign_bits = 0;            // CPU reference: bit i set: d_i = -1
  const uint32_t* rht_sign_bits_device = nullptr;  // CUDA launcher: the same word, on the device
  // A copy is requested when its global_scale_inv is given; its data and scales are empty
  // (may be null) exactly when rows * cols == 0.
  uint8_t* rowwise = nullptr;            // rows x ceil(cols/2)
  uint8_t* rowwise_scale = nullptr;      // GroupedNvfp4RowScaleDims
  float* rowwise_global_scale_inv = nullptr;  // groups values
  uint8_t* colwise = nullptr;            // GroupedNvfp4ColBytes
  uint8_t* colwise_scale = nullptr;      // GroupedNvfp4ColScaleBytes
  float* colwise_global_scale_inv = nullptr;  // groups values
};

inline Status CheckQuantizeGroupedNvfp4Args(const QuantizeGroupedNvfp4Args& a) {
  const std::string op = "lowbit_quantize_grouped_nvfp4: ";
  // The CUDA group table holds row and scale-row offsets as int32 (P_g < rows + 128 G).
  LOWBIT_RETURN_IF_ERROR(CheckGroupedShape(op, a.groups, a.rows, a.cols, a.rows_per_unit, a.group_sizes,
                                           0x7FFFFFFF - 128 * kMaxQuantizeGroups));
  if (a.rowwise_global_scale_inv == nullptr && a.colwise_global_scale_inv == nullptr) {
    return Status::InvalidArgument(op + "rowwise: neither rowwise nor colwise output requested");
  }
  const bool data = a.rows * a.cols != 0;  // else every data and scale array is empty
  if (a.rowwise_global_scale_inv != nullptr && data && (a.rowwise == nullptr || a.rowwise_scale == nullptr)) {
    return Status::InvalidArgument(op + "rowwise, rowwise_scale: expected buffers for the requested copy");
  }
  if (a.colwise_global_scale_inv != nullptr && data && (a.colwise == nullptr || a.colwise_scale == nullptr)) {
    return Status::InvalidArgument(op + "colwise, colwise_scale: expected buffers for the requested copy");
  }
  return Status::Ok();
}

// CPU reference (quantize_grouped_nvfp4_ref.cc): QuantizeNvfp4Ref per group.
Status QuantizeGroupedNvfp4Ref(const QuantizeGroupedNvfp4Args& args);

// Device workspace QuantizeGroupedNvfp4Cuda needs: a table of G + 1 entries (six int32 each)
// and two amax slots (u32) per group.
inline int64_t QuantizeGroupedNvfp4WorkspaceBytes(int64_t groups) {
  return (groups + 1) * 6 * int64_t(sizeof(int32_t)) + 2 * groups * int64_t(sizeof(uint32_t));
}

// CUDA launcher (quantize_grouped_nvfp4.cu): device pointers, enqueued on `stream`, no host
// sync (group_sizes are read on the device). `workspace`: QuantizeGroupedNvfp4WorkspaceBytes
// bytes, 16-byte aligned.
Status QuantizeGroupedNvfp4Cuda(const QuantizeGroupedNvfp4Args& args, void* workspace, GpuStream stream);

}  // namespace lowbit
