// XLA FFI handlers for lowbit_quantize_nvfp4 (quantize/quantize_nvfp4.h). Compiled twice, as
// the CPU handler (the reference) and, with LOWBIT_CUDA_HANDLERS, the CUDA one (the
// launcher); both validate identically.
//
// x (rank >= 1) is viewed as rows x cols, rows = prod(shape[:flatten_axis]). random is
// uint32 of x's shape (stochastic rounding) or (0,) (round to nearest even); rht_sign_bits
// is uint32 (1,) (low 16 bits used when rht). A data result with 0 elements is "not
// requested" unless its global scale result is (1,) (an empty x: its data and scale results
// are empty, its global scale gets 1, as A = 0 gives S = 1).
#include <string>

#include "ffi/ffi_util.h"
#include "quantize/quantize_nvfp4.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_quantize_nvfp4";

Status CheckCopy(const char* data_arg, const char* scale_arg, const char* global_arg,
                 const ffi::Result<ffi::AnyBuffer>& data, const ffi::Result<ffi::AnyBuffer>& scale,
                 const ffi::Result<ffi::AnyBuffer>& global, int64_t R, int64_t C, bool* requested) {
  // Requested copies always have a (1,) global scale (their data is empty for an empty x).
  *requested = data->element_count() != 0 || global->element_count() != 0;
  if (!*requested) {
    if (scale->element_count() != 0 || global->element_count() != 0) {
      return Invalid(kOp, scale_arg, std::string("expected empty scale results when ") + data_arg +
                                         " is not requested");
    }
    return Status::Ok();
  }
  const Dims want{R, CeilDivI64(C, 2)};
  if (data->element_type() != ffi::DataType::U8 || DimsOf(*data) != want) {
    return Invalid(kOp, data_arg, "expected " + Describe(ffi::DataType::U8, want) + ", got " +
                                      Describe(data->element_type(), DimsOf(*data)));
  }
  const ScaleDims d = Nvfp4ScaleDims(R, C);
  const Dims want_scale{d.dim0, d.dim1};
  if (scale->element_type() != ffi::DataType::F8E4M3FN || DimsOf(*scale) != want_scale) {
    return Invalid(kOp, scale_arg, "expected " + Describe(ffi::DataType::F8E4M3FN, want_scale) +
                                       ", got " + Describe(scale->element_type(), DimsOf(*scale)));
  }
  if (global->element_type() != ffi::DataType::F32 || DimsOf(*global) != Dims{1}) {
    return Invalid(kOp, global_arg, "expected " + Describe(ffi::DataType::F32, Dims{1}) + ", got " +
                                        Describe(global->element_type(), DimsOf(*global)));
  }
  return Status::Ok();
}

// Validates the call and fills *out. The RHT sign word stays where it is: read here on the
// CPU, by the kernels on the GPU. An empty x is passed on (only the global scales are written).
Status ParseArgs(ffi::AnyBuffer x, ffi::AnyBuffer random, ffi::AnyBuffer rht_sign_bits,
                 ffi::Result<ffi::AnyBuffer> rowwise, ffi::Result<ffi::AnyBuffer> rowwise_scale,
                 ffi::Result<ffi::AnyBuffer> rowwise_global_scale_inv,
                 ffi::Result<ffi::AnyBuffer> colwise, ffi::Result<ffi::AnyBuffer> colwise_scale,
                 ffi::Result<ffi::AnyBuffer> colwise_global_scale_inv, int32_t flatten_axis,
                 bool tile_2d, bool rht, QuantizeNvfp4Args* out) {
  QuantizeNvfp4Args& a = *out;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(kOp, "x", x));
  const Dims shape = DimsOf(x);
  const int rank = int(shape.size());
  if (rank < 1) return Invalid(kOp, "x", "expected rank >= 1, got a scalar");
  if (flatten_axis < 0 || flatten_axis >= rank) {
    return Invalid(kOp, "flatten_axis", "expected a value in [0, " + std::to_string(rank - 1) +
                                            "], got " + std::to_string(flatten_axis));
  }
  a.rows = 1;
  a.cols = 1;
  for (int i = 0; i < rank; ++i) (i < flatten_axis ? a.rows : a.cols) *= shape[size_t(i)];
  if (random.element_count() != 0 &&
      (random.element_type() != ffi::DataType::U32 || DimsOf(random) != shape)) {
    return Invalid(kOp, "random", "expected " + Describe(ffi::DataType::U32, shape) +
                                      " or an empty array, got " +
                                      Describe(random.element_type(), DimsOf(random)));
  }
  if (rht_sign_bits.element_type() != ffi::DataType::U32 || DimsOf(rht_sign_bits) != Dims{1}) {
    return Invalid(kOp, "rht_sign_bits", "expected " + Describe(ffi::DataType::U32, Dims{1}) +
                                             ", got " + Describe(rht_sign_bits.element_type(),
                                                                 DimsOf(rht_sign_bits)));
  }
  bool want_row = false, want_col = false;
  LOWBIT_RETURN_IF_ERROR(CheckCopy("rowwise", "rowwise_scale", "rowwise_global_scale_inv",
                                   rowwise, rowwise_scale, rowwise_global_scale_inv, a.rows, a.cols,
                                   &want_row));
  LOWBIT_RETURN_IF_ERROR(CheckCopy("colwise", "colwise_scale", "colwise_global_scale_inv",
                                   colwise, colwise_scale, colwise_global_scale_inv, a.cols, a.rows,
                                   &want_col));
  if (!want_row && !want_col) {
    return Invalid(kOp, "rowwise", "neither rowwise nor colwise output requested");
  }
  a.x = x.untyped_data();
  a.x_dtype = ToDType(x.element_type());
  a.tile_2d = tile_2d;
  a.random = random.element_count() ? static_cast<const uint32_t*>(random.untyped_data()) : nullptr;
  a.rht = rht;
#if defined(LOWBIT_CUDA_HANDLERS)
  a.rht_sign_bits_device = static_cast<const uint32_t*>(rht_sign_bits.untyped_data());
#else
  a.rht_sign_bits = *static_cast<const uint32_t*>(rht_sign_bits.untyped_data());
#endif
  if (want_row) {
    a.rowwise = static_cast<uint8_t*>(rowwise->untyped_data());
    a.rowwise_scale = static_cast<uint8_t*>(rowwise_scale->untyped_data());
    a.rowwise_global_scale_inv = static_cast<float*>(rowwise_global_scale_inv->untyped_data());
  }
  if (want_col) {
    a.colwise = static_cast<uint8_t*>(colwise->untyped_data());
    a.colwise_scale = static_cast<uint8_t*>(colwise_scale->untyped_data());
    a.colwise_global_scale_inv = static_cast<float*>(colwise_global_scale_inv->untyped_data());
  }
  return Status::Ok();
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error QuantizeNvfp4Cpu(ffi::AnyBuffer x, ffi::AnyBuffer random, ffi::AnyBuffer rht_sign_bits,
                            ffi::Result<ffi::AnyBuffer> rowwise,
                            ffi::Result<ffi::AnyBuffer> rowwise_scale,
                            ffi::Result<ffi::AnyBuffer> rowwise_global_scale_inv,
                            ffi::Result<ffi::AnyBuffer> colwise,
                            ffi::Result<ffi::AnyBuffer> colwise_scale,
                            ffi::Result<ffi::AnyBuffer> colwise_global_scale_inv,
                            int32_t flatten_axis, bool tile_2d, bool rht) {
  QuantizeNvfp4Args a;
  Status s = ParseArgs(x, random, rht_sign_bits, rowwise, rowwise_scale, rowwise_global_scale_inv,
                       colwise, colwise_scale, colwise_global_scale_inv, flatten_axis, tile_2d, rht,
                       &a);
  if (s.ok()) s = QuantizeNvfp4Ref(a);
  return ToFfiError(s);
}

#else

ffi::Error QuantizeNvfp4Gpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer random,
                            ffi::AnyBuffer rht_sign_bits, ffi::Result<ffi::AnyBuffer> rowwise,
                            ffi::Result<ffi::AnyBuffer> rowwise_scale,
                            ffi::Result<ffi::AnyBuffer> rowwise_global_scale_inv,
                            ffi::Result<ffi::AnyBuffer> colwise,
                            ffi::Result<ffi::AnyBuffer> colwise_scale,
                            ffi::Result<ffi::AnyBuffer> colwise_global_scale_inv,
                            int32_t flatten_axis, bool tile_2d, bool rht) {
  QuantizeNvfp4Args a;
  Status s = ParseArgs(x, random, rht_sign_bits, rowwise, rowwise_scale, rowwise_global_scale_inv,
                       colwise, colwise_scale, colwise_global_scale_inv, flatten_axis, tile_2d, rht,
                       &a);
  if (s.ok()) s = QuantizeNvfp4Cuda(a, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeNvfp4, lowbit::QuantizeNvfp4,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, rank >= 1
                               .Arg<xffi::AnyBuffer>()  // random: u32, x's shape, or (0,) for RNE
                               .Arg<xffi::AnyBuffer>()  // rht_sign_bits: u32 (1,)
                               .Ret<xffi::AnyBuffer>()  // rowwise: u8 (rows, ceil(cols/2)), or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_scale: e4m3 Nvfp4ScaleDims(rows, cols), or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_global_scale_inv: f32 (1,), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: u8 (cols, ceil(rows/2)), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale: e4m3 Nvfp4ScaleDims(cols, rows), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_global_scale_inv: f32 (1,), or (0,)
                               .Attr<int32_t>("flatten_axis")
                               .Attr<bool>("tile_2d")  // 16x16 tiles, else 1x16
                               .Attr<bool>("rht"));  // random Hadamard transform on the colwise copy
