// Device conversions between fp32 and the 16-bit storage types for the elementwise kernels
// (activation_kernels.cuh, softmax/softmax.cu): the hardware instructions where they give the
// element.h codecs' bits, 16-byte chunks packed for one vector store.
//
// cvt.rn.{bf16x2,f16x2}.f32 (sm_80+, PTX ISA) round to nearest even, keep subnormals (no
// .ftz) and overflow to inf: exactly StoreFromFloat for non-NaN inputs; a NaN loses its
// sign and payload, so callers that promise NaN bits pass no_nan = false for such chunks.
// f16 -> f32 by cvt.f32.f16 is exact (a NaN's payload may change); bf16 -> f32 is a shift.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/element.h"

namespace lowbit {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LOWBIT_HAS_CVT_HALF_X2 1
#else
#define LOWBIT_HAS_CVT_HALF_X2 0
#endif

#if LOWBIT_HAS_CVT_HALF_X2
// `lo` in the low 16 bits, `hi` in the high 16 bits.
__device__ __forceinline__ uint32_t CvtX2(BF16, float lo, float hi) {
  uint32_t pair;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  return pair;
}
__device__ __forceinline__ uint32_t CvtX2(F16, float lo, float hi) {
  uint32_t pair;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(hi), "f"(lo));
  return pair;
}
#endif

// The element as fp32: LoadAsFloat, f16 by the hardware conversion. Callers whose outputs
// canonicalize NaN (or compare NaN by kind only) may use it; NaN payloads are not kept.
template <typename Tag>
__device__ __forceinline__ float LoadElement(Tag tag, typename Tag::Storage v) {
  if constexpr (std::is_same_v<Tag, F16>) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
  } else {
    return LoadAsFloat(tag, v);
  }
}

// v rounded to the storage type (StoreFromFloat's bits when no_nan or when no v[j] is NaN),
// as the 16 bytes of kVec = 16 / sizeof(T) elements.
template <typename Tag, int kVec>
__device__ __forceinline__ uint4 PackChunk(const float (&v)[kVec], bool no_nan) {
  using T = typename Tag::Storage;
  static_assert(kVec * sizeof(T) == 16, "16-byte chunks");
  uint4 packed;
  if constexpr (sizeof(T) == 2) {
#if LOWBIT_HAS_CVT_HALF_X2
    if (no_nan) {
      uint32_t w[kVec / 2];
#pragma unroll
      for (int j = 0; j < kVec; j += 2) w[j / 2] = CvtX2(Tag{}, v[j], v[j + 1]);
      memcpy(&packed, w, sizeof(packed));
      return packed;
    }
#endif
  }
  T hp[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) hp[j] = StoreFromFloat(Tag{}, v[j]);
  memcpy(&packed, hp, sizeof(packed));
  return packed;
}

}  // namespace lowbit
