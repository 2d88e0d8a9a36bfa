// GoogleTest checks of the softmax CPU reference: rows sum to 1, scale, TE's mask value
// and fully masked rows, the causal mask, and the backward formula.
#include "softmax/softmax.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace lowbit {
namespace {

SoftmaxArgs Make(SoftmaxType t, int64_t q, int64_t k, const float* x, float* y) {
  SoftmaxArgs a;
  a.type = t;
  a.scale = 0.5f;
  a.batch = 1, a.heads = 1, a.q = q, a.k = k;
  a.dtype = DType::kF32;
  a.x = x;
  a.out = y;
  return a;
}

TEST(SoftmaxRef, ScaledRowsSumToOne) {
  std::vector<float> x = {1, 2, 3, -1, 0, 4};
  std::vector<float> y(6);
  ASSERT_TRUE(SoftmaxForwardRef(Make(SoftmaxType::kScaled, 2, 3, x.data(), y.data())).ok());
  for (int r = 0; r < 2; ++r) {
    double s = 0, e = 0;
    for (int j = 0; j < 3; ++j) s += y[r * 3 + j];
    EXPECT_NEAR(s, 1.0, 1e-6);
    for (int j = 0; j < 3; ++j) e += std::exp(0.5 * x[r * 3 + j]);
    EXPECT_NEAR(y[r * 3], std::exp(0.5 * x[r * 3]) / e, 1e-6);
  }
}

TEST(SoftmaxRef, MaskedAndFullyMasked) {
  std::vector<float> x = {1, 2, 3, 1, 2, 3};
  std::vector<uint8_t> mask = {0, 1, 0, 1, 1, 1};
  std::vector<float> y(6);
  SoftmaxArgs a = Make(SoftmaxType::kScaledMasked, 2, 3, x.data(), y.data());
  a.mask = mask.data();
  a.mask_batch = 1;
  ASSERT_TRUE(SoftmaxForwardRef(a).ok());
  EXPECT_NEAR(y[1], std::exp(-10000.0), 1e-30);
  EXPECT_NEAR(y[0] + y[2], 1.0, 1e-6);
  for (int j = 3; j < 6; ++j) EXPECT_EQ(y[j], 0.0f);  // fully masked row -> zeros (TE)
}

TEST(SoftmaxRef, CausalAndBackward) {
  std::vector<float> x = {1, 9, 9, 1, 2, 9, 1, 2, 3};
  std::vector<float> y(9), dy = {1, 2, 3, 4, 5, 6, 7, 8, 9}, dx(9);
  SoftmaxArgs a = Make(SoftmaxType::kScaledUpperTriang, 3, 3, x.data(), y.data());
  ASSERT_TRUE(SoftmaxForwardRef(a).ok());
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_EQ(y[5], 0.0f);
  a.dy = dy.data();
  a.y_in = y.data();
  a.out = dx.data();
  ASSERT_TRUE(SoftmaxBackwardRef(a).ok());
  for (int r = 0; r < 3; ++r) {
    double s = 0;
    for (int j = 0; j < 3; ++j) s += double(y[r * 3 + j]) * dy[r * 3 + j];
    for (int j = 0; j < 3; ++j) {
      EXPECT_NEAR(dx[r * 3 + j], 0.5 * y[r * 3 + j] * (dy[r * 3 + j] - s), 1e-5);
    }
  }
}

}  // namespace
}  // namespace lowbit
