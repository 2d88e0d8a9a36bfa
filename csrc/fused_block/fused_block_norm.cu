// CUDA fused normalization + block quantization (fused_block.h): block_tiles.cuh's FP8 block
// (1x128) and MXFP8 tile kernels with a source that normalizes in its chunk load, before the
// tile's amaxes and encodes, so x is read once and only the codes and scales are written.
// NormSource: a chunk of x, the row's mu / rsigma, the chunk's gamma / beta -> norm_math.h's
// NormOutput(NormXhat(...)), NaN canonical. LayerNorm / RMSNorm, zero-centered gamma and
// gamma's dtype (f32 or x's) are uniform runtime values; gamma / beta are the same for every
// pass of a thread's column chunk: read once per tile (Src::Cols, LoadCols). The activation
// twin is fused_block_act.cu (apart, so that the build compiles the two in parallel).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/element.h"
#include "fused_block/fused_block.h"
#include "norm/norm_math.h"
#include "quantize/block_tiles.cuh"
#include "quantize/fp8_cvt.cuh"

namespace lowbit {
namespace {

constexpr const char* kNormOp = "lowbit_norm_quantize_block";

// The normalization of x (rows x H) from its row statistics, as a tile source.
template <typename Tag>
struct NormSource {
  using T = typename Tag::Storage;
  static constexpr int kVec = 16 / int(sizeof(T));
  static constexpr int kMinBlocks = 2, kMinBlocks2d = 2, kMinBlocksMxfp8 = 3;  // as fused_block_act.cu's ActSource
  struct Chunk {
    float v[kVec];
  };
  // The weight and beta of my kVec columns, read once per tile: read per element and per row
  // (predicated on the row, so not shared between a thread's rows), they were 2 kVec loads
  // per chunk, more instructions than the rest of the kernel.
  struct Cols {
    float w[kVec], b[kVec];
  };
  const T* x;
  const void* gamma;
  const void* beta;    // null for RMSNorm
  const float* mu;     // null for RMSNorm
  const float* rsigma;
  bool gamma_f32;      // gamma / beta f32, else x's dtype
  bool zero_centered;

  bool VectorOk(int64_t cols) const { return block_tiles::Aligned(x, 16) && cols % kVec == 0; }

  __device__ __forceinline__ float Param(const void* p, int64_t c) const {
    return gamma_f32 ? __ldg(static_cast<const float*>(p) + c) : LoadAsFloatFast(Tag{}, __ldg(static_cast<const T*>(p) + c));
  }

  __device__ __forceinline__ void LoadCols(int64_t c, int64_t cols, Cols& out) const {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const bool in = c + j < cols;
      out.w[j] = in ? NormWeight(Param(gamma, c + j), zero_centered) : 0.0f;
      out.b[j] = in && beta != nullptr ? Param(beta, c + j) : 0.0f;
    }
  }

  template <bool kVectorIO>
  __device__ __forceinline__ void Load(int64_t r, int64_t c, int64_t rows, int64_t cols, const Cols& col_state,
                                       Chunk& out) const {
    T xv[kVec];
    if constexpr (kVectorIO) {
      uint4 packed = make_uint4(0, 0, 0, 0);
      if (r < rows && c < cols) packed = __ldg(reinterpret_cast<const uint4*>(x + r * cols + c));
      memcpy(xv, &packed, sizeof(packed));
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) xv[j] = (r < rows && c + j < cols) ? x[r * cols + c + j] : T(0);
    }
    const bool row_in = r < rows;
    const float m = row_in && mu != nullptr ? __ldg(mu + r) : 0.0f;
    const float rs = row_in ? __ldg(rsigma + r) : 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const bool in = row_in && c + j < cols;
      const float y = NormOutput(NormXhat(LoadAsFloatFast(Tag{}, xv[j]), m, rs), col_state.w[j], col_state.b[j],
                                 beta != nullptr);
      out.v[j] = in ? CanonicalNan(y) : 0.0f;
    }
  }
  __device__ __forceinline__ static float Value(const Chunk& chunk, int j) { return chunk.v[j]; }
};

}  // namespace

Status NormQuantizeBlockCuda(const NormQuantizeBlockArgs& a, GpuStream stream) {
  if (!a.mxfp8 && a.fp8.tile_2d) return Status::InvalidArgument(std::string(kNormOp) + ": tile_2d: only 1x128 tiles");
  const bool ln = a.norm_type == NormType::kLayerNorm;
  return DispatchHighPrecision(a.dtype, kNormOp, "x", [&](auto tag) {
    if (a.rows == 0 || a.hidden == 0) return Status::Ok();
    return DispatchFp8(a.mxfp8 ? a.mx.out_dtype : a.fp8.out_dtype, kNormOp, "out", [&](auto fmt) {
      using Tag = decltype(tag);
      using Fmt = decltype(fmt);
      const NormSource<Tag> src{static_cast<const typename Tag::Storage*>(a.x), a.gamma, ln ? a.beta : nullptr,
                                ln ? a.mu : nullptr, a.rsigma, a.gamma_dtype == DType::kF32, a.zero_centered_gamma};
      const bool vec = src.VectorOk(a.hidden);
      if (a.mxfp8) return block_tiles::LaunchMxfp8Tiles<decltype(src), Fmt>(src, vec, a.mx, kNormOp, stream);
      return block_tiles::LaunchFp8BlockTiles<decltype(src), Fmt, false>(src, vec, a.fp8, kNormOp, stream);
    });
  });
}

}  // namespace lowbit
