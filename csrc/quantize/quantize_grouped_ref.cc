// CPU reference for grouped FP8 quantization (quantize_grouped.h): the groups' row ranges,
// then per group an amax pass (current scaling) and the per-tensor encode of quantize.h
// with the group's scale, rows in order; padding rows get zero codes.
#include <algorithm>
#include <vector>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "quantize/fp8_codec.h"
#include "quantize/quantize_grouped.h"
#include "scale/scale.h"

namespace lowbit {

Status QuantizeGroupedFp8Ref(const QuantizeGroupedFp8Args& a) {
  LOWBIT_RETURN_IF_ERROR(CheckQuantizeGroupedFp8Args(a));
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  constexpr const char* kOp = "lowbit_quantize_grouped_fp8";
  return DispatchHighPrecision(a.x_dtype, kOp, "x", [&](auto tag) {
    return DispatchFp8(a.out_dtype, kOp, "out", [&](auto fmt) {
      using T = typename decltype(tag)::Storage;
      const T* x = static_cast<const T*>(a.x);
      auto value = [&](int64_t r, int64_t c) { return LoadAsFloat(tag, x[r * a.cols + c]); };
      int64_t start = 0;
      for (int64_t g = 0; g < a.groups; ++g) {
        const int64_t end = GroupEndRow(a.group_sizes, g, start, a.rows, a.rows_per_unit);
        uint32_t best = 0;
        for (int64_t r = start; r < end; ++r) {
          for (int64_t c = 0; c < a.cols; ++c) best = std::max(best, AbsBitsOf(value(r, c)));
        }
        a.amax[g] = BitsToFloat(best);
        const float scale = a.current_scaling ? CurrentScale(a.amax[g], decltype(fmt)::kMax, a.use_power_2_scales)
                                              : a.scale[g];
        a.scale_out[g] = scale;
        a.scale_inv[g] = ScaleDivRn(1.0f, scale);
        for (int64_t r = start; r < end; ++r) {
          for (int64_t c = 0; c < a.cols; ++c) {
            const uint8_t q = EncodeScaled(fmt, value(r, c), scale);
            if (a.rowwise != nullptr) a.rowwise[r * a.cols + c] = q;
            if (a.colwise != nullptr) a.colwise[c * a.rows + r] = q;
          }
        }
        start = end;
      }
      for (int64_t r = start; r < a.rows; ++r) {  // padding
        for (int64_t c = 0; c < a.cols; ++c) {
          if (a.rowwise != nullptr) a.rowwise[r * a.cols + c] = 0;
          if (a.colwise != nullptr) a.colwise[c * a.rows + r] = 0;
        }
      }
      return Status::Ok();
    });
  });
}

}  // namespace lowbit
