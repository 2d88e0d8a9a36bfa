// XLA FFI handlers for lowbit_norm_forward / lowbit_norm_backward (csrc/norm/norm.h).
// Compiled into liblowbit.so (CPU: the reference) and, with LOWBIT_CUDA_HANDLERS, into
// liblowbit_cuda.so (the CUDA kernels). Both decode and validate identically: x is viewed
// as rows x hidden (hidden = its last dimension); an output of 0 elements is "not wanted".
//
// Backward workspace. The CUDA backward needs NormBackwardWorkspaceBytes(x dtype, rows,
// hidden) bytes of device scratch (norm_plan.h). XLA's FFI ScratchAllocator allocates at
// run time, outside XLA's compile-time memory plan (gemm_ffi.cc), so, as XLA does for its own
// cuBLAS calls, the
// workspace is one more result of the custom call: a u8 buffer of exactly that size, added
// by the Python lowering (lowbit/ops/norm.py, which computes the size from the per-device
// shapes with the same formula) and dropped there. Both handlers bind it; the CPU one
// does not use the memory but checks the size, so the CPU suite keeps the Python and the
// C++ formula in step; the CUDA one checks that it is at least that size.
#include <cstdint>
#include <string>

#include "ffi/ffi_util.h"
#include "norm/norm.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

using ffi::AnyBuffer;
using ffi::Buffer;
using ffi::Result;

constexpr const char* kFwd = "lowbit_norm_forward";
constexpr const char* kBwd = "lowbit_norm_backward";

Status Bad(const char* op, const std::string& what) {
  return Status::InvalidArgument(std::string(op) + ": " + what);
}

// rows and hidden of x (hidden = last dimension; a scalar is rejected).
Status RowsHidden(const char* op, const AnyBuffer& x, int64_t* rows, int64_t* hidden) {
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const auto dims = x.dimensions();
  if (dims.size() == 0) return Bad(op, "x: expected at least one dimension");
  *hidden = dims[dims.size() - 1];
  if (*hidden < 1) return Bad(op, "x: hidden size must be at least 1");
  *rows = ElementCount(x) / *hidden;
  return Status::Ok();
}

// An optional buffer: `count` elements (returns its pointer) or none (returns null).
template <typename B>
Status Optional(const char* op, const char* arg, B& buf, int64_t count, void** ptr) {
  const int64_t n = int64_t(buf.element_count());
  if (n != 0 && n != count) {
    return Bad(op, std::string(arg) + ": expected " + std::to_string(count) +
                       " elements or none, got " + std::to_string(n));
  }
  *ptr = n == 0 ? nullptr : buf.untyped_data();
  return Status::Ok();
}

// A required buffer of exactly `count` elements (0 allowed when count is 0).
template <typename B>
Status Exact(const char* op, const char* arg, B& buf, int64_t count) {
  const int64_t n = int64_t(buf.element_count());
  if (n != count) {
    return Bad(op, std::string(arg) + ": expected " + std::to_string(count) + " elements, got " +
                       std::to_string(n));
  }
  return Status::Ok();
}

// The backward workspace result (see the top of the file): u8 of exactly (exact) or at
// least NormBackwardWorkspaceBytes bytes.
Status Workspace(const AnyBuffer& ws, const NormBackwardArgs& a, bool exact, void** ptr,
                 size_t* size) {
  const size_t need = NormBackwardWorkspaceBytes(a.x_dtype, a.rows, a.hidden);
  if (ws.element_type() != ffi::DataType::U8) return Bad(kBwd, "workspace: expected u8");
  const size_t got = ws.size_bytes();
  if (exact ? got != need : got < need) {
    return Bad(kBwd, "workspace: expected " + std::string(exact ? "" : "at least ") +
                         std::to_string(need) + " bytes (NormBackwardWorkspaceBytes), got " +
                         std::to_string(got) +
                         " (lowbit/ops/norm.py: norm_backward_workspace_bytes disagrees)");
  }
  *ptr = got == 0 ? nullptr : ws.untyped_data();
  *size = got;
  return Status::Ok();
}

Status ForwardArgs(AnyBuffer x, AnyBuffer gamma, AnyBuffer beta, Buffer<ffi::F32> scale,
                   Result<AnyBuffer>& y, Result<Buffer<ffi::F32>>& mu,
                   Result<Buffer<ffi::F32>>& rsigma, Result<AnyBuffer>& q_row,
                   Result<AnyBuffer>& q_col, Result<Buffer<ffi::F32>>& amax, int32_t norm_type,
                   bool zero_centered_gamma, float epsilon, NormForwardArgs* a) {
  a->norm_type = NormType(norm_type);
  a->zero_centered_gamma = zero_centered_gamma;
  a->epsilon = epsilon;
  if (norm_type != 0 && norm_type != 1) {
    return Bad(kFwd, "norm_type: expected 0 (layernorm) or 1 (rmsnorm), got " +
                         std::to_string(norm_type));
  }
  const bool ln = a->norm_type == NormType::kLayerNorm;
  LOWBIT_RETURN_IF_ERROR(RowsHidden(kFwd, x, &a->rows, &a->hidden));
  const int64_t n = ElementCount(x);
  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->gamma_dtype = ToDType(gamma.element_type());
  LOWBIT_RETURN_IF_ERROR(Exact(kFwd, "gamma", gamma, a->hidden));
  a->gamma = gamma.untyped_data();
  LOWBIT_RETURN_IF_ERROR(Exact(kFwd, "beta", beta, ln ? a->hidden : 0));
  if (ln && ToDType(beta.element_type()) != a->gamma_dtype) {
    return Bad(kFwd, "beta: expected gamma's dtype");
  }
  a->beta = ln ? beta.untyped_data() : nullptr;
  LOWBIT_RETURN_IF_ERROR(Optional(kFwd, "y", *y, n, &a->y));
  if (a->y != nullptr && ToDType(y->element_type()) != a->x_dtype) {
    return Bad(kFwd, "y: expected x's dtype");
  }
  LOWBIT_RETURN_IF_ERROR(Exact(kFwd, "mu", *mu, ln ? a->rows : 0));
  a->mu = ln ? mu->typed_data() : nullptr;
  LOWBIT_RETURN_IF_ERROR(Exact(kFwd, "rsigma", *rsigma, a->rows));
  a->rsigma = rsigma->typed_data();
  LOWBIT_RETURN_IF_ERROR(Optional(kFwd, "y_q_rowwise", *q_row, n, &a->q_rowwise));
  LOWBIT_RETURN_IF_ERROR(Optional(kFwd, "y_q_colwise", *q_col, n, &a->q_colwise));
  if (a->q_rowwise != nullptr) a->q_dtype = ToDType(q_row->element_type());
  if (a->q_colwise != nullptr) {
    const DType t = ToDType(q_col->element_type());
    if (a->q_rowwise != nullptr && t != a->q_dtype) {
      return Bad(kFwd, "y_q_colwise: expected y_q_rowwise's dtype");
    }
    a->q_dtype = t;
  }
  const bool quantize = a->q_rowwise != nullptr || a->q_colwise != nullptr;
  void* scale_ptr = nullptr;
  LOWBIT_RETURN_IF_ERROR(Optional(kFwd, "scale", scale, 1, &scale_ptr));
  if (quantize && scale_ptr == nullptr) return Bad(kFwd, "scale: expected shape (1,)");
  a->scale = static_cast<const float*>(scale_ptr);
  void* amax_ptr = nullptr;
  LOWBIT_RETURN_IF_ERROR(Optional(kFwd, "amax", *amax, 1, &amax_ptr));
  a->amax = static_cast<float*>(amax_ptr);
  return Status::Ok();
}

Status BackwardArgs(AnyBuffer dz, AnyBuffer x, Buffer<ffi::F32> mu, Buffer<ffi::F32> rsigma,
                    AnyBuffer gamma, Result<AnyBuffer>& dx, Result<AnyBuffer>& dgamma,
                    Result<AnyBuffer>& dbeta, int32_t norm_type, bool zero_centered_gamma,
                    NormBackwardArgs* a) {
  if (norm_type != 0 && norm_type != 1) {
    return Bad(kBwd, "norm_type: expected 0 (layernorm) or 1 (rmsnorm), got " +
                         std::to_string(norm_type));
  }
  a->norm_type = NormType(norm_type);
  a->zero_centered_gamma = zero_centered_gamma;
  const bool ln = a->norm_type == NormType::kLayerNorm;
  LOWBIT_RETURN_IF_ERROR(RowsHidden(kBwd, x, &a->rows, &a->hidden));
  const int64_t n = ElementCount(x);
  a->x_dtype = ToDType(x.element_type());
  a->gamma_dtype = ToDType(gamma.element_type());
  if (ToDType(dz.element_type()) != a->x_dtype) return Bad(kBwd, "dz: expected x's dtype");
  if (ToDType(dx->element_type()) != a->x_dtype) return Bad(kBwd, "dx: expected x's dtype");
  LOWBIT_RETURN_IF_ERROR(Exact(kBwd, "dz", dz, n));
  LOWBIT_RETURN_IF_ERROR(Exact(kBwd, "dx", *dx, n));
  LOWBIT_RETURN_IF_ERROR(Exact(kBwd, "mu", mu, ln ? a->rows : 0));
  LOWBIT_RETURN_IF_ERROR(Exact(kBwd, "rsigma", rsigma, a->rows));
  LOWBIT_RETURN_IF_ERROR(Exact(kBwd, "gamma", gamma, a->hidden));
  LOWBIT_RETURN_IF_ERROR(Exact(kBwd, "dgamma", *dgamma, a->hidden));
  LOWBIT_RETURN_IF_ERROR(Exact(kBwd, "dbeta", *dbeta, ln ? a->hidden : 0));
  if (ToDType(dgamma->element_type()) != a->gamma_dtype ||
      (ln && ToDType(dbeta->element_type()) != a->gamma_dtype)) {
    return Bad(kBwd, "dgamma, dbeta: expected gamma's dtype");
  }
  a->dz = dz.untyped_data();
  a->x = x.untyped_data();
  a->mu = ln ? mu.typed_data() : nullptr;
  a->rsigma = rsigma.typed_data();
  a->gamma = gamma.untyped_data();
  a->dx = dx->untyped_data();
  a->dgamma = dgamma->untyped_data();
  a->dbeta = ln ? dbeta->untyped_data() : nullptr;
  return Status::Ok();
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error NormForwardCpu(AnyBuffer x, AnyBuffer gamma, AnyBuffer beta, Buffer<ffi::F32> scale,
                          Result<AnyBuffer> y, Result<Buffer<ffi::F32>> mu,
                          Result<Buffer<ffi::F32>> rsigma, Result<AnyBuffer> q_row,
                          Result<AnyBuffer> q_col, Result<Buffer<ffi::F32>> amax,
                          int32_t norm_type, bool zero_centered_gamma, float epsilon) {
  NormForwardArgs a;
  Status s = ForwardArgs(x, gamma, beta, scale, y, mu, rsigma, q_row, q_col, amax, norm_type,
                         zero_centered_gamma, epsilon, &a);
  if (s.ok()) s = NormForwardRef(a);
  return ToFfiError(s);
}

ffi::Error NormBackwardCpu(AnyBuffer dz, AnyBuffer x, Buffer<ffi::F32> mu,
                           Buffer<ffi::F32> rsigma, AnyBuffer gamma, Result<AnyBuffer> dx,
                           Result<AnyBuffer> dgamma, Result<AnyBuffer> dbeta,
                           Result<AnyBuffer> workspace, int32_t norm_type,
                           bool zero_centered_gamma) {
  NormBackwardArgs a;
  Status s = BackwardArgs(dz, x, mu, rsigma, gamma, dx, dgamma, dbeta, norm_type,
                          zero_centered_gamma, &a);
  void* ws = nullptr;  // checked, not used: the reference needs no scratch
  size_t ws_bytes = 0;
  if (s.ok()) s = Workspace(*workspace, a, /*exact=*/true, &ws, &ws_bytes);
  if (s.ok()) s = NormBackwardRef(a);
  return ToFfiError(s);
}

#else

ffi::Error NormForwardGpu(cudaStream_t stream, AnyBuffer x, AnyBuffer gamma, AnyBuffer beta,
                          Buffer<ffi::F32> scale, Result<AnyBuffer> y,
                          Result<Buffer<ffi::F32>> mu, Result<Buffer<ffi::F32>> rsigma,
                          Result<AnyBuffer> q_row, Result<AnyBuffer> q_col,
                          Result<Buffer<ffi::F32>> amax, int32_t norm_type,
                          bool zero_centered_gamma, float epsilon) {
  NormForwardArgs a;
  Status s = ForwardArgs(x, gamma, beta, scale, y, mu, rsigma, q_row, q_col, amax, norm_type,
                         zero_centered_gamma, epsilon, &a);
  if (s.ok()) s = NormForwardCuda(a, stream);
  return ToFfiError(s);
}

ffi::Error NormBackwardGpu(cudaStream_t stream, AnyBuffer dz, AnyBuffer x, Buffer<ffi::F32> mu,
                           Buffer<ffi::F32> rsigma, AnyBuffer gamma, Result<AnyBuffer> dx,
                           Result<AnyBuffer> dgamma, Result<AnyBuffer> dbeta,
                           Result<AnyBuffer> workspace, int32_t norm_type,
                           bool zero_centered_gamma) {
  NormBackwardArgs a;
  Status s = BackwardArgs(dz, x, mu, rsigma, gamma, dx, dgamma, dbeta, norm_type,
                          zero_centered_gamma, &a);
  void* ws = nullptr;
  size_t ws_bytes = 0;
  if (s.ok()) s = Workspace(*workspace, a, /*exact=*/false, &ws, &ws_bytes);
  if (s.ok()) s = NormBackwardCuda(a, ws, ws_bytes, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitNormForward, lowbit::NormForward,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, (..., hidden)
                               .Arg<xffi::AnyBuffer>()  // gamma: (hidden,), f32 or x's dtype
                               .Arg<xffi::AnyBuffer>()  // beta: (hidden,) layernorm, (0,) rmsnorm
                               .Arg<xffi::Buffer<xffi::F32>>()  // scale: (1,) when quantizing, else (0,)
                               .Ret<xffi::AnyBuffer>()  // y: x's dtype and shape, or (0,)
                               .Ret<xffi::Buffer<xffi::F32>>()  // mu: (rows,) layernorm, (0,) rmsnorm
                               .Ret<xffi::Buffer<xffi::F32>>()  // rsigma: (rows,)
                               .Ret<xffi::AnyBuffer>()  // y_q_rowwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // y_q_colwise: fp8 (hidden, rows), or (0,)
                               .Ret<xffi::Buffer<xffi::F32>>()  // amax: (1,) max |y|, or (0,)
                               .Attr<int32_t>("norm_type")  // 0 layernorm, 1 rmsnorm
                               .Attr<bool>("zero_centered_gamma")  // w = 1 + gamma
                               .Attr<float>("epsilon"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitNormBackward, lowbit::NormBackward,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // dz: x's dtype and shape
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, (..., hidden)
                               .Arg<xffi::Buffer<xffi::F32>>()  // mu: (rows,) layernorm, (0,) rmsnorm
                               .Arg<xffi::Buffer<xffi::F32>>()  // rsigma: (rows,)
                               .Arg<xffi::AnyBuffer>()  // gamma: (hidden,)
                               .Ret<xffi::AnyBuffer>()  // dx: x's dtype and shape
                               .Ret<xffi::AnyBuffer>()  // dgamma: gamma's dtype, (hidden,)
                               .Ret<xffi::AnyBuffer>()  // dbeta: (hidden,) layernorm, (0,) rmsnorm
                               .Ret<xffi::AnyBuffer>()  // workspace: u8, NormBackwardWorkspaceBytes
                               .Attr<int32_t>("norm_type")
                               .Attr<bool>("zero_centered_gamma"));
