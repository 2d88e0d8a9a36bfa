// Host helpers of the cuBLASLt GEMM (cublaslt_gemm_cuda.cc): the cuBLAS version and compute
// capability gates, the cuBLAS status -> Status conversion, DType -> cudaDataType_t, pointer
// alignment, RAII owners of cuBLASLt's handles and descriptors, and ScopedDevice. Plans and
// their cache: cublaslt_plan_cache.h. Private to that one translation unit (an anonymous
// namespace, as when this code lived there).
#pragma once

#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "gemm/gemm.h"

namespace lowbit {
namespace {

// FP8 tensor-core GEMMs exist from compute capability 8.9 (Ada) and 9.0 (Hopper); cuBLASLt
// documents FP8 matmul for sm_89+ (cublasLtMatmul, "FP8" data type table, CUDA 12.0+).
constexpr int kMinFp8ComputeCapability = 89;
// cuBLASLt's VEC128_32F / BLK128x128_32F scale modes: cuBLAS 12.9 (headers and library), on
// Hopper only (compute capability 9.0; Blackwell takes MX formats instead).
constexpr int kBlockScaleCublasVersion = 120900;
constexpr int kBlockScaleComputeCapability = 90;
// MXFP8: one scale per 32 values along K; cuBLASLt is given K in whole 128-blocks (whole
// 4-column groups of the scale tiles), which lowbit/ops/gemm.py pads to.
constexpr int64_t kMxfp8ScaleBlock = 32;
constexpr int64_t kMxfp8KMultiple = 128;
// NVFP4: one scale per 16 values; K in whole 64-blocks (whole 4-column scale tile groups).
constexpr int64_t kNvfp4ScaleBlock = 16;
constexpr int64_t kNvfp4KMultiple = 64;
#if CUBLAS_VERSION >= 120900
#define LOWBIT_HAS_CUBLASLT_BLOCK_SCALING 1
#else
#define LOWBIT_HAS_CUBLASLT_BLOCK_SCALING 0
#endif
// cuBLASLt's VEC32_UE8M0 (MXFP8) scale mode: cuBLAS 12.8, on compute capability 10.x.
constexpr int kMxScaleCublasVersion = 120800;
constexpr int kMxScaleComputeCapabilityMajor = 10;
#if CUBLAS_VERSION >= 120800
#define LOWBIT_HAS_CUBLASLT_MX_SCALING 1
#else
#define LOWBIT_HAS_CUBLASLT_MX_SCALING 0
#endif

std::string Problem(const GemmArgs& args) {
  return "M=" + std::to_string(args.m) + " N=" + std::to_string(args.n) + " K=" +
         std::to_string(args.k) + " (a " + DTypeName(args.a_type) + ", b " +
         DTypeName(args.b_type) + ", out " + DTypeName(args.out_type) + ")";
}

Status CublasStatus(cublasStatus_t status, const char* what, const GemmArgs& args) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  const StatusCode code = status == CUBLAS_STATUS_NOT_SUPPORTED ? StatusCode::kUnimplemented
                                                                : StatusCode::kInternal;
  std::string msg = std::string("lowbit_gemm: ") + what + " failed: " +
                    cublasLtGetStatusName(status) + " for " + Problem(args);
  return code == StatusCode::kUnimplemented ? Status::Unimplemented(msg) : Status::Internal(msg);
}

cudaDataType_t CudaType(DType t) {
  switch (t) {
    case DType::kE4M3: return CUDA_R_8F_E4M3;
    case DType::kE5M2: return CUDA_R_8F_E5M2;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
#if LOWBIT_HAS_CUBLASLT_MX_SCALING
    case DType::kE2M1: return CUDA_R_4F_E2M1;
#endif
    default: return CUDA_R_32F;
  }
}

// Largest power of two (at most 256) dividing the address: what the heuristic must assume.
uint32_t Alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// ---------------------------------------------------------------- RAII descriptors

struct HandleDeleter {
  void operator()(cublasLtHandle_t h) const { cublasLtDestroy(h); }
};
struct DescDeleter {
  void operator()(cublasLtMatmulDesc_t d) const { cublasLtMatmulDescDestroy(d); }
};
struct LayoutDeleter {
  void operator()(cublasLtMatrixLayout_t l) const { cublasLtMatrixLayoutDestroy(l); }
};
struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreference_t p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using UniqueHandle = std::unique_ptr<std::remove_pointer_t<cublasLtHandle_t>, HandleDeleter>;
using UniqueDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>, DescDeleter>;
using UniqueLayout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>, LayoutDeleter>;
using UniquePreference =
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, PreferenceDeleter>;

// Makes `device` current for its lifetime (cuBLASLt handles belong to the current device).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    // A failed call's error is cleared: it is not the next launch's (cuda_check.h).
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
    } else if (previous_ != device) {
      switched_ = cudaSetDevice(device) == cudaSuccess;
      if (!switched_) (void)cudaGetLastError();
    }
  }
  ~ScopedDevice() {
    if (switched_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

}  // namespace
}  // namespace lowbit
