// MXFP8 quantization (OCP microscaling): one E8M0 scale byte per 32 consecutive values,
// along the rows of x (rowwise copy) or down its columns (colwise copy).
//
// Data: x is rows x cols, row-major, f32/f16/bf16 (rows = prod(shape[:flatten_axis])).
// rowwise and colwise are both rows x cols (x's layout: Blackwell's MXFP8 GEMMs read either
// major-ness, so nothing is transposed), E4M3 or E5M2 bytes, each quantized from x itself.
// Blocks: rowwise x[r, 32j : 32j+32]; colwise x[32i : 32i+32, c]. Blocks at the edge are
// partial (only existing elements; as if x were zero-padded); data is never padded.
// Numerics per block (DESIGN.md §4):
//   amax = max |x| over the block (bit compare: NaN beats inf);
//   s = amax / fp8_max (IEEE division); e = E8m0FromScaleRoundUp(s) (formats.h: the fp32
//   biased exponent of s, plus one when its mantissa is non-zero; NaN -> 0xFF; capped at
//   0xFE, so an inf amax gives 2^127);
//   q = encode_rne(clip(x * 2^(127 - e))) (== x / 2^(e-127): the factor is an exact power
//   of two), NaN stays NaN; a block with e = 0xFF (a NaN in it) encodes every value as NaN
//   (x * NaN, NaN as MulNanDefined).
// Scale layout: plain row-major bytes, padded to the 128 x 4 tiles that cuBLASLt's
// VEC32_UE8M0 interleaved ("swizzled") layout is built from, as TransformerEngine stores
// them before its swizzle (the swizzle itself belongs to the GEMM):
//   rowwise: roundup(rows, 128) x roundup(ceil(cols/32), 4), entry [r][j];
//   colwise: roundup(ceil(rows/32), 4) x roundup(cols, 128), entry [i][c].
//   Padding entries are 0x00.
// dbias (optional): the column sums of x (cols values, f32 or x's dtype), summed in fp32 in
// the order of block_dbias.h (tile height kMxfp8DbiasTileRows) in the same pass.
// dequantize: out = round(decode(q) * 2^(e - 127)) to out's dtype (E8m0ToFloat; 0xFF ->
// NaN), NaN results as MulNanDefined.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/formats.h"
#include "common/gpu_stream.h"
#include "common/status.h"
#include "quantize/quantize_block.h"

namespace lowbit {

constexpr int64_t kMxfp8BlockLen = 32;

LOWBIT_HD ScaleDims Mxfp8ScaleDims(int64_t rows, int64_t cols, bool colwise) {
  if (!colwise) return {RoundUpI64(rows, 128), RoundUpI64(CeilDivI64(cols, kMxfp8BlockLen), 4)};
  return {RoundUpI64(CeilDivI64(rows, kMxfp8BlockLen), 4), RoundUpI64(cols, 128)};
}

// Offset in the scale matrix of the block holding element (r, c).
LOWBIT_HD int64_t Mxfp8ScaleOffset(int64_t r, int64_t c, int64_t rows, int64_t cols, bool colwise) {
  const ScaleDims d = Mxfp8ScaleDims(rows, cols, colwise);
  if (!colwise) return r * d.dim1 + c / kMxfp8BlockLen;
  return (r / kMxfp8BlockLen) * d.dim1 + c;
}

struct QuantizeMxfp8Args {
  const void* x = nullptr;
  DType x_dtype = DType::kInvalid;    // f32, f16 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  DType out_dtype = DType::kInvalid;  // kE4M3 or kE5M2, for rowwise and colwise
  uint8_t* rowwise = nullptr;         // rows x cols, or null when not requested
  uint8_t* rowwise_scale = nullptr;   // Mxfp8ScaleDims(rows, cols, false) E8M0 bytes
  uint8_t* colwise = nullptr;         // rows x cols, or null when not requested
  uint8_t* colwise_scale = nullptr;   // Mxfp8ScaleDims(rows, cols, true) E8M0 bytes
  void* dbias = nullptr;              // cols values, or null when not requested
  DType dbias_dtype = DType::kInvalid;  // f32 or x_dtype
};

// CPU reference (quantize_mxfp8_ref.cc).
Status QuantizeMxfp8Ref(const QuantizeMxfp8Args& args);
// data: rows x cols; colwise: the scales run down the columns (a colwise copy).
Status DequantizeMxfp8Ref(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols,
                          bool colwise, const uint8_t* scale, void* out, DType out_dtype);

// CUDA launchers (quantize_mxfp8.cu). `workspace`: BlockDbiasWorkspaceBytes(rows, cols,
// kMxfp8DbiasTileRows, dbias) bytes (may be null when that is 0).
Status QuantizeMxfp8Cuda(const QuantizeMxfp8Args& args, void* workspace, GpuStream stream);
Status DequantizeMxfp8Cuda(const uint8_t* data, DType data_dtype, int64_t rows, int64_t cols,
                           bool colwise, const uint8_t* scale, void* out, DType out_dtype,
                           GpuStream stream);

}  // namespace lowbit
