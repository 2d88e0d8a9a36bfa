// lowbit_gemm on cuBLASLt (layout and numerics in gemm.h).
//
// Handles and plans: a process-wide CublasLtCache (created on first use, never destroyed,
// so that no cuBLASLt call runs after the CUDA runtime has shut down at exit) holds one
// DeviceState per device, created lazily: a cuBLASLt handle, and one plan per (M, N, K,
// types, bias epilogue, fast accumulation, pointer alignments, the two scale modes, algo).
// A plan is the matmul descriptor, the three matrix layouts and the algorithm: entry `algo`
// (GemmArgs::algo, default 0 = cuBLASLt's first choice) of the list
// cublasLtMatmulAlgoGetHeuristic returns for a 32 MiB workspace; every descriptor lives in a
// unique_ptr with its destroy function, so a check that fails halfway through building a
// plan leaks nothing. Plans are never evicted (a training run uses a few dozen shapes).
//
// Locking: everything that touches a device's handle or plans (lookup, build, writing the
// per-call data pointers into the descriptor, the cublasLtMatmul enqueue) runs under that
// device's mutex, so concurrent calls from several threads cannot mix up the A/B scale or
// bias pointers of a shared descriptor. Holding it costs one map lookup and an enqueue per
// call, far below the GEMM; instantiate-stage FFI state would avoid the lookup, at the
// price of a registered state type and a second handler stage.
//
// cuBLASLt's A is our b and its B is our a: D^T (N x M, ld N) = op_T(b: K x N, ld K) *
// (a: K x M, ld K). The FP8 scale of cuBLASLt's A is therefore b_scale_inv.
//
// FP8 block scaling (gemm.h's kBlock1x128 / kBlock128x128): cuBLASLt's A/B_SCALE_MODE =
// VEC128_32F / BLK128x128_32F (cublasLt.h, CUDA 12.9+), the scale pointers being the 2-D
// scale arrays as the quantizers lay them out: 1x128 [ceil(K/128)][rows] with the rows
// contiguous, 128x128 [ceil(rows/128)][roundup(ceil(K/128), 4)] (the layouts PyTorch's
// _scaled_mm checks before handing the same modes to cuBLASLt, ScaledBlas.cpp). Only on
// compute capability 9.0, for the pairs (1x128, 128x128), (128x128, 1x128) and (1x128,
// 1x128); M, N and K must be multiples of 16 (lowbit/ops/gemm.py pads them, so that a 1x128
// scale row is exactly the operand's row count), a bias epilogue only for 16-bit outputs
// (the bias in the output's dtype, added in fp32 before the one rounding, as for per-tensor
// FP8; an fp32 output's bias is lowbit.ops.gemm's, in XLA), no fast accumulation (the kernel
// promotes to fp32 per 128-long K block).
//
// MXFP8 (gemm.h's kMxfp8): cuBLASLt's VEC32_UE8M0 scale mode on both operands (cuBLAS
// 12.8+), on compute capability 10.x only (Blackwell datacenter parts; the gate is the
// major version, exactly). cuBLASLt reads the scales in its swizzled 128 x 4 tile order
// (cuBLAS docs, "1D block scaling factors layout"); the quantizers write them row-major, so
// this launcher first swizzles both arrays into the workspace behind cuBLASLt's own
// (ScaleSwizzleCuda, scale_swizzle.h; GemmWorkspaceBytes sizes it), writing 0x00 for the
// scale entries past the operand's rows and K blocks, and passes those pointers. M and N
// must be multiples of 16 and K of 128 (lowbit/ops/gemm.py pads them; the scale arrays keep
// their shapes), no bias epilogue (lowbit.ops.gemm adds the bias in fp32). Not run on real
// Blackwell hardware yet: tests/test_gemm_block_cuda.py compares it with the CPU emulation there.
//
// NVFP4 (gemm.h's kNvfp4, lowbit_gemm_nvfp4 only): A/B types CUDA_R_4F_E2M1 (packed, leading
// dimension K in elements), VEC16_UE4M3 scale mode on both, the e4m3 scale arrays swizzled
// into the workspace as for MXFP8, and the two fp32 global scale_invs folded into alpha:
// alpha = fl(a_gsi * b_gsi) computed on the device (GemmAlphaBetaCuda) and passed with
// POINTER_MODE_DEVICE, as for the 16-bit GEMMs. Compute capability 10.x only; M and N
// multiples of 16, K of 64 (whole 128 x 4 scale tiles; lowbit/ops/gemm.py pads), no bias.
// Same caveat: compile-checked only.
//
// Pieces (included here, private to this translation unit): cublaslt_helpers.h (version and
// capability gates, status and type conversion, RAII descriptors, ScopedDevice) and
// cublaslt_plan_cache.h (plan key, BuildPlan, the per-device CublasLtCache); this file keeps
// the problem checks of the rules above and GemmCuda.
#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "common/cuda_check.h"
#include "gemm/block_gemm_sm90.h"
#include "gemm/gemm.h"
#include "gemm/gemm_epilogue.h"
#include "gemm/scale_swizzle.h"

// This file's pieces (see the preamble), after everything they use.
#include "gemm/cublaslt_helpers.h"
#include "gemm/cublaslt_plan_cache.h"

namespace lowbit {
namespace {

Status CheckFp8Problem(const GemmArgs& args, int device, int capability) {
  if (capability < kMinFp8ComputeCapability) {
    return Status::Unimplemented("lowbit_gemm: FP8 GEMMs need compute capability 8.9+ (Ada, "
                                 "Hopper or newer); device " + std::to_string(device) + " is " +
                                 std::to_string(capability / 10) + "." +
                                 std::to_string(capability % 10));
  }
  if (args.k % kFp8DimMultiple != 0 || args.n % kFp8DimMultiple != 0) {
    return Status::InvalidArgument(
        "lowbit_gemm: FP8 on cuBLASLt needs K and N (the leading dimensions) to be multiples "
        "of 16, got " + Problem(args) + "; lowbit.ops.gemm pads them with zeros");
  }
  if (Alignment(args.a) < 16 || Alignment(args.b) < 16 || Alignment(args.out) < 16 ||
      (args.bias && Alignment(args.bias) < 16)) {
    return Status::InvalidArgument("lowbit_gemm: FP8 on cuBLASLt needs 16-byte aligned a, b, "
                                   "out and bias buffers, for " + Problem(args));
  }
  return Status::Ok();
}

std::string CapabilityString(int capability) {
  return std::to_string(capability / 10) + "." + std::to_string(capability % 10);
}

// The MXFP8 and NVFP4 rules of the preamble.
Status CheckMxProblem(const GemmArgs& args, int device, int capability) {
  const bool mx = args.a_scale_mode == GemmScaleMode::kMxfp8;
  const std::string op = mx ? "lowbit_gemm: MXFP8" : "lowbit_gemm_nvfp4: NVFP4";
  if (capability / 10 != kMxScaleComputeCapabilityMajor) {
    return Status::Unimplemented(
        op + " runs on cuBLASLt (" + (mx ? "VEC32_UE8M0" : "VEC16_UE4M3") + " scales) on compute "
        "capability 10.x only in lowbit; device " + std::to_string(device) + " is " +
        CapabilityString(capability) + "; lowbit.ops.gemm emulates it there");
  }
  if (cublasLtGetVersion() < size_t(kMxScaleCublasVersion)) {
    return Status::Unimplemented(op + ": the loaded cuBLASLt " + std::to_string(cublasLtGetVersion()) +
                                 " has no such scale mode (12.8+ has)");
  }
  const int64_t k_multiple = mx ? kMxfp8KMultiple : kNvfp4KMultiple;
  if (args.m % kFp8DimMultiple != 0 || args.n % kFp8DimMultiple != 0 || args.k % k_multiple != 0) {
    return Status::InvalidArgument(op + " on cuBLASLt needs M and N to be multiples of 16 and K of " +
                                   std::to_string(k_multiple) + ", got " + Problem(args) +
                                   "; lowbit.ops.gemm pads them");
  }
  if (args.bias != nullptr) {
    return Status::InvalidArgument(op + ": bias: block-scaled GEMMs take no bias on cuBLASLt; "
                                   "lowbit.ops.gemm adds it in fp32");
  }
  if (Alignment(args.a) < 16 || Alignment(args.b) < 16 || Alignment(args.out) < 16) {
    return Status::InvalidArgument(op + " on cuBLASLt needs 16-byte aligned a, b and out, for " +
                                   Problem(args));
  }
  return Status::Ok();
}

// The FP8 block-scaling rules of the preamble.
Status CheckBlockScaleProblem(const GemmArgs& args, int device, int capability) {
  const std::string modes = std::string(" (a ") + GemmScaleModeName(args.a_scale_mode) + ", b " +
                            GemmScaleModeName(args.b_scale_mode) + ")";
  if (args.a_scale_mode == GemmScaleMode::kMxfp8 || args.a_scale_mode == GemmScaleMode::kNvfp4) {
    return CheckMxProblem(args, device, capability);
  }
  if (args.a_scale_mode == GemmScaleMode::kBlock128x128 &&
      args.b_scale_mode == GemmScaleMode::kBlock128x128) {
    return Status::Unimplemented("lowbit_gemm: cuBLASLt has no 128x128 x 128x128 block-scaled "
                                 "GEMM; quantize one operand in 1x128 tiles");
  }
  if (capability != kBlockScaleComputeCapability) {
    return Status::Unimplemented(
        "lowbit_gemm: cuBLASLt's FP8 block scaling runs on compute capability 9.0 only; device " +
        std::to_string(device) + " is " + std::to_string(capability / 10) + "." +
        std::to_string(capability % 10) + modes);
  }
  if (cublasLtGetVersion() < size_t(kBlockScaleCublasVersion)) {
    return Status::Unimplemented("lowbit_gemm: the loaded cuBLASLt " +
                                 std::to_string(cublasLtGetVersion()) +
                                 " has no FP8 block scaling (12.9+ has)");
  }
  if (args.m % kFp8DimMultiple != 0) {
    return Status::InvalidArgument("lowbit_gemm: FP8 block scaling on cuBLASLt needs M to be a "
                                   "multiple of 16 too, got " + Problem(args) + modes +
                                   "; lowbit.ops.gemm pads it");
  }
  if (args.bias != nullptr && args.out_type == DType::kF32) {
    return Status::InvalidArgument("lowbit_gemm: bias: block-scaled GEMMs with an fp32 output "
                                   "take no bias on cuBLASLt; lowbit.ops.gemm adds it in fp32");
  }
  if (Alignment(args.a_scale_inv) < 16 || Alignment(args.b_scale_inv) < 16) {
    return Status::InvalidArgument("lowbit_gemm: block scale arrays must be 16-byte aligned, for " +
                                   Problem(args) + modes);
  }
  return Status::Ok();
}

}  // namespace

Status GemmCuda(const GemmArgs& args, int device_ordinal, void* workspace, GpuStream stream) {
  const bool nvfp4 = args.a_scale_mode == GemmScaleMode::kNvfp4;
  if (nvfp4) {
    LOWBIT_RETURN_IF_ERROR(CheckNvfp4Gemm(args));
  } else {
    LOWBIT_RETURN_IF_ERROR(CheckGemmTypes(args.a_type, args.b_type, args.out_type));
  }
  if (args.m == 0 || args.n == 0) return Status::Ok();
  if (args.k <= 0) {
    return Status::InvalidArgument("lowbit_gemm: K must be positive on CUDA, got " + Problem(args));
  }
  DeviceState* device = nullptr;
  LOWBIT_RETURN_IF_ERROR(CublasLtCache::Get().Device(device_ordinal, args, &device));
  if (!nvfp4) {
    LOWBIT_RETURN_IF_ERROR(CheckGemmScaleModes(args.a_scale_mode, args.b_scale_mode, args.a_type));
  }
  if (args.batch < 1) return Status::InvalidArgument("lowbit_gemm: batch: expected >= 1, for " + Problem(args));
  if (args.lda != 0 || args.ldb != 0 || args.ldd != 0 || args.batch != 1) {
    if (args.a_scale_mode != GemmScaleMode::kTensor || args.bias != nullptr || args.lda % 16 != 0 || args.ldb % 16 != 0 ||
        args.ldd % 16 != 0 || (args.lda != 0 && args.lda < args.k) || (args.ldb != 0 && args.ldb < args.k) ||
        (args.ldd != 0 && args.ldd < args.n)) {
      return Status::InvalidArgument("lowbit_gemm: lda, ldb, ldd: tensor scale mode without bias only, multiples of 16 and "
                                     "at least the row lengths, for " + Problem(args));
    }
  }
  const bool fp8 = IsFp8(args.a_type);
  const bool block = IsBlockScaleMode(args.a_scale_mode);
  if (fp8) LOWBIT_RETURN_IF_ERROR(CheckFp8Problem(args, device_ordinal, device->capability));
  LOWBIT_RETURN_IF_ERROR(CheckGemmAccumulate(args));
  // FP8 block scaling on Hopper: lowbit's own wgmma kernel where LOWBIT_BLOCK_GEMM asks for it
  // (not for an accumulating GEMM: the wgmma kernel writes out without reading it).
  if (block && !args.accumulate && BlockGemmSm90Requested() && BlockGemmSm90Applies(args, device->capability)) {
    return BlockGemmSm90Cuda(args, device_ordinal, stream);
  }
  if (block) LOWBIT_RETURN_IF_ERROR(CheckBlockScaleProblem(args, device_ordinal, device->capability));

  // f32 outputs take their bias from GemmBiasAddF32Cuda (see gemm_epilogue.h).
  const bool bias_epilogue = args.bias != nullptr && args.out_type != DType::kF32;
  if (args.algo < 0 || args.algo >= kGemmMaxAlgo) {
    return Status::InvalidArgument("lowbit_gemm: algo: expected 0.." +
                                   std::to_string(kGemmMaxAlgo - 1) + ", got " +
                                   std::to_string(args.algo));
  }
  const PlanKey key{device_ordinal, args.m, args.n, args.k, args.a_type, args.b_type,
                    args.out_type, bias_epilogue, fp8 && !block && !args.use_split_accumulator,
                    Alignment(args.a), Alignment(args.b), Alignment(args.out),
                    bias_epilogue ? Alignment(args.bias) : 0u, args.a_scale_mode,
                    args.b_scale_mode, args.algo, args.algo_or_first, args.lda ? args.lda : args.k,
                    args.ldb ? args.ldb : args.k, args.ldd ? args.ldd : args.n, args.batch,
                    args.batch_stride_a, args.batch_stride_b, args.batch_stride_d};

  // Scalars first, then cuBLASLt's workspace (kGemmScalarBytes keeps it 256-byte aligned),
  // then (MXFP8) the two swizzled scale arrays.
  float* alpha_beta = static_cast<float*>(workspace);
  void* cublas_workspace = static_cast<char*>(workspace) + kGemmScalarBytes;
  GemmArgs call = args;  // args with the scale pointers cuBLASLt reads
  if (args.a_scale_mode == GemmScaleMode::kMxfp8 || nvfp4) {
    const int64_t scale_block = nvfp4 ? kNvfp4ScaleBlock : kMxfp8ScaleBlock;
    uint8_t* swizzled = static_cast<uint8_t*>(workspace) + kGemmWorkspaceBytes;
    struct Operand {
      const void* in;
      int64_t rows;
      GemmScaleMode mode;
      const void** dst;
    };
    const Operand operands[2] = {{args.a_scale_inv, args.m, args.a_scale_mode, &call.a_scale_inv},
                                 {args.b_scale_inv, args.n, args.b_scale_mode, &call.b_scale_inv}};
    for (const Operand& op : operands) {
      const GemmScaleShape d = GemmScaleDims(op.mode, op.rows, args.k);
      ScaleSwizzleArgs sw;
      sw.in = static_cast<const uint8_t*>(op.in);
      sw.out = swizzled;
      sw.rows = d.dim0;
      sw.cols = d.dim1;
      sw.valid_rows = op.rows;
      sw.valid_cols = (args.k + scale_block - 1) / scale_block;
      LOWBIT_RETURN_IF_ERROR(ScaleSwizzleCuda(sw, stream));
      *op.dst = swizzled;
      swizzled += GemmScaleBytesPadded(op.mode, op.rows, args.k);
    }
  }
  const float host_one = 1.0f, host_zero = 0.0f;
  const void* alpha = &host_one;
  const void* beta = args.accumulate ? &host_one : &host_zero;  // FP8 only (CheckGemmAccumulate)
  if (!fp8) {  // 16-bit: the scale_invs; NVFP4: the global scale_invs
    LOWBIT_RETURN_IF_ERROR(GemmAlphaBetaCuda(
        nvfp4 ? args.a_global_scale_inv : static_cast<const float*>(args.a_scale_inv),
        nvfp4 ? args.b_global_scale_inv : static_cast<const float*>(args.b_scale_inv), alpha_beta,
        stream));
    alpha = alpha_beta;
    beta = alpha_beta + 1;
  }
  {
    std::lock_guard<std::mutex> lock(device->mutex);
    Plan* plan = nullptr;
    LOWBIT_RETURN_IF_ERROR(device->GetPlan(key, call, &plan));
    LOWBIT_RETURN_IF_ERROR(SetPointers(plan->desc.get(), key, call));
    LOWBIT_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmul(device->handle.get(), plan->desc.get(), alpha, args.b, plan->layout_a.get(),
                       args.a, plan->layout_b.get(), beta, args.out, plan->layout_d.get(), args.out,
                       plan->layout_d.get(), &plan->algo, cublas_workspace, plan->workspace_bytes,
                       stream),
        "cublasLtMatmul", args));
  }
  if (args.bias != nullptr && !bias_epilogue) {
    LOWBIT_RETURN_IF_ERROR(GemmBiasAddF32Cuda(static_cast<float*>(args.out),
                                              static_cast<const float*>(args.bias), args.m,
                                              args.n, stream));
  }
  return Status::Ok();
}

}  // namespace lowbit
