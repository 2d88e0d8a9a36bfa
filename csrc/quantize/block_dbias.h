// dbias (the column sums of x) of the block quantizers (FP8 block 1x128 / 128x128, MXFP8),
// computed in the tile kernels' pass over x (block_tiles.cuh), and the one summation order
// that the CUDA kernels and the CPU reference share, so that they agree bit for bit.
//
// Summation order. x is rows x cols, v[r][c] = float(x[r][c]) (rows past the end count as
// +0.0); H = the kernel's tile height (kFp8BlockDbiasTileRows = 128 for FP8 block, both tile
// shapes; kMxfp8DbiasTileRows = 64 for MXFP8); S = 32 / sizeof(x element) lanes (16 for
// f16/bf16, 8 for f32: the rows one pass of a 256-thread tile covers); every sum below
// starts at +0.0f and adds its terms one at a time in the order given (fp32, IEEE RNE):
//   lane sum   l[t][g][c] = v[tH + g][c] + v[tH + S + g][c] + ... + v[tH + H - S + g][c]
//   tile sum   p[t][c]    = l[t][0][c] + l[t][1][c] + ... + l[t][S-1][c]   (workspace row t)
//   finalize   the per-tensor FP8 path's DbiasFinalizeKernel (dbias_finalize.cuh), for
//              T = ceil(rows / H) workspace rows: w[y][c] = p[y][c] + p[y+8][c] + ... (t < T),
//              dbias[c] = w[0][c] + w[1][c] + ... + w[7][c], a NaN result made the canonical
//              quiet NaN 0x7FC00000 (the CPU's and the GPU's NaN payloads differ), then
//              rounded once to dbias's dtype (f32 or x's).
// Deterministic: the same bits on every run and on both backends. It differs from a plain
// row-order sum (jnp.sum) only by fp32 summation order.
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"
#include "common/formats.h"
#include "common/status.h"

namespace lowbit {

constexpr int64_t kFp8BlockDbiasTileRows = 128;
constexpr int64_t kMxfp8DbiasTileRows = 64;
constexpr int kDbiasFinalizeRows = 8;  // w[y]: the finalize's interleaved row sums

// The canonical quiet NaN for a NaN sum; any other value unchanged.
LOWBIT_HD float DbiasCanonical(float v) { return IsNanBits(FloatBits(v)) ? BitsToFloat(0x7FC00000u) : v; }

// Workspace rows x cols of fp32 tile sums, in bytes (0 when no dbias is computed).
inline int64_t BlockDbiasWorkspaceBytes(int64_t rows, int64_t cols, int64_t tile_rows, bool dbias) {
  if (!dbias || rows == 0 || cols == 0) return 0;
  return (rows + tile_rows - 1) / tile_rows * cols * int64_t(sizeof(float));
}

// "<op>: dbias: expected f32 or <x's dtype>" unless dbias_dtype is one of them. Inline: the
// CPU references and the CUDA launchers (a library without the references; through
// dbias_finalize.cuh's PrepareDbias) all call it, the per-tensor FP8 quantizer's too.
inline Status CheckBlockDbiasDType(const char* op, DType x_dtype, DType dbias_dtype) {
  if (dbias_dtype == DType::kF32 || dbias_dtype == x_dtype) return Status::Ok();
  return Status::InvalidArgument(std::string(op) + ": dbias: expected f32 or " + DTypeName(x_dtype) +
                                 ", got " + DTypeName(dbias_dtype));
}

// CPU reference of the order above (block_dbias_ref.cc): x rows x cols (f32/f16/bf16),
// dbias cols values of dbias_dtype.
Status BlockDbiasRef(const char* op, const void* x, DType x_dtype, int64_t rows, int64_t cols,
                     int64_t tile_rows, void* dbias, DType dbias_dtype);

}  // namespace lowbit
