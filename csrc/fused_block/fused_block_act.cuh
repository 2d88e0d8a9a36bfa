// The fused activation + block quantization kernels (fused_block_act.cu's preamble) and
// fused_act_cuda::LaunchActTiles, defined per gating in its own translation unit
// (fused_block_act.cu: plain, fused_block_act_gated.cu: gated) so that the build compiles the
// two in parallel.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "common/element.h"
#include "fused_block/fused_block.h"
#include "quantize/block_tiles.cuh"
#include "quantize/fp8_cvt.cuh"

namespace lowbit {
namespace fused_act_cuda {

// Launches a's tile kernels (MXFP8 or FP8 1x128) for every dtype and code format, gated or
// not; a is checked but for its dtypes. Defined in fused_block_act.cu / _gated.cu.
template <bool kGated>
Status LaunchActTiles(const ActQuantizeBlockArgs& a, GpuStream stream);
template <>
Status LaunchActTiles<false>(const ActQuantizeBlockArgs& a, GpuStream stream);
template <>
Status LaunchActTiles<true>(const ActQuantizeBlockArgs& a, GpuStream stream);

}  // namespace fused_act_cuda

namespace {

constexpr const char* kOp = "lowbit_act_quantize_block";

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

template <typename Tag, typename Fmt, bool kGated>
Status Launch(const ActQuantizeBlockArgs& a, GpuStream stream) {
  const ActSource<Tag, kGated> src{static_cast<const typename Tag::Storage*>(a.x), a.params};
  const bool vec = src.VectorOk(a.hidden);
  if (a.mxfp8) return block_tiles::LaunchMxfp8Tiles<decltype(src), Fmt>(src, vec, a.mx, kOp, stream);
  return block_tiles::LaunchFp8BlockTiles<decltype(src), Fmt, false>(src, vec, a.fp8, kOp, stream);
}

template <bool kGated>
Status LaunchActTilesImpl(const ActQuantizeBlockArgs& a, GpuStream stream) {
  return DispatchHighPrecision(a.dtype, kOp, "x", [&](auto tag) {
    if (a.rows == 0 || a.hidden == 0) return Status::Ok();  // every output is empty
    return DispatchFp8(a.mxfp8 ? a.mx.out_dtype : a.fp8.out_dtype, kOp, "out", [&](auto fmt) {
      return Launch<decltype(tag), decltype(fmt), kGated>(a, stream);
    });
  });
}

}  // namespace
}  // namespace lowbit
