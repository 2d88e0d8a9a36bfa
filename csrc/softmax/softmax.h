// Fused scaled softmax over the last dim of (batch, heads, q, k) logits, TE semantics,
// forward and backward. Inputs f16/bf16 (f32 too); all math in fp32.
//
// Forward, per row (b, h, i) of k logits x_j:
//   scaled               z_j = scale * x_j
//   scaled_masked        z_j = -10000 where mask[mb, 0, i, j] == 1 (TE's value and test:
//                        any other mask byte keeps the logit), else scale * x_j; mb = b, or
//                        0 when the mask's batch is 1. A row whose max is exactly -10000
//                        (fully masked) gives zeros, as TE's kernel does.
//   scaled_upper_triang  causal: z_j = -inf where j > i (those outputs are exactly 0).
//   m = max_j z_j, e_j = exp(z_j - m) (LbExpNonPositive, common/fp32_math.h: within 1 ulp),
//   y_j = e_j * (1 / sum_j e_j) (one IEEE division per row, then a multiply per element:
//   within 1.5 ulp of e_j / sum in fp32, before the rounding to the output dtype).
// Backward (y = the forward output): dx_j = scale * (y_j dy_j - y_j * sum_k(y_k dy_k)).
// The CPU reference sums each row in order; the CUDA kernel as a tree, so the two agree
// within rounding of those sums (every other step is bit-identical).
// CUDA limits: 1 <= k <= kSoftmaxCudaMaxK; lowbit/ops/softmax.py falls back to jnp beyond.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

// Values of the fusion_type attribute (also lowbit/ops/softmax.py).
enum class SoftmaxType : int32_t { kScaled = 0, kScaledMasked = 1, kScaledUpperTriang = 2 };

constexpr int64_t kSoftmaxCudaMaxK = 16384;

struct SoftmaxArgs {
  SoftmaxType type = SoftmaxType::kScaled;
  float scale = 1.0f;
  int64_t batch = 0, heads = 0, q = 0, k = 0;
  int64_t mask_batch = 0;             // 1 or batch (scaled_masked)
  DType dtype = DType::kInvalid;      // x/y (forward); dy/y/dx (backward)
  const void* x = nullptr;            // forward
  const uint8_t* mask = nullptr;      // (mask_batch, 1, q, k) bytes, scaled_masked only
  const void* dy = nullptr;           // backward
  const void* y_in = nullptr;         // backward: the forward output
  void* out = nullptr;                // y (forward) or dx (backward)
};

// CPU references (softmax_ref.cc).
Status SoftmaxForwardRef(const SoftmaxArgs& a);
Status SoftmaxBackwardRef(const SoftmaxArgs& a);

// CUDA launchers (softmax.cu), asynchronous on `stream`.
Status SoftmaxForwardCuda(const SoftmaxArgs& a, GpuStream stream);
Status SoftmaxBackwardCuda(const SoftmaxArgs& a, GpuStream stream);

}  // namespace lowbit
