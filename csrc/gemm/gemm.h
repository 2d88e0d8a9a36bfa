// gemm: out = (a_scale_inv * a) @ (b_scale_inv * b)^T + bias, FP32 accumulation.
//
// One canonical layout ("TN", both operands K-major): a is (M, K) row-major, b is (N, K)
// row-major, out is (M, N) row-major, bias has N values (or none). Python adapts every
// other layout by transposing (lowbit/ops/gemm.py). In cuBLASLt's column-major terms this
// is D^T (N x M) = op_T(b as K x N) * (a as K x M): transa = T, transb = N, the only
// layout Hopper's FP8 tensor cores take.
//
// Types: a and b are both FP8 (E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3; E5M2 x E5M2 has no
// hardware path and is rejected), or both bf16, or both f16. out is bf16, f16 or f32; with
// 16-bit inputs it must be the input type or f32 (what cuBLASLt offers). bias has the out
// type. The scale_invs (one f32 each) apply to every input type.
//
// Numerics (the CPU reference, exactly; the GPU within the tolerance of tests/test_gemm_ops.py):
// every product a[m,k] * b[n,k] of decoded values is exact in fp32 (FP8, bf16 and f16
// significands are short enough), so the only roundings are: acc = the fp32 sum of the
// products in increasing k order starting from +0; y = fl(fl(a_scale_inv * b_scale_inv) *
// acc); y = fl(y + bias[n]); out = y rounded to the out type (nearest even).
//
// Accumulation into out (GemmArgs::accumulate, lowbit_gemm_accumulate): out holds C (M, N, the
// out type) on entry and y = fl(y + C[m,n]) takes the bias's place (no bias then), so that
// out = C + a @ b with one more fp32 rounding: cuBLASLt's beta = 1. FP8 operands only (tensor
// or block scale modes), one dense GEMM (CheckGemmAccumulate).
//
// Block scale modes (FP8 operands only; a_scale_mode / b_scale_mode, GemmScaleMode below):
// the scale_invs are then 2-D arrays in the quantizers' GEMM-ready layouts, for an operand of
// R rows (M for a, N for b) and K columns:
//   kBlock1x128    f32 (ceil(K/128), roundup(R, 4)): entry [j][r] scales x[r, 128j:128j+128]
//                  (quantize_block.h; cuBLASLt's VEC128_32F, "M-major")
//   kBlock128x128  f32 (ceil(R/128), roundup(ceil(K/128), 4)): entry [i][j] scales the tile
//                  (i, j) (cuBLASLt's BLK128x128_32F, K-major, the K-block count padded to 4)
//   kMxfp8         e8m0 (roundup(R, 128), roundup(ceil(K/32), 4)): entry [r][j] scales
//                  x[r, 32j:32j+32] (quantize_mxfp8.h, before cuBLASLt's 128x4 swizzle,
//                  which the sm_100 CUDA path applies itself: scale_swizzle.h)
//   kNvfp4         e4m3 (roundup(R, 128), roundup(ceil(K/16), 4)): entry [r][j] scales
//                  x[r, 16j:16j+16] (quantize_nvfp4.h), times the operand's fp32
//                  global_scale_inv; the data are packed E2M1 (a_type = b_type = kE2M1,
//                  R x ceil(K/2) bytes, element 2j in the low nibble of byte j). Only through
//                  lowbit_gemm_nvfp4 (CheckNvfp4Gemm), never lowbit_gemm.
// Both operands use block modes or neither; MXFP8 pairs only with MXFP8. Numerics (the CPU
// emulation, exactly): each operand is dequantized to fp32, a'[m,k] = fl(decode(a) * s_a)
// (E8M0 s = 2^(e-127), NaN for 0xFF; NVFP4 a' = fl(fl(e2m1 * e4m3(sd)) * global_scale_inv),
// the first product exact, as lowbit.ops.quantize_nvfp4.dequantize_nvfp4), then acc = the fp32 sum of fl(a'[m,k] * b'[n,k]) in
// increasing k from +0, y = fl(acc + bias[n]), rounded to out. cuBLASLt applies the scales
// per 128-long K block to fp32 partial sums instead (a different rounding order), and so does
// lowbit's own Hopper kernel for the FP8 block pairs (block_gemm_sm90.h, LOWBIT_BLOCK_GEMM=wgmma).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

// How a_scale_inv / b_scale_inv are read (values are the FFI attribute's, and
// lowbit/ops/gemm.py's GemmScaleMode).
enum class GemmScaleMode : int32_t {
  kTensor = 0,        // one f32 for the whole operand
  kBlock1x128 = 1,    // f32 per 1x128 tile along K
  kBlock128x128 = 2,  // f32 per 128x128 tile
  kMxfp8 = 3,         // e8m0 byte per 32 values along K
  kNvfp4 = 4,         // e4m3 byte per 16 values along K, packed E2M1 data (lowbit_gemm_nvfp4)
};

inline const char* GemmScaleModeName(GemmScaleMode mode) {
  switch (mode) {
    case GemmScaleMode::kTensor: return "tensor";
    case GemmScaleMode::kBlock1x128: return "block_1x128";
    case GemmScaleMode::kBlock128x128: return "block_128x128";
    case GemmScaleMode::kMxfp8: return "mxfp8";
    case GemmScaleMode::kNvfp4: return "nvfp4";
  }
  return "invalid";
}

inline bool IsBlockScaleMode(GemmScaleMode mode) { return mode != GemmScaleMode::kTensor; }

// (dim0, dim1) of the scale array of an operand of `rows` x `k` in `mode` (see above);
// (1, 1) for kTensor.
struct GemmScaleShape {
  int64_t dim0 = 1;
  int64_t dim1 = 1;
};
inline GemmScaleShape GemmScaleDims(GemmScaleMode mode, int64_t rows, int64_t k) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  auto roundup = [&](int64_t a, int64_t b) { return cdiv(a, b) * b; };
  switch (mode) {
    case GemmScaleMode::kBlock1x128: return {cdiv(k, 128), roundup(rows, 4)};
    case GemmScaleMode::kBlock128x128: return {cdiv(rows, 128), roundup(cdiv(k, 128), 4)};
    case GemmScaleMode::kMxfp8: return {roundup(rows, 128), roundup(cdiv(k, 32), 4)};
    case GemmScaleMode::kNvfp4: return {roundup(rows, 128), roundup(cdiv(k, 16), 4)};
    default: return {1, 1};
  }
}

struct GemmArgs {
  const void* a = nullptr;  // (m, k) row-major, a_type
  const void* b = nullptr;  // (n, k) row-major, b_type
  DType a_type = DType::kInvalid;
  DType b_type = DType::kInvalid;
  // kTensor: one f32; block modes: the 2-D arrays above (f32, or e8m0 bytes for kMxfp8).
  // Host memory for the CPU reference, device memory for CUDA.
  const void* a_scale_inv = nullptr;
  const void* b_scale_inv = nullptr;
  GemmScaleMode a_scale_mode = GemmScaleMode::kTensor;
  GemmScaleMode b_scale_mode = GemmScaleMode::kTensor;
  const void* bias = nullptr;  // n values of out_type, or null for none
  void* out = nullptr;         // (m, n) row-major, out_type
  DType out_type = DType::kInvalid;
  int64_t m = 0, n = 0, k = 0;
  bool use_split_accumulator = true;  // FP8 tensor mode on the GPU only: false = fast accumulation
  // kNvfp4 only: each operand's fp32 global_scale_inv (one value; host or device as above).
  const float* a_global_scale_inv = nullptr;
  const float* b_global_scale_inv = nullptr;
  // CUDA only: which of cuBLASLt's heuristic results to run, 0 = its first choice (see
  // kGemmMaxAlgo; lowbit/ops/gemm.py takes it from LOWBIT_GEMM_ALGO). Ignored on the CPU.
  int32_t algo = 0;
  // CUDA only: when cuBLASLt returns no entry `algo` for this problem, run its first choice
  // instead of failing (for an index that is a library default, not the user's choice).
  bool algo_or_first = false;
  // CUDA, tensor scale mode only: leading dimensions (elements between rows) of a, b and out
  // when they are rows of larger arrays (lowbit_dense_backward_fp8); 0 = dense (k, k, n).
  // Multiples of 16. The CPU reference takes dense operands only.
  int64_t lda = 0, ldb = 0, ldd = 0;
  // CUDA, tensor scale mode only: `batch` GEMMs of one shape in one launch, operand i of GEMM j
  // at its pointer + j * batch_stride_i elements (a stride of 0 shares the operand).
  int32_t batch = 1;
  int64_t batch_stride_a = 0, batch_stride_b = 0, batch_stride_d = 0;
  // out = C + a @ b, C being out's contents on entry (see "Accumulation into out" above).
  bool accumulate = false;
};

// algo is an index into the list cublasLtMatmulAlgoGetHeuristic returns, 0..kGemmMaxAlgo-1.
// The CUDA launcher asks for algo + 1 results and fails (naming the count it got) when
// cuBLASLt returns fewer, unless algo_or_first; both are part of the plan key.
constexpr int32_t kGemmMaxAlgo = 32;

// The heuristic entry a plan runs, given the `usable` leading entries cuBLASLt returned
// (found, each with a success state): `algo` when it is one of them, else 0 with
// `or_first` (and at least one entry), else -1 (the caller's error).
inline int32_t PickHeuristicIndex(int32_t usable, int32_t algo, bool or_first) {
  if (algo >= 0 && algo < usable) return algo;
  return or_first && usable > 0 ? 0 : -1;
}

// The scale-mode rules above, shared by both handlers (`op_name` prefixes the messages:
// lowbit_gemm_accumulate runs the same checks under its own name).
inline Status CheckGemmScaleModes(GemmScaleMode a_mode, GemmScaleMode b_mode, DType a_type,
                                  const char* op_name = "lowbit_gemm") {
  const std::string op = std::string(op_name) + ": ";
  for (GemmScaleMode m : {a_mode, b_mode}) {
    if (int32_t(m) < 0 || int32_t(m) > int32_t(GemmScaleMode::kMxfp8)) {
      return Status::InvalidArgument(op + "scale_mode: expected 0 (tensor), 1 (block_1x128), "
                                     "2 (block_128x128) or 3 (mxfp8), got " +
                                     std::to_string(int32_t(m)));
    }
  }
  if (IsBlockScaleMode(a_mode) != IsBlockScaleMode(b_mode)) {
    return Status::InvalidArgument(op + "b_scale_mode: expected block scales on both operands "
                                   "or neither, got a " + GemmScaleModeName(a_mode) + " and b " +
                                   GemmScaleModeName(b_mode));
  }
  if ((a_mode == GemmScaleMode::kMxfp8) != (b_mode == GemmScaleMode::kMxfp8)) {
    return Status::InvalidArgument(op + "b_scale_mode: MXFP8 scales pair only with MXFP8 scales, "
                                   "got a " + std::string(GemmScaleModeName(a_mode)) + " and b " +
                                   GemmScaleModeName(b_mode));
  }
  if (IsBlockScaleMode(a_mode) && !IsFp8(a_type)) {
    return Status::InvalidArgument(op + "a: block scale modes need FP8 operands, got " +
                                   DTypeName(a_type));
  }
  return Status::Ok();
}

// The NVFP4 GEMM's rules (lowbit_gemm_nvfp4): both operands kE2M1 in kNvfp4 mode with global
// scales, out bf16 / f16 / f32.
inline Status CheckNvfp4Gemm(const GemmArgs& args) {
  const std::string op = "lowbit_gemm_nvfp4: ";
  if (args.a_type != DType::kE2M1 || args.b_type != DType::kE2M1 ||
      args.a_scale_mode != GemmScaleMode::kNvfp4 || args.b_scale_mode != GemmScaleMode::kNvfp4) {
    return Status::InvalidArgument(op + "a, b: expected packed E2M1 operands with NVFP4 scales");
  }
  if (!args.a_global_scale_inv || !args.b_global_scale_inv) {
    return Status::InvalidArgument(op + "a_global_scale_inv, b_global_scale_inv: missing");
  }
  if (!IsHighPrecision(args.out_type)) {
    return Status::InvalidArgument(op + "out: expected bf16, f16 or f32, got " +
                                   DTypeName(args.out_type));
  }
  if (args.m < 0 || args.n < 0 || args.k < 0) {
    return Status::InvalidArgument(op + "negative dimension");
  }
  return Status::Ok();
}

// The type rules above, shared by both handlers so that CPU and GPU reject the same inputs
// (`op_name` as for CheckGemmScaleModes).
inline Status CheckGemmTypes(DType a, DType b, DType out, const char* op_name = "lowbit_gemm") {
  const std::string op = std::string(op_name) + ": ";
  if (IsFp8(a) || IsFp8(b)) {
    if (!IsFp8(a) || !IsFp8(b)) {
      return Status::InvalidArgument(op + "b: expected both operands FP8 or neither, got a " +
                                     DTypeName(a) + " and b " + DTypeName(b));
    }
    if (a == DType::kE5M2 && b == DType::kE5M2) {
      return Status::InvalidArgument(op + "b: f8e5m2 x f8e5m2 has no FP8 GEMM; "
                                     "quantize one operand to f8e4m3fn");
    }
    if (!IsHighPrecision(out)) {
      return Status::InvalidArgument(op + "out: expected bf16, f16 or f32, got " +
                                     std::string(DTypeName(out)));
    }
    return Status::Ok();
  }
  if ((a != DType::kBF16 && a != DType::kF16) || b != a) {
    return Status::InvalidArgument(op + "b: expected a and b both FP8, both bf16 or both f16, got a " +
                                   DTypeName(a) + " and b " + DTypeName(b));
  }
  if (out != a && out != DType::kF32) {
    return Status::InvalidArgument(op + "out: with " + DTypeName(a) + " operands expected " +
                                   DTypeName(a) + " or f32, got " + DTypeName(out));
  }
  return Status::Ok();
}

// The limits of GemmArgs::accumulate, shared by both handlers: FP8 operands (the CUDA
// launcher passes beta on the host for them), no bias, one dense GEMM (no NVFP4).
inline Status CheckGemmAccumulate(const GemmArgs& args) {
  if (!args.accumulate) return Status::Ok();
  if (!IsFp8(args.a_type) || args.a_scale_mode == GemmScaleMode::kNvfp4) {
    return Status::InvalidArgument(std::string("lowbit_gemm_accumulate: a: expected FP8 operands, got ") +
                                   DTypeName(args.a_type));
  }
  if (args.bias != nullptr) {
    return Status::InvalidArgument("lowbit_gemm_accumulate: bias: an accumulating GEMM takes none");
  }
  if (args.batch != 1 || args.lda != 0 || args.ldb != 0 || args.ldd != 0) {
    return Status::InvalidArgument("lowbit_gemm_accumulate: one GEMM of dense operands only");
  }
  return Status::Ok();
}

// CPU reference (gemm_ref.cc): the numerics above, bit for bit. Scale pointers are host
// pointers. Cache-blocked, vectorizable, and split over up to 4 threads for large problems;
// the result does not depend on the thread count.
Status GemmRef(const GemmArgs& args);

// FP8 on cuBLASLt needs K and the leading dimension of out (N) to be multiples of 16 and
// every pointer 16-byte aligned; lowbit/ops/gemm.py pads K and N before lowering for CUDA.
constexpr int64_t kFp8DimMultiple = 16;

// Device workspace the CUDA launcher wants from the caller: the 32 MiB cuBLASLt workspace
// NVIDIA recommends for Hopper, plus 256 bytes of scalars in front of it. The FFI handler
// receives it as a second result buffer, u8[kGemmWorkspaceBytes] (GEMM_WORKSPACE_BYTES in
// lowbit/ops/gemm.py must match), which XLA aligns to 256 bytes.
constexpr size_t kGemmCublasWorkspaceBytes = size_t(32) << 20;
constexpr size_t kGemmScalarBytes = 256;
constexpr size_t kGemmWorkspaceBytes = kGemmCublasWorkspaceBytes + kGemmScalarBytes;
constexpr size_t kGemmWorkspaceAlignment = 256;

// What GemmCuda needs for `args`: kGemmWorkspaceBytes, plus for kMxfp8 / kNvfp4 room for the two
// swizzled scale arrays behind it (each rounded up to 256 bytes), where the sm_100 path
// writes them (scale_swizzle.h). GEMM_WORKSPACE_BYTES / gemm_workspace_bytes in
// lowbit/ops/gemm.py compute the same.
inline size_t GemmScaleBytesPadded(GemmScaleMode mode, int64_t rows, int64_t k) {
  const GemmScaleShape d = GemmScaleDims(mode, rows, k);
  const size_t bytes = size_t(d.dim0 * d.dim1);
  return (bytes + kGemmWorkspaceAlignment - 1) / kGemmWorkspaceAlignment * kGemmWorkspaceAlignment;
}
inline size_t GemmWorkspaceBytes(const GemmArgs& args) {
  if (args.a_scale_mode != GemmScaleMode::kMxfp8 && args.a_scale_mode != GemmScaleMode::kNvfp4) {
    return kGemmWorkspaceBytes;
  }
  return kGemmWorkspaceBytes + GemmScaleBytesPadded(args.a_scale_mode, args.m, args.k) +
         GemmScaleBytesPadded(args.b_scale_mode, args.n, args.k);
}

// CUDA launcher (cublaslt_gemm_cuda.cc): enqueues the GEMM on `stream` of device
// `device_ordinal`, no host sync. `workspace` is GemmWorkspaceBytes(args) of device memory,
// 256-byte aligned, used only by work enqueued by this call.
Status GemmCuda(const GemmArgs& args, int device_ordinal, void* workspace, GpuStream stream);

}  // namespace lowbit
