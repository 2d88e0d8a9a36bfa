// CPU reference for FP8 per-tensor quantize / dequantize (see quantize.h for layouts
// and numerics). Straightforward loops: rows in order, columns in order.
#include <string>
#include <vector>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "quantize/block_dbias.h"
#include "quantize/fp8_codec.h"
#include "quantize/quantize.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_fp8";
constexpr const char* kDequantizeOp = "lowbit_dequantize_fp8";

template <typename Tag>
void StoreDbias(Tag tag, const std::vector<float>& sums, void* out, DType dtype) {
  using T = typename Tag::Storage;
  for (size_t c = 0; c < sums.size(); ++c) {
    if (dtype == DType::kF32) {
      static_cast<float*>(out)[c] = sums[c];
    } else {
      static_cast<T*>(out)[c] = StoreFromFloat(tag, sums[c]);
    }
  }
}

}  // namespace

Status QuantizeFp8Ref(const QuantizeFp8Args& a) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  if (a.dbias != nullptr) LOWBIT_RETURN_IF_ERROR(CheckBlockDbiasDType(kQuantizeOp, a.x_dtype, a.dbias_dtype));
  if (a.placement != nullptr) {
    return Status::InvalidArgument(std::string(kQuantizeOp) + ": placement: CUDA only (the reference writes the dense "
                                   "layouts; dense_backward_ref.cc places them)");
  }
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    return DispatchFp8(a.out_dtype, kQuantizeOp, "out", [&](auto fmt) {
      using T = typename decltype(tag)::Storage;
      const T* x = static_cast<const T*>(a.x);
      const float scale = *a.scale;
      std::vector<float> sums(a.dbias != nullptr ? size_t(a.cols) : 0, 0.0f);
      uint32_t best = 0;
      for (int64_t r = 0; r < a.rows; ++r) {
        for (int64_t c = 0; c < a.cols; ++c) {
          const float v = LoadAsFloat(tag, x[r * a.cols + c]);
          const uint32_t bits = AbsBitsOf(v);
          best = bits > best ? bits : best;
          const uint8_t q = EncodeScaled(fmt, v, scale);
          if (a.rowwise != nullptr) a.rowwise[r * a.cols + c] = q;
          if (a.colwise != nullptr) a.colwise[c * a.rows + r] = q;
          if (a.dbias != nullptr) sums[size_t(c)] += v;
        }
      }
      *a.amax = BitsToFloat(best);
      if (a.dbias != nullptr) StoreDbias(tag, sums, a.dbias, a.dbias_dtype);
      return Status::Ok();
    });
  });
}

Status DequantizeFp8Ref(const uint8_t* data, DType data_dtype, int64_t n, const float* scale_inv,
                        void* out, DType out_dtype) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  return DispatchHighPrecision(out_dtype, kDequantizeOp, "out", [&](auto tag) {
    return DispatchFp8(data_dtype, kDequantizeOp, "data", [&](auto fmt) {
      using T = typename decltype(tag)::Storage;
      T* dst = static_cast<T*>(out);
      const float s = *scale_inv;
      for (int64_t i = 0; i < n; ++i) dst[i] = StoreFromFloat(tag, DecodeScaled(fmt, data[i], s));
      return Status::Ok();
    });
  });
}

}  // namespace lowbit
