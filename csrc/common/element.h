// Loading high-precision elements as fp32 and storing fp32 back, host and device, for
// the three input types lowbit accepts (f32, f16, bf16). Kernels are templated on the
// storage type; these overloads are the only place the conversions live.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/formats.h"
#include "common/status.h"

namespace lowbit {

// Storage tags: 16-bit types are carried as uint16_t bit patterns.
struct F32 { using Storage = float; static constexpr DType kDType = DType::kF32; };
struct F16 { using Storage = uint16_t; static constexpr DType kDType = DType::kF16; };
struct BF16 { using Storage = uint16_t; static constexpr DType kDType = DType::kBF16; };

LOWBIT_HD float LoadAsFloat(F32, float v) { return v; }
LOWBIT_HD float LoadAsFloat(F16, uint16_t v) { return Fp16ToFloat(v); }
LOWBIT_HD float LoadAsFloat(BF16, uint16_t v) { return Bf16ToFloat(v); }

LOWBIT_HD float StoreFromFloat(F32, float v) { return v; }
LOWBIT_HD uint16_t StoreFromFloat(F16, float v) { return FloatToFp16(v); }
LOWBIT_HD uint16_t StoreFromFloat(BF16, float v) { return FloatToBf16(v); }

// Returns fn(F32{}), fn(F16{}) or fn(BF16{}) (a Status) for a high-precision dtype, and
// an error naming `op` and `arg` for any other dtype.
template <typename Fn>
Status DispatchHighPrecision(DType dtype, const char* op, const char* arg, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: return fn(F32{});
    case DType::kF16: return fn(F16{});
    case DType::kBF16: return fn(BF16{});
    default:
      return Status::InvalidArgument(std::string(op) + ": " + arg +
                                     ": expected f32, f16 or bf16, got " + DTypeName(dtype));
  }
}

}  // namespace lowbit
