// GoogleTest checks of the grouped NVFP4 CPU reference: each group's copies, scales and global
// scales equal QuantizeNvfp4Ref of its rows alone (RNE, stochastic rounding, RHT, 16x16 tiles)
// at the packed layout's offsets, every other byte is 0 (tail rows, unused ends: the outputs
// start as garbage), negative / oversized sizes are clipped, rows_per_unit scales the sizes,
// the size bounds hold for every split, and bad arguments are errors.
#include "quantize/quantize_grouped_nvfp4.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace lowbit {
namespace {

struct Outputs {
  std::vector<uint8_t> rowwise, rowwise_scale, colwise, colwise_scale;
  std::vector<float> row_gsi, col_gsi;
};

struct Options {
  bool tile_2d = false, sr = false, rht = false;
};

std::vector<float> RandomWithSpecials(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = normal(gen);
  const float specials[] = {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            0.0f, -0.0f, 447.9f, -2687.0f, 3e-39f};
  for (size_t i = 0; i < 7 && i * 11 + 5 < x.size(); ++i) x[i * 11 + 5] = specials[i];
  return x;
}

std::vector<uint32_t> RandomWords(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint32_t> w(static_cast<size_t>(n));
  for (uint32_t& v : w) v = uint32_t(gen());
  return w;
}

// Runs the grouped reference (outputs pre-filled with garbage: every byte must be written).
// `sizes` and the vectors must outlive the call.
Status RunGrouped(const std::vector<float>& x, int64_t rows, int64_t cols, const std::vector<int32_t>& sizes,
                  int64_t unit, const Options& opt, const std::vector<uint32_t>& random, Outputs* o) {
  const int64_t G = int64_t(sizes.size());
  o->rowwise.assign(size_t(rows * CeilDivI64(cols, 2)), 0xAA);
  o->rowwise_scale.assign(size_t(GroupedNvfp4RowScaleDims(rows, cols, G).size()), 0xAA);
  o->colwise.assign(size_t(GroupedNvfp4ColBytes(rows, cols, G)), 0xAA);
  o->colwise_scale.assign(size_t(GroupedNvfp4ColScaleBytes(rows, cols, G)), 0xAA);
  o->row_gsi.assign(size_t(G), -1.0f);
  o->col_gsi.assign(size_t(G), -1.0f);
  QuantizeGroupedNvfp4Args a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.rows = rows;
  a.cols = cols;
  a.group_sizes = sizes.data();
  a.groups = G;
  a.rows_per_unit = unit;
  a.tile_2d = opt.tile_2d;
  a.random = opt.sr ? random.data() : nullptr;
  a.rht = opt.rht;
  a.rht_sign_bits = 0xB38Du;
  a.rowwise = o->rowwise.data();
  a.rowwise_scale = o->rowwise_scale.data();
  a.rowwise_global_scale_inv = o->row_gsi.data();
  a.colwise = o->colwise.data();
  a.colwise_scale = o->colwise_scale.data();
  a.colwise_global_scale_inv = o->col_gsi.data();
  return QuantizeGroupedNvfp4Ref(a);
}

// Each group against QuantizeNvfp4Ref of its rows; every byte outside the groups' slots is 0.
void ExpectMatchesUngrouped(int64_t rows, int64_t cols, const std::vector<int32_t>& sizes, int64_t unit,
                            const Options& opt) {
  const std::vector<float> x = RandomWithSpecials(rows * cols, uint32_t(rows * 131 + cols));
  const std::vector<uint32_t> random = RandomWords(rows * cols, 7);
  Outputs o;
  ASSERT_TRUE(RunGrouped(x, rows, cols, sizes, unit, opt, random, &o).ok());
  const int64_t packed = CeilDivI64(cols, 2), row_pitch = GroupedNvfp4RowScaleDims(rows, cols, 1).dim1;
  const int64_t c128 = RoundUpI64(cols, 128);
  std::vector<bool> used_row(o.rowwise.size()), used_rs(o.rowwise_scale.size()), used_col(o.colwise.size()),
      used_cs(o.colwise_scale.size());
  int64_t start = 0, P = 0, B = 0, Q = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const int64_t end = std::min(start + std::max<int64_t>(sizes[g], 0) * unit, rows), n = end - start;
    const ScaleDims rd = Nvfp4ScaleDims(n, cols), cd = Nvfp4ScaleDims(cols, n);
    std::vector<uint8_t> row(size_t(n * packed)), rs(size_t(rd.size())), col(size_t(cols * CeilDivI64(n, 2))),
        cs(size_t(cd.size()));
    float rg = 0.0f, cg = 0.0f;
    QuantizeNvfp4Args u;
    u.x = x.data() + start * cols;
    u.x_dtype = DType::kF32;
    u.rows = n;
    u.cols = cols;
    u.tile_2d = opt.tile_2d;
    u.random = opt.sr ? random.data() + start * cols : nullptr;
    u.rht = opt.rht;
    u.rht_sign_bits = 0xB38Du;
    u.rowwise = row.data();
    u.rowwise_scale = rs.data();
    u.rowwise_global_scale_inv = &rg;
    u.colwise = col.data();
    u.colwise_scale = cs.data();
    u.colwise_global_scale_inv = &cg;
    ASSERT_TRUE(QuantizeNvfp4Ref(u).ok());
    EXPECT_EQ(FloatBits(o.row_gsi[g]), FloatBits(rg)) << "group " << g;
    EXPECT_EQ(FloatBits(o.col_gsi[g]), FloatBits(cg)) << "group " << g;
    if (n == 0) {
      EXPECT_EQ(o.row_gsi[g], 1.0f) << "group " << g;
    }
    for (size_t i = 0; i < row.size(); ++i) {
      ASSERT_EQ(o.rowwise[size_t(start * packed) + i], row[i]) << "group " << g << " byte " << i;
      used_row[size_t(start * packed) + i] = true;
    }
    for (size_t i = 0; i < rs.size(); ++i) {
      ASSERT_EQ(o.rowwise_scale[size_t(P * row_pitch) + i], rs[i]) << "group " << g << " scale " << i;
      used_rs[size_t(P * row_pitch) + i] = true;
    }
    for (size_t i = 0; i < col.size(); ++i) {
      ASSERT_EQ(o.colwise[size_t(cols * B) + i], col[i]) << "group " << g << " colwise byte " << i;
      used_col[size_t(cols * B) + i] = true;
    }
    for (size_t i = 0; i < cs.size(); ++i) {
      ASSERT_EQ(o.colwise_scale[size_t(c128 * Q) + i], cs[i]) << "group " << g << " colwise scale " << i;
      used_cs[size_t(c128 * Q) + i] = true;
    }
    P += RoundUpI64(n, 128);
    B += CeilDivI64(n, 2);
    Q += RoundUpI64(CeilDivI64(n, 16), 4);
    start = end;
  }
  for (size_t i = 0; i < o.rowwise.size(); ++i) {
    if (!used_row[i]) {
      ASSERT_EQ(o.rowwise[i], 0) << "tail byte " << i;
    }
  }
  for (size_t i = 0; i < o.rowwise_scale.size(); ++i) {
    if (!used_rs[i]) {
      ASSERT_EQ(o.rowwise_scale[i], 0) << "unused rowwise scale " << i;
    }
  }
  for (size_t i = 0; i < o.colwise.size(); ++i) {
    if (!used_col[i]) {
      ASSERT_EQ(o.colwise[i], 0) << "unused colwise byte " << i;
    }
  }
  for (size_t i = 0; i < o.colwise_scale.size(); ++i) {
    if (!used_cs[i]) {
      ASSERT_EQ(o.colwise_scale[i], 0) << "unused colwise scale " << i;
    }
  }
}

TEST(QuantizeGroupedNvfp4Ref, EachGroupEqualsUngrouped) {
  for (const Options& opt : {Options{}, Options{true, false, false}, Options{false, true, false},
                             Options{false, false, true}, Options{true, true, true}}) {
    ExpectMatchesUngrouped(150, 37, {5, 0, 33, 1, 90}, 1, opt);  // a 21-row tail, odd cols
    ExpectMatchesUngrouped(64, 48, {64}, 1, opt);
    ExpectMatchesUngrouped(40, 20, {0, 0}, 1, opt);               // every row in the tail
    ExpectMatchesUngrouped(300, 17, {17, 129, 0, 100, 2}, 1, opt);
  }
}

TEST(QuantizeGroupedNvfp4Ref, ClipsSizesAndCountsUnits) {
  ExpectMatchesUngrouped(60, 24, {-4, 20, 100, 7}, 1, Options{});  // negative -> 0, cut at the end
  ExpectMatchesUngrouped(60, 24, {3, 0, 9}, 5, Options{false, true, true});  // 5 rows per unit
  // Clipping as the definition: group 1 is rows [20, 60), group 2 is empty.
  const std::vector<float> x = RandomWithSpecials(60 * 24, 3);
  Outputs a, b;
  ASSERT_TRUE(RunGrouped(x, 60, 24, {20, 100, 7}, 1, Options{}, {}, &a).ok());
  ASSERT_TRUE(RunGrouped(x, 60, 24, {20, 40, 0}, 1, Options{}, {}, &b).ok());
  EXPECT_EQ(a.rowwise, b.rowwise);
  EXPECT_EQ(a.colwise, b.colwise);
  EXPECT_EQ(a.colwise_scale, b.colwise_scale);
  EXPECT_EQ(a.col_gsi, b.col_gsi);
}

TEST(QuantizeGroupedNvfp4Ref, SizeBoundsHoldForEverySplit) {
  for (int64_t rows = 0; rows <= 200; rows += 7) {
    for (int64_t G = 1; G <= 3; ++G) {
      const int64_t step = std::max<int64_t>(1, rows / 10);
      std::vector<int64_t> n(static_cast<size_t>(G), 0);
      while (true) {
        int64_t sum = 0, P = 0, B = 0, Q = 0;
        for (int64_t v : n) sum += v;
        if (sum <= rows) {
          for (int64_t v : n) {
            P += RoundUpI64(v, 128);
            B += CeilDivI64(v, 2);
            Q += RoundUpI64(CeilDivI64(v, 16), 4);
          }
          ASSERT_LE(P, GroupedNvfp4RowScaleDims(rows, 40, G).dim0) << rows << " " << G;
          ASSERT_LE(40 * B, GroupedNvfp4ColBytes(rows, 40, G)) << rows << " " << G;
          ASSERT_LE(128 * Q, GroupedNvfp4ColScaleBytes(rows, 40, G)) << rows << " " << G;
        }
        size_t i = 0;  // next split (odometer)
        while (i < n.size() && (n[i] += step) > rows) n[i++] = 0;
        if (i == n.size()) break;
      }
    }
    // One group: exactly the ungrouped sizes.
    EXPECT_EQ(GroupedNvfp4RowScaleDims(rows, 40, 1).dim0, Nvfp4ScaleDims(rows, 40).dim0);
    EXPECT_EQ(GroupedNvfp4ColBytes(rows, 40, 1), 40 * CeilDivI64(rows, 2));
    EXPECT_EQ(GroupedNvfp4ColScaleBytes(rows, 40, 1), Nvfp4ScaleDims(40, rows).size());
  }
}

// The CUDA grid's tile walk covers every group's rows exactly once in 64-row tiles starting at
// the group's first row, within floor(rows / 64) + G tile rows, and skips the rest.
TEST(QuantizeGroupedNvfp4Ref, TileWalkCoversEachGroupOnce) {
  std::mt19937 gen(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t rows = int64_t(gen() % 700);
    const int G = 1 + int(gen() % (trial < 150 ? 8 : 200));
    std::vector<int64_t> n(static_cast<size_t>(G));
    std::vector<int32_t> tile_end(static_cast<size_t>(G));
    int64_t left = rows, tiles = 0;
    for (int g = 0; g < G; ++g) {
      n[size_t(g)] = gen() % 4 == 0 ? 0 : int64_t(gen() % uint32_t(left + 1));
      if (gen() % 8 == 0) n[size_t(g)] = left;  // a group to the end
      left -= n[size_t(g)];
      tiles += CeilDivI64(n[size_t(g)], kGroupedNvfp4TileRows);
      tile_end[size_t(g)] = int32_t(tiles);
    }
    const int64_t grid_rows = rows / kGroupedNvfp4TileRows + G;
    ASSERT_LE(tiles, grid_rows) << rows << " rows, " << G << " groups";
    std::vector<std::vector<int64_t>> seen(static_cast<size_t>(G));
    for (int64_t t = 0; t < grid_rows; ++t) {
      int64_t r0 = -1;
      const int e = GroupedNvfp4TileGroup(tile_end.data(), G, t, &r0);
      if (t >= tiles) {
        ASSERT_EQ(e, -1) << t;
        continue;
      }
      ASSERT_GE(e, 0);
      ASSERT_LT(r0, n[size_t(e)]);
      seen[size_t(e)].push_back(r0);
    }
    for (int g = 0; g < G; ++g) {
      ASSERT_EQ(int64_t(seen[size_t(g)].size()), CeilDivI64(n[size_t(g)], kGroupedNvfp4TileRows)) << g;
      for (size_t k = 0; k < seen[size_t(g)].size(); ++k) ASSERT_EQ(seen[size_t(g)][k], int64_t(k) * 64) << g;
    }
  }
}

TEST(QuantizeGroupedNvfp4Ref, EmptyXWritesGlobalScalesOnly) {
  const std::vector<float> x;
  Outputs o;
  ASSERT_TRUE(RunGrouped(x, 0, 16, {0, 0, 0}, 1, Options{}, {}, &o).ok());
  EXPECT_TRUE(o.rowwise.empty() && o.rowwise_scale.empty() && o.colwise.empty() && o.colwise_scale.empty());
  for (float g : o.row_gsi) EXPECT_EQ(g, 1.0f);
  for (float g : o.col_gsi) EXPECT_EQ(g, 1.0f);
}

TEST(QuantizeGroupedNvfp4Ref, BadArguments) {
  const std::vector<float> x(64, 1.0f);
  std::vector<int32_t> sizes = {4, 4};
  std::vector<uint8_t> buf(4096);
  std::vector<float> gsi(2);
  QuantizeGroupedNvfp4Args a;
  a.x = x.data();
  a.x_dtype = DType::kF32;
  a.rows = 8;
  a.cols = 8;
  a.group_sizes = sizes.data();
  a.groups = 2;
  a.rowwise = buf.data();
  a.rowwise_scale = buf.data();
  a.rowwise_global_scale_inv = gsi.data();
  ASSERT_TRUE(QuantizeGroupedNvfp4Ref(a).ok());
  auto expect_error = [](QuantizeGroupedNvfp4Args b, const std::string& what) {
    const Status s = QuantizeGroupedNvfp4Ref(b);
    EXPECT_FALSE(s.ok()) << what;
    EXPECT_NE(s.message().find("lowbit_quantize_grouped_nvfp4: " + what), std::string::npos) << s.message();
  };
  QuantizeGroupedNvfp4Args b = a;
  b.groups = 0;
  expect_error(b, "group_sizes");
  b.groups = kMaxQuantizeGroups + 1;
  expect_error(b, "group_sizes");
  b = a;
  b.group_sizes = nullptr;
  expect_error(b, "group_sizes");
  b = a;
  b.rowwise_global_scale_inv = nullptr;
  expect_error(b, "rowwise: neither");
  b = a;
  b.rowwise_scale = nullptr;
  expect_error(b, "rowwise, rowwise_scale");
  b = a;
  b.colwise_global_scale_inv = gsi.data();  // colwise requested without its buffers
  expect_error(b, "colwise, colwise_scale");
  b = a;
  b.rows = -1;
  expect_error(b, "x");
  b = a;
  b.rows_per_unit = 0;
  expect_error(b, "rows_per_unit");
  b = a;
  b.x_dtype = DType::kE4M3;
  expect_error(b, "x: expected f32, f16 or bf16");
}

}  // namespace
}  // namespace lowbit
