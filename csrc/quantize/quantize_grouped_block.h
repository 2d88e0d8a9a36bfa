// Grouped block quantization (MoE): G tensors stacked along the rows of one high-precision
// matrix, each block-quantized as its own tensor: MXFP8 (quantize_mxfp8.h) or FP8 block
// 1x128 / 128x128 (quantize_block.h), rowwise and/or colwise.
//
// Groups: x is rows x cols, row-major, f32/f16/bf16; group_sizes holds G int32 values in
// units of rows_per_unit rows. Group g covers rows [start_g, end_g) with exactly the
// clipping of quantize_grouped.h (negative sizes count as 0; groups past the end of x are
// cut there), n_g = end_g - start_g. Rows [end_{G-1}, rows) are the tail (no group).
// Every block boundary of a group-bound copy starts at the group's first row, so group g's
// copies and scales equal, bit for bit, the ungrouped quantizer's of rows [start_g, end_g)
// alone. Which copies are group-bound:
//   MXFP8 and FP8 1x128: the colwise copy (its blocks run down the rows). Their rowwise
//     copy is the ungrouped quantizer's of the whole x, tail rows included (blocks lie
//     within a row: nothing depends on the groups), in the ungrouped layouts.
//   FP8 128x128: both copies (a tile spans 128 rows); tail codes are 0 in both.
// Data (no padding, nothing moves):
//   MXFP8 colwise: rows x cols (x's layout), group g = rows [start_g, end_g); tail codes 0.
//   FP8 colwise: cols x rows (the transpose), group g = columns [start_g, end_g); tail 0.
//   FP8 128x128 rowwise: rows x cols, group g = rows [start_g, end_g); tail 0.
// Scales: per group the ungrouped layout of that group (its padding included), the groups
// one after the other along one scale dim, starting at offsets computable from the sizes;
// everything after the last group is 0:
//   MXFP8 colwise (E8M0): GroupedMxfp8ColScaleDims: (roundup(ceil(rows/32), 4) + 4G) x
//     roundup(cols, 128); group g is rows [S_g, S_g + roundup(ceil(n_g/32), 4)),
//     S_g = sum_{h<g} roundup(ceil(n_h/32), 4).
//   FP8 1x128 colwise (fp32 scale_inv): (ceil(rows/128) + G) x roundup(cols, 4); group g is
//     rows [T_g, T_g + ceil(n_g/128)), T_g = sum_{h<g} ceil(n_h/128).
//   FP8 128x128 rowwise: (ceil(rows/128) + G) x roundup(ceil(cols/128), 4); group g is rows
//     [T_g, T_g + ceil(n_g/128)).
//   FP8 128x128 colwise: ceil(cols/128) x (roundup(ceil(rows/128), 4) + 4G); group g is
//     columns [U_g, U_g + roundup(ceil(n_g/128), 4)), U_g = sum_{h<g} roundup(ceil(n_h/128), 4).
//   (The extra per-group terms bound the padding: sum_g ceil(n_g/b) <= floor(rows/b) + G.)
// A GEMM reading group g in place needs start_g aligned as it requires (FP8: 16 bytes); the
// quantizer takes any sizes.
// Numerics per block: those of the ungrouped quantizers (block_codec.h).
// CUDA: the tile kernels of block_tiles.cuh with a grouped row tiling (GroupedRowTiles):
// tile t of a group-bound walk is found from the groups' tile prefix sums (FindGroup of
// quantize_grouped.h), starts at start_g + k * tile_height and masks rows at end_g.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/formats.h"
#include "common/gpu_stream.h"
#include "common/status.h"
#include "quantize/quantize_block.h"
#include "quantize/quantize_grouped.h"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {

enum class GroupedBlockKind : int32_t { kMxfp8 = 0, kFp8Block1x128 = 1, kFp8Block128x128 = 2 };

LOWBIT_HD ScaleDims GroupedMxfp8ColScaleDims(int64_t rows, int64_t cols, int64_t groups) {
  return {RoundUpI64(CeilDivI64(rows, kMxfp8BlockLen), 4) + 4 * groups, RoundUpI64(cols, 128)};
}
// The group-bound FP8 block scale matrices (see above): colwise copy, and for 128x128 also
// the rowwise one.
LOWBIT_HD ScaleDims GroupedFp8BlockColScaleDims(int64_t rows, int64_t cols, int64_t groups, bool tile_2d) {
  if (tile_2d) return {CeilDivI64(cols, kFp8BlockLen), RoundUpI64(CeilDivI64(rows, kFp8BlockLen), 4) + 4 * groups};
  return {CeilDivI64(rows, kFp8BlockLen) + groups, RoundUpI64(cols, 4)};
}
LOWBIT_HD ScaleDims GroupedFp8Block2dRowScaleDims(int64_t rows, int64_t cols, int64_t groups) {
  return {CeilDivI64(rows, kFp8BlockLen) + groups, RoundUpI64(CeilDivI64(cols, kFp8BlockLen), 4)};
}

struct QuantizeGroupedBlockArgs {
  const void* x = nullptr;
  DType x_dtype = DType::kInvalid;       // f32, f16 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  const int32_t* group_sizes = nullptr;  // groups values
  int64_t groups = 0;                    // 1 .. kMaxQuantizeGroups
  int64_t rows_per_unit = 1;             // rows per unit of group_sizes (>= 1)
  GroupedBlockKind kind = GroupedBlockKind::kMxfp8;
  bool pow2_scales = false;              // FP8 block only
  DType out_dtype = DType::kInvalid;     // kE4M3 or kE5M2
  // A copy is requested when its data (x not empty) or its scales (not empty) are given.
  uint8_t* rowwise = nullptr;            // rows x cols, or null
  void* rowwise_scale = nullptr;         // ungrouped layout (128x128: grouped), with rowwise
  uint8_t* colwise = nullptr;            // MXFP8 rows x cols, FP8 cols x rows, or null
  void* colwise_scale = nullptr;         // grouped layout (above), with colwise
};

inline Status CheckQuantizeGroupedBlockArgs(const QuantizeGroupedBlockArgs& a) {
  const std::string op = "lowbit_quantize_grouped_block: ";
  LOWBIT_RETURN_IF_ERROR(CheckGroupedShape(op, a.groups, a.rows, a.cols, a.rows_per_unit, a.group_sizes));
  if (a.kind != GroupedBlockKind::kMxfp8 && a.kind != GroupedBlockKind::kFp8Block1x128 &&
      a.kind != GroupedBlockKind::kFp8Block128x128) {
    return Status::InvalidArgument(op + "kind: expected 0 (MXFP8), 1 (FP8 1x128) or 2 (FP8 128x128), got " +
                                   std::to_string(int(a.kind)));
  }
  if (a.pow2_scales && a.kind == GroupedBlockKind::kMxfp8) {
    return Status::InvalidArgument(op + "pow2_scales: applies to the FP8 block kinds only");
  }
  if ((a.rowwise != nullptr && a.rowwise_scale == nullptr) || (a.colwise != nullptr && a.colwise_scale == nullptr)) {
    return Status::InvalidArgument(op + "rowwise, colwise: expected each copy with its scales");
  }
  if (a.rows * a.cols != 0 && a.rowwise == nullptr && a.colwise == nullptr) {
    return Status::InvalidArgument(op + "rowwise: neither rowwise nor colwise output requested");
  }
  return Status::Ok();
}

// CPU reference (quantize_grouped_block_ref.cc): the ungrouped references, per group.
Status QuantizeGroupedBlockRef(const QuantizeGroupedBlockArgs& args);

// Device workspace QuantizeGroupedBlockCuda needs: a table of G + 1 entries (the tail last).
inline int64_t QuantizeGroupedBlockWorkspaceBytes(int64_t groups) { return (groups + 1) * 5 * int64_t(sizeof(int32_t)); }

// CUDA launcher (quantize_grouped_block.cu): device pointers, enqueued on `stream`, no host
// sync. `workspace`: QuantizeGroupedBlockWorkspaceBytes(groups) bytes, 16-byte aligned.
Status QuantizeGroupedBlockCuda(const QuantizeGroupedBlockArgs& args, void* workspace, GpuStream stream);

}  // namespace lowbit
