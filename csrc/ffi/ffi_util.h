// Helpers shared by every FFI handler: the only header that includes XLA's FFI API.
//
// Handlers decode buffers and attributes, validate them with these helpers and call a
// launcher (CUDA) or a reference (CPU) from csrc/<family>/. A failed Status becomes an
// ffi::Error whose message already names the op and the argument.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "xla/ffi/api/ffi.h"

namespace lowbit {

namespace ffi = ::xla::ffi;

inline DType ToDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F8E4M3FN: return DType::kE4M3;
    case ffi::DataType::F8E5M2: return DType::kE5M2;
    case ffi::DataType::F8E8M0FNU: return DType::kE8M0;
    case ffi::DataType::F4E2M1FN: return DType::kE2M1;
    case ffi::DataType::U8: return DType::kU8;
    case ffi::DataType::S32: return DType::kS32;
    case ffi::DataType::U32: return DType::kU32;
    default: return DType::kInvalid;
  }
}

inline ffi::Error ToFfiError(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, s.message());
    case StatusCode::kUnimplemented:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, s.message());
    default:
      return ffi::Error(ffi::ErrorCode::kInternal, s.message());
  }
}

inline int64_t ElementCount(const ffi::AnyBuffer& b) { return int64_t(b.element_count()); }

template <typename B>
int64_t ElementCount(const ffi::Result<B>& b) {
  return int64_t(b->element_count());
}

// Shapes in error messages: "f32 of shape (1,)".
using Dims = std::vector<int64_t>;

template <typename B>
Dims DimsOf(const B& b) {
  auto d = b.dimensions();
  return Dims(d.begin(), d.end());
}

inline std::string ShapeString(const Dims& d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

inline std::string Describe(ffi::DataType t, const Dims& d) {
  return std::string(DTypeName(ToDType(t))) + " of shape " + ShapeString(d);
}

// "<op>: <arg>: <what>" as an invalid-argument Status.
inline Status Invalid(const char* op, const char* arg, const std::string& what) {
  return Status::InvalidArgument(std::string(op) + ": " + arg + ": " + what);
}

inline Status ExpectHighPrecision(const char* op, const char* arg, const ffi::AnyBuffer& b) {
  DType t = ToDType(b.element_type());
  if (IsHighPrecision(t)) return Status::Ok();
  return Status::InvalidArgument(std::string(op) + ": " + arg +
                                 ": expected f32, f16 or bf16, got " + DTypeName(t));
}

}  // namespace lowbit

// Defines an exported FFI handler symbol. The library is built with -fvisibility=hidden;
// the declaration gives the handler default visibility and exports.map keeps only Lowbit*.
#define LOWBIT_FFI_HANDLER(fn, impl, ...)                                           \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* fn(XLA_FFI_CallFrame*); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(fn, impl, __VA_ARGS__)
