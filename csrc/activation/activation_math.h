// Activation formulas shared by the CPU reference and the CUDA kernels (host + device).
//
// All math is fp32 through common/fp32_math.h (explicit roundings: Fp32Mul/Add/Fma, no
// contraction left to the compiler), so the CPU reference and the CUDA kernels produce
// bit-identical activations and gradients.
//   sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0, e = exp(-|x|)
//                (LbExpNegAbs, LbExpNonPositive(-|x|)'s bits: e never overflows, 1 + e is
//                in [1, 2], the division is Fp32DivOneTwo; NaN gives NaN)
//   gelu       = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) * (x * (1 + 0.044715 x x)), computed as
//                x sigmoid(2u) (equal, and free of the cancellation in 1 + tanh(u) for x < 0)
//   silu       = x sigmoid(x);  quick_gelu = x sigmoid(1.702 x);  relu;  squared_relu = relu^2
//   clamped_silu (GPT-OSS, TE's clamped_swiglu act part) = c sigmoid(alpha c), c = min(x, limit)
// Gated forms: y = act(a) * gate(g) with gate(g) = g, or for clamped swiglu
// gate(g) = clamp(g, -limit, limit) + 1. Gradients follow TE: d/dx of min(x, limit) is 1
// where x <= limit, else 0; d gate / dg is 1 where |g| <= limit, else 0. NaN propagates
// through the clamps (a NaN input is never replaced by the limit). NaN results are the
// canonical 0x7FC00000 on both the CPU and the GPU (common/fp32_math.h: CanonicalNan).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/fp32_math.h"

namespace lowbit {

// Values of the act_type attribute (also lowbit/ops/activation.py: ACT_TYPES).
enum class ActType : int32_t {
  kLinear = 0,
  kGelu = 1,
  kSilu = 2,
  kRelu = 3,
  kQuickGelu = 4,
  kSquaredRelu = 5,
  kClampedSilu = 6,  // gated only: clamped swiglu
};

struct ActParams {
  ActType type = ActType::kLinear;
  bool gated = false;
  float limit = 7.0f;   // clamped swiglu
  float alpha = 1.702f;  // clamped swiglu
};

// min(|x|, 109), NaN in gives NaN out: one min.NaN with an |x| operand on the GPU.
LOWBIT_HD float AbsClampedTo109(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(fabsf(x)), "f"(109.0f));
  return r;
#else
  const float a = std::fabs(x);
  return a < 109.0f ? a : (x == x ? 109.0f : x);
#endif
}

// exp(-|x|) with LbExpNonPositive(-|x|)'s bits (common/fp32_math.h; NaN gives NaN): their
// shared core on y = -m, m = min(|x|, 109). For y = -|x| <= 0 LbExpNonPositive's clamp of
// y > 0 never fires and its clamp at -109 gives exactly -m; the negation is exact and folds
// into the core's FMA operands, so the GPU saves the sign OR and one min per element
// (activation_test.cc compares the two over every bf16/f16 value and a sweep of fp32).
LOWBIT_HD float LbExpNegAbs(float x) { return LbExpNonPositiveInRange(-AbsClampedTo109(x)); }

LOWBIT_HD float LbSigmoid(float x) {
  const float e = LbExpNegAbs(x);
  return Fp32DivOneTwo(x >= 0.0f ? 1.0f : e, Fp32Add(1.0f, e));
}

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;
constexpr float kQuickGeluAlpha = 1.702f;

// 2u, u = sqrt(2/pi) * x * (1 + 0.044715 x^2): 1 + tanh(u) = 2 sigmoid(2u), so gelu is
// computed as x sigmoid(2u), free of the cancellation of 1 + tanh(u) for negative x.
LOWBIT_HD float GeluTwoU(float x) {
  return Fp32Mul(Fp32Mul(2.0f * kGeluK0, x), Fp32Fma(Fp32Mul(kGeluK1, x), x, 1.0f));
}

LOWBIT_HD float ClampMax(float x, float limit) { return x > limit ? limit : x; }

// act(x) and d act / dx together. gelu, silu, quick_gelu and clamped_silu all have the
// form c sigmoid(t(c)), c = x (clamped_silu: min(x, limit)), with derivative
// s + c s (1 - s) t'(x), s = sigmoid(t); they share one sigmoid (one exp, one division), so
// each element inlines the exp and the division once, whatever the act_type (this keeps
// the CUDA kernels small: activation_tiled_kernel.cuh). Unused outputs are dead code once inlined.
//   t:   gelu 2u (GeluTwoU), silu x, quick_gelu 1.702 x, clamped_silu alpha c
//   t':  gelu 2 k0 (1 + 3 k1 x^2), silu 1, quick_gelu 1.702, clamped_silu alpha (0 where
//        x > limit)
LOWBIT_HD void ActValueAndDerivative(const ActParams& p, float x, float* value, float* deriv) {
  const ActType t = p.type;
  if (t == ActType::kLinear || t == ActType::kRelu || t == ActType::kSquaredRelu ||
      int32_t(t) > int32_t(ActType::kClampedSilu) || int32_t(t) < 0) {
    const bool pos = x > 0.0f, nan = !(x == x);
    const float r = pos ? x : (nan ? x : 0.0f);
    if (t == ActType::kRelu) {
      *value = r;
      *deriv = pos ? 1.0f : (nan ? x : 0.0f);
    } else if (t == ActType::kSquaredRelu) {
      *value = Fp32Mul(r, r);
      *deriv = pos ? Fp32Mul(2.0f, x) : (nan ? x : 0.0f);
    } else {
      *value = x;
      *deriv = 1.0f;
    }
    return;
  }
  // Branch-free per element (selects on the uniform type), so the kernels hold one copy of
  // the exp and the division per element rather than one per act type.
  const bool gelu = t == ActType::kGelu, clamped = t == ActType::kClampedSilu;
  const float k = clamped ? p.alpha : (t == ActType::kQuickGelu ? kQuickGeluAlpha : 1.0f);
  const float c = clamped ? ClampMax(x, p.limit) : x;
  const float arg = gelu ? GeluTwoU(x) : Fp32Mul(k, c);  // silu: 1 * x = x
  const float slope = gelu ? Fp32Mul(2.0f * kGeluK0, Fp32Fma(Fp32Mul(3.0f * kGeluK1, x), x, 1.0f)) : k;
  const float s = LbSigmoid(arg);
  const float cs = Fp32Mul(c, s);
  *value = cs;
  const float d = Fp32Fma(Fp32Mul(cs, Fp32Add(1.0f, -s)), slope, s);
  *deriv = (clamped && x > p.limit) ? 0.0f : d;
}

// act(x) for the activation part.
LOWBIT_HD float ActValue(const ActParams& p, float x) {
  float v, d;
  ActValueAndDerivative(p, x, &v, &d);
  return v;
}

// d act / dx.
LOWBIT_HD float ActDerivative(const ActParams& p, float x) {
  float v, d;
  ActValueAndDerivative(p, x, &v, &d);
  return d;
}

LOWBIT_HD bool IsClamped(const ActParams& p) { return p.type == ActType::kClampedSilu; }

LOWBIT_HD float GateValue(const ActParams& p, float g) {
  if (!IsClamped(p)) return g;
  const float c = g > p.limit ? p.limit : (g < -p.limit ? -p.limit : g);
  return Fp32Add(c, 1.0f);
}

LOWBIT_HD float GateDerivative(const ActParams& p, float g) {
  if (!IsClamped(p)) return 1.0f;
  return (g > p.limit || g < -p.limit) ? 0.0f : 1.0f;
}

// Forward before the NaN canonicalization (the CUDA kernel canonicalizes only chunks that
// hold a NaN: activation_tiled_kernel.cuh).
LOWBIT_HD float ActForwardValueRaw(const ActParams& p, float a, float g) {
  const float y = ActValue(p, a);
  return p.gated ? Fp32Mul(y, GateValue(p, g)) : y;
}

// Forward: y from the activation input a and (gated) the gate input g. A NaN result is
// the canonical 0x7FC00000 (CanonicalNan), on the CPU and on the GPU.
LOWBIT_HD float ActForwardValue(const ActParams& p, float a, float g) {
  return CanonicalNan(ActForwardValueRaw(p, a, g));
}

// Backward before the NaN canonicalization: da (and dg when gated) from dz, a, g.
LOWBIT_HD void ActBackwardValueRaw(const ActParams& p, float dz, float a, float g, float* da, float* dg) {
  float value, deriv;
  ActValueAndDerivative(p, a, &value, &deriv);
  if (!p.gated) {
    *da = Fp32Mul(dz, deriv);
    *dg = 0.0f;
    return;
  }
  *da = Fp32Mul(Fp32Mul(dz, GateValue(p, g)), deriv);
  *dg = Fp32Mul(Fp32Mul(dz, value), GateDerivative(p, g));
}

// Backward: da (and dg when gated) from dz, a, g; NaN results canonical as above.
LOWBIT_HD void ActBackwardValue(const ActParams& p, float dz, float a, float g, float* da,
                                float* dg) {
  ActBackwardValueRaw(p, dz, a, g, da, dg);
  *da = CanonicalNan(*da);
  *dg = CanonicalNan(*dg);
}

}  // namespace lowbit
