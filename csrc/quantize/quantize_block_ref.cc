// CPU reference for FP8 block quantize / dequantize (layouts and numerics: quantize_block.h).
// Straightforward loops over the tiles of each stored copy, quantized from x; dbias:
// block_dbias_ref.cc.
#include <cstring>
#include <string>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "quantize/block_codec.h"
#include "quantize/block_dbias.h"
#include "quantize/dequantize_scaled_ref.h"
#include "quantize/quantize_block.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_fp8_block";
constexpr const char* kDequantizeOp = "lowbit_dequantize_fp8_block";

// Quantizes one stored copy Q (R x C) whose element (r, c) is at(r, c) (fp32).
template <typename Fmt, typename At>
void QuantizeCopy(Fmt fmt, At at, int64_t R, int64_t C, bool tile_2d, bool pow2, uint8_t* q,
                  float* scale_inv) {
  const ScaleDims d = Fp8BlockScaleDims(R, C, tile_2d);
  std::memset(scale_inv, 0, size_t(d.size()) * sizeof(float));
  const int64_t tile_rows = tile_2d ? kFp8BlockLen : 1;
  for (int64_t r0 = 0; r0 < R; r0 += tile_rows) {
    const int64_t r1 = r0 + tile_rows < R ? r0 + tile_rows : R;
    for (int64_t c0 = 0; c0 < C; c0 += kFp8BlockLen) {
      const int64_t c1 = c0 + kFp8BlockLen < C ? c0 + kFp8BlockLen : C;
      uint32_t amax = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const uint32_t b = AbsBitsOf(at(r, c));
          amax = b > amax ? b : amax;
        }
      }
      const float scale = Fp8BlockScale(amax, Fmt::kMax, pow2);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) q[r * C + c] = EncodeScaled(fmt, at(r, c), scale);
      }
      scale_inv[Fp8BlockScaleOffset(r0, c0, R, C, tile_2d)] = ScaleDivRn(1.0f, scale);
    }
  }
}

}  // namespace

Status QuantizeFp8BlockRef(const QuantizeFp8BlockArgs& a) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    return DispatchFp8(a.out_dtype, kQuantizeOp, "out", [&](auto fmt) {
      using T = typename decltype(tag)::Storage;
      const T* x = static_cast<const T*>(a.x);
      const int64_t cols = a.cols;
      if (a.rowwise != nullptr) {
        auto at = [&](int64_t r, int64_t c) { return LoadAsFloat(tag, x[r * cols + c]); };
        QuantizeCopy(fmt, at, a.rows, a.cols, a.tile_2d, a.pow2_scales, a.rowwise, a.rowwise_scale_inv);
      }
      if (a.colwise != nullptr) {
        auto at = [&](int64_t r, int64_t c) { return LoadAsFloat(tag, x[c * cols + r]); };
        QuantizeCopy(fmt, at, a.cols, a.rows, a.tile_2d, a.pow2_scales, a.colwise, a.colwise_scale_inv);
      }
      if (a.dbias == nullptr) return Status::Ok();
      return BlockDbiasRef(kQuantizeOp, a.x, a.x_dtype, a.rows, a.cols, kFp8BlockDbiasTileRows, a.dbias,
                           a.dbias_dtype);
    });
  });
}

Status DequantizeFp8BlockRef(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols,
                             bool tile_2d, const float* scale_inv, void* out, DType out_dtype) {
  return DequantizeScaledRef(kDequantizeOp, data, data_dtype, rows, cols, out, out_dtype,
                             [&](int64_t r, int64_t c) {
                               return scale_inv[Fp8BlockScaleOffset(r, c, rows, cols, tile_2d)];
                             });
}

}  // namespace lowbit
