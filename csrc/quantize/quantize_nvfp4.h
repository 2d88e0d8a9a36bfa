// NVFP4 quantization: E2M1 data in 16-value blocks with E4M3 block decode scales under a
// per-copy fp32 global scale (DESIGN.md §4). CPU reference (quantize_nvfp4_ref.cc) and CUDA
// kernels (quantize_nvfp4.cu) give the same bits; so does the jnp twin in
// lowbit/ops/quantize_nvfp4.py (the tests' third reference).
//
// Data: x is rows x cols, row-major, f32/f16/bf16 (rows = prod(shape[:flatten_axis]), cols
// the contracting dim). Two stored copies, each a matrix Q with R x C elements:
//   rowwise: Q = x (R = rows, C = cols);
//   colwise: Q = x^T (R = cols, C = rows), K-major for the wgrad GEMM like the FP8 block
//            modes, quantized from x itself (optionally through the RHT below).
// Blocks: 16 consecutive values of one row of Q (1-D), or 16x16 tiles of Q (tile_2d, for
// weights: a 16x16 tile of Q is a 16x16 tile of x, so both copies share amaxes). Edge
// blocks are partial (as if x were zero-padded).
// Numerics, per copy (fp32, IEEE round to nearest even, subnormals honoured):
//   A = max |Q| (bit compare: NaN beats inf);
//   S = 2688 / A (448 * 6), and S = 1 when A is 0, inf or NaN or the quotient is inf (a
//       scale that maps A to 2688 does not exist; inf/NaN data saturates/propagates below);
//   per block: a = max |Q| over the block; sd = e4m3(a / 6 * S) (RNE, saturating at 448,
//       NaN -> 0x7F): the stored decode scale; factor = S / e4m3_to_float(sd), 0 when the
//       scale is 0, FLT_MAX when the quotient is inf, NaN when sd is NaN;
//   q = e2m1(Q * factor) (MulNanDefined; RNE, or stochastic with the random word of the
//       element, formats.h: up with probability rem / 2^shift iff random < rem * 2^(32 -
//       shift); saturating at 6; NaN -> +-6 with its sign: the block's NaN scale keeps it
//       visible);
//   global_scale_inv = 1 / S (stored, fp32 (1,)).
// Dequantize: value = (e2m1_to_float(q) * e4m3_to_float(sd)) * global_scale_inv (the
// first product is exact).
// Random bits (stochastic rounding): one uint32 per element of x, rows x cols; rowwise
// element (r, c) and colwise element (c, r) both consume random[r * cols + c].
// RHT (colwise copy only): each full group of 16 consecutive values of a row of Q (16 rows
// of x, one column) is replaced by T v, T = D H D / 4, H the 16x16 Sylvester Hadamard matrix
// (H H^T = 16 I), D = diag(d), d_i = -1 where bit i of rht_sign_bits is set: so T is
// symmetric and orthogonal and applying it twice is the identity (up to rounding). Order:
// v_i = d_i v_i; butterflies for h = 1, 2, 4, 8 over i with (i & h) == 0:
// (v_i, v_{i+h}) = (v_i + v_{i+h}, v_i - v_{i+h}); v_i = v_i * (d_i * 0.25), a NaN
// result made the positive quiet NaN (NaN signs through additions differ by platform). When rows % 16
// != 0 the last partial group of each column of x is left as is (T is the identity there,
// so the transform stays orthogonal).
// Packing: two E2M1 codes per byte along the row of Q, element 2j in the low nibble of byte
// j and 2j + 1 in the high nibble; an odd C leaves the last high nibble 0. Data is
// R x ceil(C/2) bytes.
// Scale layout: E4M3 bytes, row-major, padded to cuBLASLt's 128 x 4 tiles (as MXFP8):
// roundup(R, 128) x roundup(ceil(C/16), 4), entry [r][j] the scale of Q[r, 16j : 16j+16]
// (for tile_2d, the scale of the tile holding it); padding bytes 0.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/formats.h"
#include "common/fp32_math.h"
#include "common/status.h"
#include "quantize/fp8_codec.h"
#include "quantize/quantize_block.h"
#include "scale/scale.h"

namespace lowbit {

constexpr int64_t kNvfp4BlockLen = 16;
constexpr float kNvfp4GlobalNumerator = 2688.0f;  // E4M3 max * E2M1 max

LOWBIT_HD ScaleDims Nvfp4ScaleDims(int64_t R, int64_t C) {
  return {RoundUpI64(R, 128), RoundUpI64(CeilDivI64(C, kNvfp4BlockLen), 4)};
}

// S from the copy's amax (as |x| bits).
LOWBIT_HD float Nvfp4GlobalScale(uint32_t amax_bits) {
  if (!UsableAmax(BitsToFloat(amax_bits))) return 1.0f;
  const float s = ScaleDivRn(kNvfp4GlobalNumerator, BitsToFloat(amax_bits));
  return FloatBits(s) >= kPosInfBits ? 1.0f : s;
}

// The E4M3 decode-scale byte of a block with amax `amax_bits`.
LOWBIT_HD uint8_t Nvfp4BlockScaleByte(uint32_t amax_bits, float global_scale) {
  const float a6 = ScaleDivRn(BitsToFloat(amax_bits), 6.0f);
#if defined(__CUDA_ARCH__)
  return FloatToE4m3(__fmul_rn(a6, global_scale));
#else
  return FloatToE4m3(a6 * global_scale);
#endif
}

// The factor a block's values are multiplied by before the E2M1 cast.
LOWBIT_HD float Nvfp4EncodeFactor(uint8_t scale_byte, float global_scale) {
  const float sd = E4m3ToFloat(scale_byte);
  if ((scale_byte & 0x7Fu) == 0) return 0.0f;
  return ClampInfinite(ScaleDivRn(global_scale, sd));  // NaN sd -> NaN
}

LOWBIT_HD uint8_t Nvfp4Encode(float v, float factor, bool stochastic, uint32_t random) {
  const float y = MulNanDefined(v, factor);
  return stochastic ? FloatToE2m1Stochastic(y, random) : FloatToE2m1(y);
}

// FloatToE2m1(y) (RNE, saturating, NaN -> sign | 7) in a few ALU operations, for the
// kernels: |y|'s bits are clamped to 6.0f's as integers (inf and NaN become 6, hence code 7);
// e = 2^b is the power of two of its binade, at least 1 (b = 0, 1, 2); one correctly rounded
// add of 2^(22 + b) rounds it to E2M1's quantum there (0.5 below 2, 1 below 4, 2 up to 6) with
// ties to even (an even multiple of the quantum is an even code) and leaves the multiple in
// the low bits of the sum; the code is that multiple + 2b. Checked against FloatToE2m1 in
// quantize_nvfp4_test.cc.
LOWBIT_HD uint32_t Nvfp4E2m1RneMagnitude(uint32_t abs_bits) {
  const uint32_t m = abs_bits < 0x40C00000u ? abs_bits : 0x40C00000u;  // min(|y|, 6)
  const uint32_t e = (m > 0x3F800000u ? m : 0x3F800000u) & 0x7F800000u;  // 2^b, b in 0..2
  const uint32_t multiple = FloatBits(Fp32Add(BitsToFloat(m), BitsToFloat(e + (22u << 23)))) & 0x7u;
  return multiple + (e >> 22) - 254u;  // + 2b
}

LOWBIT_HD uint8_t Nvfp4E2m1Rne(float y) {
  const uint32_t sign = (FloatBits(y) >> 28) & 0x8u;
  return uint8_t(sign | Nvfp4E2m1RneMagnitude(FloatBits(y) & 0x7FFFFFFFu));
}

// Nvfp4Encode(v, factor, false, 0) for a factor that is not NaN (factors are never negative):
// v's sign with the magnitude of |v * factor| (a NaN product, from a NaN v or inf * 0,
// saturates to 7): the IEEE product carries sign(v) otherwise, and MulNanDefined gives a NaN
// product v's sign. Checked against Nvfp4Encode in quantize_nvfp4_test.cc.
LOWBIT_HD uint32_t Nvfp4EncodeRneNonNanFactor(float v, float factor) {
  return ((FloatBits(v) >> 28) & 0x8u) |
         Nvfp4E2m1RneMagnitude(FloatBits(Fp32Mul(v, factor)) & 0x7FFFFFFFu);
}

LOWBIT_HD float Nvfp4Decode(uint8_t nibble, uint8_t scale_byte, float global_scale_inv) {
  return MulNanDefined(MulNanDefined(E2m1ToFloat(nibble), E4m3ToFloat(scale_byte)), global_scale_inv);
}

// T v for one group of 16 (see above), in place.
LOWBIT_HD void Nvfp4Rht16(float* v, uint32_t sign_bits) {
  for (int i = 0; i < 16; ++i) {
    if ((sign_bits >> i) & 1u) v[i] = -v[i];
  }
  for (int h = 1; h < 16; h <<= 1) {
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
  for (int i = 0; i < 16; ++i) {
    const float s = ((sign_bits >> i) & 1u) ? -0.25f : 0.25f;
    v[i] = CanonicalNan(v[i] * s);  // NaN signs through adds differ by platform
  }
}

struct QuantizeNvfp4Args {
  const void* x = nullptr;
  DType x_dtype = DType::kInvalid;         // f32, f16 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  bool tile_2d = false;                    // 16x16 tiles, else 1x16
  const uint32_t* random = nullptr;        // rows x cols words, or null for RNE
  bool rht = false;                        // RHT on the colwise copy
  uint32_t rht_sign_bits = 0;              // bit i set: d_i = -1 (CPU reference)
  const uint32_t* rht_sign_bits_device = nullptr;  // CUDA launcher: the same word, on the device
  uint8_t* rowwise = nullptr;              // rows x ceil(cols/2), or null
  uint8_t* rowwise_scale = nullptr;        // Nvfp4ScaleDims(rows, cols) E4M3 bytes
  float* rowwise_global_scale_inv = nullptr;  // (1,)
  uint8_t* colwise = nullptr;              // cols x ceil(rows/2), or null
  uint8_t* colwise_scale = nullptr;        // Nvfp4ScaleDims(cols, rows)
  float* colwise_global_scale_inv = nullptr;  // (1,)
};

// CPU reference (quantize_nvfp4_ref.cc).
Status QuantizeNvfp4Ref(const QuantizeNvfp4Args& args);

// CUDA launcher (quantize_nvfp4.cu), same arguments (device pointers), no host sync. First
// pass: the copies' global amaxes, accumulated in the global_scale_inv results themselves
// (amax/amax.h, or a fused plain + RHT amax kernel with rht); second: one 64 x 64 tile of x
// per CTA through shared memory, both copies from the tile; last: global_scale_inv = 1 / S.
// Both: for rows * cols == 0 only the non-null global_scale_inv are written (1: A = 0).
Status QuantizeNvfp4Cuda(const QuantizeNvfp4Args& args, GpuStream stream);

}  // namespace lowbit
