#include "scale/scale.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

namespace lowbit {
namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNan = std::numeric_limits<float>::quiet_NaN();

float Current(float amax, bool pow2 = false, float* inv = nullptr) {
  float s = 0.0f, si = 0.0f;
  EXPECT_TRUE(ComputeScaleRef(&amax, 1, 448.0f, pow2, &s, &si).ok());
  if (inv != nullptr) *inv = si;
  return s;
}

TEST(ComputeScaleRef, RulesOfDelayedPy) {
  EXPECT_EQ(Current(2.0f), 224.0f);
  EXPECT_EQ(Current(0.0f), 1.0f);
  EXPECT_EQ(Current(-0.0f), 1.0f);
  EXPECT_EQ(Current(-3.0f), 1.0f);
  EXPECT_EQ(Current(kInf), 1.0f);
  EXPECT_EQ(Current(kNan), 1.0f);
  EXPECT_EQ(Current(BitsToFloat(1u)), FLT_MAX);  // denormal: the quotient overflows
  EXPECT_EQ(Current(1e-37f), FLT_MAX);
  EXPECT_EQ(Current(3.0f), 448.0f / 3.0f);
  EXPECT_EQ(Current(3.0f, true), 128.0f);
  float inv = 0.0f;
  EXPECT_EQ(Current(1e-37f, true, &inv), std::ldexp(1.0f, 127));
  EXPECT_EQ(FloatBits(inv), 0x00400000u);  // 2^-127, a denormal: not flushed
}

TEST(ScaleInverseRef, NanSignIsDefined) {
  const std::vector<float> s = {4.0f, 0.0f, -kNan, kInf};
  std::vector<float> inv(4);
  ASSERT_TRUE(ScaleInverseRef(s.data(), 4, inv.data()).ok());
  EXPECT_EQ(inv[0], 0.25f);
  EXPECT_EQ(inv[1], kInf);
  EXPECT_EQ(FloatBits(inv[2]), 0xFFC00000u);
  EXPECT_EQ(inv[3], 0.0f);
}

TEST(UpdateDelayedScalingRef, RollMaxMarginAndKeep) {
  const std::vector<float> h = {9.0f, 1.0f, 4.0f};
  std::vector<float> nh(3);
  float scale = 5.0f, s = 0.0f, inv = 0.0f;
  float amax = 2.0f;
  ASSERT_TRUE(UpdateDelayedScalingRef(h.data(), 3, &scale, &amax, 448.0f, 1, false, nh.data(), &s, &inv).ok());
  EXPECT_EQ(s, 448.0f / 4.0f / 2.0f);
  EXPECT_EQ(inv, 1.0f / s);
  EXPECT_EQ(nh, (std::vector<float>{0.0f, 4.0f, 2.0f}));
  ASSERT_TRUE(UpdateDelayedScalingRef(h.data(), 3, &scale, &amax, 448.0f, 0, true, nh.data(), &s, &inv).ok());
  EXPECT_EQ(s, 224.0f);
  amax = kNan;
  ASSERT_TRUE(UpdateDelayedScalingRef(h.data(), 3, &scale, &amax, 448.0f, 0, false, nh.data(), &s, &inv).ok());
  EXPECT_EQ(s, 5.0f);
  amax = 1e10f;  // 448 / 1e10 / 2^120 is a denormal, kept as one
  ASSERT_TRUE(UpdateDelayedScalingRef(h.data(), 1, &scale, &amax, 448.0f, 120, false, nh.data(), &s, &inv).ok());
  EXPECT_EQ(s, 448.0f / 1e10f / std::ldexp(1.0f, 120));
  EXPECT_LT(s, FLT_MIN);
  EXPECT_GT(s, 0.0f);
  EXPECT_EQ(nh[0], 0.0f);
  EXPECT_FALSE(UpdateDelayedScalingRef(h.data(), 0, &scale, &amax, 448.0f, 0, false, nh.data(), &s, &inv).ok());
}

}  // namespace
}  // namespace lowbit
