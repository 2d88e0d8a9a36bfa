// The per-element encode/decode switch shared by convert_ref.cc and convert.cu.
#pragma once

#include <string>

#include "common/formats.h"
#include "convert/convert.h"

namespace lowbit {

LOWBIT_HD uint16_t EncodeOne(float x, const uint32_t* random, int64_t i, CodecFormat format) {
  switch (format) {
    case CodecFormat::kE4M3: return random ? FloatToE4m3Stochastic(x, random[i]) : FloatToE4m3(x);
    case CodecFormat::kE5M2: return random ? FloatToE5m2Stochastic(x, random[i]) : FloatToE5m2(x);
    case CodecFormat::kE2M1: return random ? FloatToE2m1Stochastic(x, random[i]) : FloatToE2m1(x);
    case CodecFormat::kE8M0: return FloatToE8m0(x);
    case CodecFormat::kE8M0RoundUp: return E8m0FromScaleRoundUp(x);
    case CodecFormat::kBF16: return FloatToBf16(x);
    case CodecFormat::kF16: return FloatToFp16(x);
  }
  return 0;
}

LOWBIT_HD float DecodeOne(uint16_t code, CodecFormat format) {
  switch (format) {
    case CodecFormat::kE4M3: return E4m3ToFloat(uint8_t(code));
    case CodecFormat::kE5M2: return E5m2ToFloat(uint8_t(code));
    case CodecFormat::kE2M1: return E2m1ToFloat(uint8_t(code & 0xFu));
    case CodecFormat::kE8M0:
    case CodecFormat::kE8M0RoundUp: return E8m0ToFloat(uint8_t(code));
    case CodecFormat::kBF16: return Bf16ToFloat(code);
    case CodecFormat::kF16: return Fp16ToFloat(code);
  }
  return 0.0f;
}

inline Status CheckCodec(CodecFormat format, bool stochastic) {
  const int32_t f = int32_t(format);
  if (f < 0 || f > 6) {
    return Status::InvalidArgument("lowbit_encode: format: unknown codec " + std::to_string(f));
  }
  if (stochastic && format != CodecFormat::kE4M3 && format != CodecFormat::kE5M2 &&
      format != CodecFormat::kE2M1) {
    return Status::InvalidArgument(
        "lowbit_encode: random: stochastic rounding is defined for E4M3, E5M2 and E2M1 only");
  }
  return Status::Ok();
}

}  // namespace lowbit
