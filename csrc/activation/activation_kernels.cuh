// The CUDA activation kernels and their launchers, forward (act + quantize + transpose +
// amax) and backward (dact + dbias + quantize + transpose + amax), one pass over the data.
// Layouts and numerics: activation.h; formulas: activation_math.h (shared with the CPU
// reference, bit-identical). Included by one small .cu per act type (activation_<type>.cu,
// LOWBIT_DEFINE_ACT_TYPE_LAUNCH), so that nvcc compiles the types' kernels in parallel
// instead of in one translation unit (the longest of the build); activation.cu dispatches.
//
// ActTiledKernel, one per (dtype, direction, gated, act type): the act type and gating are
// template constants, so the per-element math has no branches and the compiler interleaves
// a chunk's 8 elements. Blocks loop over 256-row (the gated backward: 128-row; or, with
// LOWBIT_ACT_VARIANT 0-4 / 5, 64- / 128-row) x 128-column tiles of the H input columns.
// Each thread walks its 16-byte chunks of the tile (x, the gate half, dz) pass by pass, the
// next pass's loads issued before this pass's math (the last pass's: the next tile's first
// pass); fp32 input may take 2 or 4 chunks of a column range per pass (kChunkRows,
// LOWBIT_ACT_VARIANT 7-9), so a pass has bf16's 8 elements (or 16) instead of 4. It
// computes 1 or 2 output "planes"
// per element (2 for the gated backward: d x_a goes to columns [0, H), d x_g to [H, 2H)).
// Per plane it stores the high-precision output and the rowwise codes (hardware
// conversions: half_cvt.cuh, quantize/fp8_cvt.cuh), keeps the codes in shared memory for
// the transposed store (4 x 4 byte transposes, 8-byte column pieces), and writes per-tile
// column sums for dbias to a workspace row per tile row; DbiasFinalizeKernel then adds
// those rows in a fixed order.
// bias (optional): per tile, its column tile's values (both halves when gated) go to a
// shared fp32 row (double-buffered by tile: one barrier per tile), and each pass
// reads its chunk's columns there and adds them to the widened x (rows past the end keep
// their 0: no bias, so they still map to 0); no extra pass over global memory.
// NaN: values are computed without the reference's CanonicalNan; a chunk's max.NaN of |v|
// (its amax, one instruction per element) flags the rare chunk holding a NaN, which is
// then canonicalized and takes the codecs, so every output has the reference's bits.
// amax: block max of |v| bit patterns, one unsigned atomicMax (order independent).
// Unaligned data or H % (16 / sizeof(T)) != 0 take the bounds-checked scalar path.
// LOWBIT_ACT_VARIANT (benchmark tuning knob, see ActVariant): grid size, cross-tile
// prefetch, tile height and fp32 chunk rows; identical results but for dbias's summation
// order (per tile height; the chunk rows keep it).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "activation/activation.h"
#include "activation/activation_launch.h"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "activation/half_cvt.cuh"
#include "quantize/fp8_codec.h"
#include "quantize/fp8_cvt.cuh"

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

// One kernel per (dtype, forward/backward, gated, act type, tile height, chunk rows): the
// code format and the vector/scalar IO are uniform runtime branches, and the passes of a
// tile are a rolled loop (next pass's loads issued before this pass's math; with
// p.prefetch_tiles the last pass loads the next tile's first pass, so the loads stay in
// flight through the dbias and transpose phase), so each kernel inlines the activation
// math kElems times, not kElems * passes * formats * IO variants (compile time). Each pass
// advances 64-bit element offsets by one step (no per-pass index products).
// kChunkRows (fp32 only, ActVariant 7-9; else 1): a thread's pass takes that many 16-byte
// chunks of one column range, in rows kThreadRows apart, so a pass computes kElems =
// kChunkRows * kVec elements (fp32: 8 or 16 instead of 4, as bf16's 8) and keeps twice or
// four times the bytes in flight; the rows a thread visits, and their order, are those of
// kChunkRows = 1 (so dbias has the same bits), only fewer passes per tile.
// bias: in_cols values (activation.h: ActArgs::bias), or null; a kernel argument of its own
// (in ActKernelArgs, the kernels without a bias spilled: the gated backward at its sm_90a
// register cap). kMayBias false compiles the bias out (bias ignored): the gated backward has
// a kernel without it, the code before the bias, and one with it.
template <typename Tag, bool kBackward, bool kGated, ActType kType, int kTileRows, int kChunkRows, bool kMayBias>
__global__ void LOWBIT_ACT_LAUNCH_BOUNDS(kBackward, kGated, kChunkRows) ActTiledKernel(ActKernelArgs<typename Tag::Storage> p,
                                                                                 const typename Tag::Storage* bias) {
  using T = typename Tag::Storage;
  ActParams act = p.act;  // type and gating as compile-time constants: the math folds
  act.type = kType;
  act.gated = kGated;
  constexpr int kPlanes = kBackward && kGated ? 2 : 1;
  constexpr int kVec = 16 / int(sizeof(T));
  constexpr int kElems = kVec * kChunkRows;  // elements per thread and pass
  constexpr int kThreadsPerRow = kTileCols / kVec;
  constexpr int kThreadRows = kThreads / kThreadsPerRow;  // rows of threads
  constexpr int kRowsPerPass = kThreadRows * kChunkRows;
  constexpr int kPasses = kTileRows / kRowsPerPass;
  static_assert(kPasses * kRowsPerPass == kTileRows, "whole passes per tile");
  // dbias: 64-row tiles keep one shared row of column sums per thread row (the summation
  // order of the first kernels); tall tiles first add a warp's chunk rows by shuffles
  // (bf16/f16: lanes l and l ^ 16), one shared row per warp, so the gated backward's shared
  // memory stays under the 48 KiB static limit. Each order is fixed: same bits every run.
  constexpr bool kFoldWarpRows = kTileRows != kShortTileRows;
  constexpr int kRowsPerWarp = 32 / kThreadsPerRow;
  static_assert(kRowsPerWarp == 1 || kRowsPerWarp == 2, "the dbias warp fold");
  constexpr int kPartialRows = !kBackward ? 1 : kFoldWarpRows ? kThreads / 32 : kThreadRows;
  __shared__ __align__(16) uint8_t codes[kPlanes][kTileRows][kCodeStride];
  __shared__ float col_partial[kPlanes][kPartialRows][kTileCols];
  constexpr int kInPlanes = kGated ? 2 : 1;  // x's halves: the bias's rows
  static_assert(kInPlanes * kTileCols <= kThreads, "one bias value per thread");
  __shared__ __align__(16) float bias_tile[2][kInPlanes][kTileCols];  // every other tile

  const bool quantize = p.q_rowwise != nullptr || p.q_colwise != nullptr;
  const float scale = quantize ? __ldg(p.scale) : 1.0f;
  const bool scale_ok = ScaleKeepsFinite(scale);
  const bool dbias = kBackward && p.partials != nullptr;
  const bool has_bias = kMayBias && bias != nullptr;
  int parity = 0;  // bias_tile's buffer of this tile
  const uint32_t tiles_c = uint32_t((p.hidden + kTileCols - 1) / kTileCols);  // < 2^30: Launch
  const uint32_t tile_rows = uint32_t((p.rows + kTileRows - 1) / kTileRows);
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  const int64_t x_step = int64_t(kRowsPerPass) * p.in_cols;
  const int64_t dz_step = int64_t(kRowsPerPass) * p.hidden;
  const int64_t out_step = int64_t(kRowsPerPass) * p.out_cols;
  // Chunk row i of a pass: + i * these (unused when kChunkRows == 1).
  const int64_t x_row_step = int64_t(kThreadRows) * p.in_cols;
  const int64_t dz_row_step = int64_t(kThreadRows) * p.hidden;
  const int64_t out_row_step = int64_t(kThreadRows) * p.out_cols;
  uint32_t best = 0;

  // Tile t = tile_row * tiles_c + tile_col, t = blockIdx.x, blockIdx.x + gridDim.x, ...,
  // stepped without a division in the loop; 32-bit counters (registers).
  uint32_t tile_row, tile_col, step_rows, step_cols;
  DivMod32(blockIdx.x, tiles_c, &tile_row, &tile_col);
  DivMod32(gridDim.x, tiles_c, &step_rows, &step_cols);
  // Where this thread's chunk of a tile's first pass lies, and how much of it is in range.
  auto tile_start = [&](uint32_t tr, uint32_t tc, int64_t* x_off, int64_t* dz_off, int* rows_in_tile,
                        int* cols_left) {
    const int64_t r0 = int64_t(tr) * kTileRows, c = int64_t(tc) * kTileCols + chunk_col;
    const int64_t r = r0 + chunk_row;
    *x_off = r * p.in_cols + c;
    *dz_off = r * p.hidden + c;
    *rows_in_tile = int(min(p.rows - r0, int64_t(kTileRows)));
    *cols_left = int(max(min(p.hidden - c, int64_t(kVec)), int64_t(0)));
  };
  T xa[kElems], xg[kElems], g[kElems];  // the current pass's chunks
  bool loaded = false;                  // xa/xg/g already hold this tile's first pass (prefetched)
  for (; tile_row < tile_rows;) {
    int64_t x_off, dz_off;
    int rows_in_tile, cols_left;
    tile_start(tile_row, tile_col, &x_off, &dz_off, &rows_in_tile, &cols_left);
    if (!loaded) {
      LoadPass<Tag, kBackward, kGated, kVec, kChunkRows>(p, x_off, dz_off, x_row_step, dz_row_step, chunk_row,
                                                         rows_in_tile, cols_left, xa, xg, g);
    }
    const int64_t r0 = int64_t(tile_row) * kTileRows;
    const int64_t c0 = int64_t(tile_col) * kTileCols;
    if (has_bias) {
      // This tile's bias columns (0 past the end). The other buffer may still be read by
      // the previous tile's last passes; this one was last read two tiles ago, before the
      // previous tile's barrier.
      parity ^= 1;
      if (threadIdx.x < kInPlanes * kTileCols) {
        const int k = int(threadIdx.x) / kTileCols, col = int(threadIdx.x) % kTileCols;
        bias_tile[parity][k][col] =
            c0 + col < p.hidden ? LoadElement(Tag{}, __ldg(bias + k * p.hidden + c0 + col)) : 0.0f;
      }
      __syncthreads();
    }
    int64_t out_off = (r0 + chunk_row) * p.out_cols + c0 + chunk_col;  // plane 0, pass 0
    uint32_t next_row = tile_row + step_rows, next_col = tile_col + step_cols;
    if (next_col >= tiles_c) next_col -= tiles_c, ++next_row;
    loaded = false;

    float col_sum[kPlanes][kVec];
#pragma unroll
    for (int k = 0; k < kPlanes; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) col_sum[k][j] = 0.0f;
    }
    // 1-2. Per pass: the next loads first, then compute and store each plane of this one;
    // keep codes and column sums.
#pragma unroll 1
    for (int s = 0; s < kPasses; ++s) {
      const int local_row = s * kRowsPerPass + chunk_row;  // chunk row 0's
      bool row_ok[kChunkRows];
#pragma unroll
      for (int i = 0; i < kChunkRows; ++i) row_ok[i] = local_row + i * kThreadRows < rows_in_tile;
      T nxa[kElems], nxg[kElems], ng[kElems];
      if (s + 1 < kPasses) {
        LoadPass<Tag, kBackward, kGated, kVec, kChunkRows>(p, x_off + x_step, dz_off + dz_step, x_row_step,
                                                           dz_row_step, local_row + kRowsPerPass, rows_in_tile,
                                                           cols_left, nxa, nxg, ng);
      } else if (p.prefetch_tiles && next_row < tile_rows) {
        int64_t nx_off, ndz_off;
        int n_rows, n_cols;
        tile_start(next_row, next_col, &nx_off, &ndz_off, &n_rows, &n_cols);
        LoadPass<Tag, kBackward, kGated, kVec, kChunkRows>(p, nx_off, ndz_off, x_row_step, dz_row_step, chunk_row,
                                                           n_rows, n_cols, nxa, nxg, ng);
        loaded = true;
      }
      // The bias of this thread's kVec columns: plain kernels hold it for the pass (16-byte
      // shared loads, no spills); gated ones read each value where it is added.
      float bias_a[kVec];
      if constexpr (!kGated) {
#pragma unroll
        for (int j = 0; j < kVec; j += 4) {
          float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (has_bias) b = *reinterpret_cast<const float4*>(&bias_tile[parity][0][chunk_col + j]);
          bias_a[j] = b.x, bias_a[j + 1] = b.y, bias_a[j + 2] = b.z, bias_a[j + 3] = b.w;
        }
      }
      float v[kPlanes][kElems];
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        float a = LoadElement(Tag{}, xa[j]);
        float gate = kGated ? LoadElement(Tag{}, xg[j]) : 0.0f;
        if (has_bias && row_ok[j / kVec]) {  // one fp32 add, as the reference (x + bias)
          if constexpr (kGated) {
            a = __fadd_rn(a, LoadSharedFloat(&bias_tile[parity][0][chunk_col + j % kVec]));
            gate = __fadd_rn(gate, LoadSharedFloat(&bias_tile[parity][1][chunk_col + j % kVec]));
          } else {
            a = __fadd_rn(a, bias_a[j % kVec]);
          }
        }
        if constexpr (kBackward) {
          float da, dg;
          ActBackwardValueRaw(act, LoadElement(Tag{}, g[j]), a, gate, &da, &dg);
          v[0][j] = da;
          if constexpr (kPlanes == 2) v[1][j] = dg;
        } else {
          v[0][j] = ActForwardValueRaw(act, a, gate);
        }
      }
      // Elements outside the tensor were loaded as 0 (no bias added: rows by row_ok,
      // columns by the bias row's 0s), and every activation and gradient maps 0 inputs
      // to 0, so they cannot raise the amax; dbias sums only in-range rows
      // (columns past the end are never written).
#pragma unroll
      for (int k = 0; k < kPlanes; ++k) {
        const int64_t o = out_off + k * p.hidden;  // element j = 0 of plane k, chunk row 0
        float chunk_max = 0.0f;
#pragma unroll
        for (int j = 0; j < kElems; ++j) chunk_max = AbsMaxNan(v[k][j], chunk_max);
        best = max(best, FloatBits(chunk_max));  // NaN (0x7FFFFFFF) beats inf
        const bool no_nan = chunk_max == chunk_max;
        if (!no_nan) {  // rare: the reference's canonical NaN for the codecs below
#pragma unroll
          for (int j = 0; j < kElems; ++j) v[k][j] = CanonicalNan(v[k][j]);
        }
        // Chunk row by chunk row, so each column adds the thread's rows in row order.
#pragma unroll
        for (int i = 0; i < kChunkRows; ++i) {
          if (dbias && row_ok[i]) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) col_sum[k][j] += v[k][i * kVec + j];
          }
        }
        uint32_t q[kElems / 4] = {};
        if (quantize && p.e5m2) EncodeChunk(E5m2Fmt{}, v[k], scale, no_nan && scale_ok, q);
        if (quantize && !p.e5m2) EncodeChunk(E4m3Fmt{}, v[k], scale, no_nan && scale_ok, q);
#pragma unroll
        for (int i = 0; i < kChunkRows; ++i) {
          // Chunk row i's values and codes (views, not copies: with kChunkRows = 1 the
          // code is that of the kernel before chunk rows).
          const float(&vr)[kVec] = *reinterpret_cast<const float(*)[kVec]>(&v[k][i * kVec]);
          const uint32_t(&qr)[kVec / 4] = *reinterpret_cast<const uint32_t(*)[kVec / 4]>(&q[i * (kVec / 4)]);
          const int64_t oi = o + i * out_row_step;
          if (row_ok[i]) {
            if (p.vector_io && cols_left > 0) {
              if constexpr (sizeof(T) == 4) {
                if (p.out != nullptr) StoreGlobal16(p.out + oi, PackChunk<Tag, kVec>(vr, no_nan));
              } else {
                if (p.out != nullptr) *reinterpret_cast<uint4*>(p.out + oi) = PackChunk<Tag, kVec>(vr, no_nan);
              }
              if (p.q_rowwise != nullptr) StoreCodes<kVec>(p.q_rowwise + oi, qr);
            } else {
#pragma unroll
              for (int j = 0; j < kVec; ++j) {
                if (j >= cols_left) break;
                if (p.out != nullptr) p.out[oi + j] = StoreFromFloat(Tag{}, vr[j]);
                if (p.q_rowwise != nullptr) p.q_rowwise[oi + j] = uint8_t(qr[j / 4] >> (8 * (j % 4)));
              }
            }
          }
          if (p.q_colwise != nullptr) {
#pragma unroll
            for (int j = 0; j < kVec; j += 4) {
              *reinterpret_cast<uint32_t*>(&codes[k][local_row + i * kThreadRows][chunk_col + j]) = qr[j / 4];
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        xa[j] = nxa[j];
        if constexpr (kGated) xg[j] = nxg[j];
        if constexpr (kBackward) g[j] = ng[j];
      }
      x_off += x_step;
      dz_off += dz_step;
      out_off += out_step;
    }

    // 3. dbias: this tile's column sums, its rows combined in a fixed order.
    if (dbias) {
      if constexpr (kFoldWarpRows) {
        // bf16/f16: the odd chunk row (lanes 16-31) stores its sums, then the even one
        // (lanes 0-15) adds its own to them: even + odd, in the warp's shared row.
        const int warp = threadIdx.x / 32;
        if (chunk_row % kRowsPerWarp == kRowsPerWarp - 1) {
#pragma unroll
          for (int k = 0; k < kPlanes; ++k) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) col_partial[k][warp][chunk_col + j] = col_sum[k][j];
          }
        }
        if constexpr (kRowsPerWarp == 2) {
          __syncwarp();
          if (chunk_row % 2 == 0) {
#pragma unroll
            for (int k = 0; k < kPlanes; ++k) {
#pragma unroll
              for (int j = 0; j < kVec; ++j) {
                float* slot = &col_partial[k][warp][chunk_col + j];
                *slot = __fadd_rn(col_sum[k][j], *slot);
              }
            }
          }
        }
      } else {
#pragma unroll
        for (int k = 0; k < kPlanes; ++k) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) col_partial[k][chunk_row % kPartialRows][chunk_col + j] = col_sum[k][j];
        }
      }
      __syncthreads();
      // One column sum per thread (a loop over threadIdx.x + kThreads kept a hoisted
      // second-iteration index that the tall gated backward spilled).
      static_assert(kPlanes * kTileCols <= kThreads, "one column sum per thread");
      if (threadIdx.x < kPlanes * kTileCols) {
        const int k = int(threadIdx.x) / kTileCols, col = int(threadIdx.x) % kTileCols;
        float sum = 0.0f;
#pragma unroll
        for (int y = 0; y < kPartialRows; ++y) sum += col_partial[k][y][col];
        if (c0 + col < p.hidden) p.partials[int64_t(tile_row) * p.out_cols + k * p.hidden + c0 + col] = sum;
      }
    }

    // 4. colwise: each thread transposes 8 rows x 4 columns of codes (8 4-byte shared
    // loads, two 4 x 4 byte transposes) into 4 column pieces of 8 bytes. A warp covers 8
    // column quads x 4 row octets: conflict-free banks (row stride 33 words) and full
    // 32-byte sectors per column.
    if (p.q_colwise != nullptr) {
      static_assert(kTileCols == 128 && kTileRows % 32 == 0, "the item -> (quad, octet) map below");
      __syncthreads();
      constexpr int kItems = (kTileCols / 4) * (kTileRows / 8);
      for (int w = threadIdx.x; w < kPlanes * kItems; w += kThreads) {
        const int k = w / kItems, item = w % kItems;
        const int quad = (item & 7) + 8 * ((item >> 5) & 3);
        const int row8 = ((item >> 3) & 3) + 4 * (item >> 7);
        uint32_t in[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) in[i] = *reinterpret_cast<const uint32_t*>(&codes[k][row8 * 8 + i][quad * 4]);
        uint32_t lo[4], hi[4];  // rows 0-3 and 4-7 of each column
        Transpose4x4Bytes(in[0], in[1], in[2], in[3], lo);
        Transpose4x4Bytes(in[4], in[5], in[6], in[7], hi);
        const int64_t r = r0 + row8 * 8;
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
          const int64_t oc = c0 + quad * 4 + cc;
          if (oc >= p.hidden) break;
          uint8_t* dst = p.q_colwise + (k * p.hidden + oc) * p.rows + r;
          if (p.colwise_vec && r + 8 <= p.rows) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(lo[cc], hi[cc]);
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              if (r + i < p.rows) dst[i] = uint8_t((i < 4 ? lo[cc] : hi[cc]) >> (8 * (i % 4)));
            }
          }
        }
      }
    }
    if (p.q_colwise != nullptr || dbias) __syncthreads();
    tile_row = next_row, tile_col = next_col;
  }
  best = BlockMaxU32(best);
  if (best > 0x7F800000u) best = 0x7FC00000u;  // the reference's canonical NaN
  if (threadIdx.x == 0 && best != 0) atomicMax(p.amax, best);
}

// blockDim (32, 8): row y of the block sums workspace rows y, y + 8, ...; the 8 sums are
// then added in order. Fixed order: the same bits on every run.
template <typename Tag>
__global__ void DbiasFinalizeKernel(const float* __restrict__ partials, int64_t tile_rows,
                                    int64_t cols, typename Tag::Storage* __restrict__ dbias) {
  __shared__ float sums[8][32];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < cols) {
    for (int64_t t = threadIdx.y; t < tile_rows; t += 8) s += partials[t * cols + c];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
#pragma unroll
    for (int y = 0; y < 8; ++y) total += sums[y][threadIdx.x];
    dbias[c] = StoreFromFloat(Tag{}, CanonicalNan(total));  // as the reference
  }
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// LOWBIT_ACT_VARIANT (a benchmark tuning knob, read at every launch): the grid's cap in
// blocks per SM, whether a tile's last pass prefetches the next tile, and the tile height.
// Unset = 6 (the fp32 plain kernels: kF32DefaultChunkRows*), the fastest on an H100
// (16384 x 16384 bf16, bench/results/activation_variants_*: gelu fwd+q 628.5 / 644.2 /
// 685.9 us for 6 / 5 / 0, dgelu+dbias+q 805.5 / 833.8 / 886.4, swiglu fwd+q 803.6 / 800.5 /
// 844.3, dswiglu+dbias+q 1440 / 1436 /
// 1533). 0 = as many blocks as are resident at once (the kernel's occupancy: one
// persistent round, each block within one tile of the others' count), prefetch, 64-row
// tiles; 1 = 4 per SM, prefetch; 2 = 16, prefetch; 3 = 8 without the prefetch (the
// previous default's schedule); 4 = 8, prefetch; 5 = as 0 with 128-row tiles (128-byte
// colwise column segments, as the standalone quantize kernel's gain from taller tiles;
// half the barriers and transposes' loop overhead per element); 6 = as 0 with 256-row
// tiles (the gated backward: 128). With 8 per SM and 5
// (plain fwd) or 3 (gated bwd) resident, a second round of 3 or 2 blocks per SM runs on
// part of the SM. fp32 input only (other dtypes run 7 / 8 / 9 as 6 / 5 / 6): 7 = as 6 and
// 8 = as 5 with 2 chunk rows per pass (kChunkRows: 8 elements per thread and pass, as
// bf16; 32 loaded bytes per thread and input in flight instead of 16, the fp32 forward
// without y reading 2 of its 3 bytes moved per element where bf16 with y reads 1 of 3),
// 9 = as 6 with 4 (the gated backward: 2; 4 would load 96 values per thread and pass).
// Registers (sm_90a, ptxas -v, gelu): fp32 plain forward 48 / 63 / 78 at 1 / 2 / 4 chunk
// rows (5 / 4 / 3 blocks per SM), plain backward 62 / 80 / 122 (4 / 3 / 2). Every output
// is identical for every variant but dbias, whose fixed summation order depends on the
// tile height only (activation.h).
struct ActVariant {
  int blocks_per_sm = 0;  // 0: the occupancy
  bool prefetch_tiles = true;
  int tile_rows = kTallerTileRows;  // 64, 128 or 256 (unset: variant 6's)
  int f32_chunk_rows = 1;           // fp32 input: 1, 2 or 4 (kChunkRows); others: 1
  bool from_env = false;            // LOWBIT_ACT_VARIANT set (else the defaults below)
};

// Unset, fp32 input of the plain (not gated) kernels takes the fastest chunk rows measured
// for it (H100, 8192 x 16384 f32 gelu, kernel time, bench/results/
// activation_variants_f32_*, the forward's in the .log beside it): the forward 4 (variant
// 9: 310.2 us against 6's 351.4, 7's 326.4), the backward without dx 2 (variant 7: 481.0
// us against 6's 503.2, 9's 493.0).
// Same tile height as 6, so the same bits, dbias included. The gated kernels were not
// measured with fp32 and keep 1.
constexpr int kF32DefaultChunkRowsForward = 4;
constexpr int kF32DefaultChunkRowsBackward = 2;

constexpr char kMaxActVariant = '9';

// False if the value is invalid.
bool ReadActVariant(ActVariant* v) {
  const char* env = std::getenv("LOWBIT_ACT_VARIANT");
  if (env == nullptr || env[0] == '\0') return true;
  if (env[1] != '\0' || env[0] < '0' || env[0] > kMaxActVariant) return false;
  const int i = env[0] - '0';
  v->from_env = true;
  static constexpr int kBlocksPerSm[10] = {0, 4, 16, 8, 8, 0, 0, 0, 0, 0};
  static constexpr int kTileRowsOf[10] = {kShortTileRows, kShortTileRows, kShortTileRows, kShortTileRows,
                                          kShortTileRows, kTallTileRows,  kTallerTileRows, kTallerTileRows,
                                          kTallTileRows,  kTallerTileRows};
  static constexpr int kF32ChunkRows[10] = {1, 1, 1, 1, 1, 1, 1, 2, 2, 4};
  v->blocks_per_sm = kBlocksPerSm[i];
  v->prefetch_tiles = i != 3;
  v->tile_rows = kTileRowsOf[i];
  v->f32_chunk_rows = kF32ChunkRows[i];
  return true;
}

// Resident blocks per SM of ActTiledKernel<Tag, kBackward, kGated, kType, kTileRows,
// kChunkRows, kMayBias> (kThreads threads, static shared memory), asked once per instantiation; 1 if
// the runtime cannot tell.
template <typename Tag, bool kBackward, bool kGated, ActType kType, int kTileRows, int kChunkRows, bool kMayBias>
int ResidentBlocksPerSm() {
  static std::atomic<int> cached{0};
  int n = cached.load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &n, ActTiledKernel<Tag, kBackward, kGated, kType, kTileRows, kChunkRows, kMayBias>, kThreads, 0) !=
            cudaSuccess ||
        n < 1) {
      n = 1;
    }
    cached.store(n, std::memory_order_relaxed);
  }
  return n;
}

// The tiled kernel with kTileRows-row tiles, then (dbias) the finalize kernel over its
// tile_rows workspace rows (ActBackwardWorkspaceBytes sizes for 64-row tiles: enough).
template <typename Tag, bool kBackward, bool kGated, ActType kType, int kTileRows, int kChunkRows, bool kMayBias>
Status LaunchTiles(const ActKernelArgs<typename Tag::Storage>& p, const typename Tag::Storage* bias,
                   const ActVariant& variant, GpuStream stream,
                   const char* op) {
  using T = typename Tag::Storage;
  const int64_t tile_rows = (p.rows + kTileRows - 1) / kTileRows;
  const int64_t tile_cols = (p.hidden + kTileCols - 1) / kTileCols;
  if (tile_rows >= (int64_t(1) << 30) || tile_cols >= (int64_t(1) << 30)) {
    return Status::InvalidArgument(std::string(op) + ": x: too many rows or columns for the CUDA kernel");
  }
  const int64_t tiles = tile_rows * tile_cols;
  const int per_sm = variant.blocks_per_sm > 0
                         ? variant.blocks_per_sm
                         : ResidentBlocksPerSm<Tag, kBackward, kGated, kType, kTileRows, kChunkRows, kMayBias>();
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, per_sm);
  ActTiledKernel<Tag, kBackward, kGated, kType, kTileRows, kChunkRows, kMayBias><<<blocks, kThreads, 0, stream>>>(p, bias);
  LOWBIT_RETURN_IF_ERROR(LaunchStatus(op));
  if (p.partials == nullptr) return Status::Ok();
  const int64_t finalize_blocks = (p.out_cols + 31) / 32;
  if (finalize_blocks > 0x7FFFFFFF) return Status::InvalidArgument(std::string(op) + ": x: too many columns");
  DbiasFinalizeKernel<Tag><<<unsigned(finalize_blocks), dim3(32, 8), 0, stream>>>(
      p.partials, tile_rows, p.out_cols, static_cast<T*>(p.dbias_out));
  return LaunchStatus(op);
}

// The tall tiles (128 or 256 rows; the gated backward: 128) with kChunkRows chunk rows.
template <typename Tag, bool kBackward, bool kGated, ActType kType, int kChunkRows, bool kMayBias>
Status LaunchTall(const ActKernelArgs<typename Tag::Storage>& p, const typename Tag::Storage* bias,
                  const ActVariant& variant, GpuStream stream,
                  const char* op) {
  if (variant.tile_rows == kTallerTileRows) {
    if constexpr (!(kBackward && kGated)) {
      return LaunchTiles<Tag, kBackward, kGated, kType, kTallerTileRows, kChunkRows, kMayBias>(p, bias, variant, stream, op);
    }
  }
  return LaunchTiles<Tag, kBackward, kGated, kType, kTallTileRows, kChunkRows, kMayBias>(p, bias, variant, stream, op);
}

// The kernel of this tile height and chunk rows, with or without the bias code.
template <typename Tag, bool kBackward, bool kGated, ActType kType, bool kMayBias>
Status LaunchVariant(const ActKernelArgs<typename Tag::Storage>& p, const typename Tag::Storage* bias,
                     const ActVariant& variant, GpuStream stream,
                     const char* op) {
  if constexpr (std::is_same_v<Tag, F32>) {
    // fp32 chunk rows (tall tiles only); the gated backward takes at most 2 (4 would hold
    // 2 x 48 loaded values per thread).
    if (variant.f32_chunk_rows == 4) {
      if constexpr (!(kBackward && kGated)) {
        return LaunchTall<Tag, kBackward, kGated, kType, 4, kMayBias>(p, bias, variant, stream, op);
      }
    }
    if (variant.f32_chunk_rows != 1) return LaunchTall<Tag, kBackward, kGated, kType, 2, kMayBias>(p, bias, variant, stream, op);
  }
  if (variant.tile_rows != kShortTileRows) return LaunchTall<Tag, kBackward, kGated, kType, 1, kMayBias>(p, bias, variant, stream, op);
  return LaunchTiles<Tag, kBackward, kGated, kType, kShortTileRows, 1, kMayBias>(p, bias, variant, stream, op);
}

template <typename Tag, bool kBackward, bool kGated, ActType kType>
Status Launch(const ActArgs& a, void* workspace, GpuStream stream, const char* op) {
  using T = typename Tag::Storage;
  constexpr int kVec = 16 / int(sizeof(T));
  ActKernelArgs<T> p;
  const T* bias = static_cast<const T*>(a.bias);
  p.act = a.params;
  p.rows = a.rows;
  p.hidden = a.hidden;
  p.out_cols = ActOutCols(a, kBackward);
  p.in_cols = kGated ? 2 * a.hidden : a.hidden;
  p.x = static_cast<const T*>(a.x);
  p.dz = static_cast<const T*>(a.dz);
  p.scale = a.scale;
  p.out = static_cast<T*>(a.out);
  p.q_rowwise = a.q_rowwise;
  p.q_colwise = a.q_colwise;
  p.colwise_vec = a.q_colwise != nullptr && Aligned(a.q_colwise, 8) && a.rows % 8 == 0;
  p.amax = reinterpret_cast<uint32_t*>(a.amax);
  p.partials = kBackward && a.dbias != nullptr ? static_cast<float*>(workspace) : nullptr;
  p.dbias_out = a.dbias;
  if (kBackward && a.dbias != nullptr && workspace == nullptr) {
    return Status::Internal(std::string(op) + ": dbias: no workspace");
  }
  p.vector_io = a.hidden % kVec == 0 && Aligned(a.x, 16) && Aligned(a.dz, 16) &&
                Aligned(a.out, 16) && Aligned(a.q_rowwise, 16);
  const bool quantize = a.q_rowwise != nullptr || a.q_colwise != nullptr;
  p.e5m2 = quantize && a.q_dtype == DType::kE5M2;
  ActVariant variant;
  if (!ReadActVariant(&variant)) {
    return Status::InvalidArgument(std::string(op) + ": LOWBIT_ACT_VARIANT: expected 0 to " +
                                   std::string(1, kMaxActVariant) + ", got '" + std::getenv("LOWBIT_ACT_VARIANT") +
                                   "'");
  }
  p.prefetch_tiles = variant.prefetch_tiles;
  if constexpr (std::is_same_v<Tag, F32> && !kGated) {
    if (!variant.from_env) {
      variant.f32_chunk_rows = kBackward ? kF32DefaultChunkRowsBackward : kF32DefaultChunkRowsForward;
    }
  }
  if constexpr (kBackward && kGated) {
    if (bias == nullptr) return LaunchVariant<Tag, kBackward, kGated, kType, false>(p, bias, variant, stream, op);
  }
  return LaunchVariant<Tag, kBackward, kGated, kType, true>(p, bias, variant, stream, op);
}

// One act type's kernels for every dtype, direction and gating.
template <ActType kType>
Status RunActType(const ActArgs& a, void* workspace, GpuStream stream, bool backward, const char* op) {
  return DispatchHighPrecision(a.dtype, op, "x", [&](auto tag) {
    using Tag = decltype(tag);
    if (backward) {
      return a.params.gated ? Launch<Tag, true, true, kType>(a, workspace, stream, op)
                            : Launch<Tag, true, false, kType>(a, workspace, stream, op);
    }
    return a.params.gated ? Launch<Tag, false, true, kType>(a, workspace, stream, op)
                          : Launch<Tag, false, false, kType>(a, workspace, stream, op);
  });
}

}  // namespace
}  // namespace lowbit

// Defines act_cuda::LaunchActType<ActType::TYPE> (activation_launch.h) in the including .cu.
#define LOWBIT_DEFINE_ACT_TYPE_LAUNCH(TYPE)                                                          \
  namespace lowbit::act_cuda {                                                                      \
  template <>                                                                                       \
  Status LaunchActType<ActType::TYPE>(const ActArgs& a, void* workspace, GpuStream stream, bool backward, \
                                      const char* op) {                                             \
    return RunActType<ActType::TYPE>(a, workspace, stream, backward, op);                           \
  }                                                                                                 \
  }
