// GoogleTest checks of the activation CPU reference and of its fp32 math: LbExp and
// LbExpNonPositive accuracy against double over their ranges, LbExpNegAbs bit for bit
// against LbExpNonPositive(-|x|), Fp32DivOneTwo and LbSigmoid,
// activation values at known points, the gated layout, clamped swiglu, the backward against
// finite differences, dbias and the fused quantization.
#include "activation/activation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/element.h"
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

// |got - want| in units of the fp32 spacing at want (2^-149 for subnormal results).
double UlpError(float got, double want) {
  int e = 0;
  std::frexp(std::fabs(want), &e);
  return std::fabs(double(got) - want) / std::ldexp(1.0, std::max(e - 24, -149));
}

float FloatAt(uint32_t bits) { return BitsToFloat(bits); }

TEST(LbExpNonPositive, WithinOneUlpOfExp) {
  // Every 61st float of [-109, 0] (the exhaustive sweep gives 0.88 ulp worst, subnormal
  // results included).
  double worst = 0;
  for (uint32_t b = 0x80000000u; b <= 0xC2DA0000u; b += 61) {
    const float x = FloatAt(b);
    worst = std::max(worst, UlpError(LbExpNonPositive(x), std::exp(double(x))));
  }
  EXPECT_LE(worst, 1.0);
  EXPECT_EQ(LbExpNonPositive(0.0f), 1.0f);
  EXPECT_EQ(LbExpNonPositive(-0.0f), 1.0f);
  EXPECT_EQ(LbExpNonPositive(3.0f), 1.0f);  // x > 0 is taken as 0
  EXPECT_EQ(LbExpNonPositive(-110.0f), 0.0f);
  EXPECT_EQ(LbExpNonPositive(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(LbExpNonPositive(std::nanf(""))));
  EXPECT_EQ(LbExpNonPositive(-1e-8f), 1.0f);
  EXPECT_EQ(LbExpNonPositive(-103.0f), float(std::exp(-103.0)));  // subnormal, rounded once
}

// LbExpNegAbs(x) must give LbExpNonPositive(-|x|)'s bits (both NaN for NaN x): every bf16
// value (the high 16 bits of a float), every f16 value, every 101st fp32 bit pattern (a
// one-off sweep of all 2^32 patterns found no difference either).
bool SameExp(float x) {
  const float a = LbExpNegAbs(x), b = LbExpNonPositive(-std::fabs(x));
  return (a != a && b != b) || FloatBits(a) == FloatBits(b);
}

TEST(LbExpNegAbs, BitIdenticalToLbExpNonPositiveOfMinusAbs) {
  int64_t mismatches = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    mismatches += !SameExp(FloatAt(h << 16));
    mismatches += !SameExp(LoadAsFloat(F16{}, uint16_t(h)));
  }
  for (uint32_t b = 0; b < 0xFFFFFFFFu - 101; b += 101) mismatches += !SameExp(FloatAt(b));
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(LbExpNegAbs(0.0f), 1.0f);
  EXPECT_EQ(LbExpNegAbs(-110.0f), 0.0f);
  EXPECT_EQ(LbExpNegAbs(std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isnan(LbExpNegAbs(std::nanf(""))));
}

TEST(Fp32DivOneTwo, CorrectlyRoundedNearlyAlways) {
  double worst_normal = 0, worst_subnormal = 0;
  int64_t not_rounded = 0, n = 0;
  for (uint32_t b = 0x3F800000u; b <= 0x40000000u; b += 7) {
    const float d = FloatAt(b);
    for (float num : {1.0f, 0.7f, 0.123456f, 0.99999994f, 1e-30f, -3.5f, 2e-39f}) {
      const float q = Fp32DivOneTwo(num, d);
      const double want = double(num) / double(d), err = UlpError(q, want);
      if (std::fabs(want) >= double(std::numeric_limits<float>::min())) {
        worst_normal = std::max(worst_normal, err);
        not_rounded += q != num / d;
        ++n;
      } else {
        worst_subnormal = std::max(worst_subnormal, err);
      }
    }
  }
  EXPECT_LE(worst_normal, 0.5 + 1e-3);
  EXPECT_LE(not_rounded * 10000, n);  // measured: about 1 in 20000
  EXPECT_LE(worst_subnormal, 1.0);
  EXPECT_EQ(Fp32DivOneTwo(1.0f, 2.0f), 0.5f);
  EXPECT_EQ(Fp32DivOneTwo(0.0f, 1.5f), 0.0f);
  EXPECT_TRUE(std::isnan(Fp32DivOneTwo(std::nanf(""), 1.5f)));
  EXPECT_TRUE(std::isnan(Fp32DivOneTwo(1.0f, std::nanf(""))));
}

TEST(LbSigmoid, WithinThreeUlp) {
  double worst = 0;
  for (uint32_t b = 0; b < 0xFFFFFFFFu - 1013; b += 1013) {  // every 1013th float, |x| <= 120
    const float x = FloatAt(b);
    if (!(std::fabs(x) <= 120.0f)) continue;
    worst = std::max(worst, UlpError(LbSigmoid(x), 1.0 / (1.0 + std::exp(-double(x)))));
  }
  EXPECT_LE(worst, 3.0);  // measured 2.4 (a sweep of every 13th float)
  EXPECT_EQ(LbSigmoid(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(LbSigmoid(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(LbSigmoid(0.0f), 0.5f);
  EXPECT_TRUE(std::isnan(LbSigmoid(std::nanf(""))));
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

// The bias: every output of x with a bias is that of x + bias (the fp32 sum) without one,
// forward and backward, gated, bf16 (the widened add, not rounded back to bf16).
TEST(ActRef, BiasIsTheFp32SumOfTheWidenedValues) {
  const int64_t rows = 3, h = 5;
  std::vector<uint16_t> x(rows * 2 * h), dz(rows * h), bias(2 * h);
  for (size_t i = 0; i < x.size(); ++i) x[i] = FloatToBf16(0.37f * float(int(i % 11) - 5) + 0.01f * float(i));
  for (size_t i = 0; i < dz.size(); ++i) dz[i] = FloatToBf16(0.5f - 0.13f * float(i));
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = FloatToBf16(0.003f * float(i) - 0.7f);
  std::vector<float> xb(x.size()), dzf(dz.size());  // the widened sum, and dz, as fp32
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 2 * h; ++c) xb[r * 2 * h + c] = Bf16ToFloat(x[r * 2 * h + c]) + Bf16ToFloat(bias[c]);
  }
  for (size_t i = 0; i < dz.size(); ++i) dzf[i] = Bf16ToFloat(dz[i]);
  for (const bool backward : {false, true}) {
    const int64_t cols = backward ? 2 * h : h;
    std::vector<uint16_t> out(rows * cols), dbias(2 * h);
    std::vector<float> out_f32(rows * cols), dbias_f32(2 * h);
    float amax = 0, amax_f32 = 0, scale = 4.0f;
    std::vector<uint8_t> qc(rows * cols), qc_f32(rows * cols);
    ActArgs a;
    a.params.type = ActType::kGelu;
    a.params.gated = true;
    a.rows = rows, a.hidden = h, a.dtype = DType::kBF16, a.q_dtype = DType::kE4M3;
    a.x = x.data(), a.bias = bias.data(), a.dz = dz.data(), a.scale = &scale, a.amax = &amax;
    a.out = out.data(), a.q_colwise = qc.data(), a.dbias = backward ? dbias.data() : nullptr;
    ActArgs f = a;  // fp32 x = the sum, no bias
    f.dtype = DType::kF32, f.x = xb.data(), f.bias = nullptr, f.dz = dzf.data(), f.amax = &amax_f32;
    f.out = out_f32.data(), f.q_colwise = qc_f32.data(), f.dbias = backward ? dbias_f32.data() : nullptr;
    ASSERT_TRUE((backward ? ActBackwardRef(a) : ActForwardRef(a)).ok());
    ASSERT_TRUE((backward ? ActBackwardRef(f) : ActForwardRef(f)).ok());
    EXPECT_EQ(FloatBits(amax), FloatBits(amax_f32)) << backward;
    EXPECT_EQ(qc, qc_f32) << backward;
    for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], FloatToBf16(out_f32[i])) << backward << " " << i;
    if (backward) {
      for (size_t i = 0; i < dbias.size(); ++i) EXPECT_EQ(dbias[i], FloatToBf16(dbias_f32[i])) << i;
    }
  }
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
