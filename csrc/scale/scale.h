// Per-tensor FP8 scales (DESIGN.md §4) with explicit IEEE fp32 operations, so that the
// CPU reference and the CUDA kernels give the same bits (XLA's own fp32 division on the
// GPU is not correctly rounded; the host code runs with denormals honoured, whatever
// the calling thread's FTZ/DAZ mode).
//
// Current scaling (ComputeScale*), elementwise over n amaxes:
//   scale = fp8_max / amax, an infinite quotient clamped to FLT_MAX; amax 0, negative,
//   inf or NaN (tested on the bits) -> 1; use_power_2_scales clears the mantissa bits
//   (sign and exponent kept); scale_inv = 1 / scale.
// Delayed scaling (UpdateDelayedScaling*), history h of length L >= 1:
//   h[0] = new_amax; a = max(h) (NaN if any is NaN) or h[0] (most_recent);
//   scale = fp8_max / a / 2^margin (two correctly rounded divisions), infinite -> FLT_MAX,
//   the old scale (bits copied) when a is not > 0 and finite; new history = h rolled left
//   by one with element 0 zeroed; scale_inv = 1 / scale.
// ScaleInverse*: scale_inv = 1 / scale, elementwise.
// Divisions are IEEE round-to-nearest-even; a NaN result is the quiet NaN 0x7FC00000
// with the sign of the NaN operand (numerator first), or positive for 0/0 and inf/inf
// (GPUs and CPUs disagree on NaN bits otherwise).
#pragma once

#include <cstdint>

#include "common/formats.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

constexpr uint32_t kFltMaxBits = 0x7F7FFFFFu;
constexpr uint32_t kPosInfBits = 0x7F800000u;

// a / b, correctly rounded, NaN as described above.
LOWBIT_HD float ScaleDivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float q = __fdiv_rn(a, b);
#else
  const float q = a / b;
#endif
  if (!IsNanBits(FloatBits(q))) return q;
  const uint32_t ab = FloatBits(a), bb = FloatBits(b);
  const uint32_t sign = IsNanBits(ab) ? (ab & 0x80000000u) : IsNanBits(bb) ? (bb & 0x80000000u) : 0u;
  return BitsToFloat(sign | 0x7FC00000u);
}

// amax > 0 and finite, on the bits (no float compare, so no denormal flushing).
LOWBIT_HD bool UsableAmax(float amax) {
  const uint32_t bits = FloatBits(amax);
  return bits != 0u && bits < kPosInfBits;
}

// +-inf -> FLT_MAX (positive, as the jnp rule `where(isinf(s), FLT_MAX, s)`).
LOWBIT_HD float ClampInfinite(float s) {
  return (FloatBits(s) & 0x7FFFFFFFu) == kPosInfBits ? BitsToFloat(kFltMaxBits) : s;
}

// 2^m as fp32: exact for -149 <= m <= 127, inf above, 0 below.
LOWBIT_HD float Pow2Float(int32_t m) {
  if (m > 127) return BitsToFloat(kPosInfBits);
  if (m >= -126) return BitsToFloat(uint32_t(m + 127) << 23);
  if (m >= -149) return BitsToFloat(1u << (m + 149));
  return 0.0f;
}

LOWBIT_HD float CurrentScale(float amax, float fp8_max, bool pow2) {
  float scale = UsableAmax(amax) ? ClampInfinite(ScaleDivRn(fp8_max, amax)) : 1.0f;
  if (pow2) scale = BitsToFloat(FloatBits(scale) & 0xFF800000u);
  return scale;
}

LOWBIT_HD float DelayedScale(float a, float previous, float fp8_max, int32_t margin) {
  if (!UsableAmax(a)) return previous;
  return ClampInfinite(ScaleDivRn(ScaleDivRn(fp8_max, a), Pow2Float(margin)));
}

// Order key of a non-NaN float: unsigned compare of keys == numeric order (-0 < +0).
LOWBIT_HD uint32_t OrderKey(float v) {
  const uint32_t b = FloatBits(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The delayed step on one history (host or one device thread). history may alias nothing.
LOWBIT_HD void DelayedUpdateOne(const float* history, int64_t len, float scale, float new_amax,
                                float fp8_max, int32_t margin, bool most_recent,
                                float* new_history, float* new_scale, float* scale_inv) {
  float a = new_amax;
  if (!most_recent) {
    bool nan = IsNanBits(FloatBits(new_amax));
    for (int64_t i = 1; i < len && !nan; ++i) {
      const float h = history[i];
      if (IsNanBits(FloatBits(h))) {
        a = h;
        nan = true;
      } else if (OrderKey(h) > OrderKey(a)) {
        a = h;
      }
    }
  }
  const float s = DelayedScale(a, scale, fp8_max, margin);
  // roll(h', -1) with h'[0] = new_amax, then element 0 = 0.
  for (int64_t i = 0; i + 1 < len; ++i) new_history[i] = history[i + 1];
  new_history[len - 1] = new_amax;
  new_history[0] = 0.0f;
  *new_scale = s;
  *scale_inv = ScaleDivRn(1.0f, s);
}

// CPU references (scale_ref.cc): host pointers.
Status ComputeScaleRef(const float* amax, int64_t n, float fp8_max, bool use_power_2_scales,
                       float* scale, float* scale_inv);
Status ScaleInverseRef(const float* scale, int64_t n, float* scale_inv);
Status UpdateDelayedScalingRef(const float* history, int64_t len, const float* scale,
                               const float* new_amax, float fp8_max, int32_t margin,
                               bool most_recent, float* new_history, float* new_scale,
                               float* scale_inv);

// CUDA launchers (scale.cu): device pointers, enqueued on `stream`.
Status ComputeScaleCuda(const float* amax, int64_t n, float fp8_max, bool use_power_2_scales,
                        float* scale, float* scale_inv, GpuStream stream);
Status ScaleInverseCuda(const float* scale, int64_t n, float* scale_inv, GpuStream stream);
Status UpdateDelayedScalingCuda(const float* history, int64_t len, const float* scale,
                                const float* new_amax, float fp8_max, int32_t margin,
                                bool most_recent, float* new_history, float* new_scale,
                                float* scale_inv, GpuStream stream);

}  // namespace lowbit
