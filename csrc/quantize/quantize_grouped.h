// Grouped FP8 per-tensor quantization (MoE): G tensors stacked along the rows of one
// high-precision matrix, each quantized as its own tensor with its own scale and amax.
//
// Data: x is rows x cols, row-major, f32/f16/bf16 (x of any rank flattened at flatten_axis,
// rows = prod(shape[:flatten_axis])). group_sizes holds G int32 values counted in units of
// rows_per_unit rows (prod(shape[1:flatten_axis]): sizes count entries of x's first dim).
// Group g covers rows [start_g, end_g): with s_h = max(group_sizes[h], 0) * rows_per_unit,
// start_g = min(s_0 + ... + s_{g-1}, rows) and end_g = min(start_g + s_g, rows); so negative
// sizes count as 0 and groups past the end of x are clipped (empty). Rows at or after
// end_{G-1} (sum(group_sizes) < first dim) are padding: their codes are 0 in both copies
// and they count in no amax.
// Outputs: rowwise rows x cols (x's layout), colwise cols x rows (the transpose: group g's
// colwise copy is columns [start_g, end_g) of it), E4M3 or E5M2 bytes; per group g:
// amax[g], scale_out[g] (the scale used) and scale_inv[g] = 1 / scale_out[g].
// Scales: delayed scaling takes scale[g] as given; current scaling computes
// scale_out[g] = CurrentScale(amax[g], fmt max, use_power_2_scales) (scale.h: amax 0, inf
// or NaN -> 1, an infinite quotient -> FLT_MAX) from the group's own amax.
// Numerics per element: those of quantize.h with the element's group scale; amax =
// max |x| over the group's rows by unsigned fp32 bit compare (NaN beats inf; empty -> 0);
// scale_inv by ScaleDivRn (correctly rounded, NaN defined). No dbias.
// CUDA: the per-tensor tiled kernel (quantize_tiled.cuh) with a per-group scale table;
// LOWBIT_QUANTIZE_TILE_VARIANT (quantize.h) picks its tile variant here too. Current
// scaling runs an amax pass over x first (x is read twice).
// Block formats (MXFP8, FP8 block): quantize_grouped_block.h; NVFP4: quantize_grouped_nvfp4.h
// (their tile walks reuse FindGroup).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/formats.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

// Most groups one call takes: the CUDA kernel keeps a table of 12 bytes per group in
// shared memory next to its tiles (r256s2: 208 KB of the 227 KB an H100 block may have).
constexpr int64_t kMaxQuantizeGroups = 1024;

// The checks every grouped quantizer starts with (`op` is "<name>: "): 1 to kMaxQuantizeGroups
// groups, 0 <= rows <= max_rows (what the launcher's int32 tables hold), cols >= 0,
// rows_per_unit >= 1, a group_sizes buffer.
inline Status CheckGroupedShape(const std::string& op, int64_t groups, int64_t rows, int64_t cols,
                                int64_t rows_per_unit, const int32_t* group_sizes, int64_t max_rows = 0x7FFFFFFF) {
  if (groups < 1 || groups > kMaxQuantizeGroups) {
    return Status::InvalidArgument(op + "group_sizes: expected 1 to " + std::to_string(kMaxQuantizeGroups) +
                                   " groups, got " + std::to_string(groups));
  }
  if (rows < 0 || cols < 0 || rows > max_rows) {
    return Status::InvalidArgument(op + "x: expected 0 <= rows <= " + std::to_string(max_rows) + " and cols >= 0, got " +
                                   std::to_string(rows) + " x " + std::to_string(cols));
  }
  if (rows_per_unit < 1) {
    return Status::InvalidArgument(op + "rows_per_unit: expected >= 1, got " + std::to_string(rows_per_unit));
  }
  if (group_sizes == nullptr) return Status::InvalidArgument(op + "group_sizes: expected a buffer");
  return Status::Ok();
}

struct QuantizeGroupedFp8Args {
  const void* x = nullptr;
  DType x_dtype = DType::kInvalid;      // f32, f16 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  const int32_t* group_sizes = nullptr;  // groups values
  int64_t groups = 0;                    // 1 .. kMaxQuantizeGroups
  int64_t rows_per_unit = 1;             // rows per unit of group_sizes (>= 1)
  bool current_scaling = false;          // true: scales from the amaxes; false: `scale`
  bool use_power_2_scales = false;       // current scaling only
  const float* scale = nullptr;          // groups values (delayed), null for current scaling
  DType out_dtype = DType::kInvalid;     // kE4M3 or kE5M2
  uint8_t* rowwise = nullptr;            // rows x cols, or null when not requested
  uint8_t* colwise = nullptr;            // cols x rows, or null when not requested
  float* amax = nullptr;                 // groups values, always written
  float* scale_out = nullptr;            // groups values, always written
  float* scale_inv = nullptr;            // groups values, always written
};

// The argument checks shared by the reference and the launcher (sizes, pointers, dtypes).
inline Status CheckQuantizeGroupedFp8Args(const QuantizeGroupedFp8Args& a) {
  const std::string op = "lowbit_quantize_grouped_fp8: ";
  LOWBIT_RETURN_IF_ERROR(CheckGroupedShape(op, a.groups, a.rows, a.cols, a.rows_per_unit, a.group_sizes));
  if (a.amax == nullptr || a.scale_out == nullptr || a.scale_inv == nullptr) {
    return Status::InvalidArgument(op + "amax, scale, scale_inv: expected buffers");
  }
  if (!a.current_scaling && a.scale == nullptr) {
    return Status::InvalidArgument(op + "scale: expected one scale per group for delayed scaling");
  }
  if (a.rows * a.cols != 0 && a.rowwise == nullptr && a.colwise == nullptr) {
    return Status::InvalidArgument(op + "rowwise: neither rowwise nor colwise output requested");
  }
  return Status::Ok();
}

// The end row of group g, which starts at row `start` (the clipping above: a negative size
// counts as 0, a group past x's end is cut there). The CPU references walk the groups so.
inline int64_t GroupEndRow(const int32_t* group_sizes, int64_t g, int64_t start, int64_t rows,
                           int64_t rows_per_unit) {
  const int64_t size = std::max<int64_t>(group_sizes[g], 0) * rows_per_unit;
  return std::min(start + std::min(size, rows), rows);
}

// The CUDA kernels' row -> group lookup (host + device, so GoogleTest checks it).
// Rows [lo, hi) are in `group` (-1: padding); hi <= lo: nothing cached yet.
struct RowRange {
  int lo = 0, hi = 0, group = -1;
};

// The group of `row` (0 <= row < 2^31) from the G >= 1 end rows (GroupEndsKernel's, in shared
// memory in the kernels): the cached range, else the first group whose end is past the row
// (a binary search; empty groups are skipped), else -1 (padding). Updates the cache.
LOWBIT_HD int FindGroup(const int32_t* ends, int groups, RowRange& c, int row) {
  if (row >= c.lo && row < c.hi) return c.group;
  int lo = 0, hi = groups;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (ends[mid] > row) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  if (lo == groups) {
    c = RowRange{ends[groups - 1], 0x7FFFFFFF, -1};
  } else {
    c = RowRange{lo > 0 ? ends[lo - 1] : 0, ends[lo], lo};
  }
  return c.group;
}

// CPU reference (quantize_grouped_ref.cc): host pointers.
Status QuantizeGroupedFp8Ref(const QuantizeGroupedFp8Args& args);

// Device workspace QuantizeGroupedFp8Cuda needs: the groups' end rows (int32).
inline int64_t QuantizeGroupedFp8WorkspaceBytes(int64_t groups) { return groups * int64_t(sizeof(int32_t)); }

// CUDA launcher (quantize_grouped.cu): device pointers, enqueued on `stream`, no host
// sync (group_sizes are read on the device). `workspace` holds
// QuantizeGroupedFp8WorkspaceBytes(groups) bytes, 16-byte aligned.
Status QuantizeGroupedFp8Cuda(const QuantizeGroupedFp8Args& args, void* workspace, GpuStream stream);

}  // namespace lowbit
