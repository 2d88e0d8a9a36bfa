// XLA FFI handlers for lowbit_quantize_fp8 and lowbit_dequantize_fp8 (quantize/quantize.h).
// Compiled twice: into liblowbit.so as the CPU handlers (LowbitQuantizeFp8Cpu, ...) and,
// with LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the CUDA ones. Both validate
// identically, then call the reference or the launcher.
//
// Quantize: x (any rank >= 1) is viewed as rows x cols with rows = prod(shape[:flatten_axis]).
// A result with 0 elements is "not requested" (rowwise, colwise, dbias); amax is always
// written.
// The CUDA handler takes one more result, the workspace of dbias's per-tile-row partial sums
// (u8, QuantizeFp8WorkspaceBytes; ffi_util.h: WorkspaceFromResult), which the Python lowering
// declares and drops.
#include <string>
#include <vector>

#include "ffi/ffi_util.h"
#include "quantize/quantize.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kQuantizeOp = "lowbit_quantize_fp8";
constexpr const char* kDequantizeOp = "lowbit_dequantize_fp8";

// Decodes and validates every quantize buffer into `a`.
Status QuantizeArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                    ffi::Result<ffi::AnyBuffer>& rowwise, ffi::Result<ffi::AnyBuffer>& colwise,
                    ffi::Result<ffi::AnyBuffer>& amax, ffi::Result<ffi::AnyBuffer>& dbias,
                    int32_t flatten_axis, QuantizeFp8Args* a) {
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(kQuantizeOp, "x", x));
  LOWBIT_RETURN_IF_ERROR(ExpectScalarF32(kQuantizeOp, "scale", scale));
  const Dims shape = DimsOf(x);
  LOWBIT_RETURN_IF_ERROR(FlatView(kQuantizeOp, "x", shape, flatten_axis, &a->rows, &a->cols));
  const Dims col_dims(shape.begin() + flatten_axis, shape.end());

  bool want_rowwise = false, want_colwise = false;
  LOWBIT_RETURN_IF_ERROR(ExpectOptionalFp8(kQuantizeOp, "rowwise", rowwise, shape, &want_rowwise));
  LOWBIT_RETURN_IF_ERROR(ExpectOptionalFp8(kQuantizeOp, "colwise", colwise,
                                           TransposedShape(shape, flatten_axis), &want_colwise));
  if (want_rowwise && want_colwise) {
    LOWBIT_RETURN_IF_ERROR(ExpectSameFp8(kQuantizeOp, "colwise", "the rowwise dtype", rowwise, colwise));
  }
  const int64_t n = a->rows * a->cols;
  if (n != 0 && !want_rowwise && !want_colwise) {
    return Invalid(kQuantizeOp, "rowwise", "neither rowwise nor colwise output requested");
  }
  LOWBIT_RETURN_IF_ERROR(ExpectScalarF32(kQuantizeOp, "amax", *amax));
  const bool want_dbias = dbias->element_count() != 0;
  const ffi::DataType dbias_type = dbias->element_type();
  if (want_dbias && ((dbias_type != x.element_type() && dbias_type != ffi::DataType::F32) ||
                     DimsOf(*dbias) != col_dims)) {
    return Invalid(kQuantizeOp, "dbias",
                   std::string("expected ") + DTypeName(ToDType(x.element_type())) +
                       " or f32 of shape " + ShapeString(col_dims) + " or an empty result, got " +
                       Describe(dbias_type, DimsOf(*dbias)));
  }

  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->scale = static_cast<const float*>(scale.untyped_data());
  a->out_dtype = ToDType((want_rowwise ? rowwise : colwise)->element_type());
  if (!want_rowwise && !want_colwise) a->out_dtype = DType::kE4M3;  // empty x: unused
  a->rowwise = want_rowwise ? static_cast<uint8_t*>(rowwise->untyped_data()) : nullptr;
  a->colwise = want_colwise ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
  a->amax = static_cast<float*>(amax->untyped_data());
  a->dbias = want_dbias ? dbias->untyped_data() : nullptr;
  a->dbias_dtype = ToDType(dbias_type);
  return Status::Ok();
}

Status DequantizeArgs(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale_inv,
                      const ffi::Result<ffi::AnyBuffer>& out) {
  LOWBIT_RETURN_IF_ERROR(ExpectFp8(kDequantizeOp, "data", data));
  LOWBIT_RETURN_IF_ERROR(ExpectScalarF32(kDequantizeOp, "scale_inv", scale_inv));
  return ExpectHighPrecisionResult(kDequantizeOp, "out", out, DimsOf(data));
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error QuantizeCpu(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> rowwise,
                       ffi::Result<ffi::AnyBuffer> colwise, ffi::Result<ffi::AnyBuffer> amax,
                       ffi::Result<ffi::AnyBuffer> dbias, int32_t flatten_axis) {
  QuantizeFp8Args a;
  Status s = QuantizeArgs(x, scale, rowwise, colwise, amax, dbias, flatten_axis, &a);
  if (s.ok()) s = QuantizeFp8Ref(a);
  return ToFfiError(s);
}

ffi::Error DequantizeCpu(ffi::AnyBuffer data, ffi::AnyBuffer scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  Status s = DequantizeArgs(data, scale_inv, out);
  if (s.ok()) {
    s = DequantizeFp8Ref(static_cast<const uint8_t*>(data.untyped_data()), ToDType(data.element_type()),
                         ElementCount(data), static_cast<const float*>(scale_inv.untyped_data()),
                         out->untyped_data(), ToDType(out->element_type()));
  }
  return ToFfiError(s);
}

#else

ffi::Error QuantizeGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                       ffi::Result<ffi::AnyBuffer> rowwise, ffi::Result<ffi::AnyBuffer> colwise,
                       ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> workspace, int32_t flatten_axis) {
  QuantizeFp8Args a;
  Status s = QuantizeArgs(x, scale, rowwise, colwise, amax, dbias, flatten_axis, &a);
  void* ws = nullptr;
  if (s.ok()) {
    s = WorkspaceFromResult(kQuantizeOp, *workspace, QuantizeFp8WorkspaceBytes(a.rows, a.cols, a.dbias != nullptr),
                            &ws);
  }
  if (s.ok()) s = QuantizeFp8Cuda(a, ws, stream);
  return ToFfiError(s);
}

ffi::Error DequantizeGpu(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale_inv,
                         ffi::Result<ffi::AnyBuffer> out) {
  Status s = DequantizeArgs(data, scale_inv, out);
  if (s.ok()) {
    s = DequantizeFp8Cuda(static_cast<const uint8_t*>(data.untyped_data()),
                          ToDType(data.element_type()), ElementCount(data),
                          static_cast<const float*>(scale_inv.untyped_data()), out->untyped_data(),
                          ToDType(out->element_type()), stream);
  }
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeFp8, lowbit::Quantize,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, rank >= 1
                               .Arg<xffi::AnyBuffer>()  // scale: f32 (1,)
                               .Ret<xffi::AnyBuffer>()  // rowwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8, shape[fa:] + shape[:fa], or (0,)
                               .Ret<xffi::AnyBuffer>()  // amax: f32 (1,), max |x|
                               .Ret<xffi::AnyBuffer>()  // dbias: x's dtype or f32, shape[fa:], or (0,)
                               LOWBIT_FFI_CUDA_ONLY(.Ret<xffi::AnyBuffer>())  // workspace: u8, the dbias partials
                               .Attr<int32_t>("flatten_axis"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitDequantizeFp8, lowbit::Dequantize,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // data: fp8 E4M3 or E5M2
                               .Arg<xffi::AnyBuffer>()  // scale_inv: f32 (1,)
                               .Ret<xffi::AnyBuffer>());  // out: f32/f16/bf16, data's shape
