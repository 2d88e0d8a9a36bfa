// FP8 block scaling (Hopper's Float8BlockScaling): one fp32 scale per 1x128 tile (activations,
// gradients) or per 128x128 tile (weights), current scaling inside each tile.
//
// Data: x is rows x cols, row-major, f32/f16/bf16 (rows = prod(shape[:flatten_axis])).
// rowwise is rows x cols and colwise cols x rows (the transpose: both GEMM operands K-major,
// as Hopper's FP8 GEMMs need), E4M3 or E5M2 bytes. A tile of the stored matrix Q (rowwise:
// x; colwise: x^T) is 1x128 (128 consecutive values of one row of Q: of x's row for rowwise,
// of x's column for colwise) or 128x128. Tiles at the right/bottom edge are partial: they
// cover only the elements that exist (as if x were zero-padded); data is never padded.
// Numerics per tile (DESIGN.md §4, the current-scaling rule of scale.h: CurrentScale):
//   amax = max |x| over the tile (bit compare: NaN beats inf);
//   scale = fp8_max / amax (IEEE division), inf -> FLT_MAX; amax 0, inf or NaN -> 1;
//   pow2_scales: scale's mantissa bits cleared (rounded down to a power of two);
//   q = encode_rne(clip(x * scale)) exactly as the per-tensor path (fp8_codec.h EncodeScaled;
//   NaN stays NaN, inf saturates); scale_inv = 1 / scale (IEEE division).
// Scale layout (GEMM-ready: cuBLASLt's VEC128_32F / BLK128x128_32F scale modes on sm_90, the
// layout TransformerEngine's "GEMM_READY" Float8 block tensors feed them), for a stored
// matrix Q of R x C:
//   1x128:   scale_inv is ceil(C/128) x roundup(R, 4) fp32, row-major; entry [j][r] is the
//            scale_inv of Q[r, 128j : 128j+128] (M-major: the tile row r is contiguous).
//   128x128: scale_inv is ceil(R/128) x roundup(ceil(C/128), 4), row-major; entry [i][j] of
//            tile (i, j).
//   The padding entries (the roundup to 4 fp32 = 16 bytes of every scale row) are 0.0f.
// For 128x128 the colwise data and scales are exactly the transposes of the rowwise ones.
// dbias (optional): the column sums of x (cols values, f32 or x's dtype), summed in fp32 in
// the order of block_dbias.h (tile height kFp8BlockDbiasTileRows) in the same pass.
// dequantize: out = round(decode(q) * scale_inv[tile of q]) to out's dtype, NaN results as
// MulNanDefined.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/formats.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

constexpr int64_t kFp8BlockLen = 128;

LOWBIT_HD int64_t CeilDivI64(int64_t a, int64_t b) { return (a + b - 1) / b; }
LOWBIT_HD int64_t RoundUpI64(int64_t a, int64_t b) { return CeilDivI64(a, b) * b; }

// Shape of the scale_inv matrix of a stored rows x cols FP8-block matrix (see above).
struct ScaleDims {
  int64_t dim0 = 0;
  int64_t dim1 = 0;
  LOWBIT_HD int64_t size() const { return dim0 * dim1; }
};

LOWBIT_HD ScaleDims Fp8BlockScaleDims(int64_t rows, int64_t cols, bool tile_2d) {
  if (tile_2d) return {CeilDivI64(rows, kFp8BlockLen), RoundUpI64(CeilDivI64(cols, kFp8BlockLen), 4)};
  return {CeilDivI64(cols, kFp8BlockLen), RoundUpI64(rows, 4)};
}

// Offset in scale_inv of the tile holding element (r, c) of a stored rows x cols matrix.
LOWBIT_HD int64_t Fp8BlockScaleOffset(int64_t r, int64_t c, int64_t rows, int64_t cols, bool tile_2d) {
  const ScaleDims d = Fp8BlockScaleDims(rows, cols, tile_2d);
  if (tile_2d) return (r / kFp8BlockLen) * d.dim1 + c / kFp8BlockLen;
  return (c / kFp8BlockLen) * d.dim1 + r;
}

struct QuantizeFp8BlockArgs {
  const void* x = nullptr;
  DType x_dtype = DType::kInvalid;    // f32, f16 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  DType out_dtype = DType::kInvalid;  // kE4M3 or kE5M2, for rowwise and colwise
  bool tile_2d = false;               // 128x128 tiles, else 1x128
  bool pow2_scales = false;
  uint8_t* rowwise = nullptr;            // rows x cols, or null when not requested
  float* rowwise_scale_inv = nullptr;    // Fp8BlockScaleDims(rows, cols), with rowwise
  uint8_t* colwise = nullptr;            // cols x rows, or null when not requested
  float* colwise_scale_inv = nullptr;    // Fp8BlockScaleDims(cols, rows), with colwise
  void* dbias = nullptr;                 // cols values, or null when not requested
  DType dbias_dtype = DType::kInvalid;   // f32 or x_dtype
};

// CPU reference (quantize_block_ref.cc).
Status QuantizeFp8BlockRef(const QuantizeFp8BlockArgs& args);
// data: rows x cols as stored (a rowwise copy, or a colwise copy with rows/cols swapped).
Status DequantizeFp8BlockRef(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols,
                             bool tile_2d, const float* scale_inv, void* out, DType out_dtype);

// CUDA launchers (quantize_block.cu): device pointers, enqueued on `stream`, no host sync.
// `workspace`: BlockDbiasWorkspaceBytes(rows, cols, kFp8BlockDbiasTileRows, dbias) bytes
// (may be null when that is 0).
Status QuantizeFp8BlockCuda(const QuantizeFp8BlockArgs& args, void* workspace, GpuStream stream);
Status DequantizeFp8BlockCuda(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols,
                              bool tile_2d, const float* scale_inv, void* out, DType out_dtype,
                              GpuStream stream);

}  // namespace lowbit
