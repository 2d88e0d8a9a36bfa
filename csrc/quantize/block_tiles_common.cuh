// The shared pieces of the block-quantize tile kernels (block_tiles.cuh, which includes this
// file and the two kernel headers): tile constants, the plain row walk (UniformRowTiles),
// PlainSource, the staged-load machinery (BlockTileStaging, LaunchStagedIfFits, StageTile),
// the dbias column sums and the load / amax / rowwise-store steps both kernels take.
// The kernels: block_tiles_fp8.cuh (Fp8BlockTileKernel), block_tiles_mxfp8.cuh
// (Mxfp8TileKernel); the template interface they use is described in block_tiles.cuh.
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

}  // namespace block_tiles
}  // namespace lowbit
