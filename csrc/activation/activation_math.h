// Activation formulas shared by the CPU reference and the CUDA kernels (host + device).
//
// All math is fp32 through common/fp32_math.h (exp = LbExp, no FMA contraction), so the
// CPU reference and the CUDA kernels produce bit-identical activations and gradients.
//   sigmoid(x) = 1 / (1 + exp(-x))
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

LOWBIT_HD float LbSigmoid(float x) { return Fp32Div(1.0f, Fp32Add(1.0f, LbExp(-x))); }

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;
constexpr float kQuickGeluAlpha = 1.702f;

// 2u, u = sqrt(2/pi) * x * (1 + 0.044715 x^2): 1 + tanh(u) = 2 sigmoid(2u), so gelu is
// computed as x sigmoid(2u), free of the cancellation of 1 + tanh(u) for negative x.
LOWBIT_HD float GeluTwoU(float x) {
  const float inner = Fp32Mul(x, Fp32Add(1.0f, Fp32Mul(Fp32Mul(kGeluK1, x), x)));
  return Fp32Mul(2.0f * kGeluK0, inner);
}

LOWBIT_HD float ClampMax(float x, float limit) { return x > limit ? limit : x; }

// act(x) and d act / dx together. gelu, silu, quick_gelu and clamped_silu all have the
// form c sigmoid(t(c)), c = x (clamped_silu: min(x, limit)), with derivative
// s + c s (1 - s) t'(x), s = sigmoid(t); they share one sigmoid (one exp, one division), so
// each element inlines the exp and the division once, whatever the act_type (this keeps
// the CUDA kernels small: activation.cu). Unused outputs are dead code once inlined.
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
  float c = x, arg, slope;
  if (t == ActType::kGelu) {
    arg = GeluTwoU(x);
    slope = Fp32Mul(2.0f * kGeluK0, Fp32Add(1.0f, Fp32Mul(Fp32Mul(3.0f * kGeluK1, x), x)));
  } else if (t == ActType::kSilu) {
    arg = x;
    slope = 1.0f;
  } else if (t == ActType::kQuickGelu) {
    arg = Fp32Mul(kQuickGeluAlpha, x);
    slope = kQuickGeluAlpha;
  } else {  // kClampedSilu
    c = ClampMax(x, p.limit);
    arg = Fp32Mul(p.alpha, c);
    slope = p.alpha;
  }
  const float s = LbSigmoid(arg);
  const float cs = Fp32Mul(c, s);
  *value = cs;
  const float d = Fp32Add(s, Fp32Mul(Fp32Mul(cs, Fp32Add(1.0f, -s)), slope));
  *deriv = (t == ActType::kClampedSilu && x > p.limit) ? 0.0f : d;
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

// Forward: y from the activation input a and (gated) the gate input g. A NaN result is
// the canonical 0x7FC00000 (CanonicalNan), on the CPU and on the GPU.
LOWBIT_HD float ActForwardValue(const ActParams& p, float a, float g) {
  const float y = ActValue(p, a);
  return CanonicalNan(p.gated ? Fp32Mul(y, GateValue(p, g)) : y);
}

// Backward: da (and dg when gated) from dz, a, g; NaN results canonical as above.
LOWBIT_HD void ActBackwardValue(const ActParams& p, float dz, float a, float g, float* da,
                                float* dg) {
  float value, deriv;
  ActValueAndDerivative(p, a, &value, &deriv);
  if (!p.gated) {
    *da = CanonicalNan(Fp32Mul(dz, deriv));
    *dg = 0.0f;
    return;
  }
  *da = CanonicalNan(Fp32Mul(Fp32Mul(dz, GateValue(p, g)), deriv));
  *dg = CanonicalNan(Fp32Mul(Fp32Mul(dz, value), GateDerivative(p, g)));
}

}  // namespace lowbit
