// CPU reference for the scale ops (scale.h): the shared LOWBIT_HD formulas, run with
// IEEE denormals. XLA:CPU may call handlers with FTZ/DAZ set (it flushes denormals in
// its own kernels); a denormal amax, a scale made denormal by the margin, or 1 / 2^127
// would then differ from the GPU, so the handlers clear those modes while they run.
#include <string>

#include "scale/scale.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#define LOWBIT_SCALE_X86 1
#endif

namespace lowbit {
namespace {

class ScopedIeeeDenormals {
 public:
  ScopedIeeeDenormals() {
#if defined(LOWBIT_SCALE_X86)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u));  // FTZ (bit 15), DAZ (bit 6)
#elif defined(__aarch64__)
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t cleared = saved_ & ~(uint64_t(1) << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(cleared));
#endif
  }
  ~ScopedIeeeDenormals() {
#if defined(LOWBIT_SCALE_X86)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  ScopedIeeeDenormals(const ScopedIeeeDenormals&) = delete;
  ScopedIeeeDenormals& operator=(const ScopedIeeeDenormals&) = delete;

 private:
#if defined(LOWBIT_SCALE_X86)
  unsigned int saved_ = 0;
#else
  uint64_t saved_ = 0;
#endif
};

}  // namespace

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
