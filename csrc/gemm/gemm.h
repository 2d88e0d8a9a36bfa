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
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

struct GemmArgs {
  const void* a = nullptr;  // (m, k) row-major, a_type
  const void* b = nullptr;  // (n, k) row-major, b_type
  DType a_type = DType::kInvalid;
  DType b_type = DType::kInvalid;
  const float* a_scale_inv = nullptr;  // one f32 (host memory for the CPU reference, device for CUDA)
  const float* b_scale_inv = nullptr;
  const void* bias = nullptr;  // n values of out_type, or null for none
  void* out = nullptr;         // (m, n) row-major, out_type
  DType out_type = DType::kInvalid;
  int64_t m = 0, n = 0, k = 0;
  bool use_split_accumulator = true;  // FP8 on the GPU only: false = cuBLASLt fast accumulation
};

// The type rules above, shared by both handlers so that CPU and GPU reject the same inputs.
inline Status CheckGemmTypes(DType a, DType b, DType out) {
  const std::string op = "lowbit_gemm: ";
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

// CUDA launcher (cublaslt_gemm_cuda.cc): enqueues the GEMM on `stream` of device
// `device_ordinal`, no host sync. `workspace` is kGemmWorkspaceBytes of device memory,
// 256-byte aligned, used only by work enqueued by this call.
Status GemmCuda(const GemmArgs& args, int device_ordinal, void* workspace, GpuStream stream);

}  // namespace lowbit
