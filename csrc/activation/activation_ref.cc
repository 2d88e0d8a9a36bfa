// CPU references of the activation forward and backward (layouts and numerics:
// activation.h; formulas: activation_math.h).
#include <string>
#include <vector>

#include "activation/activation.h"
#include "common/element.h"
#include "common/fp32_math.h"
#include "quantize/fp8_codec.h"

namespace lowbit {
namespace {

// Stores one fp32 output value v at (r, c) of a rows x cols view into every requested
// output; tracks the amax bits.
template <typename Tag, typename Fmt>
struct OutputSink {
  using T = typename Tag::Storage;
  const ActArgs& a;
  int64_t rows, cols;
  float scale;
  uint32_t best = 0;

  void Put(int64_t r, int64_t c, float v) {
    best = AbsBitsOf(v) > best ? AbsBitsOf(v) : best;
    if (a.out != nullptr) static_cast<T*>(a.out)[r * cols + c] = StoreFromFloat(Tag{}, v);
    if (a.q_rowwise == nullptr && a.q_colwise == nullptr) return;
    const uint8_t q = EncodeScaled(Fmt{}, v, scale);
    if (a.q_rowwise != nullptr) a.q_rowwise[r * cols + c] = q;
    if (a.q_colwise != nullptr) a.q_colwise[c * rows + r] = q;
  }
};

// x[r, c] of a rows x cols view as fp32, plus bias[c] (one fp32 add) when there is a bias.
template <typename Tag>
struct BiasedLoad {
  using T = typename Tag::Storage;
  const T* x;
  const T* bias;  // null: none
  int64_t cols;

  float At(int64_t r, int64_t c) const {
    const float v = LoadAsFloat(Tag{}, x[r * cols + c]);
    return bias == nullptr ? v : v + LoadAsFloat(Tag{}, bias[c]);
  }
};

template <typename Fn>
Status Dispatch(const ActArgs& a, const char* op, Fn&& fn) {
  if (a.amax == nullptr) return Status::InvalidArgument(std::string(op) + ": amax: missing");
  const ScopedIeeeDenormals ieee;  // as the GPU, also when XLA's CPU runtime sets FTZ/DAZ
  const bool quantize = a.q_rowwise != nullptr || a.q_colwise != nullptr;
  if (quantize && a.scale == nullptr) {
    return Status::InvalidArgument(std::string(op) + ": scale: missing");
  }
  return DispatchHighPrecision(a.dtype, op, "x", [&](auto tag) {
    return DispatchFp8(quantize ? a.q_dtype : DType::kE4M3, op, "q", [&](auto fmt) {
      return fn(tag, fmt);
    });
  });
}

}  // namespace

Status ActForwardRef(const ActArgs& a) {
  return Dispatch(a, "lowbit_act_forward", [&](auto tag, auto fmt) {
    using Tag = decltype(tag);
    using T = typename Tag::Storage;
    const T* x = static_cast<const T*>(a.x);
    const int64_t h = a.hidden, in_cols = a.params.gated ? 2 * h : h;
    const BiasedLoad<Tag> in{x, static_cast<const T*>(a.bias), in_cols};
    OutputSink<Tag, decltype(fmt)> sink{a, a.rows, h, a.scale ? *a.scale : 1.0f};
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t c = 0; c < h; ++c) {
        const float xa = in.At(r, c);
        const float xg = a.params.gated ? in.At(r, h + c) : 0.0f;
        sink.Put(r, c, ActForwardValue(a.params, xa, xg));
      }
    }
    *a.amax = BitsToFloat(sink.best);
    return Status::Ok();
  });
}

Status ActBackwardRef(const ActArgs& a) {
  return Dispatch(a, "lowbit_act_backward", [&](auto tag, auto fmt) {
    using Tag = decltype(tag);
    using T = typename Tag::Storage;
    const T* x = static_cast<const T*>(a.x);
    const T* dz = static_cast<const T*>(a.dz);
    const int64_t h = a.hidden, cols = ActOutCols(a, true);
    const BiasedLoad<Tag> in{x, static_cast<const T*>(a.bias), cols};
    OutputSink<Tag, decltype(fmt)> sink{a, a.rows, cols, a.scale ? *a.scale : 1.0f};
    std::vector<float> sums(a.dbias != nullptr ? size_t(cols) : 0, 0.0f);
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t c = 0; c < h; ++c) {
        const float g = LoadAsFloat(tag, dz[r * h + c]);
        const float xa = in.At(r, c);
        const float xg = a.params.gated ? in.At(r, h + c) : 0.0f;
        float da = 0.0f, dg = 0.0f;
        ActBackwardValue(a.params, g, xa, xg, &da, &dg);
        sink.Put(r, c, da);
        if (!sums.empty()) sums[size_t(c)] += da;
        if (a.params.gated) {
          sink.Put(r, h + c, dg);
          if (!sums.empty()) sums[size_t(h + c)] += dg;
        }
      }
    }
    *a.amax = BitsToFloat(sink.best);
    if (a.dbias != nullptr) {
      T* dbias = static_cast<T*>(a.dbias);
      for (int64_t c = 0; c < cols; ++c) dbias[c] = StoreFromFloat(tag, CanonicalNan(sums[size_t(c)]));
    }
    return Status::Ok();
  });
}

}  // namespace lowbit
