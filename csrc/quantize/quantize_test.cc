// GoogleTest checks of the FP8 per-tensor quantize / dequantize CPU reference: the
// encoding rule (scale, saturation, NaN), the colwise transpose layout, amax, dbias in
// f32 and in x's dtype, the E5M2 variant, empty tensors and argument errors.
#include "quantize/quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/formats.h"
#include "quantize/fp8_codec.h"

namespace lowbit {
namespace {

const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

QuantizeFp8Args Args(const void* x, DType x_dtype, int64_t rows, int64_t cols, const float* scale,
                     float* amax) {
  QuantizeFp8Args a;
  a.x = x;
  a.x_dtype = x_dtype;
  a.rows = rows;
  a.cols = cols;
  a.scale = scale;
  a.out_dtype = DType::kE4M3;
  a.amax = amax;
  return a;
}

TEST(QuantizeFp8Ref, RowwiseScalesSaturatesAndKeepsNan) {
  const std::vector<float> x = {1.0f, -0.5f, 100.0f, 300.0f, -kInf, kNan, 0.0f, 1e-9f};
  const float scale = 2.0f;
  float amax = -1.0f;
  std::vector<uint8_t> q(x.size());
  QuantizeFp8Args a = Args(x.data(), DType::kF32, 2, 4, &scale, &amax);
  a.rowwise = q.data();
  ASSERT_TRUE(QuantizeFp8Ref(a).ok());
  EXPECT_EQ(q[0], FloatToE4m3(2.0f));
  EXPECT_EQ(q[1], FloatToE4m3(-1.0f));
  EXPECT_EQ(q[2], FloatToE4m3(200.0f));
  EXPECT_EQ(q[3], 0x7E);  // 600 saturates to 448
  EXPECT_EQ(q[4], 0xFE);  // -inf saturates to -448
  EXPECT_EQ(q[5] & 0x7F, 0x7F);  // NaN stays NaN
  EXPECT_EQ(q[6], 0x00);
  EXPECT_EQ(q[7], 0x00);  // below half the smallest subnormal
  EXPECT_TRUE(std::isnan(amax));  // NaN beats inf
}

TEST(QuantizeFp8Ref, ColwiseIsTheTransposeAndAmaxIsExact) {
  const int64_t rows = 3, cols = 5;
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[size_t(i)] = float(i) * (i % 2 ? -0.75f : 1.25f);
  const float scale = 0.5f;
  float amax = 0.0f;
  std::vector<uint8_t> row(size_t(rows * cols)), col(size_t(rows * cols));
  QuantizeFp8Args a = Args(x.data(), DType::kF32, rows, cols, &scale, &amax);
  a.rowwise = row.data();
  a.colwise = col.data();
  ASSERT_TRUE(QuantizeFp8Ref(a).ok());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_EQ(row[size_t(r * cols + c)], FloatToE4m3(x[size_t(r * cols + c)] * scale));
      EXPECT_EQ(col[size_t(c * rows + r)], row[size_t(r * cols + c)]);
    }
  }
  EXPECT_EQ(amax, 14.0f * 1.25f);
}

TEST(QuantizeFp8Ref, DbiasInF32AndBf16) {
  const std::vector<uint16_t> x = {FloatToBf16(1.0f), FloatToBf16(2.0f), FloatToBf16(-3.0f),
                                   FloatToBf16(0.5f)};
  const float scale = 1.0f;
  float amax = 0.0f;
  std::vector<uint8_t> q(4);
  std::vector<float> dbias_f32(2);
  std::vector<uint16_t> dbias_bf16(2);
  QuantizeFp8Args a = Args(x.data(), DType::kBF16, 2, 2, &scale, &amax);
  a.colwise = q.data();
  a.dbias = dbias_f32.data();
  a.dbias_dtype = DType::kF32;
  ASSERT_TRUE(QuantizeFp8Ref(a).ok());
  EXPECT_EQ(dbias_f32[0], -2.0f);
  EXPECT_EQ(dbias_f32[1], 2.5f);
  EXPECT_EQ(amax, 3.0f);
  a.dbias = dbias_bf16.data();
  a.dbias_dtype = DType::kBF16;
  ASSERT_TRUE(QuantizeFp8Ref(a).ok());
  EXPECT_EQ(dbias_bf16[0], FloatToBf16(-2.0f));
  EXPECT_EQ(dbias_bf16[1], FloatToBf16(2.5f));
  a.dbias_dtype = DType::kF16;
  Status s = QuantizeFp8Ref(a);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "lowbit_quantize_fp8: dbias: expected f32 or bf16, got f16");
}

TEST(QuantizeFp8Ref, E5m2AndF16) {
  const std::vector<uint16_t> x = {FloatToFp16(1000.0f), FloatToFp16(-65504.0f)};
  const float scale = 4.0f;
  float amax = 0.0f;
  std::vector<uint8_t> q(2);
  QuantizeFp8Args a = Args(x.data(), DType::kF16, 1, 2, &scale, &amax);
  a.out_dtype = DType::kE5M2;
  a.rowwise = q.data();
  ASSERT_TRUE(QuantizeFp8Ref(a).ok());
  EXPECT_EQ(q[0], FloatToE5m2(4000.0f));
  EXPECT_EQ(q[1], 0xFB);  // -262016 saturates to -57344
  EXPECT_EQ(amax, 65504.0f);
}

TEST(QuantizeFp8Ref, EmptyGivesZeroAmaxAndZeroDbias) {
  const float scale = 1.0f;
  float amax = -1.0f;
  std::vector<float> dbias = {7.0f, 7.0f};
  QuantizeFp8Args a = Args(nullptr, DType::kF32, 0, 2, &scale, &amax);
  a.dbias = dbias.data();
  a.dbias_dtype = DType::kF32;
  ASSERT_TRUE(QuantizeFp8Ref(a).ok());
  EXPECT_EQ(amax, 0.0f);
  EXPECT_EQ(dbias[0], 0.0f);
  EXPECT_EQ(dbias[1], 0.0f);
}

TEST(QuantizeFp8Ref, BadDtypesNameTheArgument) {
  const float scale = 1.0f;
  float amax = 0.0f;
  QuantizeFp8Args a = Args(nullptr, DType::kS32, 0, 0, &scale, &amax);
  Status s = QuantizeFp8Ref(a);
  EXPECT_NE(s.message().find("lowbit_quantize_fp8: x: expected f32, f16 or bf16"), std::string::npos);
  a.x_dtype = DType::kF32;
  a.out_dtype = DType::kE2M1;
  s = QuantizeFp8Ref(a);
  EXPECT_NE(s.message().find("lowbit_quantize_fp8: out: expected f8e4m3fn or f8e5m2"),
            std::string::npos);
  float out = 0.0f;
  s = DequantizeFp8Ref(nullptr, DType::kU8, 0, &scale, &out, DType::kF32);
  EXPECT_NE(s.message().find("lowbit_dequantize_fp8: data"), std::string::npos);
}

TEST(DequantizeFp8Ref, DecodesTimesScaleInvRounded) {
  const std::vector<uint8_t> q = {FloatToE4m3(1.5f), FloatToE4m3(-448.0f), 0x7F, 0x80};
  const float scale_inv = 0.25f;
  std::vector<float> out_f32(4);
  std::vector<uint16_t> out_bf16(4);
  ASSERT_TRUE(DequantizeFp8Ref(q.data(), DType::kE4M3, 4, &scale_inv, out_f32.data(), DType::kF32).ok());
  EXPECT_EQ(out_f32[0], 0.375f);
  EXPECT_EQ(out_f32[1], -112.0f);
  EXPECT_TRUE(std::isnan(out_f32[2]));
  EXPECT_TRUE(out_f32[3] == 0.0f && std::signbit(out_f32[3]));
  const float third = 1.0f / 3.0f;
  ASSERT_TRUE(DequantizeFp8Ref(q.data(), DType::kE4M3, 2, &third, out_bf16.data(), DType::kBF16).ok());
  EXPECT_EQ(out_bf16[0], FloatToBf16(1.5f * third));
  const std::vector<uint8_t> e5 = {0x7C, FloatToE5m2(3.0f)};
  ASSERT_TRUE(DequantizeFp8Ref(e5.data(), DType::kE5M2, 2, &scale_inv, out_f32.data(), DType::kF32).ok());
  EXPECT_TRUE(std::isinf(out_f32[0]));
  EXPECT_EQ(out_f32[1], 0.75f);
}

TEST(Fp8Codec, NanResultsHaveADefinedSign) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto bits = [](float f) { return FloatBits(f); };
  // A NaN operand gives its own sign (x before s), canonical payload.
  EXPECT_EQ(bits(MulNanDefined(-nan, 2.0f)), 0xFFC00000u);
  EXPECT_EQ(bits(MulNanDefined(BitsToFloat(0xFF812345u), -2.0f)), 0xFFC00000u);
  EXPECT_EQ(bits(MulNanDefined(1.0f, -nan)), 0xFFC00000u);
  EXPECT_EQ(bits(MulNanDefined(nan, -nan)), 0x7FC00000u);
  // 0 * inf: sign(x) xor sign(s).
  EXPECT_EQ(bits(MulNanDefined(0.0f, inf)), 0x7FC00000u);
  EXPECT_EQ(bits(MulNanDefined(-0.0f, inf)), 0xFFC00000u);
  EXPECT_EQ(bits(MulNanDefined(-inf, -0.0f)), 0x7FC00000u);
  EXPECT_EQ(bits(MulNanDefined(-3.0f, 0.5f)), bits(-1.5f));
  EXPECT_EQ(EncodeScaled(E4m3Fmt{}, -nan, 2.0f), 0xFFu);
  EXPECT_EQ(EncodeScaled(E5m2Fmt{}, -nan, 2.0f), 0xFEu);
  EXPECT_EQ(EncodeScaled(E4m3Fmt{}, -0.0f, inf), 0xFFu);
  EXPECT_EQ(EncodeScaled(E5m2Fmt{}, 5.0f, -nan), 0xFEu);
  EXPECT_EQ(bits(DecodeScaled(E4m3Fmt{}, 0xFF, 3.0f)), 0xFFC00000u);
  EXPECT_EQ(bits(DecodeScaled(E5m2Fmt{}, 0xFC, 0.0f)), 0xFFC00000u);  // -inf * 0
}

}  // namespace
}  // namespace lowbit
