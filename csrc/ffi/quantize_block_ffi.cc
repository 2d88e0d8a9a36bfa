// XLA FFI handlers for the block-scaled quantizers: lowbit_quantize_fp8_block,
// lowbit_dequantize_fp8_block (quantize/quantize_block.h) and lowbit_quantize_mxfp8,
// lowbit_dequantize_mxfp8 (quantize/quantize_mxfp8.h). Compiled twice, as the CPU handlers
// (references) and, with LOWBIT_CUDA_HANDLERS, the CUDA ones (launchers); both validate
// identically.
//
// x (rank >= 1) is viewed as rows x cols, rows = prod(shape[:flatten_axis]). Scale arrays
// are 2-D in the layouts of the headers. A data result with 0 elements is "not requested"
// (its scale result must then be empty too); for an empty x every result is empty. dbias
// (the column sums, quantize/block_dbias.h) is f32 or x's dtype of shape shape[fa:], or (0,)
// when not requested; the CUDA handlers take its per-tile-row partial sums in a last u8
// result, the workspace (ffi_util.h: WorkspaceFromResult), which the Python lowering drops.
//
// lowbit_quantize_fp8_block_colwise_rows: the colwise copy (and its scale_inv) of rows
// [row_begin, row_begin + row_count) of a 2-D x, read in place (no slice of x is made), equal
// to lowbit_quantize_fp8_block's colwise copy of those rows: row_begin is a multiple of 128,
// so the window's blocks are x's. lowbit.dense's block backward quantizes dy's colwise copy
// so, one band of rows per wgrad launch, to keep only a band alive (lowbit/ops/quantize_block_rows.py).
#include <string>

#include "ffi/ffi_util.h"
#include "quantize/block_dbias.h"
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

Dims ScaleShape(const ScaleDims& d) { return Dims{d.dim0, d.dim1}; }

// One requested-or-empty copy: fp8 data of `want` dims and a scale array of `want_scale`
// dims and dtype `scale_type`. Sets *requested.
Status CheckCopy(const char* op, const char* data_arg, const char* scale_arg,
                 const ffi::Result<ffi::AnyBuffer>& data, const ffi::Result<ffi::AnyBuffer>& scale,
                 const Dims& want, const Dims& want_scale, ffi::DataType scale_type, bool* requested) {
  LOWBIT_RETURN_IF_ERROR(ExpectOptionalFp8(op, data_arg, data, want, requested));
  if (*requested) return ExpectTypeAndDims(op, scale_arg, *scale, scale_type, want_scale);
  if (scale->element_count() == 0) return Status::Ok();
  return Invalid(op, scale_arg, std::string("expected an empty result when ") + data_arg +
                                    " is not requested, got " +
                                    Describe(scale->element_type(), DimsOf(*scale)));
}

// The buffers of one block-scaled quantization: both copies with their scale arrays, dbias.
struct Copies {
  ffi::Result<ffi::AnyBuffer>& rowwise;
  ffi::Result<ffi::AnyBuffer>& rowwise_scale;
  ffi::Result<ffi::AnyBuffer>& colwise;
  ffi::Result<ffi::AnyBuffer>& colwise_scale;
  ffi::Result<ffi::AnyBuffer>& dbias;
};

// dbias: empty (not requested; *out = null) or f32 / x's dtype of shape shape[fa:].
Status CheckDbias(const char* op, const ffi::AnyBuffer& x, const ffi::Result<ffi::AnyBuffer>& dbias,
                  const Dims& shape, int32_t flatten_axis, void** out, DType* dtype) {
  *out = nullptr;
  *dtype = ToDType(dbias->element_type());
  if (dbias->element_count() == 0 && DimsOf(*dbias) == Dims{0}) return Status::Ok();
  const Dims col_dims(shape.begin() + flatten_axis, shape.end());
  const ffi::DataType t = dbias->element_type();
  if ((t != x.element_type() && t != ffi::DataType::F32) || DimsOf(*dbias) != col_dims) {
    return Invalid(op, "dbias", std::string("expected ") + DTypeName(ToDType(x.element_type())) + " or f32 of shape " +
                                    ShapeString(col_dims) + " or an empty result, got " +
                                    Describe(t, DimsOf(*dbias)));
  }
  *out = dbias->untyped_data();
  return Status::Ok();
}

// What both quantizers check after x's flat view: each copy requested or empty, the
// colwise copy in `colwise_shape`, one fp8 type, and at least one copy for a non-empty x.
// Sets *want_row, *want_col and *out_dtype (e4m3 when neither is requested).
Status CheckCopies(const char* op, const char* rowwise_scale_arg, const char* colwise_scale_arg,
                   const Copies& c, const Dims& shape, const Dims& colwise_shape,
                   const ScaleDims& rowwise_scale_dims, const ScaleDims& colwise_scale_dims,
                   ffi::DataType scale_type, int64_t n, bool* want_row, bool* want_col,
                   DType* out_dtype) {
  LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "rowwise", rowwise_scale_arg, c.rowwise, c.rowwise_scale,
                                   shape, ScaleShape(rowwise_scale_dims), scale_type, want_row));
  LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "colwise", colwise_scale_arg, c.colwise, c.colwise_scale,
                                   colwise_shape, ScaleShape(colwise_scale_dims), scale_type,
                                   want_col));
  if (*want_row && *want_col) {
    LOWBIT_RETURN_IF_ERROR(ExpectSameFp8(op, "colwise", "the rowwise dtype", c.rowwise, c.colwise));
  }
  if (n != 0 && !*want_row && !*want_col) {
    return Invalid(op, "rowwise", "neither rowwise nor colwise output requested");
  }
  *out_dtype = *want_row ? ToDType(c.rowwise->element_type())
                         : *want_col ? ToDType(c.colwise->element_type()) : DType::kE4M3;
  return Status::Ok();
}

Status QuantizeBlockArgs(const ffi::AnyBuffer& x, const Copies& c, int32_t flatten_axis,
                         bool tile_2d, bool pow2_scales, QuantizeFp8BlockArgs* a) {
  const char* op = kQuantizeBlockOp;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const Dims shape = DimsOf(x);
  LOWBIT_RETURN_IF_ERROR(FlatView(op, "x", shape, flatten_axis, &a->rows, &a->cols));
  bool want_row = false, want_col = false;
  LOWBIT_RETURN_IF_ERROR(CheckCopies(op, "rowwise_scale_inv", "colwise_scale_inv", c, shape,
                                     TransposedShape(shape, flatten_axis),
                                     Fp8BlockScaleDims(a->rows, a->cols, tile_2d),
                                     Fp8BlockScaleDims(a->cols, a->rows, tile_2d),
                                     ffi::DataType::F32, a->rows * a->cols, &want_row, &want_col,
                                     &a->out_dtype));
  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->tile_2d = tile_2d;
  a->pow2_scales = pow2_scales;
  a->rowwise = want_row ? static_cast<uint8_t*>(c.rowwise->untyped_data()) : nullptr;
  a->rowwise_scale_inv = want_row ? static_cast<float*>(c.rowwise_scale->untyped_data()) : nullptr;
  a->colwise = want_col ? static_cast<uint8_t*>(c.colwise->untyped_data()) : nullptr;
  a->colwise_scale_inv = want_col ? static_cast<float*>(c.colwise_scale->untyped_data()) : nullptr;
  return CheckDbias(op, x, c.dbias, shape, flatten_axis, &a->dbias, &a->dbias_dtype);
}

Status QuantizeMxArgs(const ffi::AnyBuffer& x, const Copies& c, int32_t flatten_axis,
                      QuantizeMxfp8Args* a) {
  const char* op = kQuantizeMxOp;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const Dims shape = DimsOf(x);
  LOWBIT_RETURN_IF_ERROR(FlatView(op, "x", shape, flatten_axis, &a->rows, &a->cols));
  bool want_row = false, want_col = false;
  LOWBIT_RETURN_IF_ERROR(CheckCopies(op, "rowwise_scale", "colwise_scale", c, shape, shape,
                                     Mxfp8ScaleDims(a->rows, a->cols, false),
                                     Mxfp8ScaleDims(a->rows, a->cols, true),
                                     ffi::DataType::F8E8M0FNU, a->rows * a->cols, &want_row,
                                     &want_col, &a->out_dtype));
  a->x = x.untyped_data();
  a->x_dtype = ToDType(x.element_type());
  a->rowwise = want_row ? static_cast<uint8_t*>(c.rowwise->untyped_data()) : nullptr;
  a->rowwise_scale = want_row ? static_cast<uint8_t*>(c.rowwise_scale->untyped_data()) : nullptr;
  a->colwise = want_col ? static_cast<uint8_t*>(c.colwise->untyped_data()) : nullptr;
  a->colwise_scale = want_col ? static_cast<uint8_t*>(c.colwise_scale->untyped_data()) : nullptr;
  return CheckDbias(op, x, c.dbias, shape, flatten_axis, &a->dbias, &a->dbias_dtype);
}

constexpr const char* kQuantizeBlockRowsOp = "lowbit_quantize_fp8_block_colwise_rows";

Status QuantizeBlockRowsArgs(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& colwise,
                             ffi::Result<ffi::AnyBuffer>& colwise_scale, int64_t row_begin,
                             int64_t row_count, bool tile_2d, bool pow2_scales, QuantizeFp8BlockArgs* a) {
  const char* op = kQuantizeBlockRowsOp;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const Dims shape = DimsOf(x);
  if (shape.size() != 2) return Invalid(op, "x", "expected rank 2 (rows, cols), got " + ShapeString(shape));
  if (row_begin < 0 || row_begin % 128 != 0 || row_count < 0 || row_begin + row_count > shape[0]) {
    return Invalid(op, "row_begin", "expected a multiple of 128 with row_begin + row_count <= " +
                                        std::to_string(shape[0]) + ", got row_begin " + std::to_string(row_begin) +
                                        ", row_count " + std::to_string(row_count));
  }
  const int64_t cols = shape[1];
  bool requested = false;
  LOWBIT_RETURN_IF_ERROR(ExpectOptionalFp8(op, "colwise", colwise, Dims{cols, row_count}, &requested));
  if (!requested && cols * row_count != 0) return Invalid(op, "colwise", "expected an fp8 result");
  if (requested) {
    LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(op, "colwise_scale_inv", *colwise_scale, ffi::DataType::F32,
                                             ScaleShape(Fp8BlockScaleDims(cols, row_count, tile_2d))));
  }
  const size_t esize = ToDType(x.element_type()) == DType::kF32 ? 4 : 2;  // ExpectHighPrecision: f32, f16, bf16
  a->x = static_cast<const char*>(x.untyped_data()) + size_t(row_begin) * size_t(cols) * esize;
  a->x_dtype = ToDType(x.element_type());
  a->rows = row_count;
  a->cols = cols;
  a->out_dtype = requested ? ToDType(colwise->element_type()) : DType::kE4M3;
  a->tile_2d = tile_2d;
  a->pow2_scales = pow2_scales;
  a->colwise = requested ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
  a->colwise_scale_inv = requested ? static_cast<float*>(colwise_scale->untyped_data()) : nullptr;
  return Status::Ok();
}

// Shared dequantize validation: data fp8 of any rank >= 1 viewed at flatten_axis, the scale
// array of `want_scale` dims and `scale_type`, out high precision of data's shape.
Status DequantizeArgs(const char* op, const char* scale_arg, const ffi::AnyBuffer& data,
                      const ffi::AnyBuffer& scale, const ffi::Result<ffi::AnyBuffer>& out,
                      ffi::DataType scale_type, const ScaleDims& want_scale) {
  LOWBIT_RETURN_IF_ERROR(ExpectFp8(op, "data", data));
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(op, scale_arg, scale, scale_type, ScaleShape(want_scale)));
  return ExpectHighPrecisionResult(op, "out", out, DimsOf(data));
}

Status DequantizeBlockArgs(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale_inv,
                           const ffi::Result<ffi::AnyBuffer>& out, int32_t flatten_axis,
                           bool tile_2d, int64_t* rows, int64_t* cols) {
  LOWBIT_RETURN_IF_ERROR(FlatView(kDequantizeBlockOp, "data", DimsOf(data), flatten_axis, rows, cols));
  return DequantizeArgs(kDequantizeBlockOp, "scale_inv", data, scale_inv, out, ffi::DataType::F32,
                        Fp8BlockScaleDims(*rows, *cols, tile_2d));
}

Status DequantizeMxArgs(const ffi::AnyBuffer& data, const ffi::AnyBuffer& scale,
                        const ffi::Result<ffi::AnyBuffer>& out, int32_t flatten_axis, bool colwise,
                        int64_t* rows, int64_t* cols) {
  LOWBIT_RETURN_IF_ERROR(FlatView(kDequantizeMxOp, "data", DimsOf(data), flatten_axis, rows, cols));
  return DequantizeArgs(kDequantizeMxOp, "scale", data, scale, out, ffi::DataType::F8E8M0FNU,
                        Mxfp8ScaleDims(*rows, *cols, colwise));
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error QuantizeBlockCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rowwise,
                            ffi::Result<ffi::AnyBuffer> rowwise_scale_inv,
                            ffi::Result<ffi::AnyBuffer> colwise,
                            ffi::Result<ffi::AnyBuffer> colwise_scale_inv, ffi::Result<ffi::AnyBuffer> dbias,
                            int32_t flatten_axis, bool tile_2d, bool pow2_scales) {
  QuantizeFp8BlockArgs a;
  Status s = QuantizeBlockArgs(x, {rowwise, rowwise_scale_inv, colwise, colwise_scale_inv, dbias},
                               flatten_axis, tile_2d, pow2_scales, &a);
  if (s.ok()) s = QuantizeFp8BlockRef(a);
  return ToFfiError(s);
}

ffi::Error QuantizeBlockRowsCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> colwise,
                                ffi::Result<ffi::AnyBuffer> colwise_scale_inv, int64_t row_begin,
                                int64_t row_count, bool tile_2d, bool pow2_scales) {
  QuantizeFp8BlockArgs a;
  Status s = QuantizeBlockRowsArgs(x, colwise, colwise_scale_inv, row_begin, row_count, tile_2d, pow2_scales, &a);
  if (s.ok() && a.rows * a.cols != 0) s = QuantizeFp8BlockRef(a);
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
                         ffi::Result<ffi::AnyBuffer> colwise_scale, ffi::Result<ffi::AnyBuffer> dbias,
                         int32_t flatten_axis) {
  QuantizeMxfp8Args a;
  Status s = QuantizeMxArgs(x, {rowwise, rowwise_scale, colwise, colwise_scale, dbias}, flatten_axis, &a);
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
                            ffi::Result<ffi::AnyBuffer> rowwise_scale_inv, ffi::Result<ffi::AnyBuffer> colwise,
                            ffi::Result<ffi::AnyBuffer> colwise_scale_inv, ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> workspace, int32_t flatten_axis, bool tile_2d,
                            bool pow2_scales) {
  QuantizeFp8BlockArgs a;
  Status s = QuantizeBlockArgs(x, {rowwise, rowwise_scale_inv, colwise, colwise_scale_inv, dbias},
                               flatten_axis, tile_2d, pow2_scales, &a);
  void* ws = nullptr;
  if (s.ok()) {
    s = WorkspaceFromResult(kQuantizeBlockOp, *workspace,
                            BlockDbiasWorkspaceBytes(a.rows, a.cols, kFp8BlockDbiasTileRows, a.dbias != nullptr), &ws);
  }
  if (s.ok()) s = QuantizeFp8BlockCuda(a, ws, stream);
  return ToFfiError(s);
}

ffi::Error QuantizeBlockRowsGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> colwise,
                                ffi::Result<ffi::AnyBuffer> colwise_scale_inv, int64_t row_begin,
                                int64_t row_count, bool tile_2d, bool pow2_scales) {
  QuantizeFp8BlockArgs a;
  Status s = QuantizeBlockRowsArgs(x, colwise, colwise_scale_inv, row_begin, row_count, tile_2d, pow2_scales, &a);
  if (s.ok() && a.rows * a.cols != 0) s = QuantizeFp8BlockCuda(a, nullptr, stream);  // no dbias: no workspace
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
                         ffi::Result<ffi::AnyBuffer> colwise_scale, ffi::Result<ffi::AnyBuffer> dbias,
                         ffi::Result<ffi::AnyBuffer> workspace, int32_t flatten_axis) {
  QuantizeMxfp8Args a;
  Status s = QuantizeMxArgs(x, {rowwise, rowwise_scale, colwise, colwise_scale, dbias}, flatten_axis, &a);
  void* ws = nullptr;
  if (s.ok()) {
    s = WorkspaceFromResult(kQuantizeMxOp, *workspace,
                            BlockDbiasWorkspaceBytes(a.rows, a.cols, kMxfp8DbiasTileRows, a.dbias != nullptr), &ws);
  }
  if (s.ok()) s = QuantizeMxfp8Cuda(a, ws, stream);
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

LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeFp8Block, lowbit::QuantizeBlock,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, rank >= 1
                               .Ret<xffi::AnyBuffer>()  // rowwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_scale_inv: f32 Fp8BlockScaleDims(rows, cols), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8, shape[fa:] + shape[:fa], or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale_inv: f32 Fp8BlockScaleDims(cols, rows), or (0,)
                               .Ret<xffi::AnyBuffer>()  // dbias: f32 or x's dtype, shape[fa:], or (0,)
                               LOWBIT_FFI_CUDA_ONLY(.Ret<xffi::AnyBuffer>())  // workspace: u8, the dbias partials
                               .Attr<int32_t>("flatten_axis")
                               .Attr<bool>("tile_2d")  // 128x128 tiles, else 1x128
                               .Attr<bool>("pow2_scales"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeFp8BlockColwiseRows, lowbit::QuantizeBlockRows,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16 (rows, cols)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8 (cols, row_count)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale_inv: f32 Fp8BlockScaleDims(cols, row_count)
                               .Attr<int64_t>("row_begin")  // a multiple of 128
                               .Attr<int64_t>("row_count")
                               .Attr<bool>("tile_2d")  // 128x128 tiles, else 1x128
                               .Attr<bool>("pow2_scales"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitDequantizeFp8Block, lowbit::DequantizeBlock,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // data: fp8, one stored copy, rank >= 1
                               .Arg<xffi::AnyBuffer>()  // scale_inv: f32 Fp8BlockScaleDims(rows, cols)
                               .Ret<xffi::AnyBuffer>()  // out: f32/f16/bf16, data's shape
                               .Attr<int32_t>("flatten_axis")
                               .Attr<bool>("tile_2d"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitQuantizeMxfp8, lowbit::QuantizeMx,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, rank >= 1
                               .Ret<xffi::AnyBuffer>()  // rowwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_scale: e8m0 Mxfp8ScaleDims(rows, cols, false), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale: e8m0 Mxfp8ScaleDims(rows, cols, true), or (0,)
                               .Ret<xffi::AnyBuffer>()  // dbias: f32 or x's dtype, shape[fa:], or (0,)
                               LOWBIT_FFI_CUDA_ONLY(.Ret<xffi::AnyBuffer>())  // workspace: u8, the dbias partials
                               .Attr<int32_t>("flatten_axis"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitDequantizeMxfp8, lowbit::DequantizeMx,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // data: fp8, rank >= 1
                               .Arg<xffi::AnyBuffer>()  // scale: e8m0 Mxfp8ScaleDims(rows, cols, colwise)
                               .Ret<xffi::AnyBuffer>()  // out: f32/f16/bf16, data's shape
                               .Attr<int32_t>("flatten_axis")
                               .Attr<bool>("colwise"));  // the scales run down the columns
