// GoogleTest checks of the grouped FP8 quantize CPU reference: each group equals the
// per-tensor reference (QuantizeFp8Ref) run on its rows with the group's scale (given, or
// ComputeScaleRef of its amax), the colwise copy is the transpose with groups as column
// ranges, padding rows are zero codes, negative / oversized group sizes are clipped, and
// bad arguments are errors; the CUDA kernels' row -> group lookup against the definition.
#include "quantize/quantize_grouped.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/formats.h"
#include "quantize/quantize.h"
#include "scale/scale.h"

namespace lowbit {
namespace {

struct Outputs {
  std::vector<uint8_t> rowwise, colwise;
  std::vector<float> amax, scale, scale_inv;
};

// `sizes` must outlive the returned args (they point into it).
QuantizeGroupedFp8Args Args(const std::vector<float>& x, int64_t rows, int64_t cols,
                            const std::vector<int32_t>& sizes, Outputs* o) {
  o->rowwise.assign(size_t(rows * cols), 0xAA);  // garbage: every byte must be written
  o->colwise.assign(size_t(rows * cols), 0xAA);
  o->amax.assign(sizes.size(), -1.0f);
  o->scale.assign(sizes.size(), -1.0f);
  o->scale_inv.assign(sizes.size(), -1.0f);
  QuantizeGroupedFp8Args a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.rows = rows;
  a.cols = cols;
  a.group_sizes = sizes.data();
  a.groups = int64_t(sizes.size());
  a.out_dtype = DType::kE4M3;
  a.rowwise = o->rowwise.data();
  a.colwise = o->colwise.data();
  a.amax = o->amax.data();
  a.scale_out = o->scale.data();
  a.scale_inv = o->scale_inv.data();
  return a;
}

std::vector<float> RandomWithSpecials(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 30.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(gen);
  const float specials[] = {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            0.0f, -0.0f, 447.9f, -1e30f};
  for (size_t i = 0; i < 6 && i * 7 < x.size(); ++i) x[i * 7 + 3] = specials[i];
  return x;
}

// Checks every group against the per-tensor reference on its rows.
void ExpectMatchesPerTensor(const std::vector<float>& x, int64_t rows, int64_t cols,
                            const std::vector<int32_t>& sizes, int64_t unit, bool current,
                            const std::vector<float>& delayed_scales) {
  Outputs o;
  QuantizeGroupedFp8Args a = Args(x, rows, cols, sizes, &o);
  a.rows_per_unit = unit;
  a.current_scaling = current;
  a.scale = current ? nullptr : delayed_scales.data();
  ASSERT_TRUE(QuantizeGroupedFp8Ref(a).ok());
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const int64_t end = std::min(start + std::max<int64_t>(sizes[g], 0) * unit, rows);
    const int64_t n = end - start;
    std::vector<uint8_t> row(size_t(n * cols)), col(size_t(n * cols));
    float amax = -1.0f, scale = 0.0f;
    QuantizeFp8Args p;
    p.x = x.data() + start * cols;
    p.x_dtype = DType::kF32;
    p.rows = n;
    p.cols = cols;
    p.out_dtype = DType::kE4M3;
    p.amax = &amax;
    p.scale = &scale;
    if (current) {  // amax first, then the current scale from it
      ASSERT_TRUE(QuantizeFp8Ref(p).ok());
      float unused = 0.0f;
      ASSERT_TRUE(ComputeScaleRef(&amax, 1, kE4m3Max, false, &scale, &unused).ok());
    } else {
      scale = delayed_scales[g];
    }
    p.rowwise = row.data();
    p.colwise = col.data();
    ASSERT_TRUE(QuantizeFp8Ref(p).ok());
    EXPECT_EQ(FloatBits(o.amax[g]), FloatBits(amax)) << "group " << g;
    EXPECT_EQ(FloatBits(o.scale[g]), FloatBits(scale)) << "group " << g;
    EXPECT_EQ(FloatBits(o.scale_inv[g]), FloatBits(ScaleDivRn(1.0f, scale))) << "group " << g;
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        ASSERT_EQ(o.rowwise[size_t((start + r) * cols + c)], row[size_t(r * cols + c)]);
        ASSERT_EQ(o.colwise[size_t(c * rows + start + r)], col[size_t(c * n + r)]);
      }
    }
    start = end;
  }
  for (int64_t r = start; r < rows; ++r) {  // padding: zero codes
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(o.rowwise[size_t(r * cols + c)], 0);
      ASSERT_EQ(o.colwise[size_t(c * rows + r)], 0);
    }
  }
}

TEST(QuantizeGroupedFp8Ref, CurrentScalingEqualsPerTensorPerGroup) {
  const int64_t rows = 37, cols = 19;
  const std::vector<float> x = RandomWithSpecials(rows * cols, 1);
  ExpectMatchesPerTensor(x, rows, cols, {5, 0, 1, 20, 3}, 1, true, {});   // padding of 8 rows
  ExpectMatchesPerTensor(x, rows, cols, {37}, 1, true, {});
  ExpectMatchesPerTensor(x, rows, cols, {0, 0, 0}, 1, true, {});          // all padding
}

TEST(QuantizeGroupedFp8Ref, DelayedScalingUsesEachGroupsScale) {
  const int64_t rows = 30, cols = 7;
  const std::vector<float> x = RandomWithSpecials(rows * cols, 2);
  ExpectMatchesPerTensor(x, rows, cols, {4, 11, 0, 15}, 1, false, {0.5f, 3.0f, 1e-3f, 1e4f});
}

TEST(QuantizeGroupedFp8Ref, SizesCountUnitsAndAreClipped) {
  const int64_t rows = 24, cols = 5;
  const std::vector<float> x = RandomWithSpecials(rows * cols, 3);
  ExpectMatchesPerTensor(x, rows, cols, {2, -3, 3, 1}, 4, true, {});  // 8 + 0 + 12 + 4 rows
  ExpectMatchesPerTensor(x, rows, cols, {10, 100, 5}, 1, true, {});   // clipped at 24
}

TEST(QuantizeGroupedFp8Ref, CurrentScalingOfSpecialAmaxes) {
  // Group 0: all zeros (scale 1); group 1 holds inf (scale 1); group 2 NaN (amax NaN, scale 1).
  const std::vector<float> x = {0.0f, -0.0f, 2.0f, std::numeric_limits<float>::infinity(), 1.0f,
                                std::numeric_limits<float>::quiet_NaN()};
  const std::vector<int32_t> sizes = {1, 1, 1};
  Outputs o;
  QuantizeGroupedFp8Args a = Args(x, 3, 2, sizes, &o);
  a.current_scaling = true;
  ASSERT_TRUE(QuantizeGroupedFp8Ref(a).ok());
  EXPECT_EQ(o.amax[0], 0.0f);
  EXPECT_TRUE(std::isinf(o.amax[1]));
  EXPECT_TRUE(std::isnan(o.amax[2]));
  for (int g = 0; g < 3; ++g) EXPECT_EQ(o.scale[g], 1.0f);
  EXPECT_EQ(o.rowwise[2], FloatToE4m3(2.0f));
  EXPECT_EQ(o.rowwise[3], 0x7E);  // inf saturates to 448
}

// The kernels' lookup (FindGroup with its cached range) against the definition, rows
// visited in the kernels' kind of order: jumping around, with repeats.
TEST(QuantizeGroupedFp8, FindGroupMatchesTheDefinition) {
  std::mt19937 gen(4);
  for (int trial = 0; trial < 200; ++trial) {
    const int groups = 1 + int(gen() % 40), rows = int(gen() % 300);
    std::vector<int32_t> ends(static_cast<size_t>(groups));
    std::vector<int> owner(size_t(rows) + 50, -1);  // rows past x too: padding
    int64_t start = 0;
    for (int g = 0; g < groups; ++g) {
      const int64_t size = int64_t(gen() % 4 == 0 ? 0 : gen() % 30) - (gen() % 10 == 0 ? 5 : 0);
      const int64_t end = std::min(start + std::max<int64_t>(size, 0), int64_t(rows));
      for (int64_t r = start; r < end; ++r) owner[size_t(r)] = g;
      ends[size_t(g)] = int32_t(end);
      start = end;
    }
    RowRange cursor;
    for (int k = 0; k < 400; ++k) {
      const int row = k % 3 == 0 ? int(gen() % owner.size()) : (k * 7) % int(owner.size());
      ASSERT_EQ(FindGroup(ends.data(), groups, cursor, row), owner[size_t(row)])
          << "trial " << trial << " row " << row;
    }
  }
}

TEST(QuantizeGroupedFp8Ref, BadArgumentsAreErrors) {
  const std::vector<float> x(8, 1.0f);
  const std::vector<int32_t> sizes = {2, 2};
  Outputs o;
  QuantizeGroupedFp8Args a = Args(x, 4, 2, sizes, &o);
  a.current_scaling = false;  // delayed without scales
  EXPECT_EQ(QuantizeGroupedFp8Ref(a).code(), StatusCode::kInvalidArgument);
  a.current_scaling = true;
  a.groups = 0;
  EXPECT_EQ(QuantizeGroupedFp8Ref(a).code(), StatusCode::kInvalidArgument);
  a.groups = 2;
  a.x_dtype = DType::kE4M3;
  EXPECT_EQ(QuantizeGroupedFp8Ref(a).code(), StatusCode::kInvalidArgument);
  a.x_dtype = DType::kF32;
  a.rowwise = nullptr;
  a.colwise = nullptr;
  EXPECT_EQ(QuantizeGroupedFp8Ref(a).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lowbit
