// CPU reference for grouped block quantization (quantize_grouped_block.h): the ungrouped
// references (QuantizeMxfp8Ref, QuantizeFp8BlockRef) run on each group's rows alone, their
// outputs placed into the grouped layouts; the whole-x rowwise copy of MXFP8 / FP8 1x128 by
// one ungrouped call. Tail codes of the group-bound copies and unused scale entries are 0.
#include <algorithm>
#include <cstring>
#include <vector>

#include "quantize/quantize_grouped_block.h"

namespace lowbit {
namespace {

int64_t ElementBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Scatters a group's transposed copy (cols x n, contiguous) into columns [start, start + n)
// of the cols x rows matrix.
void PlaceTransposed(const std::vector<uint8_t>& part, int64_t cols, int64_t n, int64_t rows, int64_t start,
                     uint8_t* out) {
  for (int64_t c = 0; c < cols; ++c) std::memcpy(out + c * rows + start, part.data() + c * n, size_t(n));
}

}  // namespace

Status QuantizeGroupedBlockRef(const QuantizeGroupedBlockArgs& a) {
  LOWBIT_RETURN_IF_ERROR(CheckQuantizeGroupedBlockArgs(a));
  if (!IsHighPrecision(a.x_dtype)) {
    return Status::InvalidArgument("lowbit_quantize_grouped_block: x: expected f32, f16 or bf16");
  }
  const int64_t rows = a.rows, cols = a.cols, G = a.groups;
  const bool mx = a.kind == GroupedBlockKind::kMxfp8;
  const bool tile_2d = a.kind == GroupedBlockKind::kFp8Block128x128;
  const auto* x = static_cast<const uint8_t*>(a.x);
  const int64_t row_bytes = cols * ElementBytes(a.x_dtype);

  // The copies that do not depend on the groups: one ungrouped call over the whole x.
  if (a.rowwise != nullptr && !tile_2d) {
    if (mx) {
      QuantizeMxfp8Args u;
      u.x = a.x, u.x_dtype = a.x_dtype, u.rows = rows, u.cols = cols, u.out_dtype = a.out_dtype;
      u.rowwise = a.rowwise, u.rowwise_scale = static_cast<uint8_t*>(a.rowwise_scale);
      LOWBIT_RETURN_IF_ERROR(QuantizeMxfp8Ref(u));
    } else {
      QuantizeFp8BlockArgs u;
      u.x = a.x, u.x_dtype = a.x_dtype, u.rows = rows, u.cols = cols, u.out_dtype = a.out_dtype;
      u.pow2_scales = a.pow2_scales;
      u.rowwise = a.rowwise, u.rowwise_scale_inv = static_cast<float*>(a.rowwise_scale);
      LOWBIT_RETURN_IF_ERROR(QuantizeFp8BlockRef(u));
    }
  }
  // Group-bound copies start as zeros (tail codes, unused scale entries).
  if (a.colwise_scale != nullptr) {
    const ScaleDims d = mx ? GroupedMxfp8ColScaleDims(rows, cols, G) : GroupedFp8BlockColScaleDims(rows, cols, G, tile_2d);
    std::memset(a.colwise_scale, 0, size_t(d.size()) * (mx ? 1 : sizeof(float)));
  }
  if (tile_2d && a.rowwise_scale != nullptr) {
    std::memset(a.rowwise_scale, 0, size_t(GroupedFp8Block2dRowScaleDims(rows, cols, G).size()) * sizeof(float));
  }
  const bool group_rowwise = a.rowwise != nullptr && tile_2d;
  if (a.colwise == nullptr && !group_rowwise) return Status::Ok();  // also: x is empty
  if (a.colwise != nullptr) std::memset(a.colwise, 0, size_t(rows * cols));
  if (group_rowwise) std::memset(a.rowwise, 0, size_t(rows * cols));

  int64_t start = 0, mx_scale_row = 0, tile_row = 0, col2d_col = 0;
  std::vector<uint8_t> part;
  std::vector<float> part_scale;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t end = GroupEndRow(a.group_sizes, g, start, rows, a.rows_per_unit);
    const int64_t n = end - start;
    if (n > 0) {
      const void* xg = x + start * row_bytes;
      if (mx) {  // colwise only here: data in x's layout, scales contiguous per group
        QuantizeMxfp8Args u;
        u.x = xg, u.x_dtype = a.x_dtype, u.rows = n, u.cols = cols, u.out_dtype = a.out_dtype;
        u.colwise = a.colwise + start * cols;
        u.colwise_scale = static_cast<uint8_t*>(a.colwise_scale) + mx_scale_row * RoundUpI64(cols, 128);
        LOWBIT_RETURN_IF_ERROR(QuantizeMxfp8Ref(u));
      } else {
        QuantizeFp8BlockArgs u;
        u.x = xg, u.x_dtype = a.x_dtype, u.rows = n, u.cols = cols, u.out_dtype = a.out_dtype;
        u.tile_2d = tile_2d, u.pow2_scales = a.pow2_scales;
        if (group_rowwise) {  // rows in place; scales contiguous per group
          u.rowwise = a.rowwise + start * cols;
          u.rowwise_scale_inv = static_cast<float*>(a.rowwise_scale) +
                                tile_row * GroupedFp8Block2dRowScaleDims(rows, cols, G).dim1;
        }
        const ScaleDims pd = Fp8BlockScaleDims(cols, n, tile_2d);
        if (a.colwise != nullptr) {
          part.assign(size_t(n * cols), 0);
          u.colwise = part.data();
          if (tile_2d) {
            part_scale.assign(size_t(pd.size()), 0.0f);
            u.colwise_scale_inv = part_scale.data();
          } else {  // 1x128: contiguous per group
            u.colwise_scale_inv = static_cast<float*>(a.colwise_scale) + tile_row * pd.dim1;
          }
        }
        LOWBIT_RETURN_IF_ERROR(QuantizeFp8BlockRef(u));
        if (a.colwise != nullptr) {
          PlaceTransposed(part, cols, n, rows, start, a.colwise);
          if (tile_2d) {  // group g's columns of the ceil(cols/128) x W matrix
            const ScaleDims d = GroupedFp8BlockColScaleDims(rows, cols, G, true);
            for (int64_t i = 0; i < pd.dim0; ++i) {
              std::memcpy(static_cast<float*>(a.colwise_scale) + i * d.dim1 + col2d_col,
                          part_scale.data() + i * pd.dim1, size_t(pd.dim1) * sizeof(float));
            }
          }
        }
      }
    }
    mx_scale_row += RoundUpI64(CeilDivI64(n, kMxfp8BlockLen), 4);
    tile_row += CeilDivI64(n, kFp8BlockLen);
    col2d_col += RoundUpI64(CeilDivI64(n, kFp8BlockLen), 4);
    start = end;
  }
  return Status::Ok();
}

}  // namespace lowbit
