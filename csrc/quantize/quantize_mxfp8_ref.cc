// CPU reference for MXFP8 quantize / dequantize (layouts and numerics: quantize_mxfp8.h).
// Straightforward loops over the 32-value blocks of each copy, each quantized from x; dbias:
// block_dbias_ref.cc.
#include <cstring>
#include <string>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "quantize/block_codec.h"
#include "quantize/block_dbias.h"
#include "quantize/dequantize_scaled_ref.h"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_mxfp8";
constexpr const char* kDequantizeOp = "lowbit_dequantize_mxfp8";

// One copy: blocks of 32 along the columns (rowwise) or down the rows (colwise).
template <typename Fmt, typename Tag>
void QuantizeCopy(Fmt fmt, Tag tag, const typename Tag::Storage* x, int64_t rows, int64_t cols,
                  bool colwise, uint8_t* q, uint8_t* scale) {
  const ScaleDims d = Mxfp8ScaleDims(rows, cols, colwise);
  std::memset(scale, 0, size_t(d.size()));
  const int64_t br = colwise ? kMxfp8BlockLen : 1, bc = colwise ? 1 : kMxfp8BlockLen;
  for (int64_t r0 = 0; r0 < rows; r0 += br) {
    const int64_t r1 = r0 + br < rows ? r0 + br : rows;
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      const int64_t c1 = c0 + bc < cols ? c0 + bc : cols;
      uint32_t amax = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const uint32_t b = AbsBitsOf(LoadAsFloat(tag, x[r * cols + c]));
          amax = b > amax ? b : amax;
        }
      }
      const uint8_t e = Mxfp8ScaleByte(amax, Fmt::kMax);
      const float factor = Mxfp8EncodeFactor(e);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          q[r * cols + c] = EncodeScaled(fmt, LoadAsFloat(tag, x[r * cols + c]), factor);
        }
      }
      scale[Mxfp8ScaleOffset(r0, c0, rows, cols, colwise)] = e;
    }
  }
}

}  // namespace

Status QuantizeMxfp8Ref(const QuantizeMxfp8Args& a) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    return DispatchFp8(a.out_dtype, kQuantizeOp, "out", [&](auto fmt) {
      using T = typename decltype(tag)::Storage;
      const T* x = static_cast<const T*>(a.x);
      if (a.rowwise != nullptr) QuantizeCopy(fmt, tag, x, a.rows, a.cols, false, a.rowwise, a.rowwise_scale);
      if (a.colwise != nullptr) QuantizeCopy(fmt, tag, x, a.rows, a.cols, true, a.colwise, a.colwise_scale);
      if (a.dbias == nullptr) return Status::Ok();
      return BlockDbiasRef(kQuantizeOp, a.x, a.x_dtype, a.rows, a.cols, kMxfp8DbiasTileRows, a.dbias, a.dbias_dtype);
    });
  });
}

Status DequantizeMxfp8Ref(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols,
                          bool colwise, const uint8_t* scale, void* out, DType out_dtype) {
  return DequantizeScaledRef(kDequantizeOp, data, data_dtype, rows, cols, out, out_dtype,
                             [&](int64_t r, int64_t c) {
                               return E8m0ToFloat(scale[Mxfp8ScaleOffset(r, c, rows, cols, colwise)]);
                             });
}

}  // namespace lowbit
