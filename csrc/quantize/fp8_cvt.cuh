// Device-side FP8 encoding of 16-byte chunks for the quantize kernels (quantize_tiled.cuh,
// block_tiles.cuh), activation_tiled_kernel.cuh and the norm kernels (norm_cuda.cuh): EncodeChunk
// (one scale) and EncodeChunkScaled (a factor per value), the hardware conversion where it is
// bit-identical to the formats.h codecs, the codec elsewhere, plus the scale check, the 4x4
// byte transpose of the colwise stores and vector load/store helpers.
//
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 (sm_89+, PTX ISA 7.8,
// https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-cvt)
// rounds to nearest even and saturates out-of-range values and inf to +-max: exactly
// FloatToE4m3 / FloatToE5m2 except for NaN, whose sign it drops. So a chunk whose products
// may be NaN (a NaN input, or a NaN factor) takes the codec with MulNanDefined instead.
// (quantize_fp8.cu applies the same rule with one per-tensor scale.)
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/element.h"
#include "quantize/fp8_codec.h"

namespace lowbit {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define LOWBIT_HAS_CVT_FP8X2 1
#else
#define LOWBIT_HAS_CVT_FP8X2 0
#endif

#if LOWBIT_HAS_CVT_FP8X2
// Per format (ptx_type "e4m3" or "e5m2"):
//   CvtPair(fmt, lo, hi): two codes in the low 16 bits, `lo` in bits 0-7, `hi` in bits 8-15;
//   CvtQuad(fmt, a, b, c, d): four codes (a, b, c, d in bytes 0..3) as one word, the two pairs
//   joined in the same asm so their 16-bit results need no masking (the norm kernels).
#define LOWBIT_CVT_FP8_FOR(Fmt, ptx_type)                                                          \
  __device__ __forceinline__ uint32_t CvtPair(Fmt, float lo, float hi) {                          \
    uint16_t pair;                                                                                 \
    asm("cvt.rn.satfinite." ptx_type "x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));       \
    return pair;                                                                                   \
  }                                                                                                \
  __device__ __forceinline__ uint32_t CvtQuad(Fmt, float a, float b, float c, float d) {          \
    uint32_t w;                                                                                    \
    asm("{.reg .b16 lo, hi;\n"                                                                     \
        "cvt.rn.satfinite." ptx_type "x2.f32 lo, %2, %1;\n"                                        \
        "cvt.rn.satfinite." ptx_type "x2.f32 hi, %4, %3;\n"                                        \
        "mov.b32 %0, {lo, hi};}"                                                                   \
        : "=r"(w)                                                                                  \
        : "f"(a), "f"(b), "f"(c), "f"(d));                                                         \
    return w;                                                                                      \
  }
LOWBIT_CVT_FP8_FOR(E4m3Fmt, "e4m3")
LOWBIT_CVT_FP8_FOR(E5m2Fmt, "e5m2")
#undef LOWBIT_CVT_FP8_FOR
#endif

// LoadAsFloat (element.h) with the hardware f16 -> f32 conversion (exact, subnormals
// included) instead of the portable bit manipulation. A NaN may come out with another
// payload, which no quantizer output depends on (amax NaN -> scale 1 or E8M0 0xFF, and
// MulNanDefined keeps only the sign), so its sign is restored and that is all.
__device__ __forceinline__ float LoadAsFloatFast(F32, float v) { return v; }
__device__ __forceinline__ float LoadAsFloatFast(BF16, uint16_t v) { return Bf16ToFloat(v); }
__device__ __forceinline__ float LoadAsFloatFast(F16, uint16_t v) {
  const float f = __half2float(__ushort_as_half(v));
  if (!IsNanBits(FloatBits(f))) return f;
  return BitsToFloat((uint32_t(v & 0x8000u) << 16) | 0x7FC00000u);
}

// True when scale is finite and non-zero: then x * scale is NaN only where x is NaN (the
// `no_nan` condition of EncodeChunk, given a NaN-free chunk).
__device__ __forceinline__ bool ScaleKeepsFinite(float scale) {
  const uint32_t bits = AbsBitsOf(scale);
  return bits != 0 && bits < 0x7F800000u;
}

// 4 x 4 byte transpose: byte j of w_i (bits 8j) becomes byte i of out[j] (bits 8i); the
// colwise stores of the quantize, norm and activation kernels.
__device__ __forceinline__ void Transpose4x4Bytes(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                                  uint32_t* out) {
  const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
  const uint32_t lo23 = __byte_perm(w2, w3, 0x5140), hi23 = __byte_perm(w2, w3, 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

__device__ __forceinline__ uint32_t PackCodes4(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
  return uint32_t(a) | (uint32_t(b) << 8) | (uint32_t(c) << 16) | (uint32_t(d) << 24);
}

// Encodes v[j] * scale (kN a multiple of 4) into kN / 4 little-endian words of codes.
// `no_nan`: no product can be NaN (finite non-zero scale, no NaN in v), so the hardware
// conversion gives the formats.h codec's bits.
template <typename Fmt, int kN>
__device__ __forceinline__ void EncodeChunk(Fmt fmt, const float (&v)[kN], float scale, bool no_nan,
                                            uint32_t (&words)[kN / 4]) {
#if LOWBIT_HAS_CVT_FP8X2
  if (no_nan) {
#pragma unroll
    for (int j = 0; j < kN; j += 4) {
      words[j / 4] = CvtPair(fmt, v[j] * scale, v[j + 1] * scale) |
                     (CvtPair(fmt, v[j + 2] * scale, v[j + 3] * scale) << 16);
    }
    return;
  }
#endif
  uint8_t q[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) q[j] = EncodeScaled(fmt, v[j], scale);
#pragma unroll
  for (int j = 0; j < kN; j += 4) words[j / 4] = PackCodes4(q[j], q[j + 1], q[j + 2], q[j + 3]);
}

// Encodes v[j] * s[j] (kN a multiple of 4) into kN / 4 little-endian words of codes.
// `no_nan`: no v[j] and no s[j] is NaN. The callers' factors are finite and non-zero unless
// NaN, so then no product is NaN (no 0 * inf) and the hardware path is exact.
template <typename Fmt, int kN>
__device__ __forceinline__ void EncodeChunkScaled(Fmt fmt, const float (&v)[kN], const float (&s)[kN],
                                                  bool no_nan, uint32_t (&words)[kN / 4]) {
#if LOWBIT_HAS_CVT_FP8X2
  if (no_nan) {
#pragma unroll
    for (int j = 0; j < kN; j += 4) {
      words[j / 4] = CvtPair(fmt, v[j] * s[j], v[j + 1] * s[j + 1]) |
                     (CvtPair(fmt, v[j + 2] * s[j + 2], v[j + 3] * s[j + 3]) << 16);
    }
    return;
  }
#endif
#pragma unroll
  for (int j = 0; j < kN; j += 4) {
    words[j / 4] = PackCodes4(EncodeScaled(fmt, v[j], s[j]), EncodeScaled(fmt, v[j + 1], s[j + 1]),
                              EncodeScaled(fmt, v[j + 2], s[j + 2]), EncodeScaled(fmt, v[j + 3], s[j + 3]));
  }
}

__device__ __forceinline__ uint8_t CodeOf(const uint32_t* words, int j) {
  return uint8_t(words[j / 4] >> (8 * (j % 4)));
}

// Stores kN codes (4, 8 or 16 bytes) with one aligned store.
template <int kN>
__device__ __forceinline__ void StoreCodes(uint8_t* dst, const uint32_t (&w)[kN / 4]) {
  if constexpr (kN == 4) {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  } else if constexpr (kN == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    static_assert(kN == 16, "4, 8 or 16 codes");
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Max of |x| bits over `width` consecutive lanes (a power of two <= 32, groups aligned).
template <int kWidth>
__device__ __forceinline__ uint32_t GroupMaxU32(uint32_t v) {
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

}  // namespace lowbit
