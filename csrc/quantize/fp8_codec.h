// The FP8 encode/decode steps of quantize.h, host and device, templated on the format
// so the CPU reference and the CUDA kernels run the very same code (formats.h codecs).
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/formats.h"
#include "common/status.h"

namespace lowbit {

struct E4m3Fmt { static constexpr float kMax = kE4m3Max; };
struct E5m2Fmt { static constexpr float kMax = kE5m2Max; };

// encode_rne(clip(x * scale, -max, max)): the codecs saturate, which is the clip.
LOWBIT_HD uint8_t EncodeScaled(E4m3Fmt, float x, float scale) { return FloatToE4m3(x * scale); }
LOWBIT_HD uint8_t EncodeScaled(E5m2Fmt, float x, float scale) { return FloatToE5m2(x * scale); }

LOWBIT_HD float Decode(E4m3Fmt, uint8_t q) { return E4m3ToFloat(q); }
LOWBIT_HD float Decode(E5m2Fmt, uint8_t q) { return E5m2ToFloat(q); }

// |x| as fp32 bits, the unsigned-compare key of the amax rule.
LOWBIT_HD uint32_t AbsBitsOf(float v) { return FloatBits(v) & 0x7FFFFFFFu; }

// Returns fn(E4m3Fmt{}) or fn(E5m2Fmt{}) (a Status), or an error naming `op` and `arg`.
template <typename Fn>
Status DispatchFp8(DType dtype, const char* op, const char* arg, Fn&& fn) {
  switch (dtype) {
    case DType::kE4M3: return fn(E4m3Fmt{});
    case DType::kE5M2: return fn(E5m2Fmt{});
    default:
      return Status::InvalidArgument(std::string(op) + ": " + arg +
                                     ": expected f8e4m3fn or f8e5m2, got " + DTypeName(dtype));
  }
}

}  // namespace lowbit
