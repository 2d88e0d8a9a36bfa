// FP8 per-tensor quantization (delayed or current scaling): one pass over a
// high-precision tensor that writes any of a rowwise FP8 copy, a transposed (colwise)
// FP8 copy, the tensor's amax and the column sums (dbias), and the inverse op.
//
// Data: x is rows x cols, row-major, f32/f16/bf16. rowwise is rows x cols and colwise
// cols x rows (the transpose), both E4M3 or E5M2 bytes; dbias has `cols` values, f32 or
// x's dtype. `scale` and `scale_inv` point at one f32 (host memory for the references,
// device memory for the CUDA launchers).
// Numerics (DESIGN.md §4), identical in the reference and the kernels:
//   q = encode_rne(clip(float(x) * scale, -max, +max)), one fp32 multiply, encoded by
//   FloatToE4m3 / FloatToE5m2 (which saturate, so clip is implied; NaN stays NaN, its
//   sign defined by MulNanDefined in fp8_codec.h, not by the platform's multiply);
//   amax = max |x| chosen by comparing fp32 bit patterns as unsigned (NaN beats inf,
//   empty -> 0), as lowbit_amax does; dbias = column sums accumulated in fp32, rounded
//   once to its dtype (the reference sums rows in order; the kernel sums groups of 16
//   rows (32 for f32 x) in order, then a tile's groups, then the tiles: deterministic for
//   a given tile variant, equal to the reference within fp32 rounding; a NaN sum comes out as
//   the canonical NaN, dbias_finalize.cuh); dequantize: out = round(decode(q) * scale_inv) to out's dtype, a NaN
//   result being the canonical quiet NaN with the sign MulNanDefined gives it.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/gpu_stream.h"
#include "common/status.h"

namespace lowbit {

// Where the CUDA tiled kernel writes the two copies instead of the dense layouts above
// (lowbit_dense_backward_fp8 places them inside its outputs, dense_backward.h): rowwise row r
// at rowwise + (r % row_segment_rows) * row_pitch + (r / row_segment_rows) * row_segment_stride,
// colwise row c (x's column c) at slice_base[c / slice_rows] + (c % slice_rows) *
// slice_pitch[c / slice_rows]. slice_rows is a multiple of kQuantizeTileCols and rows, cols
// < 2^31 (32-bit index arithmetic); 16-byte aligned bases and pitches keep the wide stores.
constexpr int kFp8PlacementMaxSlices = 16;
struct Fp8CopyPlacement {
  int64_t row_pitch = 0;
  int64_t row_segment_rows = 0;
  int64_t row_segment_stride = 0;
  int64_t slice_rows = 0;
  uint8_t* slice_base[kFp8PlacementMaxSlices] = {};
  int64_t slice_pitch[kFp8PlacementMaxSlices] = {};
};

struct QuantizeFp8Args {
  const void* x = nullptr;
  DType x_dtype = DType::kInvalid;  // f32, f16 or bf16
  int64_t rows = 0;
  int64_t cols = 0;
  const float* scale = nullptr;     // one value
  DType out_dtype = DType::kInvalid;  // kE4M3 or kE5M2, for rowwise and colwise
  uint8_t* rowwise = nullptr;       // rows x cols, or null when not requested
  uint8_t* colwise = nullptr;       // cols x rows, or null when not requested
  float* amax = nullptr;            // one value, always written
  void* dbias = nullptr;            // cols values, or null when not requested
  DType dbias_dtype = DType::kInvalid;  // f32 or x_dtype
  // CUDA only, with rowwise and colwise both requested: their placement (null: dense). The
  // colwise pointer is then unused (any non-null value).
  const Fp8CopyPlacement* placement = nullptr;
};

// CPU reference (quantize_ref.cc).
Status QuantizeFp8Ref(const QuantizeFp8Args& args);
Status DequantizeFp8Ref(const uint8_t* data, DType data_dtype, int64_t n, const float* scale_inv,
                        void* out, DType out_dtype);

// CUDA tile geometry, shared with the workspace size below: a block quantizes tiles of
// 64 or 128 rows (kQuantizeTileRows is the smaller, which sizes the workspace) x
// kQuantizeTileCols columns.
constexpr int64_t kQuantizeTileRows = 64;
constexpr int64_t kQuantizeTileCols = 128;

// Tuning knob for benchmarks, read by the CUDA launcher on every call that takes the
// tiled kernel (anything with colwise or dbias): which tile variant to run. Unset or
// empty: the default, "r256s2" (the fastest on an H100, bench/results/quantize_variants_*:
// 256-byte colwise segments; 2-3% faster than r128s2; an L2 prefetch of the tiles beyond
// the staged one, tried as a knob, was 5-20% slower and is gone). Values: r64s2 | r64s3 | r128s2 | r256s2 (tile rows 64, 128
// or 256 with 4 * rows threads per block; 2 or 3 input stages in flight), optionally followed by
// b<N> (N = 1..4096): tiles in bands of N tile rows, column-major inside a band, instead
// of row-major. Any other value is an InvalidArgument error. f32 x always uses r64s2
// (the band applies); where a variant's shared memory exceeds the device's per-block limit,
// 256 rows run as r128s2 (or r64s2 below that) and the others as r64s2. Every variant gives the same rowwise, colwise and amax bits; dbias
// differs only by fp32 summation order (the tile height changes it).
constexpr const char* kQuantizeTileVariantEnv = "LOWBIT_QUANTIZE_TILE_VARIANT";

// Tuning knob for benchmarks, read by the CUDA launcher on every rowwise-only call without
// dbias: "chunks2" (unset or empty: the default; the flat kernel, two consecutive 16-byte
// chunks of x per thread step, one 16-byte store of codes for 16-bit x), "chunks1" (one
// chunk per step) or "tiled" (the tiled kernel, without its colwise copy). H100, 16384 x
// 8192 bf16, kernel time: 141.8 / 145.4 / 151.4 us. Same bits in every case; any other
// value is an InvalidArgument error.
constexpr const char* kQuantizeRowwiseKernelEnv = "LOWBIT_QUANTIZE_ROWWISE_KERNEL";

// Device workspace QuantizeFp8Cuda needs: per-tile-row column partial sums for dbias.
inline int64_t QuantizeFp8WorkspaceBytes(int64_t rows, int64_t cols, bool dbias) {
  if (!dbias || rows == 0 || cols == 0) return 0;
  return (rows + kQuantizeTileRows - 1) / kQuantizeTileRows * cols * int64_t(sizeof(float));
}

// CUDA launchers (quantize_fp8.cu): enqueue on `stream`, no host sync. `workspace`
// holds QuantizeFp8WorkspaceBytes(...) bytes (may be null when that is 0).
Status QuantizeFp8Cuda(const QuantizeFp8Args& args, void* workspace, GpuStream stream);
Status DequantizeFp8Cuda(const uint8_t* data, DType data_dtype, int64_t n, const float* scale_inv,
                         void* out, DType out_dtype, GpuStream stream);

}  // namespace lowbit
