// The block GEMM kernel BlockGemmKernel of block_gemm_sm90.cu (whose preamble describes it)
// and its sm_90a device code: the tile order, the cluster's Schedule, the producer thread
// (Produce) and the consumer warpgroups (Consume: wgmma, per-K-block promotion, epilogue).
// Constants: block_gemm_sm90_config.cuh; PTX wrappers: block_gemm_sm90_ptx.cuh; the host
// side stays in block_gemm_sm90.cu. Private to that translation unit (an anonymous namespace).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gemm/block_gemm_sm90_config.cuh"
#include "gemm/block_gemm_sm90_ptx.cuh"

namespace lowbit {
namespace {

#if defined(LOWBIT_SM90A_DEVICE)
// Groups of group_rows lines of the grouped dimension (M: cluster rows; n_major: tile
// columns), walked down that dimension inside the group, then along the other one.
__device__ __forceinline__ void TileCoords(int tile, int m_tiles, int n_tiles, int group_rows,
                                           bool n_major, int* mt, int* nt) {
  const int grouped = n_major ? n_tiles : m_tiles, other = n_major ? m_tiles : n_tiles;
  const int per_group = group_rows * other;
  const int group = tile / per_group;
  const int first = group * group_rows;
  const int lines = min(grouped - first, group_rows);
  const int in_group = tile - group * per_group;
  const int g = first + in_group % lines, o = in_group / lines;
  *mt = n_major ? o : g;
  *nt = n_major ? g : o;
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ void StorePair(float* p, float x, float y) {
  *reinterpret_cast<float2*>(p) = make_float2(x, y);
}
__device__ __forceinline__ void StorePair(__nv_bfloat16* p, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void StorePair(__half* p, float x, float y) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
}

// The work split among a cluster's CTAs: its CTAs take vertically adjacent tiles (same nt), a
// "unit" of kCluster tile rows scheduled together; each CTA loads 1/kCluster of the shared b
// tile and multicasts it into all of them.
struct Schedule {
  uint32_t rank;           // this CTA's place in its cluster
  int m_groups, units;     // units = m_groups x n_tiles
  int first, step;         // this cluster's first unit and the stride between its units

  __device__ void Tile(int unit, const Params& p, int* mt, int* nt) const {
    int mg;
    TileCoords(unit, m_groups, p.n_tiles, p.group_rows, p.n_major != 0, &mg, nt);
    *mt = mg * kCluster + int(rank);  // may be m_tiles (odd count): loads zeros, stores nothing
  }
};

// The producer thread: every K block of every tile of the schedule into the stage ring.
template <bool kAVec, bool kBVec>
__device__ __forceinline__ void Produce(const CUtensorMap* map_a, const CUtensorMap* map_b,
                                        const CUtensorMap* map_sa, const CUtensorMap* map_sb,
                                        const Params& p, const Schedule& sched, uint8_t* smem,
                                        uint64_t* full, uint64_t* empty) {
  constexpr uint32_t kTxBytes =
      kATileBytes + kBTileBytes + (kAVec ? kTileM * 4 : 16) + (kBVec ? kTileN * 4 : 32);
  constexpr int kBPart = kTileN / kCluster;
  const uint32_t rank = sched.rank;
  uint32_t it = 0;
  for (int unit = sched.first; unit < sched.units; unit += sched.step) {
    int mt, nt;
    sched.Tile(unit, p, &mt, &nt);
    for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
      const int s = it % kStages;
      MbarWait(&empty[s], ((it / kStages) & 1) ^ 1);
      uint8_t* stage = smem + s * kStageBytes;
      MbarExpectTx(&full[s], kTxBytes);
      TmaLoad2d(stage, map_a, &full[s], kb * kTileK, mt * kTileM);
      TmaLoad2dMulticast(stage + kATileBytes + rank * kBPart * kTileK, map_b, &full[s],
                         kb * kTileK, nt * kTileN + int(rank) * kBPart,
                         uint16_t((1u << kCluster) - 1));
      // 1x128 scales: the block's 128 values; 128x128: the 16-byte group holding its one.
      if (kAVec) TmaLoad2d(stage + kScaleAOffset, map_sa, &full[s], mt * kTileM, kb);
      else TmaLoad2d(stage + kScaleAOffset, map_sa, &full[s], kb & ~3, mt);
      if (kBVec) TmaLoad2d(stage + kScaleBOffset, map_sb, &full[s], nt * kTileN, kb);
      else {  // a 192-wide tile spans two 128-row scale blocks of b: both groups
        const int blk = nt * kTileN / 128;
        TmaLoad2d(stage + kScaleBOffset, map_sb, &full[s], kb & ~3, blk);
        TmaLoad2d(stage + kScaleBOffset + kScaleBHiOffset, map_sb, &full[s], kb & ~3, blk + 1);
      }
    }
  }
}

// A consumer warpgroup: 64 rows of every tile of the schedule, promoted per K block, then
// the epilogue.
template <typename OutT, bool kAVec, bool kBVec, typename ATag, typename BTag>
__device__ __forceinline__ void Consume(const Params& p, const Schedule& sched, uint32_t smem_base,
                                        uint32_t full0, uint32_t empty0) {
  // Through a shuffle the compiler knows wg is warp-uniform, so the descriptors built from
  // it live in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0) - 1;
  const int t = threadIdx.x % 128;
  const int lane = t % 32;
  const int row0 = wg * 64 + (t / 32) * 16 + lane / 4;  // and row0 + 8, within the tile
  const int col0 = 2 * (lane % 4);                      // + 8i and + 8i + 1
  // Everything an iteration needs is precomputed or carried: the stage's descriptors and
  // scale addresses are a base plus the stage index times the stage size (32-bit shared
  // addresses), and the stage index and its barrier phase are counters. While one warpgroup
  // is between its wgmmas' end and its next wgmmas, only the other one's keep the tensor
  // cores busy; so that stretch holds just the promotion: the release of the finished stage,
  // the wait for the next one and its scales come before it.
  const uint64_t desc_a0 = SmemDescAddr(smem_base + wg * 64 * kTileK);
  const uint64_t desc_b0 = SmemDescAddr(smem_base + kATileBytes);
  const uint32_t sa_addr0 = smem_base + kScaleAOffset + (kAVec ? 4 * row0 : 0);
  const uint32_t sb_addr0 = smem_base + kScaleBOffset + (kBVec ? 4 * col0 : 0);
  int s = 0;
  uint32_t phase = 0;
  // K block kb's scales from its resident stage: a's two rows (1x128) or its one value
  // (128x128, within its 16-byte group), and b's one value when b is 128x128.
  float sa0 = 0.0f, sa1 = 0.0f, sb_lo = 0.0f, sb_hi = 0.0f;
  auto wait_and_read_scales = [&](int kb) {
    MbarWaitAddr(full0 + 8 * s, phase);
    const uint32_t stage_off = uint32_t(s) * kStageBytes;
    const uint32_t scalar_off = 4 * (kb & 3);
    sa0 = LdSharedAddr(sa_addr0 + stage_off + (kAVec ? 0 : scalar_off));
    sa1 = kAVec ? LdSharedAddr(sa_addr0 + stage_off + 32) : sa0;
    if (!kBVec) {
      sb_lo = LdSharedAddr(sb_addr0 + stage_off + scalar_off);
      sb_hi = LdSharedAddr(sb_addr0 + stage_off + kScaleBHiOffset + scalar_off);
    }
  };
  for (int unit = sched.first; unit < sched.units; unit += sched.step) {
    int mt, nt;
    sched.Tile(unit, p, &mt, &nt);
    static_assert(kTileN == 192, "promote's two cases assume 192-wide tiles over 128-row blocks");
    const bool odd_nt = (nt & 1) != 0;
    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    wait_and_read_scales(0);
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      const uint32_t stage_off = uint32_t(s) * kStageBytes;
      const uint64_t desc_a = desc_a0 + (stage_off >> 4), desc_b = desc_b0 + (stage_off >> 4);
      float part[kAcc];
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 32; ++kk) {
        Wgmma(part, desc_a + 2 * kk, desc_b + 2 * kk, kk, ATag{}, BTag{});
      }
      WgmmaCommit();
      WgmmaWaitAll();
      const float a0 = sa0, a1 = sa1, b_lo = sb_lo, b_hi = sb_hi;
      const uint32_t sb_stage = sb_addr0 + stage_off;
      // The stage is no longer read (1x128 b: once its scales are): release it to every
      // CTA's producer (their multicasts write it), one arrival per warp each.
      auto release = [&] {
        __syncwarp();
        if (lane < kCluster) MbarArriveCluster(empty0 + 8 * s, uint32_t(lane));
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      };
      if (!kBVec) {
        release();
        if (kb + 1 < p.k_blocks) wait_and_read_scales(kb + 1);
      }
      // acc += part * (sa * sb), the product rounded first (the reference's order). With a
      // 128x128 b only four products exist; the fragment where the tile crosses into b's next
      // scale block is 16 (the tile starts a block: none crosses) or 8 (odd nt starts 64 rows
      // into one), fixed per tile, so each case is its own unrolled loop.
      auto promote = [&](auto hi_from) {
        constexpr int kHiFrom = decltype(hi_from)::value;
        const float lo0 = __fmul_rn(a0, b_lo), lo1 = __fmul_rn(a1, b_lo);
        const float hi0 = __fmul_rn(a0, b_hi), hi1 = __fmul_rn(a1, b_hi);
#pragma unroll
        for (int i = 0; i < kFrags; ++i) {
          float s00, s01, s10, s11;  // the scale of d[4i + 0..3]
          if (kBVec) {
            const float2 sb = LdShared2Addr(sb_stage + 32 * i);
            s00 = __fmul_rn(a0, sb.x), s01 = __fmul_rn(a0, sb.y);
            s10 = __fmul_rn(a1, sb.x), s11 = __fmul_rn(a1, sb.y);
          } else {
            s00 = s01 = i < kHiFrom ? lo0 : hi0;
            s10 = s11 = i < kHiFrom ? lo1 : hi1;
          }
          acc[4 * i + 0] = __fmaf_rn(part[4 * i + 0], s00, acc[4 * i + 0]);
          acc[4 * i + 1] = __fmaf_rn(part[4 * i + 1], s01, acc[4 * i + 1]);
          acc[4 * i + 2] = __fmaf_rn(part[4 * i + 2], s10, acc[4 * i + 2]);
          acc[4 * i + 3] = __fmaf_rn(part[4 * i + 3], s11, acc[4 * i + 3]);
        }
      };
      if (kBVec || !odd_nt) promote(std::integral_constant<int, 16>{});
      else promote(std::integral_constant<int, 8>{});
      if (kBVec) {
        release();
        if (kb + 1 < p.k_blocks) wait_and_read_scales(kb + 1);
      }
    }
    // Epilogue: bias in fp32, one rounding to OutT. n is a multiple of 16, so a pair that
    // starts inside the row ends inside it.
    const OutT* bias = static_cast<const OutT*>(p.bias);
    OutT* out = static_cast<OutT*>(p.out);
    const int row_a = mt * kTileM + row0, row_b = row_a + 8;
#pragma unroll
    for (int i = 0; i < kFrags; ++i) {
      const int col = nt * kTileN + 8 * i + col0;
      if (col >= p.n) continue;
      float y0 = acc[4 * i + 0], y1 = acc[4 * i + 1], y2 = acc[4 * i + 2], y3 = acc[4 * i + 3];
      if (bias != nullptr) {
        const float b0 = ToFloat(bias[col]), b1 = ToFloat(bias[col + 1]);
        y0 = __fadd_rn(y0, b0);
        y1 = __fadd_rn(y1, b1);
        y2 = __fadd_rn(y2, b0);
        y3 = __fadd_rn(y3, b1);
      }
      if (row_a < p.m) StorePair(out + int64_t(row_a) * p.n + col, y0, y1);
      if (row_b < p.m) StorePair(out + int64_t(row_b) * p.n + col, y2, y3);
    }
  }
}
#endif  // sm_90a device code

template <typename OutT, bool kAVec, bool kBVec, typename ATag, typename BTag>
__global__ void __launch_bounds__(kThreads, 1)
    BlockGemmKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                    const __grid_constant__ CUtensorMap map_sa,
                    const __grid_constant__ CUtensorMap map_sb, const Params p) {
#if defined(LOWBIT_SM90A_DEVICE)
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  Schedule sched;
  sched.rank = ClusterRank();
  sched.m_groups = (p.m_tiles + kCluster - 1) / kCluster;
  sched.units = sched.m_groups * p.n_tiles;
  sched.first = blockIdx.x / kCluster;
  sched.step = gridDim.x / kCluster;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(&full[s], 1);
      MbarInit(&empty[s], kCluster * kConsumerWarps);  // every consumer warp of the cluster
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    TmaPrefetchDescriptor(&map_a);
    TmaPrefetchDescriptor(&map_b);
  }
  // Every CTA's barriers exist before any CTA multicasts into it or arrives on them.
  ClusterSync();
  // Registers move to the consumers: 40 per producer thread, 232 per consumer thread (the
  // launch bounds' 168 each, redistributed), so the promotion's operands never spill.
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      Produce<kAVec, kBVec>(&map_a, &map_b, &map_sa, &map_sb, p, sched, smem, full, empty);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    // The same addresses as 32-bit shared ones, the base formed from the symbol's (a
    // constant), so the consumers never rebuild it from a generic pointer.
    const uint32_t base = (SmemAddr(smem_raw) + 1023u) & ~1023u;
    const uint32_t full0 = base + kStages * kStageBytes;
    Consume<OutT, kAVec, kBVec, ATag, BTag>(p, sched, base, full0, full0 + 8 * kStages);
  }
  // No CTA leaves while another may still multicast into it or arrive on its barriers.
  ClusterSync();
#endif
}

}  // namespace
}  // namespace lowbit
