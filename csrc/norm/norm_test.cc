// GoogleTest checks of the normalization CPU reference: hand-computed rows, RMSNorm,
// zero-centered gamma, the fused FP8 outputs (rowwise, transposed, amax), backward
// against central differences, argument errors, the backward workspace size, the row
// geometry and the forward's tuning knob (LOWBIT_NORM_FWD_VARIANT).
#include "norm/norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/formats.h"

namespace lowbit {
namespace {

NormForwardArgs Forward(NormType type, const std::vector<float>& x, int64_t hidden,
                        const std::vector<float>& gamma, const std::vector<float>& beta,
                        std::vector<float>* y, std::vector<float>* mu,
                        std::vector<float>* rsigma) {
  NormForwardArgs a;
  a.norm_type = type;
  a.rows = int64_t(x.size()) / hidden;
  a.hidden = hidden;
  a.x_dtype = a.gamma_dtype = DType::kF32;
  a.x = x.data();
  a.gamma = gamma.data();
  a.beta = type == NormType::kLayerNorm ? beta.data() : nullptr;
  y->resize(x.size());
  mu->resize(size_t(a.rows));
  rsigma->resize(size_t(a.rows));
  a.y = y->data();
  a.mu = type == NormType::kLayerNorm ? mu->data() : nullptr;
  a.rsigma = rsigma->data();
  return a;
}

TEST(NormRef, LayerNormRow) {
  std::vector<float> x = {1, 2, 3, 4}, gamma = {1, 1, 2, 2}, beta = {0, 0, 0, 1}, y, mu, rs;
  NormForwardArgs a = Forward(NormType::kLayerNorm, x, 4, gamma, beta, &y, &mu, &rs);
  a.epsilon = 0.0f;
  ASSERT_TRUE(NormForwardRef(a).ok());
  EXPECT_EQ(mu[0], 2.5f);
  EXPECT_FLOAT_EQ(rs[0], 1.0f / std::sqrt(1.25f));
  EXPECT_FLOAT_EQ(y[0], -1.5f * rs[0]);
  EXPECT_FLOAT_EQ(y[3], 1.5f * rs[0] * 2 + 1);
}

TEST(NormRef, RmsNormAndZeroCenteredGamma) {
  std::vector<float> x = {3, -4}, gamma = {0, 1}, beta, y, mu, rs;
  NormForwardArgs a = Forward(NormType::kRmsNorm, x, 2, gamma, beta, &y, &mu, &rs);
  a.epsilon = 0.0f;
  a.zero_centered_gamma = true;  // w = {1, 2}
  ASSERT_TRUE(NormForwardRef(a).ok());
  EXPECT_FLOAT_EQ(rs[0], 1.0f / std::sqrt(12.5f));
  EXPECT_FLOAT_EQ(y[0], 3 * rs[0]);
  EXPECT_FLOAT_EQ(y[1], -8 * rs[0]);
}

TEST(NormRef, QuantizedOutputsAndAmax) {
  std::vector<float> x = {1, 5, 2, 8, -3, 0}, gamma(3, 1.0f), beta(3, 0.0f), y, mu, rs;
  NormForwardArgs a = Forward(NormType::kLayerNorm, x, 3, gamma, beta, &y, &mu, &rs);
  std::vector<uint8_t> q_row(6), q_col(6);
  float scale = 100.0f, amax = -1.0f;
  a.scale = &scale;
  a.q_dtype = DType::kE4M3;
  a.q_rowwise = q_row.data();
  a.q_colwise = q_col.data();
  a.amax = &amax;
  ASSERT_TRUE(NormForwardRef(a).ok());
  float expect_amax = 0.0f;
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 3; ++c) {
      const float v = y[r * 3 + c];
      expect_amax = std::fmax(expect_amax, std::fabs(v));
      EXPECT_EQ(q_row[r * 3 + c], FloatToE4m3(v * scale));  // saturates: |y * 100| > 448
      EXPECT_EQ(q_col[c * 2 + r], q_row[r * 3 + c]);
    }
  }
  EXPECT_EQ(amax, expect_amax);
}

TEST(NormRef, BackwardMatchesFiniteDifferences) {
  const int64_t h = 5;
  std::vector<float> x = {0.3f, -1.2f, 2.0f, 0.7f, -0.4f}, gamma = {1.1f, 0.9f, -0.5f, 2.0f, 1.0f};
  std::vector<float> beta = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f}, dz = {0.5f, -1.0f, 0.25f, 2.0f, 1.5f};
  for (NormType type : {NormType::kLayerNorm, NormType::kRmsNorm}) {
    std::vector<float> y, mu, rs;
    NormForwardArgs f = Forward(type, x, h, gamma, beta, &y, &mu, &rs);
    ASSERT_TRUE(NormForwardRef(f).ok());
    std::vector<float> dx(h), dgamma(h), dbeta(h);
    NormBackwardArgs b;
    b.norm_type = type;
    b.rows = 1;
    b.hidden = h;
    b.x_dtype = b.gamma_dtype = DType::kF32;
    b.dz = dz.data();
    b.x = x.data();
    b.mu = f.mu;
    b.rsigma = rs.data();
    b.gamma = gamma.data();
    b.dx = dx.data();
    b.dgamma = dgamma.data();
    b.dbeta = type == NormType::kLayerNorm ? dbeta.data() : nullptr;
    ASSERT_TRUE(NormBackwardRef(b).ok());
    auto loss = [&](const std::vector<float>& xv) {
      std::vector<float> yy, mm, rr;
      NormForwardArgs g = Forward(type, xv, h, gamma, beta, &yy, &mm, &rr);
      EXPECT_TRUE(NormForwardRef(g).ok());
      double s = 0;
      for (int64_t c = 0; c < h; ++c) s += double(yy[c]) * dz[c];
      return s;
    };
    for (int64_t c = 0; c < h; ++c) {
      std::vector<float> xp = x, xm = x;
      xp[c] += 1e-2f;
      xm[c] -= 1e-2f;
      EXPECT_NEAR(dx[c], (loss(xp) - loss(xm)) / 2e-2, 2e-3) << "column " << c;
      EXPECT_NEAR(dgamma[c], dz[c] * (x[c] - (f.mu ? mu[0] : 0.0f)) * rs[0], 1e-5);
    }
  }
}

TEST(NormRef, Errors) {
  std::vector<float> x(4), gamma(4), beta(4), y, mu, rs;
  NormForwardArgs a = Forward(NormType::kLayerNorm, x, 4, gamma, beta, &y, &mu, &rs);
  a.hidden = 20000;
  Status s = NormForwardRef(a);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(),
            "lowbit_norm_forward: x: hidden size 20000 exceeds the supported maximum 16384");
  a.hidden = 4;
  a.gamma_dtype = DType::kF16;
  EXPECT_NE(NormForwardRef(a).message().find("gamma: expected f32 or x's dtype"),
            std::string::npos);
  a.gamma_dtype = DType::kF32;
  a.beta = nullptr;
  EXPECT_NE(NormForwardRef(a).message().find("beta, mu: required for layernorm"),
            std::string::npos);
}

// The same table is in tests/test_norm_ops.py (WORKSPACE_CASES), checked against the
// Python mirror of the formula (lowbit/ops/norm.py: norm_backward_workspace_bytes).
TEST(NormPlan, BackwardWorkspaceBytes) {
  struct Case {
    DType dtype;
    int64_t rows, hidden;
    size_t bytes;
  };
  const Case cases[] = {{DType::kF32, 1, 128, 1024},          {DType::kF32, 3, 200, 1600},
                        {DType::kF16, 16384, 1024, 4194304},  {DType::kF32, 65, 16384, 8519680},
                        {DType::kBF16, 300, 1001, 600600},    {DType::kF32, 0, 128, 0},
                        {DType::kF32, 100000, 16384, 67108864}, {DType::kBF16, 5, 20000, 0},
                        {DType::kBF16, 16384, 4096, 16777216}};
  for (const Case& c : cases) {
    EXPECT_EQ(NormBackwardWorkspaceBytes(c.dtype, c.rows, c.hidden), c.bytes)
        << DTypeName(c.dtype) << " " << c.rows << " x " << c.hidden;
  }
}

// min_items: more items per thread where the row still spans >= 128 threads; the backward
// (default min_items) keeps the fewest items per thread.
TEST(NormPlan, RowGeometryMinItems) {
  struct Case {
    int64_t hidden;
    int elem_bytes;
    bool aligned;
    int min_items, items, threads;
  };
  const Case cases[] = {{4096, 2, true, 4, 8, 512},    {4096, 2, true, 16, 16, 256},
                        {8192, 2, true, 16, 16, 512},  {16384, 2, true, 8, 16, 1024},
                        {1024, 2, true, 16, 8, 128},   {2048, 2, true, 16, 16, 128},
                        {4096, 4, true, 16, 16, 256},  {4096, 4, true, 4, 4, 1024},
                        {4097, 2, false, 16, 8, 544},  {128, 2, true, 16, 8, 32}};
  for (const Case& c : cases) {
    const RowGeometry g = ChooseRowGeometry(c.hidden, c.elem_bytes, c.aligned, c.min_items);
    EXPECT_EQ(g.items, c.items) << c.hidden << " " << c.elem_bytes << " " << c.min_items;
    EXPECT_EQ(g.threads_per_row, c.threads) << c.hidden << " " << c.elem_bytes << " " << c.min_items;
    EXPECT_EQ(g.vectorized, c.aligned);
  }
}

TEST(NormPlan, ForwardTuningKnob) {
  NormFwdTuning t;
  std::string error;
  ASSERT_TRUE(ParseNormFwdTuning(nullptr, &t, &error));
  ASSERT_TRUE(ParseNormFwdTuning("", &t, &error));
  const NormFwdTuning defaults;
  EXPECT_EQ(t.items, defaults.items);
  EXPECT_EQ(t.stages, defaults.stages);
  ASSERT_TRUE(ParseNormFwdTuning("items=8,stages=2,,block=256,colblock=512,coltile=8", &t, &error));
  EXPECT_EQ(t.items, 8);
  EXPECT_EQ(t.stages, 2);
  EXPECT_EQ(t.block, 256);
  EXPECT_EQ(t.colblock, 512);
  EXPECT_EQ(t.coltile, 8);
  ASSERT_TRUE(ParseNormFwdTuning("colspan=64,colorder=0,colsplit=0,l1keep=0", &t, &error));
  EXPECT_EQ(t.l1keep, 0);
  EXPECT_EQ(t.colspan, 64);
  EXPECT_EQ(t.colorder, 0);
  EXPECT_EQ(t.colsplit, 0);
  EXPECT_EQ(t.coltile, 8);  // kept from the previous call
  ASSERT_TRUE(ParseNormFwdTuning("colspan=128,colorder=1,colsplit=1,l1keep=1", &t, &error));
  EXPECT_EQ(t.l1keep, 1);
  EXPECT_EQ(t.colspan, 128);
  EXPECT_EQ(t.colorder, 1);
  EXPECT_EQ(t.colsplit, 1);
  EXPECT_EQ(t.parsmem, defaults.parsmem);
  EXPECT_EQ(t.colbar, defaults.colbar);
  ASSERT_TRUE(ParseNormFwdTuning("parsmem=1,colbar=0", &t, &error));
  EXPECT_EQ(t.parsmem, 1);
  EXPECT_EQ(t.colbar, 0);
  EXPECT_EQ(t.l1keep, 1);  // kept from the previous call
  EXPECT_EQ(t.parkeep, defaults.parkeep);
  EXPECT_EQ(t.parstages, defaults.parstages);
  ASSERT_TRUE(ParseNormFwdTuning("parkeep=0,colspan=32,parstages=2", &t, &error));
  EXPECT_EQ(t.parkeep, 0);
  EXPECT_EQ(t.colspan, 32);
  EXPECT_EQ(t.parstages, 2);
  EXPECT_EQ(t.colbar, 0);  // kept from the previous call
  // colspan=0|16 and stream are removed knobs (measured slower / no faster on an H100).
  for (const char* bad : {"items=12", "stages=0", "stages=5", "block=100", "block=2048",
                          "foo=1", "coltile=2", "coltile=64", "colspan=0", "colspan=8",
                          "colspan=16", "colspan=256", "colorder=2", "colsplit=3", "l1keep=2",
                          "parsmem=2", "colbar=2", "parkeep=2", "parstages=5", "stream=0",
                          "stream=1", "items", "items=", "items=8x", "=8", "block=-32"}) {
    NormFwdTuning u;
    error.clear();
    EXPECT_FALSE(ParseNormFwdTuning(bad, &u, &error)) << bad;
    EXPECT_NE(error.find("bad entry"), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace lowbit
