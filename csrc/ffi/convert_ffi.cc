// XLA FFI handlers for lowbit_encode / lowbit_decode (the codec ops of convert.h).
// Compiled into liblowbit.so (CPU) and, with LOWBIT_CUDA_HANDLERS, liblowbit_cuda.so.
#include <string>

#include "convert/convert.h"
#include "ffi/ffi_util.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

using ffi::Buffer;
using ffi::Result;

// random is either empty (round to nearest even) or one word per element of x.
Status EncodeArgs(const Buffer<ffi::F32>& x, const Buffer<ffi::U32>& random,
                  const Result<Buffer<ffi::U16>>& codes, const uint32_t** random_ptr) {
  const int64_t n = int64_t(x.element_count());
  if (int64_t(codes->element_count()) != n) {
    return Status::InvalidArgument("lowbit_encode: codes: expected " + std::to_string(n) +
                                   " elements");
  }
  const int64_t r = int64_t(random.element_count());
  if (r != 0 && r != n) {
    return Status::InvalidArgument("lowbit_encode: random: expected 0 or " + std::to_string(n) +
                                   " words, got " + std::to_string(r));
  }
  *random_ptr = r == 0 ? nullptr : random.typed_data();
  return Status::Ok();
}

Status DecodeArgs(const Buffer<ffi::U16>& codes, const Result<Buffer<ffi::F32>>& x) {
  if (codes.element_count() != x->element_count()) {
    return Status::InvalidArgument("lowbit_decode: x: expected as many elements as codes");
  }
  return Status::Ok();
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error EncodeCpu(Buffer<ffi::F32> x, Buffer<ffi::U32> random, Result<Buffer<ffi::U16>> codes,
                     int32_t format) {
  const uint32_t* random_ptr = nullptr;
  Status s = EncodeArgs(x, random, codes, &random_ptr);
  if (s.ok()) {
    s = EncodeRef(x.typed_data(), random_ptr, CodecFormat(format), int64_t(x.element_count()),
                  codes->typed_data());
  }
  return ToFfiError(s);
}

ffi::Error DecodeCpu(Buffer<ffi::U16> codes, Result<Buffer<ffi::F32>> x, int32_t format) {
  Status s = DecodeArgs(codes, x);
  if (s.ok()) {
    s = DecodeRef(codes.typed_data(), CodecFormat(format), int64_t(codes.element_count()),
                  x->typed_data());
  }
  return ToFfiError(s);
}

#else

ffi::Error EncodeGpu(cudaStream_t stream, Buffer<ffi::F32> x, Buffer<ffi::U32> random,
                     Result<Buffer<ffi::U16>> codes, int32_t format) {
  const uint32_t* random_ptr = nullptr;
  Status s = EncodeArgs(x, random, codes, &random_ptr);
  if (s.ok()) {
    s = EncodeCuda(x.typed_data(), random_ptr, CodecFormat(format), int64_t(x.element_count()),
                   codes->typed_data(), stream);
  }
  return ToFfiError(s);
}

ffi::Error DecodeGpu(cudaStream_t stream, Buffer<ffi::U16> codes, Result<Buffer<ffi::F32>> x,
                     int32_t format) {
  Status s = DecodeArgs(codes, x);
  if (s.ok()) {
    s = DecodeCuda(codes.typed_data(), CodecFormat(format), int64_t(codes.element_count()),
                   x->typed_data(), stream);
  }
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitEncode, lowbit::Encode,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())
                               .Arg<xffi::Buffer<xffi::F32>>()  // x: values to encode
                               .Arg<xffi::Buffer<xffi::U32>>()  // random: () or one word per value
                               .Ret<xffi::Buffer<xffi::U16>>()  // codes: same shape as x
                               .Attr<int32_t>("format"));  // CodecFormat
LOWBIT_FFI_BACKEND_HANDLER(LowbitDecode, lowbit::Decode,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())
                               .Arg<xffi::Buffer<xffi::U16>>()  // codes
                               .Ret<xffi::Buffer<xffi::F32>>()  // x: decoded values
                               .Attr<int32_t>("format"));  // CodecFormat
