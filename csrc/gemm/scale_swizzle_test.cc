// The scale swizzle's CPU reference (scale_swizzle.h): the documented tile order on a hand
// example, the round trip through ScaleUnswizzleRef, the zeroed invalid region, bad shapes.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gemm/scale_swizzle.h"

namespace lowbit {
namespace {

ScaleSwizzleArgs Args(const std::vector<uint8_t>& in, std::vector<uint8_t>& out, int64_t rows,
                      int64_t cols, int64_t valid_rows, int64_t valid_cols) {
  ScaleSwizzleArgs a;
  a.in = in.data();
  a.out = out.data();
  a.rows = rows;
  a.cols = cols;
  a.valid_rows = valid_rows;
  a.valid_cols = valid_cols;
  return a;
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = uint8_t(gen());
  return v;
}

TEST(ScaleSwizzle, OffsetsOfTheDocumentedLayout) {
  // One 128 x 4 tile: row r, col c at (r % 32) * 16 + (r / 32) * 4 + c.
  EXPECT_EQ(SwizzledScaleOffset(0, 0, 4), 0);
  EXPECT_EQ(SwizzledScaleOffset(0, 3, 4), 3);
  EXPECT_EQ(SwizzledScaleOffset(32, 0, 4), 4);
  EXPECT_EQ(SwizzledScaleOffset(1, 0, 4), 16);
  EXPECT_EQ(SwizzledScaleOffset(127, 3, 4), 31 * 16 + 3 * 4 + 3);
  // Tiles are rb-major: with 8 columns, (0, 4) starts tile 1 and (128, 0) tile 2.
  EXPECT_EQ(SwizzledScaleOffset(0, 4, 8), 512);
  EXPECT_EQ(SwizzledScaleOffset(128, 0, 8), 1024);
  EXPECT_EQ(SwizzledScaleOffset(200, 6, 8), (1 * 2 + 1) * 512 + (200 % 32) * 16 + (72 / 32) * 4 + 2);
}

TEST(ScaleSwizzle, RoundTripsAndWritesEveryByte) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{128, 4}, {256, 8}, {384, 36}}) {
    const auto in = RandomBytes(size_t(rows * cols), uint32_t(rows + cols));
    std::vector<uint8_t> swizzled(in.size(), 0xAB), back(in.size(), 0xCD);
    ASSERT_TRUE(ScaleSwizzleRef(Args(in, swizzled, rows, cols, rows, cols)).ok());
    // A permutation: every output byte came from a distinct input byte.
    std::vector<int> hits(in.size(), 0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) ++hits[size_t(SwizzledScaleOffset(r, c, cols))];
    }
    for (int h : hits) ASSERT_EQ(h, 1);
    ASSERT_TRUE(ScaleUnswizzleRef(swizzled.data(), back.data(), rows, cols).ok());
    EXPECT_EQ(back, in);
  }
}

TEST(ScaleSwizzle, ZeroesEntriesPastTheValidRegion) {
  const int64_t rows = 256, cols = 8;
  const auto in = RandomBytes(size_t(rows * cols), 3);
  std::vector<uint8_t> swizzled(in.size(), 0xAB), back(in.size());
  ASSERT_TRUE(ScaleSwizzleRef(Args(in, swizzled, rows, cols, 130, 5)).ok());
  ASSERT_TRUE(ScaleUnswizzleRef(swizzled.data(), back.data(), rows, cols).ok());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t want = r < 130 && c < 5 ? in[size_t(r * cols + c)] : 0;
      ASSERT_EQ(back[size_t(r * cols + c)], want) << r << ", " << c;
    }
  }
}

TEST(ScaleSwizzle, RejectsShapesOffTheTiles) {
  std::vector<uint8_t> in(1024), out(1024);
  EXPECT_FALSE(ScaleSwizzleRef(Args(in, out, 100, 4, 100, 4)).ok());
  EXPECT_FALSE(ScaleSwizzleRef(Args(in, out, 128, 6, 128, 6)).ok());
  const Status s = ScaleSwizzleRef(Args(in, out, 128, 4, 129, 4));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("valid_rows"), std::string::npos);
  EXPECT_FALSE(ScaleUnswizzleRef(in.data(), out.data(), 128, 3).ok());
}

}  // namespace
}  // namespace lowbit
