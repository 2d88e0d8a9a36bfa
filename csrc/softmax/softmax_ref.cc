// CPU references of the fused softmax forward and backward (semantics: softmax.h).
#include <cmath>
#include <string>
#include <vector>

#include "common/element.h"
#include "common/fp32_math.h"
#include "softmax/softmax.h"

namespace lowbit {

namespace {

// Sum of v[0, n): pairwise, blocks of 8 added in order. Error of a sum of positive values
// within (7 + ceil(log2(n / 8))) u relative, u = 2^-24 (the CUDA kernel: softmax.cu).
float PairwiseSum(const float* v, int64_t n) {
  if (n <= 8) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s = Fp32Add(s, v[i]);
    return s;
  }
  const int64_t half = n / 2;
  return Fp32Add(PairwiseSum(v, half), PairwiseSum(v + half, n - half));
}

}  // namespace

Status SoftmaxForwardRef(const SoftmaxArgs& a) {
  const ScopedIeeeDenormals ieee;  // as the GPU, also when XLA's CPU runtime sets FTZ/DAZ
  return DispatchHighPrecision(a.dtype, "lowbit_softmax_forward", "x", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.out);
    std::vector<float> z(size_t(a.k));
    const int64_t rows = a.batch * a.heads * a.q;
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t i = row % a.q, b = row / (a.heads * a.q);
      const uint8_t* mask = a.type == SoftmaxType::kScaledMasked
                                ? a.mask + ((a.mask_batch == 1 ? 0 : b) * a.q + i) * a.k
                                : nullptr;
      float m = -INFINITY;
      for (int64_t j = 0; j < a.k; ++j) {
        float v = Fp32Mul(LoadAsFloat(tag, x[row * a.k + j]), a.scale);
        if (mask != nullptr && mask[j] == 1) v = -10000.0f;
        if (a.type == SoftmaxType::kScaledUpperTriang && j > i) v = -INFINITY;
        z[size_t(j)] = v;
        m = std::fmax(m, v);
      }
      const bool zero_row = mask != nullptr && m == -10000.0f;
      for (int64_t j = 0; j < a.k; ++j) z[size_t(j)] = LbExpNonPositive(Fp32Add(z[size_t(j)], -m));
      const float inv_sum = Fp32Div(1.0f, PairwiseSum(z.data(), a.k));
      for (int64_t j = 0; j < a.k; ++j) {
        y[row * a.k + j] = StoreFromFloat(tag, zero_row ? 0.0f : Fp32Mul(z[size_t(j)], inv_sum));
      }
    }
    return Status::Ok();
  });
}

Status SoftmaxBackwardRef(const SoftmaxArgs& a) {
  const ScopedIeeeDenormals ieee;
  return DispatchHighPrecision(a.dtype, "lowbit_softmax_backward", "dy", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    const T* dy = static_cast<const T*>(a.dy);
    const T* y = static_cast<const T*>(a.y_in);
    T* dx = static_cast<T*>(a.out);
    std::vector<float> prod(size_t(a.k));
    const int64_t rows = a.batch * a.heads * a.q;
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t base = row * a.k;
      for (int64_t j = 0; j < a.k; ++j) {
        prod[size_t(j)] = Fp32Mul(LoadAsFloat(tag, y[base + j]), LoadAsFloat(tag, dy[base + j]));
      }
      const float sum = PairwiseSum(prod.data(), a.k);
      for (int64_t j = 0; j < a.k; ++j) {
        const float yj = LoadAsFloat(tag, y[base + j]);
        const float g = Fp32Add(Fp32Mul(yj, LoadAsFloat(tag, dy[base + j])), -Fp32Mul(yj, sum));
        dx[base + j] = StoreFromFloat(tag, Fp32Mul(a.scale, g));
      }
    }
    return Status::Ok();
  });
}

}  // namespace lowbit
