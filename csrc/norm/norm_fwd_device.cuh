// The device-side pieces of the normalization forward kernel (norm_fwd_kernel.cuh), private
// to norm_fwd.cu's translation unit (an unnamed namespace, like the rest of that file): the
// launch constants and FwdParams, shared with the launcher in norm_fwd.cu; the colwise
// cluster-tile barriers and transposed stores; the FP8 encoding of a chunk as 32-bit words.
//
// Colwise: the codes of a block tile (tile_rows rows) are staged in shared memory
// ([tile_rows][stride] bytes after the row stages, stride = hidden rounded up to 16, + 4 so
// that stride / 4 is odd and the transposing reads are bank-conflict free), then written
// transposed in column segments of `span` rows (colspan: 32, 64 or 128; whole 32-byte
// sectors at least: 16-byte halves written apart in time cost HBM read-modify-writes, 2x
// slower on H100): each thread takes 4 columns x 16 (or 4) rows, transposes 4x4 byte
// blocks with byte permutes and stores 16 (4) contiguous bytes per column, span / 16
// neighbouring threads one whole segment. A cluster of span / tile_rows blocks (sm_90+, up
// to 16) takes consecutive block tiles (one cluster tile) and each block writes a share of
// the columns of all span rows, reading its peers' codes through distributed shared memory
// between two cluster barriers: a whole one before (every block's codes are staged) and
// one after (no block restages or exits while peers read), split (colsplit) into an arrive
// right after the stores and a wait before the next tile's first codes are staged, so the
// next row's loads and sums overlap it. Cluster tiles go to clusters in contiguous ranges
// or interleaved (colorder), so neighbouring segments of a 128-byte line are written at
// about the same time. The cluster barriers order shared memory only (colbar, the default:
// restricted fences and a relaxed arrive) instead of a release arrive, which on sm_90 waits
// for every global store in flight (ClusterArrive).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "norm/norm_cuda.cuh"
#include "norm/norm_math.h"

namespace lowbit {
namespace {

using namespace norm_cuda;

constexpr const char* kOp = "lowbit_norm_forward";
constexpr int kMaxTileRows = 32;  // block tile rows without clusters, and the coltile knob's
constexpr int kMaxSpan = 128;     // rows per cluster tile: 128-byte column segments
constexpr int kMaxCluster = 16;   // blocks per cluster (non-portable above 8, sm_90)
constexpr int kStaticSmem = 1024; // partial sums and BlockMaxU32, rounded up
constexpr int kStaticUsed = 512;   // the static bytes used (384: partial, BlockMaxU32), rounded
constexpr int kL1Floor = 28 * 1024;  // L1 left at the largest carveout (sm_80..sm_100)
constexpr int kParamRegsThreads = 512;  // parkeep: __launch_bounds__ of the kernel

struct FwdParams {
  const void* x;
  const void* gamma;
  const void* beta;
  const float* scale;
  void* y;
  float* mu;
  float* rsigma;
  uint8_t* q_row;
  uint8_t* q_col;
  uint32_t* amax_bits;
  int64_t rows;
  int64_t tiles;        // ceil(rows / tile_rows)
  int hidden;
  int threads_per_row;
  int tile_rows;        // rows per block tile: groups << per_tile_log2 (a power of two)
  int tile_rows_log2;
  int cluster;          // blocks per cluster (colwise, sm_90+; else 1): a cluster tile is
  int cluster_log2;     // `cluster` consecutive block tiles, one per block of the cluster
  bool interleave;      // cluster tiles interleaved over the clusters, else contiguous
  bool split_sync;      // colwise: the barrier after the transposed stores split in two
  bool shared_fences;   // colwise clusters: barriers order shared memory only (colbar)
  int per_tile_log2;    // log2(rows of one group per tile)
  int tile_stride;      // bytes per staged row of codes (colwise)
  int stages;           // row stages in shared memory (vectorized path), >= 1
  int param_offset;     // parsmem: byte offset of the staged fp32 gamma/beta in the dynamic
                        // shared memory (after the codes tile; 0: loaded per row)
  float epsilon;
  bool layernorm, zero_centered, gamma_f32, e5m2;
  bool col_words;       // q_col 16-byte aligned, hidden % 4 == 0 (word transposes)
};

// The staged codes of row rr of the cluster tile: in the shared memory of cluster block
// rr / tile_rows (distributed shared memory, sm_90+), else of this block.
__device__ __forceinline__ const uint8_t* CodeRow(const FwdParams& p, const uint8_t* tile, int rr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster > 1) {
    const uint8_t* base = cooperative_groups::this_cluster().map_shared_rank(
        tile, unsigned(rr >> p.tile_rows_log2));
    return base + (rr & (p.tile_rows - 1)) * p.tile_stride;
  }
#endif
  return tile + rr * p.tile_stride;
}

// Arrive at the cluster barrier. colbar=0: release semantics at cluster scope, which on
// sm_90 waits for every earlier global store of the thread (MEMBAR.ALL.GPU: the y, rowwise
// and transposed stores in flight). colbar=1 (the default): only shared memory is ordered,
// by a fence restricted to it (PTX 8.6) and a relaxed arrive: `after_reads` (the barrier
// that keeps a block from restaging codes its peers still read) orders this thread's reads
// of the cluster's shared memory (acquire fence), else (codes staged) its shared memory
// writes (release fence), before the arrive.
__device__ __forceinline__ void ClusterArrive(const FwdParams& p, bool after_reads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (!p.shared_fences) {
    asm volatile("barrier.cluster.arrive.release;" ::: "memory");
  } else {
    if (after_reads) {
      asm volatile("fence.acquire.sync_restrict::shared::cluster.cluster;" ::: "memory");
    } else {
      asm volatile("fence.release.sync_restrict::shared::cta.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
  }
#endif
}

// Barrier of the blocks that share a cluster tile (release/acquire of their shared memory);
// `after_reads` as in ClusterArrive.
__device__ __forceinline__ void TileSync(const FwdParams& p, bool after_reads) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster > 1) {
    ClusterArrive(p, after_reads);
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
    return;
  }
#endif
  __syncthreads();
}

// The barrier after the transposed stores, split (colsplit): TileArrive right after them,
// TileWait before the block stages the next tile's codes (or exits). Release/acquire: the
// peers' reads of this block's codes are performed before the wait returns.
__device__ __forceinline__ void TileArrive(const FwdParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster > 1) ClusterArrive(p, true);
#endif
}
__device__ __forceinline__ void TileWait(const FwdParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster > 1) {
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
    return;
  }
#endif
  __syncthreads();
}

// Writes kG rows x 4 columns (rows rs.., columns c..) of the staged cluster tile to q_col
// rows r0 + rs.., as kG contiguous bytes per column (one 16- or 4-byte store). A 4-row
// block lies in one block's tile (tile_rows >= 4).
template <int kG>
__device__ __forceinline__ void WriteColumnBlock(const FwdParams& p, const uint8_t* tile,
                                                 int64_t r0, int rs, int c) {
  uint32_t cols[4][kG / 4];
#pragma unroll
  for (int m = 0; m < kG / 4; ++m) {
    const uint8_t* src = CodeRow(p, tile, rs + 4 * m) + c;
    uint32_t t[4];
    Transpose4x4Bytes(*reinterpret_cast<const uint32_t*>(src),
                      *reinterpret_cast<const uint32_t*>(src + p.tile_stride),
                      *reinterpret_cast<const uint32_t*>(src + 2 * p.tile_stride),
                      *reinterpret_cast<const uint32_t*>(src + 3 * p.tile_stride), t);
#pragma unroll
    for (int j = 0; j < 4; ++j) cols[j][m] = t[j];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint8_t* dst = p.q_col + int64_t(c + j) * p.rows + r0 + rs;
    if constexpr (kG == 16) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(cols[j][0], cols[j][1], cols[j][2], cols[j][3]);
    } else {
      *reinterpret_cast<uint32_t*>(dst) = cols[j][0];
    }
  }
}

// Writes the staged cluster tile rows [r0, r0 + n) transposed into q_col (hidden x rows);
// the blocks of a cluster take interleaved shares of the column blocks. Threads i .. i +
// span / 16 - 1 write the 16-byte pieces of one span-row column segment (a full tile), so
// each store instruction covers whole segments of 32, 64 or 128 bytes.
__device__ __forceinline__ void WriteTransposed(const FwdParams& p, const uint8_t* tile, int64_t r0, int n) {
  const int h = p.hidden;
  const int span_log2 = p.tile_rows_log2 + p.cluster_log2;
  const bool full = n == 1 << span_log2;
  const int first = (blockIdx.x & (p.cluster - 1)) * blockDim.x + threadIdx.x;
  const int step = p.cluster * blockDim.x;
  if (p.col_words && p.rows % 16 == 0 && n % 16 == 0) {
    // Row blocks of 16 (r0 is a multiple of 16: the span is >= 16 here, since n % 16 == 0).
    const int per_col = n >> 4, items = (h >> 2) * per_col;
    const int shift = full ? span_log2 - 4 : 0;
    for (int i = first; i < items; i += step) {
      const int rb = full ? (i & (per_col - 1)) : i % per_col;
      const int cb = full ? (i >> shift) : i / per_col;
      WriteColumnBlock<16>(p, tile, r0, rb * 16, cb * 4);
    }
  } else if (p.col_words && p.rows % 4 == 0 && n % 4 == 0) {
    const int per_col = n >> 2, items = (h >> 2) * per_col;
    for (int i = first; i < items; i += step) {
      WriteColumnBlock<4>(p, tile, r0, (i % per_col) * 4, (i / per_col) * 4);
    }
  } else {
    for (int i = first; i < h * n; i += step) {
      const int c = i / n, r = i - c * n;
      p.q_col[int64_t(c) * p.rows + r0 + r] = CodeRow(p, tile, r)[c];
    }
  }
}

// FP8 codes of y * scale as little-endian 32-bit words (Fp32Mul: the product of
// NormQuantize); `hw_ok` as in EncodeFp8.
template <int kVec>
__device__ __forceinline__ void EncodeFp8Words(const float (&y)[kVec], float scale, bool e5m2,
                                               bool hw_ok, uint32_t (&w)[kVec / 4]) {
  if (LOWBIT_HAS_CVT_FP8X2 && hw_ok && kVec < 8) {
#pragma unroll
    for (int m = 0; m < kVec / 4; ++m) {
      const uint32_t lo = CvtFp8PairHw(e5m2, Fp32Mul(y[4 * m], scale), Fp32Mul(y[4 * m + 1], scale));
      const uint32_t hi = CvtFp8PairHw(e5m2, Fp32Mul(y[4 * m + 2], scale), Fp32Mul(y[4 * m + 3], scale));
      w[m] = __byte_perm(lo, hi, 0x5410);
    }
  } else if (LOWBIT_HAS_CVT_FP8X2 && hw_ok) {
    // 2-byte x (8 codes per chunk): one branch per chunk on the format (uniform) and the
    // pairs packed by the cvt, not a select per pair and masked halves (f32 x keeps the
    // select: the branch costs its kernels spills).
    auto encode = [&](auto e5m2_tag) {
#pragma unroll
      for (int m = 0; m < kVec / 4; ++m) {
        w[m] = CvtFp8QuadHw<decltype(e5m2_tag)::value>(
            Fp32Mul(y[4 * m], scale), Fp32Mul(y[4 * m + 1], scale),
            Fp32Mul(y[4 * m + 2], scale), Fp32Mul(y[4 * m + 3], scale));
      }
    };
    if (e5m2) {
      encode(std::true_type{});
    } else {
      encode(std::false_type{});
    }
  } else {
#pragma unroll
    for (int m = 0; m < kVec / 4; ++m) {
      w[m] = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) w[m] |= uint32_t(NormQuantize(y[4 * m + i], scale, e5m2)) << (8 * i);
    }
  }
}

}  // namespace
}  // namespace lowbit
