// The normalization forward kernel NormForwardKernel (LayerNorm / RMSNorm + FP8 rowwise /
// colwise codes + amax of y), private to norm_fwd.cu's translation unit (an unnamed
// namespace), which launches it; its parameters and device helpers: norm_fwd_device.cuh.
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
// gamma/beta: in registers (<= 8 items per thread, no colwise; parkeep, the default colwise
// kernel for vectorized rows of <= 512 threads: a separate kernel bounded to 512 threads,
// 3 row stages, 88.1% / 85.7% of copy at hidden 4096 / 8192 on an H100), else loaded per
// row through L1 (at 8192 L1 keeps 28 KB of the 64 KB of f32 gamma + beta) or (parsmem,
// vectorized rows) staged once per block as fp32 in shared memory.
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

#include "norm/norm_cuda.cuh"
#include "norm/norm_fwd_device.cuh"
#include "norm/norm_math.h"

namespace lowbit {
namespace {

using namespace norm_cuda;

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

}  // namespace
}  // namespace lowbit
