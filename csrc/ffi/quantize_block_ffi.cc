// XLA FFI handlers for the block-scaled quantizers: lowbit_quantize_fp8_block,
// lowbit_dequantize_fp8_block (quantize/quantize_block.h) and lowbit_quantize_mxfp8,
// lowbit_dequantize_mxfp8 (quantize/quantize_mxfp8.h). Compiled twice, as the CPU handlers
// (references) and, with LOWBIT_CUDA_HANDLERS, the CUDA ones (launchers); both validate
// identically.
//
// x (rank >= 1) is viewed as rows x cols, rows = prod(shape[:flatten_axis]). Scale arrays
// are 2-D in the layouts of the headers. A data result with 0 elements is "not requested"
// (its scale result must then be empty too); for an empty x every result is empty.
#include <string>

#include "ffi/ffi_util.h"
#include "quantize/quantize_block.h"
#include "quantize/quantize_mxfp8.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kQuantizeBlockOp = "lowbit_quantize_fp8_block";
constexpr const char* kDequantizeBlockOp = "lowbit_dequantize_fp8_block";
constexpr const char* kQuantizeMxOp = "lowbit_quantize_mxfp8";
constexpr const char* kDequantizeMxOp = "lowbit_dequantize_mxfp8";

// rows x cols of a shape split at flatten_axis.
Status FlatView(const char* op, const char* arg, const Dims& shape, int32_t flatten_axis,
                int64_t* rows, int64_t* cols) {
  const int rank = int(shape.size());
  if (rank < 1) return Invalid(op, arg, "expected rank >= 1, got a scalar");
  if (flatten_axis < 0 || flatten_axis >= rank) {
    return Invalid(op, "flatten_axis",
                   "expected a value in [0, " + std::to_string(rank - 1) + "] for " + arg +
                       " of shape " + ShapeString(shape) + ", got " + std::to_string(flatten_axis));
  }
  *rows = 1;
  *cols = 1;
  for (int i = 0; i < rank; ++i) (i < flatten_axis ? *rows : *cols) *= shape[size_t(i)];
  return Status::Ok();
}

Dims Transposed(const Dims& shape, int32_t flatten_axis) {
  Dims t(shape.begin() + flatten_axis, shape.end());
  t.insert(t.end(), shape.begin(), shape.begin() + flatten_axis);
  return t;
}

Dims ScaleShape(const ScaleDims& d) { return Dims{d.dim0, d.dim1}; }

// One requested-or-empty copy: fp8 data of `want` dims and a scale array of `want_scale`
// dims and dtype `scale_type`. Sets *requested.
Status CheckCopy(const char* op, const char* data_arg, const char* scale_arg,
                 const ffi::Result<ffi::AnyBuffer>& data, const ffi::Result<ffi::AnyBuffer>& scale,
                 const Dims& want, const Dims& want_scale, ffi::DataType scale_type, bool* requested) {
  *requested = data->element_count() != 0;
  if (!*requested) {
    if (scale->element_count() != 0) {
      return Invalid(op, scale_arg, std::string("expected an empty result when ") + data_arg +
                                        " is not requested, got " +
                                        Describe(scale->element_type(), DimsOf(*scale)));
    }
    return Status::Ok();
  }
  if (!IsFp8(ToDType(data->element_type())) || DimsOf(*data) != want) {
    return Invalid(op, data_arg, "expected f8e4m3fn or f8e5m2 of shape " + ShapeString(want) +
                                     " or an empty result, got " +
                                     Describe(data->element_type(), DimsOf(*data)));
  }
  if (scale->element_type() != scale_type || DimsOf(*scale) != want_scale) {
    return Invalid(op, scale_arg, "expected " + Describe(scale_type, want_scale) + ", got " +
                                      Describe(scale->element_type(), DimsOf(*scale)));
  }
  return Status::Ok();
}

Status CheckSameFp8(const char* op, const ffi::Result<ffi::AnyBuffer>& rowwise,
                    const ffi::Result<ffi::AnyBuffer>& colwise) {
  if (rowwise->element_type() == colwise->element_type()) return Status::Ok();
  return Invalid(op, "colwise", std::string("expected the rowwise dtype ") +
                                    DTypeName(ToDType(rowwise->element_type())) + ", got " +
                                    DTypeName(ToDType(colwise->element_type())));
}

Status QuantizeBlockArgs(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& rowwise,
                         ffi::Result<ffi::AnyBuffer>& rowwise_scale_inv,
                         ffi::Result<ffi::AnyBuffer>& colwise,
                         ffi::Result<ffi::AnyBuffer>& colwise_scale_inv, int32_t flatten_axis,
                         bool tile_2d, bool pow2_scales, QuantizeFp8BlockArgs* a) {
  const char* op = kQuantizeBlockOp;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const Dims shape = DimsOf(x);
  LOWBIT_RETURN_IF_ERROR(FlatView(op, "x", shape, flatten_axis, &a->rows, &a->cols));
  bool want_row = false, want_col = false;
  LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "rowwise", "rowwise_scale_inv", rowwise, rowwise_scale_inv,
                                   shape, ScaleShape(Fp8BlockScaleDims(a->rows, a->cols, tile_2d)),
                                   ffi::DataType::F32, &want_row));
  LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "colwise", "colwise_scale_inv", colwise, colwise_scale_inv,
                                   Transposed(shape, flatten_axis),
                                   ScaleShape(Fp8BlockScaleDims(a->cols, a->rows, tile_2d)),
                                   ffi::DataType::F32, &want_col));
  if (want_row && want_col) LOWBIT_RETURN_IF_ERROR(CheckSameFp8(op, rowwise, colwise));
  if (a->rows * a->cols != 0 && !want_row && !want_col) {
    return Invalid(op, "rowwise", "neither rowwise nor colwise output requested");
  }
  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->out_dtype = want_row ? ToDType(rowwise->element_type())
                          : want_col ? ToDType(colwise->element_type()) : DType::kE4M3;
  a->tile_2d = tile_2d;
  a->pow2_scales = pow2_scales;
  a->rowwise = want_row ? static_cast<uint8_t*>(rowwise->untyped_data()) : nullptr;
  a->rowwise_scale_inv = want_row ? static_cast<float*>(rowwise_scale_inv->untyped_data()) : nullptr;
  a->colwise = want_col ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
  a->colwise_scale_inv = want_col ? static_cast<float*>(colwise_scale_inv->untyped_data()) : nullptr;
  return Status::Ok();
}

Status QuantizeMxArgs(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& rowwise,
                      ffi::Result<ffi::AnyBuffer>& rowwise_scale, ffi::Result<ffi::AnyBuffer>& colwise,
                      ffi::Result<ffi::AnyBuffer>& colwise_scale, int32_t flatten_axis,
                      QuantizeMxfp8Args* a) {
  const char* op = kQuantizeMxOp;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const Dims shape = DimsOf(x);
  LOWBIT_RETURN_IF_ERROR(FlatView(op, "x", shape, flatten_axis, &a->rows, &a->cols));
  bool want_row = false, want_col = false;
  LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "rowwise", "rowwise_scale", rowwise, rowwise_scale, shape,
                                   ScaleShape(Mxfp8ScaleDims(a->rows, a->cols, false)),
                                   ffi::DataType::F8E8M0FNU, &want_row));
  LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "colwise", "colwise_scale", colwise, colwise_scale, shape,
                                   ScaleShape(Mxfp8ScaleDims(a->rows, a->cols, true)),
                                   ffi::DataType::F8E8M0FNU, &want_col));
  if (want_row && want_col) LOWBIT_RETURN_IF_ERROR(CheckSameFp8(op, rowwise, colwise));
  if (a->rows * a->cols != 0 && !want_row && !want_col) {
    return Invalid(op, "rowwise", "neither rowwise nor colwise output requested");
  }
  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->out_dtype = want_row ? ToDType(rowwise->element_type())
                          : want_col ? ToDType(colwise->element_type()) : DType::kE4M3;
  a->rowwise = want_row ? static_cast<uint8_t*>(rowwise->untyped_data()) : nullptr;
  a->rowwise_scale = want_row ? static_cast<uint8_t*>(rowwise_scale->untyped_data()) : nullptr;
  a->colwise = want_col ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
  a->colwise_scale = want_col ? static_cast<uint8_t*>(colwise_scale->untyped_data()) : nullptr;
  return Status::Ok();
}

// Shared dequantize validation: data fp8 of any rank >= 1 viewed at flatten_axis, the scale
// array of `want_scale` dims and `scale_type`, out high precision of data's shape.
Status DequantizeArgs(const char* op, const char* scale_arg, const ffi::AnyBuffer& data,
                      const ffi::AnyBuffer& scale, const ffi::Result<ffi::AnyBuffer>& out,
                      ffi::DataType scale_type, const Dims& want_scale) {
  if (!IsFp8(ToDType(data.element_type()))) {
    return Invalid(op, "data", std::string("expected f8e4m3fn or f8e5m2, got ") +
                                   DTypeName(ToDType(data.element_type())));
  }
  if (scale.element_type() != scale_type || DimsOf(scale) != want_scale) {
    return Invalid(op, scale_arg, "expected " + Describe(scale_type, want_scale) + ", got " +
                                      Describe(scale.element_type(), DimsOf(scale)));
  }
  if (!IsHighPrecision(ToDType(out->element_type())) || DimsOf(*out) != DimsOf(data)) {
    return Invalid(op, "out", "expected f32, f16 or bf16 of shape " + ShapeString(DimsOf(data)) +
                                  ", got " + Describe(out->element_type(), DimsOf(*out)));
  }
  return Status::Ok();
}

Status DequantizeBlockArgs(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale_inv,
                           const ffi::Result<ffi::AnyBuffer>& out, int32_t flatten_axis,
                           bool tile_2d, int64_t* rows, int64_t* cols) {
  LOWBIT_RETURN_IF_ERROR(FlatView(kDequantizeBlockOp, "data", DimsOf(data), flatten_axis, rows, cols));
  return DequantizeArgs(kDequantizeBlockOp, "scale_inv", data, scale_inv, out, ffi::DataType::F32,
                        ScaleShape(Fp8BlockScaleDims(*rows, *cols, tile_2d)));
}

Status DequantizeMxArgs(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                        const ffi::Result<ffi::AnyBuffer>& out, int32_t flatten_axis, bool colwise,
                        int64_t* rows, int64_t* cols) {
  LOWBIT_RETURN_IF_ERROR(FlatView(kDequantizeMxOp, "data", DimsOf(data), flatten_axis, rows, cols));
  return DequantizeArgs(kDequantizeMxOp, "scale", data, scale, out, ffi::DataType::F8E8M0FNU,
                        ScaleShape(Mxfp8ScaleDims(*rows, *cols, colwise)));
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error QuantizeBlockCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rowwise,
                            ffi::Result<ffi::AnyBuffer> rowwise_scale_inv,
                            ffi::Result<ffi::AnyBuffer> colwise,
                            ffi::Result<ffi::AnyBuffer> colwise_scale_inv, int32_t flatten_axis,
                            bool tile_2d, bool pow2_scales) {
  QuantizeFp8BlockArgs a;
  Status s = QuantizeBlockArgs(x, rowwise, rowwise_scale_inv, colwise, colwise_scale_inv,
                               flatten_axis, tile_2d, pow2_scales, &a);
  if (s.ok()) s = QuantizeFp8BlockRef(a);
  return ToFfiError(s);
}

ffi::Error DequantizeBlockCpu(ffi::AnyBuffer data, ffi::AnyBuffer scale_inv,
                              ffi::Result<ffi::AnyBuffer> out, int32_t flatten_axis, bool tile_2d) {
  int64_t rows = 0, cols = 0;
  Status s = DequantizeBlockArgs(data, scale_inv, out, flatten_axis, tile_2d, &rows, &cols);
  if (s.ok()) {
    s = DequantizeFp8BlockRef(static_cast<const uint8_t*>(data.untyped_data()),
                              ToDType(data.element_type()), rows, cols, tile_2d,
                              static_cast<const float*>(scale_inv.untyped_data()),
                              out->untyped_data(), ToDType(out->element_type()));
  }
  return ToFfiError(s);
}

ffi::Error QuantizeMxCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rowwise,
                         ffi::Result<ffi::AnyBuffer> rowwise_scale, ffi::Result<ffi::AnyBuffer> colwise,
                         ffi::Result<ffi::AnyBuffer> colwise_scale, int32_t flatten_axis) {
  QuantizeMxfp8Args a;
  Status s = QuantizeMxArgs(x, rowwise, rowwise_scale, colwise, colwise_scale, flatten_axis, &a);
  if (s.ok()) s = QuantizeMxfp8Ref(a);
  return ToFfiError(s);
}

ffi::Error DequantizeMxCpu(ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out,
                           int32_t flatten_axis, bool colwise) {
  int64_t rows = 0, cols = 0;
  Status s = DequantizeMxArgs(data, scale, out, flatten_axis, colwise, &rows, &cols);
  if (s.ok()) {
    s = DequantizeMxfp8Ref(static_cast<const uint8_t*>(data.untyped_data()),
                           ToDType(data.element_type()), rows, cols, colwise,
                           static_cast<const uint8_t*>(scale.untyped_data()), out->untyped_data(),
                           ToDType(out->element_type()));
  }
  return ToFfiError(s);
}

#else

ffi::Error QuantizeBlockGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rowwise,
                            ffi::Result<ffi::AnyBuffer> rowwise_scale_inv,
                            ffi::Result<ffi::AnyBuffer> colwise,
                            ffi::Result<ffi::AnyBuffer> colwise_scale_inv, int32_t flatten_axis,
                            bool tile_2d, bool pow2_scales) {
  QuantizeFp8BlockArgs a;
  Status s = QuantizeBlockArgs(x, rowwise, rowwise_scale_inv, colwise, colwise_scale_inv,
                               flatten_axis, tile_2d, pow2_scales, &a);
  if (s.ok()) s = QuantizeFp8BlockCuda(a, stream);
  return ToFfiError(s);
}

ffi::Error DequantizeBlockGpu(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale_inv,
                              ffi::Result<ffi::AnyBuffer> out, int32_t flatten_axis, bool tile_2d) {
  int64_t rows = 0, cols = 0;
  Status s = DequantizeBlockArgs(data, scale_inv, out, flatten_axis, tile_2d, &rows, &cols);
  if (s.ok()) {
    s = DequantizeFp8BlockCuda(static_cast<const uint8_t*>(data.untyped_data()),
                               ToDType(data.element_type()), rows, cols, tile_2d,
                               static_cast<const float*>(scale_inv.untyped_data()),
                               out->untyped_data(), ToDType(out->element_type()), stream);
  }
  return ToFfiError(s);
}

ffi::Error QuantizeMxGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rowwise,
                         ffi::Result<ffi::AnyBuffer> rowwise_scale, ffi::Result<ffi::AnyBuffer> colwise,
                         ffi::Result<ffi::AnyBuffer> colwise_scale, int32_t flatten_axis) {
  QuantizeMxfp8Args a;
  Status s = QuantizeMxArgs(x, rowwise, rowwise_scale, colwise, colwise_scale, flatten_axis, &a);
  if (s.ok()) s = QuantizeMxfp8Cuda(a, stream);
  return ToFfiError(s);
}

ffi::Error DequantizeMxGpu(cudaStream_t stream, ffi::AnyBuffer data, ffi::AnyBuffer scale,
                           ffi::Result<ffi::AnyBuffer> out, int32_t flatten_axis, bool colwise) {
  int64_t rows = 0, cols = 0;
  Status s = DequantizeMxArgs(data, scale, out, flatten_axis, colwise, &rows, &cols);
  if (s.ok()) {
    s = DequantizeMxfp8Cuda(static_cast<const uint8_t*>(data.untyped_data()),
                            ToDType(data.element_type()), rows, cols, colwise,
                            static_cast<const uint8_t*>(scale.untyped_data()), out->untyped_data(),
                            ToDType(out->element_type()), stream);
  }
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

#if !defined(LOWBIT_CUDA_HANDLERS)
LOWBIT_FFI_HANDLER(LowbitQuantizeFp8BlockCpu, lowbit::QuantizeBlockCpu,
                   xffi::Ffi::Bind()
                       .Arg<xffi::AnyBuffer>()   // x: f32/f16/bf16, rank >= 1
                       .Ret<xffi::AnyBuffer>()   // rowwise: fp8, x's shape, or (0,)
                       .Ret<xffi::AnyBuffer>()   // rowwise_scale_inv: f32 Fp8BlockScaleDims(rows, cols), or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise: fp8, shape[fa:] + shape[:fa], or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise_scale_inv: f32 Fp8BlockScaleDims(cols, rows), or (0,)
                       .Attr<int32_t>("flatten_axis")
                       .Attr<bool>("tile_2d")    // 128x128 tiles, else 1x128
                       .Attr<bool>("pow2_scales"));
LOWBIT_FFI_HANDLER(LowbitDequantizeFp8BlockCpu, lowbit::DequantizeBlockCpu,
                   xffi::Ffi::Bind()
                       .Arg<xffi::AnyBuffer>()   // data: fp8, one stored copy, rank >= 1
                       .Arg<xffi::AnyBuffer>()   // scale_inv: f32 Fp8BlockScaleDims(rows, cols)
                       .Ret<xffi::AnyBuffer>()   // out: f32/f16/bf16, data's shape
                       .Attr<int32_t>("flatten_axis")
                       .Attr<bool>("tile_2d"));
LOWBIT_FFI_HANDLER(LowbitQuantizeMxfp8Cpu, lowbit::QuantizeMxCpu,
                   xffi::Ffi::Bind()
                       .Arg<xffi::AnyBuffer>()   // x: f32/f16/bf16, rank >= 1
                       .Ret<xffi::AnyBuffer>()   // rowwise: fp8, x's shape, or (0,)
                       .Ret<xffi::AnyBuffer>()   // rowwise_scale: e8m0 Mxfp8ScaleDims(rows, cols, false), or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise: fp8, x's shape, or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise_scale: e8m0 Mxfp8ScaleDims(rows, cols, true), or (0,)
                       .Attr<int32_t>("flatten_axis"));
LOWBIT_FFI_HANDLER(LowbitDequantizeMxfp8Cpu, lowbit::DequantizeMxCpu,
                   xffi::Ffi::Bind()
                       .Arg<xffi::AnyBuffer>()   // data: fp8, rank >= 1
                       .Arg<xffi::AnyBuffer>()   // scale: e8m0 Mxfp8ScaleDims(rows, cols, colwise)
                       .Ret<xffi::AnyBuffer>()   // out: f32/f16/bf16, data's shape
                       .Attr<int32_t>("flatten_axis")
                       .Attr<bool>("colwise"));  // the scales run down the columns
#else
LOWBIT_FFI_HANDLER(LowbitQuantizeFp8BlockCuda, lowbit::QuantizeBlockGpu,
                   xffi::Ffi::Bind()
                       .Ctx<xffi::PlatformStream<cudaStream_t>>()  // stream
                       .Arg<xffi::AnyBuffer>()   // x: f32/f16/bf16, rank >= 1
                       .Ret<xffi::AnyBuffer>()   // rowwise: fp8, x's shape, or (0,)
                       .Ret<xffi::AnyBuffer>()   // rowwise_scale_inv: f32 Fp8BlockScaleDims(rows, cols), or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise: fp8, shape[fa:] + shape[:fa], or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise_scale_inv: f32 Fp8BlockScaleDims(cols, rows), or (0,)
                       .Attr<int32_t>("flatten_axis")
                       .Attr<bool>("tile_2d")    // 128x128 tiles, else 1x128
                       .Attr<bool>("pow2_scales"));
LOWBIT_FFI_HANDLER(LowbitDequantizeFp8BlockCuda, lowbit::DequantizeBlockGpu,
                   xffi::Ffi::Bind()
                       .Ctx<xffi::PlatformStream<cudaStream_t>>()  // stream
                       .Arg<xffi::AnyBuffer>()   // data: fp8, one stored copy, rank >= 1
                       .Arg<xffi::AnyBuffer>()   // scale_inv: f32 Fp8BlockScaleDims(rows, cols)
                       .Ret<xffi::AnyBuffer>()   // out: f32/f16/bf16, data's shape
                       .Attr<int32_t>("flatten_axis")
                       .Attr<bool>("tile_2d"));
LOWBIT_FFI_HANDLER(LowbitQuantizeMxfp8Cuda, lowbit::QuantizeMxGpu,
                   xffi::Ffi::Bind()
                       .Ctx<xffi::PlatformStream<cudaStream_t>>()  // stream
                       .Arg<xffi::AnyBuffer>()   // x: f32/f16/bf16, rank >= 1
                       .Ret<xffi::AnyBuffer>()   // rowwise: fp8, x's shape, or (0,)
                       .Ret<xffi::AnyBuffer>()   // rowwise_scale: e8m0 Mxfp8ScaleDims(rows, cols, false), or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise: fp8, x's shape, or (0,)
                       .Ret<xffi::AnyBuffer>()   // colwise_scale: e8m0 Mxfp8ScaleDims(rows, cols, true), or (0,)
                       .Attr<int32_t>("flatten_axis"));
LOWBIT_FFI_HANDLER(LowbitDequantizeMxfp8Cuda, lowbit::DequantizeMxGpu,
                   xffi::Ffi::Bind()
                       .Ctx<xffi::PlatformStream<cudaStream_t>>()  // stream
                       .Arg<xffi::AnyBuffer>()   // data: fp8, rank >= 1
                       .Arg<xffi::AnyBuffer>()   // scale: e8m0 Mxfp8ScaleDims(rows, cols, colwise)
                       .Ret<xffi::AnyBuffer>()   // out: f32/f16/bf16, data's shape
                       .Attr<int32_t>("flatten_axis")
                       .Attr<bool>("colwise"));  // the scales run down the columns
#endif
