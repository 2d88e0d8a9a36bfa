// GoogleTest checks of the lowbit_gemm CPU reference: exact small cases, the documented
// summation order (k ascending), scale/bias/rounding order, the blocked and threaded paths
// against a naive triple loop (bit for bit), NaN propagation and the type rules.
#include "gemm/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "common/formats.h"

namespace lowbit {
namespace {

GemmArgs Args(const void* a, DType at, const void* b, DType bt, const float* sa, const float* sb,
              void* out, DType ot, int64_t m, int64_t n, int64_t k, const void* bias = nullptr) {
  GemmArgs args;
  args.a = a;
  args.b = b;
  args.a_type = at;
  args.b_type = bt;
  args.a_scale_inv = sa;
  args.b_scale_inv = sb;
  args.out = out;
  args.out_type = ot;
  args.bias = bias;
  args.m = m;
  args.n = n;
  args.k = k;
  return args;
}

float Decode(DType t, const uint8_t* bytes, int64_t i) {
  if (t == DType::kE4M3) return E4m3ToFloat(bytes[i]);
  if (t == DType::kE5M2) return E5m2ToFloat(bytes[i]);
  uint16_t v;
  std::memcpy(&v, bytes + 2 * i, 2);
  return t == DType::kBF16 ? Bf16ToFloat(v) : Fp16ToFloat(v);
}

// The numerics of gemm.h written as plainly as possible; f32 output.
std::vector<float> NaiveGemm(const GemmArgs& g, const std::vector<float>& bias) {
  std::vector<float> out(size_t(g.m * g.n));
  const float scale =
      static_cast<const float*>(g.a_scale_inv)[0] * static_cast<const float*>(g.b_scale_inv)[0];
  const auto* a = static_cast<const uint8_t*>(g.a);
  const auto* b = static_cast<const uint8_t*>(g.b);
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < g.k; ++kk) {
        acc += Decode(g.a_type, a, i * g.k + kk) * Decode(g.b_type, b, j * g.k + kk);
      }
      float y = scale * acc;
      if (!bias.empty()) y = y + bias[size_t(j)];
      out[size_t(i * g.n + j)] = y;
    }
  }
  return out;
}

TEST(GemmRef, SmallExactFp8) {
  // a = [[1, 2], [3, -4]], b = [[1, 0.5], [-2, 8]]: out = a @ b^T, times 0.5 * 4.
  std::vector<uint8_t> a = {FloatToE4m3(1), FloatToE4m3(2), FloatToE4m3(3), FloatToE4m3(-4)};
  std::vector<uint8_t> b = {FloatToE5m2(1), FloatToE5m2(0.5f), FloatToE5m2(-2), FloatToE5m2(8)};
  const float sa = 0.5f, sb = 4.0f;
  std::vector<float> out(4);
  ASSERT_TRUE(GemmRef(Args(a.data(), DType::kE4M3, b.data(), DType::kE5M2, &sa, &sb, out.data(),
                           DType::kF32, 2, 2, 2))
                  .ok());
  EXPECT_EQ(out, (std::vector<float>{4.0f, 28.0f, 2.0f, -76.0f}));
}

TEST(GemmRef, AccumulateAddsIntoOut) {
  // The SmallExactFp8 product (4, 28, 2, -76) added to out's contents in fp32: 1 + 4, -28 + 28,
  // 2^24 + 2 (the next float up from 2^24), inf - 76.
  std::vector<uint8_t> a = {FloatToE4m3(1), FloatToE4m3(2), FloatToE4m3(3), FloatToE4m3(-4)};
  std::vector<uint8_t> b = {FloatToE5m2(1), FloatToE5m2(0.5f), FloatToE5m2(-2), FloatToE5m2(8)};
  const float sa = 0.5f, sb = 4.0f;
  std::vector<float> out = {1.0f, -28.0f, 16777216.0f, INFINITY};
  GemmArgs args = Args(a.data(), DType::kE4M3, b.data(), DType::kE5M2, &sa, &sb, out.data(), DType::kF32, 2, 2, 2);
  args.accumulate = true;
  ASSERT_TRUE(GemmRef(args).ok());
  EXPECT_EQ(out, (std::vector<float>{5.0f, 0.0f, 16777218.0f, INFINITY}));
  // bf16 operands have no accumulating form; nor does a GEMM with a bias.
  std::vector<uint16_t> h = {0x3f80, 0x3f80};
  std::vector<float> o(1);
  GemmArgs half = Args(h.data(), DType::kBF16, h.data() + 1, DType::kBF16, &sa, &sb, o.data(), DType::kF32, 1, 1, 1);
  half.accumulate = true;
  const Status s = GemmRef(half);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("lowbit_gemm_accumulate: a: expected FP8 operands"), std::string::npos);
  const float bias = 1.0f;
  args.bias = &bias;
  EXPECT_NE(GemmRef(args).message().find("lowbit_gemm_accumulate: bias"), std::string::npos);
}

TEST(GemmRef, SumsInIncreasingK) {
  // Products 2^23, 0.5, 0.5: k ascending rounds 2^23 + 0.5 to 2^23 twice; summing the two
  // halves first would give 2^23 + 1.
  std::vector<uint8_t> a = {FloatToE5m2(32768.0f), FloatToE5m2(1.0f), FloatToE5m2(1.0f)};
  std::vector<uint8_t> b = {FloatToE4m3(256.0f), FloatToE4m3(0.5f), FloatToE4m3(0.5f)};
  const float one = 1.0f;
  float out = 0.0f;
  ASSERT_TRUE(GemmRef(Args(a.data(), DType::kE5M2, b.data(), DType::kE4M3, &one, &one, &out,
                           DType::kF32, 1, 1, 3))
                  .ok());
  EXPECT_EQ(out, 8388608.0f);
  std::vector<uint8_t> a_rev = {a[2], a[1], a[0]}, b_rev = {b[2], b[1], b[0]};
  ASSERT_TRUE(GemmRef(Args(a_rev.data(), DType::kE5M2, b_rev.data(), DType::kE4M3, &one, &one,
                           &out, DType::kF32, 1, 1, 3))
                  .ok());
  EXPECT_EQ(out, 8388609.0f);
}

TEST(GemmRef, ScaleThenBiasThenRoundToBf16) {
  // acc = 3; y = fl(0.1 * 3) + bias(256) rounds to bf16 256 (ulp 2 there).
  std::vector<uint16_t> a = {FloatToBf16(1.0f), FloatToBf16(2.0f)};
  std::vector<uint16_t> b = {FloatToBf16(1.0f), FloatToBf16(1.0f)};
  const float sa = 0.1f, sb = 1.0f;
  const uint16_t bias = FloatToBf16(256.0f);
  uint16_t out = 0;
  ASSERT_TRUE(GemmRef(Args(a.data(), DType::kBF16, b.data(), DType::kBF16, &sa, &sb, &out,
                           DType::kBF16, 1, 1, 2, &bias))
                  .ok());
  EXPECT_EQ(out, FloatToBf16(256.0f + 0.1f * 3.0f));
  EXPECT_EQ(Bf16ToFloat(out), 256.0f);
}

class GemmRefRandom : public ::testing::TestWithParam<std::tuple<int, int, int, int>> {};

TEST_P(GemmRefRandom, BlockedAndThreadedEqualNaive) {
  const auto [m, n, k, type_case] = GetParam();
  const DType types[4][2] = {{DType::kE4M3, DType::kE4M3}, {DType::kE4M3, DType::kE5M2},
                             {DType::kE5M2, DType::kE4M3}, {DType::kBF16, DType::kBF16}};
  const DType at = types[type_case][0], bt = types[type_case][1];
  const int width = at == DType::kBF16 ? 2 : 1;
  std::mt19937 rng(m * 1000003 + n * 101 + k + type_case);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  auto fill = [&](DType t, int64_t count) {
    std::vector<uint8_t> bytes(size_t(count * width));
    for (int64_t i = 0; i < count; ++i) {
      const float v = normal(rng);
      if (t == DType::kE4M3) bytes[size_t(i)] = FloatToE4m3(v);
      if (t == DType::kE5M2) bytes[size_t(i)] = FloatToE5m2(v);
      if (t == DType::kBF16) {
        const uint16_t h = FloatToBf16(v);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
    return bytes;
  };
  const std::vector<uint8_t> a = fill(at, int64_t(m) * k), b = fill(bt, int64_t(n) * k);
  std::vector<float> bias(static_cast<size_t>(n));
  for (float& v : bias) v = normal(rng);
  const float sa = 0.37f, sb = 1.9f;
  std::vector<float> out(size_t(m) * n);
  const GemmArgs args = Args(a.data(), at, b.data(), bt, &sa, &sb, out.data(), DType::kF32, m, n, k,
                             bias.data());
  ASSERT_TRUE(GemmRef(args).ok());
  const std::vector<float> want = NaiveGemm(args, bias);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], want[i]) << "at " << i;
}

// Shapes cross the 4-row tile, the 8-column tile, the 256-column block and (130 x 520 x 128)
// the threading threshold.
INSTANTIATE_TEST_SUITE_P(Shapes, GemmRefRandom,
                         ::testing::Values(std::make_tuple(1, 1, 16, 0), std::make_tuple(7, 17, 48, 1),
                                           std::make_tuple(33, 300, 33, 2),
                                           std::make_tuple(130, 520, 128, 0),
                                           std::make_tuple(5, 9, 1000, 3),
                                           std::make_tuple(9, 3, 0, 0)));

TEST(GemmRef, NanPropagates) {
  std::vector<uint8_t> a = {0x7F, FloatToE4m3(1.0f)};  // E4M3 NaN
  std::vector<uint8_t> b = {FloatToE4m3(1.0f), FloatToE4m3(1.0f), FloatToE4m3(0.0f), FloatToE4m3(0.0f)};
  const float one = 1.0f;
  std::vector<float> out(2);
  ASSERT_TRUE(GemmRef(Args(a.data(), DType::kE4M3, b.data(), DType::kE4M3, &one, &one, out.data(),
                           DType::kF32, 1, 2, 2))
                  .ok());
  EXPECT_TRUE(std::isnan(out[0]));
  EXPECT_TRUE(std::isnan(out[1]));  // NaN * 0 is NaN
}

TEST(GemmRef, TypeRules) {
  EXPECT_TRUE(CheckGemmTypes(DType::kE4M3, DType::kE5M2, DType::kF16).ok());
  EXPECT_TRUE(CheckGemmTypes(DType::kF16, DType::kF16, DType::kF32).ok());
  const Status e5 = CheckGemmTypes(DType::kE5M2, DType::kE5M2, DType::kBF16);
  EXPECT_FALSE(e5.ok());
  EXPECT_NE(e5.message().find("lowbit_gemm: b: f8e5m2 x f8e5m2"), std::string::npos);
  const Status mixed = CheckGemmTypes(DType::kE4M3, DType::kBF16, DType::kBF16);
  EXPECT_NE(mixed.message().find("lowbit_gemm: b: expected both operands FP8"), std::string::npos);
  const Status out16 = CheckGemmTypes(DType::kBF16, DType::kBF16, DType::kF16);
  EXPECT_NE(out16.message().find("lowbit_gemm: out: with bf16 operands expected bf16 or f32"),
            std::string::npos);
  EXPECT_FALSE(CheckGemmTypes(DType::kE4M3, DType::kE4M3, DType::kE4M3).ok());
  EXPECT_FALSE(CheckGemmTypes(DType::kF32, DType::kF32, DType::kF32).ok());
}

TEST(GemmPlan, PickHeuristicIndex) {
  // Entry `algo` when cuBLASLt returned it.
  EXPECT_EQ(PickHeuristicIndex(3, 0, false), 0);
  EXPECT_EQ(PickHeuristicIndex(3, 2, false), 2);
  EXPECT_EQ(PickHeuristicIndex(3, 2, true), 2);
  // Past the list: the caller's error, or with or_first (a library default) the first choice.
  EXPECT_EQ(PickHeuristicIndex(1, 1, false), -1);
  EXPECT_EQ(PickHeuristicIndex(1, 1, true), 0);
  EXPECT_EQ(PickHeuristicIndex(2, 31, true), 0);
  // Nothing usable: nothing to fall back to.
  EXPECT_EQ(PickHeuristicIndex(0, 0, true), -1);
  EXPECT_EQ(PickHeuristicIndex(0, 1, true), -1);
  EXPECT_EQ(PickHeuristicIndex(3, -1, false), -1);
}

}  // namespace
}  // namespace lowbit
