// GoogleTest checks of the activation CPU reference and of LbExp: exp accuracy over the
// whole fp32 range, activation values at known points, the gated layout, clamped swiglu,
// the backward against finite differences, dbias and the fused quantization.
#include "activation/activation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/formats.h"

namespace lowbit {
namespace {

int64_t UlpDistance(float a, float b) {
  auto key = [](float f) {
    const int32_t i = int32_t(FloatBits(f));
    return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
  };
  return std::llabs(key(a) - key(b));
}

TEST(LbExp, WithinTwoUlpOfLibm) {
  int64_t worst = 0;
  for (float x = -87.0f; x < 88.7f; x += 0.0137f) {
    worst = std::max(worst, UlpDistance(LbExp(x), float(std::exp(double(x)))));
  }
  EXPECT_LE(worst, 2);
  EXPECT_EQ(LbExp(0.0f), 1.0f);
  EXPECT_TRUE(std::isinf(LbExp(89.0f)));
  EXPECT_EQ(LbExp(-200.0f), 0.0f);
  EXPECT_EQ(LbExp(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(LbExp(std::nanf(""))));
  EXPECT_GT(LbExp(-100.0f), 0.0f);  // subnormal range
  EXPECT_NEAR(LbExp(-100.0f) / std::exp(-100.0f), 1.0f, 1e-3f);
}

float Fwd(ActType t, float x, bool gated = false, float g = 0.0f) {
  ActParams p;
  p.type = t;
  p.gated = gated;
  return ActForwardValue(p, x, g);
}

TEST(ActMath, KnownValues) {
  const double k0 = std::sqrt(2.0 / M_PI);
  for (float x : {-3.0f, -0.5f, 0.0f, 0.7f, 2.0f}) {
    const double gelu = 0.5 * x * (1 + std::tanh(k0 * (x + 0.044715 * x * x * x)));
    EXPECT_NEAR(Fwd(ActType::kGelu, x), gelu, 1e-6);
    EXPECT_NEAR(Fwd(ActType::kSilu, x), x / (1 + std::exp(-double(x))), 1e-6);
    EXPECT_NEAR(Fwd(ActType::kQuickGelu, x), x / (1 + std::exp(-1.702 * x)), 1e-6);
    EXPECT_EQ(Fwd(ActType::kRelu, x), x > 0 ? x : 0.0f);
    EXPECT_EQ(Fwd(ActType::kSquaredRelu, x), x > 0 ? x * x : 0.0f);
    EXPECT_EQ(Fwd(ActType::kLinear, x), x);
    EXPECT_NEAR(Fwd(ActType::kSilu, x, true, 1.5f), 1.5 * x / (1 + std::exp(-double(x))), 1e-6);
  }
  EXPECT_TRUE(std::isnan(Fwd(ActType::kRelu, std::nanf(""))));
}

TEST(ActMath, ClampedSwiglu) {
  ActParams p;
  p.type = ActType::kClampedSilu;
  p.gated = true;
  p.limit = 7.0f;
  p.alpha = 1.702f;
  // act part clamped to <= 7, gate to [-7, 7], plus 1.
  const double a = 7.0, s = 1 / (1 + std::exp(-1.702 * a));
  EXPECT_NEAR(ActForwardValue(p, 9.0f, 10.0f), a * s * 8.0, 1e-4);
  EXPECT_NEAR(ActForwardValue(p, 1.0f, -10.0f), (1 / (1 + std::exp(-1.702))) * -6.0, 1e-5);
  float da, dg;
  ActBackwardValue(p, 1.0f, 9.0f, 10.0f, &da, &dg);
  EXPECT_EQ(da, 0.0f);
  EXPECT_EQ(dg, 0.0f);
}

TEST(ActMath, BackwardMatchesFiniteDifferences) {
  for (ActType t : {ActType::kGelu, ActType::kSilu, ActType::kQuickGelu, ActType::kSquaredRelu,
                    ActType::kClampedSilu}) {
    ActParams p;
    p.type = t;
    p.gated = true;
    for (float x : {-2.5f, -0.3f, 0.4f, 1.9f}) {
      const float g = 0.8f, h = 1e-2f;
      float da, dg;
      ActBackwardValue(p, 1.0f, x, g, &da, &dg);
      const double num_a = (double(ActForwardValue(p, x + h, g)) - ActForwardValue(p, x - h, g)) / (2 * h);
      const double num_g = (double(ActForwardValue(p, x, g + h)) - ActForwardValue(p, x, g - h)) / (2 * h);
      EXPECT_NEAR(da, num_a, 2e-3) << int(t) << " x=" << x;
      EXPECT_NEAR(dg, num_g, 2e-3) << int(t) << " x=" << x;
    }
  }
}

TEST(ActRef, GatedForwardLayoutQuantizeAndAmax) {
  // rows = 2, H = 3; x[r] = [a0 a1 a2 | g0 g1 g2].
  std::vector<float> x = {1, -2, 3, 2, 2, 2, 0.5f, 4, -1, 1, -1, 10};
  std::vector<float> y(6);
  std::vector<uint8_t> qr(6), qc(6);
  float amax = -1, scale = 2.0f;
  ActArgs a;
  a.params.type = ActType::kRelu;
  a.params.gated = true;
  a.rows = 2, a.hidden = 3, a.dtype = DType::kF32, a.q_dtype = DType::kE4M3;
  a.x = x.data(), a.scale = &scale, a.out = y.data(), a.q_rowwise = qr.data(), a.q_colwise = qc.data();
  a.amax = &amax;
  ASSERT_TRUE(ActForwardRef(a).ok());
  const std::vector<float> want = {2, 0, 6, 0.5f, -4, 0};
  EXPECT_EQ(y, want);
  EXPECT_EQ(amax, 6.0f);
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 3; ++c) {
      EXPECT_EQ(qr[r * 3 + c], FloatToE4m3(want[r * 3 + c] * 2.0f));
      EXPECT_EQ(qc[c * 2 + r], qr[r * 3 + c]);
    }
  }
}

TEST(ActRef, GatedBackwardDbias) {
  std::vector<float> x = {1, -2, 3, 4, 0.5f, 4, -1, 2};  // rows 2, H 2: [a0 a1 | g0 g1]
  std::vector<float> dz = {1, 2, 3, 4};
  std::vector<float> dx(8), dbias(4);
  float amax = 0;
  ActArgs a;
  a.params.type = ActType::kLinear;
  a.params.gated = true;
  a.rows = 2, a.hidden = 2, a.dtype = DType::kF32;
  a.x = x.data(), a.dz = dz.data(), a.out = dx.data(), a.amax = &amax, a.dbias = dbias.data();
  ASSERT_TRUE(ActBackwardRef(a).ok());
  // linear gated: y = a * g -> da = dz * g, dg = dz * a.
  const std::vector<float> want = {3, 8, 1, -4, 3 * -1.0f, 4 * 2.0f, 3 * 0.5f, 4 * 4.0f};
  EXPECT_EQ(dx, want);
  EXPECT_EQ(dbias, (std::vector<float>{0, 16, 2.5f, 12}));
  EXPECT_EQ(amax, 16.0f);
}

TEST(ActRef, RejectsBadDtypes) {
  float amax;
  ActArgs a;
  a.rows = 1, a.hidden = 1, a.dtype = DType::kS32, a.amax = &amax;
  Status s = ActForwardRef(a);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lowbit_act_forward: x"), std::string::npos);
}

}  // namespace
}  // namespace lowbit
