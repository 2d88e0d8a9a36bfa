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

// *out = the device workspace a CUDA handler takes as its last result: u8 (n,), n >= `need`,
// `alignment`-byte aligned (nullptr when need is 0). The Python lowering declares that result and
// drops it (lowbit/ops/_primitive.py, cuda_workspace), so XLA plans it with the program's
// memory, where XLA's FFI ScratchAllocator would allocate at run time, outside the compiled
// program's peak. Errors name "<op>: workspace".
inline Status WorkspaceFromResult(const char* op, const ffi::AnyBuffer& workspace, int64_t need, void** out,
                                  uint64_t alignment = 16) {
  *out = nullptr;
  const Dims d = DimsOf(workspace);
  if (workspace.element_type() != ffi::DataType::U8 || d.size() != 1 || d[0] < need) {
    return Invalid(op, "workspace", "expected u8 of shape (n,) with n >= " + std::to_string(need) + ", got " +
                                        Describe(workspace.element_type(), d));
  }
  if (need <= 0) return Status::Ok();
  if (reinterpret_cast<uintptr_t>(workspace.untyped_data()) % alignment != 0) {
    return Status::Internal(std::string(op) + ": workspace: expected a " + std::to_string(alignment) +
                            "-byte aligned buffer from XLA, got address " +
                            std::to_string(reinterpret_cast<uintptr_t>(workspace.untyped_data())));
  }
  *out = workspace.untyped_data();
  return Status::Ok();
}

inline Status ExpectHighPrecision(const char* op, const char* arg, const ffi::AnyBuffer& b) {
  DType t = ToDType(b.element_type());
  if (IsHighPrecision(t)) return Status::Ok();
  return Status::InvalidArgument(std::string(op) + ": " + arg +
                                 ": expected f32, f16 or bf16, got " + DTypeName(t));
}

// "<arg>: expected f32 of shape (1,), got ..." for a buffer or a result.
template <typename B>
Status ExpectScalarF32(const char* op, const char* arg, const B& b) {
  const Dims d = DimsOf(b);
  if (b.element_type() == ffi::DataType::F32 && d == Dims{1}) return Status::Ok();
  return Invalid(op, arg, "expected f32 of shape (1,), got " + Describe(b.element_type(), d));
}

// A buffer of exactly `type` and `want` dims: "expected <type> of shape <want>, got ...".
template <typename B>
Status ExpectTypeAndDims(const char* op, const char* arg, const B& b, ffi::DataType type,
                         const Dims& want) {
  if (b.element_type() == type && DimsOf(b) == want) return Status::Ok();
  return Invalid(op, arg, "expected " + Describe(type, want) + ", got " +
                              Describe(b.element_type(), DimsOf(b)));
}

inline Status ExpectFp8(const char* op, const char* arg, const ffi::AnyBuffer& b) {
  if (IsFp8(ToDType(b.element_type()))) return Status::Ok();
  return Invalid(op, arg, std::string("expected f8e4m3fn or f8e5m2, got ") +
                              DTypeName(ToDType(b.element_type())));
}

// A high-precision result of `want` dims (a dequantized copy of its input).
inline Status ExpectHighPrecisionResult(const char* op, const char* arg,
                                        const ffi::Result<ffi::AnyBuffer>& r, const Dims& want) {
  if (IsHighPrecision(ToDType(r->element_type())) && DimsOf(*r) == want) return Status::Ok();
  return Invalid(op, arg, "expected f32, f16 or bf16 of shape " + ShapeString(want) + ", got " +
                              Describe(r->element_type(), DimsOf(*r)));
}

// An fp8 result that is either empty (not requested) or has exactly `want` dims. Sets
// *requested.
inline Status ExpectOptionalFp8(const char* op, const char* arg, const ffi::Result<ffi::AnyBuffer>& r,
                                const Dims& want, bool* requested) {
  *requested = r->element_count() != 0;
  if (!*requested) return Status::Ok();
  if (IsFp8(ToDType(r->element_type())) && DimsOf(*r) == want) return Status::Ok();
  return Invalid(op, arg, "expected f8e4m3fn or f8e5m2 of shape " + ShapeString(want) +
                              " or an empty result, got " + Describe(r->element_type(), DimsOf(*r)));
}

// Two copies of one quantization share their fp8 type: "expected <like> <dtype>, got <dtype>"
// (like: "the rowwise dtype", "q_rowwise's dtype").
inline Status ExpectSameFp8(const char* op, const char* arg, const char* like,
                            const ffi::Result<ffi::AnyBuffer>& ref,
                            const ffi::Result<ffi::AnyBuffer>& r) {
  if (ref->element_type() == r->element_type()) return Status::Ok();
  return Invalid(op, arg, std::string("expected ") + like + " " +
                              DTypeName(ToDType(ref->element_type())) + ", got " +
                              DTypeName(ToDType(r->element_type())));
}

// rows x cols of a shape of rank >= 1 split at flatten_axis: rows = prod(shape[:flatten_axis]).
inline Status FlatView(const char* op, const char* arg, const Dims& shape, int32_t flatten_axis,
                       int64_t* rows, int64_t* cols) {
  const int rank = int(shape.size());
  if (rank < 1) return Invalid(op, arg, "expected rank >= 1, got a scalar");
  if (flatten_axis < 0 || flatten_axis >= rank) {
    return Invalid(op, "flatten_axis",
                   "expected a value in [0, " + std::to_string(rank - 1) + "] for " + arg +
                       " of shape " + ShapeString(shape) + ", got " + std::to_string(flatten_axis));
  }
  *rows = 1;
  *cols = 1;
  for (int i = 0; i < rank; ++i) (i < flatten_axis ? *rows : *cols) *= shape[size_t(i)];
  return Status::Ok();
}

// The colwise (transposed) copy's shape: shape[flatten_axis:] + shape[:flatten_axis].
inline Dims TransposedShape(const Dims& shape, int32_t flatten_axis) {
  Dims t(shape.begin() + flatten_axis, shape.end());
  t.insert(t.end(), shape.begin(), shape.begin() + flatten_axis);
  return t;
}

}  // namespace lowbit

// Defines an exported FFI handler symbol. The library is built with -fvisibility=hidden;
// the declaration gives the handler default visibility and exports.map keeps only Lowbit*.
#define LOWBIT_FFI_HANDLER(fn, impl, ...)                                           \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* fn(XLA_FFI_CallFrame*); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(fn, impl, __VA_ARGS__)

// One binding for both backends. Every *_ffi.cc is compiled twice: into liblowbit (the CPU
// handlers) and with LOWBIT_CUDA_HANDLERS into liblowbit_cuda. LOWBIT_FFI_BACKEND_HANDLER(
// LowbitGemm, lowbit::Gemm, binding) defines LowbitGemmCpu over lowbit::GemmCpu, or
// LowbitGemmCuda over lowbit::GemmGpu; in the binding, LOWBIT_FFI_CUDA_ONLY(.Ctx<...>())
// holds the CUDA handler's execution context (stream, device, scratch), which comes first and
// is all that differs. So the two handlers cannot disagree on operands and attributes.
#if defined(LOWBIT_CUDA_HANDLERS)
#define LOWBIT_FFI_CUDA_ONLY(...) __VA_ARGS__
#define LOWBIT_FFI_SYMBOL(base) base##Cuda
#define LOWBIT_FFI_IMPL(impl) impl##Gpu
#else
#define LOWBIT_FFI_CUDA_ONLY(...)
#define LOWBIT_FFI_SYMBOL(base) base##Cpu
#define LOWBIT_FFI_IMPL(impl) impl##Cpu
#endif
#define LOWBIT_FFI_BACKEND_HANDLER(base, impl, ...) \
  LOWBIT_FFI_HANDLER(LOWBIT_FFI_SYMBOL(base), LOWBIT_FFI_IMPL(impl), __VA_ARGS__)
