// Scale swizzle: the row-major block scales of MXFP8 (E8M0, one per 32 values along K) and
// NVFP4 (E4M3, one per 16) rearranged into the interleaved ("swizzled") order cuBLASLt's
// VEC32_UE8M0 / VEC16_UE4M3 scale modes read on Blackwell (cuBLAS docs, "1D block scaling
// factors layout").
//
// Input: a row-major R x C byte matrix, R % 128 == 0 and C % 4 == 0: the quantizers' scale
// arrays (quantize_mxfp8.h, quantize_nvfp4.h), entry [r][j] the scale of row r of the
// operand, K block j. Output: R * C bytes, the 128 x 4 tiles of the input one after the
// other (tile (rb, cb) = rows 128rb.., cols 4cb..; rb-major: tile index rb * (C/4) + cb),
// 512 bytes each, entry (r, c) of a tile at (r % 32) * 16 + (r / 32) * 4 + c. Entries of
// the input at r >= valid_rows or c >= valid_cols are written as 0x00 instead of copied
// (finite in both E8M0 (2^-127) and E4M3 (0), so padding K blocks of zero data add 0 even
// where the input's padding holds NaN codes). Pure byte moves: bit for bit on every backend.
#pragma once

#include <cstdint>
#include <string>

#include "common/formats.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

constexpr int64_t kSwizzleTileRows = 128;
constexpr int64_t kSwizzleTileCols = 4;
constexpr int64_t kSwizzleTileBytes = kSwizzleTileRows * kSwizzleTileCols;

// Offset in the swizzled output of input entry (r, c) of an R x C matrix with C columns.
LOWBIT_HD int64_t SwizzledScaleOffset(int64_t r, int64_t c, int64_t cols) {
  const int64_t tile = (r / kSwizzleTileRows) * (cols / kSwizzleTileCols) + c / kSwizzleTileCols;
  return tile * kSwizzleTileBytes + (r % 32) * 16 + ((r % kSwizzleTileRows) / 32) * 4 +
         c % kSwizzleTileCols;
}

struct ScaleSwizzleArgs {
  const uint8_t* in = nullptr;  // rows x cols, row-major
  uint8_t* out = nullptr;       // rows * cols, swizzled (must not alias `in`)
  int64_t rows = 0;             // multiple of 128
  int64_t cols = 0;             // multiple of 4
  int64_t valid_rows = 0;       // entries at r >= valid_rows are written as 0
  int64_t valid_cols = 0;       // entries at c >= valid_cols are written as 0
};

// The shape rules above; `op` names the caller in the message. Inline: the CUDA library
// (which does not link the CPU references) calls it too.
inline Status CheckScaleSwizzleArgs(const ScaleSwizzleArgs& args, const char* op) {
  const std::string prefix = std::string(op) + ": ";
  if (args.rows < 0 || args.rows % kSwizzleTileRows != 0 || args.cols < 0 ||
      args.cols % kSwizzleTileCols != 0) {
    return Status::InvalidArgument(prefix + "scale: expected a (multiple of 128) x (multiple of "
                                   "4) matrix, got " + std::to_string(args.rows) + " x " +
                                   std::to_string(args.cols));
  }
  if (args.valid_rows < 0 || args.valid_rows > args.rows || args.valid_cols < 0 ||
      args.valid_cols > args.cols) {
    return Status::InvalidArgument(prefix + "valid_rows / valid_cols: expected within 0.." +
                                   std::to_string(args.rows) + " / 0.." +
                                   std::to_string(args.cols) + ", got " +
                                   std::to_string(args.valid_rows) + " / " +
                                   std::to_string(args.valid_cols));
  }
  return Status::Ok();
}

// CPU reference (scale_swizzle_ref.cc), and its inverse (the round trip of the tests;
// zeroed entries come back as 0).
Status ScaleSwizzleRef(const ScaleSwizzleArgs& args);
Status ScaleUnswizzleRef(const uint8_t* swizzled, uint8_t* out, int64_t rows, int64_t cols);

// CUDA launcher (scale_swizzle.cu): enqueued on `stream`, no sync.
Status ScaleSwizzleCuda(const ScaleSwizzleArgs& args, GpuStream stream);

}  // namespace lowbit
