// XLA FFI handlers for lowbit_quantize_grouped_fp8 (quantize/quantize_grouped.h).
// Compiled twice: into liblowbit.so as the CPU handler (LowbitQuantizeGroupedFp8Cpu) and,
// with LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the CUDA one. Both validate
// identically, then call the reference or the launcher.
//
// x (rank >= 2 for flatten_axis >= 1) is viewed as rows x cols, rows = prod(shape[:fa]);
// group_sizes count entries of x's first dim (rows_per_unit = prod(shape[1:fa])). A
// rowwise / colwise result with 0 elements is "not requested"; scale is (G,) for delayed
// scaling and (0,) for current scaling; amax, scale_out, scale_inv are always written.
#include <string>
#include <vector>

#include "ffi/ffi_util.h"
#include "quantize/quantize_grouped.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_grouped_fp8";

Status GroupedArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& scale,
                   ffi::Result<ffi::AnyBuffer>& rowwise, ffi::Result<ffi::AnyBuffer>& colwise,
                   ffi::Result<ffi::AnyBuffer>& amax, ffi::Result<ffi::AnyBuffer>& scale_out,
                   ffi::Result<ffi::AnyBuffer>& scale_inv, int32_t flatten_axis, bool current_scaling,
                   bool use_power_2_scales, QuantizeGroupedFp8Args* a) {
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(kOp, "x", x));
  const Dims shape = DimsOf(x);
  LOWBIT_RETURN_IF_ERROR(FlatView(kOp, "x", shape, flatten_axis, &a->rows, &a->cols));
  if (flatten_axis < 1) {
    return Invalid(kOp, "flatten_axis", "expected >= 1 (groups are stacked along x's first dim), got " +
                                            std::to_string(flatten_axis));
  }
  const Dims sizes_dims = DimsOf(group_sizes);
  if (group_sizes.element_type() != ffi::DataType::S32 || sizes_dims.size() != 1 || sizes_dims[0] < 1 ||
      sizes_dims[0] > kMaxQuantizeGroups) {
    return Invalid(kOp, "group_sizes", "expected s32 of shape (G,) with 1 <= G <= " +
                                           std::to_string(kMaxQuantizeGroups) + ", got " +
                                           Describe(group_sizes.element_type(), sizes_dims));
  }
  const int64_t groups = sizes_dims[0];
  const Dims per_group{groups};
  LOWBIT_RETURN_IF_ERROR(
      ExpectTypeAndDims(kOp, "scale", scale, ffi::DataType::F32, current_scaling ? Dims{0} : per_group));
  bool want_rowwise = false, want_colwise = false;
  LOWBIT_RETURN_IF_ERROR(ExpectOptionalFp8(kOp, "rowwise", rowwise, shape, &want_rowwise));
  LOWBIT_RETURN_IF_ERROR(
      ExpectOptionalFp8(kOp, "colwise", colwise, TransposedShape(shape, flatten_axis), &want_colwise));
  if (want_rowwise && want_colwise) {
    LOWBIT_RETURN_IF_ERROR(ExpectSameFp8(kOp, "colwise", "the rowwise dtype", rowwise, colwise));
  }
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(kOp, "amax", *amax, ffi::DataType::F32, per_group));
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(kOp, "scale_out", *scale_out, ffi::DataType::F32, per_group));
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(kOp, "scale_inv", *scale_inv, ffi::DataType::F32, per_group));

  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  a->groups = groups;
  a->rows_per_unit = 1;
  for (int32_t i = 1; i < flatten_axis; ++i) a->rows_per_unit *= shape[size_t(i)];
  a->current_scaling = current_scaling;
  a->use_power_2_scales = use_power_2_scales;
  a->scale = current_scaling ? nullptr : static_cast<const float*>(scale.untyped_data());
  // Neither copy requested: the format only picks fp8_max of the current scales (E4M3).
  a->out_dtype = want_rowwise || want_colwise ? ToDType((want_rowwise ? rowwise : colwise)->element_type())
                                              : DType::kE4M3;
  a->rowwise = want_rowwise ? static_cast<uint8_t*>(rowwise->untyped_data()) : nullptr;
  a->colwise = want_colwise ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
  a->amax = static_cast<float*>(amax->untyped_data());
  a->scale_out = static_cast<float*>(scale_out->untyped_data());
  a->scale_inv = static_cast<float*>(scale_inv->untyped_data());
  if (a->rows_per_unit == 0) a->rows_per_unit = 1;  // x is empty: no rows to assign
  return CheckQuantizeGroupedFp8Args(*a);
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error GroupedCpu(ffi::AnyBuffer x, ffi::AnyBuffer group_sizes, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> rowwise, ffi::Result<ffi::AnyBuffer> colwise,
                      ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> scale_out,
                      ffi::Result<ffi::AnyBuffer> scale_inv, int32_t flatten_axis, bool current_scaling,
                      bool use_power_2_scales) {
  QuantizeGroupedFp8Args a;
  Status s = GroupedArgs(x, group_sizes, scale, rowwise, colwise, amax, scale_out, scale_inv, flatten_axis,
                         current_scaling, use_power_2_scales, &a);
  if (s.ok()) s = QuantizeGroupedFp8Ref(a);
  return ToFfiError(s);
}

#else

ffi::Error GroupedGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> rowwise, ffi::Result<ffi::AnyBuffer> colwise,
                      ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> scale_out,
                      ffi::Result<ffi::AnyBuffer> scale_inv, ffi::Result<ffi::AnyBuffer> workspace,
                      int32_t flatten_axis, bool current_scaling, bool use_power_2_scales) {
  QuantizeGroupedFp8Args a;
  Status s = GroupedArgs(x, group_sizes, scale, rowwise, colwise, amax, scale_out, scale_inv, flatten_axis,
                         current_scaling, use_power_2_scales, &a);
  void* ws = nullptr;
  if (s.ok()) s = WorkspaceFromResult(kOp, *workspace, QuantizeGroupedFp8WorkspaceBytes(a.groups), &ws);
  if (s.ok()) s = QuantizeGroupedFp8Cuda(a, ws, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeGroupedFp8, lowbit::Grouped,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, rank >= 2, groups along dim 0
                               .Arg<xffi::AnyBuffer>()  // group_sizes: s32 (G,), entries of dim 0 per group
                               .Arg<xffi::AnyBuffer>()  // scale: f32 (G,) (delayed) or (0,) (current)
                               .Ret<xffi::AnyBuffer>()  // rowwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8, shape[fa:] + shape[:fa], or (0,)
                               .Ret<xffi::AnyBuffer>()  // amax: f32 (G,), max |x| per group
                               .Ret<xffi::AnyBuffer>()  // scale_out: f32 (G,), the scale each group used
                               .Ret<xffi::AnyBuffer>()  // scale_inv: f32 (G,), 1 / scale_out
                               LOWBIT_FFI_CUDA_ONLY(.Ret<xffi::AnyBuffer>())  // workspace: u8, group end rows (int32 per group)
                               .Attr<int32_t>("flatten_axis")
                               .Attr<bool>("current_scaling")
                               .Attr<bool>("use_power_2_scales"));
