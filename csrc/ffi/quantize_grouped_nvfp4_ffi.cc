// XLA FFI handlers for lowbit_quantize_grouped_nvfp4 (quantize/quantize_grouped_nvfp4.h).
// Compiled twice: into liblowbit.so as the CPU handler (the reference) and, with
// LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the CUDA one (the launcher); both validate
// identically.
//
// x (rank >= 2, flatten_axis >= 1) is viewed as rows x cols; group_sizes count entries of x's
// first dim (rows_per_unit = prod(shape[1:fa])). random is uint32 of x's shape (stochastic
// rounding) or (0,); rht_sign_bits is uint32 (1,) (low 16 bits used when rht). A copy is
// requested when its global_scale_inv result is (G,), not requested when all three of its
// results are (0,); a requested copy of an empty x has empty data and scales.
#include <string>

#include "ffi/ffi_util.h"
#include "quantize/quantize_grouped_nvfp4.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_grouped_nvfp4";

// One copy's three results: all (0,) (not requested) or the given shapes. Sets *requested.
Status CheckCopy(const char* data_arg, const char* scale_arg, const char* global_arg,
                 const ffi::Result<ffi::AnyBuffer>& data, const ffi::Result<ffi::AnyBuffer>& scale,
                 const ffi::Result<ffi::AnyBuffer>& global, const Dims& want_data, const Dims& want_scale,
                 int64_t groups, bool* requested) {
  *requested = global->element_count() != 0;
  if (!*requested) {
    if (data->element_count() != 0 || scale->element_count() != 0) {
      return Invalid(kOp, global_arg, std::string("expected f32 of shape (") + std::to_string(groups) +
                                          ",) when " + data_arg + " is requested, got " +
                                          Describe(global->element_type(), DimsOf(*global)));
    }
    return Status::Ok();
  }
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(kOp, data_arg, *data, ffi::DataType::U8, want_data));
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(kOp, scale_arg, *scale, ffi::DataType::F8E4M3FN, want_scale));
  return ExpectTypeAndDims(kOp, global_arg, *global, ffi::DataType::F32, Dims{groups});
}

// Validates the call and fills *a. The RHT sign word stays where it is: read here on the CPU,
// by the kernels on the GPU.
Status ParseArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& random,
                 const ffi::AnyBuffer& rht_sign_bits, ffi::Result<ffi::AnyBuffer>& rowwise,
                 ffi::Result<ffi::AnyBuffer>& rowwise_scale, ffi::Result<ffi::AnyBuffer>& rowwise_global_scale_inv,
                 ffi::Result<ffi::AnyBuffer>& colwise, ffi::Result<ffi::AnyBuffer>& colwise_scale,
                 ffi::Result<ffi::AnyBuffer>& colwise_global_scale_inv, int32_t flatten_axis, bool tile_2d,
                 bool rht, QuantizeGroupedNvfp4Args* a) {
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
  if (random.element_count() != 0 && (random.element_type() != ffi::DataType::U32 || DimsOf(random) != shape)) {
    return Invalid(kOp, "random", "expected " + Describe(ffi::DataType::U32, shape) + " or an empty array, got " +
                                      Describe(random.element_type(), DimsOf(random)));
  }
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(kOp, "rht_sign_bits", rht_sign_bits, ffi::DataType::U32, Dims{1}));
  const int64_t G = sizes_dims[0], rows = a->rows, cols = a->cols;
  const ScaleDims row_scale = GroupedNvfp4RowScaleDims(rows, cols, G);
  bool want_row = false, want_col = false;
  LOWBIT_RETURN_IF_ERROR(CheckCopy("rowwise", "rowwise_scale", "rowwise_global_scale_inv", rowwise, rowwise_scale,
                                   rowwise_global_scale_inv, Dims{rows, CeilDivI64(cols, 2)},
                                   Dims{row_scale.dim0, row_scale.dim1}, G, &want_row));
  LOWBIT_RETURN_IF_ERROR(CheckCopy("colwise", "colwise_scale", "colwise_global_scale_inv", colwise, colwise_scale,
                                   colwise_global_scale_inv, Dims{GroupedNvfp4ColBytes(rows, cols, G)},
                                   Dims{GroupedNvfp4ColScaleBytes(rows, cols, G)}, G, &want_col));
  if (!want_row && !want_col) return Invalid(kOp, "rowwise", "neither rowwise nor colwise output requested");

  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  a->groups = G;
  a->rows_per_unit = 1;
  for (int32_t i = 1; i < flatten_axis; ++i) a->rows_per_unit *= shape[size_t(i)];
  if (a->rows_per_unit == 0) a->rows_per_unit = 1;  // x is empty: no rows to assign
  a->tile_2d = tile_2d;
  a->random = random.element_count() ? static_cast<const uint32_t*>(random.untyped_data()) : nullptr;
  a->rht = rht;
#if defined(LOWBIT_CUDA_HANDLERS)
  a->rht_sign_bits_device = static_cast<const uint32_t*>(rht_sign_bits.untyped_data());
#else
  a->rht_sign_bits = *static_cast<const uint32_t*>(rht_sign_bits.untyped_data());
#endif
  const bool has_data = rows * cols != 0;  // else data and scales are empty (null pointers)
  if (want_row) {
    a->rowwise = has_data ? static_cast<uint8_t*>(rowwise->untyped_data()) : nullptr;
    a->rowwise_scale = has_data ? static_cast<uint8_t*>(rowwise_scale->untyped_data()) : nullptr;
    a->rowwise_global_scale_inv = static_cast<float*>(rowwise_global_scale_inv->untyped_data());
  }
  if (want_col) {
    a->colwise = has_data ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
    a->colwise_scale = has_data ? static_cast<uint8_t*>(colwise_scale->untyped_data()) : nullptr;
    a->colwise_global_scale_inv = static_cast<float*>(colwise_global_scale_inv->untyped_data());
  }
  return CheckQuantizeGroupedNvfp4Args(*a);
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error GroupedNvfp4Cpu(ffi::AnyBuffer x, ffi::AnyBuffer group_sizes, ffi::AnyBuffer random,
                           ffi::AnyBuffer rht_sign_bits, ffi::Result<ffi::AnyBuffer> rowwise,
                           ffi::Result<ffi::AnyBuffer> rowwise_scale,
                           ffi::Result<ffi::AnyBuffer> rowwise_global_scale_inv,
                           ffi::Result<ffi::AnyBuffer> colwise, ffi::Result<ffi::AnyBuffer> colwise_scale,
                           ffi::Result<ffi::AnyBuffer> colwise_global_scale_inv, int32_t flatten_axis,
                           bool tile_2d, bool rht) {
  QuantizeGroupedNvfp4Args a;
  Status s = ParseArgs(x, group_sizes, random, rht_sign_bits, rowwise, rowwise_scale, rowwise_global_scale_inv,
                       colwise, colwise_scale, colwise_global_scale_inv, flatten_axis, tile_2d, rht, &a);
  if (s.ok()) s = QuantizeGroupedNvfp4Ref(a);
  return ToFfiError(s);
}

#else

ffi::Error GroupedNvfp4Gpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer group_sizes,
                           ffi::AnyBuffer random, ffi::AnyBuffer rht_sign_bits,
                           ffi::Result<ffi::AnyBuffer> rowwise, ffi::Result<ffi::AnyBuffer> rowwise_scale,
                           ffi::Result<ffi::AnyBuffer> rowwise_global_scale_inv,
                           ffi::Result<ffi::AnyBuffer> colwise, ffi::Result<ffi::AnyBuffer> colwise_scale,
                           ffi::Result<ffi::AnyBuffer> colwise_global_scale_inv,
                           ffi::Result<ffi::AnyBuffer> workspace, int32_t flatten_axis, bool tile_2d, bool rht) {
  QuantizeGroupedNvfp4Args a;
  Status s = ParseArgs(x, group_sizes, random, rht_sign_bits, rowwise, rowwise_scale, rowwise_global_scale_inv,
                       colwise, colwise_scale, colwise_global_scale_inv, flatten_axis, tile_2d, rht, &a);
  void* ws = nullptr;
  if (s.ok()) s = WorkspaceFromResult(kOp, *workspace, QuantizeGroupedNvfp4WorkspaceBytes(a.groups), &ws);
  if (s.ok()) s = QuantizeGroupedNvfp4Cuda(a, ws, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeGroupedNvfp4, lowbit::GroupedNvfp4,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, rank >= 2, groups along dim 0
                               .Arg<xffi::AnyBuffer>()  // group_sizes: s32 (G,), entries of dim 0 per group
                               .Arg<xffi::AnyBuffer>()  // random: u32, x's shape, or (0,) for RNE
                               .Arg<xffi::AnyBuffer>()  // rht_sign_bits: u32 (1,)
                               .Ret<xffi::AnyBuffer>()  // rowwise: u8 (rows, ceil(cols/2)), or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_scale: e4m3 GroupedNvfp4RowScaleDims, or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_global_scale_inv: f32 (G,), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: u8 (GroupedNvfp4ColBytes,), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale: e4m3 (GroupedNvfp4ColScaleBytes,), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_global_scale_inv: f32 (G,), or (0,)
                               LOWBIT_FFI_CUDA_ONLY(.Ret<xffi::AnyBuffer>())  // workspace: u8, group table + amax slots
                               .Attr<int32_t>("flatten_axis")
                               .Attr<bool>("tile_2d")  // 16x16 tiles, else 1x16
                               .Attr<bool>("rht"));  // random Hadamard transform on the colwise copy
