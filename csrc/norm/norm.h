// Normalization (LayerNorm, RMSNorm) forward with an optional fused FP8 quantization, and
// backward, over a row-major (rows x hidden) view of x; hidden is x's last dimension.
//
// Forward, all math in fp32 (norm_math.h holds the elementwise formulas that the CPU
// reference and the CUDA kernels share):
//   LayerNorm: mu = mean(x), var = mean((x - mu)^2), rsigma = 1 / sqrt(var + eps),
//              y = (x - mu) * rsigma * w + beta
//   RMSNorm:   rsigma = 1 / sqrt(mean(x^2) + eps), y = x * rsigma * w
//   w = gamma, or 1 + gamma with zero_centered_gamma.
// Outputs (each optional: a null pointer skips it): y in x's dtype (RNE from the fp32
// y); q_rowwise = FloatToE4m3/E5m2(y * scale) (saturating, RNE, NaN kept) of the fp32 y,
// rows x hidden; q_colwise, the same bytes transposed (hidden x rows); amax = max |y|
// over the tensor, compared as fp32 bit patterns (NaN beats inf, as in amax.h).
// Backward: xhat = (x - mu) * rsigma, g = dz * w, dx = rsigma * (g - (xhat * mean(g *
// xhat) + mean(g))) (RMSNorm drops mean(g)), dgamma = sum over rows of dz * xhat, dbeta =
// sum over rows of dz.
//
// Reduction order: the CPU reference sums each row sequentially and dgamma/dbeta over
// rows in row order. The CUDA kernels reduce rows as a tree and dgamma/dbeta in two
// deterministic stages (per-block partials, then a fixed-order sum), so CUDA and CPU agree
// within rounding of those sums, and CUDA is run-to-run deterministic on one device.
// Supported: 1 <= hidden <= kNormMaxHidden (16384) on both backends, any row count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"
#include "norm/norm_plan.h"  // kNormMaxHidden, NormBackwardWorkspaceBytes

namespace lowbit {

enum class NormType : int32_t { kLayerNorm = 0, kRmsNorm = 1 };

struct NormForwardArgs {
  NormType norm_type = NormType::kLayerNorm;
  bool zero_centered_gamma = false;
  float epsilon = 1e-6f;
  int64_t rows = 0, hidden = 0;
  DType x_dtype = DType::kInvalid;      // f32/f16/bf16; y has the same dtype
  DType gamma_dtype = DType::kInvalid;  // f32 or x_dtype; beta has the same dtype
  DType q_dtype = DType::kInvalid;      // kE4M3/kE5M2 when q_rowwise or q_colwise is set
  const void* x = nullptr;
  const void* gamma = nullptr;
  const void* beta = nullptr;    // LayerNorm only
  const float* scale = nullptr;  // (1,), needed when q_rowwise or q_colwise is set
  void* y = nullptr;
  float* mu = nullptr;  // LayerNorm only
  float* rsigma = nullptr;
  void* q_rowwise = nullptr;
  void* q_colwise = nullptr;
  float* amax = nullptr;  // (1,)
};

struct NormBackwardArgs {
  NormType norm_type = NormType::kLayerNorm;
  bool zero_centered_gamma = false;
  int64_t rows = 0, hidden = 0;
  DType x_dtype = DType::kInvalid;      // dz, x and dx
  DType gamma_dtype = DType::kInvalid;  // gamma, dgamma and dbeta
  const void* dz = nullptr;
  const void* x = nullptr;
  const float* mu = nullptr;  // LayerNorm only
  const float* rsigma = nullptr;
  const void* gamma = nullptr;
  void* dx = nullptr;
  void* dgamma = nullptr;
  void* dbeta = nullptr;  // LayerNorm only
};

// Every entry point below first checks its arguments (norm_check.h): dtypes, 1 <= hidden
// <= kNormMaxHidden, the pointers that the norm type and the requested outputs need.

// CPU references (norm_ref.cc).
Status NormForwardRef(const NormForwardArgs& a);
Status NormBackwardRef(const NormBackwardArgs& a);

// CUDA launchers (norm_fwd.cu, norm_bwd.cu): asynchronous on `stream`. The backward pass
// needs NormBackwardWorkspaceBytes(x_dtype, rows, hidden) bytes (norm_plan.h: a function
// of the shape alone, mirrored in lowbit/ops/norm.py) of 4-byte aligned device scratch;
// the FFI handler gets it as an extra u8 result of the custom call.
Status NormForwardCuda(const NormForwardArgs& a, GpuStream stream);
Status NormBackwardCuda(const NormBackwardArgs& a, void* workspace, size_t workspace_bytes,
                        GpuStream stream);

}  // namespace lowbit
