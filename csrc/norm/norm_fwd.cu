// CUDA normalization forward (LayerNorm / RMSNorm) with the fused FP8 quantization,
// rowwise and transposed (colwise), and the amax of y (see norm.h for the math).
//
// One row group (threads_per_row threads, kChunks 16-byte chunks per thread; scalars on the
// unaligned path) per row; the row stays in registers between the statistics and the output
// pass. Each block owns a contiguous range of row tiles; its row groups take the tile's rows
// interleaved. Rows are prefetched `stages - 1` rows ahead with cp.async into shared memory
// ([stages][kChunks][threads] 16-byte slots, each thread reading back only its own slots),
// so the rows in flight cost no registers (vectorized path only; the unaligned scalar path
// loads each row when it gets to it).
// Per row: one warp-shuffle tree + one named barrier per sum (the row group only, never the
// block), sum x then sum (x - mu)^2 (the two-pass variance; the squares are accumulated by
// FMA), mu and var by correctly rounded division. d = x - mu is kept in registers for y.
// gamma/beta (NormWeight applied) stay in registers for rows of <= 8 items per thread.
// Conversions: y to bf16/f16 and the FP8 codes use the hardware cvt.rn instructions, exact
// against the formats.h codecs except for NaN; a chunk holding a NaN (seen from its amax
// bits), or any chunk when scale is 0/inf/NaN, takes the codecs. Outputs are template
// switches (quantize, colwise), so the plain forward does no FP8 work.
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
// gamma/beta: in registers (<= 8 items per thread, no colwise; parkeep, the default colwise
// kernel for vectorized rows of <= 512 threads: a separate kernel bounded to 512 threads,
// 3 row stages, 88.1% / 85.7% of copy at hidden 4096 / 8192 on an H100), else loaded per
// row through L1 (at 8192 L1 keeps 28 KB of the 64 KB of f32 gamma + beta) or (parsmem,
// vectorized rows) staged once per block as fp32 in shared memory.
// Tuning (items per thread, stages, block sizes): NormFwdTuning in norm_plan.h, overridable
// through LOWBIT_NORM_FWD_VARIANT for benchmarks.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "norm/norm.h"
#include "norm/norm_check.h"
#include "norm/norm_cuda.cuh"
#include "norm/norm_math.h"
#include "norm/norm_plan.h"

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

// Iteration k of row group `group` of a block handles row
//   (tile(k / per_tile) * cluster + rank) * tile_rows + group + (k % per_tile) * groups,
// per_tile = tile_rows / groups, rank = the block's rank in its cluster, tile(s) the
// cluster's s-th cluster tile: t_begin + s (contiguous ranges) or cluster_id + s * clusters
// (interleaved); a cluster tile's rows split into one block tile per rank, a block tile's
// rows interleaved over the groups. Every group of every block of a cluster runs the same
// number of iterations (rows past the end are masked), so a tile ends for the whole
// cluster at once (the colwise barriers).
//
// kParamRegs (parkeep, colwise vectorized rows only): gamma (NormWeight applied) and beta
// are held as fp32 in registers for the whole kernel: a thread's columns are the same in
// every row it handles (first_elem depends on the lane only), so they are loaded once,
// before the row loop, and no parameter load follows a barrier. They take 2 x kChunks x
// kVec registers (32 at 16 items), which the 64 registers of a 1024-thread block do not
// hold beside the colwise row state (63-64 used): such kernels are bounded to 512 threads
// (128 registers; one block per SM when they use more than 64). The kParamRegs = false
// instantiations are the kernels of the other settings, unchanged. No synchronization is
// added: the parameters are private registers, read from global memory (never written by
// the kernel) before the first barrier; the shared-memory protocol (row stages, code tile,
// cluster or block barriers) is the kParamRegs = false kernel's.
template <typename Tag, int kChunks, bool kVectorized, bool kQuant, bool kColwise,
          bool kParamRegs = false>
__global__ void __launch_bounds__(kParamRegs ? kParamRegsThreads : 1024) NormForwardKernel(FwdParams p) {
  using T = typename Tag::Storage;
  constexpr int kVec = kVectorized ? 16 / int(sizeof(T)) : 1;
  using Raw = RawChunk<T, kVec>;
  using Words = typename Raw::Words;
  static_assert(!kParamRegs || (kColwise && kVectorized), "parkeep: colwise vectorized rows");
  // gamma/beta as fp32 in registers (2 x 8 of them at most, not beside the colwise
  // staging: spills; all of them with kParamRegs, see above); else loaded per row (L1),
  // vectorized rows with the gamma dtype and beta as uniform branches around the output
  // pass (kDispatch).
  constexpr bool kKeepParams = (kChunks * kVec <= 8 && !kColwise) || kParamRegs;
  constexpr bool kDispatch = kVectorized && !kKeepParams;
  constexpr bool kCodeWords = kVec % 4 == 0;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float partial[2][32];

  const int tpr = p.threads_per_row;
  const int group = threadIdx.x / tpr, lane = threadIdx.x - group * tpr;
  const int groups = blockDim.x / tpr;
  const int h = p.hidden;
  const float hidden_f = float(h);
  const float scale = kQuant ? *p.scale : 1.0f;
  const bool scale_ok = kQuant && ScaleKeepsFinite(scale);
  const T* const x = static_cast<const T*>(p.x);
  // Row stages: slot s, chunk j of this thread at stage[(s * kChunks + j) * blockDim.x +
  // threadIdx.x]; the colwise tile follows them.
  uint8_t* const tile = smem + (kVectorized ? size_t(p.stages) * kChunks * blockDim.x * 16 : 0);
  const uint32_t my_stage = SharedAddress(smem) + threadIdx.x * 16;
  const uint32_t chunk_bytes = blockDim.x * 16, slot_bytes = kChunks * chunk_bytes;

  // 32-bit row arithmetic: the launcher keeps rows + tile_rows below 2^31.
  const int rank = blockIdx.x & (p.cluster - 1);
  const int clusters = gridDim.x >> p.cluster_log2, cluster_id = blockIdx.x >> p.cluster_log2;
  int t_begin = cluster_id, t_step = clusters, my_tiles;  // interleaved
  if (p.interleave) {
    my_tiles = int((p.tiles - cluster_id + clusters - 1) / clusters);
  } else {
    t_begin = int(int64_t(cluster_id) * p.tiles / clusters);
    my_tiles = int(int64_t(cluster_id + 1) * p.tiles / clusters) - t_begin;
    t_step = 1;
  }
  const int iters = my_tiles << p.per_tile_log2;
  const int per_tile_mask = (1 << p.per_tile_log2) - 1;
  auto tile_of = [&](int k) { return t_begin + (k >> p.per_tile_log2) * t_step; };
  auto row_in_tile = [&](int k) { return group + (k & per_tile_mask) * groups; };
  auto row_of = [&](int k) {
    return (((tile_of(k) << p.cluster_log2) + rank) << p.tile_rows_log2) + row_in_tile(k);
  };
  auto first_elem = [&](int j) { return (j * tpr + lane) * kVec; };

  // parsmem (vectorized rows whose parameters are not kept in registers): gamma (NormWeight
  // applied) and beta as fp32 quads
  // in shared memory, quad m of chunk c (elements c * kVec + 4m ..) at [m * chunks + c], beta
  // after gamma, so a warp's 16-byte reads of one chunk are contiguous (no bank conflicts).
  constexpr bool kParamSmem = kDispatch && kVec % 4 == 0;
  const bool params_smem = kParamSmem && p.param_offset != 0;
  float4* const param_quads = reinterpret_cast<float4*>(smem + p.param_offset);
  const int chunks_per_row = h / kVec;  // vectorized rows: h % kVec == 0
  if constexpr (kParamSmem) {
    if (params_smem) {
      for (int i = threadIdx.x; i < h / 4; i += blockDim.x) {
        const int e = 4 * i, q = (e % kVec) / 4 * chunks_per_row + e / kVec;
        float v[4];
        LoadParamChunk<Tag, 4>(p.gamma, p.gamma_f32, e, v);
        param_quads[q] = make_float4(NormWeight(v[0], p.zero_centered), NormWeight(v[1], p.zero_centered),
                                     NormWeight(v[2], p.zero_centered), NormWeight(v[3], p.zero_centered));
        if (p.layernorm) {
          LoadParamChunk<Tag, 4>(p.beta, p.gamma_f32, e, v);
          param_quads[(kVec / 4) * chunks_per_row + q] = make_float4(v[0], v[1], v[2], v[3]);
        }
      }
      __syncthreads();  // uniform: every thread of the block is here
    }
  }

  float w_keep[kKeepParams ? kChunks : 1][kVec] = {}, b_keep[kKeepParams ? kChunks : 1][kVec] = {};
  if constexpr (kKeepParams) {
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int e = first_elem(j);
      if (e >= h) continue;
      LoadParamChunk<Tag, kVec>(p.gamma, p.gamma_f32, e, w_keep[j]);
#pragma unroll
      for (int k = 0; k < kVec; ++k) w_keep[j][k] = NormWeight(w_keep[j][k], p.zero_centered);
      if (p.layernorm) LoadParamChunk<Tag, kVec>(p.beta, p.gamma_f32, e, b_keep[j]);
    }
  }

  // Copies the row of iteration k (if any) into the next stage slot; one commit group per
  // call, empty past the end, so that CpAsyncWait(stages - 1) always means "row k is here".
  int slot_in = 0, slot_out = 0;
  auto issue = [&](int k) {
    if (k < iters) {
      const int r = row_of(k);
      if (r < p.rows) {
        const T* src = x + int64_t(r) * h + first_elem(0);
        const uint32_t dst = my_stage + slot_in * slot_bytes;
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          if (first_elem(j) < h) CpAsync16(dst + j * chunk_bytes, src + j * tpr * kVec);
        }
      }
    }
    CpAsyncCommit();
    slot_in = slot_in + 1 == p.stages ? 0 : slot_in + 1;
  };
  if constexpr (kVectorized) {
    for (int s = 0; s + 1 < p.stages; ++s) issue(s);
  }

  uint32_t amax_bits = 0;
  int parity = 0;
  for (int k = 0; k < iters; ++k) {
    const int r = row_of(k);
    const bool row_ok = r < p.rows;  // uniform in the group
    Raw cur[kChunks];
    if constexpr (kVectorized) {
      // The slot written now was read (and its values used) in the previous iteration.
      issue(k + p.stages - 1);
      CpAsyncWait(p.stages - 1);
      const uint32_t src = my_stage + slot_out * slot_bytes;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        if (row_ok && first_elem(j) < h) {
          const uint4 v = LoadShared16(src + j * chunk_bytes);
          static_assert(sizeof(Words) == sizeof(uint4), "a staged chunk is 16 bytes");
          memcpy(&cur[j].w, &v, sizeof(v));
        } else {
          ZeroRaw(cur[j]);
        }
      }
      slot_out = slot_out + 1 == p.stages ? 0 : slot_out + 1;
    } else {
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int e = first_elem(j);
        if (row_ok && e < h) {
          LoadRaw(x + int64_t(r) * h + e, cur[j]);
        } else {
          ZeroRaw(cur[j]);
        }
      }
    }

    float mu = 0.0f;
    if (p.layernorm) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        float s = RawToFloat<Tag, kVec>(cur[j], 0);  // zeros past the end of the row
#pragma unroll
        for (int k2 = 1; k2 < kVec; ++k2) s += RawToFloat<Tag, kVec>(cur[j], k2);
        sum += s;
      }
      sum = RowGroupSum(sum, partial[parity], group, groups, tpr);
      parity ^= 1;
      mu = Fp32Div(sum, hidden_f);
    }
    float d[kChunks][kVec];  // x - mu, the first step of NormXhat
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int k2 = 0; k2 < kVec; ++k2) {
        d[j][k2] = Fp32Add(RawToFloat<Tag, kVec>(cur[j], k2), -mu);
        s = __fmaf_rn(d[j][k2], d[j][k2], s);
      }
      if (first_elem(j) < h) sq += s;  // chunks past the end hold -mu
    }
    sq = RowGroupSum(sq, partial[parity], group, groups, tpr);
    parity ^= 1;
    const float rsigma = NormRsigma(Fp32Div(sq, hidden_f), p.epsilon);
    if constexpr (kColwise) {
      // Split barrier: every thread waits here (uniform) before the first codes of a new
      // tile are staged, i.e. after the peers have read the previous tile's codes.
      if (p.split_sync && k > 0 && (k & per_tile_mask) == 0) TileWait(p);
    }
    if (row_ok && lane == 0) {
      if (p.layernorm) p.mu[r] = mu;
      p.rsigma[r] = rsigma;
    }
    // The output pass (see kDispatch).
    auto output = [&](auto gamma_f32, auto has_beta) {
      const bool gf32 = kDispatch ? decltype(gamma_f32)::value : p.gamma_f32;
      const bool beta = kDispatch ? decltype(has_beta)::value : p.layernorm;
      const int rr = row_in_tile(k);
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int e = first_elem(j);
        if (e >= h) continue;
        float w[kVec], b[kVec];
        if constexpr (kKeepParams) {
#pragma unroll
          for (int k2 = 0; k2 < kVec; ++k2) {
            w[k2] = w_keep[j][k2];
            b[k2] = b_keep[j][k2];
          }
        } else if (kParamSmem && params_smem) {
          const int c = e / kVec;
#pragma unroll
          for (int m = 0; m < kVec / 4; ++m) {
            const float4 gq = param_quads[m * chunks_per_row + c];
            const float4 bq = beta ? param_quads[(kVec / 4 + m) * chunks_per_row + c]
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            w[4 * m] = gq.x, w[4 * m + 1] = gq.y, w[4 * m + 2] = gq.z, w[4 * m + 3] = gq.w;
            b[4 * m] = bq.x, b[4 * m + 1] = bq.y, b[4 * m + 2] = bq.z, b[4 * m + 3] = bq.w;
          }
        } else {
          LoadParamChunk<Tag, kVec>(p.gamma, gf32, e, w);
#pragma unroll
          for (int k2 = 0; k2 < kVec; ++k2) {
            w[k2] = NormWeight(w[k2], p.zero_centered);
            b[k2] = 0.0f;
          }
          if (beta) LoadParamChunk<Tag, kVec>(p.beta, gf32, e, b);
        }
        float y[kVec];
        uint32_t chunk_max = 0;
#pragma unroll
        for (int k2 = 0; k2 < kVec; ++k2) {
          y[k2] = NormOutput(Fp32Mul(d[j][k2], rsigma), w[k2], b[k2], kKeepParams ? p.layernorm : beta);
          chunk_max = max(chunk_max, AbsBitsOf(y[k2]));
        }
        amax_bits = max(amax_bits, chunk_max);
        const bool no_nan = chunk_max <= 0x7F800000u;
        const int64_t off = int64_t(r) * h + e;
        if (p.y != nullptr) StoreChunkFast<Tag, kVec>(static_cast<T*>(p.y) + off, y, no_nan);
        if constexpr (kQuant) {
          if constexpr (kCodeWords) {
            Pack<uint32_t, kVec / 4> q;
            EncodeFp8Words<kVec>(y, scale, p.e5m2, scale_ok && no_nan, q.v);
            if (p.q_row != nullptr) *reinterpret_cast<Pack<uint32_t, kVec / 4>*>(p.q_row + off) = q;
            if constexpr (kColwise) {  // staged rows are only 4-byte aligned
              uint32_t* dst = reinterpret_cast<uint32_t*>(tile + rr * p.tile_stride + e);
#pragma unroll
              for (int m = 0; m < kVec / 4; ++m) dst[m] = q.v[m];
            }
          } else {
            uint8_t q[kVec];
            EncodeFp8<kVec>(y, scale, p.e5m2, scale_ok && no_nan, q);
#pragma unroll
            for (int k2 = 0; k2 < kVec; ++k2) {
              if (p.q_row != nullptr) p.q_row[off + k2] = q[k2];
              if constexpr (kColwise) tile[rr * p.tile_stride + e + k2] = q[k2];
            }
          }
        }
      }
    };
    if (row_ok) {
      using std::false_type;
      using std::true_type;
      if constexpr (!kDispatch) {
        output(false_type{}, false_type{});  // runtime flags
      } else if (p.gamma_f32) {
        p.layernorm ? output(true_type{}, true_type{}) : output(true_type{}, false_type{});
      } else {
        p.layernorm ? output(false_type{}, true_type{}) : output(false_type{}, false_type{});
      }
    }
    if constexpr (kColwise) {
      if ((int(k) & per_tile_mask) == per_tile_mask) {  // the tile's last rows: every group is here
        TileSync(p, false);  // every block's codes of the tile are staged and visible
        const int span_log2 = p.tile_rows_log2 + p.cluster_log2;
        const int r0 = tile_of(k) << span_log2;
        const int left = int(p.rows) - r0;
        WriteTransposed(p, tile, r0, left < (1 << span_log2) ? left : 1 << span_log2);
        // No block rewrites its tile while the cluster reads it, or exits.
        if (p.split_sync) {
          TileArrive(p);
        } else {
          TileSync(p, true);
        }
      }
    }
  }
  if constexpr (kColwise) {
    if (p.split_sync && iters > 0) TileWait(p);  // the last tile's arrive
  }
  if (p.amax_bits != nullptr) {
    amax_bits = BlockMaxU32(amax_bits);
    if (threadIdx.x == 0 && amax_bits != 0) atomicMax(p.amax_bits, amax_bits);
  }
}

// The smallest shared memory carveout (bytes) of sm_80..sm_100 (0, 8, 16, 32, 64, 100, 132,
// 164, 196, 228 KB, up to the SM's maximum) that holds `need` bytes; -1 if none does.
int64_t CarveoutFor(int64_t need, int64_t sm_smem) {
  for (int kb : {0, 8, 16, 32, 64, 100, 132, 164, 196, 228}) {
    if (int64_t(kb) * 1024 > sm_smem) break;
    if (int64_t(kb) * 1024 >= need) return int64_t(kb) * 1024;
  }
  return -1;
}

int Log2(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

template <typename Tag>
Status Launch(const NormForwardArgs& a, const NormFwdTuning& tune, GpuStream stream) {
  using T = typename Tag::Storage;
  const bool colwise = a.q_colwise != nullptr;
  const bool quant = colwise || a.q_rowwise != nullptr;
  const bool aligned = Aligned16(a.x) && Aligned16(a.y) && Aligned16(a.gamma) &&
                       Aligned16(a.beta) && Aligned16(a.q_rowwise);
  const RowGeometry g = ChooseRowGeometry(a.hidden, int(sizeof(T)), aligned, tune.items);
  FwdParams p{};
  p.x = a.x;
  p.gamma = a.gamma;
  p.beta = a.beta;
  p.scale = a.scale;
  p.y = a.y;
  p.mu = a.mu;
  p.rsigma = a.rsigma;
  p.q_row = static_cast<uint8_t*>(a.q_rowwise);
  p.q_col = static_cast<uint8_t*>(a.q_colwise);
  p.amax_bits = reinterpret_cast<uint32_t*>(a.amax);
  p.rows = a.rows;
  p.hidden = int(a.hidden);
  p.threads_per_row = g.threads_per_row;
  p.epsilon = a.epsilon;
  p.layernorm = a.norm_type == NormType::kLayerNorm;
  p.zero_centered = a.zero_centered_gamma;
  p.gamma_f32 = a.gamma_dtype == DType::kF32;
  p.e5m2 = a.q_dtype == DType::kE5M2;
  p.col_words = colwise && Aligned16(a.q_colwise) && a.hidden % 4 == 0;

  // Row groups per block: a power of two, the block at most the target size, at most 8
  // (named barriers 1..15) unless a row is one warp (no barrier).
  const int tpr = g.threads_per_row;
  const int max_groups = tpr == 32 ? 32 : 8;
  // parkeep: the colwise kernel that holds gamma/beta in registers (kParamRegs), for
  // vectorized rows of at most kParamRegsThreads threads, in blocks of at most that many.
  const bool param_regs =
      colwise && g.vectorized && tune.parkeep == 1 && tpr <= kParamRegsThreads;
  const int target = !colwise  ? tune.block
                     : param_regs ? (tune.colblock < kParamRegsThreads ? tune.colblock
                                                                       : kParamRegsThreads)
                                  : tune.colblock;
  int groups = 1;
  while (groups * 2 * tpr <= target && groups * 2 <= max_groups) groups *= 2;
  int stages = !g.vectorized ? 1 : param_regs && tune.parstages > 0 ? tune.parstages : tune.stages;
  p.tile_stride = colwise ? int((a.hidden + 15) / 16 * 16 + 4) : 0;  // stride / 4 odd
  const int64_t row_bytes = g.vectorized ? int64_t(g.items) * int64_t(sizeof(T)) : 0;
  // parsmem: fp32 gamma (+ beta) after the row stages and the codes tile (rounded up to 16
  // bytes), for the kernels that do not keep them in registers (kKeepParams: <= 8 items per
  // thread without colwise).
  bool parsmem = g.vectorized && (colwise || g.items > 8) && tune.parsmem == 1 && !param_regs;
  const int64_t param_smem = a.hidden * 4 * (p.layernorm ? 2 : 1);
  auto stage_bytes = [&](int tile_rows) {
    const int64_t gr = groups < tile_rows ? groups : tile_rows;
    return int64_t(stages) * gr * tpr * row_bytes;
  };
  auto smem_for = [&](int tile_rows) {
    const int64_t tile = colwise ? int64_t(tile_rows) * p.tile_stride : 0;
    return stage_bytes(tile_rows) + (parsmem ? (tile + 15) / 16 * 16 + param_smem : tile);
  };
  int device = 0, max_smem = 48 * 1024, sm_smem = 0, major = 0, cluster_launch = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), kOp, "cudaGetDevice"));
  for (auto [attr, out] : {std::pair{cudaDevAttrMaxSharedMemoryPerBlockOptin, &max_smem},
                           std::pair{cudaDevAttrMaxSharedMemoryPerMultiprocessor, &sm_smem},
                           std::pair{cudaDevAttrComputeCapabilityMajor, &major},
                           std::pair{cudaDevAttrClusterLaunch, &cluster_launch}}) {
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetAttribute(out, attr, device), kOp,
                                      "cudaDeviceGetAttribute"));
  }
  const int64_t max_dynamic = int64_t(max_smem) - kStaticSmem;
  // Colwise: column segments of `span` = colspan rows (32, 64 or 128 bytes per column
  // store; 16-byte halves of a sector written apart in time cost HBM read-modify-writes and
  // doubled the kernel's time on H100). A block stages tile_rows rows of codes; a cluster
  // of span / tile_rows blocks (sm_90+, at most 16) writes a span-row tile. Auto: the
  // largest block tile (up to span) that lets two blocks share an SM, else the largest that
  // fits. Without clusters tiles are 32 rows where they fit (else 16 and down).
  // l1keep: the colwise kernel reloads gamma (and beta) per row through L1, which is what
  // the shared memory leaves of the unified L1/shared storage (sm_smem + 28 KB on sm_80..
  // sm_100); two blocks of the largest tile left too little (28 KB at 8192, whose f32
  // gamma + beta are 64 KB: every row read them from L2). So the two blocks' tiles are
  // chosen to leave the parameters + 8 KB of L1, and the carveout is set to the smallest
  // that holds the resident blocks. Blocks of more than 512 threads never pair on an SM (64
  // registers per thread): they take the largest tile that fits.
  const bool clusters = colwise && major >= 9 && cluster_launch != 0;
  const int64_t param_bytes = param_regs ? 0  // no parameter loads in the row loop
      : a.hidden * (p.gamma_f32 ? 4 : int64_t(sizeof(T))) * (p.layernorm ? 2 : 1);
  const bool l1keep = colwise && tune.l1keep == 1;
  // parsmem only where it fits beside the stages and a 4-row tile (else per-row loads).
  if (parsmem && smem_for(colwise ? 4 : groups) > max_dynamic) parsmem = false;
  const int span = tune.colspan;
  // Two blocks per SM only where their threads fit (64 registers per thread: 1024 threads;
  // the parkeep kernel takes more than 64).
  const bool pair_ok = 2 * groups * tpr <= 1024 && !param_regs;
  int tile_rows = groups;
  if (colwise) {
    tile_rows = clusters ? span : kMaxTileRows;  // span >= 32
    if (tune.coltile != 0 && clusters) {
      tile_rows = tune.coltile;
    } else if (clusters) {
      // Two blocks per SM (1 KB reserved per block), with l1keep in a carveout that leaves
      // the parameters + 8 KB of L1.
      const int64_t half = int64_t(sm_smem) / 2 - 1024 - kStaticSmem;
      auto fits_two = [&](int rows) {
        const int64_t need = 2 * (smem_for(rows) + kStaticUsed + 1024);
        const int64_t carve = CarveoutFor(need, sm_smem);
        const int64_t l1 = int64_t(sm_smem) + kL1Floor - carve;
        return smem_for(rows) <= half && (!l1keep || (carve >= 0 && l1 >= param_bytes + 8 * 1024));
      };
      if (pair_ok) {
        while (tile_rows > 4 && !fits_two(tile_rows)) tile_rows /= 2;
      }
      if (!pair_ok || (!fits_two(tile_rows) && smem_for(tile_rows) > half)) {
        tile_rows = span;
        while (tile_rows > 4 && smem_for(tile_rows) > max_dynamic) tile_rows /= 2;
      }
    }
  }
  if (groups > tile_rows) groups = tile_rows;
  auto smem_of = [&]() { return smem_for(tile_rows); };
  // Shrink until it fits: colwise tiles down to 16 rows, stages down to 2, tiles down to 4
  // rows, gamma/beta back to per-row loads (parsmem), one stage, fewer groups.
  while (smem_of() > max_dynamic) {
    if (colwise && tile_rows > 16) {
      tile_rows /= 2;
    } else if (stages > 2) {
      --stages;
    } else if (colwise && tile_rows > 4) {
      tile_rows /= 2;
    } else if (parsmem) {
      parsmem = false;
    } else if (stages > 1) {
      --stages;
    } else if (groups > 1) {
      groups /= 2;
    } else {
      return Status::Internal(std::string(kOp) + ": no launch plan fits the shared memory (" +
                              std::to_string(smem_of()) + " bytes)");
    }
    if (groups > tile_rows) groups = tile_rows;
    if (!colwise) tile_rows = groups;
  }
  p.tile_rows = tile_rows;
  p.tile_rows_log2 = Log2(tile_rows);
  p.per_tile_log2 = Log2(tile_rows / groups);
  p.stages = stages;
  p.param_offset =
      parsmem ? int(stage_bytes(tile_rows) + (int64_t(tile_rows) * p.tile_stride + 15) / 16 * 16) : 0;
  p.interleave = colwise && tune.colorder == 1;
  p.split_sync = colwise && tune.colsplit == 1;
  p.shared_fences = colwise && tune.colbar == 1;
  auto set_cluster = [&](int c) {
    p.cluster = c;
    p.cluster_log2 = Log2(c);
    p.tiles = (a.rows + int64_t(tile_rows) * c - 1) / (int64_t(tile_rows) * c);
  };
  const int cluster = clusters && span > tile_rows ? span / tile_rows : 1;
  set_cluster(cluster < kMaxCluster ? cluster : kMaxCluster);
  const int threads = groups * tpr;
  const size_t smem = size_t(smem_of());

  auto launch = [&](auto kernel) -> Status {
    // The carveout hint (colwise, l1keep) is per kernel and sticky: back to the default
    // first, so that a hint set for another shape does not lower this one's occupancy.
    auto set_carveout = [&](int percent) {
      return CudaStatus(
          cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, percent),
          kOp, "cudaFuncSetAttribute(PreferredSharedMemoryCarveout)");
    };
    if (colwise) LOWBIT_RETURN_IF_ERROR(set_carveout(-1));  // cudaSharedmemCarveoutDefault
    int per_sm = 0;
    LOWBIT_RETURN_IF_ERROR(PrepareLaunch(kernel, threads, smem, kOp, &per_sm));
    if (l1keep && sm_smem > 0) {  // percent of the maximum; the driver rounds it up
      const int64_t carve =
          CarveoutFor(int64_t(per_sm) * (int64_t(smem) + kStaticUsed + 1024), sm_smem);
      if (carve >= 0) LOWBIT_RETURN_IF_ERROR(set_carveout(int(carve * 100 / sm_smem)));
    }
    // Clusters of more than 8 blocks (non-portable) where the GPU allows them; a cluster
    // that does not fit is halved (shorter column segments, same results).
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeClusterDimension;
    cudaLaunchConfig_t config = {};
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    int max_clusters = 0;
    while (p.cluster > 1) {
      if (p.cluster > 8 &&
          cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
              cudaSuccess) {
        cudaGetLastError();  // not sticky; take the portable size
        set_cluster(8);
        continue;
      }
      attr[0].val.clusterDim.x = unsigned(p.cluster);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      config.gridDim = dim3(unsigned(p.cluster));
      max_clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config) != cudaSuccess) {
        cudaGetLastError();  // treated as "does not fit"
        max_clusters = 0;
      }
      if (max_clusters >= 1) break;
      set_cluster(p.cluster / 2);
    }
    if (p.cluster == 1) {
      const int64_t cap = int64_t(per_sm) * SmCount();
      const int grid = int(p.tiles < cap ? p.tiles : cap);
      kernel<<<grid, threads, smem, stream>>>(p);
      return LaunchStatus(kOp);
    }
    const int64_t n = p.tiles < max_clusters ? p.tiles : max_clusters;
    config.gridDim = dim3(unsigned(n * p.cluster));
    LOWBIT_RETURN_IF_ERROR(
        CudaStatus(cudaLaunchKernelEx(&config, kernel, p), kOp, "cudaLaunchKernelEx"));
    return LaunchStatus(kOp);
  };
  return DispatchGeometry<16 / int(sizeof(T))>(g, kOp, [&](auto items, auto vectorized) {
    constexpr bool kV = decltype(vectorized)::value;
    constexpr int kC = decltype(items)::value / (kV ? 16 / int(sizeof(T)) : 1);
    if constexpr (kV) {
      if (param_regs) return launch(NormForwardKernel<Tag, kC, kV, true, true, true>);
    }
    if (colwise) return launch(NormForwardKernel<Tag, kC, kV, true, true>);
    if (quant) return launch(NormForwardKernel<Tag, kC, kV, true, false>);
    return launch(NormForwardKernel<Tag, kC, kV, false, false>);
  });
}

}  // namespace

Status NormForwardCuda(const NormForwardArgs& a, GpuStream stream) {
  LOWBIT_RETURN_IF_ERROR(CheckNormForward(a, kOp));
  NormFwdTuning tune;
  std::string error;
  if (!ParseNormFwdTuning(std::getenv("LOWBIT_NORM_FWD_VARIANT"), &tune, &error)) {
    return Status::InvalidArgument(std::string(kOp) + ": LOWBIT_NORM_FWD_VARIANT: " + error);
  }
  if (a.amax != nullptr) {
    LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a.amax, 0, sizeof(float), stream), kOp,
                                      "cudaMemsetAsync"));
  }
  if (a.rows == 0) return Status::Ok();
  if (a.rows > (int64_t(1) << 31) - 2 * kMaxSpan) {  // the kernel's 32-bit row numbers
    return Status::InvalidArgument(std::string(kOp) + ": x has " + std::to_string(a.rows) +
                                   " rows, more than the CUDA kernel supports (2^31 - 256)");
  }
  return DispatchHighPrecision(a.x_dtype, kOp, "x",
                               [&](auto tag) { return Launch<decltype(tag)>(a, tune, stream); });
}

}  // namespace lowbit
