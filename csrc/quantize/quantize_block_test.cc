// GoogleTest checks of the FP8 block and MXFP8 CPU references on chosen values: the per-tile
// scale rules (amax 0 / inf / NaN, power-of-two scales, the E8M0 round-up), partial tiles,
// the GEMM-ready scale layouts with their zero padding, dequantize, and the dbias summation
// order of block_dbias.h (lane sums, then tile sums, then the finalize's interleave).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/formats.h"
#include "quantize/block_dbias.h"
#include "quantize/quantize_block.h"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {
namespace {

const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// The args of an f32 x (rows x cols) quantized to E4M3; the copies are set by each test.
template <typename Args>
Args F32ToE4m3Args(const std::vector<float>& x, int64_t rows, int64_t cols) {
  Args a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.rows = rows;
  a.cols = cols;
  a.out_dtype = DType::kE4M3;
  return a;
}

TEST(QuantizeFp8BlockRef, OneByOneTwentyEightTilesAndLayout) {
  // 5 rows x 130 cols: two column tiles (128 + a partial 2), scale_inv (2, 8), padding 0.
  const int64_t rows = 5, cols = 130;
  std::vector<float> x(size_t(rows * cols), 0.0f);
  x[0 * cols + 7] = 448.0f;   // row 0, tile 0: amax 448 -> scale 1
  x[1 * cols + 3] = -3.0f;    // row 1, tile 0: scale 448/3
  x[2 * cols + 129] = 0.5f;   // row 2, tile 1 (partial): scale 896
  x[3 * cols + 0] = kNan;     // row 3, tile 0: NaN amax -> scale 1, NaN kept
  x[4 * cols + 1] = kInf;     // row 4, tile 0: inf amax -> scale 1, inf saturates
  x[4 * cols + 2] = 2.0f;
  std::vector<uint8_t> q(size_t(rows * cols)), qt(size_t(rows * cols));
  const ScaleDims d = Fp8BlockScaleDims(rows, cols, false), dt = Fp8BlockScaleDims(cols, rows, false);
  ASSERT_EQ(d.dim0, 2);
  ASSERT_EQ(d.dim1, 8);
  ASSERT_EQ(dt.dim0, 1);
  ASSERT_EQ(dt.dim1, 132);
  std::vector<float> s(size_t(d.size()), -1.0f), st(size_t(dt.size()), -1.0f);
  auto a = F32ToE4m3Args<QuantizeFp8BlockArgs>(x, rows, cols);
  a.rowwise = q.data();
  a.rowwise_scale_inv = s.data();
  a.colwise = qt.data();
  a.colwise_scale_inv = st.data();
  ASSERT_TRUE(QuantizeFp8BlockRef(a).ok());
  EXPECT_EQ(s[0 * 8 + 0], 1.0f);
  EXPECT_EQ(s[0 * 8 + 1], 1.0f / (448.0f / 3.0f));
  EXPECT_EQ(s[1 * 8 + 2], 1.0f / 896.0f);
  EXPECT_EQ(s[0 * 8 + 3], 1.0f);
  EXPECT_EQ(s[0 * 8 + 4], 1.0f);
  EXPECT_EQ(s[1 * 8 + 0], 1.0f);  // an all-zero tile
  for (int j = 5; j < 8; ++j) EXPECT_EQ(s[size_t(j)], 0.0f);  // padding rows 5..7
  EXPECT_EQ(q[1 * cols + 3], FloatToE4m3(-448.0f));
  EXPECT_EQ(q[2 * cols + 129], FloatToE4m3(448.0f));
  EXPECT_EQ(q[3 * cols + 0] & 0x7F, 0x7F);
  EXPECT_EQ(q[4 * cols + 1], 0x7E);
  EXPECT_EQ(q[4 * cols + 2], FloatToE4m3(2.0f));
  // Colwise: column 129 of x (row 129 of x^T) holds only 0.5 -> scale 896 at [0][129].
  EXPECT_EQ(st[129], 1.0f / 896.0f);
  EXPECT_EQ(qt[129 * rows + 2], FloatToE4m3(448.0f));
  EXPECT_EQ(st[130], 0.0f);
  EXPECT_EQ(st[131], 0.0f);

  std::vector<float> back(size_t(rows * cols));
  ASSERT_TRUE(DequantizeFp8BlockRef(q.data(), DType::kE4M3, rows, cols, false, s.data(), back.data(), DType::kF32).ok());
  EXPECT_EQ(back[1 * cols + 3], -3.0f);
  EXPECT_EQ(back[2 * cols + 129], 0.5f);
  EXPECT_TRUE(std::isnan(back[3 * cols + 0]));
}

TEST(QuantizeFp8BlockRef, PowerOfTwoAnd128x128) {
  const int64_t rows = 130, cols = 3;
  std::vector<float> x(size_t(rows * cols), 1.0f);
  x[129 * cols + 2] = -3.0f;  // tile (1, 0): amax 3 -> 149.33 -> pow2 128
  std::vector<uint8_t> q(x.size());
  const ScaleDims d = Fp8BlockScaleDims(rows, cols, true);
  ASSERT_EQ(d.dim0, 2);
  ASSERT_EQ(d.dim1, 4);
  std::vector<float> s(size_t(d.size()), -1.0f);
  auto a = F32ToE4m3Args<QuantizeFp8BlockArgs>(x, rows, cols);
  a.tile_2d = true;
  a.pow2_scales = true;
  a.rowwise = q.data();
  a.rowwise_scale_inv = s.data();
  ASSERT_TRUE(QuantizeFp8BlockRef(a).ok());
  EXPECT_EQ(s[0], 1.0f / 256.0f);  // amax 1 -> 448 -> 256
  EXPECT_EQ(s[4], 1.0f / 128.0f);
  EXPECT_EQ(s[1], 0.0f);
  EXPECT_EQ(s[7], 0.0f);
  EXPECT_EQ(q[129 * cols + 2], FloatToE4m3(-384.0f));
}

TEST(QuantizeMxfp8Ref, ScaleByteRuleAndLayouts) {
  const int64_t rows = 33, cols = 40;
  std::vector<float> x(size_t(rows * cols), 0.0f);
  x[0] = 448.0f;               // row 0 block 0: e = 127
  x[1 * cols + 0] = 449.0f;    // row 1 block 0: rounded up to 128
  x[2 * cols + 39] = kNan;     // row 2 block 1 (partial): 0xFF, the block all NaN
  x[2 * cols + 33] = 1.0f;
  x[32 * cols + 5] = 3.5f;     // colwise block 1 of column 5: 3.5/448 = 2^-7 exactly -> 120
  std::vector<uint8_t> q(x.size()), qc(x.size());
  const ScaleDims d = Mxfp8ScaleDims(rows, cols, false), dc = Mxfp8ScaleDims(rows, cols, true);
  ASSERT_EQ(d.dim0, 128);
  ASSERT_EQ(d.dim1, 4);
  ASSERT_EQ(dc.dim0, 4);
  ASSERT_EQ(dc.dim1, 128);
  std::vector<uint8_t> s(size_t(d.size()), 0xAB), sc(size_t(dc.size()), 0xAB);
  auto a = F32ToE4m3Args<QuantizeMxfp8Args>(x, rows, cols);
  a.rowwise = q.data();
  a.rowwise_scale = s.data();
  a.colwise = qc.data();
  a.colwise_scale = sc.data();
  ASSERT_TRUE(QuantizeMxfp8Ref(a).ok());
  EXPECT_EQ(s[0], 127);
  EXPECT_EQ(s[4], 128);
  EXPECT_EQ(s[2 * 4 + 1], 0xFF);
  EXPECT_EQ(s[3 * 4 + 0], 0);  // all-zero block
  EXPECT_EQ(s[2], 0);          // padding column
  EXPECT_EQ(s[33 * 4], 0);     // padding row
  EXPECT_EQ(q[1 * cols + 0], FloatToE4m3(449.0f / 2.0f));
  EXPECT_EQ(q[2 * cols + 33] & 0x7F, 0x7F);  // NaN factor: the whole block NaN
  EXPECT_EQ(sc[1 * 128 + 5], 120);
  EXPECT_EQ(qc[32 * cols + 5], FloatToE4m3(448.0f));
  EXPECT_EQ(sc[0 * 128 + 0], 128);  // column 0 rows 0..31 hold 448 and 449
  EXPECT_EQ(sc[2 * 128 + 0], 0);    // padding block rows
}

// f32 x, one column: lanes are rows g, g + 8, ... of a 128-row tile. 2^24 + 1 rounds to
// 2^24 (tie to even), so the sum depends on which 1.0s meet first.
float DbiasOfColumn(const std::vector<float>& x, int64_t tile_rows) {
  float out = 0.0f;
  EXPECT_TRUE(BlockDbiasRef("op", x.data(), DType::kF32, int64_t(x.size()), 1, tile_rows, &out, DType::kF32).ok());
  return out;
}

TEST(BlockDbiasRef, SummationOrder) {
  const float big = 16777216.0f;  // 2^24
  std::vector<float> x(1200, 0.0f);
  x[0] = big;
  x[1] = x[9] = 1.0f;  // one lane: 1 + 1 = 2 first, then 2^24 + 2 (a row-order sum gives 2^24)
  EXPECT_EQ(DbiasOfColumn(x, kFp8BlockDbiasTileRows), big + 2.0f);
  x[1] = x[9] = 0.0f;
  x[8] = x[16] = 1.0f;  // lane 0 with 2^24: each 1.0 is rounded away
  EXPECT_EQ(DbiasOfColumn(x, kFp8BlockDbiasTileRows), big);
  x[8] = x[16] = 0.0f;
  x[128] = x[1152] = 1.0f;  // tiles 1 and 9: the same finalize row, summed before 2^24 joins
  EXPECT_EQ(DbiasOfColumn(x, kFp8BlockDbiasTileRows), big + 2.0f);
  x[1152] = 0.0f;
  x[256] = 1.0f;  // tiles 1 and 2: finalize rows 1 and 2, each added to 2^24 alone
  EXPECT_EQ(DbiasOfColumn(x, kFp8BlockDbiasTileRows), big);
  // MXFP8's 64-row tiles: rows 64 and 576 are tiles 1 and 9.
  x[128] = x[256] = 0.0f;
  x[64] = x[576] = 1.0f;
  EXPECT_EQ(DbiasOfColumn(x, kMxfp8DbiasTileRows), big + 2.0f);
}

TEST(BlockDbiasRef, SpecialsDtypesAndErrors) {
  // 3 columns of bf16 x, 130 rows (a partial second tile): integers (exact in any order),
  // inf + -inf (NaN: canonical), and +0/-0 only (+0).
  const int64_t rows = 130, cols = 3;
  std::vector<uint16_t> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    x[size_t(r * cols + 0)] = FloatToBf16(float(r % 7) - 3.0f);
    x[size_t(r * cols + 1)] = FloatToBf16(r == 3 ? kInf : r == 129 ? -kInf : 1.0f);
    x[size_t(r * cols + 2)] = FloatToBf16(r % 2 ? -0.0f : 0.0f);
  }
  float want0 = 0.0f;
  for (int64_t r = 0; r < rows; ++r) want0 += float(r % 7) - 3.0f;
  std::vector<float> f(cols);
  ASSERT_TRUE(BlockDbiasRef("op", x.data(), DType::kBF16, rows, cols, 128, f.data(), DType::kF32).ok());
  EXPECT_EQ(f[0], want0);
  EXPECT_EQ(FloatBits(f[1]), 0x7FC00000u);
  EXPECT_EQ(FloatBits(f[2]), 0u);
  std::vector<uint16_t> b(cols);
  ASSERT_TRUE(BlockDbiasRef("op", x.data(), DType::kBF16, rows, cols, 64, b.data(), DType::kBF16).ok());
  EXPECT_EQ(b[0], FloatToBf16(want0));
  EXPECT_EQ(b[1], 0x7FC0u);
  const Status bad = BlockDbiasRef("lowbit_quantize_mxfp8", x.data(), DType::kBF16, rows, cols, 64, b.data(),
                                   DType::kF16);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("lowbit_quantize_mxfp8: dbias: expected f32 or bf16"), std::string::npos);
}

}  // namespace
}  // namespace lowbit
