// Activations with a fused FP8 quantization of the output (forward), and the fused
// dact + dbias + quantize of the gradient (backward), over a row-major 2-D view.
//
// Forward: x is rows x H (or rows x 2 x H when gated: the activation input x[r, 0, :] and
// the gate x[r, 1, :], TE's layout); y = act(x_a) (* gate(x_g)) in fp32 (formulas:
// activation_math.h; act_type values: ActType). Optional bias (forward and backward): H
// values (gated: 2H, [bias_a | bias_g]) in x's dtype, added to every row of x before the
// activation as one IEEE fp32 add of the widened values (x_a = float(x) + float(bias), no
// rounding back to x's dtype; denormals kept), so the result is the op's on that sum
// (bit for bit the op on x + bias for fp32 x). Outputs, each optional (null = skip):
//   y          rows x H, x's dtype (RNE from the fp32 y)
//   q_rowwise  rows x H, E4M3/E5M2 of y * scale (FloatToE4m3/E5m2: RNE, saturating, NaN kept)
//   q_colwise  H x rows, the same codes transposed
//   amax       max |y| of the fp32 y, fp32 bit patterns compared unsigned (NaN beats inf)
// Backward: dz is rows x H (x's dtype), x as in the forward; dx has x's layout, viewed as
// rows x C with C = H (plain) or 2H (gated: columns [0, H) d/dx_a, [H, 2H) d/dx_g).
// Outputs, each optional: dx (x's dtype), q_rowwise (rows x C), q_colwise (C x rows), amax
// of the fp32 dx, dbias (C values, x's dtype: column sums of the fp32 dx, summed in fp32
// and rounded once).
// Quantization takes the fp32 value (not the rounded y/dx). CPU and CUDA compute every
// element bit-identically (activation_math.h); dbias sums differ only in summation order:
// the reference adds rows in order, the kernel per 256-row tile (the gated backward: 128;
// 64- or 128-row tiles under LOWBIT_ACT_VARIANT 0-4 / 5 and 8, 256 under 6, 7 and 9:
// activation_tiled_kernel.cuh; fp32's chunk-row variants 7-9 sum in the order of their tile height's)
// then the tiles in order (deterministic run to run).
#pragma once

#include <cstdint>

#include "activation/activation_math.h"
#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"
#include "quantize/block_dbias.h"  // BlockDbiasWorkspaceBytes: the same workspace rows

namespace lowbit {

struct ActArgs {
  ActParams params;
  int64_t rows = 0, hidden = 0;
  DType dtype = DType::kInvalid;    // x, dz, y, dx, dbias: f32/f16/bf16
  DType q_dtype = DType::kInvalid;  // kE4M3 / kE5M2 when q_rowwise or q_colwise is set
  const void* dz = nullptr;         // backward only
  const void* x = nullptr;
  const void* bias = nullptr;       // optional: in_cols values (H, or 2H when gated), x's dtype
  const float* scale = nullptr;     // (1,); host for the reference, device for CUDA
  void* out = nullptr;              // y (forward) or dx (backward), optional
  uint8_t* q_rowwise = nullptr;
  uint8_t* q_colwise = nullptr;
  float* amax = nullptr;            // (1,), required
  void* dbias = nullptr;            // backward only, optional
};

// Columns of the output view: H, or 2H for the gated backward.
inline int64_t ActOutCols(const ActArgs& a, bool backward) {
  return backward && a.params.gated ? 2 * a.hidden : a.hidden;
}

// CPU references (activation_ref.cc).
Status ActForwardRef(const ActArgs& a);
Status ActBackwardRef(const ActArgs& a);

// CUDA tile: a block handles kActTileRows x kActTileCols (input columns) at a time (or
// 2 or 4 kActTileRows rows: activation_tiled_kernel.cuh, tall tiles).
constexpr int64_t kActTileRows = 64;
constexpr int64_t kActTileCols = 128;

// Device workspace ActBackwardCuda needs for dbias: one fp32 row of partial column sums
// per 64-row tile (enough for the taller tiles too).
inline int64_t ActBackwardWorkspaceBytes(int64_t rows, int64_t out_cols, bool dbias) {
  return BlockDbiasWorkspaceBytes(rows, out_cols, kActTileRows, dbias);
}

// CUDA launchers (activation.cu, kernels in activation_kernels.cuh): asynchronous on `stream`.
Status ActForwardCuda(const ActArgs& a, GpuStream stream);
Status ActBackwardCuda(const ActArgs& a, void* workspace, GpuStream stream);

}  // namespace lowbit
