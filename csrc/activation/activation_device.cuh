// The shared pieces of the CUDA activation kernels (activation_tiled_kernel.cuh), included
// through activation_kernels.cuh by one .cu per act type and private to it (an unnamed
// namespace): tile and launch constants, the launch bounds, ActKernelArgs (also filled by the
// launchers in activation_kernels.cuh) and the device helpers: AbsMaxNan, 16-byte loads and
// stores, LoadSharedFloat, DivMod32 and LoadPass (one pass's chunks of a thread).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "activation/activation.h"
#include "common/element.h"

namespace lowbit {
namespace {

constexpr int kThreads = 256;
constexpr int kTileCols = int(kActTileCols);
// Tile heights: 64 rows (kActTileRows: the dbias workspace's row granularity), 128 or 256
// (tall tiles, ActVariant: 128- / 256-byte colwise column segments, fewer barriers per
// element). 256 rows leave the gated backward's two code planes over the 48 KiB static
// shared memory, so it takes 128 there.
constexpr int kShortTileRows = int(kActTileRows);
constexpr int kTallTileRows = 2 * kShortTileRows;
constexpr int kTallerTileRows = 4 * kShortTileRows;
constexpr int kCodeStride = kTileCols + 4;  // bytes per shared row of codes (4-aligned)
// Launch bounds (minimum blocks per SM, so the register cap): sm_100a 3 (85 registers; its
// ptxas otherwise settles on 64 and spills in the forward kernels), 2 for its gated
// backward (85 spill in the bf16 clamped swiglu one). sm_90a 3 for the gated backward
// (with no minimum it takes 124 registers: 2 blocks), 4 (64) for the gated forward and the
// plain backward, 5 (48) for the plain forward; no spills. fp32 chunk rows (kChunkRows 2
// or 4: twice or four times the loaded registers) take one block less per step of
// kChunkRows on either architecture (fp32 kChunkRows 2: sm_90a 4 / 3 / 3 / 2), at least 2.
// With a bias (kMayBias) the sm_90a fp32 gated backward of 1 chunk row spills 8-12 bytes
// (gelu, silu, quick_gelu, clamped swiglu); its kernels without a bias do not.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define LOWBIT_ACT_MIN_BLOCKS(backward, gated) ((backward) && (gated) ? 2 : 3)
#else
#define LOWBIT_ACT_MIN_BLOCKS(backward, gated) ((backward) && (gated) ? 3 : (backward) || (gated) ? 4 : 5)
#endif
// The minimum for kChunkRows chunk rows: one block less for 2, two less for 4, at least 2.
constexpr int ActMinBlocks(int min_blocks, int chunk_rows) {
  const int n = min_blocks - (chunk_rows == 1 ? 0 : chunk_rows == 2 ? 1 : 2);
  return chunk_rows == 1 || n >= 2 ? n : 2;
}
#define LOWBIT_ACT_LAUNCH_BOUNDS(backward, gated, chunk_rows) \
  __launch_bounds__(kThreads, ActMinBlocks(LOWBIT_ACT_MIN_BLOCKS(backward, gated), chunk_rows))

template <typename T>
struct ActKernelArgs {
  ActParams act;
  int64_t rows, hidden, out_cols, in_cols;
  const T* x;
  const T* dz;
  const float* scale;
  T* out;
  uint8_t* q_rowwise;
  uint8_t* q_colwise;
  bool colwise_vec;  // q_colwise 8-byte aligned and rows % 8 == 0
  bool vector_io;    // 16-byte loads/stores (aligned, H % kVec == 0), else scalar
  bool e5m2;         // code format: E5M2, else E4M3
  bool prefetch_tiles;  // the last pass of a tile loads the next tile's first pass
  uint32_t* amax;
  float* partials;   // tile_rows x out_cols, or null
  void* dbias_out;   // dbias (T), written by the finalize kernel; null without dbias
};

// max(|a|, b), NaN if either is NaN (max.NaN, sm_80+): a chunk's amax and NaN test in one
// instruction per element.
__device__ __forceinline__ float AbsMaxNan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(fabsf(a)), "f"(b));
  return r;
#else
  return (a != a || b != b) ? BitsToFloat(0x7FC00000u) : fmaxf(fabsf(a), b);
#endif
}

template <typename T, int kVec>
__device__ __forceinline__ void LoadChunk(const T* src, bool valid, T (&dst)[kVec]) {
  uint4 packed = make_uint4(0, 0, 0, 0);
  if (valid) packed = __ldg(reinterpret_cast<const uint4*>(src));
  memcpy(dst, &packed, sizeof(packed));
}

// One 16-byte global store (st.global.v4.b32: weak, the default cache policy, STG.128) of
// 16-byte aligned dst. The fp32 kernels use it for y / dx: there a plain uint4 store was
// merged with the scalar path's element stores into four 4-byte stores (each warp-wide at
// a 16-byte stride), and __stwb compiles to STG.128.STRONG.SM.
__device__ __forceinline__ void StoreGlobal16(void* dst, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// One float of shared memory, read where it is used. volatile: not hoisted out of the pass
// loop and held in registers (the gated kernels' bias: hoisted, its 2 kVec values held
// through the loop made the sm_90a bf16/f16 gated backward spill). A volatile asm counts as
// a memory access, so it stays after the barrier that publishes the value.
__device__ __forceinline__ float LoadSharedFloat(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return v;
}

// q = a / b, r = a % b for b >= 1.
__device__ __forceinline__ void DivMod32(uint32_t a, uint32_t b, uint32_t* q, uint32_t* r) {
  *q = a / b, *r = a % b;
}

// Loads one pass's chunks of this thread: kChunkRows 16-byte chunks per input, rows
// first_row, first_row + kThreadRows, ... of the tile (kThreadRows = the rows of threads a
// pass spans per chunk row), at element offsets x_off (the gate half at x_off + hidden) and
// dz_off, + i * x_row_step / dz_row_step for chunk row i. Out of range -> 0 (the caller
// masks): rows from rows_limit on, and cols_left = columns from the chunk's first to the end.
template <typename Tag, bool kBackward, bool kGated, int kVec, int kChunkRows>
__device__ __forceinline__ void LoadPass(const ActKernelArgs<typename Tag::Storage>& p, int64_t x_off,
                                         int64_t dz_off, int64_t x_row_step, int64_t dz_row_step,
                                         int first_row, int rows_limit, int cols_left,
                                         typename Tag::Storage (&xa)[kVec * kChunkRows],
                                         typename Tag::Storage (&xg)[kVec * kChunkRows],
                                         typename Tag::Storage (&g)[kVec * kChunkRows]) {
  using T = typename Tag::Storage;
  constexpr int kThreadRows = kThreads * kVec / kTileCols;
#pragma unroll
  for (int i = 0; i < kChunkRows; ++i) {
    const bool row_ok = first_row + i * kThreadRows < rows_limit;
    const int64_t xo = x_off + i * x_row_step, dzo = dz_off + i * dz_row_step;
    // Chunk row i's elements in place (a 16-byte copy, as for one chunk: copied element by
    // element, bf16 chunks were kept as 16-bit values, more registers).
    T(&cxa)[kVec] = *reinterpret_cast<T(*)[kVec]>(&xa[i * kVec]);
    T(&cxg)[kVec] = *reinterpret_cast<T(*)[kVec]>(&xg[i * kVec]);
    T(&cg)[kVec] = *reinterpret_cast<T(*)[kVec]>(&g[i * kVec]);
    if (p.vector_io) {
      const bool ok = row_ok && cols_left > 0;
      LoadChunk<T, kVec>(p.x + xo, ok, cxa);
      if constexpr (kGated) LoadChunk<T, kVec>(p.x + xo + p.hidden, ok, cxg);
      if constexpr (kBackward) LoadChunk<T, kVec>(p.dz + dzo, ok, cg);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const bool ok = row_ok && j < cols_left;
        cxa[j] = ok ? p.x[xo + j] : T(0);
        if constexpr (kGated) cxg[j] = ok ? p.x[xo + p.hidden + j] : T(0);
        if constexpr (kBackward) cg[j] = ok ? p.dz[dzo + j] : T(0);
      }
    }
  }
}

}  // namespace
}  // namespace lowbit
