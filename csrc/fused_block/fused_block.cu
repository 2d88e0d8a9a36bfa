// CUDA fused activation / normalization + block quantization (fused_block.h):
// block_tiles.cuh's FP8 block (1x128) and MXFP8 tile kernels with a source that computes the
// fp32 values in its chunk load, before the tile's amaxes and encodes, so x is read once and
// only the codes and scales are written:
//   ActSource: a chunk of the activation input (and, gated, the same chunk of the gate half)
//     -> activation_math.h's ActForwardValue (the reference's function). Template constants:
//     dtype, code format, gated, vector / scalar path; the act type is a uniform runtime
//     value (ActValueAndDerivative selects on it branch-free).
//   NormSource: a chunk of x, the row's mu / rsigma, the chunk's gamma / beta -> norm_math.h's
//     NormOutput(NormXhat(...)), NaN canonical. LayerNorm / RMSNorm, zero-centered gamma and
//     gamma's dtype (f32 or x's) are uniform runtime values; gamma / beta are the same for
//     every pass of a thread's column chunk: read once per tile (Src::Cols, LoadCols).
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

constexpr const char* kOp = "lowbit_act_quantize_block";
constexpr const char* kNormOp = "lowbit_norm_quantize_block";

// The activation of x (rows x H, or rows x 2 x H gated) as a tile source (block_tiles.cuh).
// Out-of-range elements load as 0, whose activation is +0 for every act type (and gate).
template <typename Tag, bool kGated>
struct ActSource {
  using T = typename Tag::Storage;
  static constexpr int kVec = 16 / int(sizeof(T));
  // Fp8BlockTileKernel needs 120-128 registers (it spills at 80); the MXFP8 kernel fits 80
  // with at most 8 bytes of spills, so 3 blocks (24 warps) an SM hide the activation's
  // latency better than 2 (ncu on the H100: 48% of issue slots busy at 16 warps).
  static constexpr int kMinBlocks = 2, kMinBlocks2d = 2, kMinBlocksMxfp8 = 3;  // (no 128x128 here)
  struct Chunk {
    float v[kVec];
  };
  struct Cols {};
  const T* x;
  ActParams params;

  // Whole 16-byte chunks of both halves: x aligned and H % kVec == 0.
  bool VectorOk(int64_t cols) const { return block_tiles::Aligned(x, 16) && cols % kVec == 0; }

  __device__ __forceinline__ void LoadCols(int64_t, int64_t, Cols&) const {}
  template <bool kVectorIO>
  __device__ __forceinline__ void Load(int64_t r, int64_t c, int64_t rows, int64_t cols, const Cols&,
                                       Chunk& out) const {
    T a[kVec], g[kVec];
    const int64_t in_cols = kGated ? 2 * cols : cols;
    if constexpr (kVectorIO) {
      uint4 pa = make_uint4(0, 0, 0, 0), pg = make_uint4(0, 0, 0, 0);
      if (r < rows && c < cols) {
        pa = __ldg(reinterpret_cast<const uint4*>(x + r * in_cols + c));
        if constexpr (kGated) pg = __ldg(reinterpret_cast<const uint4*>(x + r * in_cols + cols + c));
      }
      memcpy(a, &pa, sizeof(pa));
      memcpy(g, &pg, sizeof(pg));
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const bool in = r < rows && c + j < cols;
        a[j] = in ? x[r * in_cols + c + j] : T(0);
        g[j] = kGated && in ? x[r * in_cols + cols + c + j] : T(0);
      }
    }
    ActParams p = params;
    p.gated = kGated;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = ActForwardValue(p, LoadAsFloatFast(Tag{}, a[j]), LoadAsFloatFast(Tag{}, g[j]));
  }
  __device__ __forceinline__ static float Value(const Chunk& chunk, int j) { return chunk.v[j]; }
};

// The normalization of x (rows x H) from its row statistics, as a tile source.
template <typename Tag>
struct NormSource {
  using T = typename Tag::Storage;
  static constexpr int kVec = 16 / int(sizeof(T));
  static constexpr int kMinBlocks = 2, kMinBlocks2d = 2, kMinBlocksMxfp8 = 3;  // as ActSource's
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

template <typename Tag, typename Fmt, bool kGated>
Status Launch(const ActQuantizeBlockArgs& a, GpuStream stream) {
  const ActSource<Tag, kGated> src{static_cast<const typename Tag::Storage*>(a.x), a.params};
  const bool vec = src.VectorOk(a.hidden);
  if (a.mxfp8) return block_tiles::LaunchMxfp8Tiles<decltype(src), Fmt>(src, vec, a.mx, kOp, stream);
  return block_tiles::LaunchFp8BlockTiles<decltype(src), Fmt, false>(src, vec, a.fp8, kOp, stream);
}

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

Status ActQuantizeBlockCuda(const ActQuantizeBlockArgs& a, GpuStream stream) {
  if (!a.mxfp8 && a.fp8.tile_2d) return Status::InvalidArgument(std::string(kOp) + ": tile_2d: only 1x128 tiles");
  return DispatchHighPrecision(a.dtype, kOp, "x", [&](auto tag) {
    if (a.rows == 0 || a.hidden == 0) return Status::Ok();  // every output is empty
    return DispatchFp8(a.mxfp8 ? a.mx.out_dtype : a.fp8.out_dtype, kOp, "out", [&](auto fmt) {
      using Tag = decltype(tag);
      using Fmt = decltype(fmt);
      return a.params.gated ? Launch<Tag, Fmt, true>(a, stream) : Launch<Tag, Fmt, false>(a, stream);
    });
  });
}

}  // namespace lowbit
