// CPU references of the fused activation / normalization + block quantization
// (fused_block.h): the fp32 values into a buffer, then the block quantizers' own references
// on it.
#include <string>
#include <vector>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "fused_block/fused_block.h"
#include "norm/norm_math.h"

namespace lowbit {
namespace {

// Quantizes v (rows x h fp32) into the outputs of `fp8` / `mx`.
Status QuantizeValues(const std::vector<float>& v, int64_t rows, int64_t h, bool mxfp8,
                      const QuantizeFp8BlockArgs& fp8, const QuantizeMxfp8Args& mx) {
  if (mxfp8) {
    QuantizeMxfp8Args q = mx;
    q.x = v.data();
    q.x_dtype = DType::kF32;
    q.rows = rows;
    q.cols = h;
    return QuantizeMxfp8Ref(q);
  }
  QuantizeFp8BlockArgs q = fp8;
  q.x = v.data();
  q.x_dtype = DType::kF32;
  q.rows = rows;
  q.cols = h;
  return QuantizeFp8BlockRef(q);
}

}  // namespace

Status ActQuantizeBlockRef(const ActQuantizeBlockArgs& a) {
  constexpr const char* kOp = "lowbit_act_quantize_block";
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  if (!a.mxfp8 && a.fp8.tile_2d) return Status::InvalidArgument(std::string(kOp) + ": tile_2d: only 1x128 tiles");
  return DispatchHighPrecision(a.dtype, kOp, "x", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    const T* x = static_cast<const T*>(a.x);
    const int64_t h = a.hidden, in_cols = a.params.gated ? 2 * h : h;
    std::vector<float> v(size_t(a.rows * h));
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t c = 0; c < h; ++c) {
        const float xa = LoadAsFloat(tag, x[r * in_cols + c]);
        const float xg = a.params.gated ? LoadAsFloat(tag, x[r * in_cols + h + c]) : 0.0f;
        v[size_t(r * h + c)] = ActForwardValue(a.params, xa, xg);
      }
    }
    return QuantizeValues(v, a.rows, h, a.mxfp8, a.fp8, a.mx);
  });
}

Status NormQuantizeBlockRef(const NormQuantizeBlockArgs& a) {
  constexpr const char* kOp = "lowbit_norm_quantize_block";
  const ScopedIeeeDenormals ieee;
  if (!a.mxfp8 && a.fp8.tile_2d) return Status::InvalidArgument(std::string(kOp) + ": tile_2d: only 1x128 tiles");
  const bool ln = a.norm_type == NormType::kLayerNorm;
  return DispatchHighPrecision(a.dtype, kOp, "x", [&](auto tag) {
    return DispatchHighPrecision(a.gamma_dtype, kOp, "gamma", [&](auto gtag) {
      using T = typename decltype(tag)::Storage;
      using G = typename decltype(gtag)::Storage;
      const T* x = static_cast<const T*>(a.x);
      const G* gamma = static_cast<const G*>(a.gamma);
      const G* beta = static_cast<const G*>(a.beta);
      const int64_t h = a.hidden;
      std::vector<float> w(size_t(h), 0.0f), b(size_t(h), 0.0f), v(size_t(a.rows * h));
      for (int64_t c = 0; c < h; ++c) {
        w[size_t(c)] = NormWeight(LoadAsFloat(gtag, gamma[c]), a.zero_centered_gamma);
        if (ln) b[size_t(c)] = LoadAsFloat(gtag, beta[c]);
      }
      for (int64_t r = 0; r < a.rows; ++r) {
        const float mu = ln ? a.mu[r] : 0.0f;
        for (int64_t c = 0; c < h; ++c) {
          const float xhat = NormXhat(LoadAsFloat(tag, x[r * h + c]), mu, a.rsigma[r]);
          v[size_t(r * h + c)] = CanonicalNan(NormOutput(xhat, w[size_t(c)], b[size_t(c)], ln));
        }
      }
      return QuantizeValues(v, a.rows, h, a.mxfp8, a.fp8, a.mx);
    });
  });
}

}  // namespace lowbit
