// CPU reference for grouped NVFP4 quantization (quantize_grouped_nvfp4.h): every output starts
// as zeros (tail rows, unused ends), then QuantizeNvfp4Ref runs on each group's rows alone,
// writing straight into the group's slots of the packed layout (its own data and padded scale
// arrays, its global_scale_inv entry).
#include <algorithm>
#include <cstring>

#include "quantize/quantize_grouped_nvfp4.h"

namespace lowbit {

Status QuantizeGroupedNvfp4Ref(const QuantizeGroupedNvfp4Args& a) {
  LOWBIT_RETURN_IF_ERROR(CheckQuantizeGroupedNvfp4Args(a));
  if (!IsHighPrecision(a.x_dtype)) {
    return Status::InvalidArgument("lowbit_quantize_grouped_nvfp4: x: expected f32, f16 or bf16");
  }
  const int64_t rows = a.rows, cols = a.cols, G = a.groups;
  const bool want_row = a.rowwise_global_scale_inv != nullptr, want_col = a.colwise_global_scale_inv != nullptr;
  const int64_t packed = CeilDivI64(cols, 2);
  const ScaleDims row_scale = GroupedNvfp4RowScaleDims(rows, cols, G);
  const int64_t col_scale_rows = RoundUpI64(cols, 128);
  if (rows * cols != 0) {
    if (want_row) {
      std::memset(a.rowwise, 0, size_t(rows * packed));
      std::memset(a.rowwise_scale, 0, size_t(row_scale.size()));
    }
    if (want_col) {
      std::memset(a.colwise, 0, size_t(GroupedNvfp4ColBytes(rows, cols, G)));
      std::memset(a.colwise_scale, 0, size_t(GroupedNvfp4ColScaleBytes(rows, cols, G)));
    }
  }
  const int64_t row_bytes = cols * (a.x_dtype == DType::kF32 ? 4 : 2);
  int64_t start = 0, P = 0, B = 0, Q = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t end = GroupEndRow(a.group_sizes, g, start, rows, a.rows_per_unit);
    const int64_t n = end - start;
    QuantizeNvfp4Args u;  // rows [start, end) alone; n * cols == 0 writes only the global scales
    u.x = static_cast<const uint8_t*>(a.x) + start * row_bytes;
    u.x_dtype = a.x_dtype;
    u.rows = n;
    u.cols = cols;
    u.tile_2d = a.tile_2d;
    u.random = a.random != nullptr ? a.random + start * cols : nullptr;
    u.rht = a.rht;
    u.rht_sign_bits = a.rht_sign_bits;
    const bool data = n * cols != 0;
    if (want_row) {
      u.rowwise = data ? a.rowwise + start * packed : nullptr;
      u.rowwise_scale = data ? a.rowwise_scale + P * row_scale.dim1 : nullptr;
      u.rowwise_global_scale_inv = a.rowwise_global_scale_inv + g;
    }
    if (want_col) {
      u.colwise = data ? a.colwise + cols * B : nullptr;
      u.colwise_scale = data ? a.colwise_scale + col_scale_rows * Q : nullptr;
      u.colwise_global_scale_inv = a.colwise_global_scale_inv + g;
    }
    LOWBIT_RETURN_IF_ERROR(QuantizeNvfp4Ref(u));
    P += RoundUpI64(n, 128);
    B += CeilDivI64(n, 2);
    Q += RoundUpI64(CeilDivI64(n, kNvfp4BlockLen), 4);
    start = end;
  }
  return Status::Ok();
}

}  // namespace lowbit
