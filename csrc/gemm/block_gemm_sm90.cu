// block_gemm_sm90: the FP8 block-scaled GEMM of block_gemm_sm90.h on Hopper's wgmma and TMA.
//
// Persistent clusters of two CTAs (one CTA per SM) walk pairs of vertically adjacent 128x192
// output tiles, grouped 8 pairs of tile rows at a time so the clusters running together share
// operand tiles in L2 (LOWBIT_BLOCK_GEMM_GROUP changes the order: ParseRasterGroup). Warpgroup 0 is the producer: one thread streams each 128-long K block
// of its a tile (128 x 128 bytes) and of the pair's shared b tile (192 x 128 bytes), both
// 128B-swizzled, with TMA into a 5-stage shared-memory ring, with the block's scales (a 1x128
// operand's 128 or 192 values; a 128x128 operand's one value in its 16-byte group, for b the
// two groups of the two 128-row scale blocks a 192-wide tile can span), signalling a "full"
// mbarrier per stage. Each CTA of the pair loads half of the b tile and multicasts it into
// both, so b costs each CTA half the L2 traffic; a stage is refilled only when the consumer
// warps of both CTAs have released it. Warpgroups 1 and 2 each own 64 rows of the tile: per K
// block they run four m64n192k32 wgmmas into a fresh fp32 partial sum, wait for them, release
// the stage, wait for the next one and read its scales, then multiply the partial by the
// block's two scales into the running fp32 total (the "promotion" of block_gemm_sm90.h's
// numerics). While one warpgroup promotes, the other's wgmmas keep the tensor cores busy,
// so everything else is kept off that stretch: descriptors and addresses are bases plus
// counters in uniform registers, no global loads, the scale products of a 128x128 b are
// formed once per block, and setmaxnreg hands the producer's registers to the consumers. The
// epilogue adds the bias in fp32 and stores pairs of outputs straight from the accumulator
// registers, while the producer already loads the next tile. (128x192 tiles measured 1030
// TFLOP/s over the seed Dense's GEMMs against 904-930 for 128x128 ones: a third more MMA work
// per promotion and per byte of a.)
//
// Device code exists for sm_90a only (wgmma needs the arch-specific target); other targets
// compile an empty kernel that the host side never launches (BlockGemmSm90Applies).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "gemm/block_gemm_sm90.h"

namespace lowbit {
namespace {

constexpr int kTileM = 128, kTileN = 192, kTileK = 128;  // kTileK = the scales' block
constexpr int kStages = 5;
constexpr int kCluster = 2;  // CTAs of a cluster: vertically adjacent tiles sharing one b tile
static_assert(kCluster >= 2 && kTileN % (8 * kCluster) == 0, "b is split in 8-row groups");
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kATileBytes = kTileM * kTileK;
constexpr int kBTileBytes = kTileN * kTileK;
constexpr int kScaleAOffset = kATileBytes + kBTileBytes;
constexpr int kScaleBOffset = kScaleAOffset + kTileM * 4;
static_assert(kScaleAOffset % 128 == 0 && kScaleBOffset % 128 == 0, "TMA destinations are 128-byte aligned");
constexpr int kStageBytes = (kScaleBOffset + kTileN * 4 + 1023) / 1024 * 1024;  // 1024-aligned
constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;  // + barriers, alignment
static_assert(kTileN == 192, "Wgmma is m64n192k32");
static_assert(kStageBytes % 1024 == 0, "128B-swizzled TMA tiles need 1024-byte aligned stages");

constexpr int kGroupRows = 8;  // cluster rows (pairs of tile rows) per raster group, by default

struct E4m3Tag {};
struct E5m2Tag {};

struct Params {
  const void* bias;                // n values of the out type, or null
  void* out;                       // (m, n) row-major
  int m, n, k_blocks, m_tiles, n_tiles;
  int group_rows, n_major;  // raster order: ParseRasterGroup
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LOWBIT_SM90A_DEVICE 1

constexpr int kConsumerWarps = 8;
constexpr int kFrags = kTileN / 8;  // accumulator column pairs per thread (4 values each)
constexpr int kAcc = kTileN / 2;    // fp32 accumulators per consumer thread
// A 128x128 b's second 16-byte scale group (the tile's next 128 rows): TMA writes shared
// memory at 128-byte aligned addresses.
constexpr int kScaleBHiOffset = 128;

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ float LdSharedAddr(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float2 LdShared2Addr(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void MbarWaitAddr(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count));
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  MbarWaitAddr(SmemAddr(bar), parity);
}
__device__ __forceinline__ void TmaLoad2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                          int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, "
      "%4}], [%2];" ::"r"(SmemAddr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)),
      "r"(c0), "r"(c1) : "memory");
}
// The same copy, written into the shared memory of every CTA in cta_mask at the same offset,
// each CTA's mbarrier at `bar`'s offset receiving the completed bytes.
__device__ __forceinline__ void TmaLoad2dMulticast(void* dst, const CUtensorMap* map, uint64_t* bar,
                                                   int c0, int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
      "cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(SmemAddr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}
// Arrive on the mbarrier at shared address `bar` in cluster CTA `cta` (this CTA included).
__device__ __forceinline__ void MbarArriveCluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta) : "memory");
}
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void TmaPrefetchDescriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// wgmma's shared-memory matrix descriptor of a K-major tile of 8-row groups, 128 bytes per
// row, 128B swizzle (what the TMA above writes): start address >> 4, leading byte offset
// (unused for this swizzle; 1), stride byte offset 1024 (one 8-row group) >> 4, swizzle
// mode 1 = 128B in bits 62-63. Moving 32 bytes along K adds 2 to the start address.
__device__ __forceinline__ uint64_t SmemDescAddr(uint32_t tile) {
  const uint64_t addr = tile;
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaWaitAll() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}

// d (64 rows x kTileN columns over the warpgroup's 128 threads) = a (64 x 32) * b (kTileN x 32)^T
// (+ d when accumulate != 0). Thread t of the warpgroup holds d[4i + {0,1}] at row
// 16*(t/32) + (t%32)/4, columns 8i + 2*(t%4) + {0,1}, and d[4i + {2,3}] eight rows lower.
#define LOWBIT_DEFINE_WGMMA(ATAG, BTAG, TYPES)                                                   \
  __device__ __forceinline__ void Wgmma(float(&d)[kAcc], uint64_t desc_a, uint64_t desc_b,        \
                                        int accumulate, ATAG, BTAG) {                             \
    asm volatile(                                                                                \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                             \
        "wgmma.mma_async.sync.aligned.m64n192k32.f32." TYPES " {"                                 \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"                                                                                     \
        "}, %96, %97, p, 1, 1;\n}\n"                                                            \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])                                                                                     \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                           \
  }
LOWBIT_DEFINE_WGMMA(E4m3Tag, E4m3Tag, "e4m3.e4m3")
LOWBIT_DEFINE_WGMMA(E4m3Tag, E5m2Tag, "e4m3.e5m2")
LOWBIT_DEFINE_WGMMA(E5m2Tag, E4m3Tag, "e5m2.e4m3")

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

// ---------------------------------------------------------------- host side

PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A 2-D TMA descriptor: `rows` x `cols` elements of `elem_bytes`, rows `ld` elements apart,
// copied in boxes of box_rows x box_cols.
Status EncodeMap(CUtensorMap* map, const void* base, CUtensorMapDataType type, int elem_bytes,
                 int64_t rows, int64_t cols, int64_t ld, int box_rows, int box_cols,
                 CUtensorMapSwizzle swizzle, const char* what) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) {
    return Status::Internal("lowbit_gemm: the driver has no cuTensorMapEncodeTiled (block GEMM)");
  }
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * elem_bytes};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal(std::string("lowbit_gemm: cuTensorMapEncodeTiled failed for ") + what +
                            " (CUresult " + std::to_string(int(r)) + ")");
  }
  return Status::Ok();
}

// One operand's scale array (gemm.h's layout) as a TMA map. 1x128: (k_blocks, roundup(rows,
// 4)), a tile's `tile_rows` values per K block; 128x128: (row tiles, k_blocks rounded up to
// 4), 16 bytes (four K blocks' scales) at a time.
Status EncodeScaleMap(CUtensorMap* map, const void* scales, GemmScaleMode mode, int64_t rows,
                      int64_t k, int tile_rows, const char* what) {
  const GemmScaleShape d = GemmScaleDims(mode, rows, k);
  const int box_cols = mode == GemmScaleMode::kBlock1x128 ? tile_rows : 4;
  return EncodeMap(map, scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, d.dim0, d.dim1, d.dim1, 1,
                   box_cols, CU_TENSOR_MAP_SWIZZLE_NONE, what);
}

// The raster order (benchmark-only knob LOWBIT_BLOCK_GEMM_GROUP, read at every call): "<g>"
// walks groups of g cluster rows (2g tile rows) down M within each tile column, then the next
// column (the default, g = kGroupRows); "n<g>" walks groups of g tile columns across N within
// each cluster row instead. Only the order changes, never a tile's arithmetic.
Status ParseRasterGroup(int* group, int* n_major) {
  *group = kGroupRows;
  *n_major = 0;
  const char* env = std::getenv("LOWBIT_BLOCK_GEMM_GROUP");
  if (env == nullptr || *env == '\0') return Status::Ok();
  const int by_n = env[0] == 'n' ? 1 : 0;
  int g = 0, used = 0;
  if (std::sscanf(env + by_n, "%d%n", &g, &used) != 1 || env[by_n + used] != '\0' || g < 1 || g > 1024) {
    return Status::InvalidArgument(std::string("block_gemm_sm90: LOWBIT_BLOCK_GEMM_GROUP=\"") + env +
                                   "\": expected <g> or n<g> with g in 1..1024");
  }
  *group = g;
  *n_major = by_n;
  return Status::Ok();
}

template <typename OutT, bool kAVec, bool kBVec, typename ATag, typename BTag>
Status Launch(const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& msa,
              const CUtensorMap& msb, const Params& p, int device, GpuStream stream) {
  auto kernel = BlockGemmKernel<OutT, kAVec, kBVec, ATag, BTag>;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
      "lowbit_gemm", "cudaFuncSetAttribute (block GEMM shared memory)"));
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = static_cast<cudaStream_t>(stream);
  config.attrs = &cluster;
  config.numAttrs = 1;
  // As many clusters as can be resident at once (the kernel is persistent), at most one per
  // unit of work.
  int sms = 0, clusters = 0;
  LOWBIT_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "lowbit_gemm",
      "cudaDeviceGetAttribute"));
  config.gridDim = dim3(sms / kCluster * kCluster);
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config),
                                    "lowbit_gemm", "cudaOccupancyMaxActiveClusters (block GEMM)"));
  const int units = (p.m_tiles + kCluster - 1) / kCluster * p.n_tiles;
  clusters = clusters < units ? clusters : units;
  if (clusters < 1) {
    return Status::Internal("lowbit_gemm: the block GEMM kernel cannot be resident on this device");
  }
  config.gridDim = dim3(clusters * kCluster);
  LOWBIT_RETURN_IF_ERROR(CudaStatus(cudaLaunchKernelEx(&config, kernel, ma, mb, msa, msb, p),
                                    "lowbit_gemm", "cudaLaunchKernelEx (block GEMM sm90)"));
  return LaunchStatus("lowbit_gemm (block GEMM sm90)");
}

template <typename OutT, bool kAVec, bool kBVec>
Status DispatchTypes(const GemmArgs& args, const CUtensorMap& ma, const CUtensorMap& mb,
                     const CUtensorMap& msa, const CUtensorMap& msb, const Params& p, int device,
                     GpuStream stream) {
  const bool a4 = args.a_type == DType::kE4M3, b4 = args.b_type == DType::kE4M3;
  if (a4 && b4) return Launch<OutT, kAVec, kBVec, E4m3Tag, E4m3Tag>(ma, mb, msa, msb, p, device, stream);
  if (a4) return Launch<OutT, kAVec, kBVec, E4m3Tag, E5m2Tag>(ma, mb, msa, msb, p, device, stream);
  if (b4) return Launch<OutT, kAVec, kBVec, E5m2Tag, E4m3Tag>(ma, mb, msa, msb, p, device, stream);
  return Status::InvalidArgument("lowbit_gemm: E5M2 x E5M2 has no FP8 tensor-core path");
}

template <typename OutT>
Status DispatchModes(const GemmArgs& args, const CUtensorMap& ma, const CUtensorMap& mb,
                     const CUtensorMap& msa, const CUtensorMap& msb, const Params& p, int device,
                     GpuStream stream) {
  const bool av = args.a_scale_mode == GemmScaleMode::kBlock1x128;
  const bool bv = args.b_scale_mode == GemmScaleMode::kBlock1x128;
  if (av && bv) return DispatchTypes<OutT, true, true>(args, ma, mb, msa, msb, p, device, stream);
  if (av) return DispatchTypes<OutT, true, false>(args, ma, mb, msa, msb, p, device, stream);
  return DispatchTypes<OutT, false, true>(args, ma, mb, msa, msb, p, device, stream);
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool BlockGemmSm90Requested() {
  const char* v = std::getenv("LOWBIT_BLOCK_GEMM");
  return v != nullptr && std::strcmp(v, "wgmma") == 0;
}

bool BlockGemmSm90Applies(const GemmArgs& args, int capability) {
  const bool a_block = args.a_scale_mode == GemmScaleMode::kBlock1x128 ||
                       args.a_scale_mode == GemmScaleMode::kBlock128x128;
  const bool b_block = args.b_scale_mode == GemmScaleMode::kBlock1x128 ||
                       args.b_scale_mode == GemmScaleMode::kBlock128x128;
  const bool both_128x128 = args.a_scale_mode == GemmScaleMode::kBlock128x128 &&
                            args.b_scale_mode == GemmScaleMode::kBlock128x128;
  return capability == 90 && a_block && b_block && !both_128x128 && IsFp8(args.a_type) &&
         IsFp8(args.b_type) && !(args.a_type == DType::kE5M2 && args.b_type == DType::kE5M2) &&
         args.k % 16 == 0 && args.n % 16 == 0 && args.k > 0 && args.m > 0 &&
         args.m < (int64_t(1) << 31) && args.n < (int64_t(1) << 31) && args.k < (int64_t(1) << 31) &&
         Aligned16(args.a) && Aligned16(args.b) && Aligned16(args.a_scale_inv) &&
         Aligned16(args.b_scale_inv) && Aligned16(args.out) &&
         !(args.bias != nullptr && args.out_type == DType::kF32);
}

Status BlockGemmSm90Cuda(const GemmArgs& args, int device_ordinal, GpuStream stream) {
  const int64_t k_blocks = (args.k + kTileK - 1) / kTileK;
  CUtensorMap ma{}, mb{}, msa{}, msb{};
  LOWBIT_RETURN_IF_ERROR(EncodeMap(&ma, args.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, args.m, args.k,
                                   args.k, kTileM, kTileK, CU_TENSOR_MAP_SWIZZLE_128B, "a"));
  LOWBIT_RETURN_IF_ERROR(EncodeMap(&mb, args.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, args.n, args.k,
                                   args.k, kTileN / kCluster, kTileK, CU_TENSOR_MAP_SWIZZLE_128B,
                                   "b"));
  Params p{};
  LOWBIT_RETURN_IF_ERROR(EncodeScaleMap(&msa, args.a_scale_inv, args.a_scale_mode, args.m, args.k,
                                        kTileM, "a_scale_inv"));
  LOWBIT_RETURN_IF_ERROR(EncodeScaleMap(&msb, args.b_scale_inv, args.b_scale_mode, args.n, args.k,
                                        kTileN, "b_scale_inv"));
  p.bias = args.bias;
  p.out = args.out;
  p.m = int(args.m);
  p.n = int(args.n);
  p.k_blocks = int(k_blocks);
  p.m_tiles = int((args.m + kTileM - 1) / kTileM);
  p.n_tiles = int((args.n + kTileN - 1) / kTileN);
  LOWBIT_RETURN_IF_ERROR(ParseRasterGroup(&p.group_rows, &p.n_major));
  switch (args.out_type) {
    case DType::kBF16:
      return DispatchModes<__nv_bfloat16>(args, ma, mb, msa, msb, p, device_ordinal, stream);
    case DType::kF16:
      return DispatchModes<__half>(args, ma, mb, msa, msb, p, device_ordinal, stream);
    case DType::kF32:
      return DispatchModes<float>(args, ma, mb, msa, msb, p, device_ordinal, stream);
    default:
      return Status::InvalidArgument(std::string("lowbit_gemm: out: the block GEMM writes bf16, "
                                                 "f16 or f32, got ") + DTypeName(args.out_type));
  }
}

}  // namespace lowbit
