// XLA FFI handlers for lowbit_gemm (gemm/gemm.h): out (M, N) = a_scale_inv * b_scale_inv *
// a (M, K) @ b (N, K)^T + bias, the scale_invs read per a_scale_mode / b_scale_mode (one f32,
// or the 2-D block scale arrays of gemm.h, checked here against their exact shapes). Compiled into liblowbit.so as LowbitGemmCpu (the C++
// reference) and, with LOWBIT_CUDA_HANDLERS, into liblowbit_cuda.so as LowbitGemmCuda
// (cuBLASLt). Both validate identically.
//
// Workspace: every 256-byte aligned request this handler first made of XLA's FFI
// ScratchAllocator for cuBLASLt failed ("cannot allocate ... bytes"), and that allocator
// allocates at run time, outside the memory XLA plans at compile time. So the device
// workspace is a second result buffer
// that lowbit/ops/gemm.py declares in the lowering and drops (as XLA's own cuBLAS custom
// calls and TransformerEngine do); buffer assignment plans it like any temp. The CUDA
// lowering makes it u8[kGemmWorkspaceBytes], the CPU lowering u8[0]; both handlers bind
// it (one primitive lowers to both), the CPU one ignores it.
//
// lowbit_gemm_accumulate: out (M, N) = c + a_scale_inv * b_scale_inv * a @ b^T for FP8
// operands (tensor or block scale modes; gemm.h's "Accumulation into out"), c aliased to out
// by lowbit/ops/gemm_accumulate.py: a GEMM split along K adds its parts in place, without a
// second (M, N) buffer (lowbit.dense's block backward runs its wgrad so).
//
// lowbit_gemm_nvfp4: out (M, N) = dequant(a) (M, K) @ dequant(b) (N, K)^T + bias for NVFP4
// operands (gemm.h's kNvfp4): a / b packed E2M1 as u8 (rows, ceil(K/2)), their e4m3 scale
// arrays, their f32 (1,) global_scale_invs, K as an attribute (the packed width cannot tell
// an odd K). CPU: the exact emulation; CUDA: cuBLASLt on compute capability 10.x.
//
// Also lowbit_gemm_swizzle_scales (gemm/scale_swizzle.h): a (R, C) one-byte scale matrix
// (u8, e8m0 or e4m3) -> its R * C bytes in cuBLASLt's swizzled 128 x 4 tile order, the step
// the sm_100 MXFP8 GEMM applies inside GemmCuda; an op of its own so that the CUDA kernel is
// tested against the CPU reference bit for bit on any GPU.
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "ffi/ffi_util.h"
#include "gemm/gemm.h"
#include "gemm/scale_swizzle.h"

#if defined(LOWBIT_CUDA_HANDLERS)
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

namespace lowbit {
namespace {

std::string Shape(ffi::Span<const int64_t> dims) {
  return ShapeString(lowbit::Dims(dims.begin(), dims.end()));
}

// Checks one operand's scale buffer against its mode and the operand's rows x k.
Status CheckScale(const char* op, const char* arg, const ffi::AnyBuffer& scale, GemmScaleMode mode,
                  int64_t rows, int64_t k) {
  auto Invalid = [op](const char* a, const std::string& what) { return lowbit::Invalid(op, a, what); };
  const DType want_type = mode == GemmScaleMode::kMxfp8 ? DType::kE8M0 : DType::kF32;
  const DType got_type = ToDType(scale.element_type());
  if (got_type != want_type) {
    return Invalid(arg, std::string("expected ") + DTypeName(want_type) + " for scale mode " +
                            GemmScaleModeName(mode) + ", got " + DTypeName(got_type));
  }
  if (mode == GemmScaleMode::kTensor) {
    if (scale.element_count() != 1) {
      return Invalid(arg, "expected one f32, got shape " + Shape(scale.dimensions()));
    }
    return Status::Ok();
  }
  const GemmScaleShape want = GemmScaleDims(mode, rows, k);
  const auto d = scale.dimensions();
  if (d.size() != 2 || d[0] != want.dim0 || d[1] != want.dim1) {
    return Invalid(arg, std::string("expected shape (") + std::to_string(want.dim0) + ", " +
                            std::to_string(want.dim1) + ") for scale mode " +
                            GemmScaleModeName(mode) + " of a " + std::to_string(rows) + " x " +
                            std::to_string(k) + " operand, got " + Shape(d));
  }
  return Status::Ok();
}

// Checks every buffer against the others and fills `args` (pointers, types, sizes); bias is
// null for lowbit_gemm_accumulate, which has none. Errors name `op`.
Status GemmArgsFromBuffers(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                           const ffi::AnyBuffer& a_scale_inv, const ffi::AnyBuffer& b_scale_inv,
                           const ffi::AnyBuffer* bias, ffi::AnyBuffer& out,
                           bool use_split_accumulator, int32_t a_scale_mode,
                           int32_t b_scale_mode, int32_t algo, bool algo_or_first, GemmArgs* args,
                           const char* op = "lowbit_gemm") {
  auto Invalid = [op](const char* arg, const std::string& what) { return lowbit::Invalid(op, arg, what); };
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out.dimensions();
  if (ad.size() != 2) return Invalid("a", "expected rank 2 (M, K), got shape " + Shape(ad));
  if (bd.size() != 2) return Invalid("b", "expected rank 2 (N, K), got shape " + Shape(bd));
  if (bd[1] != ad[1]) {
    return Invalid("b", "expected (N, " + std::to_string(ad[1]) + ") to match a " + Shape(ad) +
                            ", got " + Shape(bd));
  }
  if (od.size() != 2 || od[0] != ad[0] || od[1] != bd[0]) {
    return Invalid("out", "expected shape (" + std::to_string(ad[0]) + ", " +
                              std::to_string(bd[0]) + "), got " + Shape(od));
  }
  args->a_type = ToDType(a.element_type());
  args->b_type = ToDType(b.element_type());
  args->out_type = ToDType(out.element_type());
  LOWBIT_RETURN_IF_ERROR(CheckGemmTypes(args->a_type, args->b_type, args->out_type, op));
  args->a_scale_mode = static_cast<GemmScaleMode>(a_scale_mode);
  args->b_scale_mode = static_cast<GemmScaleMode>(b_scale_mode);
  LOWBIT_RETURN_IF_ERROR(CheckGemmScaleModes(args->a_scale_mode, args->b_scale_mode, args->a_type, op));
  LOWBIT_RETURN_IF_ERROR(CheckScale(op, "a_scale_inv", a_scale_inv, args->a_scale_mode, ad[0], ad[1]));
  LOWBIT_RETURN_IF_ERROR(CheckScale(op, "b_scale_inv", b_scale_inv, args->b_scale_mode, bd[0], bd[1]));
  const int64_t bias_count = bias ? int64_t(bias->element_count()) : 0;
  if (bias && (bias->dimensions().size() != 1 || (bias_count != 0 && bias_count != bd[0]))) {
    return Invalid("bias", "expected shape (" + std::to_string(bd[0]) + ",) or (0,), got " +
                               Shape(bias->dimensions()));
  }
  if (bias_count != 0 && ToDType(bias->element_type()) != args->out_type) {
    return Invalid("bias", std::string("expected the out type ") + DTypeName(args->out_type) +
                               ", got " + DTypeName(ToDType(bias->element_type())));
  }
  args->a = a.untyped_data();
  args->b = b.untyped_data();
  args->a_scale_inv = a_scale_inv.untyped_data();
  args->b_scale_inv = b_scale_inv.untyped_data();
  args->bias = bias_count != 0 ? bias->untyped_data() : nullptr;
  args->out = out.untyped_data();
  args->m = ad[0];
  args->n = bd[0];
  args->k = ad[1];
  args->use_split_accumulator = use_split_accumulator;
  if (algo < 0 || algo >= kGemmMaxAlgo) {
    return Invalid("algo", "expected a cuBLASLt heuristic index in 0.." +
                               std::to_string(kGemmMaxAlgo - 1) + " (LOWBIT_GEMM_ALGO), got " +
                               std::to_string(algo));
  }
  args->algo = algo;
  args->algo_or_first = algo_or_first;
  return Status::Ok();
}

// lowbit_gemm_accumulate: c must be out's shape and type (XLA aliases the two; a c in a
// buffer of its own is copied into out first by the handlers), then the GEMM's checks.
Status GemmAccumulateArgsFromBuffers(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                                     const ffi::AnyBuffer& a_scale_inv,
                                     const ffi::AnyBuffer& b_scale_inv, const ffi::AnyBuffer& c,
                                     ffi::AnyBuffer& out, bool use_split_accumulator,
                                     int32_t a_scale_mode, int32_t b_scale_mode, int32_t algo,
                                     bool algo_or_first, GemmArgs* args) {
  LOWBIT_RETURN_IF_ERROR(GemmArgsFromBuffers(a, b, a_scale_inv, b_scale_inv, nullptr, out,
                                             use_split_accumulator, a_scale_mode, b_scale_mode, algo,
                                             algo_or_first, args, "lowbit_gemm_accumulate"));
  if (c.element_type() != out.element_type() || c.dimensions().size() != 2 ||
      c.dimensions()[0] != args->m || c.dimensions()[1] != args->n) {
    return lowbit::Invalid("lowbit_gemm_accumulate", "c",
                           "expected out's shape (" + std::to_string(args->m) + ", " + std::to_string(args->n) +
                               ") and type " + DTypeName(args->out_type) + ", got " +
                               DTypeName(ToDType(c.element_type())) + " " + Shape(c.dimensions()));
  }
  args->accumulate = true;
  return CheckGemmAccumulate(*args);
}

// Checks the NVFP4 GEMM's buffers and fills `args`.
Status Nvfp4ArgsFromBuffers(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                            const ffi::AnyBuffer& a_scale, const ffi::AnyBuffer& b_scale,
                            const ffi::AnyBuffer& a_gsi, const ffi::AnyBuffer& b_gsi,
                            const ffi::AnyBuffer& bias, ffi::AnyBuffer& out, int64_t k,
                            int32_t algo, bool algo_or_first, GemmArgs* args) {
  const char* op = "lowbit_gemm_nvfp4";
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out.dimensions();
  if (k < 0) return lowbit::Invalid(op, "k", "expected K >= 0, got " + std::to_string(k));
  const int64_t kb = (k + 1) / 2;
  for (auto [name, buf, d] : {std::tuple{"a", &a, ad}, std::tuple{"b", &b, bd}}) {
    if (ToDType(buf->element_type()) != DType::kU8 || d.size() != 2 || d[1] != kb) {
      return lowbit::Invalid(op, name, "expected packed E2M1 as u8 (rows, " + std::to_string(kb) +
                                           ") for K=" + std::to_string(k) + ", got " +
                                           DTypeName(ToDType(buf->element_type())) + " " + Shape(d));
    }
  }
  if (od.size() != 2 || od[0] != ad[0] || od[1] != bd[0]) {
    return lowbit::Invalid(op, "out", "expected shape (" + std::to_string(ad[0]) + ", " +
                                          std::to_string(bd[0]) + "), got " + Shape(od));
  }
  for (auto [name, buf, rows] : {std::tuple{"a_scale", &a_scale, ad[0]}, std::tuple{"b_scale", &b_scale, bd[0]}}) {
    const GemmScaleShape want = GemmScaleDims(GemmScaleMode::kNvfp4, rows, k);
    const auto d = buf->dimensions();
    if (ToDType(buf->element_type()) != DType::kE4M3 || d.size() != 2 || d[0] != want.dim0 ||
        d[1] != want.dim1) {
      return lowbit::Invalid(op, name, "expected e4m3 (" + std::to_string(want.dim0) + ", " +
                                           std::to_string(want.dim1) + "), got " +
                                           DTypeName(ToDType(buf->element_type())) + " " + Shape(d));
    }
  }
  for (auto [name, buf] : {std::pair{"a_global_scale_inv", &a_gsi}, std::pair{"b_global_scale_inv", &b_gsi}}) {
    if (ToDType(buf->element_type()) != DType::kF32 || buf->element_count() != 1) {
      return lowbit::Invalid(op, name, "expected one f32, got " + Shape(buf->dimensions()));
    }
  }
  args->a_type = args->b_type = DType::kE2M1;
  args->out_type = ToDType(out.element_type());
  args->a_scale_mode = args->b_scale_mode = GemmScaleMode::kNvfp4;
  const int64_t bias_count = int64_t(bias.element_count());
  if (bias.dimensions().size() != 1 || (bias_count != 0 && bias_count != bd[0]) ||
      (bias_count != 0 && ToDType(bias.element_type()) != args->out_type)) {
    return lowbit::Invalid(op, "bias", "expected (" + std::to_string(bd[0]) + ",) or (0,) in the out type " +
                                           DTypeName(args->out_type) + ", got " + Shape(bias.dimensions()));
  }
  if (algo < 0 || algo >= kGemmMaxAlgo) {
    return lowbit::Invalid(op, "algo", "expected 0.." + std::to_string(kGemmMaxAlgo - 1) + ", got " +
                                           std::to_string(algo));
  }
  args->a = a.untyped_data();
  args->b = b.untyped_data();
  args->a_scale_inv = a_scale.untyped_data();
  args->b_scale_inv = b_scale.untyped_data();
  args->a_global_scale_inv = static_cast<const float*>(a_gsi.untyped_data());
  args->b_global_scale_inv = static_cast<const float*>(b_gsi.untyped_data());
  args->bias = bias_count != 0 ? bias.untyped_data() : nullptr;
  args->out = out.untyped_data();
  args->m = ad[0];
  args->n = bd[0];
  args->k = k;
  args->algo = algo;
  args->algo_or_first = algo_or_first;
  return CheckNvfp4Gemm(*args);
}

// Checks the swizzle op's buffers and fills `args`.
Status SwizzleArgsFromBuffers(const ffi::AnyBuffer& in, ffi::AnyBuffer& out, int64_t valid_rows,
                              int64_t valid_cols, ScaleSwizzleArgs* args) {
  const char* op = "lowbit_gemm_swizzle_scales";
  const auto d = in.dimensions();
  if (d.size() != 2) return lowbit::Invalid(op, "scale", "expected rank 2 (R, C), got shape " + Shape(d));
  const DType type = ToDType(in.element_type());
  if (type != DType::kU8 && type != DType::kE8M0 && type != DType::kE4M3) {
    return lowbit::Invalid(op, "scale", std::string("expected u8, e8m0 or e4m3 bytes, got ") +
                                            DTypeName(type));
  }
  if (ToDType(out.element_type()) != type || out.element_count() != in.element_count()) {
    return lowbit::Invalid(op, "out", "expected " + std::to_string(in.element_count()) + " " +
                                          DTypeName(type) + " elements, got shape " +
                                          Shape(out.dimensions()));
  }
  args->in = static_cast<const uint8_t*>(in.untyped_data());
  args->out = static_cast<uint8_t*>(out.untyped_data());
  args->rows = d[0];
  args->cols = d[1];
  args->valid_rows = valid_rows;
  args->valid_cols = valid_cols;
  return CheckScaleSwizzleArgs(*args, op);
}

#if !defined(LOWBIT_CUDA_HANDLERS)

ffi::Error GemmCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                   ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                   bool use_split_accumulator, int32_t a_scale_mode, int32_t b_scale_mode,
                   int32_t algo, bool algo_or_first) {
  (void)workspace;  // the reference needs none; the CPU lowering passes u8[0]
  GemmArgs args;
  Status s = GemmArgsFromBuffers(a, b, a_scale_inv, b_scale_inv, &bias, *out,
                                 use_split_accumulator, a_scale_mode, b_scale_mode, algo,
                                 algo_or_first, &args);
  if (s.ok()) s = GemmRef(args);
  return ToFfiError(s);
}

ffi::Error GemmAccumulateCpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                             ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer c,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                             bool use_split_accumulator, int32_t a_scale_mode, int32_t b_scale_mode,
                             int32_t algo, bool algo_or_first) {
  (void)workspace;
  GemmArgs args;
  Status s = GemmAccumulateArgsFromBuffers(a, b, a_scale_inv, b_scale_inv, c, *out, use_split_accumulator,
                                           a_scale_mode, b_scale_mode, algo, algo_or_first, &args);
  if (!s.ok()) return ToFfiError(s);
  if (c.untyped_data() != out->untyped_data()) {
    std::memcpy(out->untyped_data(), c.untyped_data(), out->size_bytes());
  }
  return ToFfiError(GemmRef(args));
}

ffi::Error GemmNvfp4Cpu(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale,
                        ffi::AnyBuffer b_scale, ffi::AnyBuffer a_gsi, ffi::AnyBuffer b_gsi,
                        ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> workspace, int64_t k, int32_t algo,
                        bool algo_or_first) {
  (void)workspace;
  GemmArgs args;
  Status s = Nvfp4ArgsFromBuffers(a, b, a_scale, b_scale, a_gsi, b_gsi, bias, *out, k, algo, algo_or_first,
                                  &args);
  if (s.ok()) s = GemmRef(args);
  return ToFfiError(s);
}

ffi::Error SwizzleScalesCpu(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int64_t valid_rows,
                            int64_t valid_cols) {
  ScaleSwizzleArgs args;
  Status s = SwizzleArgsFromBuffers(in, *out, valid_rows, valid_cols, &args);
  if (s.ok()) s = ScaleSwizzleRef(args);
  return ToFfiError(s);
}

#else

// The workspace checks of the CUDA GEMM handlers (XLA places the buffer; it is live only for
// the call, so work enqueued later may reuse it: stream order keeps that safe).
Status CheckWorkspace(const GemmArgs& args, ffi::AnyBuffer& workspace, const char* op) {
  void* ws = nullptr;
  return WorkspaceFromResult(op, workspace, GemmWorkspaceBytes(args), &ws, kGemmWorkspaceAlignment);
}

ffi::Error GemmGpu(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer a,
                   ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                   ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> workspace, bool use_split_accumulator,
                   int32_t a_scale_mode, int32_t b_scale_mode, int32_t algo, bool algo_or_first) {
  GemmArgs args;
  Status s = GemmArgsFromBuffers(a, b, a_scale_inv, b_scale_inv, &bias, *out,
                                 use_split_accumulator, a_scale_mode, b_scale_mode, algo,
                                 algo_or_first, &args);
  if (!s.ok()) return ToFfiError(s);
  if (args.m == 0 || args.n == 0) return ffi::Error::Success();
  s = CheckWorkspace(args, *workspace, "lowbit_gemm");
  if (s.ok()) s = GemmCuda(args, device_ordinal, workspace->untyped_data(), stream);
  return ToFfiError(s);
}

ffi::Error GemmAccumulateGpu(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer a,
                             ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                             ffi::AnyBuffer c, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> workspace, bool use_split_accumulator,
                             int32_t a_scale_mode, int32_t b_scale_mode, int32_t algo, bool algo_or_first) {
  GemmArgs args;
  Status s = GemmAccumulateArgsFromBuffers(a, b, a_scale_inv, b_scale_inv, c, *out, use_split_accumulator,
                                           a_scale_mode, b_scale_mode, algo, algo_or_first, &args);
  if (!s.ok()) return ToFfiError(s);
  if (c.untyped_data() != out->untyped_data() && out->size_bytes() != 0) {
    s = CudaStatus(cudaMemcpyAsync(out->untyped_data(), c.untyped_data(), out->size_bytes(),
                                   cudaMemcpyDeviceToDevice, stream),
                   "lowbit_gemm_accumulate", "cudaMemcpyAsync (c to out)");
    if (!s.ok()) return ToFfiError(s);
  }
  if (args.m == 0 || args.n == 0 || args.k == 0) return ffi::Error::Success();  // out = c
  s = CheckWorkspace(args, *workspace, "lowbit_gemm_accumulate");
  if (s.ok()) s = GemmCuda(args, device_ordinal, workspace->untyped_data(), stream);
  return ToFfiError(s);
}

ffi::Error GemmNvfp4Gpu(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer a,
                        ffi::AnyBuffer b, ffi::AnyBuffer a_scale, ffi::AnyBuffer b_scale,
                        ffi::AnyBuffer a_gsi, ffi::AnyBuffer b_gsi, ffi::AnyBuffer bias,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                        int64_t k, int32_t algo, bool algo_or_first) {
  GemmArgs args;
  Status s = Nvfp4ArgsFromBuffers(a, b, a_scale, b_scale, a_gsi, b_gsi, bias, *out, k, algo, algo_or_first,
                                  &args);
  if (!s.ok()) return ToFfiError(s);
  if (args.m == 0 || args.n == 0) return ffi::Error::Success();
  s = CheckWorkspace(args, *workspace, "lowbit_gemm_nvfp4");
  if (s.ok()) s = GemmCuda(args, device_ordinal, workspace->untyped_data(), stream);
  return ToFfiError(s);
}

ffi::Error SwizzleScalesGpu(cudaStream_t stream, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out,
                            int64_t valid_rows, int64_t valid_cols) {
  ScaleSwizzleArgs args;
  Status s = SwizzleArgsFromBuffers(in, *out, valid_rows, valid_cols, &args);
  if (s.ok()) s = ScaleSwizzleCuda(args, stream);
  return ToFfiError(s);
}

#endif

}  // namespace
}  // namespace lowbit

namespace xffi = ::xla::ffi;

LOWBIT_FFI_BACKEND_HANDLER(LowbitGemm, lowbit::Gemm,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::DeviceOrdinal>())  // device: picks the cuBLASLt handle and plans
                               .Arg<xffi::AnyBuffer>()  // a: (M, K) fp8 / bf16 / f16, row-major
                               .Arg<xffi::AnyBuffer>()  // b: (N, K) same family as a, row-major
                               .Arg<xffi::AnyBuffer>()  // a_scale_inv: f32 (1,), or 2-D per a_scale_mode
                               .Arg<xffi::AnyBuffer>()  // b_scale_inv: f32 (1,), or 2-D per b_scale_mode
                               .Arg<xffi::AnyBuffer>()  // bias: (N,) in out's type, or (0,)
                               .Ret<xffi::AnyBuffer>()  // out: (M, N) bf16 / f16 / f32
                               .Ret<xffi::AnyBuffer>()  // workspace: u8, (0,) on the CPU; CUDA: (GemmWorkspaceBytes(...),), 256-B aligned
                               .Attr<bool>("use_split_accumulator")  // FP8 on the GPU: false = fast accumulation
                               .Attr<int32_t>("a_scale_mode")  // GemmScaleMode of a_scale_inv
                               .Attr<int32_t>("b_scale_mode")  // GemmScaleMode of b_scale_inv
                               .Attr<int32_t>("algo")  // cuBLASLt heuristic index (LOWBIT_GEMM_ALGO); checked, unused on the CPU
                               .Attr<bool>("algo_or_first"));  // algo is a library default: past cuBLASLt's list, its first choice runs
LOWBIT_FFI_BACKEND_HANDLER(LowbitGemmAccumulate, lowbit::GemmAccumulate,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::DeviceOrdinal>())  // device
                               .Arg<xffi::AnyBuffer>()  // a: (M, K) fp8, row-major
                               .Arg<xffi::AnyBuffer>()  // b: (N, K) fp8, row-major
                               .Arg<xffi::AnyBuffer>()  // a_scale_inv: as lowbit_gemm's
                               .Arg<xffi::AnyBuffer>()  // b_scale_inv: as lowbit_gemm's
                               .Arg<xffi::AnyBuffer>()  // c: (M, N) in out's type; aliased to out by the lowering
                               .Ret<xffi::AnyBuffer>()  // out: (M, N) bf16 / f16 / f32 = c + a @ b
                               .Ret<xffi::AnyBuffer>()  // workspace: as lowbit_gemm's
                               .Attr<bool>("use_split_accumulator")
                               .Attr<int32_t>("a_scale_mode")
                               .Attr<int32_t>("b_scale_mode")
                               .Attr<int32_t>("algo")
                               .Attr<bool>("algo_or_first"));
LOWBIT_FFI_BACKEND_HANDLER(LowbitGemmNvfp4, lowbit::GemmNvfp4,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::DeviceOrdinal>())  // device
                               .Arg<xffi::AnyBuffer>()  // a: (M, ceil(K/2)) u8, packed E2M1
                               .Arg<xffi::AnyBuffer>()  // b: (N, ceil(K/2)) u8, packed E2M1
                               .Arg<xffi::AnyBuffer>()  // a_scale: e4m3 (roundup(M,128), roundup(ceil(K/16),4)), row-major (CUDA swizzles it)
                               .Arg<xffi::AnyBuffer>()  // b_scale: e4m3 (roundup(N,128), ...), row-major (CUDA swizzles it)
                               .Arg<xffi::AnyBuffer>()  // a_global_scale_inv: f32 (1,)
                               .Arg<xffi::AnyBuffer>()  // b_global_scale_inv: f32 (1,)
                               .Arg<xffi::AnyBuffer>()  // bias: (N,) in out's type, or (0,); always (0,) on the GPU (lowbit.ops.gemm adds it in fp32)
                               .Ret<xffi::AnyBuffer>()  // out: (M, N) bf16 / f16 / f32
                               .Ret<xffi::AnyBuffer>()  // workspace: u8, (0,) on the CPU; CUDA: (GemmWorkspaceBytes(...),)
                               .Attr<int64_t>("k")  // K (elements)
                               .Attr<int32_t>("algo")  // cuBLASLt heuristic index; checked, unused on the CPU
                               .Attr<bool>("algo_or_first"));  // as lowbit_gemm's
LOWBIT_FFI_BACKEND_HANDLER(LowbitGemmSwizzleScales, lowbit::SwizzleScales,
                           xffi::Ffi::Bind()
                               LOWBIT_FFI_CUDA_ONLY(.Ctx<xffi::PlatformStream<cudaStream_t>>())  // stream
                               .Arg<xffi::AnyBuffer>()  // scale: (R, C) u8 / e8m0 / e4m3, row-major
                               .Ret<xffi::AnyBuffer>()  // out: (R * C,) same type, swizzled
                               .Attr<int64_t>("valid_rows")  // rows >= this are written as 0
                               .Attr<int64_t>("valid_cols"));  // cols >= this are written as 0
