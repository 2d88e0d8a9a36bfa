// XLA FFI handlers for lowbit_act_quantize_block and lowbit_norm_quantize_block
// (fused_block/fused_block.h): the activation or normalization of x block-quantized in one
// pass. Compiled twice, as the CPU handlers (references) and, with LOWBIT_CUDA_HANDLERS, the
// CUDA ones (launchers); both validate identically.
//
// Norm: x (..., H) with gamma (H,) f32 or x's dtype, beta (H,) like gamma (LayerNorm) or
// (0,) (RMSNorm), mu (x.shape[:-1]) f32 (LayerNorm) or (0,), rsigma (x.shape[:-1]) f32; the
// copies as below with lead = x.shape[:-1].
//
// x is (..., H), or (..., 2, H) when gated; the activation is lead + (H,), viewed as rows x H
// (rows = prod(lead)). Copies (a data result with 0 elements is "not requested", its scale
// result then empty too; at least one copy for a non-empty x):
//   FP8 block 1x128 (mxfp8 = false): rowwise lead + (H,), colwise (H,) + lead (transposed),
//     f32 scale_inv Fp8BlockScaleDims(rows, H) / (H, rows);
//   MXFP8 (mxfp8 = true): rowwise and colwise lead + (H,), E8M0 Mxfp8ScaleDims(rows, H,
//     false / true).
#include <string>

#include "ffi/ffi_util.h"
#include "fused_block/fused_block.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

constexpr const char* kOp = "lowbit_act_quantize_block";
constexpr const char* kNormOp = "lowbit_norm_quantize_block";

struct Attrs {
  int32_t act_type;
  bool gated;
  float limit, alpha;
  bool mxfp8, pow2_scales;
};

// One requested-or-empty copy: fp8 data of `want` dims, its scale of `want_scale` dims and
// `scale_type`. Sets *requested.
Status CheckCopy(const char* op, const char* data_arg, const char* scale_arg, const ffi::Result<ffi::AnyBuffer>& data,
                 const ffi::Result<ffi::AnyBuffer>& scale, const Dims& want, const ScaleDims& want_scale,
                 ffi::DataType scale_type, bool* requested) {
  LOWBIT_RETURN_IF_ERROR(ExpectOptionalFp8(op, data_arg, data, want, requested));
  if (*requested) return ExpectTypeAndDims(op, scale_arg, *scale, scale_type, Dims{want_scale.dim0, want_scale.dim1});
  if (scale->element_count() == 0) return Status::Ok();
  return Invalid(op, scale_arg, std::string("expected an empty result when ") + data_arg +
                                     " is not requested, got " + Describe(scale->element_type(), DimsOf(*scale)));
}

// The copies of a rows x h result (rows = prod(lead)): each requested or empty, one fp8 type,
// at least one for a non-empty result; fills the output half of fp8 / mx.
Status CheckCopies(const char* op, const Dims& lead, int64_t h, bool mxfp8, bool pow2_scales, ffi::Result<ffi::AnyBuffer>& rowwise,
                   ffi::Result<ffi::AnyBuffer>& rowwise_scale, ffi::Result<ffi::AnyBuffer>& colwise,
                   ffi::Result<ffi::AnyBuffer>& colwise_scale, QuantizeFp8BlockArgs* fp8, QuantizeMxfp8Args* mx) {
  int64_t rows = 1;
  for (int64_t v : lead) rows *= v;
  Dims out = lead;
  out.push_back(h);
  Dims transposed{h};
  transposed.insert(transposed.end(), lead.begin(), lead.end());
  bool want_row = false, want_col = false;
  if (mxfp8) {
    LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "rowwise", "rowwise_scale", rowwise, rowwise_scale, out,
                                     Mxfp8ScaleDims(rows, h, false), ffi::DataType::F8E8M0FNU, &want_row));
    LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "colwise", "colwise_scale", colwise, colwise_scale, out,
                                     Mxfp8ScaleDims(rows, h, true), ffi::DataType::F8E8M0FNU, &want_col));
  } else {
    LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "rowwise", "rowwise_scale", rowwise, rowwise_scale, out,
                                     Fp8BlockScaleDims(rows, h, false), ffi::DataType::F32, &want_row));
    LOWBIT_RETURN_IF_ERROR(CheckCopy(op, "colwise", "colwise_scale", colwise, colwise_scale, transposed,
                                     Fp8BlockScaleDims(h, rows, false), ffi::DataType::F32, &want_col));
  }
  if (want_row && want_col) LOWBIT_RETURN_IF_ERROR(ExpectSameFp8(op, "colwise", "the rowwise dtype", rowwise, colwise));
  if (rows * h != 0 && !want_row && !want_col) {
    return Invalid(op, "rowwise", "neither rowwise nor colwise output requested");
  }
  const DType q = want_row ? ToDType(rowwise->element_type())
                           : want_col ? ToDType(colwise->element_type()) : DType::kE4M3;
  uint8_t* row = want_row ? static_cast<uint8_t*>(rowwise->untyped_data()) : nullptr;
  uint8_t* col = want_col ? static_cast<uint8_t*>(colwise->untyped_data()) : nullptr;
  if (mxfp8) {
    mx->rows = rows;
    mx->cols = h;
    mx->out_dtype = q;
    mx->rowwise = row;
    mx->rowwise_scale = want_row ? static_cast<uint8_t*>(rowwise_scale->untyped_data()) : nullptr;
    mx->colwise = col;
    mx->colwise_scale = want_col ? static_cast<uint8_t*>(colwise_scale->untyped_data()) : nullptr;
  } else {
    fp8->rows = rows;
    fp8->cols = h;
    fp8->out_dtype = q;
    fp8->tile_2d = false;
    fp8->pow2_scales = pow2_scales;
    fp8->rowwise = row;
    fp8->rowwise_scale_inv = want_row ? static_cast<float*>(rowwise_scale->untyped_data()) : nullptr;
    fp8->colwise = col;
    fp8->colwise_scale_inv = want_col ? static_cast<float*>(colwise_scale->untyped_data()) : nullptr;
  }
  return Status::Ok();
}

Status Args(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& rowwise, ffi::Result<ffi::AnyBuffer>& rowwise_scale,
            ffi::Result<ffi::AnyBuffer>& colwise, ffi::Result<ffi::AnyBuffer>& colwise_scale, const Attrs& at,
            ActQuantizeBlockArgs* a) {
  if (at.act_type < 0 || at.act_type > int32_t(ActType::kClampedSilu)) {
    return Invalid(kOp, "act_type", "expected a value in [0, 6], got " + std::to_string(at.act_type));
  }
  if (at.act_type == int32_t(ActType::kClampedSilu) && !at.gated) {
    return Invalid(kOp, "act_type", "clamped swiglu (6) needs gated=true");
  }
  if (!(at.limit >= 0.0f)) return Invalid(kOp, "limit", "expected a value >= 0, got " + std::to_string(at.limit));
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(kOp, "x", x));
  const Dims d = DimsOf(x);
  const size_t trailing = at.gated ? 2 : 1;
  if (d.size() < trailing || (at.gated && d[d.size() - 2] != 2)) {
    return Invalid(kOp, "x", std::string("expected shape ") + (at.gated ? "(..., 2, H)" : "(..., H)") +
                                 ", got " + ShapeString(d));
  }
  const Dims lead(d.begin(), d.end() - int64_t(trailing));
  int64_t rows = 1;
  for (int64_t v : lead) rows *= v;
  const int64_t h = d.back();
  a->params.type = ActType(at.act_type);
  a->params.gated = at.gated;
  a->params.limit = at.limit;
  a->params.alpha = at.alpha;
  a->x = x.untyped_data();
  a->dtype = ToDType(x.element_type());
  a->rows = rows;
  a->hidden = h;
  a->mxfp8 = at.mxfp8;
  return CheckCopies(kOp, lead, h, at.mxfp8, at.pow2_scales, rowwise, rowwise_scale, colwise, colwise_scale, &a->fp8,
                     &a->mx);
}

// gamma / beta: (H,) f32 or x's dtype (beta: gamma's dtype; (0,) for RMSNorm); mu (LayerNorm)
// and rsigma: f32 of x's lead dims, mu (0,) for RMSNorm.
Status NormArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& beta,
                const ffi::AnyBuffer& mu, const ffi::AnyBuffer& rsigma, ffi::Result<ffi::AnyBuffer>& rowwise,
                ffi::Result<ffi::AnyBuffer>& rowwise_scale, ffi::Result<ffi::AnyBuffer>& colwise,
                ffi::Result<ffi::AnyBuffer>& colwise_scale, int32_t norm_type, bool zero_centered_gamma,
                bool mxfp8, bool pow2_scales, NormQuantizeBlockArgs* a) {
  const char* op = kNormOp;
  if (norm_type != 0 && norm_type != 1) {
    return Invalid(op, "norm_type", "expected 0 (layernorm) or 1 (rmsnorm), got " + std::to_string(norm_type));
  }
  const bool ln = norm_type == 0;
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const Dims d = DimsOf(x);
  if (d.empty()) return Invalid(op, "x", "expected shape (..., H), got a scalar");
  const Dims lead(d.begin(), d.end() - 1);
  const int64_t h = d.back();
  const DType xt = ToDType(x.element_type()), gt = ToDType(gamma.element_type());
  if (!(gt == DType::kF32 || gt == xt) || DimsOf(gamma) != Dims{h}) {
    return Invalid(op, "gamma", "expected f32 or " + std::string(DTypeName(xt)) + " of shape " + ShapeString({h}) +
                                    ", got " + Describe(gamma.element_type(), DimsOf(gamma)));
  }
  const Dims beta_want = ln ? Dims{h} : Dims{0};
  if (DimsOf(beta) != beta_want || (ln && beta.element_type() != gamma.element_type())) {
    return Invalid(op, "beta", std::string(ln ? "expected gamma's dtype and shape " : "expected an empty (0,) buffer for "
                                                "rmsnorm, shape ") + ShapeString(beta_want) + ", got " +
                                   Describe(beta.element_type(), DimsOf(beta)));
  }
  const Dims mu_want = ln ? lead : Dims{0};
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(op, "mu", mu, ffi::DataType::F32, mu_want));
  LOWBIT_RETURN_IF_ERROR(ExpectTypeAndDims(op, "rsigma", rsigma, ffi::DataType::F32, lead));
  int64_t rows = 1;
  for (int64_t v : lead) rows *= v;
  a->norm_type = ln ? NormType::kLayerNorm : NormType::kRmsNorm;
  a->zero_centered_gamma = zero_centered_gamma;
  a->x = x.untyped_data();
  a->dtype = xt;
  a->gamma_dtype = gt;
  a->gamma = gamma.untyped_data();
  a->beta = ln ? beta.untyped_data() : nullptr;
  a->mu = ln ? static_cast<const float*>(mu.untyped_data()) : nullptr;
  a->rsigma = static_cast<const float*>(rsigma.untyped_data());
  a->rows = rows;
  a->hidden = h;
  a->mxfp8 = mxfp8;
  return CheckCopies(op, lead, h, mxfp8, pow2_scales, rowwise, rowwise_scale, colwise, colwise_scale, &a->fp8, &a->mx);
}

#if !defined(LOWBIT_CUDA_HANDLERS)
ffi::Error ActQuantizeBlockCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rowwise,
                               ffi::Result<ffi::AnyBuffer> rowwise_scale, ffi::Result<ffi::AnyBuffer> colwise,
                               ffi::Result<ffi::AnyBuffer> colwise_scale, int32_t act_type, bool gated, float limit,
                               float alpha, bool mxfp8, bool pow2_scales) {
  ActQuantizeBlockArgs a;
  Status s = Args(x, rowwise, rowwise_scale, colwise, colwise_scale,
                  Attrs{act_type, gated, limit, alpha, mxfp8, pow2_scales}, &a);
  if (s.ok()) s = ActQuantizeBlockRef(a);
  return ToFfiError(s);
}
ffi::Error NormQuantizeBlockCpu(ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta, ffi::AnyBuffer mu,
                                ffi::AnyBuffer rsigma, ffi::Result<ffi::AnyBuffer> rowwise,
                                ffi::Result<ffi::AnyBuffer> rowwise_scale, ffi::Result<ffi::AnyBuffer> colwise,
                                ffi::Result<ffi::AnyBuffer> colwise_scale, int32_t norm_type,
                                bool zero_centered_gamma, bool mxfp8, bool pow2_scales) {
  NormQuantizeBlockArgs a;
  Status s = NormArgs(x, gamma, beta, mu, rsigma, rowwise, rowwise_scale, colwise, colwise_scale, norm_type,
                      zero_centered_gamma, mxfp8, pow2_scales, &a);
  if (s.ok()) s = NormQuantizeBlockRef(a);
  return ToFfiError(s);
}
#else
ffi::Error ActQuantizeBlockGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> rowwise,
                               ffi::Result<ffi::AnyBuffer> rowwise_scale, ffi::Result<ffi::AnyBuffer> colwise,
                               ffi::Result<ffi::AnyBuffer> colwise_scale, int32_t act_type, bool gated, float limit,
                               float alpha, bool mxfp8, bool pow2_scales) {
  ActQuantizeBlockArgs a;
  Status s = Args(x, rowwise, rowwise_scale, colwise, colwise_scale,
                  Attrs{act_type, gated, limit, alpha, mxfp8, pow2_scales}, &a);
  if (s.ok()) s = ActQuantizeBlockCuda(a, stream);
  return ToFfiError(s);
}
ffi::Error NormQuantizeBlockGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                                ffi::AnyBuffer mu, ffi::AnyBuffer rsigma, ffi::Result<ffi::AnyBuffer> rowwise,
                                ffi::Result<ffi::AnyBuffer> rowwise_scale, ffi::Result<ffi::AnyBuffer> colwise,
                                ffi::Result<ffi::AnyBuffer> colwise_scale, int32_t norm_type,
                                bool zero_centered_gamma, bool mxfp8, bool pow2_scales) {
  NormQuantizeBlockArgs a;
  Status s = NormArgs(x, gamma, beta, mu, rsigma, rowwise, rowwise_scale, colwise, colwise_scale, norm_type,
                      zero_centered_gamma, mxfp8, pow2_scales, &a);
  if (s.ok()) s = NormQuantizeBlockCuda(a, stream);
  return ToFfiError(s);
}
#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitActQuantizeBlock, lowbit::ActQuantizeBlock,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16, (..., H) or (..., 2, H)
                               .Ret<xffi::AnyBuffer>()  // rowwise: fp8 lead + (H,), or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_scale: f32 or e8m0 (see above), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8 (H,) + lead (FP8 block) or lead + (H,), or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale, or (0,)
                               .Attr<int32_t>("act_type")
                               .Attr<bool>("gated")
                               .Attr<float>("limit")
                               .Attr<float>("alpha")
                               .Attr<bool>("mxfp8")  // MXFP8, else FP8 block 1x128
                               .Attr<bool>("pow2_scales"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitNormQuantizeBlock, lowbit::NormQuantizeBlock,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16 (..., H)
                               .Arg<xffi::AnyBuffer>()  // gamma: (H,) f32 or x's dtype
                               .Arg<xffi::AnyBuffer>()  // beta: gamma's dtype (H,), or (0,) for rmsnorm
                               .Arg<xffi::AnyBuffer>()  // mu: f32 lead, or (0,) for rmsnorm
                               .Arg<xffi::AnyBuffer>()  // rsigma: f32 lead
                               .Ret<xffi::AnyBuffer>()  // rowwise: fp8 x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // rowwise_scale: f32 or e8m0, or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise: fp8 (H,) + lead (FP8 block) or x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // colwise_scale, or (0,)
                               .Attr<int32_t>("norm_type")  // 0 layernorm, 1 rmsnorm
                               .Attr<bool>("zero_centered_gamma")
                               .Attr<bool>("mxfp8")  // MXFP8, else FP8 block 1x128
                               .Attr<bool>("pow2_scales"));
