// DType: the element types lowbit's kernels read and write, independent of XLA.
//
// csrc/ffi/ffi_util.h maps xla::ffi::DataType onto this enum; code below the FFI
// layer sees only DType. Sub-byte E2M1 data is stored two values per byte (low nibble
// first), as XLA stores f4e2m1fn.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lowbit {

enum class DType : uint8_t {
  kInvalid = 0,
  kF32,
  kF16,
  kBF16,
  kE4M3,  // float8_e4m3fn: no inf, NaN = S.1111.111, max 448
  kE5M2,  // float8_e5m2: IEEE-like, max 57344
  kE8M0,  // float8_e8m0fnu: exponent only, NaN = 0xFF
  kE2M1,  // float4_e2m1fn: no inf or NaN, max 6
  kU8,
  kS32,
  kU32,
};

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kE4M3: return "f8e4m3fn";
    case DType::kE5M2: return "f8e5m2";
    case DType::kE8M0: return "f8e8m0fnu";
    case DType::kE2M1: return "f4e2m1fn";
    case DType::kU8: return "u8";
    case DType::kS32: return "s32";
    case DType::kU32: return "u32";
    default: return "unsupported";
  }
}

inline bool IsHighPrecision(DType t) {
  return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16;
}

inline bool IsFp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

}  // namespace lowbit
