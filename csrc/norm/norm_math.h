// Elementwise normalization formulas shared by the CPU reference and the CUDA kernels
// (host + device). Device code uses the explicitly rounded intrinsics so that nvcc does
// not contract a * b + c into an FMA: with equal row statistics, CPU and CUDA then give
// bit-identical elementwise results.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/formats.h"
#include "common/fp32_math.h"

namespace lowbit {

// rsigma = 1 / sqrt(var + eps), correctly rounded sqrt and division.
LOWBIT_HD float NormRsigma(float var, float epsilon) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, epsilon)));
#else
  return 1.0f / std::sqrt(var + epsilon);
#endif
}

LOWBIT_HD float NormWeight(float gamma, bool zero_centered) {
  return zero_centered ? Fp32Add(1.0f, gamma) : gamma;
}

// xhat = (x - mu) * rsigma; mu is 0 for RMSNorm (x - 0 is exact).
LOWBIT_HD float NormXhat(float x, float mu, float rsigma) {
  return Fp32Mul(Fp32Add(x, -mu), rsigma);
}

// y = xhat * w (+ beta for LayerNorm).
LOWBIT_HD float NormOutput(float xhat, float w, float beta, bool has_beta) {
  const float y = Fp32Mul(xhat, w);
  return has_beta ? Fp32Add(y, beta) : y;
}

// dx = rsigma * (g - (xhat * mean_gx + mean_g)), g = dz * w.
LOWBIT_HD float NormDx(float g, float xhat, float mean_g, float mean_gx, float rsigma) {
  return Fp32Mul(rsigma, Fp32Add(g, -Fp32Add(Fp32Mul(xhat, mean_gx), mean_g)));
}

// The fused quantization: E4M3 (e5m2 == false) or E5M2 code of y * scale.
LOWBIT_HD uint8_t NormQuantize(float y, float scale, bool e5m2) {
  const float v = Fp32Mul(y, scale);
  return e5m2 ? FloatToE5m2(v) : FloatToE4m3(v);
}

}  // namespace lowbit
