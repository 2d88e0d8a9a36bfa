// convert: elementwise encode/decode between fp32 and lowbit's storage formats.
//
// This exposes the codecs of common/formats.h as ops so that tests can check the host
// and the device codecs against ml_dtypes over every bit pattern; the quantizers call
// the codecs directly. Codes travel as uint16 (narrow codes zero-extended).
#pragma once

#include <cstdint>

#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

enum class CodecFormat : int32_t {
  kE4M3 = 0,
  kE5M2 = 1,
  kE8M0 = 2,          // ml_dtypes rounding
  kE2M1 = 3,
  kE8M0RoundUp = 4,   // the MXFP8 scale rule (encode only)
  kBF16 = 5,
  kF16 = 6,
};

// `random` is null for round-to-nearest-even, else one word per value (stochastic;
// E4M3, E5M2 and E2M1 only).
Status EncodeRef(const float* x, const uint32_t* random, CodecFormat format, int64_t n,
                 uint16_t* codes);
Status DecodeRef(const uint16_t* codes, CodecFormat format, int64_t n, float* x);

Status EncodeCuda(const float* x, const uint32_t* random, CodecFormat format, int64_t n,
                  uint16_t* codes, GpuStream stream);
Status DecodeCuda(const uint16_t* codes, CodecFormat format, int64_t n, float* x,
                  GpuStream stream);

}  // namespace lowbit
