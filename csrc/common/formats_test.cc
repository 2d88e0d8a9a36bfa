// GoogleTest checks of common/formats.h that need no Python: every finite code of each
// narrow format round-trips through decode/encode, codes are monotonic in value, and
// saturation, NaN and the E8M0 scale rules behave as documented. The exhaustive
// comparison with ml_dtypes lives in tests/test_formats.py.
#include "common/formats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace lowbit {
namespace {

const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

TEST(Formats, E4m3RoundTripsEveryFiniteCode) {
  float prev = -1.0f;
  for (int c = 0; c < 0x7F; ++c) {
    float v = E4m3ToFloat(uint8_t(c));
    EXPECT_EQ(FloatToE4m3(v), c) << "code " << c;
    EXPECT_EQ(FloatToE4m3(-v), c | 0x80) << "code " << c;
    EXPECT_GT(v, prev) << "code " << c;
    prev = v;
  }
  EXPECT_EQ(E4m3ToFloat(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0x7F)));
}

TEST(Formats, E5m2RoundTripsEveryFiniteCode) {
  float prev = -1.0f;
  for (int c = 0; c < 0x7C; ++c) {
    float v = E5m2ToFloat(uint8_t(c));
    EXPECT_EQ(FloatToE5m2(v), c) << "code " << c;
    EXPECT_GT(v, prev) << "code " << c;
    prev = v;
  }
  EXPECT_EQ(E5m2ToFloat(0x7B), 57344.0f);
  EXPECT_TRUE(std::isinf(E5m2ToFloat(0x7C)));
}

TEST(Formats, E2m1Values) {
  const float expected[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(E2m1ToFloat(uint8_t(c)), expected[c]);
    EXPECT_EQ(E2m1ToFloat(uint8_t(c | 8)), -expected[c]);
    EXPECT_EQ(FloatToE2m1(expected[c]), c);
  }
  EXPECT_EQ(FloatToE2m1(2.5f), 4);   // tie -> even (2.0)
  EXPECT_EQ(FloatToE2m1(3.5f), 6);   // tie -> even (4.0)
  EXPECT_EQ(FloatToE2m1(0.25f), 0);  // tie -> even (0)
}

TEST(Formats, SaturatesAndKeepsNan) {
  EXPECT_EQ(FloatToE4m3(1e9f), 0x7E);
  EXPECT_EQ(FloatToE4m3(-kInf), 0xFE);
  EXPECT_EQ(FloatToE4m3(464.0f), 0x7E);  // would round to 480 (NaN code): saturates
  EXPECT_EQ(FloatToE4m3(kNan), 0x7F);
  EXPECT_EQ(FloatToE5m2(kInf), 0x7B);
  EXPECT_TRUE(std::isnan(E5m2ToFloat(FloatToE5m2(kNan))));
  EXPECT_EQ(FloatToE2m1(100.0f), 0x7);
  EXPECT_EQ(FloatToE4m3(-0.0f), 0x80);
}

TEST(Formats, E8m0ScaleRoundUp) {
  EXPECT_EQ(E8m0FromScaleRoundUp(1.0f), 127);
  EXPECT_EQ(E8m0FromScaleRoundUp(1.0000001f), 128);
  EXPECT_EQ(E8m0FromScaleRoundUp(0.75f), 127);
  EXPECT_EQ(E8m0FromScaleRoundUp(kNan), 0xFF);
  EXPECT_EQ(E8m0ToFloat(127), 1.0f);
  EXPECT_EQ(E8m0ToFloat(130), 8.0f);
}

TEST(Formats, StochasticPicksOnlyNeighbours) {
  // 1.1 lies between E4M3 values 1.0 and 1.125.
  for (uint32_t r : {0u, 1u, 0x7FFFFFFFu, 0xC0000000u, 0xFFFFFFFFu}) {
    uint8_t c = FloatToE4m3Stochastic(1.1f, r);
    EXPECT_TRUE(c == 0x38 || c == 0x39) << int(c);
  }
  // Representable values never move.
  EXPECT_EQ(FloatToE4m3Stochastic(1.125f, 0xFFFFFFFFu), 0x39);
  EXPECT_EQ(FloatToE4m3Stochastic(1.0f, 0u), 0x38);
}

TEST(Formats, HalfAndBf16) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(FloatToFp16(1.0f), 0x3C00);
  EXPECT_EQ(Fp16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7C00);  // rounds past the max: inf
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7BFF);
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));
}

}  // namespace
}  // namespace lowbit
