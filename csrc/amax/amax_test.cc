// GoogleTest checks of the amax CPU reference: values, NaN and inf, dtypes, row split.
#include "amax/amax.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/formats.h"

namespace lowbit {
namespace {

TEST(AmaxRef, RowsOfF32) {
  std::vector<float> x = {1.0f, -7.5f, 3.0f, 0.25f, -0.5f, 2.0f};
  float out[2];
  ASSERT_TRUE(AmaxRef(x.data(), DType::kF32, 2, 3, out).ok());
  EXPECT_EQ(out[0], 7.5f);
  EXPECT_EQ(out[1], 2.0f);
}

TEST(AmaxRef, NanBeatsInf) {
  std::vector<float> x = {1.0f, -std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::quiet_NaN()};
  float out;
  ASSERT_TRUE(AmaxRef(x.data(), DType::kF32, 1, 3, &out).ok());
  EXPECT_TRUE(std::isnan(out));
  ASSERT_TRUE(AmaxRef(x.data(), DType::kF32, 1, 2, &out).ok());
  EXPECT_TRUE(std::isinf(out) && out > 0);
}

TEST(AmaxRef, Bf16AndF16) {
  std::vector<uint16_t> bf = {FloatToBf16(-3.0f), FloatToBf16(2.0f)};
  std::vector<uint16_t> hf = {FloatToFp16(0.5f), FloatToFp16(-65504.0f)};
  float out;
  ASSERT_TRUE(AmaxRef(bf.data(), DType::kBF16, 1, 2, &out).ok());
  EXPECT_EQ(out, 3.0f);
  ASSERT_TRUE(AmaxRef(hf.data(), DType::kF16, 1, 2, &out).ok());
  EXPECT_EQ(out, 65504.0f);
}

TEST(AmaxRef, EmptyRowIsZeroAndBadDtypeFails) {
  float out = -1.0f;
  ASSERT_TRUE(AmaxRef(nullptr, DType::kF32, 1, 0, &out).ok());
  EXPECT_EQ(out, 0.0f);
  Status s = AmaxRef(nullptr, DType::kS32, 1, 0, &out);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lowbit_amax: x"), std::string::npos);
}

}  // namespace
}  // namespace lowbit
