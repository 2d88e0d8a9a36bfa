// XLA FFI handlers for lowbit_softmax_forward and lowbit_softmax_backward
// (softmax/softmax.h). Compiled twice: into liblowbit.so as the CPU handlers and, with
// LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the CUDA ones; both validate identically.
// Logits are (batch, heads, q, k); the mask argument is (0,) unless fusion_type is
// scaled_masked, then bool/int8/uint8 of shape (batch or 1, 1, q, k).
#include <string>
#include <vector>

#include "ffi/ffi_util.h"
#include "softmax/softmax.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

Status Common(const char* op, const char* arg, const ffi::AnyBuffer& x, int32_t fusion_type, float scale,
              SoftmaxArgs* a) {
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, arg, x));
  if (fusion_type < 0 || fusion_type > 2) {
    return Invalid(op, "fusion_type", "expected 0 (scaled), 1 (scaled_masked) or 2 (scaled_upper_triang), got " +
                                          std::to_string(fusion_type));
  }
  const Dims d = DimsOf(x);
  if (d.size() != 4) return Invalid(op, arg, "expected shape (batch, heads, q, k), got " + ShapeString(d));
  a->type = SoftmaxType(fusion_type);
  a->scale = scale;
  a->batch = d[0], a->heads = d[1], a->q = d[2], a->k = d[3];
  a->dtype = ToDType(x.element_type());
  return Status::Ok();
}

Status CheckOut(const char* op, const char* arg, const ffi::Result<ffi::AnyBuffer>& out, const ffi::AnyBuffer& like) {
  if (out->element_type() == like.element_type() && DimsOf(*out) == DimsOf(like)) return Status::Ok();
  return Invalid(op, arg, std::string("expected ") + DTypeName(ToDType(like.element_type())) + " of shape " +
                              ShapeString(DimsOf(like)) + ", got " + DTypeName(ToDType(out->element_type())) +
                              " of shape " + ShapeString(DimsOf(*out)));
}

constexpr const char* kFwd = "lowbit_softmax_forward";
constexpr const char* kBwd = "lowbit_softmax_backward";

Status ForwardArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& mask, ffi::Result<ffi::AnyBuffer>& y,
                   int32_t fusion_type, float scale, SoftmaxArgs* a) {
  LOWBIT_RETURN_IF_ERROR(Common(kFwd, "x", x, fusion_type, scale, a));
  LOWBIT_RETURN_IF_ERROR(CheckOut(kFwd, "y", y, x));
  if (a->type == SoftmaxType::kScaledMasked) {
    const ffi::DataType t = mask.element_type();
    const Dims d = DimsOf(mask);
    const bool byte_type = t == ffi::DataType::PRED || t == ffi::DataType::S8 || t == ffi::DataType::U8;
    if (!byte_type || d.size() != 4 || (d[0] != 1 && d[0] != a->batch) || d[1] != 1 || d[2] != a->q ||
        d[3] != a->k) {
      return Invalid(kFwd, "mask", "expected bool, int8 or uint8 of shape (" + std::to_string(a->batch) +
                                       " or 1, 1, " + std::to_string(a->q) + ", " + std::to_string(a->k) +
                                       "), got " + DTypeName(ToDType(t)) + " of shape " + ShapeString(d));
    }
    a->mask_batch = d[0];
    a->mask = static_cast<const uint8_t*>(mask.untyped_data());
  } else if (mask.element_count() != 0) {
    return Invalid(kFwd, "mask", "expected an empty array: only scaled_masked takes a mask");
  }
  a->x = x.untyped_data();
  a->out = y->untyped_data();
  return Status::Ok();
}

Status BackwardArgs(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& y, ffi::Result<ffi::AnyBuffer>& dx,
                    int32_t fusion_type, float scale, SoftmaxArgs* a) {
  LOWBIT_RETURN_IF_ERROR(Common(kBwd, "dy", dy, fusion_type, scale, a));
  if (y.element_type() != dy.element_type() || DimsOf(y) != DimsOf(dy)) {
    return Invalid(kBwd, "y", std::string("expected dy's dtype and shape ") + ShapeString(DimsOf(dy)) + ", got " +
                                  DTypeName(ToDType(y.element_type())) + " of shape " + ShapeString(DimsOf(y)));
  }
  LOWBIT_RETURN_IF_ERROR(CheckOut(kBwd, "dx", dx, dy));
  a->dy = dy.untyped_data();
  a->y_in = y.untyped_data();
  a->out = dx->untyped_data();
  return Status::Ok();
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error ForwardCpu(ffi::AnyBuffer x, ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> y,
                      int32_t fusion_type, float scale) {
  SoftmaxArgs a;
  Status s = ForwardArgs(x, mask, y, fusion_type, scale, &a);
  if (s.ok()) s = SoftmaxForwardRef(a);
  return ToFfiError(s);
}

ffi::Error BackwardCpu(ffi::AnyBuffer dy, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> dx,
                       int32_t fusion_type, float scale) {
  SoftmaxArgs a;
  Status s = BackwardArgs(dy, y, dx, fusion_type, scale, &a);
  if (s.ok()) s = SoftmaxBackwardRef(a);
  return ToFfiError(s);
}

#else

ffi::Error ForwardGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                      ffi::Result<ffi::AnyBuffer> y, int32_t fusion_type, float scale) {
  SoftmaxArgs a;
  Status s = ForwardArgs(x, mask, y, fusion_type, scale, &a);
  if (s.ok()) s = SoftmaxForwardCuda(a, stream);
  return ToFfiError(s);
}

ffi::Error BackwardGpu(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer y,
                       ffi::Result<ffi::AnyBuffer> dx, int32_t fusion_type, float scale) {
  SoftmaxArgs a;
  Status s = BackwardArgs(dy, y, dx, fusion_type, scale, &a);
  if (s.ok()) s = SoftmaxBackwardCuda(a, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitSoftmaxForward, lowbit::Forward,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16 (batch, heads, q, k)
                               .Arg<xffi::AnyBuffer>()  // mask: bool/s8/u8 (batch or 1, 1, q, k), or (0,)
                               .Ret<xffi::AnyBuffer>()  // y: x's dtype and shape
                               .Attr<int32_t>("fusion_type")  // SoftmaxType
                               .Attr<float>("scale"));  // logit scale
LOWBIT_FFI_BACKEND_HANDLER(LowbitSoftmaxBackward, lowbit::Backward,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // dy: f32/f16/bf16 (batch, heads, q, k)
                               .Arg<xffi::AnyBuffer>()  // y: the forward output, dy's dtype and shape
                               .Ret<xffi::AnyBuffer>()  // dx: dy's dtype and shape
                               .Attr<int32_t>("fusion_type")
                               .Attr<float>("scale"));
