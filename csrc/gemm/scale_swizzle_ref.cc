// CPU reference of the scale swizzle (scale_swizzle.h): one loop over the input entries.
#include "gemm/scale_swizzle.h"

namespace lowbit {

Status ScaleSwizzleRef(const ScaleSwizzleArgs& args) {
  LOWBIT_RETURN_IF_ERROR(CheckScaleSwizzleArgs(args, "lowbit_gemm_swizzle_scales"));
  for (int64_t r = 0; r < args.rows; ++r) {
    for (int64_t c = 0; c < args.cols; ++c) {
      const bool valid = r < args.valid_rows && c < args.valid_cols;
      args.out[SwizzledScaleOffset(r, c, args.cols)] = valid ? args.in[r * args.cols + c] : 0;
    }
  }
  return Status::Ok();
}

Status ScaleUnswizzleRef(const uint8_t* swizzled, uint8_t* out, int64_t rows, int64_t cols) {
  ScaleSwizzleArgs shape;
  shape.rows = rows;
  shape.cols = cols;
  LOWBIT_RETURN_IF_ERROR(CheckScaleSwizzleArgs(shape, "lowbit_gemm_unswizzle_scales"));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = swizzled[SwizzledScaleOffset(r, c, cols)];
  }
  return Status::Ok();
}

}  // namespace lowbit
