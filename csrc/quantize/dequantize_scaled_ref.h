// Host only: the dequantize loop of the block-scaled CPU references (quantize_block_ref.cc,
// quantize_mxfp8_ref.cc). They differ only in where an element's scale_inv comes from.
#pragma once

#include <cstdint>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "common/status.h"
#include "quantize/fp8_codec.h"

namespace lowbit {

// out[r, c] = decode(data[r, c]) * scale_inv_at(r, c), data and out rows x cols row-major.
template <typename ScaleInvAt>
Status DequantizeScaledRef(const char* op, const uint8_t* data, DType data_dtype, int64_t rows,
                           int64_t cols, void* out, DType out_dtype, ScaleInvAt scale_inv_at) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  return DispatchHighPrecision(out_dtype, op, "out", [&](auto tag) {
    return DispatchFp8(data_dtype, op, "data", [&](auto fmt) {
      using T = typename decltype(tag)::Storage;
      T* dst = static_cast<T*>(out);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const float s = scale_inv_at(r, c);
          dst[r * cols + c] = StoreFromFloat(tag, DecodeScaled(fmt, data[r * cols + c], s));
        }
      }
      return Status::Ok();
    });
  });
}

}  // namespace lowbit
