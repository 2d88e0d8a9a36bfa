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

// x * s with a NaN result defined by lowbit rather than by the platform. IEEE 754 leaves
// the sign and payload of a NaN result open: x86 returns the NaN operand (and a negative
// default NaN for 0 * inf), NVIDIA GPUs return 0x7FFFFFFF whatever the operands. Here a
// NaN result is always the quiet NaN 0x7FC00000 with the sign of the NaN operand (x
// first, then s), or, for an invalid 0 * inf, sign(x) xor sign(s). Non-NaN results are
// the plain IEEE product. Host and device run this same code.
LOWBIT_HD float MulNanDefined(float x, float s) {
  const float p = x * s;
  if (!IsNanBits(FloatBits(p))) return p;
  const uint32_t xb = FloatBits(x), sb = FloatBits(s);
  const uint32_t sign = IsNanBits(xb) ? (xb & 0x80000000u)
                        : IsNanBits(sb) ? (sb & 0x80000000u)
                                        : ((xb ^ sb) & 0x80000000u);
  return BitsToFloat(sign | 0x7FC00000u);
}

// encode_rne(clip(x * scale, -max, max)): the codecs saturate, which is the clip.
LOWBIT_HD uint8_t EncodeScaled(E4m3Fmt, float x, float scale) {
  return FloatToE4m3(MulNanDefined(x, scale));
}
LOWBIT_HD uint8_t EncodeScaled(E5m2Fmt, float x, float scale) {
  return FloatToE5m2(MulNanDefined(x, scale));
}

LOWBIT_HD float Decode(E4m3Fmt, uint8_t q) { return E4m3ToFloat(q); }
LOWBIT_HD float Decode(E5m2Fmt, uint8_t q) { return E5m2ToFloat(q); }

// decode(q) * scale_inv in fp32, NaN results as MulNanDefined (so a NaN code keeps its sign
// and the output NaN is the canonical quiet one on every platform).
template <typename Fmt>
LOWBIT_HD float DecodeScaled(Fmt fmt, uint8_t q, float scale_inv) {
  return MulNanDefined(Decode(fmt, q), scale_inv);
}

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
