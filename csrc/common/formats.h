// Codecs for the number formats lowbit stores: bf16, fp16, E4M3 (fn), E5M2, E8M0 (fnu)
// and E2M1 (fn). Header-only, host and device: the CPU reference and the CUDA kernels
// call the same functions, which is what makes them agree bit for bit.
//
// Encoding rules (checked exhaustively against ml_dtypes in tests/test_formats.py):
// - Round to nearest, ties to even, on the exact fp32 value; results above the largest
//   finite value saturate to it (E4M3 448, E5M2 57344, E2M1 6), inf included.
// - NaN stays NaN (sign kept) where the format has one; E2M1 has none, so NaN encodes as
//   the largest magnitude with its sign (callers keep NaN visible through the scale).
// - Stochastic rounding takes one uniform 32-bit word per value and rounds the magnitude
//   up with probability rem / 2^shift, rem being the bits below the format's quantum:
//   exactly unbiased down to 2^-8 of the smallest subnormal, and only ever one of the two
//   neighbouring representable values.
// - E8M0 (scale bytes) follows ml_dtypes: 2^round_half_up(log2 x), NaN for x <= 0, inf or
//   NaN. E8m0FromScaleRoundUp is the MXFP8 rule instead: the exponent is rounded up
//   whenever the mantissa is non-zero, so that amax / 2^e never exceeds the format's max.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace lowbit {

LOWBIT_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// |x| as fp32 bits, the unsigned-compare key of the amax rule (every amax in lowbit).
LOWBIT_HD uint32_t AbsBitsOf(float v) { return FloatBits(v) & 0x7FFFFFFFu; }

LOWBIT_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

LOWBIT_HD bool IsNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// ---------------------------------------------------------------- bf16, fp16

LOWBIT_HD float Bf16ToFloat(uint16_t h) { return BitsToFloat(uint32_t(h) << 16); }

LOWBIT_HD uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if (IsNanBits(u)) return uint16_t((u >> 16) | 0x0040u);  // keep sign, quiet the NaN
  uint32_t lsb = (u >> 16) & 1u;
  return uint16_t((u + 0x7FFFu + lsb) >> 16);
}

LOWBIT_HD float Fp16ToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return BitsToFloat(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    float mag = float(man) * 5.9604644775390625e-08f;
    return BitsToFloat(sign | FloatBits(mag));
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

// IEEE fp16 with round to nearest even; overflow goes to inf (no saturation: this is
// for high-precision outputs, not for quantized data).
template <int kMant, int kBias>
LOWBIT_HD uint32_t RoundMagnitudeRne(uint32_t abs_bits);

LOWBIT_HD uint16_t FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  if (IsNanBits(u)) return uint16_t(sign | 0x7E00u | ((u >> 13) & 0x3FFu));
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits >= 0x47800000u) return uint16_t(sign | 0x7C00u);  // >= 65536 or inf
  uint32_t code = RoundMagnitudeRne<10, 15>(abs_bits);
  if (code > 0x7C00u) code = 0x7C00u;
  return uint16_t(sign | code);
}

// Rounds the magnitude of a finite, non-negative float (given as bits) to a format with
// kMant mantissa bits and exponent bias kBias, ties to even; returns the magnitude code,
// unclamped (the caller saturates). Shared by every narrow format below.
template <int kMant, int kBias>
LOWBIT_HD uint32_t RoundMagnitudeRne(uint32_t abs_bits) {
  const int exp32 = int(abs_bits >> 23);
  if (exp32 == 0) return 0;  // fp32 zero or subnormal: below every format's half-quantum
  const int e = exp32 - 127;
  const uint32_t sig = (1u << 23) | (abs_bits & 0x7FFFFFu);
  constexpr int kEmin = 1 - kBias;
  const int shift = 23 - kMant + (e < kEmin ? kEmin - e : 0);
  if (shift > 24) return 0;  // below half the smallest subnormal (sig < 2^24: never a tie)
  uint32_t r = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  if (e < kEmin) return r;  // subnormal (r == 2^kMant is the smallest normal's code)
  return (uint32_t(e - kEmin + 1) << kMant) + r - (1u << kMant);
}

// As RoundMagnitudeRne, rounding up with probability rem / 2^shift given `random`.
template <int kMant, int kBias>
LOWBIT_HD uint32_t RoundMagnitudeStochastic(uint32_t abs_bits, uint32_t random) {
  const int exp32 = int(abs_bits >> 23);
  uint32_t sig;
  int e;
  if (exp32 == 0) {  // fp32 subnormal: value = man * 2^-149
    sig = abs_bits & 0x7FFFFFu;
    e = -126;
  } else {
    sig = (1u << 23) | (abs_bits & 0x7FFFFFu);
    e = exp32 - 127;
  }
  if (sig == 0) return 0;
  constexpr int kEmin = 1 - kBias;
  const int shift = 23 - kMant + (e < kEmin ? kEmin - e : 0);
  uint32_t r = shift >= 32 ? 0u : (sig >> shift);
  const uint64_t rem = shift >= 32 ? sig : (sig & ((1u << shift) - 1u));
  // threshold / 2^32 == rem / 2^shift, exactly while shift <= 32.
  const uint64_t threshold =
      shift <= 32 ? (rem << (32 - shift)) : (shift >= 56 ? 0 : (rem >> (shift - 32)));
  if (uint64_t(random) < threshold) ++r;
  if (e < kEmin) return r;
  return (uint32_t(e - kEmin + 1) << kMant) + r - (1u << kMant);
}

template <int kMant, int kBias>
LOWBIT_HD float DecodeMagnitude(uint32_t code) {
  const uint32_t exp = code >> kMant;
  const uint32_t man = code & ((1u << kMant) - 1u);
  if (exp == 0) {  // subnormal: man * 2^(1 - bias - mant), exact in fp32
    return float(man) * BitsToFloat(uint32_t(127 + 1 - kBias - kMant) << 23);
  }
  return BitsToFloat(((exp + 127u - kBias) << 23) | (man << (23 - kMant)));
}

// ---------------------------------------------------------------- E4M3 (fn)

constexpr float kE4m3Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;
constexpr float kE2m1Max = 6.0f;

LOWBIT_HD uint8_t FloatToE4m3(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  if (IsNanBits(u)) return uint8_t(sign | 0x7Fu);
  uint32_t code = RoundMagnitudeRne<3, 7>(u & 0x7FFFFFFFu);
  if (code > 0x7Eu) code = 0x7Eu;
  return uint8_t(sign | code);
}

LOWBIT_HD uint8_t FloatToE4m3Stochastic(float f, uint32_t random) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  if (IsNanBits(u)) return uint8_t(sign | 0x7Fu);
  uint32_t code = RoundMagnitudeStochastic<3, 7>(u & 0x7FFFFFFFu, random);
  if (code > 0x7Eu) code = 0x7Eu;
  return uint8_t(sign | code);
}

LOWBIT_HD float E4m3ToFloat(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  if ((b & 0x7Fu) == 0x7Fu) return BitsToFloat(sign | 0x7FC00000u);
  return BitsToFloat(sign | FloatBits(DecodeMagnitude<3, 7>(b & 0x7Fu)));
}

// ---------------------------------------------------------------- E5M2

LOWBIT_HD uint8_t FloatToE5m2(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  if (IsNanBits(u)) return uint8_t(sign | 0x7Eu);
  uint32_t code = RoundMagnitudeRne<2, 15>(u & 0x7FFFFFFFu);
  if (code > 0x7Bu) code = 0x7Bu;
  return uint8_t(sign | code);
}

LOWBIT_HD uint8_t FloatToE5m2Stochastic(float f, uint32_t random) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  if (IsNanBits(u)) return uint8_t(sign | 0x7Eu);
  uint32_t code = RoundMagnitudeStochastic<2, 15>(u & 0x7FFFFFFFu, random);
  if (code > 0x7Bu) code = 0x7Bu;
  return uint8_t(sign | code);
}

LOWBIT_HD float E5m2ToFloat(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t mag = b & 0x7Fu;
  if (mag == 0x7Cu) return BitsToFloat(sign | 0x7F800000u);
  if (mag > 0x7Cu) return BitsToFloat(sign | 0x7FC00000u);
  return BitsToFloat(sign | FloatBits(DecodeMagnitude<2, 15>(mag)));
}

// ---------------------------------------------------------------- E2M1 (fn), one nibble

LOWBIT_HD uint8_t FloatToE2m1(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 28) & 0x8u;
  if (IsNanBits(u)) return uint8_t(sign | 0x7u);
  uint32_t code = RoundMagnitudeRne<1, 1>(u & 0x7FFFFFFFu);
  if (code > 0x7u) code = 0x7u;
  return uint8_t(sign | code);
}

LOWBIT_HD uint8_t FloatToE2m1Stochastic(float f, uint32_t random) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 28) & 0x8u;
  if (IsNanBits(u)) return uint8_t(sign | 0x7u);
  uint32_t code = RoundMagnitudeStochastic<1, 1>(u & 0x7FFFFFFFu, random);
  if (code > 0x7u) code = 0x7u;
  return uint8_t(sign | code);
}

LOWBIT_HD float E2m1ToFloat(uint8_t nibble) {
  const uint32_t sign = uint32_t(nibble & 0x8u) << 28;
  return BitsToFloat(sign | FloatBits(DecodeMagnitude<1, 1>(nibble & 0x7u)));
}

// ---------------------------------------------------------------- E8M0 (fnu)

LOWBIT_HD float E8m0ToFloat(uint8_t b) {
  if (b == 0xFFu) return BitsToFloat(0x7FC00000u);
  if (b == 0) return BitsToFloat(0x00400000u);  // 2^-127, an fp32 subnormal
  return BitsToFloat(uint32_t(b) << 23);
}

// ml_dtypes' conversion: nearest power of two, ties (mantissa exactly 1.5) rounded up.
LOWBIT_HD uint8_t FloatToE8m0(float f) {
  const uint32_t u = FloatBits(f);
  if ((u >> 31) || u == 0 || u >= 0x7F800000u) return 0xFFu;
  uint32_t exp = u >> 23;
  const uint32_t man = u & 0x7FFFFFu;
  // fp32 subnormals, as ml_dtypes does: up to 2^-127 (code 0, the smallest value) -> 0,
  // anything above it -> 2^-126.
  if (exp == 0) return man > 0x400000u ? 1 : 0;
  if (man >= 0x400000u) ++exp;
  return exp >= 0xFFu ? 0xFFu : uint8_t(exp);
}

// MXFP8 scale rule: the smallest power of two >= s (exponent rounded up when the
// mantissa is non-zero); NaN -> 0xFF; saturates at 2^127.
LOWBIT_HD uint8_t E8m0FromScaleRoundUp(float s) {
  const uint32_t u = FloatBits(s);
  if (IsNanBits(u)) return 0xFFu;
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  uint32_t exp = abs_bits >> 23;
  if ((abs_bits & 0x7FFFFFu) != 0) ++exp;
  return exp > 0xFEu ? 0xFEu : uint8_t(exp);
}

}  // namespace lowbit
