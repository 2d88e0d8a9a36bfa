// XLA FFI handlers for lowbit_act_forward and lowbit_act_backward (activation/activation.h).
// Compiled twice: into liblowbit.so as the CPU handlers (LowbitActForwardCpu, ...) and,
// with LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as the CUDA ones. Both validate
// identically, then call the reference or the launcher.
//
// x is (..., H), or (..., 2, H) when gated; rows = the product of the leading dims. A
// result with 0 elements is "not requested" (y/dx, q_rowwise, q_colwise, dbias); amax is
// always written. q_rowwise has the output's shape or its 2-D view (rows, C). q_colwise is (C, rows), C = the output's columns, or the output's
// trailing dims followed by the leading ones ((H, ...) or, gated backward, (2, H, ...)).
// bias: x's dtype and trailing dims ((H,) or (2, H)), or an empty (0,) array for none.
#include <string>
#include <vector>

#include "activation/activation.h"
#include "ffi/ffi_util.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>
#endif

namespace lowbit {
namespace {

struct Attrs {
  int32_t act_type;
  bool gated;
  float limit, alpha;
};

Status CheckAttrs(const char* op, const Attrs& at, ActParams* p) {
  if (at.act_type < 0 || at.act_type > int32_t(ActType::kClampedSilu)) {
    return Invalid(op, "act_type", "expected a value in [0, 6], got " + std::to_string(at.act_type));
  }
  if (at.act_type == int32_t(ActType::kClampedSilu) && !at.gated) {
    return Invalid(op, "act_type", "clamped swiglu (6) needs gated=true");
  }
  if (!(at.limit >= 0.0f)) return Invalid(op, "limit", "expected a value >= 0, got " + std::to_string(at.limit));
  p->type = ActType(at.act_type);
  p->gated = at.gated;
  p->limit = at.limit;
  p->alpha = at.alpha;
  return Status::Ok();
}

// Reads x's layout: rows, H and the output dims (x's dims without the 2 when gated).
Status XLayout(const char* op, const ffi::AnyBuffer& x, bool gated, int64_t* rows, int64_t* hidden,
               Dims* lead) {
  LOWBIT_RETURN_IF_ERROR(ExpectHighPrecision(op, "x", x));
  const Dims d = DimsOf(x);
  const size_t trailing = gated ? 2 : 1;
  if (d.size() < trailing || (gated && d[d.size() - 2] != 2)) {
    return Invalid(op, "x", std::string("expected shape ") + (gated ? "(..., 2, H)" : "(..., H)") +
                                ", got " + ShapeString(d));
  }
  *hidden = d.back();
  lead->assign(d.begin(), d.end() - trailing);
  *rows = 1;
  for (int64_t v : *lead) *rows *= v;
  return Status::Ok();
}

// The optional bias operand: empty (none), or x's dtype with x's trailing dims.
Status CheckBias(const char* op, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& x, bool gated,
                 ActArgs* a) {
  const Dims d = DimsOf(bias), xd = DimsOf(x);
  if (d.size() == 1 && d[0] == 0) return Status::Ok();  // none (x's H = 0 also lands here: no adds)
  const size_t trailing = gated ? 2 : 1;
  const Dims want(xd.end() - int64_t(trailing), xd.end());
  if (bias.element_type() != x.element_type() || d != want) {
    return Invalid(op, "bias", std::string("expected ") + DTypeName(a->dtype) + " of shape " +
                                   ShapeString(want) + " (x's dtype and trailing dims) or an empty (0,) array, got " +
                                   Describe(bias.element_type(), d));
  }
  a->bias = bias.untyped_data();
  return Status::Ok();
}

// An optional result: empty, or `want_type` (kInvalid: any fp8) with dims `want`.
Status CheckOptional(const char* op, const char* arg, const ffi::Result<ffi::AnyBuffer>& r,
                     DType want_type, const Dims& want, bool* requested) {
  *requested = r->element_count() != 0;
  if (!*requested) return Status::Ok();
  const DType t = ToDType(r->element_type());
  const bool type_ok = want_type == DType::kInvalid ? IsFp8(t) : t == want_type;
  if (type_ok && DimsOf(*r) == want) return Status::Ok();
  const std::string type_name = want_type == DType::kInvalid ? "f8e4m3fn or f8e5m2" : DTypeName(want_type);
  return Invalid(op, arg, "expected " + type_name + " of shape " + ShapeString(want) +
                              " or an empty result, got " + Describe(r->element_type(), DimsOf(*r)));
}

// q_colwise: fp8 of shape (C, rows) or tail + lead, tail being the output's trailing dims
// ((H,) or (2, H)): the tensor-scaling colwise layout of lowbit/quantize/tensor.py.
Status CheckColwise(const char* op, const ffi::Result<ffi::AnyBuffer>& r, int64_t cols, int64_t rows,
                    const Dims& tail, const Dims& lead, bool* requested) {
  *requested = r->element_count() != 0;
  if (!*requested) return Status::Ok();
  Dims full = tail;
  full.insert(full.end(), lead.begin(), lead.end());
  const Dims d = DimsOf(*r);
  if (IsFp8(ToDType(r->element_type())) && (d == Dims{cols, rows} || d == full)) return Status::Ok();
  return Invalid(op, "q_colwise", "expected f8e4m3fn or f8e5m2 of shape " + ShapeString({cols, rows}) +
                                      " or " + ShapeString(full) + " or an empty result, got " +
                                      Describe(r->element_type(), d));
}

Status CheckQuantized(const char* op, const ffi::AnyBuffer& scale, ffi::Result<ffi::AnyBuffer>& q_row,
                      ffi::Result<ffi::AnyBuffer>& q_col, const Dims& out_dims, int64_t cols,
                      int64_t rows, const Dims& lead, ffi::Result<ffi::AnyBuffer>& amax, ActArgs* a) {
  LOWBIT_RETURN_IF_ERROR(ExpectScalarF32(op, "scale", scale));
  bool want_row = false, want_col = false;
  // q_rowwise: the output's shape or its 2-D view (rows, C).
  const bool row_2d = q_row->element_count() != 0 && DimsOf(*q_row) == Dims{rows, cols};
  LOWBIT_RETURN_IF_ERROR(CheckOptional(op, "q_rowwise", q_row, DType::kInvalid,
                                       row_2d ? Dims{rows, cols} : out_dims, &want_row));
  const Dims tail(out_dims.begin() + int64_t(lead.size()), out_dims.end());
  LOWBIT_RETURN_IF_ERROR(CheckColwise(op, q_col, cols, rows, tail, lead, &want_col));
  if (want_row && want_col) {
    LOWBIT_RETURN_IF_ERROR(ExpectSameFp8(op, "q_colwise", "q_rowwise's dtype", q_row, q_col));
  }
  LOWBIT_RETURN_IF_ERROR(ExpectScalarF32(op, "amax", *amax));
  a->scale = static_cast<const float*>(scale.untyped_data());
  a->q_rowwise = want_row ? static_cast<uint8_t*>(q_row->untyped_data()) : nullptr;
  a->q_colwise = want_col ? static_cast<uint8_t*>(q_col->untyped_data()) : nullptr;
  a->q_dtype = want_row ? ToDType(q_row->element_type())
                        : (want_col ? ToDType(q_col->element_type()) : DType::kE4M3);
  a->amax = static_cast<float*>(amax->untyped_data());
  return Status::Ok();
}

constexpr const char* kFwd = "lowbit_act_forward";
constexpr const char* kBwd = "lowbit_act_backward";

Status ForwardArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& scale,
                   ffi::Result<ffi::AnyBuffer>& y, ffi::Result<ffi::AnyBuffer>& q_row,
                   ffi::Result<ffi::AnyBuffer>& q_col, ffi::Result<ffi::AnyBuffer>& amax, const Attrs& at,
                   ActArgs* a) {
  LOWBIT_RETURN_IF_ERROR(CheckAttrs(kFwd, at, &a->params));
  Dims lead;
  LOWBIT_RETURN_IF_ERROR(XLayout(kFwd, x, at.gated, &a->rows, &a->hidden, &lead));
  Dims out_dims = lead;
  out_dims.push_back(a->hidden);
  a->dtype = ToDType(x.element_type());
  LOWBIT_RETURN_IF_ERROR(CheckBias(kFwd, bias, x, at.gated, a));
  bool want_y = false;
  LOWBIT_RETURN_IF_ERROR(CheckOptional(kFwd, "y", y, a->dtype, out_dims, &want_y));
  a->x = x.untyped_data();
  a->out = want_y ? y->untyped_data() : nullptr;
  return CheckQuantized(kFwd, scale, q_row, q_col, out_dims, a->hidden, a->rows, lead, amax, a);
}

Status BackwardArgs(const ffi::AnyBuffer& dz, const ffi::AnyBuffer& x, const ffi::AnyBuffer& bias,
                    const ffi::AnyBuffer& scale,
                    ffi::Result<ffi::AnyBuffer>& dx, ffi::Result<ffi::AnyBuffer>& q_row,
                    ffi::Result<ffi::AnyBuffer>& q_col, ffi::Result<ffi::AnyBuffer>& amax,
                    ffi::Result<ffi::AnyBuffer>& dbias, const Attrs& at, bool compute_dbias, ActArgs* a) {
  LOWBIT_RETURN_IF_ERROR(CheckAttrs(kBwd, at, &a->params));
  Dims lead;
  LOWBIT_RETURN_IF_ERROR(XLayout(kBwd, x, at.gated, &a->rows, &a->hidden, &lead));
  a->dtype = ToDType(x.element_type());
  Dims dz_dims = lead;
  dz_dims.push_back(a->hidden);
  if (ToDType(dz.element_type()) != a->dtype || DimsOf(dz) != dz_dims) {
    return Invalid(kBwd, "dz", std::string("expected ") + DTypeName(a->dtype) + " of shape " +
                                   ShapeString(dz_dims) + " (x's dtype and leading dims), got " +
                                   Describe(dz.element_type(), DimsOf(dz)));
  }
  LOWBIT_RETURN_IF_ERROR(CheckBias(kBwd, bias, x, at.gated, a));
  const Dims x_dims = DimsOf(x);
  const int64_t cols = ActOutCols(*a, true);
  bool want_dx = false, want_dbias = false;
  LOWBIT_RETURN_IF_ERROR(CheckOptional(kBwd, "dx", dx, a->dtype, x_dims, &want_dx));
  LOWBIT_RETURN_IF_ERROR(CheckOptional(kBwd, "dbias", dbias, a->dtype, Dims{cols}, &want_dbias));
  if (compute_dbias && !want_dbias && cols != 0) {
    return Invalid(kBwd, "dbias", "compute_dbias is set but the result is empty");
  }
  if (!compute_dbias && want_dbias) return Invalid(kBwd, "dbias", "compute_dbias is false but the result is not empty");
  a->dz = dz.untyped_data();
  a->x = x.untyped_data();
  a->out = want_dx ? dx->untyped_data() : nullptr;
  a->dbias = compute_dbias && cols != 0 ? dbias->untyped_data() : nullptr;
  return CheckQuantized(kBwd, scale, q_row, q_col, x_dims, cols, a->rows, lead, amax, a);
}

// workspace: a u8 result (dropped in Python: lowbit/ops/activation.py,
// _workspace_bytes, the same formula) of at least ActBackwardWorkspaceBytes bytes; the
// CUDA handler keeps the dbias partial sums there. Both handlers bind and check it (so the
// CPU suite keeps the two formulas in step); the checks are WorkspaceFromResult's.
Status CheckWorkspace(const ffi::Result<ffi::AnyBuffer>& workspace, const ActArgs& a, void** ptr) {
  void* p = nullptr;
  LOWBIT_RETURN_IF_ERROR(WorkspaceFromResult(
      kBwd, *workspace, ActBackwardWorkspaceBytes(a.rows, ActOutCols(a, true), a.dbias != nullptr), &p));
  if (ptr != nullptr) *ptr = p;
  return Status::Ok();
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error ForwardCpu(ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> q_row, ffi::Result<ffi::AnyBuffer> q_col,
                      ffi::Result<ffi::AnyBuffer> amax, int32_t act_type, bool gated, float limit,
                      float alpha) {
  ActArgs a;
  Status s = ForwardArgs(x, bias, scale, y, q_row, q_col, amax, Attrs{act_type, gated, limit, alpha}, &a);
  if (s.ok()) s = ActForwardRef(a);
  return ToFfiError(s);
}

ffi::Error BackwardCpu(ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer scale,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> q_row,
                       ffi::Result<ffi::AnyBuffer> q_col, ffi::Result<ffi::AnyBuffer> amax,
                       ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                       int32_t act_type, bool gated, float limit, float alpha, bool compute_dbias) {
  ActArgs a;
  Status s = BackwardArgs(dz, x, bias, scale, dx, q_row, q_col, amax, dbias,
                          Attrs{act_type, gated, limit, alpha}, compute_dbias, &a);
  if (s.ok()) s = CheckWorkspace(workspace, a, nullptr);  // validated, not used
  if (s.ok()) s = ActBackwardRef(a);
  return ToFfiError(s);
}

#else

ffi::Error ForwardGpu(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer bias, ffi::AnyBuffer scale,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> q_row,
                      ffi::Result<ffi::AnyBuffer> q_col, ffi::Result<ffi::AnyBuffer> amax,
                      int32_t act_type, bool gated, float limit, float alpha) {
  ActArgs a;
  Status s = ForwardArgs(x, bias, scale, y, q_row, q_col, amax, Attrs{act_type, gated, limit, alpha}, &a);
  if (s.ok()) s = ActForwardCuda(a, stream);
  return ToFfiError(s);
}

ffi::Error BackwardGpu(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer x,
                       ffi::AnyBuffer bias, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> dx,
                       ffi::Result<ffi::AnyBuffer> q_row, ffi::Result<ffi::AnyBuffer> q_col,
                       ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> dbias,
                       ffi::Result<ffi::AnyBuffer> workspace, int32_t act_type, bool gated,
                       float limit, float alpha, bool compute_dbias) {
  ActArgs a;
  Status s = BackwardArgs(dz, x, bias, scale, dx, q_row, q_col, amax, dbias,
                          Attrs{act_type, gated, limit, alpha}, compute_dbias, &a);
  void* ws = nullptr;
  if (s.ok()) s = CheckWorkspace(workspace, a, &ws);
  if (s.ok()) s = ActBackwardCuda(a, ws, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitActForward, lowbit::Forward,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // x: f32/f16/bf16 (..., H) or (..., 2, H)
                               .Arg<xffi::AnyBuffer>()  // bias: x's dtype (H,) or (2, H), or (0,)
                               .Arg<xffi::AnyBuffer>()  // scale: f32 (1,)
                               .Ret<xffi::AnyBuffer>()  // y: x's dtype (..., H), or (0,)
                               .Ret<xffi::AnyBuffer>()  // q_rowwise: fp8 (..., H), or (0,)
                               .Ret<xffi::AnyBuffer>()  // q_colwise: fp8 (H, rows), or (0,)
                               .Ret<xffi::AnyBuffer>()  // amax: f32 (1,), max |y|
                               .Attr<int32_t>("act_type")  // ActType
                               .Attr<bool>("gated")
                               .Attr<float>("limit")  // clamped swiglu
                               .Attr<float>("alpha"));  // clamped swiglu
LOWBIT_FFI_BACKEND_HANDLER(LowbitActBackward, lowbit::Backward,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // dz: x's dtype (..., H)
                               .Arg<xffi::AnyBuffer>()  // x: forward input (..., H) or (..., 2, H)
                               .Arg<xffi::AnyBuffer>()  // bias: x's dtype (H,) or (2, H), or (0,)
                               .Arg<xffi::AnyBuffer>()  // scale: f32 (1,)
                               .Ret<xffi::AnyBuffer>()  // dx: x's dtype and shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // q_rowwise: fp8, x's shape, or (0,)
                               .Ret<xffi::AnyBuffer>()  // q_colwise: fp8 (C, rows), or (0,)
                               .Ret<xffi::AnyBuffer>()  // amax: f32 (1,), max |dx|
                               .Ret<xffi::AnyBuffer>()  // dbias: x's dtype (C,), or (0,)
                               .Ret<xffi::AnyBuffer>()  // workspace: u8 (n,), dbias partials
                               .Attr<int32_t>("act_type")
                               .Attr<bool>("gated")
                               .Attr<float>("limit")
                               .Attr<float>("alpha")
                               .Attr<bool>("compute_dbias"));
