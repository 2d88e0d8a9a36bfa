// Fused elementwise + block quantization: an activation's or a normalization's fp32 output
// block-quantized in the same pass, for the block-scaled recipes (FP8 block 1x128:
// Float8BlockScaling's activations; MXFP8), so that no high-precision copy is written and
// read back.
//
// Activation (lowbit_act_quantize_block): x is rows x H, or rows x 2 x H when gated (TE's
// layout, as activation.h); v = ActForwardValue(params, x_a, x_g) in fp32 (activation_math.h,
// NaN canonical).
// Normalization (lowbit_norm_quantize_block): x is rows x H with its row statistics given
// (mu for LayerNorm, rsigma: the norm forward's outputs, norm.h); v = CanonicalNan(
// NormOutput(NormXhat(x, mu, rsigma), NormWeight(gamma), beta)) in fp32 (norm_math.h: the
// norm forward's own elementwise formula; mu = 0 for RMSNorm; NaN canonical, so that its
// sign does not depend on the backend's NaN propagation).
// v (rows x H) is then quantized exactly as the block quantizers quantize an f32 tensor of
// that shape (quantize_block.h with tile_2d = false, or quantize_mxfp8.h): codes and scales
// are those of QuantizeFp8BlockRef / QuantizeMxfp8Ref applied to v, the fp32 result (not to
// v rounded to x's dtype, as the per-tensor fused kernels: DESIGN.md §4).
// Outputs (at least one copy): rowwise rows x H; colwise H x rows (FP8 block, transposed)
// or rows x H (MXFP8); scales in those headers' layouts. No high-precision output is
// written (act_forward / norm_forward give it; a norm caller that needs y takes it from the
// statistics launch).
// CUDA: block_tiles.cuh's tile kernels with an activation or norm source (fused_block_act.cu,
// fused_block_norm.cu); the reference computes v into a buffer and calls the quantizer
// references (fused_block_ref.cc).
#pragma once

#include <cstdint>

#include "activation/activation_math.h"
#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"
#include "norm/norm.h"
#include "quantize/quantize_block.h"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {

struct ActQuantizeBlockArgs {
  ActParams params;
  const void* x = nullptr;
  DType dtype = DType::kInvalid;  // x: f32, f16 or bf16
  int64_t rows = 0, hidden = 0;
  bool mxfp8 = false;             // MXFP8, else FP8 block 1x128
  // The outputs, v's rows x hidden view (x / x_dtype unused; rows, cols = rows, hidden):
  QuantizeFp8BlockArgs fp8;       // !mxfp8 (tile_2d false)
  QuantizeMxfp8Args mx;           // mxfp8
};

struct NormQuantizeBlockArgs {
  NormType norm_type = NormType::kLayerNorm;
  bool zero_centered_gamma = false;
  const void* x = nullptr;
  DType dtype = DType::kInvalid;        // x: f32, f16 or bf16
  DType gamma_dtype = DType::kInvalid;  // gamma (and beta): f32 or x's dtype
  const void* gamma = nullptr;          // H
  const void* beta = nullptr;           // H, LayerNorm only
  const float* mu = nullptr;            // rows, LayerNorm only
  const float* rsigma = nullptr;        // rows
  int64_t rows = 0, hidden = 0;
  bool mxfp8 = false;
  QuantizeFp8BlockArgs fp8;             // as in ActQuantizeBlockArgs
  QuantizeMxfp8Args mx;
};

// CPU references (fused_block_ref.cc) and CUDA launchers (fused_block_act.cu,
// fused_block_norm.cu: device pointers, asynchronous on `stream`).
Status ActQuantizeBlockRef(const ActQuantizeBlockArgs& a);
Status ActQuantizeBlockCuda(const ActQuantizeBlockArgs& a, GpuStream stream);
Status NormQuantizeBlockRef(const NormQuantizeBlockArgs& a);
Status NormQuantizeBlockCuda(const NormQuantizeBlockArgs& a, GpuStream stream);

}  // namespace lowbit
