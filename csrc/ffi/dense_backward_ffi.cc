// XLA FFI handlers for lowbit_dense_backward_fp8 (dense/dense_backward.h): the backward of a
// per-tensor FP8 dense layer with dy's copies placed inside dk. Compiled twice (CPU handler
// over DenseBwdRef, CUDA handler over DenseBwdCuda); both validate identically.
#include <string>
#include <utility>

#include "dense/dense_backward.h"
#include "ffi/ffi_util.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

Status DenseBwdArgsFromBuffers(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x_col, const ffi::AnyBuffer& k_row,
                               const ffi::AnyBuffer& dy_scale, const ffi::AnyBuffer& dy_scale_inv,
                               const ffi::AnyBuffer& x_scale_inv, const ffi::AnyBuffer& k_scale_inv,
                               ffi::Result<ffi::AnyBuffer>& dx, ffi::Result<ffi::AnyBuffer>& dk,
                               ffi::Result<ffi::AnyBuffer>& dbias, ffi::Result<ffi::AnyBuffer>& amax,
                               ffi::Result<ffi::AnyBuffer>& scratch, int32_t q_dtype_code, int32_t dgrad_algo,
                               int32_t wgrad_algo, bool dgrad_split, bool wgrad_split, bool dgrad_algo_or_first,
                               bool wgrad_algo_or_first, DenseBwdArgs* a) {
  const char* op = kDenseBwdOp;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "dy", dy));
  const Dims dy_dims = DimsOf(dy);
  if (dy_dims.size() != 2) return Invalid(op, "dy", "expected rank 2 (m, n), got " + ShapeString(dy_dims));
  const int64_t m = dy_dims[0], n = dy_dims[1];
  LOWBIT_RETURN_IF_ERROR(ExpectFp8(op, "x_col", x_col));
  LOWBIT_RETURN_IF_ERROR(ExpectFp8(op, "k_row", k_row));
  const Dims x_dims = DimsOf(x_col);
  if (x_dims.size() != 2 || x_dims[1] != m) {
    return Invalid(op, "x_col", "expected (k, " + std::to_string(m) + "), got " + ShapeString(x_dims));
  }
  const int64_t k = x_dims[0];
  if (DimsOf(k_row) != Dims{k, n}) {
    return Invalid(op, "k_row", "expected " + ShapeString({k, n}) + ", got " + ShapeString(DimsOf(k_row)));
  }
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"dy_scale", &dy_scale},
                           {"dy_scale_inv", &dy_scale_inv}, {"x_scale_inv", &x_scale_inv},
                           {"k_scale_inv", &k_scale_inv}}) {
    LOWBIT_RETURN_IF_ERROR(ExpectScalarF32(op, name, *buf));
  }
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecisionResult(op, "dx", dx, {m, k}));
  const DType dk_dtype = ToDType(dk->element_type());
  if ((dk_dtype != DType::kF32 && dk_dtype != DType::kBF16 && dk_dtype != DType::kF16) || DimsOf(*dk) != Dims{k, n}) {
    return Invalid(op, "dk", "expected f32, f16 or bf16 of shape " + ShapeString({k, n}) + ", got " +
                                 Describe(dk->element_type(), DimsOf(*dk)));
  }
  const bool want_dbias = dbias->element_count() != 0;
  const DType dbias_dtype = ToDType(dbias->element_type());
  if (want_dbias && ((dbias_dtype != ToDType(dy.element_type()) && dbias_dtype != DType::kF32) ||
                     DimsOf(*dbias) != Dims{n})) {
    return Invalid(op, "dbias", "expected dy's dtype or f32 of shape " + ShapeString({n}) + ", or an empty result");
  }
  LOWBIT_RETURN_IF_ERROR(ExpectScalarF32(op, "amax", *amax));
  const DType q_dtype = DType(q_dtype_code);
  if (!IsFp8(q_dtype)) return Invalid(op, "q_dtype", "expected f8e4m3fn or f8e5m2");
  for (auto [name, algo] : {std::pair<const char*, int32_t>{"dgrad_algo", dgrad_algo}, {"wgrad_algo", wgrad_algo}}) {
    if (algo < 0 || algo >= kGemmMaxAlgo) {
      return Invalid(op, name, "expected a cuBLASLt heuristic index 0.." + std::to_string(kGemmMaxAlgo - 1) +
                                   ", got " + std::to_string(algo));
    }
  }
  a->dgrad_algo = dgrad_algo, a->wgrad_algo = wgrad_algo;
  a->dgrad_algo_or_first = dgrad_algo_or_first, a->wgrad_algo_or_first = wgrad_algo_or_first;
  a->dgrad_split = dgrad_split, a->wgrad_split = wgrad_split;
  a->m = m, a->n = n, a->k = k;
  a->dy = dy.untyped_data();
  a->dy_dtype = ToDType(dy.element_type());
  a->x_col = static_cast<const uint8_t*>(x_col.untyped_data());
  a->x_dtype = ToDType(x_col.element_type());
  a->k_row = static_cast<const uint8_t*>(k_row.untyped_data());
  a->k_dtype = ToDType(k_row.element_type());
  a->q_dtype = q_dtype;
  a->dy_scale = static_cast<const float*>(dy_scale.untyped_data());
  a->dy_scale_inv = static_cast<const float*>(dy_scale_inv.untyped_data());
  a->x_scale_inv = static_cast<const float*>(x_scale_inv.untyped_data());
  a->k_scale_inv = static_cast<const float*>(k_scale_inv.untyped_data());
  a->dx = dx->untyped_data();
  a->dx_dtype = ToDType(dx->element_type());
  a->dk = dk->untyped_data();
  a->dk_dtype = dk_dtype;
  a->dbias = want_dbias ? dbias->untyped_data() : nullptr;
  a->dbias_dtype = dbias_dtype;
  a->amax = static_cast<float*>(amax->untyped_data());
  a->scratch = static_cast<uint8_t*>(scratch->untyped_data());
#if defined(LOWBIT_CUDA_HANDLERS)
  const int64_t gemm_workspace_bytes = int64_t(kGemmWorkspaceBytes);
#else
  const int64_t gemm_workspace_bytes = 0;  // the reference needs no cuBLASLt workspace
#endif
  DenseBwdPlan plan;
  LOWBIT_RETURN_IF_ERROR(MakeDenseBwdPlanFor(*a, gemm_workspace_bytes, &plan));
  if (scratch->element_type() != ffi::DataType::U8 || int64_t(scratch->size_bytes()) < plan.scratch_bytes) {
    return Invalid(op, "scratch", "expected u8 of at least " + std::to_string(plan.scratch_bytes) + " bytes");
  }
#if defined(LOWBIT_CUDA_HANDLERS)  // cuBLASLt's workspace and the slices' 16-byte stores
  if (reinterpret_cast<uintptr_t>(a->scratch) % kDenseBwdAlign != 0) {
    return Invalid(op, "scratch", "expected a 256-byte aligned buffer from XLA");
  }
#endif
  return Status::Ok();
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error DenseBwdCpu(ffi::AnyBuffer dy, ffi::AnyBuffer x_col, ffi::AnyBuffer k_row, ffi::AnyBuffer dy_scale,
                       ffi::AnyBuffer dy_scale_inv, ffi::AnyBuffer x_scale_inv, ffi::AnyBuffer k_scale_inv,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dk,
                       ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> amax,
                       ffi::Result<ffi::AnyBuffer> scratch, int32_t q_dtype, int32_t dgrad_algo,
                       int32_t wgrad_algo, bool dgrad_split, bool wgrad_split, bool dgrad_algo_or_first,
                       bool wgrad_algo_or_first) {
  DenseBwdArgs a;
  Status s = DenseBwdArgsFromBuffers(dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv, dx, dk,
                                     dbias, amax, scratch, q_dtype, dgrad_algo, wgrad_algo, dgrad_split,
                                     wgrad_split, dgrad_algo_or_first, wgrad_algo_or_first, &a);
  if (s.ok()) s = DenseBwdRef(a);
  return ToFfiError(s);
}

#else

ffi::Error DenseBwdGpu(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer dy, ffi::AnyBuffer x_col,
                       ffi::AnyBuffer k_row, ffi::AnyBuffer dy_scale, ffi::AnyBuffer dy_scale_inv,
                       ffi::AnyBuffer x_scale_inv, ffi::AnyBuffer k_scale_inv, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> scratch, int32_t q_dtype,
                       int32_t dgrad_algo, int32_t wgrad_algo, bool dgrad_split, bool wgrad_split,
                       bool dgrad_algo_or_first, bool wgrad_algo_or_first) {
  DenseBwdArgs a;
  Status s = DenseBwdArgsFromBuffers(dy, x_col, k_row, dy_scale, dy_scale_inv, x_scale_inv, k_scale_inv, dx, dk,
                                     dbias, amax, scratch, q_dtype, dgrad_algo, wgrad_algo, dgrad_split,
                                     wgrad_split, dgrad_algo_or_first, wgrad_algo_or_first, &a);
  if (s.ok()) s = DenseBwdCuda(a, device_ordinal, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitDenseBackwardFp8, lowbit::DenseBwd,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::DeviceOrdinal>())  // device: cuBLASLt handle and plans
                               .Arg<xffi::AnyBuffer>()  // dy: (m, n) f32 / f16 / bf16
                               .Arg<xffi::AnyBuffer>()  // x_col: (k, m) fp8, x's saved colwise copy
                               .Arg<xffi::AnyBuffer>()  // k_row: (k, n) fp8, the kernel's saved rowwise copy
                               .Arg<xffi::AnyBuffer>()  // dy_scale: f32 (1,)
                               .Arg<xffi::AnyBuffer>()  // dy_scale_inv: f32 (1,)
                               .Arg<xffi::AnyBuffer>()  // x_scale_inv: f32 (1,)
                               .Arg<xffi::AnyBuffer>()  // k_scale_inv: f32 (1,)
                               .Ret<xffi::AnyBuffer>()  // dx: (m, k) f32 / f16 / bf16
                               .Ret<xffi::AnyBuffer>()  // dk: (k, n) f32 / f16 / bf16; holds dy's copies until the wgrad
                               .Ret<xffi::AnyBuffer>()  // dbias: (n,) dy's dtype or f32, or (0,)
                               .Ret<xffi::AnyBuffer>()  // amax: f32 (1,), dy's
                               .Ret<xffi::AnyBuffer>()  // scratch: u8 (plan.scratch_bytes,); CUDA: with the cuBLASLt workspace, 256-B aligned
                               .Attr<int32_t>("q_dtype")  // dy's FP8 dtype as lowbit::DType (kE4M3 = 4, kE5M2 = 5)
                               .Attr<int32_t>("dgrad_algo")  // cuBLASLt heuristic index of the dgrad (0..31)
                               .Attr<int32_t>("wgrad_algo")  // and of the wgrad launches
                               .Attr<bool>("dgrad_split")  // split (true) or fast FP8 accumulation of the dgrad
                               .Attr<bool>("wgrad_split")  // and of the wgrad
                               // true: the dgrad's index is a library default (not LOWBIT_GEMM_ALGO's), and a
                               // problem cuBLASLt offers no such entry for runs its first choice instead
                               .Attr<bool>("dgrad_algo_or_first")
                               .Attr<bool>("wgrad_algo_or_first"));  // the same for the wgrad launches
