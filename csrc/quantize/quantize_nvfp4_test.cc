// GoogleTest checks of the NVFP4 CPU reference on chosen values: the global and block scale
// rules (amax 0 / inf / NaN), nibble packing of an odd row, the padded scale layout, the
// colwise copy as the transpose, the RHT being its own inverse, and the kernels' fast E2M1
// encoder against FloatToE2m1.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/formats.h"
#include "quantize/quantize_nvfp4.h"

namespace lowbit {
namespace {

const float kNan = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// Every fp32 pattern whose magnitude lies in [2^-3, 8) (all of E2M1's rounding boundaries),
// both signs, plus every 97th pattern elsewhere (zeros, subnormals, large, inf, NaN).
TEST(QuantizeNvfp4Ref, FastE2m1EncoderMatchesFloatToE2m1) {
  const uint32_t lo = FloatBits(0.125f), hi = FloatBits(8.0f);
  for (uint32_t sign : {0u, 0x80000000u}) {
    for (uint32_t b = lo; b < hi; ++b) {
      const float y = BitsToFloat(sign | b);
      ASSERT_EQ(Nvfp4E2m1Rne(y), FloatToE2m1(y)) << std::hexfloat << y;
    }
  }
  for (uint64_t b = 0; b <= 0xFFFFFFFFull; b += 97) {
    const float y = BitsToFloat(uint32_t(b));
    ASSERT_EQ(Nvfp4E2m1Rne(y), FloatToE2m1(y)) << std::hexfloat << y;
  }
  for (float y : {0.0f, -0.0f, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f, kInf, -kInf,
                  kNan, -kNan, BitsToFloat(1u), BitsToFloat(0x7F7FFFFFu)}) {
    EXPECT_EQ(Nvfp4E2m1Rne(y), FloatToE2m1(y)) << std::hexfloat << y;
  }
}

// The kernels' RNE encode for blocks without NaN: every factor a block can get (every scale
// byte below 0x7F under several global scales, and 0) times values around every E2M1
// boundary, specials and random patterns.
TEST(QuantizeNvfp4Ref, NonNanFactorEncodeMatchesNvfp4Encode) {
  std::vector<float> values = {0.0f, -0.0f, kInf, -kInf, kNan, -kNan, BitsToFloat(1u),
                               BitsToFloat(0x807FFFFFu), BitsToFloat(0x7F7FFFFFu)};
  for (float t : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f}) {
    for (int d = -2; d <= 2; ++d) {
      values.push_back(BitsToFloat(FloatBits(t) + uint32_t(d)));
      values.push_back(-BitsToFloat(FloatBits(t) + uint32_t(d)));
    }
  }
  uint32_t state = 12345u;
  for (int i = 0; i < 2000; ++i) {
    state = state * 1664525u + 1013904223u;
    values.push_back(BitsToFloat(state));
  }
  for (float amax : {1.0f, 12.0f, 3e-39f, 3e38f, 2688.0f}) {
    const float S = Nvfp4GlobalScale(FloatBits(amax));
    for (uint32_t sd = 0; sd < 0x7F; ++sd) {
      const float factor = Nvfp4EncodeFactor(uint8_t(sd), S);
      for (float v : values) {
        for (float w : {v, v / factor}) {  // also values that land near the boundaries
          ASSERT_EQ(Nvfp4EncodeRneNonNanFactor(w, factor), Nvfp4Encode(w, factor, false, 0u))
              << std::hexfloat << w << " * " << factor;
        }
      }
    }
  }
}

TEST(QuantizeNvfp4Ref, ScaleRules) {
  EXPECT_EQ(Nvfp4GlobalScale(FloatBits(0.0f)), 1.0f);
  EXPECT_EQ(Nvfp4GlobalScale(FloatBits(kInf)), 1.0f);
  EXPECT_EQ(Nvfp4GlobalScale(FloatBits(kNan) & 0x7FFFFFFFu), 1.0f);
  EXPECT_EQ(Nvfp4GlobalScale(1u), 1.0f);  // 2688 / 2^-149 overflows
  EXPECT_EQ(Nvfp4GlobalScale(FloatBits(2688.0f)), 1.0f);
  // Block amax == global amax: scale 448 exactly, factor S / 448.
  const float S = Nvfp4GlobalScale(FloatBits(12.0f));
  EXPECT_EQ(S, 224.0f);
  EXPECT_EQ(E4m3ToFloat(Nvfp4BlockScaleByte(FloatBits(12.0f), S)), 448.0f);
  EXPECT_EQ(Nvfp4EncodeFactor(Nvfp4BlockScaleByte(FloatBits(12.0f), S), S), 0.5f);
  EXPECT_EQ(Nvfp4EncodeFactor(0, S), 0.0f);                    // all-zero block
  EXPECT_EQ(Nvfp4BlockScaleByte(FloatBits(kInf), 1.0f), 0x7E);  // saturates at 448
  EXPECT_EQ(Nvfp4BlockScaleByte(FloatBits(kNan) & 0x7FFFFFFFu, 1.0f), 0x7F);
}

TEST(QuantizeNvfp4Ref, PackingLayoutAndColwise) {
  // 3 rows x 17 cols: two blocks per row (16 + a partial 1), packed to 9 bytes.
  const int64_t rows = 3, cols = 17;
  std::vector<float> x(size_t(rows * cols), 0.0f);
  x[0] = 6.0f;     // row 0 block 0: amax 6 -> S from global amax 6: 448, sd 448, factor 1
  x[1] = -1.0f;
  x[16] = 0.5f;    // row 0 block 1 (partial): its own scale
  std::vector<uint8_t> q(size_t(rows * 9)), s(size_t(128 * 4)), qt(size_t(cols * 2)),
      st(size_t(128 * 4));
  float g = 0.0f, gt = 0.0f;
  QuantizeNvfp4Args a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.rows = rows;
  a.cols = cols;
  a.rowwise = q.data();
  a.rowwise_scale = s.data();
  a.rowwise_global_scale_inv = &g;
  a.colwise = qt.data();
  a.colwise_scale = st.data();
  a.colwise_global_scale_inv = &gt;
  ASSERT_TRUE(QuantizeNvfp4Ref(a).ok());
  EXPECT_EQ(g, 1.0f / 448.0f);
  EXPECT_EQ(q[0], 0x7 | (0x8 | 0x2) << 4);  // 6 low nibble, -1 high nibble
  EXPECT_EQ(q[8], 0x7);                      // 0.5 at the block's max -> 6; high nibble 0
  EXPECT_EQ(E4m3ToFloat(s[0]), 448.0f);
  EXPECT_EQ(s[1], FloatToE4m3(0.5f / 6.0f * 448.0f));
  EXPECT_EQ(s[4], 0);                        // row 1: all-zero blocks
  EXPECT_EQ(s[3 * 4], 0);                    // padding rows
  // colwise: x^T (17 x 3); element (0, 0) = 6, (1, 0) = -1 in separate rows now.
  EXPECT_EQ(qt[0], 0x7);
  EXPECT_EQ(qt[2], 0x8 | 0x7);  // row 1 of x^T: its own block, amax 1 -> -1 encodes as -6
}

TEST(QuantizeNvfp4Ref, RhtIsItsOwnInverse) {
  float v[16], w[16];
  for (int i = 0; i < 16; ++i) v[i] = w[i] = float(i * 3 - 20);  // small integers: exact
  Nvfp4Rht16(w, 0xA5C3u);
  bool changed = false;
  for (int i = 0; i < 16; ++i) changed |= w[i] != v[i];
  EXPECT_TRUE(changed);
  Nvfp4Rht16(w, 0xA5C3u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(w[i], v[i]) << i;
}

}  // namespace
}  // namespace lowbit
