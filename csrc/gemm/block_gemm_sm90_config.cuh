// The compile-time configuration of the block GEMM kernel of block_gemm_sm90.cu (tile, stage
// and shared-memory sizes, the cluster, the type tags, the kernel's Params), shared by its
// device code (block_gemm_sm90_ptx.cuh, block_gemm_sm90_kernel.cuh) and its host side; on
// sm_90a also LOWBIT_SM90A_DEVICE and the consumers' constants. Private to that translation
// unit (an anonymous namespace, as when this code lived there).
#pragma once

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
#endif  // sm_90a device code

}  // namespace
}  // namespace lowbit
