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
// Blackwell hardware yet: tests/test_gemm_block.py compares it with the CPU emulation there.
//
// NVFP4 (gemm.h's kNvfp4, lowbit_gemm_nvfp4 only): A/B types CUDA_R_4F_E2M1 (packed, leading
// dimension K in elements), VEC16_UE4M3 scale mode on both, the e4m3 scale arrays swizzled
// into the workspace as for MXFP8, and the two fp32 global scale_invs folded into alpha:
// alpha = fl(a_gsi * b_gsi) computed on the device (GemmAlphaBetaCuda) and passed with
// POINTER_MODE_DEVICE, as for the 16-bit GEMMs. Compute capability 10.x only; M and N
// multiples of 16, K of 64 (whole 128 x 4 scale tiles; lowbit/ops/gemm.py pads), no bias.
// Same caveat: compile-checked only.
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
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      switched_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  ~ScopedDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

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
  // FP8 block scaling on Hopper: lowbit's own wgmma kernel where LOWBIT_BLOCK_GEMM asks for it.
  if (block && BlockGemmSm90Requested() && BlockGemmSm90Applies(args, device->capability)) {
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
  const void* beta = &host_zero;
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
