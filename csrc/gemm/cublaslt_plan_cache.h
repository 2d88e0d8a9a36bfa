// cuBLASLt plans for cublaslt_gemm_cuda.cc (handles, plans and locking: its preamble): the
// plan key and its hash, the plan (descriptor, layouts, algorithm) and BuildPlan, and the
// process-wide CublasLtCache of per-device handles and plans. Helpers: cublaslt_helpers.h.
// Private to that one translation unit (an anonymous namespace, as when it lived there).
#pragma once

#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/cuda_check.h"
#include "gemm/cublaslt_helpers.h"
#include "gemm/gemm.h"

namespace lowbit {
namespace {

// ---------------------------------------------------------------- plans

struct PlanKey {
  int device;
  int64_t m, n, k;
  DType a_type, b_type, out_type;
  bool bias_epilogue, fast_accum;
  uint32_t align_a, align_b, align_out, align_bias;
  GemmScaleMode a_scale_mode, b_scale_mode;
  int32_t algo;
  bool algo_or_first;
  int64_t lda, ldb, ldd;  // leading dimensions in elements (GemmArgs' with 0 resolved)
  int32_t batch;
  int64_t batch_stride_a, batch_stride_b, batch_stride_d;

  bool operator==(const PlanKey& o) const {
    return device == o.device && m == o.m && n == o.n && k == o.k && a_type == o.a_type &&
           b_type == o.b_type && out_type == o.out_type && bias_epilogue == o.bias_epilogue &&
           fast_accum == o.fast_accum && align_a == o.align_a && align_b == o.align_b &&
           align_out == o.align_out && align_bias == o.align_bias &&
           a_scale_mode == o.a_scale_mode && b_scale_mode == o.b_scale_mode && algo == o.algo &&
           algo_or_first == o.algo_or_first && lda == o.lda && ldb == o.ldb && ldd == o.ldd && batch == o.batch &&
           batch_stride_a == o.batch_stride_a && batch_stride_b == o.batch_stride_b &&
           batch_stride_d == o.batch_stride_d;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(uint64_t(key.device));
    mix(uint64_t(key.m));
    mix(uint64_t(key.n));
    mix(uint64_t(key.k));
    mix(uint64_t(key.a_type) | uint64_t(key.b_type) << 8 | uint64_t(key.out_type) << 16 |
        uint64_t(key.bias_epilogue) << 24 | uint64_t(key.fast_accum) << 25);
    mix(uint64_t(key.align_a) | uint64_t(key.align_b) << 16 | uint64_t(key.align_out) << 32 |
        uint64_t(key.align_bias) << 48);
    mix(uint64_t(key.a_scale_mode) | uint64_t(key.b_scale_mode) << 8 | uint64_t(key.algo) << 16 |
        uint64_t(key.algo_or_first) << 48);
    mix(uint64_t(key.lda));
    mix(uint64_t(key.ldb));
    mix(uint64_t(key.ldd));
    mix(uint64_t(key.batch));
    mix(uint64_t(key.batch_stride_a));
    mix(uint64_t(key.batch_stride_b));
    mix(uint64_t(key.batch_stride_d));
    return size_t(h);
  }
};

struct Plan {
  UniqueDesc desc;
  UniqueLayout layout_a, layout_b, layout_d;  // cuBLASLt's A (our b), B (our a), C = D (out)
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_bytes = 0;
};

// The data pointers a plan's descriptor holds; written before every cublasLtMatmul.
Status SetPointers(cublasLtMatmulDesc_t desc, const PlanKey& key, const GemmArgs& args) {
  if (IsFp8(key.a_type) || key.a_type == DType::kE2M1) {
    const void* scale_a = args.b_scale_inv;  // cuBLASLt's A is our b
    const void* scale_b = args.a_scale_inv;
    LOWBIT_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a,
                                       sizeof(scale_a)),
        "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)", args));
    LOWBIT_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b,
                                       sizeof(scale_b)),
        "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)", args));
  }
  if (key.bias_epilogue) {
    const void* bias = args.bias;
    LOWBIT_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
        "cublasLtMatmulDescSetAttribute(BIAS_POINTER)", args));
  }
  return Status::Ok();
}

template <typename T>
Status SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value,
               const char* what, const GemmArgs& args) {
  return CublasStatus(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), what, args);
}

#if LOWBIT_HAS_CUBLASLT_BLOCK_SCALING
cublasLtMatmulMatrixScale_t CublasScaleMode(GemmScaleMode mode) {
  return mode == GemmScaleMode::kBlock128x128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                              : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
}
#endif

// cuBLASLt's A/B_SCALE_MODE of the block modes (cuBLASLt's A is our b: its mode is b's).
Status SetBlockScaleModes(cublasLtMatmulDesc_t desc, const PlanKey& key, const GemmArgs& args) {
  if (key.a_scale_mode == GemmScaleMode::kMxfp8 || key.a_scale_mode == GemmScaleMode::kNvfp4) {
#if LOWBIT_HAS_CUBLASLT_MX_SCALING
    const int32_t mode = int32_t(key.a_scale_mode == GemmScaleMode::kMxfp8
                                     ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0
                                     : CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3);
    LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode,
                                   "cublasLtMatmulDescSetAttribute(A_SCALE_MODE)", args));
    return SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode,
                   "cublasLtMatmulDescSetAttribute(B_SCALE_MODE)", args);
#else
    return Status::Unimplemented("lowbit_gemm: built against cuBLAS " +
                                 std::to_string(CUBLAS_VERSION) +
                                 ", which has no MXFP8 / NVFP4 scale modes (12.8+ has)");
#endif
  }
#if LOWBIT_HAS_CUBLASLT_BLOCK_SCALING
  LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                 int32_t(CublasScaleMode(key.b_scale_mode)),
                                 "cublasLtMatmulDescSetAttribute(A_SCALE_MODE)", args));
  return SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, int32_t(CublasScaleMode(key.a_scale_mode)),
                 "cublasLtMatmulDescSetAttribute(B_SCALE_MODE)", args);
#else
  return Status::Unimplemented("lowbit_gemm: built against cuBLAS " + std::to_string(CUBLAS_VERSION) +
                               ", which has no block scale modes (12.9+ has)");
#endif
}

Status MakeLayout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, const char* what,
                  const GemmArgs& args, UniqueLayout* out, int32_t batch = 1, int64_t batch_stride = 0) {
  cublasLtMatrixLayout_t layout = nullptr;
  LOWBIT_RETURN_IF_ERROR(CublasStatus(
      cublasLtMatrixLayoutCreate(&layout, type, uint64_t(rows), uint64_t(cols), ld), what, args));
  out->reset(layout);
  if (batch > 1) {
    LOWBIT_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)), what, args));
    LOWBIT_RETURN_IF_ERROR(CublasStatus(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                                         &batch_stride, sizeof(batch_stride)),
                                        what, args));
  }
  return Status::Ok();
}

Status BuildPlan(cublasLtHandle_t handle, const PlanKey& key, const GemmArgs& args, Plan* plan) {
  cublasLtMatmulDesc_t raw_desc = nullptr;
  LOWBIT_RETURN_IF_ERROR(CublasStatus(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                                      "cublasLtMatmulDescCreate", args));
  plan->desc.reset(raw_desc);
  cublasLtMatmulDesc_t desc = plan->desc.get();
  LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSA, int32_t(CUBLAS_OP_T),
                                 "cublasLtMatmulDescSetAttribute(TRANSA)", args));
  LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSB, int32_t(CUBLAS_OP_N),
                                 "cublasLtMatmulDescSetAttribute(TRANSB)", args));
  if (IsFp8(key.a_type)) {
    LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t(key.fast_accum),
                                   "cublasLtMatmulDescSetAttribute(FAST_ACCUM)", args));
  }
  if (IsBlockScaleMode(key.a_scale_mode)) {
    LOWBIT_RETURN_IF_ERROR(SetBlockScaleModes(desc, key, args));
  }
  if (!IsFp8(key.a_type)) {  // 16-bit and NVFP4: alpha (and beta) from the device
    LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                                   int32_t(CUBLASLT_POINTER_MODE_DEVICE),
                                   "cublasLtMatmulDescSetAttribute(POINTER_MODE)", args));
  }
  if (key.bias_epilogue) {
    LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, uint32_t(CUBLASLT_EPILOGUE_BIAS),
                                   "cublasLtMatmulDescSetAttribute(EPILOGUE)", args));
    LOWBIT_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                   int32_t(CudaType(key.out_type)),
                                   "cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)", args));
  }
  LOWBIT_RETURN_IF_ERROR(SetPointers(desc, key, args));

  LOWBIT_RETURN_IF_ERROR(MakeLayout(CudaType(key.b_type), key.k, key.n, key.ldb,
                                    "cublasLtMatrixLayoutCreate(b)", args, &plan->layout_a, key.batch,
                                    key.batch_stride_b));
  LOWBIT_RETURN_IF_ERROR(MakeLayout(CudaType(key.a_type), key.k, key.m, key.lda,
                                    "cublasLtMatrixLayoutCreate(a)", args, &plan->layout_b, key.batch,
                                    key.batch_stride_a));
  LOWBIT_RETURN_IF_ERROR(MakeLayout(CudaType(key.out_type), key.n, key.m, key.ldd,
                                    "cublasLtMatrixLayoutCreate(out)", args, &plan->layout_d, key.batch,
                                    key.batch_stride_d));

  cublasLtMatmulPreference_t raw_pref = nullptr;
  LOWBIT_RETURN_IF_ERROR(CublasStatus(cublasLtMatmulPreferenceCreate(&raw_pref),
                                      "cublasLtMatmulPreferenceCreate", args));
  UniquePreference pref(raw_pref);
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value, const char* what) {
    return CublasStatus(cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &value, sizeof(value)),
                        what, args);
  };
  LOWBIT_RETURN_IF_ERROR(set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                  uint64_t(kGemmCublasWorkspaceBytes), "preference MAX_WORKSPACE_BYTES"));
  LOWBIT_RETURN_IF_ERROR(set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b,
                                  "preference MIN_ALIGNMENT_A_BYTES"));
  LOWBIT_RETURN_IF_ERROR(set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a,
                                  "preference MIN_ALIGNMENT_B_BYTES"));
  LOWBIT_RETURN_IF_ERROR(set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_out,
                                  "preference MIN_ALIGNMENT_C_BYTES"));
  LOWBIT_RETURN_IF_ERROR(set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_out,
                                  "preference MIN_ALIGNMENT_D_BYTES"));

  // The first key.algo + 1 heuristic results, best first; entry key.algo is the plan's.
  cublasLtMatmulHeuristicResult_t results[kGemmMaxAlgo] = {};
  int found = 0;
  LOWBIT_RETURN_IF_ERROR(CublasStatus(
      cublasLtMatmulAlgoGetHeuristic(handle, desc, plan->layout_a.get(), plan->layout_b.get(),
                                     plan->layout_d.get(), plan->layout_d.get(), pref.get(),
                                     key.algo + 1, results, &found),
      "cublasLtMatmulAlgoGetHeuristic", args));
  int32_t usable = 0;
  while (usable < found && results[usable].state == CUBLAS_STATUS_SUCCESS) ++usable;
  if (usable == 0) {
    return Status::Unimplemented("lowbit_gemm: cuBLASLt has no algorithm for " + Problem(args) +
                                 (key.fast_accum ? " with fast accumulation" : ""));
  }
  const int32_t index = PickHeuristicIndex(usable, key.algo, key.algo_or_first);
  if (index < 0) {
    return Status::InvalidArgument(
        "lowbit_gemm: algo: cuBLASLt returned only " + std::to_string(usable) +
        " heuristic algorithms for " + Problem(args) + ", so index " + std::to_string(key.algo) +
        " (LOWBIT_GEMM_ALGO) does not exist; use 0.." + std::to_string(usable - 1));
  }
  plan->algo = results[index].algo;
  plan->workspace_bytes = results[index].workspaceSize;
  return Status::Ok();
}

// ---------------------------------------------------------------- the process-wide cache

struct DeviceState {
  std::mutex mutex;  // guards everything below and every use of `handle`
  UniqueHandle handle;
  int capability = 0;  // compute capability, major * 10 + minor
  std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> plans;

  // The plan for `key`, built on first use; call with `mutex` held.
  Status GetPlan(const PlanKey& key, const GemmArgs& args, Plan** out) {
    auto it = plans.find(key);
    if (it == plans.end()) {
      auto plan = std::make_unique<Plan>();
      LOWBIT_RETURN_IF_ERROR(BuildPlan(handle.get(), key, args, plan.get()));
      it = plans.emplace(key, std::move(plan)).first;
    }
    *out = it->second.get();
    return Status::Ok();
  }
};

class CublasLtCache {
 public:
  static CublasLtCache& Get() {
    static CublasLtCache* cache = new CublasLtCache();  // never destroyed: see the preamble
    return *cache;
  }

  // The state of `device`, with its handle created on first use. The pointer stays valid.
  Status Device(int device, const GemmArgs& args, DeviceState** out) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = devices_.find(device);
    if (it == devices_.end()) {
      auto state = std::make_unique<DeviceState>();
      int major = 0, minor = 0;
      LOWBIT_RETURN_IF_ERROR(CudaStatus(
          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "lowbit_gemm",
          "cudaDeviceGetAttribute(compute capability)"));
      LOWBIT_RETURN_IF_ERROR(CudaStatus(
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "lowbit_gemm",
          "cudaDeviceGetAttribute(compute capability)"));
      state->capability = major * 10 + minor;
      ScopedDevice scoped(device);
      cublasLtHandle_t raw = nullptr;
      LOWBIT_RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&raw), "cublasLtCreate", args));
      state->handle.reset(raw);
      it = devices_.emplace(device, std::move(state)).first;
    }
    *out = it->second.get();
    return Status::Ok();
  }

 private:
  std::mutex mutex_;  // guards devices_
  std::unordered_map<int, std::unique_ptr<DeviceState>> devices_;
};

}  // namespace
}  // namespace lowbit
