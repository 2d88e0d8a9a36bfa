// CPU reference for the scale ops (scale.h): the shared LOWBIT_HD formulas, run with
// IEEE denormals. XLA:CPU may call handlers with FTZ/DAZ set (it flushes denormals in
// its own kernels); a denormal amax, a scale made denormal by the margin, or 1 / 2^127
// would then differ from the GPU, so the handlers clear those modes while they run.
#include <string>

#include "common/ieee_denormals.h"
#include "scale/scale.h"

namespace lowbit {

Status ComputeScaleRef(const float* amax, int64_t n, float fp8_max, bool use_power_2_scales,
                       float* scale, float* scale_inv) {
  ScopedIeeeDenormals ieee;
  for (int64_t i = 0; i < n; ++i) {
    const float s = CurrentScale(amax[i], fp8_max, use_power_2_scales);
    scale[i] = s;
    scale_inv[i] = ScaleDivRn(1.0f, s);
  }
  return Status::Ok();
}

Status ScaleInverseRef(const float* scale, int64_t n, float* scale_inv) {
  ScopedIeeeDenormals ieee;
  for (int64_t i = 0; i < n; ++i) scale_inv[i] = ScaleDivRn(1.0f, scale[i]);
  return Status::Ok();
}

Status UpdateDelayedScalingRef(const float* history, int64_t len, const float* scale,
                               const float* new_amax, float fp8_max, int32_t margin,
                               bool most_recent, float* new_history, float* new_scale,
                               float* scale_inv) {
  if (len < 1) {
    return Status::InvalidArgument("lowbit_update_delayed_scaling: amax_history: expected length >= 1");
  }
  ScopedIeeeDenormals ieee;
  DelayedUpdateOne(history, len, *scale, *new_amax, fp8_max, margin, most_recent, new_history,
                   new_scale, scale_inv);
  return Status::Ok();
}

}  // namespace lowbit
