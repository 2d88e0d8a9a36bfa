// XLA FFI handlers for lowbit_quantize_grouped_block (quantize/quantize_grouped_block.h).
// Compiled twice: into liblowbit.so as the CPU handler (LowbitQuantizeGroupedBlockCpu) and,
// with LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the CUDA one. Both validate
// identically, then call the reference or the launcher.
//
// x (rank >= 2, flatten_axis >= 1) is viewed as rows x cols; group_sizes count entries of
// x's first dim (rows_per_unit = prod(shape[1:fa])). A data result with 0 elements is "not
// requested" unless its scale result is not empty (an empty x still has group-bound scale
// arrays, all 0); otherwise the scale result must be empty too. kind: 0 MXFP8, 1 FP8 block 1x128,
// 2 FP8 block 128x128 (GroupedBlockKind).
#include <string>

#include "ffi/ffi_util.h"
#include "quantize/quantize_grouped_block.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_grouped_block";

Dims ScaleShape(const ScaleDims& d) { return Dims{d.dim0, d.dim1}; }

// One requested-or-empty copy with its scale array. Sets *requested.
Status CheckCopy(const char* data_arg, const char* scale_arg, const ffi::Result<ffi::AnyBuffer>& data,
                 const ffi::Result<ffi::AnyBuffer>& scale, const Dims& want, const ScaleDims& want_scale,
                 ffi::DataType scale_type, bool* requested) {
  LOWBIT_RETURN_IF_ERROR(ExpectOptionalFp8(kOp, data_arg, data, want, requested));
  const bool empty_x_scales = !*requested && scale->element_count() != 0 && want_scale.size() != 0 &&
                              DimsOf(*data) == want;  // requested copy of an empty x
  if (*requested || empty_x_scales) {
    *requested = true;
    return ExpectTypeAndDims(kOp, scale_arg, *scale, scale_type, ScaleShape(want_scale));
  }
  if (scale->element_count() == 0) return Status::Ok();
  return Invalid(kOp, scale_arg, std::string("expected an empty result when ") + data_arg + " is not requested, got " +
                                     Describe(scale->element_type(), DimsOf(*scale)));
}

Status GroupedBlockArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& group_sizes,
                        ffi::Result<ffi::AnyBuffer>& rowwise, ffi::Result<ffi::AnyBuffer>& rowwise_scale,
                        ffi::Result<ffi::AnyBuffer>& colwise, ffi::Result<ffi::AnyBuffer>& colwise_scale,
                        int32_t flatten_axis, int32_t kind, bool pow2_scales, QuantizeGroupedBlockArgs* a) {
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(kOp, "x", x));
  const Dims shape = DimsOf(x);
  LOWBIT_RETURN_IF_ERROR(FlatView(kOp, "x", shape, flatten_axis, &a->rows, &a->cols));
  if (flatten_axis < 1) {
    return Invalid(kOp, "flatten_axis", "expected >= 1 (groups are stacked along x's first dim), got " +
                                            std::to_string(flatten_axis));
  }
  if (kind < 0 || kind > 2) {
    return Invalid(kOp, "kind", "expected 0 (MXFP8), 1 (FP8 block 1x128) or 2 (FP8 block 128x128), got " +
                                    std::to_string(kind));
  }
  const Dims sizes_dims = DimsOf(group_sizes);
  if (group_sizes.element_type() != ffi::DataType::S32 || sizes_dims.size() != 1 || sizes_dims[0] < 1 ||
      sizes_dims[0] > kMaxQuantizeGroups) {
    return Invalid(kOp, "group_sizes", "expected s32 of shape (G,) with 1 <= G <= " +
                                           std::to_string(kMaxQuantizeGroups) + ", got " +
                                           Describe(group_sizes.element_type(), sizes_dims));
  }
  const int64_t G = sizes_dims[0], rows = a->rows, cols = a->cols;
  a->kind = GroupedBlockKind(kind);
  const bool mx = a->kind == GroupedBlockKind::kMxfp8, tile_2d = a->kind == GroupedBlockKind::kFp8Block128x128;
  const ffi::DataType scale_type = mx ? ffi::DataType::F8E8M0FNU : ffi::DataType::F32;
  const ScaleDims row_scale = mx ? Mxfp8ScaleDims(rows, cols, false)
                              : tile_2d ? GroupedFp8Block2dRowScaleDims(rows, cols, G)
                                        : Fp8BlockScaleDims(rows, cols, false);
  const ScaleDims col_scale = mx ? GroupedMxfp8ColScaleDims(rows, cols, G) : GroupedFp8BlockColScaleDims(rows, cols, G, tile_2d);
  bool want_row = false, want_col = false;
  LOWBIT_RETURN_IF_ERROR(CheckCopy("rowwise", "rowwise_scale", rowwise, rowwise_scale, shape, row_scale, scale_type,
                                   &want_row));
  LOWBIT_RETURN_IF_ERROR(CheckCopy("colwise", "colwise_scale", colwise, colwise_scale,
                                   mx ? shape : TransposedShape(shape, flatten_axis), col_scale, scale_type,
                                   &want_col));
  if (want_row && want_col) LOWBIT_RETURN_IF_ERROR(ExpectSameFp8(kOp, "colwise", "the rowwise dtype", rowwise, colwise));

  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  a->groups = G;
  a->rows_per_unit = 1;
  for (int32_t i = 1; i < flatten_axis; ++i) a->rows_per_unit *= shape[size_t(i)];
  if (a->rows_per_unit == 0) a->rows_per_unit = 1;  // x is empty: no rows to assign
  a->pow2_scales = pow2_scales;
  a->out_dtype = want_row ? ToDType(rowwise->element_type())
                          : want_col ? ToDType(colwise->element_type()) : DType::kE4M3;
  // A requested copy of an empty x has no data (its pointer may be null), only scales.
  const bool has_data = rows * cols != 0;
  a->rowwise = want_row && has_data ? static_cast<uint8_t*>(rowwise->untyped_data()) : nullptr;
  a->rowwise_scale = want_row && rowwise_scale->element_count() != 0 ? rowwise_scale->untyped_data() : nullptr;
  a->colwise = want_col && has_data ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
  a->colwise_scale = want_col && colwise_scale->element_count() != 0 ? colwise_scale->untyped_data() : nullptr;
  return CheckQuantizeGroupedBlockArgs(*a);
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error GroupedBlockCpu(ffi::AnyBuffer x, ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> rowwise,
                           ffi::Result<ffi::AnyBuffer> rowwise_scale, ffi::Result<ffi::AnyBuffer> colwise,
                           ffi::Result<ffi::AnyBuffer> colwise_scale, int32_t flatten_axis, int32_t kind,
                           bool pow2_scales) {
  QuantizeGroupedBlockArgs a;
  Status s = GroupedBlockArgs(x, group_sizes, rowwise, rowwise_scale, colwise, colwise_scale, flatten_axis, kind,
                              pow2_scales, &a);
  if (s.ok()) s = QuantizeGroupedBlockRef(a);
  return ToFfiError(s);
}

#else

ffi::Error GroupedBlockGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                           ffi::Result<ffi::AnyBuffer> rowwise, ffi::Result<ffi::AnyBuffer> rowwise_scale,
                           ffi::Result<ffi::AnyBuffer> colwise, ffi::Result<ffi::AnyBuffer> colwise_scale,
                           ffi::Result<ffi::AnyBuffer> workspace, int32_t flatten_axis, int32_t kind,
                           bool pow2_scales) {
  QuantizeGroupedBlockArgs a;
  Status s = GroupedBlockArgs(x, group_sizes, rowwise, rowwise_scale, colwise, colwise_scale, flatten_axis, kind,
                              pow2_scales, &a);
  void* ws = nullptr;
  if (s.ok()) s = WorkspaceFromResult(kOp, *workspace, QuantizeGroupedBlockWorkspaceBytes(a.groups), &ws);
  if (s.ok()) s = QuantizeGroupedBlockCuda(a, ws, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeGroupedBlock, lowbit::GroupedBlock,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, rank >= 2, groups along dim 0
                               .Arg<xffi::AnyBuffer>()  // group_sizes: s32 (G,), entries of dim 0 per group
                               .Ret<xffi::AnyBuffer>()  // rowwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_scale: e8m0 / f32, see quantize_grouped_block.h, or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8, x's shape (MXFP8) or shape[fa:] + shape[:fa], or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale: e8m0 / f32, grouped layout, or (0,)
                               LOWBIT_FFI_CUDA_ONLY(.Ret<xffi::AnyBuffer>())  // workspace: u8, the group table (G + 1 entries)
                               .Attr<int32_t>("flatten_axis")
                               .Attr<int32_t>("kind")  // GroupedBlockKind
                               .Attr<bool>("pow2_scales"));
