// The block-quantize tile kernels, shared by the plain block quantizers (quantize_block.cu,
// quantize_mxfp8.cu) and the fused elementwise + block-quantize kernels (fused_block/), so
// that every block-scaled FP8 copy comes from one implementation. Numerics and layouts:
// quantize_block.h (FP8 block) and quantize_mxfp8.h (MXFP8).
//
// The kernels are templated on a row tiling (Rows: which rows a tile row covers) and a tile
// source. UniformRowTiles is the plain walk (tile row t = rows [t*h, t*h + h) of x); the
// grouped quantizers (quantize_grouped_block.cu) start tiles at group boundaries instead:
//   Rows::kGrouped, Rows::Cursor  per-thread lookup state
//   rows.TileRows(h)              tile rows to walk (an upper bound for grouped walks)
//   rows.Tile(t, h, blocks_per_tile, cursor) -> RowTile (below)
// The kernels are templated on a tile source, what a thread reads for one 16-byte chunk of
// x's row r at column c of the rows x cols matrix being quantized:
//   Src::kVec               values per chunk (16 / sizeof(input element))
//   Src::kMinBlocks, kMinBlocks2d, kMinBlocksMxfp8
//                           resident blocks per SM Fp8BlockTileKernel (1x128, 128x128) and
//                           Mxfp8TileKernel are compiled for (launch bounds: 2 leaves a thread
//                           128 registers, 3 leaves 80); 3 only where the kernel then (nearly)
//                           does not spill; the grids are twice that many blocks per SM
//   Src::Chunk              what a thread holds for a chunk between its load and its encode
//   Src::Cols               what a thread reads once per tile for its kVec columns (the
//                           same for all its rows of the tile: a norm's gamma and beta)
//   src.LoadCols(c, cols, col_state)
//   src.Load<kVectorIO>(r, c, rows, cols, col_state, chunk)
//                           kVectorIO: the chunk is one aligned 16-byte load (or its parts);
//                           else bounds-checked scalar loads. Elements outside rows x cols
//                           must come out as +0 (no amax changes).
//   Src::Value(chunk, j)    element j as fp32: the value quantized
// PlainSource is x itself (the plain quantizers: the chunk holds the input elements,
// converted when encoded). A fused source computes fp32 values in Load (fused_block/).
//
// Fp8BlockTileKernel: a block (256 threads) loops over 128 x 128 tiles of x. Each thread
//   issues all its chunk loads of the tile first (kPasses rows x one 16-byte chunk; in the
//   staged form, below, they were issued during the previous tile), then:
//   - amaxes (bf16 x: on the 16-bit halves, two per instruction): 1x128 rowwise: the tile
//     row's max over the lanes that hold it (shuffles), lane q of those computing the scale
//     of pass q's row (one division per lane) and shuffling it to the others; 1x128
//     colwise: per-thread column maxima, combined through shared memory; 128x128: one
//     block-wide max;
//   - rowwise codes: encoded with their row's scale and stored straight to global memory;
//   - colwise codes (encoded with their column's scale, from the same fp32 values as the
//     rowwise ones; for 128x128 the rowwise codes, the scale being the same) go to shared
//     memory, from which each thread gathers 4 columns x 8 rows, byte-transposes them and
//     writes 8-byte stores of the cols x rows copy (grouped tiles, which start at any row,
//     take 8-row windows aligned to x's rows instead).
//   Scales are written by the threads that own them; padding entries are zeroed by a memset
//   first, only when there are any.
// Mxfp8TileKernel: a block (256 threads) loops over 64 x 128 tiles of x; each thread
//   issues its chunk loads (kPasses rows x one chunk) first (staged: during the previous
//   tile), then
//   - amaxes (bf16 x: on the 16-bit halves): per chunk, and per column for each of the
//     tile's two 32-row blocks;
//   - rowwise: the 32-value block max over the 32 / kVec lanes that hold it (shuffles),
//     lane q of those computing pass q's E8M0 byte (and writing it) and shuffling it to the
//     others;
//   - colwise: the per-thread column maxima combined through shared memory by one thread per
//     (block, column), which writes the byte;
//   - codes: each value converted to fp32 once and encoded with its row block's factor and
//     its column block's, both copies stored in x's layout (no transpose).
//   Scale padding is zeroed by a memset first, only when there is any.
// Staged form (kStaged, both kernels: PlainSource on the plain walk with vector IO; on or off
//   per kernel by BlockTileStaging): one resident wave of blocks, each thread copying its
//   chunks of the block's next tile into its own slots of dynamic shared memory (cp.async) as
//   soon as it holds the current tile's values, so the loads of tile t+1 are in flight while
//   tile t is encoded. No thread reads another's slots, so the hand-off needs no barrier.
// dbias (both kernels, kDbias: plain walk only, compiled only into the kernels that compute
//   it, so that the others keep their registers and shared memory): after the loads, each thread
//   sums its chunk columns over its kPasses rows in pass order, the lane sums go to shared
//   memory, and one thread per column adds the tile's lanes in lane order into workspace row
//   r0 / tile height: the order of block_dbias.h (lanes S = kRowsPerPass = 32 / sizeof(x));
//   the finalize kernel (dbias_finalize.cuh) runs after the tile kernel.
// Encoding: fp8_cvt.cuh (hardware cvt where bit-identical, else the formats.h codec). Partial
// tiles and unaligned tensors take bounds-checked scalar paths: nothing outside the tensors
// is read or written.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/cp_async.cuh"
#include "common/cuda_check.h"
#include "common/element.h"
#include "common/reduce.cuh"
#include "quantize/block_codec.h"
#include "quantize/block_dbias.h"
#include "quantize/fp8_cvt.cuh"
#include "quantize/quantize_block.h"
#include "quantize/quantize_mxfp8.h"

namespace lowbit {
namespace block_tiles {

constexpr int kThreads = 256;
// FP8 block: the kernel's tile is always 128 x 128.
constexpr int kTile = int(kFp8BlockLen);
// Shared-memory row of codes: 4-byte aligned; +4 spreads a warp's 8-row reads over banks.
constexpr int kCodeStride = kTile + 4;
constexpr int kColItems = (kTile / 4) * (kTile / 8);  // 4-col x 8-row transpose items per tile
static_assert(kColItems % kThreads == 0, "whole transpose items per thread");
// MXFP8: 64 x 128 tiles (two 32-row colwise blocks).
constexpr int kBlock = int(kMxfp8BlockLen);
constexpr int kTileRows = 2 * kBlock;
constexpr int kTileCols = 128;
static_assert(kTile == kFp8BlockDbiasTileRows && kTileRows == kMxfp8DbiasTileRows, "block_dbias.h's tile heights");

inline bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// One tile row of a walk: rows [r0, min(r0 + h, r_lim)).
struct RowTile {
  int64_t r0 = 0;
  int64_t r_lim = 0;        // rows at or past r_lim are not the tile's: loaded as 0, never stored
  int64_t scale_row = 0;    // its first scale row in the (group-bound) scale matrix, in blocks
  int64_t scale_col2d = 0;  // FP8 128x128: its column in the colwise scale matrix
  bool tail = false;        // grouped tail: group-bound copies get zero codes and no scales
  bool skip = false;        // past the last tile: nothing to do
};

// The plain walk over x: tile row t is rows [t*h, t*h + h).
struct UniformRowTiles {
  static constexpr bool kGrouped = false;
  struct Cursor {};
  int64_t rows = 0;
  int64_t col2d_ld = 0;  // FP8 128x128: row length of the colwise scale matrix
  __host__ __device__ int64_t TileRows(int h) const { return (rows + h - 1) / h; }
  __device__ __forceinline__ RowTile Tile(int64_t t, int h, int blocks_per_tile, Cursor&) const {
    RowTile rt;
    rt.r0 = t * h;
    rt.r_lim = rows;
    rt.scale_row = t * blocks_per_tile;
    rt.scale_col2d = t;
    return rt;
  }
};

// Zeroes every code of a chunk (the group-bound copies of a grouped tail).
template <int kWords>
__device__ __forceinline__ void ZeroWords(uint32_t (&words)[kWords]) {
#pragma unroll
  for (int w = 0; w < kWords; ++w) words[w] = 0u;
}

// x itself, rows x cols row-major (the plain quantizers).
template <typename Tag>
struct PlainSource {
  using T = typename Tag::Storage;
  static constexpr int kVec = 16 / int(sizeof(T));
  // Resident blocks an SM the tile kernels are compiled for (ptxas, 2026-11-27, vector IO):
  // for 16-bit x, the FP8 128x128 kernel fits 80 registers (3 blocks) without spills; the FP8
  // 1x128 kernel (one scale division per lane, each value converted once) fits 80 with no
  // spills staged for bf16 and <= 44 bytes otherwise; its dbias form fits 80 staged (bf16: no
  // spills; f16: 24 bytes, 2026-11-28, its column totals sharing the colwise exchange's
  // barrier) and takes 2 unstaged, where it would spill 272-356 bytes (Fp8TileMinBlocks); the MXFP8 kernel fits 64 (4 blocks)
  // with <= 4 bytes of spills for bf16 and <= 60 for f16, its dbias form too when staged and 3
  // unstaged (Mxfp8TileMinBlocks). f32 x takes 2 (FP8) and 3 (MXFP8).
  static constexpr int kMinBlocks = sizeof(T) == 2 ? 3 : 2, kMinBlocks2d = sizeof(T) == 2 ? 3 : 2,
                       kMinBlocksMxfp8 = sizeof(T) == 2 ? 4 : 3;
  struct Chunk {
    T v[kVec];
  };
  struct Cols {};
  const T* x;

  // Whole 16-byte chunks: x 16-byte aligned and cols % kVec == 0.
  bool VectorOk(int64_t cols) const { return Aligned(x, 16) && cols % kVec == 0; }

  __device__ __forceinline__ void LoadCols(int64_t, int64_t, Cols&) const {}
  template <bool kVectorIO>
  __device__ __forceinline__ void Load(int64_t r, int64_t c, int64_t rows, int64_t cols, const Cols&,
                                       Chunk& out) const {
    if constexpr (kVectorIO) {
      uint4 packed = make_uint4(0, 0, 0, 0);
      if (r < rows && c < cols) packed = __ldg(reinterpret_cast<const uint4*>(x + r * cols + c));
      FromStaged(packed, out);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.v[j] = (r < rows && c + j < cols) ? x[r * cols + c + j] : T(0);
    }
  }
  __device__ __forceinline__ static float Value(const Chunk& chunk, int j) { return LoadAsFloatFast(Tag{}, chunk.v[j]); }

  // Staged loads (the kernels' kStaged form, vector IO only): the chunk at (r, c) copied into
  // `slot` by cp.async, or zeros outside x; FromStaged turns 16 loaded bytes into a chunk
  // (Load's vector path too).
  static constexpr bool kStageable = true;
  // bf16: Value's fp32 bits are the element's bits << 16, so the |x| bits of a chunk compare
  // as its 16-bit |x| halves do (AbsMaxBf16Chunk); other types take Value.
  static constexpr bool kBf16Bits = std::is_same_v<Tag, BF16>;
  __device__ __forceinline__ void Stage(int64_t r, int64_t c, int64_t rows, int64_t cols, uint4* slot) const {
    if (r < rows && c < cols) {
      CopyAsync16(slot, x + r * cols + c);
    } else {
      *slot = make_uint4(0, 0, 0, 0);
    }
  }
  __device__ __forceinline__ static void FromStaged(const uint4& packed, Chunk& out) {
    memcpy(out.v, &packed, sizeof(packed));
  }
};

// Resident blocks an SM Fp8BlockTileKernel is compiled for (its launch bounds). The staged
// 1x128 dbias form fits the plain form's registers (its column totals share the colwise
// exchange's barrier); the unstaged dbias form would spill there and takes 2.
template <typename Src, bool kTile2d, bool kDbias, bool kStaged>
constexpr int Fp8TileMinBlocks() {
  return kTile2d ? Src::kMinBlocks2d : (kDbias && !kStaged) ? 2 : Src::kMinBlocks;
}

// Resident blocks an SM Mxfp8TileKernel is compiled for: the staged dbias form as the plain one
// (bf16: 63 registers, no spills, with its column totals after the colwise exchange's barrier;
// f16: 12 bytes), the unstaged dbias form 3 (80 registers).
template <typename Src, bool kDbias, bool kStaged>
constexpr int Mxfp8TileMinBlocks() {
  return kDbias && !kStaged && Src::kMinBlocksMxfp8 > 3 ? 3 : Src::kMinBlocksMxfp8;
}

// Whether a source's chunks are raw bf16 (PlainSource<BF16>): its amaxes then come from the
// 16-bit halves (two per instruction), equal to AbsBitsOf(Value) maxima bit for bit.
template <typename S, typename = void>
struct Bf16Chunks : std::false_type {};
template <typename S>
struct Bf16Chunks<S, std::void_t<decltype(S::kBf16Bits)>> : std::bool_constant<S::kBf16Bits> {};

// For a bf16 chunk: max |x| bits of the chunk into *chunk_max and per column into col_max
// (both as fp32 bits: the 16-bit maximum << 16), on packed pairs.
template <int kVec, typename Chunk>
__device__ __forceinline__ void AbsMaxBf16Chunk(const Chunk& chunk, uint32_t* chunk_max, uint32_t (&col_max)[kVec]) {
  static_assert(sizeof(Chunk) == 16 && kVec == 8, "8 bf16 values");
  uint32_t w[4];
  memcpy(w, &chunk, sizeof(w));
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t a = w[k] & 0x7FFF7FFFu;
    m = __vmaxu2(m, a);
    col_max[2 * k] = max(col_max[2 * k], a << 16);
    col_max[2 * k + 1] = max(col_max[2 * k + 1], a & 0xFFFF0000u);
  }
  *chunk_max = max(m << 16, m & 0xFFFF0000u);
}

// Whether a source offers Stage / FromStaged (PlainSource; the fused sources compute their
// values in Load and do not).
template <typename S, typename = void>
struct Stageable : std::false_type {};
template <typename S>
struct Stageable<S, std::void_t<decltype(S::kStageable)>> : std::bool_constant<S::kStageable> {};

// Staged tile loads: LOWBIT_BLOCK_TILE_STAGED unset (each kernel's default, `default_on`),
// "1" (staged wherever a kernel can be) or "0" (never), read at every launch so that one
// process can time both forms. The defaults follow the H200 measurements of
// bench/results/quantize_block_tiles_2026-11-27b.log (16-bit x, kernel time): staged
// where it was faster (FP8 1x128 without dbias: 162 vs 176 us at 16384 x 8192, MXFP8 with
// dbias: 243 vs 278) and for f32 x (FP8 128x128 from f32 in the seed Dense step: 430 vs
// 496 us), unstaged where it was slower (FP8 128x128: 165 vs 153, MXFP8 without dbias: 224
// vs 213). FP8 1x128 with dbias was slower staged (253 vs 209) while its staged form spilled
// at 128 registers; since its column totals share the colwise exchange's barrier it fits 80
// with no spills (bf16), and it is staged by default: 219 vs 227 us unstaged, and MXFP8 with
// dbias at 4 blocks an SM 239 vs 243 us at 3 (H100, Nsight Compute, 2026-11-28,
// bench/results/quantize_block_dbias_registers_*).
constexpr const char* kBlockTileStagedEnv = "LOWBIT_BLOCK_TILE_STAGED";
inline Status BlockTileStaging(const char* op, bool default_on, bool* on) {
  const char* env = std::getenv(kBlockTileStagedEnv);
  *on = default_on;
  if (env == nullptr || *env == '\0') return Status::Ok();
  if (std::strcmp(env, "1") == 0 || std::strcmp(env, "0") == 0) {
    *on = env[0] == '1';
    return Status::Ok();
  }
  return Status::InvalidArgument(std::string(op) + ": " + kBlockTileStagedEnv + "=\"" + env + "\": expected 0 or 1");
}

// A kStaged kernel's one staged tile: every thread's kPasses chunks, chunk p of thread t at
// slot p * kThreads + t (each thread reads back only its own slots, after its own wait).
template <typename Src, int kTileH, int kTileW>
constexpr int StagedTileBytes() {
  return kTileH * kTileW / Src::kVec * 16;
}

// Launches a staged kernel (dynamic shared memory smem_bytes) where this device can run it:
// one resident wave (every block loops over tiles with the next one's loads in flight; a
// second wave's blocks would start theirs unstaged), at most one block per tile. *launched =
// false where it cannot (shared memory per block or SM too small): the caller then launches
// the unstaged form, which computes the same values.
template <typename Kernel, typename... Args>
Status LaunchStagedIfFits(Kernel kernel, int smem_bytes, int64_t tiles, const char* op, GpuStream stream,
                          bool* launched, const Args&... args) {
  *launched = false;
  int device = 0, optin = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), op, "cudaGetDevice"));
  LOWBIT_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), op, "cudaDeviceGetAttribute"));
  cudaFuncAttributes attrs{};
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaFuncGetAttributes(&attrs, kernel), op, "cudaFuncGetAttributes"));
  if (int64_t(attrs.sharedSizeBytes) + smem_bytes > optin) return Status::Ok();
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                         smem_bytes),
                                    op, "cudaFuncSetAttribute"));
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                         int(cudaSharedmemCarveoutMaxShared)),
                                    op, "cudaFuncSetAttribute"));
  int per_sm = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                                                  smem_bytes),
                                    op, "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
  if (per_sm < 1) return Status::Ok();
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, per_sm);
  kernel<<<blocks, kThreads, smem_bytes, stream>>>(args...);
  *launched = true;
  return LaunchStatus(op);
}

// Issues this thread's cp.async copies of tile t (kTileH x kTileW, plain walk) into its slots
// of `staged` (chunk p at p * kThreads + threadIdx.x) and commits them as one group. Called
// only by kStaged kernels, so that sources without Stage never instantiate it.
template <int kTileH, int kTileW, int kPasses, int kRowsPerPass, typename Src, typename Rows>
__device__ __forceinline__ void StageTile(const Src& src, const Rows& row_tiles, int64_t t, int64_t tiles_c,
                                          int blocks_per_tile, int chunk_row, int chunk_col, int64_t cols,
                                          uint4* staged) {
  typename Rows::Cursor none;
  const RowTile st = row_tiles.Tile(t / tiles_c, kTileH, blocks_per_tile, none);
  const int64_t c = t % tiles_c * kTileW + chunk_col;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    src.Stage(st.r0 + p * kRowsPerPass + chunk_row, c, st.r_lim, cols, &staged[p * kThreads + threadIdx.x]);
  }
  CopyAsyncCommit();
}

// The two halves of TileColumnSums, for a kernel with a barrier of its own between them:
// my lane sums to shared memory, then (threads below kCols, after a barrier) a column's total.
template <typename Src, int kPasses, int kRowsPerPass, int kCols>
__device__ __forceinline__ void StoreLaneSums(const typename Src::Chunk (&vals)[kPasses], int chunk_row,
                                              int chunk_col, float (*lane_sums)[kCols]) {
  constexpr int kVec = Src::kVec;
  // The plain source's kVec is 16 / sizeof(x): kRowsPerPass = 2 * kVec = block_dbias.h's S.
  static_assert(kVec % 4 == 0 && kRowsPerPass == 2 * kVec, "lanes of block_dbias.h: 32 / sizeof(x element)");
  float s[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    s[j] = 0.0f;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) s[j] += Src::Value(vals[p], j);
  }
#pragma unroll
  for (int j = 0; j < kVec; j += 4) {
    *reinterpret_cast<float4*>(&lane_sums[chunk_row][chunk_col + j]) = make_float4(s[j], s[j + 1], s[j + 2], s[j + 3]);
  }
}
template <int kRowsPerPass, int kCols>
__device__ __forceinline__ void FinishColumnSum(int64_t c0, int64_t cols, int64_t tile_row,
                                                const float (*lane_sums)[kCols], float* __restrict__ partials) {
  if (c0 + threadIdx.x < cols) {
    float total = 0.0f;
#pragma unroll
    for (int g = 0; g < kRowsPerPass; ++g) total += lane_sums[g][threadIdx.x];
    partials[tile_row * cols + c0 + threadIdx.x] = total;
  }
}

// dbias of one tile (block_dbias.h): my kVec columns summed over my kPasses rows in pass
// order, then (one thread per column) the kRowsPerPass lanes of a column in lane order, written
// to workspace row `tile_row`. lane_sums is kRowsPerPass x kCols; the caller syncs before it
// is written again.
template <typename Src, int kPasses, int kRowsPerPass, int kCols>
__device__ __forceinline__ void TileColumnSums(const typename Src::Chunk (&vals)[kPasses], int chunk_row,
                                               int chunk_col, int64_t c0, int64_t cols, int64_t tile_row,
                                               float (*lane_sums)[kCols], float* __restrict__ partials) {
  StoreLaneSums<Src, kPasses, kRowsPerPass, kCols>(vals, chunk_row, chunk_col, lane_sums);
  __syncthreads();
  if (threadIdx.x < kCols) FinishColumnSum<kRowsPerPass, kCols>(c0, cols, tile_row, lane_sums, partials);
}

// Byte transpose of 8 rows x 4 bytes (w[k]: row k): lo[j] holds column j of rows 0..3, hi[j]
// of rows 4..7 (little-endian: row k in byte k % 4).
__device__ __forceinline__ void TransposeBytes8x4(const uint32_t (&w)[8], uint32_t (&lo)[4], uint32_t (&hi)[4]) {
  const uint32_t a_lo = __byte_perm(w[0], w[1], 0x5140), a_hi = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t b_lo = __byte_perm(w[2], w[3], 0x5140), b_hi = __byte_perm(w[2], w[3], 0x7362);
  const uint32_t e_lo = __byte_perm(w[4], w[5], 0x5140), e_hi = __byte_perm(w[4], w[5], 0x7362);
  const uint32_t f_lo = __byte_perm(w[6], w[7], 0x5140), f_hi = __byte_perm(w[6], w[7], 0x7362);
  lo[0] = __byte_perm(a_lo, b_lo, 0x5410);
  lo[1] = __byte_perm(a_lo, b_lo, 0x7632);
  lo[2] = __byte_perm(a_hi, b_hi, 0x5410);
  lo[3] = __byte_perm(a_hi, b_hi, 0x7632);
  hi[0] = __byte_perm(e_lo, f_lo, 0x5410);
  hi[1] = __byte_perm(e_lo, f_lo, 0x7632);
  hi[2] = __byte_perm(e_hi, f_hi, 0x5410);
  hi[3] = __byte_perm(e_hi, f_hi, 0x7632);
}

// The first step of both tile kernels: this thread's kPasses chunks of the tile (rows r0 +
// p * kRowsPerPass + chunk_row, columns [c, c + kVec)), out of range -> 0, which changes no
// amax. kStaged: from its own slots of `staged`, once its copies have landed.
template <bool kStaged, bool kVectorIO, int kPasses, int kRowsPerPass, typename Src>
__device__ __forceinline__ void LoadTileChunks(const Src& src, int64_t r0, int64_t c, int64_t r_lim, int64_t cols,
                                               int chunk_row, const uint4* staged,
                                               typename Src::Chunk (&vals)[kPasses]) {
  typename Src::Cols col_state;
  src.LoadCols(c, cols, col_state);
  if constexpr (kStaged) {
    CopyAsyncWait<0>();
#pragma unroll
    for (int p = 0; p < kPasses; ++p) Src::FromStaged(staged[p * kThreads + threadIdx.x], vals[p]);
  } else {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      src.template Load<kVectorIO>(r0 + p * kRowsPerPass + chunk_row, c, r_lim, cols, col_state, vals[p]);
    }
  }
}

// The amaxes (|x| bits) of a thread's chunks: per chunk (also the chunk's "no NaN" test) and
// per column within each of kColGroups equal runs of passes (the colwise blocks the tile's
// rows fall in: 1 for a 128-row FP8 block, 2 for MXFP8's two 32-row blocks).
template <int kColGroups, int kPasses, int kVec, typename Src>
__device__ __forceinline__ void ChunkAndColumnMaxima(const typename Src::Chunk (&vals)[kPasses],
                                                     uint32_t (&chunk_max)[kPasses],
                                                     uint32_t (&col_max)[kColGroups][kVec]) {
  static_assert(kPasses % kColGroups == 0, "whole passes per column group");
#pragma unroll
  for (int g = 0; g < kColGroups; ++g) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) col_max[g][j] = 0;
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    uint32_t (&cm)[kVec] = col_max[p / (kPasses / kColGroups)];
    if constexpr (Bf16Chunks<Src>::value) {
      AbsMaxBf16Chunk<kVec>(vals[p], &chunk_max[p], cm);
    } else {
      chunk_max[p] = 0;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const uint32_t b = AbsBitsOf(Src::Value(vals[p], j));
        chunk_max[p] = max(chunk_max[p], b);
        cm[j] = max(cm[j], b);
      }
    }
  }
}

// A rowwise block's value (its scale, or E8M0 byte) for each of a thread's passes, where the
// block's chunks are spread over kLanes consecutive lanes: lane q of each group reduces pass
// q's chunk maxima over the group and computes `of(max)` for it alone, then every lane gets
// every pass's value by shuffle, so each lane computes one value instead of one per pass.
// Returns the lane's own value (pass q's, for q < kPasses), the one a caller writes out.
template <int kLanes, int kPasses, typename T, typename Of>
__device__ __forceinline__ T RowBlockValues(const uint32_t (&chunk_max)[kPasses], Of of, T (&per_pass)[kPasses]) {
  static_assert(kPasses <= kLanes, "one lane per pass");
  const int q = threadIdx.x % kLanes;
  uint32_t my_max = 0;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const uint32_t m = GroupMaxU32<kLanes>(chunk_max[p]);
    my_max = q == p ? m : my_max;
  }
  const T mine = of(my_max);
#pragma unroll
  for (int p = 0; p < kPasses; ++p) per_pass[p] = __shfl_sync(0xFFFFFFFFu, mine, p, kLanes);
  return mine;
}

// Stores a chunk's kVec codes at columns [c, c + kVec) of a rowwise row: one kVec-byte store
// (kVectorIO: aligned, and c < cols implies the whole chunk is in range), else byte by byte.
template <bool kVectorIO, int kVec>
__device__ __forceinline__ void StoreRowCodes(uint8_t* row, int64_t c, int64_t cols,
                                              const uint32_t (&words)[kVec / 4]) {
  if (kVectorIO && c < cols) {
    StoreCodes<kVec>(row + c, words);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (c + j < cols) row[c + j] = CodeOf(words, j);
    }
  }
}

// kVectorIO: the source's chunks are whole 16-byte loads (Src::Load) and rowwise is aligned:
// every in-range chunk is one kVec-byte store. colwise_vec: rows % 8 == 0, colwise 8-byte
// aligned: full 8-row transposed chunks (at rows % 8 == 0) are 8-byte stores.
// kStaged (plain walk, vector IO, a Stageable source): each thread's chunks of the block's
// next tile are copied into dynamic shared memory (StagedTileBytes) by cp.async while this
// tile is encoded and stored, instead of being loaded when the tile starts.
template <typename Src, typename Fmt, bool kTile2d, bool kVectorIO, bool kDbias, bool kStaged, typename Rows>
__global__ void __launch_bounds__(kThreads, (Fp8TileMinBlocks<Src, kTile2d, kDbias, kStaged>()))
    Fp8BlockTileKernel(const Src src, const Rows row_tiles, int64_t rows, int64_t cols,
                           bool pow2, uint8_t* __restrict__ rowwise, float* __restrict__ row_scale_inv,
                           uint8_t* __restrict__ colwise, float* __restrict__ col_scale_inv,
                           bool colwise_vec, float* __restrict__ dbias_partials) {
  constexpr int kVec = Src::kVec;                      // elements per chunk (16 input bytes)
  constexpr int kThreadsPerRow = kTile / kVec;         // 16 (16-bit x) or 32 (f32)
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTile / kRowsPerPass;        // 8 or 16
  __shared__ __align__(16) uint8_t codes[kTile][kCodeStride];
  __shared__ uint32_t col_part[kRowsPerPass][kTile];
  __shared__ float col_scale[kTile];
  __shared__ __align__(16) float lane_sums[kDbias ? kRowsPerPass : 1][kTile];  // dbias

  const int64_t tiles_c = (cols + kTile - 1) / kTile;
  const int64_t tiles = row_tiles.TileRows(kTile) * tiles_c;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  const ScaleDims row_dims = Fp8BlockScaleDims(rows, cols, kTile2d);
  const ScaleDims col_dims = Fp8BlockScaleDims(cols, rows, kTile2d);
  typename Rows::Cursor cursor;
  static_assert(!kStaged || (kVectorIO && !Rows::kGrouped && Stageable<Src>::value), "staged: plain vector walk");
  extern __shared__ __align__(16) uint8_t staged_bytes[];  // kStaged: the next tile's chunks
  uint4* const staged = reinterpret_cast<uint4*>(staged_bytes);
  if constexpr (kStaged) {
    if (blockIdx.x < tiles) {
      StageTile<kTile, kTile, kPasses, kRowsPerPass>(src, row_tiles, blockIdx.x, tiles_c, 1, chunk_row, chunk_col,
                                                     cols, staged);
    }
  }

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t tile_r = tile / tiles_c;
    const RowTile rt = row_tiles.Tile(tile_r, kTile, 1, cursor);
    if (rt.skip) continue;  // uniform across the block
    const int64_t r0 = rt.r0, r_lim = rt.r_lim;
    const int64_t c0 = tile % tiles_c * kTile;
    const int64_t c = c0 + chunk_col;

    // 1. All loads first, 2. the amaxes.
    typename Src::Chunk vals[kPasses];
    LoadTileChunks<kStaged, kVectorIO, kPasses, kRowsPerPass>(src, r0, c, r_lim, cols, chunk_row, staged, vals);
    uint32_t chunk_max[kPasses];
    uint32_t col_max[1][kVec];
    ChunkAndColumnMaxima<1, kPasses, kVec, Src>(vals, chunk_max, col_max);
    // Every staged value is in registers now (the maxima used them all): the next tile's
    // copies may overwrite the slots.
    if constexpr (kStaged) {
      if (tile + gridDim.x < tiles) {
        StageTile<kTile, kTile, kPasses, kRowsPerPass>(src, row_tiles, tile + gridDim.x, tiles_c, 1, chunk_row,
                                                       chunk_col, cols, staged);
      }
    }

    // dbias (the plain walk: tile row tile_r). 1x128 with a colwise copy: the lane sums go to
    // shared memory now and the column totals are added after the colwise exchange's barrier,
    // which then serves both; otherwise TileColumnSums with its own barrier.
    if constexpr (kDbias) {
      if (!kTile2d && colwise != nullptr) {
        StoreLaneSums<Src, kPasses, kRowsPerPass, kTile>(vals, chunk_row, chunk_col, lane_sums);
      } else {
        TileColumnSums<Src, kPasses, kRowsPerPass, kTile>(vals, chunk_row, chunk_col, c0, cols, tile_r, lane_sums,
                                                          dbias_partials);
      }
    }

    float row_scale[kPasses];  // the scale of each of my rows' tile (all equal for 128x128)
    if constexpr (kTile2d) {
      uint32_t m = 0;
#pragma unroll
      for (int p = 0; p < kPasses; ++p) m = max(m, chunk_max[p]);
      const float s = Fp8BlockScale(BlockMaxU32(m), Fmt::kMax, pow2);
#pragma unroll
      for (int p = 0; p < kPasses; ++p) row_scale[p] = s;
      if (threadIdx.x == 0 && !rt.tail) {
        const float inv = ScaleDivRn(1.0f, s);
        if (rowwise != nullptr) row_scale_inv[rt.scale_row * row_dims.dim1 + c0 / kTile] = inv;
        if (colwise != nullptr) col_scale_inv[(c0 / kTile) * row_tiles.col2d_ld + rt.scale_col2d] = inv;
      }
    } else {
      // The kThreadsPerRow lanes of a tile row share its scale (RowBlockValues); lane q also
      // writes pass q's scale_inv.
      const float my_scale = RowBlockValues<kThreadsPerRow>(
          chunk_max, [&](uint32_t m) { return Fp8BlockScale(m, Fmt::kMax, pow2); }, row_scale);
      const int q = threadIdx.x % kThreadsPerRow;
      if (q < kPasses) {
        const int64_t r = r0 + q * kRowsPerPass + chunk_row;
        if (rowwise != nullptr && r < r_lim) {
          row_scale_inv[(c0 / kTile) * row_dims.dim1 + r] = ScaleDivRn(1.0f, my_scale);
        }
      }
      if (colwise != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) col_part[chunk_row][chunk_col + j] = col_max[0][j];
        __syncthreads();
        if (threadIdx.x < kTile) {
          if constexpr (kDbias) FinishColumnSum<kRowsPerPass, kTile>(c0, cols, tile_r, lane_sums, dbias_partials);
          uint32_t m = 0;
#pragma unroll
          for (int g = 0; g < kRowsPerPass; ++g) m = max(m, col_part[g][threadIdx.x]);
          const float s = Fp8BlockScale(m, Fmt::kMax, pow2);
          col_scale[threadIdx.x] = s;
          // Colwise copy Q = x^T: element (c, r) has its 1x128 scale at [r / 128][c] (grouped:
          // at the tile's scale row).
          if (c0 + threadIdx.x < cols && !rt.tail) {
            col_scale_inv[rt.scale_row * col_dims.dim1 + c0 + threadIdx.x] = ScaleDivRn(1.0f, s);
          }
        }
        __syncthreads();
      }
    }

    // 3. Codes. 128x128: the rowwise codes, which are also the colwise ones (via shared
    // memory). 1x128: per chunk, each value converted once and encoded twice, with its row's
    // scale (stored straight out) and with its column's (to shared memory).
    if constexpr (kTile2d) {
      if (rowwise != nullptr || colwise != nullptr) {
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
          const int local_row = p * kRowsPerPass + chunk_row;
          const int64_t r = r0 + local_row;
          float v[kVec], s[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            v[j] = Src::Value(vals[p], j);
            s[j] = row_scale[p];
          }
          uint32_t words[kVec / 4];
          EncodeChunkScaled(Fmt{}, v, s, chunk_max[p] <= 0x7F800000u, words);
          if (Rows::kGrouped && rt.tail) ZeroWords(words);  // both copies group-bound
          if (rowwise != nullptr && r < r_lim) StoreRowCodes<kVectorIO, kVec>(rowwise + r * cols, c, cols, words);
          if (colwise != nullptr) {
#pragma unroll
            for (int j = 0; j < kVec; j += 4) *reinterpret_cast<uint32_t*>(&codes[local_row][chunk_col + j]) = words[j / 4];
          }
        }
      }
    } else {
      float cs[kVec];
      if (colwise != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) cs[j] = col_scale[chunk_col + j];
      }
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        const int local_row = p * kRowsPerPass + chunk_row;
        const int64_t r = r0 + local_row;
        const bool no_nan = chunk_max[p] <= 0x7F800000u;
        float v[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = Src::Value(vals[p], j);
        if (rowwise != nullptr) {
          float s[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) s[j] = row_scale[p];
          uint32_t words[kVec / 4];
          EncodeChunkScaled(Fmt{}, v, s, no_nan, words);
          if (r < r_lim) StoreRowCodes<kVectorIO, kVec>(rowwise + r * cols, c, cols, words);
        }
        if (colwise != nullptr) {
          uint32_t words[kVec / 4];
          EncodeChunkScaled(Fmt{}, v, cs, no_nan, words);
          if (Rows::kGrouped && rt.tail) ZeroWords(words);
#pragma unroll
          for (int j = 0; j < kVec; j += 4) *reinterpret_cast<uint32_t*>(&codes[local_row][chunk_col + j]) = words[j / 4];
        }
      }
    }
    if (colwise == nullptr) {  // uniform across the block
      if constexpr (kDbias) __syncthreads();  // lane_sums is rewritten by the next tile
      continue;
    }
    __syncthreads();

    // 5. Transposed write: item -> 4 tile columns x 8 tile rows, 8 lanes cover 64 bytes.
    if constexpr (!Rows::kGrouped) {
#pragma unroll
      for (int item = threadIdx.x; item < kColItems; item += kThreads) {
        const int row8 = (item % (kTile / 8)) * 8;
        const int col4 = (item / (kTile / 8)) * 4;
        uint32_t w[8], lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = *reinterpret_cast<const uint32_t*>(&codes[row8 + k][col4]);
        TransposeBytes8x4(w, lo, hi);
        const int64_t r = r0 + row8;  // first of my 8 input rows = colwise column
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t oc = c0 + col4 + j;  // colwise row
          if (oc >= cols) break;
          uint8_t* dst = colwise + oc * rows + r;
          if (colwise_vec && r + 8 <= r_lim) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(lo[j], hi[j]);
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              if (r + k < r_lim) dst[k] = uint8_t((k < 4 ? lo[j] : hi[j]) >> (8 * (k % 4)));
            }
          }
        }
      }
    } else {
      // Grouped: r0 (a group start + 128k) need not be a multiple of 8. The 8-row windows
      // are aligned to x's rows instead, so that whole windows stay 8-byte stores: with
      // shift = r0 % 8 != 0 there are 17, the first starting at tile row -shift; rows
      // outside [r0, min(r0 + 128, r_lim)) are neither read nor stored.
      const int shift = int(r0 & 7);
      const int windows = kTile / 8 + (shift != 0 ? 1 : 0);
      const int rows_here = int(min(int64_t(kTile), r_lim - r0));
      for (int item = threadIdx.x; item < windows * (kTile / 4); item += kThreads) {
        const int lr0 = (item % windows) * 8 - shift;  // tile row of the window's first row
        const int col4 = (item / windows) * 4;
        uint32_t w[8], lo[4], hi[4];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int lr = lr0 + k;
          w[k] = lr >= 0 && lr < rows_here ? *reinterpret_cast<const uint32_t*>(&codes[lr][col4]) : 0u;
        }
        TransposeBytes8x4(w, lo, hi);
        const bool whole = colwise_vec && lr0 >= 0 && lr0 + 8 <= rows_here;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t oc = c0 + col4 + j;  // colwise row
          if (oc >= cols) break;
          uint8_t* dst = colwise + oc * rows + (r0 + lr0);
          if (whole) {
            *reinterpret_cast<uint2*>(dst) = make_uint2(lo[j], hi[j]);
          } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              if (lr0 + k >= 0 && lr0 + k < rows_here) dst[k] = uint8_t((k < 4 ? lo[j] : hi[j]) >> (8 * (k % 4)));
            }
          }
        }
      }
    }
    __syncthreads();  // codes and col_scale are rewritten by the next tile
  }
}

// kVectorIO: the source's chunks are whole 16-byte loads (Src::Load) and rowwise / colwise
// are 16-byte aligned: every in-range chunk is one kVec-byte store.
// kStaged: as Fp8BlockTileKernel's.
template <typename Src, typename Fmt, bool kVectorIO, bool kDbias, bool kStaged, typename Rows>
__global__ void __launch_bounds__(kThreads, (Mxfp8TileMinBlocks<Src, kDbias, kStaged>()))
    Mxfp8TileKernel(const Src src, const Rows row_tiles, int64_t rows, int64_t cols,
                        uint8_t* __restrict__ rowwise, uint8_t* __restrict__ row_scale,
                        uint8_t* __restrict__ colwise, uint8_t* __restrict__ col_scale,
                        float* __restrict__ dbias_partials) {
  constexpr int kVec = Src::kVec;  // elements per chunk (16 input bytes)
  constexpr int kThreadsPerRow = kTileCols / kVec;
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  constexpr int kPasses = kTileRows / kRowsPerPass;  // 4 or 8; the first half is block 0
  constexpr int kLanesPerBlock = kBlock / kVec;      // 4 or 8 lanes hold one rowwise block
  __shared__ uint32_t col_part[2][kRowsPerPass][kTileCols];
  __shared__ float col_factor[2][kTileCols];
  __shared__ __align__(16) float lane_sums[kDbias ? kRowsPerPass : 1][kTileCols];  // dbias

  const int64_t tiles_c = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles = row_tiles.TileRows(kTileRows) * tiles_c;
  const int chunk_col = (threadIdx.x % kThreadsPerRow) * kVec;
  const int chunk_row = threadIdx.x / kThreadsPerRow;
  const int64_t row_ld = Mxfp8ScaleDims(rows, cols, false).dim1;
  const int64_t col_ld = Mxfp8ScaleDims(rows, cols, true).dim1;
  typename Rows::Cursor cursor;
  static_assert(!kStaged || (kVectorIO && !Rows::kGrouped && Stageable<Src>::value), "staged: plain vector walk");
  extern __shared__ __align__(16) uint8_t staged_bytes[];  // kStaged: the next tile's chunks
  uint4* const staged = reinterpret_cast<uint4*>(staged_bytes);
  if constexpr (kStaged) {
    if (blockIdx.x < tiles) {
      StageTile<kTileRows, kTileCols, kPasses, kRowsPerPass>(src, row_tiles, blockIdx.x, tiles_c, kTileRows / kBlock,
                                                             chunk_row, chunk_col, cols, staged);
    }
  }

  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const RowTile rt = row_tiles.Tile(tile / tiles_c, kTileRows, kTileRows / kBlock, cursor);
    if (rt.skip) continue;  // uniform across the block
    const int64_t r0 = rt.r0, r_lim = rt.r_lim;
    const int64_t c0 = tile % tiles_c * kTileCols;
    const int64_t c = c0 + chunk_col;

    typename Src::Chunk vals[kPasses];
    LoadTileChunks<kStaged, kVectorIO, kPasses, kRowsPerPass>(src, r0, c, r_lim, cols, chunk_row, staged, vals);
    uint32_t chunk_max[kPasses];
    uint32_t col_max[2][kVec];  // the tile's two 32-row blocks
    ChunkAndColumnMaxima<2, kPasses, kVec, Src>(vals, chunk_max, col_max);
    if constexpr (kStaged) {  // as in Fp8BlockTileKernel: every staged value is in registers
      if (tile + gridDim.x < tiles) {
        StageTile<kTileRows, kTileCols, kPasses, kRowsPerPass>(src, row_tiles, tile + gridDim.x, tiles_c,
                                                               kTileRows / kBlock, chunk_row, chunk_col, cols, staged);
      }
    }

    // dbias (the plain walk: tile row r0 / kTileRows); with a colwise copy the column totals
    // are added after the colwise exchange's barrier, as in Fp8BlockTileKernel.
    const int64_t tile_r = r0 / kTileRows;
    if constexpr (kDbias) {
      if (colwise != nullptr) {
        StoreLaneSums<Src, kPasses, kRowsPerPass, kTileCols>(vals, chunk_row, chunk_col, lane_sums);
      } else {
        TileColumnSums<Src, kPasses, kRowsPerPass, kTileCols>(vals, chunk_row, chunk_col, c0, cols, tile_r,
                                                              lane_sums, dbias_partials);
      }
    }

    // Rowwise E8M0 bytes: the kLanesPerBlock lanes of a 32-value block share it
    // (RowBlockValues); lane q also writes pass q's.
    uint32_t row_e[kPasses];
    if (rowwise != nullptr) {
      const uint32_t my_e = RowBlockValues<kLanesPerBlock>(
          chunk_max, [](uint32_t m) { return uint32_t(Mxfp8ScaleByte(m, Fmt::kMax)); }, row_e);
      const int q = threadIdx.x % kLanesPerBlock;
      const int64_t c_block = c - q * kVec;  // the block's first column
      if (q < kPasses) {
        const int64_t r = r0 + q * kRowsPerPass + chunk_row;
        if (r < r_lim && c_block < cols) row_scale[r * row_ld + c_block / kBlock] = uint8_t(my_e);
      }
    }

    // Colwise E8M0 bytes and factors, through shared memory.
    if (colwise != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        col_part[0][chunk_row][chunk_col + j] = col_max[0][j];
        col_part[1][chunk_row][chunk_col + j] = col_max[1][j];
      }
      __syncthreads();
      if constexpr (kDbias) {
        if (threadIdx.x < kTileCols) FinishColumnSum<kRowsPerPass, kTileCols>(c0, cols, tile_r, lane_sums, dbias_partials);
      }
      {
        const int half = threadIdx.x / kTileCols, col = threadIdx.x % kTileCols;  // 256 = 2 x 128
        uint32_t m = 0;
#pragma unroll
        for (int g = 0; g < kRowsPerPass; ++g) m = max(m, col_part[half][g][col]);
        const uint8_t e = Mxfp8ScaleByte(m, Fmt::kMax);
        col_factor[half][col] = Mxfp8EncodeFactor(e);
        if (r0 + half * kBlock < r_lim && c0 + col < cols && !rt.tail) col_scale[(rt.scale_row + half) * col_ld + c0 + col] = e;
      }
      __syncthreads();
    }

    // Codes: each value converted once, encoded with its row block's factor and its column
    // block's, both copies stored in x's layout.
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int64_t r = r0 + p * kRowsPerPass + chunk_row;
      float v[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = Src::Value(vals[p], j);
      if (rowwise != nullptr) {
        float f[kVec];
        const float factor = Mxfp8EncodeFactor(row_e[p]);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f[j] = factor;
        uint32_t words[kVec / 4];
        EncodeChunkScaled(Fmt{}, v, f, chunk_max[p] <= 0x7F800000u && row_e[p] != 0xFFu, words);
        if (r < r_lim) StoreRowCodes<kVectorIO, kVec>(rowwise + r * cols, c, cols, words);
      }
      if (colwise != nullptr) {
        float f[kVec];
        bool factors_ok = true;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          f[j] = col_factor[p / (kPasses / 2)][chunk_col + j];
          factors_ok &= !IsNanBits(FloatBits(f[j]));
        }
        uint32_t words[kVec / 4];
        EncodeChunkScaled(Fmt{}, v, f, chunk_max[p] <= 0x7F800000u && factors_ok, words);
        if (Rows::kGrouped && rt.tail) ZeroWords(words);
        if (r < r_lim) StoreRowCodes<kVectorIO, kVec>(colwise + r * cols, c, cols, words);
      }
    }
    // col_part / col_factor (colwise) and lane_sums (dbias) are rewritten by the next tile;
    // colwise is uniform across the block.
    if (colwise != nullptr || kDbias) __syncthreads();
  }
}

// Zeroes an FP8 block scale_inv of a stored r x c copy where it has padding entries.
inline Status ZeroFp8BlockScalePadding(float* scale_inv, int64_t r, int64_t c, bool tile_2d, const char* op,
                                       GpuStream stream) {
  if (scale_inv == nullptr) return Status::Ok();
  const int64_t used = tile_2d ? CeilDivI64(c, kFp8BlockLen) : r;
  const ScaleDims d = Fp8BlockScaleDims(r, c, tile_2d);
  if (used == d.dim1) return Status::Ok();
  return CudaStatus(cudaMemsetAsync(scale_inv, 0, size_t(d.size()) * sizeof(float), stream), op, "cudaMemsetAsync");
}

// Zeroes an MXFP8 scale array of a rows x cols tensor where it has padding entries.
inline Status ZeroMxfp8ScalePadding(uint8_t* scale, int64_t rows, int64_t cols, bool colwise, const char* op,
                                    GpuStream stream) {
  if (scale == nullptr) return Status::Ok();
  const ScaleDims d = Mxfp8ScaleDims(rows, cols, colwise);
  const int64_t used0 = colwise ? CeilDivI64(rows, kBlock) : rows;
  const int64_t used1 = colwise ? cols : CeilDivI64(cols, kBlock);
  if (used0 == d.dim0 && used1 == d.dim1) return Status::Ok();
  return CudaStatus(cudaMemsetAsync(scale, 0, size_t(d.size()), stream), op, "cudaMemsetAsync");
}

// Launches Fp8BlockTileKernel over a's outputs with the row tiling `row_tiles` (a.x and
// a.x_dtype are not used: the source is the input; a.rows is x's row count, the colwise
// copy's leading dim). src_vector_ok: the source's chunks are whole 16-byte loads.
// Scale padding is the caller's.
template <typename Src, typename Fmt, bool kTile2d, bool kDbias = false, typename Rows>
Status LaunchFp8BlockTileKernel(const Src& src, bool src_vector_ok, const Rows& row_tiles,
                                const QuantizeFp8BlockArgs& a, const char* op, GpuStream stream,
                                float* dbias_partials = nullptr) {
  static_assert(!(kDbias && Rows::kGrouped), "dbias: the plain walk only");
  if (kDbias != (dbias_partials != nullptr)) return Status::Internal(std::string(op) + ": dbias: workspace mismatch");
  const int64_t tiles = row_tiles.TileRows(kTile) * CeilDivI64(a.cols, kTile);
  const bool vec_io = src_vector_ok && (a.rowwise == nullptr || Aligned(a.rowwise, 16));
  const bool colwise_vec = a.colwise != nullptr && Aligned(a.colwise, 8) && a.rows % 8 == 0;
  if constexpr (Stageable<Src>::value && !Rows::kGrouped) {
    bool staged = false;
    const bool default_on = !(kTile2d && sizeof(typename Src::T) == 2);
    LOWBIT_RETURN_IF_ERROR(BlockTileStaging(op, default_on, &staged));
    if (vec_io && staged) {
      bool launched = false;
      LOWBIT_RETURN_IF_ERROR(LaunchStagedIfFits(Fp8BlockTileKernel<Src, Fmt, kTile2d, true, kDbias, true, Rows>,
                                                StagedTileBytes<Src, kTile, kTile>(), tiles, op, stream, &launched,
                                                src, row_tiles, a.rows, a.cols, a.pow2_scales, a.rowwise,
                                                a.rowwise_scale_inv, a.colwise, a.colwise_scale_inv, colwise_vec,
                                                dbias_partials));
      if (launched) return Status::Ok();
    }
  }
  // Unstaged: twice the resident blocks, so that blocks loading overlap blocks encoding.
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 2 * Fp8TileMinBlocks<Src, kTile2d, kDbias, false>());
  if (vec_io) {
    Fp8BlockTileKernel<Src, Fmt, kTile2d, true, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.pow2_scales, a.rowwise, a.rowwise_scale_inv, a.colwise,
        a.colwise_scale_inv, colwise_vec, dbias_partials);
  } else {
    Fp8BlockTileKernel<Src, Fmt, kTile2d, false, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.pow2_scales, a.rowwise, a.rowwise_scale_inv, a.colwise,
        a.colwise_scale_inv, colwise_vec, dbias_partials);
  }
  return LaunchStatus(op);
}

// Launches Fp8BlockTileKernel over a's outputs (the plain walk), zeroing scale padding first;
// with dbias_partials (ceil(rows / 128) x cols fp32), the tile column sums of block_dbias.h.
template <typename Src, typename Fmt, bool kTile2d, bool kDbias = false>
Status LaunchFp8BlockTiles(const Src& src, bool src_vector_ok, const QuantizeFp8BlockArgs& a, const char* op,
                           GpuStream stream, float* dbias_partials = nullptr) {
  LOWBIT_RETURN_IF_ERROR(ZeroFp8BlockScalePadding(a.rowwise_scale_inv, a.rows, a.cols, kTile2d, op, stream));
  LOWBIT_RETURN_IF_ERROR(ZeroFp8BlockScalePadding(a.colwise_scale_inv, a.cols, a.rows, kTile2d, op, stream));
  UniformRowTiles row_tiles;
  row_tiles.rows = a.rows;
  row_tiles.col2d_ld = Fp8BlockScaleDims(a.cols, a.rows, true).dim1;
  return LaunchFp8BlockTileKernel<Src, Fmt, kTile2d, kDbias>(src, src_vector_ok, row_tiles, a, op, stream,
                                                             dbias_partials);
}

// Launches Mxfp8TileKernel over a's outputs with the row tiling `row_tiles`, as above.
template <typename Src, typename Fmt, bool kDbias = false, typename Rows>
Status LaunchMxfp8TileKernel(const Src& src, bool src_vector_ok, const Rows& row_tiles, const QuantizeMxfp8Args& a,
                             const char* op, GpuStream stream, float* dbias_partials = nullptr) {
  static_assert(!(kDbias && Rows::kGrouped), "dbias: the plain walk only");
  if (kDbias != (dbias_partials != nullptr)) return Status::Internal(std::string(op) + ": dbias: workspace mismatch");
  const int64_t tiles = row_tiles.TileRows(kTileRows) * CeilDivI64(a.cols, kTileCols);
  const bool vec_io = src_vector_ok && (a.rowwise == nullptr || Aligned(a.rowwise, 16)) &&
                      (a.colwise == nullptr || Aligned(a.colwise, 16));
  if constexpr (Stageable<Src>::value && !Rows::kGrouped) {
    bool staged = false;
    const bool default_on = kDbias || sizeof(typename Src::T) != 2;
    LOWBIT_RETURN_IF_ERROR(BlockTileStaging(op, default_on, &staged));
    if (vec_io && staged) {
      bool launched = false;
      LOWBIT_RETURN_IF_ERROR(LaunchStagedIfFits(Mxfp8TileKernel<Src, Fmt, true, kDbias, true, Rows>,
                                                StagedTileBytes<Src, kTileRows, kTileCols>(), tiles, op, stream,
                                                &launched, src, row_tiles, a.rows, a.cols, a.rowwise,
                                                a.rowwise_scale, a.colwise, a.colwise_scale, dbias_partials));
      if (launched) return Status::Ok();
    }
  }
  // Unstaged: twice the resident blocks, as for the FP8 block kernel.
  const int blocks = GridStrideBlocks(tiles * kThreads, kThreads, 2 * Mxfp8TileMinBlocks<Src, kDbias, false>());
  if (vec_io) {
    Mxfp8TileKernel<Src, Fmt, true, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.rowwise, a.rowwise_scale, a.colwise, a.colwise_scale, dbias_partials);
  } else {
    Mxfp8TileKernel<Src, Fmt, false, kDbias, false, Rows><<<blocks, kThreads, 0, stream>>>(
        src, row_tiles, a.rows, a.cols, a.rowwise, a.rowwise_scale, a.colwise, a.colwise_scale, dbias_partials);
  }
  return LaunchStatus(op);
}

// Launches Mxfp8TileKernel over a's outputs (the plain walk), zeroing scale padding first;
// with dbias_partials (ceil(rows / 64) x cols fp32), the tile column sums of block_dbias.h.
template <typename Src, typename Fmt, bool kDbias = false>
Status LaunchMxfp8Tiles(const Src& src, bool src_vector_ok, const QuantizeMxfp8Args& a, const char* op,
                        GpuStream stream, float* dbias_partials = nullptr) {
  LOWBIT_RETURN_IF_ERROR(ZeroMxfp8ScalePadding(a.rowwise_scale, a.rows, a.cols, false, op, stream));
  LOWBIT_RETURN_IF_ERROR(ZeroMxfp8ScalePadding(a.colwise_scale, a.rows, a.cols, true, op, stream));
  UniformRowTiles row_tiles;
  row_tiles.rows = a.rows;
  return LaunchMxfp8TileKernel<Src, Fmt, kDbias>(src, src_vector_ok, row_tiles, a, op, stream, dbias_partials);
}

}  // namespace block_tiles
}  // namespace lowbit
