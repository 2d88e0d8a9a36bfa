// Correctly rounded fp32 arithmetic that is identical on host and device, and an exp
// built from it, for code whose CPU reference and CUDA kernel must agree bit for bit.
//
// Device code uses the explicitly rounded intrinsics so that nvcc does not contract
// a * b + c into an FMA; host code relies on the compiler not contracting either (GCC and
// Clang do not on x86-64 without -mfma, the flags lowbit builds with).
// LbExp is Cephes' expf: range reduction by ln2 split in two parts, a degree-6 polynomial,
// 2^n applied in two exact steps; within 2 ulp of exp over the whole range; it overflows to
// inf above 88.72 and returns 0 below -103.97; NaN stays NaN; exp(-inf) = 0.
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

}  // namespace lowbit
