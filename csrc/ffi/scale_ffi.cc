// XLA FFI handlers for the scale ops (scale/scale.h): lowbit_compute_scale,
// lowbit_scale_inverse and lowbit_update_delayed_scaling. Compiled twice: into
// liblowbit.so as the CPU handlers (LowbitComputeScaleCpu, ...) and, with
// LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the CUDA ones. Both validate
// identically, then call the reference or the launcher.
#include <string>

#include "ffi/ffi_util.h"
#include "scale/scale.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kComputeOp = "lowbit_compute_scale";
constexpr const char* kInverseOp = "lowbit_scale_inverse";
constexpr const char* kDelayedOp = "lowbit_update_delayed_scaling";

int64_t Count(const ffi::Buffer<ffi::F32>& b) { return int64_t(b.element_count()); }
int64_t Count(const ffi::Result<ffi::Buffer<ffi::F32>>& b) { return int64_t(b->element_count()); }

template <typename B>
Status ExpectCount(const char* op, const char* arg, const B& b, int64_t want) {
  if (Count(b) == want) return Status::Ok();
  return Invalid(op, arg, "expected " + std::to_string(want) + " values, got " +
                              std::to_string(Count(b)));
}

// in (n) -> scale_inv (n) and, for compute_scale, scale (n).
Status ElementwiseArgs(const char* op, const ffi::Buffer<ffi::F32>& in,
                       const ffi::Result<ffi::Buffer<ffi::F32>>& scale_inv,
                       const ffi::Result<ffi::Buffer<ffi::F32>>* scale) {
  const int64_t n = Count(in);
  LOWBIT_RETURN_IF_ERROR(ExpectCount(op, "scale_inv", scale_inv, n));
  if (scale != nullptr) LOWBIT_RETURN_IF_ERROR(ExpectCount(op, "scale", *scale, n));
  return Status::Ok();
}

Status DelayedArgs(const ffi::Buffer<ffi::F32>& history, const ffi::Buffer<ffi::F32>& scale,
                   const ffi::Buffer<ffi::F32>& new_amax,
                   const ffi::Result<ffi::Buffer<ffi::F32>>& new_history,
                   const ffi::Result<ffi::Buffer<ffi::F32>>& new_scale,
                   const ffi::Result<ffi::Buffer<ffi::F32>>& scale_inv, int64_t* len) {
  *len = int64_t(history.element_count());
  if (history.dimensions().size() != 1 || *len < 1) {
    return Invalid(kDelayedOp, "amax_history", "expected shape (L,) with L >= 1");
  }
  LOWBIT_RETURN_IF_ERROR(ExpectCount(kDelayedOp, "scale", scale, 1));
  LOWBIT_RETURN_IF_ERROR(ExpectCount(kDelayedOp, "new_amax", new_amax, 1));
  LOWBIT_RETURN_IF_ERROR(ExpectCount(kDelayedOp, "new_history", new_history, *len));
  LOWBIT_RETURN_IF_ERROR(ExpectCount(kDelayedOp, "new_scale", new_scale, 1));
  return ExpectCount(kDelayedOp, "scale_inv", scale_inv, 1);
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error ComputeScaleCpu(ffi::Buffer<ffi::F32> amax, ffi::Result<ffi::Buffer<ffi::F32>> scale,
                           ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, float fp8_max, bool pow2) {
  Status s = ElementwiseArgs(kComputeOp, amax, scale_inv, &scale);
  if (s.ok()) {
    s = ComputeScaleRef(amax.typed_data(), int64_t(amax.element_count()), fp8_max, pow2,
                        scale->typed_data(), scale_inv->typed_data());
  }
  return ToFfiError(s);
}

ffi::Error ScaleInverseCpu(ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv) {
  Status s = ElementwiseArgs(kInverseOp, scale, scale_inv, nullptr);
  if (s.ok()) s = ScaleInverseRef(scale.typed_data(), int64_t(scale.element_count()), scale_inv->typed_data());
  return ToFfiError(s);
}

ffi::Error UpdateDelayedCpu(ffi::Buffer<ffi::F32> history, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> new_amax,
                            ffi::Result<ffi::Buffer<ffi::F32>> new_history,
                            ffi::Result<ffi::Buffer<ffi::F32>> new_scale,
                            ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, float fp8_max,
                            int32_t margin, bool most_recent) {
  int64_t len = 0;
  Status s = DelayedArgs(history, scale, new_amax, new_history, new_scale, scale_inv, &len);
  if (s.ok()) {
    s = UpdateDelayedScalingRef(history.typed_data(), len, scale.typed_data(), new_amax.typed_data(),
                                fp8_max, margin, most_recent, new_history->typed_data(),
                                new_scale->typed_data(), scale_inv->typed_data());
  }
  return ToFfiError(s);
}

#else

ffi::Error ComputeScaleGpu(cudaStream_t stream, ffi::Buffer<ffi::F32> amax,
                           ffi::Result<ffi::Buffer<ffi::F32>> scale,
                           ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, float fp8_max, bool pow2) {
  Status s = ElementwiseArgs(kComputeOp, amax, scale_inv, &scale);
  if (s.ok()) {
    s = ComputeScaleCuda(amax.typed_data(), int64_t(amax.element_count()), fp8_max, pow2,
                         scale->typed_data(), scale_inv->typed_data(), stream);
  }
  return ToFfiError(s);
}

ffi::Error ScaleInverseGpu(cudaStream_t stream, ffi::Buffer<ffi::F32> scale,
                           ffi::Result<ffi::Buffer<ffi::F32>> scale_inv) {
  Status s = ElementwiseArgs(kInverseOp, scale, scale_inv, nullptr);
  if (s.ok()) {
    s = ScaleInverseCuda(scale.typed_data(), int64_t(scale.element_count()), scale_inv->typed_data(),
                         stream);
  }
  return ToFfiError(s);
}

ffi::Error UpdateDelayedGpu(cudaStream_t stream, ffi::Buffer<ffi::F32> history,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> new_amax,
                            ffi::Result<ffi::Buffer<ffi::F32>> new_history,
                            ffi::Result<ffi::Buffer<ffi::F32>> new_scale,
                            ffi::Result<ffi::Buffer<ffi::F32>> scale_inv, float fp8_max,
                            int32_t margin, bool most_recent) {
  int64_t len = 0;
  Status s = DelayedArgs(history, scale, new_amax, new_history, new_scale, scale_inv, &len);
  if (s.ok()) {
    s = UpdateDelayedScalingCuda(history.typed_data(), len, scale.typed_data(),
                                 new_amax.typed_data(), fp8_max, margin, most_recent,
                                 new_history->typed_data(), new_scale->typed_data(),
                                 scale_inv->typed_data(), stream);
  }
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;
using F32Buf = xffi::Buffer<xffi::F32>;

LOWBIT_FFI_BACKEND_HANDLER(LowbitComputeScale, lowbit::ComputeScale,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<F32Buf>()  // amax: f32, any shape (n values)
                               .Ret<F32Buf>()  // scale: f32, amax's shape
                               .Ret<F32Buf>()  // scale_inv: f32, amax's shape
                               .Attr<float>("fp8_max")
                               .Attr<bool>("use_power_2_scales"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitScaleInverse, lowbit::ScaleInverse,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<F32Buf>()  // scale: f32, any shape
                               .Ret<F32Buf>());  // scale_inv: f32, scale's shape
LOWBIT_FFI_BACKEND_HANDLER(LowbitUpdateDelayedScaling, lowbit::UpdateDelayed,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<F32Buf>()  // amax_history: f32 (L,)
                               .Arg<F32Buf>()  // scale: f32 (1,)
                               .Arg<F32Buf>()  // new_amax: f32 (1,)
                               .Ret<F32Buf>()  // new_history: f32 (L,)
                               .Ret<F32Buf>()  // new_scale: f32 (1,)
                               .Ret<F32Buf>()  // scale_inv: f32 (1,), 1 / new_scale
                               .Attr<float>("fp8_max")
                               .Attr<int32_t>("margin")
                               .Attr<bool>("most_recent"));
