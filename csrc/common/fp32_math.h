// Correctly rounded fp32 arithmetic that is identical on host and device, and an exp
// built from it, for code whose CPU reference and CUDA kernel must agree bit for bit.
//
// Device code uses the explicitly rounded intrinsics so that nvcc does not contract
// a * b + c into an FMA; host code relies on the compiler not contracting either (GCC and
// Clang do not on x86-64 without -mfma, the flags lowbit builds with).
// LbExp is Cephes' expf: range reduction by ln2 split in two parts, a degree-6 polynomial,
// 2^n applied in two exact steps; within 2 ulp of exp over the whole range; it overflows to
// inf above 88.72 and returns 0 below -103.97; NaN stays NaN; exp(-inf) = 0.
// The FMA-based functions below (Fp32Fma, LbExpNonPositive, Fp32DivOneTwo) are about 3x
// cheaper on the GPU and just as reproducible: an FMA rounds once on both sides (std::fmaf
// is correctly rounded, with or without a hardware FMA; __fmaf_rn on the device).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/formats.h"
#include "common/ieee_denormals.h"

namespace lowbit {

LOWBIT_HD float Fp32Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LOWBIT_HD float Fp32Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LOWBIT_HD float Fp32Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

LOWBIT_HD float Fp32Rint(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // default rounding mode: to nearest even, as rintf
#endif
}

// NaN -> the positive quiet NaN 0x7FC00000 (other values unchanged). CUDA arithmetic
// returns its canonical NaN 0x7FFFFFFF while x86 propagates the input's payload and sign,
// so outputs that must be bit-identical on both pass through this; it also makes the
// rounding of a NaN to bf16/f16 and the amax of |v| bit patterns agree.
LOWBIT_HD float CanonicalNan(float v) { return v == v ? v : BitsToFloat(0x7FC00000u); }


LOWBIT_HD float Fp32Pow2(int e) { return BitsToFloat(uint32_t(e + 127) << 23); }  // -126 <= e <= 127

LOWBIT_HD float LbExp(float x) {
  if (!(x == x)) return x;
  if (x > 88.7228394f) return BitsToFloat(0x7F800000u);
  if (x < -103.972084f) return 0.0f;
  const float n = Fp32Rint(Fp32Mul(x, 1.44269504088896341f));
  float r = Fp32Add(x, -Fp32Mul(n, 0.693359375f));  // exact: 0.693359375 has 9 bits
  r = Fp32Add(r, -Fp32Mul(n, -2.12194440e-4f));
  const float z = Fp32Mul(r, r);
  float p = 1.9875691500e-4f;
  p = Fp32Add(Fp32Mul(p, r), 1.3981999507e-3f);
  p = Fp32Add(Fp32Mul(p, r), 8.3334519073e-3f);
  p = Fp32Add(Fp32Mul(p, r), 4.1665795894e-2f);
  p = Fp32Add(Fp32Mul(p, r), 1.6666665459e-1f);
  p = Fp32Add(Fp32Mul(p, r), 5.0000001201e-1f);
  const float y = Fp32Add(Fp32Add(Fp32Mul(p, z), r), 1.0f);
  const int e = int(n);  // in [-150, 128]
  const int e1 = e / 2;
  return Fp32Mul(Fp32Mul(y, Fp32Pow2(e1)), Fp32Pow2(e - e1));
}

// a * b + c rounded once (identical on host and device).
LOWBIT_HD float Fp32Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

// exp(x) for -109 <= x <= 0 (or NaN), from FMAs only: n = rint(x log2 e) by the
// 1.5 * 2^23 shifter, r = x - n ln2 (Cody-Waite, ln2_hi with 8 trailing zero bits so the
// first step is exact), e^r by a degree-6 minimax polynomial on |r| <= ln2 / 2 (Horner,
// approximation error 0.05 ulp), then the exact product with 2^(n + 32) and one rounding
// multiply by 2^-32, which rounds subnormal results correctly. The core of
// LbExpNonPositive (which clamps into the range first) and of activation_math.h's
// LbExpNegAbs (x = -min(|v|, 109): the negation is exact and folds into the FMA operands).
LOWBIT_HD float LbExpNonPositiveInRange(float x) {
  constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = Fp32Fma(x, 1.44269502162933349609f, kShifter);
  const float n = Fp32Add(t, -kShifter);    // rint(x log2 e), exact
  float r = Fp32Fma(n, -0.693145751953125f, x);  // exact (Sterbenz; n ln2_hi has <= 24 bits)
  r = Fp32Fma(n, -1.42860676533018923e-06f, r);
  float p = 1.381461275741458e-03f;
  p = Fp32Fma(p, r, 8.368710055947304e-03f);
  p = Fp32Fma(p, r, 4.166838899254799e-02f);
  p = Fp32Fma(p, r, 1.666652113199234e-01f);
  p = Fp32Fma(p, r, 4.999999403953552e-01f);
  p = Fp32Fma(p, r, 1.0f);
  p = Fp32Fma(p, r, 1.0f);
  // t's low bits hold n (t = 1.5 * 2^23 + n, the shifter's low 9 bits are 0), so
  // t_bits << 23 = n << 23 (mod 2^32) and adding (127 + 32) << 23 builds 2^(n + 32).
  const float pow2 = BitsToFloat((FloatBits(t) << 23) + (uint32_t(127 + 32) << 23));
  return Fp32Mul(Fp32Mul(p, pow2), 2.3283064365386963e-10f);  // * 2^-32
}

// exp(x) for x <= 0 (x > 0 is taken as 0, so the result is 1): LbExpNonPositiveInRange
// after clamping to [-109, 0]. Within 2 ulp of exp for normal results (fp32_math_test.cc: a
// sweep against double); 0 below -103.98; exp(-inf) = 0; NaN in gives NaN out (payload not
// kept: callers canonicalize).
LOWBIT_HD float LbExpNonPositive(float x) {
  x = x > 0.0f ? 0.0f : x;          // comparisons are false for NaN: NaN passes through
  x = x < -109.0f ? -109.0f : x;    // exp(-109) rounds to 0; keeps n + 32 >= -126
  return LbExpNonPositiveInRange(x);
}

// num / d for 1 <= d <= 2 (NaN in gives NaN out), from FMAs only: a cubic minimax guess of
// 1 / d (relative error 1.7e-3), one Newton step (error 3e-6), then q = num r corrected by
// the residual num - d q. Normal results are within 0.5 ulp + 1e-11 relative of num / d
// (correctly rounded but for about 1 in 20000 near-ties); subnormal results within 1 ulp.
LOWBIT_HD float Fp32DivOneTwo(float num, float d) {
  float r = Fp32Fma(Fp32Fma(Fp32Fma(-0.2218371033668518f, d, 1.3310226202011108f), d,
                            -2.9393415451049805f), d, 2.828423023223877f);
  r = Fp32Fma(r, Fp32Fma(-d, r, 1.0f), r);
  const float q = Fp32Mul(num, r);
  return Fp32Fma(Fp32Fma(-d, q, num), r, q);
}

}  // namespace lowbit
