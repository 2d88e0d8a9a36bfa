// CPU reference for the normalization ops (see norm.h): plain fp32 loops. Each row is
// summed sequentially, left to right; dgamma/dbeta are summed over rows in row order.
#include <vector>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "norm/norm.h"
#include "norm/norm_check.h"
#include "norm/norm_math.h"

namespace lowbit {
namespace {

constexpr const char* kFwd = "lowbit_norm_forward";
constexpr const char* kBwd = "lowbit_norm_backward";

// gamma/beta as fp32 (zeros when p is null).
Status LoadVector(const void* p, DType dtype, int64_t n, std::vector<float>* out) {
  out->assign(size_t(n), 0.0f);
  if (p == nullptr) return Status::Ok();
  return DispatchHighPrecision(dtype, kFwd, "gamma", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    for (int64_t i = 0; i < n; ++i) (*out)[i] = LoadAsFloat(tag, static_cast<const T*>(p)[i]);
    return Status::Ok();
  });
}

Status StoreVector(const std::vector<float>& v, DType dtype, void* p) {
  return DispatchHighPrecision(dtype, kBwd, "dgamma", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    for (size_t i = 0; i < v.size(); ++i) static_cast<T*>(p)[i] = StoreFromFloat(tag, v[i]);
    return Status::Ok();
  });
}

template <typename Tag>
void ForwardRows(const NormForwardArgs& a, const std::vector<float>& w,
                 const std::vector<float>& beta) {
  using T = typename Tag::Storage;
  const bool ln = a.norm_type == NormType::kLayerNorm;
  const bool e5m2 = a.q_dtype == DType::kE5M2;
  const float scale = a.scale != nullptr ? *a.scale : 1.0f;
  const int64_t h = a.hidden;
  const float hf = float(h);
  auto* q_row = static_cast<uint8_t*>(a.q_rowwise);
  auto* q_col = static_cast<uint8_t*>(a.q_colwise);
  uint32_t amax_bits = 0;
  std::vector<float> row(static_cast<size_t>(h));
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * h;
    for (int64_t c = 0; c < h; ++c) row[c] = LoadAsFloat(Tag{}, xr[c]);
    float mu = 0.0f, sum_sq = 0.0f;
    if (ln) {
      float sum = 0.0f;
      for (int64_t c = 0; c < h; ++c) sum += row[c];
      mu = Fp32Div(sum, hf);
    }
    for (int64_t c = 0; c < h; ++c) {
      const float d = Fp32Add(row[c], -mu);
      sum_sq += Fp32Mul(d, d);
    }
    const float rsigma = NormRsigma(Fp32Div(sum_sq, hf), a.epsilon);
    if (ln) a.mu[r] = mu;
    a.rsigma[r] = rsigma;
    for (int64_t c = 0; c < h; ++c) {
      const float y = NormOutput(NormXhat(row[c], mu, rsigma), w[c], beta[c], ln);
      const uint32_t bits = AbsBitsOf(y);
      amax_bits = bits > amax_bits ? bits : amax_bits;
      if (a.y != nullptr) static_cast<T*>(a.y)[r * h + c] = StoreFromFloat(Tag{}, y);
      if (q_row != nullptr || q_col != nullptr) {
        const uint8_t q = NormQuantize(y, scale, e5m2);
        if (q_row != nullptr) q_row[r * h + c] = q;
        if (q_col != nullptr) q_col[c * a.rows + r] = q;
      }
    }
  }
  if (a.amax != nullptr) *a.amax = BitsToFloat(amax_bits);
}

template <typename Tag>
void BackwardRows(const NormBackwardArgs& a, const std::vector<float>& w,
                  std::vector<float>* dgamma, std::vector<float>* dbeta) {
  using T = typename Tag::Storage;
  const bool ln = a.norm_type == NormType::kLayerNorm;
  const int64_t h = a.hidden;
  const float hf = float(h);
  std::vector<float> xhat(static_cast<size_t>(h)), g(static_cast<size_t>(h));
  for (int64_t r = 0; r < a.rows; ++r) {
    const T* xr = static_cast<const T*>(a.x) + r * h;
    const T* dzr = static_cast<const T*>(a.dz) + r * h;
    const float mu = ln ? a.mu[r] : 0.0f, rsigma = a.rsigma[r];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int64_t c = 0; c < h; ++c) {
      const float dz = LoadAsFloat(Tag{}, dzr[c]);
      xhat[c] = NormXhat(LoadAsFloat(Tag{}, xr[c]), mu, rsigma);
      g[c] = Fp32Mul(dz, w[c]);
      sum_g += g[c];
      sum_gx += Fp32Mul(g[c], xhat[c]);
      (*dgamma)[c] += Fp32Mul(dz, xhat[c]);
      (*dbeta)[c] += dz;
    }
    const float mean_g = ln ? Fp32Div(sum_g, hf) : 0.0f;
    const float mean_gx = Fp32Div(sum_gx, hf);
    T* dxr = static_cast<T*>(a.dx) + r * h;
    for (int64_t c = 0; c < h; ++c) {
      dxr[c] = StoreFromFloat(Tag{}, NormDx(g[c], xhat[c], mean_g, mean_gx, rsigma));
    }
  }
}

}  // namespace

Status NormForwardRef(const NormForwardArgs& a) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  LOWBIT_RETURN_IF_ERROR(CheckNormForward(a, kFwd));
  if (a.rows == 0) {
    if (a.amax != nullptr) *a.amax = 0.0f;
    return Status::Ok();
  }
  std::vector<float> w, beta;
  LOWBIT_RETURN_IF_ERROR(LoadVector(a.gamma, a.gamma_dtype, a.hidden, &w));
  LOWBIT_RETURN_IF_ERROR(LoadVector(a.beta, a.gamma_dtype, a.hidden, &beta));
  for (float& v : w) v = NormWeight(v, a.zero_centered_gamma);
  return DispatchHighPrecision(a.x_dtype, kFwd, "x", [&](auto tag) {
    ForwardRows<decltype(tag)>(a, w, beta);
    return Status::Ok();
  });
}

Status NormBackwardRef(const NormBackwardArgs& a) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  LOWBIT_RETURN_IF_ERROR(CheckNormBackward(a, kBwd));
  std::vector<float> w, dgamma(size_t(a.hidden), 0.0f), dbeta(size_t(a.hidden), 0.0f);
  LOWBIT_RETURN_IF_ERROR(LoadVector(a.gamma, a.gamma_dtype, a.hidden, &w));
  for (float& v : w) v = NormWeight(v, a.zero_centered_gamma);
  if (a.rows > 0) {
    LOWBIT_RETURN_IF_ERROR(DispatchHighPrecision(a.x_dtype, kBwd, "x", [&](auto tag) {
      BackwardRows<decltype(tag)>(a, w, &dgamma, &dbeta);
      return Status::Ok();
    }));
  }
  LOWBIT_RETURN_IF_ERROR(StoreVector(dgamma, a.gamma_dtype, a.dgamma));
  if (a.dbeta != nullptr) LOWBIT_RETURN_IF_ERROR(StoreVector(dbeta, a.gamma_dtype, a.dbeta));
  return Status::Ok();
}

}  // namespace lowbit
