// CPU reference for NVFP4 quantize (layouts and numerics: quantize_nvfp4.h). Each stored
// copy Q is first materialized in fp32 (the colwise one transposed and, with RHT, transformed),
// then quantized by straightforward loops over its blocks.
#include <cstring>
#include <vector>

#include "common/element.h"
#include "common/ieee_denormals.h"
#include "quantize/quantize_nvfp4.h"

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_nvfp4";

// Quantizes Q (R x C fp32). `random_at(r, c)` is the word of Q's element (r, c).
template <typename RandomAt>
void QuantizeCopy(const std::vector<float>& q, int64_t R, int64_t C, bool tile_2d, bool stochastic,
                  RandomAt random_at, uint8_t* data, uint8_t* scale, float* global_scale_inv) {
  uint32_t amax = 0;
  for (float v : q) {
    const uint32_t b = AbsBitsOf(v);
    amax = b > amax ? b : amax;
  }
  const float S = Nvfp4GlobalScale(amax);
  *global_scale_inv = ScaleDivRn(1.0f, S);
  const ScaleDims d = Nvfp4ScaleDims(R, C);
  std::memset(scale, 0, size_t(d.size()));
  const int64_t packed = CeilDivI64(C, 2);
  std::memset(data, 0, size_t(R * packed));
  const int64_t tile_rows = tile_2d ? kNvfp4BlockLen : 1;
  for (int64_t r0 = 0; r0 < R; r0 += tile_rows) {
    const int64_t r1 = r0 + tile_rows < R ? r0 + tile_rows : R;
    for (int64_t c0 = 0; c0 < C; c0 += kNvfp4BlockLen) {
      const int64_t c1 = c0 + kNvfp4BlockLen < C ? c0 + kNvfp4BlockLen : C;
      uint32_t block_amax = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const uint32_t b = AbsBitsOf(q[size_t(r * C + c)]);
          block_amax = b > block_amax ? b : block_amax;
        }
      }
      const uint8_t sd = Nvfp4BlockScaleByte(block_amax, S);
      const float factor = Nvfp4EncodeFactor(sd, S);
      for (int64_t r = r0; r < r1; ++r) {
        scale[r * d.dim1 + c0 / kNvfp4BlockLen] = sd;
        for (int64_t c = c0; c < c1; ++c) {
          const uint8_t code = Nvfp4Encode(q[size_t(r * C + c)], factor, stochastic,
                                           stochastic ? random_at(r, c) : 0u);
          data[r * packed + c / 2] |= uint8_t(code << (4 * (c & 1)));
        }
      }
    }
  }
}

}  // namespace

Status QuantizeNvfp4Ref(const QuantizeNvfp4Args& a) {
  const ScopedIeeeDenormals ieee;  // as the GPU (see ieee_denormals.h)
  if (a.rows * a.cols == 0) {  // A = 0, so S = 1; there is nothing else to write
    for (float* g : {a.rowwise_global_scale_inv, a.colwise_global_scale_inv}) {
      if (g != nullptr) *g = 1.0f;
    }
    return Status::Ok();
  }
  return DispatchHighPrecision(a.x_dtype, kQuantizeOp, "x", [&](auto tag) {
    using T = typename decltype(tag)::Storage;
    const T* x = static_cast<const T*>(a.x);
    const int64_t rows = a.rows, cols = a.cols;
    const bool stochastic = a.random != nullptr;
    std::vector<float> q(size_t(rows * cols));
    if (a.rowwise != nullptr) {
      for (int64_t i = 0; i < rows * cols; ++i) q[size_t(i)] = LoadAsFloat(tag, x[i]);
      auto random_at = [&](int64_t r, int64_t c) { return a.random[r * cols + c]; };
      QuantizeCopy(q, rows, cols, a.tile_2d, stochastic, random_at, a.rowwise, a.rowwise_scale,
                   a.rowwise_global_scale_inv);
    }
    if (a.colwise != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) q[size_t(c * rows + r)] = LoadAsFloat(tag, x[r * cols + c]);
      }
      if (a.rht) {
        for (int64_t c = 0; c < cols; ++c) {
          for (int64_t g = 0; g + kNvfp4BlockLen <= rows; g += kNvfp4BlockLen) {
            Nvfp4Rht16(&q[size_t(c * rows + g)], a.rht_sign_bits);
          }
        }
      }
      auto random_at = [&](int64_t r, int64_t c) { return a.random[c * cols + r]; };
      QuantizeCopy(q, cols, rows, a.tile_2d, stochastic, random_at, a.colwise, a.colwise_scale,
                   a.colwise_global_scale_inv);
    }
    return Status::Ok();
  });
}

}  // namespace lowbit
