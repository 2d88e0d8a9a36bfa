// XLA FFI handlers for lowbit_amax. Compiled twice: into liblowbit.so as the CPU
// handler (LowbitAmaxCpu) and, with LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the
// CUDA one (LowbitAmaxCuda). Both validate identically, then call amax/amax.h.
#include <string>

#include "amax/amax.h"
#include "ffi/ffi_util.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

// out has `rows` elements; x must split into `rows` equal contiguous segments.
Status AmaxShape(const ffi::AnyBuffer& x, int64_t rows, int64_t* cols) {
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision("lowbit_amax", "x", x));
  const int64_t n = ElementCount(x);
  if ((rows == 0 && n != 0) || (rows != 0 && n % rows != 0)) {
    return Status::InvalidArgument("lowbit_amax: out: " + std::to_string(rows) +
                                   " rows do not divide x's " + std::to_string(n) + " elements");
  }
  *cols = rows == 0 ? 0 : n / rows;
  return Status::Ok();
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error AmaxCpu(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t rows = ElementCount(out);
  int64_t cols = 0;
  Status s = AmaxShape(x, rows, &cols);
  if (s.ok()) s = AmaxRef(x.untyped_data(), ToDType(x.element_type()), rows, cols, out->typed_data());
  return ToFfiError(s);
}

#else

ffi::Error AmaxGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const int64_t rows = ElementCount(out);
  int64_t cols = 0;
  Status s = AmaxShape(x, rows, &cols);
  if (s.ok()) {
    s = AmaxCuda(x.untyped_data(), ToDType(x.element_type()), rows, cols, out->typed_data(), stream);
  }
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

LOWBIT_FFI_BACKEND_HANDLER(LowbitAmax, lowbit::Amax,
                           xla::ffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xla::ffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xla::ffi::AnyBuffer>()  // x: f32/f16/bf16, any shape
                               .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out: (rows,) amax per segment
