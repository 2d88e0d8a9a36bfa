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
// through the clamps (a NaN input is never replaced by the limit).
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

// act(x) for the activation part.
LOWBIT_HD float ActValue(const ActParams& p, float x) {
  switch (p.type) {
    case ActType::kGelu: return Fp32Mul(x, LbSigmoid(GeluTwoU(x)));
    case ActType::kSilu: return Fp32Mul(x, LbSigmoid(x));
    case ActType::kRelu: return x > 0.0f ? x : (x == x ? 0.0f : x);
    case ActType::kQuickGelu: return Fp32Mul(x, LbSigmoid(Fp32Mul(kQuickGeluAlpha, x)));
    case ActType::kSquaredRelu: {
      const float r = x > 0.0f ? x : (x == x ? 0.0f : x);
      return Fp32Mul(r, r);
    }
    case ActType::kClampedSilu: {
      const float c = ClampMax(x, p.limit);
      return Fp32Mul(c, LbSigmoid(Fp32Mul(p.alpha, c)));
    }
    default: return x;
  }
}

// d act / dx.
LOWBIT_HD float ActDerivative(const ActParams& p, float x) {
  switch (p.type) {
    case ActType::kGelu: {
      // s + x s (1 - s) d(2u)/dx, s = sigmoid(2u), d(2u)/dx = 2 k0 (1 + 3 k1 x^2)
      const float s = LbSigmoid(GeluTwoU(x));
      const float d2u = Fp32Mul(2.0f * kGeluK0, Fp32Add(1.0f, Fp32Mul(Fp32Mul(3.0f * kGeluK1, x), x)));
      return Fp32Add(s, Fp32Mul(Fp32Mul(Fp32Mul(x, s), Fp32Add(1.0f, -s)), d2u));
    }
    case ActType::kSilu: {
      const float s = LbSigmoid(x);  // s (1 + x (1 - s))
      return Fp32Mul(s, Fp32Add(1.0f, Fp32Mul(x, Fp32Add(1.0f, -s))));
    }
    case ActType::kRelu: return x > 0.0f ? 1.0f : (x == x ? 0.0f : x);
    case ActType::kQuickGelu: {
      const float s = LbSigmoid(Fp32Mul(kQuickGeluAlpha, x));
      return Fp32Mul(s, Fp32Add(1.0f, Fp32Mul(Fp32Mul(kQuickGeluAlpha, x), Fp32Add(1.0f, -s))));
    }
    case ActType::kSquaredRelu: return x > 0.0f ? Fp32Mul(2.0f, x) : (x == x ? 0.0f : x);
    case ActType::kClampedSilu: {
      if (x > p.limit) return 0.0f;
      const float s = LbSigmoid(Fp32Mul(p.alpha, x));
      return Fp32Mul(s, Fp32Add(1.0f, Fp32Mul(Fp32Mul(p.alpha, x), Fp32Add(1.0f, -s))));
    }
    default: return 1.0f;
  }
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

// Forward: y from the activation input a and (gated) the gate input g.
LOWBIT_HD float ActForwardValue(const ActParams& p, float a, float g) {
  const float y = ActValue(p, a);
  return p.gated ? Fp32Mul(y, GateValue(p, g)) : y;
}

// Backward: da (and dg when gated) from dz, a, g.
LOWBIT_HD void ActBackwardValue(const ActParams& p, float dz, float a, float g, float* da,
                                float* dg) {
  if (!p.gated) {
    *da = Fp32Mul(dz, ActDerivative(p, a));
    *dg = 0.0f;
    return;
  }
  *da = Fp32Mul(Fp32Mul(dz, GateValue(p, g)), ActDerivative(p, a));
  *dg = Fp32Mul(Fp32Mul(dz, ActValue(p, a)), GateDerivative(p, g));
}

}  // namespace lowbit
